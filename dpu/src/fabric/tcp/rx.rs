//! The receive side of an NVMe/TCP queue (NVMe/TCP Transport 1.0 §3.6), run by the queue's
//! reactor: it parses every PDU the controller sends, moves C2HData into the request's
//! memory, answers R2Ts with H2CData, completes commands, and on any fatal error hands every
//! outstanding command back to the owner (module docs of [`super`]).
//!
//! The socket is non-blocking and one reactor serves many queues, so the parser is
//! resumable: it acts on a header only once the whole header (and, for C2HData, its padding)
//! is buffered, and a C2HData PDU's data may arrive over many wake-ups ([`DataRx`] records
//! how far it got).

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use nacre_shared::nvme::{admin_opcode, Completion as Cqe};
use nacre_shared::nvme_tcp::{
    self as pdu, digest::crc32c, fes, flags, pdu_type, CommonHeader, DataHeader, CH_LEN, DIGEST_LEN,
};
use tracing::warn;

use super::rxbuf::{Fill, RxBuf, AHEAD, BATCH, DIRECT_MIN};
use super::{Fatal, QueueConn, Slot, MAX_RX_DATA};
use crate::fabric::cmd::{AdminWait, Cmd, Dir, IoData, Target};
use crate::fabric::queue::split_cid;
use crate::telemetry::trace::TARGET as TRACE;
use crate::volume::{copy_to_segments, IoError};

/// Bytes one wake-up reads from a queue before the reactor moves on to its other queues
/// (level-triggered epoll brings it back for the rest).
const RX_BUDGET: usize = 1 << 20;

/// A queue's receive state, owned by its reactor.
pub(super) struct Rx {
    buf: RxBuf,
    data: Option<DataRx>,
    /// H2CData answering R2Ts was appended to the send buffer: the reactor sends it when it
    /// is done with the wake-up. (Only then does the reactor take the send lock, which the
    /// submitting thread holds while it appends capsules: waiting for it on every wake-up
    /// cost a context switch as often as not.)
    pub(super) answered_r2t: bool,
}

impl Rx {
    pub(super) fn new() -> Self {
        Rx {
            buf: RxBuf::new(),
            data: None,
            answered_r2t: false,
        }
    }

    /// A C2HData PDU is half received.
    #[cfg(test)]
    pub(super) fn in_pdu_data(&self) -> bool {
        self.data.is_some()
    }

    /// The queue is closed: drop the buffer and any half-received PDU's destination.
    pub(super) fn release(&mut self) {
        self.data = None;
        self.buf = RxBuf::released();
    }
}

/// A C2HData PDU whose header was handled and whose data is arriving.
struct DataRx {
    dest: Dest,
    /// Offset (within the command's data) of the next byte.
    at: usize,
    left: usize,
    /// The PDU carries a data digest: its CRC so far.
    digest: bool,
    crc: u32,
    success: bool,
    cccid: u16,
    /// The PDU's header, for the H2CTermReq a late error reports.
    hdr: [u8; pdu::DATA_HLEN],
}

/// What one parsing step did.
enum Step {
    /// Consumed something: go on.
    Progress,
    /// Needs more bytes than are buffered.
    More,
    /// Read straight from the socket, which has nothing now.
    Blocked,
}

impl QueueConn {
    /// Handle what the socket has (up to [`RX_BUDGET`] bytes of it).
    pub(super) fn on_readable(&self, rx: &mut Rx, fd: RawFd) -> Result<(), Fatal> {
        let mut budget = RX_BUDGET;
        loop {
            let step = match rx.data.is_some() {
                false => self.rx_header(rx)?,
                true => self.rx_data(rx, fd, &mut budget)?,
            };
            match step {
                Step::Progress => continue,
                Step::Blocked => return Ok(()),
                Step::More => {}
            }
            if budget == 0 {
                return Ok(());
            }
            match rx.buf.fill(fd).map_err(Fatal::io)? {
                Fill::Blocked => return Ok(()),
                // A short read emptied the socket: parse what came (no budget: no more reads,
                // not even straight into a request), then wait for the next readiness rather
                // than spend a read on EAGAIN.
                Fill::Got { short: true, .. } => budget = 0,
                Fill::Got { n, .. } => budget = budget.saturating_sub(n),
            }
        }
    }

    /// Hand every outstanding command to the owner, for good (the reactor, once the
    /// connection has failed or was shut down; module docs, step 4).
    pub(super) fn fail_outstanding(&self, fatal: Fatal) {
        let was_dead = self.is_dead();
        self.shutdown();
        if !was_dead {
            warn!(qid = self.qid, reason = %fatal.reason, "NVMe/TCP queue failed");
        }
        let cmds = {
            let mut a = self.alloc.lock().unwrap_or_else(|p| p.into_inner());
            a.closed = true;
            self.closed.store(true, Ordering::SeqCst);
            let mut cmds: Vec<Cmd> = a.overflow.drain(..).collect();
            drop(a);
            // A submitter past `alloc` stores its command under the slot's lock and then
            // looks at `closed`: either we find the command here or it takes it back.
            cmds.extend(
                self.slots
                    .iter()
                    .filter_map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).cmd.take()),
            );
            cmds
        };
        match self.owner.upgrade() {
            Some(o) => o.queue_closed(self.session, self.qid, fatal.reason, cmds),
            None => cmds.into_iter().for_each(|c| c.fail(IoError::PathLost)),
        }
    }

    /// One PDU header, if it is all buffered: validate it and act on it.
    fn rx_header(&self, rx: &mut Rx) -> Result<Step, Fatal> {
        let b = rx.buf.buffer();
        if b.len() < CH_LEN {
            return Ok(Step::More);
        }
        let ch = CommonHeader::decode(b);
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
                    &b[..CH_LEN],
                ))
            }
        };
        if ch.hlen as usize != hlen {
            return Err(Fatal::proto(
                format!("PDU type {:#04x} with HLEN {}", ch.pdu_type, ch.hlen),
                fes::INVALID_HEADER_FIELD,
                pdu::ch_offset::HLEN,
                &b[..CH_LEN],
            ));
        }
        if ch.pdu_type == pdu_type::C2H_TERM_REQ {
            if b.len() < hlen {
                return Ok(Step::More);
            }
            let (f, i, _) = pdu::decode_term_req(&b[..hlen]);
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
                &b[..CH_LEN],
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
                &b[..CH_LEN],
            ));
        }
        if b.len() < hlen + hd_len {
            return Ok(Step::More);
        }
        if hd
            && u32::from_le_bytes(b[hlen..hlen + 4].try_into().expect("4 bytes"))
                != crc32c(&b[..hlen])
        {
            return Err(Fatal::proto(
                "header digest mismatch",
                fes::HEADER_DIGEST_ERROR,
                0,
                &b[..hlen],
            ));
        }
        let mut hdr_buf = [0u8; 128];
        hdr_buf[..hlen].copy_from_slice(&b[..hlen]);
        let hdr = &hdr_buf[..hlen];
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
                rx.buf.consume(hlen + hd_len);
                let cqe = Cqe::decode(&hdr[CH_LEN..]);
                let cmd = self.take_cmd(cqe.cid, hdr)?;
                self.completed.fetch_add(1, Ordering::Relaxed);
                let st = cqe.status();
                let _span = tracing::trace_span!(target: TRACE, "fabric_cpl", qid = self.qid,
                    cid = format_args!("{:#06x}", cqe.cid), sct = st.sct, sc = st.sc)
                .entered();
                cmd.complete(cqe);
                Ok(Step::Progress)
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
                rx.buf.consume(hlen + hd_len);
                self.on_r2t(DataHeader::decode(hdr), hdr)?;
                rx.answered_r2t = true;
                Ok(Step::Progress)
            }
            pdu_type::C2H_DATA => self.on_c2h_header(rx, &ch, hdr, hd_len),
            _ => unreachable!("filtered above"),
        }
    }

    /// Remove and return the command `cid` refers to; a CID that is not outstanding is a
    /// protocol error (a completion for an unknown command must never complete another).
    fn take_cmd(&self, cid: u16, hdr: &[u8]) -> Result<Cmd, Fatal> {
        let (idx, gen) = split_cid(cid);
        let cmd = self.slots.get(idx).and_then(|s| {
            let mut s = s.lock().unwrap_or_else(|p| p.into_inner());
            if s.gen == gen {
                s.cmd.take()
            } else {
                None
            }
        });
        let Some(cmd) = cmd else {
            return Err(Fatal::proto(
                format!("completion for unknown command id {cid:#06x}"),
                fes::INVALID_HEADER_FIELD,
                pdu::data_offset_of::CCCID,
                hdr,
            ));
        };
        // The slot is empty and in nobody's free list: reuse it for the oldest waiting
        // command, or free it.
        let next = {
            let mut a = self.alloc.lock().unwrap_or_else(|p| p.into_inner());
            let next = a.overflow.pop_front();
            if next.is_none() {
                a.free.push(idx as u16);
            }
            next
        };
        if let Some(next) = next {
            // Only the reactor closes the table, and it is here: the queue is open.
            if let Err(next) = self.issue_at(idx as u16, next) {
                next.fail(IoError::PathLost);
            }
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
        let mut s = self
            .slots
            .get(idx)
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()));
        match s.as_deref_mut() {
            Some(Slot {
                gen: g,
                cmd: Some(cmd),
                ..
            }) if *g == gen => f(cmd),
            _ => Err(Fatal::proto(
                format!("data PDU for unknown command id {cid:#06x}"),
                fes::INVALID_HEADER_FIELD,
                pdu::data_offset_of::CCCID,
                hdr,
            )),
        }
    }

    /// R2T (§3.6.2.9): append the requested range as H2CData PDUs of at most MAXH2CDATA
    /// bytes, the last one flagged LAST_PDU, each copied once from the request's memory into
    /// the send buffer (under the command's slot lock and then the send lock, the order
    /// `issue` takes them). The reactor sends them when it is done with the wake-up.
    fn on_r2t(&self, r: DataHeader, hdr: &[u8]) -> Result<(), Fatal> {
        let (off, len) = (r.datao as usize, r.datal as usize);
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
            let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
            let max = self.neg.maxh2cdata;
            let mut pos = 0;
            while pos < len {
                let n = (len - pos).min(max);
                pdu::encode_h2c_data_with(
                    &mut tx.buf,
                    r.cccid,
                    r.ttag,
                    (off + pos) as u32,
                    n,
                    pos + n == len,
                    self.params.digests,
                    self.neg.cpda,
                    |d| cmd.read_data(off + pos, d),
                );
                pos += n;
            }
            Ok(())
        })
    }

    /// A C2HData header (§3.6.2.8), with its padding buffered: check it against its command
    /// and start taking its data.
    fn on_c2h_header(
        &self,
        rx: &mut Rx,
        ch: &CommonHeader,
        hdr: &[u8],
        hd_len: usize,
    ) -> Result<Step, Fatal> {
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
        if pdo - hlen - hd_len > 128 {
            return Err(Fatal::proto(
                "C2HData padding too long",
                fes::INVALID_HEADER_FIELD,
                pdu::ch_offset::PDO,
                hdr,
            ));
        }
        if rx.buf.buffer().len() < pdo {
            return Ok(Step::More);
        }
        // Where the data goes: checked and captured under the slot lock, then written without
        // it (only the reactor ever removes an outstanding command, so it cannot vanish).
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
                } => Dest::Segs(parent.clone(), *base),
                Target::Io { .. } => Dest::Discard,
                Target::Admin(w) => Dest::Admin(w.clone()),
            })
        })?;
        rx.buf.consume(pdo);
        // After long data, read only a little ahead: the next long PDU's data then goes
        // straight into its request's memory instead of through the buffer (rxbuf).
        rx.buf.set_refill(if dd == 0 && datal >= DIRECT_MIN {
            AHEAD
        } else {
            BATCH
        });
        let mut h = [0u8; pdu::DATA_HLEN];
        h.copy_from_slice(&hdr[..pdu::DATA_HLEN]);
        rx.data = Some(DataRx {
            dest,
            at: off,
            left: datal,
            digest: dd != 0,
            crc: 0,
            success,
            cccid: dh.cccid,
            hdr: h,
        });
        Ok(Step::Progress)
    }

    /// The data of the C2HData PDU in progress: from the buffer, or (no digest, nothing
    /// buffered) read by the kernel straight into the request's memory.
    fn rx_data(&self, rx: &mut Rx, fd: RawFd, budget: &mut usize) -> Result<Step, Fatal> {
        let d = rx.data.as_mut().expect("data in progress");
        if d.left > 0 && rx.buf.buffer().is_empty() && !d.digest && *budget > 0 {
            if let Some((got, asked)) = d.dest.read_direct(fd, d.at, d.left).map_err(Fatal::io)? {
                if got == 0 {
                    return Ok(Step::Blocked);
                }
                self.rx_direct.fetch_add(got as u64, Ordering::Relaxed);
                d.at += got;
                d.left -= got;
                *budget = budget.saturating_sub(got);
                // Less than asked for: the socket is empty, so wait for the rest rather than
                // spend a read on EAGAIN (a long PDU arrives in pieces on loopback).
                return Ok(if got < asked && d.left > 0 {
                    Step::Blocked
                } else {
                    Step::Progress
                });
            }
        }
        self.rx_data_buffered(rx)
    }

    /// The data of the C2HData PDU in progress, from what is buffered only; then its digest,
    /// and its completion when it stands for the response (SUCCESS).
    fn rx_data_buffered(&self, rx: &mut Rx) -> Result<Step, Fatal> {
        let Some(d) = rx.data.as_mut() else {
            return Ok(Step::More);
        };
        if d.left > 0 {
            let b = rx.buf.buffer();
            if b.is_empty() {
                return Ok(Step::More);
            }
            let m = b.len().min(d.left);
            if d.digest {
                d.crc = crc32c::crc32c_append(d.crc, &b[..m]);
            }
            if d.dest.put(d.at, &b[..m]) {
                self.rx_copied.fetch_add(m as u64, Ordering::Relaxed);
            }
            rx.buf.consume(m);
            d.at += m;
            d.left -= m;
            return Ok(Step::Progress);
        }
        if d.digest {
            let b = rx.buf.buffer();
            if b.len() < DIGEST_LEN {
                return Ok(Step::More);
            }
            let got = u32::from_le_bytes(b[..DIGEST_LEN].try_into().expect("4 bytes"));
            if got != d.crc {
                // The data is bad but the stream is intact; still, a controller that corrupts
                // data is not one to keep talking to: reset the connection, and the command
                // is retried on the next one like every other outstanding command.
                return Err(Fatal::quiet(format!(
                    "data digest mismatch on C2HData for command {:#06x}",
                    d.cccid
                )));
            }
            rx.buf.consume(DIGEST_LEN);
        }
        let d = rx.data.take().expect("data in progress");
        if d.success {
            let cmd = self.take_cmd(d.cccid, &d.hdr)?;
            self.completed.fetch_add(1, Ordering::Relaxed);
            // A C2HData PDU with the SUCCESS flag stands for the response capsule.
            let _span = tracing::trace_span!(target: TRACE, "fabric_cpl", qid = self.qid,
                cid = format_args!("{:#06x}", d.cccid), sct = 0u8, sc = 0u8)
            .entered();
            cmd.complete(Cqe {
                cid: d.cccid,
                sqid: self.qid,
                ..Default::default()
            });
        }
        Ok(Step::Progress)
    }
}

/// Where a C2HData PDU's data goes.
enum Dest {
    /// The request's segments, from this byte of them.
    Segs(Arc<crate::fabric::cmd::IoParent>, usize),
    Admin(Arc<AdminWait>),
    Discard,
}

impl Dest {
    /// Copy `src`, the command's data from offset `at`, to where it goes. Returns whether it
    /// went to a request's segments (what `rx_copied` counts).
    fn put(&self, at: usize, src: &[u8]) -> bool {
        match self {
            Dest::Segs(parent, base) => {
                // Copied from the receive buffer, never through a slice over the segment: the
                // segment may be guest memory the guest can write at any time, which no Rust
                // reference may cover. Bytes past the segments (cannot happen for checked
                // requests) are dropped.
                // SAFETY: the command is outstanding, so the request's segments are valid
                // and exclusively ours until it completes, which only the reactor does.
                unsafe { copy_to_segments(parent.segments(), base + at, src) };
                true
            }
            Dest::Admin(w) => {
                let mut b = w.buf.lock().unwrap_or_else(|p| p.into_inner());
                if b.len() < at + src.len() {
                    b.resize(at + src.len(), 0);
                }
                b[at..at + src.len()].copy_from_slice(src);
                false
            }
            Dest::Discard => false,
        }
    }

    /// Read up to `left` bytes of the command's data from offset `at` straight into the
    /// request's segments (one segment's worth at most): how many came, of how many asked
    /// for. `None`: this destination is not read into directly; 0 came: the socket has
    /// nothing now.
    fn read_direct(
        &self,
        fd: RawFd,
        at: usize,
        left: usize,
    ) -> std::io::Result<Option<(usize, usize)>> {
        let Dest::Segs(parent, base) = self else {
            return Ok(None);
        };
        let mut skip = base + at;
        for s in parent.segments() {
            if skip >= s.len() {
                skip -= s.len();
                continue;
            }
            let k = (s.len() - skip).min(left);
            loop {
                // SAFETY: the command is outstanding, so the segment is valid and exclusively
                // ours until it completes, which only the reactor does; skip + k <= s.len().
                // The kernel writes at most k bytes there (a raw address, as preadv gets in
                // the file backend: no Rust reference covers guest memory).
                let got = unsafe { libc::read(fd, s.as_ptr().add(skip).cast(), k) };
                if got > 0 {
                    return Ok(Some((got as usize, k)));
                }
                if got == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                let e = std::io::Error::last_os_error();
                match e.kind() {
                    std::io::ErrorKind::Interrupted => continue,
                    std::io::ErrorKind::WouldBlock => return Ok(Some((0, k))),
                    _ => return Err(e),
                }
            }
        }
        // Past the segments: through the buffer, and dropped there.
        Ok(None)
    }
}
