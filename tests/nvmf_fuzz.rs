//! Seeded random input against the NVMe/TCP target: garbage streams, half-valid PDUs, and
//! random command capsules and H2CData PDUs on connected admin and I/O queues.
//!
//! What must hold, whatever arrives (the brief: bad input never costs data):
//! * no thread of the target panics;
//! * no byte of the namespace changes — the random commands never carry a data-changing
//!   opcode (Write, Write Uncorrectable, Write Zeroes, Dataset Management, Copy, Zone
//!   Append; admin Format NVM, Sanitize, Namespace Management/Attachment), so any change
//!   would be a write landing where none was asked for;
//! * every connection ends once the host closes its side (no thread left waiting), and a
//!   well-behaved host is served afterwards.
//!
//! This is not a coverage-guided fuzzer; it runs in seconds on every CI run and prints the
//! seed of a failing case: NACRE_FUZZ_CASE=0x… reruns just that case, NACRE_FUZZ_SEED=N
//! starts elsewhere, NACRE_FUZZ_CASES=N runs more.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;
use nacre_shared::nvme::{Command, SglDescriptor};
use nacre_shared::nvme_tcp::{self as tcp, pdu_type, Digests, IcReq};
use nacre_tests::fuzz::{count_panics, env_u64, panics, Rng};
use nacre_tests::nvmf_host::{raw_pdu, HostOptions, NvmfHost, Queue};

const NQN: &str = "nqn.2024-01.io.nacre:fuzz";
const VOL_LEN: u64 = 1 << 20;
const LBA: u32 = 512;

/// I/O opcodes that change data (NVM Command Set 1.0 §3, §4 and the ZNS set's Zone Append).
const IO_WRITES: [u8; 6] = [0x01, 0x04, 0x08, 0x09, 0x19, 0x7d];
/// Admin opcodes that change data or namespaces (Base 2.0 §5).
const ADMIN_WRITES: [u8; 4] = [0x0d, 0x15, 0x80, 0x84];

/// A length near the interesting edges more often than uniformly.
fn edge_len(r: &mut Rng, max: u32) -> u32 {
    match r.below(6) {
        0 => 0,
        1 => max,
        2 => max.wrapping_add(1 + r.below(16) as u32),
        3 => u32::MAX - r.below(16) as u32,
        _ => r.below(max as u64 + 1) as u32,
    }
}

fn seed() -> u64 {
    env_u64("NACRE_FUZZ_SEED", 0x6e61_6372_6566_757a)
}

/// The case seeds to run: NACRE_FUZZ_CASE alone, or `default` drawn from `r`.
fn case_seeds(r: &mut Rng, default: u64) -> Vec<u64> {
    if let Ok(one) = std::env::var("NACRE_FUZZ_CASE") {
        let one = one.trim_start_matches("0x");
        return vec![u64::from_str_radix(one, 16).expect("NACRE_FUZZ_CASE=0xHEX")];
    }
    (0..env_u64("NACRE_FUZZ_CASES", default))
        .map(|_| r.next_u64())
        .collect()
}

/// The panic counter is process-wide, so the tests take turns.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn target() -> (Arc<NvmfTarget>, SocketAddr, Arc<RamVolume>) {
    let t = NvmfTarget::new();
    t.create_subsystem(NQN, "S", "M", true).unwrap();
    let vol = Arc::new(RamVolume::new(VOL_LEN, LBA).unwrap());
    let pattern: Vec<u8> = (0..VOL_LEN as usize).map(|i| (i * 7 + 3) as u8).collect();
    vol.write_at(0, &pattern).unwrap();
    t.add_namespace(NQN, None, vol.clone(), [2; 16], "v".into())
        .unwrap();
    let addr = t.add_listener(NQN, "127.0.0.1:0".parse().unwrap()).unwrap();
    (t, addr, vol)
}

fn contents(vol: &RamVolume) -> Vec<u8> {
    let mut b = vec![0u8; VOL_LEN as usize];
    vol.read_at(0, &mut b).unwrap();
    b
}

/// Close our side and wait for the target to close its side; it must not keep the
/// connection (and its thread) after the host is gone.
fn finish(mut s: TcpStream, case: u64) {
    let _ = s.shutdown(Shutdown::Write);
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut sink = Vec::new();
    match s.read_to_end(&mut sink) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("case {case:#x}: the target did not close the connection: {e}"),
    }
}

/// An ICReq asking for random digests (which the target grants as asked).
fn icreq(r: &mut Rng) -> (Vec<u8>, Digests) {
    let digests = Digests {
        header: r.chance(3),
        data: r.chance(3),
    };
    let mut b = Vec::new();
    IcReq {
        pfv: 0,
        hpda: 0,
        digests,
        maxr2t: 0,
    }
    .encode(&mut b);
    (b, digests)
}

/// A PDU header with fields near their legal values for the digests in force (type, HLEN,
/// flags and PLEN mostly consistent, PDO anywhere), then random bytes.
fn half_valid_pdu(r: &mut Rng, dg: Digests) -> Vec<u8> {
    let t = match r.below(6) {
        0 => r.next_u64() as u8,
        1 => r.below(10) as u8,
        2 => pdu_type::H2C_DATA,
        3 => pdu_type::H2C_TERM_REQ,
        _ => pdu_type::CAPSULE_CMD,
    };
    let hlen = if r.chance(4) {
        [8u8, 24, 72, 128, r.next_u64() as u8][r.below(5) as usize]
    } else {
        tcp::expected_hlen(t).unwrap_or(24) as u8
    };
    let hd = if dg.header { 4 } else { 0 };
    // A PDU without data (PLEN = HLEN) a quarter of the time: then PDO is reserved.
    let body = if r.chance(4) {
        0
    } else {
        r.below(600) as usize
    };
    let total = (hlen as usize).max(8) + hd + body;
    let plen = if r.chance(4) {
        edge_len(r, total as u32 * 2)
    } else {
        total as u32
    };
    let flags = if r.chance(4) {
        r.next_u64() as u8
    } else {
        (if dg.header { tcp::flags::HDGSTF } else { 0 })
            | (if dg.data && body > 0 {
                tcp::flags::DDGSTF
            } else {
                0
            })
    };
    let pdo = match r.below(3) {
        0 => hlen.wrapping_add(hd as u8),
        1 => hlen,
        _ => r.next_u64() as u8,
    };
    let mut b = raw_pdu(t, flags, hlen, pdo, plen, 8);
    b.extend(r.bytes(total - 8));
    b
}

/// A command capsule with a random SQE (data-changing opcodes replaced), a random SGL and
/// random in-capsule data, sometimes with one byte of the PDU flipped.
fn capsule(r: &mut Rng, banned: &[u8], digests: Digests) -> Vec<u8> {
    let mut cmd = Command::decode(&r.bytes(64));
    while banned.contains(&cmd.opcode) {
        cmd.opcode = r.next_u64() as u8;
    }
    if r.chance(3) {
        // Mostly the commands a queue really serves: Read, Flush, Identify, Get Log Page,
        // Get/Set Features, Keep Alive, AER, Property Get/Set (fabrics).
        cmd.opcode = [0x02, 0x00, 0x06, 0x02, 0x0a, 0x09, 0x18, 0x0c, 0x7f][r.below(9) as usize];
        if banned.contains(&cmd.opcode) {
            cmd.opcode = 0x02;
        }
    }
    let data_len = r.below(9000) as u32;
    if r.chance(2) {
        cmd.flags = nacre_shared::nvme::command::PSDT_SGL;
        cmd.sgl = if r.chance(2) {
            SglDescriptor::in_capsule(edge_len(r, data_len))
        } else {
            SglDescriptor::transport(edge_len(r, data_len))
        };
        cmd.nsid = r.below(3) as u32;
        cmd.cdw10 = r.below(VOL_LEN / LBA as u64 + 4) as u32;
        cmd.cdw12 = r.below(64) as u32;
    }
    let n = if r.chance(2) { data_len as usize } else { 0 };
    let data = r.bytes(n);
    let mut out = Vec::new();
    tcp::encode_capsule_cmd(&mut out, &cmd, &data, digests, 0);
    if r.chance(4) {
        let i = r.below(out.len() as u64) as usize;
        out[i] ^= 1 << r.below(8);
    }
    out
}

/// An H2CData PDU with random CCCID, TTAG, offset and length.
fn h2c_data(r: &mut Rng) -> Vec<u8> {
    let len = r.below(4200) as usize;
    let flags = if r.chance(2) {
        0x04
    } else {
        r.next_u64() as u8
    };
    let mut b = raw_pdu(pdu_type::H2C_DATA, flags, 24, 24, (24 + len) as u32, 24);
    b[8..10].copy_from_slice(&(r.below(64) as u16).to_le_bytes());
    b[10..12].copy_from_slice(&(r.below(64) as u16).to_le_bytes());
    b[12..16].copy_from_slice(&edge_len(r, 8192).to_le_bytes());
    b[16..20].copy_from_slice(
        &(if r.chance(2) {
            len as u32
        } else {
            edge_len(r, 8192)
        })
        .to_le_bytes(),
    );
    b.extend(r.bytes(len));
    b
}

fn check_nothing_changed(addr: SocketAddr, vol: &RamVolume, before: &[u8]) {
    assert_eq!(panics(), 0, "a target thread panicked");
    assert!(
        contents(vol) == before,
        "the namespace changed although no command asked for a write"
    );
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    h.write(0, 1, 5, &[0xA5; 512], 512).unwrap();
    assert_eq!(h.read(0, 1, 5, 1, 512).unwrap(), vec![0xA5; 512]);
}

#[test]
fn garbage_and_half_valid_pdus_before_and_after_icreq() {
    let _turn = serial();
    count_panics();
    let (_t, addr, vol) = target();
    let before = contents(&vol);
    let mut r = Rng::new(seed());
    for (case, case_seed) in case_seeds(&mut r, 3000).into_iter().enumerate() {
        let mut cr = Rng::new(case_seed);
        let mut s = TcpStream::connect(addr).unwrap();
        let mut stream = Vec::new();
        let mut dg = Digests::NONE;
        if cr.chance(2) {
            let (ic, negotiated) = icreq(&mut cr);
            stream.extend(ic);
            dg = negotiated;
        }
        for _ in 0..1 + cr.below(4) {
            match cr.below(3) {
                0 => {
                    let n = cr.below(300) as usize;
                    stream.extend(cr.bytes(n))
                }
                1 => stream.extend(half_valid_pdu(&mut cr, dg)),
                _ => stream.extend(capsule(&mut cr, &IO_WRITES, dg)),
            }
        }
        // The target may close early (that is its answer to garbage): a failed write is fine.
        let _ = s.write_all(&stream);
        finish(s, case_seed);
        assert_eq!(
            panics(),
            0,
            "case {case} (seed {case_seed:#x}) panicked the target"
        );
    }
    check_nothing_changed(addr, &vol, &before);
}

#[test]
fn random_commands_and_data_on_connected_queues() {
    let _turn = serial();
    count_panics();
    let (_t, addr, vol) = target();
    let before = contents(&vol);
    let mut r = Rng::new(seed() ^ 0x5555);
    for (case, case_seed) in case_seeds(&mut r, 300).into_iter().enumerate() {
        let mut cr = Rng::new(case_seed);
        let digests = Digests {
            header: cr.chance(3),
            data: cr.chance(3),
        };
        let opts = HostOptions {
            digests,
            ..HostOptions::default()
        };
        let h = NvmfHost::connect(addr, NQN, opts).unwrap_or_else(|e| {
            panic!("case {case} (seed {case_seed:#x}): a good host cannot connect: {e}")
        });
        let NvmfHost { mut admin, io, .. } = h;
        let mut io: Vec<Queue> = io;
        let mut queues: Vec<(&mut Queue, &[u8])> = vec![(&mut admin, &ADMIN_WRITES[..])];
        for q in io.iter_mut() {
            queues.push((q, &IO_WRITES[..]));
        }
        for _ in 0..4 + cr.below(20) {
            let qi = cr.below(queues.len() as u64) as usize;
            let (q, banned) = &mut queues[qi];
            let pdu = match cr.below(8) {
                0 => h2c_data(&mut cr),
                1 => half_valid_pdu(&mut cr, digests),
                _ => capsule(&mut cr, banned, digests),
            };
            if q.send_raw(&pdu).is_err() {
                break;
            }
        }
        drop(queues);
        for q in io.into_iter().chain(std::iter::once(admin)) {
            finish(q.socket().try_clone().unwrap(), case_seed);
        }
        assert_eq!(
            panics(),
            0,
            "case {case} (seed {case_seed:#x}) panicked the target"
        );
    }
    check_nothing_changed(addr, &vol, &before);
}
