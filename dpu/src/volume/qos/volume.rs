//! The layer over one volume, [`QosVolume`]: its statistics and its limiter paths (per-thread
//! credit first, the limiter's lock when that runs short); and [`VolumePath`], how frontends
//! submit through it.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use super::bucket::{bytes_of, Dir};
use super::credit::Credit;
use super::Qos;
use crate::telemetry::{self, VolumeMetrics};
use crate::volume::{BlockDevice, Geometry, IoCompletion, IoRequest, IoResult};

/// The layer over one volume: its statistics, for the frontends to record requests in
/// ([`BlockDevice::metrics`]), and its limits, when any apply.
///
/// The statistics are the frontends' to record because they already keep a slot per request
/// and see its completion: a wrapper around every completion here cost a quarter of a null
/// request's whole path. Per request this layer costs, on the submitting thread, one atomic
/// flag load when no limit applies; when one does, tokens from this thread's [`Credit`],
/// with the limiter's lock taken once per credit grant.
pub struct QosVolume {
    /// Handed to frontends as their [`VolumePath`].
    pub(super) me: Weak<QosVolume>,
    pub(super) inner: Arc<dyn BlockDevice>,
    pub(super) id: u64,
    pub(super) limited: Arc<AtomicBool>,
    pub(super) qos: Arc<Qos>,
    pub(super) metrics: Arc<VolumeMetrics>,
    /// Per thread slot ([`telemetry::clock::slot`]); the shared overflow slot has none and
    /// takes the limiter's lock per request.
    pub(super) locals: Box<[Local]>,
}

/// What one thread slot keeps for one volume, used only by the thread that owns the slot.
#[repr(align(128))]
pub(super) struct Local(pub(super) UnsafeCell<Credit>);

// SAFETY: a `Local` is only touched by the thread that owns its slot (`telemetry::clock::slot`
// hands each live thread a distinct one; a slot passes to a new thread only through a mutex
// after its owner exited), and every access is a short borrow that ends before any call into
// another layer, so even a re-entrant submit on the same thread never sees two borrows.
unsafe impl Sync for Local {}

impl QosVolume {
    /// This thread's credit, if it owns an exclusive slot.
    ///
    /// # Safety
    /// The caller must own `slot` (it came from [`telemetry::clock::slot`] on this thread) and
    /// must end the borrow before calling out of this module.
    #[allow(clippy::mut_from_ref)]
    unsafe fn credit(&self, slot: usize) -> Option<&mut Credit> {
        // SAFETY: per the caller's promise, no other borrow of this slot's state exists.
        self.locals.get(slot).map(|l| unsafe { &mut *l.0.get() })
    }

    /// The limiter's fast path: whether this thread's credit covers the request (and then it
    /// is taken). It looks at the request through a reference: deciding before the request
    /// moves keeps the limited path from copying it once more than the unlimited one does.
    #[inline(always)]
    fn admit_from_credit(&self, req: &IoRequest) -> bool {
        let slot = telemetry::clock::slot();
        let generation = self.qos.generation.load(Ordering::Acquire);
        let dir = Dir::of(req.kind);
        let bytes = bytes_of(dir, req);
        // SAFETY: `slot` is this thread's; the borrow ends before this function returns.
        unsafe { self.credit(slot) }
            .is_some_and(|c| c.generation == generation && c.try_take(dir, bytes))
    }

    /// The limiter's locked path: no credit (first request, credit spent, limits changed).
    #[cold]
    #[inline(never)]
    fn submit_locked(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let slot = telemetry::clock::slot();
        let at = telemetry::clock::now_ns();
        // SAFETY: `slot` is this thread's; `admit` only takes the limiter's lock and returns.
        let credit = unsafe { self.credit(slot) };
        if let Some(a) = self.qos.admit(self.id, req, done.clone(), at, credit) {
            a.submit();
        }
    }
}

impl QosVolume {
    /// [`BlockDevice::submit`], as a concrete call a frontend's [`VolumePath`] inlines: the
    /// device below gets the request with no dynamic call or move of the request in between.
    #[inline(always)]
    pub fn submit_here(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        if self.limited.load(Ordering::Acquire) && !self.admit_from_credit(&req) {
            self.submit_locked(req, done);
        } else {
            self.inner.submit(req, done);
        }
    }
}

/// How a frontend submits to the volume it serves: when the volume has the QoS layer over
/// it (it always does unless `nacred --no-qos`), through the layer's inlined
/// [`QosVolume::submit_here`] (a flag load; with a limit, this thread's credit) straight to
/// the device below, rather than through one more dynamic call. Each submission runs in the
/// `volume` span of request tracing ([`telemetry::trace`]).
pub struct VolumePath {
    dev: Arc<dyn BlockDevice>,
    layer: Option<Arc<QosVolume>>,
}

impl VolumePath {
    pub fn new(dev: Arc<dyn BlockDevice>) -> Self {
        VolumePath {
            layer: dev.qos_layer(),
            dev,
        }
    }

    /// The volume's statistics, for the frontend to record its requests in
    /// ([`VolumeMetrics::arrive`] and [`VolumeMetrics::complete`]).
    pub fn metrics(&self) -> Option<&Arc<VolumeMetrics>> {
        self.layer.as_ref().map(|l| &l.metrics)
    }

    #[inline]
    pub fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let _span = tracing::trace_span!(target: telemetry::trace::TARGET, "volume",
            volume = self.metrics().map(|m| m.volume()), op = ?req.kind, offset = req.offset,
            len = req.len)
        .entered();
        match &self.layer {
            Some(l) => l.submit_here(req, done),
            None => self.dev.submit(req, done),
        }
    }
}

impl Drop for QosVolume {
    fn drop(&mut self) {
        self.qos.unregister(self.id);
    }
}

// SAFETY: a request waits in the scheduler, segments and all, and then goes to the inner
// device unchanged; the completion reported is the inner device's (wrapped for the
// statistics).
unsafe impl BlockDevice for QosVolume {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        self.submit_here(req, done);
    }

    fn qos_layer(&self) -> Option<Arc<QosVolume>> {
        self.me.upgrade()
    }

    fn resize(&self, new_size: u64) -> IoResult {
        self.inner.resize(new_size)
    }
}
