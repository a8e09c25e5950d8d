//! NVMe over Fabrics 1.1 commands (§3): Connect, Property Get, Property Set.
//!
//! Fabrics commands use opcode 7Fh with the command type in byte 4 (`fctype`).

use super::{
    admin_opcode, get_str, get_u16, get_u32, get_u64, put_str_nul, put_u16, put_u32, put_u64,
    Command, SglDescriptor,
};

/// Fabrics command types (NVMe-oF 1.1 Figure 8).
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const AUTHENTICATION_SEND: u8 = 0x05;
    pub const AUTHENTICATION_RECEIVE: u8 = 0x06;
    pub const DISCONNECT: u8 = 0x08;
}

/// Connect data is always 1024 bytes (Figure 20).
pub const CONNECT_DATA_LEN: usize = 1024;
/// CNTLID of a Connect asking for any controller (dynamic controller model).
pub const CNTLID_DYNAMIC: u16 = 0xFFFF;
/// CATTR bit 2: the host disables SQ flow control (SQHD is then not maintained and a
/// controller may use C2HData's SUCCESS flag).
pub const CATTR_DISABLE_SQ_FLOW: u8 = 1 << 2;

/// Byte offsets inside the Connect SQE, used for Connect Invalid Parameters' IPO field.
pub mod connect_sqe_offset {
    pub const RECFMT: u16 = 40;
    pub const QID: u16 = 42;
    pub const SQSIZE: u16 = 44;
    pub const CATTR: u16 = 46;
    pub const KATO: u16 = 48;
}
/// Byte offsets inside the Connect data.
pub mod connect_data_offset {
    pub const HOSTID: u16 = 0;
    pub const CNTLID: u16 = 16;
    pub const SUBNQN: u16 = 256;
    pub const HOSTNQN: u16 = 512;
}

/// Completion Dword 0 of Connect Invalid Parameters (Figure 21): IATTR bit 0 in byte 2
/// (1 = the parameter is in the Connect data, 0 = in the SQE), IPO the byte offset.
pub fn connect_invalid_param_dw0(in_data: bool, offset: u16) -> u32 {
    (in_data as u32) << 16 | offset as u32
}

/// The Connect command fields (Figure 19).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connect {
    pub recfmt: u16,
    pub qid: u16,
    /// Zero-based submission queue size.
    pub sqsize: u16,
    pub cattr: u8,
    /// Keep Alive Timeout in milliseconds (admin queue only; 0 disables it).
    pub kato: u32,
}

impl Connect {
    pub fn from_command(c: &Command) -> Self {
        let b = c.to_bytes();
        Connect {
            recfmt: get_u16(&b, 40),
            qid: get_u16(&b, 42),
            sqsize: get_u16(&b, 44),
            cattr: b[46],
            kato: get_u32(&b, 48),
        }
    }

    pub fn to_command(&self, cid: u16) -> Command {
        let mut b = [0u8; 64];
        b[0] = admin_opcode::FABRICS;
        b[1] = super::command::PSDT_SGL;
        put_u16(&mut b, 2, cid);
        b[4] = fctype::CONNECT;
        SglDescriptor::in_capsule(CONNECT_DATA_LEN as u32).encode(&mut b[24..40]);
        put_u16(&mut b, 40, self.recfmt);
        put_u16(&mut b, 42, self.qid);
        put_u16(&mut b, 44, self.sqsize);
        b[46] = self.cattr;
        put_u32(&mut b, 48, self.kato);
        Command::decode(&b)
    }
}

/// The 1024 bytes of Connect data (Figure 20).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectData {
    pub hostid: [u8; 16],
    pub cntlid: u16,
    pub subnqn: String,
    pub hostnqn: String,
}

impl ConnectData {
    /// `b` must be at least [`CONNECT_DATA_LEN`] bytes.
    pub fn decode(b: &[u8]) -> Self {
        let mut hostid = [0u8; 16];
        hostid.copy_from_slice(&b[0..16]);
        ConnectData {
            hostid,
            cntlid: get_u16(b, 16),
            subnqn: get_str(&b[256..512]),
            hostnqn: get_str(&b[512..768]),
        }
    }
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; CONNECT_DATA_LEN];
        b[0..16].copy_from_slice(&self.hostid);
        put_u16(&mut b, 16, self.cntlid);
        put_str_nul(&mut b[256..512], &self.subnqn);
        put_str_nul(&mut b[512..768], &self.hostnqn);
        b
    }
}

/// Property Get / Property Set (Figures 25-28): ATTRIB byte 40 bits 2:0 give the size
/// (0 = 4 bytes, 1 = 8 bytes), OFST at bytes 44-47, VALUE (Set) at bytes 48-55.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Property {
    pub eight_bytes: bool,
    pub offset: u32,
    pub value: u64,
}

impl Property {
    pub fn from_command(c: &Command) -> Self {
        let b = c.to_bytes();
        Property {
            eight_bytes: b[40] & 7 == 1,
            offset: get_u32(&b, 44),
            value: get_u64(&b, 48),
        }
    }

    /// The ATTRIB size field holds a reserved value (neither 4 nor 8 bytes).
    pub fn size_field(c: &Command) -> u8 {
        c.cdw10 as u8 & 7
    }

    pub fn get_command(cid: u16, offset: u32, eight_bytes: bool) -> Command {
        Self::command(fctype::PROPERTY_GET, cid, offset, eight_bytes, 0)
    }

    pub fn set_command(cid: u16, offset: u32, eight_bytes: bool, value: u64) -> Command {
        Self::command(fctype::PROPERTY_SET, cid, offset, eight_bytes, value)
    }

    fn command(fct: u8, cid: u16, offset: u32, eight: bool, value: u64) -> Command {
        let mut b = [0u8; 64];
        b[0] = admin_opcode::FABRICS;
        put_u16(&mut b, 2, cid);
        b[4] = fct;
        b[40] = eight as u8;
        put_u32(&mut b, 44, offset);
        put_u64(&mut b, 48, value);
        Command::decode(&b)
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn connect_sqe_and_data_layout() {
        let c = Connect {
            recfmt: 0,
            qid: 3,
            sqsize: 127,
            cattr: CATTR_DISABLE_SQ_FLOW,
            kato: 15000,
        }
        .to_command(9);
        let b = c.to_bytes();
        assert_eq!(b[0], 0x7F);
        assert_eq!(b[4], 0x01);
        assert_eq!(&b[32..36], &1024u32.to_le_bytes());
        assert_eq!(b[39], 0x01, "in-capsule SGL");
        assert_eq!(&b[42..44], &[3, 0]);
        assert_eq!(&b[44..46], &[127, 0]);
        assert_eq!(b[46], 4);
        assert_eq!(&b[48..52], &15000u32.to_le_bytes());
        assert_eq!(Connect::from_command(&c).qid, 3);

        let d = ConnectData {
            hostid: [0xAA; 16],
            cntlid: 0xFFFF,
            subnqn: "nqn.2024-01.io.nacre:x".into(),
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:1".into(),
        };
        let b = d.encode();
        assert_eq!(b.len(), 1024);
        assert_eq!(&b[16..18], &[0xFF, 0xFF]);
        assert_eq!(&b[256..260], b"nqn.");
        assert_eq!(&b[512..516], b"nqn.");
        assert_eq!(ConnectData::decode(&b), d);
        assert_eq!(connect_invalid_param_dw0(true, 256), 0x0001_0100);
    }

    #[test]
    fn property_layout() {
        let c = Property::set_command(1, 0x14, false, 0x0046_0001);
        let b = c.to_bytes();
        assert_eq!(b[4], 0x00);
        assert_eq!(b[40], 0);
        assert_eq!(&b[44..48], &[0x14, 0, 0, 0]);
        assert_eq!(&b[48..52], &[1, 0, 0x46, 0]);
        let p = Property::from_command(&c);
        assert_eq!(
            (p.offset, p.value, p.eight_bytes),
            (0x14, 0x0046_0001, false)
        );
        let g = Property::get_command(2, 0, true);
        assert_eq!(g.to_bytes()[4], 0x04);
        assert!(Property::from_command(&g).eight_bytes);
    }
}
