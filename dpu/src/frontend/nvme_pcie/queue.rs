//! Submission and completion queues in the host's memory (NVMe Base 2.0 §3.3.1: memory-based
//! transport queue model, physically contiguous queues only: CAP.CQR = 1), and their
//! doorbells in BAR0's doorbell page (§3.1.4.20-21, CAP.DSTRD = 0).
//!
//! The doorbell page is shared with the client (mmapped through vfio-user's sparse mmap), so
//! a host rings a doorbell with a plain store and nothing reaches nacred: the controller's
//! poller reads the page. A doorbell value beyond the queue's size is a host error the
//! controller cannot recover from; the controller then reports Controller Fatal Status.
//!
//! Shadow doorbells (Doorbell Buffer Config, §5.8; Linux uses them on emulated controllers):
//! once the host has given a shadow doorbell buffer and an EventIdx buffer, each a page of its
//! memory laid out like the doorbell registers, the I/O queues' doorbell values are read from
//! the shadow buffer, and after each pass the controller writes into the EventIdx buffer the
//! value it has consumed, so that the host rings the register only when the controller asks
//! (Linux's `nvme_dbbuf_need_event`). The admin queue keeps its registers (Linux does not
//! shadow it).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use nacre_shared::nvme::Status;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// Bytes of a submission queue entry (CC.IOSQES = 6) and a completion queue entry
/// (CC.IOCQES = 4).
pub const SQE_LEN: u64 = 64;
pub const CQE_LEN: u64 = 16;

/// Offset of the doorbell page in BAR0 (§3.1.4: doorbells start at 1000h).
pub const DOORBELLS: u64 = 0x1000;
/// Doorbell registers in the page: SQyTDBL at 2y, CQyHDBL at 2y + 1 (DSTRD = 0).
pub const DOORBELL_SLOTS: usize = 1024;
/// Entries from which the queues' cache lines are asked for ahead ([`Cq::prefetch`], and the
/// submission entries in [`fetch`]): with fewer, all lie in the line the host polls or are
/// read at once anyway, and asking costs a queue lookup per pass (measured at queue depth 1:
/// 20 ns more per pass).
pub const PREFETCH_FROM: usize = 4;

/// The doorbell page: a view of shared memory the client writes at any time; and the host's
/// shadow doorbell and EventIdx buffers once it has configured them (0: none).
pub struct Doorbells {
    regs: *const AtomicU32,
    shadow: AtomicU64,
    event_idx: AtomicU64,
}

// SAFETY: the page is only accessed through atomics, which any thread may use.
unsafe impl Send for Doorbells {}
// SAFETY: as above.
unsafe impl Sync for Doorbells {}

impl Doorbells {
    /// # Safety
    /// `page` must point to [`DOORBELL_SLOTS`] 4-byte aligned u32s that stay mapped for the
    /// life of the returned value.
    pub unsafe fn new(page: *mut u8) -> Self {
        Doorbells {
            regs: page as *const AtomicU32,
            shadow: AtomicU64::new(0),
            event_idx: AtomicU64::new(0),
        }
    }

    /// Doorbell Buffer Config: the guest addresses of the shadow doorbell buffer and the
    /// EventIdx buffer (page-aligned pages the caller has checked are mapped).
    pub fn configure_shadow(&self, shadow: u64, event_idx: u64) {
        self.event_idx.store(event_idx, Ordering::Release);
        self.shadow.store(shadow, Ordering::Release);
    }

    /// The shadow buffer's guest address of doorbell slot `i`, for an I/O queue's slot when
    /// the host has configured shadow doorbells.
    fn shadow_at(&self, i: usize) -> Option<GuestAddress> {
        let base = self.shadow.load(Ordering::Acquire);
        (base != 0 && i >= 2).then(|| GuestAddress(base + 4 * i as u64))
    }

    /// A doorbell value: the shadow buffer's for I/O queues once configured (a shadow slot
    /// no longer mapped reads as the register), else the register's.
    fn value(&self, i: usize, mem: &GuestMemoryMmap) -> u32 {
        match self.shadow_at(i) {
            Some(a) => mem
                .load::<u32>(a, Ordering::Acquire)
                .map(u32::from_le)
                .unwrap_or_else(|_| self.slot(i).load(Ordering::Acquire)),
            None => self.slot(i).load(Ordering::Acquire),
        }
    }

    /// Tell the host, through the EventIdx buffer, the value of doorbell slot `i` the
    /// controller has consumed: it rings the register only once it moves past it.
    fn consumed(&self, i: usize, value: u32, mem: &GuestMemoryMmap) {
        if self.shadow_at(i).is_none() {
            return;
        }
        let base = self.event_idx.load(Ordering::Acquire);
        // A buffer the host unmapped loses the hint, never memory outside the mapping.
        let _ = mem.store(
            value.to_le(),
            GuestAddress(base + 4 * i as u64),
            Ordering::Release,
        );
    }

    fn slot(&self, i: usize) -> &AtomicU32 {
        assert!(i < DOORBELL_SLOTS);
        // SAFETY: i is in the page (asserted); the page outlives self (constructor).
        unsafe { &*self.regs.add(i) }
    }

    pub fn sq_tail(&self, qid: u16, mem: &GuestMemoryMmap) -> u32 {
        self.value(2 * qid as usize, mem)
    }

    pub fn cq_head(&self, qid: u16, mem: &GuestMemoryMmap) -> u32 {
        self.value(2 * qid as usize + 1, mem)
    }

    /// A doorbell write that arrived as a vfio-user region write (the client did not mmap
    /// the page): `offset` is relative to the page.
    pub fn store(&self, offset: u64, data: &[u8]) {
        if offset % 4 != 0 || data.len() != 4 || offset as usize / 4 >= DOORBELL_SLOTS {
            return;
        }
        let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        self.slot(offset as usize / 4).store(v, Ordering::Release);
    }

    pub fn load(&self, offset: u64, out: &mut [u8]) {
        out.fill(0);
        if offset % 4 == 0 && out.len() == 4 && (offset as usize / 4) < DOORBELL_SLOTS {
            out.copy_from_slice(
                &self
                    .slot(offset as usize / 4)
                    .load(Ordering::Acquire)
                    .to_le_bytes(),
            );
        }
    }

    /// Zero every doorbell and forget the shadow buffers (controller reset).
    pub fn clear(&self) {
        self.shadow.store(0, Ordering::Release);
        self.event_idx.store(0, Ordering::Release);
        for i in 0..DOORBELL_SLOTS {
            self.slot(i).store(0, Ordering::Release);
        }
    }
}

/// A submission queue.
pub struct Sq {
    pub qid: u16,
    pub base: u64,
    /// Entries (1-based).
    pub size: u16,
    pub cqid: u16,
    /// The next entry to fetch; only the poller moves it.
    pub head: Mutex<u16>,
    /// Deleted (or the controller reset): completions of its commands still at the volumes
    /// are dropped.
    pub retired: AtomicBool,
}

impl Sq {
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    pub fn retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }
}

/// Completion entries in one cache line: a whole line's worth is written together while a
/// poller pass holds its queue's completions back ([`HeldBack`]).
const CQES_PER_LINE: u64 = 64 / CQE_LEN;

thread_local! {
    /// The completions this thread holds back (see [`HeldBack`]).
    static HELD_BACK: std::cell::RefCell<Held> = const {
        std::cell::RefCell::new(Held {
            cq: std::ptr::null(),
            at: 0,
            entries: Vec::new(),
        })
    };
}

struct Held {
    /// The queue (compared, never dereferenced), or null.
    cq: *const Cq,
    /// Where the next held entry goes in the ring, as far as this thread knows: the queue's
    /// tail and waiting entries when the hold began, and the entries held since (another
    /// thread's posts meanwhile only move the line boundaries, which are a cost, not a rule).
    at: u64,
    entries: Vec<Pending>,
}

/// While it lives, completions posted to its queue on this thread are written a cache line's
/// worth at a time, and what is left at its drop is posted by [`HeldBack::post`].
///
/// Why: the host polls the completion queue, so the line a completion entry goes to was last
/// read by the host's core, and storing the entry has to take the line back. On x86 stores
/// leave the store buffer in program order, so every store after the entry's (a command's
/// work is many of them) waits for that transfer once the buffer fills, and a locked
/// instruction waits for it at once: each completion paid a whole cross-core transfer. Four
/// entries written together pay one, and the host still sees its completions a line at a
/// time within the pass rather than all at its end (which measured slower: the host then
/// waits for the whole pass before it submits again).
///
/// Held entries wait in the thread's own list, so a completion takes the queue's lock once a
/// line, not once an entry.
pub struct HeldBack {
    cq: Arc<Cq>,
}

impl HeldBack {
    /// Hold `cq`'s completions on this thread; `n` are coming (the pass's commands): the
    /// cache lines of the next `n` entries are asked for, for writing ([`Cq::prefetch`]).
    pub fn begin(cq: &Arc<Cq>, mem: &GuestMemoryMmap, n: usize) -> Self {
        let at = {
            let st = crate::frontend::nvme::lock(&cq.state);
            cq.prefetch(&st, mem, n);
            st.tail as u64 + st.pending.len() as u64
        };
        HELD_BACK.with_borrow_mut(|h| {
            h.cq = Arc::as_ptr(cq);
            h.at = at;
            h.entries.clear();
        });
        HeldBack { cq: cq.clone() }
    }

    /// Post what the queue still holds, as far as the host has room: how many entries were
    /// posted.
    pub fn post(self, mem: &GuestMemoryMmap, db: &Doorbells) -> Result<u32, Fatal> {
        if HELD_BACK.with_borrow(|h| h.entries.is_empty()) {
            return Ok(0);
        }
        let mut st = crate::frontend::nvme::lock(&self.cq.state);
        if !self.cq.take_held(&mut st) {
            return Ok(0);
        }
        self.cq.drain(&mut st, mem, db)
    }
}

impl Drop for HeldBack {
    /// The hold ends; what it still holds (a pass that ended early) waits on the queue for
    /// the next pass's [`Cq::flush`].
    fn drop(&mut self) {
        if !HELD_BACK.with_borrow(|h| h.entries.is_empty()) {
            let mut st = crate::frontend::nvme::lock(&self.cq.state);
            self.cq.take_held(&mut st);
        }
        HELD_BACK.with_borrow_mut(|h| h.cq = std::ptr::null());
    }
}

/// A completion the host has no room for yet.
#[derive(Clone, Copy)]
pub struct Pending {
    pub dw0: u32,
    pub sqhd: u16,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
}

pub struct CqState {
    tail: u16,
    phase: bool,
    /// Completions waiting for the host to free entries (it must not, but a hostile or
    /// slow host may let its completion queue fill).
    pending: VecDeque<Pending>,
    /// Deleted (or the controller reset): nothing is posted to its memory any more.
    retired: bool,
    /// The host's head as last read from its doorbell: posting reads the doorbell again
    /// only when the queue looks full by it, and each poller pass reads it once
    /// ([`Cq::flush`]), so a completion costs no read of a line the host keeps writing.
    head: u32,
    /// Entries posted that the host had not consumed, as of the last pass.
    backlog: u32,
}

/// A completion queue.
pub struct Cq {
    pub qid: u16,
    pub base: u64,
    pub size: u16,
    /// MSI-X vector and Interrupts Enabled.
    pub iv: u16,
    pub ien: bool,
    pub state: Mutex<CqState>,
}

/// Why a queue operation stopped the controller.
#[derive(Debug, PartialEq, Eq)]
pub enum Fatal {
    /// A doorbell value at or beyond the queue's size.
    Doorbell,
}

impl Cq {
    pub fn new(qid: u16, base: u64, size: u16, iv: u16, ien: bool) -> Self {
        Cq {
            qid,
            base,
            size,
            iv,
            ien,
            state: Mutex::new(CqState {
                tail: 0,
                phase: true,
                pending: VecDeque::new(),
                retired: false,
                head: 0,
                backlog: 0,
            }),
        }
    }

    /// `n` completions are coming (the commands of a poller pass): ask the CPU to own the
    /// cache lines of the next `n` entries for writing now, so the line transfers (the host
    /// read those lines when it last consumed them) overlap the commands' work instead of
    /// stalling each completion's store. A hint only: nothing is written here.
    fn prefetch(&self, st: &CqState, mem: &GuestMemoryMmap, n: usize) {
        let tail = st.tail as u64;
        let size = self.size as u64;
        let Some(ring) = ring_ptr(mem, self.base, size * CQE_LEN) else {
            return;
        };
        let lines_per_entry = 64 / CQE_LEN;
        let mut i = 0;
        while i < (n as u64).min(size) {
            let at = (tail + i) % size * CQE_LEN;
            prefetch::<true>(ring.wrapping_add(at as usize));
            i += lines_per_entry - (tail + i) % lines_per_entry;
        }
    }

    /// Post `c` (or keep it until the host frees an entry, or, while this thread holds the
    /// queue's completions back, until they fill the entry's cache line). Returns how many
    /// entries were posted (the caller then raises the interrupt).
    pub fn post(&self, mem: &GuestMemoryMmap, db: &Doorbells, c: Pending) -> Result<u32, Fatal> {
        // Held on this thread: kept in its list until the entries fill their line.
        let held = HELD_BACK.with_borrow_mut(|h| {
            std::ptr::eq(h.cq, self).then(|| {
                h.entries.push(c);
                h.at += 1;
                h.at % CQES_PER_LINE == 0
            })
        });
        let mut st = match held {
            Some(false) => return Ok(0),
            Some(true) => {
                let mut st = crate::frontend::nvme::lock(&self.state);
                if !self.take_held(&mut st) {
                    return Ok(0);
                }
                st
            }
            None => {
                let mut st = crate::frontend::nvme::lock(&self.state);
                if st.retired {
                    return Ok(0);
                }
                st.pending.push_back(c);
                st
            }
        };
        self.drain(&mut st, mem, db)
    }

    /// Move what this thread holds for this queue onto its waiting entries (dropped if the
    /// queue is retired); whether any wait now.
    fn take_held(&self, st: &mut CqState) -> bool {
        HELD_BACK.with_borrow_mut(|h| {
            if st.retired {
                h.entries.clear();
            } else {
                st.pending.extend(h.entries.drain(..));
            }
        });
        !st.pending.is_empty()
    }

    /// The queue was deleted: its memory is the host's again, so nothing more is written
    /// there (a command completing later finds it retired).
    pub fn retire(&self) {
        let mut st = crate::frontend::nvme::lock(&self.state);
        st.retired = true;
        st.pending.clear();
    }

    /// Entries posted that the host had not consumed, as of the last poller pass.
    pub fn backlog(&self) -> u32 {
        crate::frontend::nvme::lock(&self.state).backlog
    }

    /// The poller's pass: read the host's head doorbell (a value beyond the queue is
    /// fatal), then post what the host has room for; how many entries were posted.
    pub fn flush(&self, mem: &GuestMemoryMmap, db: &Doorbells) -> Result<u32, Fatal> {
        let mut st = crate::frontend::nvme::lock(&self.state);
        if st.retired {
            return Ok(0);
        }
        self.read_head(&mut st, mem, db)?;
        let posted = if st.pending.is_empty() {
            0
        } else {
            self.drain(&mut st, mem, db)?
        };
        st.backlog = (st.tail as u32 + self.size as u32 - st.head) % self.size as u32;
        Ok(posted)
    }

    fn read_head(
        &self,
        st: &mut CqState,
        mem: &GuestMemoryMmap,
        db: &Doorbells,
    ) -> Result<(), Fatal> {
        let head = db.cq_head(self.qid, mem);
        if head >= self.size as u32 {
            return Err(Fatal::Doorbell);
        }
        db.consumed(2 * self.qid as usize + 1, head, mem);
        st.head = head;
        Ok(())
    }

    fn drain(&self, st: &mut CqState, mem: &GuestMemoryMmap, db: &Doorbells) -> Result<u32, Fatal> {
        let mut posted = 0;
        // The ring, looked up once for all the entries (None if it is not whole in one mapped
        // region: each entry is then looked up on its own).
        let ring = mem
            .get_slice(
                GuestAddress(self.base),
                self.size as usize * CQE_LEN as usize,
            )
            .ok();
        while let Some(c) = st.pending.front().copied() {
            let next = if st.tail + 1 == self.size {
                0
            } else {
                st.tail + 1
            };
            if next as u32 == st.head {
                // Full by the head last read: read it again before waiting.
                self.read_head(st, mem, db)?;
                if next as u32 == st.head {
                    break;
                }
            }
            let at = st.tail as u64 * CQE_LEN;
            let mut b = [0u8; 12];
            b[0..4].copy_from_slice(&c.dw0.to_le_bytes());
            b[8..10].copy_from_slice(&c.sqhd.to_le_bytes());
            b[10..12].copy_from_slice(&c.sqid.to_le_bytes());
            let dw3 = c.cid as u32 | ((c.status.to_field() | st.phase as u16) as u32) << 16;
            // Dwords 0-2 first, then Dword 3 with the phase tag: the host takes the entry as
            // posted once it sees the new phase. A queue outside mapped memory loses the
            // completion (the host broke its own queue), never memory outside the mapping.
            match &ring {
                Some(r) => write_cqe(r, at as usize, at as usize + 12, &b, dw3),
                None => {
                    let at = self.base + at;
                    write_cqe(mem, GuestAddress(at), GuestAddress(at + 12), &b, dw3)
                }
            }
            st.pending.pop_front();
            st.tail = next;
            if st.tail == 0 {
                st.phase = !st.phase;
            }
            posted += 1;
        }
        Ok(posted)
    }
}

/// Write a completion entry: Dwords 0-2 (`b`) at `at`, then Dword 3 (`dw3`, with the phase
/// tag) at `dw3_at`, in the ring's slice or through the memory map.
fn write_cqe<A, M: Bytes<A>>(m: &M, at: A, dw3_at: A, b: &[u8; 12], dw3: u32) {
    if m.write_slice(b, at).is_ok() {
        std::sync::atomic::fence(Ordering::Release);
        let _ = m.write_obj(dw3, dw3_at);
    }
}

/// Fetch the entries the host submitted to `sq` since the last call (at most `max`).
pub fn fetch(
    sq: &Sq,
    mem: &GuestMemoryMmap,
    db: &Doorbells,
    max: usize,
    out: &mut Vec<(u16, [u8; SQE_LEN as usize])>,
) -> Result<(), Fatal> {
    out.clear();
    let tail = db.sq_tail(sq.qid, mem);
    if tail >= sq.size as u32 {
        return Err(Fatal::Doorbell);
    }
    let mut head = crate::frontend::nvme::lock(&sq.head);
    if *head as u32 == tail {
        return Ok(());
    }
    // Each entry is a cache line the host just wrote: ask for all of them at once, so their
    // transfers overlap rather than follow one another through the copies below.
    // (Not for a few: the copy below asks for those as soon.)
    let n = (tail + sq.size as u32 - *head as u32) % sq.size as u32;
    // The ring, looked up once for all the entries (None if it is not whole in one mapped
    // region: each entry is then looked up on its own).
    let ring = mem
        .get_slice(GuestAddress(sq.base), sq.size as usize * SQE_LEN as usize)
        .ok();
    if let Some(ring) = ring.as_ref().filter(|_| n as usize >= PREFETCH_FROM) {
        let p = ring.ptr_guard().as_ptr();
        for i in 0..n.min(max as u32) {
            let at = (*head as u64 + i as u64) % sq.size as u64 * SQE_LEN;
            prefetch::<false>(p.wrapping_add(at as usize));
        }
    }
    while *head as u32 != tail && out.len() < max {
        let mut e = [0u8; SQE_LEN as usize];
        let at = *head as u64 * SQE_LEN;
        *head = if *head + 1 == sq.size { 0 } else { *head + 1 };
        // An entry outside mapped memory reads as zeros: opcode 0 on the admin queue is
        // Delete I/O SQ of QID 0, refused; on an I/O queue a Flush of NSID 0, refused.
        match &ring {
            Some(r) => _ = r.read_slice(&mut e, at as usize),
            None => _ = mem.read_slice(&mut e, GuestAddress(sq.base + at)),
        }
        out.push((*head, e));
    }
    db.consumed(2 * sq.qid as usize, *head as u32, mem);
    Ok(())
}

/// The host address of a queue of `len` bytes at `base`, if it lies whole in one mapped
/// region (only for prefetch hints: reads and writes go through `vm-memory`'s checks).
fn ring_ptr(mem: &GuestMemoryMmap, base: u64, len: u64) -> Option<*const u8> {
    let s = mem.get_slice(GuestAddress(base), len as usize).ok()?;
    Some(s.ptr_guard().as_ptr())
}

/// A hint that the line at `p` is about to be written (`WRITE`: x86 PREFETCHW, Arm PRFM
/// PSTL1KEEP) or read (x86 PREFETCHT0, Arm PRFM PLDL1KEEP).
#[inline(always)]
fn prefetch<const WRITE: bool>(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and changes no memory, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
        if WRITE {
            _mm_prefetch::<_MM_HINT_ET0>(p as *const i8)
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
        }
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: as above.
    unsafe {
        if WRITE {
            std::arch::asm!("prfm pstl1keep, [{0}]", in(reg) p, options(nostack, readonly, preserves_flags))
        } else {
            std::arch::asm!("prfm pldl1keep, [{0}]", in(reg) p, options(nostack, readonly, preserves_flags))
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A successful completion of command `cid` of submission queue 1.
    fn success(cid: u16) -> Pending {
        Pending {
            dw0: 0,
            sqhd: 0,
            sqid: 1,
            cid,
            status: Status::SUCCESS,
        }
    }

    /// How many entries a fetch takes.
    fn fetched(sq: &Sq, mem: &GuestMemoryMmap, db: &Doorbells) -> Result<usize, Fatal> {
        let mut out = Vec::new();
        fetch(sq, mem, db, 64, &mut out).map(|()| out.len())
    }

    /// A queue is read and written through one lookup of its ring when the ring lies in one
    /// mapped region, and entry by entry when it spans two: both ways give the same entries,
    /// and the wrap goes back to the first.
    #[test]
    fn queues_across_two_mapped_regions_read_and_write_the_same_entries() {
        // Two regions that meet at 0x1000: a ring at 0xF80 spans both.
        let mem = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(0x1000), 0x1000),
        ])
        .unwrap();
        assert!(mem.get_slice(GuestAddress(0xF80), 0x100).is_err());
        assert!(mem.get_slice(GuestAddress(0xFC0), 0x80).is_err());
        let mut page = vec![0u32; DOORBELL_SLOTS];
        // SAFETY: `page` outlives `db` and holds DOORBELL_SLOTS aligned u32s.
        let db = unsafe { Doorbells::new(page.as_mut_ptr() as *mut u8) };
        // (submission ring, completion ring): both spanning the two regions, then both in one.
        for (base, cq_base) in [(0xF80u64, 0xFC0u64), (0x1400, 0x1800)] {
            let sq = Sq {
                qid: 1,
                base,
                size: 4,
                cqid: 1,
                head: Mutex::new(0),
                retired: AtomicBool::new(false),
            };
            for i in 0..4u64 {
                mem.write_obj(0xA0 + i as u8, GuestAddress(base + i * SQE_LEN + 1))
                    .unwrap();
            }
            // Three entries, then two more across the wrap.
            let mut out = Vec::new();
            db.store(2 * 4, &3u32.to_le_bytes());
            fetch(&sq, &mem, &db, 64, &mut out).unwrap();
            let seen: Vec<(u16, u8)> = out.iter().map(|(hd, e)| (*hd, e[1])).collect();
            assert_eq!(seen, [(1, 0xA0), (2, 0xA1), (3, 0xA2)], "ring at {base:#x}");
            db.store(2 * 4, &1u32.to_le_bytes());
            fetch(&sq, &mem, &db, 64, &mut out).unwrap();
            let seen: Vec<(u16, u8)> = out.iter().map(|(hd, e)| (*hd, e[1])).collect();
            assert_eq!(seen, [(0, 0xA3), (1, 0xA0)], "ring at {base:#x}");
            // Completions: five through a queue of 8 (16 bytes each).
            let cq = Cq::new(1, cq_base, 8, 0, false);
            for cid in 0..5 {
                assert_eq!(cq.post(&mem, &db, success(cid)).unwrap(), 1);
            }
            for i in 0..5u64 {
                let dw3 = mem
                    .read_obj::<u32>(GuestAddress(cq.base + i * CQE_LEN + 12))
                    .unwrap();
                assert_eq!((dw3 & 0xFFFF, dw3 >> 16 & 1), (i as u32, 1));
            }
        }
    }

    /// Held back, a queue's completions are written a cache line (four entries) at a time,
    /// the rest by `HeldBack::post`; another queue's are written at once, and once the hold
    /// ends (dropped) each completion is written as it comes again.
    #[test]
    fn held_back_completions_are_written_a_cache_line_at_a_time() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mut page = vec![0u32; DOORBELL_SLOTS];
        // SAFETY: `page` outlives `db` and holds DOORBELL_SLOTS aligned u32s.
        let db = unsafe { Doorbells::new(page.as_mut_ptr() as *mut u8) };
        let cq = Arc::new(Cq::new(1, 0x1000, 16, 0, true));
        let other = Cq::new(2, 0x2000, 16, 0, true);
        let c = success;
        // The phase tag of entry i: 1 once written (first pass through the queue).
        let phase = |base: u64, i: u64| {
            mem.read_obj::<u32>(GuestAddress(base + i * 16 + 12))
                .unwrap()
                >> 16
                & 1
        };
        let written = |base: u64| (0..16).filter(|&i| phase(base, i) == 1).count();
        // Entry 1 first, so the first line is filled by entries 1-3.
        cq.post(&mem, &db, c(0)).unwrap();
        let held = HeldBack::begin(&cq, &mem, 0);
        assert_eq!(cq.post(&mem, &db, c(1)).unwrap(), 0);
        assert_eq!(cq.post(&mem, &db, c(2)).unwrap(), 0);
        assert_eq!(written(0x1000), 1, "held back until the line is full");
        assert_eq!(
            other.post(&mem, &db, c(9)).unwrap(),
            1,
            "another queue is not held"
        );
        assert_eq!(
            cq.post(&mem, &db, c(3)).unwrap(),
            3,
            "the line is full: 1 to 3"
        );
        assert_eq!(written(0x1000), 4);
        for cid in 4..7 {
            assert_eq!(cq.post(&mem, &db, c(cid)).unwrap(), 0);
        }
        assert_eq!(written(0x1000), 4);
        assert_eq!(held.post(&mem, &db).unwrap(), 3, "what the line held");
        assert_eq!(written(0x1000), 7);
        // In order: entry i holds command i.
        for i in 0..7 {
            let dw3 = mem
                .read_obj::<u32>(GuestAddress(0x1000 + i * 16 + 12))
                .unwrap();
            assert_eq!(dw3 & 0xFFFF, i as u32);
        }
        // The hold is over: each completion is written at once.
        assert_eq!(cq.post(&mem, &db, c(7)).unwrap(), 1);
        // A hold dropped without `post` ends too; nothing it held is lost (the next pass's
        // flush posts it).
        let held = HeldBack::begin(&cq, &mem, 0);
        assert_eq!(cq.post(&mem, &db, c(8)).unwrap(), 0);
        drop(held);
        assert_eq!(written(0x1000), 8);
        assert_eq!(cq.flush(&mem, &db).unwrap(), 1);
        assert_eq!(cq.post(&mem, &db, c(9)).unwrap(), 1);
        assert_eq!(written(0x1000), 10);
        // Nothing held: `post` has nothing to write.
        assert_eq!(HeldBack::begin(&cq, &mem, 0).post(&mem, &db).unwrap(), 0);
        // Entries held when the queue is deleted are never written: its memory is the
        // host's again.
        let held = HeldBack::begin(&cq, &mem, 0);
        assert_eq!(cq.post(&mem, &db, c(10)).unwrap(), 0);
        cq.retire();
        assert_eq!(held.post(&mem, &db).unwrap(), 0);
        assert_eq!(written(0x1000), 10);
    }

    #[test]
    fn completions_wrap_with_the_phase_and_wait_when_the_queue_is_full() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mut page = vec![0u32; DOORBELL_SLOTS];
        // SAFETY: `page` outlives `db` and holds DOORBELL_SLOTS aligned u32s.
        let db = unsafe { Doorbells::new(page.as_mut_ptr() as *mut u8) };
        let cq = Cq::new(1, 0x1000, 4, 0, true);
        let c = success;
        for cid in 0..5 {
            cq.post(&mem, &db, c(cid)).unwrap();
        }
        // Size 4 holds 3 before the host moves its head; the rest wait.
        let dw3 = |i: u64| {
            mem.read_obj::<u32>(GuestAddress(0x1000 + i * 16 + 12))
                .unwrap()
        };
        assert_eq!(
            (0..3).map(|i| dw3(i) >> 16 & 1).collect::<Vec<_>>(),
            [1, 1, 1]
        );
        assert_eq!(dw3(3), 0);
        db.store(3 * 4, &3u32.to_le_bytes());
        assert_eq!(cq.flush(&mem, &db).unwrap(), 2);
        // Entry 3, then entry 0 again with the phase flipped.
        assert_eq!((dw3(3) & 0xFFFF, dw3(3) >> 16 & 1), (3, 1));
        assert_eq!((dw3(0) & 0xFFFF, dw3(0) >> 16 & 1), (4, 0));
        // A head doorbell beyond the size is fatal.
        db.store(3 * 4, &9u32.to_le_bytes());
        assert_eq!(cq.flush(&mem, &db), Err(Fatal::Doorbell));
        let sq = Sq {
            qid: 1,
            base: 0x2000,
            size: 8,
            cqid: 1,
            head: Mutex::new(0),
            retired: AtomicBool::new(false),
        };
        let mut out = Vec::new();
        db.store(2 * 4, &8u32.to_le_bytes());
        assert_eq!(fetch(&sq, &mem, &db, 64, &mut out), Err(Fatal::Doorbell));
        db.store(2 * 4, &2u32.to_le_bytes());
        fetch(&sq, &mem, &db, 64, &mut out).unwrap();
        assert_eq!(out.len(), 2);
        // A retired completion queue takes nothing more.
        cq.retire();
        db.store(3 * 4, &0u32.to_le_bytes());
        assert_eq!(cq.post(&mem, &db, c(10)), Ok(0));
    }

    /// The backlog the adaptive poller reads: entries posted that the host has not
    /// consumed (its head doorbell), as of the last post.
    #[test]
    fn the_backlog_counts_completions_the_host_has_not_consumed() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mut page = vec![0u32; DOORBELL_SLOTS];
        // SAFETY: `page` outlives `db` and holds DOORBELL_SLOTS aligned u32s.
        let db = unsafe { Doorbells::new(page.as_mut_ptr() as *mut u8) };
        let cq = Cq::new(1, 0x1000, 16, 1, false);
        let c = success;
        for cid in 0..10 {
            cq.post(&mem, &db, c(cid)).unwrap();
        }
        cq.flush(&mem, &db).unwrap();
        assert_eq!(cq.backlog(), 10);
        // The host consumed 7 (head 7); the tail wraps past the end: the queue fills up
        // to the head it last read (15 entries), the rest wait for the next pass.
        db.store(3 * 4, &7u32.to_le_bytes());
        for cid in 10..30 {
            cq.post(&mem, &db, c(cid)).unwrap();
        }
        cq.flush(&mem, &db).unwrap();
        assert_eq!(cq.backlog(), 15);
        // The host consumed all 15 (head 6): the 8 that waited are posted.
        db.store(3 * 4, &6u32.to_le_bytes());
        cq.flush(&mem, &db).unwrap();
        assert_eq!(
            cq.backlog(),
            8,
            "the waiting completions took the freed entries"
        );
    }

    /// With shadow doorbells configured, an I/O queue's doorbells are read from the host's
    /// shadow buffer and the consumed values written to its EventIdx buffer; the admin
    /// queue keeps its registers; a controller reset forgets the buffers.
    #[test]
    fn shadow_doorbells_replace_the_io_queues_registers() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mut page = vec![0u32; DOORBELL_SLOTS];
        // SAFETY: `page` outlives `db` and holds DOORBELL_SLOTS aligned u32s.
        let db = unsafe { Doorbells::new(page.as_mut_ptr() as *mut u8) };
        let (shadow, event_idx) = (0x8000u64, 0x9000u64);
        db.configure_shadow(shadow, event_idx);
        let sq = |qid| Sq {
            qid,
            base: 0x2000,
            size: 8,
            cqid: qid,
            head: Mutex::new(0),
            retired: AtomicBool::new(false),
        };
        // SQ 1: the register says 5, the shadow 3: the shadow wins.
        db.store(2 * 4, &5u32.to_le_bytes());
        mem.write_obj(3u32, GuestAddress(shadow + 2 * 4)).unwrap();
        assert_eq!(fetched(&sq(1), &mem, &db).unwrap(), 3);
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(event_idx + 2 * 4))
                .unwrap(),
            3
        );
        // The admin queue: its register.
        db.store(0, &2u32.to_le_bytes());
        mem.write_obj(6u32, GuestAddress(shadow)).unwrap();
        assert_eq!(fetched(&sq(0), &mem, &db).unwrap(), 2);
        assert_eq!(mem.read_obj::<u32>(GuestAddress(event_idx)).unwrap(), 0);
        // A shadow value beyond the queue is as fatal as a register's.
        mem.write_obj(8u32, GuestAddress(shadow + 2 * 4)).unwrap();
        assert_eq!(fetched(&sq(1), &mem, &db).unwrap_err(), Fatal::Doorbell);
        // CQ 1's head from the shadow: it frees the entries the register does not.
        let cq = Cq::new(1, 0x1000, 2, 0, true);
        let c = success(1);
        assert_eq!(cq.post(&mem, &db, c).unwrap(), 1);
        assert_eq!(cq.post(&mem, &db, c).unwrap(), 0, "a queue of 2 holds 1");
        mem.write_obj(1u32, GuestAddress(shadow + 3 * 4)).unwrap();
        assert_eq!(cq.flush(&mem, &db).unwrap(), 1);
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(event_idx + 3 * 4))
                .unwrap(),
            1
        );
        // Reset: registers again.
        db.clear();
        db.store(2 * 4, &1u32.to_le_bytes());
        assert_eq!(fetched(&sq(1), &mem, &db).unwrap(), 1);
    }
}
