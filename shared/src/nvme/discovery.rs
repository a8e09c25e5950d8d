//! The Discovery Log Page (NVMe-oF 1.1 §5.3, Figures 37-38): a 1024-byte header followed
//! by one 1024-byte entry per (subsystem, port).

use super::{get_str, get_u16, get_u64, put_ascii_padded, put_str_nul, put_u16, put_u64};

pub const HEADER_LEN: usize = 1024;
pub const ENTRY_LEN: usize = 1024;

/// TRTYPE (byte 0).
pub const TRTYPE_TCP: u8 = 3;
/// RDMA transport (NVMe RDMA Transport 1.0 §3.1.1).
pub const TRTYPE_RDMA: u8 = 1;
/// TSAS of an RDMA entry (NVMe RDMA Transport 1.0 Figure 3): RDMA_QPTYPE reliable connected,
/// RDMA_PRTYPE no provider specified, RDMA_CMS RDMA_IP_CM (sockets addressing, which is
/// what librdmacm and the Linux host use).
pub const RDMA_TSAS: [u8; 3] = [1, 1, 1];
/// ADRFAM (byte 1).
pub const ADRFAM_IPV4: u8 = 1;
pub const ADRFAM_IPV6: u8 = 2;
/// SUBTYPE (byte 2).
pub const SUBTYPE_DISCOVERY_REFERRAL: u8 = 1;
pub const SUBTYPE_NVME: u8 = 2;
pub const SUBTYPE_CURRENT_DISCOVERY: u8 = 3;
/// TREQ (byte 3) bits 1:0 = 10b: secure channel not required.
pub const TREQ_SECURE_CHANNEL_NOT_REQUIRED: u8 = 0x2;

/// One discovery log entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryEntry {
    pub trtype: u8,
    pub adrfam: u8,
    pub subtype: u8,
    pub treq: u8,
    pub portid: u16,
    pub cntlid: u16,
    /// Admin max SQ size.
    pub asqsz: u16,
    /// Bytes 32-63: transport service id (the TCP port, ASCII, space padded).
    pub trsvcid: String,
    /// Bytes 256-511.
    pub subnqn: String,
    /// Bytes 512-767: transport address (ASCII, space padded).
    pub traddr: String,
    /// Bytes 768-1023: transport specific (TCP: SECTYPE byte 0, 0 = none). RDMA entries
    /// carry [`RDMA_TSAS`] there instead (this field is ignored for them).
    pub sectype: u8,
}

impl DiscoveryEntry {
    pub fn encode(&self, b: &mut [u8]) {
        b[..ENTRY_LEN].fill(0);
        b[0] = self.trtype;
        b[1] = self.adrfam;
        b[2] = self.subtype;
        b[3] = self.treq;
        put_u16(b, 4, self.portid);
        put_u16(b, 6, self.cntlid);
        put_u16(b, 8, self.asqsz);
        put_ascii_padded(&mut b[32..64], &self.trsvcid);
        put_str_nul(&mut b[256..512], &self.subnqn);
        put_ascii_padded(&mut b[512..768], &self.traddr);
        if self.trtype == TRTYPE_RDMA {
            b[768..771].copy_from_slice(&RDMA_TSAS);
        } else {
            b[768] = self.sectype;
        }
    }
    pub fn decode(b: &[u8]) -> Self {
        DiscoveryEntry {
            trtype: b[0],
            adrfam: b[1],
            subtype: b[2],
            treq: b[3],
            portid: get_u16(b, 4),
            cntlid: get_u16(b, 6),
            asqsz: get_u16(b, 8),
            trsvcid: get_str(&b[32..64]),
            subnqn: get_str(&b[256..512]),
            traddr: get_str(&b[512..768]),
            sectype: b[768],
        }
    }
}

/// The whole log page: GENCTR (bytes 0-7), NUMREC (8-15), RECFMT (16-17), entries.
pub fn encode_log(genctr: u64, entries: &[DiscoveryEntry]) -> Vec<u8> {
    let mut b = vec![0u8; HEADER_LEN + ENTRY_LEN * entries.len()];
    put_u64(&mut b, 0, genctr);
    put_u64(&mut b, 8, entries.len() as u64);
    for (i, e) in entries.iter().enumerate() {
        let off = HEADER_LEN + i * ENTRY_LEN;
        e.encode(&mut b[off..off + ENTRY_LEN]);
    }
    b
}

/// (GENCTR, entries) from a log page; a truncated page yields the entries present.
pub fn decode_log(b: &[u8]) -> (u64, Vec<DiscoveryEntry>) {
    if b.len() < HEADER_LEN {
        return (0, Vec::new());
    }
    let n = get_u64(b, 8) as usize;
    let entries = b[HEADER_LEN..]
        .chunks_exact(ENTRY_LEN)
        .take(n)
        .map(DiscoveryEntry::decode)
        .collect();
    (get_u64(b, 0), entries)
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn entry_layout() {
        let e = DiscoveryEntry {
            trtype: TRTYPE_TCP,
            adrfam: ADRFAM_IPV4,
            subtype: SUBTYPE_NVME,
            treq: TREQ_SECURE_CHANNEL_NOT_REQUIRED,
            portid: 1,
            cntlid: 0xFFFF,
            asqsz: 32,
            trsvcid: "4420".into(),
            subnqn: "nqn.2024-01.io.nacre:v".into(),
            traddr: "127.0.0.1".into(),
            sectype: 0,
        };
        let b = encode_log(5, std::slice::from_ref(&e));
        assert_eq!(b.len(), 2048);
        assert_eq!(&b[8..16], &1u64.to_le_bytes());
        let en = &b[1024..];
        assert_eq!(&en[0..4], &[3, 1, 2, 2]);
        assert_eq!(&en[6..8], &[0xFF, 0xFF]);
        assert_eq!(&en[32..37], b"4420 ");
        assert_eq!(&en[256..260], b"nqn.");
        assert_eq!(&en[512..522], b"127.0.0.1 ");
        assert_eq!(decode_log(&b), (5, vec![e]));
    }

    /// An RDMA entry carries the RDMA TSAS (Figure 3 of the RDMA transport spec) in bytes
    /// 768-770: reliable connected, no provider specified, RDMA_IP_CM; the rest stays zero.
    #[test]
    fn rdma_entry_carries_its_tsas() {
        let e = DiscoveryEntry {
            trtype: TRTYPE_RDMA,
            adrfam: ADRFAM_IPV4,
            subtype: SUBTYPE_NVME,
            treq: TREQ_SECURE_CHANNEL_NOT_REQUIRED,
            portid: 2,
            cntlid: 0xFFFF,
            asqsz: 32,
            trsvcid: "4420".into(),
            subnqn: "nqn.2024-01.io.nacre:v".into(),
            traddr: "192.0.2.1".into(),
            sectype: 7,
        };
        let mut b = vec![0u8; ENTRY_LEN];
        e.encode(&mut b);
        assert_eq!(b[0], 1);
        assert_eq!(&b[768..772], &[1, 1, 1, 0]);
        assert!(b[772..].iter().all(|&x| x == 0));
    }
}
