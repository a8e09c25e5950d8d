//! An encrypted volume whose key can be withdrawn while it is exported.
//!
//! Devices (vhost-user-blk, NVMe-oF namespaces) hold their volume for as long as they run.
//! For an encrypted volume they hold a [`KeyGate`]: it forwards to the open
//! [`super::volume::EncryptedVolume`] while the tenant is unlocked, and to a volume that
//! fails every request while it is locked. Locking swaps the inside out, so the data key
//! (inside the encrypted volume) is dropped, and zeroed, once requests already submitted
//! to it finish; unlocking swaps a freshly opened encrypted volume back in. Hosts see I/O
//! errors in between, never zeros and never data from another key.

use std::sync::{Arc, RwLock};

use crate::volume::{BlockDevice, Geometry, IoCompletion, IoRequest, IoResult};

pub struct KeyGate {
    inner: RwLock<Arc<dyn BlockDevice>>,
}

impl KeyGate {
    pub fn new(dev: Arc<dyn BlockDevice>) -> Self {
        KeyGate {
            inner: RwLock::new(dev),
        }
    }

    fn current(&self) -> Arc<dyn BlockDevice> {
        self.inner.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Serve `dev` from now on; the previous device is dropped after the lock is released
    /// (its last request may still hold it).
    pub fn set(&self, dev: Arc<dyn BlockDevice>) {
        let old = std::mem::replace(
            &mut *self.inner.write().unwrap_or_else(|p| p.into_inner()),
            dev,
        );
        drop(old);
    }
}

// SAFETY: hands each request, segments and completion unchanged, to the current inner
// device, which keeps the contract itself.
unsafe impl BlockDevice for KeyGate {
    fn geometry(&self) -> Geometry {
        self.current().geometry()
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        self.current().submit(req, done)
    }

    fn resize(&self, new_size: u64) -> IoResult {
        self.current().resize(new_size)
    }
}
