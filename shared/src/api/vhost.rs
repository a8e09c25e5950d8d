//! `vhost_blk_*` methods: virtio-blk devices served over vhost-user (virtio 1.2 §5.2).

use serde::{Deserialize, Serialize};

pub const DEFAULT_QUEUES: u16 = 1;
/// Upper bound on queues per device; vhost-user-blk clients rarely use more than the vCPUs.
pub const MAX_QUEUES: u16 = 64;
pub const DEFAULT_QUEUE_SIZE: u16 = 1024;

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
    /// Socket path. Default `<run-dir>/vhost-<name>.sock`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<String>,
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
    pub queues: u16,
    pub queue_size: u16,
    pub read_only: bool,
    /// True while a vhost-user client (a VM, libblkio) is connected.
    pub connected: bool,
}
