//! One connection of the fake target: the ICReq/ICResp exchange, the PDU loop with its digest
//! checks, and the PDUs every command answers with (CapsuleResp, C2HData).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use nacre_shared::nvme::{Command, Completion, Status};
use nacre_shared::nvme_tcp::{
    self as pdu, digest::crc32c, flags, pdu_type, CommonHeader, DataHeader, Digests, IcReq, IcResp,
};

use super::io::{capsule, h2c};
use super::{Conn, TState};

pub(super) fn serve(st: &Arc<TState>, s: TcpStream) -> std::io::Result<()> {
    let mut c = Conn {
        s,
        dg: Digests::NONE,
        qid: 0,
        cntlid: 0,
        cc: 0,
        pending: HashMap::new(),
        stalled: false,
    };
    // ICReq -> ICResp.
    let mut ic = [0u8; 128];
    c.s.read_exact(&mut ic)?;
    let req = IcReq::decode(&ic);
    assert_eq!(CommonHeader::decode(&ic).pdu_type, pdu_type::IC_REQ);
    assert_eq!(
        req.hpda, 0,
        "hosts must send HPDA 0 (Linux nvmet requires it)"
    );
    c.dg = req.digests;
    let mut v = Vec::new();
    IcResp {
        pfv: 0,
        cpda: 0,
        digests: req.digests,
        maxh2cdata: st.opts.maxh2cdata,
    }
    .encode(&mut v);
    c.s.write_all(&v)?;
    loop {
        let mut ch = [0u8; 8];
        c.s.read_exact(&mut ch)?;
        let h = CommonHeader::decode(&ch);
        let mut rest = vec![0u8; h.plen as usize - 8];
        c.s.read_exact(&mut rest)?;
        let mut whole = ch.to_vec();
        whole.extend_from_slice(&rest);
        let hlen = h.hlen as usize;
        let hd = if h.flags & flags::HDGSTF != 0 { 4 } else { 0 };
        if hd != 0 {
            let d = u32::from_le_bytes(whole[hlen..hlen + 4].try_into().unwrap());
            if d != crc32c(&whole[..hlen]) {
                st.digest_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        if c.dg.header != (hd != 0) {
            st.digest_errors.fetch_add(1, Ordering::Relaxed);
        }
        let data: Vec<u8> = if h.pdo != 0 {
            let dd = if h.flags & flags::DDGSTF != 0 { 4 } else { 0 };
            let d = whole[h.pdo as usize..whole.len() - dd].to_vec();
            if dd != 0 {
                let got = u32::from_le_bytes(whole[whole.len() - 4..].try_into().unwrap());
                if got != crc32c(&d) {
                    st.digest_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            if c.dg.data != (dd != 0) {
                st.digest_errors.fetch_add(1, Ordering::Relaxed);
            }
            d
        } else {
            Vec::new()
        };
        if c.stalled {
            continue;
        }
        match h.pdu_type {
            pdu_type::CAPSULE_CMD => {
                let sqe = Command::decode(&whole[8..72]);
                capsule(st, &mut c, sqe, data)?;
            }
            pdu_type::H2C_DATA => {
                let dh = DataHeader::decode(&whole);
                h2c(st, &mut c, dh, &data)?;
            }
            pdu_type::H2C_TERM_REQ => return Ok(()),
            t => panic!("fake target: unexpected PDU type {t:#x} from host"),
        }
    }
}

pub(super) fn send(c: &mut Conn, v: &[u8]) -> std::io::Result<()> {
    c.s.write_all(v)
}

pub(super) fn resp(
    c: &mut Conn,
    cid: u16,
    status: Status,
    dw0: u32,
    dw1: u32,
) -> std::io::Result<()> {
    let mut v = Vec::new();
    let cqe = Completion {
        dw0,
        dw1,
        sqhd: 0,
        sqid: c.qid,
        cid,
        status: status.to_field(),
    };
    pdu::encode_capsule_resp(&mut v, &cqe, c.dg);
    send(c, &v)
}

pub(super) fn c2h(
    st: &TState,
    c: &mut Conn,
    cid: u16,
    data: &[u8],
    status_after: bool,
) -> std::io::Result<()> {
    let mut v = Vec::new();
    let chunk = st.opts.c2h_chunk.max(4);
    let mut off = 0;
    while off < data.len() {
        let n = chunk.min(data.len() - off);
        let last = off + n == data.len();
        pdu::encode_c2h_data(
            &mut v,
            cid,
            off as u32,
            &data[off..off + n],
            last,
            last && st.opts.c2h_success && !status_after,
            c.dg,
            0,
        );
        off += n;
    }
    send(c, &v)?;
    if status_after || !st.opts.c2h_success {
        resp(c, cid, Status::SUCCESS, 0, 0)?;
    }
    Ok(())
}
