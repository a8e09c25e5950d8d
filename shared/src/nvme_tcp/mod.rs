//! NVMe/TCP Transport 1.0 PDUs (NVMe/TCP Transport Specification 1.0, §3.6).
//!
//! Every PDU is a Common Header (CH, 8 bytes, §3.6.1) followed by the rest of its PDU
//! header (PSH), an optional header digest, optional padding up to PDO, optional data and
//! an optional data digest:
//!
//! ```text
//! | CH (8) | PSH | HDGST (4)? | PAD | DATA | DDGST (4)? |
//! 0        8     hlen        hlen+4 pdo    pdo+len     plen
//! ```
//!
//! Both digests are CRC32C, little-endian; ICReq, ICResp and the TermReqs never carry them
//! (§3.6.2.x). The encoders below append whole PDUs to a `Vec<u8>` so a sender can batch
//! many into one `write` call; [`CommonHeader::decode`] and the per-type header decoders
//! read them back.

pub mod digest;

pub use digest::Digests;

use crate::nvme::{get_u16, get_u32, put_u16, put_u32, Command, Completion};

/// PDU types (§3.6.1, Figure 13).
pub mod pdu_type {
    pub const IC_REQ: u8 = 0x00;
    pub const IC_RESP: u8 = 0x01;
    pub const H2C_TERM_REQ: u8 = 0x02;
    pub const C2H_TERM_REQ: u8 = 0x03;
    pub const CAPSULE_CMD: u8 = 0x04;
    pub const CAPSULE_RESP: u8 = 0x05;
    pub const H2C_DATA: u8 = 0x06;
    pub const C2H_DATA: u8 = 0x07;
    pub const R2T: u8 = 0x09;
}

/// CH flags (Figure 13).
pub mod flags {
    /// Header digest present.
    pub const HDGSTF: u8 = 1 << 0;
    /// Data digest present.
    pub const DDGSTF: u8 = 1 << 1;
    /// Last data PDU of a transfer (H2CData, C2HData).
    pub const LAST_PDU: u8 = 1 << 2;
    /// C2HData only: the command completed successfully, no CapsuleResp follows.
    pub const SUCCESS: u8 = 1 << 3;
}

/// Header lengths (hlen) per PDU type (§3.6.2).
pub const CH_LEN: usize = 8;
pub const IC_LEN: usize = 128;
pub const TERM_REQ_HLEN: usize = 24;
/// The most of the offending PDU a TermReq carries: 152 bytes in all (§3.6.2.4).
pub const TERM_REQ_MAX_LEN: usize = 152;
pub const CAPSULE_CMD_HLEN: usize = 72;
pub const CAPSULE_RESP_HLEN: usize = 24;
pub const DATA_HLEN: usize = 24;
pub const R2T_HLEN: usize = 24;
pub const DIGEST_LEN: usize = 4;

/// The header length each PDU type must carry, or None for an unknown type.
pub fn expected_hlen(pdu_type: u8) -> Option<usize> {
    Some(match pdu_type {
        pdu_type::IC_REQ | pdu_type::IC_RESP => IC_LEN,
        pdu_type::H2C_TERM_REQ | pdu_type::C2H_TERM_REQ => TERM_REQ_HLEN,
        pdu_type::CAPSULE_CMD => CAPSULE_CMD_HLEN,
        pdu_type::CAPSULE_RESP => CAPSULE_RESP_HLEN,
        pdu_type::H2C_DATA | pdu_type::C2H_DATA => DATA_HLEN,
        pdu_type::R2T => R2T_HLEN,
        _ => return None,
    })
}

/// Fatal Error Status of H2CTermReq/C2HTermReq (§3.6.2.4, Figure 19).
pub mod fes {
    pub const INVALID_HEADER_FIELD: u16 = 0x01;
    pub const PDU_SEQUENCE_ERROR: u16 = 0x02;
    pub const HEADER_DIGEST_ERROR: u16 = 0x03;
    pub const DATA_OUT_OF_RANGE: u16 = 0x04;
    /// Also "R2T limit exceeded".
    pub const DATA_LIMIT_EXCEEDED: u16 = 0x05;
    pub const UNSUPPORTED_PARAMETER: u16 = 0x06;
}

/// Offsets of CH fields, used as Fatal Error Information for invalid header fields.
pub mod ch_offset {
    pub const TYPE: u32 = 0;
    pub const FLAGS: u32 = 1;
    pub const HLEN: u32 = 2;
    pub const PDO: u32 = 3;
    pub const PLEN: u32 = 4;
}

/// The 8-byte Common Header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommonHeader {
    pub pdu_type: u8,
    pub flags: u8,
    pub hlen: u8,
    pub pdo: u8,
    pub plen: u32,
}

impl CommonHeader {
    pub fn decode(b: &[u8]) -> Self {
        CommonHeader {
            pdu_type: b[0],
            flags: b[1],
            hlen: b[2],
            pdo: b[3],
            plen: get_u32(b, 4),
        }
    }
    pub fn encode(&self, b: &mut [u8]) {
        b[0] = self.pdu_type;
        b[1] = self.flags;
        b[2] = self.hlen;
        b[3] = self.pdo;
        put_u32(b, 4, self.plen);
    }
}

/// ICReq (§3.6.2.2, Figure 15).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcReq {
    /// PDU format version, 0 for NVMe/TCP 1.0.
    pub pfv: u16,
    /// Host PDU data alignment: controller data PDUs start at multiples of (hpda+1)*4 bytes.
    pub hpda: u8,
    pub digests: Digests,
    /// Maximum outstanding R2Ts per command, zero-based.
    pub maxr2t: u32,
}

/// Offsets inside ICReq for Fatal Error Information.
pub mod icreq_offset {
    pub const PFV: u32 = 8;
    pub const HPDA: u32 = 10;
    pub const DGST: u32 = 11;
    pub const MAXR2T: u32 = 12;
}

/// HPDA and CPDA are at most 31 (128-byte alignment).
pub const MAX_PDA: u8 = 31;

impl IcReq {
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.resize(start + IC_LEN, 0);
        let b = &mut out[start..];
        ch(pdu_type::IC_REQ, 0, IC_LEN, 0, IC_LEN).encode(b);
        put_u16(b, 8, self.pfv);
        b[10] = self.hpda;
        b[11] = self.digests.to_dgst();
        put_u32(b, 12, self.maxr2t);
    }
    /// `b` is the whole 128-byte PDU.
    pub fn decode(b: &[u8]) -> Self {
        IcReq {
            pfv: get_u16(b, 8),
            hpda: b[10],
            digests: Digests::from_dgst(b[11]),
            maxr2t: get_u32(b, 12),
        }
    }
}

/// ICResp (§3.6.2.3, Figure 16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcResp {
    pub pfv: u16,
    /// Controller PDU data alignment, (cpda+1)*4 bytes; nacre uses 0 (Linux requires it).
    pub cpda: u8,
    pub digests: Digests,
    /// Most data bytes the host may put in one H2CData PDU (at least 4096, a multiple of 4).
    pub maxh2cdata: u32,
}

impl IcResp {
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.resize(start + IC_LEN, 0);
        let b = &mut out[start..];
        ch(pdu_type::IC_RESP, 0, IC_LEN, 0, IC_LEN).encode(b);
        put_u16(b, 8, self.pfv);
        b[10] = self.cpda;
        b[11] = self.digests.to_dgst();
        put_u32(b, 12, self.maxh2cdata);
    }
    pub fn decode(b: &[u8]) -> Self {
        IcResp {
            pfv: get_u16(b, 8),
            cpda: b[10],
            digests: Digests::from_dgst(b[11]),
            maxh2cdata: get_u32(b, 12),
        }
    }
}

fn ch(t: u8, flags: u8, hlen: usize, pdo: usize, plen: usize) -> CommonHeader {
    CommonHeader {
        pdu_type: t,
        flags,
        hlen: hlen as u8,
        pdo: pdo as u8,
        plen: plen as u32,
    }
}

/// Where data starts in a PDU with a header of `hlen` bytes: after the header digest,
/// rounded up to the receiver's data alignment of `(pda+1)*4` bytes (§3.5.2).
pub fn data_offset(hlen: usize, digests: Digests, pda: u8) -> usize {
    let end = hlen + if digests.header { DIGEST_LEN } else { 0 };
    let align = (pda as usize + 1) * 4;
    end.div_ceil(align) * align
}

/// Append a PDU: header (whose CH fields `flags`, `pdo`, `plen` are filled here), optional
/// header digest, padding, data and optional data digest.
fn put_pdu(out: &mut Vec<u8>, t: u8, fl: u8, hdr: &[u8], data: &[u8], digests: Digests, pda: u8) {
    let ddgst = put_pdu_head(out, t, fl, hdr, data, digests, pda);
    out.extend_from_slice(data);
    if let Some(d) = ddgst {
        out.extend_from_slice(&d);
    }
}

/// Append a PDU whose `len` data bytes `fill` writes in place: the sender copies them from
/// where they are (a request's segments) straight into `out`, once, instead of gathering
/// them into a buffer of their own first. With no data, `fill` is not called.
#[allow(clippy::too_many_arguments)]
fn put_pdu_with(
    out: &mut Vec<u8>,
    t: u8,
    fl: u8,
    hdr: &[u8],
    len: usize,
    digests: Digests,
    pda: u8,
    fill: impl FnOnce(&mut [u8]),
) {
    let dd = put_pdu_head_len(out, t, fl, hdr, len, digests, pda);
    if len == 0 {
        return;
    }
    let at = out.len();
    out.resize(at + len, 0);
    fill(&mut out[at..]);
    if dd {
        let d = digest::crc32c(&out[at..]);
        out.extend_from_slice(&d.to_le_bytes());
    }
}

/// A PDU up to its data: CH and PSH, header digest, padding to PDO. Returns the data digest
/// that follows the data when data digests are on (and there is data).
fn put_pdu_head(
    out: &mut Vec<u8>,
    t: u8,
    fl: u8,
    hdr: &[u8],
    data: &[u8],
    digests: Digests,
    pda: u8,
) -> Option<[u8; DIGEST_LEN]> {
    put_pdu_head_len(out, t, fl, hdr, data.len(), digests, pda)
        .then(|| digest::crc32c(data).to_le_bytes())
}

/// A PDU with `len` data bytes up to its data; returns whether a data digest follows them.
fn put_pdu_head_len(
    out: &mut Vec<u8>,
    t: u8,
    mut fl: u8,
    hdr: &[u8],
    len: usize,
    digests: Digests,
    pda: u8,
) -> bool {
    let hlen = hdr.len();
    let has_data = len > 0;
    let pdo = if has_data {
        data_offset(hlen, digests, pda)
    } else {
        0
    };
    let hd = if digests.header { DIGEST_LEN } else { 0 };
    let dd = if digests.data && has_data {
        DIGEST_LEN
    } else {
        0
    };
    let plen = if has_data { pdo + len + dd } else { hlen + hd };
    if digests.header {
        fl |= flags::HDGSTF;
    }
    if dd != 0 {
        fl |= flags::DDGSTF;
    }
    let start = out.len();
    out.extend_from_slice(hdr);
    ch(t, fl, hlen, pdo, plen).encode(&mut out[start..]);
    if digests.header {
        let d = digest::crc32c(&out[start..start + hlen]);
        out.extend_from_slice(&d.to_le_bytes());
    }
    if has_data {
        out.resize(start + pdo, 0);
    }
    dd != 0
}

/// CapsuleCmd (§3.6.2.5): CH, the 64-byte SQE, in-capsule data.
pub fn encode_capsule_cmd(out: &mut Vec<u8>, sqe: &Command, data: &[u8], dg: Digests, cpda: u8) {
    let mut hdr = [0u8; CAPSULE_CMD_HLEN];
    sqe.encode(&mut hdr[CH_LEN..]);
    put_pdu(out, pdu_type::CAPSULE_CMD, 0, &hdr, data, dg, cpda);
}

/// CapsuleCmd with `len` bytes of in-capsule data that `fill` writes in place (from the
/// request's memory, without an intermediate buffer).
pub fn encode_capsule_cmd_with(
    out: &mut Vec<u8>,
    sqe: &Command,
    len: usize,
    dg: Digests,
    cpda: u8,
    fill: impl FnOnce(&mut [u8]),
) {
    let mut hdr = [0u8; CAPSULE_CMD_HLEN];
    sqe.encode(&mut hdr[CH_LEN..]);
    put_pdu_with(out, pdu_type::CAPSULE_CMD, 0, &hdr, len, dg, cpda, fill);
}

/// CapsuleResp (§3.6.2.6): CH and the 16-byte CQE.
pub fn encode_capsule_resp(out: &mut Vec<u8>, cqe: &Completion, dg: Digests) {
    let mut hdr = [0u8; CAPSULE_RESP_HLEN];
    cqe.encode(&mut hdr[CH_LEN..]);
    put_pdu(out, pdu_type::CAPSULE_RESP, 0, &hdr, &[], dg, 0);
}

/// The PSH shared by H2CData and C2HData (§3.6.2.7-8): CCCID, TTAG, DATAO, DATAL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    pub cccid: u16,
    /// Transfer tag from the R2T (H2CData); reserved in C2HData.
    pub ttag: u16,
    pub datao: u32,
    pub datal: u32,
}

/// Offsets inside data PDUs and R2T for Fatal Error Information.
pub mod data_offset_of {
    pub const CCCID: u32 = 8;
    pub const TTAG: u32 = 10;
    pub const DATAO: u32 = 12;
    pub const DATAL: u32 = 16;
}

impl DataHeader {
    pub fn decode(b: &[u8]) -> Self {
        DataHeader {
            cccid: get_u16(b, 8),
            ttag: get_u16(b, 10),
            datao: get_u32(b, 12),
            datal: get_u32(b, 16),
        }
    }
    fn header(&self) -> [u8; DATA_HLEN] {
        let mut h = [0u8; DATA_HLEN];
        put_u16(&mut h, 8, self.cccid);
        put_u16(&mut h, 10, self.ttag);
        put_u32(&mut h, 12, self.datao);
        put_u32(&mut h, 16, self.datal);
        h
    }
}

/// C2HData (§3.6.2.8). `success` (only with `last`) means no CapsuleResp will follow.
#[allow(clippy::too_many_arguments)]
pub fn encode_c2h_data(
    out: &mut Vec<u8>,
    cccid: u16,
    datao: u32,
    data: &[u8],
    last: bool,
    success: bool,
    dg: Digests,
    hpda: u8,
) {
    let ddgst = encode_c2h_data_head(out, cccid, datao, data, last, success, dg, hpda);
    out.extend_from_slice(data);
    if let Some(d) = ddgst {
        out.extend_from_slice(&d);
    }
}

/// C2HData's LAST_PDU and SUCCESS flags (§3.6.2.8): SUCCESS only on the last PDU.
fn c2h_flags(last: bool, success: bool) -> u8 {
    match (last, success) {
        (true, true) => flags::LAST_PDU | flags::SUCCESS,
        (true, false) => flags::LAST_PDU,
        (false, _) => 0,
    }
}

/// C2HData (§3.6.2.8) up to its data, for a sender that transmits `data` from its own
/// buffer (a gather write) rather than copying it behind the header. The PDU is complete
/// once `data` and then the returned data digest, if any, follow what this appends.
#[allow(clippy::too_many_arguments)]
pub fn encode_c2h_data_head(
    out: &mut Vec<u8>,
    cccid: u16,
    datao: u32,
    data: &[u8],
    last: bool,
    success: bool,
    dg: Digests,
    hpda: u8,
) -> Option<[u8; DIGEST_LEN]> {
    let h = DataHeader {
        cccid,
        ttag: 0,
        datao,
        datal: data.len() as u32,
    }
    .header();
    put_pdu_head(
        out,
        pdu_type::C2H_DATA,
        c2h_flags(last, success),
        &h,
        data,
        dg,
        hpda,
    )
}

/// H2CData (§3.6.2.7).
#[allow(clippy::too_many_arguments)]
pub fn encode_h2c_data(
    out: &mut Vec<u8>,
    cccid: u16,
    ttag: u16,
    datao: u32,
    data: &[u8],
    last: bool,
    dg: Digests,
    cpda: u8,
) {
    let h = DataHeader {
        cccid,
        ttag,
        datao,
        datal: data.len() as u32,
    }
    .header();
    let fl = if last { flags::LAST_PDU } else { 0 };
    put_pdu(out, pdu_type::H2C_DATA, fl, &h, data, dg, cpda);
}

/// H2CData with `len` data bytes that `fill` writes in place (from the request's memory).
#[allow(clippy::too_many_arguments)]
pub fn encode_h2c_data_with(
    out: &mut Vec<u8>,
    cccid: u16,
    ttag: u16,
    datao: u32,
    len: usize,
    last: bool,
    dg: Digests,
    cpda: u8,
    fill: impl FnOnce(&mut [u8]),
) {
    let h = DataHeader {
        cccid,
        ttag,
        datao,
        datal: len as u32,
    }
    .header();
    let fl = if last { flags::LAST_PDU } else { 0 };
    put_pdu_with(out, pdu_type::H2C_DATA, fl, &h, len, dg, cpda, fill);
}

/// R2T (§3.6.2.9): CCCID, TTAG, R2TO (offset), R2TL (length) — same PSH layout as the
/// data PDUs.
pub fn encode_r2t(out: &mut Vec<u8>, cccid: u16, ttag: u16, r2to: u32, r2tl: u32, dg: Digests) {
    let h = DataHeader {
        cccid,
        ttag,
        datao: r2to,
        datal: r2tl,
    }
    .header();
    put_pdu(out, pdu_type::R2T, 0, &h, &[], dg, 0);
}

/// H2CTermReq/C2HTermReq (§3.6.2.4): FES (bytes 8-9), FEI (10-13), then a copy of the
/// offending PDU header so that the whole PDU is at most 152 bytes. Never digested.
pub fn encode_term_req(out: &mut Vec<u8>, c2h: bool, fes: u16, fei: u32, offending: &[u8]) {
    let n = offending.len().min(TERM_REQ_MAX_LEN - TERM_REQ_HLEN);
    let mut h = [0u8; TERM_REQ_HLEN];
    let t = if c2h {
        pdu_type::C2H_TERM_REQ
    } else {
        pdu_type::H2C_TERM_REQ
    };
    ch(t, 0, TERM_REQ_HLEN, 0, TERM_REQ_HLEN + n).encode(&mut h);
    put_u16(&mut h, 8, fes);
    put_u32(&mut h, 10, fei);
    out.extend_from_slice(&h);
    out.extend_from_slice(&offending[..n]);
}

/// A decoded TermReq: (FES, FEI, the offending header bytes).
pub fn decode_term_req(pdu: &[u8]) -> (u16, u32, Vec<u8>) {
    (
        get_u16(pdu, 8),
        get_u32(pdu, 10),
        pdu.get(TERM_REQ_HLEN..).unwrap_or(&[]).to_vec(),
    )
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::nvme::{SglDescriptor, Status};

    const BOTH: Digests = Digests {
        header: true,
        data: true,
    };

    /// The gather-write form (head, the caller's data, the returned digest) is a whole,
    /// well-formed C2HData PDU for every digest setting, padding and flag: CH fields, header
    /// digest over the header, data at PDO, data digest over the data, PLEN the total.
    #[test]
    fn c2h_data_head_then_data_is_the_whole_pdu() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 31 + 7) as u8).collect();
        for (header, dd) in [(false, false), (true, false), (false, true), (true, true)] {
            let dg = Digests { header, data: dd };
            for hpda in [0u8, 3] {
                for (last, success) in [(true, true), (true, false), (false, false)] {
                    let mut v = vec![0xAB];
                    let ddgst =
                        encode_c2h_data_head(&mut v, 9, 4096, &data, last, success, dg, hpda);
                    v.extend_from_slice(&data);
                    v.extend(ddgst.into_iter().flatten());
                    let pdu = &v[1..];
                    let ch = CommonHeader::decode(pdu);
                    assert_eq!(ch.pdu_type, pdu_type::C2H_DATA);
                    assert_eq!(ch.hlen as usize, DATA_HLEN);
                    assert_eq!(ch.plen as usize, pdu.len(), "PLEN is the whole PDU");
                    let want = (if header { flags::HDGSTF } else { 0 })
                        | (if dd { flags::DDGSTF } else { 0 })
                        | (if last { flags::LAST_PDU } else { 0 })
                        | (if success { flags::SUCCESS } else { 0 });
                    assert_eq!(ch.flags, want);
                    let pdo = ch.pdo as usize;
                    assert_eq!(pdo % ((hpda as usize + 1) * 4), 0, "PDO honours HPDA");
                    assert_eq!(&pdu[pdo..pdo + data.len()], &data[..]);
                    if header {
                        let h = digest::crc32c(&pdu[..DATA_HLEN]).to_le_bytes();
                        assert_eq!(pdu[DATA_HLEN..DATA_HLEN + DIGEST_LEN], h);
                    }
                    let end = pdo + data.len();
                    if dd {
                        assert_eq!(pdu[end..], digest::crc32c(&data).to_le_bytes());
                    } else {
                        assert_eq!(end, pdu.len());
                    }
                    let mut whole = Vec::new();
                    encode_c2h_data(&mut whole, 9, 4096, &data, last, success, dg, hpda);
                    assert_eq!(whole, pdu, "the copying encoder builds the same PDU");
                }
            }
        }
    }

    /// The in-place encoders (data written by a closure into the send buffer) build the
    /// very PDUs the slice encoders do, for every digest and alignment, and hand the
    /// closure exactly the data's place (a fill that wrote elsewhere would show).
    #[test]
    fn in_place_encoders_build_the_same_pdus() {
        let data: Vec<u8> = (0..4100u32).map(|i| (i * 13 + 5) as u8).collect();
        let sqe = Command {
            opcode: 0x01,
            cid: 0x1234,
            nsid: 1,
            cdw10: 8,
            ..Default::default()
        };
        for (header, dd) in [(false, false), (true, false), (false, true), (true, true)] {
            let dg = Digests { header, data: dd };
            for pda in [0u8, 3] {
                let (mut a, mut b) = (vec![0xAB], vec![0xAB]);
                encode_capsule_cmd(&mut a, &sqe, &data, dg, pda);
                encode_capsule_cmd_with(&mut b, &sqe, data.len(), dg, pda, |d| {
                    assert_eq!(d.len(), data.len());
                    d.copy_from_slice(&data)
                });
                assert_eq!(a, b, "CapsuleCmd, digests {dg:?}, CPDA {pda}");
                for last in [false, true] {
                    let (mut a, mut b) = (vec![0xCD], vec![0xCD]);
                    encode_h2c_data(&mut a, 3, 7, 8192, &data, last, dg, pda);
                    encode_h2c_data_with(&mut b, 3, 7, 8192, data.len(), last, dg, pda, |d| {
                        assert_eq!(d.len(), data.len());
                        d.copy_from_slice(&data)
                    });
                    assert_eq!(a, b, "H2CData, digests {dg:?}, CPDA {pda}, last {last}");
                }
            }
            // No data: no padding, no data digest, and nothing to fill.
            let (mut a, mut b) = (Vec::new(), Vec::new());
            encode_capsule_cmd(&mut a, &sqe, &[], dg, 0);
            encode_capsule_cmd_with(&mut b, &sqe, 0, dg, 0, |_| panic!("filled no data"));
            assert_eq!(a, b);
        }
    }

    #[test]
    fn ic_req_resp_layout() {
        let mut v = Vec::new();
        IcReq {
            pfv: 0,
            hpda: 0,
            digests: Digests {
                header: true,
                data: false,
            },
            maxr2t: 0,
        }
        .encode(&mut v);
        assert_eq!(v.len(), 128);
        assert_eq!(&v[0..8], &[0, 0, 128, 0, 128, 0, 0, 0]);
        assert_eq!(v[11], 1);
        let r = IcResp {
            pfv: 0,
            cpda: 0,
            digests: BOTH,
            maxh2cdata: 131072,
        };
        let mut v = Vec::new();
        r.encode(&mut v);
        assert_eq!(&v[0..4], &[1, 0, 128, 0]);
        assert_eq!(v[11], 3);
        assert_eq!(&v[12..16], &131072u32.to_le_bytes());
        assert_eq!(IcResp::decode(&v), r);
    }

    #[test]
    fn capsule_cmd_with_data_and_digests() {
        let sqe = Command::rw(1, 7, 1, 0, 1, SglDescriptor::in_capsule(8));
        let mut v = Vec::new();
        encode_capsule_cmd(&mut v, &sqe, &[1, 2, 3, 4, 5, 6, 7, 8], BOTH, 0);
        let c = CommonHeader::decode(&v);
        assert_eq!(c.pdu_type, 4);
        assert_eq!(c.flags, flags::HDGSTF | flags::DDGSTF);
        assert_eq!(c.hlen, 72);
        assert_eq!(c.pdo, 76);
        assert_eq!(c.plen, 72 + 4 + 8 + 4);
        assert_eq!(v.len(), 88);
        let hd = u32::from_le_bytes(v[72..76].try_into().unwrap());
        assert_eq!(hd, digest::crc32c(&v[..72]));
        assert_eq!(&v[76..84], &[1, 2, 3, 4, 5, 6, 7, 8]);
        let dd = u32::from_le_bytes(v[84..88].try_into().unwrap());
        assert_eq!(dd, digest::crc32c(&[1, 2, 3, 4, 5, 6, 7, 8]));
        assert_eq!(Command::decode(&v[8..72]), sqe);
    }

    #[test]
    fn capsule_resp_layout() {
        let mut v = Vec::new();
        encode_capsule_resp(&mut v, &Completion::new(5, Status::SUCCESS), Digests::NONE);
        assert_eq!(v.len(), 24);
        assert_eq!(&v[0..8], &[5, 0, 24, 0, 24, 0, 0, 0]);
        assert_eq!(&v[20..22], &[5, 0]);
    }

    #[test]
    fn c2h_data_success_and_alignment() {
        let mut v = Vec::new();
        // hpda 3: data aligned to 16 bytes; with a header digest the header ends at 28.
        encode_c2h_data(
            &mut v,
            9,
            0,
            &[0xAB; 4],
            true,
            true,
            Digests {
                header: true,
                data: false,
            },
            3,
        );
        let c = CommonHeader::decode(&v);
        assert_eq!(c.pdu_type, 7);
        assert_eq!(c.flags, flags::HDGSTF | flags::LAST_PDU | flags::SUCCESS);
        assert_eq!(c.pdo, 32);
        assert_eq!(c.plen, 36);
        let d = DataHeader::decode(&v);
        assert_eq!((d.cccid, d.datao, d.datal), (9, 0, 4));
        assert_eq!(&v[32..36], &[0xAB; 4]);
        assert_eq!(&v[28..32], &[0; 4], "padding");
    }

    #[test]
    fn r2t_h2c_and_term_req() {
        let mut v = Vec::new();
        encode_r2t(&mut v, 3, 4, 0, 8192, Digests::NONE);
        assert_eq!(&v[0..8], &[9, 0, 24, 0, 24, 0, 0, 0]);
        let d = DataHeader::decode(&v);
        assert_eq!((d.cccid, d.ttag, d.datao, d.datal), (3, 4, 0, 8192));
        let mut v = Vec::new();
        encode_h2c_data(&mut v, 3, 4, 4096, &[1; 16], true, Digests::NONE, 0);
        let c = CommonHeader::decode(&v);
        assert_eq!((c.pdu_type, c.flags, c.pdo, c.plen), (6, 4, 24, 40));
        let mut v = Vec::new();
        encode_term_req(&mut v, true, fes::INVALID_HEADER_FIELD, 2, &[0xEE; 200]);
        assert_eq!(v.len(), 152);
        let c = CommonHeader::decode(&v);
        assert_eq!((c.pdu_type, c.hlen, c.plen), (3, 24, 152));
        let (f, i, off) = decode_term_req(&v);
        assert_eq!((f, i, off.len()), (1, 2, 128));
    }
}
