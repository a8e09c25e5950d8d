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
//! layout is shared with nacred's target, [`crate::frontend::nvmf_rdma::cm`]) → ESTABLISHED,
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

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nacre_shared::nvme::command::{PSDT_SGL, SQE_LEN};
use nacre_shared::nvme::fabrics::{Connect, ConnectData, CONNECT_DATA_LEN};
use nacre_shared::nvme::{admin_opcode, put_u32, put_u64, Completion as Cqe, SglDescriptor};
use rdma_sys::*;
use tracing::{debug, warn};

use super::cmd::{AdminWait, Cmd, Dir, Target};
use super::queue::{cid_of, FabricQueue, Queue, QueueOwner, QueueParams, MAX_DEPTH};
use super::{ControllerConfig, FabricError};
use crate::frontend::nvmf_rdma::cm::{self, CmRequest};

mod completion;
mod connect;
use crate::frontend::nvmf_rdma::verbs::{self, EventChannel, RawAddr, RegBuf};
use crate::telemetry::clock;
use crate::volume::{dma, IoError};
pub use connect::reject_name;
use connect::{event_name, no_rdma, wait_cm};

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

/// A protection domain shared by every queue the initiator opens on one RDMA device: memory
/// announced for zero copy is registered once per device (a guest's memory table once, not
/// once per queue), and the domain lives as long as a queue or a registration uses it.
struct Pd {
    pd: *mut ibv_pd,
    ctx: usize,
    /// Queues open on the domain; the last one to go drops the zero-copy registrations, so
    /// no guest memory stays pinned for a device nacred no longer talks to.
    queues: AtomicUsize,
    /// Regions registered in the domain (each holds its registration as an attachment).
    attached: Mutex<Vec<Weak<dma::Region>>>,
}

// SAFETY: an ibv_pd has no thread affinity; it is deallocated once, when the last reference
// (a queue's or a registration's) goes.
unsafe impl Send for Pd {}
// SAFETY: as above; shared references only pass the pointer to libibverbs calls that are
// thread-safe (registration, queue pair creation).
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: nothing is left on the domain: every queue pair and buffer registered in
        // it belonged to a queue or a registration holding this `Pd`, all gone now. The
        // device context stays open while librdmacm knows the device.
        unsafe { ibv_dealloc_pd(self.pd) };
    }
}

/// The domains in use, by device context.
static PDS: Mutex<Vec<(usize, Weak<Pd>)>> = Mutex::new(Vec::new());

impl Pd {
    /// The domain of device context `ctx` (allocated if no queue holds one), counted as used
    /// by one more queue.
    fn for_queue(ctx: *mut ibv_context) -> Result<Arc<Pd>, std::io::Error> {
        let mut pds = PDS.lock().unwrap_or_else(|p| p.into_inner());
        pds.retain(|(_, w)| w.strong_count() > 0);
        let pd = match pds
            .iter()
            .find_map(|(c, w)| (*c == ctx as usize).then(|| w.upgrade()))
        {
            Some(Some(pd)) => pd,
            _ => {
                // SAFETY: `ctx` is the open device context of a resolved CM id.
                let raw = unsafe { ibv_alloc_pd(ctx) };
                if raw.is_null() {
                    return Err(verbs::errno());
                }
                let pd = Arc::new(Pd {
                    pd: raw,
                    ctx: ctx as usize,
                    queues: AtomicUsize::new(0),
                    attached: Mutex::new(Vec::new()),
                });
                pds.push((pd.ctx, Arc::downgrade(&pd)));
                pd
            }
        };
        pd.queues.fetch_add(1, Ordering::AcqRel);
        Ok(pd)
    }

    /// A queue on the domain is gone; the last one drops the zero-copy registrations.
    fn queue_gone(&self) {
        if self.queues.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let key = self.pd as usize;
        let regions: Vec<_> = self
            .attached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for r in regions.iter().filter_map(Weak::upgrade) {
            r.detach(key);
        }
    }
}

/// A region announced in [`dma`], registered in a device's shared protection domain for the
/// controller's RDMA READ and WRITE (a [`dma::Region`] attachment keyed by that domain).
struct DirectMr {
    mr: *mut ibv_mr,
    /// Deallocated only after this registration is gone.
    _pd: Arc<Pd>,
}

// SAFETY: an ibv_mr is used by one thread at a time here (its keys are read, it is
// deregistered once, on drop); libibverbs objects carry no thread affinity.
unsafe impl Send for DirectMr {}
// SAFETY: as above; shared references only read the keys.
unsafe impl Sync for DirectMr {}

impl DirectMr {
    fn lkey(&self) -> u32 {
        // SAFETY: a registered memory region until this value drops.
        unsafe { (*self.mr).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for DirectMr {
    fn drop(&mut self) {
        // SAFETY: registered by `RdmaQueue::direct`, deregistered once, here; the queue
        // detaches its registrations (so they drop) before it deallocates their domain.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// What a command sent from or into announced memory holds until its response.
struct Direct {
    _region: Arc<dma::Region>,
    mr: Arc<DirectMr>,
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
    /// Bytes copied between requests and slot buffers (issue 11's bounce-copy count).
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

impl Drop for RdmaQueue {
    fn drop(&mut self) {
        // SAFETY: the last reference is gone: nothing polls or posts any more, and the
        // completion thread acknowledged every completion channel event.
        unsafe { verbs::destroy_queue_objects(self.id, self.cq, self.comp) };
        // Memory regions before their protection domain: what slots of commands handed
        // back when the queue died still hold, the queue's own buffers, and (if this was
        // the device's last queue) the zero-copy registrations of announced memory.
        for slot in &mut self
            .slots
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .entries
        {
            slot.direct = None;
        }
        self.recv = None;
        self.send = None;
        self.data.clear();
        if let Some(pd) = self.shared_pd.take() {
            pd.queue_gone();
        }
        // SAFETY: the id goes after every object made on its device context (the shared
        // domain may outlive it: librdmacm keeps the context open), and before its channel
        // (a field, dropped after this body).
        unsafe {
            if !self.id.is_null() {
                rdma_destroy_id(self.id);
            }
        }
    }
}

impl RdmaQueue {
    /// Set up the queue pair (module docs), start its completion thread and send Fabrics
    /// Connect. Returns the queue and the Connect completion (CNTLID in Dword 0 for the
    /// admin queue).
    pub fn open(
        cfg: &ControllerConfig,
        params: QueueParams,
        connect_data: &ConnectData,
        session: u64,
        owner: Weak<dyn QueueOwner>,
    ) -> Result<(Queue, Cqe), FabricError> {
        if verbs::device_count() == 0 {
            return Err(no_rdma(""));
        }
        let addr = cfg.socket_addr()?;
        let qid = params.qid;
        let deadline = Instant::now() + params.timeout;
        let step_ms = params.timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        let depth = params.depth.clamp(1, MAX_DEPTH - 1) as usize;
        let icd_max = if qid == 0 { 0 } else { params.icd_max };
        let ch = EventChannel::new().map_err(|e| no_rdma(&format!(" usable ({e})")))?;
        let mut q = RdmaQueue {
            qid,
            session,
            addr,
            ch,
            id: std::ptr::null_mut(),
            pd: std::ptr::null_mut(),
            comp: std::ptr::null_mut(),
            cq: std::ptr::null_mut(),
            recv: None,
            // HRQSIZE: responses we can take at once, one per SQ entry (HSQSIZE + 1).
            recv_n: depth + 1,
            send: None,
            capsule_len: SQE_LEN + icd_max,
            data: Vec::new(),
            icd_max,
            slots: Mutex::new(Slots {
                entries: Vec::new(),
                free: Vec::new(),
                overflow: VecDeque::new(),
                closed: false,
            }),
            owner,
            dead: AtomicBool::new(false),
            disconnected: AtomicBool::new(false),
            completed: AtomicU64::new(0),
            bounced_bytes: AtomicU64::new(0),
            in_capsule: AtomicU64::new(0),
            direct_bytes: AtomicU64::new(0),
            shared_pd: None,
            thread: Mutex::new(None),
        };
        let os = |what: &str, e: std::io::Error| {
            FabricError::Connect(format!("NVMe/RDMA queue {qid} to {addr}: {what}: {e}"))
        };
        // SAFETY: `ch` is a valid channel; on success the id is recorded in `q` at once, so
        // Drop destroys it.
        let rc = unsafe {
            rdma_create_id(
                q.ch.raw(),
                &mut q.id,
                std::ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        verbs::check(rc).map_err(|e| os("rdma_create_id", e))?;
        let mut dst = RawAddr::new(addr);
        // SAFETY: valid id; `dst` is a valid address for the call (librdmacm copies it).
        let rc =
            unsafe { rdma_resolve_addr(q.id, std::ptr::null_mut(), dst.as_mut_ptr(), step_ms) };
        verbs::check(rc).map_err(|e| os("rdma_resolve_addr", e))?;
        use rdma_cm_event_type::*;
        wait_cm(
            &q.ch,
            RDMA_CM_EVENT_ADDR_RESOLVED,
            deadline,
            addr,
            qid,
            "address resolution",
        )?;
        // SAFETY: valid id with a resolved address.
        let rc = unsafe { rdma_resolve_route(q.id, step_ms) };
        verbs::check(rc).map_err(|e| os("rdma_resolve_route", e))?;
        wait_cm(
            &q.ch,
            RDMA_CM_EVENT_ROUTE_RESOLVED,
            deadline,
            addr,
            qid,
            "route resolution",
        )?;
        q.create_resources(depth).map_err(|(w, e)| os(w, e))?;

        let req = CmRequest {
            recfmt: cm::RECFMT_1_0,
            qid,
            hrqsize: q.recv_n as u16,
            // HSQSIZE is 0's based like Connect's SQSIZE: one entry more than we put in
            // flight keeps a full SQ distinguishable from an empty one.
            hsqsize: depth as u16,
            cntlid: connect_data.cntlid,
        }
        .encode();
        // SAFETY: plain query on the id's device context into a zeroed structure.
        let max_resp = unsafe {
            let mut da: ibv_device_attr = std::mem::zeroed();
            if ibv_query_device((*q.id).verbs, &mut da) == 0 {
                da.max_qp_rd_atom
            } else {
                1
            }
        };
        // SAFETY: plain data; all-zero is valid.
        let mut p: rdma_conn_param = unsafe { std::mem::zeroed() };
        p.private_data = req.as_ptr() as *const _;
        p.private_data_len = req.len() as u8;
        // The controller reads our write data with RDMA READ; we issue none ourselves.
        p.responder_resources = max_resp.clamp(1, MAX_RESPONDER_RESOURCES) as u8;
        p.initiator_depth = 0;
        p.flow_control = 1;
        p.retry_count = 7;
        p.rnr_retry_count = 7;
        // SAFETY: the id has its queue pair; `req` outlives the call (librdmacm copies it).
        let rc = unsafe { rdma_connect(q.id, &mut p) };
        verbs::check(rc).map_err(|e| os("rdma_connect", e))?;
        let ev = wait_cm(
            &q.ch,
            RDMA_CM_EVENT_ESTABLISHED,
            deadline,
            addr,
            qid,
            "connect",
        )?;
        // RDMA_CM_ACCEPT (Figure 6): CRQSIZE, the capsules the controller can take at once;
        // never keep more than that in flight.
        let crqsize = (ev.private_data.len() >= 4)
            .then(|| u16::from_le_bytes([ev.private_data[2], ev.private_data[3]]) as usize)
            .filter(|&n| n > 0)
            .unwrap_or(depth);
        let usable = depth.min(crqsize);
        {
            let mut s = q.lock();
            s.entries = (0..depth)
                .map(|_| Slot {
                    gen: 0,
                    cmd: None,
                    issued_ns: clock::now_ns(),
                    sending: false,
                    answered: false,
                    direct: None,
                })
                .collect();
            s.free = (0..usable as u16).rev().collect();
        }
        debug!(qid, %addr, depth, crqsize, icd_max, "NVMe/RDMA queue established");

        let q = Arc::new(q);
        let qt = q.clone();
        let t = std::thread::Builder::new()
            .name(format!("nvmf-rdma-q{qid}"))
            .spawn(move || qt.run())
            .map_err(FabricError::io)?;
        *q.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);

        let sqe = Connect {
            recfmt: 0,
            qid,
            sqsize: depth as u16,
            cattr: 0,
            kato: params.kato_ms,
        }
        .to_command(0);
        let w = AdminWait::with_buf(connect_data.encode());
        if let Err(c) = q.submit(Cmd {
            sqe,
            dir: Dir::H2C,
            len: CONNECT_DATA_LEN,
            target: Target::Admin(w.clone()),
            release: true,
        }) {
            c.fail(IoError::PathLost);
        }
        // Fabrics Connect gets a bound of its own after the CM steps, as on TCP.
        let cqe = match w.wait_until(Instant::now() + params.timeout) {
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                q.shutdown();
                return Err(FabricError::Connect(format!("Connect qid {qid}: {e}")));
            }
            None => {
                q.shutdown();
                return Err(FabricError::Timeout(format!("Connect qid {qid}")));
            }
        };
        if !cqe.status().is_success() {
            q.shutdown();
            return Err(FabricError::Refused(format!(
                "controller refused Connect for queue {qid}: {}",
                cqe.status()
            )));
        }
        Ok((q, cqe))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Protection domain, completion channel and queue, queue pair, registered buffers, and
    /// the RECV ring posted (before connecting: the controller may answer at once).
    fn create_resources(&mut self, depth: usize) -> Result<(), (&'static str, std::io::Error)> {
        // SAFETY: the id has a resolved route, so `verbs` is its device context; each
        // object is recorded in `self` at once, so Drop frees it.
        unsafe {
            let ctx = (*self.id).verbs;
            let pd = Pd::for_queue(ctx).map_err(|e| ("ibv_alloc_pd", e))?;
            self.pd = pd.pd;
            self.shared_pd = Some(pd);
            self.comp = ibv_create_comp_channel(ctx);
            if self.comp.is_null() {
                return Err(("ibv_create_comp_channel", verbs::errno()));
            }
            let fd = (*self.comp).fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            // Every RECV and every (signaled) SEND.
            let cqe = (self.recv_n + depth + 16) as i32;
            self.cq = ibv_create_cq(ctx, cqe, std::ptr::null_mut(), self.comp, 0);
            if self.cq.is_null() {
                return Err(("ibv_create_cq", verbs::errno()));
            }
            let mut attr: ibv_qp_init_attr = std::mem::zeroed();
            attr.send_cq = self.cq;
            attr.recv_cq = self.cq;
            attr.qp_type = ibv_qp_type::IBV_QPT_RC;
            attr.cap.max_send_wr = (depth + 1) as u32;
            attr.cap.max_recv_wr = self.recv_n as u32;
            // The SQE, and in-capsule data sent straight from request memory.
            attr.cap.max_send_sge = 2;
            attr.cap.max_recv_sge = 1;
            if rdma_create_qp(self.id, self.pd, &mut attr) != 0 {
                return Err(("rdma_create_qp", verbs::errno()));
            }
        }
        let remote = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0 as i32;
        let reg = |e| ("registering buffers", e);
        self.recv = Some(RegBuf::new(self.pd, self.recv_n * RSP_LEN).map_err(reg)?);
        self.send = Some(RegBuf::new(self.pd, depth * self.capsule_len).map_err(reg)?);
        for _ in 0..depth {
            self.data
                .push(RegBuf::with_access(self.pd, MAX_TRANSFER, remote).map_err(reg)?);
        }
        for r in 0..self.recv_n {
            if !self.post_recv(r) {
                return Err(("ibv_post_recv", verbs::errno()));
            }
        }
        Ok(())
    }

    fn post_recv(&self, r: usize) -> bool {
        let b = self.recv.as_ref().expect("registered at setup");
        let mut sge = ibv_sge {
            addr: b.addr(r * RSP_LEN),
            length: RSP_LEN as u32,
            lkey: b.lkey(),
        };
        // SAFETY: ibv_recv_wr is plain data; all-zero is a valid empty request.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_RECV | r as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the queue pair exists for self's life; RECV buffer r belongs to the device
        // until its completion is polled; the request is copied by the provider.
        unsafe { ibv_post_recv((*self.id).qp, &mut wr, &mut bad) == 0 }
    }

    /// The data buffer of slot `s`.
    ///
    /// # Safety
    /// The caller holds slot `s` (a command is in it, or its response arrived and the caller
    /// is the completion thread) and the controller is not moving data for it at the same
    /// time: before the SEND is posted, or after its response arrived.
    #[allow(clippy::mut_from_ref)]
    unsafe fn data_buf(&self, s: usize, len: usize) -> &mut [u8] {
        let d = &self.data[s];
        debug_assert!(len <= MAX_TRANSFER);
        // SAFETY: in bounds (slot s's buffer is MAX_TRANSFER bytes); exclusive per the caller.
        unsafe { std::slice::from_raw_parts_mut(d.ptr, len) }
    }

    /// The address and registration under which the controller may move `cmd`'s data
    /// straight from or into the request's memory: when that data is one contiguous range
    /// inside memory a frontend announced ([`dma`]: a vhost-user-blk driver's memory table, an
    /// encrypted volume's ciphertext buffers). The region is registered in this queue's
    /// domain the first time, and stays registered while both live.
    fn direct(&self, cmd: &Cmd) -> Option<(u64, Direct)> {
        let ptr = cmd.contiguous_data()?;
        let region = dma::lookup(ptr, cmd.len)?;
        let shared = self.shared_pd.as_ref()?;
        let pd = shared.pd;
        let mr = region.attachment(pd as usize, || {
            let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ibv_access_flags::IBV_ACCESS_REMOTE_READ
                | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
                .0 as i32;
            // SAFETY: the region is mapped memory its announcer keeps mapped while it is
            // announced, and the registration is dropped (deregistered) with the region or
            // with this queue, whichever goes first.
            let mr = unsafe { ibv_reg_mr(pd, region.base().cast(), region.len(), access) };
            if mr.is_null() {
                debug!(qid = self.qid, len = region.len(), error = %verbs::errno(),
                    "cannot register announced memory: its I/O is copied");
                return None;
            }
            debug!(
                region = region.id(),
                len = region.len(),
                "zero copy: announced memory registered"
            );
            let mut attached = shared.attached.lock().unwrap_or_else(|p| p.into_inner());
            attached.retain(|w| w.strong_count() > 0);
            attached.push(Arc::downgrade(&region));
            Some(DirectMr {
                mr,
                _pd: shared.clone(),
            })
        })?;
        Some((
            ptr as u64,
            Direct {
                _region: region,
                mr,
            },
        ))
    }

    /// Put `cmd` in slot `idx` and post its capsule. On failure the command comes back.
    fn issue(&self, s: &mut Slots, idx: u16, mut cmd: Cmd) -> Result<(), Cmd> {
        let i = idx as usize;
        let slot = &mut s.entries[i];
        slot.gen = slot.gen.wrapping_add(1) & 0x3F;
        let cid = cid_of(idx, slot.gen);
        cmd.sqe.cid = cid;
        cmd.sqe.flags = (cmd.sqe.flags & !0xC0) | PSDT_SGL;
        let in_capsule = cmd.dir == Dir::H2C
            && cmd.len <= self.icd_max
            && cmd.sqe.opcode != admin_opcode::FABRICS;
        let send = self.send.as_ref().expect("registered at setup");
        // SAFETY: slot i's capsule is ours: the slot was free, so its previous SEND has
        // completed (a slot is freed only after that).
        let capsule = unsafe {
            std::slice::from_raw_parts_mut(send.ptr.add(i * self.capsule_len), self.capsule_len)
        };
        let direct = if cmd.len > 0 { self.direct(&cmd) } else { None };
        let mut sges = [ibv_sge {
            addr: send.addr(i * self.capsule_len),
            length: SQE_LEN as u32,
            lkey: send.lkey(),
        }; 2];
        let mut nsge = 1;
        if in_capsule {
            cmd.sqe.sgl = SglDescriptor::in_capsule(cmd.len as u32);
            cmd.sqe.encode(&mut capsule[..SQE_LEN]);
            match &direct {
                // The data follows the SQE in the same SEND, gathered from request memory.
                Some((addr, d)) => {
                    sges[1] = ibv_sge {
                        addr: *addr,
                        length: cmd.len as u32,
                        lkey: d.mr.lkey(),
                    };
                    nsge = 2;
                    self.direct_bytes
                        .fetch_add(cmd.len as u64, Ordering::Relaxed);
                }
                None => {
                    cmd.read_data(0, &mut capsule[SQE_LEN..SQE_LEN + cmd.len]);
                    sges[0].length += cmd.len as u32;
                    self.bounced_bytes
                        .fetch_add(cmd.len as u64, Ordering::Relaxed);
                }
            }
            self.in_capsule.fetch_add(1, Ordering::Relaxed);
        } else {
            cmd.sqe.encode(&mut capsule[..SQE_LEN]);
            // Keyed SGL Data Block (NVMe Base 2.0 Figure 119): address, 24-bit length, key,
            // identifier in byte 15. A command without data carries one of length 0 (what
            // Linux sends; nvmet-rdma refuses any other descriptor type as an invalid field).
            let (addr, key) = match &direct {
                Some((addr, d)) => {
                    self.direct_bytes
                        .fetch_add(cmd.len as u64, Ordering::Relaxed);
                    (*addr, d.mr.rkey())
                }
                None if cmd.len > 0 => {
                    let d = &self.data[i];
                    if cmd.dir == Dir::H2C {
                        // SAFETY: slot i is ours and its SEND is not posted yet.
                        let b = unsafe { self.data_buf(i, cmd.len) };
                        cmd.read_data(0, b);
                        self.bounced_bytes
                            .fetch_add(cmd.len as u64, Ordering::Relaxed);
                    }
                    (d.addr(0), d.rkey())
                }
                None => (0, 0),
            };
            capsule[24..40].copy_from_slice(&keyed_sgl(addr, cmd.len as u32, key));
        }
        // SAFETY: plain data; all-zero is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_SEND | i as u64;
        wr.sg_list = sges.as_mut_ptr();
        wr.num_sge = nsge;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        tracing::trace!(target: crate::telemetry::trace::TARGET, qid = self.qid,
            cid = format_args!("{cid:#06x}"), opcode = cmd.sqe.opcode, len = cmd.len,
            "fabric: RDMA command sent");
        let slot = &mut s.entries[i];
        slot.sending = true;
        slot.answered = false;
        slot.issued_ns = clock::now_ns();
        slot.direct = direct.map(|(_, d)| d);
        // SAFETY: the queue pair lives as long as self; the request and its SGE are copied
        // by the provider; the capsule and data buffer are the slot's until it is freed.
        let rc = unsafe { ibv_post_send((*self.id).qp, &mut wr, &mut bad) };
        if rc != 0 {
            slot.sending = false;
            slot.direct = None;
            s.free.push(idx);
            warn!(
                qid = self.qid,
                rc, "ibv_post_send failed: closing the NVMe/RDMA queue"
            );
            self.dead.store(true, Ordering::Release);
            return Err(cmd);
        }
        s.entries[i].cmd = Some(cmd);
        Ok(())
    }

    /// Release slot `i` if both its response and its own SEND completion are in (either
    /// may arrive first); otherwise nothing yet.
    fn release_when_done(&self, s: &mut Slots, i: usize) -> Vec<Cmd> {
        let e = &s.entries[i];
        if e.answered && !e.sending {
            self.release(s, i)
        } else {
            Vec::new()
        }
    }

    /// Slot `i` is done with (answered and its SEND completed): the next waiting command
    /// takes it, or it goes back on the free list.
    fn release(&self, s: &mut Slots, i: usize) -> Vec<Cmd> {
        let slot = &mut s.entries[i];
        slot.sending = false;
        slot.answered = false;
        let mut failed = Vec::new();
        if !s.closed {
            if let Some(c) = s.overflow.pop_front() {
                if let Err(c) = self.issue(s, i as u16, c) {
                    failed.push(c);
                }
                return failed;
            }
        }
        s.free.push(i as u16);
        failed
    }
}

/// A Keyed SGL Data Block descriptor, Address subtype (NVMe Base 2.0 §4.3.2, Figure 119):
/// bytes 0-7 address, 8-10 length (24 bits), 11-14 key, 15 the identifier (type 4h, subtype
/// 0h). `len` is below 2^24 ([`MAX_TRANSFER`] is 128 KiB).
fn keyed_sgl(addr: u64, len: u32, key: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    put_u64(&mut b, 0, addr);
    b[8..11].copy_from_slice(&len.to_le_bytes()[..3]);
    put_u32(&mut b, 11, key);
    b[15] = SGL_KEYED_DATA_BLOCK_ADDRESS;
    b
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

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn keyed_sgl_layout_matches_figure_119() {
        let b = keyed_sgl(0x1122_3344_5566_7788, 0x02_0000, 0xAABB_CCDD);
        assert_eq!(&b[..8], &[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]);
        assert_eq!(
            &b[8..11],
            &[0x00, 0x00, 0x02],
            "24-bit length, little-endian"
        );
        assert_eq!(&b[11..15], &[0xDD, 0xCC, 0xBB, 0xAA], "key");
        assert_eq!(
            b[15], 0x40,
            "type 4h (keyed data block), subtype 0h (address)"
        );
        // What a command without data carries (Linux's nvme_rdma_set_sg_null).
        assert_eq!(keyed_sgl(0, 0, 0), {
            let mut z = [0u8; 16];
            z[15] = 0x40;
            z
        });
    }

    #[test]
    fn without_an_rdma_device_opening_a_queue_says_so_in_one_line() {
        if verbs::device_count() > 0 {
            return; // a machine with RDMA: the test bed covers it
        }
        let cfg = ControllerConfig::new("192.0.2.1", 4420, "nqn.2024-01.io.nacre:x", "nqn.h");
        let params = QueueParams {
            qid: 0,
            depth: 31,
            digests: Default::default(),
            kato_ms: 0,
            icd_max: 0,
            timeout: Duration::from_millis(200),
        };
        let cd = ConnectData {
            hostid: [0; 16],
            cntlid: 0xFFFF,
            subnqn: "nqn.2024-01.io.nacre:x".into(),
            hostnqn: "nqn.h".into(),
        };
        struct O;
        impl QueueOwner for O {
            fn queue_closed(&self, _: u64, _: u16, _: String, _: Vec<Cmd>) {}
        }
        let o: Arc<dyn QueueOwner> = Arc::new(O);
        let e = RdmaQueue::open(&cfg, params, &cd, 1, Arc::downgrade(&o))
            .unwrap_err()
            .to_string();
        assert!(e.contains("NVMe/RDMA needs an RDMA device"), "{e}");
        assert!(!e.contains('\n'));
    }
}
