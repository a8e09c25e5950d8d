//! A target that misbehaves — malformed PDUs, completions for unknown commands, data PDUs
//! longer than the command, C2HTermReq, a dropped connection, silence — gets its controller
//! reset (the command is resent and completes correctly); nacred lives, and another
//! controller doing I/O at the same time is never disturbed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nacre_dpu::fabric::{Controller, ControllerConfig, RemoteNamespace};
use nacre_dpu::volume::BlockDevice;
use nacre_shared::nvme_tcp::Digests;
use nacre_tests::fabric_support::{pattern, FakeTarget, Fault, Storage, TargetOpts};

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000b1";

/// Attach a controller to `t`. `quick`: timeouts short enough that a fault a timeout
/// detects resets it within the test (the faulty controller's); otherwise generous ones
/// (the bystander's: starved threads on a loaded machine must not reset it, only a fault
/// could).
fn attach(
    t: &FakeTarget,
    opts: &TargetOpts,
    name: &str,
    dg: Digests,
    quick: bool,
) -> (Controller, Arc<RemoteNamespace>) {
    let mut c = ControllerConfig::new("127.0.0.1", t.port(), &opts.subnqn, HOSTNQN);
    c.digests = dg;
    c.io_queues = 2;
    c.queue_depth = 8;
    c.reconnect_delay = Duration::from_millis(50);
    c.quiesce_time = Duration::from_millis(50);
    if quick {
        c.keep_alive_timeout = Duration::from_millis(500);
        c.connect_timeout = Duration::from_millis(500);
        c.io_timeout = Some(Duration::from_millis(800));
    } else {
        c.keep_alive_timeout = Duration::from_secs(10);
        c.connect_timeout = Duration::from_secs(10);
        c.io_timeout = Some(Duration::from_secs(30));
    }
    let ctrl = Controller::start(name, c, None);
    let info = nacre_tests::fabric_support::wait_live(&ctrl, Duration::from_secs(10));
    let dev = Arc::new(RemoteNamespace::new(
        ctrl.core().clone(),
        info.namespaces[0].clone(),
    ));
    (ctrl, dev)
}

fn check(fault: Fault) {
    check_with(fault, Digests::NONE)
}

fn check_with(fault: Fault, dg: Digests) {
    // The bystander: another shelf, another controller, busy the whole time.
    let bopts = TargetOpts::default();
    let bt = FakeTarget::start(
        bopts.clone(),
        Storage::new(&[(1, 2 << 20, 512, [0xB0; 16])]),
    );
    let (bctrl, bdev) = attach(&bt, &bopts, "bystander", Digests::NONE, false);
    let stop = Arc::new(AtomicBool::new(false));
    let berr = Arc::new(AtomicU64::new(0));
    let bystander = {
        let (stop, berr, bdev) = (stop.clone(), berr.clone(), bdev.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let d = pattern(i, i, 4096);
                let off = (i % 64) * 4096;
                let mut b = vec![0u8; 4096];
                if bdev.write_at(off, &d).is_err() || bdev.read_at(off, &mut b).is_err() || b != d {
                    berr.fetch_add(1, Ordering::Relaxed);
                }
                i += 1;
            }
        })
    };

    let opts = TargetOpts {
        fault: Some((fault, 6)),
        c2h_success: fault == Fault::WrongLength,
        ..Default::default()
    };
    let st = Storage::new(&[(1, 2 << 20, 512, [0xA0; 16])]);
    let t = FakeTarget::start(opts.clone(), st.clone());
    let (ctrl, dev) = attach(&t, &opts, "faulty", dg, true);
    for i in 0..24u64 {
        let len = if i % 2 == 0 { 4096 } else { 32768 };
        let off = i * 65536;
        let d = pattern(100 + i, off, len);
        dev.write_at(off, &d)
            .unwrap_or_else(|e| panic!("{fault:?}: write {i} failed: {e}"));
        let mut b = vec![0u8; len];
        dev.read_at(off, &mut b)
            .unwrap_or_else(|e| panic!("{fault:?}: read {i} failed: {e}"));
        assert!(b == d, "{fault:?}: read {i} returned other data");
        assert!(st.read(1, off as usize, len) == d);
    }
    assert!(t.fault_fired(), "{fault:?} was injected");
    let s = ctrl.core().status();
    assert!(s.resets >= 1, "{fault:?}: the controller was reset: {s:?}");
    assert!(s.connects >= 2, "{fault:?}: and reconnected");
    stop.store(true, Ordering::Relaxed);
    bystander.join().unwrap();
    assert_eq!(
        berr.load(Ordering::Relaxed),
        0,
        "{fault:?}: the bystander saw errors"
    );
    assert_eq!(
        bctrl.core().status().resets,
        0,
        "{fault:?}: the bystander was reset"
    );
}

#[test]
fn malformed_pdu_resets_only_that_controller() {
    check(Fault::Malformed);
}

#[test]
fn completion_for_unknown_command_resets_only_that_controller() {
    check(Fault::UnknownCid);
}

#[test]
fn data_pdu_longer_than_the_command_resets_only_that_controller() {
    check(Fault::WrongLength);
}

#[test]
fn c2h_term_req_resets_only_that_controller() {
    check(Fault::TermReq);
}

#[test]
fn dropped_connection_resets_only_that_controller() {
    check(Fault::Drop);
}

/// I/O queue silent, admin queue still answering keep-alive: the I/O timeout resets it.
#[test]
fn target_that_stops_processing_io_is_reset_by_the_io_timeout() {
    check(Fault::Stall);
}

#[test]
fn header_digest_error_resets_only_that_controller() {
    check_with(
        Fault::BadHeaderDigest,
        Digests {
            header: true,
            data: false,
        },
    );
}

#[test]
fn data_digest_error_resets_only_that_controller_and_the_read_is_retried() {
    check_with(
        Fault::BadDataDigest,
        Digests {
            header: false,
            data: true,
        },
    );
}
