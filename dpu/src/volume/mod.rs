//! Volumes: the one block-device interface of nacre's data path.
//!
//! Every frontend (vhost-user-blk, NVMe-oF target) submits [`IoRequest`]s to a
//! [`BlockDevice`]; every layer below (crypto, stripe, remote fabric, local backends)
//! implements it. Submission is asynchronous: `submit` hands the request over together with
//! an [`IoCompletion`] and returns; the device calls [`IoCompletion::complete`] exactly once,
//! either before `submit` returns (RAM, null and buffered file I/O complete inline, so a
//! frontend pays no thread hop) or later from another thread (O_DIRECT file I/O from the
//! volume's io_uring reaper, remote backends from the initiator's threads). No lock is held
//! across I/O: local backends take none on the data path, and frontends must not hold their
//! queue lock while calling `submit` if they want asynchronous devices to make progress.
//!
//! # The memory-safety contract of the data path
//!
//! Memory is described by [`Segment`]s: raw pointer/length pairs, because the bytes live in
//! guest memory mapped from a vhost-user client or in a frontend's receive buffer, neither of
//! which can be borrowed across an asynchronous completion. The types carry the contract; no
//! safe code can break it:
//!
//! * **Making a segment is `unsafe`** ([`Segment::new`], [`Segment::from_slice`]). Whoever
//!   makes one promises that its memory stays allocated, and is not read or written by Rust
//!   code of theirs, until the request carrying it (or any request a layer below builds from
//!   it) has completed. The one safe constructor, [`Segment::from_static`], takes memory
//!   borrowed exclusively for the rest of the process, which no completion can outlive.
//!   Safe callers use [`BlockDevice::read_at`] / [`BlockDevice::write_at`], which borrow the
//!   buffer and block until completion.
//! * **A segment has one owner.** `Segment` is neither `Copy` nor `Clone`: it moves into the
//!   [`IoRequest`] that carries it, and with the request into [`BlockDevice::submit`]. Safe
//!   code cannot keep a copy of a submitted segment and put it into a second request after
//!   the first completed. A layer that splits a request makes sub-segments with the
//!   `unsafe` constructor and says why they end before the parent completes.
//! * **Implementing [`BlockDevice`] is `unsafe`.** An implementation promises to read and
//!   write a request's segment memory only until it reports the request's completion, and
//!   to keep no segment of it (nor one made from it) in use after that: sub-requests it
//!   submits complete first. This is what lets the unsafe code of the layers below trust
//!   the segments they are handed.
//! * Devices touch segment memory only through raw copies ([`copy_to_segments`],
//!   [`copy_from_segments`]) or by handing the address to the kernel (preadv, io_uring) or a
//!   NIC, never through a Rust reference: the memory may be guest memory that the guest
//!   writes concurrently (a misbehaving guest gets garbage, not undefined behaviour in
//!   nacred).
//!
//! docs/safety.md lists the `unsafe fn`s of the data path and the modules Miri checks.

pub mod dma;
pub mod file;
pub mod null;
pub mod plug;
pub mod qos;
pub mod ram;
pub mod stripe;
pub mod uring;

use std::sync::{Arc, Condvar, Mutex};

use smallvec::SmallVec;
use thiserror::Error;

/// Read, write and zeroing offsets and lengths are in bytes and must be multiples of the
/// volume's logical block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    /// Fill the segments with `len` bytes from `offset`.
    Read,
    /// Store `len` bytes from the segments at `offset`.
    Write,
    /// Make every acknowledged write durable (fdatasync for files).
    Flush,
    /// The range's contents become undefined; for nacre's backends they read back as zeros.
    Discard,
    /// The range reads back as zeros afterwards.
    WriteZeroes,
}

/// A span of memory a request reads into or writes from.
///
/// Not `Copy` or `Clone`: a segment belongs to the one request that carries it (module
/// docs).
#[derive(Debug)]
pub struct Segment {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Segment is a plain address range; the submitter of the request that carries it
// guarantees exclusive access to that memory until the request completes (module docs), so
// moving it to the completing thread is sound.
unsafe impl Send for Segment {}
// SAFETY: see above; shared references to a Segment only expose the address and length.
unsafe impl Sync for Segment {}

impl Segment {
    /// A segment over raw memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes, and not accessed by anyone else,
    /// until the request carrying this segment (and every request a layer below builds from
    /// it) completes. A segment of a request that only reads it (a write) may cover memory
    /// that is only valid for reads, provided it never goes into a read request.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        Segment { ptr, len }
    }

    /// A segment over a buffer the caller owns.
    ///
    /// # Safety
    /// The borrow ends when this returns, the request does not: the caller must keep `buf`
    /// allocated, and not access it, until the request carrying this segment completes —
    /// e.g. by waiting for it ([`BlockDevice::submit_wait`]) before `buf` goes out of scope,
    /// or by moving the buffer into the request's completion.
    pub unsafe fn from_slice(buf: &mut [u8]) -> Self {
        Segment {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    /// A segment over memory borrowed exclusively for the rest of the process (a leaked
    /// buffer, a `static`): no completion can outlive it, so this needs no promise.
    pub fn from_static(buf: &'static mut [u8]) -> Self {
        Segment {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address, for raw copies and the kernel; no reference over it may be formed (the
    /// memory may be written concurrently by a guest).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

/// Most virtio-blk and NVMe requests carry one to four data segments.
pub type Segments = SmallVec<[Segment; 4]>;

/// One block I/O.
#[derive(Debug)]
pub struct IoRequest {
    pub kind: IoKind,
    /// Byte offset into the volume.
    pub offset: u64,
    /// Byte length. For Read/Write it equals the sum of the segment lengths.
    pub len: u64,
    pub segments: Segments,
    /// Opaque to the device; handed back in the completion so the frontend can find its
    /// request (virtio head index, NVMe command id).
    pub tag: u64,
}

impl IoRequest {
    pub fn new(kind: IoKind, offset: u64, len: u64, tag: u64) -> Self {
        IoRequest {
            kind,
            offset,
            len,
            segments: Segments::new(),
            tag,
        }
    }

    pub fn with_segments(mut self, segs: impl IntoIterator<Item = Segment>) -> Self {
        self.segments.extend(segs);
        self
    }

    pub fn segment_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len as u64).sum()
    }
}

/// Why an I/O failed. Frontends map these to virtio-blk and NVMe status codes.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum IoError {
    /// The range ends beyond the volume (NVMe: LBA Out of Range; virtio: IOERR).
    #[error("range {offset}+{len} is beyond the end of the volume ({size} bytes)")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    /// Offset or length not a multiple of the logical block size, or segments that do not add
    /// up to the length (NVMe: Invalid Field; virtio: IOERR).
    #[error("misaligned or inconsistent request: {0}")]
    Invalid(&'static str),
    /// The volume or device refuses writes.
    #[error("volume is read-only")]
    ReadOnly,
    /// The operation is not implemented by this device (virtio: UNSUPP; NVMe: Invalid Opcode).
    #[error("operation not supported by this volume")]
    Unsupported,
    /// The medium or the layer below failed (errno where known).
    #[error("I/O error: {0}")]
    Media(String),
    /// Decryption or integrity failure.
    #[error("crypto failure: {0}")]
    Crypto(String),
    /// The path to remote storage is gone for now: its controller is reconnecting and
    /// `fast_io_fail_timeout` has passed, or a multipath member hands the I/O back for another
    /// path. Retrying later, or elsewhere, may succeed.
    #[error("path to storage lost")]
    PathLost,
    /// The path to remote storage is gone for good: its controller failed (`ctrl_loss_timeout`
    /// expired) or was detached, or every path of a multipath volume did, or the remote said
    /// Do Not Retry. Retrying cannot help, and a host must be told so (NVMe: DNR).
    #[error("path to storage failed (controller lost for good)")]
    PathFailed,
}

impl IoError {
    pub fn from_errno(e: std::io::Error) -> Self {
        IoError::Media(e.to_string())
    }
}

pub type IoResult = Result<(), IoError>;

/// Where a device reports that a request finished: the callback a submitter hands over with
/// each request (not the NVMe completion queue entry, which is
/// `nacre_shared::nvme::Completion`).
pub trait IoCompletion: Send + Sync {
    fn complete(&self, tag: u64, result: IoResult);
}

/// Size and block size of a volume as the data path sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes; a multiple of `block_size`.
    pub size: u64,
    /// Logical block size: 512 or 4096.
    pub block_size: u32,
}

impl Geometry {
    pub fn blocks(&self) -> u64 {
        self.size / self.block_size as u64
    }

    /// Check a request against the geometry; every backend calls this first, so no layer
    /// ever touches bytes beyond the end or across a partial block.
    pub fn check(&self, req: &IoRequest) -> IoResult {
        if req.kind == IoKind::Flush {
            return Ok(());
        }
        let bs = self.block_size as u64;
        if req.offset % bs != 0 || req.len % bs != 0 {
            return Err(IoError::Invalid(
                "offset and length must be multiples of the block size",
            ));
        }
        let end = req
            .offset
            .checked_add(req.len)
            .ok_or(IoError::Invalid("offset + length overflows"))?;
        if end > self.size {
            return Err(IoError::OutOfRange {
                offset: req.offset,
                len: req.len,
                size: self.size,
            });
        }
        match req.kind {
            IoKind::Read | IoKind::Write if req.segment_bytes() != req.len => Err(
                IoError::Invalid("data segments do not add up to the request length"),
            ),
            _ => Ok(()),
        }
    }
}

/// The block-device interface every data-path layer implements.
///
/// # Safety
/// An implementation reads and writes the memory of a submitted request's segments only
/// until it reports that request's completion ([`IoCompletion::complete`]), and keeps no
/// segment of it in use past that: every request it builds from them (a stripe's pieces, a
/// path's retry) completes before it reports the parent's completion, and no segment is
/// handed to anything that outlives it. Submitters rely on this to free or reuse their
/// memory once the completion ran ([`BlockDevice::read_at`] does, safely), and the layers
/// below rely on it to trust the segments they are handed.
pub unsafe trait BlockDevice: Send + Sync {
    fn geometry(&self) -> Geometry;

    /// Start `req`; `done.complete(req.tag, …)` is called exactly once, possibly before this
    /// returns. Errors, including invalid requests, are reported through `done`, never by
    /// panicking.
    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>);

    /// The QoS and statistics layer, when this device is one: [`qos::VolumePath`] submits
    /// through it without a dynamic call and hands frontends its statistics (a bare device,
    /// `nacred --no-qos`, has none).
    fn qos_layer(&self) -> Option<Arc<qos::QosVolume>> {
        None
    }

    /// Change the size (`volume_resize`). Backends that cannot resize return Unsupported.
    fn resize(&self, _new_size: u64) -> IoResult {
        Err(IoError::Unsupported)
    }

    /// Submit and wait: for the control plane, tests and tools, never the hot path.
    fn submit_wait(&self, req: IoRequest) -> IoResult {
        let waiter = Arc::new(Waiter::default());
        let done: Arc<dyn IoCompletion> = waiter.clone();
        self.submit(req, &done);
        waiter.wait()
    }

    /// Convenience over `submit_wait` for a single buffer.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> IoResult {
        let len = buf.len() as u64;
        // SAFETY: submit_wait returns only after the request completed, and the device keeps
        // no use of the segment past that (the `BlockDevice` contract); `buf` is borrowed
        // (so alive and untouched) until then.
        let seg = unsafe { Segment::from_slice(buf) };
        self.submit_wait(IoRequest::new(IoKind::Read, offset, len, 0).with_segments([seg]))
    }

    /// Convenience over `submit_wait` for a single buffer.
    fn write_at(&self, offset: u64, buf: &[u8]) -> IoResult {
        let len = buf.len() as u64;
        // SAFETY: a write only reads its segment, and this one never goes into a read; the
        // buffer is borrowed until submit_wait returns, after the completion.
        let seg = unsafe { Segment::new(buf.as_ptr() as *mut u8, buf.len()) };
        self.submit_wait(IoRequest::new(IoKind::Write, offset, len, 0).with_segments([seg]))
    }
}

/// A one-shot completion that a thread can block on.
#[derive(Default)]
pub struct Waiter {
    result: Mutex<Option<IoResult>>,
    cond: Condvar,
}

impl Waiter {
    pub fn wait(&self) -> IoResult {
        // The request may still be held by this thread's plug (volume::plug).
        plug::flush();
        let mut r = self.result.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(res) = r.take() {
                return res;
            }
            r = self.cond.wait(r).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl IoCompletion for Waiter {
    fn complete(&self, _tag: u64, result: IoResult) {
        *self.result.lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
        self.cond.notify_all();
    }
}

/// Copy `src` into a segment list starting at byte `skip` of the list (reads).
///
/// # Safety
/// The segments must be in flight (see [`Segment`]).
pub unsafe fn copy_to_segments(segs: &[Segment], mut skip: usize, mut src: &[u8]) {
    for s in segs {
        if src.is_empty() {
            break;
        }
        if skip >= s.len {
            skip -= s.len;
            continue;
        }
        let n = (s.len - skip).min(src.len());
        // SAFETY: in-flight segment (caller), and n <= s.len - skip.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), s.ptr.add(skip), n) };
        src = &src[n..];
        skip = 0;
    }
}

/// Copy from a segment list starting at byte `skip` of the list into `dst` (writes).
///
/// # Safety
/// The segments must be in flight (see [`Segment`]).
pub unsafe fn copy_from_segments(segs: &[Segment], mut skip: usize, mut dst: &mut [u8]) {
    for s in segs {
        if dst.is_empty() {
            break;
        }
        if skip >= s.len {
            skip -= s.len;
            continue;
        }
        let n = (s.len - skip).min(dst.len());
        // SAFETY: in-flight segment (caller), and n <= s.len - skip.
        unsafe { std::ptr::copy_nonoverlapping(s.ptr.add(skip), dst.as_mut_ptr(), n) };
        dst = &mut dst[n..];
        skip = 0;
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn geometry_rejects_misaligned_and_out_of_range() {
        let g = Geometry {
            size: 1 << 20,
            block_size: 4096,
        };
        let mut buf = vec![0u8; 4096];
        // SAFETY: these requests are only checked, never submitted.
        let seg = unsafe { Segment::from_slice(&mut buf) };
        let ok = IoRequest::new(IoKind::Read, 0, 4096, 0).with_segments([seg]);
        assert_eq!(g.check(&ok), Ok(()));
        let mis = IoRequest::new(IoKind::Read, 512, 4096, 0).with_segments(ok.segments);
        assert!(matches!(g.check(&mis), Err(IoError::Invalid(_))));
        let past = IoRequest::new(IoKind::Read, (1 << 20) - 4096 + 4096, 4096, 0)
            .with_segments(mis.segments);
        assert!(matches!(g.check(&past), Err(IoError::OutOfRange { .. })));
        let wrap = IoRequest::new(IoKind::Discard, u64::MAX - 4095, 4096 * 2, 0);
        assert!(matches!(g.check(&wrap), Err(IoError::Invalid(_))));
        let short = IoRequest::new(IoKind::Write, 0, 8192, 0).with_segments(past.segments);
        assert!(matches!(g.check(&short), Err(IoError::Invalid(_))));
        assert_eq!(
            g.check(&IoRequest::new(IoKind::Flush, u64::MAX, 7, 0)),
            Ok(())
        );
    }

    #[test]
    fn segment_copies_cross_boundaries() {
        let mut a = vec![0u8; 3];
        let mut b = vec![0u8; 5];
        // SAFETY: the buffers outlive the copies below and are not touched meanwhile.
        let segs = unsafe { [Segment::from_slice(&mut a), Segment::from_slice(&mut b)] };
        // SAFETY: the buffers outlive the calls.
        unsafe { copy_to_segments(&segs, 2, &[1, 2, 3, 4]) };
        assert_eq!(a, [0, 0, 1]);
        assert_eq!(b, [2, 3, 4, 0, 0]);
        let mut out = [0u8; 4];
        // SAFETY: as above.
        unsafe { copy_from_segments(&segs, 1, &mut out) };
        assert_eq!(out, [0, 1, 2, 3]);
    }
}
