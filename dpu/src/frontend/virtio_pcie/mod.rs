//! A virtio-blk device as a PCI function, emulated over vfio-user: what a host's own
//! `virtio_pci` and `virtio_blk` drivers bind (virtio 1.2 §4.1, the PCI modern transport,
//! and §5.2, the block device), served to a vfio-user client (QEMU's `vfio-user-pci`) on a
//! Unix socket `DIR/cntrl`, as SPDK's `vfu_virtio` blk endpoints are.
//!
//! ```text
//!   client (QEMU vfio-user-pci) ── DIR/cntrl ── vfio_user::server: vfio-user messages
//!        │ guest memory by fd (DMA map)              │ region reads/writes, DMA map, IRQs
//!        │                                           ▼
//!        │                              function: the PCI function (identity 1AF4:1042,
//!        │                                BARs, MSI-X), BAR0 accesses ──► transport
//!        └── stores to the notify page ──► kick ──► queue thread
//!                                                     │
//!   transport: common configuration (features, device status, queue setup, MSI-X
//!              vectors), ISR, notification area, the capabilities that locate them
//!                                                     │
//!   vhost_user_blk::queue (the same virtqueue code as vhost-user-blk): descriptor
//!   chains → requests → crate::volume::BlockDevice, used ring, EVENT_IDX
//! ```
//!
//! Data moves between the volume and the guest's pages directly, as over vhost-user: the
//! queue code parses each chain against the DMA-mapped memory (a chain outside it ends
//! with IOERR, or is dropped without a status byte) and hands the volume the guest's
//! buffers. A hostile driver gets DEVICE_NEEDS_RESET for a queue it cannot have (a size
//! not a power of two or above the maximum, misaligned rings, rings outside the mapped
//! memory), features it was not offered refused at FEATURES_OK, and never a write outside
//! its memory.
//!
//! The seam to a BlueField: DOCA DevEmu (the device-emulation API) would replace [`crate::frontend::vfio_user`] and `function`'s regions (the PCI function, its
//! BARs, DMA and MSI-X come from the hardware's emulated function instead of a socket and
//! file descriptors, and notifications arrive as DevEmu doorbell events instead of region
//! writes); `transport`'s register logic and the virtqueue code stay, with guest memory
//! reached through DevEmu's DMA mappings.
//!
//! What it does today: one client at a time; notifications as vfio-user region writes
//! (BAR0 is not mmappable), so each kick is a socket round trip; one queue thread per
//! function; MSI-X only (no INTx); no VIRTIO_PCI_CAP_PCI_CFG window, packed rings, ring
//! reset or notification data.

mod function;
pub mod transport;

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use thiserror::Error;
use tracing::info;

use crate::frontend::nvme::lock;
use crate::frontend::vfio_user::{self, server};
use crate::frontend::vhost_user_blk::{VhostBlkConfig, VhostBlkError};
use crate::volume::BlockDevice;
pub use function::{device_features, VirtioBlkFunction, IDENTITY};

/// The socket's name in the function's directory (libvfio-user's and SPDK's).
pub const SOCKET_NAME: &str = "cntrl";
/// Request queues a function may have: each takes an MSI-X vector beside the
/// configuration vector, and a vfio-user message carries at most 64 eventfds.
pub const MAX_QUEUES: u16 = server::MAX_FDS as u16 - 1;

#[derive(Debug, Error)]
pub enum VirtioPcieError {
    #[error("invalid virtio-blk PCI function: {0}")]
    InvalidConfig(String),
    #[error("cannot serve vfio-user at {path}: {reason}")]
    Listen { path: PathBuf, reason: String },
}

/// How to serve a volume as a virtio-blk PCI function.
#[derive(Debug, Clone)]
pub struct VirtioBlkPciConfig {
    /// The directory the socket `cntrl` is created in (it must exist).
    pub dir: PathBuf,
    /// Request queues (VIRTIO_BLK_F_MQ `num_queues`), 1..=[`MAX_QUEUES`].
    pub queues: u16,
    /// Largest queue the driver may configure: a power of two, 2..=32768.
    pub queue_size: u16,
    /// Offer VIRTIO_BLK_F_RO and fail every write.
    pub read_only: bool,
    /// GET_ID answer: up to 20 ASCII bytes.
    pub serial: String,
}

/// A running virtio-blk PCI function on `DIR/cntrl`.
pub struct VirtioBlkPci {
    dev: Arc<VirtioBlkFunction>,
    /// A second descriptor of the listening socket: shut down to end the accept.
    sock: UnixListener,
    server: Option<JoinHandle<()>>,
    queues: Option<JoinHandle<()>>,
    socket_path: PathBuf,
}

impl VirtioBlkPci {
    /// Bind `dir/cntrl` (removing a stale socket) and serve clients one after the other.
    pub fn start(
        config: VirtioBlkPciConfig,
        volume: Arc<dyn BlockDevice>,
    ) -> Result<Self, VirtioPcieError> {
        if config.queues == 0 || config.queues > MAX_QUEUES {
            return Err(VirtioPcieError::InvalidConfig(format!(
                "queues must be 1..={MAX_QUEUES}, not {}",
                config.queues
            )));
        }
        let params = crate::frontend::vhost_user_blk::validate(
            &VhostBlkConfig {
                socket: config.dir.join(SOCKET_NAME),
                queues: config.queues,
                queue_size: config.queue_size,
                read_only: config.read_only,
                serial: config.serial.clone(),
            },
            volume.as_ref(),
        )
        .map_err(|e| match e {
            VhostBlkError::InvalidConfig(m) => VirtioPcieError::InvalidConfig(m),
            other => VirtioPcieError::InvalidConfig(other.to_string()),
        })?;
        let dir = &config.dir;
        let listen_err = |reason: String| VirtioPcieError::Listen {
            path: dir.to_path_buf(),
            reason,
        };
        if !dir.is_dir() {
            return Err(listen_err("no such directory".into()));
        }
        let path = dir.join(SOCKET_NAME);
        vfio_user::remove_stale_socket(&path).map_err(listen_err)?;
        let sock = UnixListener::bind(&path).map_err(|e| listen_err(e.to_string()))?;
        let sock2 = sock.try_clone().map_err(|e| listen_err(e.to_string()))?;
        let dev = VirtioBlkFunction::new(volume, params, config.queues, config.queue_size)
            .map_err(|e| listen_err(e.to_string()))?;
        let d = dev.clone();
        let server_thread = std::thread::Builder::new()
            .name("virtio-pci-vfu".into())
            .spawn(move || server::serve(sock, VirtioBlkFunction::regions(), d))
            .map_err(|e| listen_err(e.to_string()))?;
        let w = Arc::downgrade(&dev);
        let queues = std::thread::Builder::new()
            .name("virtio-pci-queues".into())
            .spawn(move || function::queue_thread(w))
            .map_err(|e| listen_err(e.to_string()))?;
        info!(path = %path.display(), "virtio-blk pci: vfio-user function listening");
        Ok(VirtioBlkPci {
            dev,
            sock: sock2,
            server: Some(server_thread),
            queues: Some(queues),
            socket_path: path,
        })
    }

    /// The socket's path (`DIR/cntrl`).
    pub fn socket(&self) -> &Path {
        &self.socket_path
    }

    /// A vfio-user client is connected.
    pub fn is_connected(&self) -> bool {
        lock(&self.dev.client).is_some()
    }

    /// Stop serving: a connected client is disconnected (to a guest, the device is gone),
    /// the queues stop and the socket is removed. Drop does the same.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(server_thread) = self.server.take() else {
            return;
        };
        self.dev.stop.store(true, Ordering::SeqCst);
        vfio_user::Function::reset(self.dev.as_ref());
        // SAFETY: shutdown(2) on a descriptor `self.sock` owns: a blocked accept() returns.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(c) = lock(&self.dev.client).take() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        let _ = std::fs::remove_file(&self.socket_path);
        if let Some(q) = self.queues.take() {
            let _ = q.join();
        }
        let _ = server_thread.join();
        info!(path = %self.socket_path.display(), "virtio-blk pci: vfio-user function stopped");
    }
}

impl Drop for VirtioBlkPci {
    fn drop(&mut self) {
        self.shutdown();
    }
}
