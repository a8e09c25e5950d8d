//! Dataset Management (NVM Command Set 1.0 §3.2.3): the command's Dwords 10-11 and the
//! 16-byte ranges its data carries.

use super::{get_u32, get_u64, put_u32, put_u64, Command};

/// One range (Figure 40): Context Attributes, Length in logical blocks, Starting LBA.
pub const RANGE_LEN: usize = 16;
/// At most 256 ranges: NR is eight bits, zero-based.
pub const MAX_RANGES: usize = 256;

/// The fields of a Dataset Management command (Figures 38-39).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DatasetManagement {
    /// Number of ranges, one-based (Dword 10 bits 7:0 hold it zero-based).
    pub ranges: usize,
    /// Attribute – Deallocate (Dword 11 bit 2): the ranges' data is no longer needed.
    pub deallocate: bool,
    /// Attribute – Integral Dataset for Write (bit 1) and for Read (bit 0): hints.
    pub integral_write: bool,
    pub integral_read: bool,
}

impl DatasetManagement {
    pub fn from_command(c: &Command) -> Self {
        DatasetManagement {
            ranges: (c.cdw10 & 0xFF) as usize + 1,
            deallocate: c.cdw11 & (1 << 2) != 0,
            integral_write: c.cdw11 & (1 << 1) != 0,
            integral_read: c.cdw11 & 1 != 0,
        }
    }

    /// Fill Dwords 10-11 of `c` (`ranges` must be 1 to [`MAX_RANGES`]).
    pub fn apply(&self, c: &mut Command) {
        c.cdw10 = (self.ranges.clamp(1, MAX_RANGES) - 1) as u32;
        c.cdw11 = (self.deallocate as u32) << 2
            | (self.integral_write as u32) << 1
            | self.integral_read as u32;
    }

    /// The bytes of data the command carries.
    pub fn data_len(&self) -> usize {
        self.ranges * RANGE_LEN
    }

    /// The command's ranges in `data`, or `None` if `data` is shorter than they need.
    pub fn ranges<'a>(&self, data: &'a [u8]) -> Option<impl Iterator<Item = Range> + 'a> {
        let data = data.get(..self.data_len())?;
        Some(data.chunks_exact(RANGE_LEN).map(Range::decode))
    }
}

/// A range (Figure 40).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Range {
    /// Bytes 3:0: context attributes (access hints).
    pub attributes: u32,
    /// Bytes 7:4: length in logical blocks (one-based: zero is an empty range).
    pub nlb: u32,
    /// Bytes 15:8: starting LBA.
    pub slba: u64,
}

impl Range {
    pub fn decode(b: &[u8]) -> Self {
        Range {
            attributes: get_u32(b, 0),
            nlb: get_u32(b, 4),
            slba: get_u64(b, 8),
        }
    }

    pub fn encode(&self) -> [u8; RANGE_LEN] {
        let mut b = [0u8; RANGE_LEN];
        put_u32(&mut b, 0, self.attributes);
        put_u32(&mut b, 4, self.nlb);
        put_u64(&mut b, 8, self.slba);
        b
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn command_dwords_follow_figures_38_and_39() {
        let c = Command {
            cdw10: 0x0000_0002,
            cdw11: 0x0000_0004,
            ..Default::default()
        };
        let d = DatasetManagement::from_command(&c);
        assert_eq!(d.ranges, 3);
        assert!(d.deallocate && !d.integral_write && !d.integral_read);
        assert_eq!(d.data_len(), 48);
        let mut back = Command::default();
        d.apply(&mut back);
        assert_eq!((back.cdw10, back.cdw11), (2, 4));
        // NR is eight bits: 256 ranges at most, and bits above are ignored.
        let c = Command {
            cdw10: 0xFFFF_FFFF,
            cdw11: 0b011,
            ..Default::default()
        };
        let d = DatasetManagement::from_command(&c);
        assert_eq!(d.ranges, MAX_RANGES);
        assert!(!d.deallocate && d.integral_write && d.integral_read);
    }

    #[test]
    fn ranges_follow_figure_40_and_short_data_is_refused() {
        let r = Range {
            attributes: 0x0102_0304,
            nlb: 8,
            slba: 0x1_0000_0010,
        };
        let b = r.encode();
        assert_eq!(&b[0..4], &[4, 3, 2, 1]);
        assert_eq!(&b[4..8], &[8, 0, 0, 0]);
        assert_eq!(&b[8..16], &[0x10, 0, 0, 0, 1, 0, 0, 0]);
        let d = DatasetManagement {
            ranges: 2,
            deallocate: true,
            integral_write: false,
            integral_read: false,
        };
        let mut data = b.to_vec();
        assert!(d.ranges(&data).is_none());
        data.extend_from_slice(&Range::default().encode());
        data.push(0xAA); // a byte past the ranges is not read
        let got: Vec<Range> = d.ranges(&data).unwrap().collect();
        assert_eq!(got, vec![r, Range::default()]);
    }
}
