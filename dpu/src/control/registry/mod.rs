//! The registry: the one owner of the control plane's objects — the persisted records
//! ([`crate::control::state`]) and the live objects built from them (open volumes, devices,
//! the NVMe-oF target, remote controllers, unlocked KEKs, peer windows).
//!
//! The method handlers (`control::volume`, `control::nvmf`, …) only parse params, call one
//! registry operation and serialise its result. Everything that knows how objects relate —
//! that a volume is composed of a backend, a crypto layer and remote namespaces, that a
//! volume exported by a frontend cannot be deleted, that replay goes remotes → volumes →
//! devices — lives here, and the dependencies point one way:
//!
//! ```text
//!   control::{server, host_channel}      bytes → method calls
//!             │
//!   control (methods table, dispatch)
//!             │
//!   control::{volume, tenant, nvmf, remote, vhost, qos, peer, metrics}   handlers: parse,
//!             │                                                  call, serialise
//!   registry::replay
//!             │
//!   registry::{volumes, tenants, kms, nvmf, remotes, vhost, qos, peers, opi}   operations,
//!             │                                          one family each; never each other
//!   registry::{compose, remote_volume, keys, exporters, target, listener_retry}
//!             │                        how live objects are built, found and indexed
//!   registry::store                    the records + live objects, under the control lock;
//!             │                        the transaction rule
//!   registry::{controllers, windows}   live objects kept outside the control lock
//!             │
//!   control::{state, error}, volume, crypto, fabric, frontend   persistence and the data path
//! ```
//!
//! Operations run under the daemon's one control lock: control-plane operations are rare
//! and short, and serialising them makes "change live objects, persist, commit" atomic with
//! respect to each other. The data path never takes this lock. An operation that changes
//! state follows one pattern: validate; build the live object; write the new state
//! (`Registry::commit`); only then commit it in memory. If persisting fails the live object
//! is torn down again, so what runs and what would be replayed never diverge.
//!
//! The tests at the end of this file hold the registry's modules to the graph above, and its
//! operations to that rule.

mod compose;
mod controllers;
mod exporters;
mod keys;
mod kms;
pub mod listener_retry;
mod nvmf;
mod opi;
mod peers;
mod qos;
mod remote_volume;
mod remotes;
mod replay;
mod store;
mod target;
mod tenants;
mod vhost;
mod volumes;
mod windows;

pub use qos::QosScope;
pub use remotes::PathState;
pub use store::{DaemonConfig, DataPathConfig, Registry};
pub use target::ListenerTransport;

#[cfg(test)]
mod test {
    /// Each registry module, with the layer it sits in (see the graph in the module
    /// documentation); a module may use only modules of lower layers.
    const LAYERS: &[(&str, u32, &str)] = &[
        ("controllers", 0, include_str!("controllers.rs")),
        ("windows", 0, include_str!("windows.rs")),
        ("store", 1, include_str!("store.rs")),
        ("keys", 2, include_str!("keys.rs")),
        ("exporters", 2, include_str!("exporters.rs")),
        ("target", 2, include_str!("target.rs")),
        ("remote_volume", 2, include_str!("remote_volume.rs")),
        ("compose", 3, include_str!("compose.rs")),
        ("listener_retry", 3, include_str!("listener_retry.rs")),
        ("volumes", 4, include_str!("volumes.rs")),
        ("tenants", 4, include_str!("tenants.rs")),
        ("kms", 4, include_str!("kms.rs")),
        ("nvmf", 4, include_str!("nvmf.rs")),
        ("remotes", 4, include_str!("remotes.rs")),
        ("vhost", 4, include_str!("vhost.rs")),
        ("qos", 4, include_str!("qos.rs")),
        ("peers", 4, include_str!("peers.rs")),
        ("opi", 4, include_str!("opi.rs")),
        ("replay", 5, include_str!("replay.rs")),
    ];

    /// The sibling modules a source file names in its `use super::…` lines (before its
    /// tests, whose `super` is the file itself).
    fn siblings_used(src: &str) -> Vec<String> {
        let code = src.split("#[cfg(test)]").next().unwrap_or_default();
        let mut out = Vec::new();
        for line in code.lines().map(str::trim) {
            let Some(rest) = line.strip_prefix("use super::") else {
                continue;
            };
            let names = match rest.strip_prefix('{') {
                Some(group) => group.split('}').next().unwrap_or_default().to_string(),
                None => rest.split("::").next().unwrap_or_default().to_string(),
            };
            out.extend(
                names
                    .split(',')
                    .map(|n| n.trim().trim_end_matches(';').to_string())
                    .filter(|n| !n.is_empty()),
            );
        }
        out
    }

    /// The registry is a DAG: no module uses one of its own layer or above, and none uses
    /// the control plane above it (handlers, dispatch) — only its records and its error.
    #[test]
    fn registry_dependencies_point_down() {
        let layer = |name: &str| LAYERS.iter().find(|(n, _, _)| *n == name).map(|l| l.1);
        for (name, own, src) in LAYERS {
            for used in siblings_used(src) {
                let theirs = layer(&used).unwrap_or_else(|| panic!("{name} uses unknown {used}"));
                assert!(
                    theirs < *own,
                    "{name} (layer {own}) uses {used} (layer {theirs})"
                );
            }
            for (i, _) in src.match_indices("crate::control::") {
                let target = &src[i + "crate::control::".len()..];
                assert!(
                    target.starts_with("error::") || target.starts_with("state::"),
                    "{name} reaches up into crate::control::{}",
                    target.lines().next().unwrap_or_default()
                );
            }
        }
        // Every module of the registry is in the table.
        let declared = include_str!("mod.rs")
            .lines()
            .filter_map(|l| {
                l.trim()
                    .strip_prefix("mod ")
                    .or_else(|| l.trim().strip_prefix("pub mod "))
            })
            .map(|l| l.trim_end_matches(';'))
            .filter(|m| !m.ends_with('{'))
            .count();
        assert_eq!(declared, LAYERS.len());
    }
}

#[cfg(test)]
mod atomicity {
    use std::sync::Arc;

    use serde::de::DeserializeOwned;
    use serde_json::json;

    use super::{DaemonConfig, ListenerTransport, Registry};
    use crate::control::error::RpcError;
    use crate::control::state::{self, STATE_FILE};

    fn req<T: DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).expect("valid request")
    }

    /// Every change persists before it commits, and one that cannot be persisted leaves
    /// nothing running that a restart would not bring back: no volume, backing file, device,
    /// subsystem or listener, and a resized volume keeps its size. Once the state can be
    /// written again, the same changes succeed (nothing left behind blocks them).
    #[test]
    fn a_change_that_cannot_be_persisted_leaves_nothing_running() {
        let dir = tempfile::tempdir().unwrap();
        let config = DaemonConfig::new(dir.path().join("state"), dir.path().join("run"));
        for d in [&config.state_dir, &config.run_dir] {
            std::fs::create_dir_all(d).unwrap();
        }
        let r = Arc::new(Registry::new(config.clone(), Default::default()));
        r.replay();
        r.create_volume(&req(
            json!({"name": "v", "size": 1 << 20, "backend": "ram"}),
        ))
        .unwrap();
        let nqn = "nqn.2024-01.io.nacre:atomic";
        let saved = state::load(&config.state_dir).unwrap().unwrap();

        // The state is written through a temporary file next to it: a directory in its place
        // makes every save fail (root included).
        let blocker = config.state_dir.join(format!(".{STATE_FILE}.tmp"));
        std::fs::create_dir(&blocker).unwrap();
        let cannot_write = |e: RpcError| {
            assert!(e.message.starts_with("cannot write state"), "{e}");
        };
        let file = dir.path().join("f.img");
        let file_volume = json!({
            "name": "f", "size": 1 << 20, "backend": "file", "path": file.to_str().unwrap()
        });
        let socket = config.run_dir.join("vhost-d.sock");
        let device = json!({"name": "d", "volume": "v", "socket": socket.to_str().unwrap()});
        let addr = "127.0.0.1:0".parse().unwrap();

        cannot_write(r.create_volume(&req(file_volume.clone())).unwrap_err());
        assert!(!file.exists(), "backing file left behind");
        cannot_write(r.create_vhost_blk(&req(device.clone())).unwrap_err());
        assert!(!socket.exists(), "device left serving");
        cannot_write(r.resize_volume("v", 2 << 20).unwrap_err());
        cannot_write(r.create_subsystem(&req(json!({"nqn": nqn}))).unwrap_err());
        cannot_write(r.delete_volume("v", false).unwrap_err());
        {
            let inner = r.lock();
            // (`format` is set on what is written, not on the state in memory.)
            assert_eq!(inner.state.format, 0);
            assert_eq!(
                inner.state,
                state::State {
                    format: 0,
                    ..saved.clone()
                }
            );
            assert_eq!(inner.live.volumes.len(), 1);
            assert_eq!(inner.live.volumes["v"].geometry().size, 1 << 20);
            assert!(inner.live.vhost_blk.is_empty());
        }
        assert!(r.subsystems().iter().all(|s| s.info.nqn != nqn));
        assert_eq!(state::load(&config.state_dir).unwrap().unwrap(), saved);

        std::fs::remove_dir(&blocker).unwrap();
        r.create_volume(&req(file_volume)).unwrap();
        r.create_vhost_blk(&req(device)).unwrap();
        assert!(socket.exists());
        assert_eq!(r.resize_volume("v", 2 << 20).unwrap().size, 2 << 20);
        r.create_subsystem(&req(json!({"nqn": nqn}))).unwrap();

        // A listener, likewise: bound, then unbound again when its record cannot be saved.
        std::fs::create_dir(&blocker).unwrap();
        cannot_write(
            r.add_listener(nqn, addr, ListenerTransport::Tcp)
                .unwrap_err(),
        );
        let sub = r
            .subsystems()
            .into_iter()
            .find(|s| s.info.nqn == nqn)
            .unwrap();
        assert!(sub.info.listeners.is_empty(), "{:?}", sub.info);
        std::fs::remove_dir(&blocker).unwrap();
        r.add_listener(nqn, addr, ListenerTransport::Tcp).unwrap();
        r.shutdown();
    }
}
