//! nacre-host in the QEMU test bed: the guest plays the diskless host. nacred (on the test
//! machine) serves it an encrypted volume over vhost-user-blk and a plain one over NVMe/TCP;
//! QEMU adds a disk of its own. `nacre-host devices` in the guest reads sysfs, asks nacred
//! over the host channel (mutual TLS through a slirp guestfwd) and must name the right volume
//! and tenant for each nacre disk and none for QEMU's. See scripts/testbed.d/host-agent.sh.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use nacre_shared::channel::{self, files, HostIdentity};
use nacre_tests::daemon::{bin, Nacred};
use nacre_tests::testbed::{self, Boot};
use serde_json::json;

const MIB: u64 = 1 << 20;

fn host_addr_port(d: &Nacred) -> u16 {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(a) = d.log_text().lines().find_map(|l| {
            l.strip_prefix("nacred: host channel on ")
                .map(str::to_owned)
        }) {
            return a.trim().rsplit(':').next().unwrap().parse().unwrap();
        }
        assert!(std::time::Instant::now() < deadline, "{}", d.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn nacre_host_in_the_guest_matches_its_disks_to_volumes() {
    if testbed::skipped("nacre_host_in_the_guest_matches_its_disks_to_volumes") {
        return;
    }
    let _bed = testbed::exclusive();
    testbed::setup().expect("scripts/testbed setup");

    let tmp = tempfile::tempdir().unwrap();
    let tls = tmp.path().join("tls");
    let out = Command::new(bin("nacre"))
        .args(["cert", "init", "--dir"])
        .arg(&tls)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let d = Nacred::start_args(&[
        "--no-default",
        "--host-listen",
        "127.0.0.1:0",
        "--host-tls-dir",
        tls.to_str().unwrap(),
    ]);
    let host_port = host_addr_port(&d);

    let kek = tmp.path().join("acme.kek");
    std::fs::write(&kek, [7u8; 32]).unwrap();
    d.ok(
        "tenant_create",
        json!({"name": "acme", "kek": {"key_file": kek.to_str().unwrap()}}),
    );
    d.ok(
        "volume_create",
        json!({"name": "db", "size": 64 * MIB, "backend": "file", "tenant": "acme", "encrypt": true}),
    );
    d.ok(
        "volume_create",
        json!({"name": "logs", "size": 32 * MIB, "backend": "file", "tenant": "acme"}),
    );
    let vhost = d.ok("vhost_blk_create", json!({"name": "db0", "volume": "db"}));
    let sock = std::path::PathBuf::from(vhost["socket"].as_str().unwrap());
    let nqn = "nqn.2014-08.io.nacre:hostagent";
    d.ok(
        "nvmf_subsystem_create",
        json!({"nqn": nqn, "allow_any_host": true}),
    );
    d.ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": nqn, "volume": "logs"}),
    );
    let l = d.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": nqn, "address": "127.0.0.1", "port": 0}),
    );
    let nvmf_port = l["port"].as_u64().unwrap();

    // The host's credentials, issued by the DPU's CA for tenant acme.
    let ca = channel::PemPair {
        cert: std::fs::read_to_string(tls.join(files::CA_CERT)).unwrap(),
        key: std::fs::read_to_string(tls.join(files::CA_KEY))
            .unwrap()
            .into(),
    };
    let (csr, key) = channel::make_host_request("guest").unwrap();
    let cert = channel::issue_host_cert(
        &ca,
        &csr,
        &HostIdentity {
            host: "guest".into(),
            tenant: "acme".into(),
        },
        time::OffsetDateTime::now_utc() - time::Duration::minutes(5),
        1,
    )
    .unwrap();
    for (f, s) in [
        ("ca.pem", &ca.cert),
        ("host.pem", &cert),
        ("host.key", &*key),
    ] {
        std::fs::write(tmp.path().join(f), s).unwrap();
    }
    // The binary goes in on a read-only virtio disk (serial NACREHOSTBIN): without its debug
    // information it is a few MiB, which fw_cfg would take minutes to read under TCG.
    let exe = tmp.path().join("nacre-host");
    let stripped = Command::new("strip")
        .arg("-o")
        .arg(&exe)
        .arg(bin("nacre-host"))
        .status()
        .is_ok_and(|s| s.success());
    if !stripped {
        std::fs::copy(bin("nacre-host"), &exe).unwrap();
    }
    // A disk that is not nacre's.
    let plain = tmp.path().join("plain.img");
    std::fs::File::create(&plain)
        .unwrap()
        .set_len(16 * MIB)
        .unwrap();

    let binsize = std::fs::metadata(&exe).unwrap().len();
    let bindisk = tmp.path().join("bin.img");
    std::fs::copy(&exe, &bindisk).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&bindisk)
        .unwrap()
        .set_len(binsize.next_multiple_of(4096))
        .unwrap();
    let mut qemu = testbed::vhost_user_blk_args(&[(&sock, 1)], "1G");
    qemu.extend([
        "-drive".to_string(),
        format!(
            "file={},format=raw,if=none,id=bin,readonly=on",
            bindisk.display()
        ),
        "-device".into(),
        "virtio-blk-pci,drive=bin,serial=NACREHOSTBIN".into(),
        "-drive".into(),
        format!("file={},format=raw,if=virtio", plain.display()),
        "-netdev".into(),
        format!(
            "user,id=n0,restrict=on,ipv6=off,\
             guestfwd=tcp:10.0.2.100:4420-cmd:socat - TCP:127.0.0.1:{nvmf_port},\
             guestfwd=tcp:10.0.2.101:4424-cmd:socat - TCP:127.0.0.1:{host_port}"
        ),
        "-device".into(),
        "virtio-net-pci,netdev=n0,romfile=".into(),
    ]);
    let out = Boot::new("host-agent")
        .param("nqn", nqn)
        .param("binsize", binsize)
        .file("ca", tmp.path().join("ca.pem"))
        .file("cert", tmp.path().join("host.pem"))
        .file("key", tmp.path().join("host.key"))
        .qemu(qemu)
        .timeout(Duration::from_secs(420))
        .run()
        .expect("boot");
    assert!(
        out.success(),
        "{}\nnacred log:\n{}",
        out.tail(80),
        d.log_text()
    );
    let devs: BTreeMap<String, String> = out
        .facts()
        .into_iter()
        .filter_map(|(k, v)| k.strip_prefix("dev_").map(|n| (n.to_string(), v)))
        .collect();
    let with = |v: &str| devs.iter().filter(|(_, x)| x.as_str() == v).count();
    assert_eq!(with("db,acme,yes,virtio"), 1, "{devs:?}");
    assert_eq!(with("logs,acme,no,tcp"), 1, "{devs:?}");
    assert_eq!(with("-,-,-,virtio"), 2, "QEMU's own disks: {devs:?}");
    assert_eq!(devs.len(), 4, "{devs:?}");
    assert!(devs.keys().any(|k| k.starts_with("nvme")), "{devs:?}");
    assert_eq!(out.fact("gpus_rc"), "0");
    assert!(
        out.fact("gpus_msg")
            .starts_with("nacre-host: no NVIDIA driver"),
        "{}",
        out.fact("gpus_msg")
    );
    assert_eq!(out.fact("agent_rc"), "0");
    let log = d.log_text();
    assert!(
        log.contains("host connected") && log.contains("host=guest"),
        "{log}"
    );
}
