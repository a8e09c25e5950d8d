//! Host access to one split virtqueue (§2.7): the descriptor table, the available and used
//! rings, and the walk from the available heads to descriptor chains, indirect tables
//! included (§2.7.5–§2.7.7).

use std::sync::atomic::{AtomicU16, Ordering};

use tracing::{error, warn};
use virtio_bindings::bindings::virtio_ring::{
    VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use virtio_queue::{Queue, QueueT};

use super::QueueWorker;
use crate::frontend::vhost_user_blk::guest::GuestMap;
use crate::frontend::vhost_user_blk::request::Desc;
use crate::telemetry::Recorder;

/// Entries an indirect table may hold: the largest split ring (§2.7: Queue Size ≤ 32768).
const MAX_INDIRECT: u32 = 32768;

/// Descriptor `i` of a table (§2.7.5: le64 addr, le32 len, le16 flags, le16 next), copied
/// once so a concurrent driver write cannot make the fields inconsistent later.
///
/// # Safety
/// `table + 16 * i .. + 16` must be mapped guest memory.
unsafe fn read_desc(table: *const u8, i: u32) -> (u64, u32, u16, u16) {
    let mut raw = [0u8; 16];
    // SAFETY: the caller guarantees the 16 bytes are mapped.
    unsafe { std::ptr::copy_nonoverlapping(table.add(16 * i as usize), raw.as_mut_ptr(), 16) };
    let mut a = [0u8; 8];
    a.copy_from_slice(&raw[0..8]);
    (
        u64::from_le_bytes(a),
        u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]),
        u16::from_le_bytes([raw[12], raw[13]]),
        u16::from_le_bytes([raw[14], raw[15]]),
    )
}

/// Host pointers to one split virtqueue's three parts (§2.7), valid for one batch.
pub(super) struct Rings {
    size: u16,
    desc: *const u8,
    avail: *const u8,
    used: *mut u8,
}

impl Rings {
    pub(super) fn new(map: &GuestMap, q: &Queue) -> Option<Self> {
        let size = q.size();
        if size == 0 || !size.is_power_of_two() {
            return None;
        }
        let n = u64::from(size);
        let desc = map.ptr(q.desc_table(), 16 * n)?;
        let avail = map.ptr(q.avail_ring(), 6 + 2 * n)?;
        let used = map.ptr(q.used_ring(), 6 + 8 * n)?;
        // §2.7: alignment 16 / 2 / 4. Atomic u16 accesses below rely on it.
        if desc as usize % 16 != 0 || avail as usize % 2 != 0 || used as usize % 4 != 0 {
            return None;
        }
        Some(Rings {
            size,
            desc,
            avail,
            used,
        })
    }

    /// The le16 field at `p` as an atomic (the driver writes these fields concurrently).
    ///
    /// # Safety
    /// `p` must be 2-byte aligned and point at a 16-bit field inside one of this value's
    /// rings (so mapped for as long as `self` is used, `GuestMap` holding the mapping), and
    /// nothing may access those two bytes non-atomically while the reference lives.
    unsafe fn atomic16(&self, p: *const u8) -> &AtomicU16 {
        // SAFETY: aligned, mapped and only accessed atomically (caller); AtomicU16 has the
        // size and alignment of u16.
        unsafe { &*(p as *const AtomicU16) }
    }

    /// avail->idx, with acquire: the ring entries it covers are visible after it.
    pub(super) fn avail_idx(&self) -> u16 {
        // SAFETY: offset 2 is inside the checked avail ring; even offsets of a 2-byte aligned
        // ring (checked in `new`), and these fields are only ever accessed atomically here.
        u16::from_le(unsafe { self.atomic16(self.avail.add(2)) }.load(Ordering::Acquire))
    }

    fn avail_entry(&self, i: u16) -> u16 {
        let off = 4 + 2 * usize::from(i % self.size);
        // SAFETY: an entry of the checked avail ring, at an even offset (see `avail_idx`).
        u16::from_le(unsafe { self.atomic16(self.avail.add(off)) }.load(Ordering::Relaxed))
    }

    /// used_event, after the avail ring entries (§2.7.10).
    pub(super) fn used_event(&self) -> u16 {
        let off = 4 + 2 * usize::from(self.size);
        // SAFETY: inside the checked avail ring (6 + 2 * size bytes), even offset.
        u16::from_le(unsafe { self.atomic16(self.avail.add(off)) }.load(Ordering::Relaxed))
    }

    /// (addr, len, flags, next) of descriptor `i` (< size).
    fn desc(&self, i: u16) -> (u64, u32, u16, u16) {
        // SAFETY: callers pass i < size, so the 16 bytes are inside the checked table.
        unsafe { read_desc(self.desc, u32::from(i)) }
    }

    pub(super) fn set_used_flags(&self, v: u16) {
        // SAFETY: offset 0 of the checked used ring; 4-byte aligned (checked in `new`).
        unsafe { self.atomic16(self.used) }.store(v.to_le(), Ordering::Relaxed);
    }

    pub(super) fn set_used_elem(&self, idx: u16, head: u16, len: u32) {
        let off = 4 + 8 * usize::from(idx % self.size);
        let mut raw = [0u8; 8];
        raw[0..4].copy_from_slice(&u32::from(head).to_le_bytes());
        raw[4..8].copy_from_slice(&len.to_le_bytes());
        // SAFETY: inside the checked used ring.
        unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr(), self.used.add(off), 8) };
    }

    /// used->idx, with release: the elements before it are visible first (§2.7.8).
    pub(super) fn set_used_idx(&self, v: u16) {
        // SAFETY: offset 2 is inside the checked used ring (4-byte aligned); only accessed
        // atomically.
        unsafe { self.atomic16(self.used.add(2)) }.store(v.to_le(), Ordering::Release);
    }

    /// avail_event, after the used ring elements (§2.7.10).
    pub(super) fn set_avail_event(&self, v: u16) {
        let off = 4 + 8 * usize::from(self.size);
        // SAFETY: inside the checked used ring (6 + 8 * size bytes), even offset; the used
        // elements written by raw copies lie before it.
        unsafe { self.atomic16(self.used.add(off)) }.store(v.to_le(), Ordering::Relaxed);
    }
}

impl QueueWorker {
    /// Process the chains made available up to `avail_idx` (a snapshot of avail->idx).
    /// Returns false when the index is impossible (more chains than the queue holds).
    pub(super) fn pop_all(
        &mut self,
        rings: &Rings,
        queue: &mut Queue,
        avail_idx: u16,
        rec: Option<&Recorder>,
    ) -> bool {
        let size = rings.size;
        let mut next = queue.next_avail();
        if avail_idx.wrapping_sub(next) > size {
            error!(
                avail_idx,
                next, "virtio-blk: driver published more chains than the queue holds"
            );
            return false;
        }
        while next != avail_idx {
            let head = rings.avail_entry(next);
            next = next.wrapping_add(1);
            if head >= size {
                warn!(
                    head,
                    "virtio-blk: available head beyond the queue size; skipped"
                );
                continue;
            }
            match self.collect_chain(rings, head) {
                Ok(()) => self.handle_chain(head, rec),
                Err(reason) => {
                    warn!(
                        head,
                        reason, "virtio-blk: malformed descriptor chain dropped"
                    );
                    self.used.push((head, 0));
                }
            }
        }
        queue.set_next_avail(next);
        true
    }

    /// Walk a chain (§2.7.5) into `self.descs`, refusing loops. A chain whose head refers to
    /// an indirect table (§2.7.5.3, VIRTIO_RING_F_INDIRECT_DESC) is walked inside the table:
    /// Linux puts a whole request there, so long requests take one ring slot. As in QEMU,
    /// only the head may be indirect; the spec forbids INDIRECT with NEXT and nested tables
    /// (§2.7.5.3.1), and such chains are dropped like any other malformed one.
    fn collect_chain(&mut self, rings: &Rings, head: u16) -> Result<(), &'static str> {
        self.descs.clear();
        let (addr, len, flags, _) = rings.desc(head);
        if flags & VRING_DESC_F_INDIRECT as u16 != 0 {
            if flags & VRING_DESC_F_NEXT as u16 != 0 {
                return Err("indirect descriptor with NEXT set");
            }
            if len == 0 || len % 16 != 0 || len / 16 > MAX_INDIRECT {
                return Err("indirect table length is not a multiple of 16 within bounds");
            }
            let table = self
                .map()
                .ptr(addr, u64::from(len))
                .ok_or("indirect table outside guest memory")?;
            if table as usize % 16 != 0 {
                return Err("indirect table not 16-byte aligned");
            }
            let n = len / 16;
            return Self::walk(&mut self.descs, 0, n, true, |i| {
                // SAFETY: i < n and the table's n * 16 bytes were checked to lie in one
                // mapped guest region, which stays mapped while the worker runs.
                unsafe { read_desc(table, i) }
            });
        }
        Self::walk(
            &mut self.descs,
            u32::from(head),
            u32::from(rings.size),
            false,
            |i| rings.desc(i as u16),
        )
    }

    /// Follow NEXT links from `start` through a table of `n` descriptors (the ring's
    /// descriptor table, or an indirect table), at most `n` steps.
    fn walk(
        descs: &mut Vec<Desc>,
        start: u32,
        n: u32,
        indirect: bool,
        desc: impl Fn(u32) -> (u64, u32, u16, u16),
    ) -> Result<(), &'static str> {
        let mut i = start;
        let mut ttl = n;
        loop {
            let (addr, len, flags, next) = desc(i);
            if flags & VRING_DESC_F_INDIRECT as u16 != 0 {
                return Err(if indirect {
                    "nested indirect descriptor"
                } else {
                    "indirect descriptor not at the head of the chain"
                });
            }
            descs.push(Desc {
                addr,
                len,
                writable: flags & VRING_DESC_F_WRITE as u16 != 0,
            });
            if flags & VRING_DESC_F_NEXT as u16 == 0 {
                return Ok(());
            }
            ttl -= 1;
            if ttl == 0 {
                return Err("descriptor chain longer than its table (a loop?)");
            }
            if u32::from(next) >= n {
                return Err("next descriptor index beyond its table");
            }
            i = u32::from(next);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: u16 = 8;
    const DESC: usize = 0;
    const AVAIL: usize = 16 * SIZE as usize;
    const USED: usize = 256;
    const BYTES: usize = USED + 6 + 8 * SIZE as usize;

    /// Plain process memory laid out like a queue's three parts; every access, the test's
    /// included, goes through the one raw pointer (as guest memory is reached).
    struct Mem {
        buf: Vec<u64>,
    }

    impl Mem {
        fn new() -> Self {
            Mem {
                buf: vec![0; BYTES.div_ceil(8)],
            }
        }
        fn rings(&mut self) -> (Rings, *mut u8) {
            let base = self.buf.as_mut_ptr() as *mut u8;
            // SAFETY: DESC, AVAIL and USED lie inside the buffer (BYTES) with their sizes.
            let r = unsafe {
                Rings {
                    size: SIZE,
                    desc: base.add(DESC),
                    avail: base.add(AVAIL),
                    used: base.add(USED),
                }
            };
            (r, base)
        }
    }

    fn put(base: *mut u8, off: usize, b: &[u8]) {
        assert!(off + b.len() <= BYTES);
        // SAFETY: inside the test's buffer (checked above).
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), base.add(off), b.len()) };
    }

    fn get(base: *mut u8, off: usize, n: usize) -> Vec<u8> {
        assert!(off + n <= BYTES);
        let mut v = vec![0; n];
        // SAFETY: inside the test's buffer (checked above).
        unsafe { std::ptr::copy_nonoverlapping(base.add(off), v.as_mut_ptr(), n) };
        v
    }

    #[test]
    fn ring_fields_are_read_and_written_at_their_little_endian_offsets() {
        let mut mem = Mem::new();
        let (rings, base) = mem.rings();
        // Descriptor 3: addr, len, flags, next (§2.7.5).
        let mut d = Vec::new();
        d.extend_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        d.extend_from_slice(&512u32.to_le_bytes());
        d.extend_from_slice(&1u16.to_le_bytes());
        d.extend_from_slice(&4u16.to_le_bytes());
        put(base, DESC + 16 * 3, &d);
        assert_eq!(rings.desc(3), (0x1122_3344_5566_7788, 512, 1, 4));
        // avail: flags, idx, ring[SIZE], used_event (§2.7.6, §2.7.10).
        put(base, AVAIL + 2, &9u16.to_le_bytes());
        put(base, AVAIL + 4 + 2, &5u16.to_le_bytes()); // ring[1]
        put(base, AVAIL + 4 + 2 * SIZE as usize, &7u16.to_le_bytes());
        assert_eq!(rings.avail_idx(), 9);
        assert_eq!(rings.avail_entry(1), 5);
        assert_eq!(
            rings.avail_entry(1 + SIZE),
            5,
            "indices wrap at the queue size"
        );
        assert_eq!(rings.used_event(), 7);
        // used: flags, idx, ring[SIZE] of (id, len), avail_event (§2.7.8, §2.7.10).
        rings.set_used_flags(1);
        rings.set_used_elem(SIZE + 2, 6, 4096);
        rings.set_used_idx(0x1234);
        rings.set_avail_event(3);
        assert_eq!(get(base, USED, 4), [1, 0, 0x34, 0x12]);
        assert_eq!(get(base, USED + 4 + 8 * 2, 8), [6, 0, 0, 0, 0, 0x10, 0, 0]);
        assert_eq!(get(base, USED + 4 + 8 * SIZE as usize, 2), [3, 0]);
    }
}
