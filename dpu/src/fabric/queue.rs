//! The seam between a controller and its transport: one NVMe-oF queue (NVMe-oF 1.1 §2.2:
//! a submission/completion queue pair carried by one transport connection), whatever the
//! transport.
//!
//! A controller ([`super::Ctrl`]) only ever needs five things of a queue: put a command on
//! it, ask how long its oldest command has waited (the I/O timeout), shut it down, wait
//! until it has closed (an NVMe/TCP queue's reactor has let it go, an NVMe/RDMA queue's
//! thread has ended), and — through [`QueueOwner`] — be told when it dies with the commands
//! it had outstanding. Bring-up, keep-alive, reconnection, the `reconnect_delay`,
//! `ctrl_loss_timeout` and `fast_io_fail_timeout` knobs, multipath and striping are all
//! above this seam and so the same for NVMe/TCP ([`super::tcp`]) and NVMe/RDMA
//! ([`super::rdma`]).

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use nacre_shared::nvme::fabrics::ConnectData;
use nacre_shared::nvme::Completion as Cqe;
use nacre_shared::nvme_tcp::Digests;

use super::cmd::Cmd;
use super::{ControllerConfig, FabricError};

/// Slot index bits of a command identifier; the remaining 6 bits are the slot's generation,
/// which changes each time the slot is reused, so a completion for a command that is not (or
/// no longer) outstanding is recognised as such (both transports number commands this way).
pub const CID_IDX_BITS: u32 = 10;
/// The deepest queue a connection supports (slot indices must fit [`CID_IDX_BITS`]).
pub const MAX_DEPTH: u16 = 1 << CID_IDX_BITS;

/// The CID of slot `idx` at generation `gen`.
pub fn cid_of(idx: u16, gen: u8) -> u16 {
    idx | ((gen as u16) << CID_IDX_BITS)
}

/// Slot index and generation of a CID.
pub fn split_cid(cid: u16) -> (usize, u8) {
    (
        (cid & (MAX_DEPTH - 1)) as usize,
        (cid >> CID_IDX_BITS) as u8,
    )
}

/// An NVMe-oF transport (NVMe-oF 1.1 §5.3, Discovery Log Page TRTYPE).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// NVMe/TCP (TRTYPE 3).
    #[default]
    Tcp,
    /// NVMe/RDMA (TRTYPE 1): RoCEv2, InfiniBand or iWARP through librdmacm.
    Rdma,
}

impl Transport {
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Rdma => "rdma",
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tcp" => Ok(Transport::Tcp),
            "rdma" => Ok(Transport::Rdma),
            _ => Err(format!(
                "transport {s:?} is not one nacre speaks: use \"tcp\" or \"rdma\""
            )),
        }
    }
}

/// What a queue tells its owner (the controller).
pub trait QueueOwner: Send + Sync {
    /// The connection is gone. `cmds` were outstanding (or queued) on it and have been
    /// neither completed nor failed: the owner decides (hold and retry, or fail).
    fn queue_closed(&self, session: u64, qid: u16, reason: String, cmds: Vec<Cmd>);
}

/// Connection parameters of one queue.
#[derive(Debug, Clone)]
pub struct QueueParams {
    pub qid: u16,
    /// Commands in flight at most (the SQ has one more entry, Connect SQSIZE = depth).
    pub depth: u16,
    /// NVMe/TCP header and data digests (NVMe/RDMA has none: the RDMA transport has its
    /// own integrity checks).
    pub digests: Digests,
    /// Keep Alive Timeout for the admin queue's Connect (0 = none).
    pub kato_ms: u32,
    /// Most bytes of write data sent inside the command capsule.
    pub icd_max: usize,
    /// Bound on the transport connect and on each step of initialisation.
    pub timeout: Duration,
    /// NVMe/TCP over TLS 1.3 with this PSK (NVMe/TCP Transport §3.6): the connection starts
    /// with the TLS handshake, before ICReq. NVMe/TCP only.
    pub tls: Option<std::sync::Arc<crate::auth::tls_channel::ClientPsk>>,
}

/// One NVMe-oF queue of any transport.
///
/// Contract (both transports keep it, and the controller's reconnect logic relies on it):
/// a command handed to [`FabricQueue::submit`] is either completed (or failed) by the queue,
/// or handed back — by `submit` returning it, or by [`QueueOwner::queue_closed`] when the
/// queue dies. After `queue_closed` nothing the queue does touches a command's memory any
/// more, so the owner may resend it elsewhere.
pub trait FabricQueue: Send + Sync + fmt::Debug {
    /// The queue identifier (0: admin).
    fn qid(&self) -> u16;
    /// Submit a command; never blocks on the network. The command comes back if the queue
    /// is closed.
    fn submit(&self, cmd: Cmd) -> Result<(), Cmd>;
    /// How long the oldest outstanding command has been waiting.
    fn oldest_outstanding(&self) -> Option<Duration>;
    /// Close the connection at once (never waits on the peer); outstanding commands go to
    /// the owner.
    fn shutdown(&self);
    /// Wait, bounded, until the queue has closed after [`FabricQueue::shutdown`] (no thread
    /// touches it any more).
    fn join(&self, timeout: Duration);
    /// Bytes of command data copied between a request's memory and transport-owned
    /// registered memory (NVMe/RDMA's slot buffers); 0 for a transport that has none.
    fn bounce_copy_bytes(&self) -> u64 {
        0
    }
    /// Bytes of command data the device moved straight from or into the request's own
    /// memory (announced in [`crate::volume::dma`] and registered by the transport): the
    /// zero-copy path. 0 for a transport that has none.
    fn direct_bytes(&self) -> u64 {
        0
    }
    /// Batches a submitter sent itself when its plug closed (`volume::plug`), and how many
    /// of them the socket did not take whole (the rest went to the queue's sender).
    fn inline_sends(&self) -> (u64, u64) {
        (0, 0)
    }
    /// Bytes of C2HData the kernel read straight into the requests' memory, and those
    /// copied there from the receive buffer (NVMe/TCP's receive side; see
    /// `fabric::tcp::rxbuf`). (0, 0) for a transport without that split.
    fn rx_bytes(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// A queue as the controller holds it.
pub type Queue = Arc<dyn FabricQueue>;

/// Open one queue of `cfg.transport` to the controller `cfg` names, and send Fabrics
/// Connect on it. Returns the queue and the Connect completion (CNTLID in Dword 0 for the
/// admin queue).
pub fn open(
    cfg: &ControllerConfig,
    params: QueueParams,
    connect_data: &ConnectData,
    session: u64,
    owner: Weak<dyn QueueOwner>,
) -> Result<(Queue, Cqe), FabricError> {
    match cfg.transport {
        Transport::Tcp => {
            let addr = cfg.socket_addr()?;
            let (q, cqe) = super::tcp::QueueConn::open(
                addr,
                params,
                connect_data,
                session,
                owner,
                &cfg.tcp_reactors,
            )?;
            Ok((q, cqe))
        }
        Transport::Rdma => {
            let (q, cqe) = super::rdma::RdmaQueue::open(cfg, params, connect_data, session, owner)?;
            Ok((q, cqe))
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn cid_generation_round_trip() {
        for idx in [0u16, 1, 511, 1023] {
            for gen in [0u8, 1, 63] {
                assert_eq!(split_cid(cid_of(idx, gen)), (idx as usize, gen));
            }
        }
        // Same slot, different generation: a different CID.
        assert_ne!(cid_of(5, 1), cid_of(5, 2));
    }

    #[test]
    fn transport_names_round_trip_and_bad_ones_are_refused() {
        for t in [Transport::Tcp, Transport::Rdma] {
            assert_eq!(t.as_str().parse::<Transport>(), Ok(t));
        }
        let e = "roce".parse::<Transport>().unwrap_err();
        assert!(e.contains("\"roce\"") && e.contains("\"rdma\""), "{e}");
        assert!("TCP".parse::<Transport>().is_err());
    }
}
