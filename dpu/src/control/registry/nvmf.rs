//! NVMe-oF subsystems, their namespaces (volumes), listeners and allowed hosts, served by
//! the daemon's one target ([`super::target`]).
//!
//! Replay recreates subsystems, then namespaces (on their reopened volumes), hosts (with
//! their DH-HMAC-CHAP secrets, read again from their files) and listeners. Namespaces
//! report the volume's UUID as NGUID and UUID, so a namespace keeps its identity across
//! restarts and across paths.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use nacre_shared::api::nvmf::{
    NvmfHostKeyFiles, NvmfListenerState, NvmfPcieStats, NvmfReactorStats, NvmfStats,
    NvmfSubsystemCreate, NvmfSubsystemInfo, NvmfSubsystemStatus, INTERRUPTS_MSI, INTERRUPTS_MSIX,
};
use nacre_shared::nvme::validate_nqn;
use tracing::{info, warn};

use super::store::{Inner, Registry};
use super::target::{
    pcie_err, rdma_ports, rpc_err, target, vfio_user_ports, ListenerTransport, Port,
};
use crate::auth::tls_psk::TlsPsk;
use crate::auth::Secret;
use crate::control::error::RpcError;
use crate::control::state::{serial_from_uuid, NvmfState, NvmfSubsystemRecord};
use crate::frontend::nvme_pcie::Signals;
use crate::frontend::nvmf_tcp::{HostKeys, NvmfTarget, AUTH_DHGROUPS, AUTH_HASHES, DEFAULT_MODEL};

impl Registry {
    /// `nvmf_subsystem_create`. The serial defaults to a fresh one in the volumes' format,
    /// the model to nacre's.
    pub fn create_subsystem(
        &self,
        p: &NvmfSubsystemCreate,
    ) -> Result<Option<NvmfSubsystemInfo>, RpcError> {
        validate_nqn(&p.nqn).map_err(RpcError::invalid_params)?;
        let serial = p
            .serial
            .clone()
            .unwrap_or_else(|| serial_from_uuid(&uuid::Uuid::new_v4()));
        let model = p.model.clone().unwrap_or_else(|| DEFAULT_MODEL.to_string());
        self.with(|inner| {
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
                host_keys: BTreeMap::new(),
                namespaces: BTreeMap::new(),
                listeners: BTreeSet::new(),
                rdma_listeners: BTreeSet::new(),
                vfio_user_listeners: BTreeSet::new(),
                vfio_user_msi: BTreeSet::new(),
                tls_listeners: BTreeSet::new(),
                host_psks: BTreeMap::new(),
            };
            self.commit_nvmf(
                inner,
                |s| {
                    s.subsystems.insert(rec.nqn.clone(), rec.clone());
                },
                || {
                    let _ = t.delete_subsystem(&p.nqn);
                },
            )?;
            info!(nqn = %p.nqn, "nvmf subsystem created");
            Ok(subsystem_info(&t, &p.nqn))
        })
    }

    /// `nvmf_subsystem_delete`: its hosts are disconnected.
    pub fn delete_subsystem(&self, nqn: &str) -> Result<(), RpcError> {
        self.with(|inner| {
            record(inner, nqn)?;
            self.commit_nvmf(
                inner,
                |s| {
                    s.subsystems.remove(nqn);
                },
                || {},
            )?;
            if let Some(ports) = inner.live.nvmf_rdma.clone() {
                ports.forget_subsystem(nqn);
            }
            if let Some(ports) = inner.live.nvmf_vfio_user.clone() {
                ports.forget_subsystem(nqn);
            }
            inner
                .live
                .vfio_user_listeners_failed
                .retain(|(n, _), _| n != nqn);
            inner
                .live
                .rdma_listeners_failed
                .retain(|(n, _), _| n != nqn);
            let t = target(inner);
            if let Err(e) = t.delete_subsystem(nqn) {
                warn!(nqn = %nqn, error = %e, "nvmf subsystem was not live");
            }
            Ok(())
        })
    }

    /// `nvmf_subsystem_add_ns`: export `volume` as namespace `nsid` (default: the lowest
    /// free one). Returns the NSID.
    pub fn add_namespace(
        &self,
        nqn: &str,
        volume: &str,
        nsid: Option<u32>,
    ) -> Result<u32, RpcError> {
        self.with(|inner| {
            if let Some(nsid) = record(inner, nqn)?
                .namespaces
                .iter()
                .find(|(_, v)| v.as_str() == volume)
                .map(|(n, _)| *n)
            {
                // Two namespaces of one subsystem with the same NGUID confuse hosts (Linux
                // refuses the second).
                return Err(RpcError::busy(format!(
                    "volume {volume:?} is already namespace {nsid} of {nqn}"
                )));
            }
            let dev = inner
                .live
                .volumes
                .get(volume)
                .cloned()
                .ok_or_else(|| RpcError::not_found("volume", volume))?;
            let nguid = nguid_of(inner, volume)?;
            let t = target(inner);
            let nsid = t
                .add_namespace(nqn, nsid, dev, nguid, volume.to_string())
                .map_err(rpc_err)?;
            self.commit_nvmf(
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(nqn) {
                        r.namespaces.insert(nsid, volume.to_string());
                    }
                },
                || {
                    let _ = t.remove_namespace(nqn, nsid);
                },
            )?;
            Ok(nsid)
        })
    }

    /// `nvmf_subsystem_remove_ns`: hosts get a namespace-changed event.
    pub fn remove_namespace(&self, nqn: &str, nsid: u32) -> Result<(), RpcError> {
        self.with(|inner| {
            if !record(inner, nqn)?.namespaces.contains_key(&nsid) {
                return Err(RpcError::not_found("namespace", &format!("{nqn}/{nsid}")));
            }
            self.commit_nvmf(
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(nqn) {
                        r.namespaces.remove(&nsid);
                    }
                },
                || {},
            )?;
            let t = target(inner);
            if let Err(e) = t.remove_namespace(nqn, nsid) {
                warn!(nqn = %nqn, nsid, error = %e, "nvmf namespace was not live");
            }
            Ok(())
        })
    }

    /// `nvmf_subsystem_add_listener`. Returns the address bound (the port actually bound
    /// when 0 was asked for). A listener that failed at replay and is added again is no
    /// longer reported failed.
    pub fn add_listener(
        &self,
        nqn: &str,
        addr: SocketAddr,
        transport: ListenerTransport,
    ) -> Result<SocketAddr, RpcError> {
        self.with(|inner| {
            if transport.listeners(record(inner, nqn)?).contains(&addr) {
                return Err(RpcError::exists("listener", &transport.name(addr)));
            }
            let port = Port::of(inner, transport);
            let bound = port.add(nqn, addr)?;
            transport.failed(inner).remove(&(nqn.to_string(), bound));
            self.commit_nvmf(
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(nqn) {
                        transport.listeners_mut(r).insert(bound);
                    }
                },
                || port.remove(nqn, bound),
            )?;
            Ok(bound)
        })
    }

    /// `nvmf_subsystem_add_listener` with transport `vfio-user`: serve the subsystem as a
    /// PCIe NVMe controller on `dir/cntrl` (`dir` must exist), its function signalling with
    /// `interrupts`. Returns the socket's path.
    pub fn add_vfio_user_listener(
        &self,
        nqn: &str,
        dir: &Path,
        interrupts: Signals,
    ) -> Result<PathBuf, RpcError> {
        if !dir.is_absolute() {
            return Err(RpcError::invalid_params(format!(
                "vfio-user directory {} must be an absolute path",
                dir.display()
            )));
        }
        self.with(|inner| {
            if record(inner, nqn)?.vfio_user_listeners.contains(dir) {
                return Err(RpcError::exists(
                    "listener",
                    &format!("vfio-user:{}", dir.display()),
                ));
            }
            let ports = vfio_user_ports(inner);
            let sock = ports.add_listener(nqn, dir, interrupts).map_err(pcie_err)?;
            inner
                .live
                .vfio_user_listeners_failed
                .remove(&(nqn.to_string(), dir.to_path_buf()));
            self.commit_nvmf(
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(nqn) {
                        r.vfio_user_listeners.insert(dir.to_path_buf());
                        if interrupts == Signals::Msi {
                            r.vfio_user_msi.insert(dir.to_path_buf());
                        }
                    }
                },
                || {
                    let _ = ports.remove_listener(nqn, dir);
                },
            )?;
            Ok(sock)
        })
    }

    /// `nvmf_subsystem_remove_listener` with transport `vfio-user`.
    pub fn remove_vfio_user_listener(&self, nqn: &str, dir: &Path) -> Result<(), RpcError> {
        self.with(|inner| {
            if !record(inner, nqn)?.vfio_user_listeners.contains(dir) {
                return Err(RpcError::not_found(
                    "listener",
                    &format!("vfio-user:{}", dir.display()),
                ));
            }
            self.commit_nvmf(
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(nqn) {
                        r.vfio_user_listeners.remove(dir);
                        r.vfio_user_msi.remove(dir);
                    }
                },
                || {},
            )?;
            if let Some(ports) = inner.live.nvmf_vfio_user.clone() {
                let _ = ports.remove_listener(nqn, dir);
            }
            inner
                .live
                .vfio_user_listeners_failed
                .remove(&(nqn.to_string(), dir.to_path_buf()));
            Ok(())
        })
    }

    /// `nvmf_subsystem_remove_listener`.
    pub fn remove_listener(
        &self,
        nqn: &str,
        addr: SocketAddr,
        transport: ListenerTransport,
    ) -> Result<(), RpcError> {
        self.with(|inner| {
            let rec = record(inner, nqn)?;
            // A TLS listener is removed by its address alone too.
            let transport = match transport {
                ListenerTransport::Tcp
                    if !rec.listeners.contains(&addr) && rec.tls_listeners.contains(&addr) =>
                {
                    ListenerTransport::Tls
                }
                t => t,
            };
            if !transport.listeners(rec).contains(&addr) {
                return Err(RpcError::not_found("listener", &transport.name(addr)));
            }
            self.commit_nvmf(
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(nqn) {
                        transport.listeners_mut(r).remove(&addr);
                    }
                },
                || {},
            )?;
            Port::of(inner, transport).remove(nqn, addr);
            transport.failed(inner).remove(&(nqn.to_string(), addr));
            Ok(())
        })
    }

    /// `nvmf_subsystem_add_host`.
    pub fn add_host(&self, nqn: &str, host: &str) -> Result<(), RpcError> {
        self.add_host_with_psk(nqn, host, None)
    }

    /// `nvmf_subsystem_add_host` with `psk`: the host's TLS PSK is read from `psk` (a file
    /// of mode 0600 in the interchange format), whose path is what is persisted.
    pub fn add_host_with_psk(
        &self,
        nqn: &str,
        host: &str,
        psk: Option<&Path>,
    ) -> Result<(), RpcError> {
        let key = match psk {
            None => None,
            Some(p) => {
                if !p.is_absolute() {
                    return Err(RpcError::invalid_params(format!(
                        "psk {} must be an absolute path",
                        p.display()
                    )));
                }
                Some(TlsPsk::load(p).map_err(|e| RpcError::invalid_params(e.to_string()))?)
            }
        };
        self.with(|inner| {
            record(inner, nqn)?;
            let t = target(inner);
            t.add_host(nqn, host).map_err(rpc_err)?;
            let had_psk = t.host_has_psk(nqn, host);
            if key.is_some() {
                t.set_host_psk(nqn, host, key.clone()).map_err(rpc_err)?;
            }
            self.commit_nvmf(
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(nqn) {
                        r.hosts.insert(host.to_string());
                        if let Some(p) = psk {
                            r.host_psks.insert(host.to_string(), p.to_path_buf());
                        }
                    }
                },
                || {
                    let _ = t.remove_host(nqn, host);
                    if key.is_some() && !had_psk {
                        let _ = t.set_host_psk(nqn, host, None);
                    }
                },
            )
        })
    }

    /// `nvmf_subsystem_add_host` with its DH-HMAC-CHAP key files: the host's new queues
    /// must authenticate with the secrets in them (`None`: the host no longer does).
    /// Queues connected already stay as they are.
    pub fn add_host_auth(
        &self,
        nqn: &str,
        host: &str,
        files: Option<NvmfHostKeyFiles>,
    ) -> Result<(), RpcError> {
        let keys = files.as_ref().map(load_host_keys).transpose()?;
        self.with(|inner| {
            let rec = record(inner, nqn)?;
            let (had_host, old_files) =
                (rec.hosts.contains(host), rec.host_keys.get(host).cloned());
            let t = target(inner);
            t.add_host(nqn, host).map_err(rpc_err)?;
            let old_keys = old_files.as_ref().and_then(|f| load_host_keys(f).ok());
            t.set_host_keys(nqn, host, keys).map_err(rpc_err)?;
            self.commit_nvmf(
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(nqn) {
                        r.hosts.insert(host.to_string());
                        match &files {
                            Some(f) => r.host_keys.insert(host.to_string(), f.clone()),
                            None => r.host_keys.remove(host),
                        };
                    }
                },
                || {
                    let _ = t.set_host_keys(nqn, host, old_keys);
                    if !had_host {
                        let _ = t.remove_host(nqn, host);
                    }
                },
            )?;
            info!(
                nqn,
                host,
                authenticate = files.is_some(),
                bidirectional = files.as_ref().is_some_and(|f| f.dhchap_ctrlr_key.is_some()),
                "nvmf host added"
            );
            Ok(())
        })
    }

    /// `nvmf_subsystem_remove_host`: existing connections stay.
    pub fn remove_host(&self, nqn: &str, host: &str) -> Result<(), RpcError> {
        self.with(|inner| {
            if !record(inner, nqn)?.hosts.contains(host) {
                return Err(RpcError::not_found("host", host));
            }
            self.commit_nvmf(
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(nqn) {
                        r.hosts.remove(host);
                        r.host_keys.remove(host);
                        r.host_psks.remove(host);
                    }
                },
                || {},
            )?;
            let _ = target(inner).set_host_psk(nqn, host, None);
            let _ = target(inner).remove_host(nqn, host);
            Ok(())
        })
    }

    /// `nvmf_subsystem_allow_any_host`.
    pub fn set_allow_any_host(&self, nqn: &str, allow: bool) -> Result<(), RpcError> {
        self.with(|inner| {
            let before = record(inner, nqn)?.allow_any_host;
            let t = target(inner);
            t.set_allow_any_host(nqn, allow).map_err(rpc_err)?;
            self.commit_nvmf(
                inner,
                |s| {
                    if let Some(r) = s.subsystems.get_mut(nqn) {
                        r.allow_any_host = allow;
                    }
                },
                || {
                    let _ = t.set_allow_any_host(nqn, before);
                },
            )
        })
    }

    /// `nvmf_get_subsystems`: each subsystem (the discovery subsystem first) with the state
    /// of its configured listeners.
    pub fn subsystems(&self) -> Vec<NvmfSubsystemStatus> {
        let mut inner = self.lock();
        let subs = target(&mut inner).subsystems();
        with_listener_states(&inner, subs)
    }

    /// `nvmf_get_stats`: the NVMe/TCP target's reactors and the PCIe controllers' pollers.
    pub fn nvmf_stats(&self) -> NvmfStats {
        let mut inner = self.lock();
        let (policy, reactors) = target(&mut inner).reactor_stats();
        let pcie = inner
            .live
            .nvmf_vfio_user
            .as_ref()
            .map(|p| p.poll_stats())
            .unwrap_or_default()
            .into_iter()
            .map(|(nqn, dir, s)| NvmfPcieStats {
                nqn,
                path: dir.display().to_string(),
                busy_passes: s.busy_passes,
                idle_passes: s.idle_passes,
                busy_ns: s.busy_ns,
                pauses: s.pauses,
                at_ns: s.at_ns,
            })
            .collect();
        NvmfStats {
            poll: policy.as_str().to_string(),
            reactors: reactors
                .into_iter()
                .map(|r| NvmfReactorStats {
                    connections: r.connections as u64,
                    busy_passes: r.busy_passes,
                    idle_polls: r.idle_polls,
                    sleeps: r.sleeps,
                    deep_sleeps: r.deep_sleeps,
                })
                .collect(),
            pcie,
        }
    }

    /// Why a configured NVMe/TCP listener is not listening (it is being retried), if it is
    /// not.
    pub fn listener_failure(&self, nqn: &str, addr: SocketAddr) -> Option<String> {
        let inner = self.lock();
        inner
            .live
            .listeners_failed
            .get(&(nqn.to_string(), addr))
            .cloned()
    }

    /// Why a configured NVMe/RDMA listener is not listening, if it is not.
    pub fn rdma_listener_failure(&self, nqn: &str, addr: SocketAddr) -> Option<String> {
        let inner = self.lock();
        inner
            .live
            .rdma_listeners_failed
            .get(&(nqn.to_string(), addr))
            .cloned()
    }

    /// Apply `change` to a copy of the NVMe-oF state, persist it, and commit; `undo` reverts
    /// the live change if persisting fails.
    fn commit_nvmf(
        &self,
        inner: &mut Inner,
        change: impl FnOnce(&mut NvmfState),
        undo: impl FnOnce(),
    ) -> Result<(), RpcError> {
        let mut next = inner.state.clone();
        change(&mut next.nvmf);
        self.commit(inner, next, undo)
    }
}

/// Read a host's secrets from their files (each of mode 0600 or stricter).
fn load_host_keys(f: &NvmfHostKeyFiles) -> Result<HostKeys, RpcError> {
    let load = |p: &Path| {
        if !p.is_absolute() {
            return Err(RpcError::invalid_params(format!(
                "{}: give the key file's absolute path",
                p.display()
            )));
        }
        Secret::load(p).map_err(|e| RpcError::invalid_params(e.to_string()))
    };
    Ok(HostKeys {
        key: load(&f.dhchap_key)?,
        ctrl_key: f.dhchap_ctrlr_key.as_deref().map(load).transpose()?,
        hashes: choose(
            "dhchap_digests",
            &AUTH_HASHES,
            f.dhchap_digests.as_deref(),
            |h| h.name(),
        )?,
        dhgroups: choose(
            "dhchap_dhgroups",
            &AUTH_DHGROUPS,
            f.dhchap_dhgroups.as_deref(),
            |g| g.name(),
        )?,
    })
}

/// The members of `all` named in `names` (all of them without a list), in `all`'s order.
fn choose<T: Copy>(
    what: &str,
    all: &[T],
    names: Option<&[String]>,
    name: impl Fn(T) -> &'static str,
) -> Result<Vec<T>, RpcError> {
    let Some(names) = names else {
        return Ok(all.to_vec());
    };
    let known: Vec<&str> = all.iter().map(|&t| name(t)).collect();
    if let Some(bad) = names.iter().find(|n| !known.contains(&n.as_str())) {
        return Err(RpcError::invalid_params(format!(
            "{what}: {bad:?} is not one of {}",
            known.join(", ")
        )));
    }
    let out: Vec<T> = all
        .iter()
        .copied()
        .filter(|&t| names.iter().any(|n| n == name(t)))
        .collect();
    if out.is_empty() {
        return Err(RpcError::invalid_params(format!(
            "{what}: name at least one"
        )));
    }
    Ok(out)
}

fn record<'a>(inner: &'a Inner, nqn: &str) -> Result<&'a NvmfSubsystemRecord, RpcError> {
    inner
        .state
        .nvmf
        .subsystems
        .get(nqn)
        .ok_or_else(|| RpcError::not_found("subsystem", nqn))
}

fn subsystem_info(t: &NvmfTarget, nqn: &str) -> Option<NvmfSubsystemInfo> {
    t.subsystems().into_iter().find(|s| s.nqn == nqn)
}

/// NGUID/UUID of a namespace: the volume's UUID.
fn nguid_of(inner: &Inner, volume: &str) -> Result<[u8; 16], RpcError> {
    let rec = inner.volume(volume)?;
    uuid::Uuid::parse_str(&rec.uuid)
        .map(|u| *u.as_bytes())
        .map_err(|e| RpcError::failed(format!("volume {volume:?} has a bad UUID: {e}")))
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
    for (h, files) in &rec.host_keys {
        // A host whose secret cannot be read is not let in without it: it stays refused
        // (its queues must authenticate and cannot) until the key file is fixed and the
        // host added again.
        let keys = match load_host_keys(files) {
            Ok(k) => k,
            Err(e) => {
                warn!(
                    nqn = %rec.nqn,
                    host = %h,
                    error = %e.message,
                    "DH-HMAC-CHAP key not restored: the host is refused"
                );
                let _ = t.remove_host(&rec.nqn, h);
                continue;
            }
        };
        if let Err(e) = t.set_host_keys(&rec.nqn, h, Some(keys)) {
            warn!(nqn = %rec.nqn, host = %h, error = %e, "DH-HMAC-CHAP key not restored");
        }
    }
    for (h, p) in &rec.host_psks {
        // A key file gone or made readable by others: the host cannot use TLS listeners
        // until it is added again with a good one.
        match TlsPsk::load(p) {
            Ok(k) => {
                let _ = t.set_host_psk(&rec.nqn, h, Some(k));
            }
            Err(e) => {
                warn!(nqn = %rec.nqn, host = %h, error = %e, "nvmf host TLS PSK not restored")
            }
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
    for d in &rec.vfio_user_listeners {
        let ports = vfio_user_ports(inner);
        // The directory existed when the listener was added; one under /run is gone after a
        // reboot, and the operator asked for the controller to stay: make it again.
        if let Err(e) = std::fs::create_dir_all(d) {
            warn!(nqn = %rec.nqn, dir = %d.display(), "cannot make the vfio-user directory: {e}");
        }
        let interrupts = if rec.vfio_user_msi.contains(d) {
            Signals::Msi
        } else {
            Signals::Msix
        };
        if let Err(e) = ports.add_listener(&rec.nqn, d, interrupts) {
            // Not retried: reported by nvmf_get_subsystems until it is re-added.
            warn!(nqn = %rec.nqn, dir = %d.display(), "vfio-user listener not restored: {e}");
            inner
                .live
                .vfio_user_listeners_failed
                .insert((rec.nqn.clone(), d.clone()), e.to_string());
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
    for l in &rec.tls_listeners {
        if let Err(e) = t.add_tls_listener(&rec.nqn, *l) {
            warn!(nqn = %rec.nqn, listener = %l, error = %e, "nvmf TLS listener not restored; retrying");
            inner
                .live
                .listeners_failed
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
pub(super) fn replay(inner: &mut Inner) {
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

/// Each subsystem with the state of its configured listeners (those that failed at replay
/// are being retried, [`super::listener_retry`]).
fn with_listener_states(inner: &Inner, subs: Vec<NvmfSubsystemInfo>) -> Vec<NvmfSubsystemStatus> {
    subs.into_iter()
        .map(|info| {
            let state = |address: String, reason: Option<String>| NvmfListenerState {
                address,
                state: if reason.is_some() {
                    "failed"
                } else {
                    "listening"
                }
                .into(),
                reason,
                interrupts: None,
            };
            let mut listener_states = Vec::new();
            if let Some(r) = inner.state.nvmf.subsystems.get(&info.nqn) {
                let key = |l: &SocketAddr| (info.nqn.clone(), *l);
                listener_states.extend(r.listeners.iter().map(|l| {
                    let reason = inner.live.listeners_failed.get(&key(l));
                    state(l.to_string(), reason.map(|r| format!("{r}; retrying")))
                }));
                listener_states.extend(r.tls_listeners.iter().map(|l| {
                    let reason = inner.live.listeners_failed.get(&key(l));
                    state(format!("tls:{l}"), reason.map(|r| format!("{r}; retrying")))
                }));
                listener_states.extend(r.vfio_user_listeners.iter().map(|d| {
                    let reason = inner
                        .live
                        .vfio_user_listeners_failed
                        .get(&(info.nqn.clone(), d.clone()));
                    let interrupts = if r.vfio_user_msi.contains(d) {
                        INTERRUPTS_MSI
                    } else {
                        INTERRUPTS_MSIX
                    };
                    NvmfListenerState {
                        interrupts: Some(interrupts.into()),
                        ..state(format!("vfio-user:{}", d.display()), reason.cloned())
                    }
                }));
                listener_states.extend(r.rdma_listeners.iter().map(|l| {
                    let reason = inner.live.rdma_listeners_failed.get(&key(l));
                    state(
                        format!("rdma:{l}"),
                        reason.map(|r| format!("{r}; retrying")),
                    )
                }));
            }
            NvmfSubsystemStatus {
                info,
                listener_states,
            }
        })
        .collect()
}
