//! Linux's own NVMe/TCP host (Debian 12's 6.1 kernel in the QEMU test bed, nvme-cli) against
//! nacred's NVMe-oF target: discovery, connect with 2 I/O queues without and with digests,
//! `nvme list` showing nacre's model, serial and firmware, 32 MiB O_DIRECT verify, and a
//! namespace added and removed over RPC while connected (Namespace Attribute Changed AEN;
//! the host rescans without reconnecting).
//!
//! Set NACRE_SKIP_TESTBED=1 on a machine without QEMU.

use std::time::Duration;

use nacre_tests::daemon::Nacred;
use nacre_tests::testbed::{self, Boot};
use serde_json::json;

const MIB: u64 = 1 << 20;

#[test]
fn kernel_nvme_tcp_host_against_nacred() {
    if testbed::skipped("kernel_nvme_tcp_host_against_nacred") {
        return;
    }
    let _bed = testbed::exclusive();
    testbed::setup().expect("scripts/testbed setup");

    let nqn = "nqn.2024-01.io.nacre:kernel";
    let n = Nacred::start();
    n.ok(
        "volume_create",
        json!({"name": "k1", "size": 64 * MIB, "block_size": 4096}),
    );
    n.ok(
        "volume_create",
        json!({"name": "k2", "size": 32 * MIB, "block_size": 512, "backend": "ram"}),
    );
    n.ok(
        "nvmf_subsystem_create",
        json!({"nqn": nqn, "serial": "NACREKERNEL01", "allow_any_host": true}),
    );
    n.ok("nvmf_subsystem_add_ns", json!({"nqn": nqn, "volume": "k1"}));
    let l = n.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": nqn, "address": "127.0.0.1", "port": 0}),
    );
    let port = l["port"].as_u64().unwrap() as u16;

    let guest = Boot::new("nvme-tcp")
        .name("nvmf-kernel")
        .param("nqn", nqn)
        .param("queues", 2)
        .param("mib", 32)
        .param("hotplug", 1)
        .ctl()
        .qemu(testbed::guestfwd_args("10.0.2.100", 4420, port))
        .timeout(Duration::from_secs(500))
        .spawn()
        .expect("host guest");
    guest
        .wait_for("TB-WAIT ns-add", Duration::from_secs(400))
        .unwrap_or_else(|e| panic!("{e}"));
    n.ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": nqn, "volume": "k2", "nsid": 2}),
    );
    guest.signal("ns-add").unwrap();
    guest
        .wait_for("TB-WAIT ns-remove", Duration::from_secs(200))
        .unwrap_or_else(|e| panic!("{e}"));
    n.ok("nvmf_subsystem_remove_ns", json!({"nqn": nqn, "nsid": 2}));
    guest.signal("ns-remove").unwrap();
    let out = guest.wait(Duration::from_secs(400)).expect("guest");
    out.assert_success();
    assert_eq!(out.fact("discovered"), nqn);
    for digests in ["off", "on"] {
        assert_eq!(out.fact(&format!("model_{digests}")), "nacre");
        assert_eq!(out.fact(&format!("serial_{digests}")), "NACREKERNEL01");
        assert_eq!(
            out.fact(&format!("firmware_{digests}")),
            env!("CARGO_PKG_VERSION")
        );
        assert_eq!(
            out.fact(&format!("ns1_bytes_{digests}")),
            (64 * MIB).to_string()
        );
        assert_eq!(out.fact(&format!("io_queues_{digests}")), "2");
        assert_eq!(out.fact(&format!("verified_{digests}")), "32MiB");
    }
    assert_eq!(out.fact("ns2_added_bytes"), (32 * MIB).to_string());
    assert_eq!(out.fact("ns2_removed"), "yes");
}
