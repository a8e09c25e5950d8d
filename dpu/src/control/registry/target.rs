//! The daemon's NVMe-oF target as live objects: one [`NvmfTarget`] (NVMe/TCP) and its
//! NVMe/RDMA ports, each created on first use, and how their errors reach the operator.

use std::sync::Arc;

use super::store::Inner;
use crate::control::error::RpcError;
use crate::frontend::nvmf_rdma::{RdmaError, RdmaPorts};
use crate::frontend::nvmf_tcp::{NvmfError, NvmfTarget};

/// The daemon's target, created on first use.
pub(super) fn target(inner: &mut Inner) -> Arc<NvmfTarget> {
    inner.live.nvmf.get_or_insert_with(NvmfTarget::new).clone()
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
