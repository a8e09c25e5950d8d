//! Parsing one virtio-blk request from its descriptor chain (virtio 1.2 §5.2.6).
//!
//! A request is `struct virtio_blk_req { le32 type; le32 reserved; le64 sector; u8 data[];
//! u8 status; }` laid over a descriptor chain: device-readable descriptors first (header, then
//! the data of writes, discards and write-zeroes), device-writable ones after (the data of reads
//! and GET_ID, then the status byte). With VIRTIO_F_VERSION_1 the driver may split or merge
//! these fields across descriptors however it likes (§2.7.4, "Message Framing"), so the parser
//! works on byte offsets, not on descriptor counts.
//!
//! Nothing here trusts the driver: every length, direction and address is checked, and a
//! malformed request ends as an error status (IOERR or UNSUPP) when it has a writable status
//! byte, or as a logged drop when it has none. The parser never panics and never hands the
//! volume a segment outside guest memory.

use vm_memory::GuestMemoryMmap;

use super::guest::GuestMap;
use super::spec::{self, S_IOERR, S_UNSUPP};
use crate::volume::{IoKind, IoRequest, Segment, Segments};

/// Guest memory as vhost-user-backend maps it (no dirty-page bitmap).
pub type Mem = GuestMemoryMmap<()>;

/// One descriptor of a chain, as the parser needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    /// VIRTQ_DESC_F_WRITE: the device writes into this buffer.
    pub writable: bool,
}

/// What the parser needs to know about the device.
#[derive(Debug, Clone)]
pub struct DeviceParams {
    pub read_only: bool,
    /// Data segments allowed per read or write (`seg_max` in the configuration space).
    pub seg_max: u32,
    /// The GET_ID answer: ASCII, NUL padded.
    pub serial: [u8; spec::ID_BYTES],
}

/// What to do with a well-framed request.
#[derive(Debug)]
pub enum Action {
    /// Hand this to the volume (its `tag` is filled in by the queue).
    Submit(IoRequest),
    /// Copy the serial into these device-writable segments.
    GetId(Segments),
    /// Complete at once with this status (malformed or unsupported request).
    Complete(u8),
}

/// A request with a place to put its status.
#[derive(Debug)]
pub struct Parsed {
    /// Host address of the status byte (inside guest memory).
    pub status: *mut u8,
    /// Device-writable data bytes the request fills on success (the used length minus the
    /// status byte).
    pub data_in: u32,
    pub action: Action,
}

#[derive(Debug)]
pub enum Outcome {
    Parsed(Parsed),
    /// No writable status byte: the request cannot even be failed. Return the chain unused
    /// and log the reason.
    Drop(&'static str),
}

/// Copy `out.len()` bytes starting `skip` bytes into the concatenation of `descs`.
fn gather(mem: &GuestMap, descs: &[Desc], mut skip: u64, out: &mut [u8]) -> bool {
    let mut done = 0usize;
    for d in descs {
        if done == out.len() {
            break;
        }
        let len = d.len as u64;
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = ((len - skip) as usize).min(out.len() - done);
        let Some(addr) = d.addr.checked_add(skip) else {
            return false;
        };
        if !mem.read(addr, &mut out[done..done + n]) {
            return false;
        }
        done += n;
        skip = 0;
    }
    done == out.len()
}

/// Segments over the bytes of `descs` after the first `skip`, without the last `trim` bytes.
/// `None` if an address is outside guest memory or there are more than `max` segments.
fn segments(
    mem: &GuestMap,
    descs: &[Desc],
    mut skip: u64,
    trim: u64,
    max: u32,
    max_len: u64,
) -> Option<Segments> {
    let total: u64 = descs.iter().map(|d| d.len as u64).sum();
    let mut remaining = total.checked_sub(skip)?.checked_sub(trim)?;
    let mut segs = Segments::new();
    for d in descs {
        if remaining == 0 {
            break;
        }
        let len = d.len as u64;
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = (len - skip).min(remaining);
        if segs.len() as u32 >= max || n > max_len {
            return None;
        }
        let ptr = mem.ptr(d.addr.checked_add(skip)?, n)?;
        // SAFETY: `ptr..ptr+n` lies inside one mapped guest memory region (GuestMap checked
        // it). The queue holds a reference to that mapping until the request completes, and
        // the driver must not touch a buffer it has made available until it is used.
        segs.push(unsafe { Segment::new(ptr, n as usize) });
        remaining -= n;
        skip = 0;
    }
    Some(segs)
}

/// Parse the request carried by `descs` (a whole chain, in order).
pub fn parse(mem: &GuestMap, descs: &[Desc], dev: &DeviceParams) -> Outcome {
    // §5.2.6: the status byte is the last byte of the chain, device-writable.
    let Some(last) = descs.last() else {
        return Outcome::Drop("empty descriptor chain");
    };
    if !last.writable {
        return Outcome::Drop("last descriptor is device-readable: no status byte");
    }
    if last.len == 0 {
        return Outcome::Drop("status descriptor has length 0");
    }
    let Some(status) = last
        .addr
        .checked_add(last.len as u64 - 1)
        .and_then(|a| mem.ptr(a, 1))
    else {
        return Outcome::Drop("status byte outside guest memory");
    };
    let fail = |code: u8| {
        Outcome::Parsed(Parsed {
            status,
            data_in: 0,
            action: Action::Complete(code),
        })
    };

    // §2.7.4.2: device-readable descriptors precede device-writable ones.
    let n_read = descs.iter().take_while(|d| !d.writable).count();
    let (rd, wr) = descs.split_at(n_read);
    if wr.iter().any(|d| !d.writable) {
        return fail(S_IOERR);
    }
    let rd_total: u64 = rd.iter().map(|d| d.len as u64).sum();
    let wr_total: u64 = wr.iter().map(|d| d.len as u64).sum();
    let mut hdr = [0u8; spec::REQ_HEADER_LEN];
    if rd_total < spec::REQ_HEADER_LEN as u64 || !gather(mem, rd, 0, &mut hdr) {
        return fail(S_IOERR);
    }
    let rtype = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let mut sector_bytes = [0u8; 8];
    sector_bytes.copy_from_slice(&hdr[8..16]);
    let sector = u64::from_le_bytes(sector_bytes);
    let hdr_len = spec::REQ_HEADER_LEN as u64;
    let out_bytes = rd_total - hdr_len;
    let in_bytes = wr_total - 1;

    match rtype {
        spec::T_IN | spec::T_OUT => {
            let (is_read, data) = if rtype == spec::T_IN {
                (true, in_bytes)
            } else {
                (false, out_bytes)
            };
            // The other direction must carry nothing but the header and the status byte.
            let stray = if is_read { out_bytes } else { in_bytes };
            if stray != 0 || data == 0 || data % spec::SECTOR_SIZE != 0 {
                return fail(S_IOERR);
            }
            if !is_read && dev.read_only {
                // §5.2.6.2: a device offering VIRTIO_BLK_F_RO fails writes with IOERR and
                // writes nothing.
                return fail(S_IOERR);
            }
            let Some(offset) = sector.checked_mul(spec::SECTOR_SIZE) else {
                return fail(S_IOERR);
            };
            // §5.2.3: with VIRTIO_BLK_F_SIZE_MAX no data segment exceeds size_max, so no
            // request exceeds seg_max × size_max bytes (and its length fits the used
            // element's 32 bits).
            let max_len = u64::from(spec::SIZE_MAX);
            let segs = if is_read {
                segments(mem, wr, 0, 1, dev.seg_max, max_len)
            } else {
                segments(mem, rd, hdr_len, 0, dev.seg_max, max_len)
            };
            let Some(segs) = segs else {
                return fail(S_IOERR);
            };
            let kind = if is_read { IoKind::Read } else { IoKind::Write };
            Outcome::Parsed(Parsed {
                status,
                data_in: if is_read { data as u32 } else { 0 },
                action: Action::Submit(IoRequest {
                    kind,
                    offset,
                    len: data,
                    segments: segs,
                    tag: 0,
                }),
            })
        }
        spec::T_FLUSH => Outcome::Parsed(Parsed {
            status,
            data_in: 0,
            action: Action::Submit(IoRequest::new(IoKind::Flush, 0, 0, 0)),
        }),
        spec::T_GET_ID => {
            if out_bytes != 0 {
                return fail(S_IOERR);
            }
            let n = in_bytes.min(spec::ID_BYTES as u64);
            // Only the first 20 bytes are ever written; anything beyond is left alone.
            let trim = 1 + (in_bytes - n);
            match segments(mem, wr, 0, trim, u32::MAX, u64::MAX) {
                Some(segs) => Outcome::Parsed(Parsed {
                    status,
                    data_in: n as u32,
                    action: Action::GetId(segs),
                }),
                None => fail(S_IOERR),
            }
        }
        spec::T_DISCARD | spec::T_WRITE_ZEROES => {
            let seg_len = spec::DWZ_SEGMENT_LEN as u64;
            if in_bytes != 0 || out_bytes == 0 || out_bytes % seg_len != 0 {
                return fail(S_IOERR);
            }
            if out_bytes / seg_len > spec::MAX_DWZ_SEG as u64 {
                return fail(S_IOERR);
            }
            let mut seg = [0u8; spec::DWZ_SEGMENT_LEN];
            if !gather(mem, rd, hdr_len, &mut seg) {
                return fail(S_IOERR);
            }
            let mut b8 = [0u8; 8];
            b8.copy_from_slice(&seg[0..8]);
            let start = u64::from_le_bytes(b8);
            let num = u32::from_le_bytes([seg[8], seg[9], seg[10], seg[11]]);
            let flags = u32::from_le_bytes([seg[12], seg[13], seg[14], seg[15]]);
            // §5.2.6.2: unknown flags, and unmap on a discard, are UNSUPP.
            if flags & !spec::DWZ_FLAG_UNMAP != 0
                || (rtype == spec::T_DISCARD && flags & spec::DWZ_FLAG_UNMAP != 0)
            {
                return fail(S_UNSUPP);
            }
            if dev.read_only || num > spec::MAX_DWZ_SECTORS {
                return fail(S_IOERR);
            }
            let Some(offset) = start.checked_mul(spec::SECTOR_SIZE) else {
                return fail(S_IOERR);
            };
            let kind = if rtype == spec::T_DISCARD {
                IoKind::Discard
            } else {
                IoKind::WriteZeroes
            };
            Outcome::Parsed(Parsed {
                status,
                data_in: 0,
                action: Action::Submit(IoRequest::new(
                    kind,
                    offset,
                    num as u64 * spec::SECTOR_SIZE,
                    0,
                )),
            })
        }
        _ => fail(S_UNSUPP),
    }
}
