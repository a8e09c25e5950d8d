//! `remote_*` methods: NVMe-oF controllers nacred connects to as a host, and the building of
//! `remote` volumes (single namespace, multipath, stripe) from their namespaces.
//!
//! Controllers live in the daemon's [`Registry`], outside the control lock's `Inner`, so a
//! volume can be opened (which needs its controllers) while the control lock is held.
//! A remote is persisted with the namespace identities it had when attached; on replay it is
//! started in the background — a shelf that is down does not delay nacred's start — and its
//! volumes open at once over it, their I/O held or failed per the reconnect knobs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nacre_shared::api::remote::{
    parse_extent, DiscoveredSubsystem, MultipathPolicy, RemoteAttach, RemoteDiscover, RemoteInfo,
    RemoteLayout, RemoteList, RemoteName, RemoteNamespaceInfo, DEFAULT_STRIPE_SIZE,
};
use nacre_shared::api::{validate_name, Ack};
use nacre_shared::nvme::discovery as disc;
use nacre_shared::nvme::validate_nqn;
use nacre_shared::nvme_tcp::Digests;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{info, warn};

use super::state::State;
use super::{parse_params, to_value, Daemon, Inner, Method, RpcError};
use crate::fabric::namespace::BlockSizeView;
use crate::fabric::{
    discovery, Controller, ControllerConfig, MultipathDevice, NamespaceInfo, PathPolicy, Phase,
    RemoteNamespace, Transport,
};
use crate::volume::stripe::StripeVolume;
use crate::volume::BlockDevice;

pub const METHODS: &[Method] = &[
    Method {
        name: "remote_attach",
        handler: remote_attach,
        help: "Connect to a remote NVMe-oF controller: name, transport (tcp or rdma; default tcp), address, port, subnqn, hostnqn, io_queues, queue_depth, header_digest, data_digest, reconnect_delay_sec, ctrl_loss_timeout_sec, fast_io_fail_timeout_sec, in_capsule_data_size, keep_alive_timeout_ms, io_timeout_sec, quiesce_time_ms.",
    },
    Method {
        name: "remote_detach",
        handler: remote_detach,
        help: "Disconnect a remote controller no volume uses: name.",
    },
    Method {
        name: "remote_list",
        handler: remote_list,
        help: "List remote controllers with their state and namespaces (optionally one: name).",
    },
    Method {
        name: "remote_discover",
        handler: remote_discover,
        help: "Read a portal's NVMe-oF discovery log: transport, address, port.",
    },
];

/// A remote as persisted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RemoteRecord {
    pub name: String,
    pub transport: String,
    pub address: String,
    pub port: u16,
    pub subnqn: String,
    pub hostnqn: String,
    /// Host Identifier (a UUID), the same for every association of this host.
    pub hostid: String,
    pub io_queues: u16,
    pub queue_depth: u16,
    #[serde(default)]
    pub header_digest: bool,
    #[serde(default)]
    pub data_digest: bool,
    pub in_capsule_data_size: u32,
    pub keep_alive_timeout_ms: u32,
    pub reconnect_delay_sec: u32,
    pub ctrl_loss_timeout_sec: i32,
    #[serde(default)]
    pub fast_io_fail_timeout_sec: u32,
    pub io_timeout_sec: u32,
    pub quiesce_time_ms: u32,
    /// The namespaces found at attach: a reconnect that finds other identities fails the
    /// controller instead of writing to a different namespace.
    #[serde(default)]
    pub namespaces: Vec<NamespaceInfo>,
}

/// The running controllers, by remote name.
#[derive(Default)]
pub struct Registry {
    ctrls: Mutex<HashMap<String, Arc<Controller>>>,
    /// Remotes being attached (name → transport, address, port, subsystem NQN):
    /// `remote_attach` connects without the control-plane lock, so the name and target are
    /// reserved here.
    attaching: Mutex<HashMap<String, (String, String, u16, String)>>,
}

/// A name reserved in [`Registry::attaching`]; released on drop.
struct Attaching<'a> {
    registry: &'a Registry,
    name: String,
}

impl Drop for Attaching<'_> {
    fn drop(&mut self) {
        self.registry
            .attaching
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.name);
    }
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Controller>>> {
        self.ctrls.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub fn get(&self, name: &str) -> Option<Arc<Controller>> {
        self.lock().get(name).cloned()
    }
    fn insert(&self, name: &str, c: Controller) {
        self.lock().insert(name.to_string(), Arc::new(c));
    }
    fn remove(&self, name: &str) -> Option<Arc<Controller>> {
        self.lock().remove(name)
    }
    /// Close every controller (nacred shutting down); each close is bounded.
    pub fn close_all(&self) {
        let all: Vec<_> = self.lock().drain().collect();
        for (_, c) in all {
            c.close();
        }
    }
}

impl RemoteRecord {
    pub fn config(&self) -> ControllerConfig {
        let mut c = ControllerConfig::new(&self.address, self.port, &self.subnqn, &self.hostnqn);
        // Records from before NVMe/RDMA say "tcp"; an unknown word cannot be persisted
        // (new_record checks it), so TCP is only the fallback of a hand-edited state file.
        c.transport = self.transport.parse().unwrap_or_default();
        c.hostid = uuid::Uuid::parse_str(&self.hostid)
            .map(|u| *u.as_bytes())
            .unwrap_or(c.hostid);
        c.io_queues = self.io_queues;
        c.queue_depth = self.queue_depth;
        c.digests = Digests {
            header: self.header_digest,
            data: self.data_digest,
        };
        c.in_capsule_data_size = self.in_capsule_data_size as usize;
        c.keep_alive_timeout = Duration::from_millis(self.keep_alive_timeout_ms as u64);
        c.reconnect_delay = Duration::from_secs(self.reconnect_delay_sec as u64);
        c.ctrl_loss_timeout = match self.ctrl_loss_timeout_sec {
            -1 => None,
            n => Some(Duration::from_secs(n.max(0) as u64)),
        };
        c.fast_io_fail_timeout = match self.fast_io_fail_timeout_sec {
            0 => None,
            n => Some(Duration::from_secs(n as u64)),
        };
        c.io_timeout = match self.io_timeout_sec {
            0 => None,
            n => Some(Duration::from_secs(n as u64)),
        };
        c.quiesce_time = Duration::from_millis(self.quiesce_time_ms as u64);
        c
    }
}

/// SPDK's rules for the three knobs (bdev_nvme_check_io_error_resiliency_params), with
/// messages that say what to change.
fn check_knobs(reconnect: u32, loss: i32, fast: u32) -> Result<(), String> {
    match loss {
        l if l < -1 => Err(format!(
            "ctrl_loss_timeout_sec must be -1 (forever), 0 (never reconnect) or positive (got {l})"
        )),
        0 if reconnect != 0 || fast != 0 => Err(
            "with ctrl_loss_timeout_sec 0 (never reconnect), reconnect_delay_sec and fast_io_fail_timeout_sec must be 0"
                .into(),
        ),
        0 => Ok(()),
        l => {
            if reconnect == 0 {
                return Err("reconnect_delay_sec must be at least 1 when the controller reconnects".into());
            }
            if l > 0 && reconnect as i64 > l as i64 {
                return Err(format!(
                    "reconnect_delay_sec ({reconnect}) must not exceed ctrl_loss_timeout_sec ({l})"
                ));
            }
            if fast != 0 && l > 0 && fast as i64 > l as i64 {
                return Err(format!(
                    "fast_io_fail_timeout_sec ({fast}) must not exceed ctrl_loss_timeout_sec ({l})"
                ));
            }
            if fast != 0 && fast < reconnect {
                return Err(format!(
                    "fast_io_fail_timeout_sec ({fast}) must be at least reconnect_delay_sec ({reconnect})"
                ));
            }
            Ok(())
        }
    }
}

/// nacred's host identity: the one already used by a remote, or a new one.
fn host_identity(state: &State, hostnqn: Option<&str>) -> (String, String) {
    if let Some(r) = state
        .remotes
        .values()
        .find(|r| hostnqn.is_none_or(|h| h == r.hostnqn))
    {
        return (r.hostnqn.clone(), r.hostid.clone());
    }
    let id = uuid::Uuid::new_v4();
    let nqn = hostnqn
        .map(str::to_string)
        .unwrap_or_else(|| format!("nqn.2014-08.org.nvmexpress:uuid:{id}"));
    (nqn, id.to_string())
}

fn new_record(state: &State, p: &RemoteAttach) -> Result<RemoteRecord, RpcError> {
    validate_name("remote", &p.name).map_err(RpcError::invalid_params)?;
    let transport: Transport = p.transport.parse().map_err(RpcError::invalid_params)?;
    if transport == Transport::Rdma && (p.header_digest || p.data_digest) {
        return Err(RpcError::invalid_params(
            "header_digest and data_digest are NVMe/TCP features: NVMe/RDMA has none",
        ));
    }
    if p.address.is_empty() {
        return Err(RpcError::invalid_params("address must not be empty"));
    }
    if p.port == 0 {
        return Err(RpcError::invalid_params("port must not be 0"));
    }
    validate_nqn(&p.subnqn).map_err(|e| RpcError::invalid_params(format!("subnqn: {e}")))?;
    if p.subnqn == nacre_shared::nvme::DISCOVERY_NQN {
        return Err(RpcError::invalid_params(
            "subnqn is the discovery NQN: use remote_discover to list subsystems, then attach one",
        ));
    }
    if let Some(h) = &p.hostnqn {
        validate_nqn(h).map_err(|e| RpcError::invalid_params(format!("hostnqn: {e}")))?;
    }
    let io_queues = p.io_queues.unwrap_or(4);
    if !(1..=128).contains(&io_queues) {
        return Err(RpcError::invalid_params(format!(
            "io_queues must be 1 to 128 (got {io_queues})"
        )));
    }
    let queue_depth = p.queue_depth.unwrap_or(128);
    if !(2..=1023).contains(&queue_depth) {
        return Err(RpcError::invalid_params(format!(
            "queue_depth must be 2 to 1023 (got {queue_depth})"
        )));
    }
    let icd = p.in_capsule_data_size.unwrap_or(8192);
    if icd > 128 << 10 || icd % 16 != 0 {
        return Err(RpcError::invalid_params(format!(
            "in_capsule_data_size must be a multiple of 16 up to 131072 (got {icd})"
        )));
    }
    let reconnect = p.reconnect_delay_sec.unwrap_or(2);
    let loss = p.ctrl_loss_timeout_sec.unwrap_or(30);
    let fast = p.fast_io_fail_timeout_sec.unwrap_or(0);
    check_knobs(reconnect, loss, fast).map_err(RpcError::invalid_params)?;
    let (hostnqn, hostid) = host_identity(state, p.hostnqn.as_deref());
    Ok(RemoteRecord {
        name: p.name.clone(),
        transport: p.transport.clone(),
        address: p.address.clone(),
        port: p.port,
        subnqn: p.subnqn.clone(),
        hostnqn,
        hostid,
        io_queues,
        queue_depth,
        header_digest: p.header_digest,
        data_digest: p.data_digest,
        in_capsule_data_size: icd,
        keep_alive_timeout_ms: p.keep_alive_timeout_ms.unwrap_or(10_000),
        reconnect_delay_sec: reconnect,
        ctrl_loss_timeout_sec: loss,
        fast_io_fail_timeout_sec: fast,
        io_timeout_sec: p.io_timeout_sec.unwrap_or(30),
        quiesce_time_ms: p.quiesce_time_ms.unwrap_or(1000),
        namespaces: Vec::new(),
    })
}

fn remote_attach(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: RemoteAttach = parse_params(params)?;
    // Check and reserve under the control-plane lock; connect without it (the first attempt
    // may take up to 15 s against a shelf that does not answer, and every other RPC would
    // wait that long); record the result under the lock again.
    let (mut rec, _reserved) = d.with_inner(|inner| {
        let mut attaching = d
            .remotes
            .attaching
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if inner.state.remotes.contains_key(&p.name) || attaching.contains_key(&p.name) {
            return Err(RpcError::exists("remote", &p.name));
        }
        let rec = new_record(&inner.state, &p)?;
        // The same subsystem at the same portal over another transport is another path
        // (a shelf's RoCE and TCP ports share address and port number).
        let same = |t: &str, a: &str, port: u16, nqn: &str| {
            t == rec.transport && a == rec.address && port == rec.port && nqn == rec.subnqn
        };
        if let Some(other) = inner
            .state
            .remotes
            .values()
            .find(|r| same(&r.transport, &r.address, r.port, &r.subnqn))
            .map(|r| r.name.clone())
            .or_else(|| {
                attaching
                    .iter()
                    .find(|(_, (t, a, port, nqn))| same(t, a, *port, nqn))
                    .map(|(n, _)| n.clone())
            })
        {
            return Err(RpcError::busy(format!(
                "remote {:?} already connects to {} at {}:{} over {}",
                other, rec.subnqn, rec.address, rec.port, rec.transport
            )));
        }
        attaching.insert(
            rec.name.clone(),
            (
                rec.transport.clone(),
                rec.address.clone(),
                rec.port,
                rec.subnqn.clone(),
            ),
        );
        let reserved = Attaching {
            registry: &d.remotes,
            name: rec.name.clone(),
        };
        Ok((rec, reserved))
    })?;
    let ctrl = Controller::start(&rec.name, rec.config(), None);
    let wait = Duration::from_secs(3) * 5;
    let info = ctrl.wait_first_attempt(wait).map_err(|e| {
        ctrl.close();
        RpcError::failed(format!(
            "cannot attach remote {:?} ({} at {}:{}): {e}",
            rec.name, rec.subnqn, rec.address, rec.port
        ))
    })?;
    rec.namespaces = info.namespaces.clone();
    d.with_inner(|inner| {
        let mut next = inner.state.clone();
        next.remotes.insert(rec.name.clone(), rec.clone());
        if let Err(e) = d.persist(&next) {
            ctrl.close();
            return Err(e);
        }
        inner.state = next;
        d.remotes.insert(&rec.name, ctrl);
        info!(remote = %rec.name, subnqn = %rec.subnqn, namespaces = rec.namespaces.len(), "remote attached");
        to_value(info_of(d, inner, &rec))
    })
}

/// Volumes whose layout names `remote`.
fn users(inner: &Inner, remote: &str) -> Vec<String> {
    inner
        .state
        .volumes
        .values()
        .filter(|v| {
            v.remote.as_ref().is_some_and(|l| {
                l.extents
                    .iter()
                    .any(|e| parse_extent(e).is_ok_and(|ps| ps.iter().any(|(r, _)| r == remote)))
            })
        })
        .map(|v| v.name.clone())
        .collect()
}

fn remote_detach(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: RemoteName = parse_params(params)?;
    d.with_inner(|inner| {
        if !inner.state.remotes.contains_key(&p.name) {
            return Err(RpcError::not_found("remote", &p.name));
        }
        let u = users(inner, &p.name);
        if !u.is_empty() {
            return Err(RpcError::busy(format!(
                "remote {:?} backs volume(s) {}; delete those first",
                p.name,
                u.join(", ")
            )));
        }
        let mut next = inner.state.clone();
        next.remotes.remove(&p.name);
        d.persist(&next)?;
        inner.state = next;
        if let Some(c) = d.remotes.remove(&p.name) {
            c.close();
        }
        info!(remote = %p.name, "remote detached");
        to_value(Ack { ok: true })
    })
}

fn info_of(d: &Daemon, inner: &Inner, rec: &RemoteRecord) -> RemoteInfo {
    let st = d.remotes.get(&rec.name).map(|c| c.core().status());
    let info = st.as_ref().and_then(|s| s.info.clone());
    let namespaces = info
        .as_ref()
        .map(|i| i.namespaces.clone())
        .unwrap_or_else(|| rec.namespaces.clone());
    RemoteInfo {
        name: rec.name.clone(),
        transport: rec.transport.clone(),
        address: rec.address.clone(),
        port: rec.port,
        subnqn: rec.subnqn.clone(),
        hostnqn: rec.hostnqn.clone(),
        state: match st.as_ref().map(|s| s.phase) {
            Some(Phase::Live) => "live",
            Some(Phase::Connecting) => "connecting",
            Some(Phase::Failed) => "failed",
            Some(Phase::Closed) | None => "closed",
        }
        .into(),
        model: info.as_ref().map(|i| i.model.clone()),
        serial: info.as_ref().map(|i| i.serial.clone()),
        firmware: info.as_ref().map(|i| i.firmware.clone()),
        cntlid: info.as_ref().map(|i| i.cntlid),
        io_queues: info.as_ref().map_or(0, |i| i.io_queues),
        queue_depth: info.as_ref().map_or(0, |i| i.queue_depth),
        resets: st.as_ref().map_or(0, |s| s.resets),
        bounce_copy_bytes: st.as_ref().map_or(0, |s| s.bounce_copy_bytes),
        last_error: st.as_ref().and_then(|s| s.last_error.clone()),
        namespaces: namespaces
            .iter()
            .map(|n| RemoteNamespaceInfo {
                nsid: n.nsid,
                block_size: n.block_size,
                size: n.size(),
                id: n.id_string(),
            })
            .collect(),
        used_by: users(inner, &rec.name),
    }
}

/// Each attached remote controller (one path to its storage) for the metrics endpoint: name,
/// state as `remote_list` reports it, sessions lost, sessions established.
pub fn path_states(d: &Daemon, state: &State) -> Vec<(String, &'static str, u64, u64)> {
    state
        .remotes
        .keys()
        .map(|name| {
            let st = d.remotes.get(name).map(|c| c.core().status());
            let phase = match st.as_ref().map(|s| s.phase) {
                Some(Phase::Live) => "live",
                Some(Phase::Connecting) => "connecting",
                Some(Phase::Failed) => "failed",
                Some(Phase::Closed) | None => "closed",
            };
            let (resets, connects) = st.map_or((0, 0), |s| (s.resets, s.connects));
            (name.clone(), phase, resets, connects)
        })
        .collect()
}

fn remote_list(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: RemoteList = parse_params(params)?;
    d.with_inner(|inner| {
        if let Some(name) = &p.name {
            let rec = inner
                .state
                .remotes
                .get(name)
                .ok_or_else(|| RpcError::not_found("remote", name))?;
            return to_value(vec![info_of(d, inner, rec)]);
        }
        to_value(
            inner
                .state
                .remotes
                .values()
                .map(|r| info_of(d, inner, r))
                .collect::<Vec<_>>(),
        )
    })
}

fn remote_discover(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: RemoteDiscover = parse_params(params)?;
    let transport: Transport = p.transport.parse().map_err(RpcError::invalid_params)?;
    let hostnqn = match &p.hostnqn {
        Some(h) => {
            validate_nqn(h).map_err(|e| RpcError::invalid_params(format!("hostnqn: {e}")))?;
            h.clone()
        }
        None => d.with_inner(|inner| Ok(host_identity(&inner.state, None).0))?,
    };
    let entries = discovery::discover_over(
        transport,
        &p.address,
        p.port,
        &hostnqn,
        Duration::from_secs(3),
    )
    .map_err(|e| RpcError::failed(format!("discovery at {}:{} failed: {e}", p.address, p.port)))?;
    to_value(
        entries
            .into_iter()
            .map(|e| DiscoveredSubsystem {
                transport: match e.trtype {
                    disc::TRTYPE_TCP => "tcp".into(),
                    1 => "rdma".into(),
                    t => t.to_string(),
                },
                subtype: match e.subtype {
                    disc::SUBTYPE_NVME => "nvme".into(),
                    disc::SUBTYPE_DISCOVERY_REFERRAL | disc::SUBTYPE_CURRENT_DISCOVERY => {
                        "discovery".into()
                    }
                    t => t.to_string(),
                },
                subnqn: e.subnqn,
                address: e.traddr,
                port: e.trsvcid,
                portid: e.portid,
            })
            .collect::<Vec<_>>(),
    )
}

/// Start every persisted remote in the background (replay): never waits for a shelf.
pub fn replay(d: &Daemon, state: &State) {
    for rec in state.remotes.values() {
        let pinned = (!rec.namespaces.is_empty()).then(|| rec.namespaces.clone());
        d.remotes.insert(
            &rec.name,
            Controller::start(&rec.name, rec.config(), pinned),
        );
        info!(remote = %rec.name, "remote connecting in the background");
    }
}

/// Build the data path of a remote volume: each extent is one namespace or a multipath
/// device over several, and several extents are striped. Returns the device and its size.
pub fn build_volume(
    d: &Daemon,
    layout: &RemoteLayout,
    block_size: u32,
) -> Result<(Arc<dyn BlockDevice>, u64), RpcError> {
    if layout.extents.is_empty() {
        return Err(RpcError::invalid_params(
            "a remote volume needs at least one extent (REMOTE:NSID)",
        ));
    }
    let policy = match layout.multipath {
        MultipathPolicy::Failover => PathPolicy::Failover,
        MultipathPolicy::RoundRobin => PathPolicy::RoundRobin,
    };
    let mut devs: Vec<Arc<dyn BlockDevice>> = Vec::new();
    for e in &layout.extents {
        let paths = parse_extent(e).map_err(RpcError::invalid_params)?;
        let mut members = Vec::new();
        for (remote, nsid) in &paths {
            let ctrl = d.remotes.get(remote).ok_or_else(|| {
                RpcError::invalid_params(format!(
                    "extent {e:?}: remote {remote:?} is not attached (remote_attach it first)"
                ))
            })?;
            let all = ctrl.core().namespaces();
            let ns = all
                .iter()
                .find(|n| n.nsid == *nsid)
                .cloned()
                .ok_or_else(|| {
                    RpcError::invalid_params(format!(
                        "extent {e:?}: remote {remote:?} has no namespace {nsid} (it has {})",
                        all.iter()
                            .map(|n| n.nsid.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })?;
            if block_size % ns.block_size != 0 {
                return Err(RpcError::invalid_params(format!(
                    "extent {e:?}: namespace block size {} does not divide the volume block size {block_size}",
                    ns.block_size
                )));
            }
            members.push(if paths.len() > 1 {
                Arc::new(RemoteNamespace::as_path(ctrl.core().clone(), ns))
            } else {
                Arc::new(RemoteNamespace::new(ctrl.core().clone(), ns))
            });
        }
        let dev: Arc<dyn BlockDevice> = if members.len() == 1 {
            members.pop().expect("one member")
        } else {
            Arc::new(
                MultipathDevice::new(members, policy)
                    .map_err(|err| RpcError::invalid_params(format!("extent {e:?}: {err}")))?,
            )
        };
        let dev: Arc<dyn BlockDevice> = if dev.geometry().block_size == block_size {
            dev
        } else {
            Arc::new(BlockSizeView::new(dev, block_size))
        };
        devs.push(dev);
    }
    let dev: Arc<dyn BlockDevice> = if devs.len() == 1 {
        devs.pop().expect("one extent")
    } else {
        let ss = layout.stripe_size.unwrap_or(DEFAULT_STRIPE_SIZE);
        Arc::new(StripeVolume::new(devs, ss).map_err(|e| RpcError::invalid_params(e.to_string()))?)
    };
    if layout.extents.len() == 1 && layout.stripe_size.is_some() {
        warn!("stripe_size ignored for a single-extent remote volume");
    }
    let size = dev.geometry().size;
    Ok((dev, size))
}

/// The size of a new remote volume: the extents' capacity, or the requested size if it fits.
pub fn volume_size(
    d: &Daemon,
    p: &nacre_shared::api::volume::VolumeCreate,
) -> Result<u64, RpcError> {
    let layout = p.remote.as_ref().ok_or_else(|| {
        RpcError::invalid_params(
            "a remote volume needs \"remote\": {\"extents\": [\"REMOTE:NSID\", …]}",
        )
    })?;
    let (_, cap) = build_volume(d, layout, p.block_size)?;
    match p.size {
        0 => Ok(cap),
        s if s % p.block_size as u64 != 0 => Err(RpcError::invalid_params(format!(
            "size must be a multiple of the block size {} (got {s})",
            p.block_size
        ))),
        s if s > cap => Err(RpcError::invalid_params(format!(
            "size {s} exceeds the {cap} bytes the extents hold"
        ))),
        s => Ok(s),
    }
}

/// Open a remote volume's data path (create and replay). Its controllers may be down: the
/// device exists anyway and I/O waits or fails per their knobs.
pub fn open_volume(
    d: &Daemon,
    rec: &super::state::VolumeRecord,
) -> Result<Arc<dyn BlockDevice>, RpcError> {
    let layout = rec.remote.as_ref().ok_or_else(|| {
        RpcError::failed(format!(
            "remote volume {:?} has no layout in the state",
            rec.name
        ))
    })?;
    let (dev, cap) = build_volume(d, layout, rec.block_size)?;
    if cap < rec.size {
        return Err(RpcError::failed(format!(
            "remote volume {:?}: its extents now hold {cap} bytes, less than its {} bytes",
            rec.name, rec.size
        )));
    }
    Ok(if cap == rec.size {
        dev
    } else {
        Arc::new(BlockSizeView::with_size(dev, rec.block_size, rec.size))
    })
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn knob_rules_follow_spdk() {
        assert!(check_knobs(2, 30, 0).is_ok());
        assert!(check_knobs(2, -1, 0).is_ok());
        assert!(check_knobs(0, 0, 0).is_ok());
        assert!(check_knobs(1, 0, 0).is_err());
        assert!(check_knobs(0, 10, 0).is_err());
        assert!(check_knobs(20, 10, 0).is_err());
        assert!(check_knobs(2, 10, 20).is_err());
        assert!(check_knobs(5, 10, 2).is_err());
        assert!(check_knobs(2, 10, 5).is_ok());
        assert!(check_knobs(2, -2, 0).is_err());
    }
}
