//! The Submission Queue Entry (NVMe Base 2.0 §4.2, Figure 88) and SGL data block
//! descriptors (§4.3.2, Figures 117-119).
//!
//! Fabrics always use SGLs (PSDT = 01b or 10b): the Data Pointer holds one 16-byte SGL
//! descriptor, which NVMe/TCP restricts to two forms (NVMe/TCP 1.0 §3.3.2): an in-capsule
//! Data Block with the Offset subtype, or a Transport SGL Data Block for data moved by
//! H2CData/C2HData PDUs.

use super::{get_u16, get_u32, get_u64, put_u16, put_u32, put_u64};

/// Size of an SQE in bytes.
pub const SQE_LEN: usize = 64;

/// SGL descriptor type/subtype byte (`type << 4 | subtype`) for the forms NVMe/TCP uses.
pub mod sgl {
    /// SGL Data Block descriptor (type 0h) with the Offset subtype (1h): in-capsule data.
    pub const DATA_BLOCK_OFFSET: u8 = 0x01;
    /// Transport SGL Data Block (type 5h) with transport-specific subtype Ah, as the Linux
    /// and SPDK hosts encode it for data moved by PDUs.
    pub const TRANSPORT_DATA_BLOCK: u8 = 0x5A;
    /// The descriptor type (upper nibble) of a Transport SGL Data Block.
    pub const TYPE_TRANSPORT_DATA_BLOCK: u8 = 0x5;
    /// The descriptor type (upper nibble) of a Data Block.
    pub const TYPE_DATA_BLOCK: u8 = 0x0;
}

/// One 16-byte SGL descriptor: address (or in-capsule offset), length, type/subtype
/// (Figure 117: bytes 0-7 address, 8-11 length, 15 identifier).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SglDescriptor {
    pub addr: u64,
    pub len: u32,
    /// `type << 4 | subtype`.
    pub kind: u8,
}

impl SglDescriptor {
    pub fn decode(b: &[u8]) -> Self {
        SglDescriptor {
            addr: get_u64(b, 0),
            len: get_u32(b, 8),
            kind: b[15],
        }
    }
    pub fn encode(&self, b: &mut [u8]) {
        b[..16].fill(0);
        put_u64(b, 0, self.addr);
        put_u32(b, 8, self.len);
        b[15] = self.kind;
    }
    /// In-capsule data of `len` bytes at offset 0.
    pub fn in_capsule(len: u32) -> Self {
        SglDescriptor {
            addr: 0,
            len,
            kind: sgl::DATA_BLOCK_OFFSET,
        }
    }
    /// Data moved by R2T/H2CData or C2HData PDUs.
    pub fn transport(len: u32) -> Self {
        SglDescriptor {
            addr: 0,
            len,
            kind: sgl::TRANSPORT_DATA_BLOCK,
        }
    }
}

/// A decoded Submission Queue Entry. Dwords 10-15 are kept raw; each command's accessor
/// interprets them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Command {
    /// Byte 0.
    pub opcode: u8,
    /// Byte 1: FUSE (bits 1:0), PSDT (bits 7:6).
    pub flags: u8,
    /// Bytes 2-3: Command Identifier.
    pub cid: u16,
    /// Bytes 4-7; for Fabrics commands byte 4 is `fctype`.
    pub nsid: u32,
    /// Bytes 8-15 (Dwords 2-3).
    pub cdw2: u32,
    pub cdw3: u32,
    /// Bytes 16-23: Metadata Pointer.
    pub mptr: u64,
    /// Bytes 24-39: Data Pointer (SGL Entry 1).
    pub sgl: SglDescriptor,
    /// Dwords 10-15 (bytes 40-63).
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}

/// PSDT (byte 1, bits 7:6) value for "SGLs used, metadata pointer is an address" (01b).
pub const PSDT_SGL: u8 = 0x40;

impl Command {
    /// Decode 64 bytes; `b` must be at least [`SQE_LEN`] long.
    pub fn decode(b: &[u8]) -> Self {
        Command {
            opcode: b[0],
            flags: b[1],
            cid: get_u16(b, 2),
            nsid: get_u32(b, 4),
            cdw2: get_u32(b, 8),
            cdw3: get_u32(b, 12),
            mptr: get_u64(b, 16),
            sgl: SglDescriptor::decode(&b[24..40]),
            cdw10: get_u32(b, 40),
            cdw11: get_u32(b, 44),
            cdw12: get_u32(b, 48),
            cdw13: get_u32(b, 52),
            cdw14: get_u32(b, 56),
            cdw15: get_u32(b, 60),
        }
    }

    pub fn encode(&self, b: &mut [u8]) {
        b[0] = self.opcode;
        b[1] = self.flags;
        put_u16(b, 2, self.cid);
        put_u32(b, 4, self.nsid);
        put_u32(b, 8, self.cdw2);
        put_u32(b, 12, self.cdw3);
        put_u64(b, 16, self.mptr);
        self.sgl.encode(&mut b[24..40]);
        put_u32(b, 40, self.cdw10);
        put_u32(b, 44, self.cdw11);
        put_u32(b, 48, self.cdw12);
        put_u32(b, 52, self.cdw13);
        put_u32(b, 56, self.cdw14);
        put_u32(b, 60, self.cdw15);
    }

    pub fn to_bytes(&self) -> [u8; SQE_LEN] {
        let mut b = [0u8; SQE_LEN];
        self.encode(&mut b);
        b
    }

    /// Fabrics command type (byte 4) when `opcode` is 7Fh.
    pub fn fctype(&self) -> u8 {
        self.nsid as u8
    }

    /// FUSE bits (byte 1, bits 1:0): nacre supports no fused operations.
    pub fn fuse(&self) -> u8 {
        self.flags & 0x3
    }

    /// Starting LBA of Read/Write/Write Zeroes (Dwords 10-11).
    pub fn slba(&self) -> u64 {
        (self.cdw11 as u64) << 32 | self.cdw10 as u64
    }

    /// Number of logical blocks of Read/Write/Write Zeroes (Dword 12 bits 15:0, zero-based),
    /// returned one-based.
    pub fn nlb(&self) -> u32 {
        (self.cdw12 & 0xFFFF) + 1
    }

    /// Force Unit Access of Read/Write/Write Zeroes (Dword 12 bit 30, NVM Command Set 1.0
    /// §3.2.4): a write is on non-volatile media before it completes.
    pub fn fua(&self) -> bool {
        self.cdw12 & (1 << 30) != 0
    }

    /// A Read/Write/Write Zeroes command.
    pub fn rw(opcode: u8, cid: u16, nsid: u32, slba: u64, nlb: u32, sgl: SglDescriptor) -> Self {
        Command {
            opcode,
            flags: PSDT_SGL,
            cid,
            nsid,
            sgl,
            cdw10: slba as u32,
            cdw11: (slba >> 32) as u32,
            cdw12: nlb.saturating_sub(1) & 0xFFFF,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn sqe_byte_layout() {
        let c = Command::rw(
            0x02,
            0x1234,
            1,
            0x1_0000_0002,
            8,
            SglDescriptor::transport(4096),
        );
        let b = c.to_bytes();
        assert_eq!(b[0], 0x02);
        assert_eq!(b[1], 0x40);
        assert_eq!(&b[2..4], &[0x34, 0x12]);
        assert_eq!(&b[4..8], &[1, 0, 0, 0]);
        // SGL1 at bytes 24..40: length at 32, identifier at 39.
        assert_eq!(&b[32..36], &4096u32.to_le_bytes());
        assert_eq!(b[39], 0x5A);
        // SLBA in Dwords 10-11, NLB zero-based in Dword 12.
        assert_eq!(&b[40..44], &2u32.to_le_bytes());
        assert_eq!(&b[44..48], &1u32.to_le_bytes());
        assert_eq!(&b[48..52], &7u32.to_le_bytes());
        let d = Command::decode(&b);
        assert_eq!(d, c);
        assert_eq!(d.slba(), 0x1_0000_0002);
        assert_eq!(d.nlb(), 8);
    }

    #[test]
    fn fabrics_fctype_is_byte_4() {
        let mut b = [0u8; 64];
        b[0] = 0x7F;
        b[4] = 0x01;
        assert_eq!(Command::decode(&b).fctype(), 0x01);
    }
}
