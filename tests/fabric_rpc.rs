//! Remote volumes through the real nacred: `remote_attach` to a storage shelf (nacre's own
//! NVMe-oF/TCP target, run in this test process), a remote volume served over
//! vhost-user-blk to libblkio, persistence across restarts with the shelf down, and the
//! errors operators get.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;
use nacre_shared::rpc;
use nacre_tests::blkio_client::{read, write, BlkioClient, ClientOptions};
use nacre_tests::daemon::Nacred;
use nacre_tests::fabric_support::pattern;
use serde_json::{json, Value};

const NQN: &str = "nqn.2024-01.io.nacre:shelf-rpc";

struct Shelf {
    target: Arc<NvmfTarget>,
    addr: SocketAddr,
    vol: Arc<RamVolume>,
}

fn shelf_on(addr: &str, vol: Arc<RamVolume>) -> Shelf {
    shelf_with(addr, vol, [0x77; 16])
}

fn shelf_with(addr: &str, vol: Arc<RamVolume>, nguid: [u8; 16]) -> Shelf {
    let target = NvmfTarget::new();
    target
        .create_subsystem(NQN, "SHELFRPC", "nacre shelf", true)
        .unwrap();
    target
        .add_namespace(NQN, Some(1), vol.clone(), nguid, "v".into())
        .unwrap();
    let mut last = None;
    for _ in 0..100 {
        match target.add_listener(NQN, addr.parse().unwrap()) {
            Ok(a) => {
                return Shelf {
                    target,
                    addr: a,
                    vol,
                }
            }
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("cannot listen on {addr}: {last:?}");
}

fn attach_params(name: &str, port: u16) -> Value {
    json!({"name": name, "address": "127.0.0.1", "port": port, "subnqn": NQN,
           "io_queues": 2, "queue_depth": 32, "reconnect_delay_sec": 1,
           "ctrl_loss_timeout_sec": -1, "quiesce_time_ms": 50})
}

#[test]
fn remote_volume_served_over_vhost_user_blk() {
    let shelf = shelf_on(
        "127.0.0.1:0",
        Arc::new(RamVolume::new(32 << 20, 512).unwrap()),
    );
    let n = Nacred::start_args(&["--no-default", "--fabric-reactors", "1"]);
    let r = n.ok("remote_attach", attach_params("shelf", shelf.addr.port()));
    assert_eq!(r["state"], "live");
    assert_eq!(r["model"], "nacre shelf");
    // Its admin and two I/O queues are served by the one reactor asked for, not by threads
    // of their own.
    let names: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", n.pid()))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect();
    let reactors = names
        .iter()
        .filter(|c| c.starts_with("fabric-tcp-"))
        .count();
    assert_eq!(reactors, 1, "{names:?}");
    assert!(!names.iter().any(|c| c.starts_with("nvmf-q")), "{names:?}");
    assert_eq!(r["namespaces"][0]["nsid"], 1);
    assert_eq!(r["namespaces"][0]["size"], 32u64 << 20);
    assert_eq!(
        r["namespaces"][0]["id"],
        "nguid:77777777777777777777777777777777"
    );
    // A 4096-byte volume over the 512-byte namespace, all of it.
    let v = n.ok(
        "volume_create",
        json!({"name": "rv", "backend": "remote", "size": 0, "remote": {"extents": ["shelf:1"]}}),
    );
    assert_eq!(v["size"], 32u64 << 20);
    assert_eq!(v["backend"], "remote");
    n.ok(
        "vhost_blk_create",
        json!({"name": "rv", "volume": "rv", "queues": 2}),
    );
    let sock = n.run_dir.join("vhost-rv.sock");
    let mut c = BlkioClient::connect(
        &sock,
        &ClientOptions {
            queues: 2,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(c.capacity().unwrap(), 32 << 20);
    let mut qs = c.take_queues();
    let mem = c.mem();
    let mut written = Vec::new();
    for i in 0..16u64 {
        let off = i * (1 << 20) + 4096 * i;
        let len = 4096 * (1 + (i as usize % 8) * 4);
        let d = pattern(i, off, len);
        mem[..len].copy_from_slice(&d);
        assert_eq!(
            write(&mut qs[(i % 2) as usize], off, &mem[..len]).unwrap(),
            0
        );
        written.push((off, d));
    }
    let read_bytes: usize = written.iter().map(|(_, d)| d.len()).sum();
    for (i, (off, d)) in written.iter().enumerate() {
        let buf = &mut mem[..d.len()];
        buf.fill(0);
        assert_eq!(read(&mut qs[i % 2], *off, buf).unwrap(), 0);
        assert!(
            buf[..] == d[..],
            "read back through vhost-user-blk at {off}"
        );
        let mut at_shelf = vec![0u8; d.len()];
        shelf.vol.read_at(*off, &mut at_shelf).unwrap();
        assert!(at_shelf == *d, "the shelf holds the data at {off}");
    }
    // Operator errors.
    let (code, msg) = n.err("remote_detach", json!({"name": "shelf"}));
    assert_eq!(code, rpc::BUSY);
    assert!(msg.contains("rv"), "{msg}");
    let l = n.ok("remote_list", Value::Null);
    assert_eq!(l[0]["used_by"], json!(["rv"]));
    // NVMe/TCP has no registered transport buffers: no bounce copies are counted.
    assert_eq!(l[0]["bounce_copy_bytes"], 0);
    // One session throughout: every byte read arrived in C2HData, straight into the guest's
    // memory or through the receive buffer, and the worker sent its batches itself.
    assert_eq!(l[0]["resets"], 0);
    let rx = |k: &str| {
        l[0][k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} in {}", l[0]))
    };
    assert_eq!(
        rx("rx_direct_bytes") + rx("rx_copied_bytes"),
        read_bytes as u64,
        "{}",
        l[0]
    );
    assert!(rx("inline_sends") > 0, "{}", l[0]);
    drop(shelf);
}

#[test]
fn remote_errors_are_clear() {
    let shelf = shelf_on(
        "127.0.0.1:0",
        Arc::new(RamVolume::new(8 << 20, 4096).unwrap()),
    );
    let n = Nacred::start_args(&["--no-default"]);
    let mut bad = attach_params("s", shelf.addr.port());
    bad["reconnect_delay_sec"] = json!(0);
    let (code, msg) = n.err("remote_attach", bad);
    assert_eq!(code, rpc::INVALID_PARAMS);
    assert!(msg.contains("reconnect_delay_sec"), "{msg}");
    let mut bad = attach_params("s", shelf.addr.port());
    bad["transport"] = json!("roce");
    let (code, msg) = n.err("remote_attach", bad);
    assert_eq!(code, rpc::INVALID_PARAMS);
    assert!(msg.contains("\"tcp\" or \"rdma\""), "{msg}");
    let mut bad = attach_params("s", shelf.addr.port());
    bad["subnqn"] = json!("nqn.2024-01.io.nacre:nope");
    let (code, msg) = n.err("remote_attach", bad);
    assert_eq!(code, rpc::OPERATION_FAILED);
    assert!(msg.contains("cannot attach"), "{msg}");
    let (_, msg) = n.err("remote_attach", attach_params("s", 1));
    assert!(msg.contains("cannot attach"), "{msg}");
    assert_eq!(
        n.ok("remote_list", Value::Null),
        json!([]),
        "nothing half-attached"
    );

    // Attach through the CLI, as an operator would.
    let port = shelf.addr.port().to_string();
    let out = n.cli(&[
        "remote",
        "attach",
        "s",
        "--address",
        "127.0.0.1",
        "--port",
        &port,
        "--subnqn",
        NQN,
        "--io-queues",
        "2",
        "--reconnect-delay-sec",
        "1",
        "--ctrl-loss-timeout-sec",
        "-1",
        "--header-digest",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("attached remote s") && text.contains("nsid 1"),
        "{text}"
    );
    assert_eq!(
        n.err("remote_attach", attach_params("s", shelf.addr.port()))
            .0,
        rpc::ALREADY_EXISTS
    );
    let (_, msg) = n.err(
        "volume_create",
        json!({"name": "x", "backend": "remote", "size": 0, "remote": {"extents": ["s:2"]}}),
    );
    assert!(msg.contains("no namespace 2"), "{msg}");
    let (_, msg) = n.err(
        "volume_create",
        json!({"name": "x", "backend": "remote", "size": 0, "remote": {"extents": ["t:1"]}}),
    );
    assert!(msg.contains("not attached"), "{msg}");
    let (_, msg) = n.err(
        "volume_create",
        json!({"name": "x", "backend": "remote", "size": 0, "block_size": 512, "remote": {"extents": ["s:1"]}}),
    );
    assert!(msg.contains("does not divide"), "{msg}");
    let (_, msg) = n.err(
        "volume_create",
        json!({"name": "x", "backend": "remote", "size": 0}),
    );
    assert!(msg.contains("extents"), "{msg}");
    let (_, msg) = n.err(
        "volume_create",
        json!({"name": "x", "backend": "remote", "size": 1u64 << 40, "remote": {"extents": ["s:1"]}}),
    );
    assert!(msg.contains("exceeds"), "{msg}");
    // A part of the namespace is fine.
    let out = n.cli(&[
        "remote",
        "volume-create",
        "x",
        "--extent",
        "s:1",
        "--size",
        "1M",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = n.ok("volume_list", json!({"name": "x"}));
    assert_eq!(v[0]["size"], 1 << 20);
    assert_eq!(v[0]["remote"]["extents"], json!(["s:1"]));
    // Discovery through the RPC and the CLI.
    let d = n.ok(
        "remote_discover",
        json!({"address": "127.0.0.1", "port": shelf.addr.port()}),
    );
    assert!(d
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["subnqn"] == NQN && e["subtype"] == "nvme"));
    let out = n.cli(&[
        "remote",
        "discover",
        "--address",
        "127.0.0.1",
        "--port",
        &shelf.addr.port().to_string(),
    ]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains(NQN));
    let out = n.cli(&["remote", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("live") && text.contains("x"), "{text}");
    // Detach after the volume is gone.
    n.ok("volume_delete", json!({"name": "x"}));
    n.ok("remote_detach", json!({"name": "s"}));
    assert_eq!(n.ok("remote_list", Value::Null), json!([]));
}

#[test]
fn remote_down_at_start_does_not_block_nacred_and_comes_back() {
    let ram = Arc::new(RamVolume::new(8 << 20, 4096).unwrap());
    let shelf = shelf_on("127.0.0.1:0", ram.clone());
    let addr = shelf.addr;
    let mut n = Nacred::start_args(&["--no-default"]);
    n.ok("remote_attach", attach_params("s", addr.port()));
    n.ok(
        "volume_create",
        json!({"name": "rv", "backend": "remote", "size": 0, "remote": {"extents": ["s:1"]}}),
    );
    let v = n.ok("volume_list", json!({"name": "rv"}));
    let size = v[0]["size"].clone();
    // Shelf down, nacred restarted: it comes up and answers at once.
    n.stop();
    drop(shelf);
    let t = Instant::now();
    n.restart();
    let l = n.ok("remote_list", Value::Null);
    assert_ne!(l[0]["state"], "live", "{l}");
    assert_eq!(n.ok("volume_list", json!({"name": "rv"}))[0]["size"], size);
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "restart did not wait for the shelf"
    );
    // The shelf returns on the same portal: nacred reconnects by itself.
    let _shelf = shelf_on(&addr.to_string(), ram);
    let t = Instant::now();
    loop {
        let l = n.ok("remote_list", Value::Null);
        if l[0]["state"] == "live" {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "never reconnected: {l}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = &_shelf.target;
}

/// Encryption composes on top of a remote volume: the shelf only ever holds ciphertext, and
/// an independent XTS implementation (pyca/cryptography) decrypts what the shelf holds with
/// the exported data key back to what the client wrote.
#[test]
fn encrypted_remote_volume_leaves_only_ciphertext_on_the_shelf() {
    use nacre_tests::xts_oracle::{python_cryptography_available, python_decrypt_file};
    assert!(
        python_cryptography_available(),
        "the XTS oracle needs python3 with the cryptography package: apt-get install python3-cryptography"
    );
    let shelf = shelf_on(
        "127.0.0.1:0",
        Arc::new(RamVolume::new(8 << 20, 4096).unwrap()),
    );
    let n = Nacred::start_args(&["--no-default"]);
    let tmp = tempfile::tempdir().unwrap();
    let kek = tmp.path().join("t.kek");
    std::fs::write(&kek, pattern(77, 0, 32)).unwrap();
    n.ok(
        "tenant_create",
        json!({"name": "t", "kek": {"key_file": kek}}),
    );
    n.ok("remote_attach", attach_params("shelf", shelf.addr.port()));
    n.ok(
        "volume_create",
        json!({"name": "ev", "backend": "remote", "size": 0, "tenant": "t", "encrypt": true,
               "remote": {"extents": ["shelf:1"]}}),
    );
    n.ok("vhost_blk_create", json!({"name": "ev", "volume": "ev"}));
    let plain = pattern(5, 0, 1 << 20);
    {
        let mut c =
            BlkioClient::connect(&n.run_dir.join("vhost-ev.sock"), &ClientOptions::default())
                .unwrap();
        let mut q = c.take_queues().remove(0);
        let buf = &mut c.mem()[..plain.len()];
        buf.copy_from_slice(&plain);
        assert_eq!(write(&mut q, 1 << 20, buf).unwrap(), 0);
        buf.fill(0);
        assert_eq!(read(&mut q, 1 << 20, buf).unwrap(), 0);
        assert!(buf[..] == plain[..], "the client reads its plaintext back");
    }
    let mut at_rest = vec![0u8; plain.len()];
    shelf.vol.read_at(1 << 20, &mut at_rest).unwrap();
    assert!(at_rest != plain, "the shelf never sees plaintext");
    let key = tmp.path().join("ev.key");
    n.ok(
        "volume_export_key",
        json!({"name": "ev", "path": key, "confirm": true}),
    );
    let dump = tmp.path().join("shelf.img");
    let mut whole = vec![0u8; 8 << 20];
    shelf.vol.read_at(0, &mut whole).unwrap();
    std::fs::write(&dump, &whole).unwrap();
    let key = std::fs::read(&key).unwrap();
    let dec = python_decrypt_file(&dump, &key, 4096, "plain64", 1 << 20, plain.len(), 256).unwrap();
    assert!(
        dec == plain,
        "the oracle decrypts the shelf's bytes to the plaintext"
    );
}

/// Multipath and stripe layouts through the control plane: one shelf reached through two
/// portals (two remotes, one namespace), a second shelf, a round-robin multipath volume, a
/// stripe over both shelves, and the refusal to group different namespaces.
#[test]
fn multipath_and_stripe_volumes_over_rpc() {
    let shelf_a = shelf_on(
        "127.0.0.1:0",
        Arc::new(RamVolume::new(8 << 20, 4096).unwrap()),
    );
    let second_portal = shelf_a
        .target
        .add_listener(NQN, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    let shelf_b = shelf_with(
        "127.0.0.1:0",
        Arc::new(RamVolume::new(8 << 20, 4096).unwrap()),
        [0x88; 16],
    );
    let mut n = Nacred::start_args(&["--no-default"]);
    n.ok("remote_attach", attach_params("a1", shelf_a.addr.port()));
    n.ok("remote_attach", attach_params("a2", second_portal.port()));
    // shelf_b exports the same NQN and NSID, but it is another namespace (its own NGUID).
    n.ok("remote_attach", attach_params("b", shelf_b.addr.port()));
    let mp = n.ok(
        "volume_create",
        json!({"name": "mp", "backend": "remote", "size": 0,
               "remote": {"extents": ["a1:1+a2:1"], "multipath": "round_robin"}}),
    );
    assert_eq!(mp["size"], 8u64 << 20);
    assert_eq!(mp["remote"]["multipath"], "round_robin");
    let st = n.ok(
        "volume_create",
        json!({"name": "st", "backend": "remote", "size": 0,
               "remote": {"extents": ["a1:1", "b:1"], "stripe_size": 65536}}),
    );
    assert_eq!(
        st["size"],
        16u64 << 20,
        "a stripe over two shelves holds both"
    );
    for name in ["mp", "st"] {
        n.ok("vhost_blk_create", json!({"name": name, "volume": name}));
        let mut c = BlkioClient::connect(
            &n.run_dir.join(format!("vhost-{name}.sock")),
            &ClientOptions::default(),
        )
        .unwrap();
        let mut q = c.take_queues().remove(0);
        let d = pattern(9, 0, 1 << 20);
        let buf = &mut c.mem()[..d.len()];
        buf.copy_from_slice(&d);
        assert_eq!(write(&mut q, 2 << 20, buf).unwrap(), 0);
        buf.fill(0);
        assert_eq!(read(&mut q, 2 << 20, buf).unwrap(), 0);
        assert!(buf[..] == d[..], "{name} reads back what was written");
    }
    // The stripe put its second 64 KiB unit of that write on shelf b.
    let mut unit = vec![0u8; 65536];
    shelf_b.vol.read_at(1 << 20, &mut unit).unwrap();
    assert!(unit[..] == pattern(9, 0, 1 << 20)[65536..131072]);
    // Paths of one extent must be the same namespace (here a1:1 and b:1 share NQN and NSID
    // but not the namespace).
    let (_, msg) = n.err(
        "volume_create",
        json!({"name": "bad", "backend": "remote", "size": 0,
               "remote": {"extents": ["a1:1+b:1"]}}),
    );
    assert!(msg.contains("not the same namespace"), "{msg}");
    // Extents of one stripe must be different namespaces, whether named twice or reached
    // through two portals (same NGUID): otherwise two stripe units land on the same blocks.
    for extents in [json!(["a1:1", "a1:1"]), json!(["a1:1", "b:1", "a2:1"])] {
        let (_, msg) = n.err(
            "volume_create",
            json!({"name": "bad", "backend": "remote", "size": 0,
                   "remote": {"extents": extents}}),
        );
        assert!(msg.contains("already an extent"), "{extents}: {msg}");
    }
    let l = n.ok("remote_list", json!({"name": "a1"}));
    assert_eq!(l[0]["used_by"], json!(["mp", "st"]));
    // Everything is replayed after a restart: remotes reconnect in the background, the
    // layouts reopen over them and the devices serve the same data.
    n.restart();
    for name in ["mp", "st"] {
        let mut c = BlkioClient::connect(
            &n.run_dir.join(format!("vhost-{name}.sock")),
            &ClientOptions::default(),
        )
        .unwrap();
        let mut q = c.take_queues().remove(0);
        let buf = &mut c.mem()[..1 << 20];
        assert_eq!(read(&mut q, 2 << 20, buf).unwrap(), 0);
        assert!(
            buf[..] == pattern(9, 0, 1 << 20)[..],
            "{name} after restart"
        );
    }
}

/// A shelf link that drops and comes back, again and again (a flapping switch port, shelf
/// failovers), must not leave sockets or threads of dead connections behind in nacred: each
/// reconnect opens an admin and two I/O queues anew.
#[test]
fn a_flapping_shelf_link_leaks_no_descriptors_or_threads() {
    use nacre_tests::fabric_support::Proxy;
    let shelf = shelf_on(
        "127.0.0.1:0",
        Arc::new(RamVolume::new(8 << 20, 512).unwrap()),
    );
    let proxy = Proxy::start(shelf.addr);
    let n = Nacred::start_args(&["--no-default"]);
    n.ok("remote_attach", attach_params("s", proxy.port()));
    n.ok(
        "volume_create",
        json!({"name": "rv", "backend": "remote", "size": 0, "remote": {"extents": ["s:1"]}}),
    );
    let state = || n.ok("remote_list", Value::Null)[0]["state"].clone();
    let wait_state = |want: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while state() != want {
            assert!(
                Instant::now() < deadline,
                "remote never {want}: {}\n{}",
                state(),
                n.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let flap = || {
        proxy.sever();
        wait_state("connecting");
        proxy.restore();
        wait_state("live");
    };
    flap();
    let before = n.settled_footprint(|| true);
    const FLAPS: usize = 6;
    for _ in 0..FLAPS {
        flap();
    }
    let after = n.footprint_back_to(before, || true);
    after.assert_no_more_than(before, FLAPS, "reconnects");
    // the controller is live at the end (I/O across flaps: fabric_failure.rs)
    assert_eq!(state(), "live");
    drop(shelf);
}
