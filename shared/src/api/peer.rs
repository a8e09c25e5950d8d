//! `peer_window_*` methods: GPU memory windows a host registers for the zero-copy RDMA path
//! (GPUDirect Storage: the DPU moves data straight into GPU memory across PCIe).
//!
//! A host registers a window it has allocated and pinned on one of its GPUs: the GPU's
//! identity and PCIe address, the bus address range of the GPU's BAR1 aperture the window
//! lives in, its length and the exported handle. nacred records it under the tenant of the
//! host's credential. A window lives only as long as the channel that registered it: when
//! the host unregisters it, or the agent exits, or the connection drops, it is gone (the GPU
//! memory behind it is freed with the process that pinned it).

use serde::{Deserialize, Serialize};

/// `peer_window_register`
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PeerWindowRegister {
    /// The GPU's UUID as NVML/CUDA print it (`GPU-…`).
    pub gpu_uuid: String,
    /// PCIe address `DDDD:BB:DD.F`.
    pub bdf: String,
    /// Start of the BAR1 bus address range, and its length (bytes).
    pub bar1_start: u64,
    pub bar1_len: u64,
    /// Length of the pinned buffer (bytes).
    pub length: u64,
    /// The buffer's CUDA device address.
    pub device_address: u64,
    /// How the buffer is exported: `dmabuf` (a dma-buf file descriptor) or `none`.
    pub handle_kind: String,
    /// The dma-buf fd number in the registering process (meaningful with `handle_kind`
    /// `dmabuf`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<i64>,
    /// Operator use only (Unix socket): the host and tenant to record it under. A host
    /// credential's own identity always wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// `peer_window_unregister`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PeerWindowId {
    pub id: u64,
}

/// `peer_window_list` parameters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PeerWindowList {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// A registered window (`peer_window_list` element, `peer_window_register` result).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PeerWindowInfo {
    pub id: u64,
    pub tenant: String,
    pub host: String,
    pub gpu_uuid: String,
    pub bdf: String,
    pub bar1_start: u64,
    pub bar1_len: u64,
    pub length: u64,
    pub device_address: u64,
    pub handle_kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<i64>,
    /// `host-channel` (lives with the connection) or `operator`.
    pub registered_via: String,
}
