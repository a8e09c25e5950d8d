//! Header and data digests (NVMe/TCP 1.0 §3.6.1): CRC32C, little-endian on the wire.

/// Which digests a connection negotiated in ICReq/ICResp (DGST byte: bit 0 HDGST_ENABLE,
/// bit 1 DDGST_ENABLE).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

impl Digests {
    pub const NONE: Digests = Digests {
        header: false,
        data: false,
    };

    pub fn from_dgst(b: u8) -> Self {
        Digests {
            header: b & 1 != 0,
            data: b & 2 != 0,
        }
    }
    pub fn to_dgst(self) -> u8 {
        self.header as u8 | (self.data as u8) << 1
    }
}

/// CRC32C (Castagnoli) of `b`, hardware accelerated where the CPU allows.
#[inline]
pub fn crc32c(b: &[u8]) -> u32 {
    crc32c::crc32c(b)
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn crc32c_check_value() {
        // The CRC-32C check value for "123456789" (RFC 3720 B.4 / Castagnoli).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(Digests::from_dgst(3).to_dgst(), 3);
        assert!(!Digests::from_dgst(2).header);
    }
}
