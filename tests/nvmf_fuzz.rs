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
use nacre_shared::nvme_tcp::Digests;
use nacre_tests::fuzz::{
    capsule, count_panics, env_u64, h2c_data, half_valid_pdu, icreq, panics, Rng,
};
use nacre_tests::nvmf_host::{HostOptions, NvmfHost, Queue};

const NQN: &str = "nqn.2024-01.io.nacre:fuzz";
const VOL_LEN: u64 = 1 << 20;
const LBA: u32 = 512;

/// I/O opcodes that change data (NVM Command Set 1.0 §3, §4 and the ZNS set's Zone Append).
const IO_WRITES: [u8; 6] = [0x01, 0x04, 0x08, 0x09, 0x19, 0x7d];
/// Admin opcodes that change data or namespaces (Base 2.0 §5).
const ADMIN_WRITES: [u8; 4] = [0x0d, 0x15, 0x80, 0x84];

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
                _ => stream.extend(capsule(&mut cr, &IO_WRITES, dg, VOL_LEN / LBA as u64)),
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
                _ => capsule(&mut cr, banned, digests, VOL_LEN / LBA as u64),
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
