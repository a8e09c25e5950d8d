//! End-to-end tests in the QEMU test bed (`scripts/testbed`): Debian's kernel in a TCG guest plays
//! the host (nvme-tcp, virtio-blk, dm-crypt) against real peers. Each test boots as few guests as
//! it can and checks several things per boot; the guest side is `scripts/testbed.d/<scenario>.sh`.
//!
//! The first test to run installs the bed (apt-get, kernel download: a minute or two); later runs
//! use the cache in `target/testbed`. Set NACRE_SKIP_TESTBED=1 on a machine without QEMU.

use std::time::Duration;

use nacre_tests::testbed::{self, Boot};

const MIB: u64 = 1 << 20;

fn prepare(test: &str) -> Option<std::sync::MutexGuard<'static, ()>> {
    if testbed::skipped(test) {
        return None;
    }
    let guard = testbed::exclusive();
    testbed::setup().expect("scripts/testbed setup");
    Some(guard)
}

/// The bed itself: kernel nvmet-tcp target and nvme-tcp host inside one guest on 127.0.0.1.
#[test]
fn kernel_selftest() {
    let Some(_bed) = prepare("kernel_selftest") else {
        return;
    };
    let out = Boot::new("kernel-selftest").run().expect("boot");
    out.assert_success();
    assert_eq!(
        out.fact("discovered"),
        "nqn.2014-08.io.nacre.testbed:selftest"
    );
    for digests in ["off", "on"] {
        assert_eq!(out.fact(&format!("transport_{digests}")), "tcp");
        assert_eq!(out.fact(&format!("model_{digests}")), "Linux");
        assert_eq!(
            out.fact(&format!("ns1_bytes_{digests}")),
            (1024 * MIB).to_string()
        );
        assert_eq!(
            out.fact(&format!("ns2_bytes_{digests}")),
            (64 * MIB).to_string()
        );
        assert_eq!(out.fact(&format!("io_queues_{digests}")), "2");
        assert_eq!(out.fact(&format!("verified_{digests}")), "16MiB");
    }
}

/// A guest's virtio-blk driver against a vhost-user-blk backend on the host: right size and
/// queue count, data written in one boot is read back intact after a second boot against the same
/// backend, and it is on the backend's disk.
#[test]
fn vhost_user_blk_survives_reboot() {
    let Some(_bed) = prepare("vhost_user_blk_survives_reboot") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.raw");
    let sock = dir.path().join("vhost.sock");
    let size = 64 * MIB;
    let queues = 2;
    std::fs::File::create(&image)
        .unwrap()
        .set_len(size)
        .unwrap();
    let _qsd = testbed::qsd_vhost_user_blk(&image, &sock, queues, &dir.path().join("qsd.log"))
        .expect("qsd");
    let boot = |phase: &str| {
        Boot::new("vhost-user-blk")
            .name(&format!("vhost-user-blk-{phase}"))
            .param("phase", phase)
            .param("bytes", size)
            .param("queues", queues)
            .param("mib", 8)
            .param("offset_mib", 1)
            .qemu(testbed::vhost_user_blk_args(&sock, queues, "1G"))
            .timeout(Duration::from_secs(180))
    };
    let first = boot("write").run().expect("first boot");
    first.assert_success();
    assert_eq!(first.fact("bytes"), size.to_string());
    assert_eq!(first.fact("queues"), queues.to_string());
    let sha = first.fact("sha256");
    assert_eq!(sha.len(), 64, "sha256 fact: {sha}");
    // the backend's file holds what the guest wrote
    assert_eq!(testbed::sha256_of_range(&image, MIB, 8 * MIB).unwrap(), sha);

    let second = boot("verify")
        .param("sha256", &sha)
        .run()
        .expect("second boot");
    second.assert_success();
    assert_eq!(second.fact("sha256"), sha);
    assert_eq!(second.fact("verified"), "8MiB");
}
