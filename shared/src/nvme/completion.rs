//! The Completion Queue Entry (NVMe Base 2.0 §4.6, Figure 89).

use super::{get_u16, get_u32, put_u16, put_u32, Status};

pub const CQE_LEN: usize = 16;

/// A decoded CQE: Dword 0-1 command specific, SQ head pointer, SQ identifier, command
/// identifier and status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Completion {
    pub dw0: u32,
    pub dw1: u32,
    /// Bytes 8-9: SQ Head Pointer.
    pub sqhd: u16,
    /// Bytes 10-11: SQ Identifier.
    pub sqid: u16,
    /// Bytes 12-13.
    pub cid: u16,
    /// Bytes 14-15: phase tag (bit 0) and Status Field (bits 15:1).
    pub status: u16,
}

impl Completion {
    pub fn new(cid: u16, status: Status) -> Self {
        Completion {
            cid,
            status: status.to_field(),
            ..Default::default()
        }
    }
    pub fn decode(b: &[u8]) -> Self {
        Completion {
            dw0: get_u32(b, 0),
            dw1: get_u32(b, 4),
            sqhd: get_u16(b, 8),
            sqid: get_u16(b, 10),
            cid: get_u16(b, 12),
            status: get_u16(b, 14),
        }
    }
    pub fn encode(&self, b: &mut [u8]) {
        put_u32(b, 0, self.dw0);
        put_u32(b, 4, self.dw1);
        put_u16(b, 8, self.sqhd);
        put_u16(b, 10, self.sqid);
        put_u16(b, 12, self.cid);
        put_u16(b, 14, self.status);
    }
    pub fn status(&self) -> Status {
        Status::from_field(self.status)
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn cqe_byte_layout() {
        let c = Completion {
            dw0: 0x0102_0304,
            dw1: 5,
            sqhd: 6,
            sqid: 7,
            cid: 0xABCD,
            status: Status::INVALID_OPCODE.to_field(),
        };
        let mut b = [0u8; 16];
        c.encode(&mut b);
        assert_eq!(
            b,
            [4, 3, 2, 1, 5, 0, 0, 0, 6, 0, 7, 0, 0xCD, 0xAB, 0x02, 0x80]
        );
        assert_eq!(Completion::decode(&b), c);
        assert_eq!(c.status(), Status::INVALID_OPCODE);
    }
}
