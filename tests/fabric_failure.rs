//! Failure semantics of the initiator, with a proxy between it and the target that the test
//! severs, restores and stalls: I/O held across a reconnect completes and verifies; past
//! fast_io_fail_timeout it fails fast; past ctrl_loss_timeout the controller fails and every
//! I/O ends with PathFailed (fast_io_fail's errors are PathLost: the path may come back), never
//! hangs; teardown of a dead controller is prompt.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use nacre_dpu::fabric::{Controller, ControllerConfig, Phase, RemoteNamespace};
use nacre_dpu::volume::{BlockDevice, IoCompletion, IoError, IoKind, IoRequest, IoResult, Segment};
use nacre_tests::fabric_support::{
    behind_proxy, pattern, FakeTarget, Fault, Proxy, Storage, TargetOpts,
};

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000f1";
/// How long a test waits for something that must happen before declaring it hung. Not a
/// performance bound: the knobs under test are all well below a second.
const HANG: Duration = Duration::from_secs(30);

struct Setup {
    _target: FakeTarget,
    proxy: Proxy,
    storage: Storage,
    ctrl: Controller,
    dev: Arc<RemoteNamespace>,
}

fn setup(tweak: impl FnOnce(&mut ControllerConfig)) -> Setup {
    let storage = Storage::new(&[(1, 4 << 20, 512, [0x31; 16])]);
    let (target, proxy, mut c) = behind_proxy(TargetOpts::default(), &storage, HOSTNQN);
    c.io_queues = 2;
    c.queue_depth = 8;
    c.reconnect_delay = Duration::from_millis(100);
    c.ctrl_loss_timeout = Some(Duration::from_secs(20));
    c.keep_alive_timeout = Duration::from_millis(600);
    c.connect_timeout = Duration::from_millis(500);
    c.quiesce_time = Duration::from_millis(50);
    tweak(&mut c);
    let ctrl = Controller::start("f", c, None);
    let info = nacre_tests::fabric_support::wait_live(&ctrl, HANG);
    let dev = Arc::new(RemoteNamespace::new(
        ctrl.core().clone(),
        info.namespaces[0].clone(),
    ));
    Setup {
        _target: target,
        proxy,
        storage,
        ctrl,
        dev,
    }
}

/// A completion that reports to a channel.
struct Chan(std::sync::Mutex<mpsc::Sender<(u64, IoResult)>>);
impl IoCompletion for Chan {
    fn complete(&self, tag: u64, r: IoResult) {
        let _ = self.0.lock().unwrap().send((tag, r));
    }
}

fn chan() -> (Arc<dyn IoCompletion>, mpsc::Receiver<(u64, IoResult)>) {
    let (tx, rx) = mpsc::channel();
    (Arc::new(Chan(std::sync::Mutex::new(tx))), rx)
}

fn wait_phase(ctrl: &Controller, p: Phase) {
    let t = Instant::now();
    while ctrl.core().phase() != p {
        assert!(t.elapsed() < HANG, "controller never reached {p:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn io_held_across_a_cut_completes_when_the_target_is_back() {
    let s = setup(|_| {});
    let before = pattern(1, 0, 65536);
    s.dev.write_at(0, &before).unwrap();

    s.proxy.sever();
    wait_phase(&s.ctrl, Phase::Connecting);
    // Writes and reads submitted while the path is down are held, not failed.
    let (done, rx) = chan();
    let w = pattern(2, 65536, 65536);
    let mut r = vec![0u8; 65536];
    // SAFETY: both buffers outlive the requests: we wait for both completions below.
    let wseg = unsafe { Segment::new(w.as_ptr() as *mut u8, w.len()) };
    s.dev.submit(
        IoRequest::new(IoKind::Write, 65536, 65536, 1).with_segments([wseg]),
        &done,
    );
    // SAFETY: `r` outlives the request: the test waits for its completion below.
    let seg = unsafe { Segment::from_slice(&mut r) };
    s.dev.submit(
        IoRequest::new(IoKind::Read, 0, 65536, 2).with_segments([seg]),
        &done,
    );
    assert!(
        rx.try_recv().is_err(),
        "nothing completes while the path is cut"
    );
    assert_eq!(s.ctrl.core().status().held, 2);
    s.proxy.restore();
    for _ in 0..2 {
        let (tag, res) = rx
            .recv_timeout(HANG)
            .expect("held I/O completes after reconnect");
        assert_eq!(res, Ok(()), "request {tag}");
    }
    assert!(r == before, "the held read returns the data");
    assert!(
        s.storage.read(1, 65536, 65536) == w,
        "the held write landed"
    );
    // (Live again: waited for, since a short keep-alive on a loaded machine may have reset
    // it once more after the held I/O completed.)
    wait_phase(&s.ctrl, Phase::Live);
    let st = s.ctrl.core().status();
    assert!(st.resets >= 1 && st.connects >= 2, "{st:?}");
}

#[test]
fn target_gone_mid_io_and_back_loses_nothing() {
    let s = setup(|_| {});
    io_across_cuts(&s, 4, 3);
}

/// More submitters than a queue has slots: commands wait in the overflow list and are
/// issued by the queue's reactor as slots free, while cuts close the queue under them (a
/// command stored in a slot the closing reactor had already emptied must come back to the
/// controller, not be lost: a lost one hangs its submitter).
#[test]
fn cuts_while_commands_wait_for_slots_lose_nothing() {
    let s = setup(|c| {
        c.io_queues = 1;
        c.queue_depth = 2;
    });
    io_across_cuts(&s, 8, 4);
}

/// `workers` threads write, read back and compare disjoint ranges while the proxy is cut
/// and restored `cuts` times: every I/O completes, none fails, all data verifies.
fn io_across_cuts(s: &Setup, workers: u64, cuts: usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let ops = Arc::new(AtomicU64::new(0));
    let span = 1024 / workers; // blocks of 4 KiB per worker, in the 4 MiB namespace
    let workers: Vec<_> = (0..workers)
        .map(|w| {
            let (dev, stop, errors, ops) =
                (s.dev.clone(), stop.clone(), errors.clone(), ops.clone());
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let off = (w * span + i % (span - 3)) * 4096; // disjoint per worker
                    let d = pattern(w * 1000 + i, off, 4096 * (1 + (i % 3) as usize));
                    let mut back = vec![0u8; d.len()];
                    let ok = dev.write_at(off, &d).is_ok()
                        && dev.read_at(off, &mut back).is_ok()
                        && back == d;
                    if !ok {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    let wait_ops = |n: u64| {
        let t = Instant::now();
        let start = ops.load(Ordering::Relaxed);
        while ops.load(Ordering::Relaxed) < start + n {
            assert!(t.elapsed() < HANG, "I/O stopped making progress");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    wait_ops(100);
    for _ in 0..cuts {
        s.proxy.sever();
        wait_phase(&s.ctrl, Phase::Connecting);
        std::thread::sleep(Duration::from_millis(50));
        s.proxy.restore();
        wait_phase(&s.ctrl, Phase::Live);
        wait_ops(100);
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(
        errors.load(Ordering::Relaxed),
        0,
        "no I/O failed or returned wrong data"
    );
    assert!(s.ctrl.core().status().resets >= cuts as u64);
}

#[test]
fn past_ctrl_loss_timeout_everything_fails_with_path_failed() {
    let s = setup(|c| {
        c.ctrl_loss_timeout = Some(Duration::from_millis(700));
        c.reconnect_delay = Duration::from_millis(200);
    });
    s.proxy.sever();
    let (done, rx) = chan();
    let mut r = vec![0u8; 4096];
    // SAFETY: `r` outlives the request: the test waits for its completion below.
    let seg = unsafe { Segment::from_slice(&mut r) };
    s.dev.submit(
        IoRequest::new(IoKind::Read, 0, 4096, 7).with_segments([seg]),
        &done,
    );
    let (tag, res) = rx.recv_timeout(HANG).expect("held I/O ends, never hangs");
    assert_eq!((tag, res), (7, Err(IoError::PathFailed)));
    wait_phase(&s.ctrl, Phase::Failed);
    let st = s.ctrl.core().status();
    assert!(
        st.last_error
            .as_deref()
            .unwrap_or("")
            .contains("ctrl_loss_timeout"),
        "{st:?}"
    );
    // New I/O fails at once (inline), even with the path back: a failed controller is final.
    s.proxy.restore();
    assert_eq!(s.dev.read_at(0, &mut r), Err(IoError::PathFailed));
    assert_eq!(s.ctrl.core().phase(), Phase::Failed);
}

#[test]
fn past_fast_io_fail_io_fails_fast_then_recovers() {
    let s = setup(|c| {
        c.fast_io_fail_timeout = Some(Duration::from_millis(300));
        c.reconnect_delay = Duration::from_millis(100);
    });
    s.proxy.sever();
    let mut r = vec![0u8; 4096];
    // Held first, then failed when fast_io_fail_timeout expires.
    assert_eq!(s.dev.read_at(0, &mut r), Err(IoError::PathLost));
    assert!(s.ctrl.core().status().fail_fast);
    assert_eq!(
        s.dev.read_at(0, &mut r),
        Err(IoError::PathLost),
        "fails fast now"
    );
    assert_eq!(
        s.ctrl.core().phase(),
        Phase::Connecting,
        "still reconnecting"
    );
    s.proxy.restore();
    wait_phase(&s.ctrl, Phase::Live);
    s.dev.write_at(0, &[9u8; 4096]).unwrap();
    s.dev.read_at(0, &mut r).unwrap();
    assert!(r.iter().all(|&b| b == 9));
}

#[test]
fn stalled_target_is_reset_by_keep_alive() {
    let s = setup(|c| c.keep_alive_timeout = Duration::from_millis(400));
    s.dev.write_at(0, &[1u8; 4096]).unwrap();
    s.proxy.stall();
    let (done, rx) = chan();
    let w = vec![2u8; 8192];
    // SAFETY: `w` outlives the request (we wait for its completion).
    let seg = unsafe { Segment::new(w.as_ptr() as *mut u8, w.len()) };
    s.dev.submit(
        IoRequest::new(IoKind::Write, 0, 8192, 1).with_segments([seg]),
        &done,
    );
    // Keep-alive notices the silence and resets the session; the write is held.
    wait_phase(&s.ctrl, Phase::Connecting);
    assert!(s
        .ctrl
        .core()
        .status()
        .last_error
        .unwrap_or_default()
        .contains("keep-alive"));
    s.proxy.sever();
    s.proxy.restore();
    let (_, res) = rx.recv_timeout(HANG).expect("completes after the reset");
    assert_eq!(res, Ok(()));
    assert!(s.storage.read(1, 0, 8192).iter().all(|&b| b == 2));
}

#[test]
fn teardown_of_a_dead_controller_is_prompt() {
    let s = setup(|c| {
        c.ctrl_loss_timeout = None; // would retry forever
        c.shutdown_timeout = Duration::from_millis(300);
    });
    s.proxy.stall(); // the worst case: connections open, nobody answering
    let (done, rx) = chan();
    let mut r = vec![0u8; 4096];
    // SAFETY: `r` outlives the request: the test waits for its completion below.
    let seg = unsafe { Segment::from_slice(&mut r) };
    s.dev.submit(
        IoRequest::new(IoKind::Read, 0, 4096, 3).with_segments([seg]),
        &done,
    );
    let t = Instant::now();
    s.ctrl.close();
    let took = t.elapsed();
    // Bounded by shutdown_timeout (plus thread joins), not by any network timeout.
    assert!(took < Duration::from_secs(5), "close took {took:?}");
    assert_eq!(
        rx.recv_timeout(HANG).unwrap(),
        (3, Err(IoError::PathFailed))
    );
    assert_eq!(s.ctrl.core().phase(), Phase::Closed);
    assert_eq!(s.dev.read_at(0, &mut r), Err(IoError::PathFailed));
}

#[test]
fn a_remote_down_at_start_connects_in_the_background() {
    let storage = Storage::new(&[(1, 1 << 20, 512, [0x41; 16])]);
    let opts = TargetOpts::default();
    // Reserve a port, then free it so nothing listens there yet.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut c = ControllerConfig::new("127.0.0.1", port, &opts.subnqn, HOSTNQN);
    c.reconnect_delay = Duration::from_millis(100);
    let expected = vec![nacre_dpu::fabric::NamespaceInfo {
        nsid: 1,
        block_size: 512,
        blocks: 2048,
        nguid: Some([0x41; 16]),
        uuid: None,
        eui64: None,
    }];
    let ctrl = Controller::start("late", c, Some(expected.clone()));
    assert!(
        ctrl.wait_first_attempt(HANG).is_err(),
        "nothing listens yet"
    );
    // A volume over it exists already and holds I/O.
    let dev = Arc::new(RemoteNamespace::new(
        ctrl.core().clone(),
        expected[0].clone(),
    ));
    let (done, rx) = chan();
    let w = vec![7u8; 4096];
    // SAFETY: `w` outlives the request.
    let seg = unsafe { Segment::new(w.as_ptr() as *mut u8, w.len()) };
    dev.submit(
        IoRequest::new(IoKind::Write, 4096, 4096, 1).with_segments([seg]),
        &done,
    );
    let _t = FakeTarget::start_on(&format!("127.0.0.1:{port}"), opts, storage.clone());
    assert_eq!(rx.recv_timeout(HANG).unwrap(), (1, Ok(())));
    assert!(storage.read(1, 4096, 4096).iter().all(|&b| b == 7));
}

#[test]
fn a_reconnect_to_a_different_namespace_fails_the_controller() {
    let opts = TargetOpts::default();
    let a = Storage::new(&[(1, 1 << 20, 512, [0x51; 16])]);
    let t = FakeTarget::start(opts.clone(), a);
    let port = t.port();
    let mut c = ControllerConfig::new("127.0.0.1", port, &opts.subnqn, HOSTNQN);
    c.reconnect_delay = Duration::from_millis(50);
    let ctrl = Controller::start("swap", c, None);
    let info = nacre_tests::fabric_support::wait_live(&ctrl, HANG);
    let dev = RemoteNamespace::new(ctrl.core().clone(), info.namespaces[0].clone());
    dev.write_at(0, &[1u8; 512]).unwrap();
    // The target is replaced by one whose namespace 1 is another namespace.
    t.kill();
    let b = Storage::new(&[(1, 1 << 20, 512, [0x52; 16])]);
    let _t2 = FakeTarget::start_on(&format!("127.0.0.1:{port}"), opts, b.clone());
    wait_phase(&ctrl, Phase::Failed);
    assert!(ctrl
        .core()
        .status()
        .last_error
        .unwrap()
        .contains("refusing to send I/O to a different namespace"));
    assert_eq!(dev.write_at(0, &[2u8; 512]), Err(IoError::PathFailed));
    assert!(
        b.read(1, 0, 512).iter().all(|&x| x == 0),
        "nothing was written to it"
    );
}

/// SPDK #3593: a write the target still executes after the host gave up on its connection
/// must not land after a newer write. The initiator waits `quiesce_time` after a loss before
/// resending anything, so the stale copy lands first and the newer write wins.
#[test]
fn a_stale_write_from_a_lost_connection_never_overwrites_a_newer_one() {
    let storage = Storage::new(&[(1, 1 << 20, 512, [0x61; 16])]);
    let opts = TargetOpts {
        fault: Some((Fault::LateWrite, 1)),
        late_ms: 300,
        ..Default::default()
    };
    let (target, proxy, mut c) = behind_proxy(opts, &storage, HOSTNQN);
    c.io_queues = 1;
    c.reconnect_delay = Duration::from_millis(50);
    // Well past the late write's 300 ms, so a loaded machine that runs the target's late
    // thread a moment late does not make the stale copy land after the newer write.
    c.quiesce_time = Duration::from_secs(3);
    let ctrl = Controller::start("stale", c, None);
    let info = nacre_tests::fabric_support::wait_live(&ctrl, HANG);
    let dev = RemoteNamespace::new(ctrl.core().clone(), info.namespaces[0].clone());
    let (done, rx) = chan();
    let old = vec![0xAA; 4096];
    // SAFETY: `old` outlives the request (we wait for its completion).
    let seg = unsafe { Segment::new(old.as_ptr() as *mut u8, old.len()) };
    dev.submit(
        IoRequest::new(IoKind::Write, 0, 4096, 1).with_segments([seg]),
        &done,
    );
    let t = Instant::now();
    while !target.fault_fired() {
        assert!(t.elapsed() < HANG);
        std::thread::sleep(Duration::from_millis(1));
    }
    // The target has the write queued; the host loses the connection and gets it back.
    proxy.sever();
    wait_phase(&ctrl, Phase::Connecting);
    proxy.restore();
    assert_eq!(
        rx.recv_timeout(HANG).unwrap(),
        (1, Ok(())),
        "resent and completed"
    );
    // The submitter now issues a newer write to the same blocks.
    dev.write_at(0, &[0xBB; 4096]).unwrap();
    let t = Instant::now();
    while target.late_writes_done() == 0 {
        assert!(t.elapsed() < HANG);
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut back = vec![0u8; 4096];
    dev.read_at(0, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0xBB),
        "the stale write landed after the newer one"
    );
}
