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

mod command;
mod conn;
pub(crate) mod ctrl;
pub(crate) mod fabrics;
mod pdu;
mod reactor;
pub(crate) mod subsystem;
mod transfer;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nacre_shared::api::nvmf::NvmfSubsystemInfo;
use nacre_shared::nvme::{validate_nqn, DISCOVERY_NQN};
use thiserror::Error;
use tracing::{debug, info, warn};

use crate::volume::BlockDevice;

pub use reactor::{
    poll_policy, set_default_reactors, set_poll_policy, PollPolicy, ReactorStats,
    MAX_DEFAULT_REACTORS,
};
pub use subsystem::{Namespace, Subsystem};

/// Limits nacre advertises (and enforces).
pub mod limits {
    /// CAP.MQES + 1: the largest I/O queue a host may create.
    pub const MAX_QUEUE_ENTRIES: u32 = 1024;
    /// Largest admin queue (Linux uses 32).
    pub const MAX_ADMIN_QUEUE_ENTRIES: u32 = 1024;
    /// I/O queues a controller grants (Set Features Number of Queues).
    pub const MAX_IO_QUEUES: u16 = 128;
    /// In-capsule data accepted on I/O queues: IOCCSZ = (64 + this) / 16.
    pub const IO_INLINE_DATA: usize = 8192;
    /// The admin queue always accepts 8 KiB in capsule: Linux sends up to
    /// NVME_TCP_ADMIN_CCSZ there regardless of IOCCSZ.
    pub const ADMIN_INLINE_DATA: usize = 8192;
    /// MDTS = 5: 2^5 × 4 KiB = 128 KiB per command.
    pub const MDTS: u8 = 5;
    pub const MAX_TRANSFER: usize = 4096 << MDTS;
    /// ICResp MAXH2CDATA: one H2CData PDU may carry a whole command's data.
    pub const MAX_H2C_DATA: u32 = MAX_TRANSFER as u32;
    /// Largest NSID (Identify Controller NN).
    pub const MAX_NSID: u32 = 1024;
    /// AERL + 1: outstanding Asynchronous Event Requests per controller.
    pub const MAX_AERS: usize = 4;
    /// Keep Alive Support granularity: 1 s (KAS in 100 ms units).
    pub const KAS_100MS: u16 = 10;
    /// CAP.TO: CSTS.RDY follows CC.EN at once; 15 s is the worst case we promise.
    pub const CAP_TO_500MS: u8 = 30;
    /// Bytes of host data one queue holds buffers for while waiting for it (R2Ts
    /// outstanding). Further writes wait for their R2T until earlier data has arrived
    /// (NVMe/TCP 1.0 §3.3.3 lets the controller choose when to send an R2T), so a host cannot
    /// pin queue entries × MDTS of target memory by announcing writes and never sending data.
    /// 16 × 128 KiB keeps a queue's pipe full on any link nacre serves.
    pub const R2T_BUDGET: usize = 16 * MAX_TRANSFER;
    /// Idle data buffers a queue keeps for reuse, in bytes (the rest are freed).
    pub const POOL_BYTES: usize = R2T_BUDGET;
}

/// How many connections peers may hold (the `--nvmf-max-*` flags of nacred).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections one listener serves at once, whatever their phase; further connections
    /// are closed as soon as they are accepted.
    pub per_listener: usize,
    /// Connections of one listener that have not completed a Fabrics Connect yet. When a new
    /// connection would exceed this, the oldest such connection is closed: a peer that opens
    /// connections and stays silent cannot lock hosts out, it only evicts its own.
    pub setup_per_listener: usize,
    /// Queues (connections with a successful Fabrics Connect) one host NQN may hold on the
    /// target; a Connect beyond it fails with Connect Controller Busy.
    pub per_host: usize,
}

impl ConnLimits {
    /// 1024 connections per listener, 64 of them setting up, 256 queues per host NQN (two
    /// controllers of 127 I/O queues each, or many smaller ones).
    pub const DEFAULT: ConnLimits = ConnLimits {
        per_listener: 1024,
        setup_per_listener: 64,
        per_host: 256,
    };
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits::DEFAULT
    }
}

/// Limits new targets start with: nacred sets them from its command line before the control
/// plane creates its target.
static DEFAULT_LIMITS: Mutex<ConnLimits> = Mutex::new(ConnLimits::DEFAULT);

/// Set the [`ConnLimits`] targets created from now on start with.
pub fn set_default_conn_limits(l: ConnLimits) {
    *lock(&DEFAULT_LIMITS) = l;
}

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

struct Listener {
    /// Port ID reported in discovery log entries.
    portid: u16,
    subsystems: BTreeSet<String>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// How a listener closes a connection that is still setting up when a newer one pushes it
/// over [`ConnLimits::setup_per_listener`] (TCP: shut the socket down; RDMA: stop the
/// queue's thread, which disconnects). Called without any lock held.
pub(crate) type Evict = Box<dyn FnOnce() + Send>;

/// What a listener's connections count against ([`ConnLimits`]). Transport-independent: the
/// TCP and the RDMA listeners admit through [`ListenerConns::admit`].
#[derive(Default)]
pub(crate) struct ListenerConns {
    live: std::sync::atomic::AtomicUsize,
    /// Connections not yet past Fabrics Connect, oldest first.
    setup: Mutex<std::collections::VecDeque<(u64, Evict)>>,
}

impl ListenerConns {
    /// Take a place for connection `id` under `limits`, or `None` when the listener already
    /// serves [`ConnLimits::per_listener`] connections (the caller closes or rejects it).
    /// The new connection counts as setting up; if that makes more than
    /// [`ConnLimits::setup_per_listener`], the oldest ones still setting up are evicted —
    /// a peer that opens connections and stays silent only evicts its own.
    pub(crate) fn admit(
        self: &Arc<Self>,
        id: u64,
        limits: &ConnLimits,
        evict: Option<Evict>,
    ) -> Option<ConnSlot> {
        // Check and take in one step: two listeners' threads never race here today, but
        // the count must not overshoot if one ever does.
        let taken = self
            .live
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < limits.per_listener).then_some(n + 1)
            });
        if taken.is_err() {
            return None;
        }
        let slot = ConnSlot {
            conns: self.clone(),
            id,
        };
        let evicted: Vec<Evict> = match evict {
            None => Vec::new(),
            Some(e) => {
                let mut setup = lock(&self.setup);
                setup.push_back((id, e));
                let over = setup.len().saturating_sub(limits.setup_per_listener.max(1));
                setup.drain(..over).map(|(_, e)| e).collect()
            }
        };
        for e in evicted {
            e();
        }
        Some(slot)
    }
}

/// One accepted connection's place in its listener's counts; given back on drop.
pub(crate) struct ConnSlot {
    conns: Arc<ListenerConns>,
    id: u64,
}

impl ConnSlot {
    /// The connection completed a Fabrics Connect: it no longer counts as setting up.
    pub(crate) fn connected(&self) {
        // The evict handle is dropped outside the lock (it may own a socket).
        let gone = {
            let mut setup = lock(&self.conns.setup);
            setup
                .iter()
                .position(|(id, _)| *id == self.id)
                .and_then(|i| setup.remove(i))
        };
        drop(gone);
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.connected();
        self.conns.live.fetch_sub(1, Ordering::SeqCst);
    }
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
        for (addr, l) in listeners {
            stop_listener(addr, l);
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

fn stop_listener(addr: SocketAddr, mut l: Listener) {
    l.stop.store(true, Ordering::SeqCst);
    // Wake the accept loop with a throw-away connection.
    let mut wake = addr;
    if wake.ip().is_unspecified() {
        wake.set_ip(if addr.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        });
    }
    let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
    if let Some(t) = l.thread.take() {
        let _ = t.join();
    }
}

impl TargetInner {
    pub(crate) fn bump_genctr(&self) {
        self.genctr.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn alloc_cntlid(&self) -> u16 {
        // CNTLIDs 1..=FFEFh are valid (FFF0h-FFFFh reserved); wrap around.
        loop {
            let id = self.next_cntlid.fetch_add(1, Ordering::Relaxed);
            if (1..0xFFF0).contains(&id) {
                return id;
            }
            self.next_cntlid.store(1, Ordering::Relaxed);
        }
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

    pub(crate) fn portid(&self, addr: &SocketAddr) -> u16 {
        lock(&self.listeners).get(addr).map_or(0, |l| l.portid)
    }

    fn acquire_listener(
        self: &Arc<Self>,
        addr: SocketAddr,
        nqn: &str,
    ) -> Result<SocketAddr, NvmfError> {
        let mut ls = lock(&self.listeners);
        if addr.port() != 0 {
            if let Some(l) = ls.get_mut(&addr) {
                l.subsystems.insert(nqn.to_string());
                return Ok(addr);
            }
        }
        let tl = TcpListener::bind(addr).map_err(|source| NvmfError::Listen { addr, source })?;
        let bound = tl
            .local_addr()
            .map_err(|source| NvmfError::Listen { addr, source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let weak = Arc::downgrade(self);
        let thread = std::thread::Builder::new()
            .name(format!("nvmf-listen-{}", bound.port()))
            .spawn(move || accept_loop(tl, bound, st, weak, Arc::default()))
            .map_err(|source| NvmfError::Listen { addr, source })?;
        let portid = ls.values().map(|l| l.portid).max().unwrap_or(0) + 1;
        ls.insert(
            bound,
            Listener {
                portid,
                subsystems: BTreeSet::from([nqn.to_string()]),
                stop,
                thread: Some(thread),
            },
        );
        Ok(bound)
    }

    fn release_listener(&self, addr: SocketAddr, nqn: &str) {
        let stopped = {
            let mut ls = lock(&self.listeners);
            let empty = match ls.get_mut(&addr) {
                Some(l) => {
                    l.subsystems.remove(nqn);
                    l.subsystems.is_empty()
                }
                None => false,
            };
            if empty {
                ls.remove(&addr)
            } else {
                None
            }
        };
        if let Some(l) = stopped {
            stop_listener(addr, l);
            info!(%addr, "nvmf listener stopped");
        }
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

fn accept_loop(
    tl: TcpListener,
    bound: SocketAddr,
    stop: Arc<AtomicBool>,
    t: Weak<TargetInner>,
    counts: Arc<ListenerConns>,
) {
    for s in tl.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Some(target) = t.upgrade() else { break };
        let stream = match s {
            Ok(s) => s,
            Err(e) => {
                warn!(%bound, "nvmf accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let limits = *lock(&target.limits);
        let id = target.next_conn.fetch_add(1, Ordering::Relaxed);
        let evict = stream.try_clone().ok().map(|c| -> Evict {
            Box::new(move || {
                // Its reactor sees the connection end and closes it.
                debug!("nvmf listener at its setup cap: closing the oldest connection still setting up");
                let _ = c.shutdown(std::net::Shutdown::Both);
            })
        });
        let Some(slot) = counts.admit(id, &limits, evict) else {
            // Dropping the stream closes it: the peer sees the connection end at once.
            debug!(%bound, "nvmf listener at its connection cap: closing a new connection");
            continue;
        };
        let _ = stream.set_nodelay(true);
        target.reactors.assign(reactor::NewConn {
            target: target.clone(),
            sock: stream,
            listener: bound,
            slot,
        });
    }
}

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

impl NvmfTarget {
    /// Serve one already-connected stream on the calling thread (a reactor of its own) until
    /// it ends, as if `listener` had accepted it (the fuzz targets' way in:
    /// dpu/src/fuzzing.rs).
    #[doc(hidden)]
    pub fn serve_stream(&self, sock: TcpStream, listener: SocketAddr) {
        // A listener of its own, holding just this connection: the caps do not apply.
        let Some(slot) = Arc::new(ListenerConns::default()).admit(0, &ConnLimits::DEFAULT, None)
        else {
            return;
        };
        reactor::serve_here(reactor::NewConn {
            target: self.inner.clone(),
            sock,
            listener,
            slot,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// An evict handle that records in `log` which connection (by its id) was evicted.
    fn evict(log: &Arc<Mutex<Vec<u64>>>, id: u64) -> Option<Evict> {
        let log = log.clone();
        Some(Box::new(move || lock(&log).push(id)))
    }

    #[test]
    fn listener_caps_evict_the_oldest_setup_and_refuse_past_the_cap() {
        let limits = ConnLimits {
            per_listener: 3,
            setup_per_listener: 2,
            per_host: 256,
        };
        let conns = Arc::new(ListenerConns::default());
        let log = Arc::new(Mutex::new(Vec::new()));
        let a = conns.admit(1, &limits, evict(&log, 1)).unwrap();
        let b = conns.admit(2, &limits, evict(&log, 2)).unwrap();
        assert!(lock(&log).is_empty());
        // A third silent connection pushes the oldest one still setting up out.
        let c = conns.admit(3, &limits, evict(&log, 3)).unwrap();
        assert_eq!(*lock(&log), vec![1]);
        // The listener is full whatever the phase of its connections.
        assert_eq!(conns.live.load(Ordering::SeqCst), 3);
        assert!(conns.admit(4, &limits, evict(&log, 4)).is_none());
        assert_eq!(conns.live.load(Ordering::SeqCst), 3);
        // A connection past Connect is never evicted.
        b.connected();
        drop(a);
        let d = conns.admit(5, &limits, evict(&log, 5)).unwrap();
        drop(c);
        let e = conns.admit(6, &limits, evict(&log, 6)).unwrap();
        assert_eq!(
            *lock(&log),
            vec![1],
            "only setting-up connections are evicted"
        );
        let f = conns.admit(7, &limits, evict(&log, 7));
        assert!(f.is_none(), "b, d and e fill the listener");
        drop((b, d, e));
        assert_eq!(conns.live.load(Ordering::SeqCst), 0);
        assert!(lock(&conns.setup).is_empty());
    }

    #[test]
    fn a_connected_slot_drops_its_evict_handle() {
        let conns = Arc::new(ListenerConns::default());
        let drops = Arc::new(AtomicUsize::new(0));
        struct Guard(Arc<AtomicUsize>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let g = Guard(drops.clone());
        let s = conns
            .admit(1, &ConnLimits::DEFAULT, Some(Box::new(move || drop(g))))
            .unwrap();
        s.connected();
        // The handle (for TCP, a clone of the socket) is released at Connect, not kept for
        // the connection's life.
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        drop(s);
        assert_eq!(conns.live.load(Ordering::SeqCst), 0);
    }
}
