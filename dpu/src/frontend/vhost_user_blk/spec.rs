//! virtio-blk constants and byte layouts (virtio 1.2 §5.2).
//!
//! Request types, status codes and feature bits come from `virtio-bindings` (the Linux uapi
//! header); this module adds the configuration space encoding (§5.2.4) and the
//! discard/write-zeroes segment (§5.2.6), both little-endian on the wire.

use virtio_bindings::bindings::virtio_blk as vb;

/// §5.2.6: every request starts with `le32 type; le32 reserved; le64 sector`.
pub const REQ_HEADER_LEN: usize = 16;
/// §5.2.6: `struct virtio_blk_discard_write_zeroes { le64 sector; le32 num_sectors; le32 flags }`.
pub const DWZ_SEGMENT_LEN: usize = 16;
/// §5.2.6: bit 0 of the segment flags; only meaningful for write zeroes.
pub const DWZ_FLAG_UNMAP: u32 = 1;
/// virtio-blk sectors are always 512 bytes, whatever `blk_size` says (§5.2.6).
pub const SECTOR_SHIFT: u32 = 9;
pub const SECTOR_SIZE: u64 = 1 << SECTOR_SHIFT;
/// §5.2.6: the device ID string is at most 20 bytes, NUL padded.
pub const ID_BYTES: usize = vb::VIRTIO_BLK_ID_BYTES as usize;

pub const T_IN: u32 = vb::VIRTIO_BLK_T_IN;
pub const T_OUT: u32 = vb::VIRTIO_BLK_T_OUT;
pub const T_FLUSH: u32 = vb::VIRTIO_BLK_T_FLUSH;
pub const T_GET_ID: u32 = vb::VIRTIO_BLK_T_GET_ID;
pub const T_DISCARD: u32 = vb::VIRTIO_BLK_T_DISCARD;
pub const T_WRITE_ZEROES: u32 = vb::VIRTIO_BLK_T_WRITE_ZEROES;

pub const S_OK: u8 = vb::VIRTIO_BLK_S_OK as u8;
pub const S_IOERR: u8 = vb::VIRTIO_BLK_S_IOERR as u8;
pub const S_UNSUPP: u8 = vb::VIRTIO_BLK_S_UNSUPP as u8;

/// Device limits nacre advertises in the configuration space.
///
/// One discard/write-zeroes segment per request, as QEMU does: drivers split larger lists
/// themselves, and one segment maps to exactly one volume request.
pub const MAX_DWZ_SEG: u32 = 1;
/// 2 GiB per discard/write-zeroes segment: large enough that drivers rarely split, small
/// enough that one request cannot occupy a queue for long.
pub const MAX_DWZ_SECTORS: u32 = 1 << 22;

/// The longest data segment a request may carry (`size_max`, VIRTIO_BLK_F_SIZE_MAX): with
/// `seg_max` it bounds a request to `seg_max × SIZE_MAX` bytes (126 MiB), which drivers then
/// respect (Linux sets its queue's segment size from it). Unbounded, a driver could claim
/// close to 4 GiB per descriptor, over the same page of its memory, and have the layers
/// below plan work for hundreds of gigabytes. 1 MiB keeps one segment of a large
/// contiguous buffer whole.
pub const SIZE_MAX: u32 = 1 << 20;

/// Offsets of the `struct virtio_blk_config` fields nacre fills (§5.2.4).
pub mod cfg {
    pub const CAPACITY: usize = 0;
    pub const SIZE_MAX: usize = 8;
    pub const SEG_MAX: usize = 12;
    pub const BLK_SIZE: usize = 20;
    pub const NUM_QUEUES: usize = 34;
    pub const MAX_DISCARD_SECTORS: usize = 36;
    pub const MAX_DISCARD_SEG: usize = 40;
    pub const DISCARD_SECTOR_ALIGNMENT: usize = 44;
    pub const MAX_WRITE_ZEROES_SECTORS: usize = 48;
    pub const MAX_WRITE_ZEROES_SEG: usize = 52;
    pub const WRITE_ZEROES_MAY_UNMAP: usize = 56;
    /// Through `unused1[3]`: the fields before the secure-erase and zoned extensions, which
    /// nacre does not offer.
    pub const LEN: usize = 60;
}

/// The values that go into the configuration space.
#[derive(Debug, Clone, Copy)]
pub struct ConfigSpace {
    pub capacity_sectors: u64,
    pub seg_max: u32,
    pub blk_size: u32,
    pub num_queues: u16,
}

impl ConfigSpace {
    /// Encode as the little-endian `struct virtio_blk_config` prefix.
    pub fn encode(&self) -> [u8; cfg::LEN] {
        let mut b = [0u8; cfg::LEN];
        let put32 = |b: &mut [u8; cfg::LEN], off: usize, v: u32| {
            b[off..off + 4].copy_from_slice(&v.to_le_bytes())
        };
        b[cfg::CAPACITY..cfg::CAPACITY + 8].copy_from_slice(&self.capacity_sectors.to_le_bytes());
        put32(&mut b, cfg::SIZE_MAX, SIZE_MAX);
        put32(&mut b, cfg::SEG_MAX, self.seg_max);
        put32(&mut b, cfg::BLK_SIZE, self.blk_size);
        b[cfg::NUM_QUEUES..cfg::NUM_QUEUES + 2].copy_from_slice(&self.num_queues.to_le_bytes());
        put32(&mut b, cfg::MAX_DISCARD_SECTORS, MAX_DWZ_SECTORS);
        put32(&mut b, cfg::MAX_DISCARD_SEG, MAX_DWZ_SEG);
        // Discards must start and end on a logical block (in 512-byte sectors).
        put32(
            &mut b,
            cfg::DISCARD_SECTOR_ALIGNMENT,
            self.blk_size >> SECTOR_SHIFT,
        );
        put32(&mut b, cfg::MAX_WRITE_ZEROES_SECTORS, MAX_DWZ_SECTORS);
        put32(&mut b, cfg::MAX_WRITE_ZEROES_SEG, MAX_DWZ_SEG);
        // Every backend zeroes by deallocating where it can (hole punch, MADV_DONTNEED).
        b[cfg::WRITE_ZEROES_MAY_UNMAP] = 1;
        b
    }
}

/// Feature bits (§5.2.3, §6) as a 64-bit mask.
pub const fn bit(n: u32) -> u64 {
    1u64 << n
}

#[cfg(test)]
mod test {
    use super::*;
    use std::mem::offset_of;
    use vb::virtio_blk_config as C;

    #[test]
    fn config_offsets_match_the_uapi_struct() {
        assert_eq!(offset_of!(C, capacity), cfg::CAPACITY);
        assert_eq!(offset_of!(C, size_max), cfg::SIZE_MAX);
        assert_eq!(offset_of!(C, seg_max), cfg::SEG_MAX);
        assert_eq!(offset_of!(C, blk_size), cfg::BLK_SIZE);
        assert_eq!(offset_of!(C, num_queues), cfg::NUM_QUEUES);
        assert_eq!(offset_of!(C, max_discard_sectors), cfg::MAX_DISCARD_SECTORS);
        assert_eq!(offset_of!(C, max_discard_seg), cfg::MAX_DISCARD_SEG);
        assert_eq!(
            offset_of!(C, discard_sector_alignment),
            cfg::DISCARD_SECTOR_ALIGNMENT
        );
        assert_eq!(
            offset_of!(C, max_write_zeroes_sectors),
            cfg::MAX_WRITE_ZEROES_SECTORS
        );
        assert_eq!(
            offset_of!(C, max_write_zeroes_seg),
            cfg::MAX_WRITE_ZEROES_SEG
        );
        assert_eq!(
            offset_of!(C, write_zeroes_may_unmap),
            cfg::WRITE_ZEROES_MAY_UNMAP
        );
        assert_eq!(offset_of!(C, max_secure_erase_sectors), cfg::LEN);
        assert_eq!(
            std::mem::size_of::<vb::virtio_blk_discard_write_zeroes>(),
            DWZ_SEGMENT_LEN
        );
        assert_eq!(std::mem::size_of::<vb::virtio_blk_outhdr>(), REQ_HEADER_LEN);
    }

    #[test]
    fn config_encodes_little_endian() {
        let c = ConfigSpace {
            capacity_sectors: 0x0102_0304_0506_0708,
            seg_max: 126,
            blk_size: 4096,
            num_queues: 3,
        }
        .encode();
        assert_eq!(&c[0..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&c[8..12], &(1u32 << 20).to_le_bytes());
        assert_eq!(&c[12..16], &126u32.to_le_bytes());
        assert_eq!(&c[20..24], &4096u32.to_le_bytes());
        assert_eq!(&c[34..36], &3u16.to_le_bytes());
        assert_eq!(&c[44..48], &8u32.to_le_bytes());
        assert_eq!(c[56], 1);
    }
}
