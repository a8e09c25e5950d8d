//! Receiving PDUs (NVMe/TCP 1.0 §3.6): connection initialization (ICReq/ICResp, §3.3.1),
//! framing and validation of the common header, header and data digests, and the fatal
//! errors that end a connection with a C2HTermReq (§3.5).
//!
//! Works on whatever the receive buffer holds: each field is checked as soon as its bytes
//! are there (a bad header is refused before its data is awaited), and a PDU is handled
//! once it is complete.

use nacre_shared::nvme::{Command, Status};
use nacre_shared::nvme_tcp::{
    self as tcp, ch_offset, data_offset_of, digest, fes, flags, icreq_offset, pdu_type,
    CommonHeader, DataHeader, IcReq, IcResp,
};
use tracing::debug;

use super::conn::{Conn, Phase, RBUF_LEN};
use crate::frontend::nvme::limits;

/// Why a connection ends.
pub(super) enum End {
    /// The peer closed, the socket failed, or the host sent H2CTermReq.
    Closed,
    /// A fatal transport error: send C2HTermReq with FES/FEI and the offending header.
    Fatal { fes: u16, fei: u32, hdr: Vec<u8> },
}

pub(super) fn fatal(fes: u16, fei: u32, hdr: &[u8]) -> End {
    End::Fatal {
        fes,
        fei,
        hdr: hdr.to_vec(),
    }
}

impl Conn {
    /// Handle the next PDU if all of it is in the receive buffer: `Ok(true)` if one was
    /// handled, `Ok(false)` if more bytes are needed (the buffer is large enough for them).
    pub(super) fn next_pdu(&mut self) -> Result<bool, End> {
        if self.phase == Phase::Init {
            return self.initialize();
        }
        let avail = self.rend - self.rstart;
        if avail < tcp::CH_LEN {
            return Ok(false);
        }
        let dg = self.digests;
        let hd = if dg.header { tcp::DIGEST_LEN } else { 0 };
        let dd = if dg.data { tcp::DIGEST_LEN } else { 0 };
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
            if avail < hlen + hd {
                return Ok(false);
            }
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
            if avail < hlen {
                return Ok(false);
            }
            let h = DataHeader::decode(&self.rbuf[self.rstart..self.rstart + hlen]);
            if !self.h2c.contains_key(&h.ttag) {
                let hdr = &self.rbuf[self.rstart..self.rstart + hlen];
                return Err(fatal(fes::INVALID_HEADER_FIELD, data_offset_of::TTAG, hdr));
            }
        }
        if avail < plen {
            self.make_room(plen);
            return Ok(false);
        }
        let buf = std::mem::take(&mut self.rbuf);
        let pdu = &buf[self.rstart..self.rstart + plen];
        let r = self.pdu(&ch, pdu, hlen, pdo, dlen);
        self.rbuf = buf;
        self.rstart += plen;
        if self.rstart == self.rend {
            self.rstart = 0;
            self.rend = 0;
        }
        r.map(|()| true)
    }

    /// Make sure a PDU of `plen` bytes fits in the receive buffer from `rstart`.
    fn make_room(&mut self, plen: usize) {
        if plen > self.rbuf.len() {
            // Before Connect the buffer is small; PDU validation bounds `plen`.
            self.rbuf.resize(RBUF_LEN.max(plen), 0);
        }
        if self.rstart + plen > self.rbuf.len() {
            self.rbuf.copy_within(self.rstart..self.rend, 0);
            self.rend -= self.rstart;
            self.rstart = 0;
        }
    }

    /// Connection initialization (NVMe/TCP 1.0 §3.3.1): the host's ICReq, our ICResp.
    fn initialize(&mut self) -> Result<bool, End> {
        let avail = self.rend - self.rstart;
        if avail < tcp::CH_LEN {
            return Ok(false);
        }
        let b = &self.rbuf[self.rstart..self.rend];
        let ch = CommonHeader::decode(b);
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
        if avail < tcp::IC_LEN {
            return Ok(false);
        }
        let b = &b[..tcp::IC_LEN];
        let req = IcReq::decode(b);
        if req.pfv != 0 {
            return Err(fatal(fes::UNSUPPORTED_PARAMETER, icreq_offset::PFV, b));
        }
        if req.hpda > tcp::MAX_PDA {
            return Err(fatal(fes::UNSUPPORTED_PARAMETER, icreq_offset::HPDA, b));
        }
        self.rstart += tcp::IC_LEN;
        IcResp {
            pfv: 0,
            cpda: 0,
            // Both digests are supported; the connection uses what the host asked for.
            digests: req.digests,
            maxh2cdata: limits::MAX_H2C_DATA,
        }
        .encode(self.out.buf());
        self.digests = req.digests;
        self.hpda = req.hpda;
        self.phase = Phase::Serving;
        Ok(true)
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
        let data_ok = !self.digests.data || dlen == 0 || {
            let d = &pdu[pdo + dlen..pdo + dlen + 4];
            digest::crc32c(data) == u32::from_le_bytes([d[0], d[1], d[2], d[3]])
        };
        match ch.pdu_type {
            pdu_type::CAPSULE_CMD => {
                let cmd = Command::decode(&pdu[tcp::CH_LEN..tcp::CAPSULE_CMD_HLEN]);
                if self.sqsize > 0 {
                    self.head = (self.head + 1) % self.sqsize;
                }
                if !data_ok {
                    // A data digest error is not fatal: the command fails with a transient
                    // transport error the host may retry (NVMe/TCP 1.0 §3.6.1).
                    self.reply(cmd.cid, Status::TRANSIENT_TRANSPORT_ERROR, 0, &[]);
                    return Ok(());
                }
                self.capsule(cmd, data)
            }
            _ => self.h2c_data(pdu, &pdu[..hlen], data, data_ok),
        }
    }
}
