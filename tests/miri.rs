//! Miri over the data path's pure-memory unsafe code (scripts/miri; docs/safety.md).
//!
//! Runs `scripts/miri`, which interprets nacre-dpu's unit tests of the covered modules
//! (segments, announced DMA regions, the virtqueue rings, the NVMe
//! doorbell page and completion queue, PRP walks) under Miri, and fails on any undefined
//! behaviour Miri reports, on a failing test, and on a covered module none of whose tests
//! ran. It fails when Miri is missing (scripts/setup --test installs it where rustup is);
//! `NACRE_SKIP_MIRI=1` leaves it out as a counted skip.

use std::path::Path;
use std::process::Command;

/// The documented switch that leaves the Miri run out (counted as a skip).
const SKIP_ENV: &str = "NACRE_SKIP_MIRI";

#[test]
fn covered_modules_pass_under_miri() {
    if nacre_tests::skip::switch_on(SKIP_ENV) {
        nacre_tests::skip::skip(
            "covered_modules_pass_under_miri",
            &format!("{SKIP_ENV} is set"),
        );
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/miri");
    let list = Command::new(&script).arg("--list").output().unwrap();
    assert!(list.status.success(), "scripts/miri --list failed");
    let covered: Vec<String> = String::from_utf8(list.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    assert!(!covered.is_empty(), "scripts/miri covers nothing");
    let out = Command::new(&script)
        .env_remove("RUSTFLAGS")
        .output()
        .expect("run scripts/miri");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail = |s: &str| -> String {
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    };
    assert!(
        out.status.success(),
        "scripts/miri failed ({}):\n{}\n{}",
        out.status,
        tail(&stdout),
        tail(&stderr)
    );
    // Every covered module ran at least one test, and it passed: a filter that matches
    // nothing (a module renamed) must not pass silently.
    for m in &covered {
        let ran = stdout
            .lines()
            .filter(|l| l.starts_with("test ") && l.contains(m.as_str()) && l.ends_with(" ok"))
            .count();
        assert!(ran > 0, "no test of {m} ran under Miri:\n{}", tail(&stdout));
    }
}
