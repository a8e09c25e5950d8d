//! `scripts/bench-crypt` runs end to end: it drives the real nacred with the nacre CLI, builds
//! a plain and an encrypted volume on each backend, and prints a ratio for every point. The
//! figures themselves are not checked (no timing assertions); that the script still works,
//! measures an encrypted volume against a plain one, and reports every point, is.

use std::process::Command;

use nacre_tests::daemon::bin;
use nacre_tests::testbed::repo_root;

#[test]
fn bench_crypt_compares_an_encrypted_and_a_plain_volume_on_each_backend() {
    let bin_dir = bin("nacred").parent().unwrap().to_path_buf();
    bin("blkio-bench");
    let out = Command::new(repo_root().join("scripts/bench-crypt"))
        .env("NO_BUILD", "1")
        .env("BIN", &bin_dir)
        .env("SECS", "0.2")
        .env("WARMUP", "0.05")
        .env("REPEAT", "1")
        .env("SIZE", "16777216")
        .env("BACKENDS", "null shm remote")
        .env("MODES", "irq")
        .output()
        .expect("run scripts/bench-crypt");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench-crypt failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for backend in ["null", "shm", "remote"] {
        // The volume table nacred printed for this backend: one plain, one encrypted volume.
        let vols: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with(&format!("# {backend}: ")))
            .collect();
        let enc = vols.iter().find(|l| l.contains(" enc ")).expect("enc row");
        let plain = vols
            .iter()
            .find(|l| l.contains(" plain "))
            .expect("plain row");
        assert!(
            enc.contains("yes"),
            "{backend}: enc is not encrypted: {enc}"
        );
        assert!(
            !plain.contains("yes"),
            "{backend}: plain is encrypted: {plain}"
        );
        for rw in ["randread", "randwrite"] {
            let row = stdout
                .lines()
                .find(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    f.len() > 3 && f[0] == backend && f[1] == "irq" && f[2] == rw
                })
                .unwrap_or_else(|| panic!("no {backend} {rw} row in:\n{stdout}"));
            // volume mode workload | IOPS plain IOPS enc ratio | ...
            let f: Vec<&str> = row.split_whitespace().collect();
            let plain: f64 = f[4].parse().expect("plain IOPS");
            let enc: f64 = f[5].parse().expect("encrypted IOPS");
            let ratio: f64 = f[6].parse().expect("ratio");
            assert!(plain > 0.0 && enc > 0.0, "{row}");
            assert!(
                (ratio - enc / plain).abs() < 0.01,
                "ratio column is not enc/plain: {row}"
            );
        }
    }
}
