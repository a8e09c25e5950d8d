//! Telemetry: per-volume (and, by their `tenant` label, per-tenant) I/O counters, queue depth,
//! QoS throttling and latency histograms, kept by the `prometheus` crate and served in the
//! Prometheus text exposition format (version 0.0.4) on a loopback HTTP endpoint.
//!
//! The data path only touches atomics: [`VolumeMetrics`] holds the resolved children of every
//! metric vector, so recording a completion is a few atomic adds and no map lookup. Latency is
//! measured from the request's arrival at the volume (QoS queueing included) to its completion,
//! i.e. everything below the frontend.
//!
//! Latency buckets grow by 2^(1/3) (≈1.26) from 1 µs to ~17 s, so `histogram_quantile`
//! computed from them is within one bucket (+26%/−21%) of the true quantile.

pub mod http;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::core::Metric;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::volume::IoKind;

/// Latency buckets: 1 µs × 2^(k/3), k = 0..73 (last finite bound ≈ 16.8 s).
pub fn latency_buckets() -> Vec<f64> {
    (0..73).map(|k| 1e-6 * 2f64.powf(k as f64 / 3.0)).collect()
}

const VOL_LABELS: &[&str] = &["volume", "tenant"];
const OP_LABELS: &[&str] = &["volume", "tenant", "op"];

/// Text appended to every scrape (device and path series the control plane renders).
pub type ExtraSource = Box<dyn Fn() -> String + Send + Sync>;

/// Every metric nacred exports.
pub struct Telemetry {
    registry: Registry,
    ops: IntCounterVec,
    bytes: IntCounterVec,
    errors: IntCounterVec,
    queue_depth: IntGaugeVec,
    qos_queued: IntGaugeVec,
    qos_throttled: IntCounterVec,
    latency: HistogramVec,
    /// How many live volume layers use each (volume, tenant) label pair: series are removed
    /// when the last one goes, so deleted volumes leave no stale series.
    users: Mutex<HashMap<(String, String), usize>>,
    extra: Mutex<Option<ExtraSource>>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

impl Telemetry {
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique");
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), VOL_LABELS).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique");
            g
        };
        let ops = counter(
            "nacre_volume_ops_total",
            "Completed requests by operation (read, write, flush, discard, write_zeroes).",
            OP_LABELS,
        );
        let bytes = counter(
            "nacre_volume_bytes_total",
            "Bytes read and written by completed requests.",
            OP_LABELS,
        );
        let errors = counter(
            "nacre_volume_errors_total",
            "Requests that completed with an error.",
            VOL_LABELS,
        );
        let qos_throttled = counter(
            "nacre_volume_qos_throttled_total",
            "Requests that waited for QoS tokens.",
            VOL_LABELS,
        );
        let queue_depth = gauge(
            "nacre_volume_queue_depth",
            "Requests inside the volume now (waiting for QoS tokens or at the device).",
        );
        let qos_queued = gauge(
            "nacre_volume_qos_queued",
            "Requests waiting for QoS tokens now.",
        );
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "nacre_volume_latency_seconds",
                "Time from a request's arrival at the volume to its completion (QoS wait included).",
            )
            .buckets(latency_buckets()),
            &["volume", "tenant", "op"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(latency.clone()))
            .expect("unique");
        Telemetry {
            registry,
            ops,
            bytes,
            errors,
            queue_depth,
            qos_queued,
            qos_throttled,
            latency,
            users: Mutex::new(HashMap::new()),
            extra: Mutex::new(None),
        }
    }

    /// The metric children of one volume layer.
    pub fn volume(self: &Arc<Self>, volume: &str, tenant: Option<&str>) -> VolumeMetrics {
        let t = tenant.unwrap_or("");
        *self
            .users
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((volume.to_string(), t.to_string()))
            .or_default() += 1;
        let op = |v: &IntCounterVec, op: &str| v.with_label_values(&[volume, t, op]);
        let lat = |op: &str| self.latency.with_label_values(&[volume, t, op]);
        VolumeMetrics {
            read_ops: op(&self.ops, "read"),
            write_ops: op(&self.ops, "write"),
            flush_ops: op(&self.ops, "flush"),
            discard_ops: op(&self.ops, "discard"),
            zeroes_ops: op(&self.ops, "write_zeroes"),
            read_bytes: op(&self.bytes, "read"),
            write_bytes: op(&self.bytes, "write"),
            errors: self.errors.with_label_values(&[volume, t]),
            queue_depth: self.queue_depth.with_label_values(&[volume, t]),
            qos_queued: self.qos_queued.with_label_values(&[volume, t]),
            qos_throttled: self.qos_throttled.with_label_values(&[volume, t]),
            lat_read: lat("read"),
            lat_write: lat("write"),
            lat_other: lat("other"),
            volume: volume.to_string(),
            tenant: tenant.map(str::to_string),
            telemetry: self.clone(),
        }
    }

    fn release(&self, volume: &str, tenant: &str) {
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        let key = (volume.to_string(), tenant.to_string());
        let Some(n) = users.get_mut(&key) else { return };
        *n -= 1;
        if *n > 0 {
            return;
        }
        users.remove(&key);
        for v in [&self.ops, &self.bytes] {
            for op in ["read", "write", "flush", "discard", "write_zeroes"] {
                let _ = v.remove_label_values(&[volume, tenant, op]);
            }
        }
        for op in ["read", "write", "other"] {
            let _ = self.latency.remove_label_values(&[volume, tenant, op]);
        }
        let _ = self.errors.remove_label_values(&[volume, tenant]);
        let _ = self.qos_throttled.remove_label_values(&[volume, tenant]);
        let _ = self.queue_depth.remove_label_values(&[volume, tenant]);
        let _ = self.qos_queued.remove_label_values(&[volume, tenant]);
    }

    /// Set the source of series rendered at scrape time (devices, QoS limits, paths).
    pub fn set_extra(&self, f: ExtraSource) {
        *self.extra.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
    }

    /// The whole exposition, as served on `/metrics`.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let mut families = self.registry.gather();
        // Stable output for diffing and tests.
        families.sort_by(|a, b| a.name().cmp(b.name()));
        TextEncoder::new()
            .encode(&families, &mut buf)
            .expect("text encoding of gathered metrics");
        let mut text = String::from_utf8(buf).expect("the text format is UTF-8");
        if let Some(extra) = &*self.extra.lock().unwrap_or_else(|p| p.into_inner()) {
            text.push_str(&extra());
        }
        text
    }
}

/// One volume layer's metrics (see [`Telemetry::volume`]).
pub struct VolumeMetrics {
    read_ops: IntCounter,
    write_ops: IntCounter,
    flush_ops: IntCounter,
    discard_ops: IntCounter,
    zeroes_ops: IntCounter,
    read_bytes: IntCounter,
    write_bytes: IntCounter,
    errors: IntCounter,
    queue_depth: IntGauge,
    qos_queued: IntGauge,
    qos_throttled: IntCounter,
    lat_read: Histogram,
    lat_write: Histogram,
    lat_other: Histogram,
    volume: String,
    tenant: Option<String>,
    telemetry: Arc<Telemetry>,
}

impl VolumeMetrics {
    /// A request arrived.
    pub fn start(&self) {
        self.queue_depth.inc();
    }

    /// A request completed after `elapsed`.
    pub fn finish(&self, kind: IoKind, bytes: u64, elapsed: Duration, error: bool) {
        self.queue_depth.dec();
        let secs = elapsed.as_secs_f64();
        match kind {
            IoKind::Read => {
                self.read_ops.inc();
                self.lat_read.observe(secs);
                if !error {
                    self.read_bytes.inc_by(bytes);
                }
            }
            IoKind::Write => {
                self.write_ops.inc();
                self.lat_write.observe(secs);
                if !error {
                    self.write_bytes.inc_by(bytes);
                }
            }
            other => {
                match other {
                    IoKind::Flush => &self.flush_ops,
                    IoKind::Discard => &self.discard_ops,
                    _ => &self.zeroes_ops,
                }
                .inc();
                self.lat_other.observe(secs);
            }
        }
        if error {
            self.errors.inc();
        }
    }

    /// A request starts waiting for QoS tokens.
    pub fn throttled_enter(&self) {
        self.qos_queued.inc();
        self.qos_throttled.inc();
    }

    /// A waiting request got its tokens.
    pub fn throttled_leave(&self) {
        self.qos_queued.dec();
    }

    /// The counters as `stats_get` reports them.
    pub fn snapshot(&self) -> nacre_shared::api::qos::VolumeStats {
        let (p50, p99, p999) = quantiles(&[&self.lat_read, &self.lat_write, &self.lat_other]);
        nacre_shared::api::qos::VolumeStats {
            volume: self.volume.clone(),
            tenant: self.tenant.clone(),
            read_ops: self.read_ops.get(),
            write_ops: self.write_ops.get(),
            other_ops: self.flush_ops.get() + self.discard_ops.get() + self.zeroes_ops.get(),
            read_bytes: self.read_bytes.get(),
            write_bytes: self.write_bytes.get(),
            errors: self.errors.get(),
            queue_depth: self.queue_depth.get().max(0) as u64,
            throttled: self.qos_queued.get().max(0) as u64,
            throttled_total: self.qos_throttled.get(),
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

/// p50, p99 and p99.9 (seconds, as bucket upper bounds) over the sum of some histograms.
fn quantiles(hs: &[&Histogram]) -> (f64, f64, f64) {
    let mut counts: Vec<(f64, u64)> = Vec::new();
    for h in hs {
        let m = h.metric();
        for (i, b) in m.get_histogram().get_bucket().iter().enumerate() {
            if counts.len() <= i {
                counts.push((b.upper_bound(), 0));
            }
            counts[i].1 += b.cumulative_count();
        }
    }
    let total: u64 = hs.iter().map(|h| h.get_sample_count()).sum();
    let q = |p: f64| {
        if total == 0 {
            return 0.0;
        }
        let want = (total as f64 * p).ceil() as u64;
        counts
            .iter()
            .find(|(_, c)| *c >= want)
            .map_or(f64::INFINITY, |(ub, _)| *ub)
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
        a.finish(IoKind::Read, 4096, Duration::from_micros(30), false);
        a.start();
        a.finish(IoKind::Write, 8192, Duration::from_micros(300), true);
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
            m.finish(kind, 4096, Duration::from_micros(10), false);
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
