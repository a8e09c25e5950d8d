//! The control plane: JSON-RPC 2.0 methods that create, list and delete nacre's objects, the
//! persistent state they live in, and the Unix-socket server that carries them.
//!
//! Each object family has its own handler module with a `METHODS` table (`volume`, `vhost`,
//! …); [`methods`] chains them. A handler parses its params, makes one call into the
//! [`registry`] — which owns every persisted record and live object, and keeps the rule that
//! what runs and what would be replayed never diverge — and serialises the result. The
//! registry's documentation draws the dependency graph; nothing below a handler calls back
//! up into one.

pub mod daemon;
pub mod error;
pub mod host_channel;
pub mod lock;
pub mod method;
pub mod metrics;
pub mod nvmf;
pub mod opi;
pub mod peer;
pub mod qos;
pub mod registry;
pub mod remote;
pub mod server;
pub mod state;
pub mod tenant;
pub mod vhost;
pub mod volume;

use nacre_shared::rpc;
use serde_json::Value;

pub use daemon::Daemon;
pub use error::RpcError;
pub use method::{parse_params, scrub, to_value, Handler, Method, NoParams};
pub use registry::{DaemonConfig, DataPathConfig};

/// Every method nacred answers.
pub fn methods() -> impl Iterator<Item = &'static Method> {
    META_METHODS
        .iter()
        .chain(volume::METHODS)
        .chain(vhost::METHODS)
        .chain(nvmf::METHODS)
        .chain(tenant::METHODS)
        .chain(remote::METHODS)
        .chain(qos::METHODS)
        .chain(peer::METHODS)
}

const META_METHODS: &[Method] = &[Method {
    name: "rpc_get_methods",
    handler: rpc_get_methods,
    help: "List the methods nacred answers (\"verbose\": true adds a line of help each).",
}];

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct GetMethods {
    #[serde(default)]
    verbose: bool,
}

fn rpc_get_methods(_d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: GetMethods = parse_params(params)?;
    if p.verbose {
        to_value(
            methods()
                .map(|m| serde_json::json!({"name": m.name, "help": m.help}))
                .collect::<Vec<_>>(),
        )
    } else {
        to_value(methods().map(|m| m.name).collect::<Vec<_>>())
    }
}

impl Daemon {
    /// Dispatch one method call.
    pub fn call(&self, method: &str, params: Value) -> Result<Value, RpcError> {
        let m = methods().find(|m| m.name == method).ok_or_else(|| {
            RpcError::new(
                rpc::METHOD_NOT_FOUND,
                format!("method {method:?} not found; rpc_get_methods lists them"),
            )
        })?;
        (m.handler)(self, params)
    }
}
