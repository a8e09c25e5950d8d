//! Builders of well-formed inputs, for the seed generator.

use nacre_shared::nvme::fabrics::{self, Connect, ConnectData, Property};
use nacre_shared::nvme::registers;
use nacre_shared::nvme_tcp::{self as tcp, Digests};

use super::nvmf_target::icreq;
use super::{init_flags, CmdRecord, HOSTNQN, NQN, VQ_SIZE};

/// One descriptor for [`virtqueue`] input.
#[derive(Debug, Clone, Copy)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// [`virtqueue`] input: `table` (at most [`VQ_SIZE`] descriptors), the avail ring's
/// heads, and `data` placed at [`VQ_DATA`](super::VQ_DATA).
pub fn virtqueue(flags: u8, heads: &[u16], table: &[Desc], data: &[u8]) -> Vec<u8> {
    let mut v = vec![flags, heads.len() as u8];
    let mut ring = vec![0u8; 2 * VQ_SIZE as usize];
    for (i, h) in heads.iter().take(VQ_SIZE as usize).enumerate() {
        ring[2 * i..2 * i + 2].copy_from_slice(&h.to_le_bytes());
    }
    v.extend(ring);
    let mut t = vec![0u8; 16 * VQ_SIZE as usize];
    for (i, d) in table.iter().take(VQ_SIZE as usize).enumerate() {
        let e = &mut t[16 * i..16 * i + 16];
        e[0..8].copy_from_slice(&d.addr.to_le_bytes());
        e[8..12].copy_from_slice(&d.len.to_le_bytes());
        e[12..14].copy_from_slice(&d.flags.to_le_bytes());
        e[14..16].copy_from_slice(&d.next.to_le_bytes());
    }
    v.extend(t);
    v.extend_from_slice(data);
    v
}

/// [`nvme_commands`](super::nvme_commands) input from records.
pub fn commands(recs: &[CmdRecord]) -> Vec<u8> {
    let mut v = Vec::new();
    for r in recs {
        v.push(u8::from(r.io) | u8::from(r.fix_sgl) << 1);
        v.extend_from_slice(&r.sqe);
        v.extend_from_slice(&(r.data.len() as u16).to_le_bytes());
        v.extend_from_slice(&r.data);
    }
    v
}

/// A host's opening for [`nvmf_target`](super::nvmf_target()): ICReq, admin Connect and
/// Property Set CC.EN=1, with `digests`.
pub fn host_opening(digests: Digests) -> Vec<u8> {
    let mut v = Vec::new();
    icreq(digests, &mut v);
    let sqe = Connect {
        recfmt: 0,
        qid: 0,
        sqsize: 31,
        cattr: 0,
        kato: 0,
    }
    .to_command(1);
    let data = ConnectData {
        hostid: [0x42; 16],
        cntlid: fabrics::CNTLID_DYNAMIC,
        subnqn: NQN.into(),
        hostnqn: HOSTNQN.into(),
    }
    .encode();
    tcp::encode_capsule_cmd(&mut v, &sqe, &data, digests, 0);
    let set = Property::set_command(2, registers::CC, false, 1 | (6 << 16) | (4 << 20));
    tcp::encode_capsule_cmd(&mut v, &set, &[], digests, 0);
    v
}

/// [`nvmf_initiator`](super::nvmf_initiator()) input: options and the controller's stream.
pub fn initiator(opts: u8, stream: &[u8]) -> Vec<u8> {
    let mut v = vec![opts & !init_flags::RAW_ICRESP];
    v.extend_from_slice(stream);
    v
}
