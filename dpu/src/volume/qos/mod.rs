//! QoS: token-bucket rate limits per volume, per tenant and daemon-wide, as a [`BlockDevice`]
//! layer on top of every opened volume, so each frontend that serves a volume (vhost-user-blk,
//! NVMe/TCP, anything later) is limited the same way.
//!
//! Each limit is a token bucket (RFC 2697's single-rate bucket without colours): `rate` tokens
//! per second flow in up to `depth` = rate × burst; an I/O takes 1 token from each IOPS bucket
//! and `len` tokens from each bytes bucket it counts against. A request is admitted when every
//! bucket it needs holds at least `min(cost, depth)` tokens, and then takes its full cost, so a
//! request larger than a bucket passes (the bucket goes into debt) and the long-run rate is
//! still exact. There is no floor (SPDK's bdev QoS refuses less than 1000 IOPS): 1 IOPS works.
//!
//! A request that cannot be admitted is queued, never blocked on: the frontend's thread goes
//! on, and a pacer thread admits queued requests as tokens arrive (completions then come
//! from the pacer thread, as they do from any asynchronous device). Volumes keep FIFO order.
//! Under contention for the daemon-wide bucket, tenants share it by weight: the pacer admits
//! the head whose tenant has the least virtual time, and each admission advances the tenant's
//! virtual time by 1/weight (start-time fair queueing over operations).
//!
//! Limits change online: [`Qos::set`] rebuilds the buckets in place (tokens clamped to the new
//! depth) and wakes the pacer, so the new rate applies from the next admission.
//!
//! Everything limiter-related sits under one mutex that is taken only by requests some limit
//! applies to; a volume with no limit on it, its tenant or the daemon checks one atomic flag.

mod bucket;
mod credit;
mod sched;
mod volume;

#[cfg(test)]
mod tests;

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use nacre_shared::api::qos::{QosLimits, DEFAULT_WEIGHT};
use tracing::trace;

use super::{BlockDevice, IoCompletion, IoRequest};
use crate::telemetry::{self, Telemetry, VolumeMetrics};
use bucket::{bytes_of, Buckets, Dir};
use credit::Credit;
use sched::{admit_queued, pacer, refresh_flags, Admitted, Pending, SchedState, VolSched};
use volume::Local;

pub use bucket::{Clock, MonotonicClock, TokenBucket};
pub use volume::{QosVolume, VolumePath};

/// Where tenants and volumes get their limits, and the pacer that admits queued requests.
pub struct Qos {
    clock: Arc<dyn Clock>,
    state: Mutex<SchedState>,
    wake: Condvar,
    next_id: AtomicU64,
    /// Bumped by every limit change: threads' [`Credit`] from before it is void.
    generation: AtomicU64,
    telemetry: Arc<Telemetry>,
}

impl Qos {
    /// A limiter on the monotonic clock with its pacer thread.
    pub fn start(telemetry: Arc<Telemetry>) -> Arc<Qos> {
        let q = Self::manual(Arc::new(MonotonicClock), telemetry);
        let weak = Arc::downgrade(&q);
        std::thread::Builder::new()
            .name("qos-pacer".into())
            .spawn(move || pacer(weak))
            .expect("spawn the QoS pacer thread");
        q
    }

    /// A limiter with no pacer thread: the caller runs [`Qos::pump`] (tests, with a fake clock).
    pub fn manual(clock: Arc<dyn Clock>, telemetry: Arc<Telemetry>) -> Arc<Qos> {
        Arc::new(Qos {
            clock,
            state: Mutex::new(SchedState::default()),
            wake: Condvar::new(),
            next_id: AtomicU64::new(1),
            generation: AtomicU64::new(1),
            telemetry,
        })
    }

    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.telemetry
    }

    fn lock(&self) -> MutexGuard<'_, SchedState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Put the QoS and statistics layer over an opened volume.
    pub fn wrap(
        self: &Arc<Self>,
        name: &str,
        tenant: Option<&str>,
        inner: Arc<dyn BlockDevice>,
    ) -> Arc<QosVolume> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let metrics = self.telemetry.volume(name, tenant);
        let limited = Arc::new(AtomicBool::new(false));
        let now = self.clock.now();
        let mut st = self.lock();
        let mut buckets = Buckets::default();
        if let Some(l) = st.volume_limits.get(name) {
            buckets.configure(&l.clone(), now);
        }
        st.volumes.insert(
            id,
            VolSched {
                name: name.to_string(),
                tenant: tenant.map(str::to_string),
                buckets,
                queue: VecDeque::new(),
                inner: inner.clone(),
                metrics: metrics.clone(),
                limited: limited.clone(),
                vtime: 0.0,
            },
        );
        if let Some(t) = tenant {
            st.tenants.entry(t.to_string()).or_default();
        }
        refresh_flags(&mut st);
        drop(st);
        Arc::new_cyclic(|me| QosVolume {
            me: me.clone(),
            inner,
            id,
            limited,
            qos: self.clone(),
            metrics,
            locals: (0..telemetry::clock::SLOTS)
                .map(|_| Local(UnsafeCell::new(Default::default())))
                .collect(),
        })
    }

    /// Replace the limits of a volume (by name), a tenant, or the daemon (`None`, `None`).
    /// `None` limits (or unlimited ones) remove the limit. Takes effect at once.
    pub fn set(&self, volume: Option<&str>, tenant: Option<&str>, limits: Option<&QosLimits>) {
        let now = self.clock.now();
        let mut st = self.lock();
        let empty = QosLimits::default();
        let l = limits.unwrap_or(&empty);
        match (volume, tenant) {
            (Some(v), _) => {
                if limits.is_some() {
                    st.volume_limits.insert(v.to_string(), l.clone());
                } else {
                    st.volume_limits.remove(v);
                }
                for vs in st.volumes.values_mut().filter(|vs| vs.name == v) {
                    vs.buckets.configure(l, now);
                }
            }
            (None, Some(t)) => {
                let ts = st.tenants.entry(t.to_string()).or_default();
                ts.buckets.configure(l, now);
                ts.weight = l.weight.unwrap_or(DEFAULT_WEIGHT);
            }
            (None, None) => st.global.configure(l, now),
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        refresh_flags(&mut st);
        drop(st);
        self.wake.notify_all();
    }

    /// One pacer pass: admit what the buckets allow now and submit it. Returns how long until
    /// the next queued request could pass (`None`: nothing is queued).
    pub fn pump(&self) -> Option<Duration> {
        let (admitted, next) = {
            let mut st = self.lock();
            let now = self.clock.now();
            admit_queued(&mut st, now)
        };
        for a in admitted {
            a.submit();
        }
        next
    }

    /// Statistics of every open volume layer (one per volume name).
    pub fn stats(&self) -> Vec<nacre_shared::api::qos::VolumeStats> {
        let metrics: Vec<Arc<VolumeMetrics>> = self
            .lock()
            .volumes
            .values()
            .map(|v| v.metrics.clone())
            .collect();
        let mut seen = std::collections::HashSet::new();
        metrics
            .iter()
            .map(|m| m.snapshot())
            .filter(|s| seen.insert(s.volume.clone()))
            .collect()
    }

    /// Requests waiting for tokens, over all volumes.
    pub fn queued(&self) -> usize {
        self.lock().queued
    }

    /// The limiter's slow path, under its lock: admit now (returned, for the caller to submit
    /// outside the lock) or queue for the pacer. `credit` is the calling thread's credit for
    /// this volume: what is left of it goes back to the buckets first, and when nothing waits
    /// anywhere it is refilled so the next requests skip this path.
    fn admit(
        &self,
        id: u64,
        req: IoRequest,
        done: Arc<dyn IoCompletion>,
        arrived: u64,
        credit: Option<&mut Credit>,
    ) -> Option<Admitted> {
        let dir = Dir::of(req.kind);
        let bytes = bytes_of(dir, &req);
        let now = self.clock.at_ns(arrived);
        let mut guard = self.lock();
        let st = &mut *guard;
        let Some(vs) = st.volumes.get_mut(&id) else {
            // Unreachable while the QosVolume lives (it unregisters on drop).
            return None;
        };
        let mut tenant = vs.tenant.as_ref().and_then(|t| st.tenants.get_mut(t));
        let mut credit = credit;
        if let Some(c) = credit.as_deref_mut() {
            if c.generation == self.generation.load(Ordering::Acquire) {
                c.fold();
                vs.buckets.give_back(&mut c.tokens[0]);
                if let Some(ts) = tenant.as_mut() {
                    ts.buckets.give_back(&mut c.tokens[1]);
                }
                st.global.give_back(&mut c.tokens[2]);
            }
            // Credit from before a limit change is dropped, not returned: the buckets were
            // rebuilt (at most CREDIT_GRANT of the old rate is lost).
            c.clear();
        }
        // FIFO per volume; and while anything waits, new requests that need the daemon-wide
        // bucket queue too, so the pacer's weighted order decides under contention.
        let global_contended = st.global.active() && st.queued > 0;
        if vs.queue.is_empty() && !global_contended {
            let mut w = vs.buckets.wait(dir, bytes, now);
            if let Some(ts) = tenant.as_mut() {
                w = w.max(ts.buckets.wait(dir, bytes, now));
            }
            w = w.max(st.global.wait(dir, bytes, now));
            if w.is_zero() {
                vs.buckets.take(dir, bytes);
                if let Some(ts) = tenant.as_mut() {
                    ts.buckets.take(dir, bytes);
                    ts.vtime = ts.vtime.max(st.vclock) + 1.0 / ts.weight as f64;
                } else {
                    vs.vtime = vs.vtime.max(st.vclock) + 1.0 / DEFAULT_WEIGHT as f64;
                }
                st.global.take(dir, bytes);
                if let Some(c) = credit {
                    if st.queued == 0 {
                        c.generation = self.generation.load(Ordering::Acquire);
                        vs.buckets.grant(&mut c.tokens[0]);
                        match tenant {
                            Some(ts) => ts.buckets.grant(&mut c.tokens[1]),
                            None => c.tokens[1] = [f64::INFINITY; 6],
                        }
                        st.global.grant(&mut c.tokens[2]);
                        c.plan();
                    }
                }
                return Some(Admitted {
                    inner: vs.inner.clone(),
                    req,
                    done,
                });
            }
        }
        vs.metrics.throttled_enter();
        trace!(volume = %vs.name, tag = req.tag, "qos: request queued for tokens");
        vs.queue.push_back(Pending {
            req,
            done,
            dir,
            bytes,
        });
        st.queued += 1;
        drop(guard);
        self.wake.notify_one();
        None
    }

    fn unregister(&self, id: u64) {
        let mut st = self.lock();
        let leftover = st.volumes.remove(&id).map(|mut vs| {
            st.queued -= vs.queue.len();
            std::mem::take(&mut vs.queue)
                .into_iter()
                .map(move |p| {
                    vs.metrics.throttled_leave();
                    Admitted {
                        inner: vs.inner.clone(),
                        req: p.req,
                        done: p.done,
                    }
                })
                .collect::<Vec<_>>()
        });
        drop(st);
        // Nobody holds the volume any more, but requests still queued are owed a completion.
        for a in leftover.into_iter().flatten() {
            a.submit();
        }
    }
}

impl Drop for Qos {
    fn drop(&mut self) {
        self.lock().shutdown = true;
        self.wake.notify_all();
    }
}
