//! NVMe structures shared by nacred's NVMe-oF target, its tests and (later) its fabric
//! initiator: the submission and completion queue entries, status codes, controller
//! registers, Identify data structures, log pages, features and the Fabrics command set.
//!
//! Module per area of the specifications:
//! * [`command`] — the 64-byte Submission Queue Entry (NVMe Base 2.0 §4.2) and SGL descriptors (§4.3.2).
//! * [`completion`] — the 16-byte Completion Queue Entry (§4.6) and [`status`] codes (§4.6.1.2).
//! * [`registers`] — controller properties CAP, VS, CC, CSTS (§3.1.3).
//! * [`identify`] — the Identify command and its data: Controller, Namespace, Active NS list,
//!   NS descriptors (§5.17).
//! * [`log`] — Get Log Page (§5.16): error, SMART/health, firmware slot, changed NS list.
//! * [`features`] — Set/Get Features: identifiers and the commands' fields (§5.27).
//! * [`dsm`] — Dataset Management and its ranges (NVM Command Set 1.0 §3.2.3).
//! * [`fabrics`] — NVMe over Fabrics 1.1 commands: Connect, Property Get/Set (§3.3, §3.4, §3.5).
//! * [`discovery`] — the discovery log page (NVMe-oF 1.1 §5.3).
//! * [`auth`] — in-band authentication: Authentication Send/Receive and the DH-HMAC-CHAP
//!   messages (NVMe Base 2.0 §8.13).
//!
//! Everything is little-endian on the wire; encoders write into caller-provided buffers
//! and decoders take slices, so no structure depends on Rust's memory layout.

pub mod auth;
pub mod command;
pub mod completion;
pub mod discovery;
pub mod dsm;
pub mod fabrics;
pub mod features;
pub mod identify;
pub mod log;
pub mod registers;
pub mod status;

pub use command::{Command, SglDescriptor};
pub use completion::Completion;
pub use status::Status;

/// Admin command opcodes (NVMe Base 2.0 Figure 28).
pub mod admin_opcode {
    pub const DELETE_IO_SQ: u8 = 0x00;
    pub const CREATE_IO_SQ: u8 = 0x01;
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const DELETE_IO_CQ: u8 = 0x04;
    pub const CREATE_IO_CQ: u8 = 0x05;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0A;
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0C;
    pub const KEEP_ALIVE: u8 = 0x18;
    /// Doorbell Buffer Config (NVMe Base 2.0 §5.8): the host's shadow doorbells and EventIdx
    /// buffers, for emulated PCIe controllers.
    pub const DOORBELL_BUFFER_CONFIG: u8 = 0x7C;
    /// All Fabrics commands share this opcode; byte 4 (`fctype`) selects the command.
    pub const FABRICS: u8 = 0x7F;
}

/// NVM command set I/O opcodes (NVM Command Set 1.0 Figure 18).
pub mod io_opcode {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DATASET_MANAGEMENT: u8 = 0x09;
}

/// NVMe Qualified Names are at most 223 bytes of UTF-8 (NVMe Base 2.0 §4.5), carried in
/// 256-byte NUL-padded fields.
pub const NQN_MAX_LEN: usize = 223;
/// The well-known NQN of discovery controllers (NVMe-oF 1.1 §5).
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// Check an NQN: 1..=223 bytes, starting with `nqn.` (NVMe Base 2.0 §4.5).
pub fn validate_nqn(nqn: &str) -> Result<(), String> {
    if nqn.is_empty() || nqn.len() > NQN_MAX_LEN {
        return Err(format!(
            "NQN must be 1 to {NQN_MAX_LEN} bytes long (got {})",
            nqn.len()
        ));
    }
    if !nqn.starts_with("nqn.") {
        return Err(format!(
            "NQN {nqn:?} must start with \"nqn.\" (e.g. nqn.2024-01.io.nacre:vol0)"
        ));
    }
    if nqn.bytes().any(|b| b.is_ascii_control()) {
        return Err("NQN must not contain control characters".into());
    }
    Ok(())
}

// Little-endian field accessors. Callers always pass slices long enough for the structure
// they decode (checked once at the structure's entry point), so the indexing cannot fail.

#[inline]
pub fn get_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
#[inline]
pub fn get_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}
#[inline]
pub fn get_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}
#[inline]
pub fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
#[inline]
pub fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
#[inline]
pub fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// Write `s` into a fixed ASCII field padded with spaces (serial, model, firmware revision:
/// NVMe Base 2.0 Figure 275: ASCII, padded with spaces).
pub fn put_ascii_padded(field: &mut [u8], s: &str) {
    field.fill(b' ');
    let n = s.len().min(field.len());
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Write `s` into a NUL-padded string field (NQNs, transport addresses).
pub fn put_str_nul(field: &mut [u8], s: &str) {
    field.fill(0);
    let n = s.len().min(field.len());
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Read a NUL- or space-padded string field; invalid UTF-8 is replaced, never a panic.
pub fn get_str(field: &[u8]) -> String {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end])
        .trim_end_matches(' ')
        .to_string()
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn nqn_rules() {
        assert!(validate_nqn("nqn.2024-01.io.nacre:vol0").is_ok());
        assert!(validate_nqn(DISCOVERY_NQN).is_ok());
        assert!(validate_nqn("").is_err());
        assert!(validate_nqn("iqn.x").is_err());
        assert!(validate_nqn(&format!("nqn.{}", "a".repeat(220))).is_err());
    }

    #[test]
    fn string_fields() {
        let mut f = [0u8; 8];
        put_ascii_padded(&mut f, "ab");
        assert_eq!(&f, b"ab      ");
        assert_eq!(get_str(&f), "ab");
        put_str_nul(&mut f, "xyz");
        assert_eq!(&f, b"xyz\0\0\0\0\0");
        assert_eq!(get_str(&f), "xyz");
        put_ascii_padded(&mut f, "0123456789");
        assert_eq!(&f, b"01234567");
    }
}
