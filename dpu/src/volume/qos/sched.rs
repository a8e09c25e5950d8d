//! The scheduler: the limiter's state under its lock, the requests queued for tokens, and the
//! pacer that admits them as tokens arrive, least tenant virtual time first.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use nacre_shared::api::qos::{QosLimits, DEFAULT_WEIGHT};

use super::bucket::{Buckets, Dir};
use super::Qos;
use crate::telemetry::VolumeMetrics;
use crate::volume::{BlockDevice, IoCompletion, IoRequest};

/// A request waiting for tokens.
pub(super) struct Pending {
    pub(super) req: IoRequest,
    pub(super) done: Arc<dyn IoCompletion>,
    pub(super) dir: Dir,
    pub(super) bytes: u64,
}

pub(super) struct VolSched {
    pub(super) name: String,
    pub(super) tenant: Option<String>,
    pub(super) buckets: Buckets,
    pub(super) queue: VecDeque<Pending>,
    /// Where admitted requests go.
    pub(super) inner: Arc<dyn BlockDevice>,
    pub(super) metrics: Arc<VolumeMetrics>,
    /// Set while any limit applies to this volume (read lock-free by `submit`).
    pub(super) limited: Arc<AtomicBool>,
    /// Fair-queueing virtual time of a volume without a tenant (weight: the default).
    pub(super) vtime: f64,
}

pub(super) struct TenantSched {
    pub(super) buckets: Buckets,
    pub(super) weight: u32,
    /// Start-time fair queueing: operations admitted / weight, caught up when it goes idle.
    pub(super) vtime: f64,
}

impl Default for TenantSched {
    fn default() -> Self {
        TenantSched {
            buckets: Buckets::default(),
            weight: DEFAULT_WEIGHT,
            vtime: 0.0,
        }
    }
}

#[derive(Default)]
pub(super) struct SchedState {
    pub(super) global: Buckets,
    pub(super) tenants: HashMap<String, TenantSched>,
    pub(super) volume_limits: HashMap<String, QosLimits>,
    pub(super) volumes: HashMap<u64, VolSched>,
    /// Requests queued over all volumes.
    pub(super) queued: usize,
    /// Virtual time of the last admission through the pacer.
    pub(super) vclock: f64,
    pub(super) shutdown: bool,
}

/// A request the limiter let through, to submit outside the lock.
pub(super) struct Admitted {
    pub(super) inner: Arc<dyn BlockDevice>,
    pub(super) req: IoRequest,
    pub(super) done: Arc<dyn IoCompletion>,
}

impl Admitted {
    pub(super) fn submit(self) {
        self.inner.submit(self.req, &self.done);
    }
}

pub(super) fn refresh_flags(st: &mut SchedState) {
    let global = st.global.active();
    for vs in st.volumes.values() {
        let tenant = vs
            .tenant
            .as_ref()
            .and_then(|t| st.tenants.get(t))
            .is_some_and(|t| t.buckets.active());
        vs.limited.store(
            global || tenant || vs.buckets.active() || !vs.queue.is_empty(),
            Ordering::Release,
        );
    }
}

/// Admit queued heads while the buckets allow, least tenant virtual time first.
pub(super) fn admit_queued(
    st: &mut SchedState,
    now: Duration,
) -> (Vec<Admitted>, Option<Duration>) {
    let mut admitted = Vec::new();
    let mut emptied = false;
    loop {
        let mut best: Option<(u64, f64)> = None;
        let mut next: Option<Duration> = None;
        let SchedState {
            global,
            tenants,
            volumes,
            vclock,
            ..
        } = st;
        for (&id, vs) in volumes.iter_mut() {
            let Some(head) = vs.queue.front() else {
                continue;
            };
            let (dir, bytes) = (head.dir, head.bytes);
            let mut w = vs.buckets.wait(dir, bytes, now);
            // A tenant back from idling starts at the current virtual time, not with credit.
            let mut vt = vs.vtime.max(*vclock);
            if let Some(ts) = vs.tenant.as_ref().and_then(|t| tenants.get_mut(t)) {
                w = w.max(ts.buckets.wait(dir, bytes, now));
                vt = ts.vtime.max(*vclock);
            }
            w = w.max(global.wait(dir, bytes, now));
            if w.is_zero() {
                if best.is_none_or(|(_, bv)| vt < bv) {
                    best = Some((id, vt));
                }
            } else {
                next = Some(next.map_or(w, |n: Duration| n.min(w)));
            }
        }
        let Some((id, start_tag)) = best else {
            if emptied {
                // A volume with no limits left goes back to the lock-free path.
                refresh_flags(st);
            }
            return (admitted, if st.queued > 0 { next } else { None });
        };
        let vs = st.volumes.get_mut(&id).expect("chosen above");
        let p = vs.queue.pop_front().expect("non-empty");
        vs.buckets.take(p.dir, p.bytes);
        if let Some(ts) = vs.tenant.as_ref().and_then(|t| st.tenants.get_mut(t)) {
            ts.buckets.take(p.dir, p.bytes);
            ts.vtime = start_tag + 1.0 / ts.weight as f64;
        } else {
            vs.vtime = start_tag + 1.0 / DEFAULT_WEIGHT as f64;
        }
        st.global.take(p.dir, p.bytes);
        st.vclock = start_tag;
        st.queued -= 1;
        vs.metrics.throttled_leave();
        emptied |= vs.queue.is_empty();
        admitted.push(Admitted {
            inner: vs.inner.clone(),
            req: p.req,
            done: p.done,
        });
    }
}

pub(super) fn pacer(q: Weak<Qos>) {
    loop {
        let Some(qos) = q.upgrade() else { return };
        let next = qos.pump();
        let st = qos.lock();
        if st.shutdown {
            return;
        }
        if st.queued > 0 && next.is_none() {
            // Something arrived since the pass: go again.
            continue;
        }
        // Sleep until the next head could pass, or until a request queues or a limit changes.
        let wait = next.unwrap_or(Duration::from_millis(500));
        let _ = qos
            .wake
            .wait_timeout(st, wait)
            .unwrap_or_else(|p| p.into_inner());
    }
}
