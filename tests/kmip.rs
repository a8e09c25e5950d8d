//! KMS tenants against a real KMIP server: PyKMIP's `pykmip-server`, started here on
//! loopback with its own CA, server and client certificates (made by
//! `tests/src/kmip_tool.py` with pyca/cryptography) and a SQLite database in a temporary
//! directory. Keys are created, revoked and destroyed with PyKMIP's own client.
//!
//! What is checked: data written through vhost-user-blk survives restarts (the tenant is
//! unlocked by the key manager at start); the ciphertext at rest decrypts under the
//! Python `cryptography` oracle; rotation to a second KMS key, after which the first can be
//! revoked and destroyed; a tenant whose key is revoked stays locked with one clear line and
//! its volume serves errors while another tenant is untouched; `tenant lock` leaves no copy
//! of the envelope key in nacred's memory; no key byte in state.json, the log or `--json`
//! output; and the failure paths: key manager down at start (a later unlock brings the
//! volume back without restarting nacred) and during rotation (nothing changes), a client
//! certificate the server does not trust, a server certificate from another CA, and a key
//! manager that does not answer in time while the control plane keeps answering; and a
//! tampered envelope blob, which the KEK check refuses.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nacre_tests::blkio_client::{self, BlkioClient, ClientOptions};
use nacre_tests::daemon::{bin, Nacred};
use nacre_tests::xts_oracle::{hex, python_cryptography_available, python_decrypt_file, to_hex};
use serde_json::{json, Value};

const KMIP_TOOL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/kmip_tool.py");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// The CLI failed with one line containing every needle.
fn fails(out: &Output, needles: &[&str]) -> String {
    let e = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}{e}", text(&out.stdout));
    for n in needles {
        assert!(e.contains(n), "expected {n:?} in: {e}");
    }
    assert_eq!(e.trim_end().lines().count(), 1, "errors are one line: {e}");
    e
}

fn random(n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut b)
        .unwrap();
    b
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// PyKMIP's server and a PyKMIP client (one Python process answering commands).
struct Kmip {
    dir: tempfile::TempDir,
    port: u16,
    server: Option<Child>,
    repl: Child,
    repl_in: ChildStdin,
    repl_out: BufReader<ChildStdout>,
}

impl Kmip {
    fn start() -> Kmip {
        let has_pykmip = Command::new("python3")
            .args(["-c", "import kmip"])
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            has_pykmip,
            "needs PyKMIP for python3 (`python3 -m pip install pykmip`, or scripts/setup --test)"
        );
        assert!(
            python_cryptography_available(),
            "needs python3 with cryptography (apt-get install python3-cryptography)"
        );
        let dir = tempfile::Builder::new()
            .prefix("nacre-kmip-")
            .tempdir()
            .unwrap();
        let st = Command::new("python3")
            .args([KMIP_TOOL, "certs"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(st.success(), "making certificates failed");
        let port = free_port();
        let d = dir.path().display();
        std::fs::create_dir(dir.path().join("policies")).unwrap();
        std::fs::write(
            dir.path().join("server.conf"),
            format!(
                "[server]\nhostname=127.0.0.1\nport={port}\ncertificate_path={d}/good-server.pem\n\
                 key_path={d}/good-server.key\nca_path={d}/good-ca.pem\nauth_suite=TLS1.2\n\
                 policy_path={d}/policies\nenable_tls_client_auth=True\nlogging_level=INFO\n\
                 database_path={d}/kmip.sqlite\n"
            ),
        )
        .unwrap();
        let mut repl = Command::new("python3")
            .args([KMIP_TOOL, "repl"])
            .arg(dir.path())
            .arg(port.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let repl_in = repl.stdin.take().unwrap();
        let repl_out = BufReader::new(repl.stdout.take().unwrap());
        let mut k = Kmip {
            dir,
            port,
            server: None,
            repl,
            repl_in,
            repl_out,
        };
        k.up();
        k
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Start the server (again: same port, same database) and wait until it listens.
    fn up(&mut self) {
        assert!(self.server.is_none());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("server.out"))
            .unwrap();
        use std::os::unix::process::CommandExt;
        self.server = Some(
            Command::new("pykmip-server")
                // Its own process group: PyKMIP forks a policy-directory monitor, which
                // must go down with it.
                .process_group(0)
                .arg("-f")
                .arg(self.dir.path().join("server.conf"))
                .arg("-l")
                .arg(self.dir.path().join("server.log"))
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("run pykmip-server (pip install pykmip)"),
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "pykmip-server did not listen: {}",
                std::fs::read_to_string(self.dir.path().join("server.out")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn down(&mut self) {
        if let Some(mut s) = self.server.take() {
            // SAFETY: kill(2) on the process group this test made for the server.
            unsafe { libc::kill(-(s.id() as i32), libc::SIGKILL) };
            let _ = s.wait();
        }
    }

    /// One PyKMIP client command: its answer, or the error PyKMIP gave.
    fn cmd(&mut self, line: &str) -> Result<String, String> {
        writeln!(self.repl_in, "{line}").unwrap();
        self.repl_in.flush().unwrap();
        let mut answer = String::new();
        self.repl_out.read_line(&mut answer).unwrap();
        let answer = answer.trim_end();
        match answer.split_once(' ').unwrap_or((answer, "")) {
            ("ok", rest) => Ok(rest.to_string()),
            (_, rest) => Err(rest.to_string()),
        }
    }

    fn create_key(&mut self) -> String {
        self.cmd("create").expect("PyKMIP create")
    }
}

impl Drop for Kmip {
    fn drop(&mut self) {
        self.down();
        let _ = self.repl.kill();
        let _ = self.repl.wait();
    }
}

fn add_kms(n: &Nacred, k: &Kmip, name: &str, ca: &str, client: &str, extra: &[&str]) {
    let mut args = vec![
        "kms".to_string(),
        "add".into(),
        name.into(),
        "--address".into(),
        k.address(),
        "--ca".into(),
        k.path(&format!("{ca}-ca.pem")),
        "--cert".into(),
        k.path(&format!("{client}-client.pem")),
        "--key".into(),
        k.path(&format!("{client}-client.key")),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&n.cli(&a), "kms add");
}

/// Write `writes` through vhost-user-blk device `dev`, or read them back and compare.
fn io(n: &Nacred, dev: &str, writes: &[(u64, Vec<u8>)], write: bool) {
    let sock = n.run_dir.join(format!("vhost-{dev}.sock"));
    let mut c = BlkioClient::connect(&sock, &ClientOptions::default()).unwrap();
    let mut q = c.take_queues().remove(0);
    for (off, data) in writes {
        let buf = &mut c.mem()[..data.len()];
        if write {
            buf.copy_from_slice(data);
            assert_eq!(blkio_client::write(&mut q, *off, buf).unwrap(), 0);
        } else {
            buf.fill(0);
            assert_eq!(
                blkio_client::read(&mut q, *off, buf).unwrap(),
                0,
                "read at {off}"
            );
            assert!(*buf == data[..], "data read back at {off} differs");
        }
    }
    if write {
        assert_eq!(blkio_client::flush(&mut q).unwrap(), 0);
    }
}

/// A read through the device fails (an error status, never zeros or data).
fn read_fails(n: &Nacred, dev: &str) {
    let sock = n.run_dir.join(format!("vhost-{dev}.sock"));
    let mut c = BlkioClient::connect(&sock, &ClientOptions::default()).unwrap();
    let mut q = c.take_queues().remove(0);
    let buf = &mut c.mem()[..4096];
    buf.fill(0xA5);
    let r = blkio_client::read(&mut q, 0, buf).unwrap();
    assert_ne!(r, 0, "a locked volume must fail reads");
    assert!(buf.iter().all(|b| *b == 0xA5), "a failed read wrote data");
}

fn volume_state(n: &Nacred, name: &str) -> (String, String) {
    let v = n.ok("volume_list", json!({}));
    let v = v
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("volume {name} in {v}"))
        .clone();
    (
        v["state"].as_str().unwrap_or("").into(),
        v["reason"].as_str().unwrap_or("").into(),
    )
}

/// The recorded envelope blob of a KMS tenant's current KEK: (key id, IV hex, blob hex).
fn recorded_blob(n: &Nacred, tenant: &str) -> (String, String, String) {
    let s: Value =
        serde_json::from_str(&std::fs::read_to_string(n.state_dir.join("state.json")).unwrap())
            .unwrap();
    let spec = &s["tenants"][tenant]["kek"]["spec"];
    assert_eq!(spec["kind"], "kms", "{spec}");
    (
        spec["key_id"].as_str().unwrap().into(),
        spec["iv"].as_str().unwrap().into(),
        spec["blob"].as_str().unwrap().into(),
    )
}

/// Python (bytes.find is fast; nacred reserves a large, mostly untouched heap): count
/// the occurrences of a hex needle in every readable mapping of a process.
const MEMSCAN_PY: &str = r#"
import sys
pid, needle = int(sys.argv[1]), bytes.fromhex(sys.argv[2])
n = 0
with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
    for line in open(f"/proc/{pid}/maps"):
        f = line.split()
        if not f[1].startswith("r") or line.rstrip().endswith(("[vvar]", "[vsyscall]", "[vvar_vclock]")):
            continue
        a, b = (int(x, 16) for x in f[0].split("-"))
        try:
            mem.seek(a)
            data = mem.read(b - a)
        except OSError:
            continue
        n += data.count(needle)
print(n)
"#;

/// Whether `needle` occurs anywhere in the readable memory of process `pid`.
fn in_memory(pid: u32, needle: &[u8]) -> bool {
    let out = Command::new("python3")
        .args(["-c", MEMSCAN_PY, &pid.to_string(), &to_hex(needle)])
        .output()
        .unwrap();
    assert!(out.status.success(), "memory scan: {}", text(&out.stderr));
    text(&out.stdout).trim() != "0"
}

/// Whether any 12-byte window of `secret` appears in `hay`, raw or as hex.
fn leaks(hay: &[u8], secret: &[u8]) -> bool {
    let lower = hay.to_ascii_lowercase();
    secret.windows(12).any(|w| {
        let h = to_hex(w);
        hay.windows(12).any(|x| x == w) || lower.windows(h.len()).any(|x| x == h.as_bytes())
    })
}

#[test]
fn kms_tenant_lifecycle_against_pykmip() {
    let mut k = Kmip::start();
    let mut n = Nacred::start_args(&["--no-default", "--metrics-listen", "127.0.0.1:0"]);
    let key1 = k.create_key();
    add_kms(&n, &k, "pykmip", "good", "good", &[]);
    let mut json_out = String::new();
    json_out += &ok(
        &n.cli(&[
            "--json",
            "tenant",
            "create",
            "acme",
            "--kms",
            "pykmip",
            "--kms-key-id",
            &key1,
        ]),
        "tenant create --kms",
    );
    ok(
        &n.cli(&[
            "volume",
            "create",
            "v1",
            "--size",
            "8M",
            "--tenant",
            "acme",
            "--encrypt",
        ]),
        "volume create --encrypt",
    );
    n.ok("vhost_blk_create", json!({"name": "d", "volume": "v1"}));
    // A key-file tenant beside it, which a KMS problem must not touch.
    let kf = k.dir.path().join("other.kek");
    std::fs::write(&kf, random(32)).unwrap();
    ok(
        &n.cli(&[
            "tenant",
            "create",
            "other",
            "--key-file",
            kf.to_str().unwrap(),
        ]),
        "tenant create --key-file",
    );
    ok(
        &n.cli(&[
            "volume",
            "create",
            "w1",
            "--size",
            "4M",
            "--tenant",
            "other",
            "--encrypt",
        ]),
        "volume create",
    );

    let writes: Vec<(u64, Vec<u8>)> = vec![
        (0, random(64 * 1024)),
        ((1 << 20) + 4096, random(12 * 1024)),
        ((8 << 20) - 8192, random(8192)),
    ];
    io(&n, "d", &writes, true);

    // Restart: the key manager unlocks the tenant at start and the data reads back.
    n.restart();
    io(&n, "d", &writes, false);
    let show = n.ok("tenant_show", json!({"name": "acme"}));
    assert_eq!(show["kms"], "pykmip", "{show}");
    assert_eq!(show["kms_key_id"], key1.as_str(), "{show}");
    assert_eq!(show["unlocked"], true, "{show}");
    assert!(show["kms_last_contact"].as_u64().is_some(), "{show}");
    let shown = ok(&n.cli(&["tenant", "show", "acme"]), "tenant show");
    assert!(
        shown.contains("pykmip") && shown.contains("last contact"),
        "{shown}"
    );
    json_out += &ok(&n.cli(&["--json", "tenant", "show", "acme"]), "show");
    json_out += &ok(&n.cli(&["--json", "tenant", "list"]), "list");
    json_out += &ok(&n.cli(&["--json", "kms", "list"]), "kms list");

    // The envelope key, as only the key manager can produce it from the recorded blob.
    let (id, iv, blob) = recorded_blob(&n, "acme");
    assert_eq!(id, key1);
    let envelope = hex(&k.cmd(&format!("decrypt {id} {iv} {blob}")).unwrap());
    assert_eq!(envelope.len(), 32);

    // The ciphertext at rest decrypts with the data key under the Python oracle.
    let key_out = k.dir.path().join("v1.key");
    ok(
        &n.cli(&[
            "volume",
            "export-key",
            "v1",
            "--out",
            key_out.to_str().unwrap(),
            "--yes-export-plaintext-key",
        ]),
        "export-key",
    );
    let data_key = std::fs::read(&key_out).unwrap();
    let img = n.state_dir.join("volumes/v1.img");
    for (off, data) in &writes {
        let pt = python_decrypt_file(
            &img,
            &data_key,
            4096,
            "plain64",
            *off,
            data.len(),
            off / 4096,
        )
        .unwrap();
        assert!(pt == *data, "oracle disagrees at offset {off}");
    }

    // While unlocked nacred holds the envelope key (the scan can see it); once locked,
    // no copy is left in its memory, and the volume fails I/O through its device.
    assert!(
        in_memory(n.pid(), &envelope),
        "the memory scan does not find the unlocked key"
    );
    let locked = ok(&n.cli(&["tenant", "lock", "acme"]), "tenant lock");
    assert!(locked.contains("locked tenant acme"), "{locked}");
    assert!(
        !in_memory(n.pid(), &envelope),
        "the envelope key is still in nacred's memory after `tenant lock`"
    );
    assert!(
        !in_memory(n.pid(), &data_key),
        "the data key is still in nacred's memory after `tenant lock`"
    );
    let (state, reason) = volume_state(&n, "v1");
    assert_eq!(state, "failed");
    assert!(reason.starts_with("tenant locked: "), "{reason}");
    read_fails(&n, "d");
    assert_eq!(volume_state(&n, "w1").0, "online");
    // Unlock: the key manager again; the same device serves the data again. A second
    // lock, after an unlock through the RPC path, leaves no copy either.
    ok(&n.cli(&["tenant", "unlock", "acme"]), "tenant unlock");
    io(&n, "d", &writes, false);
    ok(&n.cli(&["tenant", "lock", "acme"]), "tenant lock");
    for (what, key) in [("envelope", &envelope), ("data", &data_key)] {
        assert!(
            !in_memory(n.pid(), key),
            "the {what} key is in nacred's memory after unlock and lock"
        );
    }
    ok(&n.cli(&["tenant", "unlock", "acme"]), "tenant unlock");
    io(&n, "d", &writes, false);

    // Rotate to a second key; the first can then be revoked and destroyed.
    let key2 = k.create_key();
    json_out += &ok(
        &n.cli(&[
            "--json",
            "tenant",
            "rotate-kek",
            "acme",
            "--kms-key-id",
            &key2,
        ]),
        "rotate-kek",
    );
    let show = n.ok("tenant_show", json!({"name": "acme"}));
    assert_eq!(show["kek_generation"], 2, "{show}");
    assert_eq!(show["kms_key_id"], key2.as_str(), "{show}");
    k.cmd(&format!("revoke {key1}")).unwrap();
    k.cmd(&format!("destroy {key1}")).unwrap();
    n.restart();
    io(&n, "d", &writes, false);
    let (_, iv2, blob2) = recorded_blob(&n, "acme");
    let envelope2 = hex(&k.cmd(&format!("decrypt {key2} {iv2} {blob2}")).unwrap());

    // Only a deactivated key left: the tenant stays locked at start with one clear reason,
    // its volume serves errors, the other tenant is untouched, unlock says why.
    k.cmd(&format!("deactivate {key2}")).unwrap();
    n.restart();
    let (state, reason) = volume_state(&n, "v1");
    assert_eq!(state, "failed");
    assert!(
        reason.starts_with("tenant locked: KMS pykmip refused Decrypt with key")
            && reason.contains("Active state"),
        "{reason}"
    );
    read_fails(&n, "d");
    assert_eq!(volume_state(&n, "w1").0, "online");
    let show = n.ok("tenant_show", json!({"name": "acme"}));
    assert_eq!(show["unlocked"], false, "{show}");
    assert!(
        show["locked_reason"]
            .as_str()
            .unwrap()
            .contains("permission denied"),
        "{show}"
    );
    fails(
        &n.cli(&["tenant", "unlock", "acme"]),
        &["KMS pykmip refused Decrypt", "permission denied"],
    );

    // Metrics: KMS requests by result, and their time.
    let target = n.ok("metrics_endpoint", json!({}))["listen"]
        .as_str()
        .unwrap()
        .to_string();
    let mut s = TcpStream::connect(&target).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut metrics = String::new();
    s.read_to_string(&mut metrics).unwrap();
    assert!(
        metrics.contains(
            "nacre_kms_requests_total{kms=\"pykmip\",operation=\"decrypt\",result=\"error\"} "
        ) && metrics
            .contains("nacre_kms_request_seconds_count{kms=\"pykmip\",operation=\"decrypt\"}"),
        "{metrics}"
    );

    // No key byte in the state, the log or the JSON outputs.
    let state = std::fs::read(n.state_dir.join("state.json")).unwrap();
    let log = n.log_text();
    for secret in [&envelope, &envelope2, &data_key] {
        for (what, hay) in [
            ("state.json", &state[..]),
            ("the log", log.as_bytes()),
            ("--json output", json_out.as_bytes()),
        ] {
            assert!(!leaks(hay, secret), "key bytes in {what}");
        }
    }
}

/// A loopback proxy to port `to` that holds each connection for `delay` before relaying
/// it, and reports each connection it accepts.
fn delaying_proxy(to: u16, delay: Duration) -> (u16, mpsc::Receiver<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let (accepted_tx, accepted_rx) = mpsc::channel();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(client) = c else { return };
            let _ = accepted_tx.send(());
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                let Ok(server) = TcpStream::connect(("127.0.0.1", to)) else {
                    return;
                };
                let (Ok(mut c2), Ok(mut s2)) = (client.try_clone(), server.try_clone()) else {
                    return;
                };
                std::thread::spawn(move || std::io::copy(&mut s2, &mut c2));
                let (mut c, mut s) = (client, server);
                let _ = std::io::copy(&mut c, &mut s);
            });
        }
    });
    (port, accepted_rx)
}

#[test]
fn kms_failure_paths_against_pykmip() {
    let mut k = Kmip::start();
    let mut n = Nacred::start_args(&["--no-default"]);
    let key1 = k.create_key();
    let key2 = k.create_key();
    add_kms(&n, &k, "pykmip", "good", "good", &[]);
    ok(
        &n.cli(&[
            "tenant",
            "create",
            "acme",
            "--kms",
            "pykmip",
            "--kms-key-id",
            &key1,
        ]),
        "tenant create",
    );
    ok(
        &n.cli(&[
            "volume",
            "create",
            "v1",
            "--size",
            "4M",
            "--tenant",
            "acme",
            "--encrypt",
        ]),
        "volume create",
    );
    n.ok("vhost_blk_create", json!({"name": "d", "volume": "v1"}));
    let writes = vec![(4096u64, random(16 * 1024))];
    io(&n, "d", &writes, true);
    let state_before = std::fs::read(n.state_dir.join("state.json")).unwrap();

    // Key manager down during rotate-kek: one line, nothing changes, data still there.
    k.down();
    fails(
        &n.cli(&["tenant", "rotate-kek", "acme", "--kms-key-id", &key2]),
        &["KMS pykmip at 127.0.0.1", "unreachable"],
    );
    assert_eq!(
        std::fs::read(n.state_dir.join("state.json")).unwrap(),
        state_before,
        "a failed rotation changed the state"
    );
    io(&n, "d", &writes, false);

    // Key manager down at start: the tenant is locked and says why; its device serves
    // errors. Once the key manager is back, unlock brings the volume online, no restart.
    n.restart();
    let (state, reason) = volume_state(&n, "v1");
    assert_eq!(state, "failed");
    assert!(
        reason.starts_with("tenant locked: KMS pykmip at 127.0.0.1")
            && reason.contains("unreachable"),
        "{reason}"
    );
    read_fails(&n, "d");
    fails(&n.cli(&["tenant", "unlock", "acme"]), &["unreachable"]);
    k.up();
    ok(&n.cli(&["tenant", "unlock", "acme"]), "unlock");
    assert_eq!(volume_state(&n, "v1").0, "online");
    io(&n, "d", &writes, false);

    // A key id the key manager does not know.
    fails(
        &n.cli(&[
            "tenant",
            "create",
            "t1",
            "--kms",
            "pykmip",
            "--kms-key-id",
            "999999",
        ]),
        &[
            "KMS pykmip refused Encrypt with key 999999",
            "item not found",
        ],
    );
    // A client certificate from a CA the server does not trust.
    add_kms(&n, &k, "wrong-client", "good", "other", &[]);
    fails(
        &n.cli(&[
            "tenant",
            "create",
            "t2",
            "--kms",
            "wrong-client",
            "--kms-key-id",
            &key2,
        ]),
        &["KMS wrong-client at 127.0.0.1", "TLS", "UnknownCA"],
    );
    // A server certificate from another CA than the one pinned.
    add_kms(&n, &k, "wrong-ca", "other", "good", &[]);
    fails(
        &n.cli(&[
            "tenant",
            "create",
            "t3",
            "--kms",
            "wrong-ca",
            "--kms-key-id",
            &key2,
        ]),
        &["KMS wrong-ca at 127.0.0.1", "TLS", "UnknownIssuer"],
    );

    // A key manager that does not answer in time: the control plane keeps answering
    // while nacred waits, and the wait ends in one line.
    let (pport, accepted) = delaying_proxy(k.port, Duration::from_secs(10));
    let slow = format!("127.0.0.1:{pport}");
    ok(
        &n.cli(&[
            "kms",
            "add",
            "slow",
            "--address",
            &slow,
            "--ca",
            &k.path("good-ca.pem"),
            "--cert",
            &k.path("good-client.pem"),
            "--key",
            &k.path("good-client.key"),
            "--timeout-ms",
            "3000",
        ]),
        "kms add slow",
    );
    let mut create = Command::new(bin("nacre"))
        .arg("--rpc")
        .arg(&n.rpc)
        .args([
            "tenant",
            "create",
            "t4",
            "--kms",
            "slow",
            "--kms-key-id",
            &key2,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    accepted
        .recv_timeout(Duration::from_secs(30))
        .expect("nacred connected to the proxy");
    // nacred is inside the KMIP call now; other RPCs are answered meanwhile.
    n.ok("volume_list", json!({}));
    n.ok("tenant_list", json!({}));
    assert!(
        create.try_wait().unwrap().is_none(),
        "the control plane waited for the key manager"
    );
    let out = create.wait_with_output().unwrap();
    fails(&out, &["KMS slow", "did not answer within 3000 ms"]);
    assert!(n.ok("tenant_list", json!({})).as_array().unwrap().len() == 1);

    // Integrity of what the key manager returns: a blob altered in its first block still
    // decrypts under CBC (the padding is intact) to 32 wrong bytes. The KEK check refuses
    // them: the tenant stays locked and nothing is opened.
    assert!(n.stop());
    let blob = recorded_blob(&n, "acme").2;
    let mut bad = hex(&blob);
    bad[3] ^= 0x40;
    n.edit_state(|s| s["tenants"]["acme"]["kek"]["spec"]["blob"] = json!(to_hex(&bad)));
    n.spawn_again();
    let (state, reason) = volume_state(&n, "v1");
    assert_eq!(state, "failed");
    assert!(reason.contains("not tenant acme's KEK"), "{reason}");
    read_fails(&n, "d");

    // Nothing was lost along the way.
    assert!(n.stop());
    n.edit_state(|s| s["tenants"]["acme"]["kek"]["spec"]["blob"] = json!(blob));
    n.spawn_again();
    io(&n, "d", &writes, false);
}
