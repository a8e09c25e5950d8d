//! `remote_attach` over NVMe/RDMA that cannot connect: one clear error, by RPC and by CLI,
//! nothing half-attached, and nacred goes on serving. On a machine without RDMA devices (the
//! development machine and CI) the error says that NVMe/RDMA needs one; on a machine with
//! devices the same test attaches to a loopback port nobody listens on and checks the same
//! properties of the error it gets instead. The NVMe/RDMA initiator itself is exercised
//! against the kernel's nvmet-rdma target on soft-RoCE in the QEMU test bed
//! (tests/testbed.rs, scenario nvmf-rdma-initiator).

use std::sync::Arc;

use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::ram::RamVolume;
use nacre_shared::rpc;
use nacre_tests::daemon::Nacred;
use serde_json::{json, Value};

const NQN: &str = "nqn.2024-01.io.nacre:shelf-rdma";

/// Where to attach: without RDMA devices any address fails before a packet leaves; with
/// them, a loopback port with no listener, so nothing is sent beyond this machine.
fn unreachable_address() -> (&'static str, u16) {
    if no_rdma_here() {
        ("192.0.2.10", 4420)
    } else {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        ("127.0.0.1", port)
    }
}

fn attach(name: &str, transport: &str) -> Value {
    json!({"name": name, "transport": transport, "address": "192.0.2.10", "port": 4420,
           "subnqn": NQN, "io_queues": 1, "queue_depth": 16})
}

fn no_rdma_here() -> bool {
    nacre_dpu::rdma::device_count() == 0
}

/// The part of the error that depends on whether this machine has RDMA devices.
fn assert_names_the_cause(msg: &str) {
    if no_rdma_here() {
        assert!(msg.contains("NVMe/RDMA needs an RDMA device"), "{msg}");
    }
}

#[test]
fn attaching_over_rdma_that_cannot_connect_is_one_clear_error_and_nacred_keeps_serving() {
    let n = Nacred::start_args(&["--no-default"]);
    let (address, port) = unreachable_address();
    let mut p = attach("r", "rdma");
    p["address"] = json!(address);
    p["port"] = json!(port);
    let (code, msg) = n.err("remote_attach", p);
    assert_eq!(code, rpc::OPERATION_FAILED, "{msg}");
    assert!(msg.contains("cannot attach remote \"r\""), "{msg}");
    assert_names_the_cause(&msg);
    assert_eq!(msg.lines().count(), 1, "{msg}");
    assert_eq!(
        n.ok("remote_list", Value::Null),
        json!([]),
        "nothing half-attached"
    );
    // Discovery over RDMA: the same clear error.
    let (code, msg) = n.err(
        "remote_discover",
        json!({"transport": "rdma", "address": address, "port": port}),
    );
    assert_eq!(code, rpc::OPERATION_FAILED, "{msg}");
    assert_eq!(msg.lines().count(), 1, "{msg}");
    assert_names_the_cause(&msg);

    // The CLI: one line on stderr, a failing exit status.
    let port = port.to_string();
    let out = n.cli(&[
        "remote",
        "attach",
        "r",
        "--transport",
        "rdma",
        "--address",
        address,
        "--port",
        &port,
        "--subnqn",
        NQN,
    ]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(e.contains("cannot attach remote \"r\""), "{e}");
    assert_names_the_cause(&e);

    // nacred is unharmed: it still creates and lists things.
    n.ok(
        "volume_create",
        json!({"name": "v", "size": 1048576, "backend": "ram"}),
    );
    assert_eq!(n.ok("volume_list", Value::Null)[0]["name"], "v");
}

#[test]
fn bad_transports_and_tcp_only_options_are_refused_before_connecting() {
    let n = Nacred::start_args(&["--no-default"]);
    for t in ["RDMA", "roce", "", "tcp "] {
        let (code, msg) = n.err("remote_attach", attach("r", t));
        assert_eq!(code, rpc::INVALID_PARAMS, "{t:?}: {msg}");
        assert!(msg.contains("\"tcp\" or \"rdma\""), "{t:?}: {msg}");
    }
    let mut p = attach("r", "rdma");
    p["header_digest"] = json!(true);
    let (code, msg) = n.err("remote_attach", p);
    assert_eq!(code, rpc::INVALID_PARAMS);
    assert!(msg.contains("NVMe/TCP features"), "{msg}");
    let (code, _) = n.err(
        "remote_discover",
        json!({"transport": "ib", "address": "192.0.2.10"}),
    );
    assert_eq!(code, rpc::INVALID_PARAMS);
    // The CLI refuses a bad word itself, before any RPC.
    let out = n.cli(&[
        "remote",
        "attach",
        "r",
        "--transport",
        "roce",
        "--address",
        "192.0.2.10",
        "--subnqn",
        NQN,
    ]);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("invalid value 'roce'"), "{e}");
}

#[test]
fn remote_attach_help_teaches_rdma() {
    let out = std::process::Command::new(nacre_tests::daemon::bin("nacre"))
        .args(["remote", "attach", "--help"])
        .output()
        .expect("run nacre");
    let raw = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{raw}");
    // clap wraps long lines: compare with whitespace runs collapsed
    let h = raw.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(h.contains("possible values: tcp, rdma"), "{h}");
    assert!(
        h.contains("--transport rdma --address"),
        "an example over RDMA: {h}"
    );
    assert!(
        h.contains("rdma link add rxe0 type rxe"),
        "how to get soft-RoCE: {h}"
    );
}

/// The same subsystem at the same portal over the other transport is another path (a shelf's
/// RoCE and TCP ports share address and port number), not a duplicate; over the same one it is.
#[test]
fn the_same_portal_over_another_transport_is_not_a_duplicate() {
    let target = NvmfTarget::new();
    target
        .create_subsystem(NQN, "SHELFRDMA", "nacre shelf", true)
        .unwrap();
    let vol = Arc::new(RamVolume::new(8 << 20, 512).unwrap());
    target
        .add_namespace(NQN, Some(1), vol, [0x55; 16], "v".into())
        .unwrap();
    let addr = target
        .add_listener(NQN, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    let n = Nacred::start_args(&["--no-default"]);
    let tcp = |name: &str| {
        json!({"name": name, "transport": "tcp", "address": "127.0.0.1", "port": addr.port(),
               "subnqn": NQN, "io_queues": 1, "queue_depth": 16})
    };
    assert_eq!(n.ok("remote_attach", tcp("t"))["state"], "live");
    let (code, msg) = n.err("remote_attach", tcp("t2"));
    assert_eq!(code, rpc::BUSY, "{msg}");
    assert!(
        msg.contains("already connects") && msg.contains("over tcp"),
        "{msg}"
    );
    let mut rdma = tcp("r");
    rdma["transport"] = json!("rdma");
    let (code, msg) = n.err("remote_attach", rdma);
    assert_ne!(code, rpc::BUSY, "{msg}");
    assert_names_the_cause(&msg);
}
