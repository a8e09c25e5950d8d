//! `nacre-host image flash` against a simulated rshim directory: `boot` is a FIFO drained by the
//! test, which checks every byte of the stream and that every read it gets is a whole number of
//! 8-byte FIFO words; `misc` is a file the test writes the DPU's log lines into. Each verdict
//! (success, failure line, silence, a stale success line from an earlier boot) is checked with
//! its exit status.

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nacre_tests::daemon::bin;

struct Rshim {
    dir: tempfile::TempDir,
    boot: PathBuf,
    misc: PathBuf,
}

fn rshim(misc_initial: &str) -> Rshim {
    let dir = tempfile::tempdir().unwrap();
    let boot = dir.path().join("boot");
    let c = CString::new(boot.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let misc = dir.path().join("misc");
    std::fs::write(&misc, misc_initial).unwrap();
    Rshim { dir, boot, misc }
}

/// A BFB built by nacre-host, a bf.cfg whose length is not a multiple of 8.
fn bundle(dir: &Path) -> (PathBuf, PathBuf) {
    let k = dir.join("k");
    let i = dir.join("i");
    std::fs::write(
        &k,
        (0..700_003u32)
            .map(|x| (x.wrapping_mul(2654435761) >> 11) as u8)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    std::fs::write(
        &i,
        (0..123_457u32).map(|x| (x % 241) as u8).collect::<Vec<_>>(),
    )
    .unwrap();
    let out = dir.join("x.bfb");
    let o = Command::new(bin("nacre-host"))
        .args(["image", "build", "-o"])
        .args([
            &out,
            &PathBuf::from("--kernel"),
            &k,
            &PathBuf::from("--initramfs"),
            &i,
        ])
        .args(["--boot-args", "console=ttyAMA0"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cfg = dir.join("bf.cfg");
    std::fs::write(&cfg, "ENABLE_SFC_HBN=yes\nNUM_VFS=4\n").unwrap(); // 29 bytes
    (out, cfg)
}

/// Drains the boot FIFO: every byte, and the size of every read.
fn drain(boot: &Path) -> JoinHandle<(Vec<u8>, Vec<usize>)> {
    let boot = boot.to_path_buf();
    std::thread::spawn(move || {
        let mut f = std::fs::File::open(&boot).unwrap();
        let mut got = Vec::new();
        let mut reads = Vec::new();
        let mut buf = vec![0u8; 24 * 1024];
        loop {
            let n = f.read(&mut buf).unwrap();
            if n == 0 {
                return (got, reads);
            }
            got.extend_from_slice(&buf[..n]);
            reads.push(n);
            if reads.len() % 16 == 0 {
                // let the pipe fill so the writer blocks now and then, as on a real rshim
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    })
}

fn flash(r: &Rshim, bfb: &Path, extra: &[&str]) -> Child {
    Command::new(bin("nacre-host"))
        .args(["image", "flash", "--rshim"])
        .arg(r.dir.path())
        .arg(bfb)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn append(misc: &Path, line: &str) {
    let mut f = std::fs::OpenOptions::new().append(true).open(misc).unwrap();
    writeln!(f, "{line}").unwrap();
}

/// Waits for nacre-host (at most 60 s); returns (status, stdout, stderr).
fn finish(mut c: Child) -> (Option<i32>, String, String) {
    let t = Instant::now();
    while c.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(60) {
            c.kill().unwrap();
            panic!("nacre-host image flash did not finish in 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = c.wait_with_output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Pushes `bfb` (+ `cfg`) through the simulated rshim and checks what arrived; then feeds
/// `log` to misc and returns the outcome.
fn run(misc_initial: &str, extra: &[&str], log: &[&str]) -> (Rshim, Option<i32>, String, String) {
    let r = rshim(misc_initial);
    let work = tempfile::tempdir().unwrap();
    let (bfb, cfg) = bundle(work.path());
    let drainer = drain(&r.boot);
    let mut args = vec!["--config", cfg.to_str().unwrap()];
    args.extend(extra);
    let child = flash(&r, &bfb, &args);
    let (got, reads) = drainer.join().unwrap();

    let mut want = std::fs::read(&bfb).unwrap();
    want.extend(std::fs::read(&cfg).unwrap());
    assert_ne!(
        want.len() % 8,
        0,
        "the test needs a stream that needs padding"
    );
    want.resize(want.len().div_ceil(8) * 8, 0);
    assert_eq!(got.len(), want.len());
    assert!(
        got == want,
        "the stream differs from BFB + bf.cfg + zero padding"
    );
    assert!(reads.len() > 10, "{} reads", reads.len());
    for (k, n) in reads.iter().enumerate() {
        assert_eq!(n % 8, 0, "read {k} got {n} bytes: not whole 8-byte words");
    }
    let misc = std::fs::read_to_string(&r.misc).unwrap();
    assert!(misc.contains("DISPLAY_LEVEL 2\n"), "misc: {misc}");

    for l in log {
        std::thread::sleep(Duration::from_millis(300));
        append(&r.misc, l);
    }
    let (code, out, err) = finish(child);
    (r, code, out, err)
}

#[test]
fn success_line_ends_the_flash_with_status_0() {
    let (_r, code, out, err) = run(
        "",
        &["--timeout", "30"],
        &[
            " INFO[BL2]: start",
            " INFO[BL31]: start",
            " INFO[UEFI]: exit Boot Service",
            " INFO[MISC]: Linux up",
        ],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    let last = out.lines().last().unwrap();
    assert!(
        last.starts_with("nacre-host: flashed") && last.contains("Linux up"),
        "{out}"
    );
    // the log was echoed as it came
    assert!(out.contains("INFO[BL31]: start"), "{out}");
}

#[test]
fn failure_line_is_exit_1_with_the_line() {
    let (_r, code, out, err) = run(
        "",
        &["--timeout", "30"],
        &[" INFO[BL2]: start", " ERR[BL2]: DDR training failed"],
    );
    assert_eq!(code, Some(1), "{out}{err}");
    let last = err.lines().last().unwrap();
    assert!(
        last.starts_with("nacre-host: flash of") && last.contains("DDR training failed"),
        "{err}"
    );
    assert!(!out.contains("flashed"), "{out}");
}

#[test]
fn silence_past_the_timeout_is_exit_3() {
    let t = Instant::now();
    let (_r, code, out, err) = run("", &["--timeout", "2"], &[" INFO[BL2]: start"]);
    assert_eq!(code, Some(3), "{out}{err}");
    assert!(
        err.lines()
            .last()
            .unwrap()
            .contains("no word from the DPU for 2 s (last line: 'INFO[BL2]: start')"),
        "{err}"
    );
    assert!(t.elapsed() >= Duration::from_secs(2));
}

#[test]
fn a_success_line_from_an_earlier_boot_is_not_this_flash() {
    let old = "DISPLAY_LEVEL 0\n INFO[MISC]: DPU is ready\n";
    let (_r, code, out, err) = run(old, &["--timeout", "2"], &[]);
    assert_eq!(
        code,
        Some(3),
        "the stale 'DPU is ready' was taken for success: {out}{err}"
    );
}

#[test]
fn reset_is_written_before_the_display_level() {
    let (r, code, out, err) = run(
        "",
        &["--reset", "--timeout", "30"],
        &[" INFO[MISC]: Rebooting..."],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    let misc = std::fs::read_to_string(&r.misc).unwrap();
    let (a, b) = (
        misc.find("SW_RESET 1\n").unwrap(),
        misc.find("DISPLAY_LEVEL 2\n").unwrap(),
    );
    assert!(a < b, "{misc}");
}

#[test]
fn a_corrupt_bfb_is_refused_before_anything_is_written() {
    let work = tempfile::tempdir().unwrap();
    let (bfb, _) = bundle(work.path());
    let mut b = std::fs::read(&bfb).unwrap();
    let n = b.len();
    b[n - 3] ^= 0xff; // inside the initramfs padding-covered data: CRC
    std::fs::write(&bfb, &b).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("boot"), "").unwrap();
    std::fs::write(dir.path().join("misc"), "").unwrap();
    let o = Command::new(bin("nacre-host"))
        .args(["image", "flash", "--rshim"])
        .arg(dir.path())
        .arg(&bfb)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(
        e.contains("refusing to flash") && e.contains("CRC mismatch"),
        "{e}"
    );
    assert_eq!(std::fs::read(dir.path().join("boot")).unwrap().len(), 0);
    assert_eq!(std::fs::read(dir.path().join("misc")).unwrap().len(), 0);

    let o = Command::new(bin("nacre-host"))
        .args(["image", "flash", "--rshim", "/nonexistent/rshim9"])
        .arg(work.path().join("x.bfb"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
}
