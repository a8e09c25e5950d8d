//! JSON-RPC: what a client sends to nacred's control socket.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::Value;

use super::{helper, ignore_sigpipe};
use crate::control::{Daemon, DaemonConfig};

/// Methods the RPC target does not dispatch: `remote_*` open connections to addresses
/// from the input (the harness must not reach out of the machine, and a connect timeout
/// would cost seconds per input), and the tenant methods that derive a key with Argon2
/// (a fraction of a second each, by design).
pub const RPC_SKIPPED: [&str; 7] = [
    "remote_attach",
    "remote_detach",
    "remote_discover",
    "tenant_create",
    "tenant_unlock",
    "tenant_rotate_kek",
    "tenant_policy_set",
];

struct RpcFixture {
    root: PathBuf,
    daemon: Option<Arc<Daemon>>,
    generation: u64,
}

impl RpcFixture {
    fn dirs(&self) -> (PathBuf, PathBuf) {
        let g = self.root.join(format!("g{}", self.generation));
        (g.join("state"), g.join("run"))
    }

    fn daemon(&mut self) -> Arc<Daemon> {
        if let Some(d) = &self.daemon {
            return d.clone();
        }
        let (state_dir, run_dir) = self.dirs();
        let (d, _) = Daemon::open(DaemonConfig::new(state_dir, run_dir)).expect("daemon");
        self.daemon = Some(d.clone());
        d
    }

    /// Start over with an empty scratch directory (after any call changed the state).
    fn reset(&mut self) {
        if let Some(d) = self.daemon.take() {
            d.shutdown();
        }
        let _ = std::fs::remove_dir_all(&self.root);
        let _ = std::fs::create_dir_all(&self.root);
        self.generation += 1;
    }
}

/// What RPC input writes for the scratch directory: the harness puts the real (per-process)
/// directory in its place, so corpus files work in any process.
pub const RPC_DIR: &str = "/nacre-fuzz/";

/// The scratch directory of this process's RPC target: daemons' state and every path the
/// input names live in it.
pub fn rpc_root() -> PathBuf {
    // tmpfs where there is one: state is written with fsync on every change.
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    base.join(format!("nacre-fuzz-rpc-{}", std::process::id()))
}

fn rpc_fixture() -> &'static Mutex<RpcFixture> {
    static F: OnceLock<Mutex<RpcFixture>> = OnceLock::new();
    F.get_or_init(|| {
        ignore_sigpipe();
        let root = rpc_root();
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("rpc fuzz root");
        Mutex::new(RpcFixture {
            root,
            daemon: None,
            generation: 0,
        })
    })
}

/// Whether every string in `v`, object keys included (no method takes a map keyed by a
/// path or address today; one that did must not open a way out), is safe to hand the
/// daemon: a path only inside `root`, an address only on loopback, and no method from
/// [`RPC_SKIPPED`].
fn rpc_input_allowed(v: &Value, root: &str) -> bool {
    match v {
        Value::String(s) => {
            if RPC_SKIPPED.contains(&s.as_str()) {
                return false;
            }
            let outside = !s.starts_with(root) || s.contains("..");
            if s.contains('/') && outside {
                return false;
            }
            if let Ok(a) = s.parse::<SocketAddr>() {
                return a.ip().is_loopback();
            }
            if let Ok(ip) = s.parse::<std::net::IpAddr>() {
                return ip.is_loopback();
            }
            true
        }
        Value::Array(a) => a.iter().all(|x| rpc_input_allowed(x, root)),
        Value::Object(o) => o.iter().all(|(k, x)| {
            rpc_input_allowed(&Value::from(k.as_str()), root) && rpc_input_allowed(x, root)
        }),
        _ => true,
    }
}

/// Bytes a client writes to nacred's control socket: the real per-connection server loop
/// (request framing, parse errors, batches, dispatch to every method) against a control
/// plane on a scratch state directory.
///
/// [`RPC_DIR`] in the input stands for the scratch directory. Inputs that name another
/// path, a non-loopback address or one of [`RPC_SKIPPED`] are not run (the harness must
/// stay inside its sandbox, and fast).
///
/// Checks: no panic; every reply line is a JSON-RPC response object (or a batch of them)
/// with `jsonrpc: "2.0"` and exactly one of `result` and `error`; and the state the calls
/// left behind opens again (replay) without error.
pub fn json_rpc(data: &[u8]) {
    let mut fx = rpc_fixture().lock().unwrap_or_else(|p| p.into_inner());
    let root = format!("{}/", fx.root.to_string_lossy());
    let data = replace_all(data, RPC_DIR.as_bytes(), root.as_bytes());
    for v in serde_json::Deserializer::from_slice(&data).into_iter::<Value>() {
        match v {
            Ok(v) if !rpc_input_allowed(&v, &root) => return,
            Ok(_) => {}
            // The server answers the first parse error and closes (control::server): no
            // request after it runs, so none needs checking.
            Err(_) => break,
        }
    }
    let d = fx.daemon();
    let (client, server) = UnixStream::pair().expect("socketpair");
    let feeder = helper::run({
        let input = data.to_vec();
        move || {
            let mut c = client;
            let _ = c.write_all(&input);
            let _ = c.shutdown(Shutdown::Write);
            let mut out = Vec::new();
            let _ = c.read_to_end(&mut out);
            out
        }
    });
    crate::control::server::serve_stream(&d, server);
    let out = feeder.join().expect("rpc feeder");
    for line in out.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let v: Value = serde_json::from_slice(line).expect("a reply line is JSON");
        match &v {
            Value::Array(items) => items.iter().for_each(check_response),
            other => check_response(other),
        }
    }
    let (state_dir, run_dir) = fx.dirs();
    if state_dir.join("state.json").exists() {
        // Whatever the calls left, nacred must come back from it.
        d.shutdown();
        drop(d);
        fx.daemon = None;
        crate::control::state::load(&state_dir).expect("saved state loads again");
        let (again, existed) =
            Daemon::open(DaemonConfig::new(state_dir, run_dir)).expect("daemon reopens");
        assert!(existed);
        again.shutdown();
        fx.reset();
    }
}

fn replace_all(data: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len());
    let mut i = 0;
    while i < data.len() {
        if data[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(data[i]);
            i += 1;
        }
    }
    out
}

fn check_response(v: &Value) {
    let o = v.as_object().expect("a response is an object");
    assert_eq!(o.get("jsonrpc"), Some(&Value::from("2.0")), "{v}");
    assert!(
        o.contains_key("result") != o.contains_key("error"),
        "exactly one of result and error: {v}"
    );
    if let Some(e) = o.get("error") {
        assert!(e.get("code").is_some_and(Value::is_i64), "error code: {v}");
        assert!(
            e.get("message").is_some_and(Value::is_string),
            "error message: {v}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn input_naming_a_path_or_address_outside_the_sandbox_is_not_run() {
        let root = "/dev/shm/nacre-fuzz-rpc-1/";
        let ok = json!({"method": "volume_create", "params": {"path": format!("{root}v0"), "addr": "127.0.0.1:4420"}});
        assert!(rpc_input_allowed(&ok, root));
        for bad in [
            json!({"method": "volume_create", "params": {"path": "/etc/passwd"}}),
            json!({"method": "volume_create", "params": {"path": format!("{root}../x")}}),
            json!({"method": "nvmf_listener_add", "params": {"addr": "10.0.0.1:4420"}}),
            json!([{"method": "remote_attach"}]),
            // Keys too: a map keyed by a path would reach the daemon as one.
            json!({"method": "x", "params": {"/etc/passwd": 1}}),
            json!({"method": "x", "params": {"m": {"10.1.1.1": true}}}),
        ] {
            assert!(!rpc_input_allowed(&bad, root), "{bad}");
        }
    }
}
