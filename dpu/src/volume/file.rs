//! The file backend: a volume's blocks in a (sparse) file.
//!
//! Buffered I/O runs on the submitting frontend thread with `preadv`/`pwritev` straight into
//! the request's segments (guest memory or a receive buffer), so a request costs one system
//! call and no copy in nacred. Each vhost-user queue has its own worker thread and the
//! NVMe-oF target's connections are spread over a few reactor threads, so those threads are
//! the thread pool. On a file in the page cache this beats io_uring's submit/reap round trip
//! for 4 KiB requests on this class of machine (`tests/src/bin/file-engine-bench.rs`).
//! `O_DIRECT` I/O, which waits on the device, goes through io_uring instead and completes
//! from a reaper thread, so a slow disk does not stall the queue.
//!
//! `O_DIRECT` is used where the file system accepts it unless the caller asks for buffered
//! I/O or the file is on tmpfs or ramfs (memory: there is no cache to bypass, and io_uring
//! measured 0.43× of synchronous I/O there); requests whose segments are not aligned for it
//! go through an aligned bounce buffer. Flush is `fdatasync`. Discard punches a hole; Write
//! Zeroes uses `FALLOC_FL_ZERO_RANGE`, falling back to a hole and then to writing zeros, so
//! both always read back as zeros.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tracing::{debug, info};

use super::uring::{Submitted, Uring};
use super::{
    copy_from_segments, copy_to_segments, BlockDevice, Geometry, IoCompletion, IoError, IoKind,
    IoRequest, IoResult, Segment,
};

/// Alignment O_DIRECT needs for memory, offsets and lengths on the file systems nacre meets.
const DIRECT_ALIGN: usize = 4096;
/// The most an unaligned O_DIRECT request bounces at once ([`SyncIo::rw_bounce`]).
const BOUNCE_CHUNK: usize = 1 << 20;

pub struct FileVolume {
    /// Declared before `file`: dropped first, so the reaper is joined before the fd closes.
    uring: Option<Uring>,
    file: File,
    io: SyncIo,
    path: PathBuf,
    size: AtomicU64,
    block_size: u32,
}

/// Synchronous I/O on the volume's file descriptor (copied into the io_uring reaper, which
/// redoes short transfers with it). The fd is owned by `FileVolume::file`.
#[derive(Clone, Copy)]
struct SyncIo {
    fd: RawFd,
    direct: bool,
}

impl FileVolume {
    /// Open (creating if needed) `path` as a volume of `size` bytes. An existing file is
    /// extended or kept, never truncated below its data, unless `size` says so explicitly
    /// via `resize`.
    pub fn open(
        path: &Path,
        size: u64,
        block_size: u32,
        want_direct: bool,
    ) -> Result<Self, IoError> {
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true).create(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(path)
        };
        let want_direct = want_direct && !on_memory_fs(path);
        let (file, direct) = match want_direct {
            true => match open(true) {
                Ok(f) => (f, true),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    info!(path = %path.display(), "file system refuses O_DIRECT; using buffered I/O");
                    (open(false).map_err(IoError::from_errno)?, false)
                }
                Err(e) => return Err(IoError::from_errno(e)),
            },
            false => (open(false).map_err(IoError::from_errno)?, false),
        };
        let cur = file.metadata().map_err(IoError::from_errno)?.len();
        if cur < size {
            // set_len makes the file sparse: no blocks allocated until written.
            file.set_len(size).map_err(IoError::from_errno)?;
        }
        let io = SyncIo {
            fd: file.as_raw_fd(),
            direct,
        };
        let uring = if direct {
            let redo = Arc::new(move |k: IoKind, off: u64, len: usize, segs: &[Segment]| {
                // SAFETY: the reaper redoes only requests whose completion has not run yet,
                // so their segments are in flight (Uring::submit's contract).
                unsafe { io.rw(k, off, len, segs) }
            });
            match Uring::new(io.fd, redo) {
                Ok(u) => Some(u),
                Err(e) => {
                    info!(error = %e, "io_uring unavailable; O_DIRECT I/O runs synchronously");
                    None
                }
            }
        } else {
            None
        };
        debug!(path = %path.display(), size, direct, uring = uring.is_some(), "file volume open");
        Ok(FileVolume {
            uring,
            file,
            io,
            path: path.to_path_buf(),
            size: AtomicU64::new(size),
            block_size,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn is_direct(&self) -> bool {
        self.io.direct
    }

    /// Whether O_DIRECT reads and writes go through io_uring.
    pub fn uses_uring(&self) -> bool {
        self.uring.is_some()
    }

    fn zero_range(&self, offset: u64, len: u64, punch: bool) -> IoResult {
        self.io.zero_range(offset, len, punch)
    }
}

impl SyncIo {
    fn aligned(&self, segs: &[Segment]) -> bool {
        !self.direct
            || segs
                .iter()
                .all(|s| s.as_ptr() as usize % DIRECT_ALIGN == 0 && s.len() % DIRECT_ALIGN == 0)
    }

    /// Read or write `len` bytes at `offset` from or into the segments, synchronously.
    ///
    /// # Safety
    /// The segments must be those of a request in flight (see [`Segment`]), covering `len`
    /// bytes.
    unsafe fn rw(&self, kind: IoKind, offset: u64, len: usize, segs: &[Segment]) -> IoResult {
        if self.direct && (offset as usize % DIRECT_ALIGN != 0 || !self.aligned(segs)) {
            // SAFETY: the caller's guarantee.
            return unsafe { self.rw_bounce(kind, offset, len, segs) };
        }
        // SAFETY: the caller's guarantee.
        unsafe { self.rw_iov(kind, offset, len, segs) }
    }

    /// `preadv`/`pwritev` until `len` bytes moved, retrying EINTR and short transfers; a read
    /// past the end of the file (shorter than the volume) returns zeros.
    ///
    /// # Safety
    /// As [`SyncIo::rw`]: the kernel reads or writes the segments' memory.
    unsafe fn rw_iov(&self, kind: IoKind, offset: u64, len: usize, segs: &[Segment]) -> IoResult {
        let mut iov: smallvec::SmallVec<[libc::iovec; 8]> = segs
            .iter()
            .map(|s| libc::iovec {
                iov_base: s.as_ptr() as *mut libc::c_void,
                iov_len: s.len(),
            })
            .collect();
        let mut done = 0usize;
        let mut first = 0usize;
        let fd = self.fd;
        while done < len {
            let n = if kind == IoKind::Read {
                // SAFETY: iovecs describe in-flight segments (valid for writes by the kernel).
                unsafe {
                    libc::preadv(
                        fd,
                        iov[first..].as_ptr(),
                        (iov.len() - first).min(libc::UIO_MAXIOV as usize) as i32,
                        (offset + done as u64) as libc::off_t,
                    )
                }
            } else {
                // SAFETY: iovecs describe in-flight segments (valid for reads by the kernel).
                unsafe {
                    libc::pwritev(
                        fd,
                        iov[first..].as_ptr(),
                        (iov.len() - first).min(libc::UIO_MAXIOV as usize) as i32,
                        (offset + done as u64) as libc::off_t,
                    )
                }
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(IoError::from_errno(e));
            }
            if n == 0 {
                if kind == IoKind::Read {
                    // Past EOF of a file shorter than the volume (grown elsewhere): zeros.
                    // SAFETY: segments in flight.
                    unsafe { zero_segments(segs, done) };
                    return Ok(());
                }
                return Err(IoError::Media("short write".into()));
            }
            done += n as usize;
            // Advance the iovec cursor past what was transferred.
            let mut adv = n as usize;
            while adv > 0 && first < iov.len() {
                if adv >= iov[first].iov_len {
                    adv -= iov[first].iov_len;
                    first += 1;
                } else {
                    // SAFETY: still within the same segment.
                    iov[first].iov_base = unsafe { (iov[first].iov_base as *mut u8).add(adv) } as _;
                    iov[first].iov_len -= adv;
                    adv = 0;
                }
            }
        }
        Ok(())
    }

    /// Unaligned memory under O_DIRECT: through an aligned buffer of at most
    /// [`BOUNCE_CHUNK`] bytes, reused chunk after chunk, so what a request costs in memory
    /// is bounded whatever length its submitter claims (a guest may chain descriptors of
    /// nearly 4 GiB each over the same page of its memory).
    ///
    /// # Safety
    /// As [`SyncIo::rw`].
    unsafe fn rw_bounce(
        &self,
        kind: IoKind,
        offset: u64,
        len: usize,
        segs: &[Segment],
    ) -> IoResult {
        let mut buf = AlignedBuf::new(len.min(BOUNCE_CHUNK));
        let mut done = 0;
        while done < len {
            let n = (len - done).min(BOUNCE_CHUNK);
            let chunk = &mut buf.as_mut_slice()[..n];
            if kind == IoKind::Write {
                // SAFETY: segments in flight, covering `len` bytes.
                unsafe { copy_from_segments(segs, done, chunk) };
            }
            // SAFETY: rw_iov below is synchronous; `buf` outlives it and is not touched
            // meanwhile.
            let seg = unsafe { Segment::from_slice(chunk) };
            // The bounce buffer is aligned; offsets from volume requests are block aligned,
            // and a 512-byte-block volume on a 4 KiB-sector file system is refused by the
            // kernel with EINVAL, which surfaces as a media error rather than silently
            // misbehaving.
            // SAFETY: `seg` is the bounce buffer's, valid for the whole call.
            unsafe { self.rw_iov(kind, offset + done as u64, n, &[seg]) }?;
            if kind == IoKind::Read {
                // SAFETY: segments in flight, covering `len` bytes.
                unsafe { copy_to_segments(segs, done, &buf.as_mut_slice()[..n]) };
            }
            done += n;
        }
        Ok(())
    }

    fn zero_range(&self, offset: u64, len: u64, punch: bool) -> IoResult {
        let fd = self.fd;
        let modes: &[i32] = if punch {
            &[libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE]
        } else {
            &[
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            ]
        };
        for &mode in modes {
            // SAFETY: plain fallocate on our own fd.
            let r = unsafe { libc::fallocate(fd, mode, offset as libc::off_t, len as libc::off_t) };
            if r == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if !matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
            ) {
                return Err(IoError::from_errno(e));
            }
        }
        // The file system supports neither: write zeros in 1 MiB chunks.
        const CHUNK: u64 = 1 << 20;
        let mut zeros = AlignedBuf::new(CHUNK.min(len) as usize);
        let mut pos = 0;
        while pos < len {
            let n = (len - pos).min(CHUNK) as usize;
            // SAFETY: rw_iov is synchronous; `zeros` outlives it and is not touched meanwhile.
            let seg = unsafe { Segment::from_slice(&mut zeros.as_mut_slice()[..n]) };
            // SAFETY: `seg` is the zero buffer's, valid for the whole call.
            unsafe { self.rw_iov(IoKind::Write, offset + pos, n, &[seg]) }?;
            pos += n as u64;
        }
        Ok(())
    }
}

/// Whether `path` (or its directory, before the file exists) is on tmpfs or ramfs. There
/// O_DIRECT bypasses no device and saves no cache — the file *is* memory — and Linux 6.6+
/// accepts it on tmpfs, which would send the volume down the io_uring path that
/// `file-engine-bench` measured at 0.43× of synchronous I/O on tmpfs.
fn on_memory_fs(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let probe = if path.exists() {
        path
    } else {
        path.parent().unwrap_or(Path::new("/"))
    };
    let Ok(c) = std::ffi::CString::new(probe.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs with a valid NUL-terminated path and a zeroed out-struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return false;
    }
    // ramfs's magic (linux/magic.h); libc names only tmpfs's.
    const RAMFS_MAGIC: libc::c_long = 0x8584_58f6;
    st.f_type == libc::TMPFS_MAGIC || st.f_type == RAMFS_MAGIC
}

/// # Safety
/// Segments must be in flight.
unsafe fn zero_segments(segs: &[Segment], mut skip: usize) {
    for s in segs {
        if skip >= s.len() {
            skip -= s.len();
            continue;
        }
        // SAFETY: in flight (caller); skip < len.
        unsafe { std::ptr::write_bytes(s.as_ptr().add(skip), 0, s.len() - skip) };
        skip = 0;
    }
}

/// A heap buffer aligned for O_DIRECT.
struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len.max(1), DIRECT_ALIGN).expect("layout");
        // SAFETY: non-zero size layout; null is handled.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is a live allocation of len bytes owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout =
            std::alloc::Layout::from_size_align(self.len.max(1), DIRECT_ALIGN).expect("layout");
        // SAFETY: allocated in new() with the same layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

// SAFETY: segment memory is read and written by preadv/pwritev and raw copies on the
// submitting thread before the completion is reported, or by the io_uring whose reaper
// reports the completion only after the CQE (volume::uring).
unsafe impl BlockDevice for FileVolume {
    fn geometry(&self) -> Geometry {
        Geometry {
            size: self.size.load(Ordering::Relaxed),
            block_size: self.block_size,
        }
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let valid = self.geometry().check(&req);
        if let (Ok(()), Some(u), IoKind::Read | IoKind::Write) = (&valid, &self.uring, req.kind) {
            if req.offset as usize % DIRECT_ALIGN == 0 && self.io.aligned(&req.segments) {
                let len = req.len as usize;
                // SAFETY: the request's segments stay valid until its completion `done`
                // runs (the submitter's side of the BlockDevice contract), and this device
                // touches them no more once the ring has the request.
                match unsafe { u.submit(req.kind, req.offset, len, &req.segments, req.tag, done) } {
                    Submitted::Queued => return,
                    Submitted::Busy => {}
                }
            }
        }
        let result = valid.and_then(|()| match req.kind {
            // SAFETY: the request is in flight until `done` runs below, and checked: its
            // segments cover `len` bytes.
            IoKind::Read | IoKind::Write => unsafe {
                self.io
                    .rw(req.kind, req.offset, req.len as usize, &req.segments)
            },
            // SAFETY: plain fdatasync on our own fd.
            IoKind::Flush => match unsafe { libc::fdatasync(self.file.as_raw_fd()) } {
                0 => Ok(()),
                _ => Err(IoError::from_errno(std::io::Error::last_os_error())),
            },
            IoKind::Discard => self.zero_range(req.offset, req.len, true),
            IoKind::WriteZeroes => self.zero_range(req.offset, req.len, false),
        });
        done.complete(req.tag, result);
    }

    fn resize(&self, new_size: u64) -> IoResult {
        self.file.set_len(new_size).map_err(IoError::from_errno)?;
        self.file.sync_all().map_err(IoError::from_errno)?;
        self.size.store(new_size, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod test {
    use super::*;

    fn check_volume(direct: bool) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("v.img");
        let v = FileVolume::open(&p, 1 << 20, 512, direct).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20);
        // Unaligned memory forces the bounce path when O_DIRECT is on.
        let mut pat = vec![0u8; 8192 + 1];
        for (i, b) in pat.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        v.write_at(512, &pat[1..]).unwrap();
        let mut back = vec![0u8; 8192];
        v.read_at(512, &mut back).unwrap();
        assert_eq!(back, &pat[1..]);
        v.submit_wait(IoRequest::new(IoKind::Flush, 0, 0, 0))
            .unwrap();
        v.submit_wait(IoRequest::new(IoKind::Discard, 512, 4096, 0))
            .unwrap();
        v.submit_wait(IoRequest::new(IoKind::WriteZeroes, 4608, 512, 0))
            .unwrap();
        v.read_at(512, &mut back).unwrap();
        assert!(back[..4608].iter().all(|&b| b == 0));
        assert_eq!(&back[4608..], &pat[1 + 4608..]);
        v.resize(2 << 20).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 2 << 20);
        let mut tail = vec![1u8; 4096];
        v.read_at((2 << 20) - 4096, &mut tail).unwrap();
        assert!(tail.iter().all(|&b| b == 0));
        drop(v);
        // Reopening keeps the data.
        let v = FileVolume::open(&p, 2 << 20, 512, direct).unwrap();
        v.read_at(512 + 4608, &mut back[..512]).unwrap();
        assert_eq!(&back[..512], &pat[1 + 4608..1 + 4608 + 512]);
    }

    /// Counts completions from whichever thread delivers them, keeping failures.
    #[derive(Default)]
    struct Tally {
        done: std::sync::Mutex<Vec<(u64, IoResult, std::thread::ThreadId)>>,
        cond: std::sync::Condvar,
    }
    impl IoCompletion for Tally {
        fn complete(&self, tag: u64, result: IoResult) {
            let mut d = self.done.lock().unwrap();
            d.push((tag, result, std::thread::current().id()));
            self.cond.notify_all();
        }
    }
    impl Tally {
        fn wait_for(&self, n: usize) -> Vec<(u64, IoResult, std::thread::ThreadId)> {
            let mut d = self.done.lock().unwrap();
            while d.len() < n {
                d = self.cond.wait(d).unwrap();
            }
            std::mem::take(&mut *d)
        }
    }

    struct Aligned(Vec<u8>, usize);
    impl Aligned {
        fn new(len: usize) -> Self {
            let v = vec![0u8; len + DIRECT_ALIGN];
            let skip = v.as_ptr().align_offset(DIRECT_ALIGN);
            Aligned(v, skip)
        }
        fn buf(&mut self, len: usize) -> &mut [u8] {
            &mut self.0[self.1..self.1 + len]
        }
    }

    /// A file volume that really is O_DIRECT, on the first of the temporary directory,
    /// /var/tmp and the build's target directory whose file system takes O_DIRECT (the
    /// temporary directory is often tmpfs, which stays buffered by design). Fails, saying so,
    /// where none does: the tests that use it would otherwise test the buffered path.
    fn direct_volume(size: u64, block_size: u32) -> (tempfile::TempDir, FileVolume) {
        let candidates = [
            std::env::temp_dir(),
            std::path::PathBuf::from("/var/tmp"),
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
        ];
        candidates
            .iter()
            .filter_map(|c| tempfile::tempdir_in(c).ok())
            .find_map(|dir| {
                let v = FileVolume::open(&dir.path().join("v.img"), size, block_size, true).ok()?;
                v.is_direct().then_some((dir, v))
            })
            .unwrap_or_else(|| {
                panic!(
                    "no file system among {candidates:?} takes O_DIRECT file volumes: \
                     the O_DIRECT paths cannot be tested here"
                )
            })
    }

    /// O_DIRECT volumes (where the file system allows them) submit aligned reads and writes
    /// through io_uring and complete them asynchronously from the reaper thread; more
    /// requests than the ring holds fall back to the synchronous path; data is exact.
    #[test]
    fn direct_io_goes_through_io_uring_with_async_completion() {
        let (_dir, v) = direct_volume(8 << 20, 4096);
        assert!(v.uses_uring(), "O_DIRECT volume without io_uring");
        let n = super::super::uring::DEPTH as usize + 64;
        let mut mem = Aligned::new(n * 4096);
        let buf = mem.buf(n * 4096);
        for (i, c) in buf.chunks_mut(4096).enumerate() {
            c.fill(i as u8 ^ 0x5A);
            c[..8].copy_from_slice(&(i as u64).to_le_bytes());
        }
        let tally = Arc::new(Tally::default());
        let done: Arc<dyn IoCompletion> = tally.clone();
        let me = std::thread::current().id();
        for (i, c) in buf.chunks_mut(4096).enumerate() {
            let off = ((i * 7) % n) as u64 * 4096;
            // SAFETY: `buf` is neither read nor dropped until `tally.wait_for(n)` below has seen
            // every request complete.
            let seg = unsafe { Segment::from_slice(c) };
            v.submit(
                IoRequest::new(IoKind::Write, off, 4096, i as u64).with_segments([seg]),
                &done,
            );
        }
        let results = tally.wait_for(n);
        assert!(results.iter().all(|(_, r, _)| r.is_ok()), "{results:?}");
        assert!(
            results.iter().any(|(_, _, t)| *t != me),
            "no completion came from the reaper thread"
        );
        let mut back = Aligned::new(4096);
        for i in 0..n {
            let off = ((i * 7) % n) as u64 * 4096;
            let b = back.buf(4096);
            v.read_at(off, b).unwrap();
            assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), i as u64);
            assert!(b[8..].iter().all(|&x| x == i as u8 ^ 0x5A));
        }
        // A file shorter than the volume (grown behind our back): the short read past EOF
        // is redone synchronously and reads zeros.
        v.file.set_len(4096).unwrap();
        let b = back.buf(4096);
        b.fill(1);
        v.read_at(1 << 20, b).unwrap();
        assert!(b.iter().all(|&x| x == 0));
    }

    /// On tmpfs (memory) O_DIRECT buys nothing and costs an io_uring round trip: buffered.
    #[test]
    fn memory_file_systems_stay_buffered() {
        let dir = tempfile::tempdir_in("/dev/shm")
            .expect("/dev/shm (tmpfs) is needed: this test checks files on memory stay buffered");
        assert!(on_memory_fs(dir.path()));
        let v = FileVolume::open(&dir.path().join("m.img"), 1 << 20, 4096, true).unwrap();
        assert!(!v.is_direct() && !v.uses_uring());
        let disk = tempfile::tempdir().unwrap();
        if !on_memory_fs(disk.path()) {
            let v = FileVolume::open(&disk.path().join("d.img"), 1 << 20, 4096, true).unwrap();
            eprintln!("{}: O_DIRECT {}", disk.path().display(), v.is_direct());
        }
    }

    #[test]
    fn buffered_file_volume() {
        check_volume(false);
    }

    #[test]
    fn direct_file_volume_or_fallback() {
        check_volume(true);
    }

    /// A long request in unaligned memory under O_DIRECT bounces a chunk at a time (at most
    /// BOUNCE_CHUNK bytes held, however long the request); every chunk boundary lands where
    /// it should.
    #[test]
    fn long_unaligned_direct_requests_bounce_in_chunks() {
        let (dir, v) = direct_volume(8 << 20, 512);
        let len = 3 * BOUNCE_CHUNK + BOUNCE_CHUNK / 2 + 512;
        let mut pat = vec![0u8; len + 1];
        for (i, b) in pat.iter_mut().enumerate() {
            *b = (i % 253) as u8 ^ (i >> 20) as u8;
        }
        v.write_at(4096, &pat[1..]).unwrap();
        let mut back = vec![0u8; len + 3];
        v.read_at(4096, &mut back[3..]).unwrap();
        assert!(back[3..] == pat[1..], "direct {}", v.is_direct());
        // And what reached the file is the data at its place (read around the volume).
        let raw = std::fs::read(dir.path().join("v.img")).unwrap();
        assert!(raw[4096..4096 + len] == pat[1..]);
        assert!(raw[..4096].iter().all(|&b| b == 0));
    }
}
