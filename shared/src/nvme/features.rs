//! Set/Get Features (NVMe Base 2.0 §5.27, Figure 317): identifiers in Dword 10 bits 7:0;
//! the Save bit (Set, Dword 10 bit 31) and Select field (Get, Dword 10 bits 10:8).

use super::Command;

pub mod fid {
    pub const ARBITRATION: u8 = 0x01;
    pub const POWER_MANAGEMENT: u8 = 0x02;
    pub const TEMPERATURE_THRESHOLD: u8 = 0x04;
    pub const ERROR_RECOVERY: u8 = 0x05;
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const INTERRUPT_COALESCING: u8 = 0x08;
    pub const INTERRUPT_VECTOR_CONFIG: u8 = 0x09;
    pub const WRITE_ATOMICITY: u8 = 0x0A;
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0B;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0F;
}

/// Set Features Dword 10 bit 31.
pub const SAVE: u32 = 1 << 31;
/// Get Features with Select = 011b, Dword 0 bit 2: the feature is changeable (bit 0:
/// saveable, bit 1: namespace specific).
pub const CAPABILITY_CHANGEABLE: u32 = 1 << 2;

/// The fields of a Set Features command (Figures 316-317) nacre reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetFeatures {
    /// Dword 10 bits 7:0.
    pub fid: u8,
    /// Save (Dword 10 bit 31): keep the value across resets.
    pub save: bool,
    /// Dword 11: the feature's value; its layout is the feature's own.
    pub value: u32,
}

impl SetFeatures {
    pub fn from_command(c: &Command) -> Self {
        SetFeatures {
            fid: c.cdw10 as u8,
            save: c.cdw10 & SAVE != 0,
            value: c.cdw11,
        }
    }

    /// Fill Dwords 10-11 of `c`.
    pub fn apply(&self, c: &mut Command) {
        c.cdw10 = self.fid as u32 | if self.save { SAVE } else { 0 };
        c.cdw11 = self.value;
    }
}

/// Get Features Select (Dword 10 bits 10:8, Figure 312): which value to return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Select {
    Current,
    Default,
    Saved,
    /// What the feature supports (saveable, per namespace, changeable), not a value.
    SupportedCapabilities,
    /// 100b-111b are reserved.
    Reserved(u8),
}

/// The fields of a Get Features command (Figures 311-312) nacre reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetFeatures {
    /// Dword 10 bits 7:0.
    pub fid: u8,
    pub select: Select,
}

impl GetFeatures {
    pub fn from_command(c: &Command) -> Self {
        let select = match (c.cdw10 >> 8) & 7 {
            0 => Select::Current,
            1 => Select::Default,
            2 => Select::Saved,
            3 => Select::SupportedCapabilities,
            r => Select::Reserved(r as u8),
        };
        GetFeatures {
            fid: c.cdw10 as u8,
            select,
        }
    }

    /// Fill Dword 10 of `c`.
    pub fn apply(&self, c: &mut Command) {
        let sel = match self.select {
            Select::Current => 0,
            Select::Default => 1,
            Select::Saved => 2,
            Select::SupportedCapabilities => 3,
            Select::Reserved(r) => r as u32 & 7,
        };
        c.cdw10 = self.fid as u32 | sel << 8;
    }
}

/// Number of Queues (§5.27.1.7): Dword 11 and the completion's Dword 0 both carry
/// NSQR/NSQA (bits 15:0) and NCQR/NCQA (bits 31:16), zero-based.
pub fn number_of_queues(nsq: u16, ncq: u16) -> u32 {
    (ncq.saturating_sub(1) as u32) << 16 | nsq.saturating_sub(1) as u32
}

/// Decode Number of Queues into one-based (submission, completion) counts.
pub fn parse_number_of_queues(v: u32) -> (u32, u32) {
    ((v & 0xFFFF) + 1, (v >> 16) + 1)
}

/// Asynchronous Event Configuration (§5.27.1.9) bit 8: Namespace Attribute Notices.
pub const AEC_NS_ATTR: u32 = 1 << 8;

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn number_of_queues_is_zero_based() {
        assert_eq!(number_of_queues(4, 4), 0x0003_0003);
        assert_eq!(parse_number_of_queues(0x0003_0001), (2, 4));
        // FFFFh is reserved (65536 queues); decoding does not overflow.
        assert_eq!(parse_number_of_queues(0xFFFF_FFFF), (65536, 65536));
    }

    #[test]
    fn set_features_fields_follow_figure_317() {
        let c = Command {
            cdw10: 0x8000_0007,
            cdw11: 0x0003_0001,
            ..Default::default()
        };
        let f = SetFeatures::from_command(&c);
        assert_eq!(
            f,
            SetFeatures {
                fid: fid::NUMBER_OF_QUEUES,
                save: true,
                value: 0x0003_0001
            }
        );
        let mut back = Command::default();
        f.apply(&mut back);
        assert_eq!((back.cdw10, back.cdw11), (0x8000_0007, 0x0003_0001));
    }

    #[test]
    fn get_features_select_follows_figure_312() {
        let get = |cdw10| {
            GetFeatures::from_command(&Command {
                cdw10,
                ..Default::default()
            })
        };
        assert_eq!(get(0x000F).select, Select::Current);
        assert_eq!(get(0x010F).select, Select::Default);
        assert_eq!(get(0x020F).select, Select::Saved);
        assert_eq!(get(0x030F).select, Select::SupportedCapabilities);
        assert_eq!(get(0x070F).select, Select::Reserved(7));
        // Bits above SEL are not part of it.
        let g = get(0xFFFF_F80B);
        assert_eq!(
            (g.fid, g.select),
            (fid::ASYNC_EVENT_CONFIG, Select::Current)
        );
        for cdw10 in [0x000F, 0x010F, 0x020F, 0x030F, 0x050F] {
            let mut c = Command::default();
            get(cdw10).apply(&mut c);
            assert_eq!(c.cdw10, cdw10);
        }
    }
}
