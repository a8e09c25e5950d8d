//! NVMe/TCP with TLS 1.3 and pre-shared keys (NVMe/TCP §3.6, TP 8011) against a real host:
//! SPDK's `spdk_nvme_perf` with its `ssl` socket (`-S ssl --psk-path`), which derives the
//! retained PSK, the identity and the TLS PSK itself. Both cipher suites (SPDK picks the
//! suite from the key's length), a wrong key, a plain host on a TLS listener, a TLS host on a
//! plain listener, and nacred's CLI and replay.
//!
//! SPDK's binaries come from `$SPDK_DIR` or the team's `../shared/tools/spdk`; without them
//! these tests fail saying so.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command as Process;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::auth::tls_psk::TlsPsk;
use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;

const NQN: &str = "nqn.2024-01.io.nacre:tls";
const HOST256: &str = "nqn.2014-08.org.nvmexpress:uuid:0c2b6d52-0000-4000-8000-000000000256";
const HOST384: &str = "nqn.2014-08.org.nvmexpress:uuid:0c2b6d52-0000-4000-8000-000000000384";
const VOL_SIZE: u64 = 32 << 20;

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

/// SPDK's tools share DPDK's runtime files: one at a time.
static SPDK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run spdk_nvme_perf with a deadline: whether it succeeded, and its output.
fn perf(args: &[&str]) -> (bool, String) {
    let _one = SPDK.lock().unwrap_or_else(|p| p.into_inner());
    let mut child = Process::new(spdk_bin("spdk_nvme_perf"))
        .args(["--no-huge", "-s", "1024"])
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
    (out.status.success() && !text.contains("*ERROR*"), text)
}

fn trid(addr: SocketAddr, host: &str) -> String {
    format!(
        "trtype:TCP adrfam:IPv4 traddr:{} trsvcid:{} subnqn:{NQN} hostnqn:{host}",
        addr.ip(),
        addr.port()
    )
}

/// perf over TLS: `-S ssl --psk-path KEYFILE`, randrw for a second.
fn tls_perf(addr: SocketAddr, host: &str, key: &Path) -> (bool, String) {
    perf(&[
        "-S",
        "ssl",
        "--psk-path",
        key.to_str().unwrap(),
        "-q",
        "16",
        "-o",
        "4096",
        "-w",
        "randrw",
        "-M",
        "50",
        "-t",
        "1",
        "-r",
        &trid(addr, host),
    ])
}

struct Served {
    target: Arc<NvmfTarget>,
    vol: Arc<dyn BlockDevice>,
    dir: tempfile::TempDir,
    key256: PathBuf,
    key384: PathBuf,
}

/// A subsystem for two hosts, one with a SHA-256 (32-byte) PSK and one with a SHA-384
/// (48-byte) one, both also written to key files (mode 0600) for SPDK.
fn serve() -> Served {
    let target = NvmfTarget::new();
    target
        .create_subsystem(NQN, "NACRETLS0001", "nacre", false)
        .unwrap();
    let vol: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(VOL_SIZE, 512).unwrap());
    target
        .add_namespace(NQN, None, vol.clone(), *b"tls-nguid-00001!", "vol0".into())
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut paths = Vec::new();
    for (host, hmac) in [(HOST256, 1), (HOST384, 2)] {
        let k = TlsPsk::generate(hmac, None).unwrap();
        let p = dir.path().join(format!("psk{hmac}"));
        k.write_file(&p).unwrap();
        target.add_host(NQN, host).unwrap();
        target.set_host_psk(NQN, host, Some(k)).unwrap();
        paths.push(p);
    }
    Served {
        target,
        vol,
        dir,
        key256: paths[0].clone(),
        key384: paths[1].clone(),
    }
}

/// Tag every 4 KiB block with its index; afterwards every block must hold one whole tagged
/// block (its own or another's) or one repeated byte (perf's write buffers): a relay that
/// dropped, reordered or corrupted bytes would tear them.
fn tag_blocks(vol: &dyn BlockDevice) {
    let blocks = VOL_SIZE / 4096;
    let mut buf = vec![0u8; VOL_SIZE as usize];
    for b in 0..blocks as usize {
        for (i, chunk) in buf[b * 4096..(b + 1) * 4096].chunks_mut(8).enumerate() {
            chunk.copy_from_slice(&((b as u64) << 16 | i as u64 | 1 << 63).to_le_bytes());
        }
    }
    vol.write_at(0, &buf).unwrap();
}

/// How many blocks perf wrote; panics on a torn one.
fn check_blocks(vol: &dyn BlockDevice) -> usize {
    let blocks = VOL_SIZE / 4096;
    let mut buf = vec![0u8; VOL_SIZE as usize];
    vol.read_at(0, &mut buf).unwrap();
    let tag = |b: u64, i: usize| (b << 16 | i as u64 | 1 << 63).to_le_bytes();
    let mut written = 0;
    for b in 0..blocks as usize {
        let blk = &buf[b * 4096..(b + 1) * 4096];
        if blk.iter().all(|&x| x == blk[0]) {
            written += 1;
            continue;
        }
        let from = u64::from_le_bytes(blk[..8].try_into().unwrap()) >> 16 & 0xFFFF_FFFF;
        let whole = from < blocks && blk.chunks(8).enumerate().all(|(i, c)| c == tag(from, i));
        assert!(whole, "block {b} is torn: {:02x?}", &blk[..64]);
        written += (from != b as u64) as usize;
    }
    written
}

#[test]
fn spdk_perf_with_a_psk_reads_and_writes_over_both_cipher_suites() {
    let s = serve();
    let addr = s
        .target
        .add_tls_listener(NQN, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    for (host, key) in [(HOST256, &s.key256), (HOST384, &s.key384)] {
        tag_blocks(&*s.vol);
        let (ok, out) = tls_perf(addr, host, key);
        assert!(ok, "perf over TLS as {host} failed:\n{out}");
        assert!(out.contains("Total"), "no summary from perf:\n{out}");
        assert!(
            check_blocks(&*s.vol) > 0,
            "perf wrote nothing as {host}:\n{out}"
        );
    }
}

#[test]
fn a_wrong_psk_or_a_key_of_the_other_host_is_refused() {
    let s = serve();
    let addr = s
        .target
        .add_tls_listener(NQN, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    let wrong = s.dir.path().join("wrong");
    TlsPsk::generate(1, None)
        .unwrap()
        .write_file(&wrong)
        .unwrap();
    let (ok, out) = tls_perf(addr, HOST256, &wrong);
    assert!(!ok, "perf connected with a wrong PSK:\n{out}");
    // HOST256's identity with HOST384's (48-byte) key: the suite does not match either.
    let (ok, out) = tls_perf(addr, HOST256, &s.key384);
    assert!(!ok, "perf connected with another host's PSK:\n{out}");
    // A host without a PSK.
    let (ok, out) = tls_perf(addr, "nqn.2014-08.org.nvmexpress:uuid:nobody", &s.key256);
    assert!(!ok, "perf connected as a host without a PSK:\n{out}");
    // The target is unharmed: the right key still works.
    let (ok, out) = tls_perf(addr, HOST256, &s.key256);
    assert!(
        ok,
        "perf with the right PSK failed after the refusals:\n{out}"
    );
}

/// An ICReq PDU (NVMe/TCP §3.6.2.2): 128 bytes, PFV 0, HPDA 0, no digests, MAXR2T 0.
fn icreq() -> [u8; 128] {
    let mut p = [0u8; 128];
    p[0] = 0x00;
    p[2] = 128;
    p[4..8].copy_from_slice(&128u32.to_le_bytes());
    p
}

#[test]
fn a_tls_listener_refuses_plain_hosts_and_a_plain_listener_refuses_tls() {
    let s = serve();
    let tls = s
        .target
        .add_tls_listener(NQN, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    let plain = s
        .target
        .add_listener(NQN, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    // The same address cannot be both.
    assert!(s.target.add_listener(NQN, tls).is_err());
    assert!(s.target.add_tls_listener(NQN, plain).is_err());

    // A plain ICReq on the TLS listener: no ICResp, the connection is closed.
    let mut c = TcpStream::connect(tls).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(&icreq()).unwrap();
    let mut buf = [0u8; 256];
    let n = c.read(&mut buf).unwrap_or(0);
    assert!(
        n == 0 || buf[0] != 0x01,
        "the TLS listener answered a plain ICReq with an ICResp"
    );
    // Whatever came (a TLS alert at most), the connection ends.
    while let Ok(n) = c.read(&mut buf) {
        if n == 0 {
            break;
        }
    }

    // SPDK's plain host against the TLS listener, and its TLS host against the plain one.
    let (ok, out) = perf(&[
        "-q",
        "1",
        "-o",
        "4096",
        "-w",
        "read",
        "-t",
        "1",
        "-r",
        &trid(tls, HOST256),
    ]);
    assert!(!ok, "a plain host connected to a TLS listener:\n{out}");
    let (ok, out) = tls_perf(plain, HOST256, &s.key256);
    assert!(!ok, "a TLS host connected to a plain listener:\n{out}");

    // And both listeners still serve their own kind.
    let (ok, out) = tls_perf(tls, HOST256, &s.key256);
    assert!(ok, "{out}");
    let (ok, out) = perf(&[
        "-q",
        "4",
        "-o",
        "4096",
        "-w",
        "read",
        "-t",
        "1",
        "-r",
        &trid(plain, HOST256),
    ]);
    assert!(ok, "{out}");
}

#[test]
fn nacred_serves_a_tls_listener_from_the_cli_and_replays_it_without_storing_the_key() {
    use nacre_tests::daemon::Nacred;
    use serde_json::json;
    let mut n = Nacred::start();
    n.ok(
        "volume_create",
        json!({"name": "tv", "size": 16 << 20, "block_size": 4096}),
    );
    n.ok(
        "nvmf_subsystem_create",
        json!({"nqn": NQN, "serial": "NACRETLS0002", "allow_any_host": false}),
    );
    n.ok("nvmf_subsystem_add_ns", json!({"nqn": NQN, "volume": "tv"}));
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("host.psk");
    let out = n.cli(&[
        "nvmf",
        "gen-tls-key",
        "--hmac",
        "2",
        "--output",
        key.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let text = std::fs::read_to_string(&key).unwrap();
    assert!(text.starts_with("NVMeTLSkey-1:02:"), "{text}");

    // A key file others may read is refused, with the reason.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = n.cli(&[
        "nvmf",
        "add-host",
        NQN,
        HOST384,
        "--psk",
        key.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("chmod 600"),
        "{out:?}"
    );
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = n.cli(&[
        "nvmf",
        "add-host",
        NQN,
        HOST384,
        "--psk",
        key.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");

    let port = add_tls_listener(&n);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();

    let (ok, out) = tls_perf(addr, HOST384, &key);
    assert!(ok, "perf over nacred's TLS listener failed:\n{out}");

    // The key is in no state file and no log, only its path.
    let state = std::fs::read_to_string(n.state_dir.join("state.json")).unwrap();
    let secret = text.trim().split(':').nth(2).unwrap().to_string();
    assert!(!state.contains(&secret), "the PSK is stored in the state");
    assert!(state.contains(key.to_str().unwrap()));
    assert!(!n.log_text().contains(&secret), "the PSK is in the log");

    // Replayed after a restart: still TLS-only, still the key.
    n.restart();
    let (ok, out) = tls_perf(addr, HOST384, &key);
    assert!(ok, "perf over the replayed TLS listener failed:\n{out}");
    let (ok, out) = perf(&[
        "-q",
        "1",
        "-o",
        "4096",
        "-w",
        "read",
        "-t",
        "1",
        "-r",
        &trid(addr, HOST384),
    ]);
    assert!(!ok, "the replayed listener accepted a plain host:\n{out}");
    assert!(n.stop(), "nacred did not stop cleanly");
}

/// `nacre nvmf add-listener NQN --secure-channel tls` on a free loopback port of `n`: the port.
fn add_tls_listener(n: &nacre_tests::daemon::Nacred) -> u16 {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let out = n.cli(&[
        "nvmf",
        "add-listener",
        NQN,
        "--address",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--secure-channel",
        "tls",
    ]);
    assert!(out.status.success(), "{out:?}");
    port
}

/// One NVMe/TCP PDU read from a TLS stream: its bytes.
fn read_pdu(s: &mut openssl::ssl::SslStream<TcpStream>) -> Vec<u8> {
    let mut ch = [0u8; 8];
    s.read_exact(&mut ch).unwrap();
    let plen = u32::from_le_bytes(ch[4..8].try_into().unwrap()) as usize;
    let mut pdu = ch.to_vec();
    pdu.resize(plen, 0);
    s.read_exact(&mut pdu[8..]).unwrap();
    pdu
}

/// A Fabrics Connect of the admin queue as a CapsuleCmd PDU with its 1024 bytes of data in
/// the capsule (NVMe-oF 1.1 §3.3, NVMe/TCP 1.0 §3.6.2.4).
fn connect_capsule(hostnqn: &str, subnqn: &str) -> Vec<u8> {
    let mut p = vec![0u8; 8 + 64 + 1024];
    p[0] = 0x04; // CapsuleCmd
    p[2] = 72; // HLEN
    p[3] = 72; // PDO
    let plen = p.len() as u32;
    p[4..8].copy_from_slice(&plen.to_le_bytes());
    let sqe = &mut p[8..72];
    sqe[0] = 0x7f; // Fabrics
    sqe[4] = 0x01; // Connect
    sqe[32..36].copy_from_slice(&1024u32.to_le_bytes()); // SGL: data block, in capsule
    sqe[39] = 0x01;
    sqe[44..46].copy_from_slice(&31u16.to_le_bytes()); // SQSIZE
    let data = &mut p[72..];
    data[16..18].copy_from_slice(&0xffffu16.to_le_bytes()); // CNTLID: dynamic
    data[256..256 + subnqn.len()].copy_from_slice(subnqn.as_bytes());
    data[512..512 + hostnqn.len()].copy_from_slice(hostnqn.as_bytes());
    p
}

/// A TLS session as HOST256 (OpenSSL's client: the TLS 1.2-style PSK callback makes a
/// SHA-256 session, which is this key's suite), then ICReq/ICResp; the Connect's status.
fn tls_connect_as(addr: SocketAddr, psk: &TlsPsk, connect_host: &str) -> (u8, u8) {
    use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode, SslVersion};
    let (identity, key) = psk.tls_psk(HOST256, NQN);
    let mut b = SslConnector::builder(SslMethod::tls_client()).unwrap();
    b.set_min_proto_version(Some(SslVersion::TLS1_3)).unwrap();
    b.set_ciphersuites("TLS_AES_128_GCM_SHA256").unwrap();
    b.set_verify(SslVerifyMode::NONE);
    b.set_psk_client_callback(move |_, _, id, out| {
        id[..identity.len()].copy_from_slice(identity.as_bytes());
        id[identity.len()] = 0;
        out[..key.len()].copy_from_slice(&key);
        Ok(key.len())
    });
    let mut cfg = b.build().configure().unwrap();
    cfg.set_use_server_name_indication(false);
    cfg.set_verify_hostname(false);
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut s = cfg
        .connect("nacre", tcp)
        .expect("TLS handshake with the right PSK");
    s.write_all(&icreq()).unwrap();
    let icresp = read_pdu(&mut s);
    assert_eq!(icresp[0], 0x01, "no ICResp over TLS");
    s.write_all(&connect_capsule(connect_host, NQN)).unwrap();
    let resp = read_pdu(&mut s);
    assert_eq!(resp[0], 0x05, "no CapsuleResp");
    let status = u16::from_le_bytes(resp[8 + 14..8 + 16].try_into().unwrap());
    (((status >> 9) & 7) as u8, (status >> 1) as u8)
}

/// A host that proved HOST256's PSK cannot name another host NQN in Connect (NVMe/TCP §3.6:
/// the Connect names the identity's host and subsystem).
#[test]
fn a_tls_queue_must_connect_as_the_host_of_its_psk_identity() {
    let s = serve();
    let addr = s
        .target
        .add_tls_listener(NQN, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    let psk = TlsPsk::load(&s.key256).unwrap();
    assert_eq!(
        tls_connect_as(addr, &psk, HOST384),
        (1, 0x84),
        "Connect as another host than the PSK identity's was not refused as an invalid host"
    );
    assert_eq!(
        tls_connect_as(addr, &psk, HOST256),
        (0, 0),
        "Connect as the identity's host"
    );
}

/// `nacre nvmf gen-tls-key` and nvme-cli's `nvme gen-tls-key` write keys the other's
/// `check-tls-key` accepts, for both hashes (nvme-cli is installed by `scripts/setup --test`).
#[test]
fn nacre_and_nvme_cli_read_each_others_tls_keys() {
    let nacre = nacre_tests::daemon::bin("nacre");
    let run = |cmd: &mut Process| {
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cmd:?} (nvme-cli: scripts/setup --test): {e}"));
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(out.status.success(), "{cmd:?}: {out:?}");
        text
    };
    for (hmac, len) in [("1", "32"), ("2", "48")] {
        let theirs = run(Process::new("nvme").args(["gen-tls-key", &format!("--hmac={hmac}")]));
        assert!(
            theirs.starts_with(&format!("NVMeTLSkey-1:0{hmac}:")),
            "{theirs}"
        );
        let ours = run(Process::new(&nacre).args(["nvmf", "check-tls-key", &theirs]));
        assert!(
            ours.contains(&format!("HMAC {hmac}, length {len}")),
            "{ours}"
        );

        let mine = run(Process::new(&nacre).args(["nvmf", "gen-tls-key", "--hmac", hmac]));
        let check = run(Process::new("nvme").args(["check-tls-key", &format!("--key={mine}")]));
        assert!(
            check.contains(&format!("Key is valid (HMAC {hmac}, length {len}")),
            "nvme check-tls-key on nacre's key: {check}"
        );
    }
}

/// SPDK's `nvmf_tgt` as a TLS shelf: a TLS-only listener (`nvmf_subsystem_add_listener
/// --secure-channel`) and one host with a PSK from SPDK's keyring (`nvmf_subsystem_add_host
/// --psk`), exporting a 32 MiB malloc bdev.
struct SpdkTlsShelf {
    child: std::process::Child,
    sock: PathBuf,
    port: u16,
    _tmp: tempfile::TempDir,
}

const SPDK_NQN: &str = "nqn.2016-06.io.spdk:tls-shelf";

impl SpdkTlsShelf {
    fn rpc(&self, args: &[&str]) {
        let rpc = spdk_bin("rpc.py");
        let out = Process::new("python3")
            .arg(&rpc)
            .arg("-s")
            .arg(&self.sock)
            .args(args)
            .env("PYTHONPATH", rpc.parent().unwrap().join("../python"))
            .output()
            .expect("run rpc.py");
        assert!(
            out.status.success(),
            "rpc.py {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn start(key: &Path, host: &str) -> SpdkTlsShelf {
        let tmp = tempfile::Builder::new()
            .prefix("spdk-tls-")
            .tempdir()
            .unwrap();
        let sock = tmp.path().join("spdk.sock");
        let log = std::fs::File::create(tmp.path().join("nvmf_tgt.log")).unwrap();
        let child = Process::new(spdk_bin("nvmf_tgt"))
            .args(["-m", "0x1", "--no-huge", "-s", "1024", "-r"])
            .arg(&sock)
            .stdout(std::process::Stdio::from(log.try_clone().unwrap()))
            .stderr(std::process::Stdio::from(log))
            .spawn()
            .expect("start nvmf_tgt");
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let s = SpdkTlsShelf {
            child,
            sock,
            port,
            _tmp: tmp,
        };
        let t = Instant::now();
        while !s.sock.exists() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "nvmf_tgt's RPC socket did not appear"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let port = s.port.to_string();
        s.rpc(&["keyring_file_add_key", "key0", key.to_str().unwrap()]);
        s.rpc(&["nvmf_create_transport", "-t", "TCP"]);
        s.rpc(&["bdev_malloc_create", "-b", "Malloc0", "32", "512"]);
        s.rpc(&["nvmf_create_subsystem", SPDK_NQN, "-s", "SPDKTLS1"]);
        s.rpc(&["nvmf_subsystem_add_ns", SPDK_NQN, "Malloc0"]);
        s.rpc(&[
            "nvmf_subsystem_add_listener",
            SPDK_NQN,
            "-t",
            "tcp",
            "-a",
            "127.0.0.1",
            "-s",
            &port,
            "--secure-channel",
        ]);
        s.rpc(&["nvmf_subsystem_add_host", SPDK_NQN, host, "--psk", "key0"]);
        s
    }
}

impl Drop for SpdkTlsShelf {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `nacre remote attach ... --psk FILE` to the shelf at `port`: the CLI's output.
fn attach_tls(
    n: &nacre_tests::daemon::Nacred,
    name: &str,
    port: u16,
    subnqn: &str,
    psk: Option<&Path>,
) -> std::process::Output {
    let port = port.to_string();
    let mut args = vec![
        "remote",
        "attach",
        name,
        "--address",
        "127.0.0.1",
        "--port",
        &port,
        "--subnqn",
        subnqn,
        "--hostnqn",
        HOST256,
        "--io-queues",
        "2",
        "--ctrl-loss-timeout-sec",
        "60",
    ];
    if let Some(k) = psk {
        args.extend(["--psk", k.to_str().unwrap()]);
    }
    n.cli(&args)
}

/// A refused attach: one line of error naming `want`, one connection attempt in nacred's log
/// (no retry: the reconnect machinery would go on for the 60 s of ctrl-loss-timeout), and no
/// remote left behind.
fn assert_refused(n: &nacre_tests::daemon::Nacred, out: &std::process::Output, want: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "attach succeeded: {out:?}");
    assert!(
        err.contains(want) && err.trim_end().lines().count() == 1,
        "not one line naming {want:?}: {err}"
    );
    let attempts = n
        .log_text()
        .lines()
        .filter(|l| {
            l.contains("controller=bad")
                && (l.contains("connection attempt failed") || l.contains("controller failed"))
        })
        .count();
    assert_eq!(attempts, 1, "{}", n.log_text());
    let list = n.ok("remote_list", serde_json::json!({}));
    assert_eq!(list.as_array().map(Vec::len), Some(0), "{list}");
}

/// nacred's initiator over TLS 1.3 (`remote attach --psk`): to SPDK's `nvmf_tgt` with a TLS
/// listener, and to nacred's own; a wrong PSK and a plain attach to a TLS listener are refused
/// at once with the reason; data goes through; the remote comes back after a restart with
/// its PSK read again from the file; the key is in no state, log or --json output.
#[test]
fn nacreds_initiator_attaches_over_tls_to_spdk_and_to_nacred() {
    use nacre_tests::daemon::Nacred;
    use serde_json::json;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("host.psk");
    let key384 = dir.path().join("host384.psk");
    let wrong = dir.path().join("wrong.psk");
    TlsPsk::generate(1, None).unwrap().write_file(&key).unwrap();
    TlsPsk::generate(2, None)
        .unwrap()
        .write_file(&key384)
        .unwrap();
    TlsPsk::generate(1, None)
        .unwrap()
        .write_file(&wrong)
        .unwrap();
    let bodies: Vec<String> = [&key, &key384]
        .iter()
        .map(|k| {
            std::fs::read_to_string(k)
                .unwrap()
                .split(':')
                .nth(2)
                .unwrap()
                .to_string()
        })
        .collect();

    let _one = SPDK.lock().unwrap_or_else(|p| p.into_inner());
    let shelf = SpdkTlsShelf::start(&key, HOST256);
    let mut n = Nacred::start_args(&["--no-default"]);

    let out = attach_tls(&n, "bad", shelf.port, SPDK_NQN, Some(&wrong));
    assert_refused(&n, &out, "TLS handshake");
    let out = attach_tls(&n, "bad", shelf.port, SPDK_NQN, None);
    assert!(
        !out.status.success(),
        "a plain attach to a TLS listener: {out:?}"
    );

    let out = attach_tls(&n, "spdk", shelf.port, SPDK_NQN, Some(&key));
    assert!(out.status.success(), "{out:?}");
    let r = n.ok("remote_list", json!({"name": "spdk"}));
    assert_eq!(
        (r[0]["state"].as_str(), r[0]["secure_channel"].as_str()),
        (Some("live"), Some("tls")),
        "{r}"
    );
    assert_eq!(r[0]["io_queues"], 2, "{r}");
    n.remote_round_trip("spdk", 1);

    // nacred's own TLS listener as the shelf, with a 48-byte key: TLS_AES_256_GCM_SHA384
    // (SPDK's leg above used a 32-byte key: TLS_AES_128_GCM_SHA256).
    let t = Nacred::start_args(&["--no-default"]);
    t.ok(
        "volume_create",
        json!({"name": "tv", "size": 32 << 20, "block_size": 512, "backend": "ram"}),
    );
    t.ok("nvmf_subsystem_create", json!({"nqn": NQN}));
    t.ok("nvmf_subsystem_add_ns", json!({"nqn": NQN, "volume": "tv"}));
    let out = t.cli(&[
        "nvmf",
        "add-host",
        NQN,
        HOST256,
        "--psk",
        key384.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let tport = add_tls_listener(&t);
    let out = attach_tls(&n, "nacred", tport, NQN, Some(&key384));
    assert!(out.status.success(), "{out:?}");
    n.remote_round_trip("nacred", 2);
    assert!(
        t.log_text().contains("TLS_AES_256_GCM_SHA384"),
        "the target's log does not show the SHA-384 suite:\n{}",
        t.log_text()
    );

    // Replayed from the state after a restart: the PSK read again from its file.
    n.restart();
    let t0 = Instant::now();
    loop {
        let l = n.ok("remote_list", json!({}));
        let live = l
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["state"] == "live")
            .count();
        if live == 2 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "not live after a restart: {l}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    n.remote_round_trip("spdk", 3);
    n.remote_round_trip("nacred", 4);

    let state = std::fs::read_to_string(n.state_dir.join("state.json")).unwrap();
    assert!(
        state.contains(key.to_str().unwrap()),
        "the state keeps the key's path"
    );
    let list = n.cli(&["--json", "remote", "list"]);
    for (what, text) in [
        ("state.json", state),
        ("nacred's log", n.log_text()),
        (
            "remote list --json",
            String::from_utf8_lossy(&list.stdout).into_owned(),
        ),
    ] {
        for body in &bodies {
            assert!(!text.contains(body.as_str()), "{what} holds a PSK");
        }
    }
    assert!(n.stop(), "nacred did not stop cleanly");
}
