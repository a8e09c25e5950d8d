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
use nacre_tests::fuzz::{env_u64, Rng};
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

struct Gen {
    rng: Rng,
    dir: String,
}

impl Gen {
    fn name(&mut self) -> Value {
        let long = "x".repeat(300);
        json!(self.rng.pick(&[
            "v0", "v1", "v2", "t0", "t1", "d0", "shelf", "v0", "t0", "", "../v0", "a/b", "ü",
            &long, "v0 ", "-", "."
        ]))
    }
    fn nqn(&mut self) -> Value {
        json!(self.rng.pick(&[
            "nqn.2024-01.io.nacre:f0",
            "nqn.2024-01.io.nacre:f1",
            "nqn.2014-08.org.nvmexpress.discovery",
            "nqn.bad",
            "",
            "nqn.2024-01.io.nacre:f0:with spaces",
        ]))
    }
    fn path(&mut self) -> Value {
        let d = self.dir.clone();
        json!(self.rng.pick(&[
            format!("{d}/a.img"),
            format!("{d}/b.img"),
            format!("{d}/kek"),
            format!("{d}/kek31"),
            format!("{d}/export.key"),
            format!("{d}/missing/x"),
            format!("{d}/s.sock"),
            d.clone(),
            "rel.img".to_string(),
            String::new(),
        ]))
    }
    fn number(&mut self) -> Value {
        match self.rng.below(12) {
            0 => json!(-1),
            1 => json!(1.5),
            2 => json!(u64::MAX),
            3 => json!(u32::MAX),
            4 => json!(0),
            5 => json!(65536),
            _ => json!(self.rng.pick(&[1u64, 2, 4, 8, 16, 128, 512, 1023, 4096])),
        }
    }
    fn size(&mut self) -> Value {
        match self.rng.below(8) {
            0 => json!(self
                .rng
                .pick(&["1M", "16M", "1G", "abc", "-1", "1.5G", "64P"])),
            1 => self.number(),
            _ => json!(self
                .rng
                .pick(&[1u64 << 20, 4 << 20, (1 << 20) + 512, 512, 0, 1 << 62])),
        }
    }
    fn wrong_type(&mut self) -> Value {
        match self.rng.below(5) {
            0 => Value::Null,
            1 => json!([1, "a"]),
            2 => json!({"x": 1}),
            3 => json!(true),
            _ => json!("?"),
        }
    }
    fn kek(&mut self) -> Value {
        let mut m = Map::new();
        match self.rng.below(4) {
            0 => {
                m.insert("passphrase".into(), json!(self.rng.pick(&["pw", ""])));
                if self.rng.chance(2) {
                    let v = self.rng.pick(&[0u64, 7, 8, 64, 1024, u32::MAX as u64]);
                    m.insert("argon2_m_cost_kib".into(), json!(v));
                }
                if self.rng.chance(2) {
                    let v = self.rng.pick(&[0u64, 1, 2, 65, u32::MAX as u64]);
                    m.insert("argon2_t_cost".into(), json!(v));
                }
            }
            1 => {
                m.insert("key_file".into(), self.path());
                m.insert("passphrase".into(), json!("pw"));
            }
            _ => {
                let d = self.dir.clone();
                let f = if self.rng.chance(4) { "kek31" } else { "kek" };
                m.insert("key_file".into(), json!(format!("{d}/{f}")));
            }
        }
        Value::Object(m)
    }
    fn policy(&mut self) -> Value {
        let mut m = Map::new();
        for (k, vals) in [
            (
                "cipher",
                vec![json!("aes-xts-256"), json!("aes-xts-128"), json!("des")],
            ),
            (
                "data_unit",
                vec![json!(512), json!(4096), json!(1024), json!(0)],
            ),
            (
                "tweak",
                vec![json!("plain64"), json!("be64"), json!("be32")],
            ),
            (
                "require_encryption",
                vec![json!(true), json!(false), json!(1)],
            ),
        ] {
            if self.rng.chance(2) {
                m.insert(k.into(), self.rng.pick(&vals));
            }
        }
        Value::Object(m)
    }
    /// A plausible value for parameter `key`: what an operator would send, so that calls
    /// reach deep into the handlers and build up configuration.
    fn good(&mut self, method: &str, key: &str) -> Option<Value> {
        let d = self.dir.clone();
        Some(match key {
            "name" if method.starts_with("tenant") => json!(self.rng.pick(&["t0", "t1"])),
            "name" if method.starts_with("vhost") => json!(self.rng.pick(&["d0", "d1"])),
            "name" | "volume" => json!(self.rng.pick(&["v0", "v1", "v2"])),
            "tenant" => json!(self.rng.pick(&["t0", "t1"])),
            "path" if method == "volume_create" && self.rng.chance(2) => return None,
            "nqn" | "subnqn" => json!(self
                .rng
                .pick(&["nqn.2024-01.io.nacre:f0", "nqn.2024-01.io.nacre:f1"])),
            "host" | "hostnqn" => json!("nqn.2024-01.io.nacre:host"),
            "size" | "new_size" => json!(self.rng.pick(&[1u64 << 20, 4 << 20, 8 << 20])),
            "block_size" => json!(self.rng.pick(&[512, 4096])),
            "backend" => json!(self.rng.pick(&["ram", "null", "file"])),
            "path" => json!(self
                .rng
                .pick(&[format!("{d}/a.img"), format!("{d}/export.key")])),
            "socket" => json!(format!("{d}/s{}.sock", self.rng.below(3))),
            "kek" | "new_kek" => json!({"key_file": format!("{d}/kek")}),
            "policy" => self.policy(),
            "cipher" => json!("aes-xts-256"),
            "data_unit" => json!(self.rng.pick(&[512, 4096])),
            "tweak" => json!(self.rng.pick(&["plain64", "be64"])),
            "address" => json!("127.0.0.1"),
            "port" => json!(0),
            "transport" => json!("tcp"),
            "queues" | "io_queues" => json!(self.rng.pick(&[1, 2])),
            "queue_size" | "queue_depth" => json!(self.rng.pick(&[32, 128])),
            "nsid" => json!(self.rng.pick(&[1, 2])),
            "confirm" | "allow_any_host" => json!(true),
            "encrypt" | "read_only" | "force" | "delete_data" | "verbose"
            | "require_encryption" | "header_digest" | "data_digest" => json!(self.rng.chance(2)),
            _ => return None,
        })
    }

    /// A value for parameter `key`, near the edges.
    fn value(&mut self, key: &str) -> Value {
        if self.rng.chance(12) {
            return self.wrong_type();
        }
        let k = key;
        if k.contains("path") || k.contains("file") || k == "socket" || k.contains("dir") {
            return self.path();
        }
        match k {
            "kek" | "new_kek" => self.kek(),
            "policy" => self.policy(),
            "nqn" | "subnqn" | "hostnqn" | "host" => self.nqn(),
            "address" | "traddr" => {
                json!(self
                    .rng
                    .pick(&["127.0.0.1", "::1", "", "not-an-address", "127.0.0.1:9"]))
            }
            "port" | "trsvcid" => json!(self.rng.pick(&[0i64, 65535, 70000, -1])),
            "size" | "new_size" | "stripe_size" => self.size(),
            "block_size" | "data_unit" => json!(self.rng.pick(&[512u64, 4096, 0, 1000, 1 << 30])),
            "backend" => json!(self.rng.pick(&["ram", "null", "file", "remote", "bogus"])),
            "transport" | "trtype" => json!(self.rng.pick(&["tcp", "rdma", "TCP", ""])),
            "multipath" => json!(self.rng.pick(&["failover", "round_robin", "x"])),
            "cipher" | "tweak" => self.policy()[k].clone(),
            "extents" => {
                let e = self
                    .rng
                    .pick(&["shelf:1", "shelf:1+shelf:2", "x", "shelf:0", ":"]);
                json!([e, e])
            }
            "passphrase" => json!(self.rng.pick(&["pw", ""])),
            _ if k.starts_with("name") || k == "volume" || k == "tenant" || k == "device" => {
                self.name()
            }
            _ if self.rng.chance(3) => json!(self.rng.chance(2)),
            _ => self.number(),
        }
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
    let mut g = Gen {
        rng: Rng::new(env_u64("NACRE_FUZZ_SEED", 0x7270_6366_757a_7a21)),
        dir: dir.to_str().unwrap().to_string(),
    };
    let calls = env_u64("NACRE_FUZZ_CASES", 600);
    let mut answered_ok = 0;
    for i in 0..calls {
        let (method, keys) = g.rng.pick(&fields);
        let mut params = Map::new();
        // Two calls in three are plausible (every field an operator would give, one of them
        // sometimes off); the rest are edge values throughout, fields left out at random.
        let plausible = !g.rng.chance(3);
        let odd_one = g.rng.below(keys.len() as u64 * 3) as usize;
        for (j, k) in keys.iter().enumerate() {
            let v = if plausible && j != odd_one {
                g.good(&method, k)
            } else if g.rng.chance(4) {
                None
            } else {
                Some(g.value(k))
            };
            if let Some(v) = v {
                params.insert(k.clone(), v);
            }
        }
        if g.rng.chance(20) {
            params.insert("bogus".into(), json!(1));
        }
        let params = if g.rng.chance(25) {
            g.wrong_type()
        } else {
            Value::Object(params)
        };
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
