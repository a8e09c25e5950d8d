//! The control plane as an operator's tools see it: JSON-RPC 2.0 on nacred's Unix socket,
//! every method, the errors bad parameters get, and state that survives restarts and crashes.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;

use nacre_shared::rpc;
use nacre_tests::daemon::Nacred;
use nacre_tests::nvmf_host::{HostOptions, NvmfHost};
use serde_json::{json, Value};

fn volume_names(n: &Nacred) -> Vec<String> {
    n.ok("volume_list", Value::Null)
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn fresh_daemon_has_the_embedded_default() {
    let n = Nacred::start();
    let vols = n.ok("volume_list", Value::Null);
    assert_eq!(vols.as_array().unwrap().len(), 1, "{vols}");
    let v = &vols[0];
    assert_eq!(v["name"], "default");
    assert_eq!(v["size"], 1u64 << 30);
    assert_eq!(v["backend"], "file");
    assert_eq!(
        v["exported_by"],
        json!(["vhost-blk:default", "nvmf:nqn.2014-08.io.nacre:default/1"])
    );
    let img = n.state_dir.join("volumes/default.img");
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 1 << 30);
    let devs = n.ok("vhost_blk_list", Value::Null);
    assert_eq!(devs[0]["name"], "default");
    assert_eq!(
        devs[0]["socket"],
        n.run_dir.join("vhost-default.sock").display().to_string()
    );
    assert!(n
        .log_text()
        .contains("vhost-user-blk-pci,chardev=nacre-default"));

    // ... and exports it over NVMe/TCP as namespace 1 of the default subsystem, open to any
    // host (the harness asks for port 0 instead of 4420: tests run in parallel).
    let subs = n.ok("nvmf_get_subsystems", Value::Null);
    let sub = subs
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == "nqn.2014-08.io.nacre:default")
        .unwrap_or_else(|| panic!("no default subsystem in {subs}"));
    assert_eq!(sub["namespaces"][0]["nsid"], 1, "{sub}");
    assert_eq!(sub["namespaces"][0]["name"], "default", "{sub}");
    let log = n.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("nvme connect -t tcp -a 127.0.0.1 -s "))
        .unwrap_or_else(|| panic!("no nvme connect hint in:\n{log}"));
    let port: u16 = line
        .split(" -s ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_ne!(port, 0);
    let mut h = NvmfHost::connect(
        ([127, 0, 0, 1], port).into(),
        "nqn.2014-08.io.nacre:default",
        HostOptions::default(),
    )
    .unwrap();
    let id = h.identify_controller().unwrap();
    assert_eq!(
        id.serial,
        v["serial"].as_str().unwrap(),
        "same serial as virtio GET_ID"
    );
    assert_eq!(h.active_namespaces().unwrap(), [1]);
    let ns = h.identify_namespace(1).unwrap();
    assert_eq!(ns.nsze, (1u64 << 30) / 4096);
}

#[test]
fn no_default_flag_starts_empty() {
    let n = Nacred::start_args(&["--no-default"]);
    assert!(volume_names(&n).is_empty());
}

#[test]
fn rpc_socket_is_private() {
    let n = Nacred::start();
    let mode = std::fs::metadata(&n.rpc).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let mode = std::fs::metadata(&n.state_dir)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
}

#[test]
fn every_method_round_trips() {
    let n = Nacred::start_args(&["--no-default"]);
    let methods = n.ok("rpc_get_methods", Value::Null);
    for m in [
        "rpc_get_methods",
        "volume_create",
        "volume_list",
        "volume_delete",
        "volume_resize",
        "vhost_blk_create",
        "vhost_blk_list",
        "vhost_blk_delete",
    ] {
        assert!(
            methods.as_array().unwrap().contains(&json!(m)),
            "{m} missing"
        );
    }
    let verbose = n.ok("rpc_get_methods", json!({"verbose": true}));
    assert!(verbose[0]["help"].as_str().unwrap().len() > 10);

    let v = n.ok(
        "volume_create",
        json!({"name": "r", "size": 8 << 20, "block_size": 512, "backend": "ram"}),
    );
    assert_eq!(v["block_size"], 512);
    assert_eq!(v["serial"].as_str().unwrap().len(), 20);
    n.ok("volume_create", json!({"name": "f", "size": 4 << 20}));
    n.ok(
        "volume_create",
        json!({"name": "z", "size": 4 << 20, "backend": "null"}),
    );
    assert_eq!(volume_names(&n), ["f", "r", "z"]);
    assert_eq!(
        n.ok("volume_list", json!({"name": "f"}))[0]["backend"],
        "file"
    );

    let sock = n.run_dir.join("custom.sock");
    let d = n.ok(
        "vhost_blk_create",
        json!({"name": "d", "volume": "r", "queues": 2, "socket": sock.display().to_string()}),
    );
    assert_eq!(d["queues"], 2);
    assert!(sock.exists());
    assert_eq!(
        n.ok("volume_list", json!({"name": "r"}))[0]["exported_by"],
        json!(["vhost-blk:d"])
    );
    assert_eq!(n.ok("vhost_blk_list", Value::Null)[0]["name"], "d");

    let r = n.ok("volume_resize", json!({"name": "r", "size": 16 << 20}));
    assert_eq!(r["size"], 16 << 20);
    n.ok("vhost_blk_delete", json!({"name": "d"}));
    assert!(!sock.exists(), "socket removed with the device");
    assert!(n
        .ok("vhost_blk_list", Value::Null)
        .as_array()
        .unwrap()
        .is_empty());
    n.ok("volume_resize", json!({"name": "r", "size": 4 << 20}));

    let f_img = n.state_dir.join("volumes/f.img");
    assert!(f_img.exists());
    n.ok("volume_delete", json!({"name": "f", "delete_data": true}));
    assert!(!f_img.exists());
    n.ok("volume_delete", json!({"name": "r"}));
    assert_eq!(volume_names(&n), ["z"]);
}

#[test]
fn bad_params_say_what_to_fix() {
    let n = Nacred::start_args(&["--no-default"]);
    let cases: Vec<(&str, Value, i64, &str)> = vec![
        (
            "volume_create",
            json!({"name": "a"}),
            rpc::INVALID_PARAMS,
            "size is required",
        ),
        (
            "volume_create",
            json!({"name": "a", "size": 4096, "colour": 1}),
            rpc::INVALID_PARAMS,
            "unknown field `colour`",
        ),
        (
            "volume_create",
            json!({"name": "a", "size": "1G"}),
            rpc::INVALID_PARAMS,
            "invalid type",
        ),
        (
            "volume_create",
            json!({"name": "a/b", "size": 4096}),
            rpc::INVALID_PARAMS,
            "name \"a/b\" is invalid",
        ),
        (
            "volume_create",
            json!({"name": "a", "size": 0}),
            rpc::INVALID_PARAMS,
            "positive multiple",
        ),
        (
            "volume_create",
            json!({"name": "a", "size": 4097}),
            rpc::INVALID_PARAMS,
            "multiple of the block size 4096",
        ),
        (
            "volume_create",
            json!({"name": "a", "size": 4096, "block_size": 1024}),
            rpc::INVALID_PARAMS,
            "512 or 4096",
        ),
        (
            "volume_create",
            json!({"name": "a", "size": 4096, "backend": "tape"}),
            rpc::INVALID_PARAMS,
            "unknown variant `tape`",
        ),
        (
            "volume_create",
            json!({"name": "a", "size": 4096, "backend": "ram", "path": "/x"}),
            rpc::INVALID_PARAMS,
            "only applies to file",
        ),
        (
            "volume_create",
            json!({"name": "a", "size": 4096, "path": "rel.img"}),
            rpc::INVALID_PARAMS,
            "must be absolute",
        ),
        (
            "volume_delete",
            json!({"name": "nope"}),
            rpc::NOT_FOUND,
            "volume \"nope\" does not exist",
        ),
        (
            "volume_resize",
            json!({"name": "nope", "size": 4096}),
            rpc::NOT_FOUND,
            "does not exist",
        ),
        (
            "volume_list",
            json!({"name": "nope"}),
            rpc::NOT_FOUND,
            "does not exist",
        ),
        (
            "vhost_blk_create",
            json!({"name": "d", "volume": "nope"}),
            rpc::NOT_FOUND,
            "volume \"nope\"",
        ),
        (
            "vhost_blk_delete",
            json!({"name": "nope"}),
            rpc::NOT_FOUND,
            "does not exist",
        ),
        (
            "vhost_blk_list",
            json!({"name": "x"}),
            rpc::INVALID_PARAMS,
            "unknown field",
        ),
        (
            "no_such_method",
            Value::Null,
            rpc::METHOD_NOT_FOUND,
            "rpc_get_methods",
        ),
    ];
    for (method, params, code, needle) in cases {
        let (c, m) = n.err(method, params.clone());
        assert_eq!(c, code, "{method} {params}: {m}");
        assert!(
            m.contains(needle),
            "{method} {params}: {m:?} lacks {needle:?}"
        );
    }
    n.ok(
        "volume_create",
        json!({"name": "v", "size": 1 << 20, "backend": "ram"}),
    );
    for (params, needle) in [
        (
            json!({"name": "d", "volume": "v", "queues": 0}),
            "queues must be between 1 and",
        ),
        (
            json!({"name": "d", "volume": "v", "queue_size": 1000}),
            "power of two",
        ),
        (
            json!({"name": "d", "volume": "v", "socket": "x.sock"}),
            "absolute path",
        ),
    ] {
        let (c, m) = n.err("vhost_blk_create", params);
        assert_eq!(c, rpc::INVALID_PARAMS);
        assert!(m.contains(needle), "{m}");
    }
    let (c, _) = n.err("volume_create", json!({"name": "v", "size": 4096}));
    assert_eq!(c, rpc::ALREADY_EXISTS);
    n.ok("vhost_blk_create", json!({"name": "d", "volume": "v"}));
    let (c, m) = n.err("volume_delete", json!({"name": "v"}));
    assert_eq!(c, rpc::BUSY);
    assert!(m.contains("vhost-blk:d"), "{m}");
    let (c, m) = n.err("volume_resize", json!({"name": "v", "size": 4096}));
    assert_eq!(c, rpc::BUSY, "{m}");
    let (c, _) = n.err("vhost_blk_create", json!({"name": "d", "volume": "v"}));
    assert_eq!(c, rpc::ALREADY_EXISTS);
    // Nothing half-created: the failed calls left exactly what the good ones made.
    assert_eq!(volume_names(&n), ["v"]);
    assert_eq!(
        n.ok("vhost_blk_list", Value::Null)
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

/// Raw protocol: what a hand-written client (or SPDK's rpc.py style) sends.
#[test]
fn json_rpc_envelope_rules() {
    let n = Nacred::start_args(&["--no-default"]);
    let mut s = UnixStream::connect(&n.rpc).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut ask = |req: &str| -> Value {
        s.write_all(req.as_bytes()).unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    };
    let v = ask(r#"{"jsonrpc":"2.0","method":"volume_list","id":7}"#);
    assert_eq!(v["id"], 7);
    assert_eq!(v["result"], json!([]));
    let v = ask(r#"{"jsonrpc":"1.0","method":"volume_list","id":1}"#);
    assert_eq!(v["error"]["code"], rpc::INVALID_REQUEST);
    let v = ask(r#"{"jsonrpc":"2.0","id":2}"#);
    assert_eq!(v["error"]["code"], rpc::INVALID_REQUEST);
    let v = ask(r#"{"jsonrpc":"2.0","method":"volume_list","params":[1],"id":3}"#);
    assert_eq!(v["error"]["code"], rpc::INVALID_PARAMS);
    let v = ask(r#"[1]"#);
    assert_eq!(v[0]["error"]["code"], rpc::INVALID_REQUEST);
    // A notification gets no reply; the next request's reply comes straight after.
    // Concatenated objects without newlines are fine, too.
    let v = ask(
        r#"{"jsonrpc":"2.0","method":"volume_list"}{"jsonrpc":"2.0","method":"rpc_get_methods","id":"x"}"#,
    );
    assert_eq!(v["id"], "x");
    let v = ask(
        r#"[{"jsonrpc":"2.0","method":"volume_list","id":1},{"jsonrpc":"2.0","method":"nope","id":2}]"#,
    );
    assert_eq!(v[0]["result"], json!([]));
    assert_eq!(v[1]["error"]["code"], rpc::METHOD_NOT_FOUND);
    // Invalid JSON: a parse error, then the connection closes; the daemon lives on.
    let v = ask("{\"jsonrpc\": oops}\n");
    assert_eq!(v["error"]["code"], rpc::PARSE_ERROR);
    let mut rest = String::new();
    assert_eq!(r.read_line(&mut rest).unwrap(), 0);
    assert!(volume_names(&n).is_empty());
}

#[test]
fn state_survives_orderly_restart_and_crash() {
    let mut n = Nacred::start();
    n.ok(
        "volume_create",
        json!({"name": "keep", "size": 2 << 20, "block_size": 512}),
    );
    n.ok(
        "vhost_blk_create",
        json!({"name": "kd", "volume": "keep", "queues": 3}),
    );
    let before = n.ok("volume_list", Value::Null);
    n.restart();
    assert_eq!(n.ok("volume_list", Value::Null), before);
    n.crash_restart();
    assert_eq!(n.ok("volume_list", Value::Null), before);
    let devs = n.ok("vhost_blk_list", Value::Null);
    let kd = devs
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "kd")
        .expect("kd replayed");
    assert_eq!(kd["queues"], 3);
    assert!(std::path::Path::new(kd["socket"].as_str().unwrap()).exists());
    // The default is not re-created once the operator has configured anything.
    n.ok("vhost_blk_delete", json!({"name": "default"}));
    let (code, msg) = n.err("volume_delete", json!({"name": "default"}));
    assert_eq!(code, rpc::BUSY, "still exported over NVMe/TCP: {msg}");
    n.ok(
        "nvmf_subsystem_delete",
        json!({"nqn": "nqn.2014-08.io.nacre:default"}),
    );
    n.ok("volume_delete", json!({"name": "default"}));
    n.crash_restart();
    let names = volume_names(&n);
    assert_eq!(names, ["keep"]);
}
