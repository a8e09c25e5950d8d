//! The NVMe-oF initiator: nacred as a *host* of remote NVMe-oF storage (NVMe over Fabrics
//! 1.1, the NVMe/TCP Transport Specification 1.0 and the NVMe RDMA Transport Specification
//! 1.0).
//!
//! ```text
//!  volume ──▶ [stripe] ──▶ [multipath] ──▶ RemoteNamespace ──▶ Ctrl ──▶ dyn FabricQueue × (1 + N)
//!            (volume::stripe) (failover,    (BlockDevice:      (session,   (one TCP connection or
//!                              round-robin)  NVM commands)      reconnect)  RDMA queue pair per queue)
//! ```
//!
//! * [`queue`] — the transport seam: [`queue::FabricQueue`] is one NVMe-oF queue of any
//!   transport; [`Transport`] picks which (`ControllerConfig::transport`).
//! * [`tcp`] — one NVMe/TCP queue: ICReq/ICResp, Fabrics Connect, PDUs in and out, R2T,
//!   C2H SUCCESS, digests; asynchronous completion from a few reactor threads that
//!   serve every NVMe/TCP queue through epoll.
//! * [`rdma`] — one NVMe/RDMA queue: RDMA CM with the NVMe RDMA private data, SEND capsules,
//!   a pre-posted RECV ring, keyed SGLs into registered slot buffers.
//! * [`controller`] — bring-up (Connect, DH-HMAC-CHAP authentication when the shelf asks
//!   or a controller key is given, Property Get/Set, CC.EN, Identify), keep-alive, and the
//!   reconnect knobs `reconnect_delay`, `ctrl_loss_timeout`, `fast_io_fail_timeout`: the
//!   same for both transports.
//! * [`namespace`] — a remote namespace as a [`crate::volume::BlockDevice`].
//! * [`multipath`] — one namespace through several controllers, checked by NGUID/UUID.
//! * [`discovery`] — the discovery log page of a portal.
//!
//! The wire formats come from `nacre_shared::nvme` and `nacre_shared::nvme_tcp`, shared with
//! nacred's target, and the RDMA CM private data from [`crate::rdma::cm`].

pub mod cmd;
pub mod controller;
pub mod discovery;
pub mod multipath;
pub mod namespace;
pub mod queue;
pub mod rdma;
pub mod tcp;

pub use controller::{
    Controller, ControllerConfig, ControllerInfo, ControllerStatus, Ctrl, NamespaceInfo, Phase,
};
pub use multipath::{MultipathDevice, PathPolicy};
pub use namespace::RemoteNamespace;
pub use queue::Transport;

use nacre_shared::nvme::Status;
use thiserror::Error;

/// Why a controller could not be reached or brought up.
#[derive(Debug, Error, Clone)]
pub enum FabricError {
    /// Transport connect (TCP, or RDMA CM), ICReq/ICResp or Fabrics Connect failed; retried
    /// per reconnect_delay.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The controller refused us (wrong NQN, host not allowed, a discovery controller).
    #[error("refused: {0}")]
    Refused(String),
    /// The controller broke the transport's protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A step did not finish within its bound.
    #[error("timed out waiting for {0}")]
    Timeout(String),
    /// An admin command (opcode) completed with an error status.
    #[error("admin command {0:#04x} failed: {1}")]
    Status(u8, Status),
    /// A reconnect found different namespaces than before: the controller is failed rather
    /// than risk writing to the wrong namespace.
    #[error("{0}")]
    IdentityChanged(String),
    /// DH-HMAC-CHAP authentication failed (NVMe Base 2.0 §8.13), or the controller requires
    /// authentication nacre cannot give: the controller is failed, not retried (a wrong key
    /// does not become right by trying again, and a retry loop would hammer the shelf).
    #[error("{0}")]
    Auth(String),
    /// The first connection attempt of a controller failed: that attempt's error, as it was
    /// reported (already saying whether it was the connect, a refusal or a timeout).
    #[error("{0}")]
    FirstAttempt(String),
    /// The controller is failed or closed.
    #[error("controller failed: {0}")]
    Failed(String),
    /// Multipath members that are not the same namespace, and similar misuse.
    #[error("{0}")]
    Invalid(String),
}

impl FabricError {
    pub fn io(e: std::io::Error) -> Self {
        FabricError::Connect(e.to_string())
    }
}
