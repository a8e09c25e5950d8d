//! NvmeRemoteControllerService: NVMe-oF controllers nacred connects to as a host.
//!
//! An OPI remote controller is a set of paths; nacre attaches one remote (`remote_attach`)
//! per path, named `CONTROLLER.PATH`. The controller itself is a binding until its first
//! path. A remote namespace (`nvmeRemoteControllers/c/nvmeRemoteNamespaces/NSID`) named as
//! a frontend's `volume_name_ref` becomes a `remote` volume `c-nNSID` over that namespace on
//! every path of the controller (nacre's multipath), made on first use and deleted with the
//! controller's last path.

use std::sync::Arc;

use nacre_shared::api::remote::{RemoteAttach, RemoteInfo, RemoteLayout};
use nacre_shared::api::volume::{BackendKind, VolumeCreate};
use tonic::{Request, Response, Status};

use super::pb::{self, nvme_remote_controller_service_server::NvmeRemoteControllerService};
use super::{
    check_id, decode, encode, exists_differently, id_in, invalid, mask_paths, new_id, not_found,
    page, paginate, status, sum_stats, volume_stats,
};
use crate::control::registry::Registry;
use crate::control::state::OpiBinding;

const CONTROLLERS: &str = "nvmeRemoteControllers";

pub struct Service(pub Arc<Registry>);

fn controller(r: &Registry, name: &str) -> Result<pb::NvmeRemoteController, Status> {
    id_in(name, CONTROLLERS)?;
    let b = r.opi_binding(name).ok_or_else(|| not_found(name))?;
    let mut m: pb::NvmeRemoteController = decode(&b.spec);
    m.name = name.to_string();
    Ok(m)
}

/// The paths of a controller: (name, path, remote name), those whose remote still exists.
fn paths(r: &Registry, ctrl: &str) -> Vec<(String, pb::NvmePath, String)> {
    r.opi_bindings(&format!("{ctrl}/nvmePaths/"))
        .into_iter()
        .filter(|(_, b)| r.remotes(Some(&b.object)).is_ok())
        .map(|(n, b)| {
            let mut p: pb::NvmePath = decode(&b.spec);
            p.name = n.clone();
            (n, p, b.object)
        })
        .collect()
}

fn remote_info(r: &Registry, remote: &str) -> Option<RemoteInfo> {
    r.remotes(Some(remote))
        .ok()
        .and_then(|v| v.into_iter().next())
}

/// The volume nacre serves a remote namespace as (made on first use).
pub(crate) fn namespace_volume(r: &Registry, name: &str) -> Result<String, Status> {
    let (ctrl, nsid) = name
        .split_once("/nvmeRemoteNamespaces/")
        .ok_or_else(|| invalid(format!("{name:?} is not a volume or remote namespace name")))?;
    let cid = id_in(ctrl, CONTROLLERS)?;
    controller(r, ctrl)?;
    let nsid: u32 = nsid
        .parse()
        .ok()
        .filter(|&n| n != 0)
        .ok_or_else(|| invalid(format!("{name:?}: {nsid:?} is not an NSID")))?;
    let volume = format!("{cid}-n{nsid}");
    check_id(&volume)?;
    if r.volumes(Some(&volume)).is_ok() {
        return Ok(volume);
    }
    let remotes: Vec<String> = paths(r, ctrl).into_iter().map(|(_, _, rem)| rem).collect();
    if remotes.is_empty() {
        return Err(Status::failed_precondition(format!(
            "{ctrl} has no path yet"
        )));
    }
    let extent = remotes
        .iter()
        .map(|rem| format!("{rem}:{nsid}"))
        .collect::<Vec<_>>()
        .join("+");
    r.create_volume(&VolumeCreate {
        name: volume.clone(),
        size: 0,
        block_size: remote_info(r, &remotes[0])
            .and_then(|i| {
                i.namespaces
                    .iter()
                    .find(|n| n.nsid == nsid)
                    .map(|n| n.block_size)
            })
            .ok_or_else(|| not_found(name))?,
        backend: BackendKind::Remote,
        path: None,
        tenant: None,
        encrypt: false,
        remote: Some(RemoteLayout {
            extents: vec![extent],
            stripe_size: None,
            multipath: Default::default(),
        }),
        adopt_existing: false,
    })
    .map_err(status)?;
    Ok(volume)
}

/// The namespaces of a controller, as its first path's remote found them.
fn namespaces(r: &Registry, ctrl: &str) -> Vec<(String, pb::NvmeRemoteNamespace)> {
    let Some(info) = paths(r, ctrl)
        .into_iter()
        .find_map(|(_, _, rem)| remote_info(r, &rem))
    else {
        return Vec::new();
    };
    info.namespaces
        .iter()
        .map(|n| {
            let name = format!("{ctrl}/nvmeRemoteNamespaces/{}", n.nsid);
            let (nguid, uuid) = match n.id.split_once(':') {
                Some(("nguid", h)) => (h.to_string(), String::new()),
                Some(("uuid", h)) => (String::new(), h.to_string()),
                _ => (String::new(), String::new()),
            };
            let eui64 = match n.id.split_once(':') {
                Some(("eui64", h)) => u64::from_str_radix(h, 16).unwrap_or(0) as i64,
                _ => 0,
            };
            (
                name.clone(),
                pb::NvmeRemoteNamespace {
                    name,
                    nsid: n.nsid as i32,
                    nguid,
                    eui64,
                    uuid,
                },
            )
        })
        .collect()
}

/// The volumes made for a controller's namespaces.
fn namespace_volumes(r: &Registry, ctrl: &str) -> Vec<String> {
    let Ok(cid) = id_in(ctrl, CONTROLLERS) else {
        return Vec::new();
    };
    let prefix = format!("{cid}-n");
    r.volumes(None)
        .unwrap_or_default()
        .into_iter()
        .filter(|v| v.backend == BackendKind::Remote && v.name.starts_with(&prefix))
        .map(|v| v.name)
        .collect()
}

fn create_controller(
    r: &Registry,
    id: &str,
    m: &pb::NvmeRemoteController,
) -> Result<pb::NvmeRemoteController, Status> {
    let id = new_id(id)?;
    let name = format!("{CONTROLLERS}/{id}");
    let mut want = m.clone();
    want.name = name.clone();
    if want.tcp.as_ref().is_some_and(|t| !t.psk.is_empty()) {
        return Err(invalid(
            "tcp.psk: NVMe/TCP TLS is not supported by nacre's initiator",
        ));
    }
    if want.io_queues_count < 0 || want.io_queues_count > i64::from(u16::MAX) {
        return Err(invalid(format!(
            "io_queues_count {} is out of range",
            want.io_queues_count
        )));
    }
    if want.queue_size < 0 || want.queue_size > i64::from(u16::MAX) {
        return Err(invalid(format!(
            "queue_size {} is out of range",
            want.queue_size
        )));
    }
    if let Ok(have) = controller(r, &name) {
        return if encode(&have) == encode(&want) {
            Ok(have)
        } else {
            Err(exists_differently(&name))
        };
    }
    r.bind_opi(
        &name,
        OpiBinding {
            object: String::new(),
            spec: encode(&want),
        },
    )
    .map_err(status)?;
    Ok(want)
}

fn create_path(
    r: &Registry,
    parent: &str,
    id: &str,
    m: &pb::NvmePath,
) -> Result<pb::NvmePath, Status> {
    let ctrl = controller(r, parent)?;
    let cid = id_in(parent, CONTROLLERS)?;
    let id = new_id(id)?;
    let name = format!("{parent}/nvmePaths/{id}");
    let mut want = m.clone();
    want.name = name.clone();
    if let Some((_, have, _)) = paths(r, parent).into_iter().find(|(n, _, _)| *n == name) {
        return if encode(&have) == encode(&want) {
            Ok(have)
        } else {
            Err(exists_differently(&name))
        };
    }
    let transport = match pb::NvmeTransportType::try_from(want.trtype) {
        Ok(pb::NvmeTransportType::Tcp) => "tcp",
        Ok(pb::NvmeTransportType::Rdma) => "rdma",
        Ok(pb::NvmeTransportType::Pcie) => {
            return Err(Status::failed_precondition(
                "local PCIe NVMe paths are not available: use an NVMe/TCP or NVMe/RDMA target",
            ))
        }
        _ => return Err(invalid("trtype must be NVME_TRANSPORT_TYPE_TCP or _RDMA")),
    };
    let f = want
        .fabrics
        .clone()
        .ok_or_else(|| invalid("fabrics is required for TCP and RDMA paths"))?;
    let port = u16::try_from(f.trsvcid)
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| invalid(format!("fabrics.trsvcid {} is not a port", f.trsvcid)))?;
    if f.subnqn.is_empty() {
        return Err(invalid("fabrics.subnqn is required"));
    }
    let remote = format!("{cid}.{id}");
    check_id(&remote)?;
    let tcp = ctrl.tcp.clone().unwrap_or_default();
    let nonzero = |v: i64| u16::try_from(v).ok().filter(|&v| v != 0);
    r.attach_remote(&RemoteAttach {
        name: remote.clone(),
        transport: transport.into(),
        address: want.traddr.clone(),
        port,
        subnqn: f.subnqn.clone(),
        hostnqn: (!f.hostnqn.is_empty()).then(|| f.hostnqn.clone()),
        io_queues: nonzero(ctrl.io_queues_count),
        queue_depth: nonzero(ctrl.queue_size),
        header_digest: tcp.hdgst,
        data_digest: tcp.ddgst,
        in_capsule_data_size: None,
        keep_alive_timeout_ms: None,
        reconnect_delay_sec: None,
        ctrl_loss_timeout_sec: None,
        fast_io_fail_timeout_sec: None,
        io_timeout_sec: None,
        quiesce_time_ms: None,
        // OPI's pinned storage API carries no DH-HMAC-CHAP secrets for a remote controller.
        dhchap_secret: None,
        dhchap_ctrl_secret: None,
        psk: None,
    })
    .map_err(status)?;
    if let Err(e) = r.bind_opi(
        &name,
        OpiBinding {
            object: remote.clone(),
            spec: encode(&want),
        },
    ) {
        let _ = r.detach_remote(&remote);
        return Err(status(e));
    }
    Ok(want)
}

/// Remove a path: the namespace volumes go with the last one (refused while a frontend
/// exports them).
fn delete_path(r: &Registry, ctrl: &str, name: &str, remote: &str) -> Result<(), Status> {
    if paths(r, ctrl).len() <= 1 {
        for v in namespace_volumes(r, ctrl) {
            r.delete_volume(&v, false).map_err(status)?;
        }
    }
    r.detach_remote(remote).map_err(status)?;
    r.unbind_opi(name).map_err(status)
}

fn ctrl_stats(r: &Registry, ctrl: &str) -> Result<pb::VolumeStats, Status> {
    let all = namespace_volumes(r, ctrl)
        .iter()
        .map(|v| volume_stats(r, v))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(sum_stats(&all))
}

#[tonic::async_trait]
impl NvmeRemoteControllerService for Service {
    async fn create_nvme_remote_controller(
        &self,
        req: Request<pb::CreateNvmeRemoteControllerRequest>,
    ) -> Result<Response<pb::NvmeRemoteController>, Status> {
        run!(self, req, |r, q| {
            let m = q
                .nvme_remote_controller
                .ok_or_else(|| invalid("nvme_remote_controller is required"))?;
            create_controller(&r, &q.nvme_remote_controller_id, &m).map(Response::new)
        })
    }

    async fn delete_nvme_remote_controller(
        &self,
        req: Request<pb::DeleteNvmeRemoteControllerRequest>,
    ) -> Result<Response<()>, Status> {
        run!(self, req, |r, q| {
            match controller(&r, &q.name) {
                Err(e) if e.code() == tonic::Code::NotFound && q.allow_missing => {
                    return Ok(Response::new(()))
                }
                c => c?,
            };
            if !paths(&r, &q.name).is_empty() {
                return Err(Status::failed_precondition(format!(
                    "{} still has paths: delete them first",
                    q.name
                )));
            }
            r.unbind_opi(&q.name).map_err(status)?;
            Ok(Response::new(()))
        })
    }

    async fn update_nvme_remote_controller(
        &self,
        req: Request<pb::UpdateNvmeRemoteControllerRequest>,
    ) -> Result<Response<pb::NvmeRemoteController>, Status> {
        run!(self, req, |r, q| {
            let m = q
                .nvme_remote_controller
                .ok_or_else(|| invalid("nvme_remote_controller is required"))?;
            let have = match controller(&r, &m.name) {
                Err(e) if e.code() == tonic::Code::NotFound && q.allow_missing => {
                    let id = id_in(&m.name, CONTROLLERS)?.to_string();
                    return create_controller(&r, &id, &m).map(Response::new);
                }
                c => c?,
            };
            let mut next = have.clone();
            for p in mask_paths(
                &q.update_mask,
                &["multipath", "io_queues_count", "queue_size", "tcp"],
            )? {
                match p.as_str() {
                    "multipath" => next.multipath = m.multipath,
                    "io_queues_count" => next.io_queues_count = m.io_queues_count,
                    "queue_size" => next.queue_size = m.queue_size,
                    _ => next.tcp = m.tcp.clone(),
                }
            }
            if encode(&next) != encode(&have) && !paths(&r, &m.name).is_empty() {
                return Err(Status::failed_precondition(format!(
                    "{} has paths: its settings apply when paths connect; delete them first",
                    m.name
                )));
            }
            r.bind_opi(
                &m.name,
                OpiBinding {
                    object: String::new(),
                    spec: encode(&next),
                },
            )
            .map_err(status)?;
            Ok(Response::new(next))
        })
    }

    async fn list_nvme_remote_controllers(
        &self,
        req: Request<pb::ListNvmeRemoteControllersRequest>,
    ) -> Result<Response<pb::ListNvmeRemoteControllersResponse>, Status> {
        run!(self, req, |r, q| {
            let p = page(q.page_size, &q.page_token)?;
            let all = r
                .opi_bindings(&format!("{CONTROLLERS}/"))
                .into_iter()
                .filter(|(n, _)| n.matches('/').count() == 1)
                .map(|(n, b)| {
                    let mut m: pb::NvmeRemoteController = decode(&b.spec);
                    m.name = n.clone();
                    (n, m)
                })
                .collect();
            let (nvme_remote_controllers, next_page_token) = paginate(all, &p);
            Ok(Response::new(pb::ListNvmeRemoteControllersResponse {
                nvme_remote_controllers,
                next_page_token,
            }))
        })
    }

    async fn get_nvme_remote_controller(
        &self,
        req: Request<pb::GetNvmeRemoteControllerRequest>,
    ) -> Result<Response<pb::NvmeRemoteController>, Status> {
        run!(self, req, |r, q| controller(&r, &q.name).map(Response::new))
    }

    async fn reset_nvme_remote_controller(
        &self,
        req: Request<pb::ResetNvmeRemoteControllerRequest>,
    ) -> Result<Response<()>, Status> {
        // Every path of the controller is disconnected and connects again; I/O in flight
        // is held and resent.
        run!(self, req, |r, q| {
            controller(&r, &q.name)?;
            for (_, _, remote) in paths(&r, &q.name) {
                r.reset_remote(&remote).map_err(status)?;
            }
            Ok(Response::new(()))
        })
    }

    async fn stats_nvme_remote_controller(
        &self,
        req: Request<pb::StatsNvmeRemoteControllerRequest>,
    ) -> Result<Response<pb::StatsNvmeRemoteControllerResponse>, Status> {
        run!(self, req, |r, q| {
            controller(&r, &q.name)?;
            Ok(Response::new(pb::StatsNvmeRemoteControllerResponse {
                stats: Some(ctrl_stats(&r, &q.name)?),
            }))
        })
    }

    async fn list_nvme_remote_namespaces(
        &self,
        req: Request<pb::ListNvmeRemoteNamespacesRequest>,
    ) -> Result<Response<pb::ListNvmeRemoteNamespacesResponse>, Status> {
        run!(self, req, |r, q| {
            let p = page(q.page_size, &q.page_token)?;
            controller(&r, &q.parent)?;
            let (nvme_remote_namespaces, next_page_token) = paginate(namespaces(&r, &q.parent), &p);
            Ok(Response::new(pb::ListNvmeRemoteNamespacesResponse {
                nvme_remote_namespaces,
                next_page_token,
            }))
        })
    }

    async fn get_nvme_remote_namespace(
        &self,
        req: Request<pb::GetNvmeRemoteNamespaceRequest>,
    ) -> Result<Response<pb::NvmeRemoteNamespace>, Status> {
        run!(self, req, |r, q| {
            let (ctrl, _) = q.name.split_once("/nvmeRemoteNamespaces/").ok_or_else(|| {
                invalid(format!(
                    "name {:?} is not {CONTROLLERS}/{{id}}/nvmeRemoteNamespaces/{{nsid}}",
                    q.name
                ))
            })?;
            controller(&r, ctrl)?;
            namespaces(&r, ctrl)
                .into_iter()
                .find(|(n, _)| *n == q.name)
                .map(|(_, m)| Response::new(m))
                .ok_or_else(|| not_found(&q.name))
        })
    }

    async fn create_nvme_path(
        &self,
        req: Request<pb::CreateNvmePathRequest>,
    ) -> Result<Response<pb::NvmePath>, Status> {
        run!(self, req, |r, q| {
            let m = q
                .nvme_path
                .ok_or_else(|| invalid("nvme_path is required"))?;
            create_path(&r, &q.parent, &q.nvme_path_id, &m).map(Response::new)
        })
    }

    async fn delete_nvme_path(
        &self,
        req: Request<pb::DeleteNvmePathRequest>,
    ) -> Result<Response<()>, Status> {
        run!(self, req, |r, q| {
            let (ctrl, _) = q.name.split_once("/nvmePaths/").ok_or_else(|| {
                invalid(format!(
                    "name {:?} is not {CONTROLLERS}/{{id}}/nvmePaths/{{id}}",
                    q.name
                ))
            })?;
            let found = paths(&r, ctrl).into_iter().find(|(n, _, _)| *n == q.name);
            let Some((_, _, remote)) = found else {
                return if q.allow_missing {
                    Ok(Response::new(()))
                } else {
                    Err(not_found(&q.name))
                };
            };
            delete_path(&r, ctrl, &q.name, &remote)?;
            Ok(Response::new(()))
        })
    }

    async fn update_nvme_path(
        &self,
        req: Request<pb::UpdateNvmePathRequest>,
    ) -> Result<Response<pb::NvmePath>, Status> {
        run!(self, req, |r, q| {
            let m = q
                .nvme_path
                .ok_or_else(|| invalid("nvme_path is required"))?;
            let (ctrl, id) = m.name.split_once("/nvmePaths/").ok_or_else(|| {
                invalid(format!(
                    "name {:?} is not {CONTROLLERS}/{{id}}/nvmePaths/{{id}}",
                    m.name
                ))
            })?;
            let Some((_, have, _)) = paths(&r, ctrl).into_iter().find(|(n, _, _)| *n == m.name)
            else {
                return if q.allow_missing {
                    create_path(&r, ctrl, id, &m).map(Response::new)
                } else {
                    Err(not_found(&m.name))
                };
            };
            for p in mask_paths(&q.update_mask, &["trtype", "traddr", "fabrics"])? {
                let changed = match p.as_str() {
                    "trtype" => m.trtype != have.trtype,
                    "traddr" => m.traddr != have.traddr,
                    _ => m.fabrics != have.fabrics,
                };
                if changed {
                    return Err(invalid(format!(
                        "{p} of {} cannot change: delete the path and create another",
                        m.name
                    )));
                }
            }
            Ok(Response::new(have))
        })
    }

    async fn list_nvme_paths(
        &self,
        req: Request<pb::ListNvmePathsRequest>,
    ) -> Result<Response<pb::ListNvmePathsResponse>, Status> {
        run!(self, req, |r, q| {
            let p = page(q.page_size, &q.page_token)?;
            controller(&r, &q.parent)?;
            let all = paths(&r, &q.parent)
                .into_iter()
                .map(|(n, p, _)| (n, p))
                .collect();
            let (nvme_paths, next_page_token) = paginate(all, &p);
            Ok(Response::new(pb::ListNvmePathsResponse {
                nvme_paths,
                next_page_token,
            }))
        })
    }

    async fn get_nvme_path(
        &self,
        req: Request<pb::GetNvmePathRequest>,
    ) -> Result<Response<pb::NvmePath>, Status> {
        run!(self, req, |r, q| {
            let (ctrl, _) = q.name.split_once("/nvmePaths/").ok_or_else(|| {
                invalid(format!(
                    "name {:?} is not {CONTROLLERS}/{{id}}/nvmePaths/{{id}}",
                    q.name
                ))
            })?;
            controller(&r, ctrl)?;
            paths(&r, ctrl)
                .into_iter()
                .find(|(n, _, _)| *n == q.name)
                .map(|(_, p, _)| Response::new(p))
                .ok_or_else(|| not_found(&q.name))
        })
    }

    async fn stats_nvme_path(
        &self,
        req: Request<pb::StatsNvmePathRequest>,
    ) -> Result<Response<pb::StatsNvmePathResponse>, Status> {
        run!(self, req, |r, q| {
            let (ctrl, _) = q.name.split_once("/nvmePaths/").ok_or_else(|| {
                invalid(format!(
                    "name {:?} is not {CONTROLLERS}/{{id}}/nvmePaths/{{id}}",
                    q.name
                ))
            })?;
            paths(&r, ctrl)
                .into_iter()
                .find(|(n, _, _)| *n == q.name)
                .ok_or_else(|| not_found(&q.name))?;
            // Counted per volume, not per path: the controller's namespace volumes.
            Ok(Response::new(pb::StatsNvmePathResponse {
                stats: Some(ctrl_stats(&r, ctrl)?),
            }))
        })
    }
}
