//! Completion status codes (NVMe Base 2.0 §4.6.1.2 and NVMe-oF 1.1 Figure 20 for Connect).
//!
//! The 15-bit Status Field sits in bits 15:1 of CQE Dword 3's upper half: SC (bits 8:1),
//! SCT (bits 11:9), CRD (13:12), M (14), DNR (15). Bit 0 is the phase tag, which fabrics
//! transports leave zero.

/// Status Code Type (NVMe Base 2.0 Figure 95).
pub mod sct {
    pub const GENERIC: u8 = 0x0;
    pub const COMMAND_SPECIFIC: u8 = 0x1;
    pub const MEDIA: u8 = 0x2;
    pub const PATH: u8 = 0x3;
}

/// An NVMe completion status: SCT, SC and the Do Not Retry bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status {
    pub sct: u8,
    pub sc: u8,
    pub dnr: bool,
}

impl Status {
    pub const fn new(sct: u8, sc: u8, dnr: bool) -> Self {
        Status { sct, sc, dnr }
    }
    const fn generic(sc: u8) -> Self {
        Status::new(sct::GENERIC, sc, true)
    }
    const fn specific(sc: u8) -> Self {
        Status::new(sct::COMMAND_SPECIFIC, sc, true)
    }

    // Generic Command Status (NVMe Base 2.0 Figure 96).
    pub const SUCCESS: Status = Status::new(0, 0, false);
    pub const INVALID_OPCODE: Status = Status::generic(0x01);
    pub const INVALID_FIELD: Status = Status::generic(0x02);
    pub const COMMAND_ID_CONFLICT: Status = Status::generic(0x03);
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04);
    pub const INTERNAL_ERROR: Status = Status::generic(0x06);
    pub const ABORT_REQUESTED: Status = Status::generic(0x07);
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0B);
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0C);
    pub const INVALID_SGL_DESCRIPTOR: Status = Status::generic(0x0D);
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::generic(0x0F);
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::generic(0x11);
    pub const SGL_OFFSET_INVALID: Status = Status::generic(0x16);
    /// Retryable: the host may resubmit (DNR clear).
    pub const TRANSIENT_TRANSPORT_ERROR: Status = Status::new(sct::GENERIC, 0x22, false);
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80);
    pub const NAMESPACE_NOT_READY: Status = Status::new(sct::GENERIC, 0x82, false);

    // Command Specific Status (NVMe Base 2.0 Figure 97).
    pub const INVALID_QUEUE_IDENTIFIER: Status = Status::specific(0x01);
    pub const ASYNC_EVENT_LIMIT_EXCEEDED: Status = Status::specific(0x05);
    pub const INVALID_LOG_PAGE: Status = Status::specific(0x09);
    pub const FEATURE_NOT_SAVEABLE: Status = Status::specific(0x0D);
    /// NVM Command Set: a write or deallocate to a read-only namespace range.
    pub const WRITE_TO_READ_ONLY: Status = Status::specific(0x82);

    // Fabrics Connect (NVMe-oF 1.1 Figure 20, command specific).
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::specific(0x80);
    pub const CONNECT_CONTROLLER_BUSY: Status = Status::specific(0x81);
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::specific(0x82);
    pub const CONNECT_RESTART_DISCOVERY: Status = Status::specific(0x83);
    pub const CONNECT_INVALID_HOST: Status = Status::specific(0x84);

    // Media and Data Integrity Errors (NVMe Base 2.0 Figure 98).
    pub const WRITE_FAULT: Status = Status::new(sct::MEDIA, 0x80, false);
    pub const UNRECOVERED_READ_ERROR: Status = Status::new(sct::MEDIA, 0x81, false);

    // Path Related Status (NVMe Base 2.0 Figure 99).
    /// The controller's path to the namespace failed. Retryable as it stands (DNR clear);
    /// [`Status::do_not_retry`] marks it final.
    pub const INTERNAL_PATH_ERROR: Status = Status::new(sct::PATH, 0x00, false);

    /// The same status with Do Not Retry set.
    pub const fn do_not_retry(self) -> Self {
        Status::new(self.sct, self.sc, true)
    }

    pub fn is_success(&self) -> bool {
        self.sct == 0 && self.sc == 0
    }

    /// The 16-bit value of CQE bytes 14..16 (phase tag 0).
    pub fn to_field(self) -> u16 {
        ((self.dnr as u16) << 15) | (((self.sct & 7) as u16) << 9) | ((self.sc as u16) << 1)
    }

    /// Decode CQE bytes 14..16 (the phase tag, CRD and More bits are ignored).
    pub fn from_field(v: u16) -> Self {
        Status {
            sc: (v >> 1) as u8,
            sct: ((v >> 9) & 7) as u8,
            dnr: v & 0x8000 != 0,
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NVMe status SCT {:#x} SC {:#04x}{}",
            self.sct,
            self.sc,
            if self.dnr { " (DNR)" } else { "" }
        )
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn status_field_layout() {
        // Invalid Field in Command with DNR: SC 0x02 << 1 | DNR bit 15.
        assert_eq!(Status::INVALID_FIELD.to_field(), 0x8004);
        // Connect Invalid Host: SCT 1 (bits 11:9), SC 0x84.
        assert_eq!(
            Status::CONNECT_INVALID_HOST.to_field(),
            0x8000 | 0x200 | 0x108
        );
        assert_eq!(Status::SUCCESS.to_field(), 0);
        for s in [
            Status::LBA_OUT_OF_RANGE,
            Status::UNRECOVERED_READ_ERROR,
            Status::TRANSIENT_TRANSPORT_ERROR,
        ] {
            assert_eq!(Status::from_field(s.to_field()), s);
        }
        // The phase tag (bit 0) does not disturb decoding.
        assert_eq!(Status::from_field(0x8005), Status::INVALID_FIELD);
    }
}
