//! `vhost_blk_*` methods: virtio-blk devices (virtio 1.2 §5.2) served over vhost-user, or
//! as a whole PCI function over vfio-user (`transport`: [`TRANSPORT_VFIO_USER`]).

use serde::{Deserialize, Serialize};

pub const DEFAULT_QUEUES: u16 = 1;
/// Upper bound on queues per device; vhost-user-blk clients rarely use more than the vCPUs.
pub const MAX_QUEUES: u16 = 64;
pub const DEFAULT_QUEUE_SIZE: u16 = 1024;

/// A virtio-blk device as a vhost-user backend: `socket` is the socket a VMM's
/// vhost-user-blk device connects to. The default.
pub const TRANSPORT_VHOST_USER: &str = "vhost-user";
/// A virtio-blk PCI function emulated over vfio-user (virtio 1.2 §4.1): `socket` is the
/// directory its socket (`cntrl`) goes in, as with `nvmf_subsystem_add_listener`'s
/// `vfio-user` transport and SPDK's `vfu_virtio_create_blk_endpoint`.
pub const TRANSPORT_VFIO_USER: &str = "vfio-user";

/// `vhost_blk_create`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VhostBlkCreate {
    pub name: String,
    pub volume: String,
    /// Number of virtqueues offered (VIRTIO_BLK_F_MQ); each is served by its own thread.
    #[serde(default = "default_queues")]
    pub queues: u16,
    /// Largest queue size the device accepts.
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
    /// Socket path. Default `<run-dir>/vhost-<name>.sock`. With transport `vfio-user`:
    /// the directory the function's socket `cntrl` goes in (required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<String>,
    /// `vhost-user` (the default) or `vfio-user` (a virtio-blk PCI function).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    /// Offer VIRTIO_BLK_F_RO: the driver must not write, and writes fail with IOERR.
    #[serde(default)]
    pub read_only: bool,
}

fn default_queues() -> u16 {
    DEFAULT_QUEUES
}
fn default_queue_size() -> u16 {
    DEFAULT_QUEUE_SIZE
}

/// `vhost_blk_delete`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VhostBlkName {
    pub name: String,
}

/// `vhost_blk_list` element.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VhostBlkInfo {
    pub name: String,
    pub volume: String,
    pub socket: String,
    /// `vhost-user` or `vfio-user`.
    pub transport: String,
    pub queues: u16,
    pub queue_size: u16,
    pub read_only: bool,
    /// True while a vhost-user client (a VM, libblkio) is connected.
    pub connected: bool,
}
