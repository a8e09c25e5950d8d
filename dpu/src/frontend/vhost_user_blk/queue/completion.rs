//! The completion side of a request queue: the [`QueueCompleter`] the volume completes
//! requests through, and the worker's half that writes their status bytes, publishes them in
//! the used ring (§2.7.8) and decides whether to interrupt the driver (§2.7.10).

use std::cell::RefCell;
use std::num::Wrapping;
use std::os::unix::io::RawFd;
use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use tracing::{debug, error};
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::rings::Rings;
use super::QueueWorker;
use crate::frontend::vhost_user_blk::spec::{S_IOERR, S_OK, S_UNSUPP};
use crate::telemetry::{trace, Recorder};
use crate::volume::{IoCompletion, IoError, IoResult};

/// Write the driver's interrupt eventfd.
pub(super) fn signal_fd(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writing 8 bytes from a local u64 to an eventfd the vring owns for this batch.
    let r = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    if r != 8 {
        debug!(error = %std::io::Error::last_os_error(), "virtio-blk: interrupt eventfd write failed");
    }
}

/// Map a volume result to a virtio-blk status (§5.2.6).
pub fn status_of(result: &IoResult) -> u8 {
    match result {
        Ok(()) => S_OK,
        Err(IoError::Unsupported) => S_UNSUPP,
        Err(_) => S_IOERR,
    }
}

pub(super) struct InlineDone {
    /// Address of the completer whose worker runs on this thread.
    pub(super) owner: usize,
    pub(super) done: Vec<(u64, u8)>,
}

thread_local! {
    pub(super) static INLINE: RefCell<InlineDone> = const {
        RefCell::new(InlineDone { owner: 0, done: Vec::new() })
    };
}

/// The [`IoCompletion`] a queue hands to the volume.
pub struct QueueCompleter {
    pub(super) remote: Mutex<Vec<(u64, u8)>>,
    pub(super) pending: AtomicUsize,
    pub(super) event: EventFd,
    /// The worker is running a pass or polling: it looks at `pending` itself before it
    /// sleeps, so a completion needs no eventfd write (a system call on the completing
    /// thread, and an epoll round on the worker's).
    awake: AtomicBool,
}

impl QueueCompleter {
    pub fn new(capacity: usize) -> std::io::Result<Self> {
        Ok(QueueCompleter {
            remote: Mutex::new(Vec::with_capacity(capacity)),
            pending: AtomicUsize::new(0),
            event: EventFd::new(EFD_NONBLOCK)?,
            awake: AtomicBool::new(false),
        })
    }

    /// The worker starts a run: completions from now on skip the eventfd.
    pub fn wake_up(&self) {
        self.awake.store(true, Ordering::SeqCst);
    }

    /// The worker goes back to sleep. A completion that skipped the eventfd because the worker
    /// was awake, and that the worker has not drained, gets its wake-up written here. The two
    /// sides are ordered like Dekker's flags (each stores its own, then loads the other's,
    /// all SeqCst): either the completion sees `awake` false and writes, or this load sees
    /// its count.
    pub fn fall_asleep(&self) {
        self.awake.store(false, Ordering::SeqCst);
        if self.pending.load(Ordering::SeqCst) != 0 {
            self.wake_worker();
        }
    }

    fn wake_worker(&self) {
        if let Err(e) = self.event.write(1) {
            error!(error = %e, "cannot wake the virtio-blk queue worker");
        }
    }

    /// Readable when completions from other threads wait for the worker.
    pub fn event(&self) -> &EventFd {
        &self.event
    }

    pub(super) fn id(&self) -> usize {
        self as *const Self as usize
    }
}

impl IoCompletion for QueueCompleter {
    fn complete(&self, tag: u64, result: IoResult) {
        if let Err(e) = &result {
            debug!(tag, error = %e, "virtio-blk request failed");
        }
        let code = status_of(&result);
        let me = self.id();
        let inline = INLINE.with(|c| {
            let mut c = c.borrow_mut();
            if c.owner == me {
                c.done.push((tag, code));
                true
            } else {
                false
            }
        });
        if inline {
            return;
        }
        tracing::trace!(target: trace::TARGET, head = tag, "vhost: completion queued for the queue worker");
        self.remote
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((tag, code));
        // Wake the worker once per batch, not once per completion: only the completion that
        // finds nothing pending writes the eventfd; later ones ride on that wake-up, as the
        // worker takes the whole list when it drains. No completion is left behind: every
        // entry is pushed before it is counted, and the worker subtracts what it took under
        // the list's lock, so the count (one atomic, one order of updates) only goes from 0
        // to 1 — and writes — after the worker's last drain, whenever something is left for
        // it. (A drain that takes an entry before it was counted leaves the count briefly
        // "below zero"; the late count brings it back to 0 and does not write, correctly.)
        // A worker that is awake finds the count itself (see `fall_asleep`).
        if self.pending.fetch_add(1, Ordering::SeqCst) == 0 && !self.awake.load(Ordering::SeqCst) {
            self.wake_worker();
        }
    }
}

impl QueueWorker {
    pub(super) fn drain_inline(&mut self, rec: Option<&Recorder>) {
        INLINE.with(|c| std::mem::swap(&mut c.borrow_mut().done, &mut self.finished));
        let mut finished = std::mem::take(&mut self.finished);
        for &(tag, code) in &finished {
            self.finish(tag, code, rec);
        }
        finished.clear();
        self.finished = finished;
    }

    /// `rec`: this thread's statistics recorder (`None` without statistics).
    pub(super) fn drain_remote(&mut self, rec: Option<&Recorder>) {
        if self.completer.pending.load(Ordering::Acquire) == 0 {
            return;
        }
        // One clock read for the statistics of everything drained now.
        let _batch = crate::telemetry::clock::batch();
        {
            let mut remote = self
                .completer
                .remote
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            std::mem::swap(&mut *remote, &mut self.finished);
            self.completer
                .pending
                .fetch_sub(self.finished.len(), Ordering::AcqRel);
        }
        let mut finished = std::mem::take(&mut self.finished);
        for &(tag, code) in &finished {
            self.finish(tag, code, rec);
        }
        finished.clear();
        self.finished = finished;
    }

    /// `rec`: the statistics recorder of this thread's batch (`None` without statistics).
    fn finish(&mut self, tag: u64, code: u8, rec: Option<&Recorder>) {
        let Some(slot) = self.slots.get_mut(tag as usize).filter(|s| s.busy) else {
            error!(tag, "virtio-blk: completion for a request not in flight");
            return;
        };
        // SAFETY: the status byte lies in guest memory that is still mapped: either the
        // batch's mapping (inline) or the slot's pinned one (async).
        unsafe { std::ptr::write_volatile(slot.status, code) };
        let used_len = if code == S_OK { slot.data_in + 1 } else { 1 };
        slot.busy = false;
        if let Some(r) = rec {
            r.complete(&slot.arrival, code != S_OK);
        }
        tracing::trace!(target: trace::TARGET,
            dev = %trace::Serial(&self.params.serial), head = tag, status = code,
            latency_us = rec.map(|_| slot.arrival.elapsed_ns() as f64 / 1e3), "vhost: done");
        if slot.pinned.take().is_some() {
            self.in_flight_async -= 1;
        }
        self.used.push((tag as u16, used_len));
    }

    /// Write the batch's used elements, then the used index once (§2.7.8).
    pub(super) fn publish(&mut self, rings: &Rings, queue: &mut Queue) {
        if self.used.is_empty() {
            return;
        }
        let mut idx = queue.next_used();
        for &(head, len) in &self.used {
            rings.set_used_elem(idx, head, len);
            idx = idx.wrapping_add(1);
        }
        rings.set_used_idx(idx);
        queue.set_next_used(idx);
        self.used.clear();
    }

    pub(super) fn needs_interrupt(&self, rings: &Rings, queue: &Queue, old: Wrapping<u16>) -> bool {
        let new = Wrapping(queue.next_used());
        if new == old {
            return false;
        }
        if !queue.event_idx_enabled() {
            return true;
        }
        // The used index store must be globally visible before used_event is read, or the
        // driver may have re-armed with a stale view and both sides wait (§2.7.10.1).
        fence(Ordering::SeqCst);
        let used_event = Wrapping(rings.used_event());
        // vring_need_event(event, new, old): notify if event lies in [old, new).
        (new - used_event - Wrapping(1)) < (new - old)
    }
}
