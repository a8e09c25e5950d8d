//! virtio-blk devices: over vhost-user (one Unix socket each), or as a PCI function over
//! vfio-user (one socket `cntrl` in a directory each).

use std::path::PathBuf;

use nacre_shared::api::validate_name;
use nacre_shared::api::vhost::{
    VhostBlkCreate, VhostBlkInfo, MAX_QUEUES, TRANSPORT_VFIO_USER, TRANSPORT_VHOST_USER,
};
use tracing::info;

use super::store::{BlkDevice, Inner, Registry};
use crate::control::error::RpcError;
use crate::control::state::VhostBlkRecord;
use crate::frontend::vhost_user_blk::{VhostBlkConfig, VhostBlkServer};
use crate::frontend::virtio_pcie::{self, VirtioBlkPci, VirtioBlkPciConfig};

fn vfio_user(rec: &VhostBlkRecord) -> bool {
    rec.transport.as_deref() == Some(TRANSPORT_VFIO_USER)
}

impl Registry {
    /// Where a device's socket is unless told otherwise.
    pub fn default_vhost_socket(&self, name: &str) -> PathBuf {
        self.run_dir().join(format!("vhost-{name}.sock"))
    }

    /// `vhost_blk_create`: start serving an existing volume; the device is stopped again if
    /// persisting it fails.
    pub fn create_vhost_blk(&self, p: &VhostBlkCreate) -> Result<VhostBlkInfo, RpcError> {
        validate_name("vhost-blk device", &p.name).map_err(RpcError::invalid_params)?;
        if p.queues == 0 || p.queues > MAX_QUEUES {
            return Err(RpcError::invalid_params(format!(
                "queues must be between 1 and {MAX_QUEUES} (got {})",
                p.queues
            )));
        }
        if !p.queue_size.is_power_of_two() || !(16..=32768).contains(&p.queue_size) {
            return Err(RpcError::invalid_params(format!(
                "queue_size must be a power of two between 16 and 32768 (got {})",
                p.queue_size
            )));
        }
        let transport = match p.transport.as_deref() {
            None | Some(TRANSPORT_VHOST_USER) => None,
            Some(TRANSPORT_VFIO_USER) => {
                if p.socket.is_none() {
                    return Err(RpcError::invalid_params(
                        "transport vfio-user needs socket: the directory for the function's socket `cntrl`",
                    ));
                }
                if p.queues > virtio_pcie::MAX_QUEUES {
                    return Err(RpcError::invalid_params(format!(
                        "a virtio-blk PCI function has at most {} queues (got {})",
                        virtio_pcie::MAX_QUEUES,
                        p.queues
                    )));
                }
                Some(TRANSPORT_VFIO_USER.to_string())
            }
            Some(other) => {
                return Err(RpcError::invalid_params(format!(
                "transport must be {TRANSPORT_VHOST_USER} or {TRANSPORT_VFIO_USER} (got {other:?})"
            )))
            }
        };
        let socket = match &p.socket {
            Some(s) => {
                let s = PathBuf::from(s);
                if !s.is_absolute() {
                    return Err(RpcError::invalid_params(format!(
                        "socket must be an absolute path (got {s:?})"
                    )));
                }
                s
            }
            None => self.default_vhost_socket(&p.name),
        };
        self.with(|inner| {
            if inner.state.vhost_blk.contains_key(&p.name) {
                return Err(RpcError::exists("vhost-blk device", &p.name));
            }
            if !inner.state.volumes.contains_key(&p.volume) {
                return Err(RpcError::not_found("volume", &p.volume));
            }
            if let Some(other) = inner.state.vhost_blk.values().find(|v| v.socket == socket) {
                return Err(RpcError::busy(format!(
                    "socket {} is already used by vhost-blk device {:?}",
                    socket.display(),
                    other.name
                )));
            }
            let rec = VhostBlkRecord {
                name: p.name.clone(),
                volume: p.volume.clone(),
                socket: socket.clone(),
                transport,
                queues: p.queues,
                queue_size: p.queue_size,
                read_only: p.read_only,
            };
            let server = start_device(inner, &rec)?;
            let mut next = inner.state.clone();
            next.vhost_blk.insert(rec.name.clone(), rec.clone());
            if let Err(e) = self.persist(&next) {
                server.stop();
                return Err(e);
            }
            inner.state = next;
            inner.live.vhost_blk.insert(rec.name.clone(), server);
            info!(device = %rec.name, volume = %rec.volume, socket = %socket.display(),
                transport = rec.transport.as_deref().unwrap_or(TRANSPORT_VHOST_USER), "virtio-blk device created");
            Ok(vhost_info(inner, &rec))
        })
    }

    /// `vhost_blk_list`.
    pub fn vhost_blk_devices(&self) -> Vec<VhostBlkInfo> {
        let inner = self.lock();
        inner
            .state
            .vhost_blk
            .values()
            .map(|r| vhost_info(&inner, r))
            .collect()
    }

    /// `vhost_blk_delete`: its client is disconnected and its socket removed.
    pub fn delete_vhost_blk(&self, name: &str) -> Result<(), RpcError> {
        self.with(|inner| {
            if !inner.state.vhost_blk.contains_key(name) {
                return Err(RpcError::not_found("vhost-blk device", name));
            }
            let mut next = inner.state.clone();
            next.vhost_blk.remove(name);
            self.commit(inner, next, || {})?;
            if let Some(dev) = inner.live.vhost_blk.remove(name) {
                dev.stop();
            }
            info!(device = %name, "vhost-user-blk device deleted");
            Ok(())
        })
    }
}

/// Start the device of a record on its (already open) volume.
fn start_device(inner: &Inner, rec: &VhostBlkRecord) -> Result<BlkDevice, RpcError> {
    let volume = inner
        .live
        .volumes
        .get(&rec.volume)
        .cloned()
        .ok_or_else(|| RpcError::failed(format!("volume {:?} is not open", rec.volume)))?;
    let vol = inner
        .state
        .volumes
        .get(&rec.volume)
        .ok_or_else(|| RpcError::not_found("volume", &rec.volume))?;
    if vfio_user(rec) {
        return VirtioBlkPci::start(
            VirtioBlkPciConfig {
                dir: rec.socket.clone(),
                queues: rec.queues,
                queue_size: rec.queue_size,
                read_only: rec.read_only,
                serial: vol.serial.clone(),
            },
            volume,
        )
        .map(BlkDevice::VfioUser)
        .map_err(|e| RpcError::failed(format!("cannot serve a virtio-blk PCI function: {e}")));
    }
    VhostBlkServer::start(
        VhostBlkConfig {
            socket: rec.socket.clone(),
            queues: rec.queues,
            queue_size: rec.queue_size,
            read_only: rec.read_only,
            serial: vol.serial.clone(),
        },
        volume,
    )
    .map(BlkDevice::VhostUser)
    .map_err(|e| {
        RpcError::failed(format!(
            "cannot serve vhost-user-blk on {}: {e}",
            rec.socket.display()
        ))
    })
}

/// Restart the persisted devices (after volumes were reopened).
pub(super) fn replay(inner: &mut Inner) {
    let recs: Vec<VhostBlkRecord> = inner.state.vhost_blk.values().cloned().collect();
    for rec in &recs {
        // A function's directory existed when it was created; one under /run is gone after
        // a reboot, and the operator asked for the device to stay: make it again.
        if vfio_user(rec) {
            if let Err(e) = std::fs::create_dir_all(&rec.socket) {
                tracing::warn!(device = %rec.name, dir = %rec.socket.display(), "cannot make the vfio-user directory: {e}");
            }
        }
        match start_device(inner, rec) {
            Ok(server) => {
                inner.live.vhost_blk.insert(rec.name.clone(), server);
            }
            Err(e) => {
                tracing::warn!(device = %rec.name, error = %e, "vhost-user-blk device not restarted")
            }
        }
    }
}

fn vhost_info(inner: &Inner, rec: &VhostBlkRecord) -> VhostBlkInfo {
    VhostBlkInfo {
        name: rec.name.clone(),
        volume: rec.volume.clone(),
        socket: rec.socket.display().to_string(),
        transport: rec
            .transport
            .clone()
            .unwrap_or_else(|| TRANSPORT_VHOST_USER.to_string()),
        queues: rec.queues,
        queue_size: rec.queue_size,
        read_only: rec.read_only,
        connected: inner
            .live
            .vhost_blk
            .get(&rec.name)
            .is_some_and(|s| s.is_connected()),
    }
}
