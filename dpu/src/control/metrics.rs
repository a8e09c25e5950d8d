//! The daemon's own series on the Prometheus endpoint, rendered at scrape time from the
//! registry: devices (vhost-user-blk devices and NVMe-oF namespaces, each with the volume it
//! serves, so per-device rates join the volume series `on (volume)`), remote controller path
//! states, sessions lost (reconnects) and established, bytes copied through transport
//! buffers and moved directly (zero copy), the configured QoS limits, and KMIP key-manager
//! requests (answers, failures, seconds spent).

use std::fmt::Write;
use std::sync::Arc;

use nacre_shared::api::qos::QosLimits;

use super::registry::{PathState, Registry};

/// Path states (one per remote controller; every state a series, 1 for the current one, as
/// Prometheus enums go).
const PATH_STATES: [&str; 4] = ["live", "connecting", "failed", "closed"];

/// A counter of remote controllers: its name, its help, and its value for one.
type Counter = (&'static str, &'static str, fn(&PathState) -> u64);

/// Give the metrics endpoint the daemon's own series.
pub fn export_daemon_series(registry: &Arc<Registry>) {
    let weak = Arc::downgrade(registry);
    registry.qos().telemetry().set_extra(Box::new(move || {
        weak.upgrade()
            .map(|r| render_daemon_series(&r))
            .unwrap_or_default()
    }));
}

/// A Prometheus label value: backslash, double quote and newline escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn render_daemon_series(r: &Registry) -> String {
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
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP nacre_device_info A device serving a volume (kind vhost-blk: a vhost-user-blk device; nvmf: an NVMe-oF namespace, NQN/NSID).\n# TYPE nacre_device_info gauge"
    );
    for (dev, kind, vol) in &devices {
        let _ = writeln!(
            out,
            "nacre_device_info{{device=\"{}\",kind=\"{kind}\",volume=\"{}\"}} 1",
            label(dev),
            label(vol)
        );
    }
    let _ = writeln!(
        out,
        "# HELP nacre_remote_path_state State of each remote NVMe-oF controller (a path to remote storage): 1 for the current state.\n# TYPE nacre_remote_path_state gauge"
    );
    for p in &paths {
        for s in PATH_STATES {
            let _ = writeln!(
                out,
                "nacre_remote_path_state{{remote=\"{}\",state=\"{s}\"}} {}",
                label(&p.remote),
                u8::from(s == p.state)
            );
        }
    }
    let counters: [Counter; 4] = [
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
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for p in &paths {
            let _ = writeln!(
                out,
                "{name}{{remote=\"{}\"}} {}",
                label(&p.remote),
                value(p)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP nacre_qos_limit Configured QoS limits (per second; rate names as in qos_set).\n# TYPE nacre_qos_limit gauge"
    );
    for (kind, name, rate, v) in &limits {
        let _ = writeln!(
            out,
            "nacre_qos_limit{{kind=\"{kind}\",name=\"{}\",rate=\"{rate}\"}} {v}",
            label(name)
        );
    }
    render_kms(&mut out);
    out
}

/// KMIP requests per key manager and operation (`encrypt` at tenant creation and KEK
/// rotation, `decrypt` at start and unlock): a counter by result, and a summary of the
/// seconds each took (connect to answer, failures included).
fn render_kms(out: &mut String) {
    let stats = crate::crypto::kmip::stats();
    let _ = writeln!(
        out,
        "# HELP nacre_kms_requests_total KMIP requests to a key manager, by operation and result (ok, error: unreachable, TLS, timeout or refused).\n# TYPE nacre_kms_requests_total counter"
    );
    for ((kms, op), s) in &stats {
        for (result, n) in [("ok", s.ok), ("error", s.errors)] {
            let _ = writeln!(
                out,
                "nacre_kms_requests_total{{kms=\"{}\",operation=\"{op}\",result=\"{result}\"}} {n}",
                label(kms)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP nacre_kms_request_seconds Time a KMIP request took, connect to answer (failures included).\n# TYPE nacre_kms_request_seconds summary"
    );
    for ((kms, op), s) in &stats {
        let l = format!("kms=\"{}\",operation=\"{op}\"", label(kms));
        let _ = writeln!(
            out,
            "nacre_kms_request_seconds_sum{{{l}}} {}",
            s.seconds_sum
        );
        let _ = writeln!(
            out,
            "nacre_kms_request_seconds_count{{{l}}} {}",
            s.ok + s.errors
        );
    }
}
