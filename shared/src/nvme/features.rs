//! Set/Get Features (NVMe Base 2.0 §5.27, Figure 317): identifiers in Dword 10 bits 7:0;
//! the Save bit (Set, Dword 10 bit 31) and Select field (Get, Dword 10 bits 10:8).

pub mod fid {
    pub const ARBITRATION: u8 = 0x01;
    pub const POWER_MANAGEMENT: u8 = 0x02;
    pub const TEMPERATURE_THRESHOLD: u8 = 0x04;
    pub const ERROR_RECOVERY: u8 = 0x05;
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const INTERRUPT_COALESCING: u8 = 0x08;
    pub const WRITE_ATOMICITY: u8 = 0x0A;
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0B;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0F;
}

/// Set Features Dword 10 bit 31.
pub const SAVE: u32 = 1 << 31;

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
}
