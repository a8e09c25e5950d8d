//! nacred's NVMe/TCP initiator against an independent target: the Linux kernel's nvmet-tcp in
//! a QEMU guest (a RAM disk as the storage shelf), reached through a hostfwd on the host's
//! loopback. nacred attaches it, serves a remote volume through vhost-user-blk (libblkio as
//! the client) and through its own NVMe/TCP target, and the data verifies end to end; with an
//! encrypted volume the shelf's RAM disk holds exactly the XTS ciphertext the independent
//! Python oracle computes, never the plaintext.

use std::time::Duration;

use nacre_tests::blkio_client::{self, BlkioClient, ClientOptions};
use nacre_tests::daemon::Nacred;
use nacre_tests::nvmf_host::{HostOptions, NvmfHost};
use nacre_tests::testbed::{self, Boot};
use serde_json::json;

const NQN: &str = "nqn.2014-08.io.nacre.testbed:peer";
const MIB: usize = 1 << 20;

fn attach(n: &Nacred, port: u16) {
    let r = n.ok(
        "remote_attach",
        json!({"name": "shelf", "address": "127.0.0.1", "port": port, "subnqn": NQN,
               "io_queues": 2, "queue_depth": 32}),
    );
    assert_eq!(r["state"], "live", "{r}");
    assert_eq!(r["namespaces"][0]["nsid"], 1, "{r}");
    assert_eq!(r["namespaces"][0]["size"], 64 * MIB as u64, "{r}");
}

/// Write `data` at `offset` through a vhost-user-blk device with libblkio, read it back.
fn write_through_vhost(n: &Nacred, dev: &str, offset: u64, data: &[u8]) {
    let mut c = BlkioClient::connect(
        &n.run_dir.join(format!("vhost-{dev}.sock")),
        &ClientOptions::default(),
    )
    .unwrap();
    let mut q = c.take_queues().remove(0);
    let mem = c.mem();
    let (wbuf, rbuf) = mem.split_at_mut(data.len());
    wbuf.copy_from_slice(data);
    assert_eq!(blkio_client::write(&mut q, offset, wbuf).unwrap(), 0);
    assert_eq!(blkio_client::flush(&mut q).unwrap(), 0);
    let rbuf = &mut rbuf[..data.len()];
    assert_eq!(blkio_client::read(&mut q, offset, rbuf).unwrap(), 0);
    assert!(rbuf == data, "read-back through vhost-user-blk differs");
}

fn peer_sha(peer: &testbed::Guest, offset_mib: usize, mib: usize) -> String {
    let before = peer.lines().len();
    peer.signal(&format!("sha {offset_mib} {mib}")).unwrap();
    let (_, line) = peer
        .wait_for_from(before, "TB-FACT peer_sha=", Duration::from_secs(60))
        .unwrap();
    line.rsplit('=').next().unwrap().trim().to_string()
}

#[test]
fn initiator_against_the_kernel_nvmet_target() {
    if testbed::skipped("initiator_against_the_kernel_nvmet_target") {
        return;
    }
    let _bed = testbed::exclusive();
    testbed::setup().expect("scripts/testbed setup");
    let port = testbed::free_port().unwrap();
    let peer = Boot::new("nvmet-peer")
        .name("fabric-peer")
        .param("nqn", NQN)
        .param("ns_mib", 64)
        .ctl()
        .qemu(testbed::hostfwd_args(port, 4420))
        .timeout(Duration::from_secs(400))
        .spawn()
        .expect("peer guest");
    peer.wait_for("TB-READY", Duration::from_secs(180))
        .expect("peer target up");

    let n = Nacred::start_args(&["--no-default"]);
    attach(&n, port);

    // Plain: a remote volume through vhost-user-blk and through nacred's own target.
    let data = testbed::random_bytes(MIB).unwrap();
    n.ok(
        "volume_create",
        json!({"name": "plain", "backend": "remote", "size": 0, "block_size": 512,
               "remote": {"extents": ["shelf:1"]}}),
    );
    n.ok("vhost_blk_create", json!({"name": "p", "volume": "plain"}));
    write_through_vhost(&n, "p", 4 * MIB as u64, &data);
    assert_eq!(
        peer_sha(&peer, 4, 1),
        testbed::sha256(&data).unwrap(),
        "shelf holds the plaintext"
    );
    let sub = "nqn.2014-08.io.nacre:fabric";
    n.ok(
        "nvmf_subsystem_create",
        json!({"nqn": sub, "allow_any_host": true}),
    );
    n.ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": sub, "volume": "plain"}),
    );
    let l = n.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": sub, "address": "127.0.0.1", "port": 0}),
    );
    let addr = ([127, 0, 0, 1], l["port"].as_u64().unwrap() as u16).into();
    let mut h = NvmfHost::connect(addr, sub, HostOptions::default()).unwrap();
    // In 128 KiB commands: within the target's MDTS.
    let mut back = Vec::new();
    for k in 0..8u64 {
        let slba = (4 * MIB / 512) as u64 + k * 256;
        back.extend(h.read(0, 1, slba, 256, 512).unwrap());
    }
    assert!(
        back == data,
        "read-back through nacred's NVMe/TCP target differs"
    );
    drop(h);
    n.ok("nvmf_subsystem_delete", json!({"nqn": sub}));
    n.ok("vhost_blk_delete", json!({"name": "p"}));
    n.ok("volume_delete", json!({"name": "plain"}));

    // Encrypted: the shelf must hold the oracle's ciphertext of what the host wrote.
    let dir = tempfile::tempdir().unwrap();
    let kek = dir.path().join("kek");
    std::fs::write(&kek, testbed::random_bytes(32).unwrap()).unwrap();
    n.ok(
        "tenant_create",
        json!({"name": "t", "kek": {"key_file": kek}, "policy": {"data_unit": 512, "tweak": "plain64"}}),
    );
    n.ok(
        "volume_create",
        json!({"name": "enc", "backend": "remote", "size": 0, "block_size": 512,
               "remote": {"extents": ["shelf:1"]}, "tenant": "t", "encrypt": true}),
    );
    n.ok("vhost_blk_create", json!({"name": "e", "volume": "enc"}));
    write_through_vhost(&n, "e", 8 * MIB as u64, &data);
    let key = dir.path().join("xts.key");
    n.ok(
        "volume_export_key",
        json!({"name": "enc", "path": key, "confirm": true}),
    );
    let plain = dir.path().join("plain.bin");
    let cipher = dir.path().join("cipher.bin");
    std::fs::write(&plain, &data).unwrap();
    testbed::xts_oracle_run(
        "encrypt",
        &key,
        &plain,
        &cipher,
        512,
        (8 * MIB / 512) as u64,
    )
    .expect("oracle");
    let expect = testbed::sha256(&std::fs::read(&cipher).unwrap()).unwrap();
    let got = peer_sha(&peer, 8, 1);
    assert_ne!(
        got,
        testbed::sha256(&data).unwrap(),
        "the shelf holds plaintext"
    );
    assert_eq!(
        got, expect,
        "the shelf's bytes are not the oracle's ciphertext"
    );
    peer.signal("stop").unwrap();
}
