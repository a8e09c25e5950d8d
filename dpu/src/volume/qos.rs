//! QoS: token-bucket rate limits per volume, per tenant and daemon-wide, as a [`BlockDevice`]
//! layer on top of every opened volume, so each frontend that serves a volume (vhost-user-blk,
//! NVMe/TCP, anything later) is limited the same way.
//!
//! Each limit is a token bucket (RFC 2697's single-rate bucket without colours): `rate` tokens
//! per second flow in up to `depth` = rate × burst; an I/O takes 1 token from each IOPS bucket
//! and `len` tokens from each bytes bucket it counts against. A request is admitted when every
//! bucket it needs holds at least `min(cost, depth)` tokens, and then takes its full cost, so a
//! request larger than a bucket passes (the bucket goes into debt) and the long-run rate is
//! still exact. There is no floor (SPDK's bdev QoS refuses less than 1000 IOPS): 1 IOPS works.
//!
//! A request that cannot be admitted is queued, never blocked on: the frontend's thread goes
//! on, and a pacer thread admits queued requests as tokens arrive (completions then come
//! from the pacer thread, as they do from any asynchronous device). Volumes keep FIFO order.
//! Under contention for the daemon-wide bucket, tenants share it by weight: the pacer admits
//! the head whose tenant has the least virtual time, and each admission advances the tenant's
//! virtual time by 1/weight (start-time fair queueing over operations).
//!
//! Limits change online: [`Qos::set`] rebuilds the buckets in place (tokens clamped to the new
//! depth) and wakes the pacer, so the new rate applies from the next admission.
//!
//! Everything limiter-related sits under one mutex that is taken only by requests some limit
//! applies to; a volume with no limit on it, its tenant or the daemon checks one atomic flag.

use std::cell::UnsafeCell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use nacre_shared::api::qos::{QosLimits, DEFAULT_BURST_MS, DEFAULT_WEIGHT};
use tracing::trace;

use super::{BlockDevice, Geometry, IoCompletion, IoKind, IoRequest, IoResult};
use crate::telemetry::{self, Telemetry, VolumeMetrics};

/// Time as the limiter sees it: injectable so tests are deterministic.
pub trait Clock: Send + Sync {
    /// Time since an arbitrary fixed origin; never goes backwards.
    fn now(&self) -> Duration;

    /// The same clock at `ns`, an instant of [`telemetry::clock`] the caller already read
    /// (the request's arrival: no clock read of the limiter's own on the data path). Clocks
    /// other than the monotonic one ignore it.
    fn at_ns(&self, _ns: u64) -> Duration {
        self.now()
    }
}

/// The monotonic clock ([`telemetry::clock`]'s, so arrival instants need no conversion).
#[derive(Default)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(telemetry::clock::read_ns())
    }

    fn at_ns(&self, ns: u64) -> Duration {
        Duration::from_nanos(ns)
    }
}

/// One token bucket.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: f64,
    depth: f64,
    tokens: f64,
    last: Duration,
}

/// Floating-point slack when comparing tokens, so a pacer that wakes exactly on time admits.
const EPS: f64 = 1e-6;

impl TokenBucket {
    /// A full bucket of `rate` per second holding `burst` worth of it (at least one token).
    pub fn new(rate: u64, burst: Duration, now: Duration) -> Self {
        let depth = Self::depth_of(rate, burst);
        TokenBucket {
            rate: rate as f64,
            depth,
            tokens: depth,
            last: now,
        }
    }

    fn depth_of(rate: u64, burst: Duration) -> f64 {
        (rate as f64 * burst.as_secs_f64()).max(1.0)
    }

    /// Change rate and burst, keeping the tokens earned so far (clamped to the new depth).
    pub fn reconfigure(&mut self, rate: u64, burst: Duration, now: Duration) {
        self.refill(now);
        self.rate = rate as f64;
        self.depth = Self::depth_of(rate, burst);
        self.tokens = self.tokens.min(self.depth);
    }

    pub fn refill(&mut self, now: Duration) {
        if now > self.last {
            let dt = (now - self.last).as_secs_f64();
            self.tokens = (self.tokens + self.rate * dt).min(self.depth);
            self.last = now;
        }
    }

    /// How long until `cost` may be admitted (zero: now). Call after [`refill`](Self::refill).
    pub fn wait(&self, cost: f64) -> Duration {
        let need = cost.min(self.depth);
        if self.tokens + EPS >= need {
            Duration::ZERO
        } else {
            // Round up to the microsecond so the pacer never wakes a hair too early.
            Duration::from_secs_f64((need - self.tokens) / self.rate + 1e-6)
        }
    }

    pub fn take(&mut self, cost: f64) {
        self.tokens -= cost;
    }

    pub fn tokens(&self) -> f64 {
        self.tokens
    }
}

/// Which buckets an operation counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Read,
    Write,
    /// Discard and Write Zeroes: write IOPS and total IOPS, no bytes.
    WriteNoData,
    /// Flush: total IOPS only.
    Other,
}

/// Bucket indices in [`Buckets::b`].
const IOPS: usize = 0;
const READ_IOPS: usize = 1;
const WRITE_IOPS: usize = 2;
const BPS: usize = 3;
const READ_BPS: usize = 4;
const WRITE_BPS: usize = 5;

impl Dir {
    fn of(kind: IoKind) -> Dir {
        match kind {
            IoKind::Read => Dir::Read,
            IoKind::Write => Dir::Write,
            IoKind::Discard | IoKind::WriteZeroes => Dir::WriteNoData,
            IoKind::Flush => Dir::Other,
        }
    }

    /// The buckets this direction counts against, each with whether it costs bytes (else 1).
    fn buckets(self) -> &'static [(usize, bool)] {
        match self {
            Dir::Read => &[
                (IOPS, false),
                (READ_IOPS, false),
                (BPS, true),
                (READ_BPS, true),
            ],
            Dir::Write => &[
                (IOPS, false),
                (WRITE_IOPS, false),
                (BPS, true),
                (WRITE_BPS, true),
            ],
            Dir::WriteNoData => &[(IOPS, false), (WRITE_IOPS, false)],
            Dir::Other => &[(IOPS, false)],
        }
    }
}

/// The six buckets of one limit set.
#[derive(Debug, Clone, Default)]
struct Buckets {
    limits: QosLimits,
    /// Indexed by [`IOPS`] … [`WRITE_BPS`]; `None`: no such limit.
    b: [Option<TokenBucket>; 6],
}

impl Buckets {
    fn active(&self) -> bool {
        !self.limits.is_unlimited()
    }

    fn configure(&mut self, limits: &QosLimits, now: Duration) {
        let burst = Duration::from_millis(limits.burst_ms.unwrap_or(DEFAULT_BURST_MS) as u64);
        let rates = [
            limits.iops,
            limits.read_iops,
            limits.write_iops,
            limits.bps,
            limits.read_bps,
            limits.write_bps,
        ];
        for (b, rate) in self.b.iter_mut().zip(rates) {
            match (b.as_mut(), rate) {
                (_, None) => *b = None,
                (Some(tb), Some(r)) => tb.reconfigure(r, burst, now),
                (None, Some(r)) => *b = Some(TokenBucket::new(r, burst, now)),
            }
        }
        self.limits = limits.clone();
    }

    /// The buckets `dir` counts against, with each one's index and cost.
    fn each(&mut self, dir: Dir, bytes: u64, mut f: impl FnMut(usize, &mut TokenBucket, f64)) {
        for &(i, by_bytes) in dir.buckets() {
            if let Some(tb) = &mut self.b[i] {
                f(i, tb, if by_bytes { bytes as f64 } else { 1.0 })
            }
        }
    }

    fn wait(&mut self, dir: Dir, bytes: u64, now: Duration) -> Duration {
        let mut w = Duration::ZERO;
        self.each(dir, bytes, |_, tb, cost| {
            tb.refill(now);
            w = w.max(tb.wait(cost));
        });
        w
    }

    fn take(&mut self, dir: Dir, bytes: u64) {
        self.each(dir, bytes, |_, tb, cost| tb.take(cost));
    }

    /// Hand back a thread's unused credit (see [`Credit`]); the bucket stays within its depth.
    fn give_back(&mut self, credit: &mut [f64; 6]) {
        for (b, c) in self.b.iter_mut().zip(credit.iter_mut()) {
            if let Some(tb) = b {
                if c.is_finite() && *c > 0.0 {
                    tb.tokens = (tb.tokens + *c).min(tb.depth);
                }
            }
            *c = 0.0;
        }
    }

    /// Move up to [`CREDIT_GRANT`] worth of each bucket's tokens to a thread's credit; a
    /// bucket that does not exist is unlimited credit.
    fn grant(&mut self, credit: &mut [f64; 6]) {
        for (b, c) in self.b.iter_mut().zip(credit.iter_mut()) {
            *c = match b {
                None => f64::INFINITY,
                Some(tb) => {
                    let g = tb.tokens.min(tb.rate * CREDIT_GRANT.as_secs_f64()).max(0.0);
                    tb.tokens -= g;
                    g
                }
            };
        }
    }
}

/// How much of a bucket's rate one thread may take ahead for its lock-free fast path. Tokens
/// only move (bucket → credit → request, or back): the long-run rate stays exact, and a
/// limit change or queueing costs at most this much extra per thread.
const CREDIT_GRANT: Duration = Duration::from_millis(1);

/// Tokens one thread slot took ahead from the buckets of one volume, its tenant and the
/// daemon ([`Buckets::grant`]): requests they cover are admitted without the limiter's lock.
/// Valid while `generation` matches [`Qos::generation`] (every limit change bumps it).
///
/// Two levels, both private to the thread: `tokens` is what the grant moved out of each
/// bucket; `budget` is what was carved out of `tokens` for one [`Dir`] alone — whole
/// operations and bytes, taken from every bucket that direction counts against at once. A
/// request then costs one direction-indexed pair of integer compares ([`Credit::try_take`]);
/// the buckets are looked at again only when that direction's budget runs short
/// ([`Credit::carve`]), and carved budget goes back to the buckets exactly as it came
/// ([`Credit::fold`]).
#[derive(Default)]
struct Credit {
    generation: u64,
    /// Volume, tenant, daemon; by bucket index. A bucket that does not exist is infinite.
    tokens: [[f64; 6]; 3],
    /// Per [`Dir`]: the finite entries of `tokens` it takes from, so carving looks at the one
    /// or two buckets a typical limit has, not at all eighteen.
    need: [Need; 4],
    /// Per [`Dir`]: operations and bytes carved for it; [`UNBOUNDED`] where no bucket of that
    /// kind applies.
    budget: [Budget; 4],
}

#[derive(Default, Clone, Copy)]
struct Need {
    n: usize,
    /// (index into the flattened `tokens`, costs bytes).
    at: [(u8, bool); 12],
}

#[derive(Default, Clone, Copy)]
struct Budget {
    ops: u64,
    bytes: u64,
}

/// A budget no run exhausts: the direction is not limited in that dimension.
const UNBOUNDED: u64 = u64::MAX / 2;

impl Credit {
    /// Recompute `need` after a grant; nothing is carved yet.
    fn plan(&mut self) {
        for dir in [Dir::Read, Dir::Write, Dir::WriteNoData, Dir::Other] {
            let mut need = Need::default();
            for (lvl, tokens) in self.tokens.iter().enumerate() {
                for &(i, by_bytes) in dir.buckets() {
                    if tokens[i].is_finite() {
                        need.at[need.n] = ((lvl * 6 + i) as u8, by_bytes);
                        need.n += 1;
                    }
                }
            }
            self.need[dir as usize] = need;
        }
        self.budget = Default::default();
    }

    /// Void: nothing left, until the next grant.
    fn clear(&mut self) {
        self.generation = 0;
        self.tokens = Default::default();
        self.budget = Default::default();
    }

    /// Admit from this direction's budget alone, carving more from the buckets' credit when
    /// it runs short.
    #[inline(always)]
    fn try_take(&mut self, dir: Dir, bytes: u64) -> bool {
        let b = &mut self.budget[dir as usize];
        if b.ops >= 1 && b.bytes >= bytes {
            b.ops -= 1;
            b.bytes -= bytes;
            return true;
        }
        self.carve(dir, bytes)
    }

    /// Move credit from `tokens` into `dir`'s budget so it covers one request of `bytes`,
    /// plus half again of what is left (so a thread alternating directions carves rarely,
    /// and leaves the other directions something), and take the request. Carves nothing when
    /// the credit cannot cover it: the locked path folds everything back then.
    #[cold]
    #[inline(never)]
    fn carve(&mut self, dir: Dir, bytes: u64) -> bool {
        let need = self.need[dir as usize];
        let at = &need.at[..need.n];
        let tokens = self.tokens.as_flattened_mut();
        let b = &mut self.budget[dir as usize];
        // Per dimension (operations, bytes): what this direction holds, what one request costs,
        // and the least credit among the buckets of that kind it counts against.
        let avail = |by_bytes: bool| {
            at.iter()
                .filter(|&&(_, bb)| bb == by_bytes)
                .map(|&(p, _)| tokens[p as usize].max(0.0).floor() as u64)
                .min()
        };
        let dims = [
            (false, b.ops, 1, avail(false)),
            (true, b.bytes, bytes, avail(true)),
        ];
        if dims
            .iter()
            .any(|&(_, have, cost, avail)| avail.is_some_and(|a| have + a < cost))
        {
            return false;
        }
        for (by_bytes, have, cost, avail) in dims {
            let carved = match avail {
                None => UNBOUNDED,
                Some(a) => {
                    let short = cost.saturating_sub(have);
                    let take = (short + (a - short).div_ceil(2)).min(a);
                    for &(p, bb) in at {
                        if bb == by_bytes {
                            tokens[p as usize] -= take as f64;
                        }
                    }
                    have + take
                }
            };
            if by_bytes {
                b.bytes = carved;
            } else {
                b.ops = carved;
            }
        }
        b.ops -= 1;
        b.bytes -= bytes;
        true
    }

    /// Put every direction's carved budget back into `tokens`, each bucket getting back what
    /// was carved from it.
    fn fold(&mut self) {
        let tokens = self.tokens.as_flattened_mut();
        for (need, b) in self.need.iter().zip(&mut self.budget) {
            for &(p, by_bytes) in &need.at[..need.n] {
                tokens[p as usize] += if by_bytes { b.bytes } else { b.ops } as f64;
            }
            *b = Budget::default();
        }
    }
}

fn bytes_of(dir: Dir, req: &IoRequest) -> u64 {
    match dir {
        Dir::Read | Dir::Write => req.len,
        _ => 0,
    }
}

/// A request waiting for tokens.
struct Pending {
    req: IoRequest,
    done: Arc<dyn IoCompletion>,
    dir: Dir,
    bytes: u64,
}

struct VolSched {
    name: String,
    tenant: Option<String>,
    buckets: Buckets,
    queue: VecDeque<Pending>,
    /// Where admitted requests go.
    inner: Arc<dyn BlockDevice>,
    metrics: Arc<VolumeMetrics>,
    /// Set while any limit applies to this volume (read lock-free by `submit`).
    limited: Arc<AtomicBool>,
    /// Fair-queueing virtual time of a volume without a tenant (weight: the default).
    vtime: f64,
}

struct TenantSched {
    buckets: Buckets,
    weight: u32,
    /// Start-time fair queueing: operations admitted / weight, caught up when it goes idle.
    vtime: f64,
}

impl Default for TenantSched {
    fn default() -> Self {
        TenantSched {
            buckets: Buckets::default(),
            weight: DEFAULT_WEIGHT,
            vtime: 0.0,
        }
    }
}

#[derive(Default)]
struct SchedState {
    global: Buckets,
    tenants: HashMap<String, TenantSched>,
    volume_limits: HashMap<String, QosLimits>,
    volumes: HashMap<u64, VolSched>,
    /// Requests queued over all volumes.
    queued: usize,
    /// Virtual time of the last admission through the pacer.
    vclock: f64,
    shutdown: bool,
}

/// A request the limiter let through, to submit outside the lock.
struct Admitted {
    inner: Arc<dyn BlockDevice>,
    req: IoRequest,
    done: Arc<dyn IoCompletion>,
}

impl Admitted {
    fn submit(self) {
        self.inner.submit(self.req, &self.done);
    }
}

/// Where tenants and volumes get their limits, and the pacer that admits queued requests.
pub struct Qos {
    clock: Arc<dyn Clock>,
    state: Mutex<SchedState>,
    wake: Condvar,
    next_id: AtomicU64,
    /// Bumped by every limit change: threads' [`Credit`] from before it is void.
    generation: AtomicU64,
    telemetry: Arc<Telemetry>,
}

impl Qos {
    /// A limiter on the monotonic clock with its pacer thread.
    pub fn start(telemetry: Arc<Telemetry>) -> Arc<Qos> {
        let q = Self::manual(Arc::new(MonotonicClock), telemetry);
        let weak = Arc::downgrade(&q);
        std::thread::Builder::new()
            .name("qos-pacer".into())
            .spawn(move || pacer(weak))
            .expect("spawn the QoS pacer thread");
        q
    }

    /// A limiter with no pacer thread: the caller runs [`Qos::pump`] (tests, with a fake clock).
    pub fn manual(clock: Arc<dyn Clock>, telemetry: Arc<Telemetry>) -> Arc<Qos> {
        Arc::new(Qos {
            clock,
            state: Mutex::new(SchedState::default()),
            wake: Condvar::new(),
            next_id: AtomicU64::new(1),
            generation: AtomicU64::new(1),
            telemetry,
        })
    }

    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.telemetry
    }

    fn lock(&self) -> MutexGuard<'_, SchedState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Put the QoS and statistics layer over an opened volume.
    pub fn wrap(
        self: &Arc<Self>,
        name: &str,
        tenant: Option<&str>,
        inner: Arc<dyn BlockDevice>,
    ) -> Arc<QosVolume> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let metrics = self.telemetry.volume(name, tenant);
        let limited = Arc::new(AtomicBool::new(false));
        let now = self.clock.now();
        let mut st = self.lock();
        let mut buckets = Buckets::default();
        if let Some(l) = st.volume_limits.get(name) {
            buckets.configure(&l.clone(), now);
        }
        st.volumes.insert(
            id,
            VolSched {
                name: name.to_string(),
                tenant: tenant.map(str::to_string),
                buckets,
                queue: VecDeque::new(),
                inner: inner.clone(),
                metrics: metrics.clone(),
                limited: limited.clone(),
                vtime: 0.0,
            },
        );
        if let Some(t) = tenant {
            st.tenants.entry(t.to_string()).or_default();
        }
        refresh_flags(&mut st);
        drop(st);
        Arc::new_cyclic(|me| QosVolume {
            me: me.clone(),
            inner,
            id,
            limited,
            qos: self.clone(),
            metrics,
            locals: (0..telemetry::clock::SLOTS)
                .map(|_| Local(UnsafeCell::new(Default::default())))
                .collect(),
        })
    }

    /// Replace the limits of a volume (by name), a tenant, or the daemon (`None`, `None`).
    /// `None` limits (or unlimited ones) remove the limit. Takes effect at once.
    pub fn set(&self, volume: Option<&str>, tenant: Option<&str>, limits: Option<&QosLimits>) {
        let now = self.clock.now();
        let mut st = self.lock();
        let empty = QosLimits::default();
        let l = limits.unwrap_or(&empty);
        match (volume, tenant) {
            (Some(v), _) => {
                if limits.is_some() {
                    st.volume_limits.insert(v.to_string(), l.clone());
                } else {
                    st.volume_limits.remove(v);
                }
                for vs in st.volumes.values_mut().filter(|vs| vs.name == v) {
                    vs.buckets.configure(l, now);
                }
            }
            (None, Some(t)) => {
                let ts = st.tenants.entry(t.to_string()).or_default();
                ts.buckets.configure(l, now);
                ts.weight = l.weight.unwrap_or(DEFAULT_WEIGHT);
            }
            (None, None) => st.global.configure(l, now),
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        refresh_flags(&mut st);
        drop(st);
        self.wake.notify_all();
    }

    /// One pacer pass: admit what the buckets allow now and submit it. Returns how long until
    /// the next queued request could pass (`None`: nothing is queued).
    pub fn pump(&self) -> Option<Duration> {
        let (admitted, next) = {
            let mut st = self.lock();
            let now = self.clock.now();
            admit_queued(&mut st, now)
        };
        for a in admitted {
            a.submit();
        }
        next
    }

    /// Statistics of every open volume layer (one per volume name).
    pub fn stats(&self) -> Vec<nacre_shared::api::qos::VolumeStats> {
        let metrics: Vec<Arc<VolumeMetrics>> = self
            .lock()
            .volumes
            .values()
            .map(|v| v.metrics.clone())
            .collect();
        let mut seen = std::collections::HashSet::new();
        metrics
            .iter()
            .map(|m| m.snapshot())
            .filter(|s| seen.insert(s.volume.clone()))
            .collect()
    }

    /// Requests waiting for tokens, over all volumes.
    pub fn queued(&self) -> usize {
        self.lock().queued
    }

    /// The limiter's slow path, under its lock: admit now (returned, for the caller to submit
    /// outside the lock) or queue for the pacer. `credit` is the calling thread's credit for
    /// this volume: what is left of it goes back to the buckets first, and when nothing waits
    /// anywhere it is refilled so the next requests skip this path.
    fn admit(
        &self,
        id: u64,
        req: IoRequest,
        done: Arc<dyn IoCompletion>,
        arrived: u64,
        credit: Option<&mut Credit>,
    ) -> Option<Admitted> {
        let dir = Dir::of(req.kind);
        let bytes = bytes_of(dir, &req);
        let now = self.clock.at_ns(arrived);
        let mut guard = self.lock();
        let st = &mut *guard;
        let Some(vs) = st.volumes.get_mut(&id) else {
            // Unreachable while the QosVolume lives (it unregisters on drop).
            return None;
        };
        let mut tenant = vs.tenant.as_ref().and_then(|t| st.tenants.get_mut(t));
        let mut credit = credit;
        if let Some(c) = credit.as_deref_mut() {
            if c.generation == self.generation.load(Ordering::Acquire) {
                c.fold();
                vs.buckets.give_back(&mut c.tokens[0]);
                if let Some(ts) = tenant.as_mut() {
                    ts.buckets.give_back(&mut c.tokens[1]);
                }
                st.global.give_back(&mut c.tokens[2]);
            }
            // Credit from before a limit change is dropped, not returned: the buckets were
            // rebuilt (at most CREDIT_GRANT of the old rate is lost).
            c.clear();
        }
        // FIFO per volume; and while anything waits, new requests that need the daemon-wide
        // bucket queue too, so the pacer's weighted order decides under contention.
        let global_contended = st.global.active() && st.queued > 0;
        if vs.queue.is_empty() && !global_contended {
            let mut w = vs.buckets.wait(dir, bytes, now);
            if let Some(ts) = tenant.as_mut() {
                w = w.max(ts.buckets.wait(dir, bytes, now));
            }
            w = w.max(st.global.wait(dir, bytes, now));
            if w.is_zero() {
                vs.buckets.take(dir, bytes);
                if let Some(ts) = tenant.as_mut() {
                    ts.buckets.take(dir, bytes);
                    ts.vtime = ts.vtime.max(st.vclock) + 1.0 / ts.weight as f64;
                } else {
                    vs.vtime = vs.vtime.max(st.vclock) + 1.0 / DEFAULT_WEIGHT as f64;
                }
                st.global.take(dir, bytes);
                if let Some(c) = credit {
                    if st.queued == 0 {
                        c.generation = self.generation.load(Ordering::Acquire);
                        vs.buckets.grant(&mut c.tokens[0]);
                        match tenant {
                            Some(ts) => ts.buckets.grant(&mut c.tokens[1]),
                            None => c.tokens[1] = [f64::INFINITY; 6],
                        }
                        st.global.grant(&mut c.tokens[2]);
                        c.plan();
                    }
                }
                return Some(Admitted {
                    inner: vs.inner.clone(),
                    req,
                    done,
                });
            }
        }
        vs.metrics.throttled_enter();
        trace!(volume = %vs.name, tag = req.tag, "qos: request queued for tokens");
        vs.queue.push_back(Pending {
            req,
            done,
            dir,
            bytes,
        });
        st.queued += 1;
        drop(guard);
        self.wake.notify_one();
        None
    }

    fn unregister(&self, id: u64) {
        let mut st = self.lock();
        let leftover = st.volumes.remove(&id).map(|mut vs| {
            st.queued -= vs.queue.len();
            std::mem::take(&mut vs.queue)
                .into_iter()
                .map(move |p| {
                    vs.metrics.throttled_leave();
                    Admitted {
                        inner: vs.inner.clone(),
                        req: p.req,
                        done: p.done,
                    }
                })
                .collect::<Vec<_>>()
        });
        drop(st);
        // Nobody holds the volume any more, but requests still queued are owed a completion.
        for a in leftover.into_iter().flatten() {
            a.submit();
        }
    }
}

impl Drop for Qos {
    fn drop(&mut self) {
        self.lock().shutdown = true;
        self.wake.notify_all();
    }
}

fn refresh_flags(st: &mut SchedState) {
    let global = st.global.active();
    for vs in st.volumes.values() {
        let tenant = vs
            .tenant
            .as_ref()
            .and_then(|t| st.tenants.get(t))
            .is_some_and(|t| t.buckets.active());
        vs.limited.store(
            global || tenant || vs.buckets.active() || !vs.queue.is_empty(),
            Ordering::Release,
        );
    }
}

/// Admit queued heads while the buckets allow, least tenant virtual time first.
fn admit_queued(st: &mut SchedState, now: Duration) -> (Vec<Admitted>, Option<Duration>) {
    let mut admitted = Vec::new();
    let mut emptied = false;
    loop {
        let mut best: Option<(u64, f64)> = None;
        let mut next: Option<Duration> = None;
        let SchedState {
            global,
            tenants,
            volumes,
            vclock,
            ..
        } = st;
        for (&id, vs) in volumes.iter_mut() {
            let Some(head) = vs.queue.front() else {
                continue;
            };
            let (dir, bytes) = (head.dir, head.bytes);
            let mut w = vs.buckets.wait(dir, bytes, now);
            // A tenant back from idling starts at the current virtual time, not with credit.
            let mut vt = vs.vtime.max(*vclock);
            if let Some(ts) = vs.tenant.as_ref().and_then(|t| tenants.get_mut(t)) {
                w = w.max(ts.buckets.wait(dir, bytes, now));
                vt = ts.vtime.max(*vclock);
            }
            w = w.max(global.wait(dir, bytes, now));
            if w.is_zero() {
                if best.is_none_or(|(_, bv)| vt < bv) {
                    best = Some((id, vt));
                }
            } else {
                next = Some(next.map_or(w, |n: Duration| n.min(w)));
            }
        }
        let Some((id, start_tag)) = best else {
            if emptied {
                // A volume with no limits left goes back to the lock-free path.
                refresh_flags(st);
            }
            return (admitted, if st.queued > 0 { next } else { None });
        };
        let vs = st.volumes.get_mut(&id).expect("chosen above");
        let p = vs.queue.pop_front().expect("non-empty");
        vs.buckets.take(p.dir, p.bytes);
        if let Some(ts) = vs.tenant.as_ref().and_then(|t| st.tenants.get_mut(t)) {
            ts.buckets.take(p.dir, p.bytes);
            ts.vtime = start_tag + 1.0 / ts.weight as f64;
        } else {
            vs.vtime = start_tag + 1.0 / DEFAULT_WEIGHT as f64;
        }
        st.global.take(p.dir, p.bytes);
        st.vclock = start_tag;
        st.queued -= 1;
        vs.metrics.throttled_leave();
        emptied |= vs.queue.is_empty();
        admitted.push(Admitted {
            inner: vs.inner.clone(),
            req: p.req,
            done: p.done,
        });
    }
}

fn pacer(q: Weak<Qos>) {
    loop {
        let Some(qos) = q.upgrade() else { return };
        let next = qos.pump();
        let st = qos.lock();
        if st.shutdown {
            return;
        }
        if st.queued > 0 && next.is_none() {
            // Something arrived since the pass: go again.
            continue;
        }
        // Sleep until the next head could pass, or until a request queues or a limit changes.
        let wait = next.unwrap_or(Duration::from_millis(500));
        let _ = qos
            .wake
            .wait_timeout(st, wait)
            .unwrap_or_else(|p| p.into_inner());
    }
}

/// The layer over one volume: its statistics, for the frontends to record requests in
/// ([`BlockDevice::metrics`]), and its limits, when any apply.
///
/// The statistics are the frontends' to record because they already keep a slot per request
/// and see its completion: a wrapper around every completion here cost a quarter of a null
/// request's whole path. Per request this layer costs, on the submitting thread, one atomic
/// flag load when no limit applies; when one does, tokens from this thread's [`Credit`],
/// with the limiter's lock taken once per credit grant.
pub struct QosVolume {
    /// Handed to frontends as their [`VolumePath`].
    me: Weak<QosVolume>,
    inner: Arc<dyn BlockDevice>,
    id: u64,
    limited: Arc<AtomicBool>,
    qos: Arc<Qos>,
    metrics: Arc<VolumeMetrics>,
    /// Per thread slot ([`telemetry::clock::slot`]); the shared overflow slot has none and
    /// takes the limiter's lock per request.
    locals: Box<[Local]>,
}

/// What one thread slot keeps for one volume, used only by the thread that owns the slot.
#[repr(align(128))]
struct Local(UnsafeCell<Credit>);

// SAFETY: a `Local` is only touched by the thread that owns its slot (`telemetry::clock::slot`
// hands each live thread a distinct one; a slot passes to a new thread only through a mutex
// after its owner exited), and every access is a short borrow that ends before any call into
// another layer, so even a re-entrant submit on the same thread never sees two borrows.
unsafe impl Sync for Local {}

impl QosVolume {
    /// This thread's credit, if it owns an exclusive slot.
    ///
    /// # Safety
    /// The caller must own `slot` (it came from [`telemetry::clock::slot`] on this thread) and
    /// must end the borrow before calling out of this module.
    #[allow(clippy::mut_from_ref)]
    unsafe fn credit(&self, slot: usize) -> Option<&mut Credit> {
        // SAFETY: per the caller's promise, no other borrow of this slot's state exists.
        self.locals.get(slot).map(|l| unsafe { &mut *l.0.get() })
    }

    /// The limiter's fast path: whether this thread's credit covers the request (and then it
    /// is taken). It looks at the request through a reference: deciding before the request
    /// moves keeps the limited path from copying it once more than the unlimited one does.
    #[inline(always)]
    fn admit_from_credit(&self, req: &IoRequest) -> bool {
        let slot = telemetry::clock::slot();
        let generation = self.qos.generation.load(Ordering::Acquire);
        let dir = Dir::of(req.kind);
        let bytes = bytes_of(dir, req);
        // SAFETY: `slot` is this thread's; the borrow ends before this function returns.
        unsafe { self.credit(slot) }
            .is_some_and(|c| c.generation == generation && c.try_take(dir, bytes))
    }

    /// The limiter's locked path: no credit (first request, credit spent, limits changed).
    #[cold]
    #[inline(never)]
    fn submit_locked(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let slot = telemetry::clock::slot();
        let at = telemetry::clock::now_ns();
        // SAFETY: `slot` is this thread's; `admit` only takes the limiter's lock and returns.
        let credit = unsafe { self.credit(slot) };
        if let Some(a) = self.qos.admit(self.id, req, done.clone(), at, credit) {
            a.submit();
        }
    }
}

impl QosVolume {
    /// [`BlockDevice::submit`], as a concrete call a frontend's [`VolumePath`] inlines: the
    /// device below gets the request with no dynamic call or move of the request in between.
    #[inline(always)]
    pub fn submit_here(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        if self.limited.load(Ordering::Acquire) && !self.admit_from_credit(&req) {
            self.submit_locked(req, done);
        } else {
            self.inner.submit(req, done);
        }
    }
}

/// How a frontend submits to the volume it serves: when the volume has the QoS layer over
/// it (it always does unless `nacred --no-qos`), through the layer's inlined
/// [`QosVolume::submit_here`] (a flag load; with a limit, this thread's credit) straight to
/// the device below, rather than through one more dynamic call. Each submission runs in the
/// `volume` span of request tracing ([`telemetry::trace`]).
pub struct VolumePath {
    dev: Arc<dyn BlockDevice>,
    layer: Option<Arc<QosVolume>>,
}

impl VolumePath {
    pub fn new(dev: Arc<dyn BlockDevice>) -> Self {
        VolumePath {
            layer: dev.qos_layer(),
            dev,
        }
    }

    /// The volume's statistics, for the frontend to record its requests in
    /// ([`VolumeMetrics::arrive`] and [`VolumeMetrics::complete`]).
    pub fn metrics(&self) -> Option<&Arc<VolumeMetrics>> {
        self.layer.as_ref().map(|l| &l.metrics)
    }

    #[inline]
    pub fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let _span = tracing::trace_span!(target: telemetry::trace::TARGET, "volume",
            volume = self.metrics().map(|m| m.volume()), op = ?req.kind, offset = req.offset,
            len = req.len)
        .entered();
        match &self.layer {
            Some(l) => l.submit_here(req, done),
            None => self.dev.submit(req, done),
        }
    }
}

impl Drop for QosVolume {
    fn drop(&mut self) {
        self.qos.unregister(self.id);
    }
}

impl BlockDevice for QosVolume {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        self.submit_here(req, done);
    }

    fn qos_layer(&self) -> Option<Arc<QosVolume>> {
        self.me.upgrade()
    }

    fn resize(&self, new_size: u64) -> IoResult {
        self.inner.resize(new_size)
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::volume::null::NullVolume;
    use crate::volume::Segment;
    use std::sync::atomic::AtomicUsize;

    /// A clock the test moves.
    #[derive(Default)]
    struct FakeClock(Mutex<Duration>);
    impl FakeClock {
        fn advance(&self, d: Duration) {
            *self.0.lock().unwrap() += d;
        }
    }
    impl Clock for FakeClock {
        fn now(&self) -> Duration {
            *self.0.lock().unwrap()
        }
    }

    /// Counts completions (and, in `saturate`, submissions).
    #[derive(Default)]
    struct Count(AtomicUsize, AtomicUsize);
    impl IoCompletion for Count {
        fn complete(&self, _tag: u64, r: IoResult) {
            assert_eq!(r, Ok(()));
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    impl Count {
        fn get(&self) -> usize {
            self.0.load(Ordering::Relaxed)
        }
    }

    fn setup() -> (Arc<FakeClock>, Arc<Qos>) {
        let clock = Arc::new(FakeClock::default());
        let qos = Qos::manual(clock.clone(), Arc::new(Telemetry::new()));
        (clock, qos)
    }

    fn null() -> Arc<dyn BlockDevice> {
        Arc::new(NullVolume::new(1 << 30, 4096))
    }

    fn iops(n: u64) -> QosLimits {
        QosLimits {
            iops: Some(n),
            ..Default::default()
        }
    }

    static mut BUF: [u8; 4096] = [0; 4096];

    fn read4k(vol: &QosVolume, done: &Arc<dyn IoCompletion>) {
        // SAFETY: the null volume never touches segment memory; the static outlives it.
        let seg = unsafe { Segment::new(std::ptr::addr_of_mut!(BUF) as *mut u8, 4096) };
        vol.submit(
            IoRequest::new(IoKind::Read, 0, 4096, 0).with_segments([seg]),
            done,
        );
    }

    /// Keep `depth` requests outstanding on `vol` for `secs`, pumping like the pacer would at
    /// `step` resolution (a late pacer: tokens accrue meanwhile). Returns completions.
    fn saturate(
        clock: &FakeClock,
        qos: &Qos,
        vols: &[(&QosVolume, &Arc<Count>)],
        depth: usize,
        secs: f64,
        step: Duration,
    ) -> Vec<usize> {
        let start: Vec<usize> = vols.iter().map(|(_, c)| c.get()).collect();
        let end = clock.now() + Duration::from_secs_f64(secs);
        while clock.now() < end {
            for (v, c) in vols {
                let done: Arc<dyn IoCompletion> = (*c).clone();
                // Top up to `depth` outstanding; an unlimited volume completes inline, so
                // cap what one step submits.
                for _ in 0..4 * depth {
                    if c.1.load(Ordering::Relaxed) - c.get() >= depth {
                        break;
                    }
                    c.1.fetch_add(1, Ordering::Relaxed);
                    read4k(v, &done);
                }
            }
            qos.pump();
            clock.advance(step);
        }
        vols.iter()
            .zip(start)
            .map(|((_, c), s)| c.get() - s)
            .collect()
    }

    #[test]
    fn credit_admits_no_more_than_granted_and_folds_back_exactly() {
        // A volume limited to 10 IOPS in all and 3 × 4 KiB/s of reads; nothing else limited.
        let mut c = Credit {
            tokens: [[f64::INFINITY; 6]; 3],
            ..Default::default()
        };
        c.tokens[0][IOPS] = 10.0;
        c.tokens[0][READ_BPS] = 3.0 * 4096.0;
        c.plan();
        let reads = (0..10).filter(|_| c.try_take(Dir::Read, 4096)).count();
        assert_eq!(
            reads, 3,
            "the read bytes bucket admits exactly three 4 KiB reads"
        );
        let writes = (0..10).filter(|_| c.try_take(Dir::Write, 4096)).count();
        let flushes = (0..10).filter(|_| c.try_take(Dir::Other, 0)).count();
        let ops = reads + writes + flushes;
        assert!(ops <= 10, "{ops} operations from 10 IOPS of credit");
        assert!(
            writes >= 1,
            "writes share the IOPS bucket, not the read bytes one"
        );
        // What was carved and not used goes back to the bucket it came from.
        c.fold();
        assert_eq!(c.tokens[0][IOPS], (10 - ops) as f64);
        assert_eq!(c.tokens[0][READ_BPS], 0.0);
        assert!(c.tokens[0][WRITE_BPS].is_infinite() && c.tokens[1][IOPS].is_infinite());
        // Carving again after the fold admits the rest, and then nothing.
        let more = (0..20).filter(|_| c.try_take(Dir::Write, 4096)).count();
        assert_eq!(ops + more, 10);
        assert!(!c.try_take(Dir::Other, 0));
    }

    #[test]
    fn rate_is_within_one_percent_of_the_limit_even_with_a_late_pacer() {
        let (clock, qos) = setup();
        let v = qos.wrap("v", None, null());
        qos.set(Some("v"), None, Some(&iops(2000)));
        let c = Arc::new(Count::default());
        // Drain the initial burst first.
        saturate(
            &clock,
            &qos,
            &[(&v, &c)],
            32,
            1.0,
            Duration::from_micros(500),
        );
        for step_us in [100, 500, 3_000, 20_000] {
            let n = saturate(
                &clock,
                &qos,
                &[(&v, &c)],
                32,
                5.0,
                Duration::from_micros(step_us),
            )[0];
            let rate = n as f64 / 5.0;
            assert!(
                (rate - 2000.0).abs() <= 20.0,
                "pacer step {step_us} us: {rate} IOPS for a 2000 IOPS limit"
            );
        }
    }

    #[test]
    fn byte_limits_count_bytes() {
        let (clock, qos) = setup();
        let v = qos.wrap("v", None, null());
        // 4 MiB/s of 4 KiB reads = 1024 IOPS.
        let l = QosLimits {
            read_bps: Some(4 << 20),
            ..Default::default()
        };
        qos.set(Some("v"), None, Some(&l));
        let c = Arc::new(Count::default());
        saturate(&clock, &qos, &[(&v, &c)], 16, 1.0, Duration::from_millis(1));
        let n = saturate(&clock, &qos, &[(&v, &c)], 16, 4.0, Duration::from_millis(1))[0];
        let rate = n as f64 / 4.0;
        assert!((rate - 1024.0).abs() <= 1024.0 * 0.01, "{rate}");
        // A write-only limit does not touch reads.
        qos.set(
            Some("v"),
            None,
            Some(&QosLimits {
                write_bps: Some(4096),
                ..Default::default()
            }),
        );
        let n = saturate(
            &clock,
            &qos,
            &[(&v, &c)],
            16,
            0.01,
            Duration::from_millis(1),
        )[0];
        assert!(n > 100, "reads limited by a write limit: {n}");
    }

    #[test]
    fn burst_is_honoured_then_clamped() {
        let (clock, qos) = setup();
        let v = qos.wrap("v", None, null());
        let l = QosLimits {
            iops: Some(1000),
            burst_ms: Some(500),
            ..Default::default()
        };
        qos.set(Some("v"), None, Some(&l));
        // Idle for a while: the bucket is full (500 ms of 1000 IOPS), no more.
        clock.advance(Duration::from_secs(10));
        let c = Arc::new(Count::default());
        let done: Arc<dyn IoCompletion> = c.clone();
        for _ in 0..2000 {
            read4k(&v, &done);
        }
        assert_eq!(c.get(), 500, "a full bucket lets exactly the burst through");
        assert_eq!(qos.queued(), 1500);
        // Then the rate: 1000 per second.
        for _ in 0..1000 {
            clock.advance(Duration::from_millis(1));
            qos.pump();
        }
        assert!((1499..=1501).contains(&c.get()), "{}", c.get());
    }

    #[test]
    fn limit_change_takes_effect_at_once() {
        let (clock, qos) = setup();
        let v = qos.wrap("v", None, null());
        qos.set(Some("v"), None, Some(&iops(5000)));
        let c = Arc::new(Count::default());
        let step = Duration::from_micros(200);
        saturate(&clock, &qos, &[(&v, &c)], 32, 1.0, step);
        qos.set(Some("v"), None, Some(&iops(500)));
        // At most the old bucket's contents (100 ms of 500 IOPS after the clamp) pass extra.
        let n = saturate(&clock, &qos, &[(&v, &c)], 32, 1.0, step)[0];
        assert!((450..=560).contains(&n), "first second after lowering: {n}");
        qos.set(Some("v"), None, None);
        let n = saturate(&clock, &qos, &[(&v, &c)], 32, 0.01, step)[0];
        assert!(n > 1000, "cleared limit still applied: {n}");
    }

    #[test]
    fn tenant_limit_covers_its_volumes_and_spares_others() {
        let (clock, qos) = setup();
        let a1 = qos.wrap("a1", Some("A"), null());
        let a2 = qos.wrap("a2", Some("A"), null());
        let b = qos.wrap("b", Some("B"), null());
        qos.set(None, Some("A"), Some(&iops(1000)));
        let cs: Vec<Arc<Count>> = (0..3).map(|_| Arc::new(Count::default())).collect();
        let step = Duration::from_millis(1);
        let vols = [(&*a1, &cs[0]), (&*a2, &cs[1]), (&*b, &cs[2])];
        saturate(&clock, &qos, &vols, 8, 1.0, step);
        let n = saturate(&clock, &qos, &vols, 8, 2.0, step);
        let a = (n[0] + n[1]) as f64 / 2.0;
        assert!((a - 1000.0).abs() <= 10.0, "tenant A: {a} IOPS for 1000");
        assert!(n[2] as f64 / 2.0 > 10_000.0, "tenant B was limited: {n:?}");
        drop((a1, a2, b));
    }

    #[test]
    fn weights_share_the_global_limit_under_contention() {
        let (clock, qos) = setup();
        let a = qos.wrap("a", Some("A"), null());
        let b = qos.wrap("b", Some("B"), null());
        qos.set(None, None, Some(&iops(4000)));
        // Weight alone limits nothing for the tenant itself.
        qos.set(
            None,
            Some("A"),
            Some(&QosLimits {
                weight: Some(300),
                ..Default::default()
            }),
        );
        let (ca, cb) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let step = Duration::from_micros(500);
        saturate(&clock, &qos, &[(&a, &ca), (&b, &cb)], 16, 1.0, step);
        let n = saturate(&clock, &qos, &[(&a, &ca), (&b, &cb)], 16, 4.0, step);
        let (ra, rb) = (n[0] as f64 / 4.0, n[1] as f64 / 4.0);
        assert!((ra + rb - 4000.0).abs() <= 40.0, "{ra} + {rb}");
        assert!(
            (ra - 3000.0).abs() <= 150.0,
            "A (weight 300): {ra}, B (100): {rb}"
        );
        // B alone gets all of it.
        let n = saturate(&clock, &qos, &[(&b, &cb)], 16, 2.0, step)[0];
        assert!((n as f64 / 2.0 - 4000.0).abs() <= 200.0, "{n}");
    }

    #[test]
    fn one_iops_is_honoured_and_dropping_a_volume_releases_its_queue() {
        let (clock, qos) = setup();
        let v = qos.wrap("v", None, null());
        qos.set(
            Some("v"),
            None,
            Some(&QosLimits {
                iops: Some(1),
                burst_ms: Some(1),
                ..Default::default()
            }),
        );
        let c = Arc::new(Count::default());
        let done: Arc<dyn IoCompletion> = c.clone();
        for _ in 0..5 {
            read4k(&v, &done);
        }
        assert_eq!(c.get(), 1);
        assert_eq!(qos.pump(), Some(Duration::from_secs_f64(1.0 + 1e-6)));
        clock.advance(Duration::from_secs(2));
        qos.pump();
        assert_eq!(c.get(), 2, "depth is one token: no burst after idling");
        drop(v);
        assert_eq!(
            c.get(),
            5,
            "queued requests of a dropped volume still complete"
        );
        assert_eq!(qos.queued(), 0);
    }
}
