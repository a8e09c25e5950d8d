//! `nvmf_*` methods: NVMe-oF subsystems, namespaces, listeners and hosts (SPDK names:
//! `nvmf_subsystem_create`, `nvmf_subsystem_add_ns`, `nvmf_subsystem_add_listener`, …).

use serde::{Deserialize, Serialize};

/// `nvmf_subsystem_create`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NvmfSubsystemCreate {
    pub nqn: String,
    /// Serial number reported in Identify Controller (at most 20 ASCII characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// Model number (at most 40 ASCII characters). Default "nacre".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Let any host NQN connect (otherwise only hosts added with `nvmf_subsystem_add_host`).
    #[serde(default)]
    pub allow_any_host: bool,
}

/// `nvmf_subsystem_delete`, `nvmf_get_subsystems` filter.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NvmfSubsystemName {
    pub nqn: String,
}

/// `nvmf_subsystem_add_ns`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NvmfSubsystemAddNs {
    pub nqn: String,
    /// Name of the volume to export.
    pub volume: String,
    /// Namespace ID; default the lowest free one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nsid: Option<u32>,
}

/// `nvmf_subsystem_remove_ns`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NvmfSubsystemRemoveNs {
    pub nqn: String,
    pub nsid: u32,
}

/// `nvmf_subsystem_add_listener` / `nvmf_subsystem_remove_listener`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NvmfListener {
    pub nqn: String,
    /// IPv4 or IPv6 address to listen on.
    pub address: String,
    /// TCP port (4420 is the IANA NVMe-oF port; 8009 the discovery port); for RDMA the
    /// RDMA CM port (RoCEv2 uses UDP 4791 underneath whatever this is).
    #[serde(default = "default_port")]
    pub port: u16,
    /// `tcp` (the default) or `rdma` (NVMe/RDMA: RoCEv2, InfiniBand, iWARP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    /// NVMe/TCP only: a TLS-only listener (TLS 1.3 with a PSK, NVMe/TCP §3.6), as SPDK's
    /// `secure_channel`. Hosts need a PSK (`nvmf_subsystem_add_host` with `psk`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub secure_channel: bool,
    /// vfio-user only, `add_listener`: how the PCIe function signals its host,
    /// [`INTERRUPTS_MSIX`] (the default: a vector per queue) or [`INTERRUPTS_MSI`] (MSI, which
    /// QEMU 11.1.3 can hot-remove; with MSI-X its `device_del` aborts QEMU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interrupts: Option<String>,
}

/// `interrupts` of a vfio-user listener.
pub const INTERRUPTS_MSIX: &str = "msix";
pub const INTERRUPTS_MSI: &str = "msi";

/// Transports `nvmf_subsystem_add_listener` takes.
pub const TRANSPORT_TCP: &str = "tcp";
pub const TRANSPORT_RDMA: &str = "rdma";
/// A PCIe NVMe controller emulated over vfio-user: `address` is the directory its socket
/// (`cntrl`) goes in, as with SPDK's `VFIOUSER` transport; `port` is ignored.
pub const TRANSPORT_VFIO_USER: &str = "vfio-user";

pub fn default_port() -> u16 {
    4420
}

/// `nvmf_subsystem_add_host` / `nvmf_subsystem_remove_host`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NvmfHost {
    pub nqn: String,
    pub host: String,
    /// `add_host` only: a file holding the host's DH-HMAC-CHAP secret (`DHHC-1:XX:...:`,
    /// mode 0600): the host must then authenticate (NVMe Base 2.0 §8.13). The path, not
    /// the secret, is what nacred keeps. Adding a host again replaces its keys (none: the
    /// host no longer authenticates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_key: Option<std::path::PathBuf>,
    /// `add_host` only, with `dhchap_key`: a file holding the controller's secret, with
    /// which the controller answers a host that authenticates it too (bidirectional).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_ctrlr_key: Option<std::path::PathBuf>,
    /// `add_host` only, with `dhchap_key`: the hashes this host may authenticate with
    /// (`sha256`, `sha384`, `sha512`; default all). The strongest the host offers is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_digests: Option<Vec<String>>,
    /// `add_host` only, with `dhchap_key`: the DH groups it may use (`null`, `ffdhe2048` ..
    /// `ffdhe8192`; default all). The first the host offers in the order ffdhe2048,
    /// ffdhe3072, ffdhe4096, ffdhe6144, ffdhe8192, null is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_dhgroups: Option<Vec<String>>,
    /// The host's TLS PSK for TLS listeners: the path of a file (mode 0600) holding it in the
    /// interchange format `NVMeTLSkey-1:HH:...:` (SPDK names a keyring key here; nacred reads
    /// the file, and persists only its path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psk: Option<String>,
}

/// The key files of a host that must authenticate, as nacred keeps them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NvmfHostKeyFiles {
    pub dhchap_key: std::path::PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_ctrlr_key: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_digests: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_dhgroups: Option<Vec<String>>,
}

/// `nvmf_subsystem_allow_any_host`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NvmfAllowAnyHost {
    pub nqn: String,
    pub allow_any_host: bool,
}

/// A namespace in `nvmf_get_subsystems`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NvmfNamespaceInfo {
    pub nsid: u32,
    /// The volume name.
    pub name: String,
    /// NGUID and UUID, as 32 hex digits.
    pub nguid: String,
    pub size: u64,
    pub block_size: u32,
}

/// `nvmf_get_subsystems` element.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NvmfSubsystemInfo {
    pub nqn: String,
    /// "nvme" or "discovery".
    pub subtype: String,
    pub serial: String,
    pub model: String,
    pub allow_any_host: bool,
    pub hosts: Vec<String>,
    /// Hosts that must authenticate (DH-HMAC-CHAP), and how: `unidirectional` or
    /// `bidirectional` (a controller key is configured too).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub dhchap: std::collections::BTreeMap<String, String>,
    /// `address:port` strings; NVMe/RDMA listeners as `rdma:address:port`.
    pub listeners: Vec<String>,
    pub namespaces: Vec<NvmfNamespaceInfo>,
    /// Controllers currently connected.
    pub controllers: u32,
}

/// Whether a configured listener accepts connections: `listening`, or `failed` with the
/// reason (e.g. its port is taken after a restart; nacred keeps retrying it).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NvmfListenerState {
    /// `address:port`.
    pub address: String,
    /// "listening" or "failed".
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// vfio-user listeners: how the function signals, `msix` or `msi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interrupts: Option<String>,
}

/// `nvmf_get_subsystems` element as nacred answers it: the subsystem and the state of each
/// configured listener (`listeners` holds only those that listen).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NvmfSubsystemStatus {
    #[serde(flatten)]
    pub info: NvmfSubsystemInfo,
    #[serde(default)]
    pub listener_states: Vec<NvmfListenerState>,
}

/// `nvmf_get_stats`: what the NVMe/TCP target's reactors did (SPDK's method name; its
/// poll groups are nacre's reactors).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NvmfStats {
    /// The reactors' poll policy: "adaptive", "always" or "off" (nacred's `--nvmf-poll`).
    pub poll: String,
    pub reactors: Vec<NvmfReactorStats>,
    /// Each PCIe controller served over vfio-user: its poller (one thread per controller).
    #[serde(default)]
    pub pcie: Vec<NvmfPcieStats>,
}

/// One vfio-user listener's controller poller in `nvmf_get_stats`: counts since the listener
/// started, published by the poller at least every 1024 passes and before each pause. Its
/// load is `busy_ns` over the span of `at_ns` between two readings (SPDK's `thread_get_stats`
/// busy ticks): a poller that spins while it waits for work still uses its whole core.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NvmfPcieStats {
    pub nqn: String,
    /// The listener's directory (the socket is `DIR/cntrl`).
    pub path: String,
    /// Passes that found work (a command fetched or a held completion posted).
    pub busy_passes: u64,
    /// Passes that found nothing.
    pub idle_passes: u64,
    /// Nanoseconds spent in passes that found work.
    pub busy_ns: u64,
    /// Times the poller yielded or slept between passes.
    pub pauses: u64,
    /// The poller's monotonic clock (ns) when it published these.
    pub at_ns: u64,
}

/// One reactor thread of `nvmf_get_stats`; counts since the target started, published by
/// the reactor every 10 ms while busy and whenever it sleeps.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NvmfReactorStats {
    /// Connections it serves.
    pub connections: u64,
    /// Passes that found work.
    pub busy_passes: u64,
    /// Busy-polls that found nothing: the CPU polling cost.
    pub idle_polls: u64,
    /// Times it blocked in epoll_wait.
    pub sleeps: u64,
    /// Of those, sleeps taken at once after a flush answered 8 or more commands of one
    /// connection (the adaptive policy's deep-host rule).
    pub deep_sleeps: u64,
}
