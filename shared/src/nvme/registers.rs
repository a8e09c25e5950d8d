//! Controller properties (NVMe Base 2.0 §3.1.3, Figure 35), reached over fabrics with
//! Property Get/Set instead of MMIO.

/// Property offsets.
pub const CAP: u32 = 0x00;
pub const VS: u32 = 0x08;
pub const INTMS: u32 = 0x0C;
pub const INTMC: u32 = 0x10;
pub const CC: u32 = 0x14;
pub const CSTS: u32 = 0x1C;
pub const NSSR: u32 = 0x20;

/// Version register value for NVMe `major.minor.tertiary` (§3.1.3.2).
pub const fn version(major: u16, minor: u8, tertiary: u8) -> u32 {
    (major as u32) << 16 | (minor as u32) << 8 | tertiary as u32
}

/// Controller Capabilities (§3.1.3.1) from its fields.
/// * `mqes` — Maximum Queue Entries Supported, zero-based (bits 15:0).
/// * CQR (bit 16) — contiguous queues required: always 1 on fabrics.
/// * `to_500ms` — worst-case time to CSTS.RDY in 500 ms units (bits 31:24).
/// * CSS bit 37 — the NVM command set.
/// * MPSMIN/MPSMAX (bits 51:48, 55:52) = 0: 4 KiB pages only.
pub fn cap(mqes: u16, to_500ms: u8) -> u64 {
    mqes as u64 | 1 << 16 | (to_500ms as u64) << 24 | 1 << 37
}

pub fn cap_mqes(cap: u64) -> u16 {
    cap as u16
}

/// Controller Configuration fields (§3.1.3.5).
pub mod cc {
    pub const EN: u32 = 1 << 0;
    pub const SHN_SHIFT: u32 = 14;
    pub const SHN_MASK: u32 = 3 << SHN_SHIFT;
    /// SHN values: 01b normal, 10b abrupt shutdown notification.
    pub const SHN_NORMAL: u32 = 1;
    pub const SHN_ABRUPT: u32 = 2;
    pub const IOSQES_SHIFT: u32 = 16;
    pub const IOCQES_SHIFT: u32 = 20;
    /// The only entry sizes nacre accepts: 64-byte SQEs (2^6), 16-byte CQEs (2^4).
    pub const IOSQES_64: u32 = 6;
    pub const IOCQES_16: u32 = 4;
}

/// Controller Status fields (§3.1.3.6).
pub mod csts {
    pub const RDY: u32 = 1 << 0;
    pub const CFS: u32 = 1 << 1;
    pub const SHST_SHIFT: u32 = 2;
    pub const SHST_MASK: u32 = 3 << SHST_SHIFT;
    /// SHST = 10b: shutdown processing complete.
    pub const SHST_COMPLETE: u32 = 2 << SHST_SHIFT;
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn cap_and_vs_fields() {
        let c = cap(1023, 30);
        assert_eq!(cap_mqes(c), 1023);
        assert_eq!(c >> 16 & 1, 1, "CQR");
        assert_eq!(c >> 24 & 0xFF, 30, "TO");
        assert_eq!(c >> 37 & 1, 1, "CSS NVM");
        assert_eq!(c >> 48 & 0xF, 0, "MPSMIN 4 KiB");
        assert_eq!(version(1, 4, 0), 0x0001_0400);
        assert_eq!(cc::SHN_MASK, 0xC000);
        assert_eq!(csts::SHST_COMPLETE, 0x8);
    }
}
