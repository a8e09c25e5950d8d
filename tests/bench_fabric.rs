//! `fabric-bench` (`scripts/bench-fabric`) runs the whole DPU path and splits its CPU time by
//! the machine each thread stands for: host (the libblkio client), DPU (vhost-user-blk
//! worker, XTS, initiator) and shelf (the NVMe/TCP target). The figures themselves are not
//! checked (no timing assertions); that the benchmark runs both paths and puts each thread
//! where it belongs, is.

use std::process::Command;

use nacre_tests::daemon::bin;

/// Run fabric-bench with `args`; its standard output, once it has succeeded.
fn fabric_bench(args: &[&str]) -> String {
    let out = Command::new(bin("fabric-bench"))
        .args(args)
        .output()
        .expect("run fabric-bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "fabric-bench {args:?} failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The cores column after the `|` of a volume's row: `[host, dpu, shelf]`.
fn roles(stdout: &str, volume: &str) -> [f64; 3] {
    let row = stdout
        .lines()
        .find(|l| l.split_whitespace().next() == Some(volume))
        .unwrap_or_else(|| panic!("no {volume} row in:\n{stdout}"));
    let (left, right) = row.split_once('|').expect("a | between the two halves");
    let iops: f64 = left.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(iops > 0.0, "{volume}: no I/O done: {row}");
    let f: Vec<f64> = right
        .split_whitespace()
        .take(3)
        .map(|x| {
            x.parse()
                .unwrap_or_else(|_| panic!("not a number in {row}"))
        })
        .collect();
    [f[0], f[1], f[2]]
}

/// The `(thread, role)` lines `--threads` printed under a volume's row.
fn threads<'a>(stdout: &'a str, volume: &str) -> Vec<(&'a str, &'a str)> {
    stdout
        .lines()
        .skip_while(|l| l.split_whitespace().next() != Some(volume))
        .skip(1)
        .take_while(|l| l.starts_with("    "))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0], f[1])
        })
        .collect()
}

#[test]
fn fabric_bench_splits_cpu_into_host_dpu_and_shelf() {
    let stdout = fabric_bench(&[
        "--seconds",
        "0.3",
        "--only",
        "ram,nvme-tcp+xts",
        "--threads",
    ]);

    // The RAM path has no shelf: its volume is in the DPU's own memory (the target only
    // answers the initiator's keep-alives meanwhile).
    let [_, _, shelf] = roles(&stdout, "ram");
    assert!(shelf < 0.02, "ram: the shelf was busy\n{stdout}");
    let ram = threads(&stdout, "ram");
    for role in ["host", "dpu"] {
        assert!(
            ram.iter().any(|(_, r)| *r == role),
            "ram: no {role} thread ran\n{stdout}"
        );
    }

    // Through NVMe/TCP all three machines work. The listing has every thread that ran at
    // all (the table's two decimals can round a busy machine's short run to 0.00).
    roles(&stdout, "nvme-tcp+xts");
    let t = threads(&stdout, "nvme-tcp+xts");
    let role_of = |prefix: &str| {
        t.iter()
            .find(|(name, _)| name.starts_with(prefix))
            .map(|(_, role)| *role)
            .unwrap_or_else(|| panic!("no {prefix}* thread under nvme-tcp+xts:\n{stdout}"))
    };
    assert_eq!(role_of("nvmf-reactor-"), "shelf", "{stdout}");
    assert_eq!(role_of("fabric-tcp-"), "dpu", "{stdout}");
    assert_eq!(role_of("fabric-bench"), "host", "{stdout}");
}

/// Writes go the same way: in-capsule at 4 KiB, through R2T/H2CData at 128 KiB.
#[test]
fn fabric_bench_writes_through_the_fabric() {
    for bs in ["4096", "131072"] {
        let stdout = fabric_bench(&[
            "--seconds",
            "0.2",
            "--write",
            "--bs",
            bs,
            "--qd",
            "4",
            "--only",
            "ram,nvme-tcp,nvme-tcp+xts",
        ]);
        assert!(stdout.contains(" random write, QD4"), "{stdout}");
        for volume in ["nvme-tcp", "nvme-tcp+xts"] {
            let [_, _, shelf] = roles(&stdout, volume);
            assert!(shelf > 0.0, "{volume}: the shelf did no work\n{stdout}");
        }
    }
}

#[test]
fn fabric_bench_rejects_an_unknown_volume() {
    let out = Command::new(bin("fabric-bench"))
        .args(["--only", "ram,nvme-rdma"])
        .output()
        .expect("run fabric-bench");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no volume \"nvme-rdma\""), "{err}");
}
