//! `host_*` methods: what a host agent (`nacre-host`) asks about the disks it sees.
//!
//! The host reads its disks' identifiers from sysfs and sends them; nacred answers, for each
//! one, the volume behind it. The host learns nothing about volumes it does not see, and a
//! host credential (see `channel.rs`) only matches its own tenant's volumes.
//!
//! What identifies a nacre volume on the host:
//! * NVMe namespace: its NGUID and UUID (NVMe Base 2.0 §4.1.5.3 Namespace Identification
//!   Descriptors) are both the volume's UUID; Linux shows them in
//!   `/sys/block/nvmeXnY/{nguid,uuid,wwid}`. nacre reports no EUI-64 (it is zero).
//! * virtio-blk disk: the GET_ID string (virtio 1.2 §5.2.6, `VIRTIO_BLK_T_GET_ID`), shown
//!   in `/sys/block/vdX/serial`, is the volume's 20-character serial.

use serde::{Deserialize, Serialize};

/// One disk as the host sees it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SeenDevice {
    /// The host's name for it (`nvme0n1`, `vda`); echoed back.
    pub id: String,
    /// Serial: virtio-blk GET_ID; for NVMe the controller's (= subsystem's) serial.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// NVMe NGUID / UUID / EUI-64, in any of the forms Linux prints them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nguid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eui64: Option<String>,
    /// NVMe: the subsystem NQN and namespace ID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subsysnqn: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nsid: Option<u32>,
}

/// `host_devices_match`
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HostDevicesMatch {
    pub devices: Vec<SeenDevice>,
}

/// The volume behind a seen device.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MatchedVolume {
    pub volume: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub encrypted: bool,
    pub size: u64,
    pub block_size: u32,
    /// Which identifier matched: `nguid`, `uuid`, `serial` or `nsid`.
    pub matched_by: String,
    /// The nacre devices exporting the volume that fit what the host sees
    /// (`vhost-blk:NAME`, `nvmf:NQN/NSID`).
    pub exports: Vec<String>,
}

/// `host_devices_match` result element, in the order of the request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeviceMatch {
    pub id: String,
    /// `None`: not a nacre volume (or not one this caller may see).
    pub volume: Option<MatchedVolume>,
}

/// `host_whoami` result: who nacred takes the caller to be.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WhoAmI {
    /// `operator` (the Unix socket) or `host`.
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// 32 lowercase hex digits from an NGUID/UUID written with or without dashes, or `None`
/// when it is not 16 bytes of hex or is all zeros (Linux prints zeros when there is none).
pub fn normalize_id128(s: &str) -> Option<String> {
    let hex: String = s
        .trim()
        .chars()
        .filter(|c| *c != '-')
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let ok = hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit());
    (ok && hex.chars().any(|c| c != '0')).then_some(hex)
}

#[cfg(test)]
mod test {
    use super::normalize_id128;

    #[test]
    fn id128_forms() {
        let want = Some("0123456789abcdef0123456789abcdef".to_string());
        assert_eq!(
            normalize_id128("01234567-89ab-cdef-0123-456789ABCDEF\n"),
            want
        );
        assert_eq!(normalize_id128("0123456789abcdef0123456789abcdef"), want);
        assert_eq!(
            normalize_id128("00000000-0000-0000-0000-000000000000"),
            None
        );
        assert_eq!(normalize_id128("xyz"), None);
        assert_eq!(normalize_id128("0123456789abcdef"), None);
    }
}
