//! The control plane: JSON-RPC 2.0 methods that create, list and delete nacre's objects, the
//! persistent state they live in, and the Unix-socket server that carries them.
//!
//! Each object family has its own module with a `METHODS` table (`volume`, `vhost`, …);
//! [`methods`] chains them. Handlers run under the daemon's one control lock: control-plane
//! operations are rare and short, and serialising them makes "change live objects, persist,
//! commit" atomic with respect to each other. The data path never takes this lock.
//!
//! A handler that changes state follows one pattern: validate; build the live object; write
//! the new state with [`state::save`]; only then commit it in memory. If persisting fails the
//! live object is torn down again, so what runs and what would be replayed never diverge.

pub mod host_channel;
pub mod listener_retry;
pub mod lock;
pub mod nvmf;
pub mod peer;
pub mod qos;
pub mod remote;
pub mod server;
pub mod state;
pub mod tenant;
pub mod vhost;
pub mod volume;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use nacre_shared::api::volume::BackendKind;
use nacre_shared::rpc;
use serde::de::DeserializeOwned;
use serde_json::Value;
use thiserror::Error;
use tracing::{info, warn};

use crate::frontend::vhost_user_blk::VhostBlkServer;
use crate::volume::BlockDevice;
use state::State;

/// A JSON-RPC error: a code from [`nacre_shared::rpc`] and a message that says what to fix.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{message}")]
pub struct RpcError {
    pub code: i64,
    pub message: String,
}

impl RpcError {
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }
    pub fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(rpc::INVALID_PARAMS, message)
    }
    pub fn not_found(kind: &str, name: &str) -> Self {
        Self::new(rpc::NOT_FOUND, format!("{kind} {name:?} does not exist"))
    }
    pub fn exists(kind: &str, name: &str) -> Self {
        Self::new(
            rpc::ALREADY_EXISTS,
            format!("{kind} {name:?} already exists"),
        )
    }
    pub fn busy(message: impl Into<String>) -> Self {
        Self::new(rpc::BUSY, message)
    }
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(rpc::OPERATION_FAILED, message)
    }
    pub fn refused(message: impl Into<String>) -> Self {
        Self::new(rpc::REFUSED, message)
    }
}

/// Parse a method's params into its typed struct; `null`/absent means `{}`.
///
/// The typed struct gets its own copies of the strings (types holding secrets zeroize them on
/// drop), and the JSON tree is scrubbed before it is freed, so a passphrase leaves no copy
/// behind in freed heap memory.
pub fn parse_params<T: DeserializeOwned>(mut params: Value) -> Result<T, RpcError> {
    if params.is_null() {
        params = Value::Object(Default::default());
    }
    let parsed = T::deserialize(&params)
        .map_err(|e| RpcError::invalid_params(format!("invalid params: {e}")));
    scrub(&mut params);
    parsed
}

pub use nacre_shared::rpc::scrub;

/// Turn any serializable result into the JSON-RPC result value.
pub fn to_value<T: serde::Serialize>(v: T) -> Result<Value, RpcError> {
    serde_json::to_value(v).map_err(|e| RpcError::new(rpc::INTERNAL_ERROR, e.to_string()))
}

pub type Handler = fn(&Daemon, Value) -> Result<Value, RpcError>;

/// One control-plane method.
pub struct Method {
    pub name: &'static str,
    pub handler: Handler,
    /// One line, shown by `rpc_get_methods` with `"verbose": true` and by `nacre methods`.
    pub help: &'static str,
}

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

/// Where nacred keeps things.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub state_dir: PathBuf,
    pub run_dir: PathBuf,
}

/// Objects that exist only while nacred runs: opened volumes and running devices.
#[derive(Default)]
pub struct Live {
    pub volumes: HashMap<String, Arc<dyn BlockDevice>>,
    pub vhost_blk: HashMap<String, VhostBlkServer>,
    pub nvmf: Option<Arc<crate::frontend::nvmf_tcp::NvmfTarget>>,
    /// The target's NVMe/RDMA listeners (created with the first one).
    pub nvmf_rdma: Option<Arc<crate::frontend::nvmf_rdma::RdmaPorts>>,
    /// NVMe/RDMA listeners in the state that could not be started at replay ((nqn, address)
    /// → reason): no RDMA device, or none with that address. Not retried.
    pub rdma_listeners_failed: std::collections::BTreeMap<(String, std::net::SocketAddr), String>,
    /// Volumes that could not be opened at replay, with the reason (`volume_list` shows it).
    pub failed: HashMap<String, String>,
    /// NVMe/TCP listeners in the state that could not be bound at replay ((nqn, address) →
    /// reason); [`listener_retry`] keeps trying them.
    pub listeners_failed: std::collections::BTreeMap<(String, std::net::SocketAddr), String>,
    /// Tenants' unlocked KEKs (zeroized when dropped); see `tenant`.
    pub keks: HashMap<String, Arc<crate::crypto::tenant::UnlockedKek>>,
}

/// The persisted state and the live objects built from it, under the control lock.
pub struct Inner {
    pub state: State,
    pub live: Live,
}

pub struct Daemon {
    pub config: DaemonConfig,
    /// Remote NVMe-oF controllers (outside `inner`: volumes need them while it is held).
    pub remotes: remote::Registry,
    /// QoS limiter and the per-volume statistics it keeps (see `qos`).
    pub qos: Arc<crate::volume::qos::Qos>,
    /// Where the Prometheus endpoint listens, once nacred started it.
    pub metrics_addr: std::sync::OnceLock<std::net::SocketAddr>,
    /// GPU peer windows hosts registered (not persisted; see `peer`).
    pub peers: peer::Registry,
    inner: Mutex<Inner>,
    /// `nacred.lock` in the state and run directories, held for the daemon's life.
    _locks: Vec<lock::DirLock>,
}

impl Daemon {
    /// Create the daemon over its directories, and replay the persisted state: volumes are
    /// reopened and devices restarted. An object that fails to come back is logged and left
    /// in the state (so a missing backing file does not silently drop its configuration);
    /// the other objects still start. Returns the daemon and whether state existed before.
    ///
    /// Before anything else in the directories is touched, takes their locks
    /// ([`lock::acquire_all`]): a second nacred over the same state or run directory fails here
    /// and leaves the first one's sockets and files alone.
    pub fn open(config: DaemonConfig) -> anyhow::Result<(Arc<Daemon>, bool)> {
        for dir in [&config.state_dir, &config.run_dir] {
            std::fs::create_dir_all(dir)
                .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
        }
        let locks = lock::acquire_all(&[&config.state_dir, &config.run_dir])?;
        restrict_dir(&config.state_dir)?;
        let loaded = state::load(&config.state_dir)?;
        let existed = loaded.is_some();
        let state = loaded.unwrap_or_default();
        let daemon = Arc::new(Daemon {
            config,
            remotes: Default::default(),
            qos: crate::volume::qos::Qos::start(Default::default()),
            metrics_addr: Default::default(),
            peers: Default::default(),
            inner: Mutex::new(Inner {
                state: state.clone(),
                live: Live::default(),
            }),
            _locks: locks,
        });
        qos::apply(&daemon, &state.qos);
        daemon.replay(&state);
        listener_retry::start(&daemon);
        Ok((daemon, existed))
    }

    fn replay(&self, state: &State) {
        remote::replay(self, state);
        let mut inner = self.lock();
        for rec in state.volumes.values() {
            // A file volume whose file is missing comes up failed: served (so its devices
            // come back) but every I/O errs, never recreated empty.
            if let Some(path) = rec
                .path
                .as_ref()
                .filter(|_| rec.backend == BackendKind::File)
            {
                if let Err(e) = volume::check_backing_file(path) {
                    warn!(volume = %rec.name, error = %e, "volume failed");
                    let failed = volume::FailedVolume::new(rec, e.message.clone());
                    inner
                        .live
                        .volumes
                        .insert(rec.name.clone(), Arc::new(failed));
                    inner.live.failed.insert(rec.name.clone(), e.message);
                    continue;
                }
            }
            match tenant::open_existing(self, &mut inner, rec) {
                Ok(dev) => {
                    let dev = qos::wrap(self, rec, dev);
                    inner.live.volumes.insert(rec.name.clone(), dev);
                }
                Err(e) => {
                    warn!(volume = %rec.name, error = %e, "volume not reopened");
                    inner.live.failed.insert(rec.name.clone(), e.message);
                }
            }
        }
        for rec in state.vhost_blk.values() {
            if let Err(e) = vhost::start_device(&mut inner, rec) {
                warn!(device = %rec.name, error = %e, "vhost-user-blk device not restarted");
            }
        }
        nvmf::replay(&mut inner);
        info!(
            volumes = inner.live.volumes.len(),
            vhost_blk = inner.live.vhost_blk.len(),
            "state replayed"
        );
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run `f` under the control lock.
    pub fn with_inner<T>(
        &self,
        f: impl FnOnce(&mut Inner) -> Result<T, RpcError>,
    ) -> Result<T, RpcError> {
        f(&mut self.lock())
    }

    /// Persist `next` atomically. Call before committing it to `Inner::state`.
    pub fn persist(&self, next: &State) -> Result<(), RpcError> {
        state::save(&self.config.state_dir, next).map_err(|e| {
            RpcError::failed(format!(
                "cannot write state to {}: {e}",
                self.config.state_dir.display()
            ))
        })
    }

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

    /// Stop every device (clients are disconnected, sockets removed). Volumes close as
    /// their last reference drops.
    pub fn shutdown(&self) {
        let mut inner = self.lock();
        for (name, dev) in inner.live.vhost_blk.drain() {
            info!(device = %name, "stopping vhost-user-blk device");
            dev.stop();
        }
        // Stops the listener retry too (it ends when nothing is left to retry).
        inner.live.listeners_failed.clear();
        inner.live.nvmf_rdma = None;
        inner.live.nvmf = None;
        inner.live.volumes.clear();
        self.remotes.close_all();
    }

    pub fn state_dir(&self) -> &Path {
        &self.config.state_dir
    }

    pub fn run_dir(&self) -> &Path {
        &self.config.run_dir
    }
}

/// The state directory holds wrapped keys and tenant names: owner only.
fn restrict_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| anyhow::anyhow!("cannot restrict {} to mode 0700: {e}", dir.display()))
}

/// Params of methods that take none: anything but `{}`/null is an error, so a misspelt
/// filter is not silently ignored.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}
