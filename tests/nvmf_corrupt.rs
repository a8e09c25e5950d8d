//! nacred's NVMe/TCP target behind a link that flips bits in what the host sends (a proxy
//! corrupts about one byte in 20 000). With header and data digests negotiated, a corrupted
//! command or data never reaches the volume: every write the target acknowledges is there as
//! sent, every other byte of the namespace keeps its old contents (a flipped SLBA would
//! otherwise land a write elsewhere), and reads that succeed return the right data.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;
use nacre_shared::nvme_tcp::Digests;
use nacre_tests::fabric_support::{pattern, Proxy};
use nacre_tests::fuzz::Rng;
use nacre_tests::nvmf_host::{HostOptions, NvmfHost};

const NQN: &str = "nqn.2024-01.io.nacre:corrupt";
const VOL_LEN: u64 = 4 << 20;
const BS: usize = 512;
const SLOT: u64 = 64 << 10;
/// How long to keep trying to connect through the noisy link before calling it hung.
const HANG: Duration = Duration::from_secs(60);

fn connect(addr: SocketAddr) -> NvmfHost {
    let opts = HostOptions {
        digests: Digests {
            header: true,
            data: true,
        },
        ..HostOptions::default()
    };
    let t = Instant::now();
    loop {
        if let Ok(h) = NvmfHost::connect(addr, NQN, opts.clone()) {
            // A command or reply lost to corruption must not stall the test.
            for q in std::iter::once(&h.admin).chain(h.io.iter()) {
                q.socket()
                    .set_read_timeout(Some(Duration::from_secs(3)))
                    .unwrap();
            }
            return h;
        }
        assert!(t.elapsed() < HANG, "cannot connect through the link");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn with_digests_corrupted_commands_and_data_never_reach_the_volume() {
    let t = NvmfTarget::new();
    t.create_subsystem(NQN, "S", "M", true).unwrap();
    let vol = Arc::new(RamVolume::new(VOL_LEN, BS as u32).unwrap());
    let initial = pattern(3, 0, VOL_LEN as usize);
    vol.write_at(0, &initial).unwrap();
    t.add_namespace(NQN, None, vol.clone(), [5; 16], "v".into())
        .unwrap();
    let target_addr = t.add_listener(NQN, "127.0.0.1:0".parse().unwrap()).unwrap();
    let proxy = Proxy::start(target_addr);
    proxy.corrupt_upstream(20_000);
    let mut h = connect(proxy.addr);
    let mut rng = Rng::new(0x0bad_c0de_1234_5678);
    // Writes go to the upper half, one 64 KiB slot each; reads to the lower half.
    let half = VOL_LEN / 2;
    let slots = half / SLOT;
    let mut expect = initial.clone();
    let mut maybe = Vec::new(); // slots whose write failed: old or new contents, or a mix
    let (mut w_ok, mut w_err, mut r_ok, mut r_err) = (0u32, 0u32, 0u32, 0u32);
    for i in 0..200u64 {
        if i % 2 == 0 && (w_ok + w_err) < slots as u32 {
            let slot = (w_ok + w_err) as u64;
            let off = half + slot * SLOT;
            // Up to 16 KiB: in-capsule (8 KiB) and R2T-driven writes both.
            let len = 4096 * (1 + rng.below(4)) as usize;
            let data = pattern(500 + slot, off, len);
            match h.write(0, 1, off / BS as u64, &data, BS) {
                Ok(()) => {
                    w_ok += 1;
                    expect[off as usize..off as usize + len].copy_from_slice(&data);
                }
                Err(_) => {
                    w_err += 1;
                    maybe.push((off, len, data));
                    h = connect(proxy.addr);
                }
            }
        } else {
            let nlb = 1 + rng.below(16) as u32;
            let slba = rng.below(half / BS as u64 - u64::from(nlb));
            match h.read(0, 1, slba, nlb, BS) {
                Ok(d) => {
                    r_ok += 1;
                    let off = slba as usize * BS;
                    assert!(
                        d == initial[off..off + d.len()],
                        "read {i} at LBA {slba} returned wrong data"
                    );
                }
                Err(_) => {
                    r_err += 1;
                    h = connect(proxy.addr);
                }
            }
        }
    }
    let flipped = proxy.flipped.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("writes {w_ok} ok / {w_err} failed, reads {r_ok} ok / {r_err} failed, {flipped} bits flipped");
    let mut now = vec![0u8; VOL_LEN as usize];
    vol.read_at(0, &mut now).unwrap();
    // A failed write's slot may hold its old data, its new data, or a mix of the two.
    for (off, len, data) in &maybe {
        let (o, l) = (*off as usize, *len);
        for j in 0..l {
            if now[o + j] == data[j] {
                expect[o + j] = data[j];
            }
        }
    }
    if let Some(i) = (0..now.len()).find(|&i| now[i] != expect[i]) {
        panic!(
            "volume byte {i} (LBA {}) is not what any write put there",
            i / BS
        );
    }
    assert!(flipped >= 5, "only {flipped} bits flipped");
    assert!(
        w_ok >= 5 && r_ok >= 5,
        "too little I/O succeeded to mean anything"
    );
    assert!(w_err + r_err > 0, "no corruption was ever detected");
}
