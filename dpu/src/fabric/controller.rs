//! One NVMe-oF controller association over TCP, and its life across connection failures.
//!
//! ## Bringing a controller up (NVMe-oF 1.1 §3.3, NVMe Base 2.0 §3.5.1)
//! Admin queue Connect (dynamic controller, KATO) → Property Get CAP → Property Set CC
//! (EN, 64-byte SQEs, 16-byte CQEs) → poll CSTS.RDY within CAP.TO → Identify Controller →
//! Set Features Number of Queues → Identify active namespace list, each namespace and its
//! identification descriptors (NGUID/UUID/EUI-64) → Connect each I/O queue with the CNTLID.
//!
//! ## Losing it, and the knobs SPDK users know
//! A *session* is one association: the admin queue and the I/O queues. Any queue failing
//! (transport error, protocol violation, keep-alive timeout) ends the whole session — its
//! other queues are shut down at once — and the controller goes to `Connecting`:
//! * Outstanding and new I/O is **held**, not failed. The commands have not been completed
//!   to anyone, and a held command is resent on the next session as if new.
//! * Reconnection is tried at once (after the controller's Command Quiesce Time, CQT), then
//!   every `reconnect_delay`.
//! * After `fast_io_fail_timeout` held I/O fails with [`IoError::PathLost`] and new I/O fails
//!   at once, while reconnection goes on.
//! * After `ctrl_loss_timeout` the controller is `Failed`: every I/O fails with `PathLost`,
//!   reconnection stops. `None` means retry forever; zero means fail on the first loss.
//!
//! ## Why resending an unacknowledged write is safe
//! A block device promises nothing about the order of writes that are in flight together: a
//! submitter that needs one write to land before another waits for the first completion
//! before issuing the second (that is what filesystems and databases do; virtio-blk and NVMe
//! give no other guarantee). A write that was never completed to the submitter may thus
//! land once, twice or — if the connection died before the target saw it — not at all before
//! the resend; each outcome leaves the range holding the data of that one write, which is
//! what the submitter asked for. The danger is the *old* copy landing late, after the resend
//! completed and the submitter issued a newer write to the same blocks (SPDK #3593 is what
//! ignoring it costs). So the old session's sockets are shut down before anything is resent,
//! and nothing it sent is resent — on a new session or, for multipath, on another path —
//! before `quiesce_time` has passed since the loss, or the controller's Command Quiesce Time
//! (Identify Controller bytes 386-387) if that is longer: the bound the spec gives for a
//! controller to stop processing commands of a lost association. Commands that never went
//! out need no such wait.
//!
//! ## Keep-alive (NVMe Base 2.0 §3.9)
//! A Keep Alive command goes out every KATO/2 on the admin queue; if one has not completed
//! within KATO, the session is declared dead. This is also what catches a controller that
//! stalls without closing the connection.
//!
//! ## Teardown
//! Closing never waits on the network for long: a live controller gets a normal shutdown
//! notification (CC.SHN) bounded by `shutdown_timeout`, then every socket is shut down and the
//! reader threads hand back what was outstanding, which fails with `PathLost`.

use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use nacre_shared::nvme::fabrics::{ConnectData, Property, CNTLID_DYNAMIC};
use nacre_shared::nvme::identify::{self, cns, nidt, IdentifyController, IdentifyNamespace};
use nacre_shared::nvme::registers::{self, cc, csts};
use nacre_shared::nvme::{admin_opcode, get_u16, Command, Completion as Cqe};
use nacre_shared::nvme_tcp::Digests;
use tracing::{info, warn};

use super::cmd::{AdminWait, Cmd, Dir, Target};
use super::tcp::{QueueConn, QueueOwner, QueueParams, MAX_DEPTH};
use super::FabricError;
use crate::volume::IoError;

/// Admin queue depth (commands in flight; the SQ has one entry more: 32 like Linux).
const ADMIN_DEPTH: u16 = 31;
/// Feature Identifier: Number of Queues (NVMe Base 2.0 §5.27.1.5).
const FID_NUMBER_OF_QUEUES: u32 = 0x07;
/// The largest transfer nacre puts in one command, whatever MDTS allows.
pub const MAX_TRANSFER: usize = 1 << 20;
/// What nacre assumes before the first Identify Controller (SPDK's default).
const DEFAULT_TRANSFER: usize = 128 << 10;

/// How to reach a controller and what to do when it goes away.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Host name or IP address of the portal.
    pub address: String,
    pub port: u16,
    pub subnqn: String,
    pub hostnqn: String,
    /// Host Identifier (Connect data bytes 0-15); the same for every association of a host.
    pub hostid: [u8; 16],
    /// I/O queues to ask for (the controller may grant fewer).
    pub io_queues: u16,
    /// Commands in flight per I/O queue (capped by CAP.MQES).
    pub queue_depth: u16,
    pub digests: Digests,
    /// Most write bytes sent inside the command capsule (capped by IOCCSZ); larger writes wait
    /// for R2T.
    pub in_capsule_data_size: usize,
    /// Keep Alive Timeout; zero disables keep-alive.
    pub keep_alive_timeout: Duration,
    pub reconnect_delay: Duration,
    /// `None`: reconnect forever.
    pub ctrl_loss_timeout: Option<Duration>,
    /// `None`: hold I/O until reconnection or controller loss.
    pub fast_io_fail_timeout: Option<Duration>,
    /// Bound on TCP connect and each initialisation step.
    pub connect_timeout: Duration,
    /// After a session is lost, how long before the commands it had sent may be resent on
    /// another session or path (at least the controller's Command Quiesce Time, CQT, when
    /// it reports one). A target may still execute commands it received on a connection the
    /// host already gave up on; resending a write before those are done lets the stale copy
    /// land after a newer write (module docs).
    pub quiesce_time: Duration,
    /// A command outstanding this long means the controller stopped processing I/O while
    /// still answering keep-alive: the session is reset and the command resent (Linux's
    /// `nvme_core.io_timeout`, SPDK's `timeout_us` with action reset). `None` disables it.
    pub io_timeout: Option<Duration>,
    /// Bound on the graceful shutdown at teardown.
    pub shutdown_timeout: Duration,
}

impl ControllerConfig {
    /// Defaults like SPDK's and Linux's: 4 queues of 128, no digests, 8 KiB in-capsule data,
    /// KATO 10 s, I/O timeout 30 s, reconnect every 2 s, give up after 30 s, no fast I/O
    /// failure.
    pub fn new(address: &str, port: u16, subnqn: &str, hostnqn: &str) -> Self {
        ControllerConfig {
            address: address.to_string(),
            port,
            subnqn: subnqn.to_string(),
            hostnqn: hostnqn.to_string(),
            hostid: *uuid::Uuid::new_v4().as_bytes(),
            io_queues: 4,
            queue_depth: 128,
            digests: Digests::NONE,
            in_capsule_data_size: 8192,
            keep_alive_timeout: Duration::from_secs(10),
            reconnect_delay: Duration::from_secs(2),
            ctrl_loss_timeout: Some(Duration::from_secs(30)),
            fast_io_fail_timeout: None,
            connect_timeout: Duration::from_secs(3),
            io_timeout: Some(Duration::from_secs(30)),
            quiesce_time: Duration::from_secs(1),
            shutdown_timeout: Duration::from_millis(500),
        }
    }

    pub fn socket_addr(&self) -> Result<SocketAddr, FabricError> {
        (self.address.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| FabricError::Connect(format!("cannot resolve {}: {e}", self.address)))?
            .next()
            .ok_or_else(|| FabricError::Connect(format!("{} has no address", self.address)))
    }
}

/// A namespace as the controller describes it; the identifiers are what multipath and
/// reconnection compare.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NamespaceInfo {
    pub nsid: u32,
    pub block_size: u32,
    pub blocks: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nguid: Option<[u8; 16]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<[u8; 16]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eui64: Option<[u8; 8]>,
}

impl NamespaceInfo {
    pub fn size(&self) -> u64 {
        self.blocks * self.block_size as u64
    }

    /// Whether any identifier is known.
    pub fn has_id(&self) -> bool {
        self.nguid.is_some() || self.uuid.is_some() || self.eui64.is_some()
    }

    /// The same namespace: every identifier both sides report agrees, and at least one is
    /// reported by both. Without identifiers two namespaces are never "the same".
    pub fn same_namespace(&self, o: &NamespaceInfo) -> bool {
        let mut common = false;
        macro_rules! cmp {
            ($f:ident) => {
                if let (Some(a), Some(b)) = (&self.$f, &o.$f) {
                    if a != b {
                        return false;
                    }
                    common = true;
                }
            };
        }
        cmp!(nguid);
        cmp!(uuid);
        cmp!(eui64);
        common
    }

    /// A printable identity: `nguid:<hex>`, else `uuid:<hex>`, else `eui64:<hex>`.
    pub fn id_string(&self) -> String {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        if let Some(g) = &self.nguid {
            format!("nguid:{}", hex(g))
        } else if let Some(u) = &self.uuid {
            format!("uuid:{}", hex(u))
        } else if let Some(e) = &self.eui64 {
            format!("eui64:{}", hex(e))
        } else {
            "none".into()
        }
    }
}

/// What Identify told us about a live controller.
#[derive(Debug, Clone, Default)]
pub struct ControllerInfo {
    pub cntlid: u16,
    pub model: String,
    pub serial: String,
    pub firmware: String,
    pub subnqn: String,
    pub max_transfer: usize,
    pub oncs: u16,
    /// Command Quiesce Time in milliseconds (0: not reported).
    pub cqt_ms: u16,
    /// I/O Queue Command Capsule Supported Size (16-byte units) and SGL Support.
    pub ioccsz: u32,
    pub sgls: u32,
    pub io_queues: u16,
    pub queue_depth: u16,
    pub namespaces: Vec<NamespaceInfo>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// No session: connecting for the first time or reconnecting.
    Connecting,
    Live,
    /// Gave up (controller loss timeout, or the namespaces changed identity).
    Failed,
    /// Closed by its owner.
    Closed,
}

/// A snapshot for `remote_list`.
#[derive(Debug, Clone)]
pub struct ControllerStatus {
    pub phase: Phase,
    pub info: Option<ControllerInfo>,
    pub last_error: Option<String>,
    /// Sessions lost (each one a reset of this controller only).
    pub resets: u64,
    /// Sessions established.
    pub connects: u64,
    pub held: usize,
    pub fail_fast: bool,
}

/// Told when a controller changes phase (multipath uses it to resubmit parked I/O).
pub trait PhaseListener: Send + Sync {
    fn phase_changed(&self);
}

struct Session {
    id: u64,
    admin: Arc<QueueConn>,
    io: Vec<Arc<QueueConn>>,
    rr: AtomicUsize,
    /// The keep-alive in flight and when it was sent.
    ka: Mutex<Option<(Instant, Arc<AdminWait>)>>,
}

impl Session {
    fn shutdown(&self) {
        self.admin.shutdown();
        for q in &self.io {
            q.shutdown();
        }
    }
    fn pick(&self) -> &Arc<QueueConn> {
        let i = self.rr.fetch_add(1, Ordering::Relaxed);
        &self.io[i % self.io.len()]
    }
}

struct St {
    phase: Phase,
    /// When the controller last lost its session (or started connecting).
    since: Instant,
    next_attempt: Instant,
    session: Option<Arc<Session>>,
    next_session: u64,
    held: VecDeque<Cmd>,
    fail_fast: bool,
    info: Option<ControllerInfo>,
    /// Namespaces this controller must keep presenting (from the first Identify or from
    /// persisted state): a reconnect that finds other identities fails the controller.
    expected: Option<Vec<NamespaceInfo>>,
    last_error: Option<String>,
    attempts: u64,
    resets: u64,
    connects: u64,
}

/// The shared core of a controller (namespaces hold it).
pub struct Ctrl {
    pub name: String,
    cfg: ControllerConfig,
    st: Mutex<St>,
    cv: Condvar,
    listeners: Mutex<Vec<Weak<dyn PhaseListener>>>,
    max_transfer: AtomicUsize,
    oncs: AtomicUsize,
    live: AtomicBool,
    /// Commands submitted to this controller (observability; multipath tests read it).
    pub submitted: AtomicU64,
}

/// The owner's handle: dropping it closes the controller.
pub struct Controller {
    core: Arc<Ctrl>,
}

impl Controller {
    /// Start a controller: connect in the background at once and keep it connected per the
    /// knobs. `expected` pins the namespaces' identities (replay of a persisted remote).
    pub fn start(
        name: &str,
        cfg: ControllerConfig,
        expected: Option<Vec<NamespaceInfo>>,
    ) -> Controller {
        let now = Instant::now();
        let core = Arc::new(Ctrl {
            name: name.to_string(),
            st: Mutex::new(St {
                phase: Phase::Connecting,
                since: now,
                next_attempt: now,
                session: None,
                next_session: 1,
                held: VecDeque::new(),
                fail_fast: false,
                info: None,
                expected,
                last_error: None,
                attempts: 0,
                resets: 0,
                connects: 0,
            }),
            cv: Condvar::new(),
            listeners: Mutex::new(Vec::new()),
            max_transfer: AtomicUsize::new(DEFAULT_TRANSFER),
            oncs: AtomicUsize::new(usize::MAX),
            live: AtomicBool::new(false),
            submitted: AtomicU64::new(0),
            cfg,
        });
        let c = core.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("nvmf-ctrl-{name}"))
            .spawn(move || c.supervise());
        if let Err(e) = spawned {
            let mut st = core.lock();
            st.phase = Phase::Failed;
            st.last_error = Some(format!("cannot start controller thread: {e}"));
        }
        Controller { core }
    }

    pub fn core(&self) -> &Arc<Ctrl> {
        &self.core
    }

    /// Wait until the first connection attempt has an outcome: Live, or the error of the
    /// first failed attempt.
    pub fn wait_first_attempt(&self, timeout: Duration) -> Result<ControllerInfo, FabricError> {
        let deadline = Instant::now() + timeout;
        let mut st = self.core.lock();
        loop {
            match st.phase {
                Phase::Live => return Ok(st.info.clone().unwrap_or_default()),
                Phase::Failed | Phase::Closed => {
                    return Err(FabricError::Failed(
                        st.last_error.clone().unwrap_or_else(|| "closed".into()),
                    ))
                }
                Phase::Connecting if st.attempts > 0 => {
                    return Err(FabricError::Connect(
                        st.last_error.clone().unwrap_or_else(|| "unknown".into()),
                    ))
                }
                Phase::Connecting => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(FabricError::Timeout("first connection attempt".into()));
            }
            st = self
                .core
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Close: bounded, never waits for a dead controller.
    pub fn close(&self) {
        self.core.close();
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.core.close();
    }
}

impl Ctrl {
    fn lock(&self) -> MutexGuard<'_, St> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn config(&self) -> &ControllerConfig {
        &self.cfg
    }

    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    pub fn max_transfer(&self) -> usize {
        self.max_transfer.load(Ordering::Relaxed)
    }

    /// ONCS of the controller (all bits set until it is known).
    pub fn oncs(&self) -> u16 {
        self.oncs.load(Ordering::Relaxed) as u16
    }

    pub fn phase(&self) -> Phase {
        self.lock().phase
    }

    /// Live, or reconnecting and still within fast_io_fail_timeout: I/O may yet succeed
    /// here, so a multipath layer with no live path waits for it.
    pub fn hopeful(&self) -> bool {
        let st = self.lock();
        match st.phase {
            Phase::Live => true,
            Phase::Connecting => !st.fail_fast,
            Phase::Failed | Phase::Closed => false,
        }
    }

    pub fn add_listener(&self, l: Weak<dyn PhaseListener>) {
        self.listeners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(l);
    }

    fn notify(&self) {
        self.cv.notify_all();
        let ls: Vec<_> = {
            let mut g = self.listeners.lock().unwrap_or_else(|p| p.into_inner());
            g.retain(|w| w.strong_count() > 0);
            g.iter().filter_map(|w| w.upgrade()).collect()
        };
        for l in ls {
            l.phase_changed();
        }
    }

    pub fn status(&self) -> ControllerStatus {
        let st = self.lock();
        ControllerStatus {
            phase: st.phase,
            info: st.info.clone(),
            last_error: st.last_error.clone(),
            resets: st.resets,
            connects: st.connects,
            held: st.held.len(),
            fail_fast: st.fail_fast,
        }
    }

    /// The namespaces known (from Identify, or pinned from persisted state).
    pub fn namespaces(&self) -> Vec<NamespaceInfo> {
        let st = self.lock();
        st.info
            .as_ref()
            .map(|i| i.namespaces.clone())
            .or_else(|| st.expected.clone())
            .unwrap_or_default()
    }

    /// Submit a block I/O command: to a live queue, or held, or failed per the knobs.
    pub fn submit_io(&self, cmd: Cmd) {
        self.submitted.fetch_add(1, Ordering::Relaxed);
        let mut cmd = cmd;
        loop {
            let st = self.lock();
            match st.phase {
                Phase::Live => {
                    let s = st.session.clone().expect("live has a session");
                    drop(st);
                    match s.pick().submit(cmd) {
                        Ok(()) => return,
                        // The queue just closed; the session is going down. Go round again:
                        // by the time the lock is ours the phase may have changed.
                        Err(c) => {
                            cmd = c;
                            std::thread::yield_now();
                            let st = self.lock();
                            if st.phase == Phase::Live
                                && st.session.as_ref().is_some_and(|x| x.id == s.id)
                            {
                                // Still the same session: hold until the reader reports it.
                                drop(st);
                                self.hold(cmd);
                                return;
                            }
                        }
                    }
                }
                _ => {
                    drop(st);
                    self.hold(cmd);
                    return;
                }
            }
        }
    }

    /// When the commands of the last lost session may go out again.
    fn quiesce_deadline(&self, st: &St) -> Instant {
        let cqt = Duration::from_millis(st.info.as_ref().map_or(0, |i| i.cqt_ms) as u64);
        st.since + cqt.max(self.cfg.quiesce_time)
    }

    /// Hold a command for the next session, or fail it if the knobs say so. `sent`: it went
    /// out on a session that was lost (so it must not be resent before the quiesce time).
    fn hold(&self, cmd: Cmd) {
        self.hold_cmd(cmd, false)
    }

    fn hold_cmd(&self, cmd: Cmd, sent: bool) {
        let mut st = self.lock();
        let fail = match st.phase {
            Phase::Live => {
                // A session is up (e.g. a queue of the old one handed its commands back
                // after the new one came up): send it there.
                let s = st.session.clone().expect("live has a session");
                drop(st);
                if let Err(c) = s.pick().submit(cmd) {
                    self.lock().held.push_back(c);
                }
                return;
            }
            // A multipath member's command goes back up for another path: at once if it
            // never went out, after the quiesce time if it did (the supervisor releases it).
            Phase::Connecting => {
                st.fail_fast
                    || (cmd.release && (!sent || Instant::now() >= self.quiesce_deadline(&st)))
            }
            Phase::Failed | Phase::Closed => true,
        };
        if fail || !cmd.is_io() {
            drop(st);
            cmd.fail(IoError::PathLost);
        } else {
            st.held.push_back(cmd);
        }
    }

    /// End the current session (if it is `session`) and start reconnecting.
    fn lose_session(&self, session: u64, reason: &str) {
        let mut st = self.lock();
        let Some(s) = st.session.clone() else { return };
        if s.id != session {
            return;
        }
        st.session = None;
        self.live.store(false, Ordering::Release);
        st.resets += 1;
        st.last_error = Some(reason.to_string());
        let mut to_fail = Vec::new();
        if st.phase == Phase::Live {
            st.phase = Phase::Connecting;
            let now = Instant::now();
            st.since = now;
            st.fail_fast = false;
            st.next_attempt = self.quiesce_deadline(&st);
            if st.cfg_zero_loss(&self.cfg) {
                st.phase = Phase::Failed;
                to_fail.extend(st.held.drain(..));
            }
        }
        drop(st);
        warn!(controller = %self.name, reason, "session lost; reconnecting per reconnect_delay/ctrl_loss_timeout");
        s.shutdown();
        for c in to_fail {
            c.fail(IoError::PathLost);
        }
        self.notify();
    }

    fn close(&self) {
        let mut st = self.lock();
        if st.phase == Phase::Closed {
            return;
        }
        let was_live = st.phase == Phase::Live;
        st.phase = Phase::Closed;
        let session = st.session.take();
        self.live.store(false, Ordering::Release);
        let held: Vec<_> = st.held.drain(..).collect();
        drop(st);
        self.notify();
        for c in held {
            c.fail(IoError::PathLost);
        }
        if let Some(s) = session {
            if was_live {
                // Normal shutdown notification (§3.6.2), bounded: a dead controller costs
                // at most shutdown_timeout, never tens of seconds.
                let deadline = Instant::now() + self.cfg.shutdown_timeout;
                let _ = property_set(
                    &s.admin,
                    registers::CC,
                    cc::EN | cc::SHN_NORMAL << cc::SHN_SHIFT | queue_entry_sizes(),
                    deadline,
                );
            }
            s.shutdown();
            let bound = self.cfg.shutdown_timeout;
            s.admin.join(bound);
            for q in &s.io {
                q.join(bound);
            }
        }
        info!(controller = %self.name, "controller closed");
    }

    /// The supervisor: connects, reconnects, keeps alive, and applies the timeouts.
    fn supervise(self: Arc<Self>) {
        loop {
            let mut st = self.lock();
            match st.phase {
                Phase::Closed => return,
                Phase::Failed => {
                    drop(self.cv.wait(st));
                    continue;
                }
                Phase::Live => {
                    let kato = self.cfg.keep_alive_timeout;
                    let mut tick = Duration::from_secs(3600);
                    if !kato.is_zero() {
                        tick = tick.min(kato / 2);
                    }
                    if let Some(t) = self.cfg.io_timeout {
                        tick = tick.min(t / 4);
                    }
                    let s = st.session.clone().expect("live has a session");
                    drop(
                        self.cv
                            .wait_timeout(st, tick.max(Duration::from_millis(1)))
                            .unwrap_or_else(|p| p.into_inner()),
                    );
                    if self.phase() != Phase::Live {
                        continue;
                    }
                    if let Some(t) = self.cfg.io_timeout {
                        let oldest = s.io.iter().filter_map(|q| q.oldest_outstanding()).max();
                        if oldest.is_some_and(|o| o >= t) {
                            self.lose_session(
                                s.id,
                                &format!(
                                    "I/O timeout: a command has been outstanding for over {:.1} s",
                                    t.as_secs_f64()
                                ),
                            );
                            continue;
                        }
                    }
                    if !kato.is_zero() {
                        self.keep_alive(&s, kato);
                    }
                    continue;
                }
                Phase::Connecting => {}
            }
            let now = Instant::now();
            let lost_for = now - st.since;
            if let Some(loss) = self.cfg.ctrl_loss_timeout {
                // The very first connection of a controller also gives up after the loss
                // timeout (a replayed remote that never comes back ends up Failed, visibly).
                if lost_for >= loss && st.attempts > 0 {
                    st.phase = Phase::Failed;
                    st.last_error = Some(format!(
                        "controller lost for {:.1} s (ctrl_loss_timeout): {}",
                        lost_for.as_secs_f64(),
                        st.last_error.clone().unwrap_or_default()
                    ));
                    let held: Vec<_> = st.held.drain(..).collect();
                    let msg = st.last_error.clone().unwrap_or_default();
                    drop(st);
                    warn!(controller = %self.name, error = %msg, "controller failed");
                    for c in held {
                        c.fail(IoError::PathLost);
                    }
                    self.notify();
                    continue;
                }
            }
            if let Some(ff) = self.cfg.fast_io_fail_timeout {
                if lost_for >= ff && !st.fail_fast {
                    st.fail_fast = true;
                    let held: Vec<_> = st.held.drain(..).collect();
                    drop(st);
                    info!(controller = %self.name, "fast_io_fail_timeout: failing I/O while reconnecting");
                    for c in held {
                        c.fail(IoError::PathLost);
                    }
                    self.notify();
                    continue;
                }
            }
            let quiesced = self.quiesce_deadline(&st);
            if now >= quiesced && st.held.iter().any(|c| c.release) {
                let (go, keep): (Vec<Cmd>, Vec<Cmd>) = st.held.drain(..).partition(|c| c.release);
                st.held = keep.into();
                drop(st);
                for c in go {
                    c.fail(IoError::PathLost);
                }
                continue;
            }
            if now < st.next_attempt {
                let mut wake = st.next_attempt;
                if st.held.iter().any(|c| c.release) {
                    wake = wake.min(quiesced);
                }
                if let Some(l) = self.cfg.ctrl_loss_timeout {
                    wake = wake.min(st.since + l);
                }
                if let (Some(f), false) = (self.cfg.fast_io_fail_timeout, st.fail_fast) {
                    wake = wake.min(st.since + f);
                }
                let d = wake
                    .saturating_duration_since(now)
                    .max(Duration::from_millis(1));
                let _ = self.cv.wait_timeout(st, d);
                continue;
            }
            let id = st.next_session;
            st.next_session += 1;
            let expected = st.expected.clone();
            drop(st);
            let res = self.establish(id, expected.as_deref());
            let mut st = self.lock();
            st.attempts += 1;
            match res {
                Ok((s, info)) => {
                    if st.phase != Phase::Connecting {
                        drop(st);
                        s.shutdown();
                        continue;
                    }
                    self.max_transfer
                        .store(info.max_transfer, Ordering::Relaxed);
                    self.oncs.store(info.oncs as usize, Ordering::Relaxed);
                    if st.expected.is_none() {
                        st.expected = Some(info.namespaces.clone());
                    }
                    st.info = Some(info);
                    st.session = Some(s.clone());
                    st.phase = Phase::Live;
                    st.fail_fast = false;
                    st.connects += 1;
                    self.live.store(true, Ordering::Release);
                    let held: Vec<_> = st.held.drain(..).collect();
                    drop(st);
                    info!(controller = %self.name, session = id, resent = held.len(), "controller live");
                    for c in held {
                        if let Err(c) = s.pick().submit(c) {
                            self.hold(c);
                        }
                    }
                    self.notify();
                }
                Err(FabricError::IdentityChanged(msg)) => {
                    st.phase = Phase::Failed;
                    st.last_error = Some(msg.clone());
                    let held: Vec<_> = st.held.drain(..).collect();
                    drop(st);
                    warn!(controller = %self.name, error = %msg, "controller failed");
                    for c in held {
                        c.fail(IoError::PathLost);
                    }
                    self.notify();
                }
                Err(e) => {
                    st.last_error = Some(e.to_string());
                    st.next_attempt = Instant::now() + self.cfg.reconnect_delay;
                    drop(st);
                    info!(controller = %self.name, error = %e, "connection attempt failed");
                    self.notify();
                }
            }
        }
    }

    fn keep_alive(&self, s: &Arc<Session>, kato: Duration) {
        let mut ka = s.ka.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((sent, w)) = ka.as_ref() {
            if !w.is_done() {
                if sent.elapsed() >= kato {
                    drop(ka);
                    self.lose_session(s.id, "keep-alive timeout: the controller stopped answering");
                }
                return;
            }
        }
        let w = AdminWait::with_buf(Vec::new());
        let sqe = Command {
            opcode: admin_opcode::KEEP_ALIVE,
            ..Default::default()
        };
        *ka = Some((Instant::now(), w.clone()));
        drop(ka);
        if let Err(c) = s.admin.submit(Cmd {
            sqe,
            dir: Dir::None,
            len: 0,
            target: Target::Admin(w),
            release: true,
        }) {
            c.fail(IoError::PathLost);
        }
    }

    /// Build a new session (module docs: bringing a controller up).
    fn establish(
        self: &Arc<Self>,
        id: u64,
        expected: Option<&[NamespaceInfo]>,
    ) -> Result<(Arc<Session>, ControllerInfo), FabricError> {
        let cfg = &self.cfg;
        let addr = cfg.socket_addr()?;
        let deadline = Instant::now() + cfg.connect_timeout * 4;
        let owner: Weak<dyn QueueOwner> = Arc::downgrade(&(self.clone() as Arc<dyn QueueOwner>));
        let mut cd = ConnectData {
            hostid: cfg.hostid,
            cntlid: CNTLID_DYNAMIC,
            subnqn: cfg.subnqn.clone(),
            hostnqn: cfg.hostnqn.clone(),
        };
        let params = QueueParams {
            qid: 0,
            depth: ADMIN_DEPTH,
            digests: cfg.digests,
            kato_ms: cfg.keep_alive_timeout.as_millis().min(u32::MAX as u128) as u32,
            icd_max: 0,
            timeout: cfg.connect_timeout,
        };
        let (admin, cqe) = QueueConn::open(addr, params, &cd, id, owner.clone())?;
        let guard = ShutdownGuard(vec![admin.clone()]);
        let mut guard = guard;
        let cntlid = cqe.dw0 as u16;
        let info = bring_up(&admin, cfg, deadline)?;
        if let Some(exp) = expected {
            check_identity(exp, &info.0.namespaces)?;
        }
        let (mut info, mqes) = info;
        info.cntlid = cntlid;
        // I/O queues.
        let want = cfg.io_queues.max(1);
        let granted = set_queue_count(&admin, want, deadline)?;
        let depth = cfg.queue_depth.clamp(1, MAX_DEPTH - 1).min(mqes.max(1));
        cd.cntlid = cntlid;
        let mut io = Vec::new();
        for qid in 1..=granted {
            let p = QueueParams {
                qid,
                depth,
                digests: cfg.digests,
                kato_ms: 0,
                icd_max: info_icd(cfg, &info),
                timeout: cfg.connect_timeout,
            };
            let (q, _) = QueueConn::open(addr, p, &cd, id, owner.clone())?;
            guard.0.push(q.clone());
            io.push(q);
        }
        info.io_queues = granted;
        info.queue_depth = depth;
        guard.0.clear();
        Ok((
            Arc::new(Session {
                id,
                admin,
                io,
                rr: AtomicUsize::new(0),
                ka: Mutex::new(None),
            }),
            info,
        ))
    }
}

/// Shuts queues down if a session fails half-way through being built.
struct ShutdownGuard(Vec<Arc<QueueConn>>);
impl Drop for ShutdownGuard {
    fn drop(&mut self) {
        for q in &self.0 {
            q.shutdown();
        }
    }
}

impl St {
    fn cfg_zero_loss(&self, cfg: &ControllerConfig) -> bool {
        cfg.ctrl_loss_timeout == Some(Duration::ZERO)
    }
}

impl QueueOwner for Ctrl {
    fn queue_closed(&self, session: u64, qid: u16, reason: String, cmds: Vec<Cmd>) {
        self.lose_session(session, &format!("queue {qid}: {reason}"));
        for c in cmds {
            if c.is_io() {
                self.hold_cmd(c, true);
            } else {
                c.fail(IoError::PathLost);
            }
        }
    }
}

/// In-capsule data for I/O queues: what the host wants, capped by what the controller takes
/// — IOCCSZ (16-byte units, including the 64-byte SQE) and SGLS bit 20 (Offset SGLs, the
/// only form in-capsule data can take). A controller without it gets every write by R2T.
fn info_icd(cfg: &ControllerConfig, info: &ControllerInfo) -> usize {
    if info.sgls & identify::SGLS_OFFSET == 0 {
        return 0;
    }
    let ctrl = (info.ioccsz as usize * 16).saturating_sub(64);
    cfg.in_capsule_data_size.min(ctrl)
}

fn queue_entry_sizes() -> u32 {
    cc::IOSQES_64 << cc::IOSQES_SHIFT | cc::IOCQES_16 << cc::IOCQES_SHIFT
}

/// Send one admin command and wait for it until `deadline`.
pub(crate) fn admin_cmd(
    q: &Arc<QueueConn>,
    sqe: Command,
    dir: Dir,
    buf: Vec<u8>,
    deadline: Instant,
) -> Result<(Cqe, Vec<u8>), FabricError> {
    let len = buf.len();
    let w = AdminWait::with_buf(buf);
    let op = sqe.opcode;
    q.submit(Cmd {
        sqe,
        dir,
        len,
        target: Target::Admin(w.clone()),
        release: true,
    })
    .map_err(|_| FabricError::Connect("admin queue closed".into()))?;
    match w.wait_until(deadline) {
        Some(Ok(cqe)) => {
            let data = std::mem::take(&mut *w.buf.lock().unwrap_or_else(|p| p.into_inner()));
            if cqe.status().is_success() {
                Ok((cqe, data))
            } else {
                Err(FabricError::Status(op, cqe.status()))
            }
        }
        Some(Err(e)) => Err(FabricError::Connect(format!(
            "admin command {op:#04x}: {e}"
        ))),
        None => {
            q.shutdown();
            Err(FabricError::Timeout(format!("admin command {op:#04x}")))
        }
    }
}

pub(crate) fn property_get(
    q: &Arc<QueueConn>,
    off: u32,
    eight: bool,
    deadline: Instant,
) -> Result<u64, FabricError> {
    let (cqe, _) = admin_cmd(
        q,
        Property::get_command(0, off, eight),
        Dir::None,
        Vec::new(),
        deadline,
    )?;
    Ok(if eight {
        cqe.dw0 as u64 | (cqe.dw1 as u64) << 32
    } else {
        cqe.dw0 as u64
    })
}

pub(crate) fn property_set(
    q: &Arc<QueueConn>,
    off: u32,
    v: u32,
    deadline: Instant,
) -> Result<(), FabricError> {
    admin_cmd(
        q,
        Property::set_command(0, off, false, v as u64),
        Dir::None,
        Vec::new(),
        deadline,
    )
    .map(|_| ())
}

/// Enable the controller (CC.EN, wait CSTS.RDY).
pub(crate) fn enable(q: &Arc<QueueConn>, deadline: Instant) -> Result<u16, FabricError> {
    let cap = property_get(q, registers::CAP, true, deadline)?;
    let mqes = registers::cap_mqes(cap);
    let to = Duration::from_millis(500 * ((cap >> 24) & 0xFF).max(1));
    property_set(q, registers::CC, cc::EN | queue_entry_sizes(), deadline)?;
    let rdy_deadline = deadline.min(Instant::now() + to);
    loop {
        let s = property_get(q, registers::CSTS, false, deadline)? as u32;
        if s & csts::CFS != 0 {
            return Err(FabricError::Failed(
                "controller reports fatal status (CSTS.CFS)".into(),
            ));
        }
        if s & csts::RDY != 0 {
            return Ok(mqes);
        }
        if Instant::now() >= rdy_deadline {
            return Err(FabricError::Timeout("CSTS.RDY after CC.EN".into()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub(crate) fn identify(
    q: &Arc<QueueConn>,
    cns_v: u8,
    nsid: u32,
    deadline: Instant,
) -> Result<Vec<u8>, FabricError> {
    let sqe = Command {
        opcode: admin_opcode::IDENTIFY,
        nsid,
        cdw10: cns_v as u32,
        ..Default::default()
    };
    admin_cmd(
        q,
        sqe,
        Dir::C2H,
        vec![0u8; identify::IDENTIFY_LEN],
        deadline,
    )
    .map(|r| r.1)
}

/// Enable, Identify Controller and every active namespace. Returns the info and CAP.MQES.
fn bring_up(
    q: &Arc<QueueConn>,
    cfg: &ControllerConfig,
    deadline: Instant,
) -> Result<(ControllerInfo, u16), FabricError> {
    let mqes = enable(q, deadline)?;
    let raw = identify(q, cns::CONTROLLER, 0, deadline)?;
    let id = IdentifyController::decode(&raw);
    if id.cntrltype == identify::cntrltype::DISCOVERY {
        return Err(FabricError::Refused(format!(
            "{} is a discovery controller, not an I/O controller",
            cfg.subnqn
        )));
    }
    if !id.subnqn.is_empty() && id.subnqn != cfg.subnqn {
        return Err(FabricError::Refused(format!(
            "controller reports subsystem {:?}, expected {:?}",
            id.subnqn, cfg.subnqn
        )));
    }
    // MDTS is a power of two in units of the minimum page size (4 KiB; 0 = no limit).
    let max_transfer = if id.mdts == 0 || id.mdts >= 20 {
        MAX_TRANSFER
    } else {
        (4096usize << id.mdts).min(MAX_TRANSFER)
    };
    let cqt_ms = get_u16(&raw, 386);
    let list = if id.nn > 0 {
        identify::decode_ns_list(&identify(q, cns::ACTIVE_NS_LIST, 0, deadline)?)
    } else {
        Vec::new()
    };
    let mut namespaces = Vec::new();
    for nsid in list {
        let ns = IdentifyNamespace::decode(&identify(q, cns::NAMESPACE, nsid, deadline)?);
        // A broken controller must not make nacre compute an impossible size.
        if ns.nsze == 0
            || !(9..=16).contains(&ns.lbads)
            || ns.nsze.checked_mul(1u64 << ns.lbads).is_none()
        {
            warn!(
                nsid,
                lbads = ns.lbads,
                nsze = ns.nsze,
                "skipping namespace with no size, an impossible size or an unsupported block size"
            );
            continue;
        }
        let mut info = NamespaceInfo {
            nsid,
            block_size: 1 << ns.lbads,
            blocks: ns.nsze,
            nguid: (ns.nguid != [0; 16]).then_some(ns.nguid),
            uuid: None,
            eui64: (ns.eui64 != [0; 8]).then_some(ns.eui64),
        };
        // Descriptors are optional before NVMe 1.3; their absence is not an error.
        if let Ok(d) = identify(q, cns::NS_DESCRIPTOR_LIST, nsid, deadline) {
            for desc in identify::decode_ns_descriptors(&d) {
                match (desc.nidt, desc.nid.len()) {
                    (nidt::NGUID, 16) => info.nguid = desc.nid.try_into().ok(),
                    (nidt::UUID, 16) => info.uuid = desc.nid.try_into().ok(),
                    (nidt::EUI64, 8) => info.eui64 = desc.nid.try_into().ok(),
                    _ => {}
                }
            }
        }
        namespaces.push(info);
    }
    Ok((
        ControllerInfo {
            cntlid: id.cntlid,
            model: id.model,
            serial: id.serial,
            firmware: id.firmware,
            subnqn: id.subnqn,
            max_transfer,
            oncs: id.oncs,
            cqt_ms,
            ioccsz: id.ioccsz,
            sgls: id.sgls,
            io_queues: 0,
            queue_depth: 0,
            namespaces,
        },
        mqes,
    ))
}

fn set_queue_count(q: &Arc<QueueConn>, want: u16, deadline: Instant) -> Result<u16, FabricError> {
    let n = (want - 1) as u32;
    let sqe = Command {
        opcode: admin_opcode::SET_FEATURES,
        cdw10: FID_NUMBER_OF_QUEUES,
        cdw11: n | n << 16,
        ..Default::default()
    };
    let (cqe, _) = admin_cmd(q, sqe, Dir::None, Vec::new(), deadline)?;
    let nsqa = ((cqe.dw0 & 0xFFFF) as u16).saturating_add(1);
    let ncqa = ((cqe.dw0 >> 16) as u16).saturating_add(1);
    Ok(want.min(nsqa).min(ncqa).max(1))
}

/// A reconnect must find the namespaces it had: same NSID, same identity, same geometry
/// (never send I/O meant for one namespace to another that reuses the NSID).
fn check_identity(expected: &[NamespaceInfo], found: &[NamespaceInfo]) -> Result<(), FabricError> {
    for e in expected {
        let Some(f) = found.iter().find(|f| f.nsid == e.nsid) else {
            return Err(FabricError::IdentityChanged(format!(
                "namespace {} is gone from the controller",
                e.nsid
            )));
        };
        let id_ok = if e.has_id() || f.has_id() {
            e.same_namespace(f)
        } else {
            true
        };
        if !id_ok || f.block_size != e.block_size || f.blocks < e.blocks {
            return Err(FabricError::IdentityChanged(format!(
                "namespace {} changed ({} {}x{} -> {} {}x{}): refusing to send I/O to a different namespace",
                e.nsid,
                e.id_string(),
                e.blocks,
                e.block_size,
                f.id_string(),
                f.blocks,
                f.block_size
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod test {
    use super::*;

    fn ns(nsid: u32, g: u8) -> NamespaceInfo {
        NamespaceInfo {
            nsid,
            block_size: 512,
            blocks: 100,
            nguid: Some([g; 16]),
            uuid: None,
            eui64: None,
        }
    }

    #[test]
    fn identity_rules() {
        assert!(ns(1, 1).same_namespace(&ns(2, 1)));
        assert!(!ns(1, 1).same_namespace(&ns(1, 2)));
        let mut none = ns(1, 1);
        none.nguid = None;
        assert!(
            !none.same_namespace(&none.clone()),
            "no ids: never the same"
        );
        let mut u = ns(1, 1);
        u.uuid = Some([9; 16]);
        let mut u2 = ns(1, 1);
        u2.uuid = Some([8; 16]);
        assert!(!u.same_namespace(&u2), "one identifier differs");
        assert!(check_identity(&[ns(1, 1)], &[ns(1, 1)]).is_ok());
        assert!(check_identity(&[ns(1, 1)], &[ns(1, 2)]).is_err());
        assert!(check_identity(&[ns(1, 1)], &[ns(2, 1)]).is_err());
        let mut small = ns(1, 1);
        small.blocks = 10;
        assert!(check_identity(&[ns(1, 1)], &[small]).is_err());
    }
}
