//! Tests of the QoS layer: per-thread credit, and rates, bursts, limit changes, tenant limits
//! and weights measured on a fake clock.

use super::bucket::{IOPS, READ_BPS, WRITE_BPS};
use super::*;
use crate::volume::null::NullVolume;
use crate::volume::{IoKind, IoResult, Segment};
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
