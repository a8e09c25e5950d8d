//! A thin synchronous layer over libblkio's `virtio-blk-vhost-user` driver, the independent
//! vhost-user client nacre's vhost-user-blk tests and benchmark drive servers with.

use std::mem::MaybeUninit;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

pub const DRIVER: &str = "virtio-blk-vhost-user";

/// How to connect.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub queues: usize,
    /// Poll queues (libblkio busy-polls the used ring) instead of interrupt-driven ones.
    pub poll: bool,
    pub read_only: bool,
    /// libblkio's default (256) is small for QD128 at three descriptors per request.
    pub queue_size: i32,
    /// Bytes of client memory shared with the server (I/O buffers must live in it).
    pub mem_len: usize,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            queues: 1,
            poll: false,
            read_only: false,
            queue_size: 1024,
            mem_len: 16 << 20,
        }
    }
}

/// A connected, started libblkio instance with one shared memory region.
pub struct BlkioClient {
    // Queues before the instance: they must be dropped first.
    pub queues: Vec<Blkioq>,
    region: MemoryRegion,
    blkio: Blkio,
}

// SAFETY: the region's pointer is plain shared memory owned by the blkio instance, which
// moves with it.
unsafe impl Send for BlkioClient {}

fn err(e: blkio::Error) -> anyhow::Error {
    anyhow!("libblkio: {} (errno {})", e.message(), e.errno())
}

impl BlkioClient {
    pub fn connect(socket: &Path, opts: &ClientOptions) -> Result<Self> {
        let mut b = Blkio::new(DRIVER).map_err(err)?;
        b.set_str("path", socket.to_str().context("socket path is not UTF-8")?)
            .map_err(err)?;
        if opts.read_only {
            b.set_bool("read-only", true).map_err(err)?;
        }
        b.connect().map_err(err).context("connect")?;
        b.set_i32("queue-size", opts.queue_size).map_err(err)?;
        if opts.poll {
            b.set_i32("num-queues", 0).map_err(err)?;
            b.set_i32("num-poll-queues", opts.queues as i32)
                .map_err(err)?;
        } else {
            b.set_i32("num-queues", opts.queues as i32).map_err(err)?;
        }
        let started = b.start().map_err(err).context("start")?;
        let queues = if opts.poll {
            started.poll_queues
        } else {
            started.queues
        };
        let align = b.get_u64("mem-region-alignment").map_err(err)? as usize;
        let len = opts.mem_len.next_multiple_of(align.max(4096));
        let region = b.alloc_mem_region(len).map_err(err)?;
        b.map_mem_region(&region).map_err(err)?;
        Ok(BlkioClient {
            queues,
            region,
            blkio: b,
        })
    }

    pub fn capacity(&self) -> Result<u64> {
        self.blkio.get_u64("capacity").map_err(err)
    }

    pub fn get_i32(&self, name: &str) -> Result<i32> {
        self.blkio.get_i32(name).map_err(err)
    }

    pub fn get_u64(&self, name: &str) -> Result<u64> {
        self.blkio.get_u64(name).map_err(err)
    }

    /// The shared buffer.
    #[allow(clippy::mut_from_ref)]
    pub fn mem(&self) -> &mut [u8] {
        // SAFETY: the region is mapped read/write for `len` bytes for the client's lifetime;
        // callers serialise access to the parts they use for I/O.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, self.region.len) }
    }

    pub fn mem_ptr(&self) -> *mut u8 {
        self.region.addr as *mut u8
    }

    pub fn mem_len(&self) -> usize {
        self.region.len
    }

    /// Take the queues out (to drive them from several threads); the client must outlive
    /// them.
    pub fn take_queues(&mut self) -> Vec<Blkioq> {
        std::mem::take(&mut self.queues)
    }
}

impl Drop for BlkioClient {
    fn drop(&mut self) {
        self.queues.clear();
        self.blkio.unmap_mem_region(&self.region);
        self.blkio.free_mem_region(&self.region);
    }
}

/// One request's outcome: 0 or a negative errno (libblkio maps virtio IOERR to -EIO and
/// UNSUPP to -ENOTSUP).
pub fn wait_one(q: &mut Blkioq) -> Result<Completion> {
    let mut c = [MaybeUninit::<Completion>::uninit()];
    let n = q.do_io(&mut c, 1, None, None).map_err(err)?;
    if n != 1 {
        bail!("do_io returned {n} completions, wanted 1");
    }
    // SAFETY: do_io initialised the first n entries.
    Ok(unsafe { c[0].assume_init_read() })
}

/// The longest segment the helpers below put in one request: nacred's virtio-blk
/// `size_max` (a longer one fails with -EIO, as the spec lets a device do).
pub const SEGMENT: usize = 1 << 20;

/// `buf` as segments of at most [`SEGMENT`] bytes, as a guest's kernel splits a request.
fn iovecs(buf: *mut u8, len: usize) -> Vec<libc::iovec> {
    (0..len)
        .step_by(SEGMENT)
        .map(|at| libc::iovec {
            // SAFETY: `at < len`: inside the buffer.
            iov_base: unsafe { buf.add(at) }.cast(),
            iov_len: SEGMENT.min(len - at),
        })
        .collect()
}

/// Synchronous helpers over one queue; `buf` must lie inside the client's region.
pub fn read(q: &mut Blkioq, offset: u64, buf: &mut [u8]) -> Result<i32> {
    if buf.len() <= SEGMENT {
        q.read(offset, buf.as_mut_ptr(), buf.len(), 0, ReqFlags::empty());
        return Ok(wait_one(q)?.ret);
    }
    let iov = iovecs(buf.as_mut_ptr(), buf.len());
    q.readv(offset, iov.as_ptr(), iov.len() as u32, 0, ReqFlags::empty());
    Ok(wait_one(q)?.ret)
}

pub fn write(q: &mut Blkioq, offset: u64, buf: &[u8]) -> Result<i32> {
    if buf.len() <= SEGMENT {
        q.write(offset, buf.as_ptr(), buf.len(), 0, ReqFlags::empty());
        return Ok(wait_one(q)?.ret);
    }
    let iov = iovecs(buf.as_ptr().cast_mut(), buf.len());
    q.writev(offset, iov.as_ptr(), iov.len() as u32, 0, ReqFlags::empty());
    Ok(wait_one(q)?.ret)
}

pub fn flush(q: &mut Blkioq) -> Result<i32> {
    q.flush(0, ReqFlags::empty());
    Ok(wait_one(q)?.ret)
}

pub fn discard(q: &mut Blkioq, offset: u64, len: u64) -> Result<i32> {
    q.discard(offset, len, 0, ReqFlags::empty());
    Ok(wait_one(q)?.ret)
}

pub fn write_zeroes(q: &mut Blkioq, offset: u64, len: u64) -> Result<i32> {
    q.write_zeroes(offset, len, 0, ReqFlags::empty());
    Ok(wait_one(q)?.ret)
}
