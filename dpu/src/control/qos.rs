//! `qos_*` and `stats_*` methods: QoS limits of volumes, tenants and the daemon, and the
//! statistics the QoS layer keeps per open volume.

use nacre_shared::api::qos::{QosSet, QosTarget, StatsGet};
use nacre_shared::api::Ack;
use serde_json::Value;

use super::daemon::Daemon;
use super::error::RpcError;
use super::method::{parse_params, to_value, Method, NoParams};
use super::registry::QosScope;

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

fn target<'a>(
    volume: &'a Option<String>,
    tenant: &'a Option<String>,
    global: bool,
) -> QosScope<'a> {
    QosScope {
        volume: volume.as_deref(),
        tenant: tenant.as_deref(),
        global,
    }
}

fn qos_set(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: QosSet = parse_params(params)?;
    let t = target(&p.volume, &p.tenant, p.global);
    to_value(d.registry.set_qos(t, &p.limits)?)
}

fn qos_clear(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: QosTarget = parse_params(params)?;
    d.registry
        .clear_qos(target(&p.volume, &p.tenant, p.global))?;
    to_value(Ack { ok: true })
}

fn qos_show(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: QosTarget = parse_params(params)?;
    to_value(
        d.registry
            .qos_limits(target(&p.volume, &p.tenant, p.global))?,
    )
}

fn stats_get(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: StatsGet = parse_params(params)?;
    to_value(d.registry.stats(p.volume.as_deref())?)
}

fn metrics_endpoint(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let _: NoParams = parse_params(params)?;
    let addr = d.metrics_addr.get().map(|a| a.to_string());
    to_value(serde_json::json!({ "listen": addr }))
}
