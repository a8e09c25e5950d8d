//! `vhost_blk_*` methods: virtio-blk devices over vhost-user, or as PCI functions over
//! vfio-user.

use nacre_shared::api::vhost::{VhostBlkCreate, VhostBlkName};
use nacre_shared::api::Ack;
use serde_json::Value;

use super::daemon::Daemon;
use super::error::RpcError;
use super::method::{parse_params, to_value, Method, NoParams};

pub const METHODS: &[Method] = &[
    Method {
        name: "vhost_blk_create",
        handler: vhost_blk_create,
        help: "Serve a volume as a virtio-blk device: name, volume, queues, queue_size, socket, read_only, transport (vhost-user, or vfio-user: a PCI function whose socket DIR/cntrl goes in directory `socket`).",
    },
    Method {
        name: "vhost_blk_list",
        handler: vhost_blk_list,
        help: "List virtio-blk devices (vhost-user and vfio-user).",
    },
    Method {
        name: "vhost_blk_delete",
        handler: vhost_blk_delete,
        help: "Stop a virtio-blk device (its client is disconnected) and remove its socket: name.",
    },
];

fn vhost_blk_create(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VhostBlkCreate = parse_params(params)?;
    to_value(d.registry.create_vhost_blk(&p)?)
}

fn vhost_blk_list(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let _: NoParams = parse_params(params)?;
    to_value(d.registry.vhost_blk_devices())
}

fn vhost_blk_delete(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VhostBlkName = parse_params(params)?;
    d.registry.delete_vhost_blk(&p.name)?;
    to_value(Ack { ok: true })
}
