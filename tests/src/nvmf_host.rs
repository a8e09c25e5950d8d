//! A small user-space NVMe/TCP host (NVMe/TCP 1.0, NVMe-oF 1.1) for tests and the
//! `nvmf-bench` load generator: connection initialization, Connect of the admin and I/O
//! queues, controller enable through Property Set, admin commands and the I/O command set,
//! in-capsule data and R2T/H2CData, both digests. It behaves like Linux's nvme-tcp host
//! where that matters (ICReq with HPDA 0 and MAXR2T 0, 1024-byte in-capsule Connect data,
//! writes in capsule up to IOCCSZ, KATO in Connect).
//!
//! It is deliberately strict: a PDU it does not expect, a digest mismatch or a TermReq from
//! the target is an error, so tests notice target misbehaviour.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use nacre_shared::nvme::fabrics::{self, Connect, ConnectData, Property};
use nacre_shared::nvme::features::{self, fid};
use nacre_shared::nvme::identify::{self, IdentifyController, IdentifyNamespace, NsDescriptor};
use nacre_shared::nvme::log::GetLogPage;
use nacre_shared::nvme::registers::{self, cc, csts};
use nacre_shared::nvme::{
    admin_opcode, io_opcode, Command, Completion, SglDescriptor, Status, DISCOVERY_NQN,
};
use nacre_shared::nvme_tcp::{
    self as tcp, digest, flags, pdu_type, CommonHeader, DataHeader, Digests, IcReq, IcResp,
};

/// What can go wrong talking to a target.
#[derive(Debug)]
pub enum HostError {
    Io(io::Error),
    /// The command completed with this status (and Dword 0).
    Nvme(Status, u32),
    /// The target sent C2HTermReq.
    Terminated {
        fes: u16,
        fei: u32,
    },
    /// The target broke the protocol as this host understands it.
    Protocol(String),
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostError::Io(e) => write!(f, "I/O error: {e}"),
            HostError::Nvme(s, dw0) => write!(f, "{s} (dw0 {dw0:#x})"),
            HostError::Terminated { fes, fei } => {
                write!(
                    f,
                    "target terminated the connection: FES {fes:#x} FEI {fei}"
                )
            }
            HostError::Protocol(m) => write!(f, "protocol error: {m}"),
        }
    }
}

impl std::error::Error for HostError {}

impl From<io::Error> for HostError {
    fn from(e: io::Error) -> Self {
        HostError::Io(e)
    }
}

pub type Result<T> = std::result::Result<T, HostError>;

/// A PDU of `total` zero bytes whose common header says what the arguments say (NVMe/TCP
/// 1.0 §3.3.1), true or not: what tests build malformed and half-valid PDUs from.
pub fn raw_pdu(pdu_type: u8, flags: u8, hlen: u8, pdo: u8, plen: u32, total: usize) -> Vec<u8> {
    let mut b = vec![0u8; total];
    CommonHeader {
        pdu_type,
        flags,
        hlen,
        pdo,
        plen,
    }
    .encode(&mut b);
    b
}

/// A completed command: its CQE and the data the target returned.
#[derive(Debug, Clone)]
pub struct Reply {
    pub cqe: Completion,
    pub data: Vec<u8>,
}

impl Reply {
    pub fn status(&self) -> Status {
        self.cqe.status()
    }
    /// `Ok(self)` on success, the status as an error otherwise.
    pub fn ok(self) -> Result<Reply> {
        if self.status().is_success() {
            Ok(self)
        } else {
            Err(HostError::Nvme(self.status(), self.cqe.dw0))
        }
    }
}

struct Pending {
    write: Vec<u8>,
    read: Vec<u8>,
}

/// One queue: a TCP connection after ICReq/ICResp.
pub struct Queue {
    sock: TcpStream,
    pub digests: Digests,
    pub maxh2cdata: u32,
    pub cpda: u8,
    /// Largest write sent in capsule (IOCCSZ × 16 − 64; 8 KiB on the admin queue).
    pub inline_max: usize,
    next_cid: u16,
    pending: HashMap<u16, Pending>,
    done: HashMap<u16, Reply>,
    out: Vec<u8>,
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
}

impl Queue {
    /// Open a TCP connection and exchange ICReq/ICResp.
    pub fn open(addr: SocketAddr, digests: Digests) -> Result<Queue> {
        let sock = TcpStream::connect(addr)?;
        sock.set_nodelay(true)?;
        Self::initialize(sock, digests, 0)
    }

    /// ICReq with the given HPDA on an open socket.
    pub fn initialize(mut sock: TcpStream, digests: Digests, hpda: u8) -> Result<Queue> {
        let mut b = Vec::new();
        IcReq {
            pfv: 0,
            hpda,
            digests,
            maxr2t: 0,
        }
        .encode(&mut b);
        sock.write_all(&b)?;
        let mut r = [0u8; tcp::IC_LEN];
        sock.read_exact(&mut r[..8])?;
        let ch = CommonHeader::decode(&r);
        if ch.pdu_type == pdu_type::C2H_TERM_REQ {
            let mut rest = vec![0u8; ch.plen as usize - 8];
            sock.read_exact(&mut rest)?;
            let mut all = r[..8].to_vec();
            all.extend_from_slice(&rest);
            let (fes, fei, _) = tcp::decode_term_req(&all);
            return Err(HostError::Terminated { fes, fei });
        }
        if ch.pdu_type != pdu_type::IC_RESP || ch.plen as usize != tcp::IC_LEN {
            return Err(HostError::Protocol(format!("expected ICResp, got {ch:?}")));
        }
        sock.read_exact(&mut r[8..])?;
        let resp = IcResp::decode(&r);
        // The checks Linux's nvme_tcp_init_connection makes.
        if resp.pfv != 0 || resp.cpda != 0 || resp.digests != digests {
            return Err(HostError::Protocol(format!("unacceptable ICResp {resp:?}")));
        }
        if resp.maxh2cdata < 4096 || resp.maxh2cdata % 4 != 0 {
            return Err(HostError::Protocol(format!(
                "invalid MAXH2CDATA {}",
                resp.maxh2cdata
            )));
        }
        Ok(Queue {
            sock,
            digests,
            maxh2cdata: resp.maxh2cdata,
            cpda: resp.cpda,
            inline_max: 8192,
            next_cid: 1,
            pending: HashMap::new(),
            done: HashMap::new(),
            out: Vec::new(),
            rbuf: vec![0u8; 1 << 20],
            rstart: 0,
            rend: 0,
        })
    }

    pub fn socket(&self) -> &TcpStream {
        &self.sock
    }

    fn alloc_cid(&mut self) -> u16 {
        loop {
            let c = self.next_cid;
            self.next_cid = self.next_cid.wrapping_add(1);
            if !self.pending.contains_key(&c) && !self.done.contains_key(&c) {
                return c;
            }
        }
    }

    /// Queue a command (sent on [`flush`](Self::flush)): its CID and SGL are filled in. Writes
    /// up to `inline_max` bytes go in the capsule, larger ones wait for the target's R2T.
    pub fn submit(&mut self, mut cmd: Command, write: &[u8], read_len: usize) -> u16 {
        let cid = self.alloc_cid();
        cmd.cid = cid;
        cmd.flags |= nacre_shared::nvme::command::PSDT_SGL;
        let mut inline: &[u8] = &[];
        if !write.is_empty() && write.len() <= self.inline_max {
            cmd.sgl = SglDescriptor::in_capsule(write.len() as u32);
            inline = write;
        } else if !write.is_empty() {
            cmd.sgl = SglDescriptor::transport(write.len() as u32);
        } else {
            cmd.sgl = SglDescriptor::transport(read_len as u32);
        }
        tcp::encode_capsule_cmd(&mut self.out, &cmd, inline, self.digests, self.cpda);
        self.pending.insert(
            cid,
            Pending {
                write: if inline.is_empty() {
                    write.to_vec()
                } else {
                    Vec::new()
                },
                read: vec![0u8; read_len],
            },
        );
        cid
    }

    /// Send raw bytes (after anything queued).
    pub fn send_raw(&mut self, b: &[u8]) -> Result<()> {
        self.flush()?;
        self.sock.write_all(b)?;
        Ok(())
    }

    pub fn flush(&mut self) -> Result<()> {
        if !self.out.is_empty() {
            self.sock.write_all(&self.out)?;
            self.out.clear();
        }
        Ok(())
    }

    fn fill(&mut self, n: usize) -> Result<()> {
        while self.rend - self.rstart < n {
            if self.rstart + n > self.rbuf.len() {
                self.rbuf.copy_within(self.rstart..self.rend, 0);
                self.rend -= self.rstart;
                self.rstart = 0;
                if n > self.rbuf.len() {
                    self.rbuf.resize(n, 0);
                }
            }
            // About to block: send what is queued first (batches commands the way the
            // target batches responses).
            self.flush()?;
            let k = self.sock.read(&mut self.rbuf[self.rend..])?;
            if k == 0 {
                return Err(HostError::Io(io::ErrorKind::UnexpectedEof.into()));
            }
            self.rend += k;
        }
        Ok(())
    }

    /// Read one whole PDU (header, digests, data) without interpreting it.
    pub fn recv_pdu_raw(&mut self) -> Result<Vec<u8>> {
        self.fill(8)?;
        let ch = CommonHeader::decode(&self.rbuf[self.rstart..]);
        let plen = ch.plen as usize;
        if plen < 8 {
            return Err(HostError::Protocol(format!("PDU length {plen}")));
        }
        self.fill(plen)?;
        let v = self.rbuf[self.rstart..self.rstart + plen].to_vec();
        self.rstart += plen;
        Ok(v)
    }

    /// Process one PDU; returns the CID of a command that completed, if any.
    pub fn poll(&mut self) -> Result<Option<u16>> {
        let pdu = self.recv_pdu_raw()?;
        let ch = CommonHeader::decode(&pdu);
        let hlen = ch.hlen as usize;
        if ch.pdu_type == pdu_type::C2H_TERM_REQ {
            let (fes, fei, _) = tcp::decode_term_req(&pdu);
            return Err(HostError::Terminated { fes, fei });
        }
        if tcp::expected_hlen(ch.pdu_type) != Some(hlen) {
            return Err(HostError::Protocol(format!("bad PDU header {ch:?}")));
        }
        let hd = if self.digests.header { 4 } else { 0 };
        if (ch.flags & flags::HDGSTF != 0) != self.digests.header {
            return Err(HostError::Protocol("header digest flag mismatch".into()));
        }
        if self.digests.header {
            let want = u32::from_le_bytes(pdu[hlen..hlen + 4].try_into().unwrap());
            if digest::crc32c(&pdu[..hlen]) != want {
                return Err(HostError::Protocol("header digest mismatch".into()));
            }
        }
        match ch.pdu_type {
            pdu_type::CAPSULE_RESP => {
                let cqe = Completion::decode(&pdu[8..24]);
                let p = self.pending.remove(&cqe.cid).ok_or_else(|| {
                    HostError::Protocol(format!("response for unknown CID {}", cqe.cid))
                })?;
                self.done.insert(cqe.cid, Reply { cqe, data: p.read });
                Ok(Some(cqe.cid))
            }
            pdu_type::C2H_DATA => {
                let h = DataHeader::decode(&pdu);
                let pdo = ch.pdo as usize;
                let dd = if self.digests.data { 4 } else { 0 };
                if pdo < hlen + hd || pdo + h.datal as usize + dd != pdu.len() {
                    return Err(HostError::Protocol(format!("bad C2HData layout {ch:?}")));
                }
                let data = &pdu[pdo..pdo + h.datal as usize];
                if self.digests.data {
                    if ch.flags & flags::DDGSTF == 0 {
                        return Err(HostError::Protocol("data digest flag clear".into()));
                    }
                    let want = u32::from_le_bytes(pdu[pdu.len() - 4..].try_into().unwrap());
                    if digest::crc32c(data) != want {
                        return Err(HostError::Protocol("data digest mismatch".into()));
                    }
                }
                let p = self.pending.get_mut(&h.cccid).ok_or_else(|| {
                    HostError::Protocol(format!("C2HData for unknown CID {}", h.cccid))
                })?;
                let end = h.datao as usize + data.len();
                if end > p.read.len() {
                    return Err(HostError::Protocol("C2HData beyond the buffer".into()));
                }
                p.read[h.datao as usize..end].copy_from_slice(data);
                if ch.flags & flags::SUCCESS != 0 {
                    if ch.flags & flags::LAST_PDU == 0 {
                        return Err(HostError::Protocol("SUCCESS without LAST_PDU".into()));
                    }
                    let p = self.pending.remove(&h.cccid).expect("present");
                    let cqe = Completion {
                        cid: h.cccid,
                        ..Default::default()
                    };
                    self.done.insert(h.cccid, Reply { cqe, data: p.read });
                    return Ok(Some(h.cccid));
                }
                Ok(None)
            }
            pdu_type::R2T => {
                let h = DataHeader::decode(&pdu);
                let p = self.pending.get(&h.cccid).ok_or_else(|| {
                    HostError::Protocol(format!("R2T for unknown CID {}", h.cccid))
                })?;
                let (o, l) = (h.datao as usize, h.datal as usize);
                if o + l > p.write.len() || l == 0 {
                    return Err(HostError::Protocol("R2T outside the write".into()));
                }
                let data = p.write[o..o + l].to_vec();
                let max = self.maxh2cdata as usize;
                let mut off = 0;
                while off < l {
                    let n = (l - off).min(max);
                    tcp::encode_h2c_data(
                        &mut self.out,
                        h.cccid,
                        h.ttag,
                        (o + off) as u32,
                        &data[off..off + n],
                        off + n == l,
                        self.digests,
                        self.cpda,
                    );
                    off += n;
                }
                self.flush()?;
                Ok(None)
            }
            t => Err(HostError::Protocol(format!("unexpected PDU type {t:#x}"))),
        }
    }

    /// Wait for command `cid`.
    pub fn wait(&mut self, cid: u16) -> Result<Reply> {
        loop {
            if let Some(r) = self.done.remove(&cid) {
                return Ok(r);
            }
            self.poll()?;
        }
    }

    /// Take a completed command (whatever its CID), polling until one completes.
    pub fn next_completion(&mut self) -> Result<(u16, Reply)> {
        loop {
            if let Some(&cid) = self.done.keys().next() {
                let r = self.done.remove(&cid).expect("present");
                return Ok((cid, r));
            }
            self.poll()?;
        }
    }

    /// Submit, send and wait.
    pub fn call(&mut self, cmd: Command, write: &[u8], read_len: usize) -> Result<Reply> {
        let cid = self.submit(cmd, write, read_len);
        self.flush()?;
        self.wait(cid)
    }

    /// Fabrics Connect (1024 bytes of in-capsule data, like Linux).
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        &mut self,
        subnqn: &str,
        hostnqn: &str,
        hostid: [u8; 16],
        qid: u16,
        sqsize: u16,
        cntlid: u16,
        kato_ms: u32,
        cattr: u8,
    ) -> Result<Reply> {
        let cmd = Connect {
            recfmt: 0,
            qid,
            sqsize: sqsize - 1,
            cattr,
            kato: kato_ms,
        }
        .to_command(0);
        let data = ConnectData {
            hostid,
            cntlid,
            subnqn: subnqn.into(),
            hostnqn: hostnqn.into(),
        }
        .encode();
        let saved = self.inline_max;
        self.inline_max = self.inline_max.max(fabrics::CONNECT_DATA_LEN);
        let r = self.call(cmd, &data, 0);
        self.inline_max = saved;
        r
    }
}

/// How to connect.
#[derive(Debug, Clone)]
pub struct HostOptions {
    pub hostnqn: String,
    pub hostid: [u8; 16],
    pub digests: Digests,
    /// Keep Alive Timeout (ms) sent in the admin Connect.
    pub kato_ms: u32,
    pub io_queues: u16,
    pub queue_size: u16,
    /// Set CATTR "disable SQ flow control", which lets the target use C2HData SUCCESS.
    pub disable_sq_flow: bool,
}

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-6e6163726531".into(),
            hostid: *b"nacre-test-host!",
            digests: Digests::NONE,
            kato_ms: 0,
            io_queues: 1,
            queue_size: 128,
            disable_sq_flow: false,
        }
    }
}

/// A connected controller: the admin queue and its I/O queues.
pub struct NvmfHost {
    pub admin: Queue,
    pub io: Vec<Queue>,
    pub cntlid: u16,
    pub id: IdentifyController,
    pub opts: HostOptions,
    pub addr: SocketAddr,
    pub subnqn: String,
}

impl NvmfHost {
    /// Connect the admin queue, enable the controller (CC.EN → CSTS.RDY), Identify it, ask
    /// for `opts.io_queues` queues and connect them — Linux's order.
    pub fn connect(addr: SocketAddr, subnqn: &str, opts: HostOptions) -> Result<NvmfHost> {
        let mut admin = Queue::open(addr, opts.digests)?;
        let r = admin
            .connect(
                subnqn,
                &opts.hostnqn,
                opts.hostid,
                0,
                32,
                fabrics::CNTLID_DYNAMIC,
                opts.kato_ms,
                0,
            )?
            .ok()?;
        let cntlid = r.cqe.dw0 as u16;
        let mut h = NvmfHost {
            admin,
            io: Vec::new(),
            cntlid,
            id: IdentifyController::default(),
            opts: opts.clone(),
            addr,
            subnqn: subnqn.into(),
        };
        let cap = h.property_get(registers::CAP, true)?;
        let mqes = registers::cap_mqes(cap) as u32 + 1;
        h.enable()?;
        h.id = h.identify_controller()?;
        if h.id.cntlid != cntlid {
            return Err(HostError::Protocol(
                "Identify CNTLID differs from Connect's".into(),
            ));
        }
        if subnqn == DISCOVERY_NQN || opts.io_queues == 0 {
            return Ok(h);
        }
        let nq = h.set_features(
            fid::NUMBER_OF_QUEUES,
            features::number_of_queues(opts.io_queues, opts.io_queues),
        )?;
        let (granted, _) = features::parse_number_of_queues(nq);
        let n = (opts.io_queues as u32).min(granted) as u16;
        let qsize = (opts.queue_size as u32).min(mqes) as u16;
        for qid in 1..=n {
            h.io.push(h.connect_io_queue(qid, qsize)?);
        }
        Ok(h)
    }

    /// Connect one more I/O queue with `qid`.
    pub fn connect_io_queue(&self, qid: u16, qsize: u16) -> Result<Queue> {
        let mut q = Queue::open(self.addr, self.opts.digests)?;
        q.inline_max = (self.id.ioccsz as usize * 16).saturating_sub(64);
        let cattr = if self.opts.disable_sq_flow {
            fabrics::CATTR_DISABLE_SQ_FLOW
        } else {
            0
        };
        q.connect(
            &self.subnqn,
            &self.opts.hostnqn,
            self.opts.hostid,
            qid,
            qsize,
            self.cntlid,
            0,
            cattr,
        )?
        .ok()?;
        Ok(q)
    }

    pub fn enable(&mut self) -> Result<()> {
        let v = cc::EN | cc::IOSQES_64 << cc::IOSQES_SHIFT | cc::IOCQES_16 << cc::IOCQES_SHIFT;
        self.property_set(registers::CC, v as u64)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = self.property_get(registers::CSTS, false)? as u32;
            if s & csts::CFS != 0 {
                return Err(HostError::Protocol("controller fatal status".into()));
            }
            if s & csts::RDY != 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(HostError::Protocol("CSTS.RDY never set".into()));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn property_get(&mut self, offset: u32, eight: bool) -> Result<u64> {
        let r = self
            .admin
            .call(Property::get_command(0, offset, eight), &[], 0)?
            .ok()?;
        Ok((r.cqe.dw1 as u64) << 32 | r.cqe.dw0 as u64)
    }

    pub fn property_set(&mut self, offset: u32, value: u64) -> Result<()> {
        self.admin
            .call(Property::set_command(0, offset, false, value), &[], 0)?
            .ok()?;
        Ok(())
    }

    /// An admin command expecting `read_len` bytes back.
    pub fn admin_cmd(&mut self, cmd: Command, read_len: usize) -> Result<Reply> {
        self.admin.call(cmd, &[], read_len)?.ok()
    }

    pub fn identify(&mut self, cns: u8, nsid: u32, cdw11: u32) -> Result<Vec<u8>> {
        let cmd = Command {
            opcode: admin_opcode::IDENTIFY,
            nsid,
            cdw10: cns as u32,
            cdw11,
            ..Default::default()
        };
        Ok(self.admin_cmd(cmd, identify::IDENTIFY_LEN)?.data)
    }

    pub fn identify_controller(&mut self) -> Result<IdentifyController> {
        Ok(IdentifyController::decode(&self.identify(
            identify::cns::CONTROLLER,
            0,
            0,
        )?))
    }

    pub fn identify_namespace(&mut self, nsid: u32) -> Result<IdentifyNamespace> {
        Ok(IdentifyNamespace::decode(&self.identify(
            identify::cns::NAMESPACE,
            nsid,
            0,
        )?))
    }

    pub fn active_namespaces(&mut self) -> Result<Vec<u32>> {
        Ok(identify::decode_ns_list(&self.identify(
            identify::cns::ACTIVE_NS_LIST,
            0,
            0,
        )?))
    }

    pub fn ns_descriptors(&mut self, nsid: u32) -> Result<Vec<NsDescriptor>> {
        Ok(identify::decode_ns_descriptors(&self.identify(
            identify::cns::NS_DESCRIPTOR_LIST,
            nsid,
            0,
        )?))
    }

    pub fn get_log_page(
        &mut self,
        lid: u8,
        nsid: u32,
        len: usize,
        offset: u64,
        rae: bool,
    ) -> Result<Vec<u8>> {
        let mut cmd = Command {
            opcode: admin_opcode::GET_LOG_PAGE,
            nsid,
            ..Default::default()
        };
        GetLogPage {
            lid,
            rae,
            len,
            offset,
        }
        .apply(&mut cmd);
        Ok(self.admin_cmd(cmd, len)?.data)
    }

    pub fn set_features(&mut self, fid: u8, cdw11: u32) -> Result<u32> {
        let cmd = Command {
            opcode: admin_opcode::SET_FEATURES,
            cdw10: fid as u32,
            cdw11,
            ..Default::default()
        };
        Ok(self.admin_cmd(cmd, 0)?.cqe.dw0)
    }

    pub fn get_features(&mut self, fid: u8) -> Result<u32> {
        let cmd = Command {
            opcode: admin_opcode::GET_FEATURES,
            cdw10: fid as u32,
            ..Default::default()
        };
        Ok(self.admin_cmd(cmd, 0)?.cqe.dw0)
    }

    pub fn keep_alive(&mut self) -> Result<()> {
        let cmd = Command {
            opcode: admin_opcode::KEEP_ALIVE,
            ..Default::default()
        };
        self.admin_cmd(cmd, 0)?;
        Ok(())
    }

    /// Send an Asynchronous Event Request; collect it with `self.admin.wait(cid)`.
    pub fn submit_aer(&mut self) -> Result<u16> {
        let cmd = Command {
            opcode: admin_opcode::ASYNC_EVENT_REQUEST,
            ..Default::default()
        };
        let cid = self.admin.submit(cmd, &[], 0);
        self.admin.flush()?;
        Ok(cid)
    }

    pub fn io_cmd(
        &mut self,
        q: usize,
        cmd: Command,
        write: &[u8],
        read_len: usize,
    ) -> Result<Reply> {
        self.io[q].call(cmd, write, read_len)?.ok()
    }

    pub fn read(&mut self, q: usize, nsid: u32, slba: u64, nlb: u32, bs: usize) -> Result<Vec<u8>> {
        let cmd = Command::rw(
            io_opcode::READ,
            0,
            nsid,
            slba,
            nlb,
            SglDescriptor::default(),
        );
        Ok(self.io_cmd(q, cmd, &[], nlb as usize * bs)?.data)
    }

    pub fn write(&mut self, q: usize, nsid: u32, slba: u64, data: &[u8], bs: usize) -> Result<()> {
        let nlb = (data.len() / bs) as u32;
        let cmd = Command::rw(
            io_opcode::WRITE,
            0,
            nsid,
            slba,
            nlb,
            SglDescriptor::default(),
        );
        self.io_cmd(q, cmd, data, 0)?;
        Ok(())
    }

    pub fn flush(&mut self, q: usize, nsid: u32) -> Result<()> {
        let cmd = Command {
            opcode: io_opcode::FLUSH,
            nsid,
            ..Default::default()
        };
        self.io_cmd(q, cmd, &[], 0)?;
        Ok(())
    }

    pub fn write_zeroes(&mut self, q: usize, nsid: u32, slba: u64, nlb: u32) -> Result<()> {
        let cmd = Command::rw(
            io_opcode::WRITE_ZEROES,
            0,
            nsid,
            slba,
            nlb,
            SglDescriptor::default(),
        );
        self.io_cmd(q, cmd, &[], 0)?;
        Ok(())
    }

    /// Dataset Management with the Deallocate attribute over `(slba, nlb)` ranges.
    pub fn deallocate(&mut self, q: usize, nsid: u32, ranges: &[(u64, u32)]) -> Result<()> {
        let mut data = vec![0u8; ranges.len() * 16];
        for (i, (slba, nlb)) in ranges.iter().enumerate() {
            data[i * 16 + 4..i * 16 + 8].copy_from_slice(&nlb.to_le_bytes());
            data[i * 16 + 8..i * 16 + 16].copy_from_slice(&slba.to_le_bytes());
        }
        let cmd = Command {
            opcode: io_opcode::DATASET_MANAGEMENT,
            nsid,
            cdw10: ranges.len() as u32 - 1,
            cdw11: 1 << 2,
            ..Default::default()
        };
        self.io_cmd(q, cmd, &data, 0)?;
        Ok(())
    }
}
