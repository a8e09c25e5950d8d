//! The per-request cost of the QoS and statistics layer ([`nacre_dpu::volume::qos`]), alone:
//! one thread submits 4 KiB reads to a null volume in batches of 32, as the vhost-user-blk
//! queue worker does (one batch-clock read per batch, each request recorded in the volume's
//! statistics as that worker records it: `arrive` before the submit, `complete` after, on a
//! recorder made once per batch), through
//!   - `bare`:    the null volume itself (what `nacred --no-qos` runs; no statistics),
//!   - `stats`:   the layer with no limit (statistics only),
//!   - `limited`: the layer with a volume IOPS limit no run reaches (every request takes
//!     tokens from the thread's credit).
//!
//! Rounds alternate between the three so a noisy host disturbs all alike; the best round of
//! each is kept. It prints ns per request and the throughput ratio of each against `bare`:
//! the end-to-end goal (scripts/bench-qos, docs/benchmarks.md) is ≥ 0.95, so the layer may cost at most
//! about 5% of a request's whole path through nacred.
//!
//! Run: `cargo bench -p nacre-dpu --bench qos_layer` (ROUNDS, REQUESTS to change the size).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use nacre_dpu::telemetry::{self, Telemetry};
use nacre_dpu::volume::null::NullVolume;
use nacre_dpu::volume::qos::{Qos, VolumePath};
use nacre_dpu::volume::{BlockDevice, IoCompletion, IoKind, IoRequest, IoResult, Segment};
use nacre_shared::api::qos::QosLimits;

/// The frontend's completion: counts, as a queue's completer records a used element.
struct Count(AtomicU64);

impl IoCompletion for Count {
    fn complete(&self, _tag: u64, r: IoResult) {
        assert!(r.is_ok());
        self.0
            .store(self.0.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

const BATCH: u64 = 32;

fn run(dev: &VolumePath, done: &Arc<dyn IoCompletion>, buf: &mut [u8], n: u64) -> f64 {
    let metrics = dev.metrics();
    let t = Instant::now();
    let mut i = 0;
    while i < n {
        let _batch = telemetry::clock::batch();
        let rec = metrics.map(|m| m.recorder());
        for _ in 0..BATCH {
            // SAFETY: the null volume never touches segment memory; `buf` outlives the call.
            let seg = unsafe { Segment::new(buf.as_mut_ptr(), buf.len()) };
            let off = (i * 4096) & ((1 << 30) - 1);
            let arrival = rec.as_ref().map(|r| r.arrive(IoKind::Read, 4096));
            dev.submit(
                IoRequest::new(IoKind::Read, off, 4096, i).with_segments([seg]),
                done,
            );
            // The null volume completed inline; a frontend records it as it finishes.
            if let (Some(r), Some(a)) = (&rec, &arrival) {
                r.complete(a, false);
            }
            i += 1;
        }
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // nacred's logging as it runs by default (per-request tracing off, as in production).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .with_writer(std::io::stderr)
        .init();
    let rounds = env("ROUNDS", 7);
    let n = env("REQUESTS", 4_000_000);
    let qos = Qos::start(Arc::new(Telemetry::new()));
    let bare: Arc<dyn BlockDevice> = Arc::new(NullVolume::new(1 << 30, 512));
    let stats = qos.wrap("stats", None, Arc::new(NullVolume::new(1 << 30, 512)));
    let limited = qos.wrap("limited", None, Arc::new(NullVolume::new(1 << 30, 512)));
    qos.set(
        Some("limited"),
        None,
        Some(&QosLimits {
            iops: Some(100_000_000_000),
            ..Default::default()
        }),
    );
    let count = Arc::new(Count(AtomicU64::new(0)));
    let done: Arc<dyn IoCompletion> = count.clone();
    let mut buf = vec![0u8; 4096];
    // Each as a frontend submits to it.
    let devs: [(&str, VolumePath); 3] = [
        ("bare", VolumePath::new(bare)),
        ("stats", VolumePath::new(stats)),
        ("limited", VolumePath::new(limited)),
    ];
    let mut best = [f64::INFINITY; 3];
    for _ in 0..rounds {
        for (k, (_, d)) in devs.iter().enumerate() {
            best[k] = best[k].min(run(d, &done, &mut buf, n));
        }
    }
    assert_eq!(
        count.0.load(Ordering::Relaxed),
        3 * rounds * n.div_ceil(BATCH) * BATCH
    );
    println!("qos_layer: 4 KiB reads on a null volume, batches of {BATCH}, best of {rounds} rounds of {n}");
    for (k, (name, _)) in devs.iter().enumerate() {
        println!(
            "  {name:<8} {:7.1} ns/request  (+{:5.1} ns)  throughput vs bare {:.2}",
            best[k],
            best[k] - best[0],
            best[0] / best[k]
        );
    }
}
