//! Scatter Gather Lists (NVMe Base 2.0 §4.1.2): the other way an I/O command's Data
//! Pointer says where its data lies in the host's memory, walked against the memory the
//! client mapped for DMA into the same spans as a PRP walk; and [`data_pointer`], which
//! reads PSDT (Command Dword 0 bits 15:14) and walks PRPs or an SGL.
//!
//! What nacre accepts (Identify Controller SGLS = 0004_0001h: bits 1:0 = 01b and bit 18,
//! as the target core reports for PCIe controllers): SGLs on I/O commands only (the
//! specification forbids them on PCIe admin commands, which are refused with Invalid Field),
//! PSDT = 01b (SGL, no metadata: MPTR is not read); SGL Data Block descriptors with the
//! Address subtype, byte aligned and byte granular; SGL Segment and SGL Last Segment
//! descriptors chaining segments of descriptors (each a qword aligned list in the host's
//! memory); descriptors that describe more than the command moves (SGLS bit 18: the
//! excess is ignored and never read). Bit Bucket descriptors are refused (SGL Descriptor
//! Type Invalid) and not advertised, as are Keyed and Transport Data Blocks (fabrics only).
//!
//! A hostile SGL costs bounded work and never memory outside the mapping: every data block
//! and segment is looked up in [`GuestMemoryMmap`] before it is read or written (Data
//! Transfer Error otherwise); a command reads at most [`MAX_DESCRIPTORS`] descriptors,
//! whatever the chain (a segment pointing at itself included), else Invalid Number of SGL
//! Descriptors; a transfer is at most [`limits::MAX_TRANSFER`] bytes (Invalid Field).

use nacre_shared::nvme::{Command, SglDescriptor, Status};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use super::prp::{self, Spans};
use crate::frontend::nvme::limits;

/// PSDT (Command Dword 0 bits 15:14, byte 1 bits 7:6).
const PSDT_MASK: u8 = 0xC0;
const PSDT_PRP: u8 = 0x00;
/// SGLs, MPTR the address of a contiguous metadata buffer (which nacre does not read: no
/// namespace format has metadata).
const PSDT_SGL_MPTR_CONTIG: u8 = 0x40;

/// SGL Descriptor Type (byte 15 bits 7:4, Figure 120).
const TYPE_DATA_BLOCK: u8 = 0x0;
const TYPE_SEGMENT: u8 = 0x2;
const TYPE_LAST_SEGMENT: u8 = 0x3;
/// SGL Descriptor Subtype (byte 15 bits 3:0, Figure 121): Address.
const SUBTYPE_ADDRESS: u8 = 0x0;
/// Bytes of one SGL descriptor.
const DESCRIPTOR: u64 = 16;

/// The most descriptors one command's SGL may hold, segment descriptors included: a
/// 128 KiB transfer in 512-byte blocks, each its own descriptor, with room to chain.
pub const MAX_DESCRIPTORS: u32 = 512;

/// Invalid Number of SGL Descriptors (generic status 0Eh).
pub const INVALID_NUMBER_OF_SGL_DESCRIPTORS: Status = Status::new(0, 0x0E, true);

/// The spans of a `len`-byte transfer described by command `c`'s Data Pointer: PRP1 and
/// PRP2 (`prp1`, `prp2`) or the SGL descriptor in bytes 24-39, as PSDT says.
pub fn data_pointer(
    mem: &GuestMemoryMmap,
    c: &Command,
    prp1: u64,
    prp2: u64,
    len: u64,
) -> Result<Spans, Status> {
    match c.flags & PSDT_MASK {
        PSDT_PRP => prp::walk(mem, prp1, prp2, len),
        PSDT_SGL_MPTR_CONTIG => walk(mem, c.sgl, len),
        // 10b (MPTR holds an SGL descriptor: SGLS bit 19 is clear) and 11b (reserved).
        _ => Err(Status::INVALID_FIELD),
    }
}

/// The spans of a `len`-byte transfer described by the SGL whose first descriptor (SGL
/// Entry 1 of the command) is `first`.
pub fn walk(mem: &GuestMemoryMmap, first: SglDescriptor, len: u64) -> Result<Spans, Status> {
    let mut out = Spans::new();
    if len == 0 {
        return Ok(out);
    }
    if len > limits::MAX_TRANSFER as u64 {
        return Err(Status::INVALID_FIELD);
    }
    let mut left = len;
    let mut budget = MAX_DESCRIPTORS - 1;
    let mut seg = match first.kind >> 4 {
        TYPE_DATA_BLOCK => {
            data_block(mem, &first, &mut left, &mut out)?;
            return finished(left, out);
        }
        TYPE_SEGMENT | TYPE_LAST_SEGMENT => first,
        _ => return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
    };
    // Each pass reads one segment: its descriptors, the last of which may chain on.
    loop {
        if seg.kind & 0xF != SUBTYPE_ADDRESS {
            return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID);
        }
        let last = seg.kind >> 4 == TYPE_LAST_SEGMENT;
        if seg.len == 0 || seg.len as u64 % DESCRIPTOR != 0 || seg.addr % 8 != 0 {
            return Err(Status::INVALID_SGL_DESCRIPTOR);
        }
        let n = (seg.len as u64 / DESCRIPTOR) as u32;
        if n > budget {
            return Err(INVALID_NUMBER_OF_SGL_DESCRIPTORS);
        }
        budget -= n;
        let mut next = None;
        // The segment in pages' worth of descriptors, each read only if still needed.
        let mut raw = [0u8; 4096];
        let mut i = 0u32;
        while i < n && left > 0 {
            let here = (n - i).min(raw.len() as u32 / DESCRIPTOR as u32);
            let bytes = &mut raw[..(here as u64 * DESCRIPTOR) as usize];
            let at = seg
                .addr
                .checked_add(i as u64 * DESCRIPTOR)
                .ok_or(Status::DATA_TRANSFER_ERROR)?;
            prp::read_guest(mem, at, bytes)?;
            for d in bytes.chunks_exact(DESCRIPTOR as usize) {
                let d = SglDescriptor::decode(d);
                let is_last = i == n - 1;
                i += 1;
                match d.kind >> 4 {
                    TYPE_DATA_BLOCK => data_block(mem, &d, &mut left, &mut out)?,
                    // Only the last descriptor of a segment that is not the last segment
                    // may chain to another.
                    TYPE_SEGMENT | TYPE_LAST_SEGMENT if is_last && !last => next = Some(d),
                    TYPE_SEGMENT | TYPE_LAST_SEGMENT => return Err(Status::INVALID_SGL_DESCRIPTOR),
                    _ => return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
                }
                if left == 0 {
                    break;
                }
            }
        }
        match next {
            Some(d) if left > 0 => seg = d,
            _ => return finished(left, out),
        }
    }
}

/// The walk ended: the descriptors covered the transfer, or Data SGL Length Invalid.
fn finished(left: u64, out: Spans) -> Result<Spans, Status> {
    if left > 0 {
        return Err(Status::DATA_SGL_LENGTH_INVALID);
    }
    Ok(out)
}

/// Take what is still needed of the transfer from Data Block descriptor `d`: its range, cut
/// where it crosses from one mapped region into the next.
fn data_block(
    mem: &GuestMemoryMmap,
    d: &SglDescriptor,
    left: &mut u64,
    out: &mut Spans,
) -> Result<(), Status> {
    if d.kind & 0xF != SUBTYPE_ADDRESS {
        return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID);
    }
    let mut want = (d.len as u64).min(*left);
    let mut addr = d.addr;
    addr.checked_add(want).ok_or(Status::DATA_TRANSFER_ERROR)?;
    while want > 0 {
        let r = mem
            .find_region(GuestAddress(addr))
            .ok_or(Status::DATA_TRANSFER_ERROR)?;
        // Bytes from `addr` to the region's end (its last byte included).
        let in_region = (r.last_addr().0 - addr).saturating_add(1);
        let take = want.min(in_region);
        out.push(prp::span(mem, addr, take)?);
        addr += take;
        want -= take;
        *left -= take;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    const BASE: u64 = 0x10000;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(BASE), 0x40000)]).unwrap()
    }

    fn desc(kind: u8, addr: u64, len: u32) -> SglDescriptor {
        SglDescriptor {
            addr,
            len,
            kind: kind << 4,
        }
    }

    fn put(m: &GuestMemoryMmap, at: u64, ds: &[SglDescriptor]) {
        let mut b = vec![0u8; ds.len() * 16];
        for (d, c) in ds.iter().zip(b.chunks_exact_mut(16)) {
            d.encode(c);
        }
        m.write_slice(&b, GuestAddress(at)).unwrap();
    }

    fn lens(s: &Spans) -> Vec<usize> {
        s.iter().map(|x| x.len()).collect()
    }

    #[test]
    fn data_blocks_segments_and_last_segments() {
        let m = mem();
        // One Data Block in the command, byte aligned, longer than the transfer.
        let s = walk(&m, desc(TYPE_DATA_BLOCK, BASE + 3, 8192), 4096).unwrap();
        assert_eq!(lens(&s), [4096]);
        // A Last Segment of three blocks (one of zero length).
        put(
            &m,
            0x30000,
            &[
                desc(TYPE_DATA_BLOCK, BASE, 1000),
                desc(TYPE_DATA_BLOCK, BASE + 0x8000, 0),
                desc(TYPE_DATA_BLOCK, BASE + 0x9001, 3096),
            ],
        );
        let s = walk(&m, desc(TYPE_LAST_SEGMENT, 0x30000, 48), 4096).unwrap();
        assert_eq!(lens(&s), [1000, 3096]);
        // Segment → Segment → Last Segment.
        put(
            &m,
            0x31000,
            &[
                desc(TYPE_DATA_BLOCK, BASE, 512),
                desc(TYPE_SEGMENT, 0x32000, 32),
            ],
        );
        put(
            &m,
            0x32000,
            &[
                desc(TYPE_DATA_BLOCK, BASE + 0x1000, 512),
                desc(TYPE_LAST_SEGMENT, 0x33000, 16),
            ],
        );
        put(&m, 0x33000, &[desc(TYPE_DATA_BLOCK, BASE + 0x2000, 1024)]);
        let s = walk(&m, desc(TYPE_SEGMENT, 0x31000, 32), 2048).unwrap();
        assert_eq!(lens(&s), [512, 512, 1024]);
        // The transfer ends before the chain does: the rest is never read.
        let s = walk(&m, desc(TYPE_SEGMENT, 0x31000, 32), 512).unwrap();
        assert_eq!(lens(&s), [512]);
        // No data: nothing is read.
        assert!(walk(&m, desc(0xF, 0, 0), 0).unwrap().is_empty());
    }

    #[test]
    fn a_block_across_two_regions_is_cut_in_two() {
        let m = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0x10000), 0x1000),
            (GuestAddress(0x11000), 0x1000),
        ])
        .unwrap();
        let s = walk(&m, desc(TYPE_DATA_BLOCK, 0x10800, 4096), 4096).unwrap();
        assert_eq!(lens(&s), [2048, 2048]);
        // A gap after the second region: refused.
        assert_eq!(
            walk(&m, desc(TYPE_DATA_BLOCK, 0x11800, 4096), 4096).unwrap_err(),
            Status::DATA_TRANSFER_ERROR
        );
    }

    #[test]
    fn psdt_chooses_prps_or_an_sgl() {
        let m = mem();
        let mut c = Command {
            opcode: 0x02,
            ..Default::default()
        };
        c.sgl = desc(TYPE_DATA_BLOCK, BASE + 0x1000, 4096);
        // PSDT 00b: PRPs (PRP1 at an offset, so two spans).
        let s = data_pointer(&m, &c, BASE + 0x800, BASE + 0x2000, 4096).unwrap();
        assert_eq!(lens(&s), [2048, 2048]);
        c.flags = PSDT_SGL_MPTR_CONTIG;
        let s = data_pointer(&m, &c, 0, 0, 4096).unwrap();
        assert_eq!(lens(&s), [4096]);
        for psdt in [0x80, 0xC0] {
            c.flags = psdt;
            assert_eq!(
                data_pointer(&m, &c, 0, 0, 4096).unwrap_err(),
                Status::INVALID_FIELD
            );
        }
    }

    #[test]
    fn hostile_sgls_fail_with_their_statuses() {
        let m = mem();
        let dte = Status::DATA_TRANSFER_ERROR;
        // A data block outside memory, straddling its end, wrapping the address space.
        assert_eq!(
            walk(&m, desc(TYPE_DATA_BLOCK, 0x1000, 512), 512).unwrap_err(),
            dte
        );
        assert_eq!(
            walk(&m, desc(TYPE_DATA_BLOCK, BASE + 0x3FF00, 512), 512).unwrap_err(),
            dte
        );
        assert_eq!(
            walk(&m, desc(TYPE_DATA_BLOCK, u64::MAX - 8, 512), 512).unwrap_err(),
            dte
        );
        // A segment list outside memory; a list naming a block outside memory.
        assert_eq!(
            walk(&m, desc(TYPE_LAST_SEGMENT, 0x900000, 16), 512).unwrap_err(),
            dte
        );
        put(&m, 0x30000, &[desc(TYPE_DATA_BLOCK, 0xdead_0000, 512)]);
        assert_eq!(
            walk(&m, desc(TYPE_LAST_SEGMENT, 0x30000, 16), 512).unwrap_err(),
            dte
        );
        // Too short: one block, and a list whose blocks add up to less.
        assert_eq!(
            walk(&m, desc(TYPE_DATA_BLOCK, BASE, 511), 512).unwrap_err(),
            Status::DATA_SGL_LENGTH_INVALID
        );
        put(&m, 0x30000, &[desc(TYPE_DATA_BLOCK, BASE, 256)]);
        assert_eq!(
            walk(&m, desc(TYPE_LAST_SEGMENT, 0x30000, 16), 512).unwrap_err(),
            Status::DATA_SGL_LENGTH_INVALID
        );
        // A segment pointing at itself: the descriptor budget ends it.
        put(
            &m,
            0x31000,
            &[
                desc(TYPE_DATA_BLOCK, BASE, 0),
                desc(TYPE_SEGMENT, 0x31000, 32),
            ],
        );
        assert_eq!(
            walk(&m, desc(TYPE_SEGMENT, 0x31000, 32), 512).unwrap_err(),
            INVALID_NUMBER_OF_SGL_DESCRIPTORS
        );
        // A segment longer than the budget (4 GiB - 16 bytes of descriptors).
        assert_eq!(
            walk(&m, desc(TYPE_SEGMENT, BASE, 0xFFFF_FFF0), 512).unwrap_err(),
            INVALID_NUMBER_OF_SGL_DESCRIPTORS
        );
        // Zero-length, ragged and misaligned segments.
        for (addr, len) in [(0x30000, 0), (0x30000, 24), (0x30004, 16)] {
            assert_eq!(
                walk(&m, desc(TYPE_LAST_SEGMENT, addr, len), 512).unwrap_err(),
                Status::INVALID_SGL_DESCRIPTOR
            );
        }
        // A Segment descriptor in a last segment, or not last in its segment.
        put(&m, 0x32000, &[desc(TYPE_SEGMENT, 0x30000, 16)]);
        assert_eq!(
            walk(&m, desc(TYPE_LAST_SEGMENT, 0x32000, 16), 512).unwrap_err(),
            Status::INVALID_SGL_DESCRIPTOR
        );
        put(
            &m,
            0x32000,
            &[
                desc(TYPE_LAST_SEGMENT, 0x30000, 16),
                desc(TYPE_DATA_BLOCK, BASE, 512),
            ],
        );
        assert_eq!(
            walk(&m, desc(TYPE_SEGMENT, 0x32000, 32), 512).unwrap_err(),
            Status::INVALID_SGL_DESCRIPTOR
        );
        // Types nacre does not take: Bit Bucket, Keyed and Transport Data Blocks, a
        // reserved type; the Offset subtype; in the command and in a list.
        for kind in [0x10, 0x40, 0x5A, 0xE0, 0x01] {
            let d = SglDescriptor {
                addr: BASE,
                len: 512,
                kind,
            };
            assert_eq!(
                walk(&m, d, 512).unwrap_err(),
                Status::SGL_DESCRIPTOR_TYPE_INVALID
            );
            put(&m, 0x33000, &[d]);
            assert_eq!(
                walk(&m, desc(TYPE_LAST_SEGMENT, 0x33000, 16), 512).unwrap_err(),
                Status::SGL_DESCRIPTOR_TYPE_INVALID
            );
        }
        // More than MDTS.
        let too_big = limits::MAX_TRANSFER as u64 + 512;
        assert_eq!(
            walk(&m, desc(TYPE_DATA_BLOCK, BASE, u32::MAX), too_big).unwrap_err(),
            Status::INVALID_FIELD
        );
    }
}
