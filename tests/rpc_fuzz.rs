//! Seeded random RPC calls against the real nacred: every method, with parameters drawn
//! from what the method accepts (learned from its own "unknown field" error) and values near
//! the edges — wrong types, empty and overlong names, path tricks, zero and huge sizes,
//! out-of-range counts, bad enums, nested objects.
//!
//! What must hold: every call gets a JSON-RPC reply (a result or an error with a code and a
//! message), never a dropped connection; nacred stays up; and whatever configuration the
//! calls left behind, nacred restarts from its state directory — after an orderly stop and
//! after a SIGKILL — with the same volumes, tenants and devices.
//!
//! Paths are drawn only from inside the test's own directory, addresses only from loopback.
//! NACRE_FUZZ_SEED=N and NACRE_FUZZ_CASES=N change the run.

use nacre_shared::rpc::ClientError;
use nacre_tests::daemon::Nacred;
use nacre_tests::fuzz::{env_u64, Rng, RpcGen};
use serde_json::{json, Map, Value};

/// The fields a method's params accept, from serde's "unknown field `x`, expected one of
/// `a`, `b`" (or "expected `a`") message.
fn fields_of(n: &Nacred, method: &str) -> Vec<String> {
    match n.call(method, json!({"__probe__": 1})) {
        Err(ClientError::Rpc { message, .. }) if message.contains("unknown field") => {
            let tail = message.split("expected").nth(1).unwrap_or("");
            tail.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect()
        }
        // Methods without params (or that ignore an object) have nothing to learn.
        _ => Vec::new(),
    }
}

/// The configuration a restart must reproduce.
fn snapshot(n: &Nacred) -> Value {
    let mut out = Map::new();
    for m in [
        "volume_list",
        "tenant_list",
        "vhost_blk_list",
        "nvmf_get_subsystems",
    ] {
        let mut v = n.ok(m, json!({}));
        // Live counters are not configuration.
        strip(
            &mut v,
            &[
                "connected",
                "clients",
                "controllers",
                "state",
                "stats",
                "hosts_connected",
            ],
        );
        out.insert(m.into(), v);
    }
    Value::Object(out)
}

fn strip(v: &mut Value, keys: &[&str]) {
    match v {
        Value::Object(m) => {
            for k in keys {
                m.remove(*k);
            }
            m.values_mut().for_each(|x| strip(x, keys));
        }
        Value::Array(a) => a.iter_mut().for_each(|x| strip(x, keys)),
        _ => {}
    }
}

#[test]
fn random_rpc_calls_get_replies_and_leave_a_restartable_state() {
    let mut n = Nacred::start_args(&["--no-default"]);
    let dir = n.state_dir.parent().unwrap().join("fuzz");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kek"), [0x11u8; 32]).unwrap();
    std::fs::write(dir.join("kek31"), [0x22u8; 31]).unwrap();
    use std::os::unix::fs::PermissionsExt;
    for f in ["kek", "kek31"] {
        std::fs::set_permissions(dir.join(f), std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let methods: Vec<String> = serde_json::from_value(n.ok("rpc_get_methods", json!({}))).unwrap();
    let fields: Vec<(String, Vec<String>)> = methods
        .iter()
        .map(|m| (m.clone(), fields_of(&n, m)))
        .collect();
    assert!(
        fields.iter().filter(|(_, f)| !f.is_empty()).count() > 10,
        "could not learn the methods' parameters: {fields:?}"
    );
    let mut g = RpcGen {
        rng: Rng::new(env_u64("NACRE_FUZZ_SEED", 0x7270_6366_757a_7a21)),
        dir: dir.to_str().unwrap().to_string(),
    };
    let calls = env_u64("NACRE_FUZZ_CASES", 600);
    let mut answered_ok = 0;
    for i in 0..calls {
        let (method, keys) = g.rng.pick(&fields);
        let params = g.params(&method, &keys);
        match n.call(&method, params.clone()) {
            Ok(_) => answered_ok += 1,
            Err(ClientError::Rpc { code, message }) => {
                assert!(code < 0, "call {i}: {method} {params}: error code {code}");
                assert!(
                    !message.is_empty(),
                    "call {i}: {method} {params}: empty error"
                );
            }
            Err(e) => panic!(
                "call {i}: {method} {params}: no JSON-RPC reply: {e}\n{}",
                n.log_text()
            ),
        }
    }
    assert!(
        answered_ok > calls / 20,
        "only {answered_ok} of {calls} calls succeeded: the generator is not reaching the handlers"
    );
    let before = snapshot(&n);
    let configured: usize = before
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_array().map_or(0, Vec::len))
        .sum();
    assert!(
        configured > 0,
        "the calls left nothing for the restart to replay"
    );
    n.restart();
    assert_eq!(
        snapshot(&n),
        before,
        "an orderly restart lost configuration"
    );
    n.crash_restart();
    assert_eq!(snapshot(&n), before, "a crash restart lost configuration");
}
