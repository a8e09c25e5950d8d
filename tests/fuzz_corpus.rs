//! The cargo-fuzz targets (fuzz/) in the test suite.
//!
//! * `corpus_replays_*` (always, stable Rust): every committed corpus file of a target
//!   (fuzz/corpus/<target>/, crashers found earlier included) goes through the same entry
//!   point of `nacre_dpu::fuzzing` the fuzzer calls; any panic — on any thread, caught or
//!   not — fails the test with the file's name.
//! * `short_fuzz_runs`: a few seconds of coverage-guided fuzzing per target, starting from the
//!   committed corpus, with cargo-fuzz on the suite's own toolchain (no nightly). It fails
//!   when cargo-fuzz is missing; `NACRE_SKIP_FUZZ=1` leaves it out as a counted skip.
//!   NACRE_FUZZ_SECONDS=N changes the time per target.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use nacre_tests::fuzz::{count_panics, env_u64, panics};

const TARGETS: [&str; 7] = [
    "virtqueue",
    "nvmf_target",
    "nvme_commands",
    "nvmf_initiator",
    "json_rpc",
    "nvme_auth",
    "vfio_user",
];

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The panic counter is process-wide: one replay at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long one input may take (the slowest take milliseconds; a hang is a finding).
const BOUND: Duration = Duration::from_secs(30);

/// Run `run(data)` on its own thread: `Some(true)` when it returned, `Some(false)` when it
/// panicked, `None` when it was still running after [`BOUND`] (left behind).
fn bounded(run: fn(&[u8]), data: Vec<u8>) -> Option<bool> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(|| run(&data));
        let _ = tx.send(r.is_ok());
    });
    rx.recv_timeout(BOUND).ok()
}

fn replay(target: &str, run: fn(&[u8])) {
    let _turn = serial();
    count_panics();
    let dir = fuzz_dir().join("corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 10,
        "{}: only {} corpus files",
        dir.display(),
        files.len()
    );
    for f in &files {
        let data = std::fs::read(f).unwrap();
        let before = panics();
        let finished = bounded(run, data);
        assert!(
            finished.is_some(),
            "{target}: {} did not finish within {BOUND:?}",
            f.display()
        );
        assert!(
            finished == Some(true) && panics() == before,
            "{target}: {} panicked (rerun: cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -O -a -s none {target} {})",
            f.display(),
            f.display()
        );
    }
    println!("{target}: {} corpus files replayed", files.len());
}

#[test]
fn corpus_replays_virtqueue() {
    replay("virtqueue", nacre_dpu::fuzzing::virtqueue);
}

#[test]
fn corpus_replays_nvmf_target() {
    replay("nvmf_target", nacre_dpu::fuzzing::nvmf_target);
}

#[test]
fn corpus_replays_nvme_commands() {
    replay("nvme_commands", nacre_dpu::fuzzing::nvme_commands);
}

#[test]
fn corpus_replays_nvmf_initiator() {
    replay("nvmf_initiator", nacre_dpu::fuzzing::nvmf_initiator);
}

#[test]
fn corpus_replays_json_rpc() {
    replay("json_rpc", nacre_dpu::fuzzing::json_rpc);
}

#[test]
fn corpus_replays_nvme_auth() {
    replay("nvme_auth", nacre_dpu::fuzzing::nvme_auth);
}

#[test]
fn corpus_replays_vfio_user() {
    replay("vfio_user", nacre_dpu::fuzzing::vfio_user);
}

/// The vfio-user harness reaches the controller's queues, not just the message parser: the
/// seed `well-formed-identify` (a driver's start: bus mastering, the admin queue registers,
/// CC.EN, an Identify Controller on the admin queue, its doorbell) leaves a successful
/// completion in the admin completion queue (guest address 0x2000) and the controller's
/// identify data, model "nacre", at 0x4000; `well-formed-identify-msi` (the same with byte
/// 0's top bit set) does the same on a function with MSI.
#[test]
fn vfio_user_harness_runs_an_identify() {
    for seed in ["well-formed-identify", "well-formed-identify-msi"] {
        harness_runs_an_identify(seed);
    }
}

fn harness_runs_an_identify(seed: &str) {
    let _turn = serial();
    let seed = fuzz_dir().join("corpus/vfio_user").join(seed);
    let input = std::fs::read(&seed).unwrap_or_else(|e| panic!("{}: {e}", seed.display()));
    let mem = nacre_dpu::fuzzing::vfio_user_session(&input);
    assert!(mem.len() >= 0x5000, "guest memory of {} bytes", mem.len());
    let cqe = &mem[0x2000..0x2010];
    let cid = u16::from_le_bytes([cqe[12], cqe[13]]);
    let status = u16::from_le_bytes([cqe[14], cqe[15]]);
    assert_eq!(
        (cid, status & 1),
        (1, 1),
        "no completion of command 1: {cqe:02x?}"
    );
    assert_eq!(status >> 1, 0, "Identify failed: status {:#x}", status >> 1);
    let model = String::from_utf8_lossy(&mem[0x4000 + 24..0x4000 + 64]);
    assert!(model.starts_with("nacre"), "model number {model:?}");
}

/// Found by the virtqueue target: a driver that set avail->idx more than the queue size
/// ahead of the chains it had made available had the worker thread spin on the ring
/// forever (one core at 100 %, no other chain served). The queue now serves nothing more
/// until the next kick.
#[test]
fn virtqueue_avail_index_beyond_the_ring_does_not_spin_the_worker() {
    let _turn = serial();
    count_panics();
    let before = panics();
    for avail_idx in [17u8, 200] {
        let input = nacre_dpu::fuzzing::seed::virtqueue(0, &[], &[], &[]);
        let mut input = input;
        input[1] = avail_idx;
        assert_eq!(
            bounded(nacre_dpu::fuzzing::virtqueue, input),
            Some(true),
            "avail->idx {avail_idx} on a ring of {}: the worker did not return",
            nacre_dpu::fuzzing::VQ_SIZE
        );
    }
    assert_eq!(panics(), before);
}

/// The documented switch that leaves the short fuzz runs out (counted as a skip).
const SKIP_ENV: &str = "NACRE_SKIP_FUZZ";

/// `cargo fuzz` on the toolchain the suite builds with (Debian's rustc on a fresh machine,
/// rustup's stable elsewhere): libFuzzer's instrumentation without a sanitizer (`-s none`)
/// needs no nightly, and `RUSTC_BOOTSTRAP=1` lets a stable rustc take the few unstable
/// options cargo-fuzz passes.
fn cargo_fuzz() -> Command {
    let mut c = Command::new("cargo");
    c.env("RUSTC_BOOTSTRAP", "1").arg("fuzz");
    // The package variables cargo set for this test process are part of some crates'
    // fingerprints (ring's CARGO_MANIFEST_DIR, CARGO_PKG_NAME, OUT_DIR): passed on, they would
    // rebuild the fuzz workspace scripts/test built beforehand.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("CARGO_PKG_")
            || k.starts_with("CARGO_MANIFEST_")
            || [
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "OUT_DIR",
            ]
            .contains(&k.as_ref())
        {
            c.env_remove(k.as_ref());
        }
    }
    c
}

#[test]
fn short_fuzz_runs() {
    if nacre_tests::skip::switch_on(SKIP_ENV) {
        nacre_tests::skip::skip("short_fuzz_runs", &format!("{SKIP_ENV} is set"));
        return;
    }
    let version = cargo_fuzz().arg("--version").output();
    assert!(
        version.as_ref().is_ok_and(|o| o.status.success()),
        "cargo-fuzz is missing (scripts/setup --test installs it: cargo install cargo-fuzz): {:?}",
        version.map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
    );
    let secs = env_u64("NACRE_FUZZ_SECONDS", 5);
    let dir = fuzz_dir();
    for t in TARGETS {
        // A scratch copy of the corpus: what the fuzzer adds stays out of the repository.
        let scratch = tempfile::tempdir().unwrap();
        let corpus = scratch.path().join(t);
        std::fs::create_dir_all(&corpus).unwrap();
        for e in std::fs::read_dir(dir.join("corpus").join(t)).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, corpus.join(p.file_name().unwrap())).unwrap();
        }
        let artifacts = scratch.path().join("artifacts");
        std::fs::create_dir_all(&artifacts).unwrap();
        let out = cargo_fuzz()
            .current_dir(&dir)
            .args(["run", "-O", "-a", "-s", "none", t])
            .arg(&corpus)
            .arg("--")
            .arg(format!("-max_total_time={secs}"))
            .arg("-runs=2000000")
            .arg("-max_len=8192")
            .arg("-timeout=30")
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            .output()
            .expect("cargo fuzz run");
        let log = String::from_utf8_lossy(&out.stderr);
        let tail: String = log
            .lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            out.status.success(),
            "cargo fuzz run {t} failed (crash inputs in {}):\n{tail}",
            artifacts.display()
        );
        let done = log
            .lines()
            .rev()
            .find(|l| l.starts_with("Done ") || l.contains("DONE"))
            .unwrap_or("(no summary)");
        println!("{t}: {done}");
        assert!(
            log.contains("Done "),
            "cargo fuzz run {t}: no libFuzzer summary:\n{tail}"
        );
    }
}
