//! The PCIe NVMe controller over vfio-user, against real clients: SPDK's NVMe driver
//! (`spdk_nvme_identify`, `spdk_nvme_perf` with `trtype:VFIOUSER`) and a raw vfio-user
//! client (rust-vmm's `vfio_user::Client`) that plays a host driver step by step, including
//! a hostile one.
//!
//! SPDK's binaries come from `$SPDK_DIR` or the team's `../shared/tools/spdk`; without
//! them these tests fail saying so.

use std::path::{Path, PathBuf};
use std::process::Command as Process;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::frontend::nvme_pcie::VfioUserPorts;
use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;

const NQN: &str = "nqn.2024-01.io.nacre:pcie";
const SERIAL: &str = "NACREPCIE0001";
const NGUID: [u8; 16] = *b"pcie-nguid-0001!";
const VOL_SIZE: u64 = 64 << 20;

fn spdk_bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("SPDK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/spdk"));
    let p = dir.join("bin").join(name);
    assert!(
        p.is_file(),
        "SPDK's {name} is missing at {} (set SPDK_DIR to an SPDK v25.09 build with vfio-user)",
        p.display()
    );
    p
}

struct Served {
    _target: Arc<NvmfTarget>,
    ports: Arc<VfioUserPorts>,
    vol: Arc<dyn BlockDevice>,
    dir: tempfile::TempDir,
}

fn serve() -> Served {
    let target = NvmfTarget::new();
    target.create_subsystem(NQN, SERIAL, "nacre", true).unwrap();
    let vol: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(VOL_SIZE, 512).unwrap());
    target
        .add_namespace(NQN, None, vol.clone(), NGUID, "vol0".into())
        .unwrap();
    let ports = VfioUserPorts::new(&target);
    let dir = tempfile::tempdir().unwrap();
    let sock = ports.add_listener(NQN, dir.path()).unwrap();
    assert_eq!(sock, dir.path().join("cntrl"));
    Served {
        _target: target,
        ports,
        vol,
        dir,
    }
}

fn trid(dir: &Path) -> String {
    format!("trtype:VFIOUSER traddr:{} subnqn:{NQN}", dir.display())
}

/// SPDK's tools share DPDK's runtime files: one at a time.
static SPDK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run an SPDK tool with a deadline; its output, or a panic with it.
fn run_spdk(name: &str, args: &[&str]) -> String {
    let _one = SPDK.lock().unwrap_or_else(|p| p.into_inner());
    let mut child = Process::new(spdk_bin(name))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{name} failed ({}):\n{text}",
        out.status
    );
    text
}

#[test]
fn spdk_identify_sees_a_pcie_nvme_controller_named_nacre() {
    let s = serve();
    let out = run_spdk(
        "spdk_nvme_identify",
        &["--no-huge", "-s", "1024", "-r", &trid(s.dir.path())],
    );
    let field = |name: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(name))
            .map(|l| l.split_once(':').map_or("", |x| x.1).trim().to_string())
            .unwrap_or_else(|| panic!("no {name} in:\n{out}"))
    };
    assert_eq!(field("Model Number"), "nacre");
    assert_eq!(field("Serial Number"), SERIAL);
    assert_eq!(field("Subsystem NQN"), NQN);
    assert!(out.contains("NVMeoF Controller at VFIOUSER"), "{out}");
    assert_eq!(
        field("Size (in LBAs)"),
        format!("{} (0GiB)", VOL_SIZE / 512)
    );
    assert!(!out.contains("*ERROR*"), "{out}");
    drop(s.ports);
}

/// SPDK's perf over VFIOUSER: random read/write mixes at QD32 of 4 KiB and 16 KiB (PRP
/// list) transfers, error-free. The oracle: every 4 KiB block starts tagged with its own
/// index (each 8-byte word: index, word number); perf writes from buffers it filled with
/// one byte value, or read into earlier, so afterwards every block must hold one whole
/// tagged block (its own or another's, word order intact) or one repeated byte. A read that returned shifted, torn
/// or wrong data, or a write that landed so, breaks that.
#[test]
fn spdk_perf_runs_error_free_and_writes_land_whole() {
    let s = serve();
    // Tag every 4 KiB block with its index.
    let blocks = VOL_SIZE / 4096;
    let mut buf = vec![0u8; VOL_SIZE as usize];
    for b in 0..blocks as usize {
        for (i, chunk) in buf[b * 4096..(b + 1) * 4096].chunks_mut(8).enumerate() {
            chunk.copy_from_slice(&((b as u64) << 16 | i as u64 | 1 << 63).to_le_bytes());
        }
    }
    s.vol.write_at(0, &buf).unwrap();
    for (size, mix) in [("4096", "50"), ("16384", "30")] {
        let out = run_spdk(
            "spdk_nvme_perf",
            &[
                "--no-huge",
                "-s",
                "1024",
                "-q",
                "32",
                "-o",
                size,
                "-w",
                "randrw",
                "-M",
                mix,
                "-t",
                "2",
                "-r",
                &trid(s.dir.path()),
            ],
        );
        assert!(!out.contains("*ERROR*"), "{out}");
        assert!(out.contains("Total"), "no summary from perf:\n{out}");
    }
    s.vol.read_at(0, &mut buf).unwrap();
    let tag = |b: u64, i: usize| (b << 16 | i as u64 | 1 << 63).to_le_bytes();
    let mut moved = 0;
    for b in 0..blocks as usize {
        let blk = &buf[b * 4096..(b + 1) * 4096];
        if blk.iter().all(|&x| x == blk[0]) {
            moved += 1;
            continue;
        }
        let from = u64::from_le_bytes(blk[..8].try_into().unwrap()) >> 16 & 0xFFFF_FFFF;
        let whole = from < blocks && blk.chunks(8).enumerate().all(|(i, c)| c == tag(from, i));
        assert!(
            whole,
            "block {b} is not one whole tagged block: {:02x?}",
            &blk[..64]
        );
        moved += (from != b as u64) as usize;
    }
    assert!(moved > 0, "perf wrote nothing");
}
