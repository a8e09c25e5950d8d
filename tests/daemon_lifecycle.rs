//! nacred's life over its directories: one daemon per state/run directory, replay that never
//! invents data, and a banner that tells the truth about what it could restore.

use std::os::unix::fs::MetadataExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nacre_tests::daemon::{bin, Nacred};
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
    // Someone removes the run directory's sockets (a cleanup script, a second daemon of an
    // older version): stopping must not need them.
    std::fs::remove_file(&n.rpc).unwrap();
    assert!(n.stop(), "nacred hung on SIGTERM:\n{}", n.log_text());
}
