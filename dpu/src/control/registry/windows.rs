//! The GPU peer windows hosts registered, by id.
//!
//! Windows are not persisted: one registered over the host channel lives as long as that
//! connection (the GPU memory behind it is pinned by the host process at the other end).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use nacre_shared::api::peer::PeerWindowInfo;

/// Registered peer windows, by id.
#[derive(Default)]
pub(super) struct Windows {
    next: AtomicU64,
    windows: Mutex<BTreeMap<u64, Window>>,
}

pub(super) struct Window {
    pub info: PeerWindowInfo,
    /// The host-channel connection that registered it (it goes when that connection does).
    pub conn: Option<u64>,
}

impl Windows {
    pub fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Window>> {
        self.windows.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }
}
