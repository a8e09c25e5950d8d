//! Telemetry: per-volume (and, by their `tenant` label, per-tenant) I/O counters, queue depth,
//! QoS throttling and latency histograms, served in the Prometheus text exposition format
//! (version 0.0.4) on a loopback HTTP endpoint.
//!
//! The data path never shares a cache line between threads and never does an atomic
//! read-modify-write: every counter and histogram bucket of a volume is kept in one shard per
//! thread slot ([`clock::slot`]), written by that thread alone with a relaxed load and store,
//! and the shards are summed only when someone asks (a scrape, `stats_get`). The frontends
//! record each request ([`VolumeMetrics::arrive`] when they hand it to the volume,
//! [`VolumeMetrics::complete`] when it is done), so latency runs from the request's arrival at
//! the volume (QoS queueing included) to its completion, i.e. everything below the frontend,
//! on the batch clock ([`clock::now_ns`]).
//!
//! Latency buckets grow by 2^(1/3) (≈1.26) from 1 µs to ~17 s, so `histogram_quantile`
//! computed from them is within one bucket (+26%/−21%) of the true quantile.

pub mod clock;
pub mod http;
pub mod trace;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock, Weak};

use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};
use prometheus::{Encoder, TextEncoder};

use crate::volume::IoKind;

/// Finite latency buckets.
const NB: usize = 73;

/// Latency buckets: 1 µs × 2^(k/3), k = 0..73 (last finite bound ≈ 16.8 s).
pub fn latency_buckets() -> Vec<f64> {
    (0..NB).map(|k| 1e-6 * 2f64.powf(k as f64 / 3.0)).collect()
}

/// The same bounds in whole nanoseconds (floored: an integer latency `ns` is within bound `k`
/// exactly when `ns` ≤ floor(bound)).
static BOUNDS_NS: LazyLock<[u64; NB]> = LazyLock::new(|| {
    let b = latency_buckets();
    std::array::from_fn(|k| (b[k] * 1e9 + 1e-6).floor() as u64)
});

/// Index of the bucket counting `ns` (`NB`: beyond the last finite bound).
#[inline]
fn bucket_of(ns: u64) -> usize {
    if ns <= 1000 {
        return 0;
    }
    BOUNDS_NS.partition_point(|&b| b < ns)
}

/// Add to a counter of a shard: plain load and store when this thread owns the shard.
#[inline]
fn add(c: &AtomicU64, n: u64, exclusive: bool) {
    if exclusive {
        c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    } else {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// Operations in `ops` order, as the `op` label names them.
const OPS: [&str; 5] = ["read", "write", "flush", "discard", "write_zeroes"];
/// Latency histograms: read, write, everything else.
const LAT_OPS: [&str; 3] = ["read", "write", "other"];

fn op_index(kind: IoKind) -> usize {
    match kind {
        IoKind::Read => 0,
        IoKind::Write => 1,
        IoKind::Flush => 2,
        IoKind::Discard => 3,
        IoKind::WriteZeroes => 4,
    }
}

struct Hist {
    /// First, beside the lowest buckets, where fast requests land: one cache line for both.
    sum_ns: AtomicU64,
    /// Per bucket (not cumulative); `[NB]` counts what is beyond the last bound.
    counts: [AtomicU64; NB + 1],
}

/// One thread slot's share of a volume's statistics (two cache lines' alignment so
/// neighbouring shards never share one, adjacent-line prefetch included).
#[repr(align(128))]
struct Shard {
    arrived: AtomicU64,
    ops: [AtomicU64; 5],
    /// Read and written bytes of requests that succeeded.
    bytes: [AtomicU64; 2],
    errors: AtomicU64,
    throttled: AtomicU64,
    unthrottled: AtomicU64,
    lat: [Hist; 3],
}

impl Shard {
    #[inline]
    fn record(&self, x: bool, kind: IoKind, bytes: u64, elapsed_ns: u64, error: bool) {
        let op = op_index(kind);
        add(&self.ops[op], 1, x);
        if op < 2 && !error {
            add(&self.bytes[op], bytes, x);
        }
        if error {
            add(&self.errors, 1, x);
        }
        let h = &self.lat[op.min(2)];
        add(&h.counts[bucket_of(elapsed_ns)], 1, x);
        add(&h.sum_ns, elapsed_ns, x);
    }
}

/// One thread's handle on one volume's statistics for a run of requests (a vhost-user-blk
/// queue worker's passes over its ring between two sleeps): the thread's shard is looked up
/// once, so recording a request is a few plain stores.
pub struct Recorder<'a> {
    shard: &'a Shard,
    exclusive: bool,
    /// Not `Send`: the shard is the making thread's to write with plain stores.
    _this_thread: std::marker::PhantomData<*const ()>,
}

impl Recorder<'_> {
    /// [`VolumeMetrics::arrive`].
    #[inline]
    pub fn arrive(&self, kind: IoKind, bytes: u64) -> Arrival {
        add(&self.shard.arrived, 1, self.exclusive);
        Arrival {
            start: clock::now_ns(),
            bytes,
            kind,
        }
    }

    /// [`VolumeMetrics::complete`], on the thread that made this recorder.
    #[inline]
    pub fn complete(&self, a: &Arrival, error: bool) {
        let elapsed = clock::now_ns().saturating_sub(a.start);
        self.shard
            .record(self.exclusive, a.kind, a.bytes, elapsed, error);
    }
}

fn zeros<const N: usize>() -> [AtomicU64; N] {
    std::array::from_fn(|_| AtomicU64::new(0))
}

impl Shard {
    fn new() -> Box<Shard> {
        Box::new(Shard {
            arrived: AtomicU64::new(0),
            ops: zeros(),
            bytes: zeros(),
            errors: AtomicU64::new(0),
            throttled: AtomicU64::new(0),
            unthrottled: AtomicU64::new(0),
            lat: std::array::from_fn(|_| Hist {
                counts: zeros(),
                sum_ns: AtomicU64::new(0),
            }),
        })
    }
}

/// What a frontend keeps for one request between [`VolumeMetrics::arrive`] and
/// [`VolumeMetrics::complete`].
#[derive(Clone, Copy, Debug)]
pub struct Arrival {
    start: u64,
    bytes: u64,
    kind: IoKind,
}

impl Arrival {
    /// Time since arrival, on this thread's batch clock.
    pub fn elapsed_ns(&self) -> u64 {
        clock::now_ns().saturating_sub(self.start)
    }
}

/// An [`Arrival`] kept by a completion object that the request's completion may read on
/// another thread: relaxed atomic fields, which are plain loads and stores on x86 and Arm.
/// The request's submission and its completion order the writes before the reads (a volume
/// that completes elsewhere hands the request over through a lock or a queue), so a
/// completion reads what its request's submitter stored.
#[derive(Default)]
pub struct ArrivalCell {
    start: AtomicU64,
    bytes: AtomicU64,
    /// [`op_index`] + 1; 0 when empty.
    kind: AtomicU8,
}

impl ArrivalCell {
    pub fn set(&self, a: Arrival) {
        self.start.store(a.start, Ordering::Relaxed);
        self.bytes.store(a.bytes, Ordering::Relaxed);
        self.kind
            .store(op_index(a.kind) as u8 + 1, Ordering::Relaxed);
    }

    pub fn take(&self) -> Option<Arrival> {
        // A load and a store, not a swap: the cell has one reader at a time (the request's
        // completion), and a swap would be a locked instruction.
        let kind = self.kind.load(Ordering::Relaxed);
        self.kind.store(0, Ordering::Relaxed);
        let kind = match kind {
            0 => return None,
            1 => IoKind::Read,
            2 => IoKind::Write,
            3 => IoKind::Flush,
            4 => IoKind::Discard,
            _ => IoKind::WriteZeroes,
        };
        Some(Arrival {
            start: self.start.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            kind,
        })
    }
}

impl Default for Arrival {
    fn default() -> Self {
        Arrival {
            start: 0,
            bytes: 0,
            kind: IoKind::Flush,
        }
    }
}

/// The sum of a volume's shards at one moment.
#[derive(Clone)]
struct Totals {
    arrived: u64,
    ops: [u64; 5],
    bytes: [u64; 2],
    errors: u64,
    throttled: u64,
    unthrottled: u64,
    lat: [([u64; NB + 1], u64); 3],
}

impl Totals {
    fn queue_depth(&self) -> u64 {
        self.arrived.saturating_sub(self.ops.iter().sum())
    }

    fn qos_queued(&self) -> u64 {
        self.throttled.saturating_sub(self.unthrottled)
    }
}

/// Metric families added to every scrape (device and path series the control plane builds
/// at scrape time), encoded after the volume series.
pub type ExtraSource = Box<dyn Fn() -> Vec<MetricFamily> + Send + Sync>;

/// Every metric nacred exports.
pub struct Telemetry {
    /// The live statistics of each (volume, tenant) label pair: every volume layer with the
    /// same pair shares one [`VolumeMetrics`], and its series go when the last layer does,
    /// so deleted volumes leave no stale series.
    series: Mutex<HashMap<(String, String), Weak<VolumeMetrics>>>,
    extra: Mutex<Option<ExtraSource>>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

impl Telemetry {
    pub fn new() -> Self {
        Telemetry {
            series: Mutex::new(HashMap::new()),
            extra: Mutex::new(None),
        }
    }

    /// The statistics of one volume layer (shared with other layers of the same volume).
    pub fn volume(self: &Arc<Self>, volume: &str, tenant: Option<&str>) -> Arc<VolumeMetrics> {
        let key = (volume.to_string(), tenant.unwrap_or("").to_string());
        let mut series = self.series.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = series.get(&key).and_then(Weak::upgrade) {
            return m;
        }
        let m = Arc::new(VolumeMetrics {
            shards: (0..=clock::SLOTS).map(|_| OnceLock::new()).collect(),
            volume: volume.to_string(),
            tenant: tenant.map(str::to_string),
            telemetry: self.clone(),
        });
        series.insert(key, Arc::downgrade(&m));
        m
    }

    fn release(&self, volume: &str, tenant: &str) {
        let mut series = self.series.lock().unwrap_or_else(|p| p.into_inner());
        let key = (volume.to_string(), tenant.to_string());
        // A layer opened meanwhile may already have replaced the entry: keep that one.
        if series.get(&key).is_some_and(|w| w.strong_count() == 0) {
            series.remove(&key);
        }
    }

    /// Set the source of series rendered at scrape time (devices, QoS limits, paths).
    pub fn set_extra(&self, f: ExtraSource) {
        *self.extra.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
    }

    /// The whole exposition, as served on `/metrics`.
    pub fn render(&self) -> String {
        let live: Vec<Arc<VolumeMetrics>> = self
            .series
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        let mut rows: Vec<(&VolumeMetrics, Totals)> =
            live.iter().map(|m| (&**m, m.totals())).collect();
        // Stable output for diffing and tests.
        rows.sort_by(|a, b| (&a.0.volume, &a.0.tenant).cmp(&(&b.0.volume, &b.0.tenant)));
        let mut families = families(&rows);
        drop(rows);
        // Dropped outside the series lock: the last reference may go here.
        drop(live);
        if let Some(extra) = &*self.extra.lock().unwrap_or_else(|p| p.into_inner()) {
            // The encoder refuses a family without series: such a family has no samples to
            // scrape either.
            families.extend(extra().into_iter().filter(|f| !f.get_metric().is_empty()));
        }
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&families, &mut buf)
            .expect("text encoding of gathered metrics");
        String::from_utf8(buf).expect("the text format is UTF-8")
    }
}

pub(crate) fn label(name: &str, value: &str) -> LabelPair {
    let mut l = LabelPair::default();
    l.set_name(name.to_string());
    l.set_value(value.to_string());
    l
}

/// Labels in name order, as Prometheus clients write them.
fn labels(m: &VolumeMetrics, op: Option<&str>) -> Vec<LabelPair> {
    let mut v = Vec::with_capacity(3);
    if let Some(op) = op {
        v.push(label("op", op));
    }
    v.push(label("tenant", m.tenant.as_deref().unwrap_or("")));
    v.push(label("volume", &m.volume));
    v
}

pub(crate) fn family(
    name: &str,
    help: &str,
    kind: MetricType,
    metrics: Vec<Metric>,
) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(name.to_string());
    f.set_help(help.to_string());
    f.set_field_type(kind);
    f.set_metric(metrics);
    f
}

pub(crate) fn counter(labels: Vec<LabelPair>, v: u64) -> Metric {
    let mut c = Counter::default();
    c.set_value(v as f64);
    let mut m = Metric::from_label(labels);
    m.set_counter(c);
    m
}

pub(crate) fn gauge(labels: Vec<LabelPair>, v: u64) -> Metric {
    let mut g = Gauge::default();
    g.set_value(v as f64);
    let mut m = Metric::from_label(labels);
    m.set_gauge(g);
    m
}

/// The metric families of every volume, sorted by name (series with no volume are omitted).
fn families(rows: &[(&VolumeMetrics, Totals)]) -> Vec<MetricFamily> {
    if rows.is_empty() {
        return Vec::new();
    }
    let bounds = latency_buckets();
    let per_op = |ops: &[&str], f: &dyn Fn(&Totals, usize) -> u64| {
        rows.iter()
            .flat_map(|(m, t)| {
                ops.iter()
                    .enumerate()
                    .map(move |(i, op)| counter(labels(m, Some(op)), f(t, i)))
            })
            .collect::<Vec<_>>()
    };
    let per_vol = |mk: fn(Vec<LabelPair>, u64) -> Metric, f: &dyn Fn(&Totals) -> u64| {
        rows.iter()
            .map(|(m, t)| mk(labels(m, None), f(t)))
            .collect::<Vec<_>>()
    };
    let latency = rows
        .iter()
        .flat_map(|(m, t)| {
            let bounds = &bounds;
            LAT_OPS.iter().enumerate().map(move |(i, op)| {
                let (counts, sum_ns) = &t.lat[i];
                let mut cum = 0;
                let buckets = bounds
                    .iter()
                    .zip(counts)
                    .map(|(&ub, &n)| {
                        cum += n;
                        let mut b = Bucket::default();
                        b.set_upper_bound(ub);
                        b.set_cumulative_count(cum);
                        b
                    })
                    .collect();
                let mut h = Histogram::default();
                h.set_bucket(buckets);
                h.set_sample_count(counts.iter().sum());
                h.set_sample_sum(*sum_ns as f64 * 1e-9);
                let mut metric = Metric::from_label(labels(m, Some(op)));
                metric.set_histogram(h);
                metric
            })
        })
        .collect();
    vec![
        family(
            "nacre_volume_bytes_total",
            "Bytes read and written by completed requests.",
            MetricType::COUNTER,
            per_op(&OPS[..2], &|t, i| t.bytes[i]),
        ),
        family(
            "nacre_volume_errors_total",
            "Requests that completed with an error.",
            MetricType::COUNTER,
            per_vol(counter, &|t| t.errors),
        ),
        family(
            "nacre_volume_latency_seconds",
            "Time from a request's arrival at the volume to its completion (QoS wait included).",
            MetricType::HISTOGRAM,
            latency,
        ),
        family(
            "nacre_volume_ops_total",
            "Completed requests by operation (read, write, flush, discard, write_zeroes).",
            MetricType::COUNTER,
            per_op(&OPS, &|t, i| t.ops[i]),
        ),
        family(
            "nacre_volume_qos_queued",
            "Requests waiting for QoS tokens now.",
            MetricType::GAUGE,
            per_vol(gauge, &Totals::qos_queued),
        ),
        family(
            "nacre_volume_qos_throttled_total",
            "Requests that waited for QoS tokens.",
            MetricType::COUNTER,
            per_vol(counter, &|t| t.throttled),
        ),
        family(
            "nacre_volume_queue_depth",
            "Requests inside the volume now (waiting for QoS tokens or at the device).",
            MetricType::GAUGE,
            per_vol(gauge, &Totals::queue_depth),
        ),
    ]
}

/// One volume's statistics (see [`Telemetry::volume`]).
pub struct VolumeMetrics {
    /// One shard per thread slot, the last one shared ([`clock::OVERFLOW`]); made on first use.
    shards: Box<[OnceLock<Box<Shard>>]>,
    volume: String,
    tenant: Option<String>,
    telemetry: Arc<Telemetry>,
}

impl VolumeMetrics {
    /// This thread's shard, and whether it owns it.
    #[inline]
    fn mine(&self) -> (&Shard, bool) {
        let s = clock::slot();
        (self.shards[s].get_or_init(Shard::new), s != clock::OVERFLOW)
    }

    /// A request arrived.
    #[inline]
    pub fn start(&self) {
        let (s, x) = self.mine();
        add(&s.arrived, 1, x);
    }

    /// A request completed `elapsed_ns` after it arrived.
    #[inline]
    pub fn finish(&self, kind: IoKind, bytes: u64, elapsed_ns: u64, error: bool) {
        let (s, x) = self.mine();
        s.record(x, kind, bytes, elapsed_ns, error);
    }

    /// A recorder for requests this thread handles from now until it drops it ([`Recorder`]).
    pub fn recorder(&self) -> Recorder<'_> {
        let (shard, exclusive) = self.mine();
        Recorder {
            shard,
            exclusive,
            _this_thread: std::marker::PhantomData,
        }
    }

    /// The volume these statistics are of.
    pub fn volume(&self) -> &str {
        &self.volume
    }

    /// A frontend took a request for this volume: count it and stamp its arrival (on the
    /// batch clock, so inside a frontend's batch this reads no clock).
    #[inline]
    pub fn arrive(&self, kind: IoKind, bytes: u64) -> Arrival {
        self.recorder().arrive(kind, bytes)
    }

    /// The request stamped `a` completed (`error`: it failed). Any thread may call it.
    #[inline]
    pub fn complete(&self, a: &Arrival, error: bool) {
        self.recorder().complete(a, error);
    }

    /// A request starts waiting for QoS tokens.
    pub fn throttled_enter(&self) {
        let (s, x) = self.mine();
        add(&s.throttled, 1, x);
    }

    /// A waiting request got its tokens.
    pub fn throttled_leave(&self) {
        let (s, x) = self.mine();
        add(&s.unthrottled, 1, x);
    }

    fn totals(&self) -> Totals {
        let mut t = Totals {
            arrived: 0,
            ops: [0; 5],
            bytes: [0; 2],
            errors: 0,
            throttled: 0,
            unthrottled: 0,
            lat: [([0; NB + 1], 0); 3],
        };
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        for s in self.shards.iter().filter_map(OnceLock::get) {
            t.arrived += get(&s.arrived);
            for (a, b) in t.ops.iter_mut().zip(&s.ops) {
                *a += get(b);
            }
            for (a, b) in t.bytes.iter_mut().zip(&s.bytes) {
                *a += get(b);
            }
            t.errors += get(&s.errors);
            t.throttled += get(&s.throttled);
            t.unthrottled += get(&s.unthrottled);
            for ((counts, sum), h) in t.lat.iter_mut().zip(&s.lat) {
                for (a, b) in counts.iter_mut().zip(&h.counts) {
                    *a += get(b);
                }
                *sum += get(&h.sum_ns);
            }
        }
        t
    }

    /// The counters as `stats_get` reports them.
    pub fn snapshot(&self) -> nacre_shared::api::qos::VolumeStats {
        let t = self.totals();
        let (p50, p99, p999) = quantiles(&t);
        nacre_shared::api::qos::VolumeStats {
            volume: self.volume.clone(),
            tenant: self.tenant.clone(),
            read_ops: t.ops[0],
            write_ops: t.ops[1],
            other_ops: t.ops[2..].iter().sum(),
            read_bytes: t.bytes[0],
            write_bytes: t.bytes[1],
            errors: t.errors,
            queue_depth: t.queue_depth(),
            throttled: t.qos_queued(),
            throttled_total: t.throttled,
            p50_us: p50 * 1e6,
            p99_us: p99 * 1e6,
            p999_us: p999 * 1e6,
        }
    }
}

impl Drop for VolumeMetrics {
    fn drop(&mut self) {
        self.telemetry
            .release(&self.volume, self.tenant.as_deref().unwrap_or(""));
    }
}

/// p50, p99 and p99.9 (seconds, as bucket upper bounds) over all operations.
fn quantiles(t: &Totals) -> (f64, f64, f64) {
    let mut counts = [0u64; NB + 1];
    for (c, _) in &t.lat {
        for (a, b) in counts.iter_mut().zip(c) {
            *a += b;
        }
    }
    let total: u64 = counts.iter().sum();
    let bounds = latency_buckets();
    let q = |p: f64| {
        if total == 0 {
            return 0.0;
        }
        let want = (total as f64 * p).ceil() as u64;
        let mut cum = 0;
        for (i, n) in counts.iter().enumerate() {
            cum += n;
            if cum >= want {
                return bounds.get(i).copied().unwrap_or(f64::INFINITY);
            }
        }
        f64::INFINITY
    };
    (q(0.5), q(0.99), q(0.999))
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn series_follow_volume_lifetimes_and_render() {
        let t = Arc::new(Telemetry::new());
        let a = t.volume("va", Some("acme"));
        let a2 = t.volume("va", Some("acme"));
        a.start();
        a.finish(IoKind::Read, 4096, 30_000, false);
        a2.start();
        a2.finish(IoKind::Write, 8192, 300_000, true);
        let text = t.render();
        assert!(
            text.contains(r#"nacre_volume_ops_total{op="read",tenant="acme",volume="va"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"nacre_volume_bytes_total{op="read",tenant="acme",volume="va"} 4096"#)
        );
        // The failed write counts as an error and moves no bytes.
        assert!(text.contains(r#"nacre_volume_errors_total{tenant="acme",volume="va"} 1"#));
        assert!(
            text.contains(r#"nacre_volume_bytes_total{op="write",tenant="acme",volume="va"} 0"#)
        );
        assert!(text.contains("nacre_volume_latency_seconds_bucket"));
        let s = a.snapshot();
        assert_eq!(
            (s.read_ops, s.write_ops, s.errors, s.queue_depth),
            (1, 1, 1, 0)
        );
        assert!(s.p50_us >= 30.0 && s.p50_us < 30.0 * 1.26 + 1e-9, "{s:?}");
        drop(a);
        assert!(
            t.render().contains(r#"volume="va""#),
            "series go with the last user"
        );
        drop(a2);
        assert!(!t.render().contains(r#"volume="va""#));
    }

    /// Threads count into shards of their own; the scrape sums them all, none lost, and the
    /// integer bucket search agrees with the `le` comparison Prometheus makes.
    #[test]
    fn shards_of_many_threads_sum_exactly() {
        let t = Arc::new(Telemetry::new());
        let m = t.volume("v", None);
        std::thread::scope(|s| {
            for i in 0..8u64 {
                let m = &m;
                s.spawn(move || {
                    for n in 0..10_000u64 {
                        m.start();
                        m.finish(
                            IoKind::Read,
                            4096,
                            (n * 7919 + i) % 50_000_000,
                            n % 1000 == 0,
                        );
                    }
                });
            }
        });
        let totals = m.totals();
        assert_eq!(totals.arrived, 80_000);
        assert_eq!(totals.ops[0], 80_000);
        assert_eq!(totals.errors, 80);
        assert_eq!(totals.bytes[0], (80_000 - 80) * 4096);
        assert_eq!(totals.lat[0].0.iter().sum::<u64>(), 80_000);
        assert_eq!(totals.queue_depth(), 0);
        let bounds = latency_buckets();
        for ns in (0..20_000u64).chain([1_259, 1_260, 1_587, 1_588, 16_777_216_000, u64::MAX]) {
            // As `Duration::as_secs_f64` converted latencies before.
            let secs = ns as f64 / 1e9;
            let want = bounds.iter().position(|&b| secs <= b).unwrap_or(NB);
            assert_eq!(bucket_of(ns), want, "{ns} ns");
        }
    }

    #[test]
    fn buckets_are_fine_enough_for_the_stated_bound() {
        let b = latency_buckets();
        for w in b.windows(2) {
            assert!(w[1] / w[0] < 1.26 + 1e-9);
        }
        assert!(b[0] <= 1e-6 && *b.last().unwrap() > 10.0);
    }

    /// Every volume metric the Grafana dashboard in scripts/grafana queries is one nacred exports
    /// (histograms as their _bucket, _sum and _count series), so a renamed metric cannot leave
    /// the dashboard silently empty.
    #[test]
    fn grafana_dashboard_queries_only_exported_metrics() {
        let t = Arc::new(Telemetry::new());
        let m = t.volume("v", Some("t"));
        for kind in [IoKind::Read, IoKind::Write, IoKind::Flush] {
            m.start();
            m.finish(kind, 4096, 10_000, false);
        }
        m.throttled_enter();
        m.throttled_leave();
        let text = t.render();
        let mut exported = std::collections::HashSet::new();
        for line in text.lines() {
            let mut w = line.split_whitespace();
            if let (Some("#"), Some("TYPE"), Some(name), Some(kind)) =
                (w.next(), w.next(), w.next(), w.next())
            {
                exported.insert(name.to_string());
                if kind == "histogram" {
                    for suffix in ["_bucket", "_sum", "_count"] {
                        exported.insert(format!("{name}{suffix}"));
                    }
                }
            }
        }
        let dashboard: serde_json::Value = serde_json::from_str(include_str!(
            "../../../scripts/grafana/nacre-dashboard.json"
        ))
        .expect("the dashboard is JSON");
        let mut exprs = Vec::new();
        for panel in dashboard["panels"].as_array().expect("panels") {
            for target in panel["targets"].as_array().expect("targets") {
                exprs.push(target["expr"].as_str().expect("expr").to_string());
            }
        }
        for var in dashboard["templating"]["list"]
            .as_array()
            .expect("variables")
        {
            if let Some(q) = var["definition"].as_str() {
                exprs.push(q.to_string());
            }
        }
        assert!(exprs.len() >= 8, "{exprs:?}");
        for e in &exprs {
            let names: Vec<&str> = e
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("nacre_"))
                .collect();
            assert!(!names.is_empty(), "{e} queries no nacre metric");
            // The daemon's own series (devices, paths, limits) are checked against a running
            // nacred by tests/qos_prometheus.rs.
            let names = names.into_iter().filter(|n| n.starts_with("nacre_volume_"));
            for n in names {
                assert!(
                    exported.contains(n),
                    "{e}: {n} is not exported ({exported:?})"
                );
            }
        }
    }
}
