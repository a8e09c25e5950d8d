//! `remote_*` methods: NVMe-oF controllers on remote storage shelves that nacred connects to
//! as a host (SPDK's `bdev_nvme_attach_controller`, `bdev_nvme_detach_controller`,
//! `bdev_nvme_get_controllers`, `bdev_nvme_discover`), and the layout of volumes built on
//! their namespaces.
//!
//! Failure knobs follow SPDK's meaning:
//! * `reconnect_delay_sec` — seconds between reconnection attempts.
//! * `ctrl_loss_timeout_sec` — give up (fail the controller, fail all I/O with a path error)
//!   after this many seconds without a connection; -1 retries forever, 0 never reconnects.
//! * `fast_io_fail_timeout_sec` — after this many seconds without a connection, I/O fails at
//!   once instead of waiting for the reconnection; 0 disables it.

use serde::{Deserialize, Serialize};

/// The NVMe/TCP well-known port (IANA 4420).
pub const DEFAULT_PORT: u16 = 4420;

/// `remote_attach`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RemoteAttach {
    /// nacre's name for the controller; volumes refer to its namespaces as `NAME:NSID`.
    pub name: String,
    /// `tcp` (default) or `rdma` (NVMe/RDMA: RoCEv2, InfiniBand, iWARP; needs an RDMA
    /// device with a route to `address`).
    #[serde(default = "default_transport")]
    pub transport: String,
    /// Portal address (IP or host name).
    pub address: String,
    #[serde(default = "default_port")]
    pub port: u16,
    /// Subsystem NQN.
    pub subnqn: String,
    /// Host NQN to present; default: nacred's own (`nqn.2014-08.org.nvmexpress:uuid:…`,
    /// the same for every remote).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostnqn: Option<String>,
    /// I/O queues (TCP or RDMA connections) to open; the controller may grant fewer. Default 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_queues: Option<u16>,
    /// Commands in flight per I/O queue. Default 128.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<u16>,
    #[serde(default)]
    pub header_digest: bool,
    #[serde(default)]
    pub data_digest: bool,
    /// Largest write sent inside the command capsule (bytes). Default 8192.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_capsule_data_size: Option<u32>,
    /// Keep Alive Timeout in milliseconds; 0 disables keep-alive. Default 10000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_alive_timeout_ms: Option<u32>,
    /// Default 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconnect_delay_sec: Option<u32>,
    /// Default 30; -1 forever; 0 never reconnect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ctrl_loss_timeout_sec: Option<i32>,
    /// Default 0 (disabled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_io_fail_timeout_sec: Option<u32>,
    /// Reset the controller when a command is outstanding this long. Default 30; 0 disables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_timeout_sec: Option<u32>,
    /// How long after a connection loss before its commands are resent (at least the
    /// controller's Command Quiesce Time). Default 1000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quiesce_time_ms: Option<u32>,
    /// DH-HMAC-CHAP (NVMe in-band authentication): the absolute path of a file, mode 0600,
    /// holding the host's secret (`DHHC-1:XX:...:`). Only the path is sent and persisted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_secret: Option<String>,
    /// The file of the controller's secret: every queue then also authenticates the shelf.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_ctrl_secret: Option<String>,
    /// NVMe/TCP over TLS 1.3 (TP 8011): the absolute path of a file, mode 0600, holding the
    /// configured PSK (`NVMeTLSkey-1:HH:...:`). Every queue then starts with a TLS handshake
    /// offering the PSK identity `NVMe0R0S <hostnqn> <subnqn>`. Only the path is sent and
    /// persisted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psk: Option<String>,
}

fn default_transport() -> String {
    "tcp".into()
}

fn default_port() -> u16 {
    DEFAULT_PORT
}

/// `remote_detach`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RemoteName {
    pub name: String,
}

/// `remote_list` parameters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RemoteList {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// `remote_discover`: read a portal's discovery log.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RemoteDiscover {
    #[serde(default = "default_transport")]
    pub transport: String,
    pub address: String,
    #[serde(default = "default_port")]
    pub port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostnqn: Option<String>,
}

/// One discovery log entry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DiscoveredSubsystem {
    /// `tcp`, `rdma`, or the TRTYPE number.
    pub transport: String,
    /// `nvme` or `discovery`.
    pub subtype: String,
    pub subnqn: String,
    pub address: String,
    pub port: String,
    pub portid: u16,
}

/// A namespace a remote controller presents.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RemoteNamespaceInfo {
    pub nsid: u32,
    pub block_size: u32,
    pub size: u64,
    /// `nguid:<hex>`, `uuid:<hex>`, `eui64:<hex>` or `none`: what multipath compares.
    pub id: String,
}

/// `remote_list` element.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RemoteInfo {
    pub name: String,
    pub transport: String,
    pub address: String,
    pub port: u16,
    pub subnqn: String,
    pub hostnqn: String,
    /// DH-HMAC-CHAP: `unidirectional` (the shelf checks this host) or `bidirectional` (each
    /// checks the other); absent without authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap: Option<String>,
    /// `tls` when the queues run over TLS with a PSK; absent for plain NVMe/TCP and RDMA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_channel: Option<String>,
    /// `connecting`, `live`, `failed` or `closed`.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cntlid: Option<u16>,
    #[serde(default)]
    pub io_queues: u16,
    #[serde(default)]
    pub queue_depth: u16,
    /// Sessions lost so far (each a reset of this controller alone).
    #[serde(default)]
    pub resets: u64,
    /// Bytes of I/O data copied through transport buffers (NVMe/RDMA's registered slot
    /// buffers; 0 over TCP): the copies zero copy would save.
    #[serde(default)]
    pub bounce_copy_bytes: u64,
    /// Bytes of I/O data the device moved straight from or into the requests' own memory
    /// (guest memory of a vhost-user-blk device, an encrypted volume's ciphertext buffers):
    /// NVMe/RDMA's zero-copy path.
    #[serde(default)]
    pub direct_bytes: u64,
    /// Of the live session (they restart at 0 with each reconnect): batches of commands a
    /// submitter sent itself when its plug closed (a vhost-user-blk worker's batch, an
    /// NVMe/TCP target's parse pass), and those of them the socket did not take whole.
    #[serde(default)]
    pub inline_sends: u64,
    #[serde(default)]
    pub inline_partial_sends: u64,
    /// Of the live session, NVMe/TCP: bytes of read data the kernel put straight into the
    /// requests' memory, and those copied there from the queue's receive buffer (short
    /// transfers, and all of them with a data digest).
    #[serde(default)]
    pub rx_direct_bytes: u64,
    #[serde(default)]
    pub rx_copied_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    #[serde(default)]
    pub namespaces: Vec<RemoteNamespaceInfo>,
    /// Volumes built on this controller's namespaces.
    #[serde(default)]
    pub used_by: Vec<String>,
}

/// How paths of one namespace share I/O.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum MultipathPolicy {
    /// Active-passive: the first live path in the order given.
    #[default]
    Failover,
    /// Active-active: rotate over the live paths.
    RoundRobin,
}

/// The layout of a `remote` volume (`volume_create` with `"backend": "remote"`).
///
/// Each extent names one namespace as `REMOTE:NSID`, or the same namespace through several
/// remotes (multipath) as `REMOTE:NSID+REMOTE:NSID`. One extent is a plain remote volume;
/// several are striped in `stripe_size` units. Example:
/// `{"extents": ["shelf1:1+shelf1b:1", "shelf2:1+shelf2b:1"], "stripe_size": 131072,
///   "multipath": "round_robin"}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RemoteLayout {
    pub extents: Vec<String>,
    /// Bytes, a power of two of at least the block size. Default 131072 (128 KiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stripe_size: Option<u64>,
    #[serde(default)]
    pub multipath: MultipathPolicy,
}

/// The default stripe unit.
pub const DEFAULT_STRIPE_SIZE: u64 = 128 << 10;

/// One path of an extent: (remote name, NSID).
pub type PathRef = (String, u32);

/// Parse an extent string (`REMOTE:NSID[+REMOTE:NSID…]`) into its paths.
pub fn parse_extent(s: &str) -> Result<Vec<PathRef>, String> {
    let mut out = Vec::new();
    for p in s.split('+') {
        let (remote, nsid) = p
            .rsplit_once(':')
            .ok_or_else(|| format!("extent {s:?}: {p:?} is not REMOTE:NSID (e.g. shelf1:1)"))?;
        let nsid: u32 = nsid
            .parse()
            .ok()
            .filter(|&n| n != 0 && n != u32::MAX)
            .ok_or_else(|| format!("extent {s:?}: {nsid:?} is not a namespace ID (1, 2, …)"))?;
        if remote.is_empty() {
            return Err(format!("extent {s:?}: remote name missing before ':'"));
        }
        if out.iter().any(|(r, _): &PathRef| r == remote) {
            return Err(format!(
                "extent {s:?} names remote {remote:?} twice: paths must be different controllers"
            ));
        }
        out.push((remote.to_string(), nsid));
    }
    Ok(out)
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn extents_parse() {
        assert_eq!(parse_extent("a:1").unwrap(), vec![("a".into(), 1)]);
        assert_eq!(
            parse_extent("a:1+b:2").unwrap(),
            vec![("a".into(), 1), ("b".into(), 2)]
        );
        assert!(parse_extent("a").is_err());
        assert!(parse_extent("a:0").is_err());
        assert!(parse_extent(":1").is_err());
        assert!(parse_extent("a:x").is_err());
        assert!(parse_extent("a:1+a:2").is_err());
    }

    #[test]
    fn attach_defaults_and_unknown_fields() {
        let a: RemoteAttach = serde_json::from_str(
            r#"{"name":"s","address":"10.0.0.1","subnqn":"nqn.2024-01.io.x:s"}"#,
        )
        .unwrap();
        assert_eq!((a.transport.as_str(), a.port), ("tcp", 4420));
        assert!(serde_json::from_str::<RemoteAttach>(
            r#"{"name":"s","address":"a","subnqn":"n","reconect_delay_sec":1}"#
        )
        .is_err());
        let l: RemoteLayout =
            serde_json::from_str(r#"{"extents":["a:1"],"multipath":"round_robin"}"#).unwrap();
        assert_eq!(l.multipath, MultipathPolicy::RoundRobin);
    }
}
