//! The registry's data and its one transaction rule; everything else in the registry is
//! built on this.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::controllers::Controllers;
use super::windows::Windows;
use crate::control::error::RpcError;
use crate::control::state::{self, State, VolumeRecord};
use crate::frontend::nvmf_rdma::RdmaPorts;
use crate::frontend::nvmf_tcp::NvmfTarget;
use crate::frontend::vhost_user_blk::VhostBlkServer;
use crate::frontend::virtio_pcie::VirtioBlkPci;
use crate::volume::qos::Qos;
use crate::volume::BlockDevice;

/// Where nacred keeps things, and how its data path runs.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub state_dir: PathBuf,
    pub run_dir: PathBuf,
    pub data_path: DataPathConfig,
}

impl DaemonConfig {
    /// State and run directories, the data path as nacred runs it by default.
    pub fn new(state_dir: PathBuf, run_dir: PathBuf) -> DaemonConfig {
        DaemonConfig {
            state_dir,
            run_dir,
            data_path: DataPathConfig::default(),
        }
    }
}

/// How the daemon's data path runs (nacred's `--nvmf-*`, `--fabric-reactors` and `--no-qos`
/// flags). The default is nacred's default.
#[derive(Debug, Clone)]
pub struct DataPathConfig {
    /// The NVMe-oF target's reactors, poll policy and connection limits (the target is
    /// created with the first subsystem).
    pub nvmf: crate::frontend::nvmf_tcp::TargetConfig,
    /// NVMe/TCP initiator reactor threads for remote controllers; 0: the process's shared
    /// pool of the default size ([`crate::fabric::tcp::Reactors::new`]).
    pub fabric_reactors: usize,
    /// Serve volumes through the QoS and statistics layer. Off (`--no-qos`) is the baseline
    /// `scripts/bench-qos` compares against; limits are still stored, not enforced.
    pub qos: bool,
}

impl Default for DataPathConfig {
    fn default() -> Self {
        DataPathConfig {
            nvmf: Default::default(),
            fabric_reactors: 0,
            qos: true,
        }
    }
}

/// Objects that exist only while nacred runs: opened volumes and running devices.
/// A running virtio-blk device, whichever transport carries it.
pub(super) enum BlkDevice {
    VhostUser(VhostBlkServer),
    VfioUser(VirtioBlkPci),
}

impl BlkDevice {
    pub fn is_connected(&self) -> bool {
        match self {
            BlkDevice::VhostUser(s) => s.is_connected(),
            BlkDevice::VfioUser(f) => f.is_connected(),
        }
    }

    /// Stop serving: a client is disconnected, the socket removed.
    pub fn stop(self) {
        match self {
            BlkDevice::VhostUser(s) => s.stop(),
            BlkDevice::VfioUser(f) => f.stop(),
        }
    }
}

#[derive(Default)]
pub(super) struct Live {
    pub volumes: HashMap<String, Arc<dyn BlockDevice>>,
    pub vhost_blk: HashMap<String, BlkDevice>,
    pub nvmf: Option<Arc<NvmfTarget>>,
    /// How [`Live::nvmf`] is configured when it is created ([`DataPathConfig::nvmf`]).
    pub nvmf_config: crate::frontend::nvmf_tcp::TargetConfig,
    /// The target's NVMe/RDMA listeners (created with the first one).
    pub nvmf_rdma: Option<Arc<RdmaPorts>>,
    /// The target's PCIe NVMe controllers over vfio-user (created with the first one).
    pub nvmf_vfio_user: Option<Arc<crate::frontend::nvme_pcie::VfioUserPorts>>,
    /// vfio-user listeners in the state that could not be started at replay ((nqn,
    /// directory) → reason). Not retried.
    pub vfio_user_listeners_failed: BTreeMap<(String, std::path::PathBuf), String>,
    /// NVMe/RDMA listeners in the state that could not be started at replay ((nqn, address)
    /// → reason): no RDMA device, or none with that address. Not retried.
    pub rdma_listeners_failed: BTreeMap<(String, SocketAddr), String>,
    /// Volumes that could not be opened at replay, with the reason (`volume_list` shows it).
    pub failed: HashMap<String, String>,
    /// NVMe/TCP listeners in the state that could not be bound at replay ((nqn, address) →
    /// reason); [`super::listener_retry`] keeps trying them.
    pub listeners_failed: BTreeMap<(String, SocketAddr), String>,
    /// Tenants' unlocked KEKs (zeroized when dropped); see [`super::keys`].
    pub keks: HashMap<String, Arc<crate::crypto::tenant::UnlockedKek>>,
    /// KMS and passphrase tenants: last successful key-manager answer, and why the tenant
    /// is locked (see [`super::keys`]).
    pub tenant_status: HashMap<String, TenantStatus>,
    /// Encrypted volumes' key gates (weak: a gate lives as long as its volume), through
    /// which `tenant_lock`/`tenant_unlock` withdraw and restore their keys.
    pub gates: HashMap<String, std::sync::Weak<crate::crypto::gate::KeyGate>>,
}

/// What nacred knows about a tenant's KEK beyond the record: when the key manager last
/// answered for it, and why it is locked, if it is.
#[derive(Debug, Clone, Default)]
pub struct TenantStatus {
    /// Seconds since the Unix epoch.
    pub last_contact: Option<u64>,
    pub locked_reason: Option<String>,
}

/// The persisted state and the live objects built from it, under the control lock.
pub(super) struct Inner {
    pub state: State,
    pub live: Live,
}

impl Inner {
    /// The record of volume `name`, or the error that says it does not exist.
    pub fn volume(&self, name: &str) -> Result<&VolumeRecord, RpcError> {
        self.state
            .volumes
            .get(name)
            .ok_or_else(|| RpcError::not_found("volume", name))
    }
}

/// The one owner of nacred's objects: the persisted records, the live objects built from
/// them, the remote controllers volumes are built over, and the QoS layer volumes are
/// wrapped in. See the [module documentation](super) for how it is organised.
pub struct Registry {
    pub(super) config: DaemonConfig,
    /// Under the control lock.
    inner: Mutex<Inner>,
    /// Remote NVMe-oF controllers (outside `inner`: `remote_attach` connects without the
    /// control lock, and volumes need them while it is held).
    pub(super) controllers: Controllers,
    /// QoS limiter and the per-volume statistics it keeps.
    pub(super) qos: Arc<Qos>,
    /// GPU peer windows hosts registered (not persisted; see [`super::windows`]).
    pub(super) windows: Windows,
}

impl Registry {
    /// A registry over `state` (as loaded) with nothing live yet: see [`Registry::replay`].
    pub(crate) fn new(config: DaemonConfig, state: State) -> Registry {
        Registry {
            inner: Mutex::new(Inner {
                state,
                live: Live {
                    nvmf_config: config.data_path.nvmf,
                    ..Live::default()
                },
            }),
            controllers: Controllers::new(crate::fabric::tcp::Reactors::new(
                config.data_path.fabric_reactors,
            )),
            qos: Qos::start(Default::default()),
            windows: Default::default(),
            config,
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run `f` under the control lock.
    pub(super) fn with<T>(
        &self,
        f: impl FnOnce(&mut Inner) -> Result<T, RpcError>,
    ) -> Result<T, RpcError> {
        let r = f(&mut self.lock());
        // Operations use KEKs; their key schedules stay in dead stack frames otherwise.
        crate::crypto::keys::scrub_stack();
        r
    }

    /// Persist `next` atomically. Call before committing it to `Inner::state`.
    pub(super) fn persist(&self, next: &State) -> Result<(), RpcError> {
        state::save(&self.config.state_dir, next).map_err(|e| {
            RpcError::failed(format!(
                "cannot write state to {}: {e}",
                self.config.state_dir.display()
            ))
        })
    }

    /// The last two steps of every change: persist `next`, then commit it in memory. If
    /// persisting fails, `undo` tears down what the change built live, so what runs and what
    /// would be replayed never diverge.
    pub(super) fn commit(
        &self,
        inner: &mut Inner,
        next: State,
        undo: impl FnOnce(),
    ) -> Result<(), RpcError> {
        if let Err(e) = self.persist(&next) {
            undo();
            return Err(e);
        }
        inner.state = next;
        Ok(())
    }

    /// Read the persisted records (a consistent view, under the control lock).
    pub fn read_state<T>(&self, f: impl FnOnce(&State) -> T) -> T {
        f(&self.lock().state)
    }

    /// The QoS layer (its telemetry serves the metrics endpoint).
    pub fn qos(&self) -> &Arc<Qos> {
        &self.qos
    }

    pub fn state_dir(&self) -> &Path {
        &self.config.state_dir
    }

    pub fn run_dir(&self) -> &Path {
        &self.config.run_dir
    }

    /// Stop every device (clients are disconnected, sockets removed). Volumes close as
    /// their last reference drops.
    pub fn shutdown(&self) {
        let mut inner = self.lock();
        for (name, dev) in inner.live.vhost_blk.drain() {
            tracing::info!(device = %name, "stopping vhost-user-blk device");
            dev.stop();
        }
        // Stops the listener retry too (it ends when nothing is left to retry).
        inner.live.listeners_failed.clear();
        inner.live.nvmf_rdma = None;
        inner.live.nvmf_vfio_user = None;
        inner.live.nvmf = None;
        inner.live.volumes.clear();
        self.controllers.close_all();
    }
}
