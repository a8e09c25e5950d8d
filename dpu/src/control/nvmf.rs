//! `nvmf_*` methods: NVMe-oF/TCP subsystems, their namespaces (volumes), listeners and
//! allowed hosts, served by one [`NvmfTarget`] per daemon (SPDK's method names).
//!
//! State: [`NvmfState`] inside the daemon's persisted state; replay recreates subsystems,
//! then namespaces (on their reopened volumes), hosts and listeners. Namespaces report the
//! volume's UUID as NGUID and UUID, so a namespace keeps its identity across restarts and
//! across paths.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use nacre_shared::api::nvmf::{
    NvmfAllowAnyHost, NvmfHost, NvmfListener, NvmfSubsystemAddNs, NvmfSubsystemCreate,
    NvmfSubsystemInfo, NvmfSubsystemName, NvmfSubsystemRemoveNs, TRANSPORT_RDMA, TRANSPORT_TCP,
};
use nacre_shared::api::Ack;
use nacre_shared::nvme::validate_nqn;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{info, warn};

use super::{parse_params, to_value, Daemon, Inner, Method, RpcError};
use crate::frontend::nvmf_rdma::{RdmaError, RdmaPorts};
use crate::frontend::nvmf_tcp::{NvmfError, NvmfTarget, DEFAULT_MODEL};

pub const METHODS: &[Method] = &[
    Method {
        name: "nvmf_subsystem_create",
        handler: nvmf_subsystem_create,
        help: "Create an NVMe-oF subsystem: nqn, serial, model, allow_any_host.",
    },
    Method {
        name: "nvmf_subsystem_delete",
        handler: nvmf_subsystem_delete,
        help: "Delete a subsystem; its hosts are disconnected: nqn.",
    },
    Method {
        name: "nvmf_subsystem_add_ns",
        handler: nvmf_subsystem_add_ns,
        help: "Export a volume as a namespace: nqn, volume, nsid (default: lowest free).",
    },
    Method {
        name: "nvmf_subsystem_remove_ns",
        handler: nvmf_subsystem_remove_ns,
        help: "Remove a namespace (hosts get a namespace-changed event): nqn, nsid.",
    },
    Method {
        name: "nvmf_subsystem_add_listener",
        handler: nvmf_subsystem_add_listener,
        help: "Listen for NVMe/TCP or NVMe/RDMA on an address: nqn, address, port (default 4420), transport (tcp or rdma; default tcp).",
    },
    Method {
        name: "nvmf_subsystem_remove_listener",
        handler: nvmf_subsystem_remove_listener,
        help: "Stop offering a subsystem on an address: nqn, address, port, transport.",
    },
    Method {
        name: "nvmf_subsystem_add_host",
        handler: nvmf_subsystem_add_host,
        help: "Allow a host NQN to connect: nqn, host.",
    },
    Method {
        name: "nvmf_subsystem_remove_host",
        handler: nvmf_subsystem_remove_host,
        help: "Stop allowing a host NQN (existing connections stay): nqn, host.",
    },
    Method {
        name: "nvmf_subsystem_allow_any_host",
        handler: nvmf_subsystem_allow_any_host,
        help: "Let any host connect, or only listed ones: nqn, allow_any_host.",
    },
    Method {
        name: "nvmf_get_subsystems",
        handler: nvmf_get_subsystems,
        help: "List subsystems (the discovery subsystem first), namespaces, listeners, hosts.",
    },
];

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
    /// NSID → volume name.
    #[serde(default)]
    pub namespaces: BTreeMap<u32, String>,
    /// Bound addresses (the port actually bound when 0 was asked for).
    #[serde(default)]
    pub listeners: BTreeSet<SocketAddr>,
    /// NVMe/RDMA listeners (RDMA CM addresses), likewise.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub rdma_listeners: BTreeSet<SocketAddr>,
}

/// The daemon's target, created on first use.
pub fn target(inner: &mut Inner) -> Arc<NvmfTarget> {
    inner.live.nvmf.get_or_insert_with(NvmfTarget::new).clone()
}

/// The target's RDMA listeners, created on first use.
fn rdma_ports(inner: &mut Inner) -> Arc<RdmaPorts> {
    let t = target(inner);
    inner
        .live
        .nvmf_rdma
        .get_or_insert_with(|| RdmaPorts::new(&t))
        .clone()
}

fn rdma_err(e: RdmaError) -> RpcError {
    match e {
        RdmaError::Nvmf(e) => rpc_err(e),
        RdmaError::NoSuchListener(a) => RpcError::not_found("listener", &format!("rdma:{a}")),
        RdmaError::Listen { .. } => RpcError::failed(e.to_string()),
    }
}

/// Whether a listener request is for NVMe/RDMA (`transport` absent or `tcp`: NVMe/TCP).
fn is_rdma(p: &NvmfListener) -> Result<bool, RpcError> {
    match p.transport.as_deref() {
        None | Some(TRANSPORT_TCP) => Ok(false),
        Some(TRANSPORT_RDMA) => Ok(true),
        Some(t) => Err(RpcError::invalid_params(format!(
            "transport {t:?} is not one nacre serves: use \"tcp\" or \"rdma\""
        ))),
    }
}

pub(super) fn rpc_err(e: NvmfError) -> RpcError {
    match e {
        NvmfError::InvalidNqn(_)
        | NvmfError::InvalidNsid(_)
        | NvmfError::InvalidArgument(_)
        | NvmfError::Discovery => RpcError::invalid_params(e.to_string()),
        NvmfError::SubsystemExists(n) => RpcError::exists("subsystem", &n),
        NvmfError::NoSuchSubsystem(n) => RpcError::not_found("subsystem", &n),
        NvmfError::NsidInUse { .. } | NvmfError::NamespacesFull(_) => RpcError::busy(e.to_string()),
        NvmfError::NoSuchNamespace { nqn, nsid } => {
            RpcError::not_found("namespace", &format!("{nqn}/{nsid}"))
        }
        NvmfError::NoSuchListener(a) => RpcError::not_found("listener", &a.to_string()),
        NvmfError::Listen { .. } => RpcError::failed(e.to_string()),
    }
}

/// NGUID/UUID of a namespace: the volume's UUID.
fn nguid_of(inner: &Inner, volume: &str) -> Result<[u8; 16], RpcError> {
    let rec = inner
        .state
        .volumes
        .get(volume)
        .ok_or_else(|| RpcError::not_found("volume", volume))?;
    uuid::Uuid::parse_str(&rec.uuid)
        .map(|u| *u.as_bytes())
        .map_err(|e| RpcError::failed(format!("volume {volume:?} has a bad UUID: {e}")))
}

/// The names of subsystems exporting a volume (for `volume_delete` and `volume_list`).
pub fn exporters(inner: &Inner, volume: &str) -> Vec<String> {
    inner
        .state
        .nvmf
        .subsystems
        .values()
        .flat_map(|s| {
            s.namespaces
                .iter()
                .filter(|(_, v)| v.as_str() == volume)
                .map(move |(nsid, _)| format!("nvmf:{}/{}", s.nqn, nsid))
        })
        .collect()
}

/// Bring one subsystem record to life on `t`; parts that fail are logged and skipped so the
/// rest of the configuration still comes back.
fn start_subsystem(
    inner: &mut Inner,
    t: &NvmfTarget,
    rec: &NvmfSubsystemRecord,
) -> Result<(), RpcError> {
    t.create_subsystem(&rec.nqn, &rec.serial, &rec.model, rec.allow_any_host)
        .map_err(rpc_err)?;
    for h in &rec.hosts {
        if let Err(e) = t.add_host(&rec.nqn, h) {
            warn!(nqn = %rec.nqn, host = %h, error = %e, "nvmf host not restored");
        }
    }
    for (&nsid, vol) in &rec.namespaces {
        let r = match (inner.live.volumes.get(vol), nguid_of(inner, vol)) {
            (Some(dev), Ok(nguid)) => t
                .add_namespace(&rec.nqn, Some(nsid), dev.clone(), nguid, vol.clone())
                .map_err(rpc_err),
            (None, _) => Err(RpcError::failed(format!("volume {vol:?} is not open"))),
            (_, Err(e)) => Err(e),
        };
        if let Err(e) = r {
            warn!(nqn = %rec.nqn, nsid, error = %e, "nvmf namespace not restored");
        }
    }
    for l in &rec.rdma_listeners {
        let ports = rdma_ports(inner);
        if let Err(e) = ports.add_listener(&rec.nqn, *l) {
            // Not retried (RDMA devices come with drivers, not with time): reported by
            // nvmf_get_subsystems until nacred restarts or the listener is re-added.
            warn!(nqn = %rec.nqn, listener = %l, "nvmf RDMA listener not restored: {e}");
            inner
                .live
                .rdma_listeners_failed
                .insert((rec.nqn.clone(), *l), e.to_string());
        }
    }
    for l in &rec.listeners {
        if let Err(e) = t.add_listener(&rec.nqn, *l) {
            warn!(nqn = %rec.nqn, listener = %l, error = %e, "nvmf listener not restored; retrying");
            // Reported by the banner and nvmf_get_subsystems; retried by `listener_retry`.
            let reason = e.to_string();
            inner
                .live
                .listeners_failed
                .insert((rec.nqn.clone(), *l), reason);
        }
    }
    Ok(())
}

/// Recreate the persisted subsystems (after volumes were reopened).
pub fn replay(inner: &mut Inner) {
    let subs: Vec<NvmfSubsystemRecord> = inner.state.nvmf.subsystems.values().cloned().collect();
    if subs.is_empty() {
        return;
    }
    let t = target(inner);
    for rec in &subs {
        if let Err(e) = start_subsystem(inner, &t, rec) {
            warn!(nqn = %rec.nqn, error = %e, "nvmf subsystem not restored");
        }
    }
    info!(subsystems = subs.len(), "nvmf subsystems replayed");
}

/// Apply `change` to a copy of the state, persist it, and commit; `undo` reverts the live
/// change if persisting fails.
fn commit(
    d: &Daemon,
    inner: &mut Inner,
    change: impl FnOnce(&mut NvmfState),
    undo: impl FnOnce(),
) -> Result<(), RpcError> {
    let mut next = inner.state.clone();
    change(&mut next.nvmf);
    if let Err(e) = d.persist(&next) {
        undo();
        return Err(e);
    }
    inner.state = next;
    Ok(())
}

fn record<'a>(inner: &'a Inner, nqn: &str) -> Result<&'a NvmfSubsystemRecord, RpcError> {
    inner
        .state
        .nvmf
        .subsystems
        .get(nqn)
        .ok_or_else(|| RpcError::not_found("subsystem", nqn))
}

fn nvmf_subsystem_create(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfSubsystemCreate = parse_params(params)?;
    validate_nqn(&p.nqn).map_err(RpcError::invalid_params)?;
    let serial = p
        .serial
        .clone()
        .unwrap_or_else(|| super::volume::serial_from_uuid(&uuid::Uuid::new_v4()));
    let model = p.model.clone().unwrap_or_else(|| DEFAULT_MODEL.to_string());
    d.with_inner(|inner| {
        if inner.state.nvmf.subsystems.contains_key(&p.nqn) {
            return Err(RpcError::exists("subsystem", &p.nqn));
        }
        let t = target(inner);
        t.create_subsystem(&p.nqn, &serial, &model, p.allow_any_host)
            .map_err(rpc_err)?;
        let rec = NvmfSubsystemRecord {
            nqn: p.nqn.clone(),
            serial: serial.clone(),
            model: model.clone(),
            allow_any_host: p.allow_any_host,
            hosts: BTreeSet::new(),
            namespaces: BTreeMap::new(),
            listeners: BTreeSet::new(),
            rdma_listeners: BTreeSet::new(),
        };
        commit(
            d,
            inner,
            |s| {
                s.subsystems.insert(rec.nqn.clone(), rec.clone());
            },
            || {
                let _ = t.delete_subsystem(&p.nqn);
            },
        )?;
        info!(nqn = %p.nqn, "nvmf subsystem created");
        to_value(info(&t, &p.nqn))
    })
}

fn info(t: &NvmfTarget, nqn: &str) -> Option<NvmfSubsystemInfo> {
    t.subsystems().into_iter().find(|s| s.nqn == nqn)
}

fn nvmf_subsystem_delete(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfSubsystemName = parse_params(params)?;
    d.with_inner(|inner| {
        record(inner, &p.nqn)?;
        commit(
            d,
            inner,
            |s| {
                s.subsystems.remove(&p.nqn);
            },
            || {},
        )?;
        if let Some(ports) = inner.live.nvmf_rdma.clone() {
            ports.forget_subsystem(&p.nqn);
        }
        inner
            .live
            .rdma_listeners_failed
            .retain(|(nqn, _), _| *nqn != p.nqn);
        let t = target(inner);
        if let Err(e) = t.delete_subsystem(&p.nqn) {
            warn!(nqn = %p.nqn, error = %e, "nvmf subsystem was not live");
        }
        to_value(Ack { ok: true })
    })
}

fn nvmf_subsystem_add_ns(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfSubsystemAddNs = parse_params(params)?;
    d.with_inner(|inner| {
        if let Some(nsid) = record(inner, &p.nqn)?
            .namespaces
            .iter()
            .find(|(_, v)| **v == p.volume)
            .map(|(n, _)| *n)
        {
            // Two namespaces of one subsystem with the same NGUID confuse hosts (Linux
            // refuses the second).
            return Err(RpcError::busy(format!(
                "volume {:?} is already namespace {nsid} of {}",
                p.volume, p.nqn
            )));
        }
        let dev = inner
            .live
            .volumes
            .get(&p.volume)
            .cloned()
            .ok_or_else(|| RpcError::not_found("volume", &p.volume))?;
        let nguid = nguid_of(inner, &p.volume)?;
        let t = target(inner);
        let nsid = t
            .add_namespace(&p.nqn, p.nsid, dev, nguid, p.volume.clone())
            .map_err(rpc_err)?;
        commit(
            d,
            inner,
            |s| {
                if let Some(r) = s.subsystems.get_mut(&p.nqn) {
                    r.namespaces.insert(nsid, p.volume.clone());
                }
            },
            || {
                let _ = t.remove_namespace(&p.nqn, nsid);
            },
        )?;
        to_value(serde_json::json!({"nqn": p.nqn, "nsid": nsid, "volume": p.volume}))
    })
}

fn nvmf_subsystem_remove_ns(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfSubsystemRemoveNs = parse_params(params)?;
    d.with_inner(|inner| {
        if !record(inner, &p.nqn)?.namespaces.contains_key(&p.nsid) {
            return Err(RpcError::not_found(
                "namespace",
                &format!("{}/{}", p.nqn, p.nsid),
            ));
        }
        commit(
            d,
            inner,
            |s| {
                if let Some(r) = s.subsystems.get_mut(&p.nqn) {
                    r.namespaces.remove(&p.nsid);
                }
            },
            || {},
        )?;
        let t = target(inner);
        if let Err(e) = t.remove_namespace(&p.nqn, p.nsid) {
            warn!(nqn = %p.nqn, nsid = p.nsid, error = %e, "nvmf namespace was not live");
        }
        to_value(Ack { ok: true })
    })
}

fn listener_addr(p: &NvmfListener) -> Result<SocketAddr, RpcError> {
    let ip: IpAddr = p.address.parse().map_err(|_| {
        RpcError::invalid_params(format!(
            "address {:?} is not an IPv4 or IPv6 address",
            p.address
        ))
    })?;
    Ok(SocketAddr::new(ip, p.port))
}

fn nvmf_subsystem_add_listener(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfListener = parse_params(params)?;
    let addr = listener_addr(&p)?;
    if is_rdma(&p)? {
        return d.with_inner(|inner| {
            if record(inner, &p.nqn)?.rdma_listeners.contains(&addr) {
                return Err(RpcError::exists("listener", &format!("rdma:{addr}")));
            }
            let ports = rdma_ports(inner);
            let bound = ports.add_listener(&p.nqn, addr).map_err(rdma_err)?;
            inner
                .live
                .rdma_listeners_failed
                .remove(&(p.nqn.clone(), bound));
            commit(
                d,
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(&p.nqn) {
                        r.rdma_listeners.insert(bound);
                    }
                },
                || {
                    let _ = ports.remove_listener(&p.nqn, bound);
                },
            )?;
            to_value(serde_json::json!({
                "nqn": p.nqn, "address": bound.ip().to_string(), "port": bound.port(),
                "transport": TRANSPORT_RDMA
            }))
        });
    }
    d.with_inner(|inner| {
        if record(inner, &p.nqn)?.listeners.contains(&addr) {
            return Err(RpcError::exists("listener", &addr.to_string()));
        }
        let t = target(inner);
        let bound = t.add_listener(&p.nqn, addr).map_err(rpc_err)?;
        inner.live.listeners_failed.remove(&(p.nqn.clone(), bound));
        commit(
            d,
            inner,
            |s| {
                if let Some(r) = s.subsystems.get_mut(&p.nqn) {
                    r.listeners.insert(bound);
                }
            },
            || {
                let _ = t.remove_listener(&p.nqn, bound);
            },
        )?;
        to_value(serde_json::json!({
            "nqn": p.nqn, "address": bound.ip().to_string(), "port": bound.port()
        }))
    })
}

fn nvmf_subsystem_remove_listener(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfListener = parse_params(params)?;
    let addr = listener_addr(&p)?;
    if is_rdma(&p)? {
        return d.with_inner(|inner| {
            if !record(inner, &p.nqn)?.rdma_listeners.contains(&addr) {
                return Err(RpcError::not_found("listener", &format!("rdma:{addr}")));
            }
            commit(
                d,
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(&p.nqn) {
                        r.rdma_listeners.remove(&addr);
                    }
                },
                || {},
            )?;
            let _ = rdma_ports(inner).remove_listener(&p.nqn, addr);
            inner
                .live
                .rdma_listeners_failed
                .remove(&(p.nqn.clone(), addr));
            to_value(Ack { ok: true })
        });
    }
    d.with_inner(|inner| {
        if !record(inner, &p.nqn)?.listeners.contains(&addr) {
            return Err(RpcError::not_found("listener", &addr.to_string()));
        }
        commit(
            d,
            inner,
            |s| {
                if let Some(r) = s.subsystems.get_mut(&p.nqn) {
                    r.listeners.remove(&addr);
                }
            },
            || {},
        )?;
        let _ = target(inner).remove_listener(&p.nqn, addr);
        inner.live.listeners_failed.remove(&(p.nqn.clone(), addr));
        to_value(Ack { ok: true })
    })
}

fn nvmf_subsystem_add_host(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfHost = parse_params(params)?;
    d.with_inner(|inner| {
        record(inner, &p.nqn)?;
        let t = target(inner);
        t.add_host(&p.nqn, &p.host).map_err(rpc_err)?;
        commit(
            d,
            inner,
            |s| {
                if let Some(r) = s.subsystems.get_mut(&p.nqn) {
                    r.hosts.insert(p.host.clone());
                }
            },
            || {
                let _ = t.remove_host(&p.nqn, &p.host);
            },
        )?;
        to_value(Ack { ok: true })
    })
}

fn nvmf_subsystem_remove_host(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfHost = parse_params(params)?;
    d.with_inner(|inner| {
        if !record(inner, &p.nqn)?.hosts.contains(&p.host) {
            return Err(RpcError::not_found("host", &p.host));
        }
        commit(
            d,
            inner,
            |s| {
                if let Some(r) = s.subsystems.get_mut(&p.nqn) {
                    r.hosts.remove(&p.host);
                }
            },
            || {},
        )?;
        let _ = target(inner).remove_host(&p.nqn, &p.host);
        to_value(Ack { ok: true })
    })
}

fn nvmf_subsystem_allow_any_host(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfAllowAnyHost = parse_params(params)?;
    d.with_inner(|inner| {
        let before = record(inner, &p.nqn)?.allow_any_host;
        let t = target(inner);
        t.set_allow_any_host(&p.nqn, p.allow_any_host)
            .map_err(rpc_err)?;
        commit(
            d,
            inner,
            |s| {
                if let Some(r) = s.subsystems.get_mut(&p.nqn) {
                    r.allow_any_host = p.allow_any_host;
                }
            },
            || {
                let _ = t.set_allow_any_host(&p.nqn, before);
            },
        )?;
        to_value(Ack { ok: true })
    })
}

fn nvmf_get_subsystems(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let _: super::NoParams = parse_params(params)?;
    d.with_inner(|inner| {
        let subs = target(inner).subsystems();
        to_value(super::listener_retry::with_listener_states(inner, subs))
    })
}
