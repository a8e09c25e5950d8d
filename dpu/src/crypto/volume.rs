//! [`EncryptedVolume`]: the crypto layer of the data path, a [`BlockDevice`] that encrypts
//! what it writes to the device below and decrypts what it reads from it.
//!
//! * Data unit `n` of the volume (bytes `n·U .. (n+1)·U`, U = 512 or 4096) is XTS-encrypted
//!   with the tweak the policy's [`TweakMode`](super::TweakMode) derives from `n`: the
//!   absolute position, so the ciphertext of a block never depends on how it was written.
//! * Writes: guest memory is never modified. Each request is encrypted into a bounce buffer
//!   (out of place, straight from the request's segments where a data unit lies within one
//!   segment), and the bounce buffer is what goes down; it lives until the device below
//!   completes, however late that is. Buffers are recycled through a small pool.
//! * Reads: the device below fills the request's own segments with ciphertext; on its
//!   completion the plaintext is produced in place. A read that fails below is passed up
//!   unchanged and nothing is decrypted.
//! * Flush and Discard pass through. Discarded ranges read back as whatever the device
//!   below returns, decrypted, i.e. garbage (Discard makes contents undefined; dm-crypt with
//!   `allow_discards` behaves the same). Write Zeroes cannot pass through, because the
//!   command promises zeros on read: the range is written as encrypted zeros instead, in
//!   chunks of [`ZERO_CHUNK`] bytes. Never-written blocks read as decrypted zeros, which is
//!   garbage — as with dm-crypt and SPDK's crypto bdev.

use std::sync::{Arc, Mutex};

use tracing::warn;

use super::keys::XtsKey;
use super::policy::EncryptionPolicy;
use super::xts::{EngineKind, UnitLayout, XtsEngine};
use super::CryptoError;
use crate::volume::{
    copy_from_segments, copy_to_segments, BlockDevice, Completion, Geometry, IoError, IoKind,
    IoRequest, IoResult, Segment, Segments,
};

/// Write Zeroes is carried out as encrypted writes of at most this many bytes.
pub const ZERO_CHUNK: usize = 1 << 20;

/// Alignment of bounce buffers: enough for O_DIRECT on any block size nacre uses.
const BOUNCE_ALIGN: usize = 4096;

/// At most this many idle bounce buffers are kept for reuse.
const POOL_MAX: usize = 64;

/// A heap buffer aligned for O_DIRECT.
struct Bounce {
    ptr: *mut u8,
    cap: usize,
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
        Bounce { ptr, cap }
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
        let layout = std::alloc::Layout::from_size_align(self.cap, BOUNCE_ALIGN).expect("layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

/// What the volume and its in-flight completions share.
struct Shared {
    engine: Box<dyn XtsEngine>,
    layout: UnitLayout,
    pool: Mutex<Vec<Bounce>>,
}

impl Shared {
    fn take(&self, len: usize) -> Bounce {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        match pool.iter().rposition(|b| b.cap >= len) {
            Some(i) => pool.swap_remove(i),
            None => {
                drop(pool);
                Bounce::new(len)
            }
        }
    }

    fn give(&self, b: Bounce) {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < POOL_MAX {
            pool.push(b);
        }
    }

    fn unit_of(&self, offset: u64) -> u64 {
        offset / self.layout.unit_len as u64
    }

    /// Encrypt `len` bytes from the segments into `dst` (units numbered from `first`).
    ///
    /// # Safety
    /// The segments must be in flight and cover `dst.len()` bytes.
    unsafe fn encrypt_from_segments(
        &self,
        segs: &[Segment],
        first: u64,
        dst: &mut [u8],
    ) -> Result<(), CryptoError> {
        let u = self.layout.unit_len;
        let mut pos = 0usize; // bytes of the request done
        let mut seg_i = 0usize;
        let mut seg_off = 0usize;
        while pos < dst.len() {
            while seg_i < segs.len() && seg_off == segs[seg_i].len() {
                seg_i += 1;
                seg_off = 0;
            }
            let Some(seg) = segs.get(seg_i) else {
                return Err(CryptoError::Misaligned { len: pos, unit: u });
            };
            let unit_no = first + (pos / u) as u64;
            let whole = (seg.len() - seg_off) / u;
            if whole > 0 {
                // Common case: whole units inside one segment, encrypted straight from guest
                // memory into the bounce buffer.
                let n = (whole * u).min(dst.len() - pos);
                // SAFETY: in flight (caller); seg_off + n <= seg.len().
                let src = unsafe { &seg.as_slice()[seg_off..seg_off + n] };
                self.engine
                    .encrypt(self.layout, unit_no, src, &mut dst[pos..pos + n])?;
                pos += n;
                seg_off += n;
            } else {
                // A unit straddling segments: gather it, then encrypt in place.
                let out = &mut dst[pos..pos + u];
                // SAFETY: in flight (caller).
                unsafe { copy_from_segments(segs, pos, out) };
                self.engine.encrypt_in_place(self.layout, unit_no, out)?;
                pos += u;
                // Re-find the cursor after `pos` bytes.
                let mut skip = pos;
                seg_i = 0;
                while seg_i < segs.len() && skip >= segs[seg_i].len() {
                    skip -= segs[seg_i].len();
                    seg_i += 1;
                }
                seg_off = skip;
            }
        }
        Ok(())
    }

    /// Decrypt `len` bytes in place in the segments (units numbered from `first`).
    ///
    /// # Safety
    /// The segments must be in flight and cover `len` bytes.
    unsafe fn decrypt_segments(
        &self,
        segs: &[Segment],
        first: u64,
        len: usize,
    ) -> Result<(), CryptoError> {
        let u = self.layout.unit_len;
        let mut pos = 0usize;
        let mut seg_i = 0usize;
        let mut seg_off = 0usize;
        let mut tmp = Vec::new();
        while pos < len {
            while seg_i < segs.len() && seg_off == segs[seg_i].len() {
                seg_i += 1;
                seg_off = 0;
            }
            let Some(seg) = segs.get(seg_i) else {
                return Err(CryptoError::Misaligned { len: pos, unit: u });
            };
            let unit_no = first + (pos / u) as u64;
            let whole = (seg.len() - seg_off) / u;
            if whole > 0 {
                let n = (whole * u).min(len - pos);
                // SAFETY: in flight (caller); seg_off + n <= seg.len().
                let buf = unsafe { &mut seg.as_mut_slice()[seg_off..seg_off + n] };
                self.engine.decrypt_in_place(self.layout, unit_no, buf)?;
                pos += n;
                seg_off += n;
            } else {
                tmp.resize(u, 0);
                // SAFETY: in flight (caller).
                unsafe { copy_from_segments(segs, pos, &mut tmp) };
                self.engine
                    .decrypt_in_place(self.layout, unit_no, &mut tmp)?;
                // SAFETY: in flight (caller).
                unsafe { copy_to_segments(segs, pos, &tmp) };
                pos += u;
                let mut skip = pos;
                seg_i = 0;
                while seg_i < segs.len() && skip >= segs[seg_i].len() {
                    skip -= segs[seg_i].len();
                    seg_i += 1;
                }
                seg_off = skip;
            }
        }
        Ok(())
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
                pool: Mutex::new(Vec::new()),
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

    fn submit_write(&self, req: IoRequest, done: &Arc<dyn Completion>) {
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
        upstream: Arc<dyn Completion>,
    ) {
        let seg = Segment::from_slice(bounce.slice(len));
        let down = IoRequest::new(IoKind::Write, offset, len as u64, tag).with_segments([seg]);
        // The bounce buffer moves into the completion, so it outlives the inner write even
        // when the device below completes on another thread much later.
        let c: Arc<dyn Completion> = Arc::new(WriteDone {
            shared: self.shared.clone(),
            bounce: Mutex::new(Some(bounce)),
            upstream,
        });
        self.inner.submit(down, &c);
    }

    fn submit_read(&self, req: IoRequest, done: &Arc<dyn Completion>) {
        let c: Arc<dyn Completion> = Arc::new(ReadDone {
            shared: self.shared.clone(),
            segments: req.segments.clone(),
            first: self.shared.unit_of(req.offset),
            len: req.len as usize,
            upstream: done.clone(),
        });
        self.inner.submit(req, &c);
    }

    fn submit_write_zeroes(&self, req: IoRequest, done: &Arc<dyn Completion>) {
        if req.len as usize <= ZERO_CHUNK {
            let len = req.len as usize;
            let mut bounce = self.shared.take(len);
            let buf = bounce.slice(len);
            buf.fill(0);
            let first = self.shared.unit_of(req.offset);
            if let Err(e) = self
                .shared
                .engine
                .encrypt_in_place(self.shared.layout, first, buf)
            {
                self.shared.give(bounce);
                done.complete(req.tag, Err(IoError::Crypto(e.to_string())));
                return;
            }
            self.write_bounce(req.offset, len, req.tag, bounce, done.clone());
            return;
        }
        // Large ranges: one chunk at a time on a helper thread, so neither memory nor the
        // submitting (frontend) thread is tied up in proportion to the range.
        let inner = self.inner.clone();
        let shared = self.shared.clone();
        let upstream = done.clone();
        let done = done.clone();
        let tag = req.tag;
        let spawned = std::thread::Builder::new()
            .name("nacre-zeroes".into())
            .spawn(move || {
                let r = write_zeroes_chunked(&*inner, &shared, req.offset, req.len);
                done.complete(req.tag, r);
            });
        if let Err(e) = spawned {
            // The closure never ran, so this is the only completion of the request.
            warn!(error = %e, "cannot start write-zeroes thread");
            upstream.complete(tag, Err(IoError::Media(format!("write zeroes: {e}"))));
        }
    }
}

fn write_zeroes_chunked(
    inner: &dyn BlockDevice,
    shared: &Shared,
    offset: u64,
    len: u64,
) -> IoResult {
    let mut bounce = shared.take(ZERO_CHUNK);
    let mut done = 0u64;
    let r = (|| {
        while done < len {
            let n = ((len - done) as usize).min(ZERO_CHUNK);
            let buf = bounce.slice(n);
            buf.fill(0);
            shared
                .engine
                .encrypt_in_place(shared.layout, shared.unit_of(offset + done), buf)
                .map_err(|e| IoError::Crypto(e.to_string()))?;
            let seg = Segment::from_slice(buf);
            inner.submit_wait(
                IoRequest::new(IoKind::Write, offset + done, n as u64, 0).with_segments([seg]),
            )?;
            done += n as u64;
        }
        Ok(())
    })();
    shared.give(bounce);
    r
}

struct WriteDone {
    shared: Arc<Shared>,
    bounce: Mutex<Option<Bounce>>,
    upstream: Arc<dyn Completion>,
}

impl Completion for WriteDone {
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
    upstream: Arc<dyn Completion>,
}

impl Completion for ReadDone {
    fn complete(&self, tag: u64, result: IoResult) {
        let result = result.and_then(|()| {
            // SAFETY: the upstream request (and so its segments) is in flight until we
            // complete it below; the device below has finished with them.
            unsafe {
                self.shared
                    .decrypt_segments(&self.segments, self.first, self.len)
            }
            .map_err(|e| IoError::Crypto(e.to_string()))
        });
        self.upstream.complete(tag, result);
    }
}

impl BlockDevice for EncryptedVolume {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn Completion>) {
        // Validate here too: the bounce buffer is sized from the request, so a request whose
        // segments do not add up must never reach the encryption loop.
        if let Err(e) = self.geometry().check(&req) {
            done.complete(req.tag, Err(e));
            return;
        }
        match req.kind {
            IoKind::Write if req.len > 0 => self.submit_write(req, done),
            IoKind::Read if req.len > 0 => self.submit_read(req, done),
            IoKind::WriteZeroes if req.len > 0 => self.submit_write_zeroes(req, done),
            _ => self.inner.submit(req, done),
        }
    }

    fn resize(&self, new_size: u64) -> IoResult {
        self.inner.resize(new_size)
    }
}
