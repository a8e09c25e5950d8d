//! The daemon's own series on the Prometheus endpoint, built at scrape time from the
//! registry as metric families for the `prometheus` crate's text encoder (with the volume
//! series: [`crate::telemetry`]): devices (vhost-user-blk devices and NVMe-oF namespaces, each with the volume it
//! serves, so per-device rates join the volume series `on (volume)`), remote controller path
//! states, sessions lost (reconnects) and established, bytes copied through transport
//! buffers and moved directly (zero copy), the configured QoS limits, and KMIP key-manager
//! requests (answers, failures, seconds spent).

use std::sync::Arc;

use nacre_shared::api::qos::QosLimits;
use prometheus::proto::{LabelPair, Metric, MetricFamily, MetricType, Summary};

use super::registry::{PathState, Registry};
use crate::telemetry::{counter, family, gauge, label};

/// Path states (one per remote controller; every state a series, 1 for the current one, as
/// Prometheus enums go).
const PATH_STATES: [&str; 4] = ["live", "connecting", "failed", "closed"];

/// A counter of remote controllers: its name, its help, and its value for one.
type PathCounter = (&'static str, &'static str, fn(&PathState) -> u64);

/// Give the metrics endpoint the daemon's own series.
pub fn export_daemon_series(registry: &Arc<Registry>) {
    let weak = Arc::downgrade(registry);
    registry.qos().telemetry().set_extra(Box::new(move || {
        weak.upgrade()
            .map(|r| daemon_families(&r))
            .unwrap_or_default()
    }));
}

/// Labels, given in name order (as Prometheus clients write them; the encoder keeps the
/// order it is given).
fn labels<const N: usize>(pairs: [(&str, &str); N]) -> Vec<LabelPair> {
    pairs.into_iter().map(|(n, v)| label(n, v)).collect()
}

/// The daemon's series, as metric families for the text encoder (label values are escaped
/// there). A family with no series is left out by the caller.
fn daemon_families(r: &Registry) -> Vec<MetricFamily> {
    let (devices, limits) = r.read_state(|state| {
        let mut devices: Vec<(String, &str, String)> = state
            .vhost_blk
            .values()
            .map(|r| (r.name.clone(), "vhost-blk", r.volume.clone()))
            .collect();
        for s in state.nvmf.subsystems.values() {
            for (nsid, volume) in &s.namespaces {
                devices.push((format!("{}/{nsid}", s.nqn), "nvmf", volume.clone()));
            }
        }
        let q = &state.qos;
        let mut limits: Vec<(&str, String, &str, u64)> = Vec::new();
        let mut add = |kind: &'static str, name: &str, l: &QosLimits| {
            for (rate, v) in l.rates() {
                if let Some(v) = v {
                    limits.push((kind, name.to_string(), rate, v));
                }
            }
        };
        for (v, l) in &q.volumes {
            add("volume", v, l);
        }
        for (t, l) in &q.tenants {
            add("tenant", t, l);
        }
        if let Some(l) = &q.global {
            add("global", "*", l);
        }
        (devices, limits)
    });
    let paths = r.path_states();
    let mut out = vec![
        family(
            "nacre_device_info",
            "A device serving a volume (kind vhost-blk: a vhost-user-blk device; nvmf: an NVMe-oF namespace, NQN/NSID).",
            MetricType::GAUGE,
            devices
                .iter()
                .map(|(dev, kind, vol)| {
                    gauge(labels([("device", dev), ("kind", kind), ("volume", vol)]), 1)
                })
                .collect(),
        ),
        family(
            "nacre_remote_path_state",
            "State of each remote NVMe-oF controller (a path to remote storage): 1 for the current state.",
            MetricType::GAUGE,
            paths
                .iter()
                .flat_map(|p| {
                    PATH_STATES.into_iter().map(|s| {
                        gauge(
                            labels([("remote", &p.remote), ("state", s)]),
                            u64::from(s == p.state),
                        )
                    })
                })
                .collect(),
        ),
    ];
    let counters: [PathCounter; 4] = [
        (
            "nacre_remote_resets_total",
            "Sessions of a remote controller lost (each one a reconnect).",
            |p| p.resets,
        ),
        (
            "nacre_remote_connects_total",
            "Sessions of a remote controller established.",
            |p| p.connects,
        ),
        (
            "nacre_remote_bounce_copy_bytes_total",
            "I/O bytes copied between requests and a remote controller's transport buffers (NVMe/RDMA slot buffers; 0 over TCP).",
            |p| p.bounce_copy_bytes,
        ),
        (
            "nacre_remote_direct_bytes_total",
            "I/O bytes a remote controller moved straight from or into the requests' memory (NVMe/RDMA zero copy).",
            |p| p.direct_bytes,
        ),
    ];
    for (name, help, value) in counters {
        let series = paths
            .iter()
            .map(|p| counter(labels([("remote", &p.remote)]), value(p)))
            .collect();
        out.push(family(name, help, MetricType::COUNTER, series));
    }
    out.push(family(
        "nacre_qos_limit",
        "Configured QoS limits (per second; rate names as in qos_set).",
        MetricType::GAUGE,
        limits
            .iter()
            .map(|(kind, name, rate, v)| {
                gauge(labels([("kind", kind), ("name", name), ("rate", rate)]), *v)
            })
            .collect(),
    ));
    out.extend(kms_families());
    out
}

/// KMIP requests per key manager and operation (`encrypt` at tenant creation and KEK
/// rotation, `decrypt` at start and unlock): a counter by result, and a summary of the
/// seconds each took (connect to answer, failures included).
fn kms_families() -> [MetricFamily; 2] {
    let stats = crate::crypto::kmip::stats();
    let requests = stats
        .iter()
        .flat_map(|((kms, op), s)| {
            [("ok", s.ok), ("error", s.errors)].map(|(result, n)| {
                counter(
                    labels([("kms", kms), ("operation", op), ("result", result)]),
                    n,
                )
            })
        })
        .collect();
    let seconds = stats
        .iter()
        .map(|((kms, op), s)| {
            let mut sum = Summary::default();
            sum.set_sample_sum(s.seconds_sum);
            sum.set_sample_count(s.ok + s.errors);
            let mut m = Metric::from_label(labels([("kms", kms), ("operation", op)]));
            m.set_summary(sum);
            m
        })
        .collect();
    [
        family(
            "nacre_kms_requests_total",
            "KMIP requests to a key manager, by operation and result (ok, error: unreachable, TLS, timeout or refused).",
            MetricType::COUNTER,
            requests,
        ),
        family(
            "nacre_kms_request_seconds",
            "Time a KMIP request took, connect to answer (failures included).",
            MetricType::SUMMARY,
            seconds,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use nacre_shared::api::nvmf::NvmfSubsystemCreate;
    use nacre_shared::api::qos::QosLimits;
    use serde_json::json;

    use crate::control::registry::{DaemonConfig, QosScope, Registry};

    /// The daemon's series come out of the text encoder as they were always written: HELP,
    /// TYPE and sample lines, labels in name order; a family with no series (no remote
    /// here) is left out.
    #[test]
    fn daemon_series_encode_as_prometheus_text() {
        let dir = tempfile::tempdir().unwrap();
        let config = DaemonConfig::new(dir.path().join("state"), dir.path().join("run"));
        for d in [&config.state_dir, &config.run_dir] {
            std::fs::create_dir_all(d).unwrap();
        }
        let r = Arc::new(Registry::new(config, Default::default()));
        r.replay();
        r.create_volume(
            &serde_json::from_value(json!({"name": "v", "size": 1 << 20, "backend": "ram"}))
                .unwrap(),
        )
        .unwrap();
        let nqn = "nqn.2024-01.io.nacre:metrics";
        r.create_subsystem(&NvmfSubsystemCreate {
            nqn: nqn.into(),
            serial: None,
            model: None,
            allow_any_host: true,
        })
        .unwrap();
        r.add_namespace(nqn, "v", Some(3)).unwrap();
        let scope = QosScope {
            volume: Some("v"),
            tenant: None,
            global: false,
        };
        let limits = QosLimits {
            iops: Some(100),
            ..Default::default()
        };
        r.set_qos(scope, &limits).unwrap();
        super::export_daemon_series(&r);

        let text = r.qos().telemetry().render();
        let expect = format!(
            "# HELP nacre_device_info A device serving a volume (kind vhost-blk: a vhost-user-blk device; nvmf: an NVMe-oF namespace, NQN/NSID).\n\
             # TYPE nacre_device_info gauge\n\
             nacre_device_info{{device=\"{nqn}/3\",kind=\"nvmf\",volume=\"v\"}} 1\n\
             # HELP nacre_qos_limit Configured QoS limits (per second; rate names as in qos_set).\n\
             # TYPE nacre_qos_limit gauge\n\
             nacre_qos_limit{{kind=\"volume\",name=\"v\",rate=\"iops\"}} 100\n"
        );
        assert!(text.contains(&expect), "{text}");
        assert!(!text.contains("nacre_remote_"), "{text}");
        r.shutdown();
    }
}
