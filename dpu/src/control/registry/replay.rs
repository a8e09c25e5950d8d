//! Bringing the persisted state back to life when nacred starts.

use std::sync::Arc;

use tracing::{info, warn};

use super::compose;
use super::keys::recognise_kms;
use super::store::Registry;
use super::{nvmf, remotes, vhost};
use crate::crypto::kek::KekSpec;

impl Registry {
    /// Replay the persisted state, in dependency order: QoS limits, remote controllers
    /// (started in the background), volumes (over them; encryption layers over their bases), vhost-user-blk devices and NVMe-oF
    /// subsystems (over the volumes). An object that fails to come back is logged and left
    /// in the state (so a missing backing file does not silently drop its configuration);
    /// the other objects still start. KMS tenants are unlocked first, each by its key
    /// manager, in parallel and without the control lock; one that does not answer (or
    /// refuses) leaves that tenant locked and its encrypted volumes failed, nothing else.
    pub(crate) fn replay(&self) {
        let state = self.lock().state.clone();
        self.apply_qos(&state.qos);
        remotes::replay(self, &state);
        self.unlock_kms_tenants(&state);
        let mut inner = self.lock();
        // Encryption layers after the volumes they lie over.
        let (layers, bases): (Vec<_>, Vec<_>) =
            state.volumes.values().partition(|r| r.over.is_some());
        for rec in bases.into_iter().chain(layers) {
            compose::reopen(self, &mut inner, rec);
        }
        crate::crypto::keys::scrub_stack();
        vhost::replay(&mut inner);
        nvmf::replay(&mut inner);
        info!(
            volumes = inner.live.volumes.len(),
            vhost_blk = inner.live.vhost_blk.len(),
            "state replayed"
        );
    }
}

impl Registry {
    fn unlock_kms_tenants(&self, state: &crate::control::state::State) {
        let kms_tenants: Vec<_> = state
            .tenants
            .values()
            .filter(|t| matches!(t.kek.spec, KekSpec::Kms { .. }))
            .collect();
        std::thread::scope(|s| {
            for t in kms_tenants {
                s.spawn(move || {
                    let r = self.kms_unlock(t).and_then(|k| {
                        let mut inner = self.lock();
                        let k = recognise_kms(&mut inner, t, k)?;
                        inner.live.keks.insert(t.name.clone(), Arc::new(k));
                        Ok(())
                    });
                    match r {
                        Ok(()) => info!(tenant = %t.name, "tenant unlocked by its KMS"),
                        Err(e) => warn!(tenant = %t.name, error = %e.message, "tenant locked"),
                    }
                    crate::crypto::keys::scrub_stack();
                });
            }
        });
    }
}
