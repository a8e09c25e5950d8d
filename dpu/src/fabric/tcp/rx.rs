//! The receive side of an NVMe/TCP queue (NVMe/TCP Transport 1.0 §3.6): the reader thread
//! parses every PDU the controller sends, moves C2HData into the request's memory, answers
//! R2Ts with H2CData, completes commands, and on any fatal error hands every outstanding
//! command back to the owner (module docs of [`super`]).

use std::io::{BufRead, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use nacre_shared::nvme::{admin_opcode, Completion as Cqe};
use nacre_shared::nvme_tcp::{
    self as pdu, digest::crc32c, fes, flags, pdu_type, CommonHeader, DataHeader, CH_LEN, DIGEST_LEN,
};
use tracing::warn;

use super::rxbuf::{RxBuf, AHEAD, BATCH, DIRECT_MIN};
use super::{Fatal, QueueConn, Slot, MAX_RX_DATA};
use crate::fabric::cmd::{AdminWait, Cmd, Dir, IoData, Target};
use crate::fabric::queue::split_cid;
use crate::telemetry::trace::TARGET as TRACE;
use crate::volume::{copy_to_segments, IoError};

impl QueueConn {
    pub(super) fn reader(self: Arc<Self>, stream: TcpStream) {
        let mut rd = RxBuf::new(stream);
        // Where C2HData read past the reader's buffer lands before it is copied into the
        // request's memory: one per connection, not a zeroed 16 KiB array per PDU (a memset
        // per 4 KiB read showed in the profile, issue 9).
        let mut chunk = vec![0u8; 16 << 10];
        let fatal = loop {
            if let Err(f) = self.read_pdu(&mut rd, &mut chunk) {
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

    /// Read and handle one PDU.
    fn read_pdu(&self, rd: &mut RxBuf<TcpStream>, chunk: &mut [u8]) -> Result<(), Fatal> {
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
            pdu_type::C2H_DATA => self.on_c2h_data(rd, &ch, hdr, hd_len, chunk),
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
            // Only this thread closes the table, and it is here: the queue is open.
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

    /// R2T (§3.6.2.9): send the requested range as H2CData PDUs of at most MAXH2CDATA bytes,
    /// the last one flagged LAST_PDU, each copied once from the request's memory into the
    /// send buffer (under the command's slot lock and then the send lock, the order `issue`
    /// takes them).
    fn on_r2t(&self, r: DataHeader, hdr: &[u8]) -> Result<(), Fatal> {
        let (off, len) = (r.datao as usize, r.datal as usize);
        let wake = self.with_cmd(r.cccid, hdr, |cmd| {
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
            Ok(tx.waiting)
        })?;
        if wake {
            self.tx_cv.notify_one();
        }
        Ok(())
    }

    /// C2HData (§3.6.2.8): data is copied into the command's memory as it is read; with
    /// SUCCESS (only valid with LAST_PDU) the command completes without a CapsuleResp.
    fn on_c2h_data(
        &self,
        rd: &mut RxBuf<TcpStream>,
        ch: &CommonHeader,
        hdr: &[u8],
        hd_len: usize,
        chunk: &mut [u8],
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
        // After long data, read only a little ahead: the next long PDU's data then goes
        // straight into its request's memory instead of through the buffer (rxbuf).
        rd.set_refill(if dd == 0 && datal >= DIRECT_MIN {
            AHEAD
        } else {
            BATCH
        });
        let (crc, direct) = dest.read(rd, datal, dd != 0, chunk).map_err(Fatal::io)?;
        if let Dest::Segs(..) = dest {
            self.rx_direct.fetch_add(direct as u64, Ordering::Relaxed);
            self.rx_copied
                .fetch_add((datal - direct) as u64, Ordering::Relaxed);
        }
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
    Segs(Arc<crate::fabric::cmd::IoParent>, usize),
    Admin(Arc<AdminWait>, usize),
    Discard,
}

impl Dest {
    /// Read `n` bytes into the destination; returns their CRC32C (for the data digest) when
    /// `digest` (the CRC of request data is not computed for nothing: it showed in the
    /// profile without digests), and how many of them the kernel read straight into the
    /// request's memory. `chunk`: scratch space for data read past the reader's buffer.
    fn read<R: Read + AsRawFd>(
        &self,
        rd: &mut RxBuf<R>,
        n: usize,
        digest: bool,
        chunk: &mut [u8],
    ) -> std::io::Result<(u32, usize)> {
        let mut crc = 0u32;
        let mut direct = 0;
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
                    // is copied from its buffer; without a data digest the rest is read by
                    // the kernel straight into the segment (a raw address, as preadv gets in
                    // the file backend), and with one into the chunk, whose bytes the CRC
                    // needs.
                    let mut done = 0;
                    while done < k {
                        if !digest && rd.buffer().is_empty() {
                            // SAFETY: the command is outstanding, so the segment is valid and
                            // exclusively ours until it completes, which only this thread
                            // does; skip + done + (k - done) <= s.len(). The kernel writes
                            // at most k - done bytes there.
                            let got = unsafe {
                                libc::read(
                                    rd.get_ref().as_raw_fd(),
                                    s.as_ptr().add(skip + done).cast(),
                                    k - done,
                                )
                            };
                            match got {
                                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                                n if n > 0 => {
                                    done += n as usize;
                                    direct += n as usize;
                                }
                                _ => {
                                    let e = std::io::Error::last_os_error();
                                    if e.kind() != std::io::ErrorKind::Interrupted {
                                        return Err(e);
                                    }
                                }
                            }
                            continue;
                        }
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
                        if digest {
                            crc = crc32c::crc32c_append(crc, src);
                        }
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
        Ok((crc, direct))
    }
}
