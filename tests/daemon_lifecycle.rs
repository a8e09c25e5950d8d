//! nacred's life over its directories: one daemon per state/run directory, replay that never
//! invents data, and a banner that tells the truth about what it could restore.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nacre_shared::nvme::Status;
use nacre_tests::blkio_client::{self, BlkioClient, ClientOptions};
use nacre_tests::daemon::{bin, Nacred};
use nacre_tests::nvmf_host::{HostError, HostOptions, NvmfHost};
use serde_json::{json, Value};

/// Runs a second nacred over `state`/`run` and returns (exit code, stderr) once it exits
/// (it must, within 30 s).
fn second_nacred(state: &std::path::Path, run: &std::path::Path) -> (Option<i32>, String) {
    let mut child = Command::new(bin("nacred"))
        .arg("--state-dir")
        .arg(state)
        .arg("--run-dir")
        .arg(run)
        .args(["--nvmf-listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (st.code(), err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a second nacred over the same directories did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A file at the RPC socket's path that is not a stale stream socket (here a regular file)
/// is refused with one line, and left as it was: nacred removed whatever was there.
#[test]
fn a_file_at_the_rpc_socket_path_is_refused_not_removed() {
    let dir = tempfile::tempdir().unwrap();
    let (state, run) = (dir.path().join("state"), dir.path().join("run"));
    std::fs::create_dir_all(&run).unwrap();
    let rpc = run.join("nacred.sock");
    std::fs::write(&rpc, b"not a socket").unwrap();
    let (code, err) = second_nacred(&state, &run);
    assert_eq!(code, Some(1), "{err}");
    // (After the log of what it set up before binding the RPC socket.)
    let line = err.trim_end().lines().last().unwrap_or_default();
    assert!(
        line.starts_with("nacred: error: ") && line.contains("exists and is not a socket"),
        "{err}"
    );
    assert_eq!(std::fs::read(&rpc).unwrap(), b"not a socket");
}

#[test]
fn a_second_nacred_on_the_same_directories_is_refused_and_leaves_the_first_alone() {
    let mut n = Nacred::start();
    let vhost_sock = n.run_dir.join("vhost-default.sock");
    let ino = |p: &std::path::Path| std::fs::symlink_metadata(p).map(|m| m.ino()).ok();
    let (vhost_ino, rpc_ino) = (ino(&vhost_sock), ino(&n.rpc));
    assert!(vhost_ino.is_some() && rpc_ino.is_some());

    // The same state and run directories; then only the run directory; then only the state
    // directory.
    let other = tempfile::tempdir().unwrap();
    for (state, run, dir) in [
        (n.state_dir.clone(), n.run_dir.clone(), &n.state_dir),
        (other.path().join("state"), n.run_dir.clone(), &n.run_dir),
        (n.state_dir.clone(), other.path().join("run"), &n.state_dir),
    ] {
        let (code, err) = second_nacred(&state, &run);
        assert_eq!(code, Some(1), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        let line = err.trim_end();
        assert!(
            line.starts_with("nacred: error: ")
                && line.contains(&format!("{} is in use by another nacred", dir.display()))
                && line.contains(&format!("pid {}", n.pid())),
            "{line}"
        );
    }

    // The first one's sockets are untouched, it still serves, and it stops promptly.
    assert_eq!(
        ino(&vhost_sock),
        vhost_ino,
        "vhost-default.sock was replaced"
    );
    assert_eq!(ino(&n.rpc), rpc_ino, "nacred.sock was replaced");
    assert_eq!(n.ok("volume_list", Value::Null)[0]["name"], "default");
    let t = Instant::now();
    assert!(
        n.stop(),
        "the first nacred did not stop on SIGTERM:\n{}",
        n.log_text()
    );
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "stop took {:?}",
        t.elapsed()
    );
    assert!(!vhost_sock.exists() && !n.rpc.exists());
}

#[test]
fn nacred_stops_even_when_its_socket_paths_are_gone() {
    let mut n = Nacred::start_args(&["--no-default"]);
    n.ok(
        "volume_create",
        json!({"name": "v", "size": 1 << 20, "backend": "ram"}),
    );
    n.ok("vhost_blk_create", json!({"name": "d", "volume": "v"}));
    // Someone removes the run directory's sockets (a cleanup script, a second daemon of an
    // older version): stopping must not need them, the RPC socket's nor a vhost-user one's
    // (whose accept thread was once woken by connecting to its path).
    std::fs::remove_file(&n.rpc).unwrap();
    std::fs::remove_file(n.run_dir.join("vhost-d.sock")).unwrap();
    assert!(n.stop(), "nacred hung on SIGTERM:\n{}", n.log_text());
}

/// The port the default subsystem's listener has (from the RPC).
fn default_nvmf_port(n: &Nacred) -> u16 {
    let subs = n.ok("nvmf_get_subsystems", Value::Null);
    let l = subs
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == DEFAULT_NQN)
        .unwrap_or_else(|| panic!("no default subsystem in {subs}"))["listeners"][0]
        .as_str()
        .unwrap_or_else(|| panic!("no listener in {subs}"))
        .to_string();
    l.rsplit(':').next().unwrap().parse().unwrap()
}

const DEFAULT_NQN: &str = "nqn.2014-08.io.nacre:default";

#[test]
fn a_missing_backing_file_fails_the_volume_instead_of_serving_zeros() {
    let mut n = Nacred::start();
    let img = n.state_dir.join("volumes/default.img");
    let port = default_nvmf_port(&n);
    let data = vec![0xa5u8; 8192];
    {
        let mut h = NvmfHost::connect(
            ([127, 0, 0, 1], port).into(),
            DEFAULT_NQN,
            HostOptions::default(),
        )
        .unwrap();
        h.write(0, 1, 0, &data, 4096).unwrap();
        h.flush(0, 1).unwrap();
    }
    assert!(n.stop());
    // The file system holding it is not mounted yet, say: the file is gone.
    std::fs::rename(&img, n.state_dir.join("default.img.away")).unwrap();
    n.spawn_again();

    // Not recreated, and the volume says why it is failed.
    assert!(!img.exists(), "replay recreated {}", img.display());
    let v = n.ok("volume_list", json!({"name": "default"}));
    assert_eq!(v[0]["state"], "failed", "{v}");
    let reason = v[0]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("missing") && reason.contains(&img.display().to_string()),
        "{reason}"
    );
    let out = n.cli(&["volume", "list"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("failed (backing file"), "{table}");

    // NVMe: the namespace is there, its I/O gets an error status.
    let mut h = NvmfHost::connect(
        ([127, 0, 0, 1], default_nvmf_port(&n)).into(),
        DEFAULT_NQN,
        HostOptions::default(),
    )
    .unwrap_or_else(|e| panic!("connect: {e}\n{}", n.log_text()));
    match h.read(0, 1, 0, 2, 4096) {
        Err(HostError::Nvme(st, _)) => assert!(st != Status::SUCCESS, "{st:?}"),
        other => panic!("a read of a failed volume returned {other:?}"),
    }
    assert!(h.write(0, 1, 0, &data, 4096).is_err());
    drop(h);

    // virtio-blk: the device is served, its I/O gets IOERR (libblkio: -EIO).
    let sock = n.run_dir.join("vhost-default.sock");
    let mut c = BlkioClient::connect(&sock, &ClientOptions::default())
        .unwrap_or_else(|e| panic!("vhost connect: {e}\n{}", n.log_text()));
    let mut queues = c.take_queues();
    let buf = &mut c.mem()[..4096];
    let r = blkio_client::read(&mut queues[0], 0, buf).unwrap();
    assert!(r < 0, "a read of a failed volume returned {r}");
    drop(queues);
    drop(c);
    assert!(!img.exists());

    // Back in place, the next start serves the data again.
    assert!(n.stop());
    std::fs::rename(n.state_dir.join("default.img.away"), &img).unwrap();
    n.spawn_again();
    let v = n.ok("volume_list", json!({"name": "default"}));
    assert_eq!(v[0]["state"], "online", "{v}");
    let mut h = NvmfHost::connect(
        ([127, 0, 0, 1], default_nvmf_port(&n)).into(),
        DEFAULT_NQN,
        HostOptions::default(),
    )
    .unwrap();
    assert_eq!(h.read(0, 1, 0, 2, 4096).unwrap(), data);
}

#[test]
fn volume_create_never_reuses_a_backing_file_unless_asked() {
    let n = Nacred::start_args(&["--no-default"]);
    let img = n.state_dir.join("volumes/data.img");
    n.ok("volume_create", json!({"name": "data", "size": 8 << 20}));
    // Sync'd new file of the asked size, private.
    let m = std::fs::metadata(&img).unwrap();
    assert_eq!(m.len(), 8 << 20);
    assert_eq!(m.permissions().mode() & 0o777, 0o600);
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(&pattern, 4096).unwrap();
    }
    n.ok("volume_delete", json!({"name": "data"}));
    assert!(img.exists(), "delete without delete_data keeps the file");

    // Same name again: refused, naming the file and the flag; nothing changed.
    let (code, msg) = n.err("volume_create", json!({"name": "data", "size": 1 << 20}));
    assert_eq!(code, nacre_shared::rpc::ALREADY_EXISTS, "{msg}");
    assert!(
        msg.contains(&img.display().to_string()) && msg.contains("--adopt-existing"),
        "{msg}"
    );
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 8 << 20);
    let out = n.cli(&["volume", "create", "data", "--size", "1M"]);
    assert_eq!(out.status.code(), Some(1));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.lines().count() == 1 && e.starts_with("nacre: ") && e.contains("--adopt-existing"),
        "{e}"
    );
    // A size other than the file's is refused when adopting.
    let (_, msg) = n.err(
        "volume_create",
        json!({"name": "data", "size": 1 << 20, "adopt_existing": true}),
    );
    assert!(msg.contains("8388608 bytes"), "{msg}");
    // Adopting takes the file's size and its data.
    let out = n.cli(&["volume", "create", "data", "--adopt-existing"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = n.ok("volume_list", json!({"name": "data"}));
    assert_eq!(v[0]["size"], 8 << 20, "{v}");
    n.ok(
        "nvmf_subsystem_create",
        json!({"nqn": "nqn.2024-01.io.nacre:adopt", "allow_any_host": true}),
    );
    n.ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": "nqn.2024-01.io.nacre:adopt", "volume": "data"}),
    );
    let l = n.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": "nqn.2024-01.io.nacre:adopt", "address": "127.0.0.1", "port": 0}),
    );
    let port = l["port"].as_u64().unwrap() as u16;
    let mut h = NvmfHost::connect(
        ([127, 0, 0, 1], port).into(),
        "nqn.2024-01.io.nacre:adopt",
        HostOptions::default(),
    )
    .unwrap();
    assert_eq!(h.read(0, 1, 1, 1, 4096).unwrap(), pattern);
    // A path given explicitly is refused the same way.
    let other = n.state_dir.join("other.img");
    std::fs::write(&other, vec![1u8; 4096]).unwrap();
    let (_, msg) = n.err(
        "volume_create",
        json!({"name": "o", "size": 4096, "path": other}),
    );
    assert!(msg.contains("already exists"), "{msg}");
    assert_eq!(std::fs::read(&other).unwrap(), vec![1u8; 4096]);
}

#[test]
fn a_saved_listener_whose_port_is_taken_is_reported_and_retried() {
    let mut n = Nacred::start();
    let port = default_nvmf_port(&n);
    assert!(n.stop());
    // Someone else has the port when nacred comes back.
    let squatter = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let log_before = n.log_text().len();
    n.spawn_again();
    let log = n.log_text()[log_before..].to_string();
    let addr = format!("127.0.0.1:{port}");
    assert!(
        !log.contains(&format!("listens on {addr}")),
        "the banner claims a listener it does not have:\n{log}"
    );
    assert!(
        log.contains(&format!("is NOT listening on {addr}")) && log.contains("retrying"),
        "{log}"
    );
    let state = |n: &Nacred| {
        let subs = n.ok("nvmf_get_subsystems", Value::Null);
        subs.as_array()
            .unwrap()
            .iter()
            .find(|s| s["nqn"] == DEFAULT_NQN)
            .unwrap()["listener_states"][0]
            .clone()
    };
    let l = state(&n);
    assert_eq!(l["address"], addr, "{l}");
    assert_eq!(l["state"], "failed", "{l}");
    assert!(
        l["reason"].as_str().unwrap_or_default().contains("in use"),
        "{l}"
    );
    let out = n.cli(&["nvmf", "list"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains(&format!("{addr} (failed: ")), "{table}");

    // The port is free again: nacred binds it in the background and says so.
    drop(squatter);
    let deadline = Instant::now() + Duration::from_secs(60);
    while state(&n)["state"] != "listening" {
        assert!(
            Instant::now() < deadline,
            "listener not retried within 60 s: {}\n{}",
            state(&n),
            n.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut h = NvmfHost::connect(
        ([127, 0, 0, 1], port).into(),
        DEFAULT_NQN,
        HostOptions::default(),
    )
    .unwrap();
    h.identify_controller().unwrap();
    let out = n.cli(&["nvmf", "list"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains(&addr) && !table.contains("failed"),
        "{table}"
    );
}
