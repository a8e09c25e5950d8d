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
//!   registry::{compose, remote_volume, keys, exporters, target, controllers, listener_retry}
//!             │                        how live objects are built, found and indexed
//!   registry::store                    the records + live objects, under the control lock;
//!             │                        the transaction rule
//!   control::{state, error}, volume, crypto, fabric, frontend   persistence and the data path
//! ```
//!
//! Operations run under the daemon's one control lock: control-plane operations are rare
//! and short, and serialising them makes "change live objects, persist, commit" atomic with
//! respect to each other. The data path never takes this lock. An operation that changes
//! state follows one pattern: validate; build the live object; write the new state
//! (`Registry::commit`); only then commit it in memory. If persisting fails
//! the live object is torn down again, so what runs and what would be replayed never
//! diverge.

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

pub use compose::{FailedVolume, QOS_DISABLED};
pub use exporters::{exporters, Exporter};
pub use nvmf::Transport;
pub use qos::QosTarget;
pub use remotes::PathState;
pub use store::{DaemonConfig, Registry};
