//! NVMe/RDMA host queues (placeholder until the queue is written).

use std::sync::Weak;

use nacre_shared::nvme::fabrics::ConnectData;
use nacre_shared::nvme::Completion as Cqe;

use super::queue::{Queue, QueueOwner, QueueParams};
use super::{ControllerConfig, FabricError};

pub struct RdmaQueue;

impl RdmaQueue {
    pub fn open(
        _cfg: &ControllerConfig,
        _params: QueueParams,
        _cd: &ConnectData,
        _session: u64,
        _owner: Weak<dyn QueueOwner>,
    ) -> Result<(Queue, Cqe), FabricError> {
        Err(FabricError::Connect(
            "the NVMe/RDMA initiator is not built yet".into(),
        ))
    }
}
