//! `remote_*` methods: NVMe-oF controllers nacred connects to as a host (the volumes built
//! over them are `volume_create` with backend `remote`).

use nacre_shared::api::remote::{RemoteAttach, RemoteDiscover, RemoteList, RemoteName};
use nacre_shared::api::Ack;
use serde_json::Value;

use super::daemon::Daemon;
use super::error::RpcError;
use super::method::{parse_params, to_value, Method};

pub const METHODS: &[Method] = &[
    Method {
        name: "remote_attach",
        handler: remote_attach,
        help: "Connect to a remote NVMe-oF controller: name, transport (tcp or rdma; default tcp), address, port, subnqn, hostnqn, io_queues, queue_depth, header_digest, data_digest, reconnect_delay_sec, ctrl_loss_timeout_sec, fast_io_fail_timeout_sec, in_capsule_data_size, keep_alive_timeout_ms, io_timeout_sec, quiesce_time_ms.",
    },
    Method {
        name: "remote_detach",
        handler: remote_detach,
        help: "Disconnect a remote controller no volume uses: name.",
    },
    Method {
        name: "remote_list",
        handler: remote_list,
        help: "List remote controllers with their state and namespaces (optionally one: name).",
    },
    Method {
        name: "remote_discover",
        handler: remote_discover,
        help: "Read a portal's NVMe-oF discovery log: transport, address, port.",
    },
];

fn remote_attach(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: RemoteAttach = parse_params(params)?;
    to_value(d.registry.attach_remote(&p)?)
}

fn remote_detach(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: RemoteName = parse_params(params)?;
    d.registry.detach_remote(&p.name)?;
    to_value(Ack { ok: true })
}

fn remote_list(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: RemoteList = parse_params(params)?;
    to_value(d.registry.remotes(p.name.as_deref())?)
}

fn remote_discover(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: RemoteDiscover = parse_params(params)?;
    to_value(d.registry.discover(&p)?)
}
