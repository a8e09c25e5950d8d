//! Get Log Page (NVMe Base 2.0 §5.16).

use super::{put_u32, Command};

/// Log Page Identifiers (Figure 202).
pub mod lid {
    pub const ERROR_INFORMATION: u8 = 0x01;
    pub const SMART_HEALTH: u8 = 0x02;
    pub const FIRMWARE_SLOT: u8 = 0x03;
    pub const CHANGED_NS_LIST: u8 = 0x04;
    /// NVMe-oF 1.1 §5.3: the discovery log page.
    pub const DISCOVERY: u8 = 0x70;
}

pub const ERROR_ENTRY_LEN: usize = 64;
pub const SMART_LEN: usize = 512;
pub const FIRMWARE_SLOT_LEN: usize = 512;
pub const CHANGED_NS_LIST_LEN: usize = 4096;

/// The fields of a Get Log Page command (Figure 199-201).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetLogPage {
    /// Dword 10 bits 7:0.
    pub lid: u8,
    /// Dword 10 bit 15: Retain Asynchronous Event.
    pub rae: bool,
    /// Bytes to return: (NUMDU:NUMDL + 1) dwords.
    pub len: usize,
    /// Dwords 12-13: byte offset into the log page.
    pub offset: u64,
}

impl GetLogPage {
    pub fn from_command(c: &Command) -> Self {
        let numdl = c.cdw10 >> 16;
        let numdu = c.cdw11 & 0xFFFF;
        let numd = (numdu << 16 | numdl) as usize + 1;
        GetLogPage {
            lid: c.cdw10 as u8,
            rae: c.cdw10 & (1 << 15) != 0,
            len: numd * 4,
            offset: (c.cdw13 as u64) << 32 | c.cdw12 as u64,
        }
    }

    /// Fill Dwords 10-13 of `c` for this request (`len` must be a non-zero multiple of 4).
    pub fn apply(&self, c: &mut Command) {
        let numd = (self.len / 4).saturating_sub(1) as u32;
        c.cdw10 = self.lid as u32 | (self.rae as u32) << 15 | (numd & 0xFFFF) << 16;
        c.cdw11 = numd >> 16;
        c.cdw12 = self.offset as u32;
        c.cdw13 = (self.offset >> 32) as u32;
    }
}

/// SMART / Health Information (Figure 207) fields nacre reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SmartLog {
    /// Byte 0.
    pub critical_warning: u8,
    /// Bytes 1-2, Kelvin.
    pub temperature_k: u16,
    /// Byte 3, percent.
    pub available_spare: u8,
    /// Byte 4, percent.
    pub spare_threshold: u8,
    /// Bytes 32-47, 48-63: thousands of 512-byte units.
    pub data_units_read: u128,
    pub data_units_written: u128,
    /// Bytes 64-79, 80-95.
    pub host_read_commands: u128,
    pub host_write_commands: u128,
    /// Bytes 112-127.
    pub power_cycles: u128,
    /// Bytes 128-143.
    pub power_on_hours: u128,
}

impl SmartLog {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; SMART_LEN];
        b[0] = self.critical_warning;
        b[1..3].copy_from_slice(&self.temperature_k.to_le_bytes());
        b[3] = self.available_spare;
        b[4] = self.spare_threshold;
        b[32..48].copy_from_slice(&self.data_units_read.to_le_bytes());
        b[48..64].copy_from_slice(&self.data_units_written.to_le_bytes());
        b[64..80].copy_from_slice(&self.host_read_commands.to_le_bytes());
        b[80..96].copy_from_slice(&self.host_write_commands.to_le_bytes());
        b[112..128].copy_from_slice(&self.power_cycles.to_le_bytes());
        b[128..144].copy_from_slice(&self.power_on_hours.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Self {
        let u128_at = |o: usize| {
            let mut a = [0u8; 16];
            a.copy_from_slice(&b[o..o + 16]);
            u128::from_le_bytes(a)
        };
        SmartLog {
            critical_warning: b[0],
            temperature_k: u16::from_le_bytes([b[1], b[2]]),
            available_spare: b[3],
            spare_threshold: b[4],
            data_units_read: u128_at(32),
            data_units_written: u128_at(48),
            host_read_commands: u128_at(64),
            host_write_commands: u128_at(80),
            power_cycles: u128_at(112),
            power_on_hours: u128_at(128),
        }
    }
}

/// Firmware Slot Information (Figure 210): active slot 1 (AFI byte 0) holding `rev`
/// (FRS1, bytes 8-15).
pub fn encode_firmware_slot(rev: &str) -> Vec<u8> {
    let mut b = vec![0u8; FIRMWARE_SLOT_LEN];
    b[0] = 1;
    super::put_ascii_padded(&mut b[8..16], rev);
    b
}

/// Changed Namespace List (Figure 211): up to 1024 NSIDs; if more changed, the first entry
/// is FFFFFFFFh and the rest zero.
pub fn encode_changed_ns_list(nsids: &[u32]) -> Vec<u8> {
    let mut b = vec![0u8; CHANGED_NS_LIST_LEN];
    if nsids.len() > CHANGED_NS_LIST_LEN / 4 {
        put_u32(&mut b, 0, 0xFFFF_FFFF);
    } else {
        for (i, &id) in nsids.iter().enumerate() {
            put_u32(&mut b, i * 4, id);
        }
    }
    b
}

/// Asynchronous Event Request completion Dword 0 (Figure 150): type (bits 2:0), info
/// (bits 15:8), associated log page (bits 23:16).
pub mod aen {
    pub const TYPE_NOTICE: u8 = 0x2;
    pub const INFO_NS_ATTR_CHANGED: u8 = 0x00;

    pub fn dw0(event_type: u8, info: u8, log_page: u8) -> u32 {
        (event_type & 7) as u32 | (info as u32) << 8 | (log_page as u32) << 16
    }

    /// (type, info, log page) of an AER completion.
    pub fn parse(dw0: u32) -> (u8, u8, u8) {
        ((dw0 & 7) as u8, (dw0 >> 8) as u8, (dw0 >> 16) as u8)
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn get_log_page_numd_split() {
        let req = GetLogPage {
            lid: lid::DISCOVERY,
            rae: true,
            len: 0x40000 * 4 + 8,
            offset: 0x1_0000_0400,
        };
        let mut c = Command::default();
        req.apply(&mut c);
        // NUMDL in Dword 10 bits 31:16, NUMDU in Dword 11 bits 15:0.
        assert_eq!(c.cdw10, 0x70 | 1 << 15 | 0x0001 << 16);
        assert_eq!(c.cdw11, 0x0004);
        assert_eq!(c.cdw12, 0x400);
        assert_eq!(c.cdw13, 1);
        assert_eq!(GetLogPage::from_command(&c), req);
    }

    #[test]
    fn smart_and_slot_layout() {
        let s = SmartLog {
            available_spare: 100,
            spare_threshold: 10,
            host_read_commands: 7,
            data_units_written: 3,
            temperature_k: 300,
            ..Default::default()
        };
        let b = s.encode();
        assert_eq!(b[3], 100);
        assert_eq!(&b[1..3], &300u16.to_le_bytes());
        assert_eq!(b[64], 7);
        assert_eq!(b[48], 3);
        assert_eq!(SmartLog::decode(&b), s);
        let f = encode_firmware_slot("0.1.0");
        assert_eq!(f[0], 1);
        assert_eq!(&f[8..16], b"0.1.0   ");
    }

    #[test]
    fn changed_ns_list_overflow() {
        let b = encode_changed_ns_list(&[3, 9]);
        assert_eq!(&b[0..8], &[3, 0, 0, 0, 9, 0, 0, 0]);
        let many: Vec<u32> = (1..=1025).collect();
        let b = encode_changed_ns_list(&many);
        assert_eq!(&b[0..8], &[0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0]);
        assert_eq!(
            aen::dw0(aen::TYPE_NOTICE, 0, lid::CHANGED_NS_LIST),
            0x0004_0002
        );
        assert_eq!(aen::parse(0x0004_0002), (2, 0, 4));
    }
}
