//! FrontendVirtioBlkService: nacre's vhost-user-blk devices (`virtioBlks/d` is device `d`,
//! its socket `<run-dir>/vhost-d.sock`). The VM monitor (QEMU, or the DPU's virtio
//! emulation) places the device on the host's PCI bus, so `pcie_id` is accepted and not
//! kept.

use std::sync::Arc;

use nacre_shared::api::vhost::{
    VhostBlkCreate, VhostBlkInfo, DEFAULT_QUEUES, DEFAULT_QUEUE_SIZE, MAX_QUEUES,
};
use tonic::{Request, Response, Status};

use super::pb::{self, frontend_virtio_blk_service_server::FrontendVirtioBlkService};
use super::{
    blocking, exists_differently, id_in, invalid, mask_paths, new_id, not_found, page, paginate,
    status, volume_ref, volume_stats,
};
use crate::control::registry::Registry;

const COLLECTION: &str = "virtioBlks";

pub struct Service(pub Arc<Registry>);

fn to_pb(d: &VhostBlkInfo) -> pb::VirtioBlk {
    pb::VirtioBlk {
        name: format!("{COLLECTION}/{}", d.name),
        pcie_id: None,
        volume_name_ref: d.volume.clone(),
        max_io_qps: i64::from(d.queues),
        min_limit: None,
        max_limit: None,
    }
}

fn find(r: &Registry, id: &str) -> Option<VhostBlkInfo> {
    r.vhost_blk_devices().into_iter().find(|d| d.name == id)
}

fn queues(m: &pb::VirtioBlk) -> Result<u16, Status> {
    match m.max_io_qps {
        0 => Ok(DEFAULT_QUEUES),
        n if (1..=i64::from(MAX_QUEUES)).contains(&n) => Ok(n as u16),
        n => Err(invalid(format!(
            "max_io_qps must be 1 to {MAX_QUEUES} (got {n})"
        ))),
    }
}

fn create(r: &Registry, id: &str, m: &pb::VirtioBlk) -> Result<pb::VirtioBlk, Status> {
    let id = new_id(id)?;
    let volume = volume_ref(r, &m.volume_name_ref)?;
    let queues = queues(m)?;
    if m.min_limit.is_some() || m.max_limit.is_some() {
        return Err(invalid(
            "min_limit and max_limit are not set per device here: use MiddleendQosVolumeService on its volume",
        ));
    }
    if let Some(d) = find(r, &id) {
        return if d.volume == volume && (m.max_io_qps == 0 || d.queues == queues) {
            Ok(to_pb(&d))
        } else {
            Err(exists_differently(&format!("{COLLECTION}/{id}")))
        };
    }
    let d = r
        .create_vhost_blk(&VhostBlkCreate {
            name: id,
            volume,
            queues,
            queue_size: DEFAULT_QUEUE_SIZE,
            socket: None,
            transport: None,
            read_only: false,
        })
        .map_err(status)?;
    Ok(to_pb(&d))
}

#[tonic::async_trait]
impl FrontendVirtioBlkService for Service {
    async fn create_virtio_blk(
        &self,
        req: Request<pb::CreateVirtioBlkRequest>,
    ) -> Result<Response<pb::VirtioBlk>, Status> {
        let r = self.0.clone();
        let req = req.into_inner();
        blocking(move || {
            let m = req
                .virtio_blk
                .ok_or_else(|| invalid("virtio_blk is required"))?;
            create(&r, &req.virtio_blk_id, &m).map(Response::new)
        })
        .await
    }

    async fn delete_virtio_blk(
        &self,
        req: Request<pb::DeleteVirtioBlkRequest>,
    ) -> Result<Response<()>, Status> {
        let r = self.0.clone();
        let req = req.into_inner();
        blocking(move || {
            let id = id_in(&req.name, COLLECTION)?;
            if find(&r, id).is_none() {
                return if req.allow_missing {
                    Ok(Response::new(()))
                } else {
                    Err(not_found(&req.name))
                };
            }
            r.delete_vhost_blk(id).map_err(status)?;
            Ok(Response::new(()))
        })
        .await
    }

    async fn update_virtio_blk(
        &self,
        req: Request<pb::UpdateVirtioBlkRequest>,
    ) -> Result<Response<pb::VirtioBlk>, Status> {
        let r = self.0.clone();
        let req = req.into_inner();
        blocking(move || {
            let m = req
                .virtio_blk
                .ok_or_else(|| invalid("virtio_blk is required"))?;
            let id = id_in(&m.name, COLLECTION)?.to_string();
            let Some(d) = find(&r, &id) else {
                return if req.allow_missing {
                    create(&r, &id, &m).map(Response::new)
                } else {
                    Err(not_found(&m.name))
                };
            };
            for p in mask_paths(
                &req.update_mask,
                &["volume_name_ref", "max_io_qps", "pcie_id"],
            )? {
                let changed = match p.as_str() {
                    "volume_name_ref" => volume_ref(&r, &m.volume_name_ref)? != d.volume,
                    "max_io_qps" => queues(&m)? != d.queues,
                    _ => false,
                };
                if changed {
                    return Err(invalid(format!(
                        "{p} of {} cannot change while it exists: delete and create it",
                        m.name
                    )));
                }
            }
            Ok(Response::new(to_pb(&d)))
        })
        .await
    }

    async fn list_virtio_blks(
        &self,
        req: Request<pb::ListVirtioBlksRequest>,
    ) -> Result<Response<pb::ListVirtioBlksResponse>, Status> {
        let r = self.0.clone();
        let req = req.into_inner();
        blocking(move || {
            let p = page(req.page_size, &req.page_token)?;
            let all = r
                .vhost_blk_devices()
                .iter()
                .map(|d| {
                    let m = to_pb(d);
                    (m.name.clone(), m)
                })
                .collect();
            let (virtio_blks, next_page_token) = paginate(all, &p);
            Ok(Response::new(pb::ListVirtioBlksResponse {
                virtio_blks,
                next_page_token,
            }))
        })
        .await
    }

    async fn get_virtio_blk(
        &self,
        req: Request<pb::GetVirtioBlkRequest>,
    ) -> Result<Response<pb::VirtioBlk>, Status> {
        let r = self.0.clone();
        let req = req.into_inner();
        blocking(move || {
            let id = id_in(&req.name, COLLECTION)?;
            let d = find(&r, id).ok_or_else(|| not_found(&req.name))?;
            Ok(Response::new(to_pb(&d)))
        })
        .await
    }

    async fn stats_virtio_blk(
        &self,
        req: Request<pb::StatsVirtioBlkRequest>,
    ) -> Result<Response<pb::StatsVirtioBlkResponse>, Status> {
        let r = self.0.clone();
        let req = req.into_inner();
        blocking(move || {
            let id = id_in(&req.name, COLLECTION)?;
            let d = find(&r, id).ok_or_else(|| not_found(&req.name))?;
            Ok(Response::new(pb::StatsVirtioBlkResponse {
                stats: Some(volume_stats(&r, &d.volume)?),
            }))
        })
        .await
    }
}
