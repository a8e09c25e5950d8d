//! Data transfer and replies (NVMe/TCP 1.0 §3.3.2–§3.3.4): R2T and H2CData for host data
//! not in the capsule, C2HData and CapsuleResp for what goes back, and the send queue
//! that gathers a pass's replies into one `writev`, long reads straight from their slot
//! buffers.

use std::io::{IoSlice, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use nacre_shared::nvme::{Command, Completion, Status};
use nacre_shared::nvme_tcp::{self as tcp, data_offset_of, fes, DataHeader};
use smallvec::SmallVec;

use super::command::Payload;
use super::conn::Conn;
use super::pdu::{fatal, End};
use crate::frontend::nvme::limits;

/// Flush the send queue early once it holds this much (read data held for a gather write
/// included).
const FLUSH_AT: usize = 256 * 1024;
/// Reads at least this long are sent from their slot buffer by a gather write (writev)
/// instead of being copied behind their C2HData header; below it the copy costs less than
/// another iovec and the buffer's trip back to the pool.
pub(super) const GATHER_MIN: usize = 16 * 1024;
/// Flush early once this many held buffers wait for one gather write.
const GATHER_MAX_BUFS: usize = 64;
/// Slices one `writev` takes at most (IOV_MAX is 1024 on Linux).
const MAX_IOV: usize = 1024;
/// A send queue's byte buffer is given back to the allocator, not kept, past this size
/// (it grows while a host reads slowly).
const KEEP_OUT_CAPACITY: usize = 4 << 20;

/// Idle data buffers of one queue, reused across commands; at most
/// [`limits::POOL_BYTES`] of capacity is kept.
#[derive(Default)]
pub(crate) struct BufPool {
    bufs: Vec<Vec<u8>>,
    bytes: usize,
}

impl BufPool {
    /// A buffer of `len` bytes, reused where one is idle (contents unspecified: callers
    /// overwrite; a buffer is zeroed only where it grows).
    pub(super) fn take(&mut self, len: usize) -> Vec<u8> {
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

    pub(super) fn give(&mut self, b: Vec<u8>) {
        if b.capacity() > 0 && self.bytes + b.capacity() <= limits::POOL_BYTES {
            self.bytes += b.capacity();
            self.bufs.push(b);
        }
    }
}

/// What a queue has to send: bytes, with the data of long reads left in their own
/// buffers, sent in order by gather writes as the socket takes them.
#[derive(Default)]
pub(super) struct Out {
    /// The bytes to send, except the data of long reads, which stays in `held`.
    buf: Vec<u8>,
    /// Read data sent from its own buffer: `(at, data)` goes out right before `buf[at..]`.
    held: Vec<(usize, Vec<u8>)>,
    held_bytes: usize,
    /// Bytes of the whole sequence already sent.
    sent: usize,
    /// The socket took less than offered: the rest waits for EPOLLOUT.
    blocked: bool,
    /// When the socket last took bytes (or first refused them) while blocked.
    since: Option<Instant>,
}

impl Out {
    pub(super) fn pending(&self) -> usize {
        self.buf.len() + self.held_bytes - self.sent
    }

    pub(super) fn blocked(&self) -> bool {
        self.blocked
    }

    /// The byte buffer replies are encoded into.
    pub(super) fn buf(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// How long the host has taken no byte although replies wait.
    pub(super) fn stalled_for(&self, now: Instant) -> Duration {
        self.stalled_since()
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t))
    }

    /// Since when the host has taken no byte although replies wait.
    pub(super) fn stalled_since(&self) -> Option<Instant> {
        self.since.filter(|_| self.blocked && self.pending() > 0)
    }

    /// Send as much as the socket takes without blocking.
    pub(super) fn send(&mut self, sock: &TcpStream, pool: &mut BufPool) -> std::io::Result<()> {
        while self.pending() > 0 {
            let r = {
                let mut iov: SmallVec<[IoSlice<'_>; 16]> = SmallVec::new();
                let mut skip = self.sent;
                let mut at = 0;
                for (pos, data) in &self.held {
                    if *pos > at {
                        skip_push(&mut iov, &mut skip, &self.buf[at..*pos]);
                    }
                    skip_push(&mut iov, &mut skip, data);
                    at = *pos;
                }
                if at < self.buf.len() {
                    skip_push(&mut iov, &mut skip, &self.buf[at..]);
                }
                let n = iov.len().min(MAX_IOV);
                (&*sock).write_vectored(&iov[..n])
            };
            match r {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.sent += n;
                    self.blocked = false;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if !self.blocked {
                        self.blocked = true;
                        self.since = Some(Instant::now());
                    }
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
        self.discard(pool);
        Ok(())
    }

    /// Forget what is queued (sent, or the connection is gone); read buffers go back to
    /// the pool.
    pub(super) fn discard(&mut self, pool: &mut BufPool) {
        if self.buf.capacity() > KEEP_OUT_CAPACITY {
            self.buf = Vec::new();
        }
        self.buf.clear();
        self.held.drain(..).for_each(|(_, b)| pool.give(b));
        self.held_bytes = 0;
        self.sent = 0;
        self.blocked = false;
        self.since = None;
    }
}

/// Add `s` to `iov`, less the first `*skip` bytes of the sequence (already sent).
fn skip_push<'a>(iov: &mut SmallVec<[IoSlice<'a>; 16]>, skip: &mut usize, s: &'a [u8]) {
    if *skip >= s.len() {
        *skip -= s.len();
    } else {
        iov.push(IoSlice::new(&s[*skip..]));
        *skip = 0;
    }
}

/// A command waiting for H2CData after our R2T.
pub(super) struct H2cPending {
    /// Bytes asked for: counted against [`limits::R2T_BUDGET`] until the data is here.
    pub(super) len: usize,
    pub(super) cmd: Command,
    pub(super) buf: Vec<u8>,
    pub(super) received: usize,
    pub(super) digest_failed: bool,
}

impl Conn {
    pub(super) fn cqe(&self, cid: u16, status: Status, dw0: u32) -> Completion {
        Completion {
            dw0,
            dw1: 0,
            sqhd: self.head as u16,
            sqid: self.qid,
            cid,
            status: status.to_field(),
        }
    }

    /// Queue the reply to command `cid`: C2HData with `data` (if any and successful) and a
    /// CapsuleResp, unless the host disabled SQ flow control, in which case a successful
    /// data transfer ends with C2HData's SUCCESS flag instead (NVMe/TCP 1.0 §3.3.4).
    pub(super) fn reply(&mut self, cid: u16, status: Status, dw0: u32, data: &[u8]) {
        if status.is_success() && !data.is_empty() {
            let success = dw0 == 0 && self.sq_flow_disabled;
            tcp::encode_c2h_data(
                self.out.buf(),
                cid,
                0,
                data,
                true,
                success,
                self.digests,
                self.hpda,
            );
            if success {
                self.after_put();
                return;
            }
        }
        let cqe = self.cqe(cid, status, dw0);
        tcp::encode_capsule_resp(self.out.buf(), &cqe, self.digests);
        self.after_put();
    }

    /// Queue a successful read's reply with its data left in `data` (a slot buffer) for
    /// the gather write; the buffer returns to the pool once sent.
    pub(super) fn read_reply(&mut self, cid: u16, data: Vec<u8>) {
        let success = self.sq_flow_disabled;
        let (digests, hpda) = (self.digests, self.hpda);
        let ddgst =
            tcp::encode_c2h_data_head(self.out.buf(), cid, 0, &data, true, success, digests, hpda);
        let out = &mut self.out;
        out.held_bytes += data.len();
        out.held.push((out.buf.len(), data));
        if let Some(d) = ddgst {
            out.buf.extend_from_slice(&d);
        }
        if !success {
            let cqe = self.cqe(cid, Status::SUCCESS, 0);
            tcp::encode_capsule_resp(self.out.buf(), &cqe, digests);
        }
        self.after_put();
    }

    /// Send early when much is queued: memory and the gather list stay bounded.
    fn after_put(&mut self) {
        if self.out.pending() >= FLUSH_AT || self.out.held.len() >= GATHER_MAX_BUFS {
            self.flush();
        }
    }

    /// H2CData (§3.6.2.7): data for a command we sent an R2T for.
    pub(super) fn h2c_data(
        &mut self,
        pdu: &[u8],
        hdr: &[u8],
        data: &[u8],
        ok: bool,
    ) -> Result<(), End> {
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
            self.reply(p.cmd.cid, Status::TRANSIENT_TRANSPORT_ERROR, 0, &[]);
            self.pool.give(p.buf);
            Ok(())
        } else {
            self.execute(p.cmd, Payload::Owned(p.buf))
        };
        self.grant_r2ts();
        r
    }

    /// Send the R2Ts that waited for budget, oldest first, as far as the budget allows.
    pub(super) fn grant_r2ts(&mut self) {
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
    pub(super) fn send_r2t(&mut self, cmd: Command, len: usize) {
        let ttag = self.alloc_ttag();
        let digests = self.digests;
        tcp::encode_r2t(self.out.buf(), cmd.cid, ttag, 0, len as u32, digests);
        let buf = self.pool.take(len);
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

    fn alloc_ttag(&mut self) -> u16 {
        loop {
            let t = self.next_ttag;
            self.next_ttag = self.next_ttag.wrapping_add(1);
            if !self.h2c.contains_key(&t) {
                return t;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::{FromRawFd, IntoRawFd};
    use std::os::unix::net::UnixStream;

    use super::*;

    /// Replies interleaved with held read buffers leave in order, whole, however the
    /// socket splits them: a small send buffer forces partial gather writes at every
    /// boundary while the peer reads slowly.
    #[test]
    fn partial_gather_writes_keep_the_byte_order() {
        let (tx, mut rx) = UnixStream::pair().unwrap();
        tx.set_nonblocking(true).unwrap();
        // SAFETY: `into_raw_fd` hands over sole ownership of a valid socket descriptor; the
        // send queue only writes to it.
        let tx = unsafe { TcpStream::from_raw_fd(tx.into_raw_fd()) };
        let mut out = Out::default();
        let mut pool = BufPool::default();
        let mut want = Vec::new();
        for i in 0..40u32 {
            let head: Vec<u8> = (0..(i as usize * 7 % 50 + 1))
                .map(|j| (i + j as u32) as u8)
                .collect();
            out.buf().extend_from_slice(&head);
            want.extend_from_slice(&head);
            if i % 3 != 2 {
                let data: Vec<u8> = (0..GATHER_MIN + i as usize * 1000)
                    .map(|j| (j as u32 * 13 + i) as u8)
                    .collect();
                want.extend_from_slice(&data);
                out.held_bytes += data.len();
                let at = out.buf.len();
                out.held.push((at, data));
            }
        }
        let tail = b"tail".to_vec();
        out.buf().extend_from_slice(&tail);
        want.extend_from_slice(&tail);
        let total = want.len();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut b = vec![0u8; 7000];
            while got.len() < total {
                let n = rx.read(&mut b).unwrap();
                assert!(n > 0, "sender closed early");
                got.extend_from_slice(&b[..n]);
                std::thread::sleep(Duration::from_micros(200));
            }
            got
        });
        let mut partial = 0;
        while out.pending() > 0 {
            out.send(&tx, &mut pool).unwrap();
            if out.pending() > 0 {
                partial += 1;
                assert!(out.blocked());
                std::thread::sleep(Duration::from_micros(500));
            }
        }
        let got = reader.join().unwrap();
        assert!(
            partial > 0,
            "the socket took everything at once: nothing was tested"
        );
        assert!(got == want, "the byte stream differs from what was queued");
        assert_eq!((out.held.len(), out.sent, out.blocked()), (0, 0, false));
    }
}
