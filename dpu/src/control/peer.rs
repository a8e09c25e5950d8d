//! Host-facing methods: matching the disks a host sees to volumes (`host_devices_match`),
//! who the caller is (`host_whoami`), and GPU peer windows (`peer_window_*`).
//!
//! These answer both the operator (the Unix socket: everything, any tenant) and a host
//! agent over the authenticated host channel ([`super::host_channel`]): there the caller's
//! host and tenant come from its certificate, it matches only its tenant's volumes and sees
//! and removes only its own windows. Windows are not persisted: one registered over the
//! host channel lives as long as that connection (the GPU memory behind it is pinned by the
//! host process at the other end).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use nacre_shared::api::host::{
    normalize_id128, DeviceMatch, HostDevicesMatch, MatchedVolume, SeenDevice, WhoAmI,
};
use nacre_shared::api::peer::{PeerWindowId, PeerWindowInfo, PeerWindowList, PeerWindowRegister};
use nacre_shared::api::Ack;
use nacre_shared::channel::HostIdentity;
use serde_json::Value;
use tracing::info;

use super::state::VolumeRecord;
use super::{parse_params, to_value, Daemon, Inner, Method, RpcError};

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

/// Registered peer windows, by id.
#[derive(Default)]
pub struct Registry {
    next: AtomicU64,
    windows: Mutex<BTreeMap<u64, Window>>,
}

struct Window {
    info: PeerWindowInfo,
    /// The host-channel connection that registered it (it goes when that connection does).
    conn: Option<u64>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Window>> {
        self.windows.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh connection number for the host channel.
    pub fn next_conn(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The connection `conn` ended: drop the windows it registered. Returns how many.
    pub fn connection_closed(&self, conn: u64) -> usize {
        let mut w = self.lock();
        let before = w.len();
        w.retain(|id, win| {
            let keep = win.conn != Some(conn);
            if !keep {
                info!(window = id, gpu = %win.info.gpu_uuid, host = %win.info.host,
                    tenant = %win.info.tenant, "peer window removed: its host channel closed");
            }
            keep
        });
        before - w.len()
    }
}

fn whoami(_d: &Daemon, caller: &Caller, params: Value) -> Result<Value, RpcError> {
    let _: super::NoParams = parse_params(params)?;
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
    let inner = d.lock();
    to_value(
        p.devices
            .iter()
            .map(|s| DeviceMatch {
                id: s.id.clone(),
                volume: match_one(&inner, caller.tenant(), s),
            })
            .collect::<Vec<_>>(),
    )
}

/// The volume behind one seen device. NVMe namespaces match by NGUID, then UUID, then
/// subsystem NQN and NSID; virtio-blk disks by serial. A caller bound to a tenant matches
/// only that tenant's volumes.
fn match_one(inner: &Inner, tenant: Option<&str>, s: &SeenDevice) -> Option<MatchedVolume> {
    let visible = |v: &&VolumeRecord| tenant.is_none() || v.tenant.as_deref() == tenant;
    let by_id128 = |x: &Option<String>| {
        let want = normalize_id128(x.as_deref()?)?;
        inner
            .state
            .volumes
            .values()
            .filter(visible)
            .find(|v| normalize_id128(&v.uuid).as_deref() == Some(want.as_str()))
    };
    let nvme = s.nguid.is_some() || s.uuid.is_some() || s.subsysnqn.is_some();
    let (vol, by) = if let Some(v) = by_id128(&s.nguid) {
        (v, "nguid")
    } else if let Some(v) = by_id128(&s.uuid) {
        (v, "uuid")
    } else if let (Some(nqn), Some(nsid)) = (&s.subsysnqn, s.nsid) {
        let name = inner
            .state
            .nvmf
            .subsystems
            .get(nqn)?
            .namespaces
            .get(&nsid)?;
        let v = inner.state.volumes.get(name).filter(|v| visible(v))?;
        (v, "nsid")
    } else if nvme {
        return None;
    } else {
        let serial = s.serial.as_deref()?.trim();
        let v = inner
            .state
            .volumes
            .values()
            .filter(visible)
            .find(|v| !serial.is_empty() && v.serial == serial)?;
        (v, "serial")
    };
    let exports = super::volume::exporters(inner, &vol.name)
        .into_iter()
        .filter(|e| match (nvme, e.strip_prefix("nvmf:")) {
            (true, Some(rest)) => s
                .subsysnqn
                .as_deref()
                .is_none_or(|nqn| rest.starts_with(&format!("{nqn}/"))),
            (false, None) => true,
            _ => false,
        })
        .collect();
    Some(MatchedVolume {
        volume: vol.name.clone(),
        tenant: vol.tenant.clone(),
        encrypted: vol.encrypted,
        size: vol.size,
        block_size: vol.block_size,
        matched_by: by.into(),
        exports,
    })
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
    if !d.lock().state.tenants.contains_key(&tenant) {
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
    let id = d.peers.next.fetch_add(1, Ordering::Relaxed) + 1;
    let info = PeerWindowInfo {
        id,
        tenant,
        host,
        gpu_uuid: p.gpu_uuid,
        bdf: p.bdf,
        bar1_start: p.bar1_start,
        bar1_len: p.bar1_len,
        length: p.length,
        device_address: p.device_address,
        handle_kind: p.handle_kind,
        handle: p.handle,
        registered_via: if conn.is_some() {
            "host-channel"
        } else {
            "operator"
        }
        .into(),
    };
    info!(window = id, gpu = %info.gpu_uuid, bdf = %info.bdf, length = info.length,
        host = %info.host, tenant = %info.tenant, "peer window registered");
    d.peers.lock().insert(
        id,
        Window {
            info: info.clone(),
            conn,
        },
    );
    to_value(info)
}

fn unregister(d: &Daemon, caller: &Caller, params: Value) -> Result<Value, RpcError> {
    let p: PeerWindowId = parse_params(params)?;
    let mut w = d.peers.lock();
    let mine = |win: &Window| match caller {
        Caller::Operator => true,
        Caller::Host { id, .. } => win.info.host == id.host && win.info.tenant == id.tenant,
    };
    match w.get(&p.id) {
        Some(win) if mine(win) => {
            let win = w.remove(&p.id).expect("present");
            info!(window = p.id, gpu = %win.info.gpu_uuid, host = %win.info.host,
                tenant = %win.info.tenant, "peer window unregistered");
            to_value(Ack { ok: true })
        }
        // Another host's window is reported as absent: a host learns nothing of others.
        _ => Err(RpcError::not_found("peer window", &p.id.to_string())),
    }
}

fn list(d: &Daemon, caller: &Caller, params: Value) -> Result<Value, RpcError> {
    let p: PeerWindowList = parse_params(params)?;
    let w = d.peers.lock();
    to_value(
        w.values()
            .map(|win| &win.info)
            .filter(|i| match caller {
                Caller::Operator => p.tenant.as_ref().is_none_or(|t| *t == i.tenant),
                Caller::Host { id, .. } => i.host == id.host && i.tenant == id.tenant,
            })
            .cloned()
            .collect::<Vec<_>>(),
    )
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
