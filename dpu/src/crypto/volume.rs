//! [`EncryptedVolume`]: the crypto layer of the data path, a [`BlockDevice`] that encrypts
//! what it writes to the device below and decrypts what it reads from it.
//!
//! * Data unit `n` of the volume (bytes `n·U .. (n+1)·U`, U = 512 or 4096) is XTS-encrypted
//!   with the tweak the policy's [`TweakMode`](super::TweakMode) derives from `n`: the
//!   absolute position, so the ciphertext of a block never depends on how it was written.
//! * Segments may be guest memory the guest can write at any moment, so no Rust reference
//!   ever covers them: data moves between segments and bounce buffers by raw copies, and
//!   the cipher works only on bounce buffers.
//! * Writes: guest memory is never modified. Each request is copied into a bounce buffer and
//!   encrypted there, and the bounce buffer is what goes down; it lives until the device
//!   below completes, however late that is. Buffers are recycled through a small pool.
//! * Reads: the device below fills a bounce buffer with ciphertext; on its completion the
//!   plaintext is produced there and copied into the request's segments. A read that fails
//!   below is passed up unchanged and nothing is decrypted or copied.
//! * Reads and writes larger than [`RW_CHUNK`] go the way Write Zeroes goes (below): one
//!   chunk's bounce buffer, reused chunk after chunk. What a request costs in memory is then
//!   bounded whatever length its submitter claims (a guest may chain descriptors over the
//!   same page of its memory up to what vhost-user-blk allows, 126 MiB). The chunk is large
//!   enough that what drivers send by default (Linux: up to 1.25 MiB) and the common larger
//!   sizes go down whole; a longer request pays a round trip per chunk. (Over loopback
//!   NVMe/TCP at QD4: 1 MiB chunks cost 4 MiB reads 30%; with 4 MiB chunks, 4 MiB reads are
//!   unchanged and 8 MiB ones measured 258 against 202 per second before, when each took a
//!   fresh 8 MiB buffer.)
//! * Flush and Discard pass through. Discarded ranges read back as whatever the device
//!   below returns, decrypted, i.e. garbage (Discard makes contents undefined; dm-crypt with
//!   `allow_discards` behaves the same). Write Zeroes cannot pass through, because the
//!   command promises zeros on read: the range is written as encrypted zeros instead, in
//!   chunks of [`ZERO_CHUNK`] bytes, one after the other, each started by the completion of
//!   the one before (no thread per request; a device completing inline loops, not
//!   recurses). Never-written blocks read as decrypted zeros, which is
//!   garbage — as with dm-crypt and SPDK's crypto bdev.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_queue::ArrayQueue;

use tracing::warn;

use crate::telemetry::trace::TARGET as TRACE;

use super::keys::XtsKey;
use super::policy::EncryptionPolicy;
use super::xts::{EngineKind, UnitLayout, XtsEngine};
use super::CryptoError;
use crate::volume::{
    copy_from_segments, copy_to_segments, dma, BlockDevice, Geometry, IoCompletion, IoError,
    IoKind, IoRequest, IoResult, Segment, Segments,
};

/// Write Zeroes is carried out as encrypted writes of at most this many bytes.
pub const ZERO_CHUNK: usize = 1 << 20;

/// Reads and writes longer than this go down a chunk of this length at a time (module docs).
pub const RW_CHUNK: usize = 4 << 20;

/// Alignment of bounce buffers: enough for O_DIRECT on any block size nacre uses.
const BOUNCE_ALIGN: usize = 4096;

/// Idle bounce buffers are kept by size class, class `k` holding buffers of
/// `BOUNCE_ALIGN << k` bytes; larger ones (beyond 1 MiB, i.e. [`ZERO_CHUNK`]) are freed.
const POOL_CLASSES: usize = 9;
/// Idle buffers one class keeps: as many as a deep queue of small requests needs, and
/// about [`POOL_CLASS_BYTES`] of the large ones (at least 4).
const POOL_CLASS_MAX: usize = 64;
const POOL_CLASS_BYTES: usize = 4 << 20;

/// A heap buffer aligned for O_DIRECT, announced to [`dma`] while it lives: the buffer
/// that carries ciphertext to and from the device below is the one a transport may hand
/// its device directly (NVMe/RDMA), so the XTS copy is the only copy of an encrypted I/O.
struct Bounce {
    ptr: *mut u8,
    cap: usize,
    announced: Option<dma::Registration>,
}

// SAFETY: Bounce exclusively owns its allocation; it is handed between threads whole.
unsafe impl Send for Bounce {}

impl Bounce {
    fn new(len: usize) -> Self {
        let cap = len.max(BOUNCE_ALIGN).next_power_of_two();
        let layout = std::alloc::Layout::from_size_align(cap, BOUNCE_ALIGN).expect("layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Bounce {
            ptr,
            cap,
            // SAFETY: the buffer stays allocated until `drop`, which withdraws the
            // announcement first; its bytes are plain ciphertext staging that Rust reaches
            // only through `slice` while no request using the buffer is in flight.
            announced: Some(unsafe { dma::register(ptr, cap) }),
        }
    }

    fn slice(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.cap);
        // SAFETY: ptr is valid for cap bytes, exclusively owned; len <= cap. The bytes may be
        // uninitialised on first use, but u8 has no invalid values and every caller fully
        // overwrites the slice before reading it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        // Withdrawn before the memory goes back to the allocator.
        drop(self.announced.take());
        let layout = std::alloc::Layout::from_size_align(self.cap, BOUNCE_ALIGN).expect("layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

/// Idle bounce buffers for reuse. A buffer is taken where a request is submitted (the
/// frontend's worker) and given back where it completes (the fabric's receive thread), so
/// every take and give crosses threads: one lock-free queue per size class, where a mutex
/// over one list was contended on every request (the end-to-end profile in docs/benchmarks.md).
struct BouncePool {
    classes: [ArrayQueue<Bounce>; POOL_CLASSES],
}

impl BouncePool {
    fn new() -> Self {
        BouncePool {
            classes: std::array::from_fn(|k| {
                let cap = BOUNCE_ALIGN << k;
                ArrayQueue::new((POOL_CLASS_BYTES / cap).clamp(4, POOL_CLASS_MAX))
            }),
        }
    }

    /// The class of buffers of `cap` bytes (a power of two of at least [`BOUNCE_ALIGN`]).
    fn class_of(cap: usize) -> usize {
        (cap / BOUNCE_ALIGN).trailing_zeros() as usize
    }

    /// A buffer of at least `len` bytes: an idle one of its class, or a new one.
    fn take(&self, len: usize) -> Bounce {
        let cap = len.max(BOUNCE_ALIGN).next_power_of_two();
        self.classes
            .get(Self::class_of(cap))
            .and_then(ArrayQueue::pop)
            .unwrap_or_else(|| Bounce::new(cap))
    }

    /// Keep `b` for reuse if its class has room; free it otherwise.
    fn give(&self, b: Bounce) {
        if let Some(q) = self.classes.get(Self::class_of(b.cap)) {
            // A full class drops the buffer it refuses.
            let _ = q.push(b);
        }
    }

    /// Idle buffers kept, per class (tests).
    #[cfg(test)]
    fn idle(&self) -> Vec<usize> {
        self.classes.iter().map(ArrayQueue::len).collect()
    }
}

/// What the volume and its in-flight completions share.
struct Shared {
    engine: Box<dyn XtsEngine>,
    layout: UnitLayout,
    pool: BouncePool,
}

impl Shared {
    fn take(&self, len: usize) -> Bounce {
        self.pool.take(len)
    }

    fn give(&self, b: Bounce) {
        self.pool.give(b)
    }

    fn unit_of(&self, offset: u64) -> u64 {
        offset / self.layout.unit_len as u64
    }

    /// Encrypt `dst.len()` bytes from the segments into `dst` (units numbered from `first`).
    ///
    /// # Safety
    /// The segments must be in flight and cover `dst.len()` bytes.
    unsafe fn encrypt_from_segments(
        &self,
        segs: &[Segment],
        first: u64,
        dst: &mut [u8],
    ) -> Result<(), CryptoError> {
        let have: usize = segs.iter().map(|s| s.len()).sum();
        if have < dst.len() {
            return Err(CryptoError::Misaligned {
                len: have,
                unit: self.layout.unit_len,
            });
        }
        // SAFETY: in flight (caller), and the segments cover dst.len() bytes (checked).
        unsafe { copy_from_segments(segs, 0, dst) };
        self.engine.encrypt_in_place(self.layout, first, dst)
    }
}

/// An encrypting [`BlockDevice`] over another one. See the module docs.
pub struct EncryptedVolume {
    inner: Arc<dyn BlockDevice>,
    shared: Arc<Shared>,
    policy: EncryptionPolicy,
}

impl EncryptedVolume {
    /// Wrap `inner` with the data-path engine for `key` ([`EngineKind::data_path`]).
    pub fn new(
        inner: Arc<dyn BlockDevice>,
        key: &XtsKey,
        policy: EncryptionPolicy,
    ) -> Result<Self, CryptoError> {
        Self::with_engine(inner, key, policy, EngineKind::data_path(key.len()))
    }

    /// Wrap `inner` with a chosen engine (tests and benchmarks).
    pub fn with_engine(
        inner: Arc<dyn BlockDevice>,
        key: &XtsKey,
        policy: EncryptionPolicy,
        engine: EngineKind,
    ) -> Result<Self, CryptoError> {
        policy.check_volume(inner.geometry().block_size)?;
        if key.len() != policy.cipher.key_len() {
            return Err(CryptoError::Policy(format!(
                "the volume's data key is {} bytes but cipher {} needs {}",
                key.len(),
                policy.cipher.as_str(),
                policy.cipher.key_len()
            )));
        }
        let engine = engine.build(key)?;
        Ok(EncryptedVolume {
            inner,
            shared: Arc::new(Shared {
                engine,
                layout: policy.layout(),
                pool: BouncePool::new(),
            }),
            policy,
        })
    }

    pub fn policy(&self) -> &EncryptionPolicy {
        &self.policy
    }

    pub fn engine_name(&self) -> &'static str {
        self.shared.engine.name()
    }

    pub fn inner(&self) -> &Arc<dyn BlockDevice> {
        &self.inner
    }

    fn submit_write(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let len = req.len as usize;
        let mut bounce = self.shared.take(len);
        let first = self.shared.unit_of(req.offset);
        // SAFETY: the request is in flight until we complete it, which happens only after
        // this call (and the write below) finished with its segments.
        let enc = unsafe {
            self.shared
                .encrypt_from_segments(&req.segments, first, bounce.slice(len))
        };
        if let Err(e) = enc {
            self.shared.give(bounce);
            warn!(error = %e, "encrypting a write failed");
            done.complete(req.tag, Err(IoError::Crypto(e.to_string())));
            return;
        }
        self.write_bounce(req.offset, len, req.tag, bounce, done.clone());
    }

    /// Send `len` bytes of ciphertext in `bounce` down; `upstream` learns the result.
    fn write_bounce(
        &self,
        offset: u64,
        len: usize,
        tag: u64,
        mut bounce: Bounce,
        upstream: Arc<dyn IoCompletion>,
    ) {
        // SAFETY: the bounce buffer moves into the completion below, which keeps it alive and
        // untouched until the device below completes this write.
        let seg = unsafe { Segment::from_slice(bounce.slice(len)) };
        let down = IoRequest::new(IoKind::Write, offset, len as u64, tag).with_segments([seg]);
        // The bounce buffer moves into the completion, so it outlives the inner write even
        // when the device below completes on another thread much later.
        let c: Arc<dyn IoCompletion> = Arc::new(WriteDone {
            shared: self.shared.clone(),
            bounce: Mutex::new(Some(bounce)),
            upstream,
        });
        self.inner.submit(down, &c);
    }

    fn submit_read(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let len = req.len as usize;
        let mut bounce = self.shared.take(len);
        // SAFETY: the bounce buffer moves into the completion below, which keeps it alive
        // and untouched until the device below completes this read.
        let seg = unsafe { Segment::from_slice(bounce.slice(len)) };
        let down = IoRequest::new(IoKind::Read, req.offset, req.len, req.tag).with_segments([seg]);
        let c: Arc<dyn IoCompletion> = Arc::new(ReadDone {
            shared: self.shared.clone(),
            segments: req.segments,
            first: self.shared.unit_of(req.offset),
            len,
            bounce: Mutex::new(Some(bounce)),
            upstream: done.clone(),
        });
        self.inner.submit(down, &c);
    }

    /// A request taken `chunk` bytes at a time, one chunk in flight ([`ChunkJob`]).
    fn submit_chunked(
        &self,
        op: ChunkOp,
        chunk: usize,
        req: IoRequest,
        done: &Arc<dyn IoCompletion>,
    ) {
        let job = Arc::new_cyclic(|me| ChunkJob {
            me: me.clone(),
            inner: self.inner.clone(),
            shared: self.shared.clone(),
            tag: req.tag,
            start: req.offset,
            end: req.offset + req.len,
            chunk,
            op,
            segments: req.segments,
            upstream: done.clone(),
            phase: AtomicU8::new(IDLE),
            state: Mutex::new(ChunkState {
                next: req.offset,
                bounce: Some(self.shared.take((req.len as usize).min(chunk))),
                result: Ok(()),
                landed: None,
            }),
        });
        job.run();
    }
}

/// Phases of a [`ChunkJob`]'s chunk: submitted and not yet complete, completed while its
/// submitter was still in `submit` (it goes on looping), or waited for (the completion goes
/// on with the next chunk).
const IDLE: u8 = 0;
const SUBMITTED: u8 = 1;
const COMPLETED_INLINE: u8 = 2;
const WAITING: u8 = 3;

/// What a [`ChunkJob`] does with each chunk.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ChunkOp {
    /// Encrypted zeros written (Write Zeroes).
    Zeroes,
    /// The request's data, copied from its segments and encrypted, written.
    Write,
    /// Ciphertext read, decrypted and copied into the request's segments.
    Read,
}

/// A request served `chunk` bytes at a time through one bounce buffer, one chunk in
/// flight, the next started by the previous one's completion.
struct ChunkJob {
    /// The job itself, for completions arriving on another thread to continue it.
    me: std::sync::Weak<ChunkJob>,
    inner: Arc<dyn BlockDevice>,
    shared: Arc<Shared>,
    tag: u64,
    /// The request's range: its segments hold bytes `start..end` of the volume.
    start: u64,
    end: u64,
    chunk: usize,
    op: ChunkOp,
    segments: Segments,
    upstream: Arc<dyn IoCompletion>,
    phase: AtomicU8,
    state: Mutex<ChunkState>,
}

struct ChunkState {
    next: u64,
    bounce: Option<Bounce>,
    result: IoResult,
    /// A read chunk (offset, length) whose ciphertext is in the bounce buffer once its read
    /// completes: decrypted and delivered before the buffer takes the next chunk.
    landed: Option<(u64, usize)>,
}

impl ChunkJob {
    /// Submit chunks until one completes asynchronously (its completion calls `run` again)
    /// or the range is done (the request completes).
    fn run(self: &Arc<Self>) {
        loop {
            let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let st = &mut *guard;
            if let (Some((off, n)), Some(bounce)) = (st.landed.take(), st.bounce.as_mut()) {
                if st.result.is_ok() {
                    let buf = bounce.slice(n);
                    st.result = self
                        .shared
                        .engine
                        .decrypt_in_place(self.shared.layout, self.shared.unit_of(off), buf)
                        .map_err(|e| IoError::Crypto(e.to_string()));
                    if st.result.is_ok() {
                        // SAFETY: the request (and so its segments, which cover
                        // `start..end`: geometry checked) is in flight until this job
                        // completes it.
                        unsafe {
                            copy_to_segments(&self.segments, (off - self.start) as usize, buf)
                        };
                    }
                }
            }
            if st.next >= self.end || st.result.is_err() {
                let r = std::mem::replace(&mut st.result, Ok(()));
                let bounce = st.bounce.take();
                drop(guard);
                if let Some(b) = bounce {
                    self.shared.give(b);
                }
                self.upstream.complete(self.tag, r);
                return;
            }
            let off = st.next;
            let n = ((self.end - off) as usize).min(self.chunk);
            let Some(bounce) = st.bounce.as_mut() else {
                return;
            };
            let buf = bounce.slice(n);
            let kind = match self.op {
                ChunkOp::Read => {
                    st.landed = Some((off, n));
                    IoKind::Read
                }
                ChunkOp::Zeroes | ChunkOp::Write => {
                    if self.op == ChunkOp::Zeroes {
                        buf.fill(0);
                    } else {
                        // SAFETY: in flight until this job completes it; the segments cover
                        // `start..end` (geometry checked).
                        unsafe {
                            copy_from_segments(&self.segments, (off - self.start) as usize, buf)
                        };
                    }
                    if let Err(e) = self.shared.engine.encrypt_in_place(
                        self.shared.layout,
                        self.shared.unit_of(off),
                        buf,
                    ) {
                        st.result = Err(IoError::Crypto(e.to_string()));
                        continue;
                    }
                    IoKind::Write
                }
            };
            // SAFETY: the bounce buffer stays in this job, untouched, until the device below
            // completes this chunk (the next chunk is prepared only after that).
            let seg = unsafe { Segment::from_slice(buf) };
            st.next = off + n as u64;
            self.phase.store(SUBMITTED, Ordering::SeqCst);
            let me: Arc<dyn IoCompletion> = self.clone();
            // Not under the state lock: a device completing inline re-enters `complete`.
            let down = IoRequest::new(kind, off, n as u64, self.tag).with_segments([seg]);
            drop(guard);
            self.inner.submit(down, &me);
            if self
                .phase
                .compare_exchange(SUBMITTED, WAITING, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                // Completes later on another thread, which goes on from there.
                return;
            }
            // Completed inline: next chunk in this loop (no recursion however long the range).
        }
    }
}

impl IoCompletion for ChunkJob {
    fn complete(&self, _tag: u64, result: IoResult) {
        if let Err(e) = result {
            self.state.lock().unwrap_or_else(|p| p.into_inner()).result = Err(e);
        }
        if self
            .phase
            .compare_exchange(
                SUBMITTED,
                COMPLETED_INLINE,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
        {
            return;
        }
        self.phase.store(IDLE, Ordering::SeqCst);
        // The submitter has returned: continue the chain on this thread. The device holds a
        // handle to the job while it completes, so the upgrade succeeds.
        if let Some(me) = self.me.upgrade() {
            me.run();
        }
    }
}

struct WriteDone {
    shared: Arc<Shared>,
    bounce: Mutex<Option<Bounce>>,
    upstream: Arc<dyn IoCompletion>,
}

impl IoCompletion for WriteDone {
    fn complete(&self, tag: u64, result: IoResult) {
        if let Some(b) = self.bounce.lock().unwrap_or_else(|p| p.into_inner()).take() {
            self.shared.give(b);
        }
        self.upstream.complete(tag, result);
    }
}

struct ReadDone {
    shared: Arc<Shared>,
    segments: Segments,
    first: u64,
    len: usize,
    /// The ciphertext lands here; decrypted here, then copied into `segments`.
    bounce: Mutex<Option<Bounce>>,
    upstream: Arc<dyn IoCompletion>,
}

impl IoCompletion for ReadDone {
    fn complete(&self, tag: u64, result: IoResult) {
        let Some(mut bounce) = self.bounce.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        let _span = tracing::trace_span!(target: TRACE, "crypt",
            step = "decrypt", unit = self.first, len = self.len)
        .entered();
        let result = result.and_then(|()| {
            let buf = bounce.slice(self.len);
            self.shared
                .engine
                .decrypt_in_place(self.shared.layout, self.first, buf)
                .map_err(|e| IoError::Crypto(e.to_string()))?;
            // SAFETY: the upstream request (and so its segments) is in flight until we
            // complete it below; geometry checked that they add up to `len`.
            unsafe { copy_to_segments(&self.segments, 0, buf) };
            Ok(())
        });
        self.shared.give(bounce);
        self.upstream.complete(tag, result);
    }
}

// SAFETY: segment data moves only through bounce buffers by raw copies made before the
// write is sent down or before the read's completion is reported (module docs); the
// requests sent down carry the bounce buffer, never the caller's segments.
unsafe impl BlockDevice for EncryptedVolume {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        // Validate here too: the bounce buffer is sized from the request, so a request whose
        // segments do not add up must never reach the encryption loop.
        if let Err(e) = self.geometry().check(&req) {
            done.complete(req.tag, Err(e));
            return;
        }
        let _span = tracing::trace_span!(target: TRACE, "crypt",
            step = match req.kind {
                IoKind::Write => "encrypt",
                IoKind::Read => "read",
                IoKind::WriteZeroes => "zeroes",
                _ => "pass",
            },
            unit = self.shared.unit_of(req.offset), len = req.len)
        .entered();
        let large = req.len > RW_CHUNK as u64;
        match req.kind {
            IoKind::Write if large => self.submit_chunked(ChunkOp::Write, RW_CHUNK, req, done),
            IoKind::Read if large => self.submit_chunked(ChunkOp::Read, RW_CHUNK, req, done),
            IoKind::Write if req.len > 0 => self.submit_write(req, done),
            IoKind::Read if req.len > 0 => self.submit_read(req, done),
            IoKind::WriteZeroes if req.len > 0 => {
                self.submit_chunked(ChunkOp::Zeroes, ZERO_CHUNK, req, done)
            }
            _ => self.inner.submit(req, done),
        }
    }

    fn resize(&self, new_size: u64) -> IoResult {
        self.inner.resize(new_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounce_pool_reuses_buffers_of_the_same_class_only() {
        let pool = BouncePool::new();
        let a = pool.take(4096);
        let a_ptr = a.ptr;
        pool.give(a);
        // 1..=4096 bytes share the 4 KiB class; 4097 needs the 8 KiB one.
        let b = pool.take(512);
        assert_eq!(b.ptr, a_ptr, "an idle 4 KiB buffer is reused");
        assert_eq!(b.cap, 4096);
        let c = pool.take(4097);
        assert_eq!(c.cap, 8192);
        assert_ne!(c.ptr, a_ptr);
        pool.give(b);
        pool.give(c);
        let mut idle = vec![0; POOL_CLASSES];
        idle[0] = 1;
        idle[1] = 1;
        assert_eq!(pool.idle(), idle);
    }

    #[test]
    fn bounce_pool_bounds_each_class_and_frees_what_it_cannot_keep() {
        let pool = BouncePool::new();
        // 4 KiB: up to POOL_CLASS_MAX idle; 1 MiB: POOL_CLASS_BYTES' worth.
        let small: Vec<Bounce> = (0..POOL_CLASS_MAX + 5).map(|_| pool.take(4096)).collect();
        small.into_iter().for_each(|b| pool.give(b));
        let big: Vec<Bounce> = (0..10).map(|_| pool.take(1 << 20)).collect();
        big.into_iter().for_each(|b| pool.give(b));
        // Larger than any class: never kept.
        pool.give(pool.take(ZERO_CHUNK * 2));
        let idle = pool.idle();
        assert_eq!(idle[0], POOL_CLASS_MAX);
        assert_eq!(idle[BouncePool::class_of(1 << 20)], POOL_CLASS_BYTES >> 20);
        assert_eq!(
            idle.iter().sum::<usize>(),
            POOL_CLASS_MAX + (POOL_CLASS_BYTES >> 20)
        );
    }

    #[test]
    fn bounce_pool_takes_and_gives_across_threads() {
        // The data path's pattern: one thread takes, another gives back.
        let pool = Arc::new(BouncePool::new());
        let (tx, rx) = std::sync::mpsc::sync_channel::<Bounce>(16);
        let giver = {
            let pool = pool.clone();
            std::thread::spawn(move || rx.into_iter().for_each(|b| pool.give(b)))
        };
        for i in 0..10_000usize {
            let mut b = pool.take(4096 << (i % 3));
            b.slice(4096).fill(i as u8);
            tx.send(b).unwrap();
        }
        drop(tx);
        giver.join().unwrap();
        let idle = pool.idle();
        assert!(
            idle[..3].iter().all(|&n| (1..=POOL_CLASS_MAX).contains(&n)),
            "{idle:?}"
        );
    }
}
