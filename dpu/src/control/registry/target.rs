//! The daemon's NVMe-oF target as live objects: one [`NvmfTarget`] (NVMe/TCP) and its
//! NVMe/RDMA ports, each created on first use, how their errors reach the operator, and the
//! transport a listener serves with what listens for it (shared by the handlers and the
//! listener retry).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;

use super::store::Inner;
use crate::control::error::RpcError;
use crate::control::state::NvmfSubsystemRecord;
use crate::frontend::nvme_pcie::{PcieError, VfioUserPorts};
use crate::frontend::nvmf_rdma::{RdmaError, RdmaPorts};
use crate::frontend::nvmf_tcp::{NvmfError, NvmfTarget};

/// The daemon's target, created on first use (as [`Live::nvmf_config`] says).
///
/// [`Live::nvmf_config`]: super::store::Live::nvmf_config
pub(super) fn target(inner: &mut Inner) -> Arc<NvmfTarget> {
    let cfg = inner.live.nvmf_config;
    inner
        .live
        .nvmf
        .get_or_insert_with(|| NvmfTarget::with_config(cfg))
        .clone()
}

/// The target's vfio-user (PCIe NVMe) listeners, created on first use.
pub(super) fn vfio_user_ports(inner: &mut Inner) -> Arc<VfioUserPorts> {
    let t = target(inner);
    inner
        .live
        .nvmf_vfio_user
        .get_or_insert_with(|| VfioUserPorts::new(&t))
        .clone()
}

pub(super) fn pcie_err(e: PcieError) -> RpcError {
    match e {
        PcieError::Nvmf(e) => rpc_err(e),
        PcieError::NoSuchListener(d) => {
            RpcError::not_found("listener", &format!("vfio-user:{}", d.display()))
        }
        PcieError::Listen { .. } => RpcError::failed(e.to_string()),
    }
}

/// The target's RDMA listeners, created on first use.
pub(super) fn rdma_ports(inner: &mut Inner) -> Arc<RdmaPorts> {
    let t = target(inner);
    inner
        .live
        .nvmf_rdma
        .get_or_insert_with(|| RdmaPorts::new(&t))
        .clone()
}

pub(super) fn rpc_err(e: NvmfError) -> RpcError {
    match e {
        NvmfError::InvalidNqn(_)
        | NvmfError::InvalidNsid(_)
        | NvmfError::InvalidArgument(_)
        | NvmfError::Discovery => RpcError::invalid_params(e.to_string()),
        NvmfError::SubsystemExists(n) => RpcError::exists("subsystem", &n),
        NvmfError::NoSuchSubsystem(n) => RpcError::not_found("subsystem", &n),
        NvmfError::NsidInUse { .. } | NvmfError::NamespacesFull(_) => RpcError::busy(e.to_string()),
        NvmfError::NoSuchNamespace { nqn, nsid } => {
            RpcError::not_found("namespace", &format!("{nqn}/{nsid}"))
        }
        NvmfError::NoSuchListener(a) => RpcError::not_found("listener", &a.to_string()),
        NvmfError::Listen { .. } => RpcError::failed(e.to_string()),
    }
}

pub(super) fn rdma_err(e: RdmaError) -> RpcError {
    match e {
        RdmaError::Nvmf(e) => rpc_err(e),
        RdmaError::NoSuchListener(a) => RpcError::not_found("listener", &format!("rdma:{a}")),
        RdmaError::Listen { .. } => RpcError::failed(e.to_string()),
    }
}

/// The transport a target listener serves (an NVMe-oF subsystem listens on each address
/// for one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerTransport {
    Tcp,
    Rdma,
    /// NVMe/TCP on a TLS-only listener (NVMe/TCP §3.6).
    Tls,
}

impl ListenerTransport {
    /// A subsystem's configured listeners of this transport.
    pub(super) fn listeners(self, r: &NvmfSubsystemRecord) -> &BTreeSet<SocketAddr> {
        match self {
            ListenerTransport::Tcp => &r.listeners,
            ListenerTransport::Rdma => &r.rdma_listeners,
            ListenerTransport::Tls => &r.tls_listeners,
        }
    }

    pub(super) fn listeners_mut(self, r: &mut NvmfSubsystemRecord) -> &mut BTreeSet<SocketAddr> {
        match self {
            ListenerTransport::Tcp => &mut r.listeners,
            ListenerTransport::Rdma => &mut r.rdma_listeners,
            ListenerTransport::Tls => &mut r.tls_listeners,
        }
    }

    /// The listeners of this transport that could not be started at replay.
    pub(super) fn failed(self, inner: &mut Inner) -> &mut BTreeMap<(String, SocketAddr), String> {
        match self {
            // One address cannot hold a plain and a TLS listener: they share the map.
            ListenerTransport::Tcp | ListenerTransport::Tls => &mut inner.live.listeners_failed,
            ListenerTransport::Rdma => &mut inner.live.rdma_listeners_failed,
        }
    }

    /// How errors name a listener: its address, with `rdma:` before an RDMA one.
    pub(super) fn name(self, addr: SocketAddr) -> String {
        match self {
            ListenerTransport::Tcp => addr.to_string(),
            ListenerTransport::Rdma => format!("rdma:{addr}"),
            ListenerTransport::Tls => format!("tls:{addr}"),
        }
    }
}

/// What listens for one transport: the target itself (NVMe/TCP) or its RDMA ports.
pub(super) enum Port {
    Tcp(Arc<NvmfTarget>),
    Tls(Arc<NvmfTarget>),
    Rdma(Arc<RdmaPorts>),
}

impl Port {
    /// The live listener of `transport`, created on first use.
    pub(super) fn of(inner: &mut Inner, transport: ListenerTransport) -> Port {
        match transport {
            ListenerTransport::Tcp => Port::Tcp(target(inner)),
            ListenerTransport::Rdma => Port::Rdma(rdma_ports(inner)),
            ListenerTransport::Tls => Port::Tls(target(inner)),
        }
    }

    pub(super) fn add(&self, nqn: &str, addr: SocketAddr) -> Result<SocketAddr, RpcError> {
        match self {
            Port::Tcp(t) => t.add_listener(nqn, addr).map_err(rpc_err),
            Port::Tls(t) => t.add_tls_listener(nqn, addr).map_err(rpc_err),
            Port::Rdma(p) => p.add_listener(nqn, addr).map_err(rdma_err),
        }
    }

    /// Stop listening; a listener that was not live (it failed at replay) is no error.
    pub(super) fn remove(&self, nqn: &str, addr: SocketAddr) {
        match self {
            Port::Tcp(t) | Port::Tls(t) => {
                let _ = t.remove_listener(nqn, addr);
            }
            Port::Rdma(p) => {
                let _ = p.remove_listener(nqn, addr);
            }
        }
    }
}
