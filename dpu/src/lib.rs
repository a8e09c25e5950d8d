//! nacred's library: the data path and the control plane of the nacre DPU daemon.
//!
//! ```text
//!  frontend ──▶ QoS, statistics ──▶ crypto ──▶ (local backend | stripe | fabric initiator)
//!  (vhost-user-blk,  (volume::qos)    (AES-XTS     (ram, file, null | NVMe-oF over TCP
//!   NVMe-oF target)                    per tenant)   or RDMA, multipath)
//!                 control plane (JSON-RPC) creates, persists and wires them
//! ```
//!
//! Each layer is a module with the small [`volume::BlockDevice`] trait between it and the
//! next, so a new transport or frontend is one new module.

pub mod auth;
pub mod config;
pub mod control;
pub mod crypto;
pub mod fabric;
pub mod frontend;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod rdma;
pub mod telemetry;
pub mod volume;
