//! NVMe in-band authentication (DH-HMAC-CHAP) of nacred's initiator against SPDK's
//! `nvmf_tgt` as the shelf, and `nacre nvmf gen-dhchap-key` against nvme-cli's.
//!
//! SPDK's binaries come from `$SPDK_DIR` or the team folder's `tools/spdk` (see its
//! README); nvme-cli from `scripts/setup --test`. A missing one fails the test, saying so.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nacre_tests::daemon::Nacred;
use serde_json::{json, Value};

const SUBNQN: &str = "nqn.2016-06.io.spdk:auth";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:6d3a9b1e-0c7f-4f43-9a55-2b1d0a7e4c11";

fn spdk_dir() -> PathBuf {
    let dir = std::env::var_os("SPDK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/spdk"));
    for b in ["bin/nvmf_tgt", "bin/rpc.py"] {
        assert!(
            dir.join(b).exists(),
            "SPDK's {b} is missing under {}: set SPDK_DIR to an SPDK v25.09 build (nvmf_tgt, rpc.py, python/)",
            dir.display()
        );
    }
    dir
}

/// One `nvmf_tgt` with DH-HMAC-CHAP limited to `digest` and `dhgroup`, exporting a 32 MiB
/// malloc bdev to HOSTNQN only, with key0 (host) and key1 (controller).
struct Spdk {
    child: Child,
    dir: PathBuf,
    sock: PathBuf,
    port: u16,
    _tmp: tempfile::TempDir,
}

impl Spdk {
    fn rpc(&self, args: &[&str]) -> String {
        let out = Command::new("python3")
            .arg(self.dir.join("bin/rpc.py"))
            .arg("-s")
            .arg(&self.sock)
            .args(args)
            .env("PYTHONPATH", self.dir.join("python"))
            .output()
            .expect("run rpc.py");
        assert!(
            out.status.success(),
            "rpc.py {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn start(digest: &str, dhgroup: &str, host_key: &str, ctrl_key: &str) -> Spdk {
        let dir = spdk_dir();
        let tmp = tempfile::Builder::new()
            .prefix("spdk-auth-")
            .tempdir()
            .unwrap();
        let sock = tmp.path().join("spdk.sock");
        let log = std::fs::File::create(tmp.path().join("nvmf_tgt.log")).unwrap();
        let child = Command::new(dir.join("bin/nvmf_tgt"))
            .args([
                "-m",
                "0x1",
                "--no-huge",
                "-s",
                "1024",
                "--wait-for-rpc",
                "-r",
            ])
            .arg(&sock)
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start nvmf_tgt");
        let port = free_port();
        let s = Spdk {
            child,
            dir,
            sock,
            port,
            _tmp: tmp,
        };
        let t = Instant::now();
        while !s.sock.exists() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "nvmf_tgt's RPC socket"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        s.rpc(&[
            "nvmf_set_config",
            "--dhchap-digests",
            digest,
            "--dhchap-dhgroups",
            dhgroup,
        ]);
        s.rpc(&["framework_start_init"]);
        let keys = s._tmp.path().to_path_buf();
        for (name, key) in [("key0", host_key), ("key1", ctrl_key)] {
            let p = keys.join(name);
            std::fs::write(&p, key).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
            s.rpc(&["keyring_file_add_key", name, p.to_str().unwrap()]);
        }
        s.rpc(&["nvmf_create_transport", "-t", "TCP"]);
        s.rpc(&["bdev_malloc_create", "-b", "Malloc0", "32", "512"]);
        s.rpc(&["nvmf_create_subsystem", SUBNQN, "-s", "SPDKAUTH"]);
        s.rpc(&["nvmf_subsystem_add_ns", SUBNQN, "Malloc0"]);
        let port = s.port.to_string();
        s.rpc(&[
            "nvmf_subsystem_add_listener",
            SUBNQN,
            "-t",
            "tcp",
            "-a",
            "127.0.0.1",
            "-s",
            &port,
        ]);
        s.rpc(&[
            "nvmf_subsystem_add_host",
            SUBNQN,
            HOSTNQN,
            "--dhchap-key",
            "key0",
            "--dhchap-ctrlr-key",
            "key1",
        ]);
        s
    }
}

impl Drop for Spdk {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh secret from nacre's CLI, in a 0600 file.
fn gen_key(n: &Nacred, dir: &Path, name: &str, args: &[&str]) -> (PathBuf, String) {
    let p = dir.join(name);
    let mut a = vec!["nvmf", "gen-dhchap-key", "--output", p.to_str().unwrap()];
    a.extend_from_slice(args);
    let out = n.cli(&a);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let key = std::fs::read_to_string(&p).unwrap().trim().to_string();
    (p, key)
}

fn attach(
    n: &Nacred,
    name: &str,
    port: u16,
    key: &Path,
    ctrl: Option<&Path>,
) -> Result<Value, String> {
    let mut p = json!({"name": name, "address": "127.0.0.1", "port": port, "subnqn": SUBNQN,
        "hostnqn": HOSTNQN, "io_queues": 2, "queue_depth": 32, "ctrl_loss_timeout_sec": 5,
        "dhchap_secret": key});
    if let Some(c) = ctrl {
        p["dhchap_ctrl_secret"] = json!(c);
    }
    n.call("remote_attach", p).map_err(|e| e.to_string())
}

/// The shelf drops the connections (its listener goes away and comes back): nacred
/// reconnects, authenticating every queue again, and data flows.
fn reconnect_authenticates(n: &Nacred, spdk: &Spdk, seed: u64) {
    let port = spdk.port.to_string();
    let listener = ["-t", "tcp", "-a", "127.0.0.1", "-s", port.as_str()];
    spdk.rpc(&[&["nvmf_subsystem_remove_listener", SUBNQN][..], &listener].concat());
    std::thread::sleep(Duration::from_millis(500));
    spdk.rpc(&[&["nvmf_subsystem_add_listener", SUBNQN][..], &listener].concat());
    let t = Instant::now();
    loop {
        let l = n.ok("remote_list", json!({"name": "bidi"}));
        if l[0]["state"] == "live" && l[0]["resets"].as_u64() >= Some(1) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "no reconnect: {l}");
        std::thread::sleep(Duration::from_millis(100));
    }
    n.remote_round_trip("bidi", seed);
}

/// Secret bytes (the base64 body of each representation) must not appear anywhere.
fn assert_no_secret(what: &str, text: &str, keys: &[&str]) {
    for k in keys {
        let body = k.trim_end_matches(':').rsplit(':').next().unwrap();
        assert!(
            !text.contains(body) && !text.contains(k),
            "{what} contains a DH-HMAC-CHAP secret"
        );
    }
}

/// One shelf configuration: a wrong host key and a wrong controller key fail with a one-line
/// reason; the right keys attach (unidirectional, then bidirectional) and carry data.
fn shelf_scenario(n: &Nacred, dir: &Path, digest: &str, dhgroup: &str, hmac: &str, seed: u64) {
    let (host, host_key) = gen_key(
        n,
        dir,
        &format!("host{seed}"),
        &["--hmac", hmac, "--nqn", HOSTNQN],
    );
    let (ctrl, ctrl_key) = gen_key(n, dir, &format!("ctrl{seed}"), &["--key-length", "48"]);
    let (wrong, wrong_key) = gen_key(n, dir, &format!("wrong{seed}"), &[]);
    let spdk = Spdk::start(digest, dhgroup, &host_key, &ctrl_key);

    let t = Instant::now();
    let e = attach(n, "bad", spdk.port, &wrong, None).unwrap_err();
    eprintln!("wrong host key: {e}");
    assert!(
        e.contains("DH-HMAC-CHAP authentication failed on queue 0")
            && e.contains("authentication failed (reason code explanation 0x01)")
            && !e.contains('\n'),
        "{e}"
    );
    // Refused at once, not after a loop of retries until ctrl_loss_timeout.
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    let e = attach(n, "bad", spdk.port, &host, Some(&wrong)).unwrap_err();
    eprintln!("wrong controller key: {e}");
    assert!(
        e.contains("the controller's response does not verify") && !e.contains('\n'),
        "{e}"
    );

    let t = Instant::now();
    let r = attach(n, "uni", spdk.port, &host, None).unwrap();
    eprintln!(
        "{digest}/{dhgroup}: unidirectional attach (admin + 2 I/O queues) took {:?}",
        t.elapsed()
    );
    assert_eq!(
        (r["state"].as_str(), r["dhchap"].as_str()),
        (Some("live"), Some("unidirectional"))
    );
    n.remote_round_trip("uni", seed);
    n.ok("remote_detach", json!({"name": "uni"}));
    // The shelf asks for authentication (Connect AUTHREQ.ATR): without a key, a clear error.
    let e = n
        .call(
            "remote_attach",
            json!({"name": "plain", "address": "127.0.0.1", "port": spdk.port,
                   "subnqn": SUBNQN, "hostnqn": HOSTNQN}),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("requires DH-HMAC-CHAP authentication"), "{e}");

    let t = Instant::now();
    let r = attach(n, "bidi", spdk.port, &host, Some(&ctrl)).unwrap();
    eprintln!(
        "{digest}/{dhgroup}: bidirectional attach (admin + 2 I/O queues) took {:?}",
        t.elapsed()
    );
    assert_eq!(
        (r["state"].as_str(), r["dhchap"].as_str()),
        (Some("live"), Some("bidirectional"))
    );
    assert_eq!(r["io_queues"], 2);
    n.remote_round_trip("bidi", seed + 1);
    if seed == 10 {
        reconnect_authenticates(n, &spdk, seed + 2);
    }

    // No secret in the state document, the log, or --json output.
    let list = n.cli(&["--json", "remote", "list"]);
    let state = std::fs::read_to_string(n.state_dir.join("state.json")).unwrap();
    assert!(
        state.contains(host.to_str().unwrap()),
        "the state keeps the key's path"
    );
    let keys = [host_key.as_str(), ctrl_key.as_str(), wrong_key.as_str()];
    assert_no_secret("state.json", &state, &keys);
    assert_no_secret("nacred's log", &n.log_text(), &keys);
    assert_no_secret(
        "remote list --json",
        &String::from_utf8_lossy(&list.stdout),
        &keys,
    );
    n.ok("remote_detach", json!({"name": "bidi"}));
}

#[test]
fn initiator_authenticates_to_spdk() {
    let n = Nacred::start_args(&["--no-default"]);
    let tmp = tempfile::tempdir().unwrap();
    // SHA-256 with the null group and a key transformed with SHA-256; SHA-512 with ffdhe4096
    // and an untransformed key.
    shelf_scenario(&n, tmp.path(), "sha256", "null", "1", 10);
    shelf_scenario(&n, tmp.path(), "sha512", "ffdhe4096", "0", 20);
    // SHA-384 with the largest group (1024-byte DH values) and a SHA-384-transformed key.
    shelf_scenario(&n, tmp.path(), "sha384", "ffdhe8192", "2", 30);
}

#[test]
fn key_files_are_checked_before_attaching() {
    let n = Nacred::start_args(&["--no-default"]);
    let tmp = tempfile::tempdir().unwrap();
    let (p, _) = gen_key(&n, tmp.path(), "k", &[]);
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = attach(&n, "x", 4420, &p, None).unwrap_err();
    assert!(e.contains("chmod 600"), "{e}");
    std::fs::write(tmp.path().join("junk"), "DHHC-1:00:AAAA:").unwrap();
    std::fs::set_permissions(
        tmp.path().join("junk"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let e = attach(&n, "x", 4420, &tmp.path().join("junk"), None).unwrap_err();
    assert!(e.contains("not a DH-HMAC-CHAP secret"), "{e}");
    let e = n.cli(&[
        "remote",
        "attach",
        "x",
        "--address",
        "127.0.0.1",
        "--subnqn",
        SUBNQN,
        "--dhchap-ctrl-secret",
        "/nonexistent",
    ]);
    assert!(!e.status.success());
}

/// `nacre nvmf gen-dhchap-key` and nvme-cli's agree byte for byte on a given secret, and
/// each tool accepts the other's random keys.
#[test]
fn gen_dhchap_key_agrees_with_nvme_cli() {
    let nvme = which("nvme").expect("nvme-cli is missing: run scripts/setup --test");
    let nacre = nacre_tests::daemon::bin("nacre");
    let hexs: String = (0u8..64).map(|b| format!("{b:02x}")).collect();
    let run = |cmd: &Path, args: &[&str]| {
        let out = Command::new(cmd).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{cmd:?} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    for (hmac, len) in [("0", 32), ("0", 64), ("1", 32), ("2", 48), ("3", 64)] {
        let l = len.to_string();
        let s = &hexs[..len * 2];
        let args = [
            "gen-dhchap-key",
            "--hmac",
            hmac,
            "--key-length",
            &l,
            "--secret",
            s,
            "--nqn",
            HOSTNQN,
        ];
        let ours = run(&nacre, &[&["nvmf"][..], &args].concat());
        assert_eq!(ours, run(&nvme, &args), "hmac {hmac}, {len} bytes");
        // Random keys: each tool checks the other's.
        let ours = run(
            &nacre,
            &[
                "nvmf",
                "gen-dhchap-key",
                "--hmac",
                hmac,
                "--key-length",
                &l,
                "--nqn",
                HOSTNQN,
            ],
        );
        let v = run(&nvme, &["check-dhchap-key", "--key", &ours]);
        assert!(v.starts_with("Key is valid"), "{v}");
        let theirs = run(
            &nvme,
            &[
                "gen-dhchap-key",
                "--hmac",
                hmac,
                "--key-length",
                &l,
                "--nqn",
                HOSTNQN,
            ],
        );
        let v = run(&nacre, &["nvmf", "check-dhchap-key", &theirs]);
        assert_eq!(v, format!("Key is valid (HMAC {hmac}, length {len})"));
    }
    // A corrupted key is refused by both.
    let bad = "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaS:";
    assert!(!Command::new(&nacre)
        .args(["nvmf", "check-dhchap-key", bad])
        .output()
        .unwrap()
        .status
        .success());
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
}
