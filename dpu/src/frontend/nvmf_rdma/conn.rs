//! One NVMe/RDMA connection at work (NVMe RDMA Transport 1.0 §3.2-3.4): the queue thread's
//! loop over its completion queue and CM events, command capsules from the RECV ring,
//! Connect and the admin commands through the shared target controller, and I/O commands
//! with their data moved by RDMA READ/WRITE or taken from the capsule. The queue's verbs
//! resources and their set-up are in [`super::queue`].
//!
//! Completion handling: the queue thread busy-polls its completion queue for
//! [`BUSY_POLL`] after the last work, then arms the completion channel and sleeps in
//! `poll(2)` on it and on the queue's CM event channel (disconnects), waking at least every
//! [`IDLE_WAKE_MS`] to notice a controller teardown.

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_shared::nvme::command::{sgl, SQE_LEN};
use nacre_shared::nvme::fabrics::{connect_sqe_offset, fctype, Connect};
use nacre_shared::nvme::{admin_opcode, get_u32, get_u64, io_opcode, Command, Status};
use rdma_sys::*;
use tracing::{debug, warn};

use super::queue::{
    reject, setup, Incoming, Keyed, RdmaQueue, SlotState, RECV_LEN, SGL_TYPE_KEYED_DATA_BLOCK,
    WR_READ, WR_RECV, WR_SEND,
};
use crate::auth::queue::QueueAuth;
use crate::frontend::nvme::ctrl::{AdminReply, TargetController};
use crate::frontend::nvme::fabrics::{self, fabrics_connect, invalid_param, HostQueue, QueueRules};
use crate::frontend::nvme::io::{self, Io, Plan};
use crate::frontend::nvme::subsystem::{Namespace, Subsystem};
use crate::frontend::nvme::{limits, lock, ConnSlot, TargetInner};
use crate::rdma::cm::CmRequest;
use crate::rdma::verbs;
use crate::volume::{self, IoKind, Segment};

/// How long the queue thread keeps polling its completion queue after the last work before
/// it sleeps on the completion channel: long enough to catch the next command of a busy
/// host without a wake-up, short enough that an idle queue costs no CPU.
const BUSY_POLL: Duration = Duration::from_micros(50);
/// An idle queue wakes this often to notice a controller teardown (keep-alive expiry,
/// subsystem deletion): the bound on how long a dead controller's queue lingers.
const IDLE_WAKE_MS: i32 = 100;
/// Completions taken per `ibv_poll_cq`.
const POLL_BATCH: usize = 32;

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
        auth: None,
        auth_deadline: None,
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
    /// DH-HMAC-CHAP on this queue, from its Connect on (NVMe Base 2.0 §8.13).
    auth: Option<QueueAuth>,
    /// When a queue whose host must authenticate is closed if it has not (the setup
    /// timeout again, from its Connect).
    auth_deadline: Option<Instant>,
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
        self.auth = None;
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
            if self.auth_deadline.is_some_and(|d| Instant::now() > d) {
                warn!(
                    listener = %self.listener,
                    qid = self.req.qid,
                    "NVMe/RDMA queue did not authenticate within the setup timeout: closing it"
                );
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
        // A queue whose host must authenticate runs nothing else until it has (and fetches
        // no data for it).
        if let Some(Err(st)) = self.auth.as_ref().map(|a| a.may_execute(&cmd)) {
            status = status.or(Some(st));
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
            admin_opcode::FABRICS => {
                matches!(c.fctype(), fctype::CONNECT | fctype::AUTHENTICATION_SEND)
            }
            io_opcode::WRITE | io_opcode::DATASET_MANAGEMENT => qid != 0 && self.ctrl.is_some(),
            _ => false,
        }
    }

    /// Execute the command in slot `s` whose host data (if any) is in its buffer.
    fn execute(&mut self, s: usize, cmd: Command, data_len: usize) {
        let q = self.q.clone();
        if fabrics::is_authentication(&cmd) {
            // SAFETY: we hold slot s (Executing); no transfer on its buffer is in flight.
            let data = unsafe { q.buf(s, data_len) }.to_vec();
            let (status, out) = fabrics::authentication(self.auth.as_mut(), &cmd, &data);
            if self.auth.as_ref().is_some_and(|a| a.authenticated()) {
                self.auth_deadline = None;
            }
            // SAFETY: as above.
            unsafe { self.respond_data(s, status, 0, &out) };
            return;
        }
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
                // SAFETY: as above.
                AdminReply::Done(status, dw0, out) => unsafe {
                    self.respond_data(s, status, dw0, &out)
                },
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

    /// Respond to the command in slot `s` with `out` as its data to the host (written
    /// through its keyed SGL, at most the length that describes).
    ///
    /// # Safety
    /// The caller holds slot `s` (Executing) and no transfer on its buffer is in flight.
    unsafe fn respond_data(&self, s: usize, status: Status, dw0: u32, out: &[u8]) {
        let q = &self.q;
        if out.is_empty() || !status.is_success() {
            q.respond(s, status, dw0, 0, 0);
            return;
        }
        let Some(k) = lock(&q.slots[s]).keyed else {
            q.respond(s, Status::SGL_DESCRIPTOR_TYPE_INVALID, 0, 0, 0);
            return;
        };
        let n = out.len().min(k.len as usize).min(limits::MAX_TRANSFER);
        // SAFETY: the caller holds slot s, with no transfer in flight (this fn's contract).
        unsafe { q.buf(s, n) }.copy_from_slice(&out[..n]);
        q.respond(s, status, dw0, 0, n);
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
        let dw0 = done.connect_dw0;
        self.host_counted = Some(done.host);
        if done.auth.is_required() {
            let ms = self.target.setup_timeout_ms.load(Ordering::Relaxed);
            self.auth_deadline = Some(Instant::now() + Duration::from_millis(ms));
        }
        self.auth = Some(done.auth);
        self.ctrl = Some(done.ctrl);
        self.subsys = Some(done.subsys);
        if let Some(s) = &self.slot {
            s.connected();
        }
        (Status::SUCCESS, dw0)
    }

    // ---- NVM command set I/O (NVM Command Set 1.0 §3) ----

    fn refresh_namespaces(&mut self) {
        if let Some(s) = &self.subsys {
            s.refresh_namespace_table(&mut self.ns_gen, &mut self.ns);
        }
    }

    /// Execute an I/O command in slot `s` ([`io::plan`]); `None` when it went to the volume
    /// (whose completion responds).
    fn io(&mut self, s: usize, cmd: &Command, data_len: usize) -> Option<Status> {
        if cmd.opcode == admin_opcode::FABRICS {
            return Some(Status::INVALID_OPCODE);
        }
        self.refresh_namespaces();
        let plan = match io::plan(cmd, &self.ns) {
            Plan::Ranges(ns, d) => {
                // The range list was fetched (RDMA READ) or came in the capsule.
                // SAFETY: we hold slot s; no transfer on its buffer is in flight.
                let data = unsafe { self.q.buf(s, data_len) }.to_vec();
                io::deallocate(ns, &d, &data)
            }
            p => p,
        }
        // Kept past the table's borrow (submit takes the queue).
        .into_owned();
        match plan {
            Plan::Done(st) => Some(st),
            Plan::Read(io) => {
                let Some(k) = lock(&self.q.slots[s]).keyed else {
                    return Some(Status::SGL_DESCRIPTOR_TYPE_INVALID);
                };
                if (k.len as u64) < io.len {
                    return Some(Status::DATA_SGL_LENGTH_INVALID);
                }
                self.q.reads.fetch_add(1, Ordering::Relaxed);
                self.q.read_bytes.fetch_add(io.len, Ordering::Relaxed);
                self.submit(s, io)
            }
            Plan::Write(io) => {
                if data_len as u64 != io.len {
                    return Some(Status::DATA_SGL_LENGTH_INVALID);
                }
                self.q.writes.fetch_add(1, Ordering::Relaxed);
                self.q.write_bytes.fetch_add(io.len, Ordering::Relaxed);
                self.submit(s, io)
            }
            Plan::Run(io) => self.submit(s, io),
            Plan::Ranges(..) => unreachable!("deallocate gives Done or Run"),
        }
    }

    /// Submit `io`'s first request from slot `s`; its data (if any) is the slot's buffer.
    fn submit(&mut self, s: usize, mut io: Io<'static>) -> Option<Status> {
        let len = io.len as usize;
        let seg = matches!(io.kind, IoKind::Read | IoKind::Write).then(|| {
            // SAFETY: slot s is held until the volume calls `complete` for tag s, so the
            // segment stays valid and exclusively the volume's while the request runs; the
            // buffer lives in `q`, which the completion handle keeps alive.
            unsafe { Segment::from_slice(self.q.buf(s, len)) }
        });
        let mut req = io.request(s as u64);
        {
            let mut sl = lock(&self.q.slots[s]);
            sl.read_len = if io.is_read() { len } else { 0 };
            sl.stats = io.arrive();
            sl.then = std::mem::take(&mut io.then);
        }
        if let Some(seg) = seg {
            req = req.with_segments([seg]);
        }
        io.ns.path.submit(req, &self.done);
        None
    }
}
