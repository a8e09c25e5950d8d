//! The host channel end to end: the real nacred listening with mutual TLS on a free
//! loopback port, the real `nacre cert` / `nacre-host pair` pairing, and a host client
//! speaking JSON-RPC over TLS. Refusals (wrong CA, no client certificate, an expired one, a
//! host credential calling operator methods) must fail and be logged; peer windows must go
//! with the channel that registered them.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_shared::channel::{self, files, ChannelError, HostIdentity, PemPair};
use nacre_shared::rpc;
use nacre_tests::daemon::{bin, Nacred};
use serde_json::{json, Value};
use time::OffsetDateTime;

/// A nacred with a host listener, its TLS directory (a CA made by `nacre cert init`) and a
/// tenant `acme` with an encrypted volume and a plain one, and a tenant `other` with one.
struct Bed {
    d: Nacred,
    addr: String,
    tls: tempfile::TempDir,
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn host_addr(d: &Nacred) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(l) = d.log_text().lines().find_map(|l| {
            l.strip_prefix("nacred: host channel on ")
                .map(str::to_owned)
        }) {
            return l.trim().to_string();
        }
        assert!(
            Instant::now() < deadline,
            "no host channel:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn bed() -> Bed {
    let tls = tempfile::tempdir().unwrap();
    run_ok(
        Command::new(bin("nacre"))
            .args(["cert", "init", "--dir"])
            .arg(tls.path()),
    );
    let dir = tls.path().to_str().unwrap().to_string();
    let d = Nacred::start_args(&[
        "--no-default",
        "--host-listen",
        "127.0.0.1:0",
        "--host-tls-dir",
        &dir,
    ]);
    let addr = host_addr(&d);
    for t in ["acme", "other"] {
        let kek = tls.path().join(format!("{t}.kek"));
        std::fs::write(&kek, [t.len() as u8; 32]).unwrap();
        d.ok(
            "tenant_create",
            json!({"name": t, "kek": {"key_file": kek.to_str().unwrap()}}),
        );
    }
    for (name, tenant, encrypt) in [
        ("db", "acme", true),
        ("scratch", "acme", false),
        ("theirs", "other", true),
    ] {
        d.ok(
            "volume_create",
            json!({"name": name, "size": 1 << 20, "backend": "ram", "tenant": tenant, "encrypt": encrypt}),
        );
    }
    Bed { d, addr, tls }
}

fn ca(b: &Bed) -> PemPair {
    PemPair {
        cert: std::fs::read_to_string(b.tls.path().join(files::CA_CERT)).unwrap(),
        key: std::fs::read_to_string(b.tls.path().join(files::CA_KEY))
            .unwrap()
            .into(),
    }
}

/// A host key and a certificate for it from `ca`, valid from `not_before` for `days`.
fn host_creds(
    ca: &PemPair,
    host: &str,
    tenant: &str,
    not_before: OffsetDateTime,
    days: i64,
) -> (String, String) {
    let (csr, key) = channel::make_host_request(host).unwrap();
    let cert = channel::issue_host_cert(
        ca,
        &csr,
        &HostIdentity {
            host: host.into(),
            tenant: tenant.into(),
        },
        not_before,
        days,
    )
    .unwrap();
    (cert, key.to_string())
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

type Client = channel::RpcClient<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

/// Connect with these credentials and make one call.
async fn first_call(
    addr: &str,
    cfg: Arc<rustls::ClientConfig>,
) -> Result<(Client, Value), ChannelError> {
    let mut c = channel::connect(addr, cfg).await?;
    let v = c.call("host_whoami", Value::Null).await?;
    Ok((c, v))
}

fn good_client(b: &Bed, host: &str, tenant: &str) -> Arc<rustls::ClientConfig> {
    let ca = ca(b);
    let (cert, key) = host_creds(
        &ca,
        host,
        tenant,
        OffsetDateTime::now_utc() - time::Duration::minutes(5),
        30,
    );
    channel::client_config(&ca.cert, &cert, &key).unwrap()
}

fn wait_log(d: &Nacred, needle: &str, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.log_text().matches(needle).count() < count {
        assert!(
            Instant::now() < deadline,
            "nacred did not log {needle:?} {count} times:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn pairing_with_the_clis_then_a_host_sees_only_its_tenants_volumes() {
    let b = bed();
    let hostdir = tempfile::tempdir().unwrap();
    let host = |args: &[&str]| {
        let mut c = Command::new(bin("nacre-host"));
        c.env("NACRE_HOST_DIR", hostdir.path())
            .env_remove("NACRE_HOST_DPU")
            .args(args);
        c
    };
    let out = run_ok(&mut host(&["pair", "--host", "node17"]));
    assert!(out.contains("nacre cert issue"), "{out}");
    let cert = hostdir.path().join("issued.pem");
    run_ok(
        Command::new(bin("nacre"))
            .args([
                "cert", "issue", "--host", "node17", "--tenant", "acme", "--csr",
            ])
            .arg(hostdir.path().join(files::HOST_CSR))
            .arg("--out")
            .arg(&cert)
            .arg("--dir")
            .arg(b.tls.path()),
    );
    let out = run_ok(
        host(&["--dpu", &b.addr, "pair", "--cert"])
            .arg(&cert)
            .arg("--ca")
            .arg(b.tls.path().join(files::CA_CERT)),
    );
    assert!(
        out.contains("nacred knows this host as node17 (tenant acme)"),
        "{out}"
    );
    // The key stayed private.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(hostdir.path().join(files::HOST_KEY))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    // Matching over the channel: acme's volumes by serial and by UUID; another tenant's
    // volume is not revealed; a disk nacre does not know is unmatched.
    let vols = b.d.ok("volume_list", json!({}));
    let vol = |n: &str| {
        vols.as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == n)
            .unwrap()
            .clone()
    };
    let (db, theirs) = (vol("db"), vol("theirs"));
    let cfg = channel::client_config(
        &std::fs::read_to_string(hostdir.path().join(files::CA_CERT)).unwrap(),
        &std::fs::read_to_string(hostdir.path().join(files::HOST_CERT)).unwrap(),
        &std::fs::read_to_string(hostdir.path().join(files::HOST_KEY)).unwrap(),
    )
    .unwrap();
    let m = rt().block_on(async {
        let (mut c, who) = first_call(&b.addr, cfg).await.unwrap();
        assert_eq!(
            who,
            json!({"role": "host", "host": "node17", "tenant": "acme"})
        );
        c.call(
            "host_devices_match",
            json!({"devices": [
                {"id": "vda", "serial": db["serial"]},
                {"id": "nvme0n1", "nguid": db["uuid"].as_str().unwrap().to_uppercase(), "nsid": 1},
                {"id": "vdb", "serial": theirs["serial"]},
                {"id": "sda", "serial": "QM00001"},
            ]}),
        )
        .await
        .unwrap()
    });
    let m = m.as_array().unwrap();
    assert_eq!(m[0]["volume"]["volume"], "db");
    assert_eq!(m[0]["volume"]["tenant"], "acme");
    assert_eq!(m[0]["volume"]["encrypted"], true);
    assert_eq!(m[0]["volume"]["matched_by"], "serial");
    assert_eq!(m[1]["volume"]["volume"], "db");
    assert_eq!(m[1]["volume"]["matched_by"], "nguid");
    assert_eq!(
        m[2]["volume"],
        Value::Null,
        "another tenant's volume: {m:?}"
    );
    assert_eq!(m[3]["volume"], Value::Null);
    // The operator's socket matches any tenant.
    let m = b.d.ok(
        "host_devices_match",
        json!({"devices": [{"id": "vdb", "serial": theirs["serial"]}]}),
    );
    assert_eq!(m[0]["volume"]["tenant"], "other");
}

#[test]
fn wrong_missing_or_expired_certificates_are_refused_and_logged() {
    let b = bed();
    let real_ca = ca(&b);
    let now = OffsetDateTime::now_utc();
    let rt = rt();

    // A good one works (so the refusals below are the certificates' doing).
    rt.block_on(first_call(&b.addr, good_client(&b, "h1", "acme")))
        .unwrap();

    // A certificate from another CA.
    let rogue = channel::make_ca("rogue").unwrap();
    let (cert, key) = host_creds(&rogue, "h1", "acme", now - time::Duration::minutes(5), 30);
    let cfg = channel::client_config(&real_ca.cert, &cert, &key).unwrap();
    assert!(
        rt.block_on(first_call(&b.addr, cfg)).is_err(),
        "foreign CA accepted"
    );
    wait_log(&b.d, "host channel: refused", 1);

    // No client certificate at all.
    let mut roots = rustls::RootCertStore::empty();
    {
        use rustls::pki_types::pem::PemObject as _;
        for c in rustls::pki_types::CertificateDer::pem_slice_iter(real_ca.cert.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
    }
    let cfg = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    assert!(
        rt.block_on(first_call(&b.addr, cfg)).is_err(),
        "no certificate accepted"
    );
    wait_log(&b.d, "host channel: refused", 2);

    // Expired: valid for one day, ten days ago.
    let (cert, key) = host_creds(&real_ca, "h1", "acme", now - time::Duration::days(10), 1);
    let cfg = channel::client_config(&real_ca.cert, &cert, &key).unwrap();
    assert!(
        rt.block_on(first_call(&b.addr, cfg)).is_err(),
        "expired certificate accepted"
    );
    wait_log(&b.d, "host channel: refused", 3);
    // Not yet valid.
    let (cert, key) = host_creds(&real_ca, "h1", "acme", now + time::Duration::days(2), 10);
    let cfg = channel::client_config(&real_ca.cert, &cert, &key).unwrap();
    assert!(
        rt.block_on(first_call(&b.addr, cfg)).is_err(),
        "future certificate accepted"
    );
    wait_log(&b.d, "host channel: refused", 4);
    let log = b.d.log_text();
    assert!(log.contains("Expired") || log.contains("expired"), "{log}");

    // nacred's own server certificate, from the right CA, is no host credential (its
    // extended key usage is serverAuth, and it names no host).
    let cfg = channel::client_config(
        &real_ca.cert,
        &std::fs::read_to_string(b.tls.path().join(files::SERVER_CERT)).unwrap(),
        &std::fs::read_to_string(b.tls.path().join(files::SERVER_KEY)).unwrap(),
    )
    .unwrap();
    assert!(
        rt.block_on(first_call(&b.addr, cfg)).is_err(),
        "server certificate accepted as a host's"
    );
    wait_log(&b.d, "host channel: refused", 5);

    // The host refuses a server whose certificate is not from the CA it was given.
    let (cert, key) = host_creds(&rogue, "h1", "acme", now - time::Duration::minutes(5), 30);
    let cfg = channel::client_config(&rogue.cert, &cert, &key).unwrap();
    let e = rt
        .block_on(first_call(&b.addr, cfg))
        .err()
        .expect("rogue server trusted");
    assert!(e.to_string().contains("TLS handshake"), "{e}");
}

#[test]
fn a_host_credential_cannot_call_tenant_key_or_volume_methods() {
    let b = bed();
    let kek = b.tls.path().join("new.kek");
    std::fs::write(&kek, [9u8; 32]).unwrap();
    let refused = [
        (
            "tenant_create",
            json!({"name": "evil", "kek": {"key_file": kek.to_str().unwrap()}}),
        ),
        ("tenant_list", json!({})),
        (
            "tenant_rotate_kek",
            json!({"name": "acme", "kek": {"key_file": kek.to_str().unwrap()}}),
        ),
        ("volume_export_key", json!({"name": "db"})),
        ("volume_crypto_erase", json!({"name": "db"})),
        (
            "volume_create",
            json!({"name": "x", "size": 4096, "backend": "ram"}),
        ),
        ("volume_delete", json!({"name": "db"})),
        ("vhost_blk_create", json!({"name": "x", "volume": "db"})),
        (
            "nvmf_subsystem_create",
            json!({"nqn": "nqn.2024-01.io.x:y"}),
        ),
        ("volume_list", json!({})),
    ];
    rt().block_on(async {
        let (mut c, _) = first_call(&b.addr, good_client(&b, "h1", "acme"))
            .await
            .unwrap();
        for (m, p) in &refused {
            match c.call(m, p.clone()).await {
                Err(ChannelError::Rpc { code, message }) => {
                    assert_eq!(code, rpc::REFUSED, "{m}: {message}");
                    assert!(
                        message.contains("not allowed on the host channel"),
                        "{m}: {message}"
                    );
                }
                other => panic!("{m} over the host channel: {other:?}"),
            }
        }
        // The channel still answers after the refusals; rpc_get_methods lists only host methods.
        let ms = c.call("rpc_get_methods", Value::Null).await.unwrap();
        let ms: Vec<&str> = ms
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap())
            .collect();
        assert!(
            ms.contains(&"host_devices_match") && !ms.iter().any(|m| m.starts_with("tenant_")),
            "{ms:?}"
        );
    });
    // Nothing changed, and every refusal was logged.
    assert!(b.d.ok("tenant_list", json!({})).as_array().unwrap().len() == 2);
    assert!(
        b.d.ok("volume_list", json!({"name": "db"}))
            .as_array()
            .unwrap()
            .len()
            == 1
    );
    wait_log(&b.d, "method refused", refused.len());
}

#[test]
fn peer_windows_are_per_host_and_go_when_the_channel_drops() {
    let b = bed();
    let window = json!({
        "gpu_uuid": "GPU-5f0c9a3e-1234-5678-9abc-def001234567", "bdf": "0000:3b:00.0",
        "bar1_start": 0x3800_0000_0000u64, "bar1_len": 64u64 << 30, "length": 64u64 << 20,
        "device_address": 0x7f00_0000_0000u64, "handle_kind": "dmabuf", "handle": 17,
    });
    let list = || b.d.ok("peer_window_list", json!({}));
    let rt = rt();
    let (mut h1, _) = rt
        .block_on(first_call(&b.addr, good_client(&b, "h1", "acme")))
        .unwrap();
    let (mut h2, _) = rt
        .block_on(first_call(&b.addr, good_client(&b, "h2", "other")))
        .unwrap();
    let w = rt
        .block_on(h1.call("peer_window_register", window.clone()))
        .unwrap();
    assert_eq!(w["tenant"], "acme");
    assert_eq!(w["host"], "h1");
    assert_eq!(w["registered_via"], "host-channel");
    let id = w["id"].as_u64().unwrap();
    // A host cannot register for someone else, nor see or remove another host's windows.
    let mut spoof = window.clone();
    spoof["tenant"] = json!("other");
    match rt.block_on(h1.call("peer_window_register", spoof)) {
        Err(ChannelError::Rpc { code, .. }) => assert_eq!(code, rpc::REFUSED),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        rt.block_on(h2.call("peer_window_list", json!({}))).unwrap(),
        json!([])
    );
    match rt.block_on(h2.call("peer_window_unregister", json!({"id": id}))) {
        Err(ChannelError::Rpc { code, .. }) => assert_eq!(code, rpc::NOT_FOUND),
        other => panic!("{other:?}"),
    }
    // Bad windows are refused with a reason.
    for (field, bad) in [
        ("bdf", json!("3b:00.0")),
        ("length", json!(0)),
        ("handle_kind", json!("fd")),
        ("length", json!(128u64 << 30)),
    ] {
        let mut p = window.clone();
        p[field] = bad;
        match rt.block_on(h1.call("peer_window_register", p)) {
            Err(ChannelError::Rpc { code, .. }) => assert_eq!(code, rpc::INVALID_PARAMS, "{field}"),
            other => panic!("{field}: {other:?}"),
        }
    }
    // The operator sees it (`nacre peer list` too).
    assert_eq!(list().as_array().unwrap().len(), 1);
    let out = b.d.cli(&["peer", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("GPU-5f0c9a3e-1234-5678-9abc-def001234567") && text.contains("acme"),
        "{text}"
    );
    // Unregister and register again, then drop the connection without a word.
    assert_eq!(
        rt.block_on(h1.call("peer_window_unregister", json!({"id": id})))
            .unwrap(),
        json!({"ok": true})
    );
    assert_eq!(list(), json!([]));
    rt.block_on(h1.call("peer_window_register", window.clone()))
        .unwrap();
    rt.block_on(h1.call("peer_window_register", window))
        .unwrap();
    assert_eq!(list().as_array().unwrap().len(), 2);
    drop(h1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !list().as_array().unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "windows outlived their channel: {}",
            list()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_log(&b.d, "windows_removed=2", 1);
    drop(h2);
}

#[test]
fn nacre_host_devices_matches_a_recorded_sysfs_tree() {
    let b = bed();
    let vols = b.d.ok("volume_list", json!({}));
    let vol = |n: &str| {
        vols.as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == n)
            .unwrap()
            .clone()
    };
    let (db, scratch) = (vol("db"), vol("scratch"));
    // Export scratch over NVMe-oF so the NQN/NSID fallback has something to find too.
    b.d.ok(
        "nvmf_subsystem_create",
        json!({"nqn": "nqn.2024-01.io.nacre:t", "allow_any_host": true}),
    );
    b.d.ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": "nqn.2024-01.io.nacre:t", "volume": "scratch"}),
    );
    let sys = tempfile::tempdir().unwrap();
    let w = |rel: &str, s: &str| {
        let p = sys.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, s).unwrap();
    };
    let ln = |rel: &str, target: &str| {
        let p = sys.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(target, p).unwrap();
    };
    // vda: the db volume over virtio-blk; vdb: a plain QEMU disk; nvme0n1: scratch over TCP.
    w("devices/v/virtio1/block/vda/size", "2048\n");
    w(
        "devices/v/virtio1/block/vda/serial",
        &format!("{}\n", db["serial"].as_str().unwrap()),
    );
    ln("devices/v/virtio1/block/vda/device", "../../../virtio1");
    ln("block/vda", "../devices/v/virtio1/block/vda");
    w("devices/v/virtio2/block/vdb/size", "4096\n");
    ln("devices/v/virtio2/block/vdb/device", "../../../virtio2");
    ln("block/vdb", "../devices/v/virtio2/block/vdb");
    let c = "devices/virtual/nvme-fabrics/ctl/nvme0";
    w(&format!("{c}/transport"), "tcp\n");
    w(&format!("{c}/state"), "live\n");
    w(&format!("{c}/subsysnqn"), "nqn.2024-01.io.nacre:t\n");
    w(&format!("{c}/nvme0n1/size"), "2048\n");
    w(&format!("{c}/nvme0n1/nsid"), "1\n");
    w(
        &format!("{c}/nvme0n1/nguid"),
        &format!("{}\n", scratch["uuid"].as_str().unwrap()),
    );
    ln(&format!("{c}/nvme0n1/device"), "../../nvme0");
    ln("class/nvme/nvme0", &format!("../../{c}"));
    ln("block/nvme0n1", &format!("../{c}/nvme0n1"));

    let hostdir = tempfile::tempdir().unwrap();
    let ca = ca(&b);
    let (cert, key) = host_creds(
        &ca,
        "h1",
        "acme",
        OffsetDateTime::now_utc() - time::Duration::minutes(5),
        30,
    );
    for (f, s) in [
        (files::CA_CERT, &ca.cert),
        (files::HOST_CERT, &cert),
        (files::HOST_KEY, &key),
    ] {
        std::fs::write(hostdir.path().join(f), s).unwrap();
    }
    let run = |json: bool| {
        let mut cmd = Command::new(bin("nacre-host"));
        cmd.env("NACRE_HOST_DIR", hostdir.path())
            .env("NACRE_HOST_SYSFS", sys.path())
            .args(["--dpu", &b.addr, "devices"]);
        if json {
            cmd.arg("--json");
        }
        run_ok(&mut cmd)
    };
    let text = run(false);
    let line = |dev: &str| {
        text.lines()
            .find(|l| l.starts_with(dev))
            .unwrap_or_else(|| panic!("{text}"))
            .to_string()
    };
    assert!(
        line("vda ").contains(" db ")
            && line("vda ").contains("acme")
            && line("vda ").contains("yes"),
        "{text}"
    );
    assert!(
        line("nvme0n1").contains("scratch") && line("nvme0n1").contains("nvme0:live"),
        "{text}"
    );
    assert!(
        line("vdb").contains("virtio") && !line("vdb").contains("acme"),
        "{text}"
    );
    let v: Value = serde_json::from_str(&run(true)).unwrap();
    let by = |n: &str| {
        v.as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == n)
            .unwrap()
            .clone()
    };
    assert_eq!(by("vda")["nacre"]["volume"], "db");
    assert_eq!(by("nvme0n1")["nacre"]["volume"], "scratch");
    assert_eq!(
        by("nvme0n1")["nacre"]["exports"],
        json!(["nvmf:nqn.2024-01.io.nacre:t/1"])
    );
    assert_eq!(by("nvme0n1")["transport"], "tcp");
    assert_eq!(by("vdb")["nacre"], Value::Null);
}

#[test]
fn gpu_commands_without_a_driver_say_so() {
    let nohost = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        Command::new(bin("nacre-host"))
            .env("NACRE_HOST_LIBNVML", "/nonexistent/libnvidia-ml.so.1")
            .env("NACRE_HOST_LIBCUDA", "/nonexistent/libcuda.so.1")
            .env("NACRE_HOST_DIR", nohost.path())
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["gpus"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("nacre-host: no NVIDIA driver"), "{err}");
    let out = run(&["gpus", "--json"]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[]");
    for args in [&["register-gpu"][..], &["agent", "--gpu", "GPU-x"]] {
        let out = run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.starts_with(
                "nacre-host: cannot load the CUDA driver library /nonexistent/libcuda.so.1"
            ),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // A malformed command line is exit 2.
    assert_eq!(run(&["register-gpu", "--size", "0"]).status.code(), Some(2));
}

/// `nacre-host agent` holds the channel: it connects, reconnects by itself when nacred
/// restarts under it, and exits 0 on SIGTERM.
#[test]
fn the_agent_reconnects_after_nacred_restarts_and_stops_on_sigterm() {
    let tls = tempfile::tempdir().unwrap();
    run_ok(
        Command::new(bin("nacre"))
            .args(["cert", "init", "--dir"])
            .arg(tls.path()),
    );
    // A fixed port, so the restarted nacred listens where the agent dials.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let dir = tls.path().to_str().unwrap().to_string();
    let d = Nacred::start_args(&[
        "--no-default",
        "--host-listen",
        &addr,
        "--host-tls-dir",
        &dir,
    ]);
    let kek = tls.path().join("acme.kek");
    std::fs::write(&kek, [3u8; 32]).unwrap();
    d.ok(
        "tenant_create",
        json!({"name": "acme", "kek": {"key_file": kek.to_str().unwrap()}}),
    );
    let b = Bed {
        d,
        addr: addr.clone(),
        tls,
    };
    let hostdir = tempfile::tempdir().unwrap();
    let ca = ca(&b);
    let (cert, key) = host_creds(
        &ca,
        "agent1",
        "acme",
        OffsetDateTime::now_utc() - time::Duration::minutes(5),
        30,
    );
    for (f, s) in [
        (files::CA_CERT, &ca.cert),
        (files::HOST_CERT, &cert),
        (files::HOST_KEY, &key),
    ] {
        std::fs::write(hostdir.path().join(f), s).unwrap();
    }
    let empty_sys = tempfile::tempdir().unwrap();
    let agent_log = hostdir.path().join("agent.log");
    let mut agent = Command::new(bin("nacre-host"))
        .env("NACRE_HOST_DIR", hostdir.path())
        .env("NACRE_HOST_SYSFS", empty_sys.path())
        .args(["--dpu", &addr, "agent", "--keepalive", "1"])
        .stderr(std::fs::File::create(&agent_log).unwrap())
        .spawn()
        .unwrap();
    let mut d = b.d;
    wait_log(&d, "host connected", 1);
    d.restart();
    // The agent notices (keepalive) and dials again, with backoff.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !d.log_text().contains("host connected")
        || d.log_text().matches("host connected").count() < 2
    {
        assert!(
            Instant::now() < deadline,
            "the agent did not reconnect:\n{}",
            std::fs::read_to_string(&agent_log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    let status = agent.wait().unwrap();
    let log = std::fs::read_to_string(&agent_log).unwrap_or_default();
    assert!(status.success(), "{status}: {log}");
    assert!(
        log.contains("connected to nacred") && log.contains("reconnecting"),
        "{log}"
    );
    // (The first connection ended with the nacred that held it; the second ends now.)
    wait_log(&d, "host disconnected", 1);
}
