//! The target's reactors: a few threads, each owning many connections through one epoll
//! instance, with non-blocking sockets.
//!
//! ```text
//!  accept thread ──Mail::Conn──▶ reactor (epoll + eventfd) ─▶ Conn, Conn, Conn …
//!  volume worker ──Mail::Done──▶        │ inline completions: a thread-local list, no lock
//!  control plane ──Mail::Async/Close──▶ │
//! ```
//!
//! A reactor loop: wait for readiness, read once per ready connection (one read fills the
//! receive buffer; every complete PDU in it is handled), collect the completions the
//! volumes produced on this thread, then flush each connection that has replies with one
//! gather write. After work it busy-polls (`epoll_wait` with no timeout) for a window that
//! adapts as the vhost-user-blk worker's does, then sleeps in `epoll_wait`.
//!
//! Polling buys latency only where a host waits on each reply. A host that keeps many
//! commands in flight gains little from a reply a few microseconds sooner, and the poll
//! costs the core it runs on (a DPU's Arm cores also run crypto, vhost and the initiator).
//! So under [`PollPolicy::Adaptive`], the default, a reactor whose last flush answered at
//! least [`SLEEP_DEPTH`] commands of one connection sleeps at once, and polls again after a
//! flush of [`POLL_DEPTH`] or fewer ([`DepthGate`]). `--nvmf-poll always` keeps polling at
//! any depth (SPDK's way, less the pinned core); `off` never polls.
//!
//! Completions from other threads (remote and crypto volumes) and asynchronous events go
//! into the reactor's mailbox; the eventfd is written only while the reactor sleeps, so a
//! busy reactor takes them without a system call.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nacre_shared::nvme::Status;
use tracing::{error, warn};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_CLOEXEC, EFD_NONBLOCK};

use super::conn::Conn;
use crate::frontend::nvme::{lock, ConnSlot, TargetInner};
use crate::volume::IoResult;

/// Token of the reactor's eventfd in the epoll set (connections count up from 1).
const WAKE_TOKEN: u64 = u64::MAX;
/// Readiness events taken per `epoll_wait`.
const EVENTS: usize = 256;
/// Longest busy-poll after work (the vhost-user-blk worker and QEMU's `poll-max-ns` use
/// 32 µs; a TCP round trip on loopback takes a little longer).
const MAX_POLL_NS: u64 = 50_000;
const MIN_POLL_NS: u64 = 4_000;
/// [`DepthGate`]: a flush that answers this many commands of one connection shows a host
/// that keeps a queue in flight (a deep one: `fio --iodepth`, `spdk_nvme_perf -q`)...
const SLEEP_DEPTH: u32 = 8;
/// ... and one of this many or fewer a host that waits on its replies (QD1, QD2).
const POLL_DEPTH: u32 = 2;
/// Longest sleep while a connection has a deadline (setup, per PDU, stalled send): it is
/// checked at least this often.
const MAX_SLEEP_MS: i32 = 50;
/// How often the deadlines are checked while the reactor is busy.
const SCAN_EVERY: Duration = Duration::from_millis(10);

/// Default reactor count: one per core, at most this many (a DPU's Arm cores also run the
/// vhost-user-blk workers, crypto and the fabric initiator).
pub const MAX_DEFAULT_REACTORS: usize = 4;

/// When a reactor busy-polls (nacred's `--nvmf-poll`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PollPolicy {
    // (The variants' doc lines are nacred's `--help` text; the rule is `DepthGate`.)
    /// Poll after work for hosts that wait on each reply; sleep at once for hosts that keep
    /// 8 or more commands in flight.
    #[default]
    Adaptive,
    /// Poll after work at any depth: the lowest latency, a core kept busy while hosts are.
    Always,
    /// Never poll: sleep in epoll_wait whenever there is nothing to do.
    Off,
}

impl PollPolicy {
    pub const ALL: [PollPolicy; 3] = [PollPolicy::Adaptive, PollPolicy::Always, PollPolicy::Off];

    pub fn as_str(self) -> &'static str {
        match self {
            PollPolicy::Adaptive => "adaptive",
            PollPolicy::Always => "always",
            PollPolicy::Off => "off",
        }
    }
}

/// The depth rule of [`PollPolicy::Adaptive`], with hysteresis so that a host between the
/// two depths keeps the reactor in whichever mode it was.
#[derive(Debug, Default)]
struct DepthGate {
    deep: bool,
}

impl DepthGate {
    /// A pass's flushes answered at most `answered` commands of one connection (0: no
    /// flush, which tells nothing).
    fn flushed(&mut self, answered: u32) {
        if answered >= SLEEP_DEPTH {
            self.deep = true;
        } else if answered > 0 && answered <= POLL_DEPTH {
            self.deep = false;
        }
    }
}

/// What a reactor did, as `nvmf_get_stats` shows it (SPDK's poll-group statistics).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReactorStats {
    /// Connections it serves.
    pub connections: usize,
    /// Passes that found work (readiness or mail).
    pub busy_passes: u64,
    /// Busy-polls that found nothing: the price of polling.
    pub idle_polls: u64,
    /// Times it blocked in `epoll_wait`.
    pub sleeps: u64,
    /// Of those, sleeps taken at once after a deep flush instead of polling.
    pub deep_sleeps: u64,
}

/// [`ReactorStats`] as the reactor thread publishes them.
#[derive(Default)]
struct Counters {
    busy_passes: AtomicU64,
    idle_polls: AtomicU64,
    sleeps: AtomicU64,
    deep_sleeps: AtomicU64,
}

/// How many reactor threads a target starts when its configuration says 0
/// ([`super::TargetConfig::reactors`]): one per core, at most [`MAX_DEFAULT_REACTORS`].
pub fn default_reactor_count() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, MAX_DEFAULT_REACTORS)
}

/// What other threads hand a reactor.
pub(crate) enum Mail {
    /// A connection to serve.
    Conn(Box<NewConn>),
    /// A volume completed a request on another thread.
    Done {
        token: u64,
        tag: u64,
        result: IoResult,
    },
    /// Complete a parked admin command (an Asynchronous Event Request).
    Async {
        token: u64,
        cid: u16,
        status: Status,
        dw0: u32,
    },
    /// Close a connection (controller teardown, keep-alive expiry).
    Close(u64),
}

/// An accepted connection on its way to a reactor.
pub(crate) struct NewConn {
    pub(crate) target: Arc<TargetInner>,
    pub(crate) sock: TcpStream,
    pub(crate) listener: SocketAddr,
    pub(crate) slot: ConnSlot,
    /// On a TLS listener: the host and subsystem NQNs of the PSK identity the handshake
    /// proved; its Connects must name them.
    pub(crate) tls_peer: Option<Box<(String, String)>>,
}

/// The part of a reactor other threads reach.
pub(crate) struct Shared {
    epoll: Epoll,
    evfd: EventFd,
    mail: Mutex<Vec<Mail>>,
    has_mail: AtomicBool,
    /// Set while the reactor is (about to be) blocked in `epoll_wait`: posting mail then
    /// writes the eventfd.
    sleeping: AtomicBool,
    stop: AtomicBool,
    /// Connections this reactor owns (for spreading new ones).
    load: AtomicUsize,
    counters: Counters,
}

thread_local! {
    /// The reactor running on this thread (address of its `Shared`), 0 on other threads.
    static CURRENT: Cell<usize> = const { Cell::new(0) };
    /// Completions that volumes produced inline on this reactor's thread, collected
    /// without a lock and handled after the current event.
    static LOCAL: RefCell<Vec<(u64, u64, IoResult)>> = const { RefCell::new(Vec::new()) };
}

impl Shared {
    fn new() -> std::io::Result<Arc<Shared>> {
        let s = Shared {
            epoll: Epoll::new()?,
            evfd: EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC)?,
            mail: Mutex::new(Vec::new()),
            has_mail: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            load: AtomicUsize::new(0),
            counters: Counters::default(),
        };
        s.ctl(
            ControlOperation::Add,
            s.evfd.as_raw_fd(),
            EventSet::IN.bits(),
            WAKE_TOKEN,
        )?;
        Ok(Arc::new(s))
    }

    /// Add, change or remove a descriptor (which the caller keeps open) in the epoll set;
    /// `events` are epoll's bits (`EPOLLIN`...).
    pub(crate) fn ctl(
        &self,
        op: ControlOperation,
        fd: RawFd,
        events: u32,
        token: u64,
    ) -> std::io::Result<()> {
        let events = EventSet::from_bits_truncate(events);
        self.epoll.ctl(op, fd, EpollEvent::new(events, token))
    }

    pub(crate) fn post(&self, m: Mail) {
        lock(&self.mail).push(m);
        // Dekker-style with `sleep`: either the reactor sees `has_mail` after announcing
        // that it sleeps, or we see `sleeping` and wake it.
        self.has_mail.store(true, Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.wake();
        }
    }

    fn wake(&self) {
        // A full counter (EAGAIN) means a wake-up is pending anyway.
        let _ = self.evfd.write(1);
    }

    fn drain_eventfd(&self) {
        // Non-blocking: an empty counter (EAGAIN) was drained already.
        let _ = self.evfd.read();
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake();
    }

    /// Whether this thread is this reactor's.
    fn is_current(self: &Arc<Self>) -> bool {
        CURRENT.with(|c| c.get() == Arc::as_ptr(self) as usize)
    }

    /// A volume completed request `tag` of connection `token`: inline on the reactor's own
    /// thread it is queued locally (no lock, no wake-up); from another thread it is posted.
    pub(crate) fn complete(self: &Arc<Self>, token: u64, tag: u64, result: IoResult) {
        if self.is_current() {
            LOCAL.with(|l| l.borrow_mut().push((token, tag, result)));
        } else {
            self.post(Mail::Done { token, tag, result });
        }
    }
}

/// The reactor threads of one target.
pub(crate) struct Reactors {
    shared: Vec<Arc<Shared>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    pub(crate) policy: PollPolicy,
}

impl Reactors {
    /// Start `n` reactor threads (at least one) that poll as `policy` says. One that cannot
    /// be started is left out with a warning; with none at all, connections are closed as
    /// they arrive.
    pub(crate) fn start(n: usize, policy: PollPolicy) -> Reactors {
        let mut shared = Vec::new();
        let mut threads = Vec::new();
        for i in 0..n.max(1) {
            let started = Shared::new().and_then(|s| {
                let t = std::thread::Builder::new()
                    .name(format!("nvmf-reactor-{i}"))
                    .spawn({
                        let s = s.clone();
                        move || Reactor::new(s, policy).run(false)
                    })?;
                Ok((s, t))
            });
            match started {
                Ok((s, t)) => {
                    shared.push(s);
                    threads.push(t);
                }
                Err(e) => warn!("cannot start NVMe/TCP reactor {i}: {e}"),
            }
        }
        Reactors {
            shared,
            threads: Mutex::new(threads),
            policy,
        }
    }

    /// Each reactor's counts, as last published (at most [`SCAN_EVERY`] old while busy).
    pub(crate) fn stats(&self) -> Vec<ReactorStats> {
        self.shared
            .iter()
            .map(|s| {
                let c = &s.counters;
                ReactorStats {
                    connections: s.load.load(Ordering::Relaxed),
                    busy_passes: c.busy_passes.load(Ordering::Relaxed),
                    idle_polls: c.idle_polls.load(Ordering::Relaxed),
                    sleeps: c.sleeps.load(Ordering::Relaxed),
                    deep_sleeps: c.deep_sleeps.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    /// Hand a connection to the reactor owning the fewest.
    pub(crate) fn assign(&self, c: NewConn) {
        let Some(r) = self
            .shared
            .iter()
            .min_by_key(|s| s.load.load(Ordering::Relaxed))
        else {
            warn!("no NVMe/TCP reactor is running: closing a new connection");
            return;
        };
        r.load.fetch_add(1, Ordering::Relaxed);
        r.post(Mail::Conn(Box::new(c)));
    }

    /// Stop every reactor: each closes its connections and exits.
    pub(crate) fn stop(&self) {
        for s in &self.shared {
            s.stop();
        }
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
    }
}

/// Serve one connection on the calling thread until it ends (a reactor of its own, polling
/// as `policy` says).
pub(crate) fn serve_here(c: NewConn, policy: PollPolicy) {
    match Shared::new() {
        Ok(s) => {
            s.post(Mail::Conn(Box::new(c)));
            Reactor::new(s, policy).run(true);
        }
        Err(e) => warn!("cannot set up an NVMe/TCP reactor: {e}"),
    }
}

/// Tokens are handed out once; hashing them would only cost time.
#[derive(Default)]
struct TokenHasher(u64);

impl Hasher for TokenHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 tokens are hashed")
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type ConnMap = HashMap<u64, Conn, BuildHasherDefault<TokenHasher>>;

struct Reactor {
    shared: Arc<Shared>,
    conns: ConnMap,
    next_token: u64,
    /// `epoll_wait`'s output, reused by every wait.
    events: Vec<EpollEvent>,
    mail: Vec<Mail>,
    local: Vec<(u64, u64, IoResult)>,
    /// Connections with replies to flush at the end of this pass.
    dirty: Vec<u64>,
    /// Connections whose replies were held at the end of the last pass (`Conn::hold_replies`):
    /// decided again at the end of this one. The reactor does not sleep while any is.
    held: Vec<u64>,
    poll_ns: u64,
    /// The most replies one connection's flush carried in this pass: the depth its host
    /// keeps in flight (see [`DepthGate`]).
    answered: u32,
    gate: DepthGate,
    policy: PollPolicy,
    /// This thread's [`Counters`], published now and then.
    busy_passes: u64,
    idle_polls: u64,
    sleeps: u64,
    deep_sleeps: u64,
    last_scan: Instant,
}

impl Reactor {
    fn new(shared: Arc<Shared>, policy: PollPolicy) -> Reactor {
        Reactor {
            shared,
            conns: ConnMap::default(),
            next_token: 1,
            events: vec![EpollEvent::default(); EVENTS],
            mail: Vec::new(),
            local: Vec::new(),
            dirty: Vec::new(),
            held: Vec::new(),
            poll_ns: if policy == PollPolicy::Off {
                0
            } else {
                MAX_POLL_NS
            },
            answered: 0,
            gate: DepthGate::default(),
            policy,
            busy_passes: 0,
            idle_polls: 0,
            sleeps: 0,
            deep_sleeps: 0,
            last_scan: Instant::now(),
        }
    }

    /// The loop; `until_empty` ends it once the last connection is gone (a reactor of one
    /// connection, [`serve_here`]).
    fn run(mut self, until_empty: bool) {
        CURRENT.with(|c| c.set(Arc::as_ptr(&self.shared) as usize));
        let mut idle_since = Instant::now();
        // One clock read per pass, at its end.
        let mut now = idle_since;
        loop {
            if self.shared.stop.load(Ordering::SeqCst) {
                break;
            }
            let mut work = self.take_mail();
            // Tokens count connections handed over, taken or refused.
            if until_empty && self.next_token > 1 && self.conns.is_empty() {
                break;
            }
            // Held replies go out at the end of the next pass: never sleep on them.
            let deep = self.policy == PollPolicy::Adaptive && self.gate.deep;
            let polling = !self.held.is_empty()
                || (!deep && now.duration_since(idle_since).as_nanos() as u64 <= self.poll_ns);
            let n = if work || polling {
                let n = self.wait(0);
                self.idle_polls += u64::from(n == 0 && !work);
                n
            } else {
                self.deep_sleeps += u64::from(deep);
                self.sleep(!deep)
            };
            // One clock read for the statistics of everything this pass's events bring
            // (telemetry::clock): commands parsed and completions reaped in it alike.
            let batch = (n > 0).then(crate::telemetry::clock::batch);
            for i in 0..n {
                let ev = self.events[i];
                let (token, bits) = (ev.data(), ev.events());
                if token == WAKE_TOKEN {
                    self.shared.drain_eventfd();
                    continue;
                }
                work = true;
                self.with_conn(token, |c| c.on_ready(bits));
                self.run_local();
            }
            drop(batch);
            now = Instant::now();
            self.answered = 0;
            self.flush_dirty(now);
            self.gate.flushed(self.answered);
            work |= !self.dirty.is_empty() || !self.held.is_empty();
            if now.duration_since(self.last_scan) >= SCAN_EVERY {
                self.last_scan = now;
                self.scan(now);
                self.publish();
            }
            if work {
                self.busy_passes += 1;
                idle_since = now;
            }
        }
        let left = self.conns.len();
        for (_, mut c) in self.conns.drain() {
            c.abandon();
        }
        // Connections handed over but never taken are closed here; what else was posted no
        // longer has a connection to go to. (Mail left in the box would also keep the
        // target alive: a new connection holds it.)
        drop(std::mem::take(&mut *lock(&self.shared.mail)));
        if left > 0 {
            tracing::debug!(left, "nvmf reactor stopped: connections closed");
        }
        CURRENT.with(|c| c.set(0));
    }

    fn wait(&mut self, timeout_ms: i32) -> usize {
        match self.shared.epoll.wait(timeout_ms, &mut self.events) {
            Ok(n) => n,
            Err(e) => {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    error!("nvmf reactor: epoll_wait failed: {e}");
                    std::thread::sleep(Duration::from_millis(1));
                }
                0
            }
        }
    }

    /// Make this thread's counts visible to `nvmf_get_stats`.
    fn publish(&self) {
        let c = &self.shared.counters;
        c.busy_passes.store(self.busy_passes, Ordering::Relaxed);
        c.idle_polls.store(self.idle_polls, Ordering::Relaxed);
        c.sleeps.store(self.sleeps, Ordering::Relaxed);
        c.deep_sleeps.store(self.deep_sleeps, Ordering::Relaxed);
    }

    /// Block until readiness, mail, or the next deadline; `adapt`: let how long it took
    /// tune the busy-poll window (not for a sleep the depth rule chose).
    fn sleep(&mut self, adapt: bool) -> usize {
        self.sleeps += 1;
        // An idle reactor's counts are current.
        self.publish();
        let t0 = Instant::now();
        self.shared.sleeping.store(true, Ordering::SeqCst);
        if self.shared.has_mail.load(Ordering::SeqCst) {
            self.shared.sleeping.store(false, Ordering::SeqCst);
            return 0;
        }
        // Sleep until the next deadline, or until woken: an idle connected queue has none
        // (keep-alive is the reaper thread's; it closes through the mailbox).
        let timeout = match self.conns.values().filter_map(Conn::next_deadline).min() {
            None => -1,
            Some(d) => {
                let ms = d.saturating_duration_since(t0).as_micros().div_ceil(1000);
                ms.min(MAX_SLEEP_MS as u128) as i32
            }
        };
        let n = self.wait(timeout);
        self.shared.sleeping.store(false, Ordering::SeqCst);
        // Adapt the busy-poll window as the vhost-user-blk worker does: a sleep shorter
        // than the window means polling longer would have caught the work; a long one means
        // polling burns a core for nothing.
        let blocked = t0.elapsed().as_nanos() as u64;
        if self.policy == PollPolicy::Off || !adapt {
            // No window to tune.
        } else if n > 0 && blocked <= MAX_POLL_NS {
            self.poll_ns = (self.poll_ns * 2).clamp(MIN_POLL_NS, MAX_POLL_NS);
        } else if n > 0 || blocked > MAX_POLL_NS {
            self.poll_ns /= 2;
            if self.poll_ns < MIN_POLL_NS {
                self.poll_ns = 0;
            }
        }
        n
    }

    /// Take what other threads posted; true if there was any.
    fn take_mail(&mut self) -> bool {
        if !self.shared.has_mail.load(Ordering::SeqCst) {
            return false;
        }
        self.shared.has_mail.store(false, Ordering::SeqCst);
        // Completions posted by other threads: one clock read for all of them.
        let _batch = crate::telemetry::clock::batch();
        std::mem::swap(&mut self.mail, &mut *lock(&self.shared.mail));
        let mut mail = std::mem::take(&mut self.mail);
        let any = !mail.is_empty();
        for m in mail.drain(..) {
            match m {
                Mail::Conn(nc) => self.add(*nc),
                Mail::Done { token, tag, result } => {
                    self.with_conn(token, |c| c.complete(tag, result))
                }
                Mail::Async {
                    token,
                    cid,
                    status,
                    dw0,
                } => self.with_conn(token, |c| c.complete_async(cid, status, dw0)),
                Mail::Close(token) => self.with_conn(token, |c| c.request_close()),
            }
            self.run_local();
        }
        self.mail = mail;
        any
    }

    fn add(&mut self, nc: NewConn) {
        let token = self.next_token;
        self.next_token += 1;
        match Conn::new(token, self.shared.clone(), nc) {
            Ok(c) => {
                self.conns.insert(token, c);
            }
            Err(e) => {
                self.shared.load.fetch_sub(1, Ordering::Relaxed);
                warn!("cannot serve an NVMe/TCP connection: {e}");
            }
        }
    }

    /// Run `f` on connection `token` (if it still exists); a panic costs the host that
    /// connection, never the reactor's other connections. Queues the connection for a flush
    /// and drops it once it is finished.
    fn with_conn(&mut self, token: u64, f: impl FnOnce(&mut Conn)) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(c)));
        if r.is_err() {
            error!(
                peer = ?c.peer(),
                "internal error serving an NVMe/TCP connection: closing it"
            );
            c.close_now();
        }
        if c.wants_flush() {
            self.dirty.push(token);
        }
        if c.finished() {
            self.remove(token);
        }
    }

    fn remove(&mut self, token: u64) {
        if self.conns.remove(&token).is_some() {
            self.shared.load.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Completions the volumes produced on this thread, until none are left (handling one
    /// may submit the next request of a chain, which may complete inline again).
    fn run_local(&mut self) {
        loop {
            LOCAL.with(|l| std::mem::swap(&mut *l.borrow_mut(), &mut self.local));
            if self.local.is_empty() {
                return;
            }
            let mut local = std::mem::take(&mut self.local);
            for (token, tag, result) in local.drain(..) {
                self.with_conn(token, |c| c.complete(tag, result));
            }
            self.local = local;
        }
    }

    /// Flush every connection with replies. Flushing may resume a connection that had
    /// stopped reading (its output drained), and what it then parses has replies of its
    /// own: a few rounds, the rest waits for the next pass.
    fn flush_dirty(&mut self, now: Instant) {
        // Held connections are still queued for a flush (so not in `dirty` twice): decide
        // for them again, with what this pass brought.
        let held = std::mem::take(&mut self.held);
        self.dirty.extend_from_slice(&held);
        for _ in 0..4 {
            if self.dirty.is_empty() {
                return;
            }
            let mut dirty = std::mem::take(&mut self.dirty);
            for token in dirty.drain(..) {
                let (mut hold, mut answered) = (false, 0);
                self.with_conn(token, |c| {
                    (hold, answered) = c.hold_replies(now);
                    if !hold {
                        c.flush();
                    }
                });
                self.answered = self.answered.max(answered);
                if hold && self.conns.contains_key(&token) {
                    self.held.push(token);
                }
                self.run_local();
            }
            if self.dirty.is_empty() {
                self.dirty = dirty;
            }
        }
    }

    /// Deadlines: setup, per PDU, stalled sends, lingering closes.
    fn scan(&mut self, now: Instant) {
        let tokens: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.next_deadline().is_some_and(|d| now >= d))
            .map(|(t, _)| *t)
            .collect();
        for t in tokens {
            self.with_conn(t, |c| c.on_deadline(now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_gate_sleeps_for_deep_hosts_with_hysteresis() {
        let mut g = DepthGate::default();
        assert!(!g.deep, "a new reactor polls");
        // Shallow and middling flushes leave a polling reactor polling.
        for a in [1, 2, 4, SLEEP_DEPTH - 1, 0] {
            g.flushed(a);
            assert!(!g.deep, "{a}");
        }
        g.flushed(SLEEP_DEPTH);
        assert!(g.deep);
        // Between the depths, and passes without a flush, keep it sleeping...
        for a in [0, POLL_DEPTH + 1, SLEEP_DEPTH - 1, 32] {
            g.flushed(a);
            assert!(g.deep, "{a}");
        }
        // ... until a host waits on its replies again.
        g.flushed(POLL_DEPTH);
        assert!(!g.deep);
        g.flushed(SLEEP_DEPTH + 10);
        g.flushed(1);
        assert!(!g.deep);
    }

    #[test]
    fn poll_policy_names_round_trip() {
        use clap::ValueEnum;
        for p in PollPolicy::ALL {
            assert_eq!(PollPolicy::from_str(p.as_str(), false), Ok(p));
        }
        assert_eq!(PollPolicy::default(), PollPolicy::Adaptive);
    }
}
