//! Malformed NVMe/TCP input: each fatal transport error ends that connection with a
//! C2HTermReq carrying the right Fatal Error Status and Information (NVMe/TCP 1.0
//! §3.6.2.4, §3.5.6), never a panic, and never disturbs another connection.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::ram::RamVolume;
use nacre_shared::nvme::{io_opcode, Command, SglDescriptor, Status};
use nacre_shared::nvme_tcp::{
    self as tcp, ch_offset, data_offset_of, fes, icreq_offset, pdu_type, CommonHeader, Digests,
    IcReq,
};
use nacre_tests::nvmf_host::{raw_pdu, HostOptions, NvmfHost, Queue};

const NQN: &str = "nqn.2024-01.io.nacre:malformed";

/// A target with one reactor thread: every connection of a test shares it, so a misbehaving
/// peer is always next to the well-behaved ones it must not disturb.
fn target() -> (Arc<NvmfTarget>, SocketAddr) {
    let t = NvmfTarget::with_reactors(1);
    t.create_subsystem(NQN, "S", "M", true).unwrap();
    t.add_namespace(
        NQN,
        None,
        Arc::new(RamVolume::new(1 << 20, 512).unwrap()),
        [1; 16],
        "v".into(),
    )
    .unwrap();
    let addr = t.add_listener(NQN, "127.0.0.1:0".parse().unwrap()).unwrap();
    (t, addr)
}

/// Read the C2HTermReq, check the connection is closed after it, return (FES, FEI, copied
/// header).
fn expect_term(q: &mut Queue) -> (u16, u32, Vec<u8>) {
    q.socket()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let pdu = q.recv_pdu_raw().expect("a C2HTermReq");
    let ch = CommonHeader::decode(&pdu);
    assert_eq!(ch.pdu_type, pdu_type::C2H_TERM_REQ, "{ch:?}");
    assert_eq!(ch.hlen, 24);
    assert!(pdu.len() <= tcp::TERM_REQ_MAX_LEN);
    let r = tcp::decode_term_req(&pdu);
    assert!(
        q.recv_pdu_raw().is_err(),
        "connection must close after C2HTermReq"
    );
    r
}

fn expect_term_raw(s: &mut TcpStream) -> (u16, u32) {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = Vec::new();
    s.read_to_end(&mut b).unwrap();
    assert!(b.len() >= 24, "got {} bytes", b.len());
    assert_eq!(b[0], pdu_type::C2H_TERM_REQ);
    let (f, i, _) = tcp::decode_term_req(&b);
    (f, i)
}

/// A healthy connection still works (the target survived and is not disturbed).
fn still_serves(addr: SocketAddr) {
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    h.write(0, 1, 3, &[0x5A; 512], 512).unwrap();
    assert_eq!(h.read(0, 1, 3, 1, 512).unwrap(), vec![0x5A; 512]);
}

#[test]
fn first_pdu_must_be_icreq() {
    let (_t, addr) = target();
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&raw_pdu(pdu_type::CAPSULE_CMD, 0, 72, 0, 72, 72))
        .unwrap();
    assert_eq!(expect_term_raw(&mut s).0, fes::PDU_SEQUENCE_ERROR);
    still_serves(addr);
}

#[test]
fn icreq_with_unsupported_pfv_or_bad_length() {
    let (_t, addr) = target();
    let mut s = TcpStream::connect(addr).unwrap();
    let mut b = Vec::new();
    IcReq {
        pfv: 1,
        hpda: 0,
        digests: Digests::NONE,
        maxr2t: 0,
    }
    .encode(&mut b);
    s.write_all(&b).unwrap();
    assert_eq!(
        expect_term_raw(&mut s),
        (fes::UNSUPPORTED_PARAMETER, icreq_offset::PFV)
    );
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&raw_pdu(pdu_type::IC_REQ, 0, 128, 0, 64, 128))
        .unwrap();
    assert_eq!(
        expect_term_raw(&mut s),
        (fes::INVALID_HEADER_FIELD, ch_offset::PLEN)
    );
    let mut s = TcpStream::connect(addr).unwrap();
    b[10] = 200; // HPDA beyond 31
    b[8] = 0;
    s.write_all(&b).unwrap();
    assert_eq!(
        expect_term_raw(&mut s),
        (fes::UNSUPPORTED_PARAMETER, icreq_offset::HPDA)
    );
    still_serves(addr);
}

#[test]
fn second_icreq_is_a_sequence_error() {
    let (_t, addr) = target();
    let mut q = Queue::open(addr, Digests::NONE).unwrap();
    let mut b = Vec::new();
    IcReq {
        pfv: 0,
        hpda: 0,
        digests: Digests::NONE,
        maxr2t: 0,
    }
    .encode(&mut b);
    q.send_raw(&b).unwrap();
    let (f, _, hdr) = expect_term(&mut q);
    assert_eq!(f, fes::PDU_SEQUENCE_ERROR);
    assert_eq!(hdr[0], pdu_type::IC_REQ, "the offending header is copied");
}

#[test]
fn unknown_and_controller_to_host_types_are_invalid() {
    let (_t, addr) = target();
    for t in [
        0x08u8,
        0x0A,
        0xFF,
        pdu_type::C2H_DATA,
        pdu_type::CAPSULE_RESP,
        pdu_type::R2T,
    ] {
        let mut q = Queue::open(addr, Digests::NONE).unwrap();
        q.send_raw(&raw_pdu(t, 0, 24, 0, 24, 24)).unwrap();
        let (f, i, _) = expect_term(&mut q);
        assert_eq!(
            (f, i),
            (fes::INVALID_HEADER_FIELD, ch_offset::TYPE),
            "type {t:#x}"
        );
    }
    still_serves(addr);
}

#[test]
fn bad_lengths_and_offsets() {
    let (_t, addr) = target();
    // hlen wrong for a CapsuleCmd.
    let mut q = Queue::open(addr, Digests::NONE).unwrap();
    q.send_raw(&raw_pdu(pdu_type::CAPSULE_CMD, 0, 64, 0, 72, 72))
        .unwrap();
    assert_eq!(expect_term(&mut q).1, ch_offset::HLEN);
    // plen shorter than the header.
    let mut q = Queue::open(addr, Digests::NONE).unwrap();
    q.send_raw(&raw_pdu(pdu_type::CAPSULE_CMD, 0, 72, 0, 40, 72))
        .unwrap();
    assert_eq!(expect_term(&mut q).1, ch_offset::PLEN);
    // Data offset inside the header.
    let mut q = Queue::open(addr, Digests::NONE).unwrap();
    q.send_raw(&raw_pdu(pdu_type::CAPSULE_CMD, 0, 72, 10, 100, 100))
        .unwrap();
    assert_eq!(expect_term(&mut q).1, ch_offset::PDO);
    // Header digest flag set though no digest was negotiated.
    let mut q = Queue::open(addr, Digests::NONE).unwrap();
    q.send_raw(&raw_pdu(pdu_type::CAPSULE_CMD, 1, 72, 0, 76, 76))
        .unwrap();
    assert_eq!(expect_term(&mut q).1, ch_offset::FLAGS);
    still_serves(addr);
}

#[test]
fn oversize_in_capsule_data_exceeds_the_limit() {
    let (_t, addr) = target();
    let mut q = Queue::open(addr, Digests::NONE).unwrap();
    // 1 MiB of in-capsule data announced: beyond the 8 KiB the queue accepts.
    q.send_raw(&raw_pdu(
        pdu_type::CAPSULE_CMD,
        0,
        72,
        72,
        72 + (1 << 20),
        72,
    ))
    .unwrap();
    assert_eq!(expect_term(&mut q).0, fes::DATA_LIMIT_EXCEEDED);
    still_serves(addr);
}

/// A read capsule with a header digest, flipped at byte `at` by `mask` before it is sent:
/// the target must answer with a fatal Header Digest Error.
fn expect_header_digest_error(at: usize, mask: u8) {
    let (_t, addr) = target();
    let mut q = Queue::open(
        addr,
        Digests {
            header: true,
            data: false,
        },
    )
    .unwrap();
    let mut b = Vec::new();
    tcp::encode_capsule_cmd(
        &mut b,
        &Command::rw(io_opcode::READ, 1, 1, 0, 1, SglDescriptor::transport(512)),
        &[],
        q.digests,
        0,
    );
    b[at] ^= mask;
    q.send_raw(&b).unwrap();
    assert_eq!(expect_term(&mut q).0, fes::HEADER_DIGEST_ERROR);
    still_serves(addr);
}

#[test]
fn header_digest_error_is_fatal() {
    expect_header_digest_error(72, 0xFF); // the digest itself
}

/// A bit flipped in PLEN of a header that carries a digest: the target must check the digest
/// before believing PLEN, and answer at once — not wait for bytes the host never sends.
#[test]
fn corrupted_plen_is_caught_by_the_header_digest_without_waiting() {
    expect_header_digest_error(4, 0x02); // PLEN 76 -> 78: two bytes that never come
}

#[test]
fn data_digest_error_fails_the_command_only() {
    let (_t, addr) = target();
    let opts = HostOptions {
        digests: Digests {
            header: false,
            data: true,
        },
        ..Default::default()
    };
    let mut h = NvmfHost::connect(addr, NQN, opts).unwrap();
    let mut b = Vec::new();
    let cmd = Command::rw(
        io_opcode::WRITE,
        0x4242,
        1,
        0,
        1,
        SglDescriptor::in_capsule(512),
    );
    tcp::encode_capsule_cmd(&mut b, &cmd, &[9u8; 512], h.io[0].digests, 0);
    let n = b.len();
    b[n - 1] ^= 0x01;
    h.io[0].send_raw(&b).unwrap();
    let pdu = h.io[0].recv_pdu_raw().unwrap();
    let cqe = nacre_shared::nvme::Completion::decode(&pdu[8..24]);
    assert_eq!(cqe.cid, 0x4242);
    assert_eq!(cqe.status(), Status::TRANSIENT_TRANSPORT_ERROR);
    // Not written, and the queue keeps working.
    assert_eq!(h.read(0, 1, 0, 1, 512).unwrap(), vec![0u8; 512]);
}

#[test]
fn data_for_an_unknown_command_or_out_of_range() {
    let (_t, addr) = target();
    // H2CData with no R2T outstanding.
    let mut q = Queue::open(addr, Digests::NONE).unwrap();
    let mut b = Vec::new();
    tcp::encode_h2c_data(&mut b, 5, 77, 0, &[0u8; 512], true, Digests::NONE, 0);
    q.send_raw(&b).unwrap();
    assert_eq!(
        expect_term(&mut q),
        (
            fes::INVALID_HEADER_FIELD,
            data_offset_of::TTAG,
            b[..24].to_vec()
        )
    );
    // A real R2T, answered with data beyond the requested range.
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    let big = vec![1u8; 64 * 1024];
    let cmd = Command::rw(
        io_opcode::WRITE,
        9,
        1,
        0,
        128,
        SglDescriptor::transport(big.len() as u32),
    );
    let mut b = Vec::new();
    tcp::encode_capsule_cmd(&mut b, &cmd, &[], Digests::NONE, 0);
    h.io[0].send_raw(&b).unwrap();
    let r2t = h.io[0].recv_pdu_raw().unwrap();
    assert_eq!(r2t[0], pdu_type::R2T);
    let d = tcp::DataHeader::decode(&r2t);
    assert_eq!((d.cccid, d.datao, d.datal), (9, 0, 64 * 1024));
    let mut b = Vec::new();
    tcp::encode_h2c_data(
        &mut b,
        9,
        d.ttag,
        4096,
        &big[..4096],
        false,
        Digests::NONE,
        0,
    );
    h.io[0].send_raw(&b).unwrap();
    assert_eq!(expect_term(&mut h.io[0]).0, fes::DATA_OUT_OF_RANGE);
    // Only that I/O queue died: the controller's admin queue still answers.
    h.keep_alive().unwrap();
    still_serves(addr);
}

#[test]
fn random_garbage_never_takes_the_target_down() {
    let (_t, addr) = target();
    // A deterministic xorshift stream of PDU-shaped garbage.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..64 {
        let mut q = match Queue::open(addr, Digests::NONE) {
            Ok(q) => q,
            Err(e) => panic!("target stopped accepting: {e}"),
        };
        let len = 8 + (next() % 200) as usize;
        let mut b: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        b[0] = [pdu_type::CAPSULE_CMD, pdu_type::H2C_DATA, next() as u8][(next() % 3) as usize];
        // Keep plen small so the target does not wait for data that never comes.
        let plen = (next() % 300) as u32;
        b[4..8].copy_from_slice(&plen.to_le_bytes());
        let _ = q.send_raw(&b);
        let _ = q.socket().shutdown(std::net::Shutdown::Write);
        q.socket()
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        // Whatever comes back must be well-formed PDUs, ending in EOF.
        while let Ok(p) = q.recv_pdu_raw() {
            assert!(tcp::expected_hlen(p[0]).is_some());
        }
    }
    still_serves(addr);
}

#[test]
fn more_writes_awaiting_data_than_queue_entries_is_fatal() {
    let (_t, addr) = target();
    let opts = HostOptions {
        queue_size: 32,
        ..Default::default()
    };
    let mut h = NvmfHost::connect(addr, NQN, opts).unwrap();
    // 33 writes announcing 64 KiB each through R2T, never followed by data: the target
    // answers 32 R2Ts, then refuses to pin more buffers than the queue has entries.
    let mut b = Vec::new();
    for cid in 0..33u16 {
        let cmd = Command::rw(
            io_opcode::WRITE,
            cid,
            1,
            0,
            128,
            SglDescriptor::transport(65536),
        );
        tcp::encode_capsule_cmd(&mut b, &cmd, &[], Digests::NONE, 0);
    }
    h.io[0].send_raw(&b).unwrap();
    for _ in 0..32 {
        let p = h.io[0].recv_pdu_raw().unwrap();
        assert_eq!(p[0], pdu_type::R2T);
    }
    assert_eq!(expect_term(&mut h.io[0]).0, fes::DATA_LIMIT_EXCEEDED);
    still_serves(addr);
}

/// Found by tests/nvmf_fuzz.rs: PDO of a capsule without data is reserved (NVMe/TCP 1.0
/// §3.6.1: it describes where data starts, and there is none), so a value pointing past the
/// PDU must be ignored — it panicked the connection thread by indexing with it.
#[test]
fn pdo_of_a_capsule_without_data_is_ignored() {
    let (_t, addr) = target();
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    let cmd = Command {
        opcode: nacre_shared::nvme::admin_opcode::KEEP_ALIVE,
        cid: 0x4242,
        ..Default::default()
    };
    let mut pdu = Vec::new();
    tcp::encode_capsule_cmd(&mut pdu, &cmd, &[], Digests::NONE, 0);
    assert_eq!(pdu.len(), 72);
    pdu[3] = 200; // PDO, far past PLEN
    h.admin.send_raw(&pdu).unwrap();
    h.admin
        .socket()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let resp = h
        .admin
        .recv_pdu_raw()
        .expect("a CapsuleResp, not a dead connection");
    assert_eq!(CommonHeader::decode(&resp).pdu_type, pdu_type::CAPSULE_RESP);
    let cqe = nacre_shared::nvme::Completion::decode(&resp[tcp::CH_LEN..]);
    assert_eq!(cqe.cid, 0x4242);
    assert_eq!(cqe.status >> 1, 0, "Keep Alive must succeed: {cqe:?}");
    still_serves(addr);
}

/// A peer that never finishes setting up (no ICReq, or an ICReq but no Fabrics Connect) is
/// disconnected after the setup timeout; a connected queue that is merely idle is not.
#[test]
fn connections_that_never_connect_a_queue_are_closed() {
    let (t, addr) = target();
    // Long enough that the test's own host, on a loaded machine, sets up within it.
    t.set_setup_timeout(Duration::from_secs(1));
    let closed_by_target = |s: &mut TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut b = Vec::new();
        s.read_to_end(&mut b).is_ok()
    };
    // Silent from the start.
    let mut s = TcpStream::connect(addr).unwrap();
    assert!(closed_by_target(&mut s), "a silent peer was kept");
    // ICReq, then silence.
    let q = Queue::open(addr, Digests::NONE).unwrap();
    let mut s = q.socket().try_clone().unwrap();
    assert!(
        closed_by_target(&mut s),
        "a peer that never sent Connect was kept"
    );
    // Connected and idle past the setup timeout: still served.
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    h.write(0, 1, 9, &[0x3C; 512], 512).unwrap();
    assert_eq!(h.read(0, 1, 9, 1, 512).unwrap(), vec![0x3C; 512]);
}
/// A connected host that stops, or trickles bytes, in the middle of a PDU is disconnected
/// once the PDU timeout has passed since the PDU began — trickling does not reset it — while
/// idling between PDUs and large transfers are unaffected.
#[test]
fn a_host_stalling_mid_pdu_is_disconnected() {
    let (t, addr) = target();
    // Long enough that the test's own 128 KiB write, on a loaded machine, completes its
    // PDUs within it.
    t.set_pdu_timeout(Duration::from_secs(1));
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    // Idle between PDUs longer than the PDU timeout, then a 128 KiB write (R2T and H2CData
    // PDUs) and read: all fine.
    std::thread::sleep(Duration::from_millis(1500));
    let big: Vec<u8> = (0..128 * 1024).map(|i| (i % 251) as u8).collect();
    h.write(0, 1, 64, &big, 512).unwrap();
    assert_eq!(h.read(0, 1, 64, 256, 512).unwrap(), big);

    // A capsule claiming 4 KiB of in-capsule data; send its first 40 bytes, then one byte
    // every 100 ms (the whole PDU would take over 40 s).
    let cmd = Command::rw(
        io_opcode::WRITE,
        1,
        8,
        0,
        7,
        SglDescriptor::in_capsule(4096),
    );
    let mut pdu = Vec::new();
    tcp::encode_capsule_cmd(&mut pdu, &cmd, &[0xEE; 4096], Digests::NONE, 0);
    let mut s = h.io[0].socket().try_clone().unwrap();
    // Another host, served by the same reactor all along.
    let mut other = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    s.write_all(&pdu[..40]).unwrap();
    // Trickle for up to 6 s: six times the timeout. A per-read timeout would never fire.
    let mut refused = false;
    for i in 0..60 {
        std::thread::sleep(Duration::from_millis(100));
        other.write(0, 1, 20, &[i as u8; 512], 512).unwrap();
        assert_eq!(other.read(0, 1, 20, 1, 512).unwrap(), vec![i as u8; 512]);
        if s.write_all(&pdu[40 + i..41 + i]).is_err() {
            refused = true;
            break;
        }
    }
    assert!(
        refused,
        "the target kept a connection whose PDU never completed"
    );
    // Nothing of the half-sent write reached the volume, and others are still served.
    assert_ne!(other.read(0, 1, 7, 1, 512).unwrap(), vec![0xEE; 512]);
    still_serves(addr);
}
