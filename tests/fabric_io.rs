//! nacred's NVMe/TCP initiator against a scripted target on loopback: connect, identify and
//! move data every way the protocol allows (in-capsule, R2T, C2HData with and without
//! SUCCESS, digests), with many commands in flight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use nacre_dpu::fabric::{discovery, Controller, ControllerConfig, Phase, RemoteNamespace};
use nacre_dpu::volume::{BlockDevice, IoCompletion, IoKind, IoRequest, IoResult, Segment};
use nacre_shared::nvme_tcp::Digests;
use nacre_tests::fabric_support::{pattern, FakeTarget, Storage, TargetOpts};

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";

fn cfg(port: u16, opts: &TargetOpts) -> ControllerConfig {
    let mut c = ControllerConfig::new("127.0.0.1", port, &opts.subnqn, HOSTNQN);
    c.io_queues = 4;
    c.queue_depth = 16;
    c.connect_timeout = Duration::from_secs(2);
    c
}

fn connect(port: u16, opts: &TargetOpts, dg: Digests) -> (Controller, Arc<RemoteNamespace>) {
    let mut c = cfg(port, opts);
    c.digests = dg;
    let ctrl = Controller::start("t", c, None);
    let info = ctrl
        .wait_first_attempt(Duration::from_secs(10))
        .expect("connect");
    assert_eq!(info.model, opts.model);
    let ns = info.namespaces[0].clone();
    let dev = Arc::new(RemoteNamespace::new(ctrl.core().clone(), ns));
    (ctrl, dev)
}

fn storage() -> Storage {
    Storage::new(&[
        (1, 8 << 20, 512, [0x11; 16]),
        (2, 4 << 20, 4096, [0x22; 16]),
    ])
}

/// Write, read back and compare, over sizes that exercise in-capsule data (<= 8 KiB),
/// R2T (larger) and splitting at MDTS (128 KiB here).
fn round_trip(dev: &dyn BlockDevice, st: &Storage, seed: u64) {
    let bs = dev.geometry().block_size as u64;
    for (i, &len) in [512usize, 4096, 8192, 12288, 65536, 131072, 1 << 20]
        .iter()
        .enumerate()
    {
        if len as u64 % bs != 0 {
            continue;
        }
        let off = (i as u64 * 3 + 1) * 4096 * 2;
        let data = pattern(seed, off, len);
        dev.write_at(off, &data).expect("write");
        let mut back = vec![0u8; len];
        dev.read_at(off, &mut back).expect("read");
        assert!(back == data, "read back differs at {off}+{len}");
        assert!(
            st.read(1, off as usize, len) == data,
            "target holds other bytes at {off}+{len}"
        );
    }
}

#[test]
fn plain_read_write_in_capsule_and_r2t() {
    let st = storage();
    let opts = TargetOpts::default();
    let t = FakeTarget::start(opts.clone(), st.clone());
    let (ctrl, dev) = connect(t.port(), &opts, Digests::NONE);
    let info = ctrl.core().status().info.unwrap();
    assert_eq!(info.namespaces.len(), 2);
    assert_eq!(info.namespaces[1].block_size, 4096);
    assert_eq!(info.namespaces[0].nguid, Some([0x11; 16]));
    assert_eq!(
        info.io_queues, 2,
        "the target grants 2 of the 4 queues asked for"
    );
    assert_eq!(info.max_transfer, 128 << 10, "MDTS 5 with 4 KiB pages");
    assert_eq!(dev.geometry().size, 8 << 20);
    round_trip(&*dev, &st, 1);
    assert!(t.writes_in_capsule() > 0, "small writes go in the capsule");
    assert!(t.writes_r2t() > 0, "large writes wait for R2T");
    assert_eq!(t.digest_errors(), 0);
    assert_eq!(ctrl.core().status().resets, 0);
}

#[test]
fn digests_c2h_success_and_small_pdus() {
    let st = storage();
    let opts = TargetOpts {
        c2h_success: true,
        c2h_chunk: 3000,
        r2t_chunk: 20480,
        maxh2cdata: 4096,
        ..Default::default()
    };
    let t = FakeTarget::start(opts.clone(), st.clone());
    let (ctrl, dev) = connect(
        t.port(),
        &opts,
        Digests {
            header: true,
            data: true,
        },
    );
    round_trip(&*dev, &st, 2);
    assert_eq!(
        t.digest_errors(),
        0,
        "every PDU the host sent carried correct digests"
    );
    assert_eq!(ctrl.core().phase(), Phase::Live);
}

struct Count {
    ok: AtomicU64,
    err: AtomicU64,
    m: Mutex<u64>,
    cv: Condvar,
}
impl IoCompletion for Count {
    fn complete(&self, _tag: u64, r: IoResult) {
        if r.is_ok() {
            self.ok.fetch_add(1, Ordering::Relaxed);
        } else {
            self.err.fetch_add(1, Ordering::Relaxed);
        }
        *self.m.lock().unwrap() += 1;
        self.cv.notify_all();
    }
}

#[test]
fn many_commands_in_flight_complete_asynchronously() {
    let st = storage();
    let opts = TargetOpts::default();
    let t = FakeTarget::start(opts.clone(), st.clone());
    let (_ctrl, dev) = connect(t.port(), &opts, Digests::NONE);
    // 512 writes of 8 KiB submitted without waiting: far more than 2 queues x 16 slots, so
    // the overflow path and CID recycling are exercised.
    let n = 512usize;
    let bufs: Vec<Vec<u8>> = (0..n).map(|i| pattern(7, i as u64, 8192)).collect();
    let count = Arc::new(Count {
        ok: AtomicU64::new(0),
        err: AtomicU64::new(0),
        m: Mutex::new(0),
        cv: Condvar::new(),
    });
    let done: Arc<dyn IoCompletion> = count.clone();
    for (i, b) in bufs.iter().enumerate() {
        // SAFETY: the buffers outlive the requests (we wait for all completions below).
        let seg = unsafe { Segment::new(b.as_ptr() as *mut u8, b.len()) };
        dev.submit(
            IoRequest::new(IoKind::Write, i as u64 * 8192, 8192, i as u64).with_segments([seg]),
            &done,
        );
    }
    let mut g = count.m.lock().unwrap();
    while *g < n as u64 {
        g = count.cv.wait(g).unwrap();
    }
    drop(g);
    assert_eq!(count.err.load(Ordering::Relaxed), 0);
    for (i, b) in bufs.iter().enumerate() {
        assert!(st.read(1, i * 8192, 8192) == *b, "write {i} landed wrong");
    }
    // And read them back the same way.
    let mut outs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 8192]).collect();
    *count.m.lock().unwrap() = 0;
    for (i, o) in outs.iter_mut().enumerate() {
        dev.submit(
            IoRequest::new(IoKind::Read, i as u64 * 8192, 8192, i as u64)
                // SAFETY: the request is waited for (or completes inline) while the buffer lives.
                .with_segments([unsafe { Segment::from_slice(o) }]),
            &done,
        );
    }
    let mut g = count.m.lock().unwrap();
    while *g < n as u64 {
        g = count.cv.wait(g).unwrap();
    }
    drop(g);
    assert_eq!(count.err.load(Ordering::Relaxed), 0);
    assert!(outs == bufs);
}

#[test]
fn zeroes_discard_flush_and_range_checks() {
    let st = storage();
    let opts = TargetOpts::default();
    let t = FakeTarget::start(opts.clone(), st.clone());
    let (_ctrl, dev) = connect(t.port(), &opts, Digests::NONE);
    dev.write_at(0, &[0xAB; 65536]).unwrap();
    dev.submit_wait(IoRequest::new(IoKind::WriteZeroes, 4096, 8192, 0))
        .unwrap();
    dev.submit_wait(IoRequest::new(IoKind::Discard, 32768, 4096, 0))
        .unwrap();
    dev.submit_wait(IoRequest::new(IoKind::Flush, 0, 0, 0))
        .unwrap();
    let mut b = vec![0u8; 65536];
    dev.read_at(0, &mut b).unwrap();
    assert!(b[..4096].iter().all(|&x| x == 0xAB));
    assert!(b[4096..12288].iter().all(|&x| x == 0));
    assert!(b[12288..32768].iter().all(|&x| x == 0xAB));
    assert!(b[32768..36864].iter().all(|&x| x == 0));
    // Beyond the end: refused before anything is sent.
    let size = dev.geometry().size;
    assert!(dev.read_at(size, &mut [0u8; 512]).is_err());
}

#[test]
fn discovery_lists_the_subsystem() {
    let opts = TargetOpts::default();
    let t = FakeTarget::start(opts.clone(), storage());
    let e = discovery::discover("127.0.0.1", t.port(), HOSTNQN, Duration::from_secs(2)).unwrap();
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].subnqn, opts.subnqn);
    assert_eq!(e[0].trsvcid, t.port().to_string());
}

#[test]
fn wrong_subsystem_is_refused_with_a_reason() {
    let opts = TargetOpts::default();
    let t = FakeTarget::start(opts.clone(), storage());
    let mut c = cfg(t.port(), &opts);
    c.subnqn = "nqn.2024-01.io.nacre.test:nope".into();
    let ctrl = Controller::start("t", c, None);
    let e = ctrl.wait_first_attempt(Duration::from_secs(5)).unwrap_err();
    assert!(e.to_string().contains("refused"), "{e}");
}

/// In-capsule data never exceeds what the controller advertises (IOCCSZ, SGLS offset bit):
/// Linux nvmet, for one, sizes it per port.
#[test]
fn in_capsule_data_respects_ioccsz() {
    for (icd, small_in_capsule) in [(4096usize, true), (0, false)] {
        let st = storage();
        let opts = TargetOpts {
            icd,
            ..Default::default()
        };
        let t = FakeTarget::start(opts.clone(), st.clone());
        let (_ctrl, dev) = connect(t.port(), &opts, Digests::NONE);
        dev.write_at(0, &pattern(9, 0, 4096)).unwrap();
        assert_eq!(t.writes_in_capsule() > 0, small_in_capsule, "icd {icd}");
        let before = t.writes_r2t();
        dev.write_at(8192, &pattern(9, 8192, 8192)).unwrap();
        assert_eq!(t.writes_r2t(), before + 1, "8 KiB exceeds {icd}: R2T");
        assert!(st.read(1, 8192, 8192) == pattern(9, 8192, 8192));
    }
}
