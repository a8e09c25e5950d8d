//! Types that both sides of nacre speak.
//!
//! * [`rpc`] — the JSON-RPC 2.0 envelope of nacred's control plane and its error codes.
//! * [`api`] — the parameters and results of every control-plane method, one module per
//!   object family (volumes, vhost-user-blk devices, …), so the `nacre` CLI, tests and any
//!   other client build requests from the same definitions nacred parses them with.
//! * `channel` (feature `channel`) — the host ↔ DPU channel: JSON-RPC inside mutual TLS, and
//!   the certificates.
//! * [`size`] — human-readable sizes (`1G`, `512M`, `4096`) as operators write them.
//! * [`table`] — the aligned text tables the `nacre` and `nacre-host` commands print.

pub mod api;
#[cfg(feature = "channel")]
pub mod channel;
pub mod nvme;
pub mod nvme_tcp;
pub mod rpc;
pub mod size;
pub mod table;
