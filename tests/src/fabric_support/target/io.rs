//! The fake target's I/O queues: Read/Write/Flush/Write Zeroes/DSM over the RAM namespaces,
//! R2T and H2CData for writes, and the injected [`Fault`]s.

use std::net::Shutdown;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use nacre_shared::nvme::{admin_opcode, io_opcode, Command, Completion, Status};
use nacre_shared::nvme_tcp::{self as pdu, DataHeader};

use super::admin::{admin, fabrics};
use super::conn::{c2h, resp, send};
use super::{Conn, Fault, TState};

pub(super) fn capsule(
    st: &Arc<TState>,
    c: &mut Conn,
    sqe: Command,
    data: Vec<u8>,
) -> std::io::Result<()> {
    let cid = sqe.cid;
    if sqe.opcode == admin_opcode::FABRICS {
        return fabrics(st, c, sqe, data);
    }
    if c.qid == 0 {
        return admin(st, c, sqe);
    }
    // I/O queue: maybe misbehave.
    let n = st.io_cmds.fetch_add(1, Ordering::AcqRel) + 1;
    if let Some((fault, after)) = st.opts.fault {
        if n >= after && !st.fault_fired.swap(true, Ordering::AcqRel) {
            if fault == Fault::LateWrite {
                assert_eq!(sqe.opcode, io_opcode::WRITE, "LateWrite needs a write");
                assert!(!data.is_empty(), "LateWrite needs in-capsule data");
                let (st2, late) = (st.clone(), Duration::from_millis(st.opts.late_ms));
                std::thread::spawn(move || {
                    std::thread::sleep(late);
                    let mut g = st2.storage.namespaces.lock().unwrap();
                    let ns = g.iter_mut().find(|x| x.nsid == sqe.nsid).unwrap();
                    let off = sqe.slba() as usize * ns.block_size as usize;
                    ns.data[off..off + data.len()].copy_from_slice(&data);
                    drop(g);
                    st2.late_writes_done.fetch_add(1, Ordering::Release);
                });
                return Ok(()); // no completion: the host must not see this one succeed
            }
            return misbehave(c, fault, &sqe);
        }
    }
    let mut g = st.storage.namespaces.lock().unwrap();
    let Some(ns) = g.iter_mut().find(|x| x.nsid == sqe.nsid) else {
        drop(g);
        return resp(c, cid, Status::INVALID_NAMESPACE, 0, 0);
    };
    let bs = ns.block_size as usize;
    let off = sqe.slba() as usize * bs;
    let len = sqe.nlb() as usize * bs;
    match sqe.opcode {
        io_opcode::READ => {
            if off + len > ns.data.len() {
                drop(g);
                return resp(c, cid, Status::LBA_OUT_OF_RANGE, 0, 0);
            }
            let d = ns.data[off..off + len].to_vec();
            drop(g);
            c2h(st, c, cid, &d, false)
        }
        io_opcode::WRITE => {
            if off + len > ns.data.len() {
                drop(g);
                return resp(c, cid, Status::LBA_OUT_OF_RANGE, 0, 0);
            }
            assert_eq!(sqe.sgl.len as usize, len, "SGL length must match NLB");
            if !data.is_empty() {
                assert_eq!(sqe.sgl.kind, 0x01, "in-capsule data needs an offset SGL");
                assert!(data.len() <= st.opts.icd, "in-capsule data beyond IOCCSZ");
                assert_eq!(data.len(), len);
                ns.data[off..off + len].copy_from_slice(&data);
                drop(g);
                st.writes_in_capsule.fetch_add(1, Ordering::Relaxed);
                return resp(c, cid, Status::SUCCESS, 0, 0);
            }
            drop(g);
            st.writes_r2t.fetch_add(1, Ordering::Relaxed);
            let first = st.opts.r2t_chunk.min(len);
            c.pending.insert(cid, (sqe, vec![0u8; len], 0, first));
            let mut v = Vec::new();
            pdu::encode_r2t(&mut v, cid, cid ^ 0x5A5A, 0, first as u32, c.dg);
            send(c, &v)
        }
        io_opcode::FLUSH => {
            drop(g);
            resp(c, cid, Status::SUCCESS, 0, 0)
        }
        io_opcode::WRITE_ZEROES => {
            ns.data[off..off + len].fill(0);
            drop(g);
            resp(c, cid, Status::SUCCESS, 0, 0)
        }
        io_opcode::DATASET_MANAGEMENT => {
            for r in data.chunks_exact(16) {
                let nlb = u32::from_le_bytes(r[4..8].try_into().unwrap()) as usize;
                let slba = u64::from_le_bytes(r[8..16].try_into().unwrap()) as usize;
                ns.data[slba * bs..(slba + nlb) * bs].fill(0);
            }
            drop(g);
            resp(c, cid, Status::SUCCESS, 0, 0)
        }
        _ => {
            drop(g);
            resp(c, cid, Status::INVALID_OPCODE, 0, 0)
        }
    }
}

fn misbehave(c: &mut Conn, fault: Fault, sqe: &Command) -> std::io::Result<()> {
    let mut v = Vec::new();
    match fault {
        Fault::Malformed => {
            // A CapsuleResp whose HLEN says 40.
            pdu::encode_capsule_resp(&mut v, &Completion::new(sqe.cid, Status::SUCCESS), c.dg);
            v[2] = 40;
            send(c, &v)
        }
        Fault::UnknownCid => resp(c, sqe.cid ^ 0x0200, Status::SUCCESS, 0, 0),
        Fault::WrongLength => {
            let len = sqe.sgl.len as usize + 4096;
            pdu::encode_c2h_data(&mut v, sqe.cid, 0, &vec![0xEE; len], true, false, c.dg, 0);
            send(c, &v)
        }
        Fault::TermReq => {
            pdu::encode_term_req(&mut v, true, pdu::fes::PDU_SEQUENCE_ERROR, 0, &[0u8; 8]);
            send(c, &v)?;
            let _ = c.s.shutdown(Shutdown::Both);
            Ok(())
        }
        Fault::Drop => {
            let _ = c.s.shutdown(Shutdown::Both);
            Ok(())
        }
        Fault::Stall => {
            c.stalled = true;
            Ok(())
        }
        Fault::LateWrite => unreachable!("handled by the caller"),
        Fault::BadHeaderDigest => {
            assert!(c.dg.header, "BadHeaderDigest needs header digests");
            pdu::encode_capsule_resp(&mut v, &Completion::new(sqe.cid, Status::SUCCESS), c.dg);
            v[24] ^= 0xFF;
            send(c, &v)
        }
        Fault::BadDataDigest => {
            assert!(c.dg.data, "BadDataDigest needs data digests");
            assert_eq!(sqe.opcode, io_opcode::READ, "BadDataDigest needs a read");
            let data = vec![0x5Au8; sqe.sgl.len as usize];
            pdu::encode_c2h_data(&mut v, sqe.cid, 0, &data, true, true, c.dg, 0);
            let n = v.len();
            v[n - 1] ^= 0xFF;
            send(c, &v)
        }
    }
}

pub(super) fn h2c(
    st: &Arc<TState>,
    c: &mut Conn,
    dh: DataHeader,
    data: &[u8],
) -> std::io::Result<()> {
    let cid = dh.cccid;
    let (sqe, buf, got, asked) = c
        .pending
        .get_mut(&cid)
        .expect("H2CData for a pending write");
    assert_eq!(dh.ttag, cid ^ 0x5A5A, "H2CData must echo the R2T's TTAG");
    assert_eq!(dh.datao as usize, *got, "H2CData in order");
    assert!(
        data.len() <= st.opts.maxh2cdata as usize,
        "H2CData beyond MAXH2CDATA"
    );
    buf[*got..*got + data.len()].copy_from_slice(data);
    *got += data.len();
    if *got < *asked {
        return Ok(());
    }
    let total = buf.len();
    if *got < total {
        let next = st.opts.r2t_chunk.min(total - *got);
        let from = *got;
        *asked += next;
        let mut v = Vec::new();
        pdu::encode_r2t(&mut v, cid, cid ^ 0x5A5A, from as u32, next as u32, c.dg);
        return send(c, &v);
    }
    let sqe = *sqe;
    let (_, buf, _, _) = c.pending.remove(&cid).unwrap();
    {
        let mut g = st.storage.namespaces.lock().unwrap();
        let ns = g.iter_mut().find(|x| x.nsid == sqe.nsid).unwrap();
        let off = sqe.slba() as usize * ns.block_size as usize;
        ns.data[off..off + buf.len()].copy_from_slice(&buf);
    }
    resp(c, cid, Status::SUCCESS, 0, 0)
}
