//! `volume_*` methods.

use nacre_shared::api::volume::{VolumeCreate, VolumeDelete, VolumeList, VolumeResize};
use nacre_shared::api::Ack;
use serde_json::Value;

use super::daemon::Daemon;
use super::error::RpcError;
use super::method::{parse_params, to_value, Method};

pub const METHODS: &[Method] = &[
    Method {
        name: "volume_create",
        handler: volume_create,
        help: "Create a volume: name, size (bytes), block_size (512|4096), backend (ram|file|null), path, tenant, encrypt.",
    },
    Method {
        name: "volume_list",
        handler: volume_list,
        help: "List volumes (optionally one: name), each with its state (online|failed) and the reason a failed one gives.",
    },
    Method {
        name: "volume_delete",
        handler: volume_delete,
        help: "Delete an unexported volume: name; delete_data also removes a file volume's backing file.",
    },
    Method {
        name: "volume_resize",
        handler: volume_resize,
        help: "Change a volume's size: name, size (bytes). Shrinking an exported volume is refused.",
    },
];

fn volume_create(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeCreate = parse_params(params)?;
    to_value(d.registry.create_volume(&p)?)
}

fn volume_list(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeList = parse_params(params)?;
    to_value(d.registry.volumes(p.name.as_deref())?)
}

fn volume_delete(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeDelete = parse_params(params)?;
    d.registry.delete_volume(&p.name, p.delete_data)?;
    to_value(Ack { ok: true })
}

fn volume_resize(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeResize = parse_params(params)?;
    to_value(d.registry.resize_volume(&p.name, p.size)?)
}
