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
//! The queue thread's loop over these resources (completions, capsules, commands) is in
//! [`super::conn`].
//!
//! Life of the memory: every verbs object and buffer belongs to [`RdmaQueue`], freed when
//! its last reference goes: the queue thread's, or a volume's still running request (whose
//! completion then finds the queue pair closed and posts nothing). The queue pair is
//! destroyed before the buffers it may still access.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use nacre_shared::nvme::command::SQE_LEN;
use nacre_shared::nvme::{Command, Completion, Status};
use rdma_sys::*;
use tracing::{debug, warn};

use crate::frontend::nvme::ctrl::CtrlQueue;
use crate::frontend::nvme::io::{self, Then};
use crate::frontend::nvme::{limits, lock, ConnSlot};
use crate::rdma::cm::{self, CmRequest};
use crate::rdma::verbs::{self, EventChannel, RegBuf};
use crate::telemetry::{Arrival, VolumeMetrics};
use crate::volume::{self, IoResult};

/// Bytes of a RECV buffer: the 64-byte SQE and the in-capsule data IOCCSZ allows.
pub(super) const RECV_LEN: usize = SQE_LEN + limits::IO_INLINE_DATA;
/// Bytes of a response capsule: the 16-byte CQE (IORCSZ 1).
const RSP_LEN: usize = 16;

// Work request ids: the kind in the high half, the RECV buffer or slot index in the low.
pub(super) const WR_RECV: u64 = 1 << 32;
pub(super) const WR_SEND: u64 = 2 << 32;
pub(super) const WR_READ: u64 = 3 << 32;
pub(super) const WR_WRITE: u64 = 4 << 32;

/// SGL descriptor type of a Keyed SGL Data Block (NVMe Base 2.0 Figure 119).
pub(super) const SGL_TYPE_KEYED_DATA_BLOCK: u8 = 0x4;

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
pub(super) struct Keyed {
    pub(super) addr: u64,
    pub(super) len: u32,
    pub(super) key: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum SlotState {
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
pub(super) struct Slot {
    pub(super) state: SlotState,
    pub(super) cmd: Command,
    pub(super) keyed: Option<Keyed>,
    /// Bytes of host data in the slot's buffer (fetched or in-capsule).
    pub(super) data_len: usize,
    /// Bytes to RDMA WRITE to the host on success (reads).
    pub(super) read_len: usize,
    pub(super) stats: Option<(Arc<VolumeMetrics>, Arrival)>,
    /// The command's volume requests still to run once the current one succeeds.
    pub(super) then: Then,
}

/// The queue's verbs objects and buffers, and the state completing threads share.
pub(super) struct RdmaQueue {
    /// The queue itself, for submitting the next request of a command from a completion.
    me: Weak<RdmaQueue>,
    /// The queue's own CM event channel (the id is migrated here from the listener's).
    pub(super) ch: EventChannel,
    pub(super) id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    pub(super) comp: *mut ibv_comp_channel,
    pub(super) cq: *mut ibv_cq,
    /// Whether the queue pair may still be posted to; held while posting, so teardown
    /// cannot race a completing thread's post.
    pub(super) open: Mutex<bool>,
    pub(super) recv: Option<RegBuf>,
    data: Option<RegBuf>,
    rsp: Option<RegBuf>,
    /// Capsules the RECV ring holds (CRQSIZE).
    pub(super) entries: usize,
    pub(super) slots: Box<[Mutex<Slot>]>,
    free: Mutex<Vec<u16>>,
    pub(super) qid: AtomicU16,
    pub(super) sqhd: AtomicU16,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) last_rx_ms: AtomicU64,
    pub(super) reads: AtomicU64,
    pub(super) writes: AtomicU64,
    pub(super) read_bytes: AtomicU64,
    pub(super) write_bytes: AtomicU64,
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
    pub(super) unsafe fn buf(&self, s: usize, len: usize) -> &mut [u8] {
        let d = self.data.as_ref().expect("allocated before serving");
        debug_assert!(len <= limits::MAX_TRANSFER && s < self.slots.len());
        // SAFETY: in bounds (slot s's region is MAX_TRANSFER bytes); exclusive per the caller.
        unsafe { std::slice::from_raw_parts_mut(d.ptr.add(s * limits::MAX_TRANSFER), len) }
    }

    pub(super) fn alloc_slot(&self) -> Option<usize> {
        lock(&self.free).pop().map(usize::from)
    }

    pub(super) fn post_recv(&self, r: usize) -> bool {
        let b = self.recv.as_ref().expect("allocated");
        let open = lock(&self.open);
        if !*open {
            return false;
        }
        // SAFETY: the queue pair is open (checked under the lock teardown takes); the RECV
        // buffer r belongs to the device until its completion is polled (it is not read
        // before).
        unsafe {
            verbs::post_recv_slot(
                (*self.id).qp,
                b,
                r * RECV_LEN,
                RECV_LEN as u32,
                WR_RECV | r as u64,
            )
        }
    }

    /// Post RDMA READ of the host's data for slot `s` into its buffer.
    pub(super) fn post_read(&self, s: usize, k: Keyed) -> bool {
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
    pub(super) fn respond(&self, s: usize, status: Status, dw0: u32, dw1: u32, read_len: usize) {
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

    pub(super) fn release_slot(&self, s: usize) {
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
        let (read_len, next) = {
            let mut sl = lock(&self.slots[s]);
            let next = sl.then.next(result.is_ok());
            if next.is_none() {
                if let Some((m, a)) = sl.stats.take() {
                    m.complete(&a, result.is_err());
                }
            }
            (sl.read_len, next)
        };
        // The next request of the command, submitted outside the slot's lock (a volume may
        // complete it on this thread).
        if let (Some((dev, req)), Some(me)) = (next, self.me.upgrade()) {
            let done: Arc<dyn volume::IoCompletion> = me;
            dev.submit(req, &done);
            return;
        }
        self.respond(s, io::status(&result, read_len > 0), 0, 0, read_len);
    }
}

/// Create the queue's resources, post its RECV ring and accept the connection.
pub(super) fn setup(inc: &mut Incoming) -> Result<Arc<RdmaQueue>, (u16, String)> {
    let no_rsc = |what: &str, e: std::io::Error| (cm::reject::NO_RESOURCES, format!("{what}: {e}"));
    let ch = EventChannel::new().map_err(|e| no_rsc("event channel", e))?;
    // SAFETY: the id is ours (its CONNECT_REQUEST event was acknowledged, which
    // rdma_migrate_id waits for); from here its events arrive on `ch`.
    let rc = unsafe { rdma_migrate_id(inc.id, ch.raw()) };
    verbs::check(rc).map_err(|e| no_rsc("rdma_migrate_id", e))?;
    let entries = inc.req.entries() as usize;
    let nslots = entries;
    let mut q = RdmaQueue {
        me: Weak::new(),
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
        // Every RECV, and per slot a READ or a WRITE + SEND.
        let shape = verbs::QueueShape {
            cqe: entries + 2 * nslots + 16,
            send_wr: 2 * nslots + 1,
            recv_wr: entries,
            send_sge: 1,
        };
        let (mut comp, mut cq) = (std::ptr::null_mut(), std::ptr::null_mut());
        let made = verbs::create_queue_objects(q.id, q.pd, shape, &mut comp, &mut cq);
        (q.comp, q.cq) = (comp, cq);
        if let Err((what, e)) = made {
            return Err(fail(q, what, e));
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
    Ok(Arc::new_cyclic(move |me| {
        q.me = me.clone();
        q
    }))
}
