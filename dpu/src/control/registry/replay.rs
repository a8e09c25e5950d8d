//! Bringing the persisted state back to life when nacred starts.

use tracing::info;

use super::compose;
use super::store::Registry;
use super::{nvmf, remotes, vhost};

impl Registry {
    /// Replay the persisted state, in dependency order: QoS limits, remote controllers
    /// (started in the background), volumes (over them), vhost-user-blk devices and NVMe-oF
    /// subsystems (over the volumes). An object that fails to come back is logged and left
    /// in the state (so a missing backing file does not silently drop its configuration);
    /// the other objects still start.
    pub(crate) fn replay(&self) {
        let state = self.lock().state.clone();
        self.apply_qos(&state.qos);
        remotes::replay(self, &state);
        let mut inner = self.lock();
        for rec in state.volumes.values() {
            compose::reopen(self, &mut inner, rec);
        }
        vhost::replay(&mut inner);
        nvmf::replay(&mut inner);
        info!(
            volumes = inner.live.volumes.len(),
            vhost_blk = inner.live.vhost_blk.len(),
            "state replayed"
        );
    }
}
