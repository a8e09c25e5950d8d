//! The RAM backend: blocks in anonymous memory, lost when nacred exits.
//!
//! The memory is an anonymous `MAP_NORESERVE` mapping, so a large RAM volume costs only the
//! pages actually written, and unwritten blocks read as zeros. Discard and Write Zeroes
//! return pages to the kernel with `MADV_DONTNEED` where whole pages are covered.
//!
//! Queues of one device run on different threads and may touch the same blocks at once, as
//! they may on a real disk; the data path copies with raw pointers under a shared lock that
//! only `resize` takes exclusively, so resizing never races a copy.

use std::sync::{Arc, RwLock};

use super::{
    copy_from_segments, copy_to_segments, BlockDevice, Geometry, IoCompletion, IoError, IoKind,
    IoRequest, IoResult,
};

struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the region is plain anonymous memory owned by this struct; concurrent access is
// coordinated by the RwLock in RamVolume (copies under read, remap under write).
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    fn map(len: usize) -> Result<Self, IoError> {
        if len == 0 {
            return Ok(Region {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len: 0,
            });
        }
        // SAFETY: anonymous private mapping with no address hint; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(IoError::from_errno(std::io::Error::last_os_error()));
        }
        Ok(Region {
            ptr: ptr as *mut u8,
            len,
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: ptr/len came from a successful mmap and are unmapped exactly once.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }
}

pub struct RamVolume {
    region: RwLock<Region>,
    block_size: u32,
}

impl RamVolume {
    pub fn new(size: u64, block_size: u32) -> Result<Self, IoError> {
        let len = usize::try_from(size).map_err(|_| IoError::Invalid("size too large"))?;
        Ok(RamVolume {
            region: RwLock::new(Region::map(len)?),
            block_size,
        })
    }

    fn zero(region: &Region, offset: usize, len: usize) {
        const PAGE: usize = 4096;
        let start = offset.next_multiple_of(PAGE).min(offset + len);
        let end = ((offset + len) / PAGE * PAGE).max(start);
        // SAFETY: offset+len <= region.len (checked by Geometry::check); the head and tail
        // are zeroed by hand and the whole pages in between are dropped, which makes them
        // read as zeros (private anonymous mapping).
        unsafe {
            std::ptr::write_bytes(region.ptr.add(offset), 0, start - offset);
            if end > start {
                libc::madvise(
                    region.ptr.add(start) as *mut libc::c_void,
                    end - start,
                    libc::MADV_DONTNEED,
                );
            }
            std::ptr::write_bytes(region.ptr.add(end), 0, offset + len - end);
        }
    }
}

// SAFETY: copies between the region and the segments run before the completion is
// reported; nothing is kept.
unsafe impl BlockDevice for RamVolume {
    fn geometry(&self) -> Geometry {
        let r = self.region.read().unwrap_or_else(|p| p.into_inner());
        Geometry {
            size: r.len as u64,
            block_size: self.block_size,
        }
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let region = self.region.read().unwrap_or_else(|p| p.into_inner());
        let geo = Geometry {
            size: region.len as u64,
            block_size: self.block_size,
        };
        let result = geo.check(&req).map(|()| {
            let off = req.offset as usize;
            let len = req.len as usize;
            match req.kind {
                IoKind::Read => {
                    // SAFETY: range checked against the region; segments in flight.
                    unsafe {
                        let src = std::slice::from_raw_parts(region.ptr.add(off), len);
                        copy_to_segments(&req.segments, 0, src);
                    }
                }
                IoKind::Write => {
                    // SAFETY: range checked against the region; segments in flight.
                    unsafe {
                        let dst = std::slice::from_raw_parts_mut(region.ptr.add(off), len);
                        copy_from_segments(&req.segments, 0, dst);
                    }
                }
                IoKind::Flush => {}
                IoKind::Discard | IoKind::WriteZeroes => Self::zero(&region, off, len),
            }
        });
        drop(region);
        done.complete(req.tag, result);
    }

    fn resize(&self, new_size: u64) -> IoResult {
        let len = usize::try_from(new_size).map_err(|_| IoError::Invalid("size too large"))?;
        let mut region = self.region.write().unwrap_or_else(|p| p.into_inner());
        let new = Region::map(len)?;
        let keep = region.len.min(len);
        // SAFETY: both regions are valid for `keep` bytes and do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(region.ptr, new.ptr, keep) };
        *region = new;
        Ok(())
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn write_read_zero_resize() {
        let v = RamVolume::new(64 << 10, 512).unwrap();
        let pat: Vec<u8> = (0..12288u32).map(|i| (i * 7 + 3) as u8).collect();
        v.write_at(4096, &pat).unwrap();
        let mut back = vec![0u8; pat.len()];
        v.read_at(4096, &mut back).unwrap();
        assert_eq!(back, pat);
        // Zero a range that is not page aligned on either side.
        v.submit_wait(IoRequest::new(IoKind::WriteZeroes, 4096 + 512, 8192, 0))
            .unwrap();
        v.read_at(4096, &mut back).unwrap();
        assert_eq!(&back[..512], &pat[..512]);
        assert!(back[512..512 + 8192].iter().all(|&b| b == 0));
        assert_eq!(&back[512 + 8192..], &pat[512 + 8192..]);
        v.resize(128 << 10).unwrap();
        assert_eq!(v.geometry().size, 128 << 10);
        let mut first = vec![0u8; 512];
        v.read_at(4096, &mut first).unwrap();
        assert_eq!(&first[..], &pat[..512]);
        assert!(matches!(
            v.read_at(128 << 10, &mut first),
            Err(IoError::OutOfRange { .. })
        ));
    }
}
