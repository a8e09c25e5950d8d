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
//! a shared list and wakes the worker through an eventfd. No allocation happens per request:
//! the lists, the descriptor scratch and the per-head slots are sized once per queue.

use std::cell::RefCell;
use std::num::Wrapping;
use std::sync::atomic::{fence, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{debug, error, warn};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::request::{self, Action, Desc, DeviceParams, Mem, Outcome};
use super::spec::{self, S_IOERR, S_OK, S_UNSUPP};
use crate::volume::{BlockDevice, Completion, IoError, IoResult};

/// Map a volume result to a virtio-blk status (§5.2.6).
pub fn status_of(result: &IoResult) -> u8 {
    match result {
        Ok(()) => S_OK,
        Err(IoError::Unsupported) => S_UNSUPP,
        Err(_) => S_IOERR,
    }
}

struct InlineDone {
    /// Address of the completer whose worker runs on this thread.
    owner: usize,
    done: Vec<(u64, u8)>,
}

thread_local! {
    static INLINE: RefCell<InlineDone> = const {
        RefCell::new(InlineDone { owner: 0, done: Vec::new() })
    };
}

/// The [`Completion`] a queue hands to the volume.
pub struct QueueCompleter {
    remote: Mutex<Vec<(u64, u8)>>,
    pending: AtomicUsize,
    event: EventFd,
}

impl QueueCompleter {
    pub fn new(capacity: usize) -> std::io::Result<Self> {
        Ok(QueueCompleter {
            remote: Mutex::new(Vec::with_capacity(capacity)),
            pending: AtomicUsize::new(0),
            event: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    /// Readable when completions from other threads wait for the worker.
    pub fn event(&self) -> &EventFd {
        &self.event
    }

    fn id(&self) -> usize {
        self as *const Self as usize
    }
}

impl Completion for QueueCompleter {
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
        self.remote
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((tag, code));
        self.pending.fetch_add(1, Ordering::Release);
        if let Err(e) = self.event.write(1) {
            error!(error = %e, "cannot wake the virtio-blk queue worker");
        }
    }
}

/// A request handed to the volume and not yet completed.
struct Slot {
    status: *mut u8,
    data_in: u32,
    busy: bool,
    /// Set when the volume did not complete inline: keeps the guest memory mapping the
    /// request's segments point into alive until it completes, even if the driver replaces
    /// the memory table meanwhile.
    pinned: Option<Arc<Mem>>,
}

/// Per-queue state, owned by the queue's worker thread.
pub struct QueueWorker {
    volume: Arc<dyn BlockDevice>,
    params: Arc<DeviceParams>,
    completer: Arc<QueueCompleter>,
    done: Arc<dyn Completion>,
    slots: Vec<Slot>,
    descs: Vec<Desc>,
    used: Vec<(u16, u32)>,
    finished: Vec<(u64, u8)>,
    in_flight_async: usize,
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
        let done: Arc<dyn Completion> = completer.clone();
        Ok(QueueWorker {
            volume,
            params,
            completer,
            done,
            slots: (0..n)
                .map(|_| Slot {
                    status: std::ptr::null_mut(),
                    data_in: 0,
                    busy: false,
                    pinned: None,
                })
                .collect(),
            descs: Vec::with_capacity(n),
            used: Vec::with_capacity(n),
            finished: Vec::with_capacity(n),
            in_flight_async: 0,
        })
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
        let me = self.completer.id();
        INLINE.with(|c| {
            let mut c = c.borrow_mut();
            c.owner = me;
            if c.done.capacity() < self.slots.len() {
                c.done.reserve(self.slots.len());
            }
        });
        let old_used = Wrapping(queue.next_used());
        loop {
            if let Err(e) = queue.disable_notification(&**mem) {
                warn!(error = %e, "virtio-blk: cannot disable notifications");
            }
            self.pop_all(queue, mem);
            self.drain_remote();
            self.publish(queue, mem);
            match queue.enable_notification(&**mem) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    warn!(error = %e, "virtio-blk: cannot enable notifications");
                    break;
                }
            }
        }
        self.needs_interrupt(queue, mem, old_used)
    }

    /// Only the completions from other threads (eventfd wake-up).
    pub fn run_completions(&mut self, queue: &mut Queue, mem: &Arc<Mem>) -> bool {
        let _ = self.completer.event.read();
        let old_used = Wrapping(queue.next_used());
        self.drain_remote();
        self.publish(queue, mem);
        self.needs_interrupt(queue, mem, old_used)
    }

    fn pop_all(&mut self, queue: &mut Queue, mem: &Arc<Mem>) {
        let mut iter = match queue.iter(&**mem) {
            Ok(it) => it,
            Err(e) => {
                debug!(error = %e, "virtio-blk: queue not ready");
                return;
            }
        };
        for chain in &mut iter {
            let head = chain.head_index();
            self.descs.clear();
            self.descs.extend(chain.map(|d| Desc {
                addr: d.addr().0,
                len: d.len(),
                writable: d.is_write_only(),
            }));
            self.handle_chain(head, mem);
        }
    }

    fn handle_chain(&mut self, head: u16, mem: &Arc<Mem>) {
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
        let parsed = match request::parse(mem, &self.descs, &self.params) {
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
                let slot = &mut self.slots[head as usize];
                slot.status = parsed.status;
                slot.data_in = parsed.data_in;
                slot.busy = true;
                self.volume.submit(req, &self.done);
                self.drain_inline();
                let slot = &mut self.slots[head as usize];
                if slot.busy {
                    slot.pinned = Some(mem.clone());
                    self.in_flight_async += 1;
                }
            }
        }
    }

    fn drain_inline(&mut self) {
        INLINE.with(|c| std::mem::swap(&mut c.borrow_mut().done, &mut self.finished));
        let mut finished = std::mem::take(&mut self.finished);
        for &(tag, code) in &finished {
            self.finish(tag, code);
        }
        finished.clear();
        self.finished = finished;
    }

    fn drain_remote(&mut self) {
        if self.completer.pending.load(Ordering::Acquire) == 0 {
            return;
        }
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
            self.finish(tag, code);
        }
        finished.clear();
        self.finished = finished;
    }

    fn finish(&mut self, tag: u64, code: u8) {
        let Some(slot) = self.slots.get_mut(tag as usize).filter(|s| s.busy) else {
            error!(tag, "virtio-blk: completion for a request not in flight");
            return;
        };
        // SAFETY: the status byte lies in guest memory that is still mapped: either the
        // batch's mapping (inline) or the slot's pinned one (async).
        unsafe { std::ptr::write_volatile(slot.status, code) };
        let used_len = if code == S_OK { slot.data_in + 1 } else { 1 };
        slot.busy = false;
        if slot.pinned.take().is_some() {
            self.in_flight_async -= 1;
        }
        self.used.push((tag as u16, used_len));
    }

    /// Write the batch's used elements, then the used index once (§2.7.8).
    fn publish(&mut self, queue: &mut Queue, mem: &Mem) {
        if self.used.is_empty() {
            return;
        }
        let size = queue.size();
        let ring = queue.used_ring();
        let mut idx = Wrapping(queue.next_used());
        for &(head, len) in &self.used {
            // struct virtq_used_elem { le32 id; le32 len; } at ring + 4 + 8 * slot.
            let off = 4 + 8 * u64::from(idx.0 % size);
            let elem = u64::from(head) | (u64::from(len) << 32);
            if let Err(e) = mem.write_obj(elem.to_le(), GuestAddress(ring.wrapping_add(off))) {
                error!(error = %e, "virtio-blk: used ring outside guest memory");
                self.used.clear();
                return;
            }
            idx += Wrapping(1);
        }
        // The elements must be visible before the index that exposes them.
        if let Err(e) = mem.store(
            idx.0.to_le(),
            GuestAddress(ring.wrapping_add(2)),
            Ordering::Release,
        ) {
            error!(error = %e, "virtio-blk: used index outside guest memory");
        }
        queue.set_next_used(idx.0);
        self.used.clear();
    }

    fn needs_interrupt(&self, queue: &Queue, mem: &Mem, old: Wrapping<u16>) -> bool {
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
        // used_event sits after the avail ring: flags, idx, ring[size].
        let addr = queue
            .avail_ring()
            .wrapping_add(4 + 2 * u64::from(queue.size()));
        let used_event: u16 = match mem.load(GuestAddress(addr), Ordering::Acquire) {
            Ok(v) => u16::from_le(v),
            Err(_) => return true,
        };
        // vring_need_event(event, new, old): notify if event lies in [old, new).
        (new - Wrapping(used_event) - Wrapping(1)) < (new - old)
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
