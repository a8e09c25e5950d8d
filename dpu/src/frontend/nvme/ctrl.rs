//! A controller of the dynamic controller model (NVMe-oF 1.1 §3.3): created by the admin
//! queue's Connect, torn down when the admin queue closes, on keep-alive timeout, or when
//! its subsystem goes away. Holds the controller properties (CAP, VS, CC, CSTS), the
//! features, the asynchronous event state and executes admin commands.

use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};

use nacre_shared::nvme::features::{self, fid, GetFeatures, Select, SetFeatures};
use nacre_shared::nvme::identify::{
    self, cns, cntrltype, nidt, oncs, Identify, IdentifyController, IdentifyNamespace, NsDescriptor,
};
use nacre_shared::nvme::log::{self, aen, lid, GetLogPage, SmartLog};
use nacre_shared::nvme::registers::{self, cc, csts};
use nacre_shared::nvme::{admin_opcode, Command, Status};
use tracing::debug;

use super::subsystem::{discovery_log, Subsystem};
use super::{limits, lock, Clock, TargetInner, FIRMWARE_REVISION};

/// What a controller needs of one of its queues, whatever transport carries it (NVMe/TCP:
/// `conn::Queue`; NVMe/RDMA: `nvmf_rdma`'s queue): keep-alive accounting, the SMART log's
/// counters, teardown, and completing a parked Asynchronous Event Request.
pub(crate) trait CtrlQueue: Send + Sync {
    /// When the host last sent anything on this queue (target clock, ms).
    fn last_rx_ms(&self) -> u64;
    /// Host read commands, write commands, bytes read, bytes written.
    fn stats(&self) -> (u64, u64, u64, u64);
    /// Close the queue: its serving thread notices and ends it.
    fn shutdown(&self);
    /// Complete command `cid` from outside the queue's thread (asynchronous events).
    fn complete_async(&self, cid: u16, status: Status, dw0: u32);
    /// Whether the transport moves data with keyed SGL data blocks (RDMA): Identify
    /// Controller's SGLS says so, as the admin queue's transport decides.
    fn keyed_sgls(&self) -> bool {
        false
    }
    /// Whether the queue is a PCIe controller's (memory-based transport): Identify
    /// Controller then reports the SGLs the PCIe controller walks and no fabrics capsule
    /// sizes.
    fn pcie(&self) -> bool {
        false
    }
}

/// What an admin command produced.
pub(crate) enum AdminReply {
    /// Complete now with this status, Dword 0 and data for the host.
    Done(Status, u32, Vec<u8>),
    /// An Asynchronous Event Request parked until an event occurs.
    Parked,
}

fn done(s: Status) -> AdminReply {
    AdminReply::Done(s, 0, Vec::new())
}

struct CtrlState {
    cc: u32,
    csts: u32,
    /// I/O queues granted by Set Features Number of Queues.
    io_queues: u16,
    /// Asynchronous Event Configuration.
    aec: u32,
    /// Outstanding Asynchronous Event Request command identifiers.
    aers: Vec<u16>,
    /// Events waiting for an Asynchronous Event Request (completion Dword 0).
    events: VecDeque<u32>,
    /// Changed Namespace List log (cleared when read without RAE).
    changed_ns: Vec<u32>,
    changed_overflow: bool,
    /// After a Namespace Attribute Changed notice, further notices are masked until the
    /// host reads the Changed Namespace List (NVMe Base 2.0 §5.2.2).
    ns_notice_masked: bool,
    temp_threshold: u32,
}

/// A controller of nacre's NVMe-oF target, as a host's Connect made it (not the initiator's
/// view of a remote controller, [`crate::fabric::Controller`]).
pub(crate) struct TargetController {
    pub(crate) cntlid: u16,
    pub(crate) subsys: Arc<Subsystem>,
    pub(crate) hostnqn: String,
    target: Weak<TargetInner>,
    clock: Clock,
    /// The address the host reached us on (for discovery entries on wildcard listeners).
    local_ip: IpAddr,
    state: Mutex<CtrlState>,
    /// qid → queue; qid 0 is the admin queue.
    queues: Mutex<BTreeMap<u16, Weak<dyn CtrlQueue>>>,
    /// Keep Alive Timeout in ms (0: disabled).
    kato_ms: AtomicU32,
    dead: AtomicBool,
    created_ms: u64,
}

impl TargetController {
    pub(crate) fn new<Q: CtrlQueue + 'static>(
        target: &Arc<TargetInner>,
        subsys: Arc<Subsystem>,
        hostnqn: String,
        kato_ms: u32,
        local_ip: IpAddr,
        admin: &Arc<Q>,
    ) -> Arc<Self> {
        let admin: Weak<Q> = Arc::downgrade(admin);
        let admin: Weak<dyn CtrlQueue> = admin;
        let c = Arc::new(TargetController {
            cntlid: target.alloc_cntlid(),
            subsys,
            hostnqn,
            target: Arc::downgrade(target),
            clock: target.clock,
            local_ip,
            state: Mutex::new(CtrlState {
                cc: 0,
                csts: 0,
                io_queues: limits::MAX_IO_QUEUES,
                aec: 0,
                aers: Vec::new(),
                events: VecDeque::new(),
                changed_ns: Vec::new(),
                changed_overflow: false,
                ns_notice_masked: false,
                temp_threshold: 343,
            }),
            queues: Mutex::new(BTreeMap::from([(0, admin)])),
            kato_ms: AtomicU32::new(round_kato(kato_ms)),
            dead: AtomicBool::new(false),
            created_ms: target.clock.now_ms(),
        });
        debug!(
            cntlid = c.cntlid,
            nqn = c.subsys.nqn(),
            "controller created"
        );
        c
    }

    pub(crate) fn ready(&self) -> bool {
        lock(&self.state).csts & csts::RDY != 0
    }

    /// Register I/O queue `qid`; fails if it exceeds the granted count or is taken.
    pub(crate) fn attach_io_queue<Q: CtrlQueue + 'static>(&self, qid: u16, q: &Arc<Q>) -> bool {
        if qid == 0 || qid > lock(&self.state).io_queues {
            return false;
        }
        let mut qs = lock(&self.queues);
        if qs.get(&qid).is_some_and(|w| w.strong_count() > 0) {
            return false;
        }
        let w: Weak<Q> = Arc::downgrade(q);
        let w: Weak<dyn CtrlQueue> = w;
        qs.insert(qid, w);
        true
    }

    pub(crate) fn detach_queue(&self, qid: u16) {
        lock(&self.queues).remove(&qid);
    }

    fn live_queues(&self) -> Vec<Arc<dyn CtrlQueue>> {
        lock(&self.queues)
            .values()
            .filter_map(|w| w.upgrade())
            .collect()
    }

    fn admin_pcie(&self) -> bool {
        lock(&self.queues)
            .get(&0)
            .and_then(Weak::upgrade)
            .is_some_and(|q| q.pcie())
    }

    fn admin_keyed_sgls(&self) -> bool {
        lock(&self.queues)
            .get(&0)
            .and_then(Weak::upgrade)
            .is_some_and(|q| q.keyed_sgls())
    }

    pub(crate) fn keep_alive_expired(&self, now_ms: u64) -> bool {
        let kato = self.kato_ms.load(Ordering::Relaxed) as u64;
        if kato == 0 || self.dead.load(Ordering::Relaxed) {
            return false;
        }
        let last = self
            .live_queues()
            .iter()
            .map(|q| q.last_rx_ms())
            .max()
            .unwrap_or(self.created_ms)
            .max(self.created_ms);
        now_ms.saturating_sub(last) > kato
    }

    /// Close every queue of this controller: their threads see EOF and exit.
    pub(crate) fn teardown(&self) {
        self.dead.store(true, Ordering::SeqCst);
        for q in self.live_queues() {
            q.shutdown();
        }
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    // ---- Properties (NVMe Base 2.0 §3.1.3) ----

    fn cap(&self) -> u64 {
        registers::cap((limits::MAX_QUEUE_ENTRIES - 1) as u16, limits::CAP_TO_500MS)
    }

    pub(crate) fn property_get(&self, offset: u32, eight: bool) -> Result<u64, Status> {
        let st = lock(&self.state);
        let v = match offset {
            registers::CAP => self.cap(),
            registers::VS => registers::version(1, 4, 0) as u64,
            registers::CC => st.cc as u64,
            registers::CSTS => st.csts as u64,
            _ => return Err(Status::INVALID_FIELD),
        };
        Ok(if eight { v } else { v & 0xFFFF_FFFF })
    }

    pub(crate) fn property_set(&self, offset: u32, value: u64) -> Status {
        if offset != registers::CC {
            // CAP, VS and CSTS are read-only; other properties are not implemented.
            return Status::INVALID_FIELD;
        }
        let new = value as u32;
        let mut st = lock(&self.state);
        let old = st.cc;
        st.cc = new;
        if new & cc::EN != 0 && old & cc::EN == 0 {
            let mps = (new >> 7) & 0xF;
            let iosqes = (new >> cc::IOSQES_SHIFT) & 0xF;
            let iocqes = (new >> cc::IOCQES_SHIFT) & 0xF;
            let sizes_ok =
                self.subsys.discovery || (iosqes == cc::IOSQES_64 && iocqes == cc::IOCQES_16);
            if mps != 0 || !sizes_ok {
                // An unusable configuration: report Controller Fatal Status (§3.1.3.6).
                st.csts |= csts::CFS;
            } else {
                st.csts = csts::RDY;
            }
        } else if new & cc::EN == 0 && old & cc::EN != 0 {
            // Controller reset: not ready, shutdown state cleared.
            st.csts = 0;
        }
        let shn = (new & cc::SHN_MASK) >> cc::SHN_SHIFT;
        if shn == cc::SHN_NORMAL || shn == cc::SHN_ABRUPT {
            // Nothing is cached in nacre's target above the volume: shutdown completes at
            // once.
            st.csts = (st.csts & !csts::SHST_MASK) | csts::SHST_COMPLETE;
        } else {
            st.csts &= !csts::SHST_MASK;
        }
        Status::SUCCESS
    }

    // ---- Admin commands (NVMe Base 2.0 §5) ----

    pub(crate) fn admin(&self, c: &Command, data: &[u8]) -> AdminReply {
        let _ = data;
        if !self.ready() {
            return done(Status::COMMAND_SEQUENCE_ERROR);
        }
        if c.fuse() != 0 {
            return done(Status::INVALID_FIELD);
        }
        let disc = self.subsys.discovery;
        match c.opcode {
            admin_opcode::IDENTIFY => self.identify(c),
            admin_opcode::GET_LOG_PAGE => self.get_log_page(c),
            admin_opcode::SET_FEATURES => self.set_features(c),
            admin_opcode::GET_FEATURES => self.get_features(c),
            admin_opcode::KEEP_ALIVE => done(Status::SUCCESS),
            admin_opcode::ASYNC_EVENT_REQUEST => self.async_event_request(c.cid),
            // Abort: nacre never aborts; Dword 0 bit 0 set means "not aborted" (§5.1).
            admin_opcode::ABORT if !disc => AdminReply::Done(Status::SUCCESS, 1, Vec::new()),
            // Queues are created by Connect on fabrics; Create/Delete I/O SQ/CQ do not exist
            // there (NVMe-oF 1.1 §2.1), nor does anything else we do not list.
            _ => done(Status::INVALID_OPCODE),
        }
    }

    fn identify(&self, c: &Command) -> AdminReply {
        let id = Identify::from_command(c);
        let disc = self.subsys.discovery;
        let reply = |b: Vec<u8>| AdminReply::Done(Status::SUCCESS, 0, b);
        match id.cns {
            cns::CONTROLLER => reply(self.identify_controller().encode()),
            cns::NAMESPACE if !disc => {
                if c.nsid == 0 || c.nsid == 0xFFFF_FFFF || c.nsid > limits::MAX_NSID {
                    return done(Status::INVALID_NAMESPACE);
                }
                match self.subsys.namespace(c.nsid) {
                    Some(ns) => reply(
                        IdentifyNamespace::for_geometry(ns.blocks(), ns.block_size, ns.nguid)
                            .encode(),
                    ),
                    // An inactive but valid NSID: a zero-filled structure (§5.17.2.1).
                    None => reply(vec![0; identify::IDENTIFY_LEN]),
                }
            }
            cns::ACTIVE_NS_LIST if !disc => {
                if c.nsid >= 0xFFFF_FFFE {
                    return done(Status::INVALID_NAMESPACE);
                }
                let ids = self.subsys.namespace_table().into_keys();
                reply(identify::encode_active_ns_list(ids, c.nsid))
            }
            cns::NS_DESCRIPTOR_LIST if !disc => match self.subsys.namespace(c.nsid) {
                Some(ns) => reply(identify::encode_ns_descriptors(&[
                    NsDescriptor {
                        nidt: nidt::NGUID,
                        nid: ns.nguid.to_vec(),
                    },
                    NsDescriptor {
                        nidt: nidt::UUID,
                        nid: ns.nguid.to_vec(),
                    },
                    NsDescriptor {
                        nidt: nidt::CSI,
                        nid: vec![0],
                    },
                ])),
                None => done(Status::INVALID_NAMESPACE),
            },
            // NVM Command Set specific Identify Controller (CSI 0): all limits zero, i.e.
            // none beyond MDTS.
            cns::CS_CONTROLLER if !disc && id.csi == 0 => reply(vec![0; identify::IDENTIFY_LEN]),
            _ => done(Status::INVALID_FIELD),
        }
    }

    pub(crate) fn identify_controller(&self) -> IdentifyController {
        let disc = self.subsys.discovery;
        let id = IdentifyController {
            vid: 0,
            ssvid: 0,
            serial: self.subsys.serial.clone(),
            model: self.subsys.model.clone(),
            firmware: FIRMWARE_REVISION.to_string(),
            rab: 6,
            // Multi-port, multi-controller subsystem: hosts may use multipath.
            cmic: if disc { 0 } else { 0b11 },
            mdts: limits::MDTS,
            cntlid: self.cntlid,
            ver: registers::version(1, 4, 0),
            oaes: if disc { 0 } else { identify::OAES_NS_ATTR },
            // CTRATT bit 0: 128-bit host identifiers (fabrics use them).
            ctratt: 1,
            cntrltype: if disc {
                cntrltype::DISCOVERY
            } else {
                cntrltype::IO
            },
            oacs: 0,
            acl: 3,
            aerl: (limits::MAX_AERS - 1) as u8,
            // One firmware slot, read-only.
            frmw: 0b11,
            lpa: identify::LPA_EXTENDED_DATA,
            elpe: 0,
            kas: limits::KAS_100MS,
            sqes: 0x66,
            cqes: 0x44,
            maxcmd: limits::MAX_QUEUE_ENTRIES as u16,
            nn: if disc { 0 } else { limits::MAX_NSID },
            oncs: if disc {
                0
            } else {
                oncs::DATASET_MANAGEMENT | oncs::WRITE_ZEROES
            },
            vwc: if disc { 0 } else { 1 },
            sgls: identify::SGLS_SUPPORTED
                | identify::SGLS_OFFSET
                | if self.admin_keyed_sgls() {
                    identify::SGLS_KEYED
                } else {
                    0
                },
            subnqn: self.subsys.nqn().to_string(),
            ioccsz: ((64 + limits::IO_INLINE_DATA) / 16) as u32,
            iorcsz: 1,
            icdoff: 0,
            fcatt: 0,
            msdbd: 1,
        };
        if self.admin_pcie() {
            // SGLs for I/O commands, byte aligned, Data Block, Segment and Last Segment
            // descriptors, longer than the transfer allowed (`nvme_pcie::sgl`); no fabrics
            // fields; CTRATT's 128-bit host identifier is a fabrics requirement. Shadow
            // doorbells (Doorbell Buffer Config), which hosts use on emulated controllers.
            return IdentifyController {
                oacs: identify::OACS_DOORBELL_BUFFER_CONFIG,
                sgls: identify::SGLS_SUPPORTED | identify::SGLS_LONGER_THAN_DATA,
                ioccsz: 0,
                iorcsz: 0,
                msdbd: 0,
                ctratt: 0,
                kas: 0,
                ..id
            };
        }
        id
    }

    fn get_log_page(&self, c: &Command) -> AdminReply {
        let req = GetLogPage::from_command(c);
        if req.offset % 4 != 0 || req.len > limits::MAX_TRANSFER {
            // Log page offsets are dword granular, and no transfer exceeds MDTS (NUMD can
            // ask for 16 GiB).
            return done(Status::INVALID_FIELD);
        }
        // LSP (Dword 10 bits 14:8) is ignored: for the discovery log, nvme-cli may set
        // PLEO ("port local entries only") and every entry we list is reachable anyway.
        let disc = self.subsys.discovery;
        let page = match req.lid {
            lid::DISCOVERY if disc => match self.target.upgrade() {
                Some(t) => discovery_log(&t, &self.hostnqn, self.local_ip),
                None => return done(Status::INTERNAL_ERROR),
            },
            lid::ERROR_INFORMATION if !disc => {
                vec![0; log::ERROR_ENTRY_LEN]
            }
            lid::SMART_HEALTH if !disc => {
                if c.nsid != 0 && c.nsid != 0xFFFF_FFFF {
                    // Per-namespace SMART data is not supported (LPA bit 0 clear).
                    return done(Status::INVALID_FIELD);
                }
                self.smart_log().encode()
            }
            lid::FIRMWARE_SLOT if !disc => log::encode_firmware_slot(FIRMWARE_REVISION),
            lid::CHANGED_NS_LIST if !disc => {
                let mut st = lock(&self.state);
                let b = if st.changed_overflow {
                    log::encode_changed_ns_list(&vec![0; 1025])
                } else {
                    log::encode_changed_ns_list(&st.changed_ns)
                };
                if !req.rae {
                    st.changed_ns.clear();
                    st.changed_overflow = false;
                    st.ns_notice_masked = false;
                }
                b
            }
            _ => return done(Status::INVALID_LOG_PAGE),
        };
        let off = req.offset as usize;
        if off > page.len() {
            return done(Status::INVALID_FIELD);
        }
        let mut out = vec![0u8; req.len];
        let n = (page.len() - off).min(req.len);
        out[..n].copy_from_slice(&page[off..off + n]);
        AdminReply::Done(Status::SUCCESS, 0, out)
    }

    fn smart_log(&self) -> SmartLog {
        let mut s = SmartLog {
            available_spare: 100,
            spare_threshold: 10,
            power_cycles: 1,
            ..Default::default()
        };
        for q in self.live_queues() {
            let st = q.stats();
            s.host_read_commands += st.0 as u128;
            s.host_write_commands += st.1 as u128;
            s.data_units_read += st.2 as u128;
            s.data_units_written += st.3 as u128;
        }
        // Data units are thousands of 512-byte units, rounded up (Figure 207).
        s.data_units_read = (s.data_units_read / 512).div_ceil(1000);
        s.data_units_written = (s.data_units_written / 512).div_ceil(1000);
        s.power_on_hours = (self.clock.now_ms() / 3_600_000) as u128;
        s
    }

    fn set_features(&self, c: &Command) -> AdminReply {
        let f = SetFeatures::from_command(c);
        if f.save {
            return done(Status::FEATURE_NOT_SAVEABLE);
        }
        let disc = self.subsys.discovery;
        let mut st = lock(&self.state);
        match f.fid {
            fid::NUMBER_OF_QUEUES if !disc => {
                if f.value & 0xFFFF == 0xFFFF || f.value >> 16 == 0xFFFF {
                    return done(Status::INVALID_FIELD);
                }
                let (nsq, ncq) = features::parse_number_of_queues(f.value);
                let n = nsq.min(ncq).min(limits::MAX_IO_QUEUES as u32) as u16;
                st.io_queues = n;
                AdminReply::Done(
                    Status::SUCCESS,
                    features::number_of_queues(n, n),
                    Vec::new(),
                )
            }
            fid::KEEP_ALIVE_TIMER => {
                self.kato_ms.store(round_kato(f.value), Ordering::Relaxed);
                done(Status::SUCCESS)
            }
            fid::ASYNC_EVENT_CONFIG => {
                st.aec = f.value & if disc { 0 } else { features::AEC_NS_ATTR };
                done(Status::SUCCESS)
            }
            // The write cache cannot be turned off: writes land in the volume's cache
            // (page cache for files) until Flush.
            fid::VOLATILE_WRITE_CACHE if !disc && f.value & 1 == 1 => done(Status::SUCCESS),
            fid::TEMPERATURE_THRESHOLD if !disc => {
                st.temp_threshold = f.value & 0xFFFF;
                done(Status::SUCCESS)
            }
            _ => done(Status::INVALID_FIELD),
        }
    }

    fn get_features(&self, c: &Command) -> AdminReply {
        let g = GetFeatures::from_command(c);
        match g.select {
            Select::Current | Select::Default | Select::Saved => {}
            // Nothing saveable, everything per controller.
            Select::SupportedCapabilities => {
                return AdminReply::Done(Status::SUCCESS, 0, Vec::new())
            }
            Select::Reserved(_) => return done(Status::INVALID_FIELD),
        }
        let disc = self.subsys.discovery;
        let st = lock(&self.state);
        let dw0 = match g.fid {
            fid::NUMBER_OF_QUEUES if !disc => {
                features::number_of_queues(st.io_queues, st.io_queues)
            }
            fid::KEEP_ALIVE_TIMER => self.kato_ms.load(Ordering::Relaxed),
            fid::ASYNC_EVENT_CONFIG => st.aec,
            fid::VOLATILE_WRITE_CACHE if !disc => 1,
            fid::TEMPERATURE_THRESHOLD if !disc => st.temp_threshold,
            fid::ARBITRATION
            | fid::POWER_MANAGEMENT
            | fid::ERROR_RECOVERY
            | fid::WRITE_ATOMICITY
                if !disc =>
            {
                0
            }
            // Interrupt Coalescing and Interrupt Vector Configuration are PCIe features (the
            // PCIe controller answers them itself); fabrics controllers refuse them, as
            // everything else this controller does not know.
            _ => return done(Status::INVALID_FIELD),
        };
        AdminReply::Done(Status::SUCCESS, dw0, Vec::new())
    }

    fn async_event_request(&self, cid: u16) -> AdminReply {
        let mut st = lock(&self.state);
        if let Some(ev) = st.events.pop_front() {
            return AdminReply::Done(Status::SUCCESS, ev, Vec::new());
        }
        if st.aers.len() >= limits::MAX_AERS {
            return done(Status::ASYNC_EVENT_LIMIT_EXCEEDED);
        }
        st.aers.push(cid);
        AdminReply::Parked
    }

    /// A namespace was added or removed: record it in the Changed Namespace List and, if
    /// the host enabled Namespace Attribute Notices, raise the event.
    pub(crate) fn namespace_changed(&self, nsid: u32) {
        let mut st = lock(&self.state);
        if !st.changed_ns.contains(&nsid) {
            if st.changed_ns.len() < log::CHANGED_NS_LIST_LEN / 4 {
                st.changed_ns.push(nsid);
            } else {
                st.changed_overflow = true;
            }
        }
        if st.aec & features::AEC_NS_ATTR == 0 || st.ns_notice_masked {
            return;
        }
        st.ns_notice_masked = true;
        let dw0 = aen::dw0(
            aen::TYPE_NOTICE,
            aen::INFO_NS_ATTR_CHANGED,
            lid::CHANGED_NS_LIST,
        );
        match st.aers.pop() {
            Some(cid) => {
                // The queue's reactor sends it: whoever raised the event (the control plane,
                // holding its lock) must not wait on this host's socket.
                let admin = lock(&self.queues).get(&0).cloned();
                let posted = match (admin, self.target.upgrade()) {
                    (Some(queue), Some(t)) if queue.strong_count() > 0 => {
                        t.post_async(super::AsyncReply { queue, cid, dw0 })
                    }
                    _ => false,
                };
                if !posted {
                    // Not sent: the request stays outstanding and the event waits for it.
                    st.aers.push(cid);
                    st.events.push_back(dw0);
                }
            }
            None => st.events.push_back(dw0),
        }
    }
}

/// KATO is rounded up to the Keep Alive Support granularity (1 s).
fn round_kato(ms: u32) -> u32 {
    let g = limits::KAS_100MS as u32 * 100;
    ms.div_ceil(g).saturating_mul(g)
}
