//! One request queue: pops descriptor chains, submits them to the volume, and returns them
//! through the used ring (virtio 1.2 §2.7.7–§2.7.10).
//!
//! Each queue runs on its own vring worker thread. Per batch of available chains it:
//! 1. parses and submits each chain (the volume may complete it inline, before `submit`
//!    returns, or later from another thread);
//! 2. writes every finished request's status byte, then all used-ring elements, then the used
//!    index once (one release store per batch);
//! 3. re-arms driver notifications and re-checks the available ring, so a chain made
//!    available in between is never missed (§2.7.10, with or without EVENT_IDX);
//! 4. interrupts the driver at most once, and with VIRTIO_F_EVENT_IDX only if `used_event`
//!    falls inside the range of used entries published since the last check (§2.7.10.1, the
//!    same test as Linux's `vring_need_event`).
//!
//! Completions never touch the ring themselves: an inline completion lands in a thread-local
//! list that the worker drains right after `submit`; a completion from another thread lands in
//! a shared list and wakes the worker through an eventfd, written only while the worker
//! sleeps (an awake worker checks the list before it sleeps). The lists, the descriptor
//! scratch and the per-head slots are sized once per queue, so a request of up to four data
//! segments allocates nothing; a longer chain's segment list ([`crate::volume::Segments`],
//! inline for four) spills to the heap. The clock is read once per batch
//! ([`crate::telemetry::clock::batch`]), not per request.
//!
//! The code is in three files:
//! * this file — the worker: its state, the adaptive poll/sleep loop, request execution;
//! * `rings` — host access to the split virtqueue (descriptor table, available ring, used
//!   ring; §2.7.5–§2.7.8) and the walk from available heads to descriptor chains;
//! * `completion` — the completions coming back: the [`QueueCompleter`] the volume calls,
//!   the used-ring publication and the driver notification (§2.7.8, §2.7.10).

mod completion;
mod rings;

use std::num::Wrapping;
use std::os::unix::io::RawFd;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, error, warn};
use virtio_bindings::bindings::virtio_ring::VRING_USED_F_NO_NOTIFY;
use virtio_queue::{Queue, QueueT};

use super::guest::GuestMap;
use super::request::{self, Action, Desc, DeviceParams, Mem, Outcome};
use super::spec::{self, S_OK};
use crate::telemetry::{trace, Arrival, Recorder, VolumeMetrics};
use crate::volume::qos::VolumePath;
use crate::volume::{BlockDevice, IoCompletion};
use completion::{signal_fd, INLINE};
pub use completion::{status_of, QueueCompleter};
use rings::Rings;

/// Longest busy-poll after a batch (QEMU's default `poll-max-ns` is the same 32 µs).
pub(super) const MAX_POLL_NS: u64 = 32_000;
/// Shortest non-zero poll window.
const MIN_POLL_NS: u64 = 4_000;
/// Requests in flight on other threads (a remote or crypto volume) from which the worker
/// sleeps after a batch instead of polling. The driver of such a queue is after throughput:
/// its next requests mostly follow completions, whose arrival wakes the worker anyway, and
/// the poll would take the core the completing threads (the initiator's receive thread,
/// the NVMe/TCP reactor) need. Measured end to end (`fabric-bench`, 4 KiB QD32 through
/// XTS and NVMe/TCP): +10-15% IOPS per core. The NVMe/TCP target's reactors apply the same
/// rule (`nvmf_tcp::reactor`, `SLEEP_DEPTH`).
pub(super) const SLEEP_IN_FLIGHT: usize = 8;

/// A request handed to the volume and not yet completed.
struct Slot {
    status: *mut u8,
    data_in: u32,
    busy: bool,
    /// Set when the volume did not complete inline: keeps the guest memory mapping the
    /// request's segments point into alive until it completes, even if the driver replaces
    /// the memory table meanwhile.
    pinned: Option<Arc<Mem>>,
    /// For the volume's statistics.
    arrival: Arrival,
}

/// Per-queue state, owned by the queue's worker thread.
pub struct QueueWorker {
    volume: VolumePath,
    params: Arc<DeviceParams>,
    completer: Arc<QueueCompleter>,
    done: Arc<dyn IoCompletion>,
    slots: Vec<Slot>,
    descs: Vec<Desc>,
    used: Vec<(u16, u32)>,
    finished: Vec<(u64, u8)>,
    in_flight_async: usize,
    /// Host view of the current memory table (rebuilt when the driver sends a new one).
    map: Option<GuestMap>,
    /// Adaptive poll window (ns) and when the worker last went to sleep.
    poll_ns: u64,
    slept_at: Option<Instant>,
    /// Poll windows started (for tests).
    poll_windows: u64,
}

// SAFETY: the raw status pointers in `slots` point into guest memory that the slot's
// pinned mapping (or the queue's current mapping, for inline completions) keeps alive; they
// are only dereferenced by whichever thread owns the worker, under its mutex.
unsafe impl Send for QueueWorker {}

impl QueueWorker {
    pub fn new(
        volume: Arc<dyn BlockDevice>,
        params: Arc<DeviceParams>,
        queue_size: u16,
    ) -> std::io::Result<Self> {
        let n = queue_size as usize;
        let completer = Arc::new(QueueCompleter::new(n)?);
        let done: Arc<dyn IoCompletion> = completer.clone();
        Ok(QueueWorker {
            volume: VolumePath::new(volume),
            params,
            completer,
            done,
            slots: (0..n)
                .map(|_| Slot {
                    status: std::ptr::null_mut(),
                    data_in: 0,
                    busy: false,
                    pinned: None,
                    arrival: Arrival::default(),
                })
                .collect(),
            descs: Vec::with_capacity(n),
            used: Vec::with_capacity(n),
            finished: Vec::with_capacity(n),
            in_flight_async: 0,
            map: None,
            poll_ns: 0,
            slept_at: None,
            poll_windows: 0,
        })
    }

    #[cfg(test)]
    pub(crate) fn poll_windows(&self) -> u64 {
        self.poll_windows
    }

    #[cfg(test)]
    pub(crate) fn set_poll_window(&mut self, ns: u64) {
        self.poll_ns = ns;
        self.slept_at = None;
    }

    pub fn completer(&self) -> &Arc<QueueCompleter> {
        &self.completer
    }

    /// Requests submitted to the volume that have not completed yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight_async
    }

    /// Handle a kick or a completion wake-up: process every available chain and every
    /// finished request, publish them, and say whether the driver must be interrupted.
    pub fn run(&mut self, queue: &mut Queue, mem: &Arc<Mem>) -> bool {
        self.run_polling(queue, &|| mem.clone(), None)
    }

    /// [`run`](Self::run), and with `call` (the driver's interrupt eventfd) also poll the
    /// avail ring for a short, adaptive window before going back to sleep: interrupts due
    /// are sent through `call` before polling starts, so polling never delays a completion.
    ///
    /// The window follows QEMU's adaptive polling (`poll-max-ns`): it grows when the next
    /// kick came soon after we went to sleep (a longer poll would have caught it without the
    /// kick and wake-up), and shrinks when it came later than the maximum. Kicks stay
    /// suppressed while polling, so the driver saves its eventfd writes too.
    ///
    /// `mem` returns the current memory table. It is consulted before every pass over the
    /// ring, not once per call: the driver may add a region (and then use it) while this
    /// worker polls, and a stale table would make its requests untranslatable.
    pub fn run_polling(
        &mut self,
        queue: &mut Queue,
        mem: &dyn Fn() -> Arc<Mem>,
        call: Option<RawFd>,
    ) -> bool {
        // One recorder (this thread's shard, looked up once) for every pass until we sleep;
        // it borrows its own reference to the statistics while the passes borrow the worker.
        let metrics = self.volume.metrics().cloned();
        let rec = metrics.as_deref().map(VolumeMetrics::recorder);
        self.completer.wake_up();
        let notify = self.run_passes(queue, mem, call, rec.as_ref());
        self.completer.fall_asleep();
        notify
    }

    fn run_passes(
        &mut self,
        queue: &mut Queue,
        mem: &dyn Fn() -> Arc<Mem>,
        call: Option<RawFd>,
        rec: Option<&Recorder>,
    ) -> bool {
        let me = self.completer.id();
        INLINE.with(|c| {
            let mut c = c.borrow_mut();
            c.owner = me;
            if c.done.capacity() < self.slots.len() {
                c.done.reserve(self.slots.len());
            }
        });
        if call.is_some() {
            self.adapt_poll_window();
        }
        let mut old_used = Wrapping(queue.next_used());
        let event_idx = queue.event_idx_enabled();
        let mut rings;
        loop {
            // Snapshot avail->idx, then (re)load the memory table: every chain up to the
            // snapshot was made available after the driver's memory-table changes it relies
            // on were acknowledged, so the table loaded now can translate it.
            let mut avail_idx = None;
            rings = loop {
                self.refresh_map(&mem());
                let Some(r) = Rings::new(self.map(), queue) else {
                    warn!(
                        "virtio-blk: queue rings outside guest memory or misaligned; not serving"
                    );
                    // Interrupt if anything was published before the table changed.
                    return Wrapping(queue.next_used()) != old_used;
                };
                match avail_idx {
                    Some(_) => break r,
                    None => avail_idx = Some(r.avail_idx()),
                }
            };
            // Suppress kicks while we are busy anyway (§2.7.10). With EVENT_IDX the stale
            // avail_event already does that.
            if !event_idx {
                rings.set_used_flags(VRING_USED_F_NO_NOTIFY as u16);
            }
            // One clock read for the whole batch: the statistics and QoS layers below stamp
            // every request of it with this instant (telemetry::clock).
            let batch = crate::telemetry::clock::batch();
            // Remote volumes hold what they send until the whole batch is submitted, then
            // send it from this thread in one go (volume::plug).
            let plug = crate::volume::plug::Plug::open();
            let sane = self.pop_all(&rings, queue, avail_idx.unwrap_or_default(), rec);
            // Closing the plug sends what it held; a device that completes a request right
            // there (on this thread) leaves the completion in this thread's inline list,
            // which only a submit drained before: take it now, or it would wait for the
            // guest's next request, which may never come.
            drop(plug);
            self.drain_inline(rec);
            drop(batch);
            self.drain_remote(rec);
            self.publish(&rings, queue);
            if !sane {
                // The avail index can never catch up with ours: looping (or polling) on it
                // would spin this thread forever. Serve nothing more until the next kick.
                return self.needs_interrupt(&rings, queue, old_used);
            }
            // A deep queue's next requests follow its completions, which wake us anyway.
            let deep = self.in_flight_async >= SLEEP_IN_FLIGHT;
            if let Some(fd) = call.filter(|_| self.poll_ns > 0 && !deep) {
                if self.needs_interrupt(&rings, queue, old_used) {
                    signal_fd(fd);
                }
                old_used = Wrapping(queue.next_used());
                if self.poll(&rings, queue) {
                    continue;
                }
            }
            // Re-arm, then look again: a chain made available before the driver saw the
            // re-armed state would otherwise wait for a kick that never comes.
            if event_idx {
                rings.set_avail_event(queue.next_avail());
            } else {
                rings.set_used_flags(0);
            }
            fence(Ordering::SeqCst);
            if rings.avail_idx() == queue.next_avail() {
                break;
            }
        }
        if call.is_some() {
            self.slept_at = Some(Instant::now());
        }
        self.needs_interrupt(&rings, queue, old_used)
    }

    fn adapt_poll_window(&mut self) {
        let Some(slept) = self.slept_at.take() else {
            return;
        };
        let blocked = slept.elapsed().as_nanos() as u64;
        if blocked <= MAX_POLL_NS {
            self.poll_ns = (self.poll_ns * 2).clamp(MIN_POLL_NS, MAX_POLL_NS);
        } else {
            self.poll_ns /= 2;
            if self.poll_ns < MIN_POLL_NS {
                self.poll_ns = 0;
            }
        }
    }

    /// Spin up to the poll window for new chains or remote completions.
    fn poll(&mut self, rings: &Rings, queue: &Queue) -> bool {
        self.poll_windows += 1;
        let start = Instant::now();
        let window = Duration::from_nanos(self.poll_ns);
        loop {
            for _ in 0..64 {
                if rings.avail_idx() != queue.next_avail()
                    || self.completer.pending.load(Ordering::Relaxed) != 0
                {
                    return true;
                }
                std::hint::spin_loop();
            }
            if start.elapsed() >= window {
                return false;
            }
        }
    }

    /// Only the completions from other threads (eventfd wake-up).
    pub fn run_completions(&mut self, queue: &mut Queue, mem: &Arc<Mem>) -> bool {
        self.completer.wake_up();
        let notify = self.run_completions_awake(queue, mem);
        self.completer.fall_asleep();
        notify
    }

    fn run_completions_awake(&mut self, queue: &mut Queue, mem: &Arc<Mem>) -> bool {
        let _ = self.completer.event.read();
        self.refresh_map(mem);
        let Some(rings) = Rings::new(self.map(), queue) else {
            return false;
        };
        let old_used = Wrapping(queue.next_used());
        let metrics = self.volume.metrics().cloned();
        self.drain_remote(metrics.as_deref().map(VolumeMetrics::recorder).as_ref());
        self.publish(&rings, queue);
        self.needs_interrupt(&rings, queue, old_used)
    }

    fn refresh_map(&mut self, mem: &Arc<Mem>) {
        if !self.map.as_ref().is_some_and(|m| Arc::ptr_eq(m.mem(), mem)) {
            self.map = Some(GuestMap::new(mem.clone()));
        }
    }

    fn map(&self) -> &GuestMap {
        self.map.as_ref().expect("refresh_map ran")
    }

    fn handle_chain(&mut self, head: u16, rec: Option<&Recorder>) {
        let Some(slot) = self.slots.get(head as usize) else {
            warn!(
                head,
                "virtio-blk: chain head beyond the queue size; dropped"
            );
            return;
        };
        if slot.busy {
            // A well-behaved driver never reuses a head that is still in flight.
            warn!(
                head,
                "virtio-blk: driver reused an in-flight descriptor head; dropped"
            );
            return;
        }
        let parsed = match request::parse(self.map(), &self.descs, &self.params) {
            Outcome::Parsed(p) => p,
            Outcome::Drop(reason) => {
                warn!(head, reason, "virtio-blk: malformed request dropped");
                self.used.push((head, 0));
                return;
            }
        };
        match parsed.action {
            Action::Complete(code) => {
                debug!(head, code, "virtio-blk: request failed before submission");
                // SAFETY: the parser checked the status byte lies in guest memory mapped by
                // `mem`, which we hold.
                unsafe { std::ptr::write_volatile(parsed.status, code) };
                self.used.push((head, 1));
            }
            Action::GetId(segs) => {
                // SAFETY: segments in mapped guest memory (parser), held via `mem`.
                unsafe { crate::volume::copy_to_segments(&segs, 0, &self.params.serial) };
                // SAFETY: as above.
                unsafe { std::ptr::write_volatile(parsed.status, S_OK) };
                self.used.push((head, parsed.data_in + 1));
            }
            Action::Submit(mut req) => {
                req.tag = head as u64;
                let _span = tracing::trace_span!(target: trace::TARGET, "vhost",
                    dev = %trace::Serial(&self.params.serial), head)
                .entered();
                let slot = &mut self.slots[head as usize];
                slot.status = parsed.status;
                slot.data_in = parsed.data_in;
                slot.busy = true;
                if let Some(r) = rec {
                    slot.arrival = r.arrive(req.kind, req.len);
                }
                self.volume.submit(req, &self.done);
                self.drain_inline(rec);
                let slot = &mut self.slots[head as usize];
                if slot.busy {
                    slot.pinned = Some(self.map.as_ref().expect("map").mem().clone());
                    self.in_flight_async += 1;
                }
            }
        }
    }
}

impl Drop for QueueWorker {
    /// A request still in the volume points into guest memory; wait (bounded) for it so the
    /// memory is not unmapped under the volume's feet.
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.in_flight_async > 0 && Instant::now() < deadline {
            let mut remote = self
                .completer
                .remote
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let done: Vec<(u64, u8)> = remote.drain(..).collect();
            drop(remote);
            for (tag, code) in done {
                if let Some(slot) = self.slots.get_mut(tag as usize).filter(|s| s.busy) {
                    // SAFETY: pinned mapping still alive (held by the slot).
                    unsafe { std::ptr::write_volatile(slot.status, code) };
                    slot.busy = false;
                    if slot.pinned.take().is_some() {
                        self.in_flight_async -= 1;
                    }
                }
            }
            if self.in_flight_async > 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        if self.in_flight_async > 0 {
            error!(
                in_flight = self.in_flight_async,
                "virtio-blk: requests never completed; leaking their guest memory mappings"
            );
            for slot in &mut self.slots {
                if let Some(m) = slot.pinned.take() {
                    std::mem::forget(m);
                }
            }
        }
    }
}

/// The bytes of the GET_ID answer for `serial` (at most 20 ASCII bytes, NUL padded).
pub fn serial_bytes(serial: &str) -> Option<[u8; spec::ID_BYTES]> {
    if serial.len() > spec::ID_BYTES || !serial.is_ascii() {
        return None;
    }
    let mut b = [0u8; spec::ID_BYTES];
    b[..serial.len()].copy_from_slice(serial.as_bytes());
    Some(b)
}
