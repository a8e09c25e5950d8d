//! Multipath and striping over remote namespaces: one namespace through two portals
//! (failover and round-robin, a path cut under load with zero failed I/O, the other path
//! never reset), refusal to group different namespaces, and a stripe across two of nacred's
//! own targets that reads back exactly what was written.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::fabric::{
    Controller, ControllerConfig, MultipathDevice, PathPolicy, Phase, RemoteNamespace,
};
use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::stripe::StripeVolume;
use nacre_dpu::volume::{BlockDevice, IoError};
use nacre_tests::fabric_support::{pattern, FakeTarget, Proxy, Storage, TargetOpts};

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000c1";
const HANG: Duration = Duration::from_secs(30);

fn ctrl_to(port: u16, subnqn: &str, name: &str) -> Controller {
    let mut c = ControllerConfig::new("127.0.0.1", port, subnqn, HOSTNQN);
    c.io_queues = 2;
    c.queue_depth = 16;
    c.reconnect_delay = Duration::from_millis(100);
    c.ctrl_loss_timeout = Some(Duration::from_secs(20));
    // Cuts here close the sockets (Proxy::sever), which the queues see at once: keep-alive
    // detects nothing in these tests, and a short one would reset a path whose threads a
    // loaded machine starved for a moment.
    c.keep_alive_timeout = Duration::from_secs(5);
    c.connect_timeout = Duration::from_secs(2);
    c.quiesce_time = Duration::from_millis(100);
    let ctrl = Controller::start(name, c, None);
    nacre_tests::fabric_support::wait_live(&ctrl, HANG);
    ctrl
}

fn path(ctrl: &Controller) -> Arc<RemoteNamespace> {
    let ns = ctrl.core().namespaces()[0].clone();
    Arc::new(RemoteNamespace::as_path(ctrl.core().clone(), ns))
}

fn wait_phase(ctrl: &Controller, p: Phase) {
    let t = Instant::now();
    while ctrl.core().phase() != p {
        assert!(t.elapsed() < HANG, "controller never reached {p:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

struct Two {
    _t: FakeTarget,
    st: Storage,
    pa: Proxy,
    pb: Proxy,
    ca: Controller,
    cb: Controller,
}

fn two_portals() -> Two {
    let opts = TargetOpts::default();
    let st = Storage::new(&[(1, 4 << 20, 512, [0xD1; 16])]);
    let t = FakeTarget::start(opts.clone(), st.clone());
    let pa = Proxy::start(t.addr);
    let pb = Proxy::start(t.addr);
    let ca = ctrl_to(pa.port(), &opts.subnqn, "portal-a");
    let cb = ctrl_to(pb.port(), &opts.subnqn, "portal-b");
    Two {
        _t: t,
        st,
        pa,
        pb,
        ca,
        cb,
    }
}

/// Writers that verify what they wrote, until told to stop; returns (ops, errors).
fn load(
    dev: Arc<dyn BlockDevice>,
    stop: Arc<AtomicBool>,
) -> (
    Vec<std::thread::JoinHandle<()>>,
    Arc<AtomicU64>,
    Arc<AtomicU64>,
) {
    let ops = Arc::new(AtomicU64::new(0));
    let errs = Arc::new(AtomicU64::new(0));
    let hs = (0..4u64)
        .map(|w| {
            let (dev, stop, ops, errs) = (dev.clone(), stop.clone(), ops.clone(), errs.clone());
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let off = (w * 256 + i % 200) * 4096; // disjoint per worker
                    let d = pattern(w << 32 | i, off, 4096 + 4096 * (i % 4) as usize);
                    let mut b = vec![0u8; d.len()];
                    match dev.write_at(off, &d).and_then(|_| dev.read_at(off, &mut b)) {
                        Ok(()) if b == d => {}
                        Ok(()) => {
                            errs.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            eprintln!("I/O failed: {e}");
                            errs.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    (hs, ops, errs)
}

fn wait_ops(ops: &AtomicU64, n: u64) {
    let t = Instant::now();
    let start = ops.load(Ordering::Relaxed);
    while ops.load(Ordering::Relaxed) < start + n {
        assert!(t.elapsed() < HANG, "I/O stopped making progress");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn cut_under_load(policy: PathPolicy) {
    let two = two_portals();
    let mp = Arc::new(
        MultipathDevice::new(vec![path(&two.ca), path(&two.cb)], policy).expect("same namespace"),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let (hs, ops, errs) = load(mp.clone(), stop.clone());
    wait_ops(&ops, 200);
    let b_before = two.cb.core().submitted.load(Ordering::Relaxed);
    if policy == PathPolicy::Failover {
        assert_eq!(
            b_before, 0,
            "failover: the passive path carries nothing while A is up"
        );
    } else {
        assert!(b_before > 0, "round-robin: both paths carry I/O");
    }
    two.pa.sever();
    wait_phase(&two.ca, Phase::Connecting);
    wait_ops(&ops, 300);
    assert!(
        two.cb.core().submitted.load(Ordering::Relaxed) > b_before,
        "B took over"
    );
    two.pa.restore();
    wait_phase(&two.ca, Phase::Live);
    wait_ops(&ops, 200);
    stop.store(true, Ordering::Relaxed);
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(errs.load(Ordering::Relaxed), 0, "zero failed I/O");
    assert!(two.ca.core().status().resets >= 1);
    assert_eq!(
        two.cb.core().status().resets,
        0,
        "one path failing never resets the other"
    );
    let _ = &two.st;
    let _ = &two.pb;
}

#[test]
fn failover_one_portal_cut_under_load_zero_failed_io() {
    cut_under_load(PathPolicy::Failover);
}

#[test]
fn round_robin_one_portal_cut_under_load_zero_failed_io() {
    cut_under_load(PathPolicy::RoundRobin);
}

#[test]
fn all_paths_down_io_waits_for_one_to_return() {
    let two = two_portals();
    let mp = Arc::new(
        MultipathDevice::new(vec![path(&two.ca), path(&two.cb)], PathPolicy::RoundRobin).unwrap(),
    );
    two.pa.sever();
    two.pb.sever();
    wait_phase(&two.ca, Phase::Connecting);
    wait_phase(&two.cb, Phase::Connecting);
    let h = {
        let mp = mp.clone();
        std::thread::spawn(move || mp.write_at(8192, &[0x77; 4096]))
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(!h.is_finished(), "parked while no path is up");
    two.pb.restore();
    assert_eq!(h.join().unwrap(), Ok(()));
    assert!(two.st.read(1, 8192, 4096).iter().all(|&b| b == 0x77));
}

#[test]
fn all_paths_failed_fails_with_path_failed() {
    let opts = TargetOpts::default();
    let st = Storage::new(&[(1, 1 << 20, 512, [0xD2; 16])]);
    let t = FakeTarget::start(opts.clone(), st);
    let pa = Proxy::start(t.addr);
    let pb = Proxy::start(t.addr);
    let mk = |p: &Proxy, n: &str| {
        let mut c = ControllerConfig::new("127.0.0.1", p.port(), &opts.subnqn, HOSTNQN);
        c.reconnect_delay = Duration::from_millis(50);
        c.ctrl_loss_timeout = Some(Duration::from_millis(400));
        let ctrl = Controller::start(n, c, None);
        nacre_tests::fabric_support::wait_live(&ctrl, HANG);
        ctrl
    };
    let (ca, cb) = (mk(&pa, "a"), mk(&pb, "b"));
    let mp = MultipathDevice::new(vec![path(&ca), path(&cb)], PathPolicy::Failover).unwrap();
    pa.sever();
    pb.sever();
    let mut b = [0u8; 512];
    // Parked while the paths reconnect, failed once both are past ctrl_loss_timeout: for
    // good, which a host behind nacred is told with DNR.
    assert_eq!(mp.read_at(0, &mut b), Err(IoError::PathFailed));
    wait_phase(&ca, Phase::Failed);
    wait_phase(&cb, Phase::Failed);
    assert_eq!(mp.read_at(0, &mut b), Err(IoError::PathFailed));
}

#[test]
fn different_namespaces_are_never_grouped() {
    let opts = TargetOpts::default();
    let ta = FakeTarget::start(opts.clone(), Storage::new(&[(1, 1 << 20, 512, [0xE1; 16])]));
    let tb = FakeTarget::start(opts.clone(), Storage::new(&[(1, 1 << 20, 512, [0xE2; 16])]));
    let ca = ctrl_to(ta.port(), &opts.subnqn, "a");
    let cb = ctrl_to(tb.port(), &opts.subnqn, "b");
    let e = MultipathDevice::new(vec![path(&ca), path(&cb)], PathPolicy::Failover)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("not the same namespace"), "{e}");
    // Same NGUID but a different size is refused too.
    let tc = FakeTarget::start(opts.clone(), Storage::new(&[(1, 2 << 20, 512, [0xE1; 16])]));
    let cc = ctrl_to(tc.port(), &opts.subnqn, "c");
    assert!(MultipathDevice::new(vec![path(&ca), path(&cc)], PathPolicy::Failover).is_err());
}

fn nacre_shelf(nqn: &str, size: u64) -> (Arc<NvmfTarget>, SocketAddr, Arc<RamVolume>) {
    let t = NvmfTarget::new();
    t.create_subsystem(nqn, "SHELF", "nacre shelf", true)
        .unwrap();
    let vol = Arc::new(RamVolume::new(size, 4096).unwrap());
    let mut nguid = [0u8; 16];
    nguid[..nqn.len().min(16)].copy_from_slice(&nqn.as_bytes()[nqn.len().saturating_sub(16)..]);
    t.add_namespace(nqn, None, vol.clone(), nguid, "v".into())
        .unwrap();
    let addr = t.add_listener(nqn, "127.0.0.1:0".parse().unwrap()).unwrap();
    (t, addr, vol)
}

#[test]
fn stripe_over_two_of_nacreds_targets_reads_back_exactly() {
    let (_ta, aa, ra) = nacre_shelf("nqn.2024-01.io.nacre:shelf-a", 8 << 20);
    let (_tb, ab, rb) = nacre_shelf("nqn.2024-01.io.nacre:shelf-b", 8 << 20);
    let ca = ctrl_to(aa.port(), "nqn.2024-01.io.nacre:shelf-a", "a");
    let cb = ctrl_to(ab.port(), "nqn.2024-01.io.nacre:shelf-b", "b");
    let na = Arc::new(RemoteNamespace::new(
        ca.core().clone(),
        ca.core().namespaces()[0].clone(),
    ));
    let nb = Arc::new(RemoteNamespace::new(
        cb.core().clone(),
        cb.core().namespaces()[0].clone(),
    ));
    let stripe_size = 64 << 10;
    let s = StripeVolume::new(vec![na, nb], stripe_size).unwrap();
    assert_eq!(s.geometry().size, 16 << 20, "capacity adds up");
    // Writes that straddle units, and one across the whole volume.
    let whole = pattern(42, 0, 16 << 20);
    s.write_at(0, &whole).unwrap();
    let part = pattern(43, 100 << 10, 300 << 10);
    s.write_at(100 << 10, &part).unwrap();
    let mut expect = whole.clone();
    expect[(100 << 10)..(400 << 10)].copy_from_slice(&part);
    let mut back = vec![0u8; 16 << 20];
    s.read_at(0, &mut back).unwrap();
    assert!(
        back == expect,
        "the stripe reads back exactly what was written"
    );
    // And the units really are on alternate shelves.
    for unit in 0..8u64 {
        let (shelf, off) = (unit % 2, (unit / 2) * stripe_size);
        let mut at_rest = vec![0u8; stripe_size as usize];
        let vol = if shelf == 0 { &ra } else { &rb };
        vol.read_at(off, &mut at_rest).unwrap();
        let v = (unit * stripe_size) as usize;
        assert!(
            at_rest[..] == expect[v..v + stripe_size as usize],
            "unit {unit}"
        );
    }
}
