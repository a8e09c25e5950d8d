//! virtio-blk over vhost-user. (Placeholder with the agreed API until the frontend lands.)

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::volume::BlockDevice;

pub struct VhostBlkConfig {
    pub socket: PathBuf,
    pub queues: u16,
    pub queue_size: u16,
    pub read_only: bool,
    pub serial: String,
}

#[derive(Debug, thiserror::Error)]
#[error("vhost-user-blk frontend not built yet")]
pub struct VhostBlkError;

pub struct VhostBlkServer {
    socket: PathBuf,
}

impl VhostBlkServer {
    pub fn start(
        config: VhostBlkConfig,
        _volume: Arc<dyn BlockDevice>,
    ) -> Result<Self, VhostBlkError> {
        Ok(VhostBlkServer {
            socket: config.socket,
        })
    }
    pub fn is_connected(&self) -> bool {
        false
    }
    pub fn socket(&self) -> &Path {
        &self.socket
    }
    pub fn stop(self) {}
}
