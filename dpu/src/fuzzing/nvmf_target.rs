//! NVMe/TCP target: what a host sends, as a raw byte stream ([`nvmf_target`]) and as
//! NVMe admin and I/O commands on connected queues ([`nvme_commands`]). Both share the
//! target fixture and the capsule helpers.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};

use nacre_shared::nvme::command::PSDT_SGL;
use nacre_shared::nvme::fabrics::{self, Connect, ConnectData, Property};
use nacre_shared::nvme::{registers, Command, Completion as Cqe, SglDescriptor};
use nacre_shared::nvme_tcp::{self as tcp, pdu_type, CommonHeader, Digests, IcReq};

use super::{feed, helper, ignore_sigpipe, stream_pair, HOSTNQN, NQN, NS_BYTES, NS_LBA};
use crate::frontend::nvmf_tcp::NvmfTarget;
use crate::volume::ram::RamVolume;
use crate::volume::BlockDevice;

struct TargetFixture {
    target: Arc<NvmfTarget>,
    listener: SocketAddr,
    vol: Arc<RamVolume>,
}

fn target_fixture() -> &'static TargetFixture {
    static T: OnceLock<TargetFixture> = OnceLock::new();
    T.get_or_init(|| {
        ignore_sigpipe();
        let target = NvmfTarget::new();
        target
            .create_subsystem(NQN, "FUZZ0001", "nacre-fuzz", true)
            .expect("subsystem");
        let vol = Arc::new(RamVolume::new(NS_BYTES, NS_LBA).expect("ram volume"));
        target
            .add_namespace(NQN, None, vol.clone(), [7; 16], "fuzz".into())
            .expect("namespace");
        // The subsystem must be reachable on the listener a connection came through.
        let listener = target
            .add_listener(NQN, "127.0.0.1:0".parse().expect("addr"))
            .expect("listener");
        TargetFixture {
            target,
            listener,
            vol,
        }
    })
}

/// Check that `out` is a sequence of well-framed controller-to-host PDUs (ICResp first).
fn check_c2h_stream(out: &[u8], digests: Option<Digests>) {
    let mut at = 0;
    let mut first = true;
    while at < out.len() {
        assert!(
            out.len() - at >= tcp::CH_LEN,
            "target sent a truncated PDU header"
        );
        let ch = CommonHeader::decode(&out[at..]);
        let plen = ch.plen as usize;
        let expected = tcp::expected_hlen(ch.pdu_type);
        assert!(
            matches!(
                ch.pdu_type,
                pdu_type::IC_RESP
                    | pdu_type::C2H_TERM_REQ
                    | pdu_type::CAPSULE_RESP
                    | pdu_type::C2H_DATA
                    | pdu_type::R2T
            ),
            "target sent PDU type {:#x}",
            ch.pdu_type
        );
        if first {
            assert!(
                matches!(ch.pdu_type, pdu_type::IC_RESP | pdu_type::C2H_TERM_REQ),
                "the target's first PDU is ICResp or C2HTermReq, not {:#x}",
                ch.pdu_type
            );
        } else {
            assert_ne!(ch.pdu_type, pdu_type::IC_RESP, "ICResp comes once, first");
        }
        assert_eq!(
            Some(ch.hlen as usize),
            expected,
            "HLEN of {:#x}",
            ch.pdu_type
        );
        assert!(plen >= ch.hlen as usize, "PLEN below HLEN");
        assert!(out.len() - at >= plen, "target sent a truncated PDU");
        if let (Some(dg), false) = (digests, first) {
            if ch.pdu_type != pdu_type::C2H_TERM_REQ {
                assert_eq!(ch.flags & tcp::flags::HDGSTF != 0, dg.header);
            }
        }
        first = false;
        at += plen;
    }
}

/// A raw host byte stream into one NVMe/TCP target connection, as if accepted from the
/// network: ICReq, capsules, H2CData, garbage, in any order. The target serves the
/// subsystem [`NQN`] (any host allowed) with one [`NS_BYTES`] RAM namespace.
///
/// Checks: no panic (a caught one too), the connection ends when the host closes, and
/// what the target sent back is a sequence of well-framed controller-to-host PDUs.
pub fn nvmf_target(data: &[u8]) {
    let f = target_fixture();
    let (host, tgt) = stream_pair();
    let feeder = feed(host, data.to_vec(), true);
    f.target.serve_stream(tgt, f.listener);
    let out = feeder.join().expect("feeder");
    let digests = (data.len() >= tcp::IC_LEN && data[0] == pdu_type::IC_REQ)
        .then(|| IcReq::decode(&data[..tcp::IC_LEN]).digests);
    check_c2h_stream(&out, digests);
}

// ---------------------------------------------------------------------------------------
// NVMe admin and I/O commands on connected queues
// ---------------------------------------------------------------------------------------

/// I/O opcodes that change data (NVM Command Set 1.0 and the ZNS set's Zone Append).
pub const IO_WRITES: [u8; 6] = [0x01, 0x04, 0x08, 0x09, 0x19, 0x7d];
/// Admin opcodes that change data or namespaces (Base 2.0 §5).
pub const ADMIN_WRITES: [u8; 4] = [0x0d, 0x15, 0x80, 0x84];

/// One command record of [`nvme_commands`] input.
#[derive(Debug, Clone)]
pub struct CmdRecord {
    /// Send on the I/O queue (else the admin queue).
    pub io: bool,
    /// Replace the SGL by an in-capsule descriptor over `data` (and set PSDT to SGL).
    pub fix_sgl: bool,
    pub sqe: [u8; 64],
    pub data: Vec<u8>,
}

/// Parse [`nvme_commands`] input: records of `kind` (bit 0 I/O queue, bit 1 fix the SGL),
/// the 64-byte SQE, le16 data length, data (cut at the end of the input).
pub fn parse_cmd_records(data: &[u8]) -> Vec<CmdRecord> {
    let mut v = Vec::new();
    let mut at = 0;
    while data.len() - at > 64 {
        let kind = data[at];
        let mut sqe = [0u8; 64];
        sqe.copy_from_slice(&data[at + 1..at + 65]);
        at += 65;
        let mut len = 0usize;
        if data.len() - at >= 2 {
            len = usize::from(u16::from_le_bytes([data[at], data[at + 1]]));
            at += 2;
        }
        let len = len.min(data.len() - at);
        v.push(CmdRecord {
            io: kind & 1 != 0,
            fix_sgl: kind & 2 != 0,
            sqe,
            data: data[at..at + len].to_vec(),
        });
        at += len;
    }
    v
}

fn capsule_of(r: &CmdRecord, cid: u16, out: &mut Vec<u8>) {
    let mut cmd = Command::decode(&r.sqe);
    cmd.cid = cid;
    if r.fix_sgl {
        cmd.flags = (cmd.flags & !0xC0) | PSDT_SGL;
        cmd.sgl = SglDescriptor::in_capsule(r.data.len() as u32);
    }
    tcp::encode_capsule_cmd(out, &cmd, &r.data, Digests::NONE, 0);
}

fn connect_capsule(qid: u16, cntlid: u16, out: &mut Vec<u8>) {
    let sqe = Connect {
        recfmt: 0,
        qid,
        sqsize: 31,
        cattr: 0,
        kato: 0,
    }
    .to_command(0xC000 | qid);
    let data = ConnectData {
        hostid: [0x42; 16],
        cntlid,
        subnqn: NQN.into(),
        hostnqn: HOSTNQN.into(),
    }
    .encode();
    tcp::encode_capsule_cmd(out, &sqe, &data, Digests::NONE, 0);
}

pub(super) fn icreq(digests: Digests, out: &mut Vec<u8>) {
    IcReq {
        pfv: 0,
        hpda: 0,
        digests,
        maxr2t: 0,
    }
    .encode(out);
}

/// Read one PDU from `s` (no digests).
fn read_pdu(s: &mut UnixStream) -> Option<Vec<u8>> {
    let mut b = vec![0u8; tcp::CH_LEN];
    s.read_exact(&mut b).ok()?;
    let plen = CommonHeader::decode(&b).plen as usize;
    if !(tcp::CH_LEN..=1 << 20).contains(&plen) {
        return None;
    }
    b.resize(plen, 0);
    s.read_exact(&mut b[tcp::CH_LEN..]).ok()?;
    Some(b)
}

fn namespace_bytes(v: &RamVolume) -> Vec<u8> {
    let mut b = vec![0u8; NS_BYTES as usize];
    v.read_at(0, &mut b).expect("read namespace");
    b
}

/// NVMe admin and I/O commands on a connected, enabled controller: the harness opens an
/// admin queue (ICReq, Connect, Property Set CC.EN=1) and an I/O queue (Connect qid 1),
/// then sends each record of the input (see [`parse_cmd_records`]) as a command capsule on
/// its queue — the I/O commands first, then the admin commands — and closes.
///
/// Checks: no panic; replies are well-framed; and when no record carries a data-changing
/// opcode ([`IO_WRITES`], [`ADMIN_WRITES`]) not one byte of the namespace changed.
pub fn nvme_commands(data: &[u8]) {
    let f = target_fixture();
    let recs = parse_cmd_records(data);
    static PATTERN: OnceLock<Vec<u8>> = OnceLock::new();
    let pattern =
        PATTERN.get_or_init(|| (0..NS_BYTES as usize).map(|i| (i * 7 + 3) as u8).collect());
    f.vol.write_at(0, pattern).expect("reset namespace");

    // Admin queue, served on its own thread for as long as the I/O queue needs it.
    let (mut admin, admin_tgt) = stream_pair();
    let target = f.target.clone();
    let listener = f.listener;
    let admin_thread = helper::run(move || target.serve_stream(admin_tgt, listener));
    let mut setup = Vec::new();
    icreq(Digests::NONE, &mut setup);
    connect_capsule(0, fabrics::CNTLID_DYNAMIC, &mut setup);
    let cc = 1 | (6 << 16) | (4 << 20);
    let set = Property::set_command(0xC100, registers::CC, false, cc);
    tcp::encode_capsule_cmd(&mut setup, &set, &[], Digests::NONE, 0);
    admin.write_all(&setup).expect("admin setup");
    let mut admin_out = Vec::new();
    let mut cntlid = None;
    for _ in 0..3 {
        let Some(p) = read_pdu(&mut admin) else { break };
        if p[0] == pdu_type::CAPSULE_RESP && cntlid.is_none() {
            let cqe = Cqe::decode(&p[tcp::CH_LEN..]);
            assert!(cqe.status().is_success(), "admin Connect failed");
            cntlid = Some(cqe.dw0 as u16);
        }
        admin_out.extend_from_slice(&p);
    }
    let cntlid = cntlid.expect("admin Connect answered");

    // I/O queue, served on this thread.
    let (io, io_tgt) = stream_pair();
    let mut io_in = Vec::new();
    icreq(Digests::NONE, &mut io_in);
    connect_capsule(1, cntlid, &mut io_in);
    for (i, r) in recs.iter().enumerate().filter(|(_, r)| r.io) {
        capsule_of(r, i as u16, &mut io_in);
    }
    let feeder = feed(io, io_in, true);
    f.target.serve_stream(io_tgt, f.listener);
    let io_out = feeder.join().expect("io feeder");
    check_c2h_stream(&io_out, Some(Digests::NONE));

    let mut admin_in = Vec::new();
    for (i, r) in recs.iter().enumerate().filter(|(_, r)| !r.io) {
        capsule_of(r, i as u16, &mut admin_in);
    }
    let rest = feed(admin, admin_in, true).join().expect("admin feeder");
    admin_thread.join().expect("admin queue thread");
    admin_out.extend_from_slice(&rest);
    check_c2h_stream(&admin_out, Some(Digests::NONE));

    let writes = recs.iter().any(|r| {
        let banned: &[u8] = if r.io { &IO_WRITES } else { &ADMIN_WRITES };
        banned.contains(&r.sqe[0])
    });
    if !writes {
        assert!(
            namespace_bytes(&f.vol) == *pattern,
            "the namespace changed although no command asked for a write"
        );
    }
}
