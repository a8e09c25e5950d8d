//! One NVMe/RDMA host queue (NVMe RDMA Transport Specification 1.0): a reliable-connected
//! queue pair set up with RDMA CM, carrying command capsules out as SENDs and response
//! capsules in to a ring of pre-posted RECV buffers, with command data moved by the
//! controller (RDMA READ of a host-to-controller transfer, RDMA WRITE of a
//! controller-to-host one) against a Keyed SGL Data Block, or carried in the capsule.
//!
//! ## Setting a queue up (§3.1)
//! `rdma_resolve_addr` → `rdma_resolve_route` → protection domain, completion queue with its
//! completion channel, queue pair, registered buffers, RECV ring posted → `rdma_connect`
//! with the RDMA_CM_REQUEST private data (RECFMT 0, QID, HRQSIZE, HSQSIZE, CNTLID: the
//! layout is shared with nacred's target, [`crate::rdma::cm`]) → ESTABLISHED,
//! or an RDMA_CM_REJECT whose private data carries the NVMe RDMA status, turned into an
//! error that names it. Every step is bounded by the controller's `connect_timeout`. Then
//! Fabrics Connect goes out as the first capsule, as on TCP.
//!
//! ## Capsules and data (§3.2, NVMe Base 2.0 §4.3.2)
//! Each slot of the queue (one command in flight) owns a send capsule (the 64-byte SQE and,
//! on I/O queues, up to the controller's IOCCSZ of in-capsule data) and a data buffer of
//! [`MAX_TRANSFER`] bytes in a memory region of its own, which the controller may read and
//! write remotely (its key opens that buffer only; keys are not invalidated per command,
//! so a stale key of a misbehaving controller still reaches the slot's buffer). A write that
//! fits the capsule travels in it (SGL Data Block, Offset subtype); any other transfer names
//! the slot's buffer with a Keyed SGL Data Block (type 4h, subtype 0h: address, 24-bit
//! length, 32-bit remote key).
//!
//! ## Zero copy
//! When a command's data is one contiguous range inside memory a frontend announced
//! ([`dma`]: a vhost-user-blk driver's memory table, an encrypted volume's ciphertext
//! buffers), the controller moves it straight from or into that memory: the region is
//! registered the first time a command uses it, in a protection domain every queue to the
//! same RDMA device shares (one registration per region and device, kept as the region's
//! attachment until the region is withdrawn or the device's last queue goes), the Keyed SGL names the request's own address under the
//! region's key, and a write small enough for the capsule is gathered from it by a second
//! SGE of the SEND. Anything else (data spread over several segments: Linux nvmet-rdma
//! takes one data descriptor per command, MSDBD 1; memory nobody announced) is copied
//! through the slot's buffer. Both are counted: `direct_bytes` and `bounce_copy_bytes`.
//!
//! The price of zero copy is trust: a region's key opens the whole region (a guest's
//! memory table) to the controller for as long as it is registered, as SPDK's initiator
//! does with its memory maps. Binding a memory window per command (type 2, invalidated at
//! the response) would narrow each key to its command's range; not done yet.
//!
//! ## Completions
//! One thread per queue polls the completion queue: for [`BUSY_POLL`] after the last work,
//! then it arms the completion channel and sleeps in `poll(2)` on it and on the queue's
//! CM event channel (a disconnect), waking at least every [`IDLE_WAKE_MS`] to notice a
//! shutdown. A response capsule completes its command (after copying read data out of the
//! slot's buffer: an RC queue pair delivers the controller's RDMA WRITEs before the SEND
//! that follows them); the slot is reused only once both its response has arrived and its
//! own SEND has completed, since until then the device may still read the capsule.
//!
//! ## Failure
//! A failed work request, a CM disconnect or [`FabricQueue::shutdown`] ends the queue: the
//! thread takes every outstanding command out of the slot table, under the lock submitters
//! use, and hands them to the owner. Nothing touches a command's memory after that (the
//! controller only ever sees the slot buffers), so the owner may resend them elsewhere —
//! keep-alive, reconnect, `ctrl_loss_timeout`, `fast_io_fail_timeout` and multipath are the
//! controller's, above [`super::queue`], the same as for TCP.
//!
//! ## Where it is
//! The queue, its slot table and its [`FabricQueue`] implementation are here; setting a
//! queue up and tearing it down in `setup.rs` (waiting for each RDMA CM step, and what its
//! failures mean, in `connect.rs`); issuing commands and posting work requests in `io.rs`;
//! the protection domain a device's queues share and the zero-copy registrations in
//! `pd.rs`; the completion thread in `completion.rs`.
//!
//! [`dma`]: crate::volume::dma

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdma_sys::*;

use super::cmd::Cmd;
use super::queue::{FabricQueue, QueueOwner};
use crate::rdma::verbs::{EventChannel, RegBuf};
use crate::telemetry::clock;
use crate::volume::IoError;
use pd::{Direct, Pd};

mod completion;
mod connect;
mod io;
mod pd;
mod setup;

pub use connect::reject_name;

/// The largest transfer of one command over NVMe/RDMA: the size of each slot's registered
/// buffer (the controller splits larger I/O). 128 KiB is what SPDK and Linux default to;
/// a queue of 128 pins 16 MiB.
pub const MAX_TRANSFER: usize = 128 << 10;
/// Bytes of a response capsule: the 16-byte CQE (IORCSZ 1; NVMe RDMA 1.0 §3.2).
const RSP_LEN: usize = 16;
/// How long the completion thread keeps polling after the last work before it sleeps on
/// the completion channel (the target's queues use the same bound).
const BUSY_POLL: Duration = Duration::from_micros(50);
/// An idle queue wakes this often to notice a shutdown: the bound on how long a dead
/// controller's queue thread lingers.
const IDLE_WAKE_MS: i32 = 50;
/// Completions taken per `ibv_poll_cq`.
const POLL_BATCH: usize = 32;
/// RDMA Reads we let the controller have in flight against us (our responder resources),
/// capped by the device.
const MAX_RESPONDER_RESOURCES: i32 = 16;
/// Keyed SGL Data Block, Address subtype (NVMe Base 2.0 Figure 119: type 4h, subtype 0h).
const SGL_KEYED_DATA_BLOCK_ADDRESS: u8 = 0x40;

// Work request ids: the kind in the high half, the RECV buffer or slot index in the low.
const WR_RECV: u64 = 1 << 32;
const WR_SEND: u64 = 2 << 32;

struct Slot {
    gen: u8,
    cmd: Option<Cmd>,
    /// When the command went out, on the batch clock (for the I/O timeout, which is
    /// seconds: a submitting vhost worker's batch instant is close enough and costs no
    /// clock read per command).
    issued_ns: u64,
    /// The capsule SEND is still in flight (its buffer is the device's).
    sending: bool,
    /// The response has arrived (the command is done with).
    answered: bool,
    /// The command's data is moved by the controller straight from or into the request's
    /// memory under this registration (held until the slot is reused or the queue goes).
    direct: Option<Direct>,
}

struct Slots {
    entries: Vec<Slot>,
    free: Vec<u16>,
    overflow: VecDeque<Cmd>,
    closed: bool,
}

/// One NVMe/RDMA queue. Verbs objects are freed in `Drop`, when the last reference (the
/// completion thread's, or the controller's) goes.
pub struct RdmaQueue {
    pub qid: u16,
    session: u64,
    addr: SocketAddr,
    ch: EventChannel,
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    comp: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    /// Response capsules: `recv_n` × 16 bytes.
    recv: Option<RegBuf>,
    recv_n: usize,
    /// Send capsules: one of `capsule_len` bytes per slot.
    send: Option<RegBuf>,
    capsule_len: usize,
    /// Data buffers: one of [`MAX_TRANSFER`] bytes per slot, remotely readable/writable, each
    /// its own memory region: a controller holds the key of the slot it was given, not of the
    /// others (a buggy or hostile target cannot write into another command's buffer).
    data: Vec<RegBuf>,
    /// Most write bytes sent in the capsule (0 on the admin queue).
    icd_max: usize,
    slots: Mutex<Slots>,
    owner: Weak<dyn QueueOwner>,
    dead: AtomicBool,
    disconnected: AtomicBool,
    /// Commands completed (observability).
    pub completed: AtomicU64,
    /// Bytes copied between requests and slot buffers (`remote_list`'s `bounce_copy_bytes`).
    pub bounced_bytes: AtomicU64,
    /// Writes sent inside their command capsule.
    pub in_capsule: AtomicU64,
    /// Bytes the controller moved straight from or into request memory (no copy).
    pub direct_bytes: AtomicU64,
    /// The device's shared protection domain (`pd` is its pointer).
    shared_pd: Option<Arc<Pd>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

// SAFETY: the raw verbs pointers are used under libibverbs' rules (posting and polling are
// thread-safe; objects are destroyed only in Drop, when no other reference exists). A slot's
// buffers are touched only by the holder of the slot (see `data_buf`).
unsafe impl Send for RdmaQueue {}
// SAFETY: as above.
unsafe impl Sync for RdmaQueue {}

impl std::fmt::Debug for RdmaQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaQueue")
            .field("qid", &self.qid)
            .field("session", &self.session)
            .field("addr", &self.addr)
            .finish()
    }
}

impl RdmaQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl FabricQueue for RdmaQueue {
    fn qid(&self) -> u16 {
        self.qid
    }

    fn submit(&self, cmd: Cmd) -> Result<(), Cmd> {
        if cmd.len > MAX_TRANSFER {
            // The controller splits I/O at MAX_TRANSFER (and admin transfers are smaller);
            // a command that is not is failed, not sent with a buffer too small for it.
            cmd.fail(IoError::Invalid(
                "transfer larger than the NVMe/RDMA slot buffer (rdma::MAX_TRANSFER)",
            ));
            return Ok(());
        }
        let mut s = self.lock();
        if s.closed || self.dead.load(Ordering::Acquire) {
            return Err(cmd);
        }
        match s.free.pop() {
            Some(idx) => self.issue(&mut s, idx, cmd),
            None => {
                s.overflow.push_back(cmd);
                Ok(())
            }
        }
    }

    fn oldest_outstanding(&self) -> Option<Duration> {
        let s = self.lock();
        s.entries
            .iter()
            .filter(|e| e.cmd.is_some())
            .map(|e| Duration::from_nanos(clock::read_ns().saturating_sub(e.issued_ns)))
            .max()
    }

    fn shutdown(&self) {
        self.dead.store(true, Ordering::Release);
        self.disconnect();
    }

    fn bounce_copy_bytes(&self) -> u64 {
        self.bounced_bytes.load(Ordering::Relaxed)
    }

    fn direct_bytes(&self) -> u64 {
        self.direct_bytes.load(Ordering::Relaxed)
    }

    fn join(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let t = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = t {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}
