//! virtio-blk (virtio 1.2 §5.2) served over vhost-user.
//!
//! A [`VhostBlkServer`] owns one Unix socket and serves one client (a VM's vhost-user-blk
//! device, libblkio, ...) at a time. When the client goes away the server accepts the next
//! one on the same socket, so a VM can reconnect, and a restarted nacred serves again on the
//! socket path it had (the client reconnects, e.g. QEMU's chardev with `reconnect-ms`).
//!
//! Performance shape (see `scripts/bench-vhost`): one worker thread per queue; guest memory
//! reached through a flat region table ([`guest::GuestMap`]) rather than vm-memory's generic
//! accessors; no heap allocation per request; the used index written and the driver
//! interrupted once per batch (EVENT_IDX honoured); and, like QEMU's iothreads, an adaptive
//! busy-poll of the avail ring (at most 32 µs) after each batch, so a steady stream of
//! requests is served without kicks or wake-ups, except while 8 or more requests are in
//! flight on other threads (a remote volume), whose completions wake the worker anyway.
//! Setting `NACRE_VHOST_NO_POLL` in the environment turns the polling off (for A/B
//! measurements and CPU-starved hosts).
//!
//! Modules:
//! * [`spec`] — §5.2 constants, configuration space and segment layouts.
//! * [`guest`] — fast guest-address translation for the data path.
//! * [`request`] — one request from a descriptor chain (§5.2.6), validated.
//! * [`queue`] — one request queue: submission, completion, used ring, EVENT_IDX.
//! * [`backend`] — the vhost-user device: features, config space, vring events.

pub mod backend;
pub mod guest;
pub mod queue;
pub mod request;
pub mod spec;

#[cfg(test)]
mod tests;

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use thiserror::Error;
use tracing::{debug, info, warn};
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;

use crate::volume::BlockDevice;
use backend::BlkBackend;
use request::DeviceParams;

/// The largest queue the virtio split ring allows (§2.7: Queue Size ≤ 32768).
pub const MAX_QUEUE_SIZE: u16 = 32768;
/// The ring size `seg_max` is derived from: QEMU's default virtqueue size for
/// vhost-user-blk-pci, so every request fits a default ring even without indirect
/// descriptors (126 segments, 504 KiB of 4 KiB pages, per request).
pub const SEG_MAX_RING: u16 = 128;
/// One worker thread per queue, and vhost-user-backend's queue masks are 64 bits.
pub const MAX_QUEUES: u16 = 64;

/// How to serve a volume as a vhost-user-blk device.
#[derive(Debug, Clone)]
pub struct VhostBlkConfig {
    /// Unix socket path the client connects to.
    pub socket: PathBuf,
    /// Request queues (VIRTIO_BLK_F_MQ `num_queues`), 1..=64.
    pub queues: u16,
    /// Largest queue the driver may configure: a power of two, 2..=32768.
    pub queue_size: u16,
    /// Offer VIRTIO_BLK_F_RO and fail every write.
    pub read_only: bool,
    /// GET_ID answer: up to 20 ASCII bytes.
    pub serial: String,
}

#[derive(Debug, Error)]
pub enum VhostBlkError {
    #[error("invalid vhost-user-blk configuration: {0}")]
    InvalidConfig(String),
    #[error("socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("vhost-user: {0}")]
    Vhost(String),
}

impl From<VhostBlkError> for io::Error {
    fn from(e: VhostBlkError) -> Self {
        match e {
            VhostBlkError::Socket { source, .. } => source,
            other => io::Error::other(other.to_string()),
        }
    }
}

struct Shared {
    stopping: AtomicBool,
    connected: AtomicBool,
    /// Shuts down the current client connection; set while one is being served.
    shutdown: Mutex<Option<vhost_user_backend::ShutdownHandle>>,
}

/// A running vhost-user-blk device on one socket.
pub struct VhostBlkServer {
    socket: PathBuf,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// A duplicate of the listening socket's descriptor: `shutdown(2)` on it wakes the accept
    /// thread. Stopping must not depend on the socket path (it may be gone, or someone else's).
    wake: OwnedFd,
}

impl VhostBlkServer {
    /// Binds the socket (removing a stale one) and serves clients on background threads:
    /// one client at a time; when it disconnects, accept the next (so a VM/libblkio can
    /// reconnect, and a restarted nacred serves again).
    pub fn start(
        config: VhostBlkConfig,
        volume: Arc<dyn BlockDevice>,
    ) -> Result<Self, VhostBlkError> {
        let params = validate(&config, volume.as_ref())?;
        remove_stale_socket(&config.socket)?;
        let listener = Listener::new(&config.socket, true).map_err(|e| VhostBlkError::Socket {
            path: config.socket.clone(),
            source: io::Error::other(e.to_string()),
        })?;
        // SAFETY: the listener owns this descriptor and is alive for the whole borrow, which
        // only duplicates it.
        let wake = unsafe { BorrowedFd::borrow_raw(listener.as_raw_fd()) }
            .try_clone_to_owned()
            .map_err(|source| VhostBlkError::Socket {
                path: config.socket.clone(),
                source,
            })?;
        let shared = Arc::new(Shared {
            stopping: AtomicBool::new(false),
            connected: AtomicBool::new(false),
            shutdown: Mutex::new(None),
        });
        let socket = config.socket.clone();
        let thread = {
            let shared = shared.clone();
            let socket = socket.clone();
            std::thread::Builder::new()
                .name("vhost-blk-accept".into())
                .spawn(move || serve(listener, socket, config, params, volume, shared))
                .map_err(|e| VhostBlkError::Vhost(format!("cannot start server thread: {e}")))?
        };
        info!(socket = %socket.display(), "vhost-user-blk server listening");
        Ok(VhostBlkServer {
            socket,
            shared,
            thread: Some(thread),
            wake,
        })
    }

    pub fn is_connected(&self) -> bool {
        self.shared.connected.load(Ordering::Acquire)
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Stop serving (disconnect a client), join threads, remove the socket. Drop does the
    /// same.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        {
            let mut handle = self
                .shared
                .shutdown
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            self.shared.stopping.store(true, Ordering::Release);
            if let Some(h) = handle.take() {
                h.shutdown();
            }
        }
        // The accept thread may be blocked in accept(): shutting the listening socket down
        // makes accept() fail (EINVAL), and the thread sees `stopping`.
        // SAFETY: `wake` is an open descriptor this server owns; shutdown(2) touches no memory.
        unsafe { libc::shutdown(self.wake.as_raw_fd(), libc::SHUT_RDWR) };
        if thread.join().is_err() {
            warn!(socket = %self.socket.display(), "vhost-user-blk server thread panicked");
        }
        let _ = std::fs::remove_file(&self.socket);
        info!(socket = %self.socket.display(), "vhost-user-blk server stopped");
    }
}

impl Drop for VhostBlkServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

pub(crate) fn validate(
    config: &VhostBlkConfig,
    volume: &dyn BlockDevice,
) -> Result<DeviceParams, VhostBlkError> {
    let bad = |m: String| Err(VhostBlkError::InvalidConfig(m));
    if config.queues == 0 || config.queues > MAX_QUEUES {
        return bad(format!(
            "queues must be 1..={MAX_QUEUES}, not {}",
            config.queues
        ));
    }
    if config.queue_size < 2 || !config.queue_size.is_power_of_two() {
        return bad(format!(
            "queue_size must be a power of two in 2..={MAX_QUEUE_SIZE}, not {}",
            config.queue_size
        ));
    }
    let Some(serial) = queue::serial_bytes(&config.serial) else {
        return bad(format!(
            "serial must be at most {} ASCII bytes: {:?}",
            spec::ID_BYTES,
            config.serial
        ));
    };
    let bs = volume.geometry().block_size;
    if bs < 512 || !bs.is_power_of_two() {
        return bad(format!(
            "volume block size {bs} is not a power of two >= 512"
        ));
    }
    Ok(DeviceParams {
        read_only: config.read_only,
        // A chain holds the header, the data segments and the status. The driver, not us,
        // picks the ring size (QEMU's vhost-user-blk-pci defaults to 128), and a driver
        // without VIRTIO_RING_F_INDIRECT_DESC needs a ring slot per segment: Linux then
        // waits forever for room for a request longer than its ring. So the bound follows
        // the smallest ring we expect, not the largest we accept.
        seg_max: u32::from(config.queue_size.min(SEG_MAX_RING)) - 2,
        serial,
    })
}

/// Make way for the device's socket at `path` ([`crate::config::make_way_for_socket`]).
fn remove_stale_socket(path: &Path) -> Result<(), VhostBlkError> {
    crate::config::make_way_for_socket(path).map_err(|source| VhostBlkError::Socket {
        path: path.to_path_buf(),
        source,
    })
}

/// The accept loop: one daemon (and one fresh device) per client connection.
fn serve(
    mut listener: Listener,
    socket: PathBuf,
    config: VhostBlkConfig,
    params: DeviceParams,
    volume: Arc<dyn BlockDevice>,
    shared: Arc<Shared>,
) {
    while !shared.stopping.load(Ordering::Acquire) {
        if let Err(e) = serve_one(&mut listener, &config, &params, &volume, &shared) {
            if shared.stopping.load(Ordering::Acquire) {
                break;
            }
            warn!(socket = %socket.display(), error = %e, "vhost-user-blk connection ended with an error");
            // Do not spin if accept itself keeps failing.
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn serve_one(
    listener: &mut Listener,
    config: &VhostBlkConfig,
    params: &DeviceParams,
    volume: &Arc<dyn BlockDevice>,
    shared: &Shared,
) -> Result<(), VhostBlkError> {
    let vhost = |e: &dyn std::fmt::Display| VhostBlkError::Vhost(e.to_string());
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
    let backend = Arc::new(
        BlkBackend::new(
            volume.clone(),
            params.clone(),
            config.queues,
            config.queue_size,
            mem.clone(),
        )
        .map_err(|e| vhost(&e))?,
    );
    let mut daemon =
        VhostUserDaemon::new("vhost-blk".into(), backend.clone(), mem).map_err(|e| vhost(&e))?;
    for (q, handler) in daemon.get_epoll_handlers().iter().enumerate() {
        handler
            .register_listener(
                backend.completion_fd(q),
                EventSet::IN,
                backend.completion_event_id(),
            )
            .map_err(|e| vhost(&e))?;
    }
    daemon.start(listener).map_err(|e| vhost(&e))?;
    {
        let mut handle = shared.shutdown.lock().unwrap_or_else(|p| p.into_inner());
        if shared.stopping.load(Ordering::Acquire) {
            daemon.request_shutdown();
        } else {
            *handle = daemon.shutdown_handle();
            shared.connected.store(true, Ordering::Release);
            info!(socket = %config.socket.display(), "vhost-user-blk client connected");
        }
    }
    let result = daemon.wait();
    shared.connected.store(false, Ordering::Release);
    shared
        .shutdown
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    debug!(socket = %config.socket.display(), ?result, "vhost-user-blk client gone");
    // Dropping the daemon stops and joins the queue threads (exit events), then the
    // backend's queues wait for any request still inside the volume.
    drop(daemon);
    result.map_err(|e| vhost(&e))
}

#[cfg(test)]
mod stale_socket_test {
    use super::remove_stale_socket;
    use std::os::unix::net::{UnixDatagram, UnixListener};

    #[test]
    fn only_a_socket_nothing_listens_on_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        // Live: another program's listener keeps its socket.
        let live = dir.path().join("live.sock");
        let _l = UnixListener::bind(&live).unwrap();
        let e = remove_stale_socket(&live).unwrap_err().to_string();
        assert!(e.contains("listening"), "{e}");
        assert!(live.exists());
        // A datagram socket (journald's kind) is not ours to remove either.
        let dgram = dir.path().join("dgram.sock");
        let _d = UnixDatagram::bind(&dgram).unwrap();
        assert!(remove_stale_socket(&dgram).is_err());
        assert!(dgram.exists());
        // Stale: bound, then its listener gone (a nacred that crashed).
        let stale = dir.path().join("stale.sock");
        drop(UnixListener::bind(&stale).unwrap());
        remove_stale_socket(&stale).unwrap();
        assert!(!stale.exists());
        // Nothing there: nothing to do; a regular file: refused.
        remove_stale_socket(&stale).unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(remove_stale_socket(&file).is_err());
    }
}

#[cfg(test)]
mod seg_max_test {
    use super::*;
    use crate::volume::ram::RamVolume;

    /// A request with seg_max segments must fit QEMU's default 128-entry ring even when the
    /// driver does not use indirect descriptors (header + segments + status), whatever
    /// queue size we accept; otherwise Linux waits forever for ring space.
    #[test]
    fn seg_max_fits_a_default_qemu_ring() {
        let vol: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(1 << 20, 512).unwrap());
        for queue_size in [16u16, 128, 256, 1024, MAX_QUEUE_SIZE] {
            let cfg = VhostBlkConfig {
                socket: PathBuf::from("/unused.sock"),
                queues: 1,
                queue_size,
                read_only: false,
                serial: "s".into(),
            };
            let p = validate(&cfg, &*vol).unwrap();
            assert!(
                p.seg_max + 2 <= u32::from(queue_size.min(128)),
                "{queue_size}: {}",
                p.seg_max
            );
            assert!(p.seg_max >= 14, "{queue_size}: {}", p.seg_max);
        }
    }
}
