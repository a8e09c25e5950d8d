//! Memory a device may reach directly: regions a frontend announces so that a transport
//! below the volumes can move request data without a bounce copy (zero copy over NVMe/RDMA).
//!
//! The vhost-user-blk frontend maps its driver's memory table and announces each region
//! here ([`register`]) for as long as the mapping is in use. A transport that needs memory
//! registered with a device (NVMe/RDMA: `ibv_reg_mr` in a protection domain) looks a
//! request's segment up ([`lookup`]) and keeps what it made for the region as an
//! *attachment* ([`Region::attachment`]): made the first time it is asked for, kept while
//! the region lives, dropped — so deregistered — only when the last holder of the region is
//! gone. A transport holds the [`Region`] for as long as a command uses it, so a memory
//! table the driver replaces mid-I/O keeps its registration until that I/O completes.
//!
//! The same range announced twice (each vhost queue worker maps the one memory table) is
//! one region with a count of announcements: one registration per memory table, not per
//! queue.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// A range of this process's memory that devices may be given.
pub struct Region {
    base: usize,
    len: usize,
    id: u64,
    /// What transports made for this region, by a key of theirs (e.g. the address of the
    /// protection domain a memory region was registered in).
    attachments: Mutex<Vec<(usize, Arc<dyn Any + Send + Sync>)>>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("id", &self.id)
            .finish()
    }
}

impl Region {
    pub fn base(&self) -> *mut u8 {
        self.base as *mut u8
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Unique for the life of the process (a range announced again after it was withdrawn
    /// is a new region).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether `ptr..ptr+len` lies inside the region.
    pub fn contains(&self, ptr: *const u8, len: usize) -> bool {
        let p = ptr as usize;
        p >= self.base && len <= self.len && p - self.base <= self.len - len
    }

    /// The attachment of `key`, made by `make` if the region has none yet; `None` if `make`
    /// fails (it is asked again next time). `make` runs under the region's lock: two
    /// threads never make the same attachment twice.
    pub fn attachment<T: Any + Send + Sync>(
        &self,
        key: usize,
        make: impl FnOnce() -> Option<T>,
    ) -> Option<Arc<T>> {
        let mut a = self.attachments.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, v)) = a.iter().find(|(k, _)| *k == key) {
            return v.clone().downcast::<T>().ok();
        }
        let v = Arc::new(make()?);
        a.push((key, v.clone()));
        Some(v)
    }

    /// Drop the attachment of `key` (its owner is going away: a protection domain is
    /// deallocated only once nothing registered in it is left).
    pub fn detach(&self, key: usize) {
        let gone: Vec<_> = {
            let mut a = self.attachments.lock().unwrap_or_else(|p| p.into_inner());
            let (gone, keep) = a.drain(..).partition(|(k, _)| *k == key);
            *a = keep;
            gone
        };
        drop(gone);
    }
}

struct Announced {
    region: Arc<Region>,
    count: usize,
}

/// Announced regions by (base, length).
static REGIONS: RwLock<BTreeMap<(usize, usize), Announced>> = RwLock::new(BTreeMap::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// An announcement of a region; withdrawn when dropped.
#[derive(Debug)]
pub struct Registration {
    region: Arc<Region>,
}

impl Registration {
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let key = (self.region.base, self.region.len);
        let mut m = REGIONS.write().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = m.get_mut(&key) {
            a.count -= 1;
            if a.count == 0 {
                m.remove(&key);
            }
        }
    }
}

/// Announce `base..base+len` as memory devices may be given, until the returned
/// registration is dropped. A transport holding the [`Region`] (from [`lookup`]) keeps only
/// its own attachments alive, never the mapping, so it must hold the region no longer than
/// the commands that use it.
///
/// # Safety
/// Announcing a range lets a transport register it with a device (`ibv_reg_mr` with remote
/// read and write access), after which a remote shelf may read and write it at any time
/// while the registration lasts, with no Rust code in between. The caller must therefore:
/// * keep `base..base+len` allocated and mapped until the returned [`Registration`] is
///   dropped (a transport uses a [`Region`] it looked up only for the commands of requests in
///   flight, whose memory the [`super::BlockDevice`] contract keeps valid);
/// * announce only memory whose every byte may be overwritten by a remote peer without
///   breaking Rust's rules: bytes no Rust reference covers, read and written only by raw
///   copies (guest memory, bounce buffers), never memory of a Rust object.
pub unsafe fn register(base: *mut u8, len: usize) -> Registration {
    let key = (base as usize, len);
    let mut m = REGIONS.write().unwrap_or_else(|p| p.into_inner());
    let a = m.entry(key).or_insert_with(|| Announced {
        region: Arc::new(Region {
            base: key.0,
            len,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            attachments: Mutex::new(Vec::new()),
        }),
        count: 0,
    });
    a.count += 1;
    Registration {
        region: a.region.clone(),
    }
}

/// The announced region holding all of `ptr..ptr+len`, if any.
pub fn lookup(ptr: *const u8, len: usize) -> Option<Arc<Region>> {
    let m = REGIONS.read().unwrap_or_else(|p| p.into_inner());
    // Regions of one process do not overlap unless one mapping replaced another at the same
    // place; a few steps back cover that.
    m.range(..=(ptr as usize, usize::MAX))
        .rev()
        .take(4)
        .map(|(_, a)| &a.region)
        .find(|r| r.contains(ptr, len))
        .cloned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_segment_is_found_only_inside_an_announced_region() {
        let mut mem = vec![0u8; 8192];
        let base = mem.as_mut_ptr();
        // SAFETY: `mem` outlives the registration, and no device is given the region.
        let r = unsafe { register(base, 8192) };
        let mid = base.wrapping_add(4096);
        assert_eq!(lookup(mid, 4096).map(|x| x.id()), Some(r.region().id()));
        assert_eq!(lookup(base, 8192).map(|x| x.id()), Some(r.region().id()));
        assert!(lookup(mid, 4097).is_none(), "runs past the end");
        assert!(lookup(base.wrapping_sub(1), 2).is_none(), "starts before");
        drop(r);
        assert!(lookup(mid, 1).is_none(), "withdrawn");
    }

    #[test]
    fn one_region_per_range_however_often_announced() {
        let mut mem = vec![0u8; 4096];
        let base = mem.as_mut_ptr();
        // SAFETY: `mem` outlives the registration, and no device is given the region.
        let a = unsafe { register(base, 4096) };
        // SAFETY: `mem` outlives the registration, and no device is given the region.
        let b = unsafe { register(base, 4096) };
        let id = a.region().id();
        assert_eq!(id, b.region().id());
        drop(a);
        assert!(lookup(base, 4096).is_some(), "still announced by b");
        drop(b);
        assert!(lookup(base, 4096).is_none());
        // SAFETY: `mem` outlives the registration, and no device is given the region.
        let c = unsafe { register(base, 4096) };
        assert_ne!(
            c.region().id(),
            id,
            "a range announced again is a new region"
        );
    }

    #[test]
    fn an_attachment_is_made_once_and_dropped_with_the_last_holder() {
        let mut mem = vec![0u8; 4096];
        let base = mem.as_mut_ptr();
        let drops = Arc::new(AtomicUsize::new(0));
        // SAFETY: `mem` outlives the registration, and no device is given the region.
        let reg = unsafe { register(base, 4096) };
        let made = AtomicUsize::new(0);
        let make = || {
            made.fetch_add(1, Ordering::SeqCst);
            Some(Counted(drops.clone()))
        };
        let held = lookup(base, 4096).unwrap();
        let x = held.attachment(7, make).unwrap();
        let y = held.attachment(7, || -> Option<Counted> { panic!("made twice") });
        assert!(Arc::ptr_eq(&x, &y.unwrap()));
        assert_eq!(made.load(Ordering::SeqCst), 1);
        // A failed make is asked again.
        assert!(held.attachment(8, || -> Option<Counted> { None }).is_none());
        drop(x);
        // Withdrawn while a transport still holds the region: the attachment lives on.
        drop(reg);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(held);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn detach_drops_one_owners_attachment() {
        let mut mem = vec![0u8; 4096];
        // SAFETY: `mem` outlives the registration, and no device is given the region.
        let reg = unsafe { register(mem.as_mut_ptr(), 4096) };
        let drops = Arc::new(AtomicUsize::new(0));
        let r = reg.region().clone();
        drop(r.attachment(1, || Some(Counted(drops.clone()))));
        drop(r.attachment(2, || Some(Counted(drops.clone()))));
        r.detach(1);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert!(r.attachment(2, || -> Option<Counted> { None }).is_some());
    }
}
