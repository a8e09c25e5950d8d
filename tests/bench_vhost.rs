//! `scripts/bench-vhost` runs end to end against the real qemu-storage-daemon: every backend
//! (null, RAM, a file it writes itself) gets a row per workload with IOPS from both servers and
//! a ratio that is their quotient. The figures are not checked (no timing assertions); that the
//! script still works and reports every point, is.

use std::process::Command;

use nacre_tests::daemon::bin;
use nacre_tests::testbed::repo_root;

#[test]
fn bench_vhost_reports_every_backend_against_qemu_storage_daemon() {
    let bin_dir = bin("nacred").parent().unwrap().to_path_buf();
    bin("blkio-bench");
    let out = Command::new(repo_root().join("scripts/bench-vhost"))
        .arg("--quick")
        .env("NO_BUILD", "1")
        .env("BIN", &bin_dir)
        .env("SECS", "0.1")
        .env("WARMUP", "0.02")
        .env("REPEAT", "1")
        .env("SIZE", "16777216")
        .output()
        .expect("run scripts/bench-vhost");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench-vhost failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for section in [
        "== nacred null volume",
        "== nacred ram volume",
        "== nacred file volume",
    ] {
        let body: Vec<&str> = stdout
            .split(section)
            .nth(1)
            .unwrap_or_else(|| panic!("no section {section:?} in:\n{stdout}"))
            .lines()
            .skip(2) // the rest of the heading line, the column names
            .take_while(|l| !l.trim().is_empty())
            .collect();
        for w in [
            "randread 4096 1",
            "randread 4096 32",
            "randwrite 4096 32",
            "read 131072 16",
        ] {
            let row = body
                .iter()
                .find(|l| l.starts_with(w))
                .unwrap_or_else(|| panic!("{section}: no {w} row in:\n{stdout}"));
            // workload(4 words) | IOPS n, IOPS q, n/q | ...
            let f: Vec<&str> = row.split_whitespace().collect();
            let n: f64 = f[4].parse().expect("nacred IOPS");
            let q: f64 = f[5].parse().expect("qsd IOPS");
            let ratio: f64 = f[6].parse().expect("ratio");
            assert!(n > 0.0 && q > 0.0, "{row}");
            assert!(
                (ratio - n / q).abs() < 0.01,
                "ratio column is not nacred/qsd: {row}"
            );
        }
    }
}
