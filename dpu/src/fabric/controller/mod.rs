//! One NVMe-oF controller association, and its life across connection failures.
//!
//! The transport is below a small seam ([`super::queue::FabricQueue`]): everything here —
//! bring-up, keep-alive, reconnection and its knobs — is the same for NVMe/TCP and NVMe/RDMA.
//!
//! * [`admin`] — bringing a controller up: the admin commands (Property Get/Set, CC.EN,
//!   Identify, Set Features Number of Queues) and the namespace identity check.
//! * [`auth`] — DH-HMAC-CHAP on each queue after its Connect ([`crate::auth::chap::HostAuth`]
//!   driven with Authentication Send/Receive).
//! * [`session`] — a session (admin queue + I/O queues), losing it, reconnecting per
//!   `reconnect_delay`/`ctrl_loss_timeout`/`fast_io_fail_timeout`, keep-alive, teardown.
//! * this module — configuration, what is known about a controller, and the I/O submit
//!   path (a command goes to a live queue, is held, or fails, per the knobs).

use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use nacre_shared::nvme_tcp::Digests;

use super::cmd::{AdminWait, Cmd};
use super::queue::{Queue, Transport};
use super::FabricError;
use crate::volume::IoError;

mod admin;
mod auth;
mod session;

pub(crate) use admin::{admin_cmd, enable};

/// The largest transfer nacre puts in one command, whatever MDTS allows.
pub const MAX_TRANSFER: usize = 1 << 20;
/// What nacre assumes before the first Identify Controller (SPDK's default).
const DEFAULT_TRANSFER: usize = 128 << 10;

/// How to reach a controller and what to do when it goes away.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// NVMe/TCP (default) or NVMe/RDMA.
    pub transport: Transport,
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
    /// Bound on the transport connect (TCP connect; RDMA CM address and route resolution
    /// and connect, each) and on each initialisation step.
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
    /// DH-HMAC-CHAP (NVMe Base 2.0 §8.13): the file holding the host's secret
    /// (`DHHC-1:...`, mode 0600). Read at each connection and never kept here, so the config
    /// (and its Debug form) holds only the path.
    pub dhchap_secret: Option<std::path::PathBuf>,
    /// The file holding the controller's secret: with it every queue also authenticates
    /// the controller (bidirectional), whether or not the controller asks for
    /// authentication.
    pub dhchap_ctrl_secret: Option<std::path::PathBuf>,
    /// NVMe/TCP over TLS 1.3 (NVMe/TCP Transport §3.6): the file holding the configured PSK
    /// (`NVMeTLSkey-1:...`, mode 0600), read at each session like the secrets above.
    pub tls_psk: Option<std::path::PathBuf>,
    /// The NVMe/TCP initiator reactors that serve its queues (default: the process's shared
    /// pool, [`crate::fabric::tcp::Reactors::shared`]).
    pub tcp_reactors: crate::fabric::tcp::Reactors,
}

impl ControllerConfig {
    /// Defaults like SPDK's and Linux's: 4 queues of 128, no digests, 8 KiB in-capsule data,
    /// KATO 10 s, I/O timeout 30 s, reconnect every 2 s, give up after 30 s, no fast I/O
    /// failure.
    pub fn new(address: &str, port: u16, subnqn: &str, hostnqn: &str) -> Self {
        ControllerConfig {
            transport: Transport::Tcp,
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
            dhchap_secret: None,
            dhchap_ctrl_secret: None,
            tls_psk: None,
            tcp_reactors: crate::fabric::tcp::Reactors::shared(),
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
    /// Bytes of I/O data copied through transport buffers (NVMe/RDMA's registered slot
    /// buffers), over every session: what zero copy would save.
    pub bounce_copy_bytes: u64,
    /// Bytes of I/O data the device moved straight from or into the requests' memory, over
    /// every session (the zero-copy path).
    pub direct_bytes: u64,
    /// Of the live session: batches of commands a submitter sent itself when its plug
    /// closed (`volume::plug`), and those the socket did not take whole.
    pub inline_sends: u64,
    pub inline_partial_sends: u64,
    /// Of the live session: C2HData bytes the kernel read straight into the requests'
    /// memory, and those copied there from the receive buffer (NVMe/TCP).
    pub rx_direct_bytes: u64,
    pub rx_copied_bytes: u64,
}

/// Told when a controller changes phase (multipath uses it to resubmit parked I/O).
pub trait PhaseListener: Send + Sync {
    fn phase_changed(&self);
}

struct Session {
    id: u64,
    admin: Queue,
    io: Vec<Queue>,
    rr: AtomicUsize,
    /// The keep-alive in flight and when it was sent.
    ka: Mutex<Option<(Instant, Arc<AdminWait>)>>,
    /// The controller's total of ended sessions' bounce copies, added to when this one ends.
    bounced: Arc<AtomicU64>,
    /// The same for bytes moved directly (zero copy).
    direct: Arc<AtomicU64>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.bounced
            .fetch_add(self.bounce_copy_bytes(), Ordering::Relaxed);
        self.direct
            .fetch_add(self.direct_bytes(), Ordering::Relaxed);
    }
}

impl Session {
    fn bounce_copy_bytes(&self) -> u64 {
        self.admin.bounce_copy_bytes() + self.io.iter().map(|q| q.bounce_copy_bytes()).sum::<u64>()
    }

    fn direct_bytes(&self) -> u64 {
        self.admin.direct_bytes() + self.io.iter().map(|q| q.direct_bytes()).sum::<u64>()
    }

    fn inline_sends(&self) -> (u64, u64) {
        self.io
            .iter()
            .map(|q| q.inline_sends())
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
    }

    fn rx_bytes(&self) -> (u64, u64) {
        self.io
            .iter()
            .map(|q| q.rx_bytes())
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
    }

    fn shutdown(&self) {
        self.admin.shutdown();
        for q in &self.io {
            q.shutdown();
        }
    }

    /// The I/O queue for a command submitted by the calling thread: always the same one for
    /// a thread (its submitter number modulo the queue count). One frontend queue is served
    /// by one thread, so its commands stay on one fabric queue: they gather in one send
    /// buffer and leave in fewer writes, and frontend threads on different cores do not
    /// contend for one connection's locks. (Spreading commands round-robin, as before, had
    /// every frontend queue touch every connection.) The price: one frontend queue gets
    /// at most one fabric queue's depth in flight; more waits in that queue's overflow list.
    fn pick(&self) -> &Queue {
        &self.io[submitter_index() % self.io.len()]
    }

    /// Round-robin, for commands that come from many submitters at once and are resent by
    /// one thread (held over a reconnect, handed back by a dead queue): spread them rather
    /// than load them all on the resending thread's queue.
    fn pick_rr(&self) -> &Queue {
        let i = self.rr.fetch_add(1, Ordering::Relaxed);
        &self.io[i % self.io.len()]
    }
}

/// A small number per thread that submits I/O, given on its first submission (0, 1, 2, ...
/// in that order), so that N frontend threads over N fabric queues usually get one each.
fn submitter_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
    }
    INDEX.with(|c| {
        let mut i = c.get();
        if i == usize::MAX {
            i = NEXT.fetch_add(1, Ordering::Relaxed);
            c.set(i);
        }
        i
    })
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
    /// The live session, published for the I/O submit path: `Some(s)` exactly while
    /// `st.phase == Live` and `st.session == Some(s)` (both are only changed together, under
    /// `st`'s lock, by [`Ctrl::publish`]). A submitter reads it without taking `st`'s mutex,
    /// which every I/O used to take (a controller-wide lock per command). Reading a
    /// session here is what reading it under the lock and then dropping the lock was: the
    /// session may be lost right after, and then its queue either refuses the command or
    /// hands it back through `queue_closed`, exactly as before.
    published: ArcSwapOption<Session>,
    /// Commands submitted to this controller (observability; multipath tests read it).
    pub submitted: AtomicU64,
    /// Bounce copies of the sessions that ended (see [`ControllerStatus::bounce_copy_bytes`]).
    bounced: Arc<AtomicU64>,
    /// Bytes moved directly by ended sessions (see [`ControllerStatus::direct_bytes`]).
    direct: Arc<AtomicU64>,
    /// The next DH-HMAC-CHAP transaction identifier (one per queue authentication).
    auth_t_id: std::sync::atomic::AtomicU16,
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
            published: ArcSwapOption::empty(),
            submitted: AtomicU64::new(0),
            bounced: Arc::new(AtomicU64::new(0)),
            direct: Arc::new(AtomicU64::new(0)),
            auth_t_id: std::sync::atomic::AtomicU16::new(0),
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
                    return Err(FabricError::FirstAttempt(
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

    /// Disconnect and reconnect (see [`Ctrl::reset`]).
    pub fn reset(&self) -> Result<(), FabricError> {
        self.core.reset()
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
    /// A fresh DH-HMAC-CHAP transaction identifier.
    fn next_t_id(&self) -> u16 {
        self.auth_t_id.fetch_add(1, Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, St> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Set the live session (`None`: not live). Callers hold `st`'s lock and set
    /// `st.session` to the same value, so the published session never disagrees with it.
    fn publish(&self, _st: &St, s: Option<Arc<Session>>) {
        self.live.store(s.is_some(), Ordering::Release);
        self.published.store(s);
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
        let (inline_sends, inline_partial_sends) =
            st.session.as_ref().map_or((0, 0), |s| s.inline_sends());
        let (rx_direct_bytes, rx_copied_bytes) =
            st.session.as_ref().map_or((0, 0), |s| s.rx_bytes());
        ControllerStatus {
            phase: st.phase,
            info: st.info.clone(),
            last_error: st.last_error.clone(),
            resets: st.resets,
            connects: st.connects,
            held: st.held.len(),
            fail_fast: st.fail_fast,
            bounce_copy_bytes: self.bounced.load(Ordering::Relaxed)
                + st.session.as_ref().map_or(0, |s| s.bounce_copy_bytes()),
            direct_bytes: self.direct.load(Ordering::Relaxed)
                + st.session.as_ref().map_or(0, |s| s.direct_bytes()),
            inline_sends,
            inline_partial_sends,
            rx_direct_bytes,
            rx_copied_bytes,
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
        // The hot path: a live controller takes no lock of its own (see `published`).
        let cmd = {
            let g = self.published.load();
            match g.as_ref() {
                Some(s) => match s.pick().submit(cmd) {
                    Ok(()) => return,
                    Err(c) => c,
                },
                None => cmd,
            }
        };
        self.submit_slow(cmd);
    }

    /// Not live, or the queue just refused the command: decide under the lock.
    fn submit_slow(&self, cmd: Cmd) {
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
                                // Still the same session: hold until the queue's close reports it.
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

    /// Hold a command for the controller's next association (its next set of queues), or fail
    /// it if the knobs say so. `sent`: it went out on queues that were lost (so it must not
    /// be resent before the quiesce time).
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
                if let Err(c) = s.pick_rr().submit(cmd) {
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
            Phase::Failed | Phase::Closed => {
                drop(st);
                cmd.fail(IoError::PathFailed);
                return;
            }
        };
        if fail || !cmd.is_io() {
            drop(st);
            cmd.fail(IoError::PathLost);
        } else {
            st.held.push_back(cmd);
        }
    }
}
