//! A flat host view of the driver's memory table, for the data path.
//!
//! vm-memory's generic accessors (region lookup, slice iterators, error plumbing) cost more
//! per request than the rest of the frontend together; a request touches guest memory five
//! or six times (avail entry, descriptors, header, data, status, used entry). A `GuestMap` is
//! a snapshot of the (few) mapped regions as `(guest start, length, host address)` built once
//! per memory table, and translates a guest range with one short scan. It holds the mapping
//! (`Arc<Mem>`), so every pointer it returns stays valid while the map lives.
//!
//! While a map lives its regions are announced to [`crate::volume::dma`]: a transport below
//! the volumes (NVMe/RDMA) may then register the guest's memory with its device once per
//! memory table and move request data straight to and from the guest's buffers.

use std::sync::Arc;

use smallvec::SmallVec;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use super::request::Mem;
use crate::volume::dma;

#[derive(Debug, Clone, Copy)]
struct Region {
    start: u64,
    len: u64,
    host: *mut u8,
}

pub struct GuestMap {
    regions: SmallVec<[Region; 8]>,
    /// Withdrawn before `mem` lets the mapping go (fields drop in order).
    _announced: SmallVec<[dma::Registration; 8]>,
    mem: Arc<Mem>,
}

impl GuestMap {
    pub fn new(mem: Arc<Mem>) -> Self {
        let regions: SmallVec<[Region; 8]> = mem
            .iter()
            .filter_map(|r| {
                let host = r.get_host_address(MemoryRegionAddress(0)).ok()?;
                Some(Region {
                    start: r.start_addr().0,
                    len: r.len(),
                    host,
                })
            })
            .collect();
        let announced = regions
            .iter()
            // SAFETY: guest memory, mapped for as long as `mem` (kept in this map beside the
            // registrations, which drop first) and only ever reached by raw copies, never
            // through a Rust reference: a remote peer writing it is no different from the
            // guest doing so.
            .map(|r| unsafe { dma::register(r.host, r.len as usize) })
            .collect();
        GuestMap {
            regions,
            _announced: announced,
            mem,
        }
    }

    /// The memory table this map was built from.
    pub fn mem(&self) -> &Arc<Mem> {
        &self.mem
    }

    /// Host address of guest range `addr..addr+len`, if it lies inside one region.
    #[inline]
    pub fn ptr(&self, addr: u64, len: u64) -> Option<*mut u8> {
        for r in &self.regions {
            let off = addr.wrapping_sub(r.start);
            if off < r.len {
                if len > r.len - off {
                    return None;
                }
                // SAFETY: off < r.len, so the result stays inside the mapped region.
                return Some(unsafe { r.host.add(off as usize) });
            }
        }
        None
    }

    /// Copy guest bytes out (the driver may change them concurrently: callers copy once and
    /// use the copy).
    #[inline]
    pub fn read(&self, addr: u64, out: &mut [u8]) -> bool {
        match self.ptr(addr, out.len() as u64) {
            Some(p) => {
                // SAFETY: `p..p+out.len()` is mapped guest memory (checked above), held by
                // `self.mem`; `out` is a distinct local buffer.
                unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
                true
            }
            None => false,
        }
    }
}
