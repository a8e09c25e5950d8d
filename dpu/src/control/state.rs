//! nacred's persistent state: every control-plane object, as one JSON document.
//!
//! Every change is written to `<state-dir>/state.json` atomically — a temporary file is
//! written and fsynced, renamed over the old one, and the directory is fsynced — so a crash at
//! any point leaves either the old or the new state, never a torn one. nacred replays the
//! document on start. Fields default when absent so a state file written by an older nacred
//! still loads.
//!
//! Every record type of the document is defined here, so persistence depends on no part of
//! the control plane above it: the [registry](super::registry) owns the document in memory
//! and is the only writer.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nacre_shared::api::qos::QosLimits;
use nacre_shared::api::volume::BackendKind;
use serde::{Deserialize, Serialize};

use crate::fabric::NamespaceInfo;

/// Bumped when the layout changes incompatibly.
pub const STATE_FORMAT: u32 = 1;
pub const STATE_FILE: &str = "state.json";

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct State {
    #[serde(default)]
    pub format: u32,
    #[serde(default)]
    pub volumes: BTreeMap<String, VolumeRecord>,
    #[serde(default)]
    pub vhost_blk: BTreeMap<String, VhostBlkRecord>,
    #[serde(default)]
    pub nvmf: NvmfState,
    /// Tenants: policy, KEK description and check, wrapped data keys (never plaintext keys).
    #[serde(default)]
    pub tenants: BTreeMap<String, crate::crypto::tenant::TenantRecord>,
    /// Key managers (KMIP) that KMS tenants' envelope keys are encrypted by: address and
    /// certificate paths, never a key.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub kms: BTreeMap<String, crate::crypto::kmip::KmsEndpoint>,
    #[serde(default)]
    pub remotes: BTreeMap<String, RemoteRecord>,
    /// QoS limits of volumes, tenants and the daemon.
    #[serde(default)]
    pub qos: QosState,
    /// OPI resource names (`nvmeSubsystems/s1`, …) and the objects above they stand for
    /// (`control::opi`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub opi: BTreeMap<String, OpiBinding>,
}

/// What one OPI resource name stands for.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct OpiBinding {
    /// The object: a subsystem NQN, `NQN nsid`, `NQN tcp ADDR`, a volume, a remote; empty
    /// for a remote controller that has no path yet.
    pub object: String,
    /// The resource as the client gave it, protobuf-encoded, in hex (keys left out): what an
    /// idempotent Create compares and Get returns.
    pub spec: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeRecord {
    pub name: String,
    pub size: u64,
    pub block_size: u32,
    pub backend: BackendKind,
    /// Backing file of a `file` volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    pub uuid: String,
    pub serial: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default)]
    pub encrypted: bool,
    /// Layout of a `remote` volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<nacre_shared::api::remote::RemoteLayout>,
    /// An encryption layer's base: this volume is the encrypted view of that volume's
    /// blocks (its own backend, path and remote are unused), opened after the base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub over: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VhostBlkRecord {
    pub name: String,
    pub volume: String,
    /// The vhost-user socket, or with transport `vfio-user` the function's directory.
    pub socket: PathBuf,
    /// `vfio-user`: a virtio-blk PCI function; absent: vhost-user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    pub queues: u16,
    pub queue_size: u16,
    #[serde(default)]
    pub read_only: bool,
}

/// The persisted NVMe-oF configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct NvmfState {
    #[serde(default)]
    pub subsystems: BTreeMap<String, NvmfSubsystemRecord>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NvmfSubsystemRecord {
    pub nqn: String,
    pub serial: String,
    pub model: String,
    #[serde(default)]
    pub allow_any_host: bool,
    #[serde(default)]
    pub hosts: BTreeSet<String>,
    /// Hosts that must authenticate (DH-HMAC-CHAP): the files their secrets are in (never
    /// the secrets).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub host_keys: BTreeMap<String, nacre_shared::api::nvmf::NvmfHostKeyFiles>,
    /// NSID → volume name.
    #[serde(default)]
    pub namespaces: BTreeMap<u32, String>,
    /// Bound addresses (the port actually bound when 0 was asked for).
    #[serde(default)]
    pub listeners: BTreeSet<SocketAddr>,
    /// NVMe/RDMA listeners (RDMA CM addresses), likewise.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub rdma_listeners: BTreeSet<SocketAddr>,
    /// vfio-user listeners: directories of PCIe NVMe controllers' sockets.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub vfio_user_listeners: BTreeSet<std::path::PathBuf>,
    /// Those of `vfio_user_listeners` whose functions signal with MSI (the others: MSI-X).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub vfio_user_msi: BTreeSet<std::path::PathBuf>,
    /// TLS-only NVMe/TCP listeners (bound addresses).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub tls_listeners: BTreeSet<SocketAddr>,
    /// Host NQN → the file holding its TLS PSK (the key itself is never stored here).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub host_psks: BTreeMap<String, std::path::PathBuf>,
}

/// A remote NVMe-oF controller nacred connects to as a host, as persisted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RemoteRecord {
    pub name: String,
    pub transport: String,
    pub address: String,
    pub port: u16,
    pub subnqn: String,
    pub hostnqn: String,
    /// Host Identifier (a UUID), the same for every association of this host.
    pub hostid: String,
    pub io_queues: u16,
    pub queue_depth: u16,
    #[serde(default)]
    pub header_digest: bool,
    #[serde(default)]
    pub data_digest: bool,
    pub in_capsule_data_size: u32,
    pub keep_alive_timeout_ms: u32,
    pub reconnect_delay_sec: u32,
    pub ctrl_loss_timeout_sec: i32,
    #[serde(default)]
    pub fast_io_fail_timeout_sec: u32,
    pub io_timeout_sec: u32,
    pub quiesce_time_ms: u32,
    /// DH-HMAC-CHAP: the paths of the files (mode 0600) holding the host's and the
    /// controller's secrets; the secrets themselves are never in the state document.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_secret: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_ctrl_secret: Option<String>,
    /// NVMe/TCP over TLS: the path of the file (mode 0600) holding the configured PSK; the
    /// key itself is never in the state document.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psk: Option<String>,
    /// The namespaces found at attach: a reconnect that finds other identities fails the
    /// controller instead of writing to a different namespace.
    #[serde(default)]
    pub namespaces: Vec<NamespaceInfo>,
}

/// QoS limits in the state document.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct QosState {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub volumes: BTreeMap<String, QosLimits>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tenants: BTreeMap<String, QosLimits>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global: Option<QosLimits>,
}

/// The serial devices report: 20 ASCII characters, the NVMe Identify Controller SN width and
/// the virtio-blk GET_ID length, so both frontends show the same string.
pub fn serial_from_uuid(uuid: &uuid::Uuid) -> String {
    let hex = uuid.simple().to_string().to_ascii_uppercase();
    format!("NACRE{}", &hex[..15])
}

/// Load the state document, or `None` when there is none yet (a fresh state directory).
pub fn load(dir: &Path) -> std::io::Result<Option<State>> {
    let path = dir.join(STATE_FILE);
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let state: State = serde_json::from_str(&text).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is not a valid nacre state file: {e}", path.display()),
        )
    })?;
    if state.format > STATE_FORMAT {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{} was written by a newer nacred (format {}, this one reads {STATE_FORMAT})",
                path.display(),
                state.format
            ),
        ));
    }
    Ok(Some(state))
}

/// Write the state document atomically (write, fsync, rename, fsync the directory).
/// The file is private (0600): it names tenants and holds wrapped keys.
pub fn save(dir: &Path, state: &State) -> std::io::Result<()> {
    let mut state = state.clone();
    state.format = STATE_FORMAT;
    let text = serde_json::to_vec_pretty(&state).map_err(std::io::Error::other)?;
    let tmp = dir.join(format!(".{STATE_FILE}.tmp"));
    {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&text)?;
        f.write_all(b"\n")?;
        f.sync_all()?;
    }
    fs::rename(&tmp, dir.join(STATE_FILE))?;
    File::open(dir)?.sync_all()
}

/// Records for tests of the modules that read them.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;

    /// A 1 MiB RAM volume with 512-byte blocks, no tenant.
    pub fn volume(name: &str, uuid: &str) -> VolumeRecord {
        VolumeRecord {
            name: name.into(),
            size: 1 << 20,
            block_size: 512,
            backend: BackendKind::Ram,
            path: None,
            uuid: uuid.into(),
            serial: "s".into(),
            tenant: None,
            encrypted: false,
            remote: None,
            over: None,
        }
    }

    /// A subsystem open to any host exporting `namespaces` (NSID, volume), with no listener.
    pub fn subsystem(nqn: &str, namespaces: &[(u32, &str)]) -> NvmfSubsystemRecord {
        NvmfSubsystemRecord {
            nqn: nqn.into(),
            serial: "s".into(),
            model: "m".into(),
            allow_any_host: true,
            hosts: Default::default(),
            host_keys: Default::default(),
            namespaces: namespaces
                .iter()
                .map(|&(n, v)| (n, v.to_string()))
                .collect(),
            listeners: Default::default(),
            rdma_listeners: Default::default(),
            tls_listeners: Default::default(),
            host_psks: Default::default(),
            vfio_user_listeners: Default::default(),
            vfio_user_msi: Default::default(),
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn save_load_round_trip_and_absent() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(load(d.path()).unwrap(), None);
        let mut s = State::default();
        s.volumes.insert("v".into(), fixtures::volume("v", "u"));
        save(d.path(), &s).unwrap();
        let back = load(d.path()).unwrap().unwrap();
        assert_eq!(back.volumes, s.volumes);
        assert_eq!(back.format, STATE_FORMAT);
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(d.path().join(STATE_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn corrupt_or_newer_state_is_refused_with_a_reason() {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join(STATE_FILE), "{not json").unwrap();
        let e = load(d.path()).unwrap_err();
        assert!(
            e.to_string().contains("not a valid nacre state file"),
            "{e}"
        );
        fs::write(d.path().join(STATE_FILE), r#"{"format": 99}"#).unwrap();
        let e = load(d.path()).unwrap_err();
        assert!(e.to_string().contains("newer nacred"), "{e}");
        // Unknown future fields and missing ones are tolerated.
        fs::write(d.path().join(STATE_FILE), r#"{"format": 1, "whatever": 3}"#).unwrap();
        assert!(load(d.path()).unwrap().is_some());
    }
}
