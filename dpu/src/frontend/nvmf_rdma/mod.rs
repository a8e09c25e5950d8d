//! NVMe-oF target over RDMA (NVMe RDMA Transport Specification 1.0; RoCEv2 in practice),
//! beside the NVMe/TCP target and sharing its subsystems, controllers and discovery
//! service (`frontend::nvme`, the target core: a controller does not care which transport
//! carries its queues).
//!
//! ```text
//!  RdmaPorts ── listeners: one RDMA CM listening id per address, each with a thread that
//!               takes connect requests: the private data (`rdma::cm`) is checked, bad requests get
//!               an RDMA_CM_REJECT with its status, good ones a queue thread
//!  queue thread per RDMA connection = one NVMe queue (queue.rs): its own CM event channel,
//!               protection domain, completion queue and reliable-connected queue pair
//! ```
//!
//! * `queue` — capsules (§3.2): a pre-posted RECV ring takes command capsules (SQE plus
//!   in-capsule data), responses go out as SEND, keyed SGL data blocks are served with
//!   RDMA READ (host to controller) and RDMA WRITE (controller to host).
//!
//! The verbs objects and the CM private data (§3.1, Figures 5-7) come from [`crate::rdma`],
//! the layer this target shares with nacred's NVMe/RDMA initiator (`fabric::rdma`).
//!
//! Where the machine has no RDMA device (or no rdma_cm), adding an RDMA listener fails with
//! one error saying so; nothing else changes and TCP keeps working.
//!
//! What a peer can make the target hold: a queue pins HSQSIZE + 1 MDTS buffers
//! ([`MAX_IO_QUEUE_ENTRIES`] bounds it) and a thread until it is connected, which must
//! happen within the target's setup timeout; connected queues count against the per-host
//! queue cap ([`crate::frontend::nvme::ConnLimits::per_host`]) and keep-alive, and a
//! listener's queues count against the same per-listener caps as a TCP listener's
//! connections (`ConnLimits::per_listener`: a full listener rejects with "no resources";
//! `ConnLimits::setup_per_listener`: the oldest queue still short of Fabrics Connect is
//! closed). Not yet: a retry of RDMA listeners that could not start (an RDMA device
//! appearing later needs the listener re-added).

mod conn;
mod queue;

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use rdma_sys::*;
use thiserror::Error;
use tracing::{debug, info, warn};

use crate::frontend::nvme::{limits, lock, Evict, ListenerConns, NvmfError, TargetInner};
use crate::frontend::nvmf_tcp::NvmfTarget;
use nacre_shared::nvme::DISCOVERY_NQN;

pub use crate::rdma::device_count;
use crate::rdma::{cm, verbs};

/// Errors of the RDMA listeners' management API.
#[derive(Debug, Error)]
pub enum RdmaError {
    #[error(transparent)]
    Nvmf(#[from] NvmfError),
    /// No RDMA device, no rdma_cm, or no RDMA device with the address asked for.
    #[error("cannot listen for NVMe/RDMA on {addr}: {reason}")]
    Listen { addr: SocketAddr, reason: String },
    #[error("no NVMe/RDMA listener on {0} for this subsystem")]
    NoSuchListener(SocketAddr),
}

/// Largest I/O queue (HSQSIZE + 1) a host may ask for over RDMA. Every entry pins an MDTS
/// data buffer (128 KiB) for the queue's life, so this bounds what one connection can make
/// nacred pin (32 MiB). Linux asks for at most 128 (NVME_RDMA_MAX_QUEUE_SIZE), SPDK for 128
/// by default.
pub const MAX_IO_QUEUE_ENTRIES: u32 = 256;
/// Largest admin queue over RDMA (Linux and SPDK use 32).
pub const MAX_ADMIN_QUEUE_ENTRIES: u32 = 128;

/// Backlog of connect requests a listening id queues (RDMA CM `rdma_listen`).
const LISTEN_BACKLOG: i32 = 128;
/// How often a listener thread looks at its stop flag while no CM event arrives.
const LISTEN_POLL_MS: i32 = 200;

/// The RDMA listeners of one [`NvmfTarget`]. Listeners are shared by subsystems like the TCP
/// ones; a subsystem is reachable over RDMA on the addresses added here.
pub struct RdmaPorts {
    target: Weak<TargetInner>,
    listeners: Mutex<HashMap<SocketAddr, Listener>>,
}

struct Listener {
    subsystems: BTreeSet<String>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RdmaPorts {
    pub fn new(target: &NvmfTarget) -> Arc<RdmaPorts> {
        Arc::new(RdmaPorts {
            target: Arc::downgrade(target.inner()),
            listeners: Mutex::new(HashMap::new()),
        })
    }

    fn inner(&self) -> Result<Arc<TargetInner>, RdmaError> {
        self.target.upgrade().ok_or_else(|| RdmaError::Listen {
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            reason: "the NVMe-oF target is stopping".into(),
        })
    }

    /// Make subsystem `nqn` reachable over NVMe/RDMA on `addr` (RDMA CM port space; 4420 is
    /// the IANA NVMe-oF port). Port 0 picks a free port; the bound address is returned.
    pub fn add_listener(&self, nqn: &str, addr: SocketAddr) -> Result<SocketAddr, RdmaError> {
        let t = self.inner()?;
        if nqn == DISCOVERY_NQN {
            return Err(NvmfError::Discovery.into());
        }
        let s = t
            .find_subsystem(nqn)
            .ok_or_else(|| NvmfError::NoSuchSubsystem(nqn.into()))?;
        let bound = {
            let mut ls = lock(&self.listeners);
            match ls.get_mut(&addr) {
                Some(l) if addr.port() != 0 => {
                    l.subsystems.insert(nqn.to_string());
                    addr
                }
                _ => {
                    let (bound, l) = start_listener(&t, addr, nqn)?;
                    ls.insert(bound, l);
                    bound
                }
            }
        };
        lock(&s.state).rdma_listeners.insert(bound);
        t.bump_genctr();
        info!(nqn, %bound, "nvmf RDMA listener added");
        Ok(bound)
    }

    pub fn remove_listener(&self, nqn: &str, addr: SocketAddr) -> Result<(), RdmaError> {
        let t = self.inner()?;
        let s = t
            .find_subsystem(nqn)
            .filter(|s| s.nqn() != DISCOVERY_NQN)
            .ok_or_else(|| NvmfError::NoSuchSubsystem(nqn.into()))?;
        if !lock(&s.state).rdma_listeners.remove(&addr) {
            return Err(RdmaError::NoSuchListener(addr));
        }
        t.bump_genctr();
        let stopped = {
            let mut ls = lock(&self.listeners);
            let empty = ls.get_mut(&addr).is_some_and(|l| {
                l.subsystems.remove(nqn);
                l.subsystems.is_empty()
            });
            if empty {
                ls.remove(&addr)
            } else {
                None
            }
        };
        if let Some(l) = stopped {
            stop_listener(l);
            info!(%addr, "nvmf RDMA listener stopped");
        }
        Ok(())
    }

    /// Subsystem `nqn` is being deleted: it no longer holds any listener (listeners no other
    /// subsystem holds stop).
    pub fn forget_subsystem(&self, nqn: &str) {
        let stopped: Vec<Listener> = {
            let mut ls = lock(&self.listeners);
            let empty: Vec<SocketAddr> = ls
                .iter_mut()
                .filter_map(|(a, l)| {
                    (l.subsystems.remove(nqn) && l.subsystems.is_empty()).then_some(*a)
                })
                .collect();
            empty.iter().filter_map(|a| ls.remove(a)).collect()
        };
        for l in stopped {
            stop_listener(l);
        }
    }

    /// Addresses listened on.
    pub fn listeners(&self) -> Vec<SocketAddr> {
        lock(&self.listeners).keys().copied().collect()
    }
}

impl Drop for RdmaPorts {
    fn drop(&mut self) {
        let ls: Vec<Listener> = lock(&self.listeners).drain().map(|(_, l)| l).collect();
        for l in ls {
            stop_listener(l);
        }
    }
}

fn stop_listener(mut l: Listener) {
    l.stop.store(true, Ordering::SeqCst);
    if let Some(t) = l.thread.take() {
        let _ = t.join();
    }
}

/// A listening RDMA CM id and the channel its connect requests arrive on (dropped in this
/// order: the id before its channel).
struct ListenId {
    id: *mut rdma_cm_id,
    ch: verbs::EventChannel,
}

// SAFETY: the listening id is used only by the listener thread that owns this value after
// it is moved there; librdmacm ids carry no thread affinity.
unsafe impl Send for ListenId {}

impl Drop for ListenId {
    fn drop(&mut self) {
        // SAFETY: the id was created on `ch` and is destroyed once, before the channel
        // (the `ch` field drops after this body). Events of the listening id were all
        // acknowledged by `EventChannel::get`.
        unsafe {
            rdma_destroy_id(self.id);
        }
    }
}

fn listen_error(addr: SocketAddr, what: &str, e: std::io::Error) -> RdmaError {
    let hint = match e.raw_os_error() {
        Some(libc::ENODEV) | Some(libc::EADDRNOTAVAIL) | Some(libc::ENOENT) => {
            " (no RDMA device has this address: for soft-RoCE, `rdma link add rxe0 type rxe netdev IFACE`)"
        }
        _ => "",
    };
    RdmaError::Listen {
        addr,
        reason: format!("{what}: {e}{hint}"),
    }
}

fn start_listener(
    t: &Arc<TargetInner>,
    addr: SocketAddr,
    nqn: &str,
) -> Result<(SocketAddr, Listener), RdmaError> {
    if verbs::device_count() == 0 {
        return Err(RdmaError::Listen {
            addr,
            reason: "this machine has no RDMA device (load an RDMA driver, or for soft-RoCE \
                     `modprobe rdma_rxe` and `rdma link add rxe0 type rxe netdev IFACE`)"
                .into(),
        });
    }
    let ch = verbs::EventChannel::new()
        .map_err(|e| listen_error(addr, "no RDMA CM event channel (is rdma_ucm loaded?)", e))?;
    let mut id: *mut rdma_cm_id = std::ptr::null_mut();
    // SAFETY: `ch` is a valid channel; on success `id` is a new id we own (ListenId).
    let rc = unsafe {
        rdma_create_id(
            ch.raw(),
            &mut id,
            std::ptr::null_mut(),
            rdma_port_space::RDMA_PS_TCP,
        )
    };
    verbs::check(rc).map_err(|e| listen_error(addr, "rdma_create_id", e))?;
    let l = ListenId { id, ch };
    let mut raw = verbs::RawAddr::new(addr);
    // SAFETY: `l.id` is valid; `raw` is a valid socket address for the call.
    let rc = unsafe { rdma_bind_addr(l.id, raw.as_mut_ptr()) };
    verbs::check(rc).map_err(|e| listen_error(addr, "bind", e))?;
    // SAFETY: as above.
    let rc = unsafe { rdma_listen(l.id, LISTEN_BACKLOG) };
    verbs::check(rc).map_err(|e| listen_error(addr, "listen", e))?;
    // SAFETY: the id is bound; rdma_get_src_port reads its bound address.
    let port = u16::from_be(unsafe { rdma_get_src_port(l.id) });
    let bound = SocketAddr::new(addr.ip(), port);
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let weak = Arc::downgrade(t);
    let thread = std::thread::Builder::new()
        .name(format!("nvmf-rdma-listen-{port}"))
        .spawn(move || listen_loop(l, bound, st, weak, Arc::default()))
        .map_err(|e| listen_error(addr, "thread", e))?;
    Ok((
        bound,
        Listener {
            subsystems: BTreeSet::from([nqn.to_string()]),
            stop,
            thread: Some(thread),
        },
    ))
}

fn listen_loop(
    l: ListenId,
    bound: SocketAddr,
    stop: Arc<AtomicBool>,
    t: Weak<TargetInner>,
    counts: Arc<ListenerConns>,
) {
    debug!(%bound, "nvmf RDMA listener running");
    while !stop.load(Ordering::SeqCst) {
        let ev = match l.ch.get(LISTEN_POLL_MS) {
            Ok(Some(ev)) => ev,
            Ok(None) => continue,
            Err(e) => {
                warn!(%bound, "RDMA CM event channel failed: {e}; listener stops");
                break;
            }
        };
        if ev.kind != rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
            // Events of ids that are not ours any more (a request the host gave up on
            // before its queue thread took it over) need nothing but the acknowledgement.
            debug!(%bound, kind = ev.kind, "RDMA CM event on the listener ignored");
            continue;
        }
        let Some(target) = t.upgrade() else {
            queue::reject(ev.id, cm::reject::NO_RESOURCES);
            break;
        };
        let req = match cm::CmRequest::parse(
            &ev.private_data,
            MAX_ADMIN_QUEUE_ENTRIES,
            MAX_IO_QUEUE_ENTRIES,
            limits::MAX_IO_QUEUES,
        ) {
            Ok(r) => r,
            Err(status) => {
                warn!(%bound, status, "NVMe/RDMA connect request with bad private data: rejected");
                queue::reject(ev.id, status);
                continue;
            }
        };
        // The same per-listener caps as TCP (ConnLimits): a full listener rejects, and a
        // queue still short of Fabrics Connect is the one a newer connection evicts.
        let limits = *lock(&target.limits);
        let queue_stop = Arc::new(AtomicBool::new(false));
        let evict: Evict = {
            let s = queue_stop.clone();
            Box::new(move || {
                // Its thread sees the flag within IDLE_WAKE_MS and disconnects.
                debug!("nvmf RDMA listener at its setup cap: closing the oldest queue still setting up");
                s.store(true, Ordering::SeqCst);
            })
        };
        let id = target.next_conn.fetch_add(1, Ordering::Relaxed);
        let Some(slot) = counts.admit(id, &limits, evict) else {
            debug!(%bound, "nvmf RDMA listener at its connection cap: rejecting a queue");
            queue::reject(ev.id, cm::reject::NO_RESOURCES);
            continue;
        };
        let conn = queue::Incoming {
            slot: Some(slot),
            stop: queue_stop,
            id: ev.id,
            req,
            responder_resources: ev.responder_resources,
            initiator_depth: ev.initiator_depth,
            rnr_retry_count: ev.rnr_retry_count,
            listener: bound,
        };
        let spawned = std::thread::Builder::new()
            .name("nvmf-rdma-queue".into())
            .spawn(move || conn::serve(target, conn));
        if let Err(e) = spawned {
            // The closure (and the id in it) is gone with the failed spawn: the host sees
            // its connect time out.
            warn!("cannot start an NVMe/RDMA queue thread: {e}");
        }
    }
}
