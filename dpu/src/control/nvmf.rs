//! `nvmf_*` methods: NVMe-oF subsystems, their namespaces (volumes), listeners and allowed
//! hosts, served by the daemon's one target (SPDK's method names).

use std::net::{IpAddr, SocketAddr};

use nacre_shared::api::nvmf::{
    NvmfAllowAnyHost, NvmfHost, NvmfHostKeyFiles, NvmfListener, NvmfSubsystemAddNs,
    NvmfSubsystemCreate, NvmfSubsystemName, NvmfSubsystemRemoveNs, INTERRUPTS_MSI, INTERRUPTS_MSIX,
    TRANSPORT_RDMA, TRANSPORT_TCP, TRANSPORT_VFIO_USER,
};
use nacre_shared::api::Ack;
use serde_json::{json, Value};

use super::daemon::Daemon;
use super::error::RpcError;
use super::method::{parse_params, to_value, Method, NoParams};
use super::registry::ListenerTransport;
use crate::frontend::nvme_pcie::Signals;

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
        help: "Listen for NVMe/TCP or NVMe/RDMA on an address: nqn, address, port (default 4420), transport (tcp or rdma; default tcp), secure_channel (true: TLS-only NVMe/TCP, TLS 1.3 with pre-shared keys).",
    },
    Method {
        name: "nvmf_subsystem_remove_listener",
        handler: nvmf_subsystem_remove_listener,
        help: "Stop offering a subsystem on an address: nqn, address, port, transport.",
    },
    Method {
        name: "nvmf_subsystem_add_host",
        handler: nvmf_subsystem_add_host,
        help: "Allow a host NQN to connect: nqn, host, psk (optional: absolute path of a mode-0600 file holding the host's TLS PSK, NVMeTLSkey-1:HH:...:, for TLS listeners).",
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
    Method {
        name: "nvmf_get_stats",
        handler: nvmf_get_stats,
        help: "What the pollers did: poll policy; per NVMe/TCP reactor connections, busy passes, idle polls, sleeps, deep sleeps; per PCIe (vfio-user) controller busy and idle passes, busy ns, pauses and the poller clock they were published at.",
    },
];

fn nvmf_subsystem_create(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfSubsystemCreate = parse_params(params)?;
    to_value(d.registry.create_subsystem(&p)?)
}

fn nvmf_subsystem_delete(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfSubsystemName = parse_params(params)?;
    d.registry.delete_subsystem(&p.nqn)?;
    to_value(Ack { ok: true })
}

fn nvmf_subsystem_add_ns(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfSubsystemAddNs = parse_params(params)?;
    let nsid = d.registry.add_namespace(&p.nqn, &p.volume, p.nsid)?;
    to_value(json!({"nqn": p.nqn, "nsid": nsid, "volume": p.volume}))
}

fn nvmf_subsystem_remove_ns(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfSubsystemRemoveNs = parse_params(params)?;
    d.registry.remove_namespace(&p.nqn, p.nsid)?;
    to_value(Ack { ok: true })
}

/// A listener request's address and transport (`transport` absent: NVMe/TCP).
fn listener(p: &NvmfListener) -> Result<(SocketAddr, ListenerTransport), RpcError> {
    let ip: IpAddr = p.address.parse().map_err(|_| {
        RpcError::invalid_params(format!(
            "address {:?} is not an IPv4 or IPv6 address",
            p.address
        ))
    })?;
    let transport = match p.transport.as_deref() {
        None | Some(TRANSPORT_TCP) if p.secure_channel => ListenerTransport::Tls,
        None | Some(TRANSPORT_TCP) => ListenerTransport::Tcp,
        Some(_) if p.secure_channel => {
            return Err(RpcError::invalid_params(
                "secure_channel (TLS) is for NVMe/TCP listeners only",
            ))
        }
        Some(TRANSPORT_RDMA) => ListenerTransport::Rdma,
        Some(t) => {
            return Err(RpcError::invalid_params(format!(
                "transport {t:?} is not one nacre serves: use \"tcp\" or \"rdma\" (or \"vfio-user\" for a PCIe controller)"
            )))
        }
    };
    Ok((SocketAddr::new(ip, p.port), transport))
}

/// Whether a listener request names the vfio-user transport (SPDK spells it `VFIOUSER`).
fn is_vfio_user(p: &NvmfListener) -> bool {
    p.transport.as_deref().is_some_and(|t| {
        t.eq_ignore_ascii_case(TRANSPORT_VFIO_USER) || t.eq_ignore_ascii_case("vfiouser")
    })
}

fn nvmf_subsystem_add_listener(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfListener = parse_params(params)?;
    if is_vfio_user(&p) {
        let dir = std::path::Path::new(&p.address);
        let interrupts = match p.interrupts.as_deref() {
            None | Some(INTERRUPTS_MSIX) => Signals::Msix,
            Some(INTERRUPTS_MSI) => Signals::Msi,
            Some(other) => {
                return Err(RpcError::invalid_params(format!(
                    "interrupts {other:?}: {INTERRUPTS_MSIX} or {INTERRUPTS_MSI}"
                )))
            }
        };
        let sock = d.registry.add_vfio_user_listener(&p.nqn, dir, interrupts)?;
        return to_value(json!({
            "nqn": p.nqn, "address": p.address, "socket": sock.display().to_string(),
            "transport": TRANSPORT_VFIO_USER,
            "interrupts": if interrupts == Signals::Msi { INTERRUPTS_MSI } else { INTERRUPTS_MSIX }
        }));
    }
    if p.interrupts.is_some() {
        return Err(RpcError::invalid_params(
            "interrupts is for vfio-user listeners only",
        ));
    }
    let (addr, transport) = listener(&p)?;
    let bound = d.registry.add_listener(&p.nqn, addr, transport)?;
    let (address, port) = (bound.ip().to_string(), bound.port());
    to_value(match transport {
        ListenerTransport::Tcp => json!({"nqn": p.nqn, "address": address, "port": port}),
        ListenerTransport::Tls => json!({
            "nqn": p.nqn, "address": address, "port": port, "secure_channel": true
        }),
        ListenerTransport::Rdma => json!({
            "nqn": p.nqn, "address": address, "port": port, "transport": TRANSPORT_RDMA
        }),
    })
}

fn nvmf_subsystem_remove_listener(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfListener = parse_params(params)?;
    if is_vfio_user(&p) {
        let dir = std::path::Path::new(&p.address);
        d.registry.remove_vfio_user_listener(&p.nqn, dir)?;
        return to_value(Ack { ok: true });
    }
    let (addr, transport) = listener(&p)?;
    d.registry.remove_listener(&p.nqn, addr, transport)?;
    to_value(Ack { ok: true })
}

fn nvmf_subsystem_add_host(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfHost = parse_params(params)?;
    // Adding a host again replaces both its TLS PSK and its DH-HMAC-CHAP keys. The PSK
    // first: a key file that cannot be used refuses the call before the host is added.
    d.registry
        .add_host_with_psk(&p.nqn, &p.host, p.psk.as_deref().map(std::path::Path::new))?;
    let files = match p.dhchap_key {
        Some(k) => Some(NvmfHostKeyFiles {
            dhchap_key: k,
            dhchap_ctrlr_key: p.dhchap_ctrlr_key,
            dhchap_digests: p.dhchap_digests,
            dhchap_dhgroups: p.dhchap_dhgroups,
        }),
        None if p.dhchap_ctrlr_key.is_some()
            || p.dhchap_digests.is_some()
            || p.dhchap_dhgroups.is_some() =>
        {
            return Err(RpcError::invalid_params(
                "dhchap_ctrlr_key, dhchap_digests and dhchap_dhgroups need dhchap_key: the host authenticates with it",
            ))
        }
        None => None,
    };
    d.registry.add_host_auth(&p.nqn, &p.host, files)?;
    to_value(Ack { ok: true })
}

fn nvmf_subsystem_remove_host(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfHost = parse_params(params)?;
    d.registry.remove_host(&p.nqn, &p.host)?;
    to_value(Ack { ok: true })
}

fn nvmf_subsystem_allow_any_host(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: NvmfAllowAnyHost = parse_params(params)?;
    d.registry.set_allow_any_host(&p.nqn, p.allow_any_host)?;
    to_value(Ack { ok: true })
}

fn nvmf_get_subsystems(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let _: NoParams = parse_params(params)?;
    to_value(d.registry.subsystems())
}

fn nvmf_get_stats(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let _: NoParams = parse_params(params)?;
    to_value(d.registry.nvmf_stats())
}
