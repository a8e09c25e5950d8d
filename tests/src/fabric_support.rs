//! Test peers for nacred's NVMe-oF/TCP initiator (fenced to the tests crate; never built into
//! the product):
//!
//! * [`FakeTarget`] — a small scripted NVMe/TCP target over RAM namespaces. It speaks enough of
//!   the protocol for the initiator (ICReq, Connect, Property Get/Set, Identify, Set Features,
//!   Keep Alive, discovery log, Read/Write/Flush/Write Zeroes/DSM with in-capsule data, R2T
//!   and C2HData with or without SUCCESS) and can be told to misbehave once, on a chosen I/O
//!   command: a malformed PDU, a completion for an unknown command, a data PDU longer than
//!   the command, a C2HTermReq, a dropped connection, or a stall.
//! * [`Proxy`] — a TCP forwarder between initiator and target that a test can sever, restore
//!   and stall, to cut a path deterministically.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nacre_shared::nvme::discovery::{self, DiscoveryEntry};
use nacre_shared::nvme::fabrics::{fctype, Connect, ConnectData, Property};
use nacre_shared::nvme::identify::{self, IdentifyController, IdentifyNamespace, NsDescriptor};
use nacre_shared::nvme::log::GetLogPage;
use nacre_shared::nvme::{admin_opcode, io_opcode, registers, Command, Completion, Status};
use nacre_shared::nvme_tcp::{
    self as pdu, digest::crc32c, flags, pdu_type, CommonHeader, DataHeader, Digests, IcReq, IcResp,
};

/// A misbehaviour, fired once on the `after`-th I/O command (counted over all connections).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A PDU with an impossible header length.
    Malformed,
    /// A CapsuleResp for a command id that is not outstanding.
    UnknownCid,
    /// A C2HData longer than the command asked for.
    WrongLength,
    /// A C2HTermReq.
    TermReq,
    /// Close the connection without a word.
    Drop,
    /// Stop answering on this connection (still reading, never replying).
    Stall,
    /// A CapsuleResp whose header digest is wrong (needs header digests).
    BadHeaderDigest,
    /// A read's C2HData whose data digest is wrong (needs data digests; the command must be a
    /// read).
    BadDataDigest,
    /// Execute this (in-capsule) write only after `TargetOpts::late_ms`, as a target with
    /// commands queued deep inside may still do after the host gave up on the connection.
    LateWrite,
}

#[derive(Debug, Clone)]
pub struct TargetOpts {
    pub subnqn: String,
    /// Use C2HData SUCCESS instead of a CapsuleResp for reads.
    pub c2h_success: bool,
    /// Split read data into C2HData PDUs of at most this size.
    pub c2h_chunk: usize,
    /// Ask for write data in R2Ts of at most this size.
    pub r2t_chunk: usize,
    pub maxh2cdata: u32,
    /// In-capsule data the I/O queues accept (IOCCSZ).
    pub icd: usize,
    pub mdts: u8,
    pub cqt_ms: u16,
    pub fault: Option<(Fault, u64)>,
    pub model: String,
    /// Delay of [`Fault::LateWrite`].
    pub late_ms: u64,
}

impl Default for TargetOpts {
    fn default() -> Self {
        TargetOpts {
            subnqn: "nqn.2024-01.io.nacre.test:shelf".into(),
            c2h_success: false,
            c2h_chunk: 64 << 10,
            r2t_chunk: 64 << 10,
            maxh2cdata: 32 << 10,
            icd: 8192,
            mdts: 5,
            cqt_ms: 0,
            fault: None,
            model: "nacre-fake-target".into(),
            late_ms: 300,
        }
    }
}

/// RAM namespaces, shareable between target instances (a target that "comes back").
#[derive(Clone)]
pub struct Storage {
    pub namespaces: Arc<Mutex<Vec<Ns>>>,
}

pub struct Ns {
    pub nsid: u32,
    pub block_size: u32,
    pub data: Vec<u8>,
    pub nguid: [u8; 16],
}

impl Storage {
    pub fn new(namespaces: &[(u32, u64, u32, [u8; 16])]) -> Self {
        Storage {
            namespaces: Arc::new(Mutex::new(
                namespaces
                    .iter()
                    .map(|&(nsid, size, bs, nguid)| Ns {
                        nsid,
                        block_size: bs,
                        data: vec![0u8; size as usize],
                        nguid,
                    })
                    .collect(),
            )),
        }
    }

    pub fn read(&self, nsid: u32, off: usize, len: usize) -> Vec<u8> {
        let g = self.namespaces.lock().unwrap();
        let ns = g.iter().find(|n| n.nsid == nsid).unwrap();
        ns.data[off..off + len].to_vec()
    }
}

struct TState {
    opts: TargetOpts,
    storage: Storage,
    io_cmds: AtomicU64,
    fault_fired: AtomicBool,
    next_cntlid: AtomicUsize,
    stop: AtomicBool,
    conns: Mutex<Vec<TcpStream>>,
    /// Digest errors seen in what the host sent (must stay 0).
    pub digest_errors: AtomicU64,
    pub connects: AtomicU64,
    pub writes_in_capsule: AtomicU64,
    pub writes_r2t: AtomicU64,
    pub late_writes_done: AtomicU64,
}

pub struct FakeTarget {
    pub addr: SocketAddr,
    st: Arc<TState>,
    listener: Option<std::thread::JoinHandle<()>>,
}

impl FakeTarget {
    pub fn start(opts: TargetOpts, storage: Storage) -> FakeTarget {
        Self::start_on("127.0.0.1:0", opts, storage)
    }

    /// Listen on a given address (e.g. the port a previous instance used).
    pub fn start_on(bind: &str, opts: TargetOpts, storage: Storage) -> FakeTarget {
        let l = bind_retry(bind);
        let addr = l.local_addr().unwrap();
        let st = Arc::new(TState {
            opts,
            storage,
            io_cmds: AtomicU64::new(0),
            fault_fired: AtomicBool::new(false),
            next_cntlid: AtomicUsize::new(1),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            digest_errors: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            writes_in_capsule: AtomicU64::new(0),
            writes_r2t: AtomicU64::new(0),
            late_writes_done: AtomicU64::new(0),
        });
        l.set_nonblocking(true).unwrap();
        let s2 = st.clone();
        let listener = std::thread::spawn(move || {
            while !s2.stop.load(Ordering::Acquire) {
                match l.accept() {
                    Ok((c, _)) => {
                        c.set_nonblocking(false).unwrap();
                        let _ = c.set_nodelay(true);
                        s2.conns.lock().unwrap().push(c.try_clone().unwrap());
                        let s3 = s2.clone();
                        std::thread::spawn(move || {
                            let _ = serve(&s3, c);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        FakeTarget {
            addr,
            st,
            listener: Some(listener),
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn digest_errors(&self) -> u64 {
        self.st.digest_errors.load(Ordering::Relaxed)
    }
    pub fn connects(&self) -> u64 {
        self.st.connects.load(Ordering::Relaxed)
    }
    pub fn writes_in_capsule(&self) -> u64 {
        self.st.writes_in_capsule.load(Ordering::Relaxed)
    }
    pub fn writes_r2t(&self) -> u64 {
        self.st.writes_r2t.load(Ordering::Relaxed)
    }
    pub fn late_writes_done(&self) -> u64 {
        self.st.late_writes_done.load(Ordering::Relaxed)
    }
    pub fn fault_fired(&self) -> bool {
        self.st.fault_fired.load(Ordering::Relaxed)
    }

    /// Stop listening and close every connection (the target "dies").
    pub fn kill(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        self.st.stop.store(true, Ordering::Release);
        for c in self.st.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.listener.take() {
            let _ = h.join();
        }
    }
}

impl Drop for FakeTarget {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

fn bind_retry(bind: &str) -> TcpListener {
    for _ in 0..200 {
        if let Ok(l) = TcpListener::bind(bind) {
            return l;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    TcpListener::bind(bind).expect("bind")
}

struct Conn {
    s: TcpStream,
    dg: Digests,
    qid: u16,
    cntlid: u16,
    cc: u32,
    /// Writes waiting for H2CData: cid -> (command, buffer, received, requested so far).
    pending: HashMap<u16, (Command, Vec<u8>, usize, usize)>,
    stalled: bool,
}

fn serve(st: &Arc<TState>, s: TcpStream) -> std::io::Result<()> {
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

fn send(c: &mut Conn, v: &[u8]) -> std::io::Result<()> {
    c.s.write_all(v)
}

fn resp(c: &mut Conn, cid: u16, status: Status, dw0: u32, dw1: u32) -> std::io::Result<()> {
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

fn c2h(
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

fn capsule(st: &Arc<TState>, c: &mut Conn, sqe: Command, data: Vec<u8>) -> std::io::Result<()> {
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

fn h2c(st: &Arc<TState>, c: &mut Conn, dh: DataHeader, data: &[u8]) -> std::io::Result<()> {
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

fn fabrics(st: &Arc<TState>, c: &mut Conn, sqe: Command, data: Vec<u8>) -> std::io::Result<()> {
    let cid = sqe.cid;
    match sqe.fctype() {
        fctype::CONNECT => {
            let conn = Connect::from_command(&sqe);
            let cd = ConnectData::decode(&data);
            c.qid = conn.qid;
            let is_disc = cd.subnqn == nacre_shared::nvme::DISCOVERY_NQN;
            if !is_disc && cd.subnqn != st.opts.subnqn {
                return resp(c, cid, Status::CONNECT_INVALID_PARAMETERS, 0x0001_0100, 0);
            }
            c.cntlid = if conn.qid == 0 {
                st.next_cntlid.fetch_add(1, Ordering::Relaxed) as u16
            } else {
                cd.cntlid
            };
            st.connects.fetch_add(1, Ordering::Relaxed);
            resp(c, cid, Status::SUCCESS, c.cntlid as u32, 0)
        }
        fctype::PROPERTY_GET => {
            let p = Property::from_command(&sqe);
            let v: u64 = match p.offset {
                registers::CAP => registers::cap(1023, 2),
                registers::VS => registers::version(1, 4, 0) as u64,
                registers::CC => c.cc as u64,
                registers::CSTS => {
                    let mut s = (c.cc & 1) as u64;
                    if c.cc & registers::cc::SHN_MASK != 0 {
                        s |= registers::csts::SHST_COMPLETE as u64;
                    }
                    s
                }
                _ => 0,
            };
            resp(c, cid, Status::SUCCESS, v as u32, (v >> 32) as u32)
        }
        fctype::PROPERTY_SET => {
            let p = Property::from_command(&sqe);
            if p.offset == registers::CC {
                c.cc = p.value as u32;
            }
            resp(c, cid, Status::SUCCESS, 0, 0)
        }
        _ => resp(c, cid, Status::INVALID_OPCODE, 0, 0),
    }
}

fn admin(st: &Arc<TState>, c: &mut Conn, sqe: Command) -> std::io::Result<()> {
    let cid = sqe.cid;
    match sqe.opcode {
        admin_opcode::IDENTIFY => {
            let cns = sqe.cdw10 as u8;
            let g = st.storage.namespaces.lock().unwrap();
            let page = match cns {
                identify::cns::CONTROLLER => {
                    let mut b = IdentifyController {
                        vid: 0x1b36,
                        serial: "FAKE0001".into(),
                        model: st.opts.model.clone(),
                        firmware: "0.1".into(),
                        mdts: st.opts.mdts,
                        cntlid: c.cntlid,
                        ver: registers::version(1, 4, 0),
                        cntrltype: identify::cntrltype::IO,
                        kas: 1,
                        sqes: 0x66,
                        cqes: 0x44,
                        maxcmd: 1024,
                        nn: g.iter().map(|n| n.nsid).max().unwrap_or(0),
                        oncs: identify::oncs::WRITE_ZEROES | identify::oncs::DATASET_MANAGEMENT,
                        sgls: identify::SGLS_SUPPORTED
                            | if st.opts.icd > 0 {
                                identify::SGLS_OFFSET
                            } else {
                                0
                            },
                        subnqn: st.opts.subnqn.clone(),
                        ioccsz: ((st.opts.icd + 64) / 16) as u32,
                        iorcsz: 1,
                        msdbd: 1,
                        ..Default::default()
                    }
                    .encode();
                    b[386..388].copy_from_slice(&st.opts.cqt_ms.to_le_bytes());
                    b
                }
                identify::cns::ACTIVE_NS_LIST => {
                    identify::encode_active_ns_list(g.iter().map(|n| n.nsid), sqe.nsid)
                }
                identify::cns::NAMESPACE => match g.iter().find(|n| n.nsid == sqe.nsid) {
                    Some(n) => IdentifyNamespace::for_geometry(
                        n.data.len() as u64 / n.block_size as u64,
                        n.block_size,
                        n.nguid,
                    )
                    .encode(),
                    None => {
                        drop(g);
                        return resp(c, cid, Status::INVALID_NAMESPACE, 0, 0);
                    }
                },
                identify::cns::NS_DESCRIPTOR_LIST => match g.iter().find(|n| n.nsid == sqe.nsid) {
                    Some(n) => identify::encode_ns_descriptors(&[NsDescriptor {
                        nidt: identify::nidt::NGUID,
                        nid: n.nguid.to_vec(),
                    }]),
                    None => {
                        drop(g);
                        return resp(c, cid, Status::INVALID_NAMESPACE, 0, 0);
                    }
                },
                _ => {
                    drop(g);
                    return resp(c, cid, Status::INVALID_FIELD, 0, 0);
                }
            };
            drop(g);
            c2h(st, c, cid, &page, true)
        }
        admin_opcode::SET_FEATURES => {
            if sqe.cdw10 & 0xFF == 0x07 {
                // Grant at most 2 queues each way, to exercise "fewer than asked".
                let n = (sqe.cdw11 & 0xFFFF).min(1);
                resp(c, cid, Status::SUCCESS, n | n << 16, 0)
            } else {
                resp(c, cid, Status::SUCCESS, 0, 0)
            }
        }
        admin_opcode::KEEP_ALIVE => resp(c, cid, Status::SUCCESS, 0, 0),
        admin_opcode::GET_LOG_PAGE => {
            let glp = GetLogPage::from_command(&sqe);
            let port = c.s.local_addr().map(|a| a.port()).unwrap_or(0);
            let page = discovery::encode_log(
                1,
                &[DiscoveryEntry {
                    trtype: discovery::TRTYPE_TCP,
                    adrfam: discovery::ADRFAM_IPV4,
                    subtype: discovery::SUBTYPE_NVME,
                    treq: discovery::TREQ_SECURE_CHANNEL_NOT_REQUIRED,
                    portid: 1,
                    cntlid: 0xFFFF,
                    asqsz: 32,
                    trsvcid: port.to_string(),
                    subnqn: st.opts.subnqn.clone(),
                    traddr: "127.0.0.1".into(),
                    sectype: 0,
                }],
            );
            let mut out = vec![0u8; glp.len];
            let n = glp.len.min(page.len());
            out[..n].copy_from_slice(&page[..n]);
            c2h(st, c, cid, &out, true)
        }
        _ => resp(c, cid, Status::INVALID_OPCODE, 0, 0),
    }
}

// ---------------------------------------------------------------------------------------
// Proxy

const PASS: u8 = 0;
const SEVER: u8 = 1;
const STALL: u8 = 2;

/// A TCP forwarder to `upstream` that can be cut.
pub struct Proxy {
    pub addr: SocketAddr,
    mode: Arc<AtomicU8>,
    /// Flip one bit in about one of this many bytes flowing from the target (0: never).
    corrupt_one_in: Arc<AtomicU64>,
    /// The same for bytes flowing to the target.
    corrupt_up_one_in: Arc<AtomicU64>,
    /// Bits flipped so far.
    pub flipped: Arc<AtomicU64>,
    socks: Arc<Mutex<Vec<TcpStream>>>,
    stop: Arc<AtomicBool>,
    pub accepted: Arc<AtomicU64>,
}

impl Proxy {
    pub fn start(upstream: SocketAddr) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let mode = Arc::new(AtomicU8::new(PASS));
        let socks = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicU64::new(0));
        let corrupt_one_in = Arc::new(AtomicU64::new(0));
        let corrupt_up_one_in = Arc::new(AtomicU64::new(0));
        let flipped = Arc::new(AtomicU64::new(0));
        let (m, so, sp, acc) = (mode.clone(), socks.clone(), stop.clone(), accepted.clone());
        let (co, cu, fl) = (
            corrupt_one_in.clone(),
            corrupt_up_one_in.clone(),
            flipped.clone(),
        );
        std::thread::spawn(move || {
            while !sp.load(Ordering::Acquire) {
                let (down, _) = match l.accept() {
                    Ok(x) => x,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                };
                down.set_nonblocking(false).unwrap();
                if m.load(Ordering::Acquire) == SEVER {
                    let _ = down.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(up) = TcpStream::connect(upstream) else {
                    let _ = down.shutdown(Shutdown::Both);
                    continue;
                };
                acc.fetch_add(1, Ordering::Relaxed);
                let _ = up.set_nodelay(true);
                let _ = down.set_nodelay(true);
                {
                    let mut g = so.lock().unwrap();
                    g.push(down.try_clone().unwrap());
                    g.push(up.try_clone().unwrap());
                }
                let n = acc.load(Ordering::Relaxed);
                for (a, b, corrupt) in [
                    (
                        down.try_clone().unwrap(),
                        up.try_clone().unwrap(),
                        Some((cu.clone(), fl.clone(), n ^ 0xff)),
                    ),
                    (up, down, Some((co.clone(), fl.clone(), n))),
                ] {
                    let m = m.clone();
                    std::thread::spawn(move || pump(a, b, m, corrupt));
                }
            }
        });
        Proxy {
            addr,
            mode,
            corrupt_one_in,
            corrupt_up_one_in,
            flipped,
            socks,
            stop,
            accepted,
        }
    }

    /// Flip a random bit in about one of `one_in` bytes the target sends (0 stops it), on
    /// connections open now and later: a flaky link or NIC that the digests must catch.
    pub fn corrupt(&self, one_in: u64) {
        self.corrupt_one_in.store(one_in, Ordering::Release);
    }

    /// [`Proxy::corrupt`] for the bytes the host sends to the target.
    pub fn corrupt_upstream(&self, one_in: u64) {
        self.corrupt_up_one_in.store(one_in, Ordering::Release);
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Cut every connection and refuse new ones until [`Proxy::restore`].
    pub fn sever(&self) {
        self.mode.store(SEVER, Ordering::Release);
        for s in self.socks.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Let connections through again.
    pub fn restore(&self) {
        self.mode.store(PASS, Ordering::Release);
    }

    /// Stop forwarding bytes (connections stay open): a target that stalls. Returns once
    /// the pumps have noticed (they poll every 20 ms), so nothing sent afterwards gets through.
    pub fn stall(&self) {
        self.mode.store(STALL, Ordering::Release);
        std::thread::sleep(Duration::from_millis(60));
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.sever();
    }
}

/// (one-in rate, flip counter, seed) for a pump that corrupts.
type Corrupt = Option<(Arc<AtomicU64>, Arc<AtomicU64>, u64)>;

fn pump(mut from: TcpStream, mut to: TcpStream, mode: Arc<AtomicU8>, corrupt: Corrupt) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(20)));
    let mut buf = vec![0u8; 64 << 10];
    let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ corrupt.as_ref().map_or(0, |c| c.2 << 32);
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    loop {
        match mode.load(Ordering::Acquire) {
            SEVER => break,
            STALL => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            _ => {}
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if let Some((one_in, flipped, _)) = &corrupt {
                    let k = one_in.load(Ordering::Acquire);
                    if k > 0 {
                        for b in &mut buf[..n] {
                            if next() % k == 0 {
                                *b ^= 1 << (next() % 8);
                                flipped.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
                if mode.load(Ordering::Acquire) == SEVER || to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// A deterministic pattern for block `lba` of a test (so any misplaced block shows).
pub fn pattern(seed: u64, off: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut x = seed ^ off.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// A fake target for `storage` behind a [`Proxy`] (to cut, stall or corrupt the link), and a
/// controller configuration for `hostnqn` that points at the proxy; the test sets the rest.
pub fn behind_proxy(
    opts: TargetOpts,
    storage: &Storage,
    hostnqn: &str,
) -> (FakeTarget, Proxy, nacre_dpu::fabric::ControllerConfig) {
    let target = FakeTarget::start(opts.clone(), storage.clone());
    let proxy = Proxy::start(target.addr);
    let config =
        nacre_dpu::fabric::ControllerConfig::new("127.0.0.1", proxy.port(), &opts.subnqn, hostnqn);
    (target, proxy, config)
}

/// Wait until `ctrl` is live, tolerating failed first attempts (the controller keeps retrying
/// after `reconnect_delay`): on a loaded 2-core machine an ICResp can take longer than the
/// short connect timeouts the failure tests use, and that is not what they test.
pub fn wait_live(
    ctrl: &nacre_dpu::fabric::controller::Controller,
    timeout: std::time::Duration,
) -> nacre_dpu::fabric::controller::ControllerInfo {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match ctrl.wait_first_attempt(left) {
            Ok(info) => return info,
            Err(e) if left.is_zero() => panic!("controller not live within {timeout:?}: {e}"),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
}
