//! `volume_*` methods: named block devices with a size, a logical block size and a backend.

use serde::{Deserialize, Serialize};

pub use super::remote::RemoteLayout;

/// Where a volume's blocks live.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Process memory; contents are lost when nacred exits. For tests and scratch space.
    Ram,
    /// A sparse file in nacred's state directory (or at a given path). The default.
    #[default]
    File,
    /// Completes every request at once without touching data (SPDK's null bdev): benchmarks.
    Null,
    /// Namespaces on remote NVMe-oF controllers (see `remote_attach` and [`RemoteLayout`]).
    Remote,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Ram => "ram",
            BackendKind::File => "file",
            BackendKind::Null => "null",
            BackendKind::Remote => "remote",
        })
    }
}

/// Logical block sizes a volume may have (bytes).
pub const BLOCK_SIZES: [u32; 2] = [512, 4096];
pub const DEFAULT_BLOCK_SIZE: u32 = 4096;

/// `volume_create`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VolumeCreate {
    pub name: String,
    /// Size in bytes; must be a positive multiple of `block_size`. For `remote` volumes 0
    /// means the whole capacity of the extents; with `adopt_existing`, the file's size.
    #[serde(default)]
    pub size: u64,
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    #[serde(default)]
    pub backend: BackendKind,
    /// For `file`: the backing file. Default `<state-dir>/volumes/<name>.img`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The tenant that owns the volume (see `tenant_create`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Encrypt with a fresh per-volume AES-XTS key wrapped by the tenant's KEK.
    #[serde(default)]
    pub encrypt: bool,
    /// For `remote`: the namespaces the volume lives on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemoteLayout>,
    /// For `file`: serve the data of a backing file that already exists (size 0 takes the
    /// file's size; any other size must equal it). Without it an existing file is refused:
    /// nacre never hands old data to a new volume implicitly.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopt_existing: bool,
}

fn default_block_size() -> u32 {
    DEFAULT_BLOCK_SIZE
}

/// `volume_delete`, and any method that names one volume.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VolumeName {
    pub name: String,
}

/// `volume_delete`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VolumeDelete {
    pub name: String,
    /// Also delete the backing file of a file volume (default: keep it).
    #[serde(default)]
    pub delete_data: bool,
}

/// `volume_resize`: grow or shrink. Shrinking refuses while the volume is exported.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VolumeResize {
    pub name: String,
    pub size: u64,
}

/// `volume_list` element.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeInfo {
    pub name: String,
    pub size: u64,
    pub block_size: u32,
    pub backend: BackendKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The serial that devices report (virtio-blk GET_ID, NVMe serial/NGUID source).
    pub serial: String,
    /// Stable identity; NVMe NGUID/UUID derive from it.
    pub uuid: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default)]
    pub encrypted: bool,
    /// Names of devices (vhost-user-blk, NVMe-oF namespaces) exporting this volume.
    #[serde(default)]
    pub exported_by: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemoteLayout>,
    /// For an encryption layer: the volume whose blocks it encrypts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub over: Option<String>,
    /// `online`, or `failed` when nacred could not open it (see `reason`): I/O to a failed
    /// volume gets errors, never data it does not have.
    #[serde(default)]
    pub state: VolumeState,
    /// Why a volume is failed (e.g. its backing file is missing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Whether a volume serves I/O.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum VolumeState {
    #[default]
    Online,
    Failed,
}

impl std::fmt::Display for VolumeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            VolumeState::Online => "online",
            VolumeState::Failed => "failed",
        })
    }
}

/// `volume_list` parameters (all optional).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VolumeList {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}
