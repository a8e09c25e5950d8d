//! `qos_*` and `stats_*` methods: per-volume and per-tenant I/O limits (token buckets) and the
//! counters the data path keeps.
//!
//! A limit is a rate in operations or bytes per second; `None` means unlimited. Reads count
//! against the read and total limits, writes against the write and total limits; Flush,
//! Discard and Write Zeroes count as one operation against the total IOPS limit (Discard and
//! Write Zeroes also against the write IOPS limit) and move no bytes. There is no floor: any
//! rate from 1 upwards is honoured.

use serde::{Deserialize, Serialize};

/// Default burst: how many milliseconds of each rate a bucket holds when full.
pub const DEFAULT_BURST_MS: u32 = 100;
/// Longest burst accepted (a minute of full rate).
pub const MAX_BURST_MS: u32 = 60_000;
/// Default share of a tenant under contention for a shared limit.
pub const DEFAULT_WEIGHT: u32 = 100;
pub const MAX_WEIGHT: u32 = 10_000;

/// The limits of one volume or tenant.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct QosLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_iops: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_iops: Option<u64>,
    /// Reads, writes and every other command together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_bps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_bps: Option<u64>,
    /// Read and write bytes per second together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bps: Option<u64>,
    /// Milliseconds of each rate that may pass at once after an idle spell (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst_ms: Option<u32>,
    /// Share under contention for the daemon-wide limit (default 100); tenants only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

impl QosLimits {
    /// True when no rate is limited (burst and weight alone limit nothing).
    pub fn is_unlimited(&self) -> bool {
        self.rates().iter().all(|(_, r)| r.is_none())
    }

    /// The six rates by name, in display order.
    pub fn rates(&self) -> [(&'static str, Option<u64>); 6] {
        [
            ("read_iops", self.read_iops),
            ("write_iops", self.write_iops),
            ("iops", self.iops),
            ("read_bps", self.read_bps),
            ("write_bps", self.write_bps),
            ("bps", self.bps),
        ]
    }

    /// Reject zero rates (use `qos_clear` or leave the rate out for "unlimited"), and bursts
    /// or weights out of range.
    pub fn validate(&self) -> Result<(), String> {
        for (name, r) in self.rates() {
            if r == Some(0) {
                return Err(format!(
                    "{name} must be at least 1 (leave it out for no limit)"
                ));
            }
        }
        if let Some(b) = self.burst_ms {
            if b == 0 || b > MAX_BURST_MS {
                return Err(format!("burst_ms must be 1 to {MAX_BURST_MS} (got {b})"));
            }
        }
        if let Some(w) = self.weight {
            if w == 0 || w > MAX_WEIGHT {
                return Err(format!("weight must be 1 to {MAX_WEIGHT} (got {w})"));
            }
        }
        Ok(())
    }

    /// `self` with every field `other` sets replaced (how `qos_set` changes a subset).
    pub fn merged(&self, other: &QosLimits) -> QosLimits {
        QosLimits {
            read_iops: other.read_iops.or(self.read_iops),
            write_iops: other.write_iops.or(self.write_iops),
            iops: other.iops.or(self.iops),
            read_bps: other.read_bps.or(self.read_bps),
            write_bps: other.write_bps.or(self.write_bps),
            bps: other.bps.or(self.bps),
            burst_ms: other.burst_ms.or(self.burst_ms),
            weight: other.weight.or(self.weight),
        }
    }
}

/// What a limit applies to: exactly one of a volume, a tenant (all its volumes together), or
/// the whole daemon (`global`, shared between tenants by weight).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct QosTarget {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub global: bool,
}

/// `qos_set`: the fields given replace the target's current ones; the others stay.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct QosSet {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub global: bool,
    #[serde(default)]
    pub limits: QosLimits,
}

/// `qos_show` element.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct QosInfo {
    /// `volume`, `tenant` or `global`.
    pub kind: String,
    /// The volume or tenant name (`*` for global).
    pub name: String,
    pub limits: QosLimits,
}

/// `stats_get` params: optionally one volume.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StatsGet {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
}

/// Counters of one volume since nacred started (monotonic; rates are differences).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct VolumeStats {
    pub volume: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub read_ops: u64,
    pub write_ops: u64,
    pub other_ops: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    /// Requests inside the volume now (queued by QoS or at the device).
    pub queue_depth: u64,
    /// Requests waiting for QoS tokens now.
    pub throttled: u64,
    /// Requests that had to wait for tokens, ever.
    pub throttled_total: u64,
    /// Latency quantiles over all requests since start, microseconds (bucket upper bounds).
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn validate_and_merge() {
        let l = QosLimits {
            iops: Some(2000),
            ..Default::default()
        };
        assert!(l.validate().is_ok());
        assert!(!l.is_unlimited());
        assert!(QosLimits::default().is_unlimited());
        let zero = QosLimits {
            read_bps: Some(0),
            ..Default::default()
        };
        assert!(zero.validate().unwrap_err().contains("read_bps"));
        let burst = QosLimits {
            burst_ms: Some(0),
            ..Default::default()
        };
        assert!(burst.validate().is_err());
        let m = l.merged(&QosLimits {
            write_iops: Some(5),
            ..Default::default()
        });
        assert_eq!(m.iops, Some(2000));
        assert_eq!(m.write_iops, Some(5));
        let e = serde_json::from_str::<QosSet>(r#"{"volume":"v","limits":{"iosp":1}}"#);
        assert!(e.unwrap_err().to_string().contains("iosp"));
    }
}
