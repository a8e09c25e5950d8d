//! Command capsules (NVMe/TCP 1.0 §3.3.2) and what they do: Fabrics commands (Connect,
//! Property Get/Set; NVMe-oF 1.1 §3; Authentication Send/Receive, NVMe Base 2.0 §6.2-6.3,
//! on a queue whose host must authenticate: [`fabrics::authentication`]), admin commands
//! (handed to the controller) and the NVM command set, as the target core decides it
//! ([`io::plan`], NVM Command Set 1.0 §3): this file only checks the transport's SGL and
//! moves the data through a slot's buffer.
//!
//! Nothing here blocks the reactor: a command that needs several volume requests (a
//! Force Unit Access write and its Flush, Dataset Management ranges, a Flush of every
//! namespace) runs them one after the other from their completions ([`io::Then`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use nacre_shared::nvme::command::sgl;
use nacre_shared::nvme::fabrics::{
    connect_sqe_offset, fctype, Connect, ConnectData, CATTR_DISABLE_SQ_FLOW,
};
use nacre_shared::nvme::{admin_opcode, io_opcode, Command, Status};
use nacre_shared::nvme_tcp::{self as tcp, fes};
use tracing::warn;

use super::conn::Conn;
use super::pdu::{fatal, End};
use super::transfer::GATHER_MIN;
use crate::frontend::nvme::ctrl::AdminReply;
use crate::frontend::nvme::fabrics::{self, fabrics_connect, invalid_param, QueueRules};
use crate::frontend::nvme::io::{self, Io, Plan, Then};
use crate::frontend::nvme::limits;
use crate::frontend::nvme::subsystem::Subsystem;
use crate::telemetry::{trace, Arrival, VolumeMetrics};
use crate::volume::{IoKind, IoResult, Segment};

/// A command at the volumes; indexed by the request tag.
#[derive(Default)]
pub(super) struct Slot {
    pub(super) busy: bool,
    cid: u16,
    /// Bytes to return in C2HData on success (reads), 0 otherwise.
    read_len: usize,
    pub(super) buf: Vec<u8>,
    /// The namespace volume's statistics and this request's arrival in them.
    stats: Option<(Arc<VolumeMetrics>, Arrival)>,
    /// Requests still to run once the current one succeeds.
    then: Then,
}

/// Host data of a command: in the capsule, or gathered by R2T/H2CData.
pub(super) enum Payload<'a> {
    None,
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

impl Payload<'_> {
    fn as_slice(&self) -> &[u8] {
        match self {
            Payload::None => &[],
            Payload::Borrowed(b) => b,
            Payload::Owned(v) => v,
        }
    }
}

impl Conn {
    /// The span a command's submission runs in (see [`trace`]).
    fn io_span(&self, cid: u16) -> tracing::span::EnteredSpan {
        tracing::trace_span!(target: trace::TARGET, "nvmf", qid = self.qid, cid).entered()
    }

    /// Whether a command moves data from host to controller.
    fn host_to_controller(&self, c: &Command) -> bool {
        match c.opcode {
            admin_opcode::FABRICS => {
                matches!(c.fctype(), fctype::CONNECT | fctype::AUTHENTICATION_SEND)
            }
            io_opcode::WRITE | io_opcode::DATASET_MANAGEMENT => {
                self.qid != 0 && self.ctrl.is_some()
            }
            _ => false,
        }
    }

    /// A command capsule: its data in the capsule, asked for by R2T, or none.
    pub(super) fn capsule(&mut self, cmd: Command, data: &[u8]) -> Result<(), End> {
        if let Some(Err(s)) = self.auth.as_ref().map(|a| a.may_execute(&cmd)) {
            // Not authenticated yet: no data is asked for.
            self.reply(cmd.cid, s, 0, &[]);
            return Ok(());
        }
        if !self.host_to_controller(&cmd) {
            // Data in a capsule of a command that takes none is ignored; data the host wants
            // back must be described by a transport SGL.
            return self.execute(cmd, Payload::None);
        }
        let sg = cmd.sgl;
        if sg.len == 0 {
            return self.execute(cmd, Payload::None);
        }
        if !data.is_empty() {
            if sg.kind != sgl::DATA_BLOCK_OFFSET {
                self.reply(cmd.cid, Status::SGL_DESCRIPTOR_TYPE_INVALID, 0, &[]);
                return Ok(());
            }
            // ICDOFF is 0, so the SGL offset is relative to the start of the data.
            let (off, len) = (sg.addr as usize, sg.len as usize);
            if sg.addr > data.len() as u64 || off + len > data.len() {
                self.reply(cmd.cid, Status::DATA_SGL_LENGTH_INVALID, 0, &[]);
                return Ok(());
            }
            return self.execute(cmd, Payload::Borrowed(&data[off..off + len]));
        }
        if sg.kind >> 4 != sgl::TYPE_TRANSPORT_DATA_BLOCK {
            self.reply(cmd.cid, Status::SGL_DESCRIPTOR_TYPE_INVALID, 0, &[]);
            return Ok(());
        }
        let len = sg.len as usize;
        if len > limits::MAX_TRANSFER {
            self.reply(cmd.cid, Status::INVALID_FIELD, 0, &[]);
            return Ok(());
        }
        if self.h2c.len() + self.r2t_waiting.len() >= (self.sqsize as usize).max(32) {
            // More commands waiting for data than the queue has entries: the host is not
            // respecting the queue size.
            let mut hdr = [0u8; tcp::CAPSULE_CMD_HLEN];
            cmd.encode(&mut hdr[tcp::CH_LEN..]);
            return Err(fatal(fes::DATA_LIMIT_EXCEEDED, 0, &hdr));
        }
        // Buffers for data the host has yet to send are bounded per queue: past the budget
        // the R2T waits (only the 64-byte command is kept) until earlier data arrived.
        if !self.r2t_waiting.is_empty()
            || (!self.h2c.is_empty() && self.r2t_bytes + len > limits::R2T_BUDGET)
        {
            self.r2t_waiting.push_back(cmd);
            return Ok(());
        }
        self.send_r2t(cmd, len);
        Ok(())
    }

    pub(super) fn execute(&mut self, cmd: Command, data: Payload<'_>) -> Result<(), End> {
        self.fresh_cmds += 1;
        if fabrics::is_authentication(&cmd) {
            let (status, out) = fabrics::authentication(self.auth.as_mut(), &cmd, data.as_slice());
            if self.auth.as_ref().is_some_and(|a| a.authenticated()) {
                self.authenticated();
            }
            match clip_to_sgl(&cmd, &out) {
                Ok(d) => self.reply(cmd.cid, status, 0, d),
                Err(s) => self.reply(cmd.cid, s, 0, &[]),
            }
            return Ok(());
        }
        // A queue whose host must authenticate runs nothing else until it has.
        if let Some(Err(s)) = self.auth.as_ref().map(|a| a.may_execute(&cmd)) {
            self.reply(cmd.cid, s, 0, &[]);
            return Ok(());
        }
        if cmd.opcode == admin_opcode::FABRICS {
            let (status, v) = self.fabrics(&cmd, data.as_slice());
            let mut c = self.cqe(cmd.cid, status, v as u32);
            c.dw1 = (v >> 32) as u32;
            let digests = self.digests;
            tcp::encode_capsule_resp(self.out.buf(), &c, digests);
            return Ok(());
        }
        let Some(ctrl) = self.ctrl.clone() else {
            // Nothing but Connect before Connect.
            self.reply(cmd.cid, Status::COMMAND_SEQUENCE_ERROR, 0, &[]);
            return Ok(());
        };
        if self.qid == 0 {
            match ctrl.admin(&cmd, data.as_slice()) {
                AdminReply::Done(status, dw0, out) => match clip_to_sgl(&cmd, &out) {
                    Ok(d) => self.reply(cmd.cid, status, dw0, d),
                    Err(s) => self.reply(cmd.cid, s, 0, &[]),
                },
                AdminReply::Parked => {}
            }
            return Ok(());
        }
        if let Some(status) = self.io(&cmd, data) {
            self.reply(cmd.cid, status, 0, &[]);
        }
        Ok(())
    }

    // ---- Fabrics commands (NVMe-oF 1.1 §3) ----

    fn fabrics(&mut self, cmd: &Command, data: &[u8]) -> (Status, u64) {
        match cmd.fctype() {
            fctype::CONNECT => self.connect(cmd, data),
            _ => fabrics::property(self.ctrl.as_ref(), self.qid, cmd),
        }
    }

    fn connect(&mut self, cmd: &Command, data: &[u8]) -> (Status, u64) {
        if self.ctrl.is_some() {
            return (Status::COMMAND_SEQUENCE_ERROR, 0);
        }
        // NVMe/TCP §3.6: on a TLS connection the Connect must name the host and subsystem
        // of the PSK identity the handshake proved.
        if let Some(peer) = &self.tls_peer {
            if data.len() >= nacre_shared::nvme::fabrics::CONNECT_DATA_LEN {
                let d = ConnectData::decode(data);
                if (d.hostnqn.as_str(), d.subnqn.as_str()) != (peer.0.as_str(), peer.1.as_str()) {
                    warn!(
                        hostnqn = d.hostnqn,
                        subnqn = d.subnqn,
                        tls_hostnqn = peer.0,
                        tls_subnqn = peer.1,
                        "connect refused: NQNs differ from the TLS PSK identity"
                    );
                    return (Status::CONNECT_INVALID_HOST, 0);
                }
            }
        }
        let listener = self.listener;
        let rules = QueueRules {
            reachable: |s: &Subsystem| s.reachable_on(&listener),
            // NVMe/TCP sizes the queue from the Connect itself (NVMe/TCP 1.0 §3.3).
            sqe: |c: &Connect| {
                let max = if c.qid == 0 {
                    limits::MAX_ADMIN_QUEUE_ENTRIES
                } else {
                    limits::MAX_QUEUE_ENTRIES
                };
                (c.sqsize == 0 || c.sqsize as u32 + 1 > max)
                    .then(|| invalid_param(false, connect_sqe_offset::SQSIZE))
            },
            local_ip: self.local_ip,
        };
        let done = match fabrics_connect(&self.target, &self.q, cmd, data, rules) {
            Ok(d) => d,
            Err(r) => return r,
        };
        let c = done.connect;
        let entries = c.sqsize as u32 + 1;
        if c.qid != 0 {
            self.qid = c.qid;
            self.slots = (0..entries).map(|_| Slot::default()).collect();
            self.free = (0..entries as u16).rev().collect();
            self.max_inline = limits::IO_INLINE_DATA;
        }
        self.sq_flow_disabled = c.cattr & CATTR_DISABLE_SQ_FLOW != 0;
        self.sqsize = entries;
        self.head = 1 % entries;
        let dw0 = done.connect_dw0;
        self.connected();
        if done.auth.is_required() {
            self.await_authentication();
        }
        self.host_counted = Some(done.host);
        self.auth = Some(done.auth);
        self.ctrl = Some(done.ctrl);
        self.subsys = Some(done.subsys);
        (Status::SUCCESS, dw0)
    }

    // ---- NVM command set I/O (NVM Command Set 1.0 §3) ----

    fn refresh_namespaces(&mut self) {
        if let Some(s) = &self.subsys {
            s.refresh_namespace_table(&mut self.ns_gen, &mut self.ns);
        }
    }

    /// Execute an I/O command ([`io::plan`]); `None` when it went to the volume (the
    /// completion replies).
    fn io(&mut self, cmd: &Command, data: Payload<'_>) -> Option<Status> {
        if cmd.opcode == admin_opcode::FABRICS {
            return Some(Status::INVALID_OPCODE);
        }
        self.refresh_namespaces();
        // The plan keeps its namespace past the table's borrow (submit takes the queue).
        let plan = match io::plan(cmd, &self.ns) {
            // The range list came with the command (in the capsule or by R2T).
            Plan::Ranges(ns, d) => io::deallocate(ns, &d, data.as_slice()),
            p => p,
        }
        .into_owned();
        match plan {
            Plan::Done(s) => Some(s),
            Plan::Read(io) => {
                if cmd.sgl.kind >> 4 != sgl::TYPE_TRANSPORT_DATA_BLOCK {
                    return Some(Status::SGL_DESCRIPTOR_TYPE_INVALID);
                }
                if (cmd.sgl.len as u64) < io.len {
                    return Some(Status::DATA_SGL_LENGTH_INVALID);
                }
                self.q.reads.fetch_add(1, Ordering::Relaxed);
                self.q.read_bytes.fetch_add(io.len, Ordering::Relaxed);
                self.submit(io, cmd.cid, data)
            }
            Plan::Write(io) => {
                if data.as_slice().len() as u64 != io.len {
                    return Some(Status::DATA_SGL_LENGTH_INVALID);
                }
                self.q.writes.fetch_add(1, Ordering::Relaxed);
                self.q.write_bytes.fetch_add(io.len, Ordering::Relaxed);
                self.submit(io, cmd.cid, data)
            }
            Plan::Run(io) => self.submit(io, cmd.cid, Payload::None),
            Plan::Ranges(..) => unreachable!("deallocate gives Done or Run"),
        }
    }

    /// Take a free slot for a command.
    fn alloc_slot(&mut self) -> Option<u16> {
        let tag = self.free.pop()?;
        self.slots[tag as usize].busy = true;
        self.outstanding += 1;
        Some(tag)
    }

    /// Submit `io`'s first request through its namespace's path; reads and writes move
    /// their data through the slot's buffer (a write's `data` becomes it).
    fn submit(&mut self, mut io: Io<'static>, cid: u16, data: Payload<'_>) -> Option<Status> {
        let Some(tag) = self.alloc_slot() else {
            warn!("host exceeded its queue size");
            return Some(Status::INTERNAL_ERROR);
        };
        let len = io.len as usize;
        let moves_data = matches!(io.kind, IoKind::Read | IoKind::Write);
        let buf = match (io.kind, data) {
            (IoKind::Write, Payload::Owned(v)) => v,
            (IoKind::Write, d) => {
                let mut b = self.pool.take(0);
                b.extend_from_slice(d.as_slice());
                b
            }
            (IoKind::Read, _) => self.pool.take(len),
            _ => Vec::new(),
        };
        let mut req = io.request(tag as u64);
        let s = &mut self.slots[tag as usize];
        s.cid = cid;
        s.buf = buf;
        s.read_len = if io.is_read() { len } else { 0 };
        s.stats = io.arrive();
        s.then = std::mem::take(&mut io.then);
        if moves_data {
            // SAFETY: the slot's buffer is not touched again until the volume completes
            // this tag (the slot is busy until then, and a connection whose slots are busy
            // is kept, or its busy buffers leaked, never freed), so the segment stays valid
            // and exclusively the volume's while the request runs.
            let seg = unsafe { Segment::new(s.buf.as_mut_ptr(), len) };
            req = req.with_segments([seg]);
        }
        let _span = self.io_span(cid);
        io.ns.path.submit(req, &self.done);
        None
    }

    /// A volume completed request `tag`: run the next request of its chain, or reply.
    pub(super) fn complete(&mut self, tag: u64, result: IoResult) {
        let Some(s) = self.slots.get_mut(tag as usize).filter(|s| s.busy) else {
            return;
        };
        if let Some((dev, req)) = s.then.next(result.is_ok() && self.sock.is_some()) {
            dev.submit(req, &self.done);
            return;
        }
        let status = io::status(&result, s.read_len > 0);
        let stats = s.stats.take();
        if let Some((m, a)) = &stats {
            m.complete(a, !status.is_success());
        }
        tracing::trace!(target: trace::TARGET, qid = self.qid, cid = s.cid, status = %status,
            latency_us = stats.map(|(_, a)| a.elapsed_ns() as f64 / 1e3), "nvmf: done");
        s.busy = false;
        let (cid, read_len) = (s.cid, s.read_len);
        let mut buf = std::mem::take(&mut s.buf);
        self.free.push(tag as u16);
        self.outstanding -= 1;
        if self.sock.is_none() {
            self.pool.give(buf);
            return;
        }
        if status.is_success() && read_len >= GATHER_MIN {
            // The data is sent from the slot's buffer itself.
            buf.truncate(read_len);
            self.read_reply(cid, buf);
            return;
        }
        let data = if status.is_success() {
            &buf[..read_len]
        } else {
            &[][..]
        };
        self.reply(cid, status, 0, data);
        // The reply holds a copy of the data: the buffer goes back to the pool, so a queue
        // keeps at most POOL_BYTES of idle buffers however deep it is.
        self.pool.give(buf);
    }

    /// Complete a parked admin command (an Asynchronous Event Request).
    pub(super) fn complete_async(&mut self, cid: u16, status: Status, dw0: u32) {
        if self.sock.is_some() {
            self.reply(cid, status, dw0, &[]);
        }
    }
}

/// Data for the host goes through a transport SGL; return at most its length.
fn clip_to_sgl<'b>(cmd: &Command, data: &'b [u8]) -> Result<&'b [u8], Status> {
    if data.is_empty() {
        return Ok(data);
    }
    if cmd.sgl.kind >> 4 != sgl::TYPE_TRANSPORT_DATA_BLOCK {
        return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID);
    }
    Ok(&data[..data.len().min(cmd.sgl.len as usize)])
}
