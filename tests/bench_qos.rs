//! `scripts/bench-qos` runs end to end: both daemons (QoS and metrics on, and `--no-qos`) serve
//! the same libblkio client, and every workload gets a row whose ratio columns are the
//! quotients of the figures beside them. The figures themselves are not checked (no timing
//! assertions); that the script still works and reports every point, is.

use std::process::Command;

use nacre_tests::daemon::bin;
use nacre_tests::testbed::repo_root;

#[test]
fn bench_qos_reports_on_and_off_with_their_ratios() {
    let bin_dir = bin("nacred").parent().unwrap().to_path_buf();
    bin("blkio-bench");
    let out = Command::new(repo_root().join("scripts/bench-qos"))
        .env("NO_BUILD", "1")
        .env("BIN", &bin_dir)
        .env("SECS", "0.1")
        .env("WARMUP", "0.02")
        .env("REPEAT", "1")
        .env("SIZE", "16777216")
        .output()
        .expect("run scripts/bench-qos");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench-qos failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("/metrics on 127.0.0.1:"), "{stdout}");
    for w in ["randread 4096 32 poll", "randread 4096 32 irq"] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(w))
            .unwrap_or_else(|| panic!("no {w} row in:\n{stdout}"));
        // workload (4 words) | IOPS on, IOPS off, on/off | per core on, off, on/off | p99
        let f: Vec<&str> = row.split_whitespace().collect();
        let num = |i: usize| -> f64 {
            f[i].parse()
                .unwrap_or_else(|_| panic!("column {i} of {row:?}"))
        };
        let (on, off, ratio) = (num(4), num(5), num(6));
        assert!(on > 0.0 && off > 0.0, "{row}");
        assert!(
            (ratio - on / off).abs() < 0.01,
            "IOPS ratio is not on/off: {row}"
        );
        let (con, coff, cratio) = (num(8), num(9), num(10));
        assert!(con > 0.0 && coff > 0.0, "{row}");
        assert!(
            (cratio - con / coff).abs() < 0.01,
            "per-core ratio is not on/off: {row}"
        );
    }
}
