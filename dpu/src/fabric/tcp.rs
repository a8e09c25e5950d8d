//! One NVMe/TCP queue: a TCP connection carrying one submission/completion queue pair
//! (NVMe/TCP Transport 1.0 §3.3: one connection per queue).
//!
//! Life of a connection:
//! 1. Connection initialisation (§3.6.2.2-3): the host sends ICReq with HPDA 0 (Linux nvmet
//!    requires it), the digests it wants and MAXR2T 0 (one R2T per command at a time), and
//!    reads ICResp: CPDA (where our data PDUs must start), the digests the controller
//!    enabled (they must be the ones we asked for) and MAXH2CDATA.
//! 2. Two threads per connection. The *writer* owns the socket's send side: submitters only
//!    append encoded PDUs to a buffer and wake it, so a submitter never blocks on the network
//!    and many PDUs leave in one `write`. The *reader* owns the receive side: it parses every
//!    PDU, copies C2HData into the request's memory (from the read buffer, or from a small
//!    private chunk the socket is read into: the memory may be a guest's, which no Rust
//!    reference may cover), answers R2Ts with H2CData, and completes commands (CapsuleResp,
//!    or C2HData with SUCCESS, §3.6.2.8).
//! 3. Commands in flight live in a slot table of `depth` entries. The CID is the slot index
//!    plus a 6-bit generation that changes each time the slot is reused, so a completion for
//!    a command that is not (or no longer) outstanding is recognised as such, and a slot is
//!    only reused after its completion has been fully processed. Commands beyond `depth` wait
//!    in an overflow list and go out as slots free.
//! 4. Any transport or protocol error (a malformed PDU, a digest mismatch, an unknown CID, a
//!    C2HTermReq, EOF) is fatal to the connection (§3.6.2.4): the host sends H2CTermReq where
//!    it makes sense and closes. When the reader exits it takes every outstanding command out
//!    of the table, under the same lock submitters use, and hands them to the owner: nothing
//!    can touch a command's memory after that, so the owner may safely resubmit it elsewhere.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nacre_shared::nvme::command::{sgl, PSDT_SGL};
use nacre_shared::nvme::fabrics::{Connect, ConnectData};
use nacre_shared::nvme::{admin_opcode, Completion as Cqe, SglDescriptor};
use nacre_shared::nvme_tcp::{
    self as pdu, digest::crc32c, fes, flags, pdu_type, CommonHeader, DataHeader, IcReq, IcResp,
    CH_LEN, DIGEST_LEN, IC_LEN,
};
use tracing::{debug, warn};

use crate::telemetry::trace::TARGET as TRACE;

use super::cmd::{AdminWait, Cmd, Dir, IoData, Target};
use super::queue::{cid_of, split_cid, FabricQueue};
pub use super::queue::{QueueOwner, QueueParams, MAX_DEPTH};
use super::FabricError;
use crate::volume::{copy_to_segments, IoError};

/// In-capsule data the admin queue always accepts (NVMe/TCP 1.0 §3.4: 8 KiB).
pub const ADMIN_ICD: usize = 8192;
/// The largest data PDU nacre accepts from a controller. Transfers are split by the host at
/// the maximum transfer size (at most 1 MiB), and a controller never sends more than a
/// command asked for, so this only bounds what a broken peer can make us read.
const MAX_RX_DATA: usize = 1 << 20;

/// Negotiated at ICReq/ICResp.
#[derive(Debug, Clone, Copy)]
struct Negotiated {
    cpda: u8,
    maxh2cdata: usize,
}

struct Slot {
    gen: u8,
    cmd: Option<Cmd>,
    /// When the command went out (for the I/O timeout).
    issued: Instant,
}

struct Slots {
    entries: Vec<Slot>,
    free: Vec<u16>,
    overflow: VecDeque<Cmd>,
    closed: bool,
}

struct Tx {
    buf: Vec<u8>,
    /// The writer is asleep on the condition variable: only then is a wake-up (a futex
    /// system call) needed; while it is sending it picks new PDUs up by itself.
    waiting: bool,
    closed: bool,
}

pub struct QueueConn {
    pub qid: u16,
    session: u64,
    stream: TcpStream,
    params: QueueParams,
    neg: Negotiated,
    slots: Mutex<Slots>,
    tx: Mutex<Tx>,
    tx_cv: Condvar,
    owner: Weak<dyn QueueOwner>,
    dead: AtomicBool,
    /// Commands completed on this connection (observability).
    pub completed: AtomicU64,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for QueueConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueConn")
            .field("qid", &self.qid)
            .field("session", &self.session)
            .finish()
    }
}

/// A fatal protocol error: what to put in the H2CTermReq (if anything) and why.
struct Fatal {
    reason: String,
    term: Option<(u16, u32, Vec<u8>)>,
}

impl Fatal {
    fn io(e: std::io::Error) -> Self {
        Fatal {
            reason: format!("connection lost: {e}"),
            term: None,
        }
    }
    fn proto(reason: impl Into<String>, fes: u16, fei: u32, hdr: &[u8]) -> Self {
        Fatal {
            reason: reason.into(),
            term: Some((fes, fei, hdr.to_vec())),
        }
    }
    fn quiet(reason: impl Into<String>) -> Self {
        Fatal {
            reason: reason.into(),
            term: None,
        }
    }
}

impl QueueConn {
    /// Connect TCP, exchange ICReq/ICResp, start the reader and writer, and send Fabrics
    /// Connect (NVMe-oF 1.1 §3.3). Returns the queue and the Connect completion (CNTLID in
    /// Dword 0 for the admin queue).
    pub fn open(
        addr: SocketAddr,
        params: QueueParams,
        connect_data: &ConnectData,
        session: u64,
        owner: Weak<dyn QueueOwner>,
    ) -> Result<(Arc<QueueConn>, Cqe), FabricError> {
        let deadline = Instant::now() + params.timeout;
        let stream = TcpStream::connect_timeout(&addr, params.timeout)
            .map_err(|e| FabricError::Connect(format!("cannot connect to {addr}: {e}")))?;
        let _ = stream.set_nodelay(true);
        let neg = initialize(&stream, &params)?;
        let depth = params.depth.clamp(1, MAX_DEPTH);
        let q = Arc::new(QueueConn {
            qid: params.qid,
            session,
            stream: stream.try_clone().map_err(FabricError::io)?,
            neg,
            slots: Mutex::new(Slots {
                entries: (0..depth)
                    .map(|_| Slot {
                        gen: 0,
                        cmd: None,
                        issued: Instant::now(),
                    })
                    .collect(),
                free: (0..depth).rev().collect(),
                overflow: VecDeque::new(),
                closed: false,
            }),
            tx: Mutex::new(Tx {
                buf: Vec::with_capacity(64 << 10),
                waiting: false,
                closed: false,
            }),
            tx_cv: Condvar::new(),
            owner,
            dead: AtomicBool::new(false),
            completed: AtomicU64::new(0),
            threads: Mutex::new(Vec::new()),
            params,
        });
        // The socket has no timeouts from here on: the reader blocks until data or shutdown,
        // and a silent controller is caught by keep-alive, not by a socket timeout.
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(None);
        let rs = stream.try_clone().map_err(FabricError::io)?;
        let (qr, qw) = (q.clone(), q.clone());
        let name = format!("nvmf-q{}", q.qid);
        let r = std::thread::Builder::new()
            .name(format!("{name}-rx"))
            .spawn(move || qr.reader(rs))
            .map_err(FabricError::io)?;
        let w = std::thread::Builder::new()
            .name(format!("{name}-tx"))
            .spawn(move || qw.writer(stream))
            .map_err(FabricError::io)?;
        q.threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend([r, w]);

        // Fabrics Connect: SQSIZE is zero-based, and one entry more than the commands we put
        // in flight keeps a full SQ distinguishable from an empty one.
        let sqe = Connect {
            recfmt: 0,
            qid: q.qid,
            sqsize: depth,
            cattr: 0,
            kato: q.params.kato_ms,
        }
        .to_command(0);
        let w = AdminWait::with_buf(connect_data.encode());
        let len = nacre_shared::nvme::fabrics::CONNECT_DATA_LEN;
        if let Err(c) = q.submit(Cmd {
            sqe,
            dir: Dir::H2C,
            len,
            target: Target::Admin(w.clone()),
            release: true,
        }) {
            c.fail(IoError::PathLost);
        }
        let cqe = match w.wait_until(deadline) {
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                q.shutdown();
                return Err(FabricError::Connect(format!("Connect qid {}: {e}", q.qid)));
            }
            None => {
                q.shutdown();
                return Err(FabricError::Timeout(format!("Connect qid {}", q.qid)));
            }
        };
        if !cqe.status().is_success() {
            q.shutdown();
            return Err(FabricError::Refused(format!(
                "controller refused Connect for queue {}: {}",
                q.qid,
                cqe.status()
            )));
        }
        Ok((q, cqe))
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Submit a command. Never blocks on the network. Returns the command back if the
    /// connection is closed (the caller holds or fails it).
    pub fn submit(&self, cmd: Cmd) -> Result<(), Cmd> {
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if s.closed {
            return Err(cmd);
        }
        match s.free.pop() {
            Some(idx) => {
                let wake = self.issue(&mut s, idx, cmd);
                drop(s);
                if wake {
                    self.tx_cv.notify_one();
                }
            }
            None => s.overflow.push_back(cmd),
        }
        Ok(())
    }

    /// Put `cmd` in slot `idx` and append its capsule to the send buffer. Returns whether
    /// the writer must be woken.
    fn issue(&self, s: &mut Slots, idx: u16, mut cmd: Cmd) -> bool {
        let slot = &mut s.entries[idx as usize];
        slot.gen = slot.gen.wrapping_add(1) & 0x3F;
        let cid = cid_of(idx, slot.gen);
        cmd.sqe.cid = cid;
        tracing::trace!(target: TRACE, qid = self.qid, cid = format_args!("{cid:#06x}"),
            opcode = cmd.sqe.opcode, len = cmd.len, "fabric: command sent");
        cmd.sqe.flags = (cmd.sqe.flags & !0xC0) | PSDT_SGL;
        // Fabrics commands (Connect data) always travel in the capsule (NVMe-oF 1.1 §3.3:
        // a controller accepts Connect data in-capsule whatever its IOCCSZ).
        let in_capsule = cmd.dir == Dir::H2C
            && (cmd.len <= self.icd_max() || cmd.sqe.opcode == admin_opcode::FABRICS);
        cmd.sqe.sgl = if in_capsule {
            SglDescriptor::in_capsule(cmd.len as u32)
        } else {
            SglDescriptor {
                addr: 0,
                len: cmd.len as u32,
                kind: sgl::TRANSPORT_DATA_BLOCK,
            }
        };
        let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        if in_capsule && cmd.len > 0 {
            // Two copies: the command's segments are gathered into `data`, which the encoder
            // then copies into the send buffer behind the header (and digests). Sending
            // straight from the segments (writev) is the reactor work of issue 9.
            let mut data = vec![0u8; cmd.len];
            cmd.read_data(0, &mut data);
            pdu::encode_capsule_cmd(
                &mut tx.buf,
                &cmd.sqe,
                &data,
                self.params.digests,
                self.neg.cpda,
            );
        } else {
            pdu::encode_capsule_cmd(
                &mut tx.buf,
                &cmd.sqe,
                &[],
                self.params.digests,
                self.neg.cpda,
            );
        }
        let wake = tx.waiting;
        drop(tx);
        slot.cmd = Some(cmd);
        slot.issued = Instant::now();
        wake
    }

    /// How long the oldest outstanding command has been waiting (commands waiting for a free
    /// slot count too: they wait on the controller just the same).
    pub fn oldest_outstanding(&self) -> Option<Duration> {
        let s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        s.entries
            .iter()
            .filter(|e| e.cmd.is_some())
            .map(|e| e.issued.elapsed())
            .max()
    }

    fn icd_max(&self) -> usize {
        if self.qid == 0 {
            ADMIN_ICD
        } else {
            self.params.icd_max
        }
    }

    /// Close the connection: the reader and writer stop, and the reader hands outstanding
    /// commands to the owner. Returns at once; it never waits on the peer.
    pub fn shutdown(&self) {
        self.dead.store(true, Ordering::Release);
        let _ = self.stream.shutdown(Shutdown::Both);
        let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        tx.closed = true;
        drop(tx);
        self.tx_cv.notify_all();
    }

    /// Wait (bounded) for the reader and writer to exit after [`QueueConn::shutdown`].
    pub fn join(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let threads: Vec<_> = self
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for t in threads {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }

    fn writer(self: Arc<Self>, mut stream: TcpStream) {
        let mut out = Vec::with_capacity(64 << 10);
        loop {
            {
                let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
                while tx.buf.is_empty() && !tx.closed {
                    tx.waiting = true;
                    tx = self.tx_cv.wait(tx).unwrap_or_else(|p| p.into_inner());
                    tx.waiting = false;
                }
                if tx.buf.is_empty() && tx.closed {
                    return;
                }
                std::mem::swap(&mut tx.buf, &mut out);
            }
            if let Err(e) = stream.write_all(&out) {
                if !self.is_dead() {
                    debug!(qid = self.qid, error = %e, "send failed");
                }
                self.shutdown();
                return;
            }
            out.clear();
            if out.capacity() > (4 << 20) {
                out = Vec::with_capacity(64 << 10);
            }
        }
    }

    fn reader(self: Arc<Self>, stream: TcpStream) {
        let mut rd = BufReader::with_capacity(128 << 10, stream);
        let fatal = loop {
            if let Err(f) = self.read_pdu(&mut rd) {
                break f;
            }
        };
        if let Some((fes, fei, hdr)) = &fatal.term {
            if !self.is_dead() {
                // Best effort: tell the controller why (§3.6.2.4), then close.
                let mut v = Vec::new();
                pdu::encode_term_req(&mut v, false, *fes, *fei, hdr);
                let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
                tx.buf.extend_from_slice(&v);
                drop(tx);
                self.tx_cv.notify_all();
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let was_dead = self.is_dead();
        self.shutdown();
        if !was_dead {
            warn!(qid = self.qid, reason = %fatal.reason, "NVMe/TCP queue failed");
        }
        let cmds = {
            let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            s.closed = true;
            let mut cmds: Vec<Cmd> = s.entries.iter_mut().filter_map(|e| e.cmd.take()).collect();
            cmds.extend(s.overflow.drain(..));
            cmds
        };
        match self.owner.upgrade() {
            Some(o) => o.queue_closed(self.session, self.qid, fatal.reason, cmds),
            None => cmds.into_iter().for_each(|c| c.fail(IoError::PathLost)),
        }
    }

    /// Read and handle one PDU.
    fn read_pdu(&self, rd: &mut BufReader<TcpStream>) -> Result<(), Fatal> {
        let mut hdr = [0u8; 128];
        rd.read_exact(&mut hdr[..CH_LEN]).map_err(Fatal::io)?;
        let ch = CommonHeader::decode(&hdr);
        let hlen = match pdu::expected_hlen(ch.pdu_type) {
            Some(h)
                if matches!(
                    ch.pdu_type,
                    pdu_type::CAPSULE_RESP
                        | pdu_type::C2H_DATA
                        | pdu_type::R2T
                        | pdu_type::C2H_TERM_REQ
                ) =>
            {
                h
            }
            _ => {
                return Err(Fatal::proto(
                    format!("unexpected PDU type {:#04x} from controller", ch.pdu_type),
                    fes::INVALID_HEADER_FIELD,
                    pdu::ch_offset::TYPE,
                    &hdr[..CH_LEN],
                ))
            }
        };
        if ch.hlen as usize != hlen {
            return Err(Fatal::proto(
                format!("PDU type {:#04x} with HLEN {}", ch.pdu_type, ch.hlen),
                fes::INVALID_HEADER_FIELD,
                pdu::ch_offset::HLEN,
                &hdr[..CH_LEN],
            ));
        }
        if ch.pdu_type == pdu_type::C2H_TERM_REQ {
            rd.read_exact(&mut hdr[CH_LEN..hlen]).map_err(Fatal::io)?;
            let (f, i, _) = pdu::decode_term_req(&hdr[..hlen]);
            return Err(Fatal::quiet(format!(
                "controller terminated the connection (C2HTermReq FES {f:#x}, FEI {i:#x})"
            )));
        }
        let hd = self.params.digests.header;
        if (ch.flags & flags::HDGSTF != 0) != hd {
            return Err(Fatal::proto(
                "header digest flag does not match what was negotiated",
                fes::INVALID_HEADER_FIELD,
                pdu::ch_offset::FLAGS,
                &hdr[..CH_LEN],
            ));
        }
        let hd_len = if hd { DIGEST_LEN } else { 0 };
        let plen = ch.plen as usize;
        if plen < hlen + hd_len || plen > hlen + hd_len + 128 + MAX_RX_DATA + DIGEST_LEN {
            return Err(Fatal::proto(
                format!(
                    "PDU length {plen} is impossible for type {:#04x}",
                    ch.pdu_type
                ),
                fes::INVALID_HEADER_FIELD,
                pdu::ch_offset::PLEN,
                &hdr[..CH_LEN],
            ));
        }
        rd.read_exact(&mut hdr[CH_LEN..hlen]).map_err(Fatal::io)?;
        if hd {
            let mut d = [0u8; 4];
            rd.read_exact(&mut d).map_err(Fatal::io)?;
            if u32::from_le_bytes(d) != crc32c(&hdr[..hlen]) {
                return Err(Fatal::proto(
                    "header digest mismatch",
                    fes::HEADER_DIGEST_ERROR,
                    0,
                    &hdr[..hlen],
                ));
            }
        }
        let hdr = &hdr[..hlen];
        match ch.pdu_type {
            pdu_type::CAPSULE_RESP => {
                if plen != hlen + hd_len {
                    return Err(Fatal::proto(
                        "CapsuleResp with data",
                        fes::INVALID_HEADER_FIELD,
                        pdu::ch_offset::PLEN,
                        hdr,
                    ));
                }
                let cqe = Cqe::decode(&hdr[CH_LEN..]);
                let cmd = self.take_cmd(cqe.cid, hdr)?;
                self.completed.fetch_add(1, Ordering::Relaxed);
                let st = cqe.status();
                let _span = tracing::trace_span!(target: TRACE, "fabric_cpl", qid = self.qid,
                    cid = format_args!("{:#06x}", cqe.cid), sct = st.sct, sc = st.sc)
                .entered();
                cmd.complete(cqe);
                Ok(())
            }
            pdu_type::R2T => {
                if plen != hlen + hd_len {
                    return Err(Fatal::proto(
                        "R2T with data",
                        fes::INVALID_HEADER_FIELD,
                        pdu::ch_offset::PLEN,
                        hdr,
                    ));
                }
                self.on_r2t(DataHeader::decode(hdr), hdr)
            }
            pdu_type::C2H_DATA => self.on_c2h_data(rd, &ch, hdr, hd_len),
            _ => unreachable!("filtered above"),
        }
    }

    /// Remove and return the command `cid` refers to; a CID that is not outstanding is a
    /// protocol error (a completion for an unknown command must never complete another).
    fn take_cmd(&self, cid: u16, hdr: &[u8]) -> Result<Cmd, Fatal> {
        let (idx, gen) = split_cid(cid);
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let ok = s
            .entries
            .get(idx)
            .is_some_and(|e| e.gen == gen && e.cmd.is_some());
        if !ok {
            return Err(Fatal::proto(
                format!("completion for unknown command id {cid:#06x}"),
                fes::INVALID_HEADER_FIELD,
                pdu::data_offset_of::CCCID,
                hdr,
            ));
        }
        let cmd = s.entries[idx].cmd.take().expect("checked");
        match s.overflow.pop_front() {
            Some(next) => {
                let wake = self.issue(&mut s, idx as u16, next);
                drop(s);
                if wake {
                    self.tx_cv.notify_one();
                }
            }
            None => s.free.push(idx as u16),
        }
        Ok(cmd)
    }

    /// Look at an outstanding command without removing it.
    fn with_cmd<T>(
        &self,
        cid: u16,
        hdr: &[u8],
        f: impl FnOnce(&mut Cmd) -> Result<T, Fatal>,
    ) -> Result<T, Fatal> {
        let (idx, gen) = split_cid(cid);
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        match s.entries.get_mut(idx) {
            Some(e) if e.gen == gen && e.cmd.is_some() => f(e.cmd.as_mut().expect("checked")),
            _ => Err(Fatal::proto(
                format!("data PDU for unknown command id {cid:#06x}"),
                fes::INVALID_HEADER_FIELD,
                pdu::data_offset_of::CCCID,
                hdr,
            )),
        }
    }

    /// R2T (§3.6.2.9): send the requested range as H2CData PDUs of at most MAXH2CDATA bytes,
    /// the last one flagged LAST_PDU.
    fn on_r2t(&self, r: DataHeader, hdr: &[u8]) -> Result<(), Fatal> {
        let (off, len) = (r.datao as usize, r.datal as usize);
        let mut data = Vec::new();
        self.with_cmd(r.cccid, hdr, |cmd| {
            if cmd.dir != Dir::H2C
                || cmd.len <= self.icd_max()
                || cmd.sqe.opcode == admin_opcode::FABRICS
            {
                return Err(Fatal::proto(
                    "R2T for a command with no data to transfer",
                    fes::PDU_SEQUENCE_ERROR,
                    0,
                    hdr,
                ));
            }
            if len == 0 || off.checked_add(len).is_none_or(|e| e > cmd.len) {
                return Err(Fatal::proto(
                    format!(
                        "R2T range {off}+{len} outside the command's {} bytes",
                        cmd.len
                    ),
                    fes::DATA_OUT_OF_RANGE,
                    pdu::data_offset_of::DATAO,
                    hdr,
                ));
            }
            data.resize(len, 0);
            cmd.read_data(off, &mut data);
            Ok(())
        })?;
        let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let max = self.neg.maxh2cdata;
        let mut pos = 0;
        while pos < len {
            let n = (len - pos).min(max);
            pdu::encode_h2c_data(
                &mut tx.buf,
                r.cccid,
                r.ttag,
                (off + pos) as u32,
                &data[pos..pos + n],
                pos + n == len,
                self.params.digests,
                self.neg.cpda,
            );
            pos += n;
        }
        let wake = tx.waiting;
        drop(tx);
        if wake {
            self.tx_cv.notify_one();
        }
        Ok(())
    }

    /// C2HData (§3.6.2.8): data is copied into the command's memory as it is read; with
    /// SUCCESS (only valid with LAST_PDU) the command completes without a CapsuleResp.
    fn on_c2h_data(
        &self,
        rd: &mut BufReader<TcpStream>,
        ch: &CommonHeader,
        hdr: &[u8],
        hd_len: usize,
    ) -> Result<(), Fatal> {
        let dh = DataHeader::decode(hdr);
        let hlen = hdr.len();
        let plen = ch.plen as usize;
        let pdo = ch.pdo as usize;
        let dd = if ch.flags & flags::DDGSTF != 0 {
            DIGEST_LEN
        } else {
            0
        };
        if (dd != 0) != self.params.digests.data {
            return Err(Fatal::proto(
                "data digest flag does not match what was negotiated",
                fes::INVALID_HEADER_FIELD,
                pdu::ch_offset::FLAGS,
                hdr,
            ));
        }
        let datal = dh.datal as usize;
        if pdo < hlen + hd_len || pdo + datal + dd != plen || datal == 0 {
            return Err(Fatal::proto(
                format!("C2HData with PDO {pdo}, DATAL {datal} and PLEN {plen} do not add up"),
                fes::INVALID_HEADER_FIELD,
                pdu::ch_offset::PDO,
                hdr,
            ));
        }
        let last = ch.flags & flags::LAST_PDU != 0;
        let success = ch.flags & flags::SUCCESS != 0;
        if success && !last {
            return Err(Fatal::proto(
                "C2HData with SUCCESS but not LAST_PDU",
                fes::INVALID_HEADER_FIELD,
                pdu::ch_offset::FLAGS,
                hdr,
            ));
        }
        // Where the data goes: checked and captured under the slot lock, then read without it
        // (only this thread ever removes an outstanding command, so it cannot vanish).
        let off = dh.datao as usize;
        let dest = self.with_cmd(dh.cccid, hdr, |cmd| {
            if cmd.dir != Dir::C2H {
                return Err(Fatal::proto(
                    "C2HData for a command that reads no data",
                    fes::PDU_SEQUENCE_ERROR,
                    0,
                    hdr,
                ));
            }
            if off.checked_add(datal).is_none_or(|e| e > cmd.len) {
                return Err(Fatal::proto(
                    format!(
                        "C2HData {off}+{datal} beyond the command's {} bytes",
                        cmd.len
                    ),
                    fes::DATA_OUT_OF_RANGE,
                    pdu::data_offset_of::DATAO,
                    hdr,
                ));
            }
            Ok(match &cmd.target {
                Target::Io {
                    parent,
                    data: IoData::Segs { off: base },
                } => Dest::Segs(parent.clone(), *base + off),
                Target::Io { .. } => Dest::Discard,
                Target::Admin(w) => Dest::Admin(w.clone(), off),
            })
        })?;
        let mut pad = [0u8; 128];
        let padn = pdo - hlen - hd_len;
        if padn > pad.len() {
            return Err(Fatal::proto(
                "C2HData padding too long",
                fes::INVALID_HEADER_FIELD,
                pdu::ch_offset::PDO,
                hdr,
            ));
        }
        rd.read_exact(&mut pad[..padn]).map_err(Fatal::io)?;
        let crc = dest.read(rd, datal).map_err(Fatal::io)?;
        if dd != 0 {
            let mut d = [0u8; 4];
            rd.read_exact(&mut d).map_err(Fatal::io)?;
            if u32::from_le_bytes(d) != crc {
                // The data is bad but the stream is intact; still, a controller that corrupts
                // data is not one to keep talking to: reset the connection, and the command
                // is retried on the next one like every other outstanding command.
                return Err(Fatal::quiet(format!(
                    "data digest mismatch on C2HData for command {:#06x}",
                    dh.cccid
                )));
            }
        }
        if success {
            let cmd = self.take_cmd(dh.cccid, hdr)?;
            self.completed.fetch_add(1, Ordering::Relaxed);
            // A C2HData PDU with the SUCCESS flag stands for the response capsule.
            let _span = tracing::trace_span!(target: TRACE, "fabric_cpl", qid = self.qid,
                cid = format_args!("{:#06x}", dh.cccid), sct = 0u8, sc = 0u8)
            .entered();
            cmd.complete(Cqe {
                cid: dh.cccid,
                sqid: self.qid,
                ..Default::default()
            });
        }
        Ok(())
    }
}

enum Dest {
    Segs(Arc<super::cmd::IoParent>, usize),
    Admin(Arc<AdminWait>, usize),
    Discard,
}

impl Dest {
    /// Read `n` bytes into the destination; returns their CRC32C (for the data digest).
    fn read<R: Read>(&self, rd: &mut BufReader<R>, n: usize) -> std::io::Result<u32> {
        let mut crc = 0u32;
        match self {
            Dest::Segs(parent, off) => {
                let mut skip = *off;
                let mut left = n;
                for s in parent.segments() {
                    if left == 0 {
                        break;
                    }
                    if skip >= s.len() {
                        skip -= s.len();
                        continue;
                    }
                    let k = (s.len() - skip).min(left);
                    // Through the reader's buffer or a private chunk, not a slice over the
                    // segment: the segment may be guest memory the guest can write at any
                    // time, which no Rust reference may cover. What the reader has buffered
                    // is copied from its buffer; the rest is read from the socket straight
                    // into the chunk (not through the reader's buffer: one copy less).
                    let mut chunk = [0u8; 16 << 10];
                    let mut done = 0;
                    while done < k {
                        let buffered = rd.buffer();
                        let (src, from_buffer) = if buffered.is_empty() {
                            let m = (k - done).min(chunk.len());
                            let got = match rd.get_mut().read(&mut chunk[..m]) {
                                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                                Ok(got) => got,
                                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                                Err(e) => return Err(e),
                            };
                            (&chunk[..got], false)
                        } else {
                            (&buffered[..(k - done).min(buffered.len())], true)
                        };
                        let m = src.len();
                        crc = crc32c::crc32c_append(crc, src);
                        // SAFETY: the command is outstanding, so the request's segments are
                        // valid and exclusively ours until it completes, which only this
                        // thread does; skip + done + m <= s.len().
                        unsafe { copy_to_segments(std::slice::from_ref(s), skip + done, src) };
                        if from_buffer {
                            rd.consume(m);
                        }
                        done += m;
                    }
                    left -= k;
                    skip = 0;
                }
                if left > 0 {
                    // Segments shorter than the command (cannot happen for checked requests).
                    let mut sink = vec![0u8; left];
                    rd.read_exact(&mut sink)?;
                    crc = crc32c::crc32c_append(crc, &sink);
                }
            }
            Dest::Admin(w, off) => {
                let mut b = w.buf.lock().unwrap_or_else(|p| p.into_inner());
                if b.len() < off + n {
                    b.resize(off + n, 0);
                }
                rd.read_exact(&mut b[*off..off + n])?;
                crc = crc32c::crc32c(&b[*off..off + n]);
            }
            Dest::Discard => {
                let mut sink = vec![0u8; n];
                rd.read_exact(&mut sink)?;
                crc = crc32c::crc32c(&sink);
            }
        }
        Ok(crc)
    }
}

impl FabricQueue for QueueConn {
    fn qid(&self) -> u16 {
        self.qid
    }
    fn submit(&self, cmd: Cmd) -> Result<(), Cmd> {
        QueueConn::submit(self, cmd)
    }
    fn oldest_outstanding(&self) -> Option<Duration> {
        QueueConn::oldest_outstanding(self)
    }
    fn shutdown(&self) {
        QueueConn::shutdown(self)
    }
    fn join(&self, timeout: Duration) {
        QueueConn::join(self, timeout)
    }
}

/// ICReq/ICResp on a fresh socket (§3.6.2.2-3), bounded by the queue's timeout.
fn initialize(stream: &TcpStream, p: &QueueParams) -> Result<Negotiated, FabricError> {
    let _ = stream.set_read_timeout(Some(p.timeout));
    let _ = stream.set_write_timeout(Some(p.timeout));
    let mut v = Vec::new();
    IcReq {
        pfv: 0,
        hpda: 0,
        digests: p.digests,
        maxr2t: 0,
    }
    .encode(&mut v);
    let mut s = stream;
    s.write_all(&v)
        .map_err(|e| FabricError::Connect(format!("ICReq: {e}")))?;
    let mut r = [0u8; IC_LEN];
    s.read_exact(&mut r[..CH_LEN])
        .map_err(|e| FabricError::Connect(format!("no ICResp: {e}")))?;
    let ch = CommonHeader::decode(&r);
    if ch.pdu_type == pdu_type::C2H_TERM_REQ {
        return Err(FabricError::Refused(
            "controller rejected ICReq with a C2HTermReq".into(),
        ));
    }
    if ch.pdu_type != pdu_type::IC_RESP || ch.hlen as usize != IC_LEN || ch.plen as usize != IC_LEN
    {
        return Err(FabricError::Protocol(format!(
            "expected ICResp, got PDU type {:#04x} hlen {} plen {}",
            ch.pdu_type, ch.hlen, ch.plen
        )));
    }
    s.read_exact(&mut r[CH_LEN..])
        .map_err(|e| FabricError::Connect(format!("short ICResp: {e}")))?;
    let ic = IcResp::decode(&r);
    if ic.pfv != 0 {
        return Err(FabricError::Protocol(format!(
            "controller speaks NVMe/TCP PDU format version {}",
            ic.pfv
        )));
    }
    if ic.cpda > pdu::MAX_PDA {
        return Err(FabricError::Protocol(format!(
            "ICResp CPDA {} > 31",
            ic.cpda
        )));
    }
    if ic.digests != p.digests {
        return Err(FabricError::Protocol(format!(
            "controller enabled digests {:?}, host asked for {:?}",
            ic.digests, p.digests
        )));
    }
    let maxh2cdata = ic.maxh2cdata as usize;
    if maxh2cdata < 4096 || maxh2cdata % 4 != 0 {
        return Err(FabricError::Protocol(format!(
            "ICResp MAXH2CDATA {maxh2cdata} is below 4096 or not a multiple of 4"
        )));
    }
    Ok(Negotiated {
        cpda: ic.cpda,
        maxh2cdata,
    })
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn cid_generation_round_trip() {
        for idx in [0u16, 1, 511, 1023] {
            for gen in [0u8, 1, 63] {
                assert_eq!(split_cid(cid_of(idx, gen)), (idx as usize, gen));
            }
        }
        // Same slot, different generation: a different CID.
        assert_ne!(cid_of(5, 1), cid_of(5, 2));
    }
}
