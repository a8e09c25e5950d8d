//! Run the real `nacred` and `nacre` binaries in tests.
//!
//! The binaries belong to the nacre-dpu and nacre-cli packages, so they are found next to the test
//! executable's `deps/` directory (`target/<profile>/nacred`); the README's test command
//! builds them first (`cargo build --workspace --bins`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nacre_shared::rpc::{Client, ClientError};
use serde_json::Value;

/// Path of a workspace binary built for the same profile as the running test.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test>-<hash>  ->  target/<profile>/<name>
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins)",
        p.display()
    );
    p
}

/// What a nacred process holds: a test that opens and closes sessions over and over compares
/// it before and after, so that a leak of one fd or thread per session shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    pub fds: usize,
    pub threads: usize,
}

impl Footprint {
    /// Fails if `self` holds more than `before` did, after `sessions` sessions of `what`.
    pub fn assert_no_more_than(self, before: Footprint, sessions: usize, what: &str) {
        assert!(
            self.fds <= before.fds && self.threads <= before.threads,
            "nacred holds {} fds and {} threads after {sessions} more {what}, {} and {} before",
            self.fds,
            self.threads,
            before.fds,
            before.threads
        );
    }
}

/// A nacred process over its own temporary state and run directories.
pub struct Nacred {
    child: Option<Child>,
    _tmp: Option<tempfile::TempDir>,
    pub state_dir: PathBuf,
    pub run_dir: PathBuf,
    pub rpc: PathBuf,
    pub log: PathBuf,
    extra_args: Vec<String>,
    /// RLIMIT_NOFILE (soft, hard) nacred starts with, instead of the test's own.
    fd_limit: Option<(u64, u64)>,
}

impl Nacred {
    /// A fresh nacred with the embedded default.
    pub fn start() -> Self {
        Self::start_args(&[])
    }

    /// A fresh nacred with extra command-line arguments (e.g. `--no-default`).
    pub fn start_args(args: &[&str]) -> Self {
        Self::start_limited(args, None)
    }

    /// [`Nacred::start_args`], started with the open-file limit (soft, hard) a service manager
    /// might give it.
    pub fn start_with_fd_limit(args: &[&str], soft: u64, hard: u64) -> Self {
        Self::start_limited(args, Some((soft, hard)))
    }

    fn start_limited(args: &[&str], fd_limit: Option<(u64, u64)>) -> Self {
        let tmp = tempfile::Builder::new()
            .prefix("nacre-test-")
            .tempdir()
            .expect("tempdir");
        let root = tmp.path().to_path_buf();
        let mut n = Nacred {
            child: None,
            _tmp: Some(tmp),
            state_dir: root.join("state"),
            run_dir: root.join("run"),
            rpc: root.join("run").join("nacred.sock"),
            log: root.join("nacred.log"),
            extra_args: args.iter().map(|s| s.to_string()).collect(),
            fd_limit,
        };
        n.spawn();
        n
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut defaults: Vec<&str> = Vec::new();
        if !self.extra_args.iter().any(|a| a == "--nvmf-listen") {
            // Tests run in parallel: the embedded default's NVMe/TCP listener takes any free
            // port instead of 4420.
            defaults.extend(["--nvmf-listen", "127.0.0.1:0"]);
        }
        if !self.extra_args.iter().any(|a| a == "--log") {
            defaults.extend(["--log", "debug"]);
        }
        let mut cmd = Command::new(bin("nacred"));
        if let Some((soft, hard)) = self.fd_limit {
            use std::os::unix::process::CommandExt;
            let lim = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            // SAFETY: the hook runs in the forked child before exec and only calls setrlimit,
            // which is async-signal-safe, with a struct it owns.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = cmd
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--run-dir")
            .arg(&self.run_dir)
            .args(&defaults)
            .args(&self.extra_args)
            .env_remove("NACRE_RPC")
            // No fixed port in tests (the default 127.0.0.1:9444 would be shared by every
            // nacred on the machine); a test that wants the endpoint passes --metrics-listen.
            .env("NACRE_METRICS_LISTEN", "off")
            // A relative path in a request must never land in the checkout.
            .current_dir(self.state_dir.parent().expect("test root"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn nacred");
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut c) = Client::connect(&self.rpc) {
                if c.call("rpc_get_methods", Value::Null).is_ok() {
                    return;
                }
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "nacred exited during start ({status}):\n{}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "nacred did not answer on {} within 30 s:\n{}",
                self.rpc.display(),
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// nacred's open descriptors and threads now, from /proc.
    ///
    /// The kernel's io_uring workers (`iou-wrk-*`, serving a file volume's ring) are not
    /// counted: the kernel starts them on demand and retires them when idle, whatever nacred
    /// does, and a leaked ring would still show as a leaked fd.
    pub fn footprint(&self) -> Footprint {
        let dir = |what: &str| std::fs::read_dir(format!("/proc/{}/{what}", self.pid()));
        let fds = dir("fd").map(|d| d.count()).unwrap_or(0);
        let threads = dir("task")
            .map(|d| {
                d.flatten()
                    .filter(|t| {
                        std::fs::read_to_string(t.path().join("comm"))
                            .map_or(true, |comm| !comm.starts_with("iou-wrk-"))
                    })
                    .count()
            })
            .unwrap_or(0);
        Footprint { fds, threads }
    }

    /// The footprint once it has stopped changing for 200 ms and `idle()` holds (nacred tears a
    /// connection down asynchronously after the peer leaves); whatever it is after 20 s.
    pub fn settled_footprint(&self, idle: impl Fn() -> bool) -> Footprint {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut last = self.footprint();
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let now = self.footprint();
            if (now == last && idle()) || Instant::now() > deadline {
                return now;
            }
            last = now;
        }
    }

    /// The footprint once it is back to `before` (or below) and `idle()` holds; whatever it
    /// is after 20 s. For the "after" side of a leak check: a thread that a loaded machine
    /// left a moment late in its teardown gets there, a leak never does.
    pub fn footprint_back_to(&self, before: Footprint, idle: impl Fn() -> bool) -> Footprint {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let now = self.footprint();
            let back = now.fds <= before.fds && now.threads <= before.threads;
            if (back && idle()) || Instant::now() > deadline {
                return now;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.rpc).expect("connect to nacred")
    }

    pub fn call(&self, method: &str, params: Value) -> Result<Value, ClientError> {
        self.client().call(method, params)
    }

    /// Call and expect success.
    pub fn ok(&self, method: &str, params: Value) -> Value {
        self.call(method, params)
            .unwrap_or_else(|e| panic!("{method} failed: {e}\n{}", self.log_text()))
    }

    /// Export `volume` as a namespace of a new subsystem `nqn` that any host may reach, on a
    /// listener on a free loopback port; returns the listener's address.
    pub fn export_nvmf(&self, nqn: &str, volume: &str) -> std::net::SocketAddr {
        self.ok(
            "nvmf_subsystem_create",
            serde_json::json!({"nqn": nqn, "allow_any_host": true}),
        );
        self.ok(
            "nvmf_subsystem_add_ns",
            serde_json::json!({"nqn": nqn, "volume": volume}),
        );
        let l = self.ok(
            "nvmf_subsystem_add_listener",
            serde_json::json!({"nqn": nqn, "address": "127.0.0.1", "port": 0}),
        );
        let port = l["port"].as_u64().expect("listener port") as u16;
        std::net::SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// The first listener of subsystem `nqn` (one a restart replayed, say).
    pub fn nvmf_listener(&self, nqn: &str) -> std::net::SocketAddr {
        let subs = self.ok("nvmf_get_subsystems", serde_json::json!({}));
        let sub = subs
            .as_array()
            .and_then(|a| a.iter().find(|s| s["nqn"] == nqn))
            .unwrap_or_else(|| panic!("no subsystem {nqn}: {subs}"));
        sub["listeners"][0]
            .as_str()
            .and_then(|l| l.parse().ok())
            .unwrap_or_else(|| panic!("no listener: {sub}"))
    }

    /// Rewrite the saved `state.json` with `edit` (the daemon stopped: a hand-edited or
    /// damaged state for the next start to replay).
    pub fn edit_state(&self, edit: impl FnOnce(&mut Value)) {
        let path = self.state_dir.join("state.json");
        let mut state: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut state);
        std::fs::write(&path, serde_json::to_vec_pretty(&state).unwrap()).unwrap();
    }

    /// Call and expect a JSON-RPC error; returns (code, message).
    pub fn err(&self, method: &str, params: Value) -> (i64, String) {
        match self.call(method, params) {
            Err(ClientError::Rpc { code, message }) => (code, message),
            other => panic!("{method}: expected an RPC error, got {other:?}"),
        }
    }

    /// SIGKILL: a crash, nothing is cleaned up.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for an orderly exit; returns whether it exited successfully.
    pub fn stop(&mut self) -> bool {
        let Some(mut c) = self.child.take() else {
            return true;
        };
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(st)) = c.try_wait() {
                return st.success();
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Start again over the same directories after [`Nacred::stop`] or [`Nacred::kill`]
    /// (e.g. once the test changed something in them).
    pub fn spawn_again(&mut self) {
        assert!(self.child.is_none(), "nacred is still running");
        self.spawn();
    }

    /// Crash (SIGKILL) and start again over the same directories.
    pub fn crash_restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Orderly stop and start again over the same directories.
    pub fn restart(&mut self) {
        assert!(
            self.stop(),
            "nacred did not stop cleanly:\n{}",
            self.log_text()
        );
        self.spawn();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Run the `nacre` CLI against this daemon.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(bin("nacre"))
            .arg("--rpc")
            .arg(&self.rpc)
            .args(args)
            .output()
            .expect("run nacre")
    }

    /// Data through an attached remote: a volume on its namespace 1, served over
    /// vhost-user-blk to libblkio, 4 x 16 KiB written at scattered offsets and read back
    /// (`seed` makes the pattern and the volume's name); the volume is deleted afterwards.
    pub fn remote_round_trip(&self, remote: &str, seed: u64) {
        use crate::blkio_client::{read, write, BlkioClient, ClientOptions};
        use serde_json::json;
        let vol = format!("v{seed}");
        self.ok(
            "volume_create",
            json!({"name": vol, "backend": "remote", "size": 0, "remote": {"extents": [format!("{remote}:1")]}}),
        );
        self.ok(
            "vhost_blk_create",
            json!({"name": vol, "volume": vol, "queues": 1}),
        );
        let sock = self.run_dir.join(format!("vhost-{vol}.sock"));
        let mut c = BlkioClient::connect(&sock, &ClientOptions::default()).unwrap();
        let mut qs = c.take_queues();
        let mem = c.mem();
        for i in 0..4u64 {
            let off = i * (4 << 20) + 8192 * i;
            let d = crate::fabric_support::pattern(seed * 16 + i, off, 16384);
            mem[..d.len()].copy_from_slice(&d);
            assert_eq!(write(&mut qs[0], off, &mem[..d.len()]).unwrap(), 0);
            mem[..d.len()].fill(0);
            assert_eq!(read(&mut qs[0], off, &mut mem[..d.len()]).unwrap(), 0);
            assert!(mem[..d.len()] == d[..], "data read back at {off}");
        }
        drop(qs);
        drop(c);
        self.ok("vhost_blk_delete", json!({"name": vol}));
        self.ok("volume_delete", json!({"name": vol}));
    }
}

impl Drop for Nacred {
    fn drop(&mut self) {
        self.kill();
    }
}
