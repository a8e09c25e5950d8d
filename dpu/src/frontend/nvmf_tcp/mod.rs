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
//! * [`command`] — capsules: Fabrics commands, admin commands (to [`ctrl`]) and the I/O
//!   command set mapped onto [`crate::volume::BlockDevice`].
//! * [`ctrl`] — a controller (dynamic controller model): properties, admin commands,
//!   features, log pages, asynchronous events, keep-alive.
//! * [`subsystem`] — subsystems, namespaces and the discovery log page.
//! * `listener` — the TCP listeners subsystems share: binding, the accept loop, stopping.
//! * `admission` — [`ConnLimits`] and what a listener's connections count against (the RDMA
//!   listeners count theirs the same way).
//! * [`limits`] — what nacre advertises to hosts and enforces: queue sizes, MDTS, R2T budget.
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
//! works), `remove_listener`, `add_host`, `remove_host`, `set_allow_any_host`,
//! `subsystems`. Namespace changes raise Namespace Attribute Changed events on connected
//! controllers. Dropping the target closes every listener and connection.

mod admission;
mod command;
mod conn;
pub(crate) mod ctrl;
pub(crate) mod fabrics;
pub mod limits;
mod listener;
mod pdu;
mod reactor;
pub(crate) mod subsystem;
mod transfer;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nacre_shared::api::nvmf::NvmfSubsystemInfo;
use nacre_shared::nvme::{validate_nqn, DISCOVERY_NQN};
use thiserror::Error;
use tracing::{info, warn};

use crate::volume::BlockDevice;

use admission::DEFAULT_LIMITS;
use listener::{stop_listener, Listener};

pub use admission::{set_default_conn_limits, ConnLimits};
pub(crate) use admission::{ConnSlot, Evict, ListenerConns};
pub use reactor::{
    poll_policy, set_default_reactors, set_poll_policy, PollPolicy, ReactorStats,
    MAX_DEFAULT_REACTORS,
};
pub use subsystem::{Namespace, Subsystem};

/// Errors of the target's management API.
#[derive(Debug, Error)]
pub enum NvmfError {
    /// The NQN is malformed.
    #[error("invalid NQN: {0}")]
    InvalidNqn(String),
    #[error("subsystem {0} already exists")]
    SubsystemExists(String),
    #[error("subsystem {0} does not exist")]
    NoSuchSubsystem(String),
    /// The discovery subsystem is built in; it cannot carry namespaces or be deleted.
    #[error("the discovery subsystem cannot be changed that way")]
    Discovery,
    #[error("namespace {nsid} already exists in {nqn}")]
    NsidInUse { nqn: String, nsid: u32 },
    #[error("namespace {nsid} does not exist in {nqn}")]
    NoSuchNamespace { nqn: String, nsid: u32 },
    #[error("invalid namespace ID {0}: use 1 to {max}", max = limits::MAX_NSID)]
    InvalidNsid(u32),
    #[error("subsystem {0} has no free namespace ID")]
    NamespacesFull(String),
    /// Serial or model number too long or not printable ASCII.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("no listener on {0} for this subsystem")]
    NoSuchListener(SocketAddr),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Milliseconds since the target started: the clock of keep-alive accounting.
#[derive(Clone, Copy)]
pub(crate) struct Clock(Instant);

impl Clock {
    pub(crate) fn now_ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }
}

/// An NVMe-oF/TCP target: subsystems, their namespaces and the TCP listeners that reach
/// them. Dropping the last reference stops every listener and closes every connection.
pub struct NvmfTarget {
    inner: Arc<TargetInner>,
    reaper: Mutex<Option<JoinHandle<()>>>,
}

pub(crate) struct TargetInner {
    pub(crate) clock: Clock,
    subsystems: Mutex<BTreeMap<String, Arc<Subsystem>>>,
    pub(crate) discovery: Arc<Subsystem>,
    listeners: Mutex<HashMap<SocketAddr, Listener>>,
    /// The threads serving connections; stopping them closes every connection.
    reactors: reactor::Reactors,
    pub(crate) limits: Mutex<ConnLimits>,
    /// Connected queues per host NQN (for [`ConnLimits::per_host`]).
    host_queues: Mutex<HashMap<String, usize>>,
    pub(crate) next_conn: AtomicU64,
    next_cntlid: AtomicU16,
    /// The next TCP listener's PORTID (see `acquire_listener`).
    pub(crate) next_portid: AtomicU16,
    /// Discovery log generation counter (GENCTR).
    pub(crate) genctr: AtomicU64,
    /// Milliseconds a new connection may take to send its ICReq and then its Fabrics
    /// Connect; see [`NvmfTarget::set_setup_timeout`].
    pub(crate) setup_timeout_ms: AtomicU64,
    /// Milliseconds the rest of a PDU may take once part of it has arrived; see
    /// [`NvmfTarget::set_pdu_timeout`].
    pub(crate) pdu_timeout_ms: AtomicU64,
    stop: AtomicBool,
}

/// Default for [`NvmfTarget::set_setup_timeout`].
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Default for [`NvmfTarget::set_pdu_timeout`]: the largest PDU nacre accepts (128 KiB plus
/// headers) moves in well under a second even on a slow link.
pub const PDU_TIMEOUT: Duration = Duration::from_secs(30);

/// A completion raised by the control plane (asynchronous events); the queue's reactor
/// sends it.
pub(crate) struct AsyncReply {
    pub(crate) queue: Weak<dyn ctrl::CtrlQueue>,
    pub(crate) cid: u16,
    pub(crate) dw0: u32,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The firmware revision every controller reports: nacre's version.
pub const FIRMWARE_REVISION: &str = env!("CARGO_PKG_VERSION");
/// Default model number.
pub const DEFAULT_MODEL: &str = "nacre";

impl NvmfTarget {
    /// The shared state other transports' queues serve (`frontend::nvmf_rdma`).
    pub(crate) fn inner(&self) -> &Arc<TargetInner> {
        &self.inner
    }

    /// Its reactors' poll policy and what each did (`nvmf_get_stats`).
    pub fn reactor_stats(&self) -> (PollPolicy, Vec<ReactorStats>) {
        (self.inner.reactors.policy, self.inner.reactors.stats())
    }

    /// A target with the default number of reactor threads ([`set_default_reactors`]).
    pub fn new() -> Arc<NvmfTarget> {
        NvmfTarget::with_reactors(reactor::default_reactors())
    }

    /// A target whose connections are served by `reactors` threads (at least one).
    pub fn with_reactors(reactors: usize) -> Arc<NvmfTarget> {
        let inner = Arc::new(TargetInner {
            clock: Clock(Instant::now()),
            subsystems: Mutex::new(BTreeMap::new()),
            discovery: Subsystem::new_discovery(),
            listeners: Mutex::new(HashMap::new()),
            reactors: reactor::Reactors::start(reactors),
            limits: Mutex::new(*lock(&DEFAULT_LIMITS)),
            host_queues: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            next_cntlid: AtomicU16::new(1),
            next_portid: AtomicU16::new(1),
            genctr: AtomicU64::new(1),
            setup_timeout_ms: AtomicU64::new(SETUP_TIMEOUT.as_millis() as u64),
            pdu_timeout_ms: AtomicU64::new(PDU_TIMEOUT.as_millis() as u64),
            stop: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&inner);
        let reaper = std::thread::Builder::new()
            .name("nvmf-keepalive".into())
            .spawn(move || keep_alive_reaper(weak))
            .ok();
        Arc::new(NvmfTarget {
            inner,
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
        validate_nqn(nqn).map_err(NvmfError::InvalidNqn)?;
        if nqn == DISCOVERY_NQN {
            return Err(NvmfError::Discovery);
        }
        check_ascii("serial number", serial, 20)?;
        check_ascii("model number", model, 40)?;
        let mut subs = lock(&self.inner.subsystems);
        if subs.contains_key(nqn) {
            return Err(NvmfError::SubsystemExists(nqn.into()));
        }
        let s = Subsystem::new(nqn, serial, model, allow_any_host);
        subs.insert(nqn.to_string(), s);
        self.inner.bump_genctr();
        info!(nqn, "nvmf subsystem created");
        Ok(())
    }

    /// Delete a subsystem: its controllers are torn down and its listeners released.
    pub fn delete_subsystem(&self, nqn: &str) -> Result<(), NvmfError> {
        if nqn == DISCOVERY_NQN {
            return Err(NvmfError::Discovery);
        }
        let s = lock(&self.inner.subsystems)
            .remove(nqn)
            .ok_or_else(|| NvmfError::NoSuchSubsystem(nqn.into()))?;
        s.teardown_all();
        let addrs: Vec<SocketAddr> = lock(&s.state).listeners.iter().copied().collect();
        for a in addrs {
            self.inner.release_listener(a, nqn);
        }
        self.inner.bump_genctr();
        info!(nqn, "nvmf subsystem deleted");
        Ok(())
    }

    fn subsystem(&self, nqn: &str) -> Result<Arc<Subsystem>, NvmfError> {
        if nqn == DISCOVERY_NQN {
            return Err(NvmfError::Discovery);
        }
        lock(&self.inner.subsystems)
            .get(nqn)
            .cloned()
            .ok_or_else(|| NvmfError::NoSuchSubsystem(nqn.into()))
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
        let s = self.subsystem(nqn)?;
        let id = s.add_namespace(nsid, volume, nguid, name)?;
        info!(nqn, nsid = id, "nvmf namespace added");
        Ok(id)
    }

    pub fn remove_namespace(&self, nqn: &str, nsid: u32) -> Result<(), NvmfError> {
        let s = self.subsystem(nqn)?;
        s.remove_namespace(nsid)?;
        info!(nqn, nsid, "nvmf namespace removed");
        Ok(())
    }

    /// Make the subsystem reachable on `addr`, starting a listener there unless one is
    /// already running (listeners are shared by subsystems). Port 0 picks a free port; the
    /// address actually bound is returned and is the one to pass to `remove_listener`.
    pub fn add_listener(&self, nqn: &str, addr: SocketAddr) -> Result<SocketAddr, NvmfError> {
        let s = self.subsystem(nqn)?;
        let bound = self.inner.acquire_listener(addr, nqn)?;
        lock(&s.state).listeners.insert(bound);
        self.inner.bump_genctr();
        info!(nqn, %bound, "nvmf listener added");
        Ok(bound)
    }

    pub fn remove_listener(&self, nqn: &str, addr: SocketAddr) -> Result<(), NvmfError> {
        let s = self.subsystem(nqn)?;
        if !lock(&s.state).listeners.remove(&addr) {
            return Err(NvmfError::NoSuchListener(addr));
        }
        self.inner.release_listener(addr, nqn);
        self.inner.bump_genctr();
        Ok(())
    }

    /// Allow `hostnqn` to connect.
    pub fn add_host(&self, nqn: &str, hostnqn: &str) -> Result<(), NvmfError> {
        validate_nqn(hostnqn).map_err(NvmfError::InvalidNqn)?;
        let s = self.subsystem(nqn)?;
        lock(&s.state).hosts.insert(hostnqn.to_string());
        self.inner.bump_genctr();
        Ok(())
    }

    pub fn remove_host(&self, nqn: &str, hostnqn: &str) -> Result<(), NvmfError> {
        let s = self.subsystem(nqn)?;
        lock(&s.state).hosts.remove(hostnqn);
        self.inner.bump_genctr();
        Ok(())
    }

    pub fn set_allow_any_host(&self, nqn: &str, allow: bool) -> Result<(), NvmfError> {
        let s = self.subsystem(nqn)?;
        lock(&s.state).allow_any_host = allow;
        self.inner.bump_genctr();
        Ok(())
    }

    /// Every subsystem, the discovery subsystem first.
    pub fn subsystems(&self) -> Vec<NvmfSubsystemInfo> {
        let subs: Vec<Arc<Subsystem>> = lock(&self.inner.subsystems).values().cloned().collect();
        let mut out = vec![self.inner.discovery.info()];
        out.extend(subs.iter().map(|s| s.info()));
        out
    }

    /// Addresses currently listened on.
    pub fn listeners(&self) -> Vec<SocketAddr> {
        lock(&self.inner.listeners).keys().copied().collect()
    }
}

fn check_ascii(what: &str, s: &str, max: usize) -> Result<(), NvmfError> {
    if s.len() > max || !s.bytes().all(|b| (0x20..0x7F).contains(&b)) {
        return Err(NvmfError::InvalidArgument(format!(
            "{what} {s:?} must be at most {max} printable ASCII characters"
        )));
    }
    Ok(())
}

impl Drop for NvmfTarget {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        let listeners: Vec<(SocketAddr, Listener)> = lock(&self.inner.listeners).drain().collect();
        for (_, l) in listeners {
            stop_listener(l);
        }
        for s in lock(&self.inner.subsystems).values() {
            s.teardown_all();
        }
        self.inner.discovery.teardown_all();
        // Each reactor closes its connections as it stops.
        self.inner.reactors.stop();
        if let Some(h) = lock(&self.reaper).take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

impl TargetInner {
    pub(crate) fn bump_genctr(&self) {
        self.genctr.fetch_add(1, Ordering::Relaxed);
    }

    /// A CNTLID for a new controller, unique among the controllers that exist: once the
    /// counter has wrapped (a daemon that has seen 65,519 controllers, e.g. a host
    /// reconnecting every few minutes for months), the ids of live ones are skipped, or two
    /// controllers of a subsystem would share one and an I/O queue's Connect could join the
    /// wrong one.
    pub(crate) fn alloc_cntlid(&self) -> u16 {
        let mut subsystems = self.all_subsystems();
        subsystems.push(self.discovery.clone());
        next_free_id(&self.next_cntlid, CNTLIDS, |id| {
            subsystems.iter().any(|s| s.controller(id).is_some())
        })
    }

    pub(crate) fn find_subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        if nqn == DISCOVERY_NQN {
            return Some(self.discovery.clone());
        }
        lock(&self.subsystems).get(nqn).cloned()
    }

    pub(crate) fn all_subsystems(&self) -> Vec<Arc<Subsystem>> {
        lock(&self.subsystems).values().cloned().collect()
    }

    /// Count a connected queue against its host NQN's cap; false if the host is at it.
    pub(crate) fn acquire_host_queue(&self, hostnqn: &str) -> bool {
        let cap = lock(&self.limits).per_host;
        let mut m = lock(&self.host_queues);
        let n = m.entry(hostnqn.to_string()).or_insert(0);
        if *n >= cap {
            return false;
        }
        *n += 1;
        true
    }

    pub(crate) fn release_host_queue(&self, hostnqn: &str) {
        let mut m = lock(&self.host_queues);
        if let Some(n) = m.get_mut(hostnqn) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(hostnqn);
            }
        }
    }

    /// Hand an asynchronous event completion to the queue's reactor (it never blocks on
    /// the host's socket); false if the queue is gone or the target is stopping.
    pub(crate) fn post_async(&self, r: AsyncReply) -> bool {
        if self.stop.load(Ordering::SeqCst) {
            return false;
        }
        let Some(q) = r.queue.upgrade() else {
            return false;
        };
        q.complete_async(r.cid, nacre_shared::nvme::Status::SUCCESS, r.dw0);
        true
    }
}

/// The next id from the counter `next` within `ids` that `in_use` does not claim; the
/// counter wraps around to `ids.start`. Should every id be in use, the next one is returned
/// after one full round. CNTLIDs take 1..=FFEFh (FFF0h-FFFFh are reserved; FFFFh in a
/// Connect asks for a dynamic controller), and the connection limits (1,024 connections per
/// listener by default) keep controllers far fewer than that; listeners' PORTIDs take
/// 1..=7FFFh (`listener.rs`).
pub(super) fn next_free_id(
    next: &AtomicU16,
    ids: std::ops::Range<u16>,
    in_use: impl Fn(u16) -> bool,
) -> u16 {
    let bump = || loop {
        let id = next.fetch_add(1, Ordering::Relaxed);
        if ids.contains(&id) {
            return id;
        }
        next.store(ids.start, Ordering::Relaxed);
    };
    (ids.start..ids.end)
        .map(|_| bump())
        .find(|&id| !in_use(id))
        .unwrap_or_else(bump)
}

/// Valid CNTLIDs (see [`next_free_id`]).
const CNTLIDS: std::ops::Range<u16> = 1..0xFFF0;

/// Tears down controllers whose Keep Alive Timeout expired without any command on any of
/// their queues (NVMe Base 2.0 §3.9: the host must send Keep Alive — or, for us, any
/// command — at least every KATO).
fn keep_alive_reaper(t: Weak<TargetInner>) {
    loop {
        std::thread::park_timeout(Duration::from_millis(100));
        let Some(target) = t.upgrade() else { return };
        if target.stop.load(Ordering::SeqCst) {
            return;
        }
        let now = target.clock.now_ms();
        let mut subs = target.all_subsystems();
        subs.push(target.discovery.clone());
        for s in subs {
            for c in s.controllers() {
                if c.keep_alive_expired(now) {
                    warn!(
                        nqn = s.nqn(),
                        cntlid = c.cntlid,
                        "keep alive timeout expired: tearing the controller down"
                    );
                    s.remove_controller(c.cntlid);
                    c.teardown();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn cntlids_count_up_wrap_past_the_reserved_range_and_skip_live_controllers() {
        let next = AtomicU16::new(1);
        let none = |_| false;
        assert_eq!(
            [0; 3].map(|_| next_free_id(&next, CNTLIDS, none)),
            [1, 2, 3]
        );
        // FFF0h-FFFFh are reserved, and 0 is not a CNTLID.
        next.store(0xFFEF, Ordering::Relaxed);
        assert_eq!(next_free_id(&next, CNTLIDS, none), 0xFFEF);
        assert_eq!(next_free_id(&next, CNTLIDS, none), 1);
        // After the wrap, ids of controllers that still exist are passed over.
        let live: BTreeSet<u16> = [2, 3, 5].into();
        next.store(2, Ordering::Relaxed);
        let in_use = |id| live.contains(&id);
        assert_eq!(next_free_id(&next, CNTLIDS, in_use), 4);
        assert_eq!(next_free_id(&next, CNTLIDS, in_use), 6);
        // Every id taken: one full round, then an answer rather than a hang.
        let id = next_free_id(&next, CNTLIDS, |_| true);
        assert!((1..0xFFF0).contains(&id));
    }
}
