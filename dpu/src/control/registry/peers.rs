//! GPU peer windows hosts register ([`super::windows`] holds them), and matching the disks a
//! host sees to volumes.

use nacre_shared::api::host::{normalize_id128, MatchedVolume, SeenDevice};
use nacre_shared::api::peer::PeerWindowInfo;
use tracing::info;

use super::exporters::{exporters, Exporter};
use super::store::Registry;
use super::windows::Window;
use crate::control::error::RpcError;
use crate::control::state::{State, VolumeRecord};

impl Registry {
    /// A fresh connection number for the host channel (from the sequence window ids come
    /// from).
    pub fn next_host_conn(&self) -> u64 {
        self.windows.next_id()
    }

    /// The host-channel connection `conn` ended: drop the windows it registered. Returns how
    /// many.
    pub fn host_conn_closed(&self, conn: u64) -> usize {
        let mut w = self.windows.lock();
        let before = w.len();
        w.retain(|id, win| {
            let keep = win.conn != Some(conn);
            if !keep {
                info!(window = id, gpu = %win.info.gpu_uuid, host = %win.info.host,
                    tenant = %win.info.tenant, "peer window removed: its host channel closed");
            }
            keep
        });
        before - w.len()
    }

    /// Record a window `make` describes (given its id) for `tenant`'s host; `conn` is the
    /// host-channel connection registering it, `None` for the operator.
    pub fn register_window(
        &self,
        tenant: &str,
        conn: Option<u64>,
        make: impl FnOnce(u64) -> PeerWindowInfo,
    ) -> Result<PeerWindowInfo, RpcError> {
        if !self.read_state(|s| s.tenants.contains_key(tenant)) {
            return Err(RpcError::not_found("tenant", tenant));
        }
        let info = make(self.windows.next_id());
        info!(window = info.id, gpu = %info.gpu_uuid, bdf = %info.bdf, length = info.length,
            host = %info.host, tenant = %info.tenant, "peer window registered");
        self.windows.lock().insert(
            info.id,
            Window {
                info: info.clone(),
                conn,
            },
        );
        Ok(info)
    }

    /// Remove window `id` if `mine` says the caller may; another's window is reported as
    /// absent, so a host learns nothing of others.
    pub fn unregister_window(
        &self,
        id: u64,
        mine: impl FnOnce(&PeerWindowInfo) -> bool,
    ) -> Result<(), RpcError> {
        let mut w = self.windows.lock();
        match w.get(&id) {
            Some(win) if mine(&win.info) => {
                let win = w.remove(&id).expect("present");
                info!(window = id, gpu = %win.info.gpu_uuid, host = %win.info.host,
                    tenant = %win.info.tenant, "peer window unregistered");
                Ok(())
            }
            _ => Err(RpcError::not_found("peer window", &id.to_string())),
        }
    }

    /// The windows `visible` lets the caller see, by id.
    pub fn windows(&self, visible: impl Fn(&PeerWindowInfo) -> bool) -> Vec<PeerWindowInfo> {
        self.windows
            .lock()
            .values()
            .map(|win| &win.info)
            .filter(|i| visible(i))
            .cloned()
            .collect()
    }

    /// The volume behind each device a host sees (`None` where none is, or where it is not
    /// `tenant`'s, when a tenant is given).
    pub fn match_devices(
        &self,
        tenant: Option<&str>,
        seen: &[SeenDevice],
    ) -> Vec<Option<MatchedVolume>> {
        self.read_state(|state| seen.iter().map(|s| match_one(state, tenant, s)).collect())
    }
}

/// The volume behind one seen device. NVMe namespaces match by NGUID, then UUID, then
/// subsystem NQN and NSID; virtio-blk disks by serial. A caller bound to a tenant matches
/// only that tenant's volumes.
fn match_one(state: &State, tenant: Option<&str>, s: &SeenDevice) -> Option<MatchedVolume> {
    let visible = |v: &&VolumeRecord| tenant.is_none() || v.tenant.as_deref() == tenant;
    let by_id128 = |x: &Option<String>| {
        let want = normalize_id128(x.as_deref()?)?;
        state
            .volumes
            .values()
            .filter(visible)
            .find(|v| normalize_id128(&v.uuid).as_deref() == Some(want.as_str()))
    };
    let nvme = s.nguid.is_some() || s.uuid.is_some() || s.subsysnqn.is_some();
    let (vol, by) = if let Some(v) = by_id128(&s.nguid) {
        (v, "nguid")
    } else if let Some(v) = by_id128(&s.uuid) {
        (v, "uuid")
    } else if let (Some(nqn), Some(nsid)) = (&s.subsysnqn, s.nsid) {
        let name = state.nvmf.subsystems.get(nqn)?.namespaces.get(&nsid)?;
        let v = state.volumes.get(name).filter(|v| visible(v))?;
        (v, "nsid")
    } else if nvme {
        return None;
    } else {
        let serial = s.serial.as_deref()?.trim();
        let v = state
            .volumes
            .values()
            .filter(visible)
            .find(|v| !serial.is_empty() && v.serial == serial)?;
        (v, "serial")
    };
    // The exports of the kind the host sees: an NVMe namespace's (of the subsystem it names,
    // if it names one), or a virtio-blk disk's.
    let exports = exporters(state, &vol.name)
        .into_iter()
        .filter(|e| match (nvme, e) {
            (true, Exporter::Nvmf { nqn, .. }) => {
                s.subsysnqn.as_deref().is_none_or(|want| want == nqn)
            }
            (false, Exporter::VhostBlk(_)) => true,
            _ => false,
        })
        .map(|e| e.to_string())
        .collect();
    Some(MatchedVolume {
        volume: vol.name.clone(),
        tenant: vol.tenant.clone(),
        encrypted: vol.encrypted,
        size: vol.size,
        block_size: vol.block_size,
        matched_by: by.into(),
        exports,
    })
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::control::state::fixtures;

    /// A namespace a host sees lists the exports of its own subsystem only, even where
    /// another subsystem's NQN starts with it (NQNs may contain '/', the separator in
    /// `nvmf:NQN/NSID`).
    #[test]
    fn nvme_match_lists_the_exports_of_the_seen_subsystem_only() {
        let uuid = "6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
        let mut s = State::default();
        s.volumes.insert("v".into(), fixtures::volume("v", uuid));
        for (nqn, nsid) in [
            ("nqn.2024-01.io.nacre:a", 1),
            ("nqn.2024-01.io.nacre:a/b", 2),
        ] {
            s.nvmf
                .subsystems
                .insert(nqn.into(), fixtures::subsystem(nqn, &[(nsid, "v")]));
        }
        let seen = SeenDevice {
            id: "nvme0n1".into(),
            nguid: Some(uuid.replace('-', "")),
            subsysnqn: Some("nqn.2024-01.io.nacre:a".into()),
            nsid: Some(1),
            ..Default::default()
        };
        let m = match_one(&s, None, &seen).expect("matched");
        assert_eq!(m.matched_by, "nguid");
        assert_eq!(m.exports, ["nvmf:nqn.2024-01.io.nacre:a/1"]);
        // Another tenant's caller sees nothing.
        assert!(match_one(&s, Some("other"), &seen).is_none());
    }
}
