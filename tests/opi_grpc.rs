//! OPI's storage API over gRPC (`nacred --opi-listen`), driven by a Python grpcio client
//! (tests/opi/opi_client.py) whose stubs grpcio-tools generates from proto/opi/storage/v1 at
//! test time: the services listed through server reflection; the sequence of OPI's
//! `godpu storage create`, data written through what it made and read back, `godpu storage
//! delete`; Create/Get/List/Update/Delete/Stats and the AIP rules per service; bad input;
//! and the gRPC and JSON-RPC APIs seeing one state, replayed by a restart; an encrypted
//! volume with the client's key, its ciphertext at rest checked by Python `cryptography`.
//!
//! The NVMe/TCP target the backend connects to is a second nacred; SPDK's own NVMe host
//! (`spdk_nvme_identify`, `spdk_nvme_perf`, from `$SPDK_DIR` or the team's
//! `../shared/tools/spdk`) also drives the OPI-made NVMe/TCP controller and, over
//! `trtype:VFIOUSER`, the OPI-made PCIe controller; without it the tests fail saying so.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nacre_tests::blkio_client::{read, write, BlkioClient, ClientOptions};
use nacre_tests::daemon::Nacred;
use nacre_tests::nvmf_host::{HostOptions, NvmfHost};
use nacre_tests::xts_oracle::{python_cryptography_available, python_decrypt_file, to_hex};
use serde_json::{json, Value};

const TARGET_NQN: &str = "nqn.2024-01.io.nacre:opi-shelf";
const FRONT_NQN: &str = "nqn.2024-01.io.nacre:opi-front";

/// Run one subcommand of the Python client; its last stdout line is JSON.
fn client(args: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("opi/opi_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .args(args)
        .output()
        .expect("python3 must be installed (scripts/setup --test)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "opi_client.py {args:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("opi_client.py {args:?}: {e}: {stdout}"))
}

/// The address nacred says its OPI server bound.
fn opi_addr(n: &Nacred) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = n.log_text();
        if let Some(a) = log
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("nacred: OPI gRPC on "))
        {
            return a.trim().to_string();
        }
        assert!(
            Instant::now() < deadline,
            "no OPI address in the log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An SPDK v25.09 binary: from `$SPDK_DIR` or the team's `../shared/tools/spdk`.
fn spdk_bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("SPDK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/spdk"));
    let p = dir.join("bin").join(name);
    assert!(
        p.is_file(),
        "SPDK's {name} is missing at {} (set SPDK_DIR to an SPDK v25.09 build)",
        p.display()
    );
    p
}

/// Run an SPDK tool without hugepages (`--no-huge -s 1024`); its output, which it must
/// end successfully.
fn run_spdk(name: &str, args: &[&str]) -> String {
    let out = Command::new(spdk_bin(name))
        .args(["--no-huge", "-s", "1024"])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run SPDK's {name}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{name} {args:?} failed ({}):\n{text}",
        out.status
    );
    text
}

fn opi_daemon() -> Nacred {
    Nacred::start_args(&["--no-default", "--opi-listen", "127.0.0.1:0"])
}

#[test]
fn reflection_lists_every_storage_service() {
    let n = opi_daemon();
    let names = client(&["services", &opi_addr(&n)]);
    for s in [
        "opi_api.storage.v1.FrontendNvmeService",
        "opi_api.storage.v1.FrontendVirtioBlkService",
        "opi_api.storage.v1.NvmeRemoteControllerService",
        "opi_api.storage.v1.NullVolumeService",
        "opi_api.storage.v1.MallocVolumeService",
        "opi_api.storage.v1.AioVolumeService",
        "opi_api.storage.v1.MiddleendQosVolumeService",
        "opi_api.storage.v1.MiddleendEncryptionService",
    ] {
        assert!(
            names["services"].as_array().unwrap().iter().any(|n| n == s),
            "{s} missing: {names}"
        );
    }
}

#[test]
fn non_loopback_without_tls_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (state, run) = (tmp.path().join("state"), tmp.path().join("run"));
    let out = Command::new(nacre_tests::daemon::bin("nacred"))
        .args(["--no-default", "--opi-listen", "0.0.0.0:0"])
        .arg("--state-dir")
        .arg(&state)
        .arg("--run-dir")
        .arg(&run)
        .env("NACRE_METRICS_LISTEN", "off")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("loopback only"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    // Refused before anything else: the directories are not even made.
    assert!(!state.exists() && !run.exists());
}

#[test]
fn mutual_tls_serves_the_cas_clients_only() {
    let tls = tempfile::tempdir().unwrap();
    let out = Command::new(nacre_tests::daemon::bin("nacre"))
        .args(["cert", "init", "--dir"])
        .arg(tls.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let n = Nacred::start_args(&[
        "--no-default",
        "--opi-listen",
        "127.0.0.1:0",
        "--opi-tls-dir",
        tls.path().to_str().unwrap(),
    ]);
    let out = client(&["tls", &opi_addr(&n), tls.path().to_str().unwrap()]);
    assert_eq!(out["refused"].as_object().unwrap().len(), 4, "{out}");
    assert!(
        n.log_text()
            .contains("OPI gRPC: refused (TLS handshake failed)"),
        "refusals are logged"
    );
}

#[test]
fn crud_aip_rules_bad_input_and_both_apis() {
    let n = opi_daemon();
    let out = client(&["crud", &opi_addr(&n), n.rpc.to_str().unwrap()]);
    assert_eq!(out["checks"], 6, "{out}");
}

/// A controller with a PCIe endpoint is a vfio-user listener in
/// `<run-dir>/vfio-user/<port>-<pf>-<vf>`: SPDK's NVMe driver identifies it, a restart
/// replays it, and deleting it removes the socket.
#[test]
fn pcie_controller_is_a_vfio_user_listener_spdk_identifies() {
    const NQN: &str = "nqn.2024-01.io.nacre:opi-pcie";
    let mut n = opi_daemon();
    let made = client(&["pcie", &opi_addr(&n), NQN]);
    assert_eq!(made["nsid"], 1, "{made}");
    let dir = n.run_dir.join("vfio-user/0-0-1");
    let sock = dir.join("cntrl");
    assert!(sock.exists(), "no vfio-user socket at {}", sock.display());
    let identify = || {
        let trid = format!("trtype:VFIOUSER traddr:{} subnqn:{NQN}", dir.display());
        let id = run_spdk("spdk_nvme_identify", &["-r", &trid]);
        assert!(
            id.lines()
                .any(|l| l.starts_with("Model Number:") && l.ends_with(" nacre")),
            "model is not nacre:\n{id}"
        );
        assert!(
            id.contains("Serial Number:                         OPIPCIE1"),
            "{id}"
        );
        assert!(id.contains("Namespace ID:1"), "{id}");
    };
    identify();
    n.restart();
    identify();
    client(&["pcie-delete", &opi_addr(&n)]);
    assert!(!sock.exists(), "{} is still there", sock.display());
    assert!(!dir.exists(), "{} is still there", dir.display());
}

#[test]
fn godpu_create_data_path_restart_delete() {
    // The shelf: a second nacred exporting a RAM volume over NVMe/TCP.
    let shelf = Nacred::start_args(&["--no-default"]);
    shelf.ok(
        "volume_create",
        json!({"name": "shelf", "size": 16 << 20, "backend": "ram", "block_size": 512}),
    );
    let target: SocketAddr = shelf.export_nvmf(TARGET_NQN, "shelf");

    let mut n = opi_daemon();
    let addr = opi_addr(&n);
    let made = client(&["create", &addr, &target.to_string(), TARGET_NQN, FRONT_NQN]);
    let port = made["tcp_port"].as_u64().unwrap() as u16;
    let nsid = made["nsid"].as_u64().unwrap() as u32;

    // Written through the OPI frontend (NVMe/TCP on the DPU) … read back on the shelf.
    let bs = 512;
    let data: Vec<u8> = (0..8 * bs).map(|i| (i * 7 + 3) as u8).collect();
    let mut front = NvmfHost::connect(
        SocketAddr::from(([127, 0, 0, 1], port)),
        FRONT_NQN,
        HostOptions::default(),
    )
    .expect("connect to the OPI-made controller");
    front
        .write(0, nsid, 16, &data, bs)
        .expect("write through the frontend");
    assert_eq!(front.read(0, nsid, 16, 8, bs).unwrap(), data);
    drop(front);
    let mut back = NvmfHost::connect(target, TARGET_NQN, HostOptions::default()).unwrap();
    assert_eq!(
        back.read(0, 1, 16, 8, bs).unwrap(),
        data,
        "the shelf does not hold what was written through the OPI frontend"
    );
    drop(back);

    // ResetNvmeRemoteController: the path's session ends and comes back; the data with it.
    let remote = || {
        let l = n.ok("remote_list", json!({}));
        l.as_array().unwrap()[0].clone()
    };
    assert_eq!(remote()["resets"], 0, "{}", remote());
    client(&["reset", &addr]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(remote()["resets"] == 1 && remote()["state"] == "live") {
        assert!(
            Instant::now() < deadline,
            "not reconnected after the reset: {}",
            remote()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut front = NvmfHost::connect(
        SocketAddr::from(([127, 0, 0, 1], port)),
        FRONT_NQN,
        HostOptions::default(),
    )
    .unwrap();
    assert_eq!(
        front.read(0, nsid, 16, 8, bs).unwrap(),
        data,
        "after the reset"
    );
    drop(front);

    // SPDK's NVMe host against the OPI-made NVMe/TCP controller: what it identifies is
    // the OPI spec, and what it writes reaches the shelf block for block.
    let trid = format!("trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:{port} subnqn:{FRONT_NQN}");
    let id = run_spdk("spdk_nvme_identify", &["-r", &trid]);
    let field = |name: &str| {
        id.lines()
            .find(|l| l.trim_start().starts_with(name))
            .map(|l| l.split_once(':').map_or("", |x| x.1).trim().to_string())
            .unwrap_or_else(|| panic!("no {name} in:\n{id}"))
    };
    assert_eq!(field("Serial Number"), "OPI0001", "{id}");
    assert_eq!(field("Model Number"), "nacre-opi", "{id}");
    assert_eq!(field("Subsystem NQN"), FRONT_NQN, "{id}");
    assert!(id.contains("Namespace ID:1"), "{id}");
    assert!(
        field("Size (in LBAs)").starts_with("32768 "),
        "16 MiB of 512-byte blocks: {id}"
    );
    // The first MiB gets a pattern that differs in every 512-byte block; spdk_nvme_perf's
    // writes (its buffers hold zeros or what it read elsewhere) leave their mark on it.
    let pattern = |lba: u64| -> Vec<u8> {
        (0..128 * bs)
            .map(|i| ((lba as usize * bs + i) % 253 + 1) as u8)
            .collect()
    };
    let mut front = NvmfHost::connect(
        SocketAddr::from(([127, 0, 0, 1], port)),
        FRONT_NQN,
        HostOptions::default(),
    )
    .unwrap();
    for lba in (0..2048u64).step_by(128) {
        front.write(0, nsid, lba, &pattern(lba), bs).unwrap();
    }
    drop(front);
    let perf = run_spdk(
        "spdk_nvme_perf",
        &[
            "-q", "8", "-o", "4096", "-w", "randrw", "-M", "50", "-t", "1", "-r", &trid,
        ],
    );
    let total = perf
        .lines()
        .find(|l| l.trim_start().starts_with("Total"))
        .unwrap_or_else(|| panic!("no Total in:\n{perf}"));
    let iops: f64 = total
        .split(':')
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no IOPS in {total:?}"));
    assert!(iops > 0.0, "{perf}");
    // What SPDK wrote through the frontend is what the shelf holds (the first MiB).
    let mut front = NvmfHost::connect(
        SocketAddr::from(([127, 0, 0, 1], port)),
        FRONT_NQN,
        HostOptions::default(),
    )
    .unwrap();
    let mut back = NvmfHost::connect(target, TARGET_NQN, HostOptions::default()).unwrap();
    let mut differs = 0;
    let mut written = 0;
    for lba in (0..2048u64).step_by(128) {
        let f = front.read(0, nsid, lba, 128, bs).unwrap();
        let b = back.read(0, 1, lba, 128, bs).unwrap();
        differs += usize::from(f != b);
        let p = pattern(lba);
        written += f
            .chunks(bs)
            .zip(p.chunks(bs))
            .filter(|(a, b)| a != b)
            .count();
    }
    assert_eq!(
        differs, 0,
        "the frontend and the shelf disagree after spdk_nvme_perf"
    );
    assert!(written > 0, "spdk_nvme_perf wrote nothing in the first MiB");
    drop((front, back));

    // The virtio-blk device, through libblkio on its vhost-user socket.
    let sock = n.run_dir.join("vhost-vblk-1.sock");
    {
        let mut c = BlkioClient::connect(&sock, &ClientOptions::default()).unwrap();
        assert_eq!(c.capacity().unwrap(), 8192 * 512);
        let mut q = c.queues.remove(0);
        let mem = c.mem();
        let (w, r) = mem.split_at_mut(4096);
        for (i, b) in w.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        assert_eq!(write(&mut q, 8192, w).unwrap(), 0);
        assert_eq!(read(&mut q, 8192, &mut r[..4096]).unwrap(), 0);
        assert_eq!(&r[..4096], &w[..]);
    }

    // Both APIs see it; a restart replays it, and OPI's names with it.
    let subs = n.ok("nvmf_get_subsystems", json!({}));
    assert!(
        subs.as_array()
            .unwrap()
            .iter()
            .any(|s| s["nqn"] == FRONT_NQN),
        "{subs}"
    );
    let stats = client(&["verify", &addr]);
    assert!(stats["ns_write_ops"].as_u64().unwrap() >= 1, "{stats}");
    n.restart();
    let addr = opi_addr(&n);
    let after = client(&["verify", &addr]);
    assert_eq!(after["tcp_port"].as_u64().unwrap() as u16, port, "{after}");

    client(&["delete", &addr]);
    let subs = n.ok("nvmf_get_subsystems", json!({}));
    assert!(
        subs.as_array()
            .unwrap()
            .iter()
            .all(|s| s["nqn"] != FRONT_NQN),
        "{subs}"
    );
    assert_eq!(n.ok("remote_list", json!({})), json!([]));
    assert_eq!(n.ok("vhost_blk_list", json!({})), json!([]));
}

fn random(n: usize) -> Vec<u8> {
    use std::io::Read;
    let mut b = vec![0; n];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut b)
        .unwrap();
    b
}

/// Whether any 12-byte window of `secret` is in `hay`, raw or as hex.
fn leaks(hay: &[u8], secret: &[u8]) -> bool {
    let lower = hay.to_ascii_lowercase();
    secret.windows(12).any(|w| {
        let hex = to_hex(w);
        hay.windows(12).any(|h| h == w) || lower.windows(hex.len()).any(|h| h == hex.as_bytes())
    })
}

#[test]
fn encrypted_volume_with_the_clients_key() {
    assert!(
        python_cryptography_available(),
        "needs python3 with cryptography (apt-get install python3-cryptography)"
    );
    const ENC_NQN: &str = "nqn.2024-01.io.nacre:opi-enc";
    let mut n = Nacred::start_args(&[
        "--no-default",
        "--opi-listen",
        "127.0.0.1:0",
        "--opi-tenant",
        "opi",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let kek = dir.path().join("opi.kek");
    std::fs::write(&kek, random(32)).unwrap();
    n.ok(
        "tenant_create",
        json!({"name": "opi", "kek": {"key_file": kek.to_str().unwrap()}}),
    );
    // The base: an AIO volume over a file of 1 MiB of zeros.
    let file = dir.path().join("base.img");
    std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
    let key = random(64);
    let addr = opi_addr(&n);
    let made = client(&[
        "encrypt",
        &addr,
        file.to_str().unwrap(),
        &to_hex(&key),
        ENC_NQN,
    ]);
    let port = made["tcp_port"].as_u64().unwrap() as u16;
    let nsid = made["nsid"].as_u64().unwrap() as u32;
    let front = SocketAddr::from(([127, 0, 0, 1], port));

    // Written through the encrypted volume's NVMe/TCP controller …
    let bs = 512;
    let lba = 40;
    let data: Vec<u8> = (0..16 * bs).map(|i| (i * 13 + 5) as u8).collect();
    let mut host = NvmfHost::connect(front, ENC_NQN, HostOptions::default())
        .expect("connect to the OPI-made controller");
    host.write(0, nsid, lba, &data, bs).expect("write");
    assert_eq!(host.read(0, nsid, lba, 16, bs).unwrap(), data);
    drop(host);
    // … lies in the base's file as AES-XTS under the client's key: one data unit per
    // 512-byte block, tweak = LBA (little-endian), decrypted by an independent oracle.
    let at_rest = std::fs::read(&file).unwrap();
    let off = lba as usize * bs;
    assert_ne!(
        &at_rest[off..off + data.len()],
        &data[..],
        "stored in the clear"
    );
    let pt = python_decrypt_file(&file, &key, bs, "plain64", off as u64, data.len(), lba).unwrap();
    assert!(
        pt == data,
        "the oracle does not decrypt the base to what was written"
    );

    // A restart replays the layer over its base; the plaintext reads back.
    n.restart();
    let addr = opi_addr(&n);
    let mut host =
        NvmfHost::connect(front, ENC_NQN, HostOptions::default()).expect("connect after restart");
    assert_eq!(host.read(0, nsid, lba, 16, bs).unwrap(), data);
    drop(host);
    let vols = n.ok("volume_list", json!({}));
    let layer = vols
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "enc-1")
        .unwrap_or_else(|| panic!("{vols}"));
    assert_eq!(layer["over"], "base", "{layer}");
    assert_eq!(layer["encrypted"], true, "{layer}");

    // The state holds the key wrapped, never in the clear.
    let state = std::fs::read(n.state_dir.join("state.json")).unwrap();
    assert!(!leaks(&state, &key), "the data key is in state.json");
    assert!(String::from_utf8_lossy(&state).contains("\"enc-1\""));

    let stats = client(&["unencrypt", &addr]);
    // (Counters start again at a restart: the read since.)
    assert!(stats["read_ops"].as_u64().unwrap() >= 1, "{stats}");
    // The layer is gone, its key with it; the base and its (cipher) data stay.
    let t = n.ok("tenant_list", json!({}));
    assert!(!t.to_string().contains("enc-1"), "{t}");
    assert_eq!(std::fs::read(&file).unwrap(), at_rest);

    // No byte of the key in the state or the log.
    n.stop();
    let state = std::fs::read(n.state_dir.join("state.json")).unwrap();
    assert!(!leaks(&state, &key), "the data key is in state.json");
    assert!(
        !leaks(&std::fs::read(&n.log).unwrap(), &key),
        "the data key is in the log"
    );
}
