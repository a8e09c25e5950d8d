//! One NVMe/TCP connection = one NVMe queue (NVMe/TCP 1.0 §3.3): connection
//! initialization, PDU framing and validation, capsules, data transfer and the I/O
//! command set.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nacre_shared::nvme::command::sgl;
use nacre_shared::nvme::fabrics::{
    self, connect_data_offset, connect_invalid_param_dw0, connect_sqe_offset, fctype, Connect,
    ConnectData, Property,
};
use nacre_shared::nvme::status::sct;
use nacre_shared::nvme::{admin_opcode, get_u32, get_u64, io_opcode, Command, Completion, Status};
use nacre_shared::nvme_tcp::{
    self as tcp, ch_offset, data_offset_of, digest, fes, flags, icreq_offset, pdu_type,
    CommonHeader, DataHeader, Digests, IcReq, IcResp,
};
use smallvec::SmallVec;
use tracing::{debug, warn};

use super::ctrl::{AdminReply, Controller};
use super::subsystem::{Namespace, Subsystem};
use super::{limits, lock, ConnSlot, TargetInner};
use crate::telemetry::{trace, Arrival, VolumeMetrics};
use crate::volume::{self, IoError, IoKind, IoRequest, IoResult, Segment};

thread_local! {
    /// The queue whose connection thread this is (address of its `Queue`), so completions
    /// running inline can leave the flush to the batching loop.
    static OWNER: Cell<usize> = const { Cell::new(0) };
}

/// Receive buffer of a connected queue: large enough for a whole H2CData PDU carrying
/// MAXH2CDATA bytes, plus room to read ahead.
const RBUF_LEN: usize = limits::MAX_TRANSFER + 64 * 1024;
/// Receive buffer until the queue is connected: a Fabrics Connect capsule (72 + 1024 bytes)
/// or any admin capsule with in-capsule data fits; a connection that never connects costs
/// its peer little more than its thread.
const SETUP_RBUF_LEN: usize = 2 * limits::ADMIN_INLINE_DATA;
/// Flush the send buffer early once it holds this much (read data held for a gather write
/// included).
const FLUSH_AT: usize = 256 * 1024;
/// Reads at least this long are sent from their slot buffer by a gather write (writev)
/// instead of being copied behind their C2HData header; below it the copy costs less than
/// another iovec and the buffer's trip back to the pool.
const GATHER_MIN: usize = 16 * 1024;
/// At most this many held buffers wait for one gather write.
const GATHER_MAX_BUFS: usize = 64;
/// How long a send may block on a host that stops reading before the connection is dropped:
/// replies are also sent from other threads (completions, asynchronous events raised by the
/// control plane), which must not hang on one stuck host.
const WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Idle data buffers of one queue, reused across commands; at most
/// [`limits::POOL_BYTES`] of capacity is kept.
#[derive(Default)]
pub(crate) struct BufPool {
    bufs: Vec<Vec<u8>>,
    bytes: usize,
}

impl BufPool {
    /// A buffer of `len` zeroed-or-reused bytes (contents unspecified; callers overwrite).
    fn take(&mut self, len: usize) -> Vec<u8> {
        let mut b = match self.bufs.pop() {
            Some(b) => {
                self.bytes -= b.capacity();
                b
            }
            None => Vec::new(),
        };
        b.resize(len, 0);
        b
    }

    fn give(&mut self, b: Vec<u8>) {
        if b.capacity() > 0 && self.bytes + b.capacity() <= limits::POOL_BYTES {
            self.bytes += b.capacity();
            self.bufs.push(b);
        }
    }
}

/// A pending I/O command handed to a volume; indexed by the request tag.
#[derive(Default)]
struct Slot {
    cid: u16,
    /// Bytes to return in C2HData on success (reads), 0 otherwise.
    read_len: usize,
    buf: Vec<u8>,
    /// The namespace volume's statistics and this request's arrival in them.
    stats: Option<(Arc<VolumeMetrics>, Arrival)>,
}

/// What a queue has to send, gathered until the connection thread is about to block (or a
/// completion arrives from another thread) and then written with one system call.
struct Out {
    sock: TcpStream,
    /// The bytes to send, except the data of long reads, which stays in `held`.
    buf: Vec<u8>,
    /// Read data sent from its own buffer: `(at, data)` goes out right before `buf[at..]`.
    held: Vec<(usize, Vec<u8>)>,
    held_bytes: usize,
    /// Buffers of `held` whose data has been sent, for the queue's pool.
    spent: Vec<Vec<u8>>,
    broken: bool,
}

impl Out {
    fn new(sock: TcpStream) -> Out {
        Out {
            sock,
            buf: Vec::with_capacity(1024),
            held: Vec::new(),
            held_bytes: 0,
            spent: Vec::new(),
            broken: false,
        }
    }

    fn pending(&self) -> usize {
        self.buf.len() + self.held_bytes
    }

    fn flush(&mut self) {
        if self.pending() > 0 && !self.broken && self.send().is_err() {
            self.broken = true;
            let _ = self.sock.shutdown(Shutdown::Both);
        }
        self.buf.clear();
        self.held_bytes = 0;
        self.spent.extend(self.held.drain(..).map(|(_, b)| b));
    }

    fn send(&mut self) -> std::io::Result<()> {
        if self.held.is_empty() {
            return self.sock.write_all(&self.buf);
        }
        let mut iov: SmallVec<[IoSlice<'_>; 16]> = SmallVec::new();
        let mut at = 0;
        for (pos, data) in &self.held {
            if *pos > at {
                iov.push(IoSlice::new(&self.buf[at..*pos]));
            }
            iov.push(IoSlice::new(data));
            at = *pos;
        }
        if at < self.buf.len() {
            iov.push(IoSlice::new(&self.buf[at..]));
        }
        let mut iov = &mut iov[..];
        while !iov.is_empty() {
            match self.sock.write_vectored(iov) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => IoSlice::advance_slices(&mut iov, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// The part of a queue shared with completing threads and the controller.
pub(crate) struct Queue {
    out: Mutex<Out>,
    digests: Digests,
    hpda: u8,
    sq_flow_disabled: AtomicBool,
    qid: AtomicU16,
    /// SQ head pointer reported in CQEs.
    sqhd: AtomicU16,
    slots: OnceLock<Box<[Mutex<Slot>]>>,
    free: Mutex<Vec<u16>>,
    /// Data buffers for commands (slots and R2T data), bounded in what it keeps idle.
    pool: Mutex<BufPool>,
    last_rx_ms: AtomicU64,
    // Host read/write commands and bytes, for the SMART log.
    reads: AtomicU64,
    writes: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    sock: TcpStream,
}

impl Queue {
    pub(crate) fn last_rx_ms(&self) -> u64 {
        self.last_rx_ms.load(Ordering::Relaxed)
    }

    pub(crate) fn stats(&self) -> (u64, u64, u64, u64) {
        (
            self.reads.load(Ordering::Relaxed),
            self.writes.load(Ordering::Relaxed),
            self.read_bytes.load(Ordering::Relaxed),
            self.write_bytes.load(Ordering::Relaxed),
        )
    }

    pub(crate) fn shutdown(&self) {
        let _ = self.sock.shutdown(Shutdown::Both);
    }

    fn on_own_thread(&self) -> bool {
        OWNER.with(|o| o.get() == self as *const Queue as usize)
    }

    fn cqe(&self, cid: u16, status: Status, dw0: u32) -> Completion {
        Completion {
            dw0,
            dw1: 0,
            sqhd: self.sqhd.load(Ordering::Relaxed),
            sqid: self.qid.load(Ordering::Relaxed),
            cid,
            status: status.to_field(),
        }
    }

    /// Encode the reply to command `cid`: C2HData with `data` (if any and successful) and a
    /// CapsuleResp, unless the host disabled SQ flow control, in which case a successful
    /// data transfer ends with C2HData's SUCCESS flag instead (NVMe/TCP 1.0 §3.3.4).
    fn put_reply(&self, out: &mut Out, cid: u16, status: Status, dw0: u32, data: &[u8]) {
        if status.is_success() && !data.is_empty() {
            let success = dw0 == 0 && self.sq_flow_disabled.load(Ordering::Relaxed);
            tcp::encode_c2h_data(
                &mut out.buf,
                cid,
                0,
                data,
                true,
                success,
                self.digests,
                self.hpda,
            );
            if success {
                return;
            }
        }
        tcp::encode_capsule_resp(&mut out.buf, &self.cqe(cid, status, dw0), self.digests);
    }

    /// Encode a successful read's reply with its data left in `data` (a slot buffer) for
    /// the gather write; the buffer returns to the pool once sent.
    fn put_read_reply(&self, out: &mut Out, cid: u16, data: Vec<u8>) {
        let success = self.sq_flow_disabled.load(Ordering::Relaxed);
        let ddgst = tcp::encode_c2h_data_head(
            &mut out.buf,
            cid,
            0,
            &data,
            true,
            success,
            self.digests,
            self.hpda,
        );
        out.held_bytes += data.len();
        out.held.push((out.buf.len(), data));
        if let Some(d) = ddgst {
            out.buf.extend_from_slice(&d);
        }
        if !success {
            tcp::encode_capsule_resp(
                &mut out.buf,
                &self.cqe(cid, Status::SUCCESS, 0),
                self.digests,
            );
        }
    }

    fn after_put(&self, out: &mut Out) {
        if !self.on_own_thread() || out.pending() >= FLUSH_AT || out.held.len() >= GATHER_MAX_BUFS {
            out.flush();
            self.recycle(out);
        }
    }

    /// Return the buffers a gather write has sent to the pool (the pool lock is taken
    /// under the send lock, never the other way round).
    fn recycle(&self, out: &mut Out) {
        if !out.spent.is_empty() {
            let mut pool = lock(&self.pool);
            out.spent.drain(..).for_each(|b| pool.give(b));
        }
    }

    fn reply(&self, cid: u16, status: Status, dw0: u32, data: &[u8]) {
        let mut out = lock(&self.out);
        self.put_reply(&mut out, cid, status, dw0, data);
        self.after_put(&mut out);
    }

    /// Complete a command from outside the connection thread (asynchronous events).
    pub(crate) fn complete_async(&self, cid: u16, status: Status, dw0: u32) {
        self.reply(cid, status, dw0, &[]);
    }

    fn flush(&self) {
        let mut out = lock(&self.out);
        out.flush();
        self.recycle(&mut out);
    }
}

impl volume::Completion for Queue {
    fn complete(&self, tag: u64, result: IoResult) {
        let Some(slot) = self.slots.get().and_then(|s| s.get(tag as usize)) else {
            return;
        };
        let mut s = lock(slot);
        let status = match &result {
            Ok(()) => Status::SUCCESS,
            Err(e) => io_status(e, s.read_len > 0),
        };
        let stats = s.stats.take();
        if let Some((m, a)) = &stats {
            m.complete(a, !status.is_success());
        }
        tracing::trace!(target: trace::TARGET, qid = self.qid.load(Ordering::Relaxed),
            cid = s.cid, status = %status,
            latency_us = stats.map(|(_, a)| a.elapsed_ns() as f64 / 1e3), "nvmf: done");
        // Free the slot before the host can see the reply (it may reuse the queue entry at
        // once); whoever takes it next waits for this slot's lock, which is held until the
        // reply no longer needs the buffer.
        lock(&self.free).push(tag as u16);
        if status.is_success() && s.read_len >= GATHER_MIN {
            // The data is sent from the slot's buffer itself: the slot gives it up.
            let mut b = std::mem::take(&mut s.buf);
            b.truncate(s.read_len);
            let mut out = lock(&self.out);
            self.put_read_reply(&mut out, s.cid, b);
            self.after_put(&mut out);
            return;
        }
        let data = if status.is_success() {
            &s.buf[..s.read_len]
        } else {
            &[][..]
        };
        let mut out = lock(&self.out);
        self.put_reply(&mut out, s.cid, status, 0, data);
        self.after_put(&mut out);
        drop(out);
        // The reply holds a copy of the data: the buffer goes back to the pool, so a queue
        // keeps at most POOL_BYTES of idle buffers however deep it is.
        let b = std::mem::take(&mut s.buf);
        lock(&self.pool).give(b);
    }
}

/// Map a volume error to the NVMe status the host sees.
fn io_status(e: &IoError, read: bool) -> Status {
    match e {
        IoError::OutOfRange { .. } => Status::LBA_OUT_OF_RANGE,
        IoError::Invalid(_) => Status::INVALID_FIELD,
        IoError::ReadOnly => Status::WRITE_TO_READ_ONLY,
        IoError::Unsupported => Status::INVALID_OPCODE,
        IoError::Media(_) | IoError::Crypto(_) if read => Status::UNRECOVERED_READ_ERROR,
        IoError::Media(_) | IoError::Crypto(_) => Status::WRITE_FAULT,
        // Internal Path Error: retryable on another path.
        IoError::PathLost => Status::new(sct::PATH, 0x00, false),
    }
}

/// Why a connection ends.
enum End {
    /// The peer closed, the socket failed, or the host sent H2CTermReq.
    Closed,
    /// A fatal transport error: send C2HTermReq with FES/FEI and the offending header.
    Fatal { fes: u16, fei: u32, hdr: Vec<u8> },
}

fn fatal(fes: u16, fei: u32, hdr: &[u8]) -> End {
    End::Fatal {
        fes,
        fei,
        hdr: hdr.to_vec(),
    }
}

/// Host data of a command: in the capsule, or gathered by R2T/H2CData.
enum Payload<'a> {
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

/// A command waiting for H2CData after our R2T.
struct H2cPending {
    /// Bytes asked for: counted against [`limits::R2T_BUDGET`] until the data is here.
    len: usize,
    cmd: Command,
    buf: Vec<u8>,
    received: usize,
    digest_failed: bool,
}

struct Conn<'s> {
    target: Arc<TargetInner>,
    q: Arc<Queue>,
    rd: TcpStream,
    /// The read timeout now set on `rd`: the setup timeout until a queue is connected, then
    /// the rest of the PDU deadline while part of a PDU has arrived, none between PDUs.
    rd_timeout: Option<Duration>,
    /// When the PDU being received must be complete (set once part of it has arrived, moved
    /// later by the time spent flushing replies to a host that reads slowly).
    pdu_deadline: Option<Instant>,
    /// This connection's place in its listener's connection counts.
    slot: &'s ConnSlot,
    /// The host NQN this queue counts against ([`super::ConnLimits::per_host`]).
    host_counted: Option<String>,
    listener: SocketAddr,
    local_ip: IpAddr,
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
    ctrl: Option<Arc<Controller>>,
    subsys: Option<Arc<Subsystem>>,
    ns_gen: u64,
    ns: BTreeMap<u32, Arc<Namespace>>,
    sqsize: u32,
    head: u32,
    max_inline: usize,
    h2c: HashMap<u16, H2cPending>,
    /// Bytes of the R2Ts outstanding (buffers allocated, data not yet all here).
    r2t_bytes: usize,
    /// Writes whose R2T waits for budget, oldest first.
    r2t_waiting: VecDeque<Command>,
    next_ttag: u16,
    /// `q` as the completion handle requests carry (made once, not per request).
    done: Arc<dyn volume::Completion>,
}

/// Serve one accepted connection until it closes.
pub(crate) fn serve(
    target: &Arc<TargetInner>,
    sock: TcpStream,
    listener: SocketAddr,
    slot: &ConnSlot,
) {
    let local_ip = sock.local_addr().map(|a| a.ip()).unwrap_or(listener.ip());
    let Ok(wr) = sock.try_clone() else { return };
    let _ = wr.set_write_timeout(Some(WRITE_TIMEOUT));
    let Ok(shut) = sock.try_clone() else { return };
    let mut rd = sock;
    // A peer that connects and says nothing must not hold a thread forever: the timeout
    // stays until the queue's Fabrics Connect succeeds (`connect` clears it); from then on
    // keep-alive watches the controller.
    let setup = target.setup_timeout_ms.load(Ordering::Relaxed);
    let setup = Duration::from_millis(setup);
    let _ = rd.set_read_timeout(Some(setup));
    let ic = initialize(&mut rd);
    let ic = match ic {
        Ok(ic) => ic,
        Err(End::Fatal { fes, fei, hdr }) => {
            let mut b = Vec::new();
            tcp::encode_term_req(&mut b, true, fes, fei, &hdr);
            let mut w = wr;
            let _ = w.write_all(&b);
            let _ = w.shutdown(Shutdown::Both);
            return;
        }
        Err(End::Closed) => return,
    };
    let q = Arc::new(Queue {
        out: Mutex::new(Out::new(wr)),
        digests: ic.digests,
        hpda: ic.hpda,
        sq_flow_disabled: AtomicBool::new(false),
        qid: AtomicU16::new(0),
        sqhd: AtomicU16::new(0),
        slots: OnceLock::new(),
        free: Mutex::new(Vec::new()),
        pool: Mutex::new(BufPool::default()),
        last_rx_ms: AtomicU64::new(target.clock.now_ms()),
        reads: AtomicU64::new(0),
        writes: AtomicU64::new(0),
        read_bytes: AtomicU64::new(0),
        write_bytes: AtomicU64::new(0),
        sock: shut,
    });
    OWNER.with(|o| o.set(Arc::as_ptr(&q) as usize));
    let mut c = Conn {
        target: target.clone(),
        q: q.clone(),
        rd,
        rd_timeout: Some(setup),
        pdu_deadline: None,
        slot,
        host_counted: None,
        listener,
        local_ip,
        rbuf: vec![0u8; SETUP_RBUF_LEN],
        rstart: 0,
        rend: 0,
        ctrl: None,
        subsys: None,
        ns_gen: 0,
        ns: BTreeMap::new(),
        sqsize: 0,
        head: 0,
        max_inline: limits::ADMIN_INLINE_DATA,
        h2c: HashMap::new(),
        r2t_bytes: 0,
        r2t_waiting: VecDeque::new(),
        next_ttag: 0,
        done: q.clone(),
    };
    // A bug in this connection's handling must cost the host this connection, not leave it
    // open with no thread reading it (the writer half and the controller would live on).
    let end = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.run())) {
        Ok(end) => end,
        Err(_) => {
            tracing::error!(
                peer = ?q.sock.peer_addr().ok(),
                "internal error serving an NVMe/TCP connection: closing it"
            );
            Err(End::Closed)
        }
    };
    if let Err(End::Fatal { fes, fei, hdr }) = end {
        warn!(
            peer = ?q.sock.peer_addr().ok(),
            fes, fei, "fatal NVMe/TCP transport error: terminating the connection"
        );
        let mut out = lock(&q.out);
        out.flush();
        tcp::encode_term_req(&mut out.buf, true, fes, fei, &hdr);
        out.flush();
    } else {
        q.flush();
    }
    q.shutdown();
    OWNER.with(|o| o.set(0));
    c.close();
}

/// Connection initialization (NVMe/TCP 1.0 §3.3.1): the host's ICReq, our ICResp.
fn initialize(rd: &mut TcpStream) -> Result<IcReq, End> {
    let mut b = [0u8; tcp::IC_LEN];
    rd.read_exact(&mut b[..tcp::CH_LEN])
        .map_err(|_| End::Closed)?;
    let ch = CommonHeader::decode(&b);
    if ch.pdu_type != pdu_type::IC_REQ {
        // Nothing but ICReq may come first.
        return Err(fatal(fes::PDU_SEQUENCE_ERROR, 0, &b[..tcp::CH_LEN]));
    }
    if ch.hlen as usize != tcp::IC_LEN {
        return Err(fatal(
            fes::INVALID_HEADER_FIELD,
            ch_offset::HLEN,
            &b[..tcp::CH_LEN],
        ));
    }
    if ch.plen as usize != tcp::IC_LEN {
        return Err(fatal(
            fes::INVALID_HEADER_FIELD,
            ch_offset::PLEN,
            &b[..tcp::CH_LEN],
        ));
    }
    rd.read_exact(&mut b[tcp::CH_LEN..])
        .map_err(|_| End::Closed)?;
    let req = IcReq::decode(&b);
    if req.pfv != 0 {
        return Err(fatal(fes::UNSUPPORTED_PARAMETER, icreq_offset::PFV, &b));
    }
    if req.hpda > tcp::MAX_PDA {
        return Err(fatal(fes::UNSUPPORTED_PARAMETER, icreq_offset::HPDA, &b));
    }
    let mut resp = Vec::with_capacity(tcp::IC_LEN);
    IcResp {
        pfv: 0,
        cpda: 0,
        // Both digests are supported; the connection uses what the host asked for.
        digests: req.digests,
        maxh2cdata: limits::MAX_H2C_DATA,
    }
    .encode(&mut resp);
    rd.write_all(&resp).map_err(|_| End::Closed)?;
    Ok(req)
}

impl Conn<'_> {
    /// The span a command's submission runs in (see [`trace`]).
    fn io_span(&self, cid: u16) -> tracing::span::EnteredSpan {
        tracing::trace_span!(target: trace::TARGET, "nvmf",
            qid = self.q.qid.load(Ordering::Relaxed), cid)
        .entered()
    }

    fn close(&mut self) {
        if let Some(h) = self.host_counted.take() {
            self.target.release_host_queue(&h);
        }
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

    /// Make `n` bytes available at `rstart`, reading (and flushing replies) as needed.
    fn need(&mut self, n: usize) -> Result<(), End> {
        while self.rend - self.rstart < n {
            if n > self.rbuf.len() {
                // Before Connect the buffer is small; PDU validation bounds `n`.
                self.rbuf.resize(RBUF_LEN.max(n), 0);
            }
            if self.rstart + n > self.rbuf.len() {
                self.rbuf.copy_within(self.rstart..self.rend, 0);
                self.rend -= self.rstart;
                self.rstart = 0;
            }
            // About to block: send what the batch produced. Time spent here is the host
            // being slow to read, not to send: it does not count against the PDU deadline
            // (the write timeout bounds it).
            let flush_start = self.pdu_deadline.map(|_| Instant::now());
            self.q.flush();
            if let (Some(d), Some(t0)) = (self.pdu_deadline.as_mut(), flush_start) {
                *d += t0.elapsed();
            }
            self.arm_pdu_deadline()?;
            match self.rd.read(&mut self.rbuf[self.rend..]) {
                Ok(0) => return Err(End::Closed),
                // A signal is no reason to drop a host (sockets with a receive timeout are
                // not restarted after a signal handler runs).
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    if self.pdu_deadline.is_some()
                        && matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        )
                    {
                        warn!(
                            peer = ?self.q.sock.peer_addr().ok(),
                            "host stalled in the middle of a PDU: closing the connection"
                        );
                    }
                    return Err(End::Closed);
                }
                Ok(k) => {
                    self.rend += k;
                    self.q
                        .last_rx_ms
                        .store(self.target.clock.now_ms(), Ordering::Relaxed);
                }
            }
            if self.ctrl.as_ref().is_some_and(|c| c.is_dead()) {
                return Err(End::Closed);
            }
        }
        Ok(())
    }

    /// Set the read timeout for the next read of a connected queue: none between PDUs (an
    /// idle queue is keep-alive's business), the rest of the PDU deadline once part of a PDU
    /// has arrived. A deadline, not a per-read timeout, so a host trickling bytes cannot
    /// hold the thread; before Connect the setup timeout set in `serve` stays.
    fn arm_pdu_deadline(&mut self) -> Result<(), End> {
        if self.ctrl.is_none() {
            return Ok(());
        }
        let want = if self.rend > self.rstart {
            let now = Instant::now();
            let ms = self.target.pdu_timeout_ms.load(Ordering::Relaxed);
            let deadline = *self
                .pdu_deadline
                .get_or_insert_with(|| now + Duration::from_millis(ms));
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                warn!(
                    peer = ?self.q.sock.peer_addr().ok(),
                    "host stalled in the middle of a PDU: closing the connection"
                );
                return Err(End::Closed);
            }
            Some(left)
        } else {
            None
        };
        if want != self.rd_timeout {
            let _ = self.rd.set_read_timeout(want);
            self.rd_timeout = want;
        }
        Ok(())
    }

    fn run(&mut self) -> Result<(), End> {
        let dg = self.q.digests;
        let hd = if dg.header { tcp::DIGEST_LEN } else { 0 };
        let dd = if dg.data { tcp::DIGEST_LEN } else { 0 };
        loop {
            self.pdu_deadline = None;
            self.need(tcp::CH_LEN)?;
            let ch = CommonHeader::decode(&self.rbuf[self.rstart..]);
            let mut chb = [0u8; tcp::CH_LEN];
            chb.copy_from_slice(&self.rbuf[self.rstart..self.rstart + tcp::CH_LEN]);
            match ch.pdu_type {
                pdu_type::CAPSULE_CMD | pdu_type::H2C_DATA => {}
                pdu_type::H2C_TERM_REQ => {
                    debug!("host terminated the connection (H2CTermReq)");
                    return Err(End::Closed);
                }
                pdu_type::IC_REQ => return Err(fatal(fes::PDU_SEQUENCE_ERROR, 0, &chb)),
                _ => return Err(fatal(fes::INVALID_HEADER_FIELD, ch_offset::TYPE, &chb)),
            }
            let hlen = ch.hlen as usize;
            if Some(hlen) != tcp::expected_hlen(ch.pdu_type) {
                return Err(fatal(fes::INVALID_HEADER_FIELD, ch_offset::HLEN, &chb));
            }
            if (ch.flags & flags::HDGSTF != 0) != dg.header {
                return Err(fatal(fes::INVALID_HEADER_FIELD, ch_offset::FLAGS, &chb));
            }
            if hd != 0 {
                // Check the header digest before trusting PLEN or PDO: a bit flipped there
                // would otherwise have us wait for bytes the host never sends.
                self.need(hlen + hd)?;
                let h = &self.rbuf[self.rstart..self.rstart + hlen + hd];
                let want = u32::from_le_bytes([h[hlen], h[hlen + 1], h[hlen + 2], h[hlen + 3]]);
                if digest::crc32c(&h[..hlen]) != want {
                    return Err(fatal(fes::HEADER_DIGEST_ERROR, 0, &h[..hlen]));
                }
            }
            let plen = ch.plen as usize;
            if plen < hlen + hd {
                return Err(fatal(fes::INVALID_HEADER_FIELD, ch_offset::PLEN, &chb));
            }
            let has_data = plen > hlen + hd;
            let pdo = ch.pdo as usize;
            let mut dlen = 0;
            if has_data {
                if (ch.flags & flags::DDGSTF != 0) != dg.data {
                    return Err(fatal(fes::INVALID_HEADER_FIELD, ch_offset::FLAGS, &chb));
                }
                if pdo < hlen + hd || pdo + dd >= plen {
                    return Err(fatal(fes::INVALID_HEADER_FIELD, ch_offset::PDO, &chb));
                }
                dlen = plen - pdo - dd;
                let max = if ch.pdu_type == pdu_type::CAPSULE_CMD {
                    self.max_inline
                } else {
                    limits::MAX_H2C_DATA as usize
                };
                if dlen > max {
                    return Err(fatal(fes::DATA_LIMIT_EXCEEDED, 0, &chb));
                }
            } else if ch.pdu_type == pdu_type::H2C_DATA {
                // An H2CData PDU without data.
                return Err(fatal(fes::INVALID_HEADER_FIELD, ch_offset::PLEN, &chb));
            }
            if ch.pdu_type == pdu_type::H2C_DATA {
                // Data nobody asked for is refused before it is read: no buffer grows for it
                // (before Connect the receive buffer stays small).
                self.need(hlen)?;
                let h = DataHeader::decode(&self.rbuf[self.rstart..self.rstart + hlen]);
                if !self.h2c.contains_key(&h.ttag) {
                    let hdr = &self.rbuf[self.rstart..self.rstart + hlen];
                    return Err(fatal(fes::INVALID_HEADER_FIELD, data_offset_of::TTAG, hdr));
                }
            }
            self.need(plen)?;
            let buf = std::mem::take(&mut self.rbuf);
            let pdu = &buf[self.rstart..self.rstart + plen];
            // One clock read per PDU for the statistics and QoS layers below (an inline
            // completion then costs no second one).
            let batch = crate::telemetry::clock::batch();
            let r = self.pdu(&ch, pdu, hlen, pdo, dlen);
            drop(batch);
            self.rbuf = buf;
            self.rstart += plen;
            r?;
        }
    }

    fn pdu(
        &mut self,
        ch: &CommonHeader,
        pdu: &[u8],
        hlen: usize,
        pdo: usize,
        dlen: usize,
    ) -> Result<(), End> {
        // PDO means nothing in a PDU without data, and may point anywhere.
        let data = if dlen == 0 {
            &[][..]
        } else {
            &pdu[pdo..pdo + dlen]
        };
        let data_ok = !self.q.digests.data || dlen == 0 || {
            let d = &pdu[pdo + dlen..pdo + dlen + 4];
            digest::crc32c(data) == u32::from_le_bytes([d[0], d[1], d[2], d[3]])
        };
        match ch.pdu_type {
            pdu_type::CAPSULE_CMD => {
                let cmd = Command::decode(&pdu[tcp::CH_LEN..tcp::CAPSULE_CMD_HLEN]);
                if self.sqsize > 0 {
                    self.head = (self.head + 1) % self.sqsize;
                    self.q.sqhd.store(self.head as u16, Ordering::Relaxed);
                }
                if !data_ok {
                    // A data digest error is not fatal: the command fails with a transient
                    // transport error the host may retry (NVMe/TCP 1.0 §3.6.1).
                    self.q
                        .reply(cmd.cid, Status::TRANSIENT_TRANSPORT_ERROR, 0, &[]);
                    return Ok(());
                }
                self.capsule(cmd, data)
            }
            _ => self.h2c_data(pdu, &pdu[..hlen], data, data_ok),
        }
    }

    /// H2CData (§3.6.2.7): data for a command we sent an R2T for.
    fn h2c_data(&mut self, pdu: &[u8], hdr: &[u8], data: &[u8], ok: bool) -> Result<(), End> {
        let h = DataHeader::decode(pdu);
        let Some(p) = self.h2c.get_mut(&h.ttag) else {
            return Err(fatal(fes::INVALID_HEADER_FIELD, data_offset_of::TTAG, hdr));
        };
        if p.cmd.cid != h.cccid {
            return Err(fatal(fes::INVALID_HEADER_FIELD, data_offset_of::CCCID, hdr));
        }
        if h.datal as usize != data.len() {
            return Err(fatal(fes::INVALID_HEADER_FIELD, data_offset_of::DATAL, hdr));
        }
        let off = h.datao as usize;
        if off != p.received || off + data.len() > p.buf.len() {
            return Err(fatal(fes::DATA_OUT_OF_RANGE, 0, hdr));
        }
        p.buf[off..off + data.len()].copy_from_slice(data);
        p.received += data.len();
        p.digest_failed |= !ok;
        if p.received < p.buf.len() {
            return Ok(());
        }
        let p = self.h2c.remove(&h.ttag).expect("looked up above");
        self.r2t_bytes -= p.len;
        let r = if p.digest_failed {
            self.q
                .reply(p.cmd.cid, Status::TRANSIENT_TRANSPORT_ERROR, 0, &[]);
            lock(&self.q.pool).give(p.buf);
            Ok(())
        } else {
            self.execute(p.cmd, Payload::Owned(p.buf))
        };
        self.grant_r2ts();
        r
    }

    /// Send the R2Ts that waited for budget, oldest first, as far as the budget allows.
    fn grant_r2ts(&mut self) {
        while let Some(cmd) = self.r2t_waiting.front() {
            let len = cmd.sgl.len as usize;
            if !self.h2c.is_empty() && self.r2t_bytes + len > limits::R2T_BUDGET {
                return;
            }
            let cmd = self.r2t_waiting.pop_front().expect("looked at above");
            self.send_r2t(cmd, len);
        }
    }

    /// Ask for a command's data: one R2T covering all of it (MAXH2CDATA allows one H2CData
    /// PDU; a host may still split it).
    fn send_r2t(&mut self, cmd: Command, len: usize) {
        let ttag = self.alloc_ttag();
        {
            let mut out = lock(&self.q.out);
            tcp::encode_r2t(&mut out.buf, cmd.cid, ttag, 0, len as u32, self.q.digests);
        }
        let buf = lock(&self.q.pool).take(len);
        self.r2t_bytes += len;
        self.h2c.insert(
            ttag,
            H2cPending {
                len,
                cmd,
                buf,
                received: 0,
                digest_failed: false,
            },
        );
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

    fn capsule(&mut self, cmd: Command, data: &[u8]) -> Result<(), End> {
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
                self.q
                    .reply(cmd.cid, Status::SGL_DESCRIPTOR_TYPE_INVALID, 0, &[]);
                return Ok(());
            }
            // ICDOFF is 0, so the SGL offset is relative to the start of the data.
            let (off, len) = (sg.addr as usize, sg.len as usize);
            if sg.addr > data.len() as u64 || off + len > data.len() {
                self.q
                    .reply(cmd.cid, Status::DATA_SGL_LENGTH_INVALID, 0, &[]);
                return Ok(());
            }
            return self.execute(cmd, Payload::Borrowed(&data[off..off + len]));
        }
        if sg.kind >> 4 != sgl::TYPE_TRANSPORT_DATA_BLOCK {
            self.q
                .reply(cmd.cid, Status::SGL_DESCRIPTOR_TYPE_INVALID, 0, &[]);
            return Ok(());
        }
        let len = sg.len as usize;
        if len > limits::MAX_TRANSFER {
            self.q.reply(cmd.cid, Status::INVALID_FIELD, 0, &[]);
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

    fn alloc_ttag(&mut self) -> u16 {
        loop {
            let t = self.next_ttag;
            self.next_ttag = self.next_ttag.wrapping_add(1);
            if !self.h2c.contains_key(&t) {
                return t;
            }
        }
    }

    fn execute(&mut self, cmd: Command, data: Payload<'_>) -> Result<(), End> {
        let q = self.q.clone();
        if cmd.opcode == admin_opcode::FABRICS {
            let (status, v) = self.fabrics(&cmd, data.as_slice());
            let mut c = q.cqe(cmd.cid, status, v as u32);
            c.dw1 = (v >> 32) as u32;
            let mut out = lock(&q.out);
            tcp::encode_capsule_resp(&mut out.buf, &c, q.digests);
            q.after_put(&mut out);
            return Ok(());
        }
        let Some(ctrl) = self.ctrl.clone() else {
            // Nothing but Connect before Connect.
            q.reply(cmd.cid, Status::COMMAND_SEQUENCE_ERROR, 0, &[]);
            return Ok(());
        };
        if q.qid.load(Ordering::Relaxed) == 0 {
            match ctrl.admin(&cmd, data.as_slice()) {
                AdminReply::Done(status, dw0, out) => {
                    let out = self.clip_to_sgl(&cmd, &out);
                    match out {
                        Ok(d) => q.reply(cmd.cid, status, dw0, d),
                        Err(s) => q.reply(cmd.cid, s, 0, &[]),
                    }
                }
                AdminReply::Parked => {}
            }
            return Ok(());
        }
        if let Some(status) = self.io(&cmd, data) {
            q.reply(cmd.cid, status, 0, &[]);
        }
        Ok(())
    }

    /// Data for the host goes through a transport SGL; return at most its length.
    fn clip_to_sgl<'b>(&self, cmd: &Command, data: &'b [u8]) -> Result<&'b [u8], Status> {
        if data.is_empty() {
            return Ok(data);
        }
        if cmd.sgl.kind >> 4 != sgl::TYPE_TRANSPORT_DATA_BLOCK {
            return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID);
        }
        Ok(&data[..data.len().min(cmd.sgl.len as usize)])
    }

    // ---- Fabrics commands (NVMe-oF 1.1 §3) ----

    fn fabrics(&mut self, cmd: &Command, data: &[u8]) -> (Status, u64) {
        let qid = self.q.qid.load(Ordering::Relaxed);
        match cmd.fctype() {
            fctype::CONNECT => self.connect(cmd, data),
            fctype::PROPERTY_GET | fctype::PROPERTY_SET if self.ctrl.is_none() => {
                (Status::COMMAND_SEQUENCE_ERROR, 0)
            }
            // Properties are reached only through the admin queue.
            fctype::PROPERTY_GET | fctype::PROPERTY_SET if qid != 0 => (Status::INVALID_FIELD, 0),
            fctype::PROPERTY_GET => {
                if Property::size_field(cmd) > 1 {
                    return (Status::INVALID_FIELD, 0);
                }
                let p = Property::from_command(cmd);
                let ctrl = self.ctrl.as_ref().expect("checked above");
                match ctrl.property_get(p.offset, p.eight_bytes) {
                    // The value is returned in CQE Dwords 0-1 (NVMe-oF 1.1 Figure 26).
                    Ok(v) => (Status::SUCCESS, v),
                    Err(s) => (s, 0),
                }
            }
            fctype::PROPERTY_SET => {
                if Property::size_field(cmd) > 1 {
                    return (Status::INVALID_FIELD, 0);
                }
                let p = Property::from_command(cmd);
                let ctrl = self.ctrl.as_ref().expect("checked above");
                (ctrl.property_set(p.offset, p.value), 0)
            }
            _ => (Status::INVALID_OPCODE, 0),
        }
    }

    fn connect(&mut self, cmd: &Command, data: &[u8]) -> (Status, u64) {
        let bad_data = |off| {
            (
                Status::CONNECT_INVALID_PARAMETERS,
                connect_invalid_param_dw0(true, off) as u64,
            )
        };
        if self.ctrl.is_some() {
            return (Status::COMMAND_SEQUENCE_ERROR, 0);
        }
        let c = Connect::from_command(cmd);
        if c.recfmt != 0 {
            return (Status::CONNECT_INCOMPATIBLE_FORMAT, 0);
        }
        if data.len() < fabrics::CONNECT_DATA_LEN {
            return (Status::DATA_SGL_LENGTH_INVALID, 0);
        }
        let d = ConnectData::decode(data);
        let Some(subsys) = self
            .target
            .find_subsystem(&d.subnqn)
            .filter(|s| s.reachable_on(&self.listener))
        else {
            return bad_data(connect_data_offset::SUBNQN);
        };
        if !subsys.host_allowed(&d.hostnqn) {
            warn!(
                subnqn = d.subnqn,
                hostnqn = d.hostnqn,
                "connect refused: host not allowed"
            );
            return (Status::CONNECT_INVALID_HOST, 0);
        }
        if !self.target.acquire_host_queue(&d.hostnqn) {
            warn!(
                subnqn = d.subnqn,
                hostnqn = d.hostnqn,
                "connect refused: the host holds as many queues as it may"
            );
            return (Status::CONNECT_CONTROLLER_BUSY, 0);
        }
        // Counted from here; released when the connection ends (or below on failure).
        self.host_counted = Some(d.hostnqn.clone());
        let r = self.connect_counted(&c, &d, subsys);
        if r.0 != Status::SUCCESS {
            if let Some(h) = self.host_counted.take() {
                self.target.release_host_queue(&h);
            }
        }
        r
    }

    fn connect_counted(
        &mut self,
        c: &Connect,
        d: &ConnectData,
        subsys: Arc<Subsystem>,
    ) -> (Status, u64) {
        let bad_data = |off| {
            (
                Status::CONNECT_INVALID_PARAMETERS,
                connect_invalid_param_dw0(true, off) as u64,
            )
        };
        let bad_sqe = |off| {
            (
                Status::CONNECT_INVALID_PARAMETERS,
                connect_invalid_param_dw0(false, off) as u64,
            )
        };
        let entries = c.sqsize as u32 + 1;
        let max = if c.qid == 0 {
            limits::MAX_ADMIN_QUEUE_ENTRIES
        } else {
            limits::MAX_QUEUE_ENTRIES
        };
        if c.sqsize == 0 || entries > max {
            return bad_sqe(connect_sqe_offset::SQSIZE);
        }
        let ctrl = if c.qid == 0 {
            if d.cntlid != fabrics::CNTLID_DYNAMIC {
                return bad_data(connect_data_offset::CNTLID);
            }
            let ctrl = Controller::new(
                &self.target,
                subsys.clone(),
                d.hostnqn.clone(),
                c.kato,
                self.local_ip,
                &self.q,
            );
            subsys.insert_controller(ctrl.clone());
            ctrl
        } else {
            if subsys.discovery {
                return bad_sqe(connect_sqe_offset::QID);
            }
            let Some(ctrl) = subsys.controller(d.cntlid) else {
                return bad_data(connect_data_offset::CNTLID);
            };
            if ctrl.hostnqn != d.hostnqn {
                return bad_data(connect_data_offset::HOSTNQN);
            }
            if !ctrl.ready() {
                return (Status::COMMAND_SEQUENCE_ERROR, 0);
            }
            self.q.qid.store(c.qid, Ordering::Relaxed);
            if !ctrl.attach_io_queue(c.qid, &self.q) {
                self.q.qid.store(0, Ordering::Relaxed);
                return bad_sqe(connect_sqe_offset::QID);
            }
            let slots: Box<[Mutex<Slot>]> = (0..entries).map(|_| Mutex::default()).collect();
            let _ = self.q.slots.set(slots);
            *lock(&self.q.free) = (0..entries as u16).rev().collect();
            self.max_inline = limits::IO_INLINE_DATA;
            ctrl
        };
        self.q.sq_flow_disabled.store(
            c.cattr & fabrics::CATTR_DISABLE_SQ_FLOW != 0,
            Ordering::Relaxed,
        );
        self.sqsize = entries;
        self.head = 1 % entries;
        self.q.sqhd.store(self.head as u16, Ordering::Relaxed);
        let cntlid = ctrl.cntlid;
        debug!(cntlid, qid = c.qid, sqsize = c.sqsize, "queue connected");
        // Set up: an idle connected queue is keep-alive's business, not a read timeout's.
        let _ = self.rd.set_read_timeout(None);
        self.rd_timeout = None;
        self.slot.connected();
        if self.rbuf.len() < RBUF_LEN {
            self.rbuf.resize(RBUF_LEN, 0);
        }
        self.ctrl = Some(ctrl);
        self.subsys = Some(subsys);
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

    /// Execute an I/O command; `None` when it went to the volume (the completion replies).
    fn io(&mut self, cmd: &Command, data: Payload<'_>) -> Option<Status> {
        if cmd.opcode == admin_opcode::FABRICS {
            return Some(Status::INVALID_OPCODE);
        }
        if cmd.fuse() != 0 {
            return Some(Status::INVALID_FIELD);
        }
        self.refresh_namespaces();
        if cmd.opcode == io_opcode::FLUSH && cmd.nsid == 0xFFFF_FFFF {
            // Flush every namespace (NVM Command Set 1.0 §3.2.2, broadcast NSID).
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
        match cmd.opcode {
            io_opcode::READ | io_opcode::WRITE | io_opcode::WRITE_ZEROES => {
                let len = cmd.nlb() as u64 * bs;
                let Some(offset) = cmd.slba().checked_mul(bs) else {
                    return Some(Status::LBA_OUT_OF_RANGE);
                };
                match cmd.opcode {
                    io_opcode::READ => {
                        if len as usize > limits::MAX_TRANSFER {
                            return Some(Status::INVALID_FIELD);
                        }
                        if cmd.sgl.kind >> 4 != sgl::TYPE_TRANSPORT_DATA_BLOCK {
                            return Some(Status::SGL_DESCRIPTOR_TYPE_INVALID);
                        }
                        if (cmd.sgl.len as u64) < len {
                            return Some(Status::DATA_SGL_LENGTH_INVALID);
                        }
                        self.q.reads.fetch_add(1, Ordering::Relaxed);
                        self.q.read_bytes.fetch_add(len, Ordering::Relaxed);
                        self.submit(&ns, IoKind::Read, offset, len as usize, cmd.cid, data)
                    }
                    io_opcode::WRITE => {
                        if data.as_slice().len() as u64 != len {
                            return Some(Status::DATA_SGL_LENGTH_INVALID);
                        }
                        self.q.writes.fetch_add(1, Ordering::Relaxed);
                        self.q.write_bytes.fetch_add(len, Ordering::Relaxed);
                        if cmd.cdw12 & (1 << 30) != 0 {
                            // FUA: the write must be durable before completion.
                            let mut buf = data.as_slice().to_vec();
                            // SAFETY: submit_wait returns after completion; `buf` outlives it.
                            let seg = unsafe { Segment::from_slice(&mut buf) };
                            let req =
                                IoRequest::new(IoKind::Write, offset, len, 0).with_segments([seg]);
                            let r = ns.volume.submit_wait(req).and_then(|()| {
                                ns.volume
                                    .submit_wait(IoRequest::new(IoKind::Flush, 0, 0, 0))
                            });
                            return Some(r.err().map_or(Status::SUCCESS, |e| io_status(&e, false)));
                        }
                        self.submit(&ns, IoKind::Write, offset, len as usize, cmd.cid, data)
                    }
                    _ => {
                        let len = cmd.nlb() as u64 * bs;
                        self.submit_nodata(&ns, IoKind::WriteZeroes, offset, len, cmd.cid)
                    }
                }
            }
            io_opcode::FLUSH => self.submit_nodata(&ns, IoKind::Flush, 0, 0, cmd.cid),
            io_opcode::DATASET_MANAGEMENT => Some(self.dsm(&ns, cmd, data.as_slice())),
            _ => Some(Status::INVALID_OPCODE),
        }
    }

    /// Dataset Management (NVM Command Set 1.0 §3.2.3): only the Attribute – Deallocate
    /// bit acts; the other attributes are hints nacre may ignore.
    fn dsm(&self, ns: &Namespace, cmd: &Command, data: &[u8]) -> Status {
        let nr = (cmd.cdw10 & 0xFF) as usize + 1;
        if data.len() < nr * 16 {
            return Status::DATA_SGL_LENGTH_INVALID;
        }
        if cmd.cdw11 & (1 << 2) == 0 {
            return Status::SUCCESS;
        }
        let bs = ns.block_size as u64;
        for r in data[..nr * 16].chunks_exact(16) {
            let nlb = get_u32(r, 4) as u64;
            let slba = get_u64(r, 8);
            if nlb == 0 {
                continue;
            }
            let (Some(off), Some(len)) = (slba.checked_mul(bs), nlb.checked_mul(bs)) else {
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

    fn alloc_slot(&self) -> Option<u16> {
        lock(&self.q.free).pop()
    }

    fn submit(
        &mut self,
        ns: &Namespace,
        kind: IoKind,
        offset: u64,
        len: usize,
        cid: u16,
        data: Payload<'_>,
    ) -> Option<Status> {
        let Some(tag) = self.alloc_slot() else {
            warn!("host exceeded its queue size");
            return Some(Status::INTERNAL_ERROR);
        };
        let slots = self.q.slots.get()?;
        let seg = {
            let mut s = lock(&slots[tag as usize]);
            s.cid = cid;
            match (kind, data) {
                (IoKind::Write, Payload::Owned(v)) => s.buf = v,
                (IoKind::Write, d) => {
                    let mut b = lock(&self.q.pool).take(0);
                    b.extend_from_slice(d.as_slice());
                    s.buf = b;
                }
                _ => s.buf = lock(&self.q.pool).take(len),
            }
            s.read_len = if kind == IoKind::Read { len } else { 0 };
            s.stats = ns
                .path
                .metrics()
                .map(|m| (m.clone(), m.arrive(kind, len as u64)));
            // SAFETY: the slot's buffer is not touched again until the volume calls
            // `complete` for this tag (the slot is off the free list until then), so the
            // segment stays valid and exclusively the volume's while the request runs.
            unsafe { Segment::new(s.buf.as_mut_ptr(), len) }
        };
        let req = IoRequest::new(kind, offset, len as u64, tag as u64).with_segments([seg]);
        let _span = self.io_span(cid);
        ns.path.submit(req, &self.done);
        None
    }

    fn submit_nodata(
        &mut self,
        ns: &Namespace,
        kind: IoKind,
        offset: u64,
        len: u64,
        cid: u16,
    ) -> Option<Status> {
        let Some(tag) = self.alloc_slot() else {
            warn!("host exceeded its queue size");
            return Some(Status::INTERNAL_ERROR);
        };
        {
            let slots = self.q.slots.get()?;
            let mut s = lock(&slots[tag as usize]);
            s.cid = cid;
            s.read_len = 0;
            s.stats = ns.path.metrics().map(|m| (m.clone(), m.arrive(kind, len)));
        }
        let req = IoRequest::new(kind, offset, len, tag as u64);
        let _span = self.io_span(cid);
        ns.path.submit(req, &self.done);
        None
    }
}
