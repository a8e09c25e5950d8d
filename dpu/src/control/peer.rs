//! Host-facing methods: matching the disks a host sees to volumes (`host_devices_match`),
//! who the caller is (`host_whoami`), and GPU peer windows (`peer_window_*`).
//!
//! These answer both the operator (the Unix socket: everything, any tenant) and a host
//! agent over the authenticated host channel ([`super::host_channel`]): there the caller's
//! host and tenant come from its certificate, it matches only its tenant's volumes and sees
//! and removes only its own windows. Windows are not persisted: one registered over the
//! host channel lives as long as that connection (the GPU memory behind it is pinned by the
//! host process at the other end).

use nacre_shared::api::host::{DeviceMatch, HostDevicesMatch, WhoAmI};
use nacre_shared::api::peer::{PeerWindowId, PeerWindowInfo, PeerWindowList, PeerWindowRegister};
use nacre_shared::api::Ack;
use nacre_shared::channel::HostIdentity;
use serde_json::Value;

use super::daemon::Daemon;
use super::error::RpcError;
use super::method::{parse_params, to_value, Method, NoParams};

/// Who is calling a host-facing method.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The Unix socket: the DPU's operator.
    Operator,
    /// A host agent on the host channel; `conn` numbers its connection.
    Host { id: HostIdentity, conn: u64 },
}

impl Caller {
    fn tenant(&self) -> Option<&str> {
        match self {
            Caller::Operator => None,
            Caller::Host { id, .. } => Some(&id.tenant),
        }
    }

    /// Whether the caller may see and remove window `w`: the operator any, a host only its
    /// own host's and tenant's.
    fn owns(&self, w: &PeerWindowInfo) -> bool {
        match self {
            Caller::Operator => true,
            Caller::Host { id, .. } => w.host == id.host && w.tenant == id.tenant,
        }
    }
}

pub const METHODS: &[Method] = &[
    Method {
        name: "host_devices_match",
        handler: |d, p| devices_match(d, &Caller::Operator, p),
        help: "Match disks a host sees (serial, NGUID/UUID, NQN/NSID) to volumes: devices.",
    },
    Method {
        name: "host_whoami",
        handler: |d, p| whoami(d, &Caller::Operator, p),
        help: "Who nacred takes the caller to be (operator, or a host and its tenant).",
    },
    Method {
        name: "peer_window_register",
        handler: |d, p| register(d, &Caller::Operator, p),
        help: "Record a GPU memory window for a tenant's host: gpu_uuid, bdf, bar1_start, bar1_len, length, device_address, handle_kind, host, tenant.",
    },
    Method {
        name: "peer_window_unregister",
        handler: |d, p| unregister(d, &Caller::Operator, p),
        help: "Remove a GPU peer window: id.",
    },
    Method {
        name: "peer_window_list",
        handler: |d, p| list(d, &Caller::Operator, p),
        help: "List GPU peer windows (optionally of one tenant).",
    },
];

/// A host-facing method, told who calls it.
pub type HostHandler = fn(&Daemon, &Caller, Value) -> Result<Value, RpcError>;

/// The methods a host credential may call, and nothing else: no tenant, key, volume or
/// device management.
pub const HOST_METHODS: &[(&str, HostHandler)] = &[
    ("host_whoami", whoami),
    ("host_devices_match", devices_match),
    ("peer_window_register", register),
    ("peer_window_unregister", unregister),
    ("peer_window_list", list),
];

fn whoami(_d: &Daemon, caller: &Caller, params: Value) -> Result<Value, RpcError> {
    let _: NoParams = parse_params(params)?;
    to_value(match caller {
        Caller::Operator => WhoAmI {
            role: "operator".into(),
            host: None,
            tenant: None,
        },
        Caller::Host { id, .. } => WhoAmI {
            role: "host".into(),
            host: Some(id.host.clone()),
            tenant: Some(id.tenant.clone()),
        },
    })
}

fn devices_match(d: &Daemon, caller: &Caller, params: Value) -> Result<Value, RpcError> {
    let p: HostDevicesMatch = parse_params(params)?;
    if p.devices.len() > 4096 {
        return Err(RpcError::invalid_params("at most 4096 devices per request"));
    }
    let matched = d.registry.match_devices(caller.tenant(), &p.devices);
    to_value(
        p.devices
            .iter()
            .zip(matched)
            .map(|(s, volume)| DeviceMatch {
                id: s.id.clone(),
                volume,
            })
            .collect::<Vec<_>>(),
    )
}

/// `DDDD:BB:DD.F`, lowercase hex.
fn valid_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(|c| c.is_ascii_hexdigit());
    b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && (b'0'..=b'7').contains(&b[11])
}

fn register(d: &Daemon, caller: &Caller, params: Value) -> Result<Value, RpcError> {
    let p: PeerWindowRegister = parse_params(params)?;
    let (host, tenant, conn) = match caller {
        Caller::Host { id, conn } => {
            if p.host.as_ref().is_some_and(|h| *h != id.host)
                || p.tenant.as_ref().is_some_and(|t| *t != id.tenant)
            {
                return Err(RpcError::refused(
                    "a host credential registers windows only for its own host and tenant",
                ));
            }
            (id.host.clone(), id.tenant.clone(), Some(*conn))
        }
        Caller::Operator => match (&p.host, &p.tenant) {
            (Some(h), Some(t)) => (h.clone(), t.clone(), None),
            _ => {
                return Err(RpcError::invalid_params(
                    "host and tenant are required on the operator socket",
                ))
            }
        },
    };
    nacre_shared::api::validate_name("host", &host).map_err(RpcError::invalid_params)?;
    if !d.registry.read_state(|s| s.tenants.contains_key(&tenant)) {
        return Err(RpcError::not_found("tenant", &tenant));
    }
    let uuid_ok = !p.gpu_uuid.is_empty()
        && p.gpu_uuid.len() <= 80
        && p.gpu_uuid
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-');
    if !uuid_ok {
        return Err(RpcError::invalid_params(format!(
            "gpu_uuid {:?} is not a GPU UUID (GPU-xxxxxxxx-…)",
            p.gpu_uuid
        )));
    }
    if !valid_bdf(&p.bdf) {
        return Err(RpcError::invalid_params(format!(
            "bdf {:?} is not a PCIe address DDDD:BB:DD.F",
            p.bdf
        )));
    }
    if p.length == 0 || p.bar1_start.checked_add(p.bar1_len).is_none() {
        return Err(RpcError::invalid_params(
            "length must be positive and bar1_start + bar1_len must not overflow",
        ));
    }
    if p.bar1_len != 0 && p.length > p.bar1_len {
        return Err(RpcError::invalid_params(format!(
            "a {}-byte window cannot fit the GPU's {}-byte BAR1",
            p.length, p.bar1_len
        )));
    }
    match p.handle_kind.as_str() {
        "dmabuf" if p.handle.is_some_and(|h| h >= 0) => {}
        "none" => {}
        _ => {
            return Err(RpcError::invalid_params(
                "handle_kind must be \"dmabuf\" (with a handle) or \"none\"",
            ))
        }
    }
    let registered_via = if conn.is_some() {
        "host-channel"
    } else {
        "operator"
    };
    let info = d
        .registry
        .register_window(&tenant, conn, |id| PeerWindowInfo {
            id,
            tenant: tenant.clone(),
            host,
            gpu_uuid: p.gpu_uuid,
            bdf: p.bdf,
            bar1_start: p.bar1_start,
            bar1_len: p.bar1_len,
            length: p.length,
            device_address: p.device_address,
            handle_kind: p.handle_kind,
            handle: p.handle,
            registered_via: registered_via.into(),
        })?;
    to_value(info)
}

fn unregister(d: &Daemon, caller: &Caller, params: Value) -> Result<Value, RpcError> {
    let p: PeerWindowId = parse_params(params)?;
    d.registry.unregister_window(p.id, |w| caller.owns(w))?;
    to_value(Ack { ok: true })
}

fn list(d: &Daemon, caller: &Caller, params: Value) -> Result<Value, RpcError> {
    let p: PeerWindowList = parse_params(params)?;
    to_value(d.registry.windows(|w| match caller {
        Caller::Operator => p.tenant.as_ref().is_none_or(|t| *t == w.tenant),
        Caller::Host { .. } => caller.owns(w),
    }))
}

#[cfg(test)]
mod test {
    use super::valid_bdf;

    #[test]
    fn bdfs() {
        assert!(valid_bdf("0000:3b:00.0"));
        assert!(valid_bdf("0001:AF:1f.7"));
        assert!(!valid_bdf("3b:00.0"));
        assert!(!valid_bdf("0000:3b:00.8"));
        assert!(!valid_bdf("0000:3b:00.0\n"));
        assert!(!valid_bdf("0000:3g:00.0"));
    }
}
