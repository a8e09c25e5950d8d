//! MiddleendQosVolumeService: QoS limits of a volume (`qos_set` with a volume target).
//! `qosVolumes/q` is bound to the volume it limits; one QoS volume per volume. OPI's limits
//! are kIOPS and MB/s: nacre keeps IOPS and bytes/s, so they are multiplied by 1,000 and
//! 1,000,000. nacre enforces ceilings only: a `min` limit is INVALID_ARGUMENT.

use std::sync::Arc;

use nacre_shared::api::qos::QosLimits;
use tonic::{Request, Response, Status};

use super::pb::{self, middleend_qos_volume_service_server::MiddleendQosVolumeService};
use super::{
    blocking, decode, encode, exists_differently, id_in, invalid, mask_paths, new_id, not_found,
    page, paginate, status, volume_ref, volume_stats,
};
use crate::control::registry::{QosScope, Registry};
use crate::control::state::OpiBinding;

const COLLECTION: &str = "qosVolumes";

pub struct Service(pub Arc<Registry>);

fn scope(volume: &str) -> QosScope<'_> {
    QosScope {
        volume: Some(volume),
        tenant: None,
        global: false,
    }
}

/// OPI's ceiling in nacre's units.
fn limits(l: &pb::Limits) -> Result<QosLimits, Status> {
    if l.min
        .as_ref()
        .is_some_and(|m| *m != pb::QosLimit::default())
    {
        return Err(invalid(
            "limits.min: nacre enforces ceilings only; set limits.max",
        ));
    }
    let max = l.max.unwrap_or_default();
    let conv = |v: i64, unit: u64, what: &str| -> Result<Option<u64>, Status> {
        match v {
            0 => Ok(None),
            v if v < 0 => Err(invalid(format!("limits.max.{what} must not be negative"))),
            v => (v as u64)
                .checked_mul(unit)
                .map(Some)
                .ok_or_else(|| invalid(format!("limits.max.{what} is too large"))),
        }
    };
    let q = QosLimits {
        read_iops: conv(max.rd_iops_kiops, 1000, "rd_iops_kiops")?,
        write_iops: conv(max.wr_iops_kiops, 1000, "wr_iops_kiops")?,
        iops: conv(max.rw_iops_kiops, 1000, "rw_iops_kiops")?,
        read_bps: conv(max.rd_bandwidth_mbs, 1_000_000, "rd_bandwidth_mbs")?,
        write_bps: conv(max.wr_bandwidth_mbs, 1_000_000, "wr_bandwidth_mbs")?,
        bps: conv(max.rw_bandwidth_mbs, 1_000_000, "rw_bandwidth_mbs")?,
        burst_ms: None,
        weight: None,
    };
    if q.is_unlimited() {
        return Err(invalid("limits: set at least one field of limits.max"));
    }
    Ok(q)
}

/// The bound QoS volumes whose volume still exists.
fn all(r: &Registry) -> Vec<(String, pb::QosVolume)> {
    r.opi_bindings(&format!("{COLLECTION}/"))
        .into_iter()
        .filter(|(_, b)| r.volumes(Some(&b.object)).is_ok())
        .map(|(n, b)| {
            let mut m: pb::QosVolume = decode(&b.spec);
            m.name = n.clone();
            (n, m)
        })
        .collect()
}

fn find(r: &Registry, name: &str) -> Option<pb::QosVolume> {
    all(r).into_iter().find(|(n, _)| n == name).map(|(_, m)| m)
}

fn apply(r: &Registry, name: &str, m: &pb::QosVolume) -> Result<pb::QosVolume, Status> {
    let volume = volume_ref(r, &m.volume_name_ref)?;
    let l = limits(
        m.limits
            .as_ref()
            .ok_or_else(|| invalid("limits is required"))?,
    )?;
    if let Some((other, _)) = all(r).into_iter().find(|(n, q)| {
        n != name && volume_ref(r, &q.volume_name_ref).ok().as_deref() == Some(&volume)
    }) {
        return Err(Status::already_exists(format!(
            "volume {volume:?} already has QoS limits: {other}"
        )));
    }
    let previous = r.qos_limits(scope(&volume)).map_err(status)?;
    r.set_qos(scope(&volume), &l).map_err(status)?;
    let mut stored = m.clone();
    stored.name = name.to_string();
    if let Err(e) = r.bind_opi(
        name,
        OpiBinding {
            object: volume.clone(),
            spec: encode(&stored),
        },
    ) {
        let _ = match previous.first() {
            Some(p) => r.set_qos(scope(&volume), &p.limits).map(|_| ()),
            None => r.clear_qos(scope(&volume)),
        };
        return Err(status(e));
    }
    Ok(stored)
}

fn create(r: &Registry, id: &str, m: &pb::QosVolume) -> Result<pb::QosVolume, Status> {
    let id = new_id(id)?;
    let name = format!("{COLLECTION}/{id}");
    if let Some(have) = find(r, &name) {
        let mut want = m.clone();
        want.name = name.clone();
        return if encode(&want) == encode(&have) {
            Ok(have)
        } else {
            Err(exists_differently(&name))
        };
    }
    apply(r, &name, m)
}

#[tonic::async_trait]
impl MiddleendQosVolumeService for Service {
    async fn create_qos_volume(
        &self,
        req: Request<pb::CreateQosVolumeRequest>,
    ) -> Result<Response<pb::QosVolume>, Status> {
        let r = self.0.clone();
        let q = req.into_inner();
        blocking(move || {
            let m = q
                .qos_volume
                .ok_or_else(|| invalid("qos_volume is required"))?;
            create(&r, &q.qos_volume_id, &m).map(Response::new)
        })
        .await
    }

    async fn delete_qos_volume(
        &self,
        req: Request<pb::DeleteQosVolumeRequest>,
    ) -> Result<Response<()>, Status> {
        let r = self.0.clone();
        let q = req.into_inner();
        blocking(move || {
            id_in(&q.name, COLLECTION)?;
            let Some(b) = r.opi_binding(&q.name) else {
                return if q.allow_missing {
                    Ok(Response::new(()))
                } else {
                    Err(not_found(&q.name))
                };
            };
            if r.volumes(Some(&b.object)).is_ok() {
                r.clear_qos(scope(&b.object)).map_err(status)?;
            }
            r.unbind_opi(&q.name).map_err(status)?;
            Ok(Response::new(()))
        })
        .await
    }

    async fn update_qos_volume(
        &self,
        req: Request<pb::UpdateQosVolumeRequest>,
    ) -> Result<Response<pb::QosVolume>, Status> {
        let r = self.0.clone();
        let q = req.into_inner();
        blocking(move || {
            let m = q
                .qos_volume
                .ok_or_else(|| invalid("qos_volume is required"))?;
            let id = id_in(&m.name, COLLECTION)?.to_string();
            let Some(have) = find(&r, &m.name) else {
                return if q.allow_missing {
                    create(&r, &id, &m).map(Response::new)
                } else {
                    Err(not_found(&m.name))
                };
            };
            let mut next = have.clone();
            for p in mask_paths(&q.update_mask, &["volume_name_ref", "limits"])? {
                match p.as_str() {
                    "volume_name_ref" => {
                        if volume_ref(&r, &m.volume_name_ref)?
                            != volume_ref(&r, &have.volume_name_ref)?
                        {
                            return Err(invalid(format!(
                                "volume_name_ref of {} cannot change: delete and create it",
                                m.name
                            )));
                        }
                    }
                    _ => next.limits = m.limits,
                }
            }
            apply(&r, &m.name, &next).map(Response::new)
        })
        .await
    }

    async fn list_qos_volumes(
        &self,
        req: Request<pb::ListQosVolumesRequest>,
    ) -> Result<Response<pb::ListQosVolumesResponse>, Status> {
        let r = self.0.clone();
        let q = req.into_inner();
        blocking(move || {
            let p = page(q.page_size, &q.page_token)?;
            let (qos_volumes, next_page_token) = paginate(all(&r), &p);
            Ok(Response::new(pb::ListQosVolumesResponse {
                qos_volumes,
                next_page_token,
            }))
        })
        .await
    }

    async fn get_qos_volume(
        &self,
        req: Request<pb::GetQosVolumeRequest>,
    ) -> Result<Response<pb::QosVolume>, Status> {
        let r = self.0.clone();
        let q = req.into_inner();
        blocking(move || {
            id_in(&q.name, COLLECTION)?;
            find(&r, &q.name)
                .map(Response::new)
                .ok_or_else(|| not_found(&q.name))
        })
        .await
    }

    async fn stats_qos_volume(
        &self,
        req: Request<pb::StatsQosVolumeRequest>,
    ) -> Result<Response<pb::StatsQosVolumeResponse>, Status> {
        let r = self.0.clone();
        let q = req.into_inner();
        blocking(move || {
            id_in(&q.name, COLLECTION)?;
            find(&r, &q.name).ok_or_else(|| not_found(&q.name))?;
            let b = r.opi_binding(&q.name).ok_or_else(|| not_found(&q.name))?;
            Ok(Response::new(pb::StatsQosVolumeResponse {
                stats: Some(volume_stats(&r, &b.object)?),
            }))
        })
        .await
    }
}
