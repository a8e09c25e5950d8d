//! Emulated PCI functions served over vfio-user: the part every function shares, whatever
//! device it is.
//!
//! ```text
//!   client (QEMU vfio-user-pci / SPDK) ── DIR/cntrl ── server: vfio-user messages
//!        │ guest memory by fd (DMA map)                 │ version, region info, DMA map,
//!        │ mmappable parts of a BAR by fd               │ IRQs (MSI-X or MSI eventfds), reset
//!        │                                              ▼
//!        └── region reads and writes ──────────► Function (a trait): its BARs, its config
//!                                                space, its reset; one per device model
//!                                                  ├── nvme_pcie: an NVMe controller
//!                                                  └── virtio_pcie: a virtio-blk device
//!   config: a PCI type 0 configuration space (PM, MSI-X or MSI, PCIe capabilities, and whatever
//!           a function adds, such as virtio's vendor-specific capabilities)
//! ```
//!
//! A function holds what the client gives it (the DMA-mapped memory, the interrupt eventfds,
//! the connected socket) in fields the server reaches through [`Function`]; the server
//! answers the messages, checks every access against the regions' sizes, and clears what a
//! client gave when it goes away.

pub mod config;
pub mod server;

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};

use tracing::warn;
use vm_memory::GuestMemoryMmap;

pub use server::Region;

/// vfio-user's PCI region indexes (`VFIO_PCI_*_REGION_INDEX`).
pub const REGION_BAR0: u32 = 0;
pub const REGION_BAR4: u32 = 4;
pub const REGION_BAR5: u32 = 5;
pub const REGION_CONFIG: u32 = 7;

/// One emulated PCI function, as the server reaches it.
pub trait Function: Send + Sync + 'static {
    /// A read of a BAR region (the server has checked it lies inside the region).
    fn region_read(&self, region: u32, offset: u64, data: &mut [u8]);
    /// A write to a BAR region (checked as for reads).
    fn region_write(this: &Arc<Self>, region: u32, offset: u64, data: &[u8]);
    /// A read of the configuration space.
    fn config_read(&self, offset: u64, data: &mut [u8]);
    /// A write to the configuration space.
    fn config_write(&self, offset: u64, data: &[u8]);
    /// How the function signals its host: MSI-X or MSI, and how many vectors (at most
    /// [`server::MAX_FDS`]).
    fn interrupts(&self) -> config::Interrupts;
    /// The memory the client mapped for DMA; replaced whole on each map and unmap.
    fn dma(&self) -> &Mutex<Arc<GuestMemoryMmap>>;
    /// [`Function::dma`] was replaced (for a function that keeps a copy of it).
    fn dma_changed(&self) {}
    /// Vector (MSI-X or MSI) → the client's eventfd.
    fn irqs(&self) -> &Mutex<Vec<Option<File>>>;
    /// A second handle on the connected client's socket (stopping shuts it down).
    fn client(&self) -> &Mutex<Option<UnixStream>>;
    /// The function is being removed: accept no further client.
    fn stopping(&self) -> bool;
    /// Device reset (vfio-user's, and when a client goes away).
    fn reset(&self);
}

/// Raise MSI-X vector `vector` through the client's eventfd, if it gave one.
pub fn signal(irqs: &Mutex<Vec<Option<File>>>, vector: u16) {
    use std::io::Write;
    if let Some(Some(mut f)) = crate::frontend::nvme::lock(irqs)
        .get(vector as usize)
        .map(|f| f.as_ref())
    {
        let _ = f.write_all(&1u64.to_ne_bytes());
    }
}

/// A BAR's backing memory shared with the client: a memfd that the client may mmap parts of
/// (a doorbell page), mapped here too.
pub struct SharedRegion {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; its users reach it through atomics or raw
// copies only.
unsafe impl Send for SharedRegion {}
// SAFETY: as above.
unsafe impl Sync for SharedRegion {}

impl SharedRegion {
    pub fn new(len: usize) -> std::io::Result<Self> {
        // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
        let raw = unsafe { libc::memfd_create(c"nacre-bar".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a new shared mapping of the whole memfd; checked for failure below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(SharedRegion {
            fd,
            ptr: ptr as *mut u8,
            len,
        })
    }

    /// The host address of byte `offset` (inside the mapping, or None).
    pub fn at(&self, offset: usize) -> Option<*mut u8> {
        // SAFETY: offset < len: inside the mapping.
        (offset < self.len).then(|| unsafe { self.ptr.add(offset) })
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `new`; whoever read it held this region, so
        // it is gone.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// A socket left behind by an earlier run (nobody accepts on it) is removed; anything else
/// at the path is an error.
pub fn remove_stale_socket(path: &Path) -> Result<(), String> {
    match std::fs::symlink_metadata(path) {
        Err(_) => Ok(()),
        Ok(m) => {
            use std::os::unix::fs::FileTypeExt;
            if !m.file_type().is_socket() {
                return Err(format!("{} exists and is not a socket", path.display()));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(format!("{} is in use", path.display()));
            }
            warn!(path = %path.display(), "vfio-user: removing a stale socket");
            std::fs::remove_file(path).map_err(|e| e.to_string())
        }
    }
}
