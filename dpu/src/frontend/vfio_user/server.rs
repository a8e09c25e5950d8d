//! The vfio-user server (vfio-user protocol 0.1: the messages QEMU's `vfio-user-pci` and
//! SPDK's NVMe driver send) for one emulated PCI function ([`Function`]): the regions the
//! client sees (each function's BARs, parts of them mmappable, and its configuration space),
//! the client's DMA maps as [`GuestMemoryMmap`] regions, its MSI-X or MSI eventfds, and the device
//! reset.
//!
//! Written here rather than with rust-vmm's `vfio_user` server (0.1.7): that server fails
//! SPDK's client at the first message (a Version without a capabilities string makes it
//! panic) and panics on some malformed messages. Every message is checked here before it
//! is used: a size outside what its command allows, an unknown command or a region access
//! out of range gets an error reply, and a header that cannot be trusted (a size below the
//! header's own, or above [`MAX_MSG`]) ends the connection; nothing panics. One client is
//! served at a time; a client that goes away leaves the function reset, with no memory and no interrupts.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use tracing::{debug, info, warn};
use vfio_bindings::bindings::vfio::*;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::{Function, REGION_CONFIG};
use crate::frontend::nvme::lock;

/// vfio-user's PCI interrupt indexes (`VFIO_PCI_*_IRQ_INDEX`).
const IRQ_INTX: u32 = 0;
const IRQ_ERR: u32 = 3;

/// The largest message accepted: a region write of one page plus headers is the largest a
/// client needs for this device.
pub const MAX_MSG: usize = 64 * 1024;
/// File descriptors one message may carry (DMA map: one; MSI-X: one per vector, and a
/// function has at most this many).
pub const MAX_FDS: usize = 64;

/// vfio-user message header (protocol §"Header"): id, command, size (with the header),
/// flags (type, no-reply, error), error.
const HEADER: usize = 16;
mod cmd {
    pub const VERSION: u16 = 1;
    pub const DMA_MAP: u16 = 2;
    pub const DMA_UNMAP: u16 = 3;
    pub const DEVICE_GET_INFO: u16 = 4;
    pub const DEVICE_GET_REGION_INFO: u16 = 5;
    pub const DEVICE_GET_IRQ_INFO: u16 = 7;
    pub const DEVICE_SET_IRQS: u16 = 8;
    pub const REGION_READ: u16 = 9;
    pub const REGION_WRITE: u16 = 10;
    pub const DEVICE_RESET: u16 = 13;
}
const FLAG_REPLY: u32 = 1;
const FLAG_NO_REPLY: u32 = 1 << 4;
const FLAG_ERROR: u32 = 1 << 5;
/// What the server offers in its Version reply.
/// QEMU's client caps max_msg_fds at 16 (it splits a larger MSI-X setup into several
/// messages).
const CAPABILITIES: &str = r#"{"capabilities":{"max_msg_fds":16,"max_data_xfer_size":65536}}"#;

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap_or_default())
}
fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap_or_default())
}

/// A message as read: header, payload, the descriptors it carried.
type Message = ([u8; HEADER], Vec<u8>, Vec<File>);

/// A reply: payload and the descriptor to pass with it, or an errno.
type Reply = Result<(Vec<u8>, Option<RawFd>), i32>;

struct Conn<'a, F: Function> {
    dev: &'a Arc<F>,
    regions: &'a [Region],
    stream: UnixStream,
}

/// One region as the client sees it.
#[derive(Clone)]
pub struct Region {
    pub flags: u32,
    pub size: u64,
    /// (offset, size) of the parts the client may mmap, and the descriptor to map.
    pub sparse: Vec<(u64, u64)>,
    pub fd: Option<RawFd>,
}

impl<F: Function> Conn<'_, F> {
    /// Read one message: its header, payload and descriptors. `Ok(None)`: the client closed.
    fn read_msg(&mut self) -> std::io::Result<Option<Message>> {
        let mut hdr = [0u8; HEADER];
        let mut fds = [-1; MAX_FDS];
        let mut iov = [libc::iovec {
            iov_base: hdr.as_mut_ptr() as *mut libc::c_void,
            iov_len: HEADER,
        }];
        // SAFETY: the iovec points at `hdr`, which outlives the call; `fds` has room for
        // MAX_FDS descriptors.
        let (n, nfds) = unsafe { self.stream.recv_with_fds(&mut iov, &mut fds) }
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        // SAFETY: the kernel just installed these descriptors for us; each is owned once.
        let files: Vec<File> = fds[..nfds]
            .iter()
            .map(|&fd| unsafe { File::from_raw_fd(fd) })
            .collect();
        if n == 0 {
            return Ok(None);
        }
        if n < HEADER {
            self.stream.read_exact(&mut hdr[n..])?;
        }
        let size = u32_at(&hdr, 4) as usize;
        if !(HEADER..=MAX_MSG).contains(&size) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("message size {size} outside {HEADER}..={MAX_MSG}"),
            ));
        }
        let mut payload = vec![0u8; size - HEADER];
        self.stream.read_exact(&mut payload)?;
        Ok(Some((hdr, payload, files)))
    }

    fn send(&mut self, hdr: &[u8; HEADER], reply: Reply) -> std::io::Result<()> {
        let mut out = [0u8; HEADER];
        out[0..4].copy_from_slice(&hdr[0..4]);
        let (payload, fd, flags, err) = match reply {
            Ok((p, fd)) => (p, fd, FLAG_REPLY, 0),
            Err(e) => (Vec::new(), None, FLAG_REPLY | FLAG_ERROR, e as u32),
        };
        out[4..8].copy_from_slice(&((HEADER + payload.len()) as u32).to_le_bytes());
        out[8..12].copy_from_slice(&flags.to_le_bytes());
        out[12..16].copy_from_slice(&err.to_le_bytes());
        // One send per reply: clients read a reply's fixed part with a single recvmsg.
        let mut msg = out.to_vec();
        msg.extend_from_slice(&payload);
        match fd {
            Some(fd) => {
                self.stream
                    .send_with_fd(&msg[..], fd)
                    .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
            }
            None => self.stream.write_all(&msg)?,
        }
        Ok(())
    }

    fn handle(&mut self, command: u16, p: &[u8], fds: Vec<File>) -> Reply {
        let need = |n: usize| {
            if p.len() < n {
                Err(libc::EINVAL)
            } else {
                Ok(())
            }
        };
        match command {
            cmd::VERSION => {
                // Major 0; the client's capabilities (an optional JSON string) are not
                // needed: nacre asks nothing of the client beyond the protocol's defaults.
                need(4)?;
                if u16_at(p, 0) != 0 {
                    return Err(libc::ENOTSUP);
                }
                // Minor 0: what QEMU's client accepts (it refuses a minor above its own, 0);
                // SPDK's asks for 0.1 and takes 0.0.
                let mut r = Vec::with_capacity(4 + CAPABILITIES.len() + 1);
                r.extend_from_slice(&0u16.to_le_bytes());
                r.extend_from_slice(&0u16.to_le_bytes());
                r.extend_from_slice(CAPABILITIES.as_bytes());
                r.push(0);
                Ok((r, None))
            }
            cmd::DMA_MAP => {
                need(32)?;
                let (offset, address, size) = (u64_at(p, 8), u64_at(p, 16), u64_at(p, 24));
                let Some(fd) = fds.into_iter().next() else {
                    // Memory not shared by descriptor (QEMU maps its ROMs and MMIO this way):
                    // nacre offers no DMA Read/Write messages, so the device never reaches it;
                    // a PRP that points there fails like any unmapped address.
                    debug!(
                        address,
                        size, "vfio-user: DMA map without a descriptor ignored"
                    );
                    return Ok((Vec::new(), None));
                };
                self.dma_map(fd, offset, address, size).map_err(|e| {
                    warn!("vfio-user: DMA map refused: {e}");
                    libc::EINVAL
                })?;
                Ok((Vec::new(), None))
            }
            cmd::DMA_UNMAP => {
                need(24)?;
                let (flags, address, size) = (u32_at(p, 4), u64_at(p, 8), u64_at(p, 16));
                self.dma_unmap(flags, address, size)?;
                Ok((p[..24].to_vec(), None))
            }
            cmd::DEVICE_GET_INFO => {
                need(16)?;
                let mut r = p[..16].to_vec();
                r[0..4].copy_from_slice(&16u32.to_le_bytes());
                r[4..8].copy_from_slice(
                    &(VFIO_DEVICE_FLAGS_PCI | VFIO_DEVICE_FLAGS_RESET).to_le_bytes(),
                );
                r[8..12].copy_from_slice(&VFIO_PCI_NUM_REGIONS.to_le_bytes());
                r[12..16].copy_from_slice(&VFIO_PCI_NUM_IRQS.to_le_bytes());
                Ok((r, None))
            }
            cmd::DEVICE_GET_REGION_INFO => {
                need(32)?;
                let argsz = u32_at(p, 0) as usize;
                let index = u32_at(p, 8);
                let r = self.regions.get(index as usize).ok_or(libc::EINVAL)?;
                let caps_len = if r.sparse.is_empty() {
                    0
                } else {
                    16 + 16 * r.sparse.len()
                };
                let full = 32 + caps_len;
                let mut info = vec![0u8; 32];
                let with_caps = caps_len > 0 && argsz >= full;
                let flags = r.flags
                    | if with_caps {
                        VFIO_REGION_INFO_FLAG_CAPS
                    } else {
                        0
                    };
                info[0..4].copy_from_slice(&(full as u32).to_le_bytes());
                info[4..8].copy_from_slice(&flags.to_le_bytes());
                info[8..12].copy_from_slice(&index.to_le_bytes());
                info[12..16].copy_from_slice(&(if with_caps { 32u32 } else { 0 }).to_le_bytes());
                info[16..24].copy_from_slice(&r.size.to_le_bytes());
                // offset: where the region starts in the descriptor (0).
                if with_caps {
                    info.extend_from_slice(
                        &(VFIO_REGION_INFO_CAP_SPARSE_MMAP as u16).to_le_bytes(),
                    );
                    info.extend_from_slice(&1u16.to_le_bytes());
                    info.extend_from_slice(&0u32.to_le_bytes());
                    info.extend_from_slice(&(r.sparse.len() as u32).to_le_bytes());
                    info.extend_from_slice(&0u32.to_le_bytes());
                    for &(off, len) in &r.sparse {
                        info.extend_from_slice(&off.to_le_bytes());
                        info.extend_from_slice(&len.to_le_bytes());
                    }
                }
                Ok((info, r.fd))
            }
            cmd::DEVICE_GET_IRQ_INFO => {
                need(16)?;
                let index = u32_at(p, 8);
                if index >= VFIO_PCI_NUM_IRQS {
                    return Err(libc::EINVAL);
                }
                // INTx and the error interrupt: one each (offered so that a client's error
                // recovery setup succeeds; nacre never raises either); the function's own kind
                // (MSI-X or MSI) its vectors; the other kind none.
                let irqs = self.dev.interrupts();
                let count = match index {
                    IRQ_INTX | IRQ_ERR => 1,
                    i if i == irqs.irq_index() => u32::from(irqs.vectors()),
                    _ => 0,
                };
                let mut r = p[..16].to_vec();
                r[0..4].copy_from_slice(&16u32.to_le_bytes());
                r[4..8].copy_from_slice(
                    &(VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_NORESIZE).to_le_bytes(),
                );
                r[12..16].copy_from_slice(&count.to_le_bytes());
                Ok((r, None))
            }
            cmd::DEVICE_SET_IRQS => {
                need(20)?;
                let (flags, index, start, count) =
                    (u32_at(p, 4), u32_at(p, 8), u32_at(p, 12), u32_at(p, 16));
                self.set_irqs(index, flags, start, count, fds)?;
                Ok((Vec::new(), None))
            }
            cmd::REGION_READ => {
                need(16)?;
                let (offset, region, count) = (u64_at(p, 0), u32_at(p, 8), u32_at(p, 12));
                self.check_access(region, offset, count)?;
                let mut r = p[..16].to_vec();
                let mut data = vec![0u8; count as usize];
                self.region_read(region, offset, &mut data);
                r.extend_from_slice(&data);
                Ok((r, None))
            }
            cmd::REGION_WRITE => {
                need(16)?;
                let (offset, region, count) = (u64_at(p, 0), u32_at(p, 8), u32_at(p, 12));
                self.check_access(region, offset, count)?;
                let data = p.get(16..16 + count as usize).ok_or(libc::EINVAL)?;
                self.region_write(region, offset, data);
                Ok((p[..16].to_vec(), None))
            }
            cmd::DEVICE_RESET => {
                self.dev.reset();
                Ok((Vec::new(), None))
            }
            _ => Err(libc::ENOSYS),
        }
    }

    /// A region access must lie inside the region and move at most one page.
    fn check_access(&self, region: u32, offset: u64, count: u32) -> Result<(), i32> {
        let r = self.regions.get(region as usize).ok_or(libc::EINVAL)?;
        let end = offset.checked_add(count as u64).ok_or(libc::EINVAL)?;
        if end > r.size || count > 4096 {
            return Err(libc::EINVAL);
        }
        Ok(())
    }

    fn region_read(&self, region: u32, offset: u64, data: &mut [u8]) {
        match region {
            REGION_CONFIG => self.dev.config_read(offset, data),
            _ => self.dev.region_read(region, offset, data),
        }
    }

    fn region_write(&self, region: u32, offset: u64, data: &[u8]) {
        match region {
            REGION_CONFIG => self.dev.config_write(offset, data),
            _ => F::region_write(self.dev, region, offset, data),
        }
    }

    fn dma_map(&self, fd: File, offset: u64, address: u64, size: u64) -> Result<(), String> {
        let size = usize::try_from(size).map_err(|_| "size".to_string())?;
        let mapping =
            MmapRegion::from_file(FileOffset::new(fd, offset), size).map_err(|e| e.to_string())?;
        let region = GuestRegionMmap::new(mapping, GuestAddress(address))
            .ok_or_else(|| "address range overflows".to_string())?;
        let mut mem = lock(self.dev.dma());
        let next = mem
            .insert_region(Arc::new(region))
            .map_err(|e| e.to_string())?;
        *mem = Arc::new(next);
        drop(mem);
        self.dev.dma_changed();
        Ok(())
    }

    fn dma_unmap(&self, flags: u32, address: u64, size: u64) -> Result<(), i32> {
        let mut mem = lock(self.dev.dma());
        if flags & VFIO_DMA_UNMAP_FLAG_ALL != 0 {
            *mem = Arc::new(GuestMemoryMmap::new());
        } else if let Ok((next, _)) = mem.remove_region(GuestAddress(address), size) {
            // Requests in flight keep the old map (and so the mapping) until they complete.
            // (An unmap of what was never mapped, a map without a descriptor, changes nothing.)
            *mem = Arc::new(next);
        }
        drop(mem);
        self.dev.dma_changed();
        Ok(())
    }

    fn set_irqs(
        &self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> Result<(), i32> {
        let kind = self.dev.interrupts();
        if index != kind.irq_index() {
            return Ok(());
        }
        let end = start
            .checked_add(count)
            .filter(|&e| e <= u32::from(kind.vectors()))
            .ok_or(libc::EINVAL)?;
        let mut irqs = lock(self.dev.irqs());
        irqs.resize_with(usize::from(kind.vectors()), || None);
        if flags & VFIO_IRQ_SET_DATA_EVENTFD != 0 {
            let mut fds = fds.into_iter();
            for v in start..end {
                irqs[v as usize] = fds.next();
            }
        } else if flags & VFIO_IRQ_SET_DATA_NONE != 0 && count == 0 {
            irqs.iter_mut().for_each(|f| *f = None);
        }
        Ok(())
    }

    fn run(&mut self) -> std::io::Result<()> {
        while let Some((hdr, payload, fds)) = self.read_msg()? {
            let command = u16_at(&hdr, 2);
            let flags = u32_at(&hdr, 8);
            let reply = self.handle(command, &payload, fds);
            if let Err(e) = &reply {
                debug!(command, errno = e, "vfio-user: vfio-user request refused");
            }
            if flags & FLAG_NO_REPLY == 0 {
                self.send(&hdr, reply)?;
            }
        }
        Ok(())
    }
}

/// One session of a client that sends `messages` (raw vfio-user bytes, headers and all) with
/// `memory` already DMA-mapped at guest address 0, for the fuzzers
/// (`nvme_pcie::fuzz_session`). The session runs as [`Conn::run`] does, on one end of a socket
/// pair, except that `poll` runs after each message (the function's queues polled as its
/// own thread would, at a point the input decides). No thread is spawned: the client's bytes (at
/// most [`FUZZ_MAX_STREAM`], which the socket's buffer holds) are written before the session
/// starts, and its replies are drained after each message.
#[cfg(feature = "fuzzing")]
pub fn fuzz_session<F: Function>(
    dev: &Arc<F>,
    regions: &[Region],
    memory: File,
    memory_len: u64,
    messages: &[u8],
    poll: &dyn Fn(),
) -> std::io::Result<()> {
    let (ours, mut theirs) = UnixStream::pair()?;
    theirs.write_all(&messages[..messages.len().min(FUZZ_MAX_STREAM)])?;
    theirs.shutdown(std::net::Shutdown::Write)?;
    theirs.set_nonblocking(true)?;
    let mut conn = Conn {
        dev,
        regions,
        stream: ours,
    };
    conn.dma_map(memory, 0, 0, memory_len)
        .map_err(std::io::Error::other)?;
    let mut sink = [0u8; 4096];
    while let Ok(Some((hdr, payload, fds))) = conn.read_msg() {
        let reply = conn.handle(u16_at(&hdr, 2), &payload, fds);
        if u32_at(&hdr, 8) & FLAG_NO_REPLY == 0 && conn.send(&hdr, reply).is_err() {
            break;
        }
        while matches!(theirs.read(&mut sink), Ok(n) if n > 0) {}
        poll();
    }
    detach(dev.as_ref());
    Ok(())
}

/// The most of a fuzz input's byte stream a session takes: well inside a Unix socket's send
/// buffer, so writing it before the session never blocks.
#[cfg(feature = "fuzzing")]
pub const FUZZ_MAX_STREAM: usize = 64 * 1024;

/// What a client leaves behind when it goes: a reset function with no memory and no
/// interrupts.
fn detach<F: Function>(dev: &F) {
    dev.reset();
    *lock(dev.dma()) = Arc::new(GuestMemoryMmap::new());
    dev.dma_changed();
    lock(dev.irqs()).clear();
}

/// Serve clients one after the other on `listener` until the function is stopping.
pub fn serve<F: Function>(listener: UnixListener, regions: Vec<Region>, dev: Arc<F>) {
    for stream in listener.incoming() {
        if dev.stopping() {
            return;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                warn!("vfio-user: vfio-user accept failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        info!("vfio-user: vfio-user client connected");
        *lock(dev.client()) = stream.try_clone().ok();
        // `stop` sets the flag, then takes the handle: one of the two sides sees the other.
        if dev.stopping() {
            return;
        }
        let mut conn = Conn {
            dev: &dev,
            regions: &regions,
            stream,
        };
        match conn.run() {
            Ok(()) => info!("vfio-user: vfio-user client disconnected"),
            Err(e) => warn!("vfio-user: vfio-user connection closed: {e}"),
        }
        // The client is gone: so is its view of the device.
        *lock(dev.client()) = None;
        detach(dev.as_ref());
        if dev.stopping() {
            return;
        }
    }
}
