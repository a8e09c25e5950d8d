//! Harness for the QEMU test bed (`scripts/testbed`): boot a guest scenario, follow its serial log
//! while it runs, signal it, and collect its result; plus host-side peers (qemu-storage-daemon)
//! that are stopped when dropped.
//!
//! The guest side of each scenario lives in `scripts/testbed.d/NAME.sh`; the protocol between the
//! two is line-based on the serial console:
//! - `TB-FACT key=value` — a value the test asserts on ([`Outcome::fact`]);
//! - `TB-WAIT WORD` — the guest blocks until the host writes `WORD` to its control socket
//!   ([`Guest::signal`]);
//! - `TB-RESULT name=NAME rc=RC` — turned into the exit status of `scripts/testbed run`.
//!
//! A boot with [`Boot::qmp`] also gives the test QEMU's machine protocol ([`Qmp`]): hot-plug
//! (`device_add`, `device_del`) and the VM's run state, as an operator's management layer has.
//!
//! Guests are slow under TCG (no KVM here): [`exclusive`] serialises scenarios within a test binary
//! so two tests never fight for the two CPUs, and every wait has a deadline.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The repository root (the parent of the `tests` crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests crate has a parent directory")
        .to_path_buf()
}

/// `scripts/testbed`.
pub fn script() -> PathBuf {
    repo_root().join("scripts/testbed")
}

/// Set to skip test-bed tests on a machine that cannot run QEMU (the README documents it;
/// each skip is counted in the suite's summary, see [`crate::skip`]).
pub const SKIP_ENV: &str = "NACRE_SKIP_TESTBED";

/// True (and recorded as a skip) when the caller asked to skip the test bed.
pub fn skipped(test: &str) -> bool {
    if crate::skip::switch_on(SKIP_ENV) {
        crate::skip::skip(test, &format!("{SKIP_ENV} is set"));
        return true;
    }
    false
}

static SERIAL: Mutex<()> = Mutex::new(());

/// Hold this for the duration of a test that boots guests: one scenario at a time per process.
pub fn exclusive() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `scripts/testbed trixie-qemu`: the path of a QEMU with the vfio-user client (trixie-backports',
/// built into a trixie root once).
pub fn trixie_qemu() -> Result<PathBuf> {
    let out = Command::new(script()).arg("trixie-qemu").output()?;
    if !out.status.success() {
        anyhow::bail!(
            "scripts/testbed trixie-qemu failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// `scripts/testbed trixie-kernel`: Debian 13's 6.12 kernel (NVMe in-band authentication, NVMe/TCP
/// TLS) and a base initramfs of trixie's user space, built once into the cache (root only the
/// first time; `scripts/setup --test` does it).
pub fn trixie_kernel() -> Result<()> {
    let out = Command::new(script())
        .arg("trixie-kernel")
        .stdin(Stdio::null())
        .output()
        .context("running scripts/testbed trixie-kernel")?;
    if !out.status.success() {
        bail!(
            "scripts/testbed trixie-kernel failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Run `scripts/testbed setup` (idempotent; the script locks against concurrent setups).
pub fn setup() -> Result<()> {
    let out = Command::new(script())
        .arg("setup")
        .stdin(Stdio::null())
        .output()
        .context("running scripts/testbed setup")?;
    if !out.status.success() {
        bail!(
            "scripts/testbed setup failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// A free TCP port on 127.0.0.1 (bound, then released: a tiny race, acceptable for tests).
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// What to boot: a scenario, its parameters and the extra QEMU arguments.
#[derive(Debug, Clone)]
pub struct Boot {
    scenario: String,
    name: String,
    params: Vec<(String, String)>,
    files: Vec<(String, PathBuf)>,
    packs: Vec<PathBuf>,
    qemu: Vec<String>,
    ctl: bool,
    qmp: bool,
    timeout: Duration,
    qemu_binary: Option<PathBuf>,
    smp: Option<u32>,
    kernel: Option<String>,
}

impl Boot {
    /// Boot `scripts/testbed.d/<scenario>.sh`.
    pub fn new(scenario: &str) -> Self {
        Boot {
            scenario: scenario.to_string(),
            name: scenario.to_string(),
            params: Vec::new(),
            files: Vec::new(),
            packs: Vec::new(),
            qemu: Vec::new(),
            ctl: false,
            qmp: false,
            timeout: Duration::from_secs(240),
            qemu_binary: None,
            smp: None,
            kernel: None,
        }
    }

    /// Boot with this QEMU instead of the one on $PATH (e.g. [`trixie_qemu`]'s).
    pub fn qemu_binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.qemu_binary = Some(path.into());
        self
    }

    /// Guest vCPUs (the script's default is 2).
    pub fn smp(mut self, n: u32) -> Self {
        self.smp = Some(n);
        self
    }

    /// Boot this kernel flavour (`scripts/testbed run --kernel`): "trixie" is Debian 13's 6.12 with
    /// trixie's user space ([`trixie_kernel`] builds it), "bookworm" the default 6.1.
    pub fn kernel(mut self, flavour: &str) -> Self {
        self.kernel = Some(flavour.to_string());
        self
    }

    /// Label for the log and pid files; distinct for guests that run at the same time.
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_string();
        self
    }

    /// `tb.KEY=VALUE` on the guest's kernel command line (`param KEY` in the scenario).
    pub fn param(mut self, key: &str, value: impl ToString) -> Self {
        self.params.push((key.to_string(), value.to_string()));
        self
    }

    /// A host file the guest reads at `$(tb_file NAME)` (fw_cfg).
    pub fn file(mut self, name: &str, path: impl Into<PathBuf>) -> Self {
        self.files.push((name.to_string(), path.into()));
        self
    }

    /// A host executable to run inside the guest (`scripts/testbed run --pack`): it and the
    /// libraries it links are packed into the initramfs, as /usr/bin/NAME.
    pub fn pack(mut self, exe: impl Into<PathBuf>) -> Self {
        self.packs.push(exe.into());
        self
    }

    /// Extra QEMU arguments (devices, netdevs).
    pub fn qemu<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.qemu.extend(args.into_iter().map(Into::into));
        self
    }

    /// Give the guest a control channel (/dev/ttyS1) for [`Guest::signal`].
    pub fn ctl(mut self) -> Self {
        self.ctl = true;
        self
    }

    /// Give the test QEMU's QMP monitor (a Unix socket QEMU listens on) for [`Guest::qmp`].
    pub fn qmp(mut self) -> Self {
        self.qmp = true;
        self
    }

    /// Hard limit for the whole boot (QEMU is killed after it).
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// Start the guest and return at once; follow it with [`Guest::wait_for`] and [`Guest::wait`].
    pub fn spawn(self) -> Result<Guest> {
        let tmp = tempfile::Builder::new().prefix("nacre-tb-").tempdir()?;
        let ctl_path = self.ctl.then(|| tmp.path().join("ctl.sock"));
        let qmp_path = self.qmp.then(|| tmp.path().join("qmp.sock"));
        let mut cmd = Command::new(script());
        cmd.arg("run")
            .arg(&self.scenario)
            .arg("--name")
            .arg(&self.name)
            .arg("--timeout")
            .arg(self.timeout.as_secs().max(1).to_string());
        for (k, v) in &self.params {
            cmd.arg("--param").arg(format!("{k}={v}"));
        }
        for (n, p) in &self.files {
            cmd.arg("--file").arg(format!("{n}={}", p.display()));
        }
        for p in &self.packs {
            cmd.arg("--pack").arg(p);
        }
        if let Some(c) = &ctl_path {
            cmd.arg("--ctl").arg(c);
        }
        if let Some(n) = self.smp {
            cmd.arg("--smp").arg(n.to_string());
        }
        if let Some(k) = &self.kernel {
            cmd.arg("--kernel").arg(k);
        }
        if let Some(q) = &self.qemu_binary {
            cmd.env("NACRE_TESTBED_QEMU", q);
        }
        cmd.arg("--").args(&self.qemu);
        if let Some(q) = &qmp_path {
            cmd.arg("-qmp")
                .arg(format!("unix:{},server=on,wait=off", q.display()));
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().context("starting scripts/testbed")?;
        let log = Arc::new(Log::default());
        let qemu_pid = Arc::new(Mutex::new(None));
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let mut readers = Vec::new();
        {
            let log = log.clone();
            let name = self.name.clone();
            readers.push(thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                    log.push(&name, line);
                }
            }));
        }
        {
            let log = log.clone();
            let name = self.name.clone();
            let qemu_pid = qemu_pid.clone();
            readers.push(thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
                    if let Some(rest) = line.strip_prefix("TB-QEMU pid=") {
                        let pid = rest.split_whitespace().next().and_then(|p| p.parse().ok());
                        *qemu_pid.lock().unwrap() = pid;
                    }
                    log.push(&name, line);
                }
            }));
        }
        Ok(Guest {
            boot: self,
            child: Some(child),
            log,
            qemu_pid,
            readers,
            ctl_path,
            ctl: Mutex::new(None),
            qmp_path,
            _tmp: tmp,
        })
    }

    /// Boot, run to the end and return the outcome (success or not: check it).
    pub fn run(self) -> Result<Outcome> {
        let limit = self.timeout + Duration::from_secs(60);
        self.spawn()?.wait(limit)
    }
}

/// The serial log, shared with the reader threads.
#[derive(Default)]
struct Log {
    lines: Mutex<Vec<String>>,
    grew: Condvar,
}

impl Log {
    fn push(&self, name: &str, line: String) {
        eprintln!("[{name}] {line}");
        self.lines.lock().unwrap().push(line);
        self.grew.notify_all();
    }
}

/// A running guest. Dropping it stops the script and QEMU.
pub struct Guest {
    boot: Boot,
    child: Option<Child>,
    log: Arc<Log>,
    qemu_pid: Arc<Mutex<Option<i32>>>,
    readers: Vec<thread::JoinHandle<()>>,
    ctl_path: Option<PathBuf>,
    ctl: Mutex<Option<UnixStream>>,
    qmp_path: Option<PathBuf>,
    _tmp: tempfile::TempDir,
}

impl Guest {
    /// Wait until a log line contains `needle`, scanning from line `from`; returns the index of
    /// that line and the line. Fails if the guest ends first or `timeout` passes.
    pub fn wait_for_from(
        &self,
        from: usize,
        needle: &str,
        timeout: Duration,
    ) -> Result<(usize, String)> {
        let deadline = Instant::now() + timeout;
        let mut lines = self.log.lines.lock().unwrap();
        let mut seen = from;
        loop {
            if let Some(i) = lines[seen.min(lines.len())..]
                .iter()
                .position(|l| l.contains(needle))
            {
                let idx = seen + i;
                return Ok((idx, lines[idx].clone()));
            }
            seen = lines.len();
            if lines
                .iter()
                .any(|l| l.contains("TB-RESULT ") || l.contains("TB-TIMEOUT"))
            {
                bail!(
                    "{}: guest finished without printing '{needle}'",
                    self.boot.name
                );
            }
            let now = Instant::now();
            if now >= deadline {
                bail!("{}: no '{needle}' within {timeout:?}", self.boot.name);
            }
            let (l, _) = self
                .log
                .grew
                .wait_timeout(lines, (deadline - now).min(Duration::from_millis(500)))
                .unwrap();
            lines = l;
        }
    }

    /// Wait until a log line contains `needle` (anywhere in the log so far or later).
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> Result<String> {
        self.wait_for_from(0, needle, timeout).map(|(_, l)| l)
    }

    /// Write `word` as one line to the guest's control channel (`wait_host WORD` in the guest).
    pub fn signal(&self, word: &str) -> Result<()> {
        let path = self
            .ctl_path
            .as_ref()
            .with_context(|| format!("{}: booted without .ctl()", self.boot.name))?;
        let mut ctl = self.ctl.lock().unwrap();
        if ctl.is_none() {
            *ctl = Some(
                UnixStream::connect(path)
                    .with_context(|| format!("connecting {}", path.display()))?,
            );
        }
        ctl.as_mut()
            .unwrap()
            .write_all(format!("{word}\n").as_bytes())
            .context("writing to the guest's control channel")
    }

    /// A QMP connection to this guest's QEMU (booted with [`Boot::qmp`]), capabilities negotiated.
    /// QEMU serves one QMP client at a time on the socket: keep the one this returns.
    pub fn qmp(&self) -> Result<Qmp> {
        let path = self
            .qmp_path
            .as_ref()
            .with_context(|| format!("{}: booted without .qmp()", self.boot.name))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(e).with_context(|| {
                        format!("{}: connecting QMP at {}", self.boot.name, path.display())
                    })
                }
                Err(_) => thread::sleep(Duration::from_millis(100)),
            }
        };
        Qmp::negotiate(stream, &self.boot.name)
    }

    /// QEMU's pid, once the script has started it.
    pub fn qemu_pid(&self) -> Option<u32> {
        self.qemu_pid.lock().unwrap().map(|p| p as u32)
    }

    /// Lines logged so far.
    pub fn lines(&self) -> Vec<String> {
        self.log.lines.lock().unwrap().clone()
    }

    /// Wait for the guest to finish (at most `timeout`, then it is killed).
    pub fn wait(mut self, timeout: Duration) -> Result<Outcome> {
        let deadline = Instant::now() + timeout;
        let mut child = self.child.take().expect("child present until wait/drop");
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break Some(s);
            }
            if Instant::now() >= deadline {
                stop(&mut child, &self.qemu_pid);
                break None;
            }
            thread::sleep(Duration::from_millis(100));
        };
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        let lines = self.lines();
        Ok(Outcome {
            name: self.boot.name.clone(),
            status,
            lines,
        })
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop(&mut child, &self.qemu_pid);
        }
    }
}

/// A QEMU Machine Protocol client (JSON objects, one per line, over the Unix socket of
/// [`Boot::qmp`]): commands and their answers, with the asynchronous events kept for
/// [`Qmp::wait_event`]. Every read has a deadline.
pub struct Qmp {
    name: String,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    events: Vec<serde_json::Value>,
}

/// How long a QMP command may take to answer.
const QMP_REPLY_TIMEOUT: Duration = Duration::from_secs(30);

impl Qmp {
    /// Read the greeting and leave capabilities negotiation mode (`qmp_capabilities`).
    fn negotiate(stream: UnixStream, name: &str) -> Result<Self> {
        let mut q = Qmp {
            name: name.to_string(),
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
            events: Vec::new(),
        };
        let greeting = q.read(Instant::now() + QMP_REPLY_TIMEOUT)?;
        if greeting.get("QMP").is_none() {
            bail!("{}: QMP greeting expected, got {greeting}", q.name);
        }
        q.execute("qmp_capabilities", serde_json::json!({}))?;
        Ok(q)
    }

    /// The next JSON object from QEMU, before `deadline`.
    fn read(&mut self, deadline: Instant) -> Result<serde_json::Value> {
        let mut line = String::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("{}: QMP: nothing from QEMU before the deadline", self.name);
            }
            self.reader.get_ref().set_read_timeout(Some(left))?;
            match self.reader.read_line(&mut line) {
                Ok(0) => bail!("{}: QMP: QEMU closed the socket", self.name),
                Ok(_) if line.ends_with('\n') => {
                    return serde_json::from_str(line.trim())
                        .with_context(|| format!("{}: QMP: not JSON: {line}", self.name));
                }
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e).context("reading QMP"),
            }
        }
    }

    /// Run `command` with `arguments`; its `return` value, or its `error` as an error. Events
    /// that arrive meanwhile are kept.
    pub fn execute(
        &mut self,
        command: &str,
        arguments: serde_json::Value,
    ) -> Result<serde_json::Value> {
        let msg = serde_json::json!({"execute": command, "arguments": arguments});
        eprintln!("[{}] QMP -> {msg}", self.name);
        self.writer
            .write_all(format!("{msg}\n").as_bytes())
            .with_context(|| format!("{}: QMP: sending {command}", self.name))?;
        let deadline = Instant::now() + QMP_REPLY_TIMEOUT;
        loop {
            let v = self
                .read(deadline)
                .with_context(|| format!("QMP {command}"))?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                bail!("{}: QMP {command} failed: {e}", self.name);
            }
            if v.get("event").is_some() {
                eprintln!("[{}] QMP <- {v}", self.name);
                self.events.push(v);
            }
        }
    }

    /// Wait for an event named `event` whose `data` satisfies `matches` (kept ones first).
    pub fn wait_event(
        &mut self,
        event: &str,
        matches: impl Fn(&serde_json::Value) -> bool,
        timeout: Duration,
    ) -> Result<serde_json::Value> {
        let hit = |v: &serde_json::Value| {
            v.get("event").and_then(|e| e.as_str()) == Some(event)
                && matches(v.get("data").unwrap_or(&serde_json::Value::Null))
        };
        if let Some(i) = self.events.iter().position(hit) {
            return Ok(self.events.remove(i));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let v = self
                .read(deadline)
                .with_context(|| format!("waiting {timeout:?} for QMP event {event}"))?;
            if hit(&v) {
                eprintln!("[{}] QMP <- {v}", self.name);
                return Ok(v);
            }
            if v.get("event").is_some() {
                eprintln!("[{}] QMP <- {v}", self.name);
                self.events.push(v);
            }
        }
    }

    /// `device_add` with these properties (`driver`, `id`, `bus` and the driver's own).
    pub fn device_add(&mut self, properties: serde_json::Value) -> Result<()> {
        self.execute("device_add", properties).map(drop)
    }

    /// `device_del` of device `id`, then wait for its `DEVICE_DELETED` event: a PCI device goes
    /// only once the guest has let it go (ACPI or native PCIe hot-plug), so this waits on the
    /// guest too. (QEMU 11.1.3 aborts while it frees a `vfio-user-pci` function with MSI-X;
    /// see docs/nvme-pcie.md.)
    pub fn device_del(&mut self, id: &str, timeout: Duration) -> Result<()> {
        self.execute("device_del", serde_json::json!({ "id": id }))?;
        self.wait_event(
            "DEVICE_DELETED",
            |d| d.get("device").and_then(|v| v.as_str()) == Some(id),
            timeout,
        )
        .map(drop)
    }
}

/// Stop the script (it kills QEMU by its pid file), then QEMU itself if it is still there.
fn stop(child: &mut Child, qemu_pid: &Mutex<Option<i32>>) {
    let pid = child.id() as libc::pid_t;
    // SAFETY: plain signal to a child process we spawned and have not reaped yet.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    if let Some(q) = *qemu_pid.lock().unwrap() {
        // The script normally has killed it already; QEMU also dies with its parent (pdeathsig).
        // SAFETY: signal to the QEMU pid the script reported; a stale pid gets ESRCH.
        unsafe { libc::kill(q, libc::SIGKILL) };
    }
}

/// The end of a boot: exit status and the whole log.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub name: String,
    /// None: killed by the harness after its deadline.
    pub status: Option<ExitStatus>,
    pub lines: Vec<String>,
}

impl Outcome {
    /// The scenario's result: 0 = passed, 124 = timeout, 125 = no result line (crash).
    pub fn code(&self) -> Option<i32> {
        self.status.and_then(|s| s.code())
    }

    pub fn success(&self) -> bool {
        self.code() == Some(0)
    }

    /// Panic with the log tail unless the scenario passed.
    #[track_caller]
    pub fn assert_success(&self) -> &Self {
        assert!(
            self.success(),
            "test-bed scenario {} failed (status {:?}); log tail:\n{}",
            self.name,
            self.code(),
            self.tail(60)
        );
        self
    }

    /// The last `n` log lines.
    pub fn tail(&self, n: usize) -> String {
        self.lines[self.lines.len().saturating_sub(n)..].join("\n")
    }

    /// Every `TB-FACT key=value` (the last value of a key wins).
    pub fn facts(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        for l in &self.lines {
            if let Some(i) = l.find("TB-FACT ") {
                if let Some((k, v)) = l[i + 8..].split_once('=') {
                    m.insert(k.trim().to_string(), v.trim_end().to_string());
                }
            }
        }
        m
    }

    /// One fact; panics (with the log) if the guest did not report it.
    #[track_caller]
    pub fn fact(&self, key: &str) -> String {
        match self.facts().remove(key) {
            Some(v) => v,
            None => panic!(
                "{}: no TB-FACT {key}; log tail:\n{}",
                self.name,
                self.tail(60)
            ),
        }
    }

    /// True if some log line contains `needle`.
    pub fn contains(&self, needle: &str) -> bool {
        self.lines.iter().any(|l| l.contains(needle))
    }
}

/// QEMU arguments that attach vhost-user-blk sockets as virtio-blk-pci devices (vda, vdb, ... in
/// this order), each `(socket, num_queues)`; the guest's memory becomes a shared memfd so the
/// backend can map it (`mem` must equal the guest's memory size, default 1G). The chardevs
/// reconnect when the backend goes away and comes back.
pub fn vhost_user_blk_args(devices: &[(&Path, u32)], mem: &str) -> Vec<String> {
    let mut args = vec![
        "-object".into(),
        format!("memory-backend-memfd,id=mem,size={mem},share=on"),
        "-numa".into(),
        "node,memdev=mem".into(),
    ];
    let reconnect = chardev_reconnect_option();
    for (i, (sock, queues)) in devices.iter().enumerate() {
        args.push("-chardev".into());
        args.push(format!(
            "socket,id=vub{i},path={},{reconnect}",
            sock.display()
        ));
        args.push("-device".into());
        args.push(format!(
            "vhost-user-blk-pci,chardev=vub{i},num-queues={queues}"
        ));
    }
    args
}

/// The socket chardev's reconnect option: `reconnect-ms` since QEMU 9.2 (QEMU 10 dropped the
/// older `reconnect`, in seconds, that Debian 12's QEMU 7.2 has).
pub fn chardev_reconnect_option() -> &'static str {
    let qemu = std::env::var("NACRE_TESTBED_QEMU").unwrap_or_else(|_| "qemu-system-x86_64".into());
    let out = Command::new(qemu).arg("--version").output();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    // "QEMU emulator version 10.0.2 (...)"
    let version: Vec<u32> = text
        .split_whitespace()
        .nth(3)
        .unwrap_or("0.0")
        .split('.')
        .map(|p| p.parse().unwrap_or(0))
        .collect();
    let (major, minor) = (version[0], version.get(1).copied().unwrap_or(0));
    if (major, minor) >= (9, 2) {
        "reconnect-ms=500"
    } else {
        "reconnect=1"
    }
}

/// QEMU arguments for user networking that reaches nothing but `guest_addr:guest_port` ->
/// `127.0.0.1:host_port` on the host, one `socat` per TCP connection (NVMe/TCP opens one per queue).
pub fn guestfwd_args(guest_addr: &str, guest_port: u16, host_port: u16) -> Vec<String> {
    vec![
        "-netdev".into(),
        format!(
            "user,id=n0,restrict=on,ipv6=off,guestfwd=tcp:{guest_addr}:{guest_port}-cmd:socat - TCP:127.0.0.1:{host_port}"
        ),
        "-device".into(),
        // no option ROM: nothing boots from the network, and QEMU need not find efi-virtio.rom
        "virtio-net-pci,netdev=n0,romfile=".into(),
    ]
}

/// QEMU arguments that expose the guest's `guest_port` on the host's `127.0.0.1:host_port`.
pub fn hostfwd_args(host_port: u16, guest_port: u16) -> Vec<String> {
    vec![
        "-netdev".into(),
        format!("user,id=n0,restrict=on,ipv6=off,hostfwd=tcp:127.0.0.1:{host_port}-:{guest_port}"),
        "-device".into(),
        // no option ROM: nothing boots from the network, and QEMU need not find efi-virtio.rom
        "virtio-net-pci,netdev=n0,romfile=".into(),
    ]
}

/// A host-side process stopped (SIGTERM, then SIGKILL) when dropped.
pub struct HostProcess {
    pub name: String,
    child: Child,
}

impl HostProcess {
    /// Spawn `cmd` with its output appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<Self> {
        let f = std::fs::File::create(log)?;
        cmd.stdin(Stdio::null()).stdout(f.try_clone()?).stderr(f);
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        Ok(HostProcess {
            name: name.to_string(),
            child,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails if the process has exited.
    pub fn check_running(&mut self) -> Result<()> {
        if let Some(s) = self.child.try_wait()? {
            bail!("{} exited: {s}", self.name);
        }
        Ok(())
    }

    /// Wait until `path` exists (a socket the process creates), failing if it exits first.
    pub fn wait_for_path(&mut self, path: &Path, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !path.exists() {
            self.check_running()?;
            if Instant::now() >= deadline {
                bail!(
                    "{} did not create {} within {timeout:?}",
                    self.name,
                    path.display()
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

impl Drop for HostProcess {
    fn drop(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: signal to our own unreaped child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every thread's stack of process `pid`, from `gdb` (when installed; bounded to 60 s), for the
/// message of a test that found a guest or a daemon stuck: where QEMU waits (a vhost-user reply,
/// the BQL, a vCPU) and where nacred's threads are tell a hang in our code from one in the peer.
pub fn thread_stacks(pid: u32) -> String {
    let out = Command::new("timeout")
        .args(["60", "gdb", "-p", &pid.to_string(), "-batch", "-nx"])
        .args(["-ex", "set pagination off", "-ex", "thread apply all bt 30"])
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => {
            let text = String::from_utf8_lossy(&o.stdout);
            // gdb's own chatter (symbol loading) precedes the first "Thread" line
            match text.find("\nThread ") {
                Some(i) => text[i + 1..].to_string(),
                None => text.into_owned(),
            }
        }
        Ok(o) => format!(
            "(gdb on pid {pid} failed: {}: {})",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => format!("(no stacks for pid {pid}: {e})"),
    }
}

/// sha256 of `len` bytes of `path` at `offset`, with the host's `sha256sum` (an independent check).
pub fn sha256_of_range(path: &Path, offset: u64, len: u64) -> Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    f.seek(SeekFrom::Start(offset))?;
    let mut buf = vec![0u8; len as usize];
    f.read_exact(&mut buf)?;
    sha256(&buf)
}

/// sha256 of `data` (hex), with the host's `sha256sum`.
pub fn sha256(data: &[u8]) -> Result<String> {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let data = data.to_vec();
    let writer = thread::spawn(move || stdin.write_all(&data));
    let out = child.wait_with_output()?;
    writer.join().expect("writer thread")?;
    let s = String::from_utf8_lossy(&out.stdout);
    Ok(s.split_whitespace().next().unwrap_or_default().to_string())
}

/// `scripts/testbed.d/xts-oracle.py`: the independent AES-XTS (dm-crypt plain64) oracle.
pub fn xts_oracle() -> PathBuf {
    repo_root().join("scripts/testbed.d/xts-oracle.py")
}

/// Encrypt (or decrypt) `input` into `output` with the XTS oracle: `sector_size`-byte data units
/// numbered from `first_sector`, tweak = the unit number in `sector_size` units (cryptsetup's
/// `--iv-large-sectors`).
pub fn xts_oracle_run(
    op: &str,
    key: &Path,
    input: &Path,
    output: &Path,
    sector_size: u32,
    first_sector: u64,
) -> Result<()> {
    let out = Command::new("python3")
        .arg(xts_oracle())
        .arg(op)
        .arg(key)
        .arg(input)
        .arg(output)
        .arg("--sector-size")
        .arg(sector_size.to_string())
        .arg("--iv-sector-size")
        .arg(sector_size.to_string())
        .arg("--first-sector")
        .arg(first_sector.to_string())
        .output()
        .context("running python3 xts-oracle.py")?;
    if !out.status.success() {
        bail!(
            "xts-oracle.py {op} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// `n` random bytes from the kernel.
pub fn random_bytes(n: usize) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf)
}
