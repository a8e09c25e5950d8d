//! Identify data structures (NVMe Base 2.0 §5.17.2, NVM Command Set 1.0 §4.1.5).
//!
//! Every Identify data structure is 4096 bytes.

use super::{
    get_str, get_u16, get_u32, get_u64, put_ascii_padded, put_str_nul, put_u16, put_u32, put_u64,
    Command,
};

pub const IDENTIFY_LEN: usize = 4096;

/// Controller or Namespace Structure (CNS) values, Identify Dword 10 bits 7:0 (Figure 273).
pub mod cns {
    pub const NAMESPACE: u8 = 0x00;
    pub const CONTROLLER: u8 = 0x01;
    pub const ACTIVE_NS_LIST: u8 = 0x02;
    pub const NS_DESCRIPTOR_LIST: u8 = 0x03;
    /// I/O command set specific Identify Controller (with CSI in Dword 11 bits 31:24).
    pub const CS_CONTROLLER: u8 = 0x06;
}

/// The fields of an Identify command (Figures 271-272) besides its NSID.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Identify {
    /// Dword 10 bits 7:0: which data structure ([`cns`]).
    pub cns: u8,
    /// Dword 10 bits 31:16: Controller Identifier, for the CNS values that take one.
    pub cntid: u16,
    /// Dword 11 bits 31:24: Command Set Identifier, for the command-set-specific CNS values
    /// (0 is the NVM Command Set).
    pub csi: u8,
}

impl Identify {
    pub fn from_command(c: &Command) -> Self {
        Identify {
            cns: c.cdw10 as u8,
            cntid: (c.cdw10 >> 16) as u16,
            csi: (c.cdw11 >> 24) as u8,
        }
    }

    /// Fill Dwords 10-11 of `c`.
    pub fn apply(&self, c: &mut Command) {
        c.cdw10 = self.cns as u32 | (self.cntid as u32) << 16;
        c.cdw11 = (self.csi as u32) << 24;
    }
}

/// CNTRLTYPE (byte 111) values.
pub mod cntrltype {
    pub const IO: u8 = 1;
    pub const DISCOVERY: u8 = 2;
}

/// ONCS bits (bytes 520-521).
pub mod oncs {
    pub const DATASET_MANAGEMENT: u16 = 1 << 2;
    pub const WRITE_ZEROES: u16 = 1 << 3;
}

/// OAES bit 8: Namespace Attribute Notices are supported.
pub const OAES_NS_ATTR: u32 = 1 << 8;
/// OACS bit 8: the Doorbell Buffer Config command is supported.
pub const OACS_DOORBELL_BUFFER_CONFIG: u16 = 1 << 8;

/// SGLS bits (bytes 536-539): bit 0 SGLs supported (no alignment requirement), bit 20
/// the Offset subtype of SGL Data Block descriptors (in-capsule data).
pub const SGLS_SUPPORTED: u32 = 1 << 0;
pub const SGLS_OFFSET: u32 = 1 << 20;
/// SGLS bit 2: Keyed SGL Data Block descriptors supported (what RDMA transports move data
/// with; the Linux nvme-rdma host refuses a controller without it).
pub const SGLS_KEYED: u32 = 1 << 2;
/// SGLS bit 18: an SGL may describe more data than the command moves (the excess is
/// ignored).
pub const SGLS_LONGER_THAN_DATA: u32 = 1 << 18;

/// LPA bit 2: extended data for Get Log Page (NUMDU and the log page offset).
pub const LPA_EXTENDED_DATA: u8 = 1 << 2;

/// The Identify Controller fields nacre fills (Figure 275). Fields not listed are zero.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdentifyController {
    /// Bytes 0-1 and 2-3.
    pub vid: u16,
    pub ssvid: u16,
    /// Bytes 4-23, 24-63, 64-71: ASCII, space padded.
    pub serial: String,
    pub model: String,
    pub firmware: String,
    /// Byte 72: Recommended Arbitration Burst.
    pub rab: u8,
    /// Byte 76: CMIC bit 1: may have more than one controller (multipath capable).
    pub cmic: u8,
    /// Byte 77: Maximum Data Transfer Size, a power of two in units of CAP.MPSMIN (4 KiB).
    pub mdts: u8,
    /// Bytes 78-79.
    pub cntlid: u16,
    /// Bytes 80-83.
    pub ver: u32,
    /// Bytes 92-95: Optional Asynchronous Events Supported.
    pub oaes: u32,
    /// Bytes 96-99: Controller Attributes.
    pub ctratt: u32,
    /// Byte 111.
    pub cntrltype: u8,
    /// Bytes 256-257: Optional Admin Command Support.
    pub oacs: u16,
    /// Byte 258: Abort Command Limit (zero-based).
    pub acl: u8,
    /// Byte 259: Asynchronous Event Request Limit (zero-based).
    pub aerl: u8,
    /// Byte 260: Firmware Updates (bits 3:1 slots; bit 0 slot 1 read-only).
    pub frmw: u8,
    /// Byte 261: Log Page Attributes.
    pub lpa: u8,
    /// Byte 262: Error Log Page Entries (zero-based).
    pub elpe: u8,
    /// Bytes 320-321: Keep Alive Support: KATO granularity in 100 ms units (0 = none).
    pub kas: u16,
    /// Byte 512/513: SQ and CQ entry sizes (max << 4 | required), 0x66 and 0x44.
    pub sqes: u8,
    pub cqes: u8,
    /// Bytes 514-515: Maximum Outstanding Commands (fabrics).
    pub maxcmd: u16,
    /// Bytes 516-519: Number of Namespaces (the largest valid NSID).
    pub nn: u32,
    /// Bytes 520-521: Optional NVM Command Support.
    pub oncs: u16,
    /// Byte 525: Volatile Write Cache (bit 0 present).
    pub vwc: u8,
    /// Bytes 536-539: SGL Support.
    pub sgls: u32,
    /// Bytes 768-1023.
    pub subnqn: String,
    /// Bytes 1792-1795: I/O Queue Command Capsule Supported Size, 16-byte units (fabrics).
    pub ioccsz: u32,
    /// Bytes 1796-1799: I/O Queue Response Capsule Supported Size, 16-byte units.
    pub iorcsz: u32,
    /// Bytes 1800-1801: In Capsule Data Offset, 16-byte units (NVMe/TCP hosts require 0).
    pub icdoff: u16,
    /// Byte 1802: Fabrics Controller Attributes (bit 0: static controller model).
    pub fcatt: u8,
    /// Byte 1803: Maximum SGL Data Block Descriptors a command may carry (NVMe/TCP: 1).
    pub msdbd: u8,
}

impl IdentifyController {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; IDENTIFY_LEN];
        put_u16(&mut b, 0, self.vid);
        put_u16(&mut b, 2, self.ssvid);
        put_ascii_padded(&mut b[4..24], &self.serial);
        put_ascii_padded(&mut b[24..64], &self.model);
        put_ascii_padded(&mut b[64..72], &self.firmware);
        b[72] = self.rab;
        b[76] = self.cmic;
        b[77] = self.mdts;
        put_u16(&mut b, 78, self.cntlid);
        put_u32(&mut b, 80, self.ver);
        put_u32(&mut b, 92, self.oaes);
        put_u32(&mut b, 96, self.ctratt);
        b[111] = self.cntrltype;
        put_u16(&mut b, 256, self.oacs);
        b[258] = self.acl;
        b[259] = self.aerl;
        b[260] = self.frmw;
        b[261] = self.lpa;
        b[262] = self.elpe;
        put_u16(&mut b, 320, self.kas);
        b[512] = self.sqes;
        b[513] = self.cqes;
        put_u16(&mut b, 514, self.maxcmd);
        put_u32(&mut b, 516, self.nn);
        put_u16(&mut b, 520, self.oncs);
        b[525] = self.vwc;
        put_u32(&mut b, 536, self.sgls);
        put_str_nul(&mut b[768..1024], &self.subnqn);
        put_u32(&mut b, 1792, self.ioccsz);
        put_u32(&mut b, 1796, self.iorcsz);
        put_u16(&mut b, 1800, self.icdoff);
        b[1802] = self.fcatt;
        b[1803] = self.msdbd;
        b
    }

    /// Decode a 4096-byte structure (shorter input is zero-extended).
    pub fn decode(src: &[u8]) -> Self {
        let mut b = vec![0u8; IDENTIFY_LEN];
        let n = src.len().min(IDENTIFY_LEN);
        b[..n].copy_from_slice(&src[..n]);
        IdentifyController {
            vid: get_u16(&b, 0),
            ssvid: get_u16(&b, 2),
            serial: get_str(&b[4..24]),
            model: get_str(&b[24..64]),
            firmware: get_str(&b[64..72]),
            rab: b[72],
            cmic: b[76],
            mdts: b[77],
            cntlid: get_u16(&b, 78),
            ver: get_u32(&b, 80),
            oaes: get_u32(&b, 92),
            ctratt: get_u32(&b, 96),
            cntrltype: b[111],
            oacs: get_u16(&b, 256),
            acl: b[258],
            aerl: b[259],
            frmw: b[260],
            lpa: b[261],
            elpe: b[262],
            kas: get_u16(&b, 320),
            sqes: b[512],
            cqes: b[513],
            maxcmd: get_u16(&b, 514),
            nn: get_u32(&b, 516),
            oncs: get_u16(&b, 520),
            vwc: b[525],
            sgls: get_u32(&b, 536),
            subnqn: get_str(&b[768..1024]),
            ioccsz: get_u32(&b, 1792),
            iorcsz: get_u32(&b, 1796),
            icdoff: get_u16(&b, 1800),
            fcatt: b[1802],
            msdbd: b[1803],
        }
    }
}

/// NSFEAT bit 0: thin provisioning (NUSE may be less than NCAP); bit 3: NAWUN etc. valid.
pub const NSFEAT_THIN: u8 = 1 << 0;
/// NMIC bit 0: the namespace may be attached to more than one controller.
pub const NMIC_SHARED: u8 = 1 << 0;
/// DLFEAT: bits 2:0 = 001b deallocated blocks read as zeros; bit 3 Write Zeroes may
/// deallocate.
pub const DLFEAT_READ_ZEROES: u8 = 0b001 | 1 << 3;

/// The Identify Namespace fields nacre fills (NVM Command Set 1.0 Figure 97), with a single
/// LBA format (LBAF0) of `1 << lbads` bytes and no metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdentifyNamespace {
    /// Bytes 0-7, 8-15, 16-23 in logical blocks.
    pub nsze: u64,
    pub ncap: u64,
    pub nuse: u64,
    /// Byte 24.
    pub nsfeat: u8,
    /// Byte 25: number of LBA formats, zero-based.
    pub nlbaf: u8,
    /// Byte 26: formatted LBA size (bits 3:0 index into LBAF).
    pub flbas: u8,
    /// Byte 30.
    pub nmic: u8,
    /// Byte 33.
    pub dlfeat: u8,
    /// Bytes 104-119.
    pub nguid: [u8; 16],
    /// Bytes 120-127.
    pub eui64: [u8; 8],
    /// LBAF0 (bytes 128-131) bits 23:16: log2 of the logical block size.
    pub lbads: u8,
}

impl IdentifyNamespace {
    pub fn for_geometry(blocks: u64, block_size: u32, nguid: [u8; 16]) -> Self {
        IdentifyNamespace {
            nsze: blocks,
            ncap: blocks,
            nuse: blocks,
            nsfeat: 0,
            nlbaf: 0,
            flbas: 0,
            nmic: NMIC_SHARED,
            dlfeat: DLFEAT_READ_ZEROES,
            nguid,
            eui64: [0; 8],
            lbads: block_size.trailing_zeros() as u8,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; IDENTIFY_LEN];
        put_u64(&mut b, 0, self.nsze);
        put_u64(&mut b, 8, self.ncap);
        put_u64(&mut b, 16, self.nuse);
        b[24] = self.nsfeat;
        b[25] = self.nlbaf;
        b[26] = self.flbas;
        b[30] = self.nmic;
        b[33] = self.dlfeat;
        b[104..120].copy_from_slice(&self.nguid);
        b[120..128].copy_from_slice(&self.eui64);
        put_u32(&mut b, 128, (self.lbads as u32) << 16);
        b
    }

    pub fn decode(src: &[u8]) -> Self {
        let mut b = vec![0u8; IDENTIFY_LEN];
        let n = src.len().min(IDENTIFY_LEN);
        b[..n].copy_from_slice(&src[..n]);
        let flbas = b[26];
        let lbaf = get_u32(&b, 128 + 4 * (flbas & 0xF) as usize);
        let mut nguid = [0u8; 16];
        nguid.copy_from_slice(&b[104..120]);
        let mut eui64 = [0u8; 8];
        eui64.copy_from_slice(&b[120..128]);
        IdentifyNamespace {
            nsze: get_u64(&b, 0),
            ncap: get_u64(&b, 8),
            nuse: get_u64(&b, 16),
            nsfeat: b[24],
            nlbaf: b[25],
            flbas,
            nmic: b[30],
            dlfeat: b[33],
            nguid,
            eui64,
            lbads: (lbaf >> 16) as u8,
        }
    }
}

/// Active Namespace ID list (CNS 02h): up to 1024 NSIDs greater than the command's NSID,
/// ascending, zero-terminated.
pub fn encode_active_ns_list(nsids: impl IntoIterator<Item = u32>, after: u32) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    for (i, id) in nsids
        .into_iter()
        .filter(|&id| id > after)
        .take(IDENTIFY_LEN / 4)
        .enumerate()
    {
        put_u32(&mut b, i * 4, id);
    }
    b
}

pub fn decode_ns_list(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .take_while(|&id| id != 0)
        .collect()
}

/// Namespace Identifier Type (NIDT) values of the descriptor list (Figure 274).
pub mod nidt {
    pub const EUI64: u8 = 1;
    pub const NGUID: u8 = 2;
    pub const UUID: u8 = 3;
    pub const CSI: u8 = 4;
}

/// One Namespace Identification Descriptor: NIDT, NIDL, 2 reserved bytes, NID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NsDescriptor {
    pub nidt: u8,
    pub nid: Vec<u8>,
}

/// Encode the descriptor list (CNS 03h); a zero NIDT ends it.
pub fn encode_ns_descriptors(descs: &[NsDescriptor]) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    let mut off = 0;
    for d in descs {
        let need = 4 + d.nid.len();
        if off + need > IDENTIFY_LEN {
            break;
        }
        b[off] = d.nidt;
        b[off + 1] = d.nid.len() as u8;
        b[off + 4..off + need].copy_from_slice(&d.nid);
        off += need;
    }
    b
}

pub fn decode_ns_descriptors(b: &[u8]) -> Vec<NsDescriptor> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 4 <= b.len() && b[off] != 0 {
        let len = b[off + 1] as usize;
        if off + 4 + len > b.len() {
            break;
        }
        out.push(NsDescriptor {
            nidt: b[off],
            nid: b[off + 4..off + 4 + len].to_vec(),
        });
        off += 4 + len;
    }
    out
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn identify_command_fields_follow_figure_272() {
        let c = Command {
            cdw10: 0x0012_0006,
            cdw11: 0x0200_0000,
            ..Default::default()
        };
        let i = Identify::from_command(&c);
        assert_eq!(
            i,
            Identify {
                cns: cns::CS_CONTROLLER,
                cntid: 0x12,
                csi: 2
            }
        );
        let mut back = Command::default();
        i.apply(&mut back);
        assert_eq!((back.cdw10, back.cdw11), (0x0012_0006, 0x0200_0000));
    }

    #[test]
    fn identify_controller_offsets() {
        let id = IdentifyController {
            serial: "SN1".into(),
            model: "nacre".into(),
            firmware: "0.1.0".into(),
            mdts: 5,
            cntlid: 0x0102,
            ver: 0x0001_0400,
            oaes: OAES_NS_ATTR,
            cntrltype: cntrltype::IO,
            kas: 10,
            sqes: 0x66,
            cqes: 0x44,
            maxcmd: 128,
            nn: 32,
            oncs: oncs::DATASET_MANAGEMENT | oncs::WRITE_ZEROES,
            vwc: 1,
            sgls: SGLS_SUPPORTED | SGLS_OFFSET,
            subnqn: "nqn.2024-01.io.nacre:a".into(),
            ioccsz: 516,
            iorcsz: 1,
            ..Default::default()
        };
        let b = id.encode();
        assert_eq!(b.len(), 4096);
        assert_eq!(&b[4..8], b"SN1 ");
        assert_eq!(b[23], b' ');
        assert_eq!(&b[24..29], b"nacre");
        assert_eq!(&b[64..69], b"0.1.0");
        assert_eq!(b[77], 5);
        assert_eq!(&b[78..80], &[2, 1]);
        assert_eq!(&b[80..84], &[0, 4, 1, 0]);
        assert_eq!(b[93], 1, "OAES bit 8");
        assert_eq!(b[111], 1);
        assert_eq!(&b[320..322], &[10, 0]);
        assert_eq!(b[512], 0x66);
        assert_eq!(&b[516..520], &[32, 0, 0, 0]);
        assert_eq!(b[520], 0x0C, "ONCS DSM + write zeroes");
        assert_eq!(b[525], 1);
        assert_eq!(&b[536..540], &[1, 0, 0x10, 0]);
        assert_eq!(&b[768..773], b"nqn.2");
        assert_eq!(b[768 + 22], 0);
        assert_eq!(&b[1792..1796], &516u32.to_le_bytes());
        assert_eq!(IdentifyController::decode(&b), id);
    }

    #[test]
    fn identify_namespace_offsets() {
        let ns = IdentifyNamespace::for_geometry(256, 4096, [7; 16]);
        let b = ns.encode();
        assert_eq!(&b[0..8], &256u64.to_le_bytes());
        assert_eq!(&b[8..16], &256u64.to_le_bytes());
        assert_eq!(b[25], 0);
        assert_eq!(b[26], 0);
        assert_eq!(&b[104..120], &[7; 16]);
        // LBAF0: LBADS = 12 in bits 23:16.
        assert_eq!(&b[128..132], &[0, 0, 12, 0]);
        assert_eq!(IdentifyNamespace::decode(&b), ns);
        assert_eq!(IdentifyNamespace::for_geometry(1, 512, [0; 16]).lbads, 9);
    }

    #[test]
    fn ns_lists_and_descriptors() {
        let b = encode_active_ns_list([1, 2, 5], 1);
        assert_eq!(decode_ns_list(&b), vec![2, 5]);
        let d = vec![
            NsDescriptor {
                nidt: nidt::NGUID,
                nid: vec![1; 16],
            },
            NsDescriptor {
                nidt: nidt::CSI,
                nid: vec![0],
            },
        ];
        let b = encode_ns_descriptors(&d);
        assert_eq!(&b[0..4], &[2, 16, 0, 0]);
        assert_eq!(&b[20..24], &[4, 1, 0, 0]);
        assert_eq!(b[25], 0);
        assert_eq!(decode_ns_descriptors(&b), d);
    }
}
