//! Remote NVMe-oF controllers nacred connects to as a host (`remote_*`).
//!
//! A remote is persisted with the namespace identities it had when attached; on replay it is
//! started in the background — a shelf that is down does not delay nacred's start — and its
//! volumes open at once over it ([`super::remote_volume`]), their I/O held or failed per
//! the reconnect knobs.

use std::time::Duration;

use nacre_shared::api::remote::{
    parse_extent, DiscoveredSubsystem, RemoteAttach, RemoteDiscover, RemoteInfo,
    RemoteNamespaceInfo,
};
use nacre_shared::api::validate_name;
use nacre_shared::nvme::discovery as disc;
use nacre_shared::nvme::validate_nqn;
use tracing::info;

use super::store::{Inner, Registry};
use crate::control::error::RpcError;
use crate::control::state::{RemoteRecord, State};
use crate::fabric::{discovery, Controller, Phase, Transport};

/// A remote controller's state as `remote_list` and the metrics report it.
fn phase_name(phase: Option<Phase>) -> &'static str {
    match phase {
        Some(Phase::Live) => "live",
        Some(Phase::Connecting) => "connecting",
        Some(Phase::Failed) => "failed",
        Some(Phase::Closed) | None => "closed",
    }
}

/// One attached remote controller (one path to its storage) as the metrics endpoint shows
/// it.
pub struct PathState {
    pub remote: String,
    /// As `remote_list` reports it: live, connecting, failed or closed.
    pub state: &'static str,
    /// Sessions lost (each one a reconnect).
    pub resets: u64,
    /// Sessions established.
    pub connects: u64,
    /// I/O bytes copied through transport buffers (NVMe/RDMA's slot buffers).
    pub bounce_copy_bytes: u64,
    /// I/O bytes moved straight from or into the requests' memory (zero copy).
    pub direct_bytes: u64,
}

impl Registry {
    /// `remote_attach`. The name and target are checked and reserved under the control
    /// lock; the connection is made without it (the first attempt may take up to 15 s
    /// against a shelf that does not answer, and every other RPC would wait that long); the
    /// result is persisted under the lock again.
    pub fn attach_remote(&self, p: &RemoteAttach) -> Result<RemoteInfo, RpcError> {
        let (mut rec, _reserved) = self.with(|inner| {
            if inner.state.remotes.contains_key(&p.name) || self.controllers.is_attaching(&p.name) {
                return Err(RpcError::exists("remote", &p.name));
            }
            let rec = new_record(&inner.state, p)?;
            let busy = |other: &str| {
                RpcError::busy(format!(
                    "remote {:?} already connects to {} at {}:{} over {}",
                    other, rec.subnqn, rec.address, rec.port, rec.transport
                ))
            };
            // The same subsystem at the same portal over another transport is another path
            // (a shelf's RoCE and TCP ports share address and port number).
            if let Some(other) = inner.state.remotes.values().find(|r| {
                r.transport == rec.transport
                    && r.address == rec.address
                    && r.port == rec.port
                    && r.subnqn == rec.subnqn
            }) {
                return Err(busy(&other.name));
            }
            let reserved = self
                .controllers
                .reserve(&rec)
                .map_err(|other| busy(&other))?;
            Ok((rec, reserved))
        })?;
        let ctrl = Controller::start(&rec.name, self.controllers.config(&rec), None);
        let wait = Duration::from_secs(3) * 5;
        let info = ctrl.wait_first_attempt(wait).map_err(|e| {
            ctrl.close();
            RpcError::failed(format!(
                "cannot attach remote {:?} ({} at {}:{}): {e}",
                rec.name, rec.subnqn, rec.address, rec.port
            ))
        })?;
        rec.namespaces = info.namespaces.clone();
        self.with(|inner| {
            let mut next = inner.state.clone();
            next.remotes.insert(rec.name.clone(), rec.clone());
            if let Err(e) = self.persist(&next) {
                ctrl.close();
                return Err(e);
            }
            inner.state = next;
            self.controllers.insert(&rec.name, ctrl);
            info!(remote = %rec.name, subnqn = %rec.subnqn, namespaces = rec.namespaces.len(), "remote attached");
            Ok(self.remote_info(inner, &rec))
        })
    }

    /// `remote_detach`: refused while volumes are built over it.
    pub fn detach_remote(&self, name: &str) -> Result<(), RpcError> {
        self.with(|inner| {
            if !inner.state.remotes.contains_key(name) {
                return Err(RpcError::not_found("remote", name));
            }
            let u = users(inner, name);
            if !u.is_empty() {
                return Err(RpcError::busy(format!(
                    "remote {name:?} backs volume(s) {}; delete those first",
                    u.join(", ")
                )));
            }
            let mut next = inner.state.clone();
            next.remotes.remove(name);
            self.commit(inner, next, || {})?;
            if let Some(c) = self.controllers.remove(name) {
                c.close();
            }
            info!(remote = %name, "remote detached");
            Ok(())
        })
    }

    /// Reset a remote: disconnect the remote's queues and connect again through the
    /// reconnect machinery (I/O in flight is held and resent, not failed). Returns at once;
    /// `remote_list` shows the controller connecting, then live.
    pub fn reset_remote(&self, name: &str) -> Result<(), RpcError> {
        self.with(|inner| {
            if !inner.state.remotes.contains_key(name) {
                return Err(RpcError::not_found("remote", name));
            }
            let c = self
                .controllers
                .get(name)
                .ok_or_else(|| RpcError::failed(format!("remote {name:?} is not started")))?;
            c.reset()
                .map_err(|e| RpcError::failed(format!("cannot reset remote {name:?}: {e}")))?;
            info!(remote = %name, "remote reset");
            Ok(())
        })
    }

    /// `remote_list`: every remote, or the one named.
    pub fn remotes(&self, name: Option<&str>) -> Result<Vec<RemoteInfo>, RpcError> {
        self.with(|inner| {
            if let Some(name) = name {
                let rec = inner
                    .state
                    .remotes
                    .get(name)
                    .ok_or_else(|| RpcError::not_found("remote", name))?;
                return Ok(vec![self.remote_info(inner, rec)]);
            }
            Ok(inner
                .state
                .remotes
                .values()
                .map(|r| self.remote_info(inner, r))
                .collect())
        })
    }

    /// `remote_discover`: read a portal's discovery log, as nacred's host identity (the one
    /// its remotes use) unless another host NQN is given.
    pub fn discover(&self, p: &RemoteDiscover) -> Result<Vec<DiscoveredSubsystem>, RpcError> {
        let transport: Transport = p.transport.parse().map_err(RpcError::invalid_params)?;
        let hostnqn = match &p.hostnqn {
            Some(h) => {
                validate_nqn(h).map_err(|e| RpcError::invalid_params(format!("hostnqn: {e}")))?;
                h.clone()
            }
            None => self.read_state(|state| host_identity(state, None).0),
        };
        let entries = discovery::discover_over(
            transport,
            &p.address,
            p.port,
            &hostnqn,
            Duration::from_secs(3),
            self.controllers.tcp_reactors(),
        )
        .map_err(|e| {
            RpcError::failed(format!("discovery at {}:{} failed: {e}", p.address, p.port))
        })?;
        Ok(entries
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
            .collect())
    }

    /// Each attached remote controller, for the metrics endpoint.
    pub fn path_states(&self) -> Vec<PathState> {
        let names: Vec<String> = self.read_state(|s| s.remotes.keys().cloned().collect());
        names
            .into_iter()
            .map(|remote| {
                let st = self.controllers.get(&remote).map(|c| c.core().status());
                let state = phase_name(st.as_ref().map(|s| s.phase));
                let (resets, connects, bounce_copy_bytes, direct_bytes) = st
                    .map_or((0, 0, 0, 0), |s| {
                        (s.resets, s.connects, s.bounce_copy_bytes, s.direct_bytes)
                    });
                PathState {
                    remote,
                    state,
                    resets,
                    connects,
                    bounce_copy_bytes,
                    direct_bytes,
                }
            })
            .collect()
    }

    fn remote_info(&self, inner: &Inner, rec: &RemoteRecord) -> RemoteInfo {
        let st = self.controllers.get(&rec.name).map(|c| c.core().status());
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
            dhchap: match (&rec.dhchap_secret, &rec.dhchap_ctrl_secret) {
                (None, _) => None,
                (Some(_), None) => Some("unidirectional".into()),
                (Some(_), Some(_)) => Some("bidirectional".into()),
            },
            secure_channel: rec.psk.as_ref().map(|_| "tls".into()),
            state: phase_name(st.as_ref().map(|s| s.phase)).into(),
            model: info.as_ref().map(|i| i.model.clone()),
            serial: info.as_ref().map(|i| i.serial.clone()),
            firmware: info.as_ref().map(|i| i.firmware.clone()),
            cntlid: info.as_ref().map(|i| i.cntlid),
            io_queues: info.as_ref().map_or(0, |i| i.io_queues),
            queue_depth: info.as_ref().map_or(0, |i| i.queue_depth),
            resets: st.as_ref().map_or(0, |s| s.resets),
            bounce_copy_bytes: st.as_ref().map_or(0, |s| s.bounce_copy_bytes),
            direct_bytes: st.as_ref().map_or(0, |s| s.direct_bytes),
            inline_sends: st.as_ref().map_or(0, |s| s.inline_sends),
            inline_partial_sends: st.as_ref().map_or(0, |s| s.inline_partial_sends),
            rx_direct_bytes: st.as_ref().map_or(0, |s| s.rx_direct_bytes),
            rx_copied_bytes: st.as_ref().map_or(0, |s| s.rx_copied_bytes),
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
}

/// Start every persisted remote in the background (replay): never waits for a shelf.
pub(super) fn replay(reg: &Registry, state: &State) {
    for rec in state.remotes.values() {
        let pinned = (!rec.namespaces.is_empty()).then(|| rec.namespaces.clone());
        let cfg = reg.controllers.config(rec);
        reg.controllers
            .insert(&rec.name, Controller::start(&rec.name, cfg, pinned));
        info!(remote = %rec.name, "remote connecting in the background");
    }
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
    if p.dhchap_ctrl_secret.is_some() && p.dhchap_secret.is_none() {
        return Err(RpcError::invalid_params(
            "dhchap_ctrl_secret needs dhchap_secret: the host authenticates itself first",
        ));
    }
    // Checked now for a clear error at attach; read again at each connection.
    for (what, path) in [
        ("dhchap_secret", &p.dhchap_secret),
        ("dhchap_ctrl_secret", &p.dhchap_ctrl_secret),
    ] {
        if let Some(path) = path {
            let path = std::path::Path::new(path);
            if !path.is_absolute() {
                return Err(RpcError::invalid_params(format!(
                    "{what} must be an absolute path (got {})",
                    path.display()
                )));
            }
            crate::auth::Secret::load(path)
                .map_err(|e| RpcError::invalid_params(format!("{what}: {e}")))?;
        }
    }
    if let Some(path) = &p.psk {
        if p.transport != "tcp" {
            return Err(RpcError::invalid_params(format!(
                "psk secures NVMe/TCP only (transport is {}; NVMe/RDMA has no TLS)",
                p.transport
            )));
        }
        let path = std::path::Path::new(path);
        if !path.is_absolute() {
            return Err(RpcError::invalid_params(format!(
                "psk must be an absolute path (got {})",
                path.display()
            )));
        }
        crate::auth::tls_psk::TlsPsk::load(path)
            .map_err(|e| RpcError::invalid_params(format!("psk: {e}")))?;
    }
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
        dhchap_secret: p.dhchap_secret.clone(),
        dhchap_ctrl_secret: p.dhchap_ctrl_secret.clone(),
        psk: p.psk.clone(),
        namespaces: Vec::new(),
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
