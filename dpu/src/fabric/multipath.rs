//! Native multipath: one namespace reached through several controllers (portals).
//!
//! Paths are grouped only if they are provably the same namespace: every path must report
//! identifiers (NGUID, UUID or EUI-64 from Identify Namespace and the Namespace
//! Identification Descriptor list, NVMe Base 2.0 §5.17.2.3) and they must agree, with the
//! same block size and size. Two namespaces that merely share an NSID are refused.
//!
//! * `Failover` (active-passive): I/O goes to the first live path in the configured order.
//! * `RoundRobin` (active-active): I/O rotates over the live paths.
//!
//! Each path is its own controller with its own session, keep-alive and reconnect loop, so a
//! failing path never resets another. Path members are built with
//! [`RemoteNamespace::as_path`]: when their controller loses its session, their outstanding
//! I/O comes back at once with `PathLost` instead of being held, and this layer resends it
//! down another live path (safe for the reasons given in [`super::controller`]: the request
//! was never completed upward). With no live path, requests are parked until a path comes
//! back, and fail once no path is hopeful any more (every controller past its
//! fast_io_fail_timeout, or failed): with `PathLost` while one of them is still reconnecting,
//! with `PathFailed` once all have failed for good.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::controller::{Phase, PhaseListener};
use super::{FabricError, RemoteNamespace};
use crate::volume::{BlockDevice, Geometry, IoCompletion, IoError, IoKind, IoRequest, IoResult};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PathPolicy {
    #[default]
    Failover,
    RoundRobin,
}

struct Parked {
    kind: IoKind,
    offset: u64,
    len: u64,
    segs: crate::volume::Segments,
    tag: u64,
    done: Arc<dyn IoCompletion>,
}

impl Parked {
    /// One attempt at the parked request down one path, over the same memory.
    fn request(&self) -> IoRequest {
        let segments = self
            .segs
            .iter()
            // SAFETY: the same ranges as the parked request's own segments, which stay valid
            // until `done` runs; an attempt completes (PathDone) before the next one is made
            // and before `done` is called, so no two attempts use the memory at once and
            // none outlives the request.
            .map(|s| unsafe { crate::volume::Segment::new(s.as_ptr(), s.len()) })
            .collect();
        IoRequest {
            kind: self.kind,
            offset: self.offset,
            len: self.len,
            segments,
            tag: self.tag,
        }
    }
}

struct Inner {
    paths: Vec<Arc<RemoteNamespace>>,
    policy: PathPolicy,
    rr: AtomicUsize,
    parked: Mutex<VecDeque<Arc<Parked>>>,
    /// Requests resent down another path after a path failed under them.
    retried: AtomicU64,
    me: Weak<Inner>,
}

pub struct MultipathDevice {
    inner: Arc<Inner>,
    geo: Geometry,
}

impl MultipathDevice {
    pub fn new(paths: Vec<Arc<RemoteNamespace>>, policy: PathPolicy) -> Result<Self, FabricError> {
        let first = paths
            .first()
            .ok_or_else(|| {
                FabricError::Invalid("a multipath device needs at least one path".into())
            })?
            .info()
            .clone();
        for p in &paths {
            let i = p.info();
            if !i.has_id() {
                return Err(FabricError::Invalid(format!(
                    "namespace {} on {} reports no NGUID, UUID or EUI-64: cannot prove it is the same namespace as the other paths",
                    i.nsid,
                    p.controller().name
                )));
            }
            if !first.same_namespace(i)
                || i.block_size != first.block_size
                || i.blocks != first.blocks
            {
                return Err(FabricError::Invalid(format!(
                    "namespace {} on {} ({}, {} x {} B) is not the same namespace as {} on {} ({}, {} x {} B): refusing to group them",
                    i.nsid,
                    p.controller().name,
                    i.id_string(),
                    i.blocks,
                    i.block_size,
                    first.nsid,
                    paths[0].controller().name,
                    first.id_string(),
                    first.blocks,
                    first.block_size
                )));
            }
        }
        let geo = paths[0].geometry();
        let inner = Arc::new_cyclic(|me| Inner {
            paths,
            policy,
            rr: AtomicUsize::new(0),
            parked: Mutex::new(VecDeque::new()),
            retried: AtomicU64::new(0),
            me: me.clone(),
        });
        let l: Arc<dyn PhaseListener> = inner.clone();
        for p in &inner.paths {
            p.controller().add_listener(Arc::downgrade(&l));
        }
        Ok(MultipathDevice { inner, geo })
    }

    /// Requests resent down another path so far.
    pub fn retried(&self) -> u64 {
        self.inner.retried.load(Ordering::Relaxed)
    }

    pub fn paths(&self) -> &[Arc<RemoteNamespace>] {
        &self.inner.paths
    }
}

impl Inner {
    fn pick(&self) -> Option<usize> {
        let live: Vec<usize> = (0..self.paths.len())
            .filter(|&i| self.paths[i].controller().is_live())
            .collect();
        if live.is_empty() {
            return None;
        }
        Some(match self.policy {
            PathPolicy::Failover => live[0],
            PathPolicy::RoundRobin => live[self.rr.fetch_add(1, Ordering::Relaxed) % live.len()],
        })
    }

    fn dispatch(self: &Arc<Self>, p: Arc<Parked>) {
        match self.pick() {
            Some(i) => {
                let done: Arc<dyn IoCompletion> = Arc::new(PathDone {
                    mp: Arc::downgrade(self),
                    req: p.clone(),
                });
                self.paths[i].submit(p.request(), &done);
            }
            None => {
                if self.paths.iter().any(|x| x.controller().hopeful()) {
                    self.parked
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push_back(p);
                    // A path may have come up between pick() and parking.
                    if self.paths.iter().any(|x| x.controller().is_live()) {
                        self.kick();
                    }
                } else {
                    // Gone for good only when every path is: a path past its
                    // fast_io_fail_timeout may still reconnect.
                    let reconnecting = self
                        .paths
                        .iter()
                        .any(|x| x.controller().phase() == Phase::Connecting);
                    let e = if reconnecting {
                        IoError::PathLost
                    } else {
                        IoError::PathFailed
                    };
                    p.done.complete(p.tag, Err(e));
                }
            }
        }
    }

    fn kick(self: &Arc<Self>) {
        let parked: Vec<_> = self
            .parked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        for p in parked {
            self.dispatch(p);
        }
    }
}

impl PhaseListener for Inner {
    fn phase_changed(&self) {
        // A path came back, or none is hopeful any more: re-dispatch parked requests.
        if let Some(me) = self.me.upgrade() {
            me.kick();
        }
    }
}

/// Completion of one attempt down one path.
struct PathDone {
    mp: Weak<Inner>,
    req: Arc<Parked>,
}

impl IoCompletion for PathDone {
    fn complete(&self, _tag: u64, result: IoResult) {
        match (result, self.mp.upgrade()) {
            // One path's loss, for now or for good, is a reason to try another.
            (Err(IoError::PathLost | IoError::PathFailed), Some(mp)) => {
                mp.retried.fetch_add(1, Ordering::Relaxed);
                mp.dispatch(self.req.clone());
            }
            (r, _) => self.req.done.complete(self.req.tag, r),
        }
    }
}

// SAFETY: the segments stay in the request's `Parked` entry until it completes it; a
// retry on another path completes (or is cancelled by its path) before that.
unsafe impl BlockDevice for MultipathDevice {
    fn geometry(&self) -> Geometry {
        self.geo
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        if let Err(e) = self.geo.check(&req) {
            done.complete(req.tag, Err(e));
            return;
        }
        self.inner.dispatch(Arc::new(Parked {
            kind: req.kind,
            offset: req.offset,
            len: req.len,
            segs: req.segments,
            tag: req.tag,
            done: done.clone(),
        }));
    }
}
