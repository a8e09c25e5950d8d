//! NVM subsystems and namespaces (NVMe Base 2.0 §2.4, §3.2), and the discovery subsystem
//! with its log page (NVMe-oF 1.1 §5). A host may have DH-HMAC-CHAP secrets
//! ([`HostKeys`]): its queues then authenticate before they carry commands (NVMe Base 2.0
//! §8.13, [`crate::auth::queue`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use nacre_shared::api::nvmf::{NvmfNamespaceInfo, NvmfSubsystemInfo};
use nacre_shared::nvme::discovery::{self, DiscoveryEntry};
use nacre_shared::nvme::DISCOVERY_NQN;

use nacre_shared::nvme::auth::{DhGroupId, HashId};

use super::ctrl::TargetController;
use super::{limits, lock, NvmfError, TargetInner, DEFAULT_MODEL};
use crate::auth::queue::QueueAuth;
use crate::auth::{CtrlAuthConfig, Secret};
use crate::volume::BlockDevice;

/// A namespace: a volume exported under an NSID.
pub struct Namespace {
    pub nsid: u32,
    pub name: String,
    pub volume: Arc<dyn BlockDevice>,
    /// Reported as NGUID and UUID: the same namespace seen through several paths or
    /// controllers must carry the same identifiers.
    pub nguid: [u8; 16],
    /// Logical block size (the LBA format), fixed for the namespace's life.
    pub block_size: u32,
    /// The data path to `volume` (and its statistics): [`VolumePath`].
    pub path: crate::volume::qos::VolumePath,
}

impl Namespace {
    pub fn blocks(&self) -> u64 {
        self.volume.geometry().size / self.block_size as u64
    }
}

/// A host's DH-HMAC-CHAP secrets (NVMe Base 2.0 §8.13.5): the host's own, which it proves
/// it holds, and optionally the controller's, with which the controller answers a host that
/// asks it to authenticate too (bidirectional authentication).
#[derive(Debug, Clone)]
pub struct HostKeys {
    pub key: Secret,
    pub ctrl_key: Option<Secret>,
    /// The hashes and DH groups this host may use, in the target's order of preference
    /// (normally [`AUTH_HASHES`] and [`AUTH_DHGROUPS`], or a part of them).
    pub hashes: Vec<HashId>,
    pub dhgroups: Vec<DhGroupId>,
}

/// Hashes the target accepts, in its order of preference (the strongest the host offers).
pub const AUTH_HASHES: [HashId; 3] = [HashId::Sha512, HashId::Sha384, HashId::Sha256];
/// DH groups the target accepts, in its order of preference: a Diffie-Hellman exchange
/// whenever the host offers one (the smallest group first: each queue's transaction pays
/// for the modular exponentiation), the null group last.
pub const AUTH_DHGROUPS: [DhGroupId; 6] = [
    DhGroupId::Ffdhe2048,
    DhGroupId::Ffdhe3072,
    DhGroupId::Ffdhe4096,
    DhGroupId::Ffdhe6144,
    DhGroupId::Ffdhe8192,
    DhGroupId::Null,
];

pub(crate) struct SubState {
    pub(crate) allow_any_host: bool,
    pub(crate) hosts: BTreeSet<String>,
    /// Secrets of the hosts that must authenticate.
    pub(crate) host_keys: BTreeMap<String, HostKeys>,
    pub(crate) listeners: BTreeSet<SocketAddr>,
    /// NVMe/RDMA listeners (RDMA CM port space: the same address may also be a TCP one).
    pub(crate) rdma_listeners: BTreeSet<SocketAddr>,
}

/// An NVM subsystem (or the discovery subsystem).
pub struct Subsystem {
    nqn: String,
    pub(crate) discovery: bool,
    pub(crate) serial: String,
    pub(crate) model: String,
    pub(crate) state: Mutex<SubState>,
    namespaces: RwLock<BTreeMap<u32, Arc<Namespace>>>,
    /// Bumped on every namespace change, so queues refresh their cached namespace table.
    pub(crate) ns_gen: AtomicU64,
    controllers: Mutex<BTreeMap<u16, Arc<TargetController>>>,
}

impl Subsystem {
    pub(crate) fn new(nqn: &str, serial: &str, model: &str, allow_any_host: bool) -> Arc<Self> {
        Arc::new(Subsystem {
            nqn: nqn.to_string(),
            discovery: false,
            serial: serial.to_string(),
            model: if model.is_empty() {
                DEFAULT_MODEL.to_string()
            } else {
                model.to_string()
            },
            state: Mutex::new(SubState {
                allow_any_host,
                hosts: BTreeSet::new(),
                host_keys: BTreeMap::new(),
                listeners: BTreeSet::new(),
                rdma_listeners: BTreeSet::new(),
            }),
            namespaces: RwLock::new(BTreeMap::new()),
            ns_gen: AtomicU64::new(1),
            controllers: Mutex::new(BTreeMap::new()),
        })
    }

    pub(crate) fn new_discovery() -> Arc<Self> {
        let mut s = Subsystem::new(DISCOVERY_NQN, "", DEFAULT_MODEL, true);
        Arc::get_mut(&mut s).expect("fresh Arc").discovery = true;
        s
    }

    pub fn nqn(&self) -> &str {
        &self.nqn
    }

    pub(crate) fn host_allowed(&self, hostnqn: &str) -> bool {
        let st = lock(&self.state);
        st.allow_any_host || st.hosts.contains(hostnqn)
    }

    /// The authentication state a new queue of `hostnqn` starts in: required when the host
    /// has a secret here.
    pub(crate) fn queue_auth(&self, hostnqn: &str) -> QueueAuth {
        let keys = lock(&self.state).host_keys.get(hostnqn).cloned();
        match keys {
            None => QueueAuth::not_required(),
            Some(k) => QueueAuth::required(CtrlAuthConfig {
                hostnqn: hostnqn.to_string(),
                subnqn: self.nqn.clone(),
                host_secret: k.key,
                ctrl_secret: k.ctrl_key,
                hashes: k.hashes,
                dhgroups: k.dhgroups,
            }),
        }
    }

    pub(crate) fn reachable_on(&self, listener: &SocketAddr) -> bool {
        self.discovery || lock(&self.state).listeners.contains(listener)
    }

    /// Whether a host that reached the RDMA listener `listener` may connect here.
    pub(crate) fn reachable_on_rdma(&self, listener: &SocketAddr) -> bool {
        self.discovery || lock(&self.state).rdma_listeners.contains(listener)
    }

    pub(crate) fn namespace_table(&self) -> BTreeMap<u32, Arc<Namespace>> {
        self.namespaces
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Bring a connection's copy of the namespace table (`table`, taken at generation
    /// `gen`) up to date: one atomic load per command while nothing changed, a copy of the
    /// table after a namespace was added or removed. Both targets (TCP and RDMA) keep one.
    pub(crate) fn refresh_namespace_table(
        &self,
        gen: &mut u64,
        table: &mut BTreeMap<u32, Arc<Namespace>>,
    ) {
        let g = self.ns_gen.load(Ordering::Acquire);
        if g != *gen {
            *table = self.namespace_table();
            *gen = g;
        }
    }

    pub(crate) fn namespace(&self, nsid: u32) -> Option<Arc<Namespace>> {
        self.namespaces
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&nsid)
            .cloned()
    }

    pub(crate) fn add_namespace(
        &self,
        nsid: Option<u32>,
        volume: Arc<dyn BlockDevice>,
        nguid: [u8; 16],
        name: String,
    ) -> Result<u32, NvmfError> {
        let id = {
            let mut ns = self.namespaces.write().unwrap_or_else(|p| p.into_inner());
            let id = match nsid {
                Some(id) if id == 0 || id > limits::MAX_NSID => {
                    return Err(NvmfError::InvalidNsid(id))
                }
                Some(id) if ns.contains_key(&id) => {
                    return Err(NvmfError::NsidInUse {
                        nqn: self.nqn.clone(),
                        nsid: id,
                    })
                }
                Some(id) => id,
                None => (1..=limits::MAX_NSID)
                    .find(|id| !ns.contains_key(id))
                    .ok_or_else(|| NvmfError::NamespacesFull(self.nqn.clone()))?,
            };
            let block_size = volume.geometry().block_size;
            ns.insert(
                id,
                Arc::new(Namespace {
                    nsid: id,
                    name,
                    path: crate::volume::qos::VolumePath::new(volume.clone()),
                    volume,
                    nguid,
                    block_size,
                }),
            );
            id
        };
        self.ns_gen.fetch_add(1, Ordering::Release);
        self.notify_ns_changed(id);
        Ok(id)
    }

    pub(crate) fn remove_namespace(&self, nsid: u32) -> Result<(), NvmfError> {
        let removed = self
            .namespaces
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&nsid);
        if removed.is_none() {
            return Err(NvmfError::NoSuchNamespace {
                nqn: self.nqn.clone(),
                nsid,
            });
        }
        self.ns_gen.fetch_add(1, Ordering::Release);
        self.notify_ns_changed(nsid);
        Ok(())
    }

    fn notify_ns_changed(&self, nsid: u32) {
        for c in self.controllers() {
            c.namespace_changed(nsid);
        }
    }

    pub(crate) fn controllers(&self) -> Vec<Arc<TargetController>> {
        lock(&self.controllers).values().cloned().collect()
    }

    pub(crate) fn controller(&self, cntlid: u16) -> Option<Arc<TargetController>> {
        lock(&self.controllers).get(&cntlid).cloned()
    }

    pub(crate) fn insert_controller(&self, c: Arc<TargetController>) {
        lock(&self.controllers).insert(c.cntlid, c);
    }

    pub(crate) fn remove_controller(&self, cntlid: u16) {
        lock(&self.controllers).remove(&cntlid);
    }

    /// Close every controller's queues (subsystem deletion, target shutdown).
    pub(crate) fn teardown_all(&self) {
        let cs: Vec<Arc<TargetController>> = std::mem::take(&mut *lock(&self.controllers))
            .into_values()
            .collect();
        for c in cs {
            c.teardown();
        }
    }

    pub(crate) fn info(&self) -> NvmfSubsystemInfo {
        let st = lock(&self.state);
        NvmfSubsystemInfo {
            nqn: self.nqn.clone(),
            subtype: if self.discovery { "discovery" } else { "nvme" }.into(),
            serial: self.serial.clone(),
            model: self.model.clone(),
            allow_any_host: st.allow_any_host,
            hosts: st.hosts.iter().cloned().collect(),
            dhchap: st
                .host_keys
                .iter()
                .map(|(h, k)| {
                    let how = if k.ctrl_key.is_some() {
                        "bidirectional"
                    } else {
                        "unidirectional"
                    };
                    (h.clone(), how.to_string())
                })
                .collect(),
            listeners: st
                .listeners
                .iter()
                .map(|a| a.to_string())
                .chain(st.rdma_listeners.iter().map(|a| format!("rdma:{a}")))
                .collect(),
            namespaces: self
                .namespace_table()
                .values()
                .map(|n| {
                    let g = n.volume.geometry();
                    NvmfNamespaceInfo {
                        nsid: n.nsid,
                        name: n.name.clone(),
                        nguid: n.nguid.iter().map(|b| format!("{b:02x}")).collect(),
                        size: g.size,
                        block_size: n.block_size,
                    }
                })
                .collect(),
            controllers: lock(&self.controllers).len() as u32,
        }
    }
}

/// The discovery log page for `hostnqn` (NVMe-oF 1.1 §5.3): one entry per (subsystem the
/// host may connect to, listener of that subsystem). A listener bound to the unspecified
/// address is reported with the address the host reached us on.
pub(crate) fn discovery_log(t: &TargetInner, hostnqn: &str, local: IpAddr) -> Vec<u8> {
    let mut entries = Vec::new();
    for s in t.all_subsystems() {
        if !s.host_allowed(hostnqn) {
            continue;
        }
        let listeners: Vec<(u8, SocketAddr)> = {
            let st = lock(&s.state);
            let tcp = st.listeners.iter().map(|a| (discovery::TRTYPE_TCP, *a));
            let rdma = st
                .rdma_listeners
                .iter()
                .map(|a| (discovery::TRTYPE_RDMA, *a));
            tcp.chain(rdma).collect()
        };
        for (trtype, l) in listeners {
            let ip = if l.ip().is_unspecified() {
                local
            } else {
                l.ip()
            };
            entries.push(DiscoveryEntry {
                trtype,
                adrfam: if ip.is_ipv4() {
                    discovery::ADRFAM_IPV4
                } else {
                    discovery::ADRFAM_IPV6
                },
                subtype: discovery::SUBTYPE_NVME,
                treq: discovery::TREQ_SECURE_CHANNEL_NOT_REQUIRED,
                // RDMA ports are numbered apart from TCP ones (their port space is apart).
                portid: if trtype == discovery::TRTYPE_RDMA {
                    0x8000 | l.port() & 0x7FFF
                } else {
                    t.portid(&l)
                },
                cntlid: nacre_shared::nvme::fabrics::CNTLID_DYNAMIC,
                asqsz: 32,
                trsvcid: l.port().to_string(),
                subnqn: s.nqn().to_string(),
                traddr: ip.to_string(),
                sectype: 0,
            });
        }
    }
    discovery::encode_log(t.genctr.load(Ordering::Relaxed), &entries)
}
