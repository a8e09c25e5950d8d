//! One NVMe/RDMA queue (NVMe RDMA Transport 1.0 §3.2, Figure 8): a reliable-connected
//! queue pair carrying command capsules in RDMA SENDs to a ring of pre-posted RECV buffers,
//! responses back as SENDs, and command data by RDMA READ (host to controller) or RDMA
//! WRITE (controller to host) against the keyed SGL data block of the command
//! (Figure 10), or in the capsule (SGL Data Block, Offset subtype) up to IOCCSZ.
//!
//! Resources are per queue: a protection domain, a completion queue with its completion
//! channel, the queue pair, and three registered regions: the RECV ring (queue entries ×
//! (64 + in-capsule data)), the data buffers (one of MDTS bytes per slot) and the response
//! capsules (16 bytes per slot). A slot holds one command from its arrival until the SEND
//! of its response completes; the RECV buffer is re-posted as soon as the capsule is copied
//! into its slot, so the host's send credits never wait for the volume.
//!
//! Completion handling: the queue thread busy-polls its completion queue for
//! [`BUSY_POLL`] after the last work, then arms the completion channel and sleeps in
//! `poll(2)` on it and on the queue's CM event channel (disconnects), waking at least every
//! [`IDLE_WAKE_MS`] to notice a controller teardown.
//!
//! Life of the memory: every verbs object and buffer belongs to [`RdmaQueue`], freed when
//! its last reference goes: the queue thread's, or a volume's still running request (whose
//! completion then finds the queue pair closed and posts nothing). The queue pair is
//! destroyed before the buffers it may still access.

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nacre_shared::nvme::command::{sgl, SQE_LEN};
use nacre_shared::nvme::dsm::DatasetManagement;
use nacre_shared::nvme::fabrics::{connect_sqe_offset, fctype, Connect};
use nacre_shared::nvme::{admin_opcode, get_u32, get_u64, io_opcode, Command, Completion, Status};
use rdma_sys::*;
use tracing::{debug, warn};

use super::cm::{self, CmRequest};
use super::verbs::{self, EventChannel, RegBuf};
use crate::frontend::nvmf_tcp::ctrl::{AdminReply, CtrlQueue, TargetController};
use crate::frontend::nvmf_tcp::fabrics::{
    self, fabrics_connect, invalid_param, io_status, HostQueue, QueueRules,
};
use crate::frontend::nvmf_tcp::subsystem::{Namespace, Subsystem};
use crate::frontend::nvmf_tcp::{limits, lock, ConnSlot, TargetInner};
use crate::telemetry::{Arrival, VolumeMetrics};
use crate::volume::{self, IoKind, IoRequest, IoResult, Segment};

/// How long the queue thread keeps polling its completion queue after the last work before
/// it sleeps on the completion channel: long enough to catch the next command of a busy
/// host without a wake-up, short enough that an idle queue costs no CPU.
const BUSY_POLL: Duration = Duration::from_micros(50);
/// An idle queue wakes this often to notice a controller teardown (keep-alive expiry,
/// subsystem deletion): the bound on how long a dead controller's queue lingers.
const IDLE_WAKE_MS: i32 = 100;
/// Bytes of a RECV buffer: the 64-byte SQE and the in-capsule data IOCCSZ allows.
const RECV_LEN: usize = SQE_LEN + limits::IO_INLINE_DATA;
/// Bytes of a response capsule: the 16-byte CQE (IORCSZ 1).
const RSP_LEN: usize = 16;
/// Completions taken per `ibv_poll_cq`.
const POLL_BATCH: usize = 32;

// Work request ids: the kind in the high half, the RECV buffer or slot index in the low.
const WR_RECV: u64 = 1 << 32;
const WR_SEND: u64 = 2 << 32;
const WR_READ: u64 = 3 << 32;
const WR_WRITE: u64 = 4 << 32;

/// SGL descriptor type of a Keyed SGL Data Block (NVMe Base 2.0 Figure 119).
const SGL_TYPE_KEYED_DATA_BLOCK: u8 = 0x4;

/// A connect request the listener accepted the private data of; the queue thread owns the
/// CM id from here (an `Incoming` dropped unserved rejects and destroys it).
pub(super) struct Incoming {
    /// The queue's place in its listener's counts (taken by the queue when it is served).
    pub slot: Option<ConnSlot>,
    /// Set by the listener to evict the queue while it is still setting up.
    pub stop: Arc<AtomicBool>,
    pub id: *mut rdma_cm_id,
    pub req: CmRequest,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub rnr_retry_count: u8,
    pub listener: SocketAddr,
}

// SAFETY: the CM id is handed from the listener thread to the queue thread and used by
// one thread at a time; librdmacm ids carry no thread affinity.
unsafe impl Send for Incoming {}

impl Drop for Incoming {
    fn drop(&mut self) {
        if !self.id.is_null() {
            reject(self.id, cm::reject::NO_RESOURCES);
        }
    }
}

/// Reject a connect request with `status` in the RDMA_CM_REJECT private data, and destroy
/// its id (its CONNECT_REQUEST event is acknowledged already).
pub(super) fn reject(id: *mut rdma_cm_id, status: u16) {
    let pd = cm::encode_reject(status);
    // SAFETY: `id` is a connect request's id we own and destroy exactly once, here;
    // `pd` outlives the call (librdmacm copies the private data).
    unsafe {
        rdma_reject(id, pd.as_ptr() as *const _, pd.len() as u8);
        rdma_destroy_id(id);
    }
}

/// A keyed SGL data block: the host buffer a command's data moves to or from.
#[derive(Debug, Clone, Copy, Default)]
struct Keyed {
    addr: u64,
    len: u32,
    key: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum SlotState {
    #[default]
    Free,
    /// RDMA READ of the command's data in flight.
    Fetching,
    /// With the controller or the volume.
    Executing,
    /// An Asynchronous Event Request waiting for an event.
    Parked,
    /// Response SEND (and RDMA WRITE before it) in flight.
    Sending,
}

#[derive(Default)]
struct Slot {
    state: SlotState,
    cmd: Command,
    keyed: Option<Keyed>,
    /// Bytes of host data in the slot's buffer (fetched or in-capsule).
    data_len: usize,
    /// Bytes to RDMA WRITE to the host on success (reads).
    read_len: usize,
    stats: Option<(Arc<VolumeMetrics>, Arrival)>,
}

/// The queue's verbs objects and buffers, and the state completing threads share.
pub(super) struct RdmaQueue {
    /// The queue's own CM event channel (the id is migrated here from the listener's).
    ch: EventChannel,
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    comp: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    /// Whether the queue pair may still be posted to; held while posting, so teardown
    /// cannot race a completing thread's post.
    open: Mutex<bool>,
    recv: Option<RegBuf>,
    data: Option<RegBuf>,
    rsp: Option<RegBuf>,
    /// Capsules the RECV ring holds (CRQSIZE).
    entries: usize,
    slots: Box<[Mutex<Slot>]>,
    free: Mutex<Vec<u16>>,
    qid: AtomicU16,
    sqhd: AtomicU16,
    stop: Arc<AtomicBool>,
    last_rx_ms: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
}

// SAFETY: the raw verbs pointers are used under the rules libibverbs gives (posting and
// polling are thread-safe; objects are destroyed only in Drop, when no other reference
// exists). Slot buffers are reached only by the holder of the slot (see `buf`).
unsafe impl Send for RdmaQueue {}
// SAFETY: as above.
unsafe impl Sync for RdmaQueue {}

impl Drop for RdmaQueue {
    fn drop(&mut self) {
        // SAFETY: the last reference is gone: nothing polls or posts any more; the memory
        // regions and the protection domain follow below.
        unsafe { verbs::destroy_queue_objects(self.id, self.cq, self.comp) };
        // Memory regions before their protection domain.
        self.recv = None;
        self.data = None;
        self.rsp = None;
        // SAFETY: no memory region or queue pair is left on the domain; the id is destroyed
        // after every object made on its device context, then the channel (a field, dropped
        // after this body).
        unsafe {
            if !self.pd.is_null() {
                ibv_dealloc_pd(self.pd);
            }
            if !self.id.is_null() {
                rdma_destroy_id(self.id);
            }
        }
    }
}

impl RdmaQueue {
    /// The data buffer of slot `s`, `len` bytes.
    ///
    /// # Safety
    /// The caller holds slot `s` (it is not on the free list and no RDMA READ/WRITE on it is
    /// in flight), which makes it the only user of that buffer.
    #[allow(clippy::mut_from_ref)]
    unsafe fn buf(&self, s: usize, len: usize) -> &mut [u8] {
        let d = self.data.as_ref().expect("allocated before serving");
        debug_assert!(len <= limits::MAX_TRANSFER && s < self.slots.len());
        // SAFETY: in bounds (slot s's region is MAX_TRANSFER bytes); exclusive per the caller.
        unsafe { std::slice::from_raw_parts_mut(d.ptr.add(s * limits::MAX_TRANSFER), len) }
    }

    fn alloc_slot(&self) -> Option<usize> {
        lock(&self.free).pop().map(usize::from)
    }

    fn post_recv(&self, r: usize) -> bool {
        let b = self.recv.as_ref().expect("allocated");
        let mut sge = ibv_sge {
            addr: b.addr(r * RECV_LEN),
            length: RECV_LEN as u32,
            lkey: b.lkey(),
        };
        // SAFETY: ibv_recv_wr is plain data; all-zero is a valid empty request.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_RECV | r as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        let open = lock(&self.open);
        if !*open {
            return false;
        }
        // SAFETY: the queue pair is open (checked under the lock teardown takes); the RECV
        // buffer r belongs to the device until its completion is polled (it is not read
        // before); the request structures are copied by the provider during the call.
        unsafe { ibv_post_recv((*self.id).qp, &mut wr, &mut bad) == 0 }
    }

    /// Post RDMA READ of the host's data for slot `s` into its buffer.
    fn post_read(&self, s: usize, k: Keyed) -> bool {
        let d = self.data.as_ref().expect("allocated");
        let mut sge = ibv_sge {
            addr: d.addr(s * limits::MAX_TRANSFER),
            length: k.len,
            lkey: d.lkey(),
        };
        // SAFETY: ibv_send_wr is plain data (unions of plain data); zero is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_READ | s as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma = rdma_t {
            remote_addr: k.addr,
            rkey: k.key,
        };
        self.post_send_chain(&mut wr)
    }

    /// Post the response of slot `s` (its CQE already in the response buffer), preceded by an
    /// RDMA WRITE of `write` bytes of its buffer when `write > 0`. The queue pair executes
    /// them in order, so the data is in the host's memory before the response arrives.
    fn post_response(&self, s: usize, k: Option<Keyed>, write: usize) -> bool {
        let r = self.rsp.as_ref().expect("allocated");
        let d = self.data.as_ref().expect("allocated");
        let mut rsp_sge = ibv_sge {
            addr: r.addr(s * RSP_LEN),
            length: RSP_LEN as u32,
            lkey: r.lkey(),
        };
        // SAFETY: plain data, as in post_read.
        let mut send: ibv_send_wr = unsafe { std::mem::zeroed() };
        send.wr_id = WR_SEND | s as u64;
        send.sg_list = &mut rsp_sge;
        send.num_sge = 1;
        send.opcode = ibv_wr_opcode::IBV_WR_SEND;
        send.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut data_sge = ibv_sge {
            addr: d.addr(s * limits::MAX_TRANSFER),
            length: write as u32,
            lkey: d.lkey(),
        };
        // SAFETY: plain data.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        match k {
            Some(k) if write > 0 => {
                // Unsignaled: the signaled SEND after it completes only once it has.
                wr.wr_id = WR_WRITE | s as u64;
                wr.sg_list = &mut data_sge;
                wr.num_sge = 1;
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                wr.wr.rdma = rdma_t {
                    remote_addr: k.addr,
                    rkey: k.key,
                };
                wr.next = &mut send;
                self.post_send_chain(&mut wr)
            }
            _ => self.post_send_chain(&mut send),
        }
    }

    fn post_send_chain(&self, wr: &mut ibv_send_wr) -> bool {
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        let open = lock(&self.open);
        if !*open {
            return false;
        }
        // SAFETY: the queue pair is open (teardown takes this lock to close it); the work
        // requests and their SGEs live on the caller's stack for the call (the provider
        // copies them); the buffers they name belong to the slot, which stays off the free
        // list until the signaled completion of this chain is polled.
        let rc = unsafe { ibv_post_send((*self.id).qp, wr, &mut bad) };
        if rc != 0 {
            warn!(rc, "ibv_post_send failed: closing the NVMe/RDMA queue");
            drop(open);
            self.stop.store(true, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Complete the command in slot `s`: its CQE, and `read_len` bytes of its buffer for the
    /// host first when the command succeeded.
    fn respond(&self, s: usize, status: Status, dw0: u32, dw1: u32, read_len: usize) {
        let (cid, keyed) = {
            let mut sl = lock(&self.slots[s]);
            sl.state = SlotState::Sending;
            (sl.cmd.cid, sl.keyed)
        };
        let cqe = Completion {
            dw0,
            dw1,
            sqhd: self.sqhd.load(Ordering::Relaxed),
            sqid: self.qid.load(Ordering::Relaxed),
            cid,
            status: status.to_field(),
        };
        let r = self.rsp.as_ref().expect("allocated");
        // SAFETY: slot s's 16 response bytes belong to its holder (us) until the SEND
        // posted below completes.
        let b = unsafe { std::slice::from_raw_parts_mut(r.ptr.add(s * RSP_LEN), RSP_LEN) };
        cqe.encode(b);
        let write = if status.is_success() { read_len } else { 0 };
        if !self.post_response(s, keyed, write) {
            // Closed: nothing will complete this slot; the queue is going away.
            debug!(cid, "response not sent: the queue is closed");
        }
    }

    fn release_slot(&self, s: usize) {
        *lock(&self.slots[s]) = Slot::default();
        lock(&self.free).push(s as u16);
    }
}

impl CtrlQueue for RdmaQueue {
    fn last_rx_ms(&self) -> u64 {
        self.last_rx_ms.load(Ordering::Relaxed)
    }
    fn stats(&self) -> (u64, u64, u64, u64) {
        (
            self.reads.load(Ordering::Relaxed),
            self.writes.load(Ordering::Relaxed),
            self.read_bytes.load(Ordering::Relaxed),
            self.write_bytes.load(Ordering::Relaxed),
        )
    }
    fn shutdown(&self) {
        // The queue thread sees it within IDLE_WAKE_MS and disconnects.
        self.stop.store(true, Ordering::SeqCst);
    }
    fn keyed_sgls(&self) -> bool {
        true
    }
    fn complete_async(&self, cid: u16, status: Status, dw0: u32) {
        let parked = (0..self.slots.len()).find(|&s| {
            let sl = lock(&self.slots[s]);
            sl.state == SlotState::Parked && sl.cmd.cid == cid
        });
        if let Some(s) = parked {
            self.respond(s, status, dw0, 0, 0);
        }
    }
}

impl volume::IoCompletion for RdmaQueue {
    fn complete(&self, tag: u64, result: IoResult) {
        let s = tag as usize;
        if s >= self.slots.len() {
            return;
        }
        let read_len = {
            let mut sl = lock(&self.slots[s]);
            let status_ok = result.is_ok();
            if let Some((m, a)) = sl.stats.take() {
                m.complete(&a, !status_ok);
            }
            sl.read_len
        };
        let status = match &result {
            Ok(()) => Status::SUCCESS,
            Err(e) => io_status(e, read_len > 0),
        };
        self.respond(s, status, 0, 0, read_len);
    }
}

/// Create the queue's resources, post its RECV ring and accept the connection.
fn setup(inc: &mut Incoming) -> Result<Arc<RdmaQueue>, (u16, String)> {
    let no_rsc = |what: &str, e: std::io::Error| (cm::reject::NO_RESOURCES, format!("{what}: {e}"));
    let ch = EventChannel::new().map_err(|e| no_rsc("event channel", e))?;
    // SAFETY: the id is ours (its CONNECT_REQUEST event was acknowledged, which
    // rdma_migrate_id waits for); from here its events arrive on `ch`.
    let rc = unsafe { rdma_migrate_id(inc.id, ch.raw()) };
    verbs::check(rc).map_err(|e| no_rsc("rdma_migrate_id", e))?;
    let entries = inc.req.entries() as usize;
    let nslots = entries;
    let mut q = RdmaQueue {
        ch,
        id: std::mem::replace(&mut inc.id, std::ptr::null_mut()),
        pd: std::ptr::null_mut(),
        comp: std::ptr::null_mut(),
        cq: std::ptr::null_mut(),
        open: Mutex::new(false),
        recv: None,
        data: None,
        rsp: None,
        entries,
        slots: (0..nslots).map(|_| Mutex::default()).collect(),
        free: Mutex::new((0..nslots as u16).rev().collect()),
        qid: AtomicU16::new(inc.req.qid),
        sqhd: AtomicU16::new(0),
        stop: inc.stop.clone(),
        last_rx_ms: AtomicU64::new(0),
        reads: AtomicU64::new(0),
        writes: AtomicU64::new(0),
        read_bytes: AtomicU64::new(0),
        write_bytes: AtomicU64::new(0),
    };
    // From here on a failure drops `q`, which frees what was made; the id goes with it, so
    // the reject is sent here first.
    let fail = |q: RdmaQueue, what: &str, e: std::io::Error| {
        let pd = cm::encode_reject(cm::reject::NO_RESOURCES);
        // SAFETY: the id is valid until `q` drops below; librdmacm copies the private data.
        unsafe { rdma_reject(q.id, pd.as_ptr() as *const _, pd.len() as u8) };
        drop(q);
        (0, format!("{what}: {e}"))
    };
    // SAFETY: `verbs` is the device context of the connect request's id.
    let ctx = unsafe { (*q.id).verbs };
    // SAFETY: plain verbs object creation on a valid context; each object is recorded in
    // `q` at once, so Drop frees it.
    unsafe {
        q.pd = ibv_alloc_pd(ctx);
        if q.pd.is_null() {
            return Err(fail(q, "ibv_alloc_pd", verbs::errno()));
        }
        q.comp = ibv_create_comp_channel(ctx);
        if q.comp.is_null() {
            return Err(fail(q, "ibv_create_comp_channel", verbs::errno()));
        }
        let fd = (*q.comp).fd;
        let fl = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        // Every RECV, and per slot a READ or a WRITE + SEND.
        let cqe = (entries + 2 * nslots + 16) as i32;
        q.cq = ibv_create_cq(ctx, cqe, std::ptr::null_mut(), q.comp, 0);
        if q.cq.is_null() {
            return Err(fail(q, "ibv_create_cq", verbs::errno()));
        }
        let mut attr: ibv_qp_init_attr = std::mem::zeroed();
        attr.send_cq = q.cq;
        attr.recv_cq = q.cq;
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        attr.cap.max_send_wr = (2 * nslots + 1) as u32;
        attr.cap.max_recv_wr = entries as u32;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        if rdma_create_qp(q.id, q.pd, &mut attr) != 0 {
            return Err(fail(q, "rdma_create_qp", verbs::errno()));
        }
    }
    for (field, len) in [
        (0, entries * RECV_LEN),
        (1, nslots * limits::MAX_TRANSFER),
        (2, nslots * RSP_LEN),
    ] {
        match RegBuf::new(q.pd, len) {
            Ok(b) => match field {
                0 => q.recv = Some(b),
                1 => q.data = Some(b),
                _ => q.rsp = Some(b),
            },
            Err(e) => return Err(fail(q, "registering buffers", e)),
        }
    }
    *lock(&q.open) = true;
    for r in 0..entries {
        if !q.post_recv(r) {
            return Err(fail(q, "ibv_post_recv", verbs::errno()));
        }
    }
    // RDMA Read depth: we issue Reads to the host (host writes) up to what it accepts (its
    // responder resources) and our device allows; the host issues none to us.
    // SAFETY: plain query on a valid context into a zeroed attribute structure.
    let (max_init, max_resp) = unsafe {
        let mut da: ibv_device_attr = std::mem::zeroed();
        if ibv_query_device(ctx, &mut da) == 0 {
            (da.max_qp_init_rd_atom, da.max_qp_rd_atom)
        } else {
            (1, 1)
        }
    };
    let accept = cm::encode_accept(entries as u16);
    // SAFETY: plain data; all-zero is valid.
    let mut p: rdma_conn_param = unsafe { std::mem::zeroed() };
    p.private_data = accept.as_ptr() as *const _;
    p.private_data_len = accept.len() as u8;
    p.initiator_depth = (inc.responder_resources as i32).min(max_init).max(1) as u8;
    p.responder_resources = (inc.initiator_depth as i32).min(max_resp) as u8;
    p.flow_control = 1;
    p.retry_count = 7;
    // NVMe RDMA Transport §3.1.4: match the host's RNR retry count.
    p.rnr_retry_count = inc.rnr_retry_count;
    // SAFETY: the id has its queue pair; `accept` outlives the call.
    let rc = unsafe { rdma_accept(q.id, &mut p) };
    if rc != 0 {
        return Err(fail(q, "rdma_accept", verbs::errno()));
    }
    Ok(Arc::new(q))
}

/// Why a queue stops.
enum End {
    /// The host disconnected, the controller was torn down, or the queue pair failed.
    Closed,
}

/// Serve one connection until it ends.
pub(super) fn serve(target: Arc<TargetInner>, mut inc: Incoming) {
    let req = inc.req;
    // SAFETY: the id is valid; its local address is part of the id structure.
    let local_ip = unsafe {
        let sa = &(*inc.id).route.addr.src_addr_union.src_addr as *const libc::sockaddr;
        verbs::ip_of(sa)
    }
    .unwrap_or(inc.listener.ip());
    let q = match setup(&mut inc) {
        Ok(q) => q,
        Err((status, why)) => {
            warn!(listener = %inc.listener, qid = req.qid, "NVMe/RDMA queue setup failed: {why}");
            if status != 0 && !inc.id.is_null() {
                reject(std::mem::replace(&mut inc.id, std::ptr::null_mut()), status);
            }
            return;
        }
    };
    q.last_rx_ms.store(target.clock.now_ms(), Ordering::Relaxed);
    debug!(listener = %inc.listener, qid = req.qid, entries = q.entries, "NVMe/RDMA queue accepted");
    let mut c = Conn {
        done: q.clone(),
        q: q.clone(),
        target,
        req,
        listener: inc.listener,
        local_ip,
        ctrl: None,
        subsys: None,
        host_counted: None,
        ns_gen: 0,
        ns: BTreeMap::new(),
        head: 0,
        backlog: VecDeque::new(),
        slot: inc.slot.take(),
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.run()));
    if r.is_err() {
        tracing::error!("internal error serving an NVMe/RDMA queue: closing it");
    }
    // Close: no more posts; the disconnect flushes what the device still holds.
    *lock(&q.open) = false;
    // SAFETY: the id is valid while `q` lives.
    unsafe { rdma_disconnect(q.id) };
    c.close();
    debug!(
        qid = q.qid.load(Ordering::Relaxed),
        "NVMe/RDMA queue closed"
    );
}

struct Conn {
    target: Arc<TargetInner>,
    q: Arc<RdmaQueue>,
    req: CmRequest,
    listener: SocketAddr,
    local_ip: IpAddr,
    ctrl: Option<Arc<TargetController>>,
    subsys: Option<Arc<Subsystem>>,
    host_counted: Option<HostQueue>,
    ns_gen: u64,
    ns: BTreeMap<u32, Arc<Namespace>>,
    /// SQ head: capsules received, modulo the queue size.
    head: u32,
    /// Received capsules (RECV index, length) waiting for a free slot: the host may send
    /// its next command as soon as it sees a response, before our SEND completion for it
    /// has been polled.
    backlog: VecDeque<(usize, usize)>,
    /// `q` as the completion handle requests carry.
    done: Arc<dyn volume::IoCompletion>,
    /// This queue's place in its listener's counts; given back when the queue ends.
    slot: Option<ConnSlot>,
}

/// A work completion, copied out of the polled array.
struct Wc {
    wr_id: u64,
    status: u32,
    byte_len: u32,
}

impl Conn {
    fn close(&mut self) {
        self.slot = None;
        self.host_counted = None;
        if let Some(c) = self.ctrl.take() {
            let qid = self.q.qid.load(Ordering::Relaxed);
            if qid == 0 {
                // The admin queue ends the association (NVMe-oF 1.1 §3.6).
                if let Some(s) = &self.subsys {
                    s.remove_controller(c.cntlid);
                }
                c.teardown();
                debug!(cntlid = c.cntlid, "controller destroyed");
            } else {
                c.detach_queue(qid);
            }
        }
    }

    fn dead(&self) -> bool {
        self.q.stop.load(Ordering::Relaxed) || self.ctrl.as_ref().is_some_and(|c| c.is_dead())
    }

    fn run(&mut self) -> Result<(), End> {
        // A queue must connect (Fabrics Connect) within the target's setup timeout, as on
        // TCP: until then no keep-alive covers it, and it pins its buffers and a thread.
        let setup_deadline = Instant::now()
            + Duration::from_millis(self.target.setup_timeout_ms.load(Ordering::Relaxed));
        // SAFETY: ibv_wc is plain data; zeroed entries are overwritten by ibv_poll_cq.
        let mut wcs: Vec<ibv_wc> = (0..POLL_BATCH)
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        let mut last_work = Instant::now();
        let comp_fd = {
            // SAFETY: the channel lives as long as `q`.
            unsafe { (*self.q.comp).fd }
        };
        loop {
            if self.dead() {
                return Err(End::Closed);
            }
            if self.ctrl.is_none() && Instant::now() > setup_deadline {
                warn!(
                    listener = %self.listener,
                    qid = self.req.qid,
                    "NVMe/RDMA queue not connected within the setup timeout: closing it"
                );
                return Err(End::Closed);
            }
            let n = self.poll(&mut wcs)?;
            if n > 0 {
                last_work = Instant::now();
                continue;
            }
            if last_work.elapsed() < BUSY_POLL {
                std::hint::spin_loop();
                continue;
            }
            // Arm the channel, then poll once more: a completion that arrived between the
            // last poll and the arming would otherwise raise no event.
            // SAFETY: valid CQ.
            unsafe { ibv_req_notify_cq(self.q.cq, 0) };
            if self.poll(&mut wcs)? > 0 {
                last_work = Instant::now();
                continue;
            }
            let _ = verbs::wait_readable(&[comp_fd, self.q.ch.fd()], IDLE_WAKE_MS);
            self.drain_cq_events();
            self.cm_events()?;
        }
    }

    /// Acknowledge completion channel events (the CQ is polled right after).
    fn drain_cq_events(&self) {
        let mut n = 0;
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut libc::c_void = std::ptr::null_mut();
            // SAFETY: non-blocking channel of ours; returns -1 (EAGAIN) when empty.
            if unsafe { ibv_get_cq_event(self.q.comp, &mut cq, &mut ctx) } != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: acknowledges the events just taken from this CQ's channel.
            unsafe { ibv_ack_cq_events(self.q.cq, n) };
        }
    }

    fn cm_events(&mut self) -> Result<(), End> {
        while let Ok(Some(ev)) = self.q.ch.get(0) {
            match ev.kind {
                rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED => {
                    debug!(qid = self.req.qid, "NVMe/RDMA queue established");
                }
                rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
                | rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL
                | rdma_cm_event_type::RDMA_CM_EVENT_TIMEWAIT_EXIT
                | rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_ERROR
                | rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE
                | rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => {
                    debug!(
                        qid = self.req.qid,
                        kind = ev.kind,
                        status = ev.status,
                        "NVMe/RDMA queue disconnected"
                    );
                    return Err(End::Closed);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Poll the CQ once and handle what it returned; the number of completions.
    fn poll(&mut self, wcs: &mut [ibv_wc]) -> Result<usize, End> {
        // SAFETY: `wcs` has room for POLL_BATCH entries.
        let n = unsafe { ibv_poll_cq(self.q.cq, wcs.len() as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            warn!("ibv_poll_cq failed: closing the NVMe/RDMA queue");
            return Err(End::Closed);
        }
        let n = n as usize;
        let got: Vec<Wc> = wcs[..n]
            .iter()
            .map(|w| Wc {
                wr_id: w.wr_id,
                status: w.status,
                byte_len: w.byte_len,
            })
            .collect();
        for w in got {
            self.completion(w)?;
        }
        Ok(n)
    }

    fn completion(&mut self, w: Wc) -> Result<(), End> {
        let idx = (w.wr_id & 0xFFFF_FFFF) as usize;
        let kind = w.wr_id & !0xFFFF_FFFF;
        if w.status != ibv_wc_status::IBV_WC_SUCCESS {
            if w.status != ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
                warn!(
                    qid = self.req.qid,
                    status = w.status,
                    kind = kind >> 32,
                    "NVMe/RDMA work request failed: closing the queue"
                );
            }
            return Err(End::Closed);
        }
        match kind {
            WR_RECV => {
                self.q
                    .last_rx_ms
                    .store(self.target.clock.now_ms(), Ordering::Relaxed);
                if idx >= self.q.entries {
                    return Err(End::Closed);
                }
                self.backlog.push_back((idx, w.byte_len as usize));
                self.drain_backlog()
            }
            WR_READ => {
                let s = idx;
                if s >= self.q.slots.len() {
                    return Err(End::Closed);
                }
                let (cmd, len) = {
                    let mut sl = lock(&self.q.slots[s]);
                    sl.state = SlotState::Executing;
                    (sl.cmd, sl.data_len)
                };
                self.execute(s, cmd, len);
                Ok(())
            }
            WR_SEND => {
                if idx < self.q.slots.len() {
                    self.q.release_slot(idx);
                }
                self.drain_backlog()
            }
            _ => Ok(()),
        }
    }

    fn drain_backlog(&mut self) -> Result<(), End> {
        while let Some(&(r, len)) = self.backlog.front() {
            let Some(s) = self.q.alloc_slot() else {
                return Ok(());
            };
            self.backlog.pop_front();
            self.capsule(s, r, len)?;
        }
        Ok(())
    }

    /// A command capsule arrived in RECV buffer `r`: take it into slot `s`, give the buffer
    /// back to the device, and start the command (fetching its data first if the host
    /// described it with a keyed SGL).
    fn capsule(&mut self, s: usize, r: usize, len: usize) -> Result<(), End> {
        if !(SQE_LEN..=RECV_LEN).contains(&len) {
            // Not a capsule: there is no command to answer; the queue is unusable.
            warn!(
                qid = self.req.qid,
                len, "NVMe/RDMA capsule of impossible length: closing the queue"
            );
            return Err(End::Closed);
        }
        let rb = self.q.recv.as_ref().expect("allocated");
        // SAFETY: the device wrote `len` bytes into RECV buffer r and is done with it (its
        // completion was polled); it is not re-posted until after this copy.
        let cap = unsafe { std::slice::from_raw_parts(rb.ptr.add(r * RECV_LEN), len) };
        let cmd = Command::decode(&cap[..SQE_LEN]);
        let raw_sgl = &cap[24..40];
        let kind = raw_sgl[15];
        let keyed = (kind >> 4 == SGL_TYPE_KEYED_DATA_BLOCK).then(|| Keyed {
            addr: get_u64(raw_sgl, 0),
            len: get_u32(raw_sgl, 8) & 0x00FF_FFFF,
            key: get_u32(raw_sgl, 11),
        });
        let h2c = self.host_to_controller(&cmd);
        // In-capsule data (ICDOFF 0: the offset counts from the end of the SQE).
        let mut status = None;
        let mut data_len = 0;
        if h2c && kind == sgl::DATA_BLOCK_OFFSET {
            let inline = &cap[SQE_LEN..];
            let (off, dl) = (cmd.sgl.addr, cmd.sgl.len as usize);
            if off > inline.len() as u64 || off as usize + dl > inline.len() {
                status = Some(Status::DATA_SGL_LENGTH_INVALID);
            } else {
                let off = off as usize;
                // SAFETY: slot s was just taken from the free list: we hold it.
                unsafe { self.q.buf(s, dl) }.copy_from_slice(&inline[off..off + dl]);
                data_len = dl;
            }
        } else if h2c && cmd.sgl.len != 0 && keyed.is_none() {
            status = Some(Status::SGL_DESCRIPTOR_TYPE_INVALID);
        }
        if h2c {
            if let Some(k) = keyed {
                if k.len as usize > limits::MAX_TRANSFER {
                    status = Some(Status::INVALID_FIELD);
                }
            }
        }
        {
            let mut sl = lock(&self.q.slots[s]);
            sl.state = SlotState::Executing;
            sl.cmd = cmd;
            sl.keyed = keyed;
            sl.data_len = data_len;
            sl.read_len = 0;
        }
        // The SQ head moves as capsules are taken; CQEs report it (SQ flow control).
        self.head = (self.head + 1) % self.q.entries as u32;
        self.q.sqhd.store(self.head as u16, Ordering::Relaxed);
        if !self.q.post_recv(r) {
            return Err(End::Closed);
        }
        if let Some(st) = status {
            self.q.respond(s, st, 0, 0, 0);
            return Ok(());
        }
        match keyed {
            Some(k) if h2c && k.len > 0 => {
                {
                    let mut sl = lock(&self.q.slots[s]);
                    sl.state = SlotState::Fetching;
                    sl.data_len = k.len as usize;
                }
                if !self.q.post_read(s, k) {
                    return Err(End::Closed);
                }
            }
            _ => self.execute(s, cmd, data_len),
        }
        Ok(())
    }

    /// Whether a command moves data from host to controller.
    fn host_to_controller(&self, c: &Command) -> bool {
        let qid = self.q.qid.load(Ordering::Relaxed);
        match c.opcode {
            admin_opcode::FABRICS => c.fctype() == fctype::CONNECT,
            io_opcode::WRITE | io_opcode::DATASET_MANAGEMENT => qid != 0 && self.ctrl.is_some(),
            _ => false,
        }
    }

    /// Execute the command in slot `s` whose host data (if any) is in its buffer.
    fn execute(&mut self, s: usize, cmd: Command, data_len: usize) {
        let q = self.q.clone();
        if cmd.opcode == admin_opcode::FABRICS {
            // SAFETY: we hold slot s (Executing); no transfer on its buffer is in flight.
            let data = unsafe { q.buf(s, data_len) }.to_vec();
            let (status, v) = self.fabrics(&cmd, &data);
            q.respond(s, status, v as u32, (v >> 32) as u32, 0);
            return;
        }
        let Some(ctrl) = self.ctrl.clone() else {
            q.respond(s, Status::COMMAND_SEQUENCE_ERROR, 0, 0, 0);
            return;
        };
        if q.qid.load(Ordering::Relaxed) == 0 {
            // SAFETY: as above.
            let data = unsafe { q.buf(s, data_len) }.to_vec();
            match ctrl.admin(&cmd, &data) {
                AdminReply::Done(status, dw0, out) => {
                    if out.is_empty() || !status.is_success() {
                        q.respond(s, status, dw0, 0, 0);
                        return;
                    }
                    let Some(k) = lock(&q.slots[s]).keyed else {
                        q.respond(s, Status::SGL_DESCRIPTOR_TYPE_INVALID, 0, 0, 0);
                        return;
                    };
                    let n = out.len().min(k.len as usize).min(limits::MAX_TRANSFER);
                    // SAFETY: as above.
                    unsafe { q.buf(s, n) }.copy_from_slice(&out[..n]);
                    q.respond(s, status, dw0, 0, n);
                }
                AdminReply::Parked => {
                    lock(&q.slots[s]).state = SlotState::Parked;
                }
            }
            return;
        }
        if let Some(status) = self.io(s, &cmd, data_len) {
            q.respond(s, status, 0, 0, 0);
        }
    }

    // ---- Fabrics commands (NVMe-oF 1.1 §3) ----

    fn fabrics(&mut self, cmd: &Command, data: &[u8]) -> (Status, u64) {
        match cmd.fctype() {
            fctype::CONNECT => self.connect(cmd, data),
            _ => fabrics::property(self.ctrl.as_ref(), self.q.qid.load(Ordering::Relaxed), cmd),
        }
    }

    fn connect(&mut self, cmd: &Command, data: &[u8]) -> (Status, u64) {
        if self.ctrl.is_some() {
            return (Status::COMMAND_SEQUENCE_ERROR, 0);
        }
        let listener = self.listener;
        let (cm_qid, entries) = (self.req.qid, self.q.entries);
        let rules = QueueRules {
            reachable: |s: &Subsystem| s.reachable_on_rdma(&listener),
            // The queue was sized by the CM request (NVMe RDMA Transport 1.0 §3.1): the
            // Connect must describe the same queue.
            sqe: |c: &Connect| {
                if c.qid != cm_qid {
                    Some(invalid_param(false, connect_sqe_offset::QID))
                } else if c.sqsize == 0 || c.sqsize as usize + 1 > entries {
                    Some(invalid_param(false, connect_sqe_offset::SQSIZE))
                } else {
                    None
                }
            },
            local_ip: self.local_ip,
        };
        let done = match fabrics_connect(&self.target, &self.q, cmd, data, rules) {
            Ok(d) => d,
            Err(r) => return r,
        };
        let cntlid = done.ctrl.cntlid;
        self.host_counted = Some(done.host);
        self.ctrl = Some(done.ctrl);
        self.subsys = Some(done.subsys);
        if let Some(s) = &self.slot {
            s.connected();
        }
        (Status::SUCCESS, cntlid as u64)
    }

    // ---- NVM command set I/O (NVM Command Set 1.0 §3) ----

    fn refresh_namespaces(&mut self) {
        let Some(s) = &self.subsys else { return };
        let g = s.ns_gen.load(Ordering::Acquire);
        if g != self.ns_gen {
            self.ns = s.namespace_table();
            self.ns_gen = g;
        }
    }

    /// Execute an I/O command in slot `s`; `None` when it went to the volume (whose
    /// completion responds).
    fn io(&mut self, s: usize, cmd: &Command, data_len: usize) -> Option<Status> {
        if cmd.opcode == admin_opcode::FABRICS || cmd.fuse() != 0 {
            return Some(Status::INVALID_FIELD);
        }
        self.refresh_namespaces();
        if cmd.opcode == io_opcode::FLUSH && cmd.nsid == 0xFFFF_FFFF {
            for ns in self.ns.values() {
                if let Err(e) = ns
                    .volume
                    .submit_wait(IoRequest::new(IoKind::Flush, 0, 0, 0))
                {
                    return Some(io_status(&e, false));
                }
            }
            return Some(Status::SUCCESS);
        }
        let Some(ns) = self.ns.get(&cmd.nsid).cloned() else {
            return Some(Status::INVALID_NAMESPACE);
        };
        let bs = ns.block_size as u64;
        let len = cmd.nlb() as u64 * bs;
        let Some(offset) = cmd.slba().checked_mul(bs) else {
            return Some(Status::LBA_OUT_OF_RANGE);
        };
        match cmd.opcode {
            io_opcode::READ => {
                if len as usize > limits::MAX_TRANSFER {
                    return Some(Status::INVALID_FIELD);
                }
                let Some(k) = lock(&self.q.slots[s]).keyed else {
                    return Some(Status::SGL_DESCRIPTOR_TYPE_INVALID);
                };
                if (k.len as u64) < len {
                    return Some(Status::DATA_SGL_LENGTH_INVALID);
                }
                self.q.reads.fetch_add(1, Ordering::Relaxed);
                self.q.read_bytes.fetch_add(len, Ordering::Relaxed);
                self.submit(&ns, s, IoKind::Read, offset, len as usize)
            }
            io_opcode::WRITE => {
                if data_len as u64 != len {
                    return Some(Status::DATA_SGL_LENGTH_INVALID);
                }
                self.q.writes.fetch_add(1, Ordering::Relaxed);
                self.q.write_bytes.fetch_add(len, Ordering::Relaxed);
                if cmd.fua() {
                    // FUA: durable before completion.
                    // SAFETY: we hold slot s; submit_wait returns after the volume is done
                    // with the segment.
                    let seg = unsafe { Segment::from_slice(self.q.buf(s, len as usize)) };
                    let req = IoRequest::new(IoKind::Write, offset, len, 0).with_segments([seg]);
                    let r = ns.volume.submit_wait(req).and_then(|()| {
                        ns.volume
                            .submit_wait(IoRequest::new(IoKind::Flush, 0, 0, 0))
                    });
                    return Some(r.err().map_or(Status::SUCCESS, |e| io_status(&e, false)));
                }
                self.submit(&ns, s, IoKind::Write, offset, len as usize)
            }
            io_opcode::WRITE_ZEROES => {
                self.submit(&ns, s, IoKind::WriteZeroes, offset, len as usize)
            }
            io_opcode::FLUSH => self.submit(&ns, s, IoKind::Flush, 0, 0),
            io_opcode::DATASET_MANAGEMENT => {
                // SAFETY: we hold slot s.
                let data = unsafe { self.q.buf(s, data_len) }.to_vec();
                Some(dsm(&ns, cmd, &data))
            }
            _ => Some(Status::INVALID_OPCODE),
        }
    }

    fn submit(
        &mut self,
        ns: &Namespace,
        s: usize,
        kind: IoKind,
        offset: u64,
        len: usize,
    ) -> Option<Status> {
        let seg = matches!(kind, IoKind::Read | IoKind::Write).then(|| {
            // SAFETY: slot s is held until the volume calls `complete` for tag s, so the
            // segment stays valid and exclusively the volume's while the request runs; the
            // buffer lives in `q`, which the completion handle keeps alive.
            unsafe { Segment::from_slice(self.q.buf(s, len)) }
        });
        {
            let mut sl = lock(&self.q.slots[s]);
            sl.read_len = if kind == IoKind::Read { len } else { 0 };
            sl.stats = ns
                .path
                .metrics()
                .map(|m| (m.clone(), m.arrive(kind, len as u64)));
        }
        let mut req = IoRequest::new(kind, offset, len as u64, s as u64);
        if let Some(seg) = seg {
            req = req.with_segments([seg]);
        }
        ns.path.submit(req, &self.done);
        None
    }
}

/// Dataset Management (NVM Command Set 1.0 §3.2.3): only Deallocate acts.
fn dsm(ns: &Namespace, cmd: &Command, data: &[u8]) -> Status {
    let d = DatasetManagement::from_command(cmd);
    let Some(ranges) = d.ranges(data) else {
        return Status::DATA_SGL_LENGTH_INVALID;
    };
    if !d.deallocate {
        return Status::SUCCESS;
    }
    let bs = ns.block_size as u64;
    for r in ranges.filter(|r| r.nlb != 0) {
        let (Some(off), Some(len)) = (r.slba.checked_mul(bs), (r.nlb as u64).checked_mul(bs))
        else {
            return Status::LBA_OUT_OF_RANGE;
        };
        if let Err(e) = ns
            .volume
            .submit_wait(IoRequest::new(IoKind::Discard, off, len, 0))
        {
            return io_status(&e, false);
        }
    }
    Status::SUCCESS
}
