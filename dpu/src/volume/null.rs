//! The null backend: completes every request at once without touching data, like SPDK's null
//! bdev and QEMU's `null-co`. It exists to measure the cost of everything above the medium.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{BlockDevice, Geometry, IoCompletion, IoRequest, IoResult};

pub struct NullVolume {
    size: AtomicU64,
    block_size: u32,
}

impl NullVolume {
    pub fn new(size: u64, block_size: u32) -> Self {
        NullVolume {
            size: AtomicU64::new(size),
            block_size,
        }
    }
}

// SAFETY: reads are zero-filled before the completion is reported; nothing is kept.
unsafe impl BlockDevice for NullVolume {
    fn geometry(&self) -> Geometry {
        Geometry {
            size: self.size.load(Ordering::Relaxed),
            block_size: self.block_size,
        }
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let r = self.geometry().check(&req);
        done.complete(req.tag, r);
    }

    fn resize(&self, new_size: u64) -> IoResult {
        self.size.store(new_size, Ordering::Relaxed);
        Ok(())
    }
}
