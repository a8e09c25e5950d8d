//! The exporter index: which frontends serve which volume.
//!
//! Derived from the persisted records (vhost-user-blk devices and NVMe-oF namespaces) each
//! time it is asked, not kept beside them, so it can never disagree with what would be
//! replayed. A volume with exporters cannot be deleted, shrunk or crypto-erased.

use std::fmt;

use crate::control::error::RpcError;
use crate::control::state::State;

/// A frontend serving a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exporter {
    /// A vhost-user-blk device, by name.
    VhostBlk(String),
    /// An NVMe-oF namespace: subsystem NQN and NSID.
    Nvmf { nqn: String, nsid: u32 },
    /// An encryption layer over the volume, by name.
    Layer(String),
}

/// As `volume_list`'s `exported_by` and the refusals show them: `vhost-blk:NAME`,
/// `nvmf:NQN/NSID`.
impl fmt::Display for Exporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exporter::VhostBlk(name) => write!(f, "vhost-blk:{name}"),
            Exporter::Nvmf { nqn, nsid } => write!(f, "nvmf:{nqn}/{nsid}"),
            Exporter::Layer(name) => write!(f, "encrypted-volume:{name}"),
        }
    }
}

/// The frontends serving `volume`: vhost-user-blk devices first, then NVMe-oF namespaces
/// (by NQN, then NSID), then the encryption layers over it.
pub fn exporters(state: &State, volume: &str) -> Vec<Exporter> {
    let vhost = state
        .vhost_blk
        .values()
        .filter(|v| v.volume == volume)
        .map(|v| Exporter::VhostBlk(v.name.clone()));
    let nvmf = state.nvmf.subsystems.values().flat_map(|s| {
        s.namespaces
            .iter()
            .filter(|(_, v)| v.as_str() == volume)
            .map(move |(&nsid, _)| Exporter::Nvmf {
                nqn: s.nqn.clone(),
                nsid,
            })
    });
    let layers = state
        .volumes
        .values()
        .filter(|v| v.over.as_deref() == Some(volume))
        .map(|v| Exporter::Layer(v.name.clone()));
    vhost.chain(nvmf).chain(layers).collect()
}

/// [`exporters`] as the strings `volume_list` reports.
pub fn exporter_names(state: &State, volume: &str) -> Vec<String> {
    exporters(state, volume)
        .iter()
        .map(Exporter::to_string)
        .collect()
}

/// Refuse a change to `volume` while frontends serve it; `what` says what to do.
pub(super) fn refuse_if_exported(
    state: &State,
    volume: &str,
    message: impl FnOnce(&str) -> String,
) -> Result<(), RpcError> {
    let users = exporter_names(state, volume);
    if users.is_empty() {
        return Ok(());
    }
    Err(RpcError::busy(message(&users.join(", "))))
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::control::state::fixtures::subsystem;
    use crate::control::state::VhostBlkRecord;

    /// The index lists every frontend of a volume and only its own, vhost-user-blk devices
    /// first, in the form `volume_list` and the refusals show.
    #[test]
    fn exporters_of_a_volume_are_its_devices_then_its_namespaces() {
        let mut s = State::default();
        for (name, volume) in [("d1", "v"), ("d2", "w")] {
            s.vhost_blk.insert(
                name.into(),
                VhostBlkRecord {
                    transport: None,
                    name: name.into(),
                    volume: volume.into(),
                    socket: format!("/run/{name}.sock").into(),
                    queues: 1,
                    queue_size: 128,
                    read_only: false,
                },
            );
        }
        for sub in [
            subsystem("nqn.2024-01.io.nacre:a", &[(1, "v"), (2, "w"), (3, "v")]),
            subsystem("nqn.2024-01.io.nacre:b", &[(7, "v")]),
        ] {
            s.nvmf.subsystems.insert(sub.nqn.clone(), sub);
        }
        assert_eq!(
            exporter_names(&s, "v"),
            [
                "vhost-blk:d1",
                "nvmf:nqn.2024-01.io.nacre:a/1",
                "nvmf:nqn.2024-01.io.nacre:a/3",
                "nvmf:nqn.2024-01.io.nacre:b/7",
            ]
        );
        assert!(exporters(&s, "unexported").is_empty());
        let e = refuse_if_exported(&s, "w", |u| format!("exported by {u}")).unwrap_err();
        assert_eq!(e.code, nacre_shared::rpc::BUSY);
        assert_eq!(
            e.message,
            "exported by vhost-blk:d2, nvmf:nqn.2024-01.io.nacre:a/2"
        );
        assert!(refuse_if_exported(&s, "unexported", |u| u.to_string()).is_ok());
    }
}
