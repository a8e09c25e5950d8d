//! Physical Region Page lists (NVMe Base 2.0 §4.1.1): where a command's data lies in the
//! host's memory, walked against the memory the client mapped for DMA.
//!
//! Every page is looked up in [`GuestMemoryMmap`] before anything is read or written, so a
//! PRP entry outside the mapped memory fails the command (Data Transfer Error) instead of
//! touching anything. A transfer is at most [`limits::MAX_TRANSFER`] bytes (MDTS), which
//! bounds a PRP list to one page of entries; nacre reports CAP.MPSMIN = MPSMAX = 4 KiB.

use nacre_shared::nvme::Status;
use smallvec::SmallVec;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use super::ctrl::PRP_OFFSET_INVALID;
use crate::frontend::nvme::limits;
use crate::volume::Segment;

/// Memory page size (CC.MPS = 0).
pub const PAGE: u64 = 4096;
/// Bytes of one PRP entry.
const ENTRY: u64 = 8;

/// The host spans of one command's data, in order, each inside mapped memory.
pub type Spans = SmallVec<[Segment; 4]>;

/// Resolve a guest range to a host segment, or fail with Data Transfer Error.
pub(super) fn span(mem: &GuestMemoryMmap, addr: u64, len: u64) -> Result<Segment, Status> {
    let s = mem
        .get_slice(GuestAddress(addr), len as usize)
        .map_err(|_| Status::DATA_TRANSFER_ERROR)?;
    // SAFETY: the slice lies inside a region of `mem`; the caller keeps `mem` (and so the
    // mapping) alive until the request carrying the segment completes.
    Ok(unsafe { Segment::new(s.ptr_guard_mut().as_ptr(), len as usize) })
}

/// The spans of a `len`-byte transfer described by PRP1 and PRP2.
pub fn walk(mem: &GuestMemoryMmap, prp1: u64, prp2: u64, len: u64) -> Result<Spans, Status> {
    let mut out = Spans::new();
    if len == 0 {
        return Ok(out);
    }
    if len > limits::MAX_TRANSFER as u64 {
        return Err(Status::INVALID_FIELD);
    }
    // PRP1 may start anywhere in a page (dword aligned); it covers up to the page's end.
    if prp1 % 4 != 0 {
        return Err(PRP_OFFSET_INVALID);
    }
    let first = (PAGE - prp1 % PAGE).min(len);
    out.push(span(mem, prp1, first)?);
    let mut left = len - first;
    if left == 0 {
        return Ok(out);
    }
    if left <= PAGE {
        // PRP2 is the second (and last) data page.
        if prp2 % PAGE != 0 {
            return Err(PRP_OFFSET_INVALID);
        }
        out.push(span(mem, prp2, left)?);
        return Ok(out);
    }
    // PRP2 points to a PRP list (it may start within a page; the list then runs to that
    // page's end, whose last entry points to the next list page).
    if prp2 % ENTRY != 0 || prp2 == 0 {
        return Err(PRP_OFFSET_INVALID);
    }
    let mut list = prp2;
    // Entries still needed bound the walk: at most MDTS / 4 KiB + 1 pages of lists.
    let mut budget = limits::MAX_TRANSFER as u64 / PAGE + 2;
    while left > 0 {
        if budget == 0 {
            return Err(Status::INVALID_FIELD);
        }
        budget -= 1;
        let entries_here = (PAGE - list % PAGE) / ENTRY;
        let mut raw = [0u8; PAGE as usize];
        let n = entries_here as usize;
        let page_bytes = &mut raw[..n * ENTRY as usize];
        read_guest(mem, list, page_bytes)?;
        for i in 0..n {
            let e = u64::from_le_bytes(page_bytes[i * 8..i * 8 + 8].try_into().unwrap_or_default());
            let need = left.div_ceil(PAGE);
            if i == n - 1 && need > 1 {
                // The last entry of a list page chains to the next list page.
                if e % ENTRY != 0 || e == 0 {
                    return Err(PRP_OFFSET_INVALID);
                }
                list = e;
                break;
            }
            if e % PAGE != 0 {
                return Err(PRP_OFFSET_INVALID);
            }
            let chunk = left.min(PAGE);
            out.push(span(mem, e, chunk)?);
            left -= chunk;
            if left == 0 {
                break;
            }
        }
    }
    Ok(out)
}

/// Copy `buf.len()` bytes of guest memory at `addr` out, or fail with Data Transfer Error.
pub fn read_guest(mem: &GuestMemoryMmap, addr: u64, buf: &mut [u8]) -> Result<(), Status> {
    use vm_memory::Bytes;
    mem.read_slice(buf, GuestAddress(addr))
        .map_err(|_| Status::DATA_TRANSFER_ERROR)
}

/// Copy `data` into the transfer's spans (admin data to the host), at most the spans' total.
pub fn copy_out(spans: &Spans, data: &[u8]) {
    // SAFETY: the spans lie in mapped guest memory the caller keeps alive for this call.
    unsafe { crate::volume::copy_to_segments(spans, 0, data) }
}

/// Copy the transfer's spans into `buf` (host data for an admin or DSM command).
pub fn copy_in(spans: &Spans, buf: &mut [u8]) {
    // SAFETY: as for `copy_out`.
    unsafe { crate::volume::copy_from_segments(spans, 0, buf) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x10000), 0x40000)]).unwrap()
    }

    #[test]
    fn one_two_and_listed_pages() {
        let m = mem();
        // Within one page, with an offset.
        let s = walk(&m, 0x10100, 0, 512).unwrap();
        assert_eq!(s.len(), 1);
        // Two pages: PRP1 to the page end, PRP2 the rest.
        let s = walk(&m, 0x10800, 0x20000, 4096).unwrap();
        assert_eq!((s[0].len(), s[1].len()), (2048, 2048));
        // A list: 16 KiB at 0x11000, list at 0x30000 naming 0x12000.. 0x14000.
        let list: Vec<u8> = [0x12000u64, 0x13000, 0x14000]
            .iter()
            .flat_map(|e| e.to_le_bytes())
            .collect();
        m.write_slice(&list, GuestAddress(0x30000)).unwrap();
        let s = walk(&m, 0x11000, 0x30000, 16384).unwrap();
        assert_eq!(s.len(), 4);
        assert!(s.iter().all(|x| x.len() == 4096));
    }

    #[test]
    fn hostile_prps_fail_without_touching_memory() {
        let m = mem();
        // Outside mapped memory: PRP1, PRP2, a list, and a list entry.
        assert_eq!(
            walk(&m, 0x1000, 0, 512).unwrap_err(),
            Status::DATA_TRANSFER_ERROR
        );
        assert_eq!(
            walk(&m, 0x10000, 0x900000, 8192).unwrap_err(),
            Status::DATA_TRANSFER_ERROR
        );
        assert_eq!(
            walk(&m, 0x10000, 0x900000, 16384).unwrap_err(),
            Status::DATA_TRANSFER_ERROR
        );
        m.write_slice(&0xdead_0000u64.to_le_bytes(), GuestAddress(0x30000))
            .unwrap();
        assert_eq!(
            walk(&m, 0x10000, 0x30000, 16384).unwrap_err(),
            Status::DATA_TRANSFER_ERROR
        );
        // A zero list pointer, misaligned entries, an oversized transfer.
        assert_eq!(walk(&m, 0x10000, 0, 16384).unwrap_err(), PRP_OFFSET_INVALID);
        assert_eq!(walk(&m, 0x10002, 0, 16).unwrap_err(), PRP_OFFSET_INVALID);
        assert_eq!(
            walk(&m, 0x10000, 0x20010, 8192).unwrap_err(),
            PRP_OFFSET_INVALID
        );
        let too_big = limits::MAX_TRANSFER as u64 + 4096;
        assert_eq!(
            walk(&m, 0x10000, 0x30000, too_big).unwrap_err(),
            Status::INVALID_FIELD
        );
        // A range straddling the end of the mapping.
        assert_eq!(
            walk(&m, 0x4FF00, 0, 512).unwrap_err(),
            Status::DATA_TRANSFER_ERROR
        );
    }
}
