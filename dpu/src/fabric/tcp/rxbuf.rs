//! The receive buffer of an NVMe/TCP queue, filled by its reactor from a non-blocking socket.
//!
//! One large read brings many short PDUs at once (CapsuleResps, 4 KiB C2HData), which is
//! what keeps the reactor's system calls few. But a large read also pulls most of a long
//! C2HData PDU's data into this buffer, and that data then has to be copied into the
//! request's memory: at 128 KiB sequential reads, that copy was 40% of the receiving thread
//! (docs/benchmarks.md). So the amount one refill asks for follows the traffic: after a long C2HData
//! PDU the next refill reads only [`AHEAD`] bytes (enough for the next headers and a CQE
//! run), and the rest of the next long PDU's data is read straight into the request's
//! memory (`rx::Dest::read_direct`); after a short one, refills go back to [`BATCH`].

use std::io;
use std::os::fd::RawFd;

/// What a refill asks for while the controller sends short PDUs: many of them per read.
pub(super) const BATCH: usize = 128 << 10;
/// What a refill asks for after a long C2HData PDU (see the module docs).
pub(super) const AHEAD: usize = 4 << 10;
/// C2HData at least this long, without a data digest, makes the next refill [`AHEAD`]: above
/// it, a system call for the data costs less than copying it out of this buffer. (With a
/// data digest the data passes through memory the reactor owns anyway, for the CRC.)
pub(super) const DIRECT_MIN: usize = 32 << 10;

pub(super) struct RxBuf {
    buf: Box<[u8]>,
    /// `buf[pos..end]` is read but not yet consumed.
    pos: usize,
    end: usize,
    /// At most this much is read by the next refill.
    refill: usize,
}

/// What a refill got.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Fill {
    /// This many bytes, fewer than asked for when the socket had no more.
    Got { n: usize, short: bool },
    /// Nothing: the socket has nothing to read now.
    Blocked,
}

impl RxBuf {
    pub(super) fn new() -> Self {
        RxBuf {
            buf: vec![0u8; BATCH].into_boxed_slice(),
            pos: 0,
            end: 0,
            refill: BATCH,
        }
    }

    /// An empty buffer, for a closed queue (its reads fail).
    pub(super) fn released() -> Self {
        RxBuf {
            buf: Box::new([]),
            pos: 0,
            end: 0,
            refill: 1,
        }
    }

    /// What is read but not yet consumed.
    pub(super) fn buffer(&self) -> &[u8] {
        &self.buf[self.pos..self.end]
    }

    pub(super) fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.end);
    }

    /// Make the next refills ask for at most `n` bytes (1 ..= [`BATCH`]).
    pub(super) fn set_refill(&mut self, n: usize) {
        self.refill = n.clamp(1, self.buf.len());
    }

    /// Read from `fd` (non-blocking) behind what is buffered, at most the refill size. What
    /// is left unconsumed is only ever the start of a PDU header or digest (the parser
    /// consumes data as it arrives), so moving it to the front costs little.
    pub(super) fn fill(&mut self, fd: RawFd) -> io::Result<Fill> {
        if self.pos == self.end {
            self.pos = 0;
            self.end = 0;
        } else if self.pos > 0 {
            self.buf.copy_within(self.pos..self.end, 0);
            self.end -= self.pos;
            self.pos = 0;
        }
        let want = self.refill.min(self.buf.len() - self.end);
        if want == 0 {
            // A full buffer that the parser could not use: cannot happen (headers are
            // far shorter), but must not spin.
            return Err(io::Error::other("receive buffer full"));
        }
        loop {
            // SAFETY: the destination is `buf[end..end + want]`, owned by this buffer and
            // within its length; the kernel writes at most `want` bytes there.
            let n = unsafe { libc::read(fd, self.buf[self.end..].as_mut_ptr().cast(), want) };
            match n {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n if n > 0 => {
                    let n = n as usize;
                    self.end += n;
                    return Ok(Fill::Got { n, short: n < want });
                }
                _ => {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::Interrupted => continue,
                        io::ErrorKind::WouldBlock => return Ok(Fill::Blocked),
                        _ => return Err(e),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    fn stream(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn refills_ask_for_the_size_set_and_bytes_arrive_in_order() {
        let (mut w, r) = UnixStream::pair().unwrap();
        r.set_nonblocking(true).unwrap();
        let mut rd = RxBuf::new();
        assert_eq!(rd.fill(r.as_raw_fd()).unwrap(), Fill::Blocked);

        let data = stream(20_000);
        w.write_all(&data).unwrap();
        rd.set_refill(AHEAD);
        assert_eq!(
            rd.fill(r.as_raw_fd()).unwrap(),
            Fill::Got {
                n: AHEAD,
                short: false
            },
            "after a long C2HData: a short refill"
        );
        assert_eq!(rd.buffer(), &data[..AHEAD]);
        // Part of a header left: it moves to the front, the next bytes behind it.
        rd.consume(AHEAD - 10);
        rd.set_refill(BATCH);
        assert_eq!(
            rd.fill(r.as_raw_fd()).unwrap(),
            Fill::Got {
                n: 20_000 - AHEAD,
                short: true
            }
        );
        assert_eq!(rd.buffer(), &data[AHEAD - 10..]);
        rd.consume(usize::MAX);
        assert!(rd.buffer().is_empty());
        drop(w);
        assert_eq!(
            rd.fill(r.as_raw_fd()).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn the_refill_size_stays_within_the_buffer() {
        let mut rd = RxBuf::new();
        rd.set_refill(0);
        assert_eq!(rd.refill, 1);
        rd.set_refill(usize::MAX);
        assert_eq!(rd.refill, BATCH);
    }
}
