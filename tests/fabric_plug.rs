//! Submission plugging on the NVMe/TCP initiator (`volume::plug`): commands submitted
//! inside a plug leave when it closes, in one send from the submitting thread; a wait inside
//! a plug does not wait for a command the plug still holds; and a batch the socket cannot
//! take whole reaches the target intact, its rest sent by the queue's writer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use nacre_dpu::fabric::{Controller, ControllerConfig, RemoteNamespace};
use nacre_dpu::volume::plug::Plug;
use nacre_dpu::volume::{BlockDevice, IoCompletion, IoKind, IoRequest, IoResult, Segment};
use nacre_tests::fabric_support::{behind_proxy, pattern, FakeTarget, Storage, TargetOpts};

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000c1";
const NS_BYTES: u64 = 32 << 20;

#[derive(Default)]
struct Count {
    ok: AtomicU64,
    failed: AtomicU64,
}

impl IoCompletion for Count {
    fn complete(&self, _tag: u64, r: IoResult) {
        match r {
            Ok(()) => self.ok.fetch_add(1, Ordering::AcqRel),
            Err(_) => self.failed.fetch_add(1, Ordering::AcqRel),
        };
    }
}

impl Count {
    fn done(&self) -> u64 {
        self.ok.load(Ordering::Acquire) + self.failed.load(Ordering::Acquire)
    }

    fn wait_for(&self, n: u64, within: Duration) {
        let deadline = Instant::now() + within;
        while self.done() < n {
            assert!(
                Instant::now() < deadline,
                "{} of {n} commands completed within {within:?}",
                self.done()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(self.failed.load(Ordering::Acquire), 0, "a command failed");
    }
}

fn start(mut c: ControllerConfig, depth: u16) -> (Controller, Arc<RemoteNamespace>) {
    c.io_queues = 1;
    c.queue_depth = depth;
    c.in_capsule_data_size = 128 << 10;
    c.connect_timeout = Duration::from_secs(5);
    let ctrl = Controller::start("plug", c, None);
    let info = nacre_tests::fabric_support::wait_live(&ctrl, Duration::from_secs(10));
    let dev = Arc::new(RemoteNamespace::new(
        ctrl.core().clone(),
        info.namespaces[0].clone(),
    ));
    (ctrl, dev)
}

fn opts() -> TargetOpts {
    TargetOpts {
        icd: 128 << 10,
        ..TargetOpts::default()
    }
}

/// A fake target with one namespace (filled with `fill`) and a controller attached to it.
fn attach_fake(fill: u8) -> (FakeTarget, Storage, Controller, Arc<RemoteNamespace>) {
    let opts = opts();
    let st = Storage::new(&[(1, NS_BYTES, 512, [fill; 16])]);
    let t = FakeTarget::start(opts.clone(), st.clone());
    let c = ControllerConfig::new("127.0.0.1", t.port(), &opts.subnqn, HOSTNQN);
    let (ctrl, dev) = start(c, 32);
    (t, st, ctrl, dev)
}

/// Submit writes of `data` (one per chunk of `len` bytes, at its own offset); the buffers
/// must outlive the commands, so the caller keeps `data` until they complete.
fn submit_writes(dev: &RemoteNamespace, data: &mut [u8], len: usize, done: &Arc<dyn IoCompletion>) {
    for (i, chunk) in data.chunks_mut(len).enumerate() {
        let off = (i * len) as u64;
        // SAFETY: `data` outlives every command (the caller waits for all of them before
        // dropping it) and nothing touches it meanwhile.
        let seg = unsafe { Segment::from_slice(chunk) };
        dev.submit(
            IoRequest::new(IoKind::Write, off, chunk.len() as u64, i as u64).with_segments([seg]),
            done,
        );
    }
}

fn expected(seed: u64, n: usize, len: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| pattern(seed, (i * len) as u64, len))
        .collect()
}

#[test]
fn plugged_commands_leave_when_the_plug_closes() {
    let (_t, st, ctrl, dev) = attach_fake(0xC1);
    let (n, len) = (24, 4096);
    let mut data = expected(1, n, len);
    let count = Arc::new(Count::default());
    let done: Arc<dyn IoCompletion> = count.clone();
    let before = ctrl.core().status().inline_sends;
    let plug = Plug::open();
    submit_writes(&dev, &mut data, len, &done);
    // Held: not one of them reached the target while the plug is open.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        count.done(),
        0,
        "a plugged command left before the plug closed"
    );
    drop(plug);
    count.wait_for(n as u64, Duration::from_secs(10));
    let s = ctrl.core().status();
    assert_eq!(
        s.inline_sends - before,
        1,
        "the batch did not leave in one send from the submitting thread"
    );
    assert_eq!(s.inline_partial_sends, 0);
    assert!(
        st.read(1, 0, n * len) == expected(1, n, len),
        "the target holds other bytes"
    );
    drop(data);
    // Outside a plug a command leaves at once, through the writer.
    let one = pattern(2, 0, len);
    dev.write_at(0, &one).expect("unplugged write");
    let mut back = vec![0u8; len];
    dev.read_at(0, &mut back).expect("read");
    assert!(back == one);
    assert_eq!(
        ctrl.core().status().inline_sends - before,
        1,
        "a write outside a plug was sent inline"
    );
}

#[test]
fn a_wait_inside_a_plug_sends_what_the_plug_holds() {
    let (_t, _st, _ctrl, dev) = attach_fake(0xC2);
    let (tx, rx) = mpsc::channel();
    let d = dev.clone();
    std::thread::spawn(move || {
        let len = 8192;
        let mut data = expected(3, 4, len);
        let count = Arc::new(Count::default());
        let done: Arc<dyn IoCompletion> = count.clone();
        let _plug = Plug::open();
        submit_writes(&d, &mut data, len, &done);
        // A blocking read behind the plugged writes: it must send them and its own command
        // rather than wait for an answer to a command that never left.
        let mut back = vec![0u8; 4 * len];
        let r = d.read_at(0, &mut back);
        count.wait_for(4, Duration::from_secs(10));
        tx.send((r, back == expected(3, 4, len))).unwrap();
        drop(data);
    });
    let (r, same) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("a wait inside a plug hung: the plug kept its command");
    r.expect("read inside a plug");
    assert!(
        same,
        "the read inside the plug did not see the plugged writes"
    );
}

#[test]
fn a_batch_the_socket_cannot_take_whole_arrives_intact() {
    let opts = opts();
    let st = Storage::new(&[(1, NS_BYTES, 512, [0xC3; 16])]);
    let (_t, proxy, c) = behind_proxy(opts.clone(), &st, HOSTNQN);
    // 128 writes of 128 KiB in the capsule: 16 MiB, more than the loopback socket buffers
    // between initiator and stalled proxy hold (4 MiB send + 6 MiB receive at most).
    let (n, len) = (128, 128 << 10);
    let (ctrl, dev) = start(c, n as u16);
    let mut data = expected(4, n, len);
    let count = Arc::new(Count::default());
    let done: Arc<dyn IoCompletion> = count.clone();
    proxy.stall();
    {
        let _plug = Plug::open();
        submit_writes(&dev, &mut data, len, &done);
    }
    let s = ctrl.core().status();
    assert!(
        s.inline_partial_sends >= 1,
        "the socket took 16 MiB at once: nothing was tested ({s:?})"
    );
    assert_eq!(count.done(), 0);
    proxy.restore();
    count.wait_for(n as u64, Duration::from_secs(30));
    assert!(
        st.read(1, 0, n * len) == expected(4, n, len),
        "bytes were lost, repeated or reordered between the inline send and the writer"
    );
    drop(data);
}
