//! The receive buffer of an NVMe/TCP queue's reader thread.
//!
//! One large read brings many short PDUs at once (CapsuleResps, 4 KiB C2HData), which is
//! what keeps the reader's system calls few. But a large read also pulls most of a long
//! C2HData PDU's data into this buffer, and that data then has to be copied into the
//! request's memory: at 128 KiB sequential reads, that copy was 40% of the reader thread
//! (issue 9). So the amount one refill asks for follows the traffic: after a long C2HData
//! PDU the next refill reads only [`AHEAD`] bytes (enough for the next headers and a CQE
//! run), and the reader reads the rest of the next long PDU's data straight into the
//! request's memory (`rx::Dest::read`); after a short one, refills go back to [`BATCH`].
//!
//! Like `std::io::BufReader`, but with that refill size, which `BufReader` does not let a
//! caller choose.

use std::io::{self, BufRead, Read};

/// What a refill asks for while the controller sends short PDUs: many of them per read.
pub(super) const BATCH: usize = 128 << 10;
/// What a refill asks for after a long C2HData PDU (see the module docs).
pub(super) const AHEAD: usize = 4 << 10;
/// C2HData at least this long, without a data digest, makes the next refill [`AHEAD`]: above
/// it, a system call for the data costs less than copying it out of this buffer. (With a
/// data digest the data passes through memory the reader owns anyway, for the CRC.)
pub(super) const DIRECT_MIN: usize = 32 << 10;

pub(super) struct RxBuf<R> {
    inner: R,
    buf: Box<[u8]>,
    /// `buf[pos..end]` is read but not yet consumed.
    pos: usize,
    end: usize,
    /// At most this much is read by the next refill.
    refill: usize,
}

impl<R: Read> RxBuf<R> {
    pub(super) fn new(inner: R) -> Self {
        RxBuf {
            inner,
            buf: vec![0u8; BATCH].into_boxed_slice(),
            pos: 0,
            end: 0,
            refill: BATCH,
        }
    }

    /// What is read but not yet consumed.
    pub(super) fn buffer(&self) -> &[u8] {
        &self.buf[self.pos..self.end]
    }

    pub(super) fn get_ref(&self) -> &R {
        &self.inner
    }

    pub(super) fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Make the next refills ask for at most `n` bytes (1 ..= [`BATCH`]).
    pub(super) fn set_refill(&mut self, n: usize) {
        self.refill = n.clamp(1, self.buf.len());
    }
}

impl<R: Read> Read for RxBuf<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        // Nothing buffered and a destination at least as large as a full refill: read into
        // it directly (as BufReader does).
        if self.pos == self.end && out.len() >= self.refill {
            return self.inner.read(out);
        }
        let avail = self.fill_buf()?;
        let n = avail.len().min(out.len());
        out[..n].copy_from_slice(&avail[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl<R: Read> BufRead for RxBuf<R> {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        if self.pos == self.end {
            let n = self.inner.read(&mut self.buf[..self.refill])?;
            self.pos = 0;
            self.end = n;
        }
        Ok(&self.buf[self.pos..self.end])
    }

    fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.end);
    }
}

#[cfg(test)]
mod test {
    use super::*;

    /// A stream that records how much each read asked for.
    struct Recorder {
        data: Vec<u8>,
        at: usize,
        asked: Vec<usize>,
    }

    impl Read for Recorder {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            self.asked.push(out.len());
            let n = out.len().min(self.data.len() - self.at);
            out[..n].copy_from_slice(&self.data[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    fn stream(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn refills_ask_for_the_size_set_and_bytes_arrive_in_order() {
        let data = stream(300_000);
        let mut rd = RxBuf::new(Recorder {
            data: data.clone(),
            at: 0,
            asked: Vec::new(),
        });
        let mut got = vec![0u8; 24];
        rd.read_exact(&mut got).unwrap();
        assert_eq!(rd.get_ref().asked, [BATCH], "a batch refill by default");
        assert_eq!(rd.buffer().len(), BATCH - 24);
        rd.consume(rd.buffer().len());

        rd.set_refill(AHEAD);
        let mut hdr = [0u8; 8];
        rd.read_exact(&mut hdr).unwrap();
        assert_eq!(
            rd.get_ref().asked[1],
            AHEAD,
            "after a long C2HData: a short refill"
        );
        assert_eq!(hdr[..], data[BATCH..BATCH + 8]);
        assert_eq!(rd.buffer(), &data[BATCH + 8..BATCH + AHEAD]);
        rd.consume(rd.buffer().len());

        // Nothing buffered, a destination larger than the refill: read into it directly.
        let mut big = vec![0u8; 64 << 10];
        let n = rd.read(&mut big).unwrap();
        assert_eq!(rd.get_ref().asked[2], 64 << 10);
        assert_eq!(big[..n], data[BATCH + AHEAD..BATCH + AHEAD + n]);
        assert!(rd.buffer().is_empty());

        rd.set_refill(BATCH);
        let at = BATCH + AHEAD + n;
        let mut rest = Vec::new();
        rd.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, data[at..], "every byte, in order");
    }

    #[test]
    fn the_refill_size_stays_within_the_buffer() {
        let mut rd = RxBuf::new(&[][..]);
        rd.set_refill(0);
        assert_eq!(rd.refill, 1);
        rd.set_refill(usize::MAX);
        assert_eq!(rd.refill, BATCH);
    }
}
