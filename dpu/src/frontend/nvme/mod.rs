//! The NVMe target core, whatever transport carries its queues (NVMe Base 2.0 §3, NVMe-oF
//! 1.1 §3 and §5): subsystems and namespaces, controllers with their admin commands,
//! features, log pages and asynchronous events, the Fabrics Connect and Property commands,
//! admission and limits. The transports are modules of their own that use this one and
//! never each other:
//!
//! ```text
//!   nvmf_tcp (NvmfTarget:        nvmf_rdma (RdmaPorts)    nvme_pcie (vfio-user
//!   TCP listeners, reactors)            │                 PCIe controllers)
//!          │                            │                        │
//!          └────────────────────────────┼────────────────────────┘
//!                                       │   queues implement ctrl::CtrlQueue
//!   nvme (this module): TargetInner ─ the target: subsystems, CNTLIDs, PORTIDs,
//!          │                         keep-alive, host queue caps, management operations
//!          ├─ fabrics    Connect (NVMe-oF 1.1 §3.3), Property Get/Set, I/O error statuses
//!          ├─ io         the NVM command set's I/O commands: what each becomes at the volumes
//!          ├─ ctrl       a controller: properties, admin commands, features, log pages,
//!          │             asynchronous events, keep-alive
//!          ├─ subsystem  subsystems, namespaces, the discovery log page
//!          ├─ admission  connection limits and what a listener's connections count against
//!          └─ limits     what nacre advertises to hosts and enforces
//!          │
//!   crate::volume (BlockDevice), nacre_shared::nvme (wire layouts)
//! ```
//!
//! A transport owns how bytes reach a queue (sockets, verbs) and serves its queues; it asks
//! this module for everything a controller decides. The test at the end of this file holds
//! the core's files to that direction: none of them names a transport module.
//!
//! The I/O command set is decided here too ([`io::plan`]): which volume requests a command
//! becomes and in which order, so every transport serves the same NVM commands with the same
//! statuses and none of them waits on a volume from its queue thread. A transport checks its
//! own data pointers (NVMe/TCP and RDMA SGLs, PCIe PRPs) and moves the bytes. The fabrics
//! helpers the fabric transports share ([`fabrics::QueueRules`]) live here as well; a second
//! test below holds the transports to that split.

pub(crate) mod admission;
pub(crate) mod ctrl;
pub(crate) mod fabrics;
pub(crate) mod io;
pub mod limits;
pub(crate) mod subsystem;

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

pub use admission::ConnLimits;
pub(crate) use admission::{ConnSlot, Evict, ListenerConns};
pub use subsystem::{HostKeys, Namespace, Subsystem, AUTH_DHGROUPS, AUTH_HASHES};

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

/// Default for `NvmfTarget::set_setup_timeout`.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Default for `NvmfTarget::set_pdu_timeout`: the largest PDU nacre accepts (128 KiB plus
/// headers) moves in well under a second even on a slow link.
pub const PDU_TIMEOUT: Duration = Duration::from_secs(30);

/// The target's shared state, which every transport's queues serve: subsystems, the
/// discovery subsystem, id counters, connection limits and timeouts.
pub(crate) struct TargetInner {
    pub(crate) clock: Clock,
    subsystems: Mutex<BTreeMap<String, Arc<Subsystem>>>,
    pub(crate) discovery: Arc<Subsystem>,
    pub(crate) limits: Mutex<ConnLimits>,
    /// Connected queues per host NQN (for [`ConnLimits::per_host`]).
    host_queues: Mutex<HashMap<String, usize>>,
    pub(crate) next_conn: AtomicU64,
    next_cntlid: AtomicU16,
    /// The next TCP listener's PORTID (see [`TargetInner::alloc_portid`]).
    next_portid: AtomicU16,
    /// PORTIDs of the TCP listeners, for discovery log entries.
    portids: Mutex<HashMap<SocketAddr, u16>>,
    /// Discovery log generation counter (GENCTR).
    pub(crate) genctr: AtomicU64,
    /// Milliseconds a new connection may take to set up (`NvmfTarget::set_setup_timeout`).
    pub(crate) setup_timeout_ms: AtomicU64,
    /// Milliseconds the rest of a PDU may take once part of it has arrived
    /// (`NvmfTarget::set_pdu_timeout`).
    pub(crate) pdu_timeout_ms: AtomicU64,
    pub(crate) stop: AtomicBool,
}

/// A completion raised by the control plane (asynchronous events); the queue's transport
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

impl TargetInner {
    /// A target with no subsystem but discovery, and its keep-alive reaper thread (which
    /// ends once `stop` is set and the thread is unparked, or the target is dropped).
    pub(crate) fn start() -> (Arc<TargetInner>, Option<JoinHandle<()>>) {
        let inner = Arc::new(TargetInner {
            clock: Clock(Instant::now()),
            subsystems: Mutex::new(BTreeMap::new()),
            discovery: Subsystem::new_discovery(),
            limits: Mutex::new(ConnLimits::DEFAULT),
            host_queues: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            next_cntlid: AtomicU16::new(1),
            next_portid: AtomicU16::new(1),
            portids: Mutex::new(HashMap::new()),
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
        (inner, reaper)
    }

    /// Create an NVM subsystem. `serial` at most 20 and `model` at most 40 printable ASCII
    /// characters (Identify Controller fields).
    pub(crate) fn create_subsystem(
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
        let mut subs = lock(&self.subsystems);
        if subs.contains_key(nqn) {
            return Err(NvmfError::SubsystemExists(nqn.into()));
        }
        let s = Subsystem::new(nqn, serial, model, allow_any_host);
        subs.insert(nqn.to_string(), s);
        self.bump_genctr();
        info!(nqn, "nvmf subsystem created");
        Ok(())
    }

    /// Remove a subsystem and tear its controllers down; the caller releases its listeners.
    pub(crate) fn remove_subsystem(&self, nqn: &str) -> Result<Arc<Subsystem>, NvmfError> {
        if nqn == DISCOVERY_NQN {
            return Err(NvmfError::Discovery);
        }
        let s = lock(&self.subsystems)
            .remove(nqn)
            .ok_or_else(|| NvmfError::NoSuchSubsystem(nqn.into()))?;
        s.teardown_all();
        self.bump_genctr();
        Ok(s)
    }

    /// A subsystem the management API may change (not discovery).
    pub(crate) fn subsystem(&self, nqn: &str) -> Result<Arc<Subsystem>, NvmfError> {
        if nqn == DISCOVERY_NQN {
            return Err(NvmfError::Discovery);
        }
        lock(&self.subsystems)
            .get(nqn)
            .cloned()
            .ok_or_else(|| NvmfError::NoSuchSubsystem(nqn.into()))
    }

    /// Attach `volume` as namespace `nsid` (default: the lowest free NSID); connected
    /// controllers get a Namespace Attribute Changed event. Returns the NSID.
    pub(crate) fn add_namespace(
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

    pub(crate) fn remove_namespace(&self, nqn: &str, nsid: u32) -> Result<(), NvmfError> {
        let s = self.subsystem(nqn)?;
        s.remove_namespace(nsid)?;
        info!(nqn, nsid, "nvmf namespace removed");
        Ok(())
    }

    pub(crate) fn add_host(&self, nqn: &str, hostnqn: &str) -> Result<(), NvmfError> {
        validate_nqn(hostnqn).map_err(NvmfError::InvalidNqn)?;
        let s = self.subsystem(nqn)?;
        lock(&s.state).hosts.insert(hostnqn.to_string());
        self.bump_genctr();
        Ok(())
    }

    /// Require DH-HMAC-CHAP of `hostnqn`'s new queues in subsystem `nqn` (`None`: no
    /// longer). Queues connected already keep the state they authenticated in.
    pub(crate) fn set_host_keys(
        &self,
        nqn: &str,
        hostnqn: &str,
        keys: Option<HostKeys>,
    ) -> Result<(), NvmfError> {
        validate_nqn(hostnqn).map_err(NvmfError::InvalidNqn)?;
        let s = self.subsystem(nqn)?;
        let mut st = lock(&s.state);
        match keys {
            Some(k) => st.host_keys.insert(hostnqn.to_string(), k),
            None => st.host_keys.remove(hostnqn),
        };
        Ok(())
    }

    pub(crate) fn remove_host(&self, nqn: &str, hostnqn: &str) -> Result<(), NvmfError> {
        let s = self.subsystem(nqn)?;
        let mut st = lock(&s.state);
        st.hosts.remove(hostnqn);
        st.host_keys.remove(hostnqn);
        drop(st);
        self.bump_genctr();
        Ok(())
    }

    pub(crate) fn set_allow_any_host(&self, nqn: &str, allow: bool) -> Result<(), NvmfError> {
        let s = self.subsystem(nqn)?;
        lock(&s.state).allow_any_host = allow;
        self.bump_genctr();
        Ok(())
    }

    /// Every subsystem, the discovery subsystem first.
    pub(crate) fn subsystem_infos(&self) -> Vec<NvmfSubsystemInfo> {
        let subs = self.all_subsystems();
        let mut out = vec![self.discovery.info()];
        out.extend(subs.iter().map(|s| s.info()));
        out
    }

    /// Tear every controller down (the target is stopping).
    pub(crate) fn teardown_all(&self) {
        self.stop.store(true, Ordering::SeqCst);
        for s in lock(&self.subsystems).values() {
            s.teardown_all();
        }
        self.discovery.teardown_all();
    }

    /// A PORTID for a new TCP listener on `addr`. A PORTID names one port for as long as
    /// the target runs: a removed listener's id is not given to another address (a host may
    /// have cached the discovery log that showed it). TCP ports take 1..=7FFFh; RDMA ones
    /// are numbered from 8000h (`subsystem::discovery_log`).
    pub(crate) fn alloc_portid(&self, addr: SocketAddr) -> u16 {
        let mut ids = lock(&self.portids);
        let id = next_free_id(&self.next_portid, 1..0x8000, |id| {
            ids.values().any(|&p| p == id)
        });
        ids.insert(addr, id);
        id
    }

    pub(crate) fn free_portid(&self, addr: &SocketAddr) {
        lock(&self.portids).remove(addr);
    }

    /// The PORTID of the TCP listener on `addr` (0: none).
    pub(crate) fn portid(&self, addr: &SocketAddr) -> u16 {
        lock(&self.portids).get(addr).copied().unwrap_or(0)
    }

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
/// 1..=7FFFh (the TCP transport's listeners).
pub(crate) fn next_free_id(
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

#[cfg(test)]
mod dependencies {
    /// The core's files, which must not name a transport.
    const CORE: &[(&str, &str)] = &[
        ("mod.rs", include_str!("mod.rs")),
        ("admission.rs", include_str!("admission.rs")),
        ("ctrl.rs", include_str!("ctrl.rs")),
        ("fabrics.rs", include_str!("fabrics.rs")),
        ("io.rs", include_str!("io.rs")),
        ("limits.rs", include_str!("limits.rs")),
        ("subsystem.rs", include_str!("subsystem.rs")),
    ];

    #[test]
    fn the_core_uses_no_transport() {
        for (file, src) in CORE {
            let code = src.split("mod dependencies").next().unwrap_or_default();
            for line in code.lines().map(str::trim) {
                if line.starts_with("//") {
                    continue;
                }
                for t in ["nvmf_tcp", "nvmf_rdma", "nvme_pcie", "super::super"] {
                    assert!(!line.contains(t), "nvme/{file} names {t}: {line}");
                }
            }
        }
        // Every module of the core is in the table.
        let declared = include_str!("mod.rs")
            .lines()
            .filter(|l| l.starts_with("pub mod ") || l.starts_with("pub(crate) mod "))
            .count();
        assert_eq!(declared + 1, CORE.len());
    }

    /// The transports' files that serve I/O queues.
    const TRANSPORT: &[(&str, &str)] = &[
        (
            "nvmf_tcp/command.rs",
            include_str!("../nvmf_tcp/command.rs"),
        ),
        ("nvmf_rdma/conn.rs", include_str!("../nvmf_rdma/conn.rs")),
        ("nvmf_rdma/queue.rs", include_str!("../nvmf_rdma/queue.rs")),
        ("nvme_pcie/ctrl.rs", include_str!("../nvme_pcie/ctrl.rs")),
        ("nvme_pcie/queue.rs", include_str!("../nvme_pcie/queue.rs")),
    ];

    /// What an I/O command does is decided in `io` only: a transport that names an I/O
    /// command's semantics (a Flush, a Force Unit Access, a Deallocate's ranges) or waits
    /// on a volume from its queue has grown its own copy again.
    #[test]
    fn io_commands_are_decided_once() {
        for (file, src) in TRANSPORT {
            let code = src.split("#[cfg(test)]").next().unwrap_or_default();
            for line in code.lines().map(str::trim) {
                if line.starts_with("//") {
                    continue;
                }
                for t in [
                    "io_opcode::READ",
                    "io_opcode::FLUSH",
                    "io_opcode::WRITE_ZEROES",
                    "DatasetManagement",
                    "IoKind::Discard",
                    ".fua()",
                    "NSID_ALL",
                ] {
                    assert!(
                        !line.contains(t),
                        "{file} decides an I/O command ({t}): {line}"
                    );
                }
            }
        }
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
