//! The fake target's Fabrics commands (Connect, Property Get/Set) and admin queue (Identify,
//! Set Features, Keep Alive, the discovery log page).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use nacre_shared::nvme::discovery::{self, DiscoveryEntry};
use nacre_shared::nvme::fabrics::{fctype, Connect, ConnectData, Property};
use nacre_shared::nvme::identify::{self, IdentifyController, IdentifyNamespace, NsDescriptor};
use nacre_shared::nvme::log::GetLogPage;
use nacre_shared::nvme::{admin_opcode, registers, Command, Status};

use super::conn::{c2h, resp};
use super::{Conn, TState};

pub(super) fn fabrics(
    st: &Arc<TState>,
    c: &mut Conn,
    sqe: Command,
    data: Vec<u8>,
) -> std::io::Result<()> {
    let cid = sqe.cid;
    match sqe.fctype() {
        fctype::CONNECT => {
            let conn = Connect::from_command(&sqe);
            let cd = ConnectData::decode(&data);
            c.qid = conn.qid;
            let is_disc = cd.subnqn == nacre_shared::nvme::DISCOVERY_NQN;
            if !is_disc && cd.subnqn != st.opts.subnqn {
                return resp(c, cid, Status::CONNECT_INVALID_PARAMETERS, 0x0001_0100, 0);
            }
            c.cntlid = if conn.qid == 0 {
                st.next_cntlid.fetch_add(1, Ordering::Relaxed) as u16
            } else {
                cd.cntlid
            };
            st.connects.fetch_add(1, Ordering::Relaxed);
            resp(c, cid, Status::SUCCESS, c.cntlid as u32, 0)
        }
        fctype::PROPERTY_GET => {
            let p = Property::from_command(&sqe);
            let v: u64 = match p.offset {
                registers::CAP => registers::cap(1023, 2),
                registers::VS => registers::version(1, 4, 0) as u64,
                registers::CC => c.cc as u64,
                registers::CSTS => {
                    let mut s = (c.cc & 1) as u64;
                    if c.cc & registers::cc::SHN_MASK != 0 {
                        s |= registers::csts::SHST_COMPLETE as u64;
                    }
                    s
                }
                _ => 0,
            };
            resp(c, cid, Status::SUCCESS, v as u32, (v >> 32) as u32)
        }
        fctype::PROPERTY_SET => {
            let p = Property::from_command(&sqe);
            if p.offset == registers::CC {
                c.cc = p.value as u32;
            }
            resp(c, cid, Status::SUCCESS, 0, 0)
        }
        _ => resp(c, cid, Status::INVALID_OPCODE, 0, 0),
    }
}

pub(super) fn admin(st: &Arc<TState>, c: &mut Conn, sqe: Command) -> std::io::Result<()> {
    let cid = sqe.cid;
    match sqe.opcode {
        admin_opcode::IDENTIFY => {
            let cns = sqe.cdw10 as u8;
            let g = st.storage.namespaces.lock().unwrap();
            let page = match cns {
                identify::cns::CONTROLLER => {
                    let mut b = IdentifyController {
                        vid: 0x1b36,
                        serial: "FAKE0001".into(),
                        model: st.opts.model.clone(),
                        firmware: "0.1".into(),
                        mdts: st.opts.mdts,
                        cntlid: c.cntlid,
                        ver: registers::version(1, 4, 0),
                        cntrltype: identify::cntrltype::IO,
                        kas: 1,
                        sqes: 0x66,
                        cqes: 0x44,
                        maxcmd: 1024,
                        nn: g.iter().map(|n| n.nsid).max().unwrap_or(0),
                        oncs: identify::oncs::WRITE_ZEROES | identify::oncs::DATASET_MANAGEMENT,
                        sgls: identify::SGLS_SUPPORTED
                            | if st.opts.icd > 0 {
                                identify::SGLS_OFFSET
                            } else {
                                0
                            },
                        subnqn: st.opts.subnqn.clone(),
                        ioccsz: ((st.opts.icd + 64) / 16) as u32,
                        iorcsz: 1,
                        msdbd: 1,
                        ..Default::default()
                    }
                    .encode();
                    b[386..388].copy_from_slice(&st.opts.cqt_ms.to_le_bytes());
                    b
                }
                identify::cns::ACTIVE_NS_LIST => {
                    identify::encode_active_ns_list(g.iter().map(|n| n.nsid), sqe.nsid)
                }
                identify::cns::NAMESPACE => match g.iter().find(|n| n.nsid == sqe.nsid) {
                    Some(n) => IdentifyNamespace::for_geometry(
                        n.data.len() as u64 / n.block_size as u64,
                        n.block_size,
                        n.nguid,
                    )
                    .encode(),
                    None => {
                        drop(g);
                        return resp(c, cid, Status::INVALID_NAMESPACE, 0, 0);
                    }
                },
                identify::cns::NS_DESCRIPTOR_LIST => match g.iter().find(|n| n.nsid == sqe.nsid) {
                    Some(n) => identify::encode_ns_descriptors(&[NsDescriptor {
                        nidt: identify::nidt::NGUID,
                        nid: n.nguid.to_vec(),
                    }]),
                    None => {
                        drop(g);
                        return resp(c, cid, Status::INVALID_NAMESPACE, 0, 0);
                    }
                },
                _ => {
                    drop(g);
                    return resp(c, cid, Status::INVALID_FIELD, 0, 0);
                }
            };
            drop(g);
            c2h(st, c, cid, &page, true)
        }
        admin_opcode::SET_FEATURES => {
            if sqe.cdw10 & 0xFF == 0x07 {
                // Grant at most 2 queues each way, to exercise "fewer than asked".
                let n = (sqe.cdw11 & 0xFFFF).min(1);
                resp(c, cid, Status::SUCCESS, n | n << 16, 0)
            } else {
                resp(c, cid, Status::SUCCESS, 0, 0)
            }
        }
        admin_opcode::KEEP_ALIVE => resp(c, cid, Status::SUCCESS, 0, 0),
        admin_opcode::GET_LOG_PAGE => {
            let glp = GetLogPage::from_command(&sqe);
            let port = c.s.local_addr().map(|a| a.port()).unwrap_or(0);
            let page = discovery::encode_log(
                1,
                &[DiscoveryEntry {
                    trtype: discovery::TRTYPE_TCP,
                    adrfam: discovery::ADRFAM_IPV4,
                    subtype: discovery::SUBTYPE_NVME,
                    treq: discovery::TREQ_SECURE_CHANNEL_NOT_REQUIRED,
                    portid: 1,
                    cntlid: 0xFFFF,
                    asqsz: 32,
                    trsvcid: port.to_string(),
                    subnqn: st.opts.subnqn.clone(),
                    traddr: "127.0.0.1".into(),
                    sectype: 0,
                }],
            );
            let mut out = vec![0u8; glp.len];
            let n = glp.len.min(page.len());
            out[..n].copy_from_slice(&page[..n]);
            c2h(st, c, cid, &out, true)
        }
        _ => resp(c, cid, Status::INVALID_OPCODE, 0, 0),
    }
}
