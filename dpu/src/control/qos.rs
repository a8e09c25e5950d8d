//! `qos_*` and `stats_*` methods: limits persisted in the state document and applied to the
//! live [`Qos`](crate::volume::qos::Qos) at once; statistics read from the volume layers.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use nacre_shared::api::qos::{QosInfo, QosLimits, QosSet, QosTarget, StatsGet};
use nacre_shared::api::{validate_name, Ack};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::info;

use super::state::State;
use super::{parse_params, to_value, Daemon, Method, NoParams, RpcError};
use crate::volume::BlockDevice;

pub const METHODS: &[Method] = &[
    Method {
        name: "qos_set",
        handler: qos_set,
        help: "Set QoS limits of a volume, a tenant or the daemon (global): volume|tenant|global, limits {read_iops, write_iops, iops, read_bps, write_bps, bps, burst_ms, weight}; given fields replace, others stay.",
    },
    Method {
        name: "qos_show",
        handler: qos_show,
        help: "List QoS limits (optionally of one volume, tenant or global).",
    },
    Method {
        name: "qos_clear",
        handler: qos_clear,
        help: "Remove every QoS limit of a volume, a tenant or the daemon (global).",
    },
    Method {
        name: "stats_get",
        handler: stats_get,
        help: "I/O counters, queue depth, QoS throttling and latency quantiles per open volume (optionally one: volume).",
    },
    Method {
        name: "metrics_endpoint",
        handler: metrics_endpoint,
        help: "Where the Prometheus /metrics endpoint listens (null when off).",
    },
];

/// Set by `nacred --no-qos`: volumes are served without the QoS and statistics layer (the
/// baseline `scripts/bench-qos` compares against). Limits are still stored, not enforced.
pub static DISABLED: AtomicBool = AtomicBool::new(false);

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

/// Which object a target names, checked against the state.
enum Target {
    Volume(String),
    Tenant(String),
    Global,
}

fn target(
    state: &State,
    volume: &Option<String>,
    tenant: &Option<String>,
    global: bool,
) -> Result<Target, RpcError> {
    match (volume, tenant, global) {
        (Some(v), None, false) => {
            validate_name("volume", v).map_err(RpcError::invalid_params)?;
            if !state.volumes.contains_key(v) {
                return Err(RpcError::not_found("volume", v));
            }
            Ok(Target::Volume(v.clone()))
        }
        (None, Some(t), false) => {
            validate_name("tenant", t).map_err(RpcError::invalid_params)?;
            if !state.tenants.contains_key(t) {
                return Err(RpcError::not_found("tenant", t));
            }
            Ok(Target::Tenant(t.clone()))
        }
        (None, None, true) => Ok(Target::Global),
        _ => Err(RpcError::invalid_params(
            "name exactly one of volume, tenant or global",
        )),
    }
}

/// Push persisted limits into the live limiter (nacred start, before volumes are reopened).
pub fn apply(d: &Daemon, q: &QosState) {
    for (v, l) in &q.volumes {
        d.qos.set(Some(v), None, Some(l));
    }
    for (t, l) in &q.tenants {
        d.qos.set(None, Some(t), Some(l));
    }
    if let Some(l) = &q.global {
        d.qos.set(None, None, Some(l));
    }
}

/// The QoS and statistics layer over a freshly opened volume (unless nacred runs without it).
pub fn wrap(
    d: &Daemon,
    rec: &super::state::VolumeRecord,
    dev: Arc<dyn BlockDevice>,
) -> Arc<dyn BlockDevice> {
    if DISABLED.load(Ordering::Relaxed) {
        return dev;
    }
    d.qos.wrap(&rec.name, rec.tenant.as_deref(), dev)
}

/// Path states (one per remote controller; every state a series, 1 for the current one, as
/// Prometheus enums go).
const PATH_STATES: [&str; 4] = ["live", "connecting", "failed", "closed"];

/// Give the metrics endpoint the daemon's own series, rendered at scrape time from the state:
/// devices (vhost-user-blk devices and NVMe-oF namespaces, each with the volume it serves, so
/// per-device rates join the volume series `on (volume)`), remote controller path states,
/// sessions lost (reconnects) and established, and the configured QoS limits.
pub fn export_daemon_series(d: &Arc<Daemon>) {
    let weak = Arc::downgrade(d);
    d.qos.telemetry().set_extra(Box::new(move || {
        weak.upgrade()
            .map(|d| render_daemon_series(&d))
            .unwrap_or_default()
    }));
}

/// A Prometheus label value: backslash, double quote and newline escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn render_daemon_series(d: &Daemon) -> String {
    use std::fmt::Write;
    let Ok((devices, paths, limits)) = d.with_inner(|inner| {
        let mut devices: Vec<(String, &str, String)> = inner
            .state
            .vhost_blk
            .values()
            .map(|r| (r.name.clone(), "vhost-blk", r.volume.clone()))
            .collect();
        for s in inner.state.nvmf.subsystems.values() {
            for (nsid, volume) in &s.namespaces {
                devices.push((format!("{}/{nsid}", s.nqn), "nvmf", volume.clone()));
            }
        }
        let paths = super::remote::path_states(d, &inner.state);
        let q = &inner.state.qos;
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
        Ok((devices, paths, limits))
    }) else {
        return String::new();
    };
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
    for (name, state, _, _) in &paths {
        for s in PATH_STATES {
            let _ = writeln!(
                out,
                "nacre_remote_path_state{{remote=\"{}\",state=\"{s}\"}} {}",
                label(name),
                u8::from(s == *state)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP nacre_remote_resets_total Sessions of a remote controller lost (each one a reconnect).\n# TYPE nacre_remote_resets_total counter"
    );
    for (name, _, resets, _) in &paths {
        let _ = writeln!(
            out,
            "nacre_remote_resets_total{{remote=\"{}\"}} {resets}",
            label(name)
        );
    }
    let _ = writeln!(
        out,
        "# HELP nacre_remote_connects_total Sessions of a remote controller established.\n# TYPE nacre_remote_connects_total counter"
    );
    for (name, _, _, connects) in &paths {
        let _ = writeln!(
            out,
            "nacre_remote_connects_total{{remote=\"{}\"}} {connects}",
            label(name)
        );
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
    out
}

fn get(q: &QosState, t: &Target) -> Option<QosLimits> {
    match t {
        Target::Volume(v) => q.volumes.get(v).cloned(),
        Target::Tenant(n) => q.tenants.get(n).cloned(),
        Target::Global => q.global.clone(),
    }
}

fn put(q: &mut QosState, t: &Target, l: Option<QosLimits>) {
    match (t, l) {
        (Target::Volume(v), Some(l)) => {
            q.volumes.insert(v.clone(), l);
        }
        (Target::Volume(v), None) => {
            q.volumes.remove(v);
        }
        (Target::Tenant(n), Some(l)) => {
            q.tenants.insert(n.clone(), l);
        }
        (Target::Tenant(n), None) => {
            q.tenants.remove(n);
        }
        (Target::Global, l) => q.global = l,
    }
}

fn apply_one(d: &Daemon, t: &Target, l: Option<&QosLimits>) {
    match t {
        Target::Volume(v) => d.qos.set(Some(v), None, l),
        Target::Tenant(n) => d.qos.set(None, Some(n), l),
        Target::Global => d.qos.set(None, None, l),
    }
}

fn info(t: &Target, l: QosLimits) -> QosInfo {
    let (kind, name) = match t {
        Target::Volume(v) => ("volume", v.clone()),
        Target::Tenant(n) => ("tenant", n.clone()),
        Target::Global => ("global", "*".to_string()),
    };
    QosInfo {
        kind: kind.into(),
        name,
        limits: l,
    }
}

fn qos_set(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: QosSet = parse_params(params)?;
    p.limits.validate().map_err(RpcError::invalid_params)?;
    d.with_inner(|inner| {
        let t = target(&inner.state, &p.volume, &p.tenant, p.global)?;
        if p.limits.weight.is_some() && !matches!(t, Target::Tenant(_)) {
            return Err(RpcError::invalid_params(
                "weight applies to tenants (their share of the global limit)",
            ));
        }
        let merged = get(&inner.state.qos, &t)
            .unwrap_or_default()
            .merged(&p.limits);
        let mut next = inner.state.clone();
        put(&mut next.qos, &t, Some(merged.clone()));
        d.persist(&next)?;
        inner.state = next;
        apply_one(d, &t, Some(&merged));
        info!(target = ?info(&t, merged.clone()), "qos limits set");
        to_value(info(&t, merged))
    })
}

fn qos_clear(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: QosTarget = parse_params(params)?;
    d.with_inner(|inner| {
        let t = target(&inner.state, &p.volume, &p.tenant, p.global)?;
        let mut next = inner.state.clone();
        put(&mut next.qos, &t, None);
        d.persist(&next)?;
        inner.state = next;
        apply_one(d, &t, None);
        info!(target = ?info(&t, QosLimits::default()).name, "qos limits cleared");
        to_value(Ack { ok: true })
    })
}

fn qos_show(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: QosTarget = parse_params(params)?;
    d.with_inner(|inner| {
        let q = &inner.state.qos;
        if p.volume.is_some() || p.tenant.is_some() || p.global {
            let t = target(&inner.state, &p.volume, &p.tenant, p.global)?;
            let l = get(q, &t).unwrap_or_default();
            return to_value(vec![info(&t, l)]);
        }
        let mut out: Vec<QosInfo> = Vec::new();
        if let Some(l) = &q.global {
            out.push(info(&Target::Global, l.clone()));
        }
        out.extend(
            q.tenants
                .iter()
                .map(|(n, l)| info(&Target::Tenant(n.clone()), l.clone())),
        );
        out.extend(
            q.volumes
                .iter()
                .map(|(v, l)| info(&Target::Volume(v.clone()), l.clone())),
        );
        to_value(out)
    })
}

fn stats_get(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: StatsGet = parse_params(params)?;
    if let Some(v) = &p.volume {
        let known = d.with_inner(|inner| Ok(inner.state.volumes.contains_key(v)))?;
        if !known {
            return Err(RpcError::not_found("volume", v));
        }
    }
    let mut stats = d.qos.stats();
    stats.retain(|s| p.volume.as_ref().is_none_or(|v| &s.volume == v));
    stats.sort_by(|a, b| a.volume.cmp(&b.volume));
    to_value(stats)
}

fn metrics_endpoint(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let _: NoParams = parse_params(params)?;
    let addr = d.metrics_addr.get().map(|a| a.to_string());
    to_value(serde_json::json!({ "listen": addr }))
}
