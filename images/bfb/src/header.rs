//! The BFB image header: three little-endian 64-bit words (`union boot_image_header` in
//! Mellanox's ARM Trusted Firmware `bluefield_boot.h`; packed and unpacked the same way by
//! `mlx-mkbfb`'s `ImageHdr`).

use crate::Error;

/// `BFB_IMGHDR_MAGIC`, "Bf^B^S" in little-endian byte order.
pub const MAGIC: u32 = 0x1302_6642;
/// The header major version every known stream uses; a different one is incompatible.
pub const MAJOR: u8 = 1;
/// The newest minor version known: 2 added the next/current image-version fields.
pub const MINOR: u8 = 2;
/// Header length in bytes (3 words). `mlx-mkbfb` rejects any other length.
pub const HEADER_LEN: usize = 24;

/// One image header, every field as stored (so an image read from a vendor bundle is written
/// back byte for byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Word 0 bits 32-35.
    pub major: u8,
    /// Word 0 bits 36-39.
    pub minor: u8,
    /// Word 0 bits 40-43: reserved, kept as read.
    pub reserved: u8,
    /// Word 0 bits 44-47 (minor >= 2): version of the next image of the same id, 0 if none.
    pub next_img_ver: u8,
    /// Word 0 bits 48-51 (minor >= 2): this image's version.
    pub cur_img_ver: u8,
    /// Word 0 bits 52-55: header length in 8-byte words.
    pub header_words: u8,
    /// Word 0 bits 56-63: the image id (see [`crate::ids`]).
    pub image_id: u8,
    /// Word 1 bits 0-31: data length without padding.
    pub image_len: u32,
    /// Word 1 bits 32-63: CRC-32 of the data and its zero padding.
    pub image_crc: u32,
    /// Word 2: bit N set when an image of id N follows this one in the stream.
    pub following_images: u64,
}

impl Header {
    /// Decode and check a header found at stream offset `offset` (for error messages).
    pub fn parse(b: &[u8; HEADER_LEN], offset: u64) -> Result<Header, Error> {
        let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let (w0, w1, w2) = (w(0), w(1), w(2));
        let magic = w0 as u32;
        if magic != MAGIC {
            return Err(Error::BadMagic {
                offset,
                found: magic,
            });
        }
        let nib = |shift: u32| ((w0 >> shift) & 0xf) as u8;
        let h = Header {
            major: nib(32),
            minor: nib(36),
            reserved: nib(40),
            next_img_ver: nib(44),
            cur_img_ver: nib(48),
            header_words: nib(52),
            image_id: (w0 >> 56) as u8,
            image_len: w1 as u32,
            image_crc: (w1 >> 32) as u32,
            following_images: w2,
        };
        if h.major != MAJOR || h.minor > MINOR {
            return Err(Error::BadVersion {
                offset,
                major: h.major,
                minor: h.minor,
            });
        }
        if h.header_words as usize * 8 != HEADER_LEN {
            return Err(Error::BadHeaderLength {
                offset,
                words: h.header_words,
            });
        }
        Ok(h)
    }

    /// The 24 bytes of this header.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let nib = |v: u8, shift: u32| u64::from(v & 0xf) << shift;
        let w0 = u64::from(MAGIC)
            | nib(self.major, 32)
            | nib(self.minor, 36)
            | nib(self.reserved, 40)
            | nib(self.next_img_ver, 44)
            | nib(self.cur_img_ver, 48)
            | nib(self.header_words, 52)
            | (u64::from(self.image_id) << 56);
        let w1 = u64::from(self.image_len) | (u64::from(self.image_crc) << 32);
        let mut out = [0u8; HEADER_LEN];
        out[0..8].copy_from_slice(&w0.to_le_bytes());
        out[8..16].copy_from_slice(&w1.to_le_bytes());
        out[16..24].copy_from_slice(&self.following_images.to_le_bytes());
        out
    }
}
