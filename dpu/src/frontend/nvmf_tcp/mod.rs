//! NVMe-oF target over TCP (NVMe over Fabrics 1.1, NVMe/TCP Transport 1.0).
//!
//! ```text
//!  NvmfTarget ─┬─ listeners: TcpListener per address (accept thread), shared by subsystems
//!              ├─ subsystems: NQN → Subsystem { namespaces, allowed hosts, controllers }
//!              │     (plus the discovery subsystem, reachable on every listener)
//!              ├─ keep-alive reaper thread: tears down controllers whose KATO expired
//!              └─ reactors (`--nvmf-reactors`): threads that each serve many connections
//!                 through epoll; a TCP connection = one NVMe queue (admin qid 0 or I/O)
//! ```
//!
//! What a peer can make the target hold is bounded ([`ConnLimits`], [`limits::R2T_BUDGET`]):
//! connections per listener, connections still setting up per listener (the oldest is
//! closed when a new one would exceed the cap), queues per host NQN, a setup timeout and a
//! per-PDU deadline, and per queue the bytes of host data it waits for after R2T.
//!
//! * [`reactor`] — the reactor threads: epoll, busy-poll then sleep, the mailbox other
//!   threads complete requests and raise events through (eventfd).
//! * [`conn`] — one queue as a reactor serves it: receiving, deadlines, closing.
//! * [`pdu`] — ICReq/ICResp, PDU framing and validation (fatal errors end the connection
//!   with a C2HTermReq), digests.
//! * [`transfer`] — R2T/H2CData, C2HData/CapsuleResp, the send queue (gather writes).
//! * [`command`] — capsules: Fabrics commands, admin commands (to the core's controller) and
//!   the I/O command set mapped onto [`crate::volume::BlockDevice`].
//! * `listener` — the TCP listeners subsystems share: binding, the accept loop, stopping.
//! * `tls` — TLS 1.3 with a pre-shared key (NVMe/TCP §3.6): TLS-only listeners' handshake
//!   and the relay between TLS records and the reactor's plain PDUs.
//!
//! Controllers, subsystems, namespaces, discovery, admission and limits are the target core's
//! ([`crate::frontend::nvme`]), which the RDMA transport shares; this module re-exports the
//! names the management API has always had here ([`ConnLimits`], [`limits`], [`NvmfError`]).
//!
//! Reactors, not a thread per queue and not an async runtime: a connection belongs to one
//! reactor thread, which reads it without blocking, handles every complete PDU a read
//! brought, and flushes the replies of the whole pass with one gather write, so a QD32
//! burst costs one `read` and one `writev`. A volume that completes inline (RAM, file and
//! null always do) costs no hop and no lock; completions from other threads (remote and
//! crypto volumes) go through the reactor's mailbox and wake it by eventfd if it sleeps.
//!
//! Management API (wired to the `nvmf_*` RPC methods by `control::nvmf`):
//! [`NvmfTarget::new`], `create_subsystem`, `delete_subsystem`, `add_namespace` (returns the
//! NSID), `remove_namespace`, `add_listener` (returns the address actually bound, so port 0
//! works), `add_tls_listener` (TLS-only), `remove_listener`, `add_host`, `set_host_keys`
//! (DH-HMAC-CHAP), `set_host_psk` (TLS), `remove_host`, `set_allow_any_host`,
//! `subsystems`. Namespace changes raise Namespace Attribute Changed events on connected
//! controllers. Dropping the target closes every listener and connection.

mod command;
mod conn;
mod listener;
mod pdu;
mod reactor;
mod tls;
mod transfer;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nacre_shared::api::nvmf::NvmfSubsystemInfo;
use tracing::info;

use crate::auth::tls_psk::TlsPsk;
use crate::frontend::nvme::{lock, TargetInner};
use crate::volume::BlockDevice;

use listener::{stop_listener, Listener};

pub use crate::frontend::nvme::{
    limits, ConnLimits, HostKeys, Namespace, NvmfError, Subsystem, AUTH_DHGROUPS, AUTH_HASHES,
    DEFAULT_MODEL, FIRMWARE_REVISION, PDU_TIMEOUT, SETUP_TIMEOUT,
};
pub use reactor::{default_reactor_count, PollPolicy, ReactorStats, MAX_DEFAULT_REACTORS};

/// How a target serves its connections (nacred's `--nvmf-reactors`, `--nvmf-poll` and
/// `--nvmf-max-*`). The default is nacred's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TargetConfig {
    /// Reactor threads; 0 picks [`default_reactor_count`]: one per core, at most
    /// [`MAX_DEFAULT_REACTORS`].
    pub reactors: usize,
    /// When the reactors busy-poll.
    pub poll: PollPolicy,
    /// The connection limits it starts with ([`NvmfTarget::set_conn_limits`] changes them).
    pub conn_limits: ConnLimits,
}

/// An NVMe-oF/TCP target: the target core's subsystems and namespaces, and the TCP listeners
/// that reach them. Dropping the last reference stops every listener and closes every
/// connection.
pub struct NvmfTarget {
    inner: Arc<TargetInner>,
    tcp: Arc<TcpPorts>,
    reaper: Mutex<Option<JoinHandle<()>>>,
}

/// The TCP transport's state: its listeners and the reactor threads serving connections.
pub(crate) struct TcpPorts {
    target: Arc<TargetInner>,
    listeners: Mutex<HashMap<SocketAddr, Listener>>,
    /// The threads serving connections; stopping them closes every connection.
    reactors: reactor::Reactors,
    /// TLS PSKs per (subsystem, host), for TLS listeners' handshakes.
    psks: Arc<tls::PskStore>,
}

impl NvmfTarget {
    /// The shared state other transports' queues serve (`frontend::nvmf_rdma`).
    pub(crate) fn inner(&self) -> &Arc<TargetInner> {
        &self.inner
    }

    /// The poll policy its reactors (and the PCIe controllers' pollers) follow.
    pub fn poll_policy(&self) -> PollPolicy {
        self.tcp.reactors.policy
    }

    /// Its reactors' poll policy and what each did (`nvmf_get_stats`).
    pub fn reactor_stats(&self) -> (PollPolicy, Vec<ReactorStats>) {
        (self.tcp.reactors.policy, self.tcp.reactors.stats())
    }

    /// A target with the default configuration ([`TargetConfig::default`]).
    pub fn new() -> Arc<NvmfTarget> {
        NvmfTarget::with_config(TargetConfig::default())
    }

    /// A target whose connections are served by `reactors` threads (at least one), the rest
    /// of its configuration the default.
    pub fn with_reactors(reactors: usize) -> Arc<NvmfTarget> {
        NvmfTarget::with_config(TargetConfig {
            reactors: reactors.max(1),
            ..TargetConfig::default()
        })
    }

    /// A target configured by `cfg`.
    pub fn with_config(cfg: TargetConfig) -> Arc<NvmfTarget> {
        let (inner, reaper) = TargetInner::start();
        *lock(&inner.limits) = cfg.conn_limits;
        let reactors = match cfg.reactors {
            0 => reactor::default_reactor_count(),
            n => n,
        };
        let tcp = Arc::new(TcpPorts {
            target: inner.clone(),
            listeners: Mutex::new(HashMap::new()),
            reactors: reactor::Reactors::start(reactors, cfg.poll),
            psks: Arc::default(),
        });
        Arc::new(NvmfTarget {
            inner,
            tcp,
            reaper: Mutex::new(reaper),
        })
    }

    /// Change the connection limits (new connections and Connects are checked against them).
    pub fn set_conn_limits(&self, l: ConnLimits) {
        *lock(&self.inner.limits) = l;
    }

    pub fn conn_limits(&self) -> ConnLimits {
        *lock(&self.inner.limits)
    }

    /// How long the rest of a PDU may take once part of it has arrived on a connected queue
    /// before the connection is closed (default [`PDU_TIMEOUT`]). Keep-alive cannot catch a
    /// host that stalls mid-PDU: it may still be trickling bytes, or have keep-alive off.
    /// Only time spent waiting for the host's bytes counts, not time the connection stops
    /// reading because its replies wait for a host that reads slowly (a host that reads
    /// nothing for 30 s is disconnected).
    pub fn set_pdu_timeout(&self, d: Duration) {
        let ms = d.as_millis().clamp(1, u64::MAX as u128) as u64;
        self.inner.pdu_timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// How long a new connection may take to send its ICReq and then its Fabrics Connect
    /// before it is closed (default [`SETUP_TIMEOUT`]). Until a queue is connected no
    /// keep-alive covers it, so without this a peer could hold connections (and their
    /// buffers) open forever without ever authenticating as a host.
    pub fn set_setup_timeout(&self, d: Duration) {
        let ms = d.as_millis().clamp(1, u64::MAX as u128) as u64;
        self.inner.setup_timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// Create an NVM subsystem. `serial` at most 20 and `model` at most 40 printable ASCII
    /// characters (Identify Controller fields).
    pub fn create_subsystem(
        &self,
        nqn: &str,
        serial: &str,
        model: &str,
        allow_any_host: bool,
    ) -> Result<(), NvmfError> {
        self.inner
            .create_subsystem(nqn, serial, model, allow_any_host)
    }

    /// Delete a subsystem: its controllers are torn down and its listeners released.
    pub fn delete_subsystem(&self, nqn: &str) -> Result<(), NvmfError> {
        let s = self.inner.remove_subsystem(nqn)?;
        let addrs: Vec<SocketAddr> = lock(&s.state).listeners.iter().copied().collect();
        for a in addrs {
            self.tcp.release_listener(a, nqn);
        }
        self.tcp.psks.forget_subsystem(nqn);
        info!(nqn, "nvmf subsystem deleted");
        Ok(())
    }

    /// Attach `volume` as namespace `nsid` (default: the lowest free NSID); `nguid` is
    /// reported as both the NGUID and the UUID. Connected controllers get a Namespace
    /// Attribute Changed event. Returns the NSID.
    pub fn add_namespace(
        &self,
        nqn: &str,
        nsid: Option<u32>,
        volume: Arc<dyn BlockDevice>,
        nguid: [u8; 16],
        name: String,
    ) -> Result<u32, NvmfError> {
        self.inner.add_namespace(nqn, nsid, volume, nguid, name)
    }

    pub fn remove_namespace(&self, nqn: &str, nsid: u32) -> Result<(), NvmfError> {
        self.inner.remove_namespace(nqn, nsid)
    }

    /// Make the subsystem reachable on `addr`, starting a listener there unless one is
    /// already running (listeners are shared by subsystems). Port 0 picks a free port; the
    /// address actually bound is returned and is the one to pass to `remove_listener`.
    pub fn add_listener(&self, nqn: &str, addr: SocketAddr) -> Result<SocketAddr, NvmfError> {
        self.add_listener_of(nqn, addr, false)
    }

    /// [`add_listener`](Self::add_listener) for a TLS-only listener (NVMe/TCP §3.6): hosts
    /// must complete a TLS 1.3 handshake with the PSK [`set_host_psk`](Self::set_host_psk)
    /// gave them before the ICReq. An address already served by a plain listener is an
    /// error, and the other way round.
    pub fn add_tls_listener(&self, nqn: &str, addr: SocketAddr) -> Result<SocketAddr, NvmfError> {
        self.add_listener_of(nqn, addr, true)
    }

    fn add_listener_of(
        &self,
        nqn: &str,
        addr: SocketAddr,
        tls: bool,
    ) -> Result<SocketAddr, NvmfError> {
        let s = self.inner.subsystem(nqn)?;
        let bound = self.tcp.acquire_listener(addr, nqn, tls)?;
        lock(&s.state).listeners.insert(bound);
        self.inner.bump_genctr();
        info!(nqn, %bound, tls, "nvmf listener added");
        Ok(bound)
    }

    /// The TLS PSK `hostnqn` uses on `nqn`'s TLS listeners (`None`: remove it). Without one
    /// the host cannot complete a handshake there. Connections already up stay.
    pub fn set_host_psk(
        &self,
        nqn: &str,
        hostnqn: &str,
        psk: Option<TlsPsk>,
    ) -> Result<(), NvmfError> {
        self.inner.subsystem(nqn)?;
        self.tcp.psks.set(nqn, hostnqn, psk);
        Ok(())
    }

    /// Whether `hostnqn` has a TLS PSK on `nqn`.
    pub fn host_has_psk(&self, nqn: &str, hostnqn: &str) -> bool {
        self.tcp.psks.has(nqn, hostnqn)
    }

    pub fn remove_listener(&self, nqn: &str, addr: SocketAddr) -> Result<(), NvmfError> {
        let s = self.inner.subsystem(nqn)?;
        if !lock(&s.state).listeners.remove(&addr) {
            return Err(NvmfError::NoSuchListener(addr));
        }
        self.tcp.release_listener(addr, nqn);
        self.inner.bump_genctr();
        Ok(())
    }

    /// Allow `hostnqn` to connect.
    pub fn add_host(&self, nqn: &str, hostnqn: &str) -> Result<(), NvmfError> {
        self.inner.add_host(nqn, hostnqn)
    }

    /// Require DH-HMAC-CHAP of `hostnqn`'s new queues with `keys` (`None`: no longer).
    pub fn set_host_keys(
        &self,
        nqn: &str,
        hostnqn: &str,
        keys: Option<HostKeys>,
    ) -> Result<(), NvmfError> {
        self.inner.set_host_keys(nqn, hostnqn, keys)
    }

    pub fn remove_host(&self, nqn: &str, hostnqn: &str) -> Result<(), NvmfError> {
        self.inner.remove_host(nqn, hostnqn)
    }

    pub fn set_allow_any_host(&self, nqn: &str, allow: bool) -> Result<(), NvmfError> {
        self.inner.set_allow_any_host(nqn, allow)
    }

    /// Every subsystem, the discovery subsystem first.
    pub fn subsystems(&self) -> Vec<NvmfSubsystemInfo> {
        self.inner.subsystem_infos()
    }

    /// Addresses currently listened on.
    pub fn listeners(&self) -> Vec<SocketAddr> {
        lock(&self.tcp.listeners).keys().copied().collect()
    }
}

impl Drop for NvmfTarget {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        let listeners: Vec<(SocketAddr, Listener)> = lock(&self.tcp.listeners).drain().collect();
        for (addr, l) in listeners {
            stop_listener(l);
            self.inner.free_portid(&addr);
        }
        self.inner.teardown_all();
        // Each reactor closes its connections as it stops.
        self.tcp.reactors.stop();
        if let Some(h) = lock(&self.reaper).take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}
