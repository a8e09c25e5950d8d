//! Write Zeroes on an encrypted volume costs no thread: large ranges are written chunk by
//! chunk, each chunk started by the completion of the one before, whatever thread that
//! completion runs on. (It used to start an OS thread per request over 1 MiB: a host could
//! make nacred spawn as many threads as it had queue entries.)
//!
//! Alone in its test binary: it counts the threads of this process.

use std::sync::{Arc, Mutex};

use nacre_dpu::crypto::volume::{EncryptedVolume, ZERO_CHUNK};
use nacre_dpu::crypto::{EncryptionPolicy, XtsKey};
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::{BlockDevice, Geometry, IoCompletion, IoKind, IoRequest, IoResult, Waiter};

/// A device that holds every write until the test releases it, then passes it to a RAM
/// volume: an asynchronous device whose completions the test controls.
struct Gate {
    ram: Arc<RamVolume>,
    held: Mutex<Vec<(IoRequest, Arc<dyn IoCompletion>)>>,
}

impl Gate {
    /// Complete every write held now (from this thread, like a device's completion thread);
    /// returns how many there were.
    fn release(&self) -> usize {
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        let n = held.len();
        for (req, done) in held {
            self.ram.submit(req, &done);
        }
        n
    }
}

// SAFETY: a held write goes, with its completion, to the RAM volume when released; other
// requests go there at once.
unsafe impl BlockDevice for Gate {
    fn geometry(&self) -> Geometry {
        self.ram.geometry()
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        if req.kind == IoKind::Write {
            self.held.lock().unwrap().push((req, done.clone()));
        } else {
            self.ram.submit(req, done);
        }
    }
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Records which requests completed, with what.
#[derive(Default)]
struct Done(Mutex<Vec<(u64, IoResult)>>);

impl IoCompletion for Done {
    fn complete(&self, tag: u64, result: IoResult) {
        self.0.lock().unwrap().push((tag, result));
    }
}

#[test]
fn large_write_zeroes_start_no_thread_and_zero_the_range() {
    const REQS: u64 = 8;
    const LEN: u64 = 4 * ZERO_CHUNK as u64 + 4096;
    let size = REQS * LEN;
    let ram = Arc::new(RamVolume::new(size, 4096).unwrap());
    let gate = Arc::new(Gate {
        ram: ram.clone(),
        held: Mutex::new(Vec::new()),
    });
    let vol = EncryptedVolume::new(
        gate.clone(),
        &XtsKey::generate(64).unwrap(),
        EncryptionPolicy::default(),
    )
    .unwrap();
    // Something other than zeros first, so the zeroing shows.
    // (A write this long goes down a chunk at a time, each after the last completed: the
    // gate is opened until it is all written.)
    let junk = vec![0xA5u8; size as usize];
    let written = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let w = std::thread::spawn({
        let (gate, written) = (gate.clone(), written.clone());
        move || {
            while !written.load(std::sync::atomic::Ordering::SeqCst) {
                gate.release();
                std::thread::yield_now();
            }
        }
    });
    vol.write_at(0, &junk).unwrap();
    written.store(true, std::sync::atomic::Ordering::SeqCst);
    w.join().unwrap();

    let before = threads();
    let done = Arc::new(Done::default());
    let handle: Arc<dyn IoCompletion> = done.clone();
    for i in 0..REQS {
        vol.submit(
            IoRequest::new(IoKind::WriteZeroes, i * LEN, LEN, i),
            &handle,
        );
    }
    // Every request now has its first chunk held by the device below.
    assert_eq!(gate.held.lock().unwrap().len(), REQS as usize);
    assert_eq!(
        threads(),
        before,
        "Write Zeroes started threads while its chunks were in flight"
    );
    // Completions continue the chains on this (the "device's") thread, one chunk each.
    let mut rounds = 0;
    while gate.release() > 0 {
        rounds += 1;
        assert_eq!(threads(), before);
    }
    assert_eq!(rounds, 5, "4 MiB + 4 KiB is five chunks of at most 1 MiB");
    let mut results = std::mem::take(&mut *done.0.lock().unwrap());
    results.sort_by_key(|(t, _)| *t);
    assert_eq!(results.len(), REQS as usize);
    for (tag, r) in &results {
        assert_eq!(r, &Ok(()), "request {tag}");
    }
    // Reads pass the gate: the whole volume reads back as zeros through the cipher.
    let mut back = vec![0xFFu8; size as usize];
    let w = Arc::new(Waiter::default());
    let wd: Arc<dyn IoCompletion> = w.clone();
    // SAFETY: waited for below while `back` lives.
    let seg = unsafe { nacre_dpu::volume::Segment::from_slice(&mut back) };
    vol.submit(
        IoRequest::new(IoKind::Read, 0, size, 0).with_segments([seg]),
        &wd,
    );
    w.wait().unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "the range does not read back as zeros"
    );
}
