//! `vhost_blk_*` methods: virtio-blk devices over vhost-user.

use std::path::PathBuf;

use nacre_shared::api::vhost::{VhostBlkCreate, VhostBlkInfo, VhostBlkName, MAX_QUEUES};
use nacre_shared::api::{validate_name, Ack};
use serde_json::Value;
use tracing::info;

use super::state::VhostBlkRecord;
use super::{parse_params, to_value, Daemon, Inner, Method, RpcError};
use crate::frontend::vhost_user_blk::{VhostBlkConfig, VhostBlkServer};

pub const METHODS: &[Method] = &[
    Method {
        name: "vhost_blk_create",
        handler: vhost_blk_create,
        help: "Serve a volume as a vhost-user-blk device: name, volume, queues, queue_size, socket, read_only.",
    },
    Method {
        name: "vhost_blk_list",
        handler: vhost_blk_list,
        help: "List vhost-user-blk devices.",
    },
    Method {
        name: "vhost_blk_delete",
        handler: vhost_blk_delete,
        help: "Stop a vhost-user-blk device (its client is disconnected) and remove its socket: name.",
    },
];

pub fn default_socket(d: &Daemon, name: &str) -> PathBuf {
    d.run_dir().join(format!("vhost-{name}.sock"))
}

/// Start the device of a record on its (already open) volume and register it as live.
pub fn start_device(inner: &mut Inner, rec: &VhostBlkRecord) -> Result<(), RpcError> {
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
    let server = VhostBlkServer::start(
        VhostBlkConfig {
            socket: rec.socket.clone(),
            queues: rec.queues,
            queue_size: rec.queue_size,
            read_only: rec.read_only,
            serial: vol.serial.clone(),
        },
        volume,
    )
    .map_err(|e| {
        RpcError::failed(format!(
            "cannot serve vhost-user-blk on {}: {e}",
            rec.socket.display()
        ))
    })?;
    inner.live.vhost_blk.insert(rec.name.clone(), server);
    Ok(())
}

fn vhost_blk_create(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VhostBlkCreate = parse_params(params)?;
    create(d, &p).and_then(to_value)
}

/// `vhost_blk_create`, callable from the embedded default too.
pub fn create(d: &Daemon, p: &VhostBlkCreate) -> Result<VhostBlkInfo, RpcError> {
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
        None => default_socket(d, &p.name),
    };
    d.with_inner(|inner| {
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
            queues: p.queues,
            queue_size: p.queue_size,
            read_only: p.read_only,
        };
        start_device(inner, &rec)?;
        let mut next = inner.state.clone();
        next.vhost_blk.insert(rec.name.clone(), rec.clone());
        if let Err(e) = d.persist(&next) {
            if let Some(dev) = inner.live.vhost_blk.remove(&rec.name) {
                dev.stop();
            }
            return Err(e);
        }
        inner.state = next;
        info!(device = %rec.name, volume = %rec.volume, socket = %socket.display(), "vhost-user-blk device created");
        Ok(info_of(inner, &rec))
    })
}

fn info_of(inner: &Inner, rec: &VhostBlkRecord) -> VhostBlkInfo {
    VhostBlkInfo {
        name: rec.name.clone(),
        volume: rec.volume.clone(),
        socket: rec.socket.display().to_string(),
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

fn vhost_blk_list(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let _: super::NoParams = parse_params(params)?;
    d.with_inner(|inner| {
        to_value(
            inner
                .state
                .vhost_blk
                .values()
                .map(|r| info_of(inner, r))
                .collect::<Vec<_>>(),
        )
    })
}

fn vhost_blk_delete(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VhostBlkName = parse_params(params)?;
    d.with_inner(|inner| {
        if !inner.state.vhost_blk.contains_key(&p.name) {
            return Err(RpcError::not_found("vhost-blk device", &p.name));
        }
        let mut next = inner.state.clone();
        next.vhost_blk.remove(&p.name);
        d.persist(&next)?;
        inner.state = next;
        if let Some(dev) = inner.live.vhost_blk.remove(&p.name) {
            dev.stop();
        }
        info!(device = %p.name, "vhost-user-blk device deleted");
        to_value(Ack { ok: true })
    })
}
