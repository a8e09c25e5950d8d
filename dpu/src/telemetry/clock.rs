//! The data path's two cheap primitives: a batch clock and per-thread slots.
//!
//! **Batch clock.** Reading the monotonic clock costs about as much as the whole null-volume
//! path per request, so a frontend that handles requests in batches (the vhost-user-blk queue
//! worker takes every available chain per pass) reads it once per batch with [`batch`]; until
//! the returned guard drops, [`now_ns`] on that thread returns that instant. A thread outside
//! a batch (the QoS pacer, a fabric completion thread) reads the clock on every call. Latency
//! measured this way has a resolution of one batch: a request that completes inline inside
//! the batch it arrived in measures 0 (it lands in the lowest histogram bucket, ≤ 1 µs, which
//! is where a null or RAM completion belongs anyway).
//!
//! **Thread slots.** Every thread that touches a volume's statistics gets a small index of
//! its own ([`slot`]), held until the thread exits and then handed to the next new thread.
//! Statistics keep one shard per slot, written only by the thread that owns the slot (plain
//! relaxed load and store, no read-modify-write, no shared cache line) and summed at scrape
//! time. Threads beyond [`SLOTS`] share the [`OVERFLOW`] shard, updated with atomic adds.

use std::cell::Cell;
use std::sync::{LazyLock, Mutex};
use std::time::Instant;

/// Exclusive slots; slot [`OVERFLOW`] (= `SLOTS`) is the shared one.
pub const SLOTS: usize = 64;
/// The slot of threads that found every exclusive one taken.
pub const OVERFLOW: usize = SLOTS;

static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

thread_local! {
    /// The batch's instant (ns since [`EPOCH`], never 0), or 0 outside a batch.
    static BATCH: Cell<u64> = const { Cell::new(0) };
}

/// Read the monotonic clock: nanoseconds since a process-wide origin, at least 1.
pub fn read_ns() -> u64 {
    EPOCH.elapsed().as_nanos() as u64 + 1
}

/// The current batch's instant on this thread, or the clock when no batch is open.
#[inline]
pub fn now_ns() -> u64 {
    match BATCH.with(Cell::get) {
        0 => read_ns(),
        t => t,
    }
}

/// Open a batch on this thread: one clock read now, reused by [`now_ns`] until the guard
/// drops. Batches nest (the inner one restores the outer's instant).
pub fn batch() -> Batch {
    Batch {
        outer: BATCH.with(|b| b.replace(read_ns())),
    }
}

/// Join the batch open on this thread, or open one ([`batch`]) where none is: for a step
/// that is sometimes part of a larger batch (an NVMe/TCP target reactor's pass) and
/// sometimes runs on its own.
pub fn join() -> Option<Batch> {
    match BATCH.with(Cell::get) {
        0 => Some(batch()),
        _ => None,
    }
}

/// See [`batch`].
pub struct Batch {
    outer: u64,
}

impl Drop for Batch {
    fn drop(&mut self) {
        BATCH.with(|b| b.set(self.outer));
    }
}

/// Slots given back by exited threads.
static FREE: Mutex<Vec<usize>> = Mutex::new(Vec::new());
static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

struct SlotOwner(usize);

impl SlotOwner {
    fn acquire() -> Self {
        // The mutex hands a slot's history from its last owner to the next (happens-before),
        // so the next owner's plain load-and-store continues from the right values.
        if let Some(s) = FREE.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return SlotOwner(s);
        }
        let s = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        SlotOwner(s.min(OVERFLOW))
    }
}

impl Drop for SlotOwner {
    fn drop(&mut self) {
        // From here on this thread uses the shared slot (a later destructor may still count).
        CACHED.with(|c| c.set(OVERFLOW));
        if self.0 < SLOTS {
            FREE.lock().unwrap_or_else(|p| p.into_inner()).push(self.0);
        }
    }
}

thread_local! {
    static SLOT: SlotOwner = SlotOwner::acquire();
    /// `SLOT`'s value once known, in a plain thread-local (no lazy state, no destructor to
    /// check), so the data path reads it with one load. `usize::MAX`: not yet known.
    static CACHED: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// This thread's slot: `< SLOTS` is exclusive to it until it exits, [`OVERFLOW`] is shared.
#[inline]
pub fn slot() -> usize {
    match CACHED.with(Cell::get) {
        usize::MAX => first_slot(),
        s => s,
    }
}

#[cold]
fn first_slot() -> usize {
    // During thread teardown the slot may already be given back: use the shared one.
    let s = SLOT.try_with(|s| s.0).unwrap_or(OVERFLOW);
    CACHED.with(|c| c.set(s));
    s
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn a_batch_reads_the_clock_once_and_nests() {
        let b = batch();
        let t = now_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(now_ns(), t, "inside a batch the instant stays");
        {
            let _inner = batch();
            assert!(now_ns() >= t + 2_000_000);
        }
        assert_eq!(now_ns(), t, "the inner batch restored the outer one");
        {
            let joined = join();
            assert!(joined.is_none(), "a batch is open: join opens none");
            assert_eq!(now_ns(), t, "joining keeps the open batch's instant");
        }
        drop(b);
        let own = join();
        assert!(own.is_some(), "no batch open: join opens one");
        let u = now_ns();
        assert!(u >= t + 2_000_000);
        std::thread::sleep(std::time::Duration::from_millis(1));
        assert_eq!(now_ns(), u, "the batch join opened holds its instant");
        drop(own);
        assert!(now_ns() >= t + 2_000_000, "outside a batch: the clock");
    }

    #[test]
    fn live_threads_hold_distinct_slots_and_exited_ones_give_them_back() {
        let mine = slot();
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(slot);
            let b = s.spawn(slot);
            (a.join().unwrap(), b.join().unwrap())
        });
        // Other tests run threads too: only what is certain here is asserted.
        assert_ne!(mine, OVERFLOW);
        assert_ne!(a, mine);
        assert_ne!(b, mine);
        let again = std::thread::spawn(slot).join().unwrap();
        assert!(again < SLOTS, "a slot given back is reused: {again}");
    }
}
