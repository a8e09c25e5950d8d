//! The memory the controller reaches directly: the protection domain every queue to one
//! RDMA device shares (with `PDS`, the registry of those in use), and the registration of
//! announced memory in it for zero copy (module docs of [`super`], "Zero copy").

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use rdma_sys::*;
use tracing::debug;

use super::RdmaQueue;
use crate::fabric::cmd::Cmd;
use crate::rdma::verbs;
use crate::volume::dma;

/// A protection domain shared by every queue the initiator opens on one RDMA device: memory
/// announced for zero copy is registered once per device (a guest's memory table once, not
/// once per queue), and the domain lives as long as a queue or a registration uses it.
pub(super) struct Pd {
    pub(super) pd: *mut ibv_pd,
    ctx: usize,
    /// Queues open on the domain; the last one to go drops the zero-copy registrations, so
    /// no guest memory stays pinned for a device nacred no longer talks to.
    queues: AtomicUsize,
    /// Regions registered in the domain (each holds its registration as an attachment).
    attached: Mutex<Vec<Weak<dma::Region>>>,
}

// SAFETY: an ibv_pd has no thread affinity; it is deallocated once, when the last reference
// (a queue's or a registration's) goes.
unsafe impl Send for Pd {}
// SAFETY: as above; shared references only pass the pointer to libibverbs calls that are
// thread-safe (registration, queue pair creation).
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: nothing is left on the domain: every queue pair and buffer registered in
        // it belonged to a queue or a registration holding this `Pd`, all gone now. The
        // device context stays open while librdmacm knows the device.
        unsafe { ibv_dealloc_pd(self.pd) };
    }
}

/// The domains in use, by device context.
static PDS: Mutex<Vec<(usize, Weak<Pd>)>> = Mutex::new(Vec::new());

impl Pd {
    /// The domain of device context `ctx` (allocated if no queue holds one), counted as used
    /// by one more queue.
    pub(super) fn for_queue(ctx: *mut ibv_context) -> Result<Arc<Pd>, std::io::Error> {
        let mut pds = PDS.lock().unwrap_or_else(|p| p.into_inner());
        pds.retain(|(_, w)| w.strong_count() > 0);
        let pd = match pds
            .iter()
            .find_map(|(c, w)| (*c == ctx as usize).then(|| w.upgrade()))
        {
            Some(Some(pd)) => pd,
            _ => {
                // SAFETY: `ctx` is the open device context of a resolved CM id.
                let raw = unsafe { ibv_alloc_pd(ctx) };
                if raw.is_null() {
                    return Err(verbs::errno());
                }
                let pd = Arc::new(Pd {
                    pd: raw,
                    ctx: ctx as usize,
                    queues: AtomicUsize::new(0),
                    attached: Mutex::new(Vec::new()),
                });
                pds.push((pd.ctx, Arc::downgrade(&pd)));
                pd
            }
        };
        pd.queues.fetch_add(1, Ordering::AcqRel);
        Ok(pd)
    }

    /// A queue on the domain is gone; the last one drops the zero-copy registrations.
    pub(super) fn queue_gone(&self) {
        // Under the registry's lock, which [`Pd::for_queue`] counts a new queue under: a
        // queue opening on the domain meanwhile would otherwise see its fresh registrations
        // (or ones it just reused) dropped by the departing queue.
        let _pds = PDS.lock().unwrap_or_else(|p| p.into_inner());
        if self.queues.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let key = self.pd as usize;
        let regions: Vec<_> = self
            .attached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for r in regions.iter().filter_map(Weak::upgrade) {
            r.detach(key);
        }
    }
}

/// A region announced in [`dma`], registered in a device's shared protection domain for the
/// controller's RDMA READ and WRITE (a [`dma::Region`] attachment keyed by that domain).
pub(super) struct DirectMr {
    mr: *mut ibv_mr,
    /// Deallocated only after this registration is gone.
    _pd: Arc<Pd>,
}

// SAFETY: an ibv_mr is used by one thread at a time here (its keys are read, it is
// deregistered once, on drop); libibverbs objects carry no thread affinity.
unsafe impl Send for DirectMr {}
// SAFETY: as above; shared references only read the keys.
unsafe impl Sync for DirectMr {}

impl DirectMr {
    pub(super) fn lkey(&self) -> u32 {
        // SAFETY: a registered memory region until this value drops.
        unsafe { (*self.mr).lkey }
    }

    pub(super) fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for DirectMr {
    fn drop(&mut self) {
        // SAFETY: registered by `RdmaQueue::direct`, deregistered once, here; the queue
        // detaches its registrations (so they drop) before it deallocates their domain.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// What a command sent from or into announced memory holds until its response.
pub(super) struct Direct {
    _region: Arc<dma::Region>,
    pub(super) mr: Arc<DirectMr>,
}

impl RdmaQueue {
    /// The address and registration under which the controller may move `cmd`'s data
    /// straight from or into the request's memory: when that data is one contiguous range
    /// inside memory a frontend announced ([`dma`]: a vhost-user-blk driver's memory table, an
    /// encrypted volume's ciphertext buffers). The region is registered in this queue's
    /// domain the first time, and stays registered while both live.
    pub(super) fn direct(&self, cmd: &Cmd) -> Option<(u64, Direct)> {
        let ptr = cmd.contiguous_data()?;
        let region = dma::lookup(ptr, cmd.len)?;
        let shared = self.shared_pd.as_ref()?;
        let pd = shared.pd;
        let mr = region.attachment(pd as usize, || {
            let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ibv_access_flags::IBV_ACCESS_REMOTE_READ
                | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
                .0 as i32;
            // SAFETY: the region is mapped memory its announcer keeps mapped while it is
            // announced, and the registration is dropped (deregistered) with the region or
            // with this queue, whichever goes first.
            let mr = unsafe { ibv_reg_mr(pd, region.base().cast(), region.len(), access) };
            if mr.is_null() {
                debug!(qid = self.qid, len = region.len(), error = %verbs::errno(),
                    "cannot register announced memory: its I/O is copied");
                return None;
            }
            debug!(
                region = region.id(),
                len = region.len(),
                "zero copy: announced memory registered"
            );
            let mut attached = shared.attached.lock().unwrap_or_else(|p| p.into_inner());
            attached.retain(|w| w.strong_count() > 0);
            attached.push(Arc::downgrade(&region));
            Some(DirectMr {
                mr,
                _pd: shared.clone(),
            })
        })?;
        Some((
            ptr as u64,
            Direct {
                _region: region,
                mr,
            },
        ))
    }
}
