//! An NVMe controller on PCIe, emulated over vfio-user: what a host's own `nvme` driver
//! binds (NVMe Base 2.0, memory-based transport), served to a vfio-user client (QEMU's
//! `vfio-user-pci`, SPDK's NVMe driver with `trtype:VFIOUSER`) on a Unix socket `DIR/cntrl`,
//! as SPDK's `vfiouser` transport does.
//!
//! ```text
//!   client (QEMU vfio-user-pci / SPDK) ── DIR/cntrl ── vfio_user::server: vfio-user messages
//!        │ guest memory by fd (DMA map)                   │ region access, DMA map, IRQs
//!        │ doorbell page by fd (sparse mmap of BAR0)      ▼
//!        │                                  ctrl: BAR0 registers, CC.EN/SHN, queue
//!        └──── stores to doorbells ───────► commands, I/O onto BlockDevice, MSI-X
//!                                                 │  poller thread reads the doorbells
//!              queue: SQ/CQ in guest memory ◄─────┤
//!              prp, sgl: PRP lists, SGLs → segments ◄─┘
//!              config: PCI configuration space and capabilities (on vfio_user::config)
//!              function: the controller as a vfio_user::Function (regions, DMA, IRQs, reset)
//!                                                 │
//!   frontend::nvme (the target core): the controller's admin commands, subsystems,
//!   namespaces, asynchronous events — the same as over NVMe/TCP and NVMe/RDMA
//! ```
//!
//! Data moves between the volume and the guest's pages directly: the PRP or SGL walk turns
//! the command's pages or data blocks into the request's segments (no bounce), each checked
//! against the mapped memory first. A hostile host gets NVMe error statuses (PRP or SGL
//! data outside mapped memory: Data Transfer Error; malformed PRPs: PRP Offset Invalid;
//! malformed SGLs: the SGL statuses of `sgl`; oversized transfers: Invalid Field) or, for a
//! doorbell value beyond its queue's size, Controller Fatal Status until it resets the
//! controller; never a write outside its mapping.
//!
//! The seam to a BlueField: DOCA DevEmu (the device-emulation API) would replace
//! [`crate::frontend::vfio_user`] (the server and the configuration space) and `function`
//! (the PCI function, BARs, DMA and MSI-X come from the hardware's emulated
//! function instead of a socket and file descriptors) and the doorbell page (DevEmu raises
//! doorbell events); `ctrl`, `queue`, `prp`, `sgl` and the target core stay, with guest memory
//! reached through DevEmu's DMA mappings instead of `vm-memory` regions.
//!
//! What it does today: one client at a time per controller; a poller thread per controller
//! (busy while there is work, pausing 4 µs between passes while the host leaves completions
//! unconsumed under nacred's `--nvmf-poll adaptive`, backing off to 1 ms sleeps when idle); interrupt coalescing
//! (Features 08h and 09h, `coalesce`), each vector raised at most once per poller pass;
//! shadow doorbells (Doorbell Buffer Config, `queue`); SGLs for I/O commands
//! (`sgl`), PRPs for admin commands; 4 KiB pages only (CAP.MPSMAX = 0).

mod coalesce;
mod config;
mod ctrl;
mod function;
mod prp;
mod queue;
mod sgl;

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use thiserror::Error;
use tracing::info;

use crate::frontend::nvme::{lock, NvmfError, TargetInner};
use crate::frontend::nvmf_tcp::{NvmfTarget, PollPolicy};
use crate::frontend::vfio_user::config::Interrupts;
use crate::frontend::vfio_user::server;
use ctrl::PcieController;
pub use ctrl::PollStats;
#[cfg(feature = "fuzzing")]
pub use server::FUZZ_MAX_STREAM;

/// The socket's name in the listener directory (SPDK's and libvfio-user's).
pub const SOCKET_NAME: &str = "cntrl";

/// How a controller's function signals its host: the operator's choice per listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Signals {
    /// MSI-X, a vector per queue ([`ctrl::MSIX_VECTORS`]): what every NVMe driver asks for
    /// first, and what SPDK's and a BlueField's functions have.
    #[default]
    Msix,
    /// MSI, up to [`ctrl::MSI_VECTORS`] vectors (Linux on x86 enables one without interrupt
    /// remapping, so every queue shares it). For a client that must be able to remove the
    /// function: QEMU 11.1.3's `device_del` of a `vfio-user-pci` function with MSI-X aborts
    /// QEMU, one without MSI-X it removes (docs/nvme-pcie.md).
    Msi,
}

impl Signals {
    fn config(self) -> Interrupts {
        match self {
            Signals::Msix => Interrupts::Msix(ctrl::MSIX_VECTORS),
            Signals::Msi => Interrupts::Msi(ctrl::MSI_VECTORS),
        }
    }
}

#[derive(Debug, Error)]
pub enum PcieError {
    #[error(transparent)]
    Nvmf(#[from] NvmfError),
    #[error("cannot serve vfio-user at {path}: {reason}")]
    Listen { path: PathBuf, reason: String },
    #[error("no vfio-user listener at {0} for this subsystem")]
    NoSuchListener(PathBuf),
}

struct Listener {
    nqn: String,
    dev: Arc<PcieController>,
    /// A second descriptor of the listening socket: shut down to end the accept.
    sock: UnixListener,
    server: Option<JoinHandle<()>>,
    poller: Option<JoinHandle<()>>,
    socket_path: PathBuf,
}

/// The vfio-user listeners of one [`NvmfTarget`]: each a PCIe NVMe controller of one
/// subsystem, served on `DIR/cntrl`.
pub struct VfioUserPorts {
    target: Weak<TargetInner>,
    /// The target's poll policy (nacred's `--nvmf-poll`), which the controllers' pollers
    /// follow too.
    poll: PollPolicy,
    listeners: Mutex<HashMap<PathBuf, Listener>>,
}

impl VfioUserPorts {
    pub fn new(target: &NvmfTarget) -> Arc<VfioUserPorts> {
        Arc::new(VfioUserPorts {
            target: Arc::downgrade(target.inner()),
            poll: target.poll_policy(),
            listeners: Mutex::new(HashMap::new()),
        })
    }

    /// Serve subsystem `nqn` as a PCIe NVMe controller on `dir/cntrl` (`dir` must exist),
    /// signalling its host with `interrupts` ([`Signals`]). Returns the socket's path.
    pub fn add_listener(
        &self,
        nqn: &str,
        dir: &Path,
        interrupts: Signals,
    ) -> Result<PathBuf, PcieError> {
        let listen_err = |reason: String| PcieError::Listen {
            path: dir.to_path_buf(),
            reason,
        };
        let target = self
            .target
            .upgrade()
            .ok_or_else(|| listen_err("the NVMe target is stopping".into()))?;
        let subsys = target.subsystem(nqn)?;
        let mut ls = lock(&self.listeners);
        if ls.contains_key(dir) {
            return Err(listen_err("a controller is already served there".into()));
        }
        if !dir.is_dir() {
            return Err(listen_err("no such directory".into()));
        }
        let path = dir.join(SOCKET_NAME);
        remove_stale_socket(&path).map_err(listen_err)?;
        let sock = UnixListener::bind(&path).map_err(|e| listen_err(e.to_string()))?;
        let sock2 = sock.try_clone().map_err(|e| listen_err(e.to_string()))?;
        let bar0 = Arc::new(function::bar0().map_err(|e| listen_err(e.to_string()))?);
        // SAFETY: the doorbell page lies in `bar0`'s mapping, which the controller holds.
        let dev = unsafe {
            PcieController::new(
                target.clone(),
                subsys,
                format!("nqn.2024-01.io.nacre:pcie:{}", dir.display()),
                function::doorbell_page(&bar0),
                bar0.clone(),
                interrupts.config(),
            )
        };
        let regions = function::regions(&bar0, interrupts.config());
        let d = dev.clone();
        let server_thread = std::thread::Builder::new()
            .name("nvme-pcie-vfu".into())
            .spawn(move || server::serve(sock, regions, d))
            .map_err(|e| listen_err(e.to_string()))?;
        let (w, policy) = (Arc::downgrade(&dev), self.poll);
        let poller = std::thread::Builder::new()
            .name("nvme-pcie-poll".into())
            .spawn(move || ctrl::poller(w, policy))
            .map_err(|e| listen_err(e.to_string()))?;
        info!(nqn, path = %path.display(), "nvme pcie: vfio-user controller listening");
        ls.insert(
            dir.to_path_buf(),
            Listener {
                nqn: nqn.to_string(),
                dev,
                sock: sock2,
                server: Some(server_thread),
                poller: Some(poller),
                socket_path: path.clone(),
            },
        );
        Ok(path)
    }

    /// Stop serving subsystem `nqn` at `dir`: a connected client is disconnected (to a guest,
    /// the device is gone) and the socket removed.
    pub fn remove_listener(&self, nqn: &str, dir: &Path) -> Result<(), PcieError> {
        let l = {
            let mut ls = lock(&self.listeners);
            match ls.get(dir) {
                Some(l) if l.nqn == nqn => ls.remove(dir),
                _ => None,
            }
        };
        let l = l.ok_or_else(|| PcieError::NoSuchListener(dir.to_path_buf()))?;
        stop(l);
        Ok(())
    }

    /// Stop every listener of subsystem `nqn` (it is being deleted).
    pub fn forget_subsystem(&self, nqn: &str) {
        let gone: Vec<Listener> = {
            let mut ls = lock(&self.listeners);
            let dirs: Vec<PathBuf> = ls
                .iter()
                .filter(|(_, l)| l.nqn == nqn)
                .map(|(d, _)| d.clone())
                .collect();
            dirs.iter().filter_map(|d| ls.remove(d)).collect()
        };
        for l in gone {
            stop(l);
        }
    }

    /// (subsystem NQN, listener directory, what its controller's poller did) of every
    /// listener, ordered by directory.
    pub fn poll_stats(&self) -> Vec<(String, PathBuf, PollStats)> {
        let mut v: Vec<_> = lock(&self.listeners)
            .iter()
            .map(|(d, l)| (l.nqn.clone(), d.clone(), l.dev.poll_counters.read()))
            .collect();
        v.sort_by(|a, b| a.1.cmp(&b.1));
        v
    }

    /// (subsystem NQN, listener directory) of every listener.
    pub fn listeners(&self) -> Vec<(String, PathBuf)> {
        lock(&self.listeners)
            .iter()
            .map(|(d, l)| (l.nqn.clone(), d.clone()))
            .collect()
    }
}

impl Drop for VfioUserPorts {
    fn drop(&mut self) {
        let ls: Vec<Listener> = lock(&self.listeners).drain().map(|(_, l)| l).collect();
        for l in ls {
            stop(l);
        }
    }
}

fn stop(mut l: Listener) {
    l.dev.stop.store(true, Ordering::SeqCst);
    l.dev.reset();
    // SAFETY: shutdown(2) on a descriptor `l.sock` owns: a blocked accept() returns.
    unsafe { libc::shutdown(l.sock.as_raw_fd(), libc::SHUT_RDWR) };
    // A connected client is disconnected: its server thread then ends.
    if let Some(c) = lock(&l.dev.client).take() {
        let _ = c.shutdown(std::net::Shutdown::Both);
    }
    let _ = std::fs::remove_file(&l.socket_path);
    if let Some(p) = l.poller.take() {
        let _ = p.join();
    }
    if let Some(s) = l.server.take() {
        let _ = s.join();
    }
    info!(nqn = l.nqn, path = %l.socket_path.display(), "nvme pcie: vfio-user listener stopped");
}

fn remove_stale_socket(path: &Path) -> Result<(), String> {
    crate::frontend::vfio_user::remove_stale_socket(path)
}

/// One session of a hostile vfio-user client against a fresh controller of subsystem `nqn`,
/// for the fuzzers (`crate::fuzzing::vfio_user`): `memory` is the client's guest memory,
/// DMA-mapped at guest address 0 from a memfd of its size (whole pages), and `messages` the
/// bytes the client sends on the socket. The controller serves them as it serves a real
/// client (the same message checks, register and doorbell handling, queues, PRP and SGL
/// walks and I/O), polling its queues after each message; its function signals with `signals`.
/// Returns the guest memory as the session left it.
#[cfg(feature = "fuzzing")]
pub fn fuzz_session(
    target: &NvmfTarget,
    nqn: &str,
    memory: &[u8],
    messages: &[u8],
    signals: Signals,
) -> std::io::Result<Vec<u8>> {
    use std::io::{Read, Seek, Write};
    let subsys = target
        .inner()
        .subsystem(nqn)
        .map_err(std::io::Error::other)?;
    let bar0 = Arc::new(function::bar0()?);
    // SAFETY: the doorbell page lies in `bar0`'s mapping, which the controller holds.
    let dev = unsafe {
        PcieController::new(
            target.inner().clone(),
            subsys,
            "nqn.2024-01.io.nacre:pcie:fuzz".into(),
            function::doorbell_page(&bar0),
            bar0.clone(),
            signals.config(),
        )
    };
    let regions = function::regions(&bar0, signals.config());
    let len = memory.len().div_ceil(4096).max(1) * 4096;
    // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
    let raw = unsafe { libc::memfd_create(c"nacre-fuzz-guest".as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new descriptor that nothing else owns.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    file.set_len(len as u64)?;
    file.write_all(memory)?;
    let poll = || {
        dev.poll();
    };
    server::fuzz_session(
        &dev,
        &regions,
        file.try_clone()?,
        len as u64,
        messages,
        &poll,
    )?;
    dev.stop.store(true, Ordering::SeqCst);
    let mut after = vec![0u8; len];
    file.rewind()?;
    file.read_exact(&mut after)?;
    Ok(after)
}
