//! The initiator's reactors: a few threads, each owning many NVMe/TCP queues through one
//! epoll set, in place of a reader and a writer thread per queue (with a remote
//! controller of 1 + 4 queues, and a volume striped over several, those were tens of threads
//! on a DPU slice of a few cores, each wake-up a context switch).
//!
//! A queue is registered when its connection is initialised and deregistered by its reactor
//! when it closes. On readiness the reactor parses what arrived (`rx.rs`: a resumable
//! parser, since a long C2HData PDU may arrive over many wake-ups), and on a socket that had
//! refused part of a send (`EPOLLOUT`, armed by the sender) it sends the rest. Everything
//! else is sent by whoever produced it: a submitter (or a closing plug) sends its capsules
//! itself with a non-blocking `send`, the reactor its H2CData answers to R2Ts.
//!
//! The reactors sleep in `epoll_wait` (no busy-poll): on a DPU the cores are shared with the
//! vhost-user-blk workers and crypto, and measurements (docs/benchmarks.md) showed spinning on
//! the initiator's side costs more than the wake-ups it saves.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tracing::{error, warn};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::QueueConn;

/// Readiness events taken per `epoll_wait`.
const EVENTS: usize = 64;

/// Default reactor count: one per core, at most this many (the same rule as the target's).
pub const MAX_DEFAULT_REACTORS: usize = 4;

fn default_count() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_DEFAULT_REACTORS)
}

/// A pool of initiator reactors, as a controller's configuration names it
/// (`ControllerConfig::tcp_reactors`). The threads start with the pool's first queue and
/// then run as long as the process. Cloning shares the pool.
#[derive(Clone)]
pub struct Reactors(Arc<Lazy>);

struct Lazy {
    /// Threads to start (0: [`default_count`]).
    count: usize,
    pool: OnceLock<Pool>,
}

impl std::fmt::Debug for Reactors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reactors")
            .field("count", &self.0.count)
            .field("started", &self.0.pool.get().map(|p| p.pollers.len()))
            .finish()
    }
}

impl Default for Reactors {
    /// [`Reactors::shared`].
    fn default() -> Self {
        Reactors::shared()
    }
}

impl Reactors {
    /// A pool of its own of `n` threads (nacred's `--fabric-reactors`); 0 is the same as
    /// [`Reactors::shared`].
    pub fn new(n: usize) -> Reactors {
        if n == 0 {
            return Reactors::shared();
        }
        Reactors(Arc::new(Lazy {
            count: n,
            pool: OnceLock::new(),
        }))
    }

    /// The process's pool of the default size (one thread per core, at most
    /// [`MAX_DEFAULT_REACTORS`]), shared by every controller that does not name one of its
    /// own: started once, so tests and tools that open many controllers do not start
    /// threads for each.
    pub fn shared() -> Reactors {
        static SHARED: OnceLock<Reactors> = OnceLock::new();
        SHARED
            .get_or_init(|| {
                Reactors(Arc::new(Lazy {
                    count: 0,
                    pool: OnceLock::new(),
                }))
            })
            .clone()
    }

    fn pool(&self) -> &Pool {
        self.0.pool.get_or_init(|| {
            let n = match self.0.count {
                0 => default_count(),
                n => n,
            };
            Pool::start(n)
        })
    }

    /// Pick the reactor for a new queue: the one serving the fewest queues, the first such
    /// after the last one picked (so the queues of one controller spread over the reactors).
    pub(super) fn pick(&self) -> std::io::Result<Home> {
        let pool = self.pool();
        let n = pool.pollers.len();
        if n == 0 {
            return Err(std::io::Error::other(
                "no NVMe/TCP initiator reactor is running",
            ));
        }
        let start = pool.next.fetch_add(1, Ordering::Relaxed);
        let poller = (0..n)
            .map(|i| &pool.pollers[(start + i) % n])
            .min_by_key(|p| p.load())
            .expect("at least one")
            .clone();
        let token = poller.next_token.fetch_add(1, Ordering::Relaxed);
        Ok(Home { poller, token })
    }
}

/// One reactor as queues and other threads see it.
struct Poller {
    epoll: Epoll,
    /// The queues this reactor serves, by epoll token. Touched once per wake-up (to find the
    /// ready queues) and when a queue comes or goes.
    conns: Mutex<HashMap<u64, Arc<QueueConn>>>,
    next_token: AtomicU64,
}

/// Where a registered queue lives: its reactor and its token there.
pub(super) struct Home {
    poller: Arc<Poller>,
    token: u64,
}

struct Pool {
    pollers: Vec<Arc<Poller>>,
    next: AtomicUsize,
}

impl Pool {
    fn start(n: usize) -> Pool {
        let mut pollers = Vec::new();
        for i in 0..n.max(1) {
            let started = Poller::new().and_then(|p| {
                let run = p.clone();
                std::thread::Builder::new()
                    .name(format!("fabric-tcp-{i}"))
                    .spawn(move || run.run())?;
                Ok(p)
            });
            match started {
                Ok(p) => pollers.push(p),
                Err(e) => warn!("cannot start NVMe/TCP initiator reactor {i}: {e}"),
            }
        }
        Pool {
            pollers,
            next: AtomicUsize::new(0),
        }
    }
}

impl Home {
    /// Start serving `q` (its socket non-blocking and initialised, this its `home`).
    pub(super) fn add(&self, q: &Arc<QueueConn>) -> std::io::Result<()> {
        lock(&self.poller.conns).insert(self.token, q.clone());
        if let Err(e) = self
            .poller
            .ctl(ControlOperation::Add, q.fd(), self.token, false)
        {
            lock(&self.poller.conns).remove(&self.token);
            return Err(e);
        }
        Ok(())
    }

    /// Arm or disarm `EPOLLOUT` for `q`.
    pub(super) fn want_out(&self, q: &QueueConn, out: bool) -> std::io::Result<()> {
        self.poller
            .ctl(ControlOperation::Modify, q.fd(), self.token, out)
    }

    /// Whether two queues are served by the same reactor.
    #[cfg(test)]
    pub(super) fn same_reactor(&self, other: &Home) -> bool {
        Arc::ptr_eq(&self.poller, &other.poller)
    }

    /// Stop serving `q` (its reactor, when the queue closes).
    pub(super) fn remove(&self, q: &QueueConn) {
        let _ = self
            .poller
            .ctl(ControlOperation::Delete, q.fd(), self.token, false);
        lock(&self.poller.conns).remove(&self.token);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Poller {
    fn new() -> std::io::Result<Arc<Poller>> {
        Ok(Arc::new(Poller {
            epoll: Epoll::new()?,
            conns: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(0),
        }))
    }

    fn load(&self) -> usize {
        lock(&self.conns).len()
    }

    /// `epoll_ctl` for a queue's socket: readable always, writable when `out`.
    fn ctl(&self, op: ControlOperation, fd: RawFd, token: u64, out: bool) -> std::io::Result<()> {
        let mut events = EventSet::IN | EventSet::READ_HANG_UP;
        if out {
            events |= EventSet::OUT;
        }
        self.epoll.ctl(op, fd, EpollEvent::new(events, token))
    }

    fn run(self: Arc<Self>) {
        // Reused by every wait: nothing is allocated per wake-up.
        let mut events = vec![EpollEvent::default(); EVENTS];
        let mut ready: Vec<(Arc<QueueConn>, u32)> = Vec::with_capacity(EVENTS);
        loop {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) => {
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        error!("NVMe/TCP initiator reactor: epoll_wait failed: {e}");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    continue;
                }
            };
            {
                let conns = lock(&self.conns);
                ready.extend(
                    events[..n]
                        .iter()
                        .filter_map(|ev| conns.get(&ev.data()).map(|q| (q.clone(), ev.events()))),
                );
            }
            for (q, ev) in ready.drain(..) {
                // What a queue's completions run is other code (vhost-user-blk, XTS,
                // multipath): a panic there costs that queue, whose commands go back to its
                // controller, never the other queues this thread serves.
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| q.on_ready(ev)));
                if r.is_err() {
                    error!(
                        qid = q.qid,
                        "internal error serving an NVMe/TCP queue: closing it"
                    );
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        q.close(super::Fatal::quiet("internal error in nacred"))
                    }));
                    if r.is_err() {
                        // Its commands are lost to their owner, but the queue is gone
                        // from this reactor (close removes it first).
                        error!(qid = q.qid, "internal error closing an NVMe/TCP queue");
                    }
                }
            }
        }
    }
}
