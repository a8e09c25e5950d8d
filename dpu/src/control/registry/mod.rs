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
//!   registry::{volumes, tenants, nvmf, remotes, vhost, qos, peers}   operations, one
//!             │                                          family each; never each other
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
//! The test at the end of this file holds the registry's modules to the graph above.

mod compose;
mod controllers;
mod exporters;
mod keys;
pub mod listener_retry;
mod nvmf;
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

pub use compose::QOS_DISABLED;
pub use nvmf::ListenerTransport;
pub use qos::QosScope;
pub use remotes::PathState;
pub use store::{DaemonConfig, Registry};

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
        ("nvmf", 4, include_str!("nvmf.rs")),
        ("remotes", 4, include_str!("remotes.rs")),
        ("vhost", 4, include_str!("vhost.rs")),
        ("qos", 4, include_str!("qos.rs")),
        ("peers", 4, include_str!("peers.rs")),
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
            .filter(|m| *m != "test {")
            .count();
        assert_eq!(declared, LAYERS.len());
    }
}
