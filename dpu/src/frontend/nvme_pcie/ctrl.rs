//! The PCIe controller: BAR0's registers (NVMe Base 2.0 §3.1.4), controller enable, reset
//! and shutdown (§3.5), the admin commands that exist only on PCIe (Create/Delete I/O
//! Submission/Completion Queue, §5.4-5.7, Doorbell Buffer Config, §5.8), the PCIe-only
//! features (Interrupt Coalescing and Interrupt Vector Configuration, `coalesce`), the I/O
//! command set onto [`crate::volume::BlockDevice`], and MSI-X through the client's eventfds.
//!
//! Everything else an admin command asks (Identify, other features, log pages,
//! asynchronous events, Abort) is the target core's controller ([`TargetController`]): the
//! same code a host reaches over NVMe/TCP or RDMA.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use nacre_shared::nvme::features::{self, fid, GetFeatures, Select, SetFeatures};
use nacre_shared::nvme::registers::{self, cc, csts};
use nacre_shared::nvme::{admin_opcode, Command, Status};
use tracing::{debug, warn};
use vm_memory::GuestMemoryMmap;

use super::coalesce::Coalescing;
use super::config::ConfigSpace;
use super::function::{BAR0_LEN, MSIX_BAR_LEN};
use super::prp;
use super::queue::{self, Cq, Doorbells, Fatal, Pending, Sq, SQE_LEN};
use super::sgl;
use crate::frontend::nvme::ctrl::{AdminReply, CtrlQueue, TargetController};
use crate::frontend::nvme::io::{self, Plan, Then};
use crate::frontend::nvme::{limits, lock, Namespace, Subsystem, TargetInner};
use crate::frontend::nvmf_tcp::PollPolicy;
use crate::frontend::vfio_user::config::Interrupts;
use crate::telemetry::{ArrivalCell, VolumeMetrics};
use crate::volume::{IoCompletion, IoKind, IoRequest, IoResult};

/// BAR0 registers not in `registers` (§3.1.4).
const AQA: u64 = 0x24;
const ASQ: u64 = 0x28;
const ACQ: u64 = 0x30;
/// Bytes of the register file below the doorbells that mean anything.
const REGS_LEN: usize = 0x40;

/// MSI-X vectors a function offers (admin plus one per I/O queue a host typically asks for).
pub const MSIX_VECTORS: u16 = 64;
/// MSI vectors a function with MSI offers (the most MSI allows).
pub const MSI_VECTORS: u16 = crate::frontend::vfio_user::config::MSI_MAX_VECTORS;
/// Entries the poller takes from one queue per pass (so one busy queue cannot starve others).
const FETCH_BATCH: usize = 64;

struct Regs {
    cc: u32,
    aqa: u32,
    asq: u64,
    acq: u64,
    /// INTMS/INTMC (§3.1.4.3-4): vectors the host masked; they apply with MSI only (with
    /// MSI-X the host masks in the table the client emulates).
    intms: u32,
    /// MSI vectors that came due while masked: raised when the host unmasks them.
    intm_pending: u32,
}

struct Queues {
    sqs: BTreeMap<u16, Arc<Sq>>,
    cqs: BTreeMap<u16, Arc<Cq>>,
}

/// What the poller keeps between passes: the queues and whether the controller is enabled,
/// as of [`PcieController::generation`] `gen`, and the subsystem's namespaces as of its
/// `ns_gen`, so a pass takes no lock on the queue or namespace table and allocates nothing
/// unless a queue, a namespace or the enable state changed.
pub(super) struct PollCache {
    gen: u64,
    enabled: bool,
    /// PCI Command register's Bus Master Enable.
    bus_master: bool,
    /// The memory the client mapped for DMA (the function's `mem`).
    mem: Arc<GuestMemoryMmap>,
    /// Each submission queue with its completion queue and completion objects.
    sqs: Vec<QueuePair>,
    cqs: Vec<Arc<Cq>>,
    ns_gen: u64,
    namespaces: BTreeMap<u32, Arc<Namespace>>,
    /// The entries one queue's fetch took.
    entries: Vec<(u16, [u8; SQE_LEN as usize])>,
    /// When the last pass took its first command (the batch clock's instant, ns of
    /// [`crate::telemetry::clock::read_ns`]), or 0 if it took none.
    pass_started: u64,
}

impl PollCache {
    /// The largest completion backlog of the I/O queues: entries posted that the host has
    /// not consumed yet, as of each queue's last post.
    fn backlog(&self) -> u32 {
        self.cqs
            .iter()
            .filter(|c| c.qid != 0)
            .map(|c| c.backlog())
            .max()
            .unwrap_or(0)
    }

    pub(super) fn new() -> Self {
        PollCache {
            gen: u64::MAX,
            enabled: false,
            bus_master: false,
            mem: Arc::new(GuestMemoryMmap::new()),
            sqs: Vec::new(),
            cqs: Vec::new(),
            ns_gen: 0,
            namespaces: BTreeMap::new(),
            entries: Vec::with_capacity(FETCH_BATCH),
            pass_started: 0,
        }
    }
}

/// A submission queue, its completion queue, and the completion objects ([`Inflight`]) its
/// commands use: made as the queue's commands need them, up to one per entry of the queue,
/// and used again command after command, so a command costs no allocation and none of the
/// reference counting a fresh object's fields would.
struct QueuePair {
    /// The controller, as completion objects hold it.
    dev: Weak<PcieController>,
    sq: Arc<Sq>,
    cq: Arc<Cq>,
    slots: Vec<Slot>,
    /// The last one-off object (see [`QueuePair::take`]).
    spare: Option<Slot>,
    /// Where the search for a free slot starts: completions mostly come back in order.
    next: usize,
    /// Moves when the memory map or the namespace table changes: an object made before
    /// holds a map or a volume's statistics that may be gone, and is let go once free.
    epoch: u64,
    /// Objects of an earlier epoch are still at the volumes.
    stale: bool,
}

/// A pooled completion object, and the same object as the volumes take it.
struct Slot {
    this: Arc<Inflight>,
    done: Arc<dyn IoCompletion>,
    /// The [`QueuePair::epoch`] it was made in.
    epoch: u64,
}

/// Slots looked at for a free one before another is made (or, with the queue's worth in use,
/// a one-off object is).
const SLOT_SCAN: usize = 4;

impl QueuePair {
    fn new(dev: Weak<PcieController>, sq: Arc<Sq>, cq: Arc<Cq>) -> Self {
        QueuePair {
            dev,
            sq,
            cq,
            slots: Vec::new(),
            spare: None,
            next: 0,
            epoch: 0,
            stale: false,
        }
    }

    /// The memory map or the namespaces changed: let go of the completion objects that hold
    /// the old ones (those still at the volumes once they are free, [`QueuePair::sweep`]).
    fn renew(&mut self) {
        self.epoch += 1;
        self.stale = true;
        self.sweep();
    }

    /// Let go of the free objects of an earlier epoch.
    fn sweep(&mut self) {
        let epoch = self.epoch;
        let keep = |s: &Slot| s.epoch == epoch || s.this.busy.load(Ordering::Acquire);
        self.slots.retain(keep);
        if self.spare.as_ref().is_some_and(|s| !keep(s)) {
            self.spare = None;
        }
        self.stale = self
            .slots
            .iter()
            .chain(&self.spare)
            .any(|s| s.epoch != epoch);
        if self.next >= self.slots.len() {
            self.next = 0;
        }
    }

    /// A completion object not in use, marked in use: a pooled one while the queue has
    /// fewer commands at the volumes than entries, else a one-off (a host may keep more
    /// commands outstanding than its queue holds, and each still completes). The volumes
    /// clone what they keep past their `submit`. A new object holds `mem` and `metrics`
    /// (the command's volume's statistics) for as long as it lives.
    fn take(&mut self, mem: &Arc<GuestMemoryMmap>, metrics: Option<&Arc<VolumeMetrics>>) -> &Slot {
        let n = self.slots.len();
        for _ in 0..n.min(SLOT_SCAN) {
            let i = self.next;
            self.next = if i + 1 == n { 0 } else { i + 1 };
            let slot = &self.slots[i];
            if slot.epoch == self.epoch && !slot.this.busy.load(Ordering::Acquire) {
                slot.this.busy.store(true, Ordering::Relaxed);
                return &self.slots[i];
            }
        }
        let this = Inflight::new(
            self.dev.clone(),
            self.sq.clone(),
            self.cq.clone(),
            mem.clone(),
            metrics.cloned(),
        );
        let slot = Slot {
            done: this.clone(),
            this,
            epoch: self.epoch,
        };
        if n < self.sq.size as usize {
            self.slots.push(slot);
            &self.slots[n]
        } else {
            self.spare.insert(slot)
        }
    }
}

/// One emulated NVMe PCIe function.
pub struct PcieController {
    target: Arc<TargetInner>,
    subsys: Arc<Subsystem>,
    /// What the host sees as its identity in the core's logs.
    hostnqn: String,
    pub(super) config: Mutex<ConfigSpace>,
    /// MSI-X or MSI, and the vectors offered.
    pub(super) interrupts: Interrupts,
    regs: Mutex<Regs>,
    queues: Mutex<Queues>,
    /// Moves on every change of the queue table or of `ctrl` (after the change), so the
    /// poller's [`PollCache`] knows to read them again.
    generation: AtomicU64,
    ctrl: Mutex<Option<Arc<TargetController>>>,
    /// The admin queue as the core's controller sees it (asynchronous events).
    admin: Mutex<Option<Arc<AdminQueue>>>,
    pub(super) doorbells: Doorbells,
    /// The memory the client mapped for DMA; replaced whole on each map and unmap.
    pub(super) mem: Mutex<Arc<GuestMemoryMmap>>,
    /// Vector (MSI-X or MSI) → eventfd.
    pub(super) irqs: Mutex<Vec<Option<File>>>,
    /// Interrupt coalescing settings and the vectors' unsignalled completions.
    coalescing: Mutex<Coalescing>,
    /// An Aggregation Time is set: vectors may come due with no work arriving, so every
    /// poller pass, idle or not, ends by asking [`Coalescing::end_pass`].
    coalescing_timed: AtomicBool,
    /// Any instant: what coalescing is given when no aggregation time makes the clock
    /// matter.
    epoch: Instant,
    /// Controller Fatal Status: set by a host error the controller cannot go on from;
    /// cleared by a controller reset.
    fatal: AtomicBool,
    pub(super) stop: AtomicBool,
    /// What the poller did, as it last published it (`nvmf_get_stats`).
    pub(super) poll_counters: PollCounters,
    /// A second handle on the connected client's socket: stopping the listener shuts it down,
    /// which disconnects the client and ends the server thread.
    pub(super) client: Mutex<Option<std::os::unix::net::UnixStream>>,
    /// Keeps the doorbell page mapped for as long as the controller lives.
    _doorbell_backing: Arc<dyn std::any::Any + Send + Sync>,
}

/// The admin queue's face towards the core's controller: parked Asynchronous Event Requests
/// complete through it.
struct AdminQueue {
    dev: Weak<PcieController>,
}

impl CtrlQueue for AdminQueue {
    fn last_rx_ms(&self) -> u64 {
        0
    }
    fn stats(&self) -> (u64, u64, u64, u64) {
        (0, 0, 0, 0)
    }
    fn shutdown(&self) {}
    fn complete_async(&self, cid: u16, status: Status, dw0: u32) {
        if let Some(d) = self.dev.upgrade() {
            d.complete(0, 0, cid, status, dw0);
        }
    }
    fn pcie(&self) -> bool {
        true
    }
}

impl PcieController {
    /// # Safety
    /// `doorbell_page` must point to 4 KiB of shared memory that stays mapped while
    /// `backing` lives.
    pub(super) unsafe fn new(
        target: Arc<TargetInner>,
        subsys: Arc<Subsystem>,
        hostnqn: String,
        doorbell_page: *mut u8,
        backing: Arc<dyn std::any::Any + Send + Sync>,
        interrupts: Interrupts,
    ) -> Arc<Self> {
        Arc::new(PcieController {
            target,
            subsys,
            hostnqn,
            config: Mutex::new(ConfigSpace::new(interrupts, BAR0_LEN, MSIX_BAR_LEN)),
            interrupts,
            regs: Mutex::new(Regs {
                cc: 0,
                aqa: 0,
                asq: 0,
                acq: 0,
                intms: 0,
                intm_pending: 0,
            }),
            queues: Mutex::new(Queues {
                sqs: BTreeMap::new(),
                cqs: BTreeMap::new(),
            }),
            ctrl: Mutex::new(None),
            admin: Mutex::new(None),
            // SAFETY: `backing`, held below, keeps the page mapped (caller).
            doorbells: unsafe { Doorbells::new(doorbell_page) },
            mem: Mutex::new(Arc::new(GuestMemoryMmap::new())),
            irqs: Mutex::new(Vec::new()),
            coalescing: Mutex::new(Coalescing::new(interrupts.vectors())),
            coalescing_timed: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            epoch: Instant::now(),
            fatal: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            poll_counters: PollCounters::default(),
            client: Mutex::new(None),
            _doorbell_backing: backing,
        })
    }

    fn csts(&self) -> u32 {
        let core = lock(&self.ctrl)
            .as_ref()
            .and_then(|c| c.property_get(registers::CSTS, false).ok())
            .unwrap_or(0) as u32;
        core | if self.fatal.load(Ordering::SeqCst) {
            csts::CFS
        } else {
            0
        }
    }

    fn regs_bytes(&self) -> [u8; REGS_LEN] {
        let mut b = [0u8; REGS_LEN];
        let cap = registers::cap((limits::MAX_QUEUE_ENTRIES - 1) as u16, limits::CAP_TO_500MS);
        let r = lock(&self.regs);
        b[0..8].copy_from_slice(&cap.to_le_bytes());
        b[8..12].copy_from_slice(&registers::version(1, 4, 0).to_le_bytes());
        b[0x0C..0x10].copy_from_slice(&r.intms.to_le_bytes());
        b[0x10..0x14].copy_from_slice(&r.intms.to_le_bytes());
        b[0x14..0x18].copy_from_slice(&r.cc.to_le_bytes());
        drop(r);
        b[0x1C..0x20].copy_from_slice(&self.csts().to_le_bytes());
        let r = lock(&self.regs);
        b[0x24..0x28].copy_from_slice(&r.aqa.to_le_bytes());
        b[0x28..0x30].copy_from_slice(&r.asq.to_le_bytes());
        b[0x30..0x38].copy_from_slice(&r.acq.to_le_bytes());
        b
    }

    /// A read of BAR0 below the doorbells.
    pub(super) fn read_regs(&self, offset: u64, out: &mut [u8]) {
        let b = self.regs_bytes();
        for (i, o) in out.iter_mut().enumerate() {
            *o = (offset as usize)
                .checked_add(i)
                .and_then(|at| b.get(at).copied())
                .unwrap_or(0);
        }
    }

    /// A write to BAR0 below the doorbells: 4- or 8-byte accesses to the registers a host
    /// writes (INTMS, INTMC, CC, AQA, ASQ, ACQ); others are ignored (read-only or reserved).
    pub(super) fn write_regs(self: &Arc<Self>, offset: u64, data: &[u8]) {
        let v = match data.len() {
            4 => u32::from_le_bytes(data.try_into().unwrap_or_default()) as u64,
            8 => u64::from_le_bytes(data.try_into().unwrap_or_default()),
            _ => return,
        };
        match offset {
            o if o == registers::INTMS as u64 => lock(&self.regs).intms |= v as u32,
            o if o == registers::INTMC as u64 => {
                let due = {
                    let mut r = lock(&self.regs);
                    r.intms &= !(v as u32);
                    let due = r.intm_pending & !r.intms;
                    r.intm_pending &= r.intms;
                    due
                };
                (0..32u16)
                    .filter(|b| due & 1 << b != 0)
                    .for_each(|iv| self.interrupt(iv));
            }
            o if o == registers::CC as u64 => self.write_cc(v as u32),
            AQA => lock(&self.regs).aqa = v as u32,
            ASQ => {
                let mut r = lock(&self.regs);
                r.asq = if data.len() == 8 {
                    v
                } else {
                    (r.asq & !0xFFFF_FFFF) | v
                };
            }
            0x2C if data.len() == 4 => {
                let mut r = lock(&self.regs);
                r.asq = (r.asq & 0xFFFF_FFFF) | v << 32;
            }
            ACQ => {
                let mut r = lock(&self.regs);
                r.acq = if data.len() == 8 {
                    v
                } else {
                    (r.acq & !0xFFFF_FFFF) | v
                };
            }
            0x34 if data.len() == 4 => {
                let mut r = lock(&self.regs);
                r.acq = (r.acq & 0xFFFF_FFFF) | v << 32;
            }
            _ => {}
        }
    }

    fn write_cc(self: &Arc<Self>, new: u32) {
        let old = {
            let mut r = lock(&self.regs);
            std::mem::replace(&mut r.cc, new)
        };
        let enabling = new & cc::EN != 0 && old & cc::EN == 0;
        let disabling = new & cc::EN == 0 && old & cc::EN != 0;
        if enabling {
            self.enable(new);
        } else if disabling {
            self.reset();
        }
        let shn = (new & cc::SHN_MASK) >> cc::SHN_SHIFT;
        let shn_old = (old & cc::SHN_MASK) >> cc::SHN_SHIFT;
        if shn != 0 && shn_old == 0 {
            // Shutdown notification: every acknowledged write durable before SHST says
            // complete.
            for ns in self.subsys.namespace_table().into_values() {
                if let Err(e) = ns
                    .volume
                    .submit_wait(IoRequest::new(IoKind::Flush, 0, 0, 0))
                {
                    warn!(nsid = ns.nsid, "nvme pcie: flush at shutdown failed: {e}");
                }
            }
        }
        if !disabling {
            if let Some(c) = lock(&self.ctrl).as_ref() {
                c.property_set(registers::CC, new as u64);
            }
        }
    }

    /// CC.EN 0 → 1: the admin queues from AQA/ASQ/ACQ, a new controller of the core.
    fn enable(self: &Arc<Self>, cc_val: u32) {
        if self.stop.load(Ordering::SeqCst) {
            // The listener is gone: no new controller in the subsystem.
            self.fatal.store(true, Ordering::SeqCst);
            return;
        }
        let (aqa, asq, acq) = {
            let r = lock(&self.regs);
            (r.aqa, r.asq, r.acq)
        };
        let sqs = (aqa & 0xFFF) as u16 + 1;
        let cqs = ((aqa >> 16) & 0xFFF) as u16 + 1;
        if sqs < 2 || cqs < 2 || asq % prp::PAGE != 0 || acq % prp::PAGE != 0 {
            warn!("nvme pcie: enabled with unusable admin queues: controller fatal");
            self.fatal.store(true, Ordering::SeqCst);
            return;
        }
        let admin = Arc::new(AdminQueue {
            dev: Arc::downgrade(self),
        });
        let ctrl = TargetController::new(
            &self.target,
            self.subsys.clone(),
            self.hostnqn.clone(),
            0,
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            &admin,
        );
        self.subsys.insert_controller(ctrl.clone());
        {
            let mut q = lock(&self.queues);
            q.sqs.insert(
                0,
                Arc::new(Sq {
                    qid: 0,
                    base: asq,
                    size: sqs,
                    cqid: 0,
                    head: Mutex::new(0),
                    retired: AtomicBool::new(false),
                }),
            );
            q.cqs.insert(0, Arc::new(Cq::new(0, acq, cqs, 0, true)));
        }
        *lock(&self.admin) = Some(admin);
        *lock(&self.ctrl) = Some(ctrl);
        self.changed();
        debug!(
            nqn = self.subsys.nqn(),
            cc = cc_val,
            "nvme pcie: controller enabled"
        );
    }

    /// Controller reset (CC.EN 1 → 0, or the device reset): queues deleted, the core's
    /// controller gone, registers but AQA/ASQ/ACQ back to their reset values.
    pub(super) fn reset(&self) {
        if let Some(c) = lock(&self.ctrl).take() {
            self.subsys.remove_controller(c.cntlid);
            c.teardown();
        }
        *lock(&self.admin) = None;
        {
            let mut q = lock(&self.queues);
            q.sqs.values().for_each(|s| s.retire());
            q.cqs.values().for_each(|c| c.retire());
            q.sqs.clear();
            q.cqs.clear();
        }
        self.changed();
        self.doorbells.clear();
        lock(&self.coalescing).reset();
        self.coalescing_timed.store(false, Ordering::Release);
        self.fatal.store(false, Ordering::SeqCst);
        let mut r = lock(&self.regs);
        r.cc = 0;
        r.intms = 0;
        r.intm_pending = 0;
    }

    fn set_fatal(&self, why: Fatal) {
        if !self.fatal.swap(true, Ordering::SeqCst) {
            warn!(
                nqn = self.subsys.nqn(),
                ?why,
                "nvme pcie: host error: controller fatal status"
            );
        }
    }

    /// Raise vector `iv`, if the function's interrupts are on and the client gave an eventfd.
    /// With MSI, a vector the host masked (INTMS) is raised when it unmasks it, and with fewer
    /// vectors enabled than the queues name, vector `iv` is raised as the enabled vector its
    /// low bits name (the Message Data bits the function may change, PCI Local Bus 3.0
    /// §6.8.1.6: Linux on x86 enables one MSI vector and gives every queue vector 0 then).
    fn interrupt(&self, iv: u16) {
        let Some(enabled) = lock(&self.config).vectors_enabled() else {
            return;
        };
        let iv = if let Interrupts::Msi(_) = self.interrupts {
            let iv = iv & (enabled - 1);
            let mut r = lock(&self.regs);
            if r.intms & 1 << iv != 0 {
                r.intm_pending |= 1 << iv;
                return;
            }
            iv
        } else {
            iv
        };
        if let Some(Some(f)) = lock(&self.irqs).get(iv as usize) {
            let _ = (&*f).write_all(&1u64.to_ne_bytes());
        }
    }

    /// `n` completions were posted to `cq`: raise its vector now if interrupts are on and
    /// coalescing does not hold it back (or the running poller pass takes it).
    fn signal(&self, cq: &Cq, n: u32) {
        if !cq.ien {
            return;
        }
        let mut co = lock(&self.coalescing);
        // The clock is read only when an aggregation time is set.
        let now = if co.timed() {
            Instant::now()
        } else {
            self.epoch
        };
        if co.posted(cq.iv, cq.qid == 0, n, now) {
            drop(co);
            self.interrupt(cq.iv);
        }
    }

    /// Raise the vectors the poller pass gathered and those whose aggregation time passed.
    fn end_pass(&self) {
        let due = {
            let mut co = lock(&self.coalescing);
            let now = if co.timed() {
                Instant::now()
            } else {
                self.epoch
            };
            co.end_pass(now)
        };
        for iv in due {
            self.interrupt(iv);
        }
    }

    /// Post a completion on the completion queue of submission queue `sqid` (the admin
    /// queue's, and completions that are not an I/O command's).
    fn complete(&self, sqid: u16, sqhd: u16, cid: u16, status: Status, dw0: u32) {
        let pair = {
            let q = lock(&self.queues);
            let Some(sq) = q.sqs.get(&sqid).cloned() else {
                return;
            };
            q.cqs.get(&sq.cqid).cloned().map(|cq| (sq, cq))
        };
        if let Some((sq, cq)) = pair {
            let mem = lock(&self.mem).clone();
            self.post(&mem, &sq, &cq, sqhd, cid, status, dw0);
        }
    }

    /// Post a completion of a command of `sq` on its completion queue `cq`, in `mem` (the
    /// memory map the command's data moved through); nothing if either queue was deleted
    /// meanwhile (a deleted queue's memory may be the host's again).
    #[allow(clippy::too_many_arguments)]
    fn post(
        &self,
        mem: &GuestMemoryMmap,
        sq: &Sq,
        cq: &Cq,
        sqhd: u16,
        cid: u16,
        status: Status,
        dw0: u32,
    ) {
        if sq.retired() {
            return;
        }
        let posted = cq.post(
            mem,
            &self.doorbells,
            Pending {
                dw0,
                sqhd,
                sqid: sq.qid,
                cid,
                status,
            },
        );
        match posted {
            Ok(0) => {}
            Ok(n) => self.signal(cq, n),
            Err(f) => self.set_fatal(f),
        }
    }

    /// The queue table, the enable state, the DMA memory or the configuration space changed:
    /// the poller reads them again.
    pub(super) fn changed(&self) {
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// Bring the poller's cache up to generation `gen`.
    fn refresh(self: &Arc<Self>, cache: &mut PollCache, gen: u64) {
        {
            let q = lock(&self.queues);
            // A queue still in the table keeps its completion objects.
            let mut old = std::mem::take(&mut cache.sqs);
            for sq in q.sqs.values() {
                let Some(cq) = q.cqs.get(&sq.cqid) else {
                    continue;
                };
                let pair = match old
                    .iter()
                    .position(|p| Arc::ptr_eq(&p.sq, sq) && Arc::ptr_eq(&p.cq, cq))
                {
                    Some(i) => {
                        let mut pair = old.swap_remove(i);
                        // The memory map may be another.
                        pair.renew();
                        pair
                    }
                    None => QueuePair::new(Arc::downgrade(self), sq.clone(), cq.clone()),
                };
                cache.sqs.push(pair);
            }
            cache.cqs.clear();
            cache.cqs.extend(q.cqs.values().cloned());
        }
        cache.enabled = lock(&self.ctrl).is_some();
        cache.bus_master = lock(&self.config).bus_master();
        cache.mem = lock(&self.mem).clone();
        cache.gen = gen;
    }

    /// One pass over every submission queue; whether any work was found (the fuzz target's
    /// poller: no cache kept between passes).
    #[cfg(feature = "fuzzing")]
    pub(super) fn poll(self: &Arc<Self>) -> bool {
        self.poll_with(&mut PollCache::new())
    }

    /// [`PcieController::poll`] with the poller's cache of the queue table.
    pub(super) fn poll_with(self: &Arc<Self>, cache: &mut PollCache) -> bool {
        if self.fatal.load(Ordering::SeqCst) {
            return false;
        }
        let gen = self.generation.load(Ordering::Acquire);
        if gen != cache.gen {
            self.refresh(cache, gen);
        }
        // No DMA before the driver enables bus mastering (PCI Command register).
        if !cache.enabled || !cache.bus_master {
            return false;
        }
        let mut work = false;
        cache.pass_started = 0;
        for cq in &cache.cqs {
            match cq.flush(&cache.mem, &self.doorbells) {
                Ok(0) => {}
                Ok(n) => {
                    work = true;
                    self.signal(cq, n);
                }
                Err(f) => return self.fatal_pass(f),
            }
        }
        let ns_gen = cache.ns_gen;
        self.subsys
            .refresh_namespace_table(&mut cache.ns_gen, &mut cache.namespaces);
        if cache.ns_gen != ns_gen {
            // A volume's statistics may be gone.
            cache.sqs.iter_mut().for_each(QueuePair::renew);
        }
        // The statistics' clock is read once for the pass's commands, not per command; the
        // coalescing pass (vectors raised once, at its end) begins with the first command.
        let mut batch = None;
        let PollCache {
            sqs,
            entries,
            namespaces,
            mem,
            pass_started,
            ..
        } = cache;
        for pair in sqs.iter_mut() {
            if pair.stale {
                pair.sweep();
            }
            if let Err(f) = queue::fetch(&pair.sq, mem, &self.doorbells, FETCH_BATCH, entries) {
                return self.fatal_pass(f);
            }
            if !entries.is_empty() && batch.is_none() {
                batch = Some(crate::telemetry::clock::batch());
                *pass_started = crate::telemetry::clock::now_ns();
                lock(&self.coalescing).begin_pass();
            }
            // From as many commands as make the prefetch worth it, an I/O queue's completions
            // of this batch are written a cache line at a time (queue::HeldBack); a host at a
            // low queue depth gets each as it comes.
            let held = (entries.len() >= queue::PREFETCH_FROM && pair.sq.qid != 0)
                .then(|| queue::HeldBack::begin(&pair.cq, mem, entries.len()));
            for (sqhd, raw) in entries.drain(..) {
                work = true;
                let cmd = Command::decode(&raw);
                let prp1 = u64::from_le_bytes(raw[24..32].try_into().unwrap_or_default());
                let prp2 = u64::from_le_bytes(raw[32..40].try_into().unwrap_or_default());
                if pair.sq.qid == 0 {
                    self.admin_command(mem, sqhd, &cmd, prp1, prp2);
                } else {
                    self.io_command(mem, pair, namespaces, sqhd, &cmd, prp1, prp2);
                }
            }
            if let Some(held) = held {
                match held.post(mem, &self.doorbells) {
                    Ok(0) => {}
                    Ok(n) => self.signal(&pair.cq, n),
                    Err(f) => return self.fatal_pass(f),
                }
            }
        }
        if batch.is_some() || self.coalescing_timed.load(Ordering::Acquire) {
            self.end_pass();
        }
        work
    }

    fn fatal_pass(&self, f: Fatal) -> bool {
        self.set_fatal(f);
        self.end_pass();
        false
    }

    // ---- Admin commands ----

    fn admin_command(
        &self,
        mem: &Arc<GuestMemoryMmap>,
        sqhd: u16,
        c: &Command,
        prp1: u64,
        prp2: u64,
    ) {
        let reply = |s: Status, dw0: u32| self.complete(0, sqhd, c.cid, s, dw0);
        if c.flags & 0xC0 != 0 {
            // PSDT: PRPs only on the admin queue (NVMe Base 2.0 §4.1.2: SGLs are not
            // used for admin commands over PCIe).
            return reply(Status::INVALID_FIELD, 0);
        }
        match c.opcode {
            admin_opcode::CREATE_IO_CQ => reply(self.create_cq(c), 0),
            admin_opcode::CREATE_IO_SQ => reply(self.create_sq(c), 0),
            admin_opcode::DELETE_IO_SQ => reply(self.delete_sq(c.cdw10 as u16), 0),
            admin_opcode::DELETE_IO_CQ => reply(self.delete_cq(c.cdw10 as u16), 0),
            admin_opcode::DOORBELL_BUFFER_CONFIG => {
                reply(self.doorbell_buffer_config(mem, prp1, prp2), 0)
            }
            admin_opcode::SET_FEATURES | admin_opcode::GET_FEATURES
                if matches!(
                    c.cdw10 as u8,
                    fid::INTERRUPT_COALESCING | fid::INTERRUPT_VECTOR_CONFIG
                ) =>
            {
                let (s, dw0) = self.coalescing_feature(c);
                reply(s, dw0)
            }
            _ => {
                let Some(ctrl) = lock(&self.ctrl).clone() else {
                    return reply(Status::COMMAND_SEQUENCE_ERROR, 0);
                };
                match ctrl.admin(c, &[]) {
                    AdminReply::Done(s, dw0, data) => {
                        if s.is_success() && !data.is_empty() {
                            match prp::walk(mem, prp1, prp2, data.len() as u64) {
                                Ok(spans) => prp::copy_out(&spans, &data),
                                Err(e) => return reply(e, 0),
                            }
                        }
                        reply(s, dw0)
                    }
                    AdminReply::Parked => {}
                }
            }
        }
    }

    /// Set/Get Features 08h (Interrupt Coalescing) and 09h (Interrupt Vector Configuration):
    /// (status, Dword 0). Neither is saveable; Default and Saved read the reset values.
    fn coalescing_feature(&self, c: &Command) -> (Status, u32) {
        let mut co = lock(&self.coalescing);
        if c.opcode == admin_opcode::SET_FEATURES {
            let f = SetFeatures::from_command(c);
            if f.save {
                return (Status::FEATURE_NOT_SAVEABLE, 0);
            }
            if f.fid == fid::INTERRUPT_COALESCING {
                co.set_feature(f.value);
                self.coalescing_timed.store(co.timed(), Ordering::Release);
                return (Status::SUCCESS, 0);
            }
            return match co.set_vector_config(f.value) {
                Ok(()) => (Status::SUCCESS, 0),
                Err(s) => (s, 0),
            };
        }
        let g = GetFeatures::from_command(c);
        let reset = Coalescing::new(self.interrupts.vectors());
        let from = match g.select {
            Select::Current => &*co,
            Select::Default | Select::Saved => &reset,
            Select::SupportedCapabilities => {
                return (Status::SUCCESS, features::CAPABILITY_CHANGEABLE)
            }
            Select::Reserved(_) => return (Status::INVALID_FIELD, 0),
        };
        if g.fid == fid::INTERRUPT_COALESCING {
            return (Status::SUCCESS, from.feature());
        }
        match from.vector_config(c.cdw11) {
            Ok(v) => (Status::SUCCESS, v),
            Err(s) => (s, 0),
        }
    }

    /// Doorbell Buffer Config (NVMe Base 2.0 §5.8): PRP1 the shadow doorbell buffer, PRP2
    /// the EventIdx buffer, each a page-aligned page of the host's mapped memory.
    fn doorbell_buffer_config(&self, mem: &GuestMemoryMmap, prp1: u64, prp2: u64) -> Status {
        use vm_memory::{GuestAddress, GuestMemory};
        let usable = |a: u64| {
            a != 0
                && a % prp::PAGE == 0
                && mem.check_range(
                    GuestAddress(a),
                    prp::PAGE as usize,
                    vm_memory::Permissions::ReadWrite,
                )
        };
        if !usable(prp1) || !usable(prp2) || prp1 == prp2 {
            return Status::INVALID_FIELD;
        }
        self.doorbells.configure_shadow(prp1, prp2);
        debug!(
            shadow = prp1,
            event_idx = prp2,
            "nvme pcie: shadow doorbells configured"
        );
        Status::SUCCESS
    }

    fn create_cq(&self, c: &Command) -> Status {
        let qid = c.cdw10 as u16;
        let size = (c.cdw10 >> 16) as u16 as u32 + 1;
        let contiguous = c.cdw11 & 1 != 0;
        let ien = c.cdw11 & 2 != 0;
        let iv = (c.cdw11 >> 16) as u16;
        let base = c.sgl.addr;
        let mut q = lock(&self.queues);
        if qid == 0 || qid > limits::MAX_IO_QUEUES || q.cqs.contains_key(&qid) {
            return Status::INVALID_QUEUE_IDENTIFIER;
        }
        if !(2..=limits::MAX_QUEUE_ENTRIES).contains(&size) {
            return MAX_QUEUE_SIZE_EXCEEDED;
        }
        if !contiguous {
            return Status::INVALID_FIELD;
        }
        if iv >= self.interrupts.vectors() {
            return INVALID_INTERRUPT_VECTOR;
        }
        if base % prp::PAGE != 0 {
            return PRP_OFFSET_INVALID;
        }
        q.cqs
            .insert(qid, Arc::new(Cq::new(qid, base, size as u16, iv, ien)));
        self.changed();
        Status::SUCCESS
    }

    fn create_sq(&self, c: &Command) -> Status {
        let qid = c.cdw10 as u16;
        let size = (c.cdw10 >> 16) as u16 as u32 + 1;
        let contiguous = c.cdw11 & 1 != 0;
        let cqid = (c.cdw11 >> 16) as u16;
        let base = c.sgl.addr;
        let mut q = lock(&self.queues);
        if qid == 0 || qid > limits::MAX_IO_QUEUES || q.sqs.contains_key(&qid) {
            return Status::INVALID_QUEUE_IDENTIFIER;
        }
        if cqid == 0 || !q.cqs.contains_key(&cqid) {
            return COMPLETION_QUEUE_INVALID;
        }
        if !(2..=limits::MAX_QUEUE_ENTRIES).contains(&size) {
            return MAX_QUEUE_SIZE_EXCEEDED;
        }
        if !contiguous {
            return Status::INVALID_FIELD;
        }
        if base % prp::PAGE != 0 {
            return PRP_OFFSET_INVALID;
        }
        q.sqs.insert(
            qid,
            Arc::new(Sq {
                qid,
                base,
                size: size as u16,
                cqid,
                head: Mutex::new(0),
                retired: AtomicBool::new(false),
            }),
        );
        self.changed();
        Status::SUCCESS
    }

    fn delete_sq(&self, qid: u16) -> Status {
        let mut q = lock(&self.queues);
        if qid == 0 {
            return Status::INVALID_QUEUE_IDENTIFIER;
        }
        let Some(sq) = q.sqs.remove(&qid) else {
            return Status::INVALID_QUEUE_IDENTIFIER;
        };
        sq.retire();
        self.changed();
        Status::SUCCESS
    }

    fn delete_cq(&self, qid: u16) -> Status {
        let mut q = lock(&self.queues);
        if qid == 0 || !q.cqs.contains_key(&qid) {
            return Status::INVALID_QUEUE_IDENTIFIER;
        }
        if q.sqs.values().any(|s| s.cqid == qid) {
            return INVALID_QUEUE_DELETION;
        }
        if let Some(cq) = q.cqs.remove(&qid) {
            cq.retire();
        }
        self.changed();
        Status::SUCCESS
    }

    // ---- I/O commands (NVM Command Set 1.0 §3) ----

    #[allow(clippy::too_many_arguments)]
    fn io_command(
        &self,
        mem: &Arc<GuestMemoryMmap>,
        pair: &mut QueuePair,
        namespaces: &BTreeMap<u32, Arc<Namespace>>,
        sqhd: u16,
        c: &Command,
        prp1: u64,
        prp2: u64,
    ) {
        let fail = |s: Status| self.post(mem, &pair.sq, &pair.cq, sqhd, c.cid, s, 0);
        let plan = match io::plan(c, namespaces) {
            Plan::Ranges(ns, d) => {
                // The range list, copied out of the host's memory.
                let mut buf = vec![0u8; d.data_len()];
                match sgl::data_pointer(mem, c, prp1, prp2, buf.len() as u64) {
                    Ok(spans) => prp::copy_in(&spans, &mut buf),
                    Err(s) => return fail(s),
                }
                io::deallocate(ns, &d, &buf)
            }
            p => p,
        };
        let (mut io, spans) = match plan {
            Plan::Done(s) => return fail(s),
            Plan::Read(io) | Plan::Write(io) => {
                // Reads and writes go straight to and from the host's pages (PRPs or SGLs).
                match sgl::data_pointer(mem, c, prp1, prp2, io.len) {
                    Ok(spans) => (io, Some(spans)),
                    Err(s) => return fail(s),
                }
            }
            Plan::Run(io) => (io, None),
            Plan::Ranges(..) => unreachable!("deallocate gives Done or Run"),
        };
        // Submit the first request (with the host's pages for its data) through the
        // namespace's path; its completion runs the rest of the command.
        let mut req = io.request(0);
        if let Some(spans) = spans {
            req.segments = spans;
        }
        let metrics = io.ns.path.metrics();
        let slot = pair.take(mem, metrics);
        let this = &slot.this;
        let mut at = Origin {
            sqhd,
            cid: c.cid,
            read: io.is_read(),
            then: false,
            metrics: Kept::None,
        };
        if let Some(m) = metrics {
            this.arrival.set(m.arrive(io.kind, io.len));
            at.metrics = if this.metrics.as_ref().is_some_and(|k| Arc::ptr_eq(k, m)) {
                Kept::Fixed
            } else {
                // Another namespace's volume than the one the object was made for.
                lock(&this.rare).metrics = Some(m.clone());
                Kept::Rare
            };
        }
        if !io.then.is_empty() {
            lock(&this.rare).then = std::mem::take(&mut io.then);
            at.then = true;
        }
        this.set_origin(at);
        io.ns.path.submit(req, &slot.done);
    }
}

/// Where a command came from (the submission queue head after it was fetched, and its
/// Command Identifier: both go in its completion entry), and what its completion has to look
/// at besides.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Origin {
    sqhd: u16,
    cid: u16,
    /// A failure is reported as a read's.
    read: bool,
    /// Requests follow the first ([`Rare::then`]).
    then: bool,
    /// Where the statistics handle of the command's volume is.
    metrics: Kept,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kept {
    /// The volume has no statistics layer.
    None,
    /// [`Inflight::metrics`]: the volume the object was made for.
    Fixed,
    /// [`Rare::metrics`].
    Rare,
}

impl Origin {
    fn pack(self) -> u64 {
        let metrics = match self.metrics {
            Kept::None => 0,
            Kept::Fixed => 1,
            Kept::Rare => 2,
        };
        self.sqhd as u64
            | (self.cid as u64) << 16
            | (self.read as u64) << 32
            | (self.then as u64) << 33
            | metrics << 34
    }

    fn unpack(v: u64) -> Self {
        Origin {
            sqhd: v as u16,
            cid: (v >> 16) as u16,
            read: v >> 32 & 1 != 0,
            then: v >> 33 & 1 != 0,
            metrics: match v >> 34 & 3 {
                0 => Kept::None,
                1 => Kept::Fixed,
                _ => Kept::Rare,
            },
        }
    }
}

/// A command's completion object while the command is at the volumes; pooled per queue
/// ([`QueuePair`]). It holds the guest memory map the command's data spans point into (its
/// completion is posted in the same map, so the mapping outlives the request even if the
/// client unmaps it meanwhile) and the statistics of the volume it was made for, both for
/// its life, so neither costs a reference count per command.
///
/// What changes from command to command is in relaxed atomics (plain loads and stores): the
/// poller writes them before it submits the command, the completion reads them, and the
/// request's way through the volume orders the two (a volume that completes on another
/// thread hands the request over through a lock or a queue). `busy` orders the completion's
/// reads before the poller's next writes. What most commands lack is behind a lock.
struct Inflight {
    me: Weak<Inflight>,
    dev: Weak<PcieController>,
    /// The queues the command came from and completes on.
    sq: Arc<Sq>,
    cq: Arc<Cq>,
    mem: Arc<GuestMemoryMmap>,
    metrics: Option<Arc<VolumeMetrics>>,
    /// A command holds it, from the poller's taking it to the posting of its completion.
    busy: AtomicBool,
    /// [`Origin::pack`].
    origin: AtomicU64,
    /// The command's arrival in its volume's statistics.
    arrival: ArrivalCell,
    rare: Mutex<Rare>,
}

/// What few commands have.
#[derive(Default)]
struct Rare {
    /// The command's requests still to run.
    then: Then,
    /// The statistics of a volume other than the one the object was made for.
    metrics: Option<Arc<VolumeMetrics>>,
}

impl Inflight {
    /// A completion object, in use.
    fn new(
        dev: Weak<PcieController>,
        sq: Arc<Sq>,
        cq: Arc<Cq>,
        mem: Arc<GuestMemoryMmap>,
        metrics: Option<Arc<VolumeMetrics>>,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Inflight {
            me: me.clone(),
            dev,
            sq,
            cq,
            mem,
            metrics,
            busy: AtomicBool::new(true),
            origin: AtomicU64::new(0),
            arrival: ArrivalCell::default(),
            rare: Mutex::new(Rare::default()),
        })
    }

    fn set_origin(&self, at: Origin) {
        self.origin.store(at.pack(), Ordering::Relaxed);
    }
}

impl IoCompletion for Inflight {
    fn complete(&self, _tag: u64, result: IoResult) {
        let at = Origin::unpack(self.origin.load(Ordering::Relaxed));
        if at.then {
            let next = lock(&self.rare).then.next(result.is_ok());
            if let Some((vol, req)) = next {
                if let Some(me) = self.me.upgrade() {
                    let d: Arc<dyn IoCompletion> = me;
                    vol.submit(req, &d);
                }
                return;
            }
        }
        if let Some(a) = self.arrival.take() {
            match at.metrics {
                Kept::None => {}
                Kept::Fixed => {
                    if let Some(m) = &self.metrics {
                        m.complete(&a, result.is_err());
                    }
                }
                Kept::Rare => {
                    if let Some(m) = lock(&self.rare).metrics.take() {
                        m.complete(&a, result.is_err());
                    }
                }
            }
        }
        let status = io::status(&result, at.read);
        let post = |dev: &PcieController| {
            dev.post(&self.mem, &self.sq, &self.cq, at.sqhd, at.cid, status, 0)
        };
        // On the poller's thread (a volume that completes within its submit), through the
        // poller's own handle on the controller; elsewhere through a new one.
        let by_poller = POLLING.with_borrow(|p| match p {
            Some(dev) if std::ptr::eq(Arc::as_ptr(dev), self.dev.as_ptr()) => {
                post(dev);
                true
            }
            _ => false,
        });
        if !by_poller {
            if let Some(dev) = self.dev.upgrade() {
                post(&dev);
            }
        }
        // The completion is posted: the poller may give this object to another command.
        self.busy.store(false, Ordering::Release);
    }
}

/// Command specific statuses of the queue commands (§5.4-5.7, Figure 103).
const COMPLETION_QUEUE_INVALID: Status = Status::new(1, 0x00, true);
const MAX_QUEUE_SIZE_EXCEEDED: Status = Status::new(1, 0x02, true);
const INVALID_INTERRUPT_VECTOR: Status = Status::new(1, 0x08, true);
const INVALID_QUEUE_DELETION: Status = Status::new(1, 0x0C, true);
/// PRP Offset Invalid (§4.1.1, generic status 13h).
pub(super) const PRP_OFFSET_INVALID: Status = Status::new(0, 0x13, true);

/// A completion backlog (entries the host has not consumed yet, on one completion queue)
/// from which [`PollPolicy::Adaptive`] takes the host as deep, and one at or under which it
/// takes it as waiting on each completion again.
const NAP_BACKLOG: u32 = 8;
const SPIN_BACKLOG: u32 = 2;
/// The poller's pause between passes while the host is deep.
const NAP: Duration = Duration::from_micros(4);

/// How long the poller spins once it finds no work, before it starts to yield and then to
/// sleep: a host waiting on each completion (queue depth 1) finds the poller spinning, not
/// in a system call, when it rings; a controller left idle costs a core for no longer.
const SPIN_TIME: Duration = Duration::from_micros(50);
/// Idle passes between two looks at the clock while spinning.
const SPIN_CLOCK_EVERY: u32 = 16;
/// Idle passes with a `sched_yield` between them, after the spin, before sleeping.
const YIELD_PASSES: u32 = 64;
/// Passes run on one strong handle on the controller before the poller lets go of it and
/// looks again whether the controller still exists.
const HOLD_PASSES: u32 = 1024;

/// What a controller's poller did since it started, as `nvmf_get_stats` shows it: SPDK's
/// thread statistics (`thread_get_stats`: busy and idle ticks), so a polled target's load can
/// be read as the share of its core spent in passes that found work rather than as the whole
/// core it spins on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PollStats {
    /// Passes that found work (a command fetched or a held completion posted).
    pub busy_passes: u64,
    /// Passes that found nothing: the price of polling.
    pub idle_passes: u64,
    /// Time in busy passes: from the end of the pass before (when that one was busy too and
    /// no pause came between) or else the first command's fetch, to the pass's end.
    pub busy_ns: u64,
    /// Times the poller paused (yielded or slept) between passes.
    pub pauses: u64,
    /// The poller's clock when it published these ([`crate::telemetry::clock::read_ns`]):
    /// the time base of `busy_ns`.
    pub at_ns: u64,
}

/// [`PollStats`] as the poller publishes them: written by the poller thread alone, at least
/// every [`HOLD_PASSES`] passes and before each pause.
#[derive(Default)]
pub(super) struct PollCounters {
    busy_passes: AtomicU64,
    idle_passes: AtomicU64,
    busy_ns: AtomicU64,
    pauses: AtomicU64,
    at_ns: AtomicU64,
}

impl PollCounters {
    fn publish(&self, s: &PollStats) {
        self.busy_passes.store(s.busy_passes, Ordering::Relaxed);
        self.idle_passes.store(s.idle_passes, Ordering::Relaxed);
        self.busy_ns.store(s.busy_ns, Ordering::Relaxed);
        self.pauses.store(s.pauses, Ordering::Relaxed);
        self.at_ns.store(s.at_ns, Ordering::Release);
    }

    pub(super) fn read(&self) -> PollStats {
        let at_ns = self.at_ns.load(Ordering::Acquire);
        PollStats {
            busy_passes: self.busy_passes.load(Ordering::Relaxed),
            idle_passes: self.idle_passes.load(Ordering::Relaxed),
            busy_ns: self.busy_ns.load(Ordering::Relaxed),
            pauses: self.pauses.load(Ordering::Relaxed),
            at_ns,
        }
    }
}

/// The poller's account of its passes ([`PollStats`]), kept on its own stack.
#[derive(Default)]
struct BusyClock {
    stats: PollStats,
    /// When the last pass ended, if it was busy (0 after an idle pass).
    busy_until: u64,
}

impl BusyClock {
    /// A pass found work; `started` is when it took its first command (0 if it took none).
    /// One clock read: the pass's end.
    fn busy(&mut self, started: u64) {
        let end = crate::telemetry::clock::read_ns();
        let from = match (self.busy_until, started) {
            (0, 0) => end,
            (0, s) => s,
            (b, _) => b,
        };
        self.stats.busy_ns += end.saturating_sub(from);
        self.stats.busy_passes += 1;
        self.busy_until = end;
    }

    fn idle(&mut self) {
        self.stats.idle_passes += 1;
        self.busy_until = 0;
    }

    /// The poller pauses (yields or sleeps) before its next pass: that time is not busy,
    /// whatever the pass before found.
    fn paused(&mut self) {
        self.stats.pauses += 1;
        self.busy_until = 0;
    }

    fn publish(&mut self, to: &PollCounters) {
        self.stats.at_ns = crate::telemetry::clock::read_ns();
        to.publish(&self.stats);
    }
}

thread_local! {
    /// The controller a poller thread is polling, while it holds a handle on it: completions
    /// that run on the poller's thread post through it rather than upgrade their own weak
    /// handle (two atomic instructions per command).
    static POLLING: std::cell::RefCell<Option<Arc<PcieController>>> =
        const { std::cell::RefCell::new(None) };
}

/// While alive, [`POLLING`] names the controller this thread polls.
struct Polling;

impl Polling {
    fn begin(dev: &Arc<PcieController>) -> Self {
        POLLING.set(Some(dev.clone()));
        Polling
    }
}

impl Drop for Polling {
    fn drop(&mut self) {
        POLLING.take();
    }
}

/// The poller's loop: busy while there is work, spinning for a while once there is none,
/// then sleeping in growing steps (up to 1 ms, or one 100 µs unit of aggregation time while
/// a coalesced interrupt waits: each pass raises the vectors whose time has come) so an idle
/// controller costs little.
///
/// Busy-polling buys latency only for a host that waits on each completion. A host that
/// leaves completions unconsumed on its queue (at least [`NAP_BACKLOG`]) gains nothing from
/// the next pass coming sooner, and the poll costs the core it runs on (a DPU's Arm cores
/// also run crypto, the initiator and other functions). So under [`PollPolicy::Adaptive`],
/// the default, the poller pauses [`NAP`] after each pass while the host is that deep, and
/// spins again once a pass sees [`SPIN_BACKLOG`] or fewer; `always` spins at any depth
/// (SPDK's way), `off` pauses after every pass. Doorbells are stores to mapped memory that
/// raise no event, so a pause is a timed sleep: the thread's timer slack is set to 1 µs so
/// that it lasts microseconds, not the default 50.
pub(super) fn poller(dev: Weak<PcieController>, policy: PollPolicy) {
    // SAFETY: PR_SET_TIMERSLACK takes a plain integer and affects only this thread.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64) };
    let mut idle = 0u32;
    // The passes that spun, once the spin is over (0 while spinning).
    let mut spun = 0u32;
    let mut idle_since = Instant::now();
    let mut deep = false;
    let mut cache = PollCache::new();
    let mut clock = BusyClock::default();
    loop {
        let Some(d) = dev.upgrade() else { return };
        let polling = Polling::begin(&d);
        let mut pause = None;
        for _ in 0..HOLD_PASSES {
            if d.stop.load(Ordering::Relaxed) {
                return;
            }
            if d.poll_with(&mut cache) {
                clock.busy(cache.pass_started);
                idle = 0;
                spun = 0;
                let nap = match policy {
                    PollPolicy::Always => false,
                    PollPolicy::Off => true,
                    PollPolicy::Adaptive => {
                        let backlog = cache.backlog();
                        if backlog >= NAP_BACKLOG {
                            deep = true;
                        } else if backlog <= SPIN_BACKLOG {
                            deep = false;
                        }
                        deep
                    }
                };
                if nap {
                    pause = Some(NAP);
                    break;
                }
                continue;
            }
            clock.idle();
            idle = idle.saturating_add(1);
            if spun == 0 && policy != PollPolicy::Off {
                if idle == 1 {
                    idle_since = Instant::now();
                }
                if idle % SPIN_CLOCK_EVERY != 0 || idle_since.elapsed() < SPIN_TIME {
                    std::hint::spin_loop();
                    continue;
                }
                spun = idle;
            }
            let after_spin = idle - spun;
            pause = Some(if after_spin < YIELD_PASSES && policy != PollPolicy::Off {
                Duration::ZERO
            } else {
                let most = if lock(&d.coalescing).waiting() {
                    100
                } else {
                    1000
                };
                Duration::from_micros(
                    (after_spin.saturating_sub(YIELD_PASSES) as u64).clamp(1, most),
                )
            });
            break;
        }
        if pause.is_some() {
            clock.paused();
        }
        clock.publish(&d.poll_counters);
        drop(polling);
        drop(d);
        match pause {
            None => {}
            Some(Duration::ZERO) => std::thread::yield_now(),
            Some(t) => std::thread::sleep(t),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(size: u16) -> QueuePair {
        let sq = Arc::new(Sq {
            qid: 1,
            base: 0,
            size,
            cqid: 1,
            head: Mutex::new(0),
            retired: AtomicBool::new(false),
        });
        QueuePair::new(Weak::new(), sq, Arc::new(Cq::new(1, 0, size, 1, false)))
    }

    /// Busy time runs from a pass's first command (or the end of a busy pass just before it)
    /// to the pass's end; idle passes and pauses between passes are not in it.
    #[test]
    fn busy_time_leaves_out_idle_passes_and_pauses() {
        use crate::telemetry::clock::read_ns;
        let mut c = BusyClock::default();
        let t0 = read_ns();
        std::thread::sleep(Duration::from_millis(20));
        // A pass whose first command came at t0 ran until now: at least the 20 ms.
        c.busy(t0);
        let first = c.stats.busy_ns;
        assert!(first >= 20_000_000, "{first}");
        // A pause after a busy pass, then a pass that found work but took no command (a
        // held completion posted): neither the pause nor that pass adds anything.
        c.paused();
        std::thread::sleep(Duration::from_millis(20));
        c.busy(0);
        assert_eq!(c.stats.busy_ns, first, "the pause counted as busy");
        // Busy again right after: the time since the last pass's end is busy.
        let last_end = c.busy_until;
        assert_ne!(last_end, 0);
        c.busy(0);
        assert_eq!(c.stats.busy_ns - first, c.busy_until - last_end);
        // An idle pass, 20 ms, then a pass whose first command came at t1: only from t1.
        let mid = c.stats.busy_ns;
        c.idle();
        std::thread::sleep(Duration::from_millis(20));
        let t1 = read_ns();
        c.busy(t1);
        let end = read_ns();
        assert!(
            c.stats.busy_ns - mid <= end - t1,
            "the idle time counted as busy: {:?}",
            c.stats
        );
        assert_eq!(
            (c.stats.busy_passes, c.stats.idle_passes, c.stats.pauses),
            (4, 1, 1)
        );
        let counters = PollCounters::default();
        c.publish(&counters);
        let read = counters.read();
        assert_eq!(read.busy_ns, c.stats.busy_ns);
        assert!(read.at_ns >= end && read.busy_ns < read.at_ns, "{read:?}");
    }

    /// Completion objects are made once per entry of the queue and used again once their
    /// command has completed; past a queue's worth in use, each command gets a one-off.
    #[test]
    fn completion_objects_are_pooled_per_queue_and_reused_once_free() {
        let mut p = pair(4);
        let mem = Arc::new(GuestMemoryMmap::new());
        let take = |p: &mut QueuePair| Arc::as_ptr(&p.take(&mem, None).this);
        let taken: Vec<*const Inflight> = (0..4).map(|_| take(&mut p)).collect();
        assert_eq!(p.slots.len(), 4);
        let distinct: std::collections::BTreeSet<_> = taken.iter().collect();
        assert_eq!(distinct.len(), 4, "four commands in flight, four objects");
        // All four busy: a one-off, not kept in the pool.
        let extra = take(&mut p);
        assert!(!taken.contains(&extra));
        assert_eq!(p.slots.len(), 4);
        // The second command completes: its object is the next one handed out.
        p.slots[1].this.busy.store(false, Ordering::Release);
        assert_eq!(take(&mut p), taken[1]);
        assert!(p.slots.iter().all(|s| s.this.busy.load(Ordering::Acquire)));
    }

    /// After the memory map or the namespace table changed, no object made before is handed
    /// out again, and each lets go of the old map and statistics once its command is done.
    #[test]
    fn objects_of_an_old_map_or_namespace_table_are_let_go_once_free() {
        let mut p = pair(4);
        let old = Arc::new(GuestMemoryMmap::new());
        let telemetry = Arc::new(crate::telemetry::Telemetry::new());
        let stats = telemetry.volume("v", None);
        p.take(&old, Some(&stats));
        let second = Arc::as_ptr(&p.take(&old, Some(&stats)).this);
        assert_eq!((Arc::strong_count(&old), Arc::strong_count(&stats)), (3, 3));
        // The first command is done, the second still at its volume, when the map changes.
        p.slots[0].this.busy.store(false, Ordering::Release);
        p.renew();
        assert_eq!(p.slots.len(), 1, "the free object is let go at once");
        assert_eq!(Arc::as_ptr(&p.slots[0].this), second);
        assert!(p.stale);
        let new = Arc::new(GuestMemoryMmap::new());
        // (The first object is gone: a new one may reuse its address, so look at the map.)
        let third = Arc::as_ptr(&p.take(&new, None).this);
        assert!(third != second);
        assert_eq!(p.slots.len(), 2);
        assert!(Arc::ptr_eq(&p.slots[1].this.mem, &new));
        // The second command completes: the next pass's sweep lets go of its object.
        p.slots[0].this.busy.store(false, Ordering::Release);
        p.sweep();
        assert!(!p.stale);
        assert_eq!(p.slots.len(), 1);
        assert_eq!((Arc::strong_count(&old), Arc::strong_count(&stats)), (1, 1));
    }

    #[test]
    fn origin_packs_every_field() {
        for at in [
            Origin {
                sqhd: 0,
                cid: 0,
                read: false,
                then: false,
                metrics: Kept::None,
            },
            Origin {
                sqhd: u16::MAX,
                cid: u16::MAX,
                read: true,
                then: true,
                metrics: Kept::Rare,
            },
            Origin {
                sqhd: 0x1234,
                cid: 0xBEEF,
                read: false,
                then: true,
                metrics: Kept::Fixed,
            },
        ] {
            assert_eq!(Origin::unpack(at.pack()), at);
        }
    }
}
