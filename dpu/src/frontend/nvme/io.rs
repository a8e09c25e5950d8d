//! The NVM Command Set's I/O commands (NVM Command Set 1.0 §3), decided once for every
//! transport: which volume requests a command becomes, in which order, and the statuses of
//! the commands that become none.
//!
//! A transport hands [`plan`] a command from one of its I/O queues and the namespaces its
//! controller sees. What it gets back says everything the command does except move bytes:
//!
//! ```text
//!   Plan::Done(status)       complete now (bad field, unknown namespace or opcode, nothing to do)
//!   Plan::Read(io)           io.len bytes from the volume to the host, then io.then
//!   Plan::Write(io)          io.len bytes from the host to the volume, then io.then (FUA: a Flush)
//!   Plan::Run(io)            no data (Flush, Write Zeroes, each range of a Deallocate), then io.then
//!   Plan::Ranges(ns, dsm)    Dataset Management: bring its range list, then [`deallocate`]
//! ```
//!
//! The transport moves the data (NVMe/TCP: PDUs; NVMe/RDMA: RDMA READ and WRITE; PCIe: PRP
//! lists and SGLs in the host's memory), submits [`Io::request`] through the namespace's
//! [`VolumePath`](crate::volume::qos::VolumePath) with the statistics [`Io::arrive`] opens,
//! and from each completion runs what [`Then::next`] gives, one request after the other, so
//! that no queue thread ever waits on a volume. The command completes with the first failure
//! ([`status`]) or after the last request.

use std::collections::BTreeMap;
use std::sync::Arc;

use nacre_shared::nvme::dsm::DatasetManagement;
use nacre_shared::nvme::{io_opcode, Command, Status};

use super::fabrics::io_status;
use super::limits;
use super::subsystem::{Namespace, Subsystem};
use crate::telemetry::{Arrival, VolumeMetrics};
use crate::volume::{BlockDevice, IoKind, IoRequest, IoResult};

/// The broadcast NSID: a Flush to it flushes every namespace (NVM Command Set 1.0 §3.2.2).
pub const NSID_ALL: u32 = 0xFFFF_FFFF;

/// The namespaces a controller's I/O queue sees: a queue's own copy of the table, or the
/// subsystem's (looked up per command).
pub trait Namespaces {
    fn get(&self, nsid: u32) -> Option<NsRef<'_>>;
    fn all(&self) -> Vec<Arc<Namespace>>;
}

/// A command's namespace: borrowed from the queue's table while the command is planned and
/// submitted (no reference count per command: a polled queue's commands cost a few tens of
/// nanoseconds, and two atomic instructions are a good part of that), or a handle of the
/// command's own ([`Plan::into_owned`], for a transport that keeps the plan past its table's
/// borrow).
pub enum NsRef<'a> {
    Table(&'a Arc<Namespace>),
    Own(Arc<Namespace>),
}

impl NsRef<'_> {
    pub fn into_owned(self) -> NsRef<'static> {
        match self {
            NsRef::Table(ns) => NsRef::Own(ns.clone()),
            NsRef::Own(ns) => NsRef::Own(ns),
        }
    }
}

impl std::ops::Deref for NsRef<'_> {
    type Target = Arc<Namespace>;
    fn deref(&self) -> &Arc<Namespace> {
        match self {
            NsRef::Table(ns) => ns,
            NsRef::Own(ns) => ns,
        }
    }
}

impl Namespaces for BTreeMap<u32, Arc<Namespace>> {
    fn get(&self, nsid: u32) -> Option<NsRef<'_>> {
        BTreeMap::get(self, &nsid).map(NsRef::Table)
    }
    fn all(&self) -> Vec<Arc<Namespace>> {
        self.values().cloned().collect()
    }
}

impl Namespaces for Subsystem {
    fn get(&self, nsid: u32) -> Option<NsRef<'_>> {
        self.namespace(nsid).map(NsRef::Own)
    }
    fn all(&self) -> Vec<Arc<Namespace>> {
        self.namespace_table().into_values().collect()
    }
}

/// A request's arrival in its volume's statistics, closed at the command's completion
/// (`None` for a volume without the statistics layer).
pub type Arrived = Option<(Arc<VolumeMetrics>, Arrival)>;

/// What an I/O command does; see the module's table.
pub enum Plan<'a> {
    Done(Status),
    Read(Io<'a>),
    Write(Io<'a>),
    Run(Io<'a>),
    Ranges(NsRef<'a>, DatasetManagement),
}

impl Plan<'_> {
    /// The same plan, holding its namespace by a handle of its own.
    pub fn into_owned(self) -> Plan<'static> {
        match self {
            Plan::Done(s) => Plan::Done(s),
            Plan::Read(io) => Plan::Read(io.into_owned()),
            Plan::Write(io) => Plan::Write(io.into_owned()),
            Plan::Run(io) => Plan::Run(io.into_owned()),
            Plan::Ranges(ns, d) => Plan::Ranges(ns.into_owned(), d),
        }
    }
}

/// The requests one command becomes: a first one through its namespace's path, then the
/// rest, each after the previous one succeeded.
pub struct Io<'a> {
    pub ns: NsRef<'a>,
    pub kind: IoKind,
    pub offset: u64,
    /// Bytes of the first request (for reads and writes, the host data).
    pub len: u64,
    pub then: Then,
}

impl<'a> Io<'a> {
    fn new(ns: NsRef<'a>, kind: IoKind, offset: u64, len: u64) -> Self {
        Io {
            ns,
            kind,
            offset,
            len,
            then: Then::default(),
        }
    }

    pub fn into_owned(self) -> Io<'static> {
        Io {
            ns: self.ns.into_owned(),
            kind: self.kind,
            offset: self.offset,
            len: self.len,
            then: self.then,
        }
    }

    /// The first request, tagged with the transport's `tag` (its slot); the transport adds
    /// the data's segments to a read or write. The requests of [`Io::then`] get the same tag.
    pub fn request(&mut self, tag: u64) -> IoRequest {
        self.then.tag(tag);
        IoRequest::new(self.kind, self.offset, self.len, tag)
    }

    /// Record the first request's arrival in its volume's statistics; the transport keeps
    /// what this returns and closes it at the command's completion.
    pub fn arrive(&self) -> Arrived {
        self.ns
            .path
            .metrics()
            .map(|m| (m.clone(), m.arrive(self.kind, self.len)))
    }

    /// Whether a failure is reported as a read's (Unrecovered Read Error) or a write's.
    pub fn is_read(&self) -> bool {
        self.kind == IoKind::Read
    }
}

/// The requests still to run once the current one succeeded, the next one last.
#[derive(Default)]
pub struct Then(Vec<(Arc<dyn BlockDevice>, IoRequest)>);

impl Then {
    /// After a request of the command completed: the next one to submit (with the
    /// transport's completion handle), if the request succeeded (`ok`) and one is left.
    /// Otherwise the rest is dropped and the command completes.
    pub fn next(&mut self, ok: bool) -> Option<(Arc<dyn BlockDevice>, IoRequest)> {
        if ok {
            if let Some(step) = self.0.pop() {
                return Some(step);
            }
        }
        self.0.clear();
        None
    }

    /// No request follows the current one.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn tag(&mut self, tag: u64) {
        for (_, r) in &mut self.0 {
            r.tag = tag;
        }
    }

    /// `steps` in the order they run.
    fn of(mut steps: Vec<(Arc<dyn BlockDevice>, IoRequest)>) -> Self {
        steps.reverse();
        Then(steps)
    }
}

/// A flush of `ns`'s volume, as a later step of a command.
fn flush(ns: &Namespace) -> (Arc<dyn BlockDevice>, IoRequest) {
    (ns.volume.clone(), IoRequest::new(IoKind::Flush, 0, 0, 0))
}

/// Decide what the I/O command `c` does on the namespaces `nss` (NVM Command Set 1.0 §3.2).
pub fn plan<'a>(c: &Command, nss: &'a impl Namespaces) -> Plan<'a> {
    if c.fuse() != 0 {
        // Fused operations (Compare and Write) are not supported (FUSES = 0).
        return Plan::Done(Status::INVALID_FIELD);
    }
    if c.opcode == io_opcode::FLUSH && c.nsid == NSID_ALL {
        let all = nss.all();
        let Some((first, rest)) = all.split_first() else {
            return Plan::Done(Status::SUCCESS);
        };
        let mut io = Io::new(NsRef::Own(first.clone()), IoKind::Flush, 0, 0);
        io.then = Then::of(rest.iter().map(|ns| flush(ns)).collect());
        return Plan::Run(io);
    }
    let Some(ns) = nss.get(c.nsid) else {
        return Plan::Done(Status::INVALID_NAMESPACE);
    };
    let bs = ns.block_size as u64;
    // NLB is 0's based and 16 bits wide, so the length cannot overflow; the start can.
    let len = c.nlb() as u64 * bs;
    let offset = c.slba().checked_mul(bs);
    match c.opcode {
        io_opcode::READ | io_opcode::WRITE => {
            let Some(offset) = offset else {
                return Plan::Done(Status::LBA_OUT_OF_RANGE);
            };
            if len > limits::MAX_TRANSFER as u64 {
                // Beyond MDTS (NVMe Base 2.0 Figure 275).
                return Plan::Done(Status::INVALID_FIELD);
            }
            if c.opcode == io_opcode::READ {
                return Plan::Read(Io::new(ns, IoKind::Read, offset, len));
            }
            let fua = c.fua();
            let mut io = Io::new(ns, IoKind::Write, offset, len);
            if fua {
                // Force Unit Access: the data is durable before the command completes, so a
                // Flush of the volume runs after the write.
                io.then = Then::of(vec![flush(&io.ns)]);
            }
            Plan::Write(io)
        }
        io_opcode::WRITE_ZEROES => match offset {
            Some(offset) => Plan::Run(Io::new(ns, IoKind::WriteZeroes, offset, len)),
            None => Plan::Done(Status::LBA_OUT_OF_RANGE),
        },
        io_opcode::FLUSH => Plan::Run(Io::new(ns, IoKind::Flush, 0, 0)),
        io_opcode::DATASET_MANAGEMENT => Plan::Ranges(ns, DatasetManagement::from_command(c)),
        _ => Plan::Done(Status::INVALID_OPCODE),
    }
}

/// Dataset Management once its range list (`data`) is here (NVM Command Set 1.0 §3.2.3):
/// only Attribute – Deallocate acts, one Discard per non-empty range; the other attributes
/// are hints nacre may ignore. Gives [`Plan::Done`] or [`Plan::Run`].
pub fn deallocate<'a>(ns: NsRef<'a>, d: &DatasetManagement, data: &[u8]) -> Plan<'a> {
    let Some(ranges) = d.ranges(data) else {
        return Plan::Done(Status::DATA_SGL_LENGTH_INVALID);
    };
    if !d.deallocate {
        return Plan::Done(Status::SUCCESS);
    }
    let bs = ns.block_size as u64;
    let mut discards = Vec::new();
    for r in ranges.filter(|r| r.nlb != 0) {
        let (Some(off), Some(len)) = (r.slba.checked_mul(bs), (r.nlb as u64).checked_mul(bs))
        else {
            return Plan::Done(Status::LBA_OUT_OF_RANGE);
        };
        discards.push((off, len));
    }
    let Some((&(off, len), rest)) = discards.split_first() else {
        return Plan::Done(Status::SUCCESS);
    };
    let mut io = Io::new(ns, IoKind::Discard, off, len);
    io.then = Then::of(
        rest.iter()
            .map(|&(o, l)| {
                let dev = io.ns.volume.clone();
                (dev, IoRequest::new(IoKind::Discard, o, l, 0))
            })
            .collect(),
    );
    Plan::Run(io)
}

/// The status a command completes with, from the result of its last request.
pub fn status(result: &IoResult, read: bool) -> Status {
    match result {
        Ok(()) => Status::SUCCESS,
        Err(e) => io_status(e, read),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume::null::NullVolume;
    use crate::volume::qos::VolumePath;
    use nacre_shared::nvme::dsm::{Range, RANGE_LEN};

    fn table(blocks: u64) -> BTreeMap<u32, Arc<Namespace>> {
        let mut t = BTreeMap::new();
        for nsid in [1, 2] {
            let volume: Arc<dyn BlockDevice> = Arc::new(NullVolume::new(blocks * 512, 512));
            let ns = Namespace {
                nsid,
                name: format!("v{nsid}"),
                path: VolumePath::new(volume.clone()),
                volume,
                nguid: [nsid as u8; 16],
                block_size: 512,
            };
            t.insert(nsid, Arc::new(ns));
        }
        t
    }

    fn cmd(opcode: u8, nsid: u32, slba: u64, nlb0: u16) -> Command {
        let mut c = Command {
            opcode,
            nsid,
            ..Default::default()
        };
        c.cdw10 = slba as u32;
        c.cdw11 = (slba >> 32) as u32;
        c.cdw12 = nlb0 as u32;
        c
    }

    fn steps(mut t: Then) -> Vec<(IoKind, u64, u64)> {
        let mut out = Vec::new();
        while let Some((_, r)) = t.next(true) {
            out.push((r.kind, r.offset, r.len));
        }
        out
    }

    fn done(p: Plan) -> Status {
        match p {
            Plan::Done(s) => s,
            _ => panic!("expected a status"),
        }
    }

    #[test]
    fn reads_and_writes_become_one_request_and_fua_adds_a_flush() {
        let t = table(1024);
        let Plan::Read(io) = plan(&cmd(io_opcode::READ, 1, 8, 7), &t) else {
            panic!("read");
        };
        assert_eq!((io.kind, io.offset, io.len), (IoKind::Read, 4096, 4096));
        assert!(io.then.is_empty() && io.is_read());
        let mut w = cmd(io_opcode::WRITE, 2, 1, 0);
        let Plan::Write(io) = plan(&w, &t) else {
            panic!("write");
        };
        assert!(io.then.is_empty() && io.ns.nsid == 2);
        w.cdw12 |= 1 << 30; // FUA
        let Plan::Write(mut io) = plan(&w, &t) else {
            panic!("write");
        };
        let req = io.request(7);
        assert_eq!(
            (req.kind, req.offset, req.len, req.tag),
            (IoKind::Write, 512, 512, 7)
        );
        let (_, flush) = io.then.next(true).expect("FUA's flush");
        assert_eq!((flush.kind, flush.tag), (IoKind::Flush, 7));
        assert!(io.then.next(true).is_none());
    }

    #[test]
    fn bad_commands_complete_with_their_status() {
        let t = table(16);
        assert_eq!(
            done(plan(&cmd(io_opcode::READ, 3, 0, 0), &t)),
            Status::INVALID_NAMESPACE
        );
        assert_eq!(done(plan(&cmd(0x7F, 1, 0, 0), &t)), Status::INVALID_OPCODE);
        let over = (limits::MAX_TRANSFER / 512) as u16; // one block past MDTS (0's based)
        assert_eq!(
            done(plan(&cmd(io_opcode::READ, 1, 0, over), &t)),
            Status::INVALID_FIELD
        );
        let far = cmd(io_opcode::WRITE, 1, u64::MAX / 4, 0);
        assert_eq!(done(plan(&far, &t)), Status::LBA_OUT_OF_RANGE);
        let mut fused = cmd(io_opcode::READ, 1, 0, 0);
        fused.flags |= 1;
        assert_eq!(done(plan(&fused, &t)), Status::INVALID_FIELD);
    }

    #[test]
    fn a_broadcast_flush_flushes_every_namespace_one_after_the_other() {
        let t = table(16);
        let Plan::Run(io) = plan(&cmd(io_opcode::FLUSH, NSID_ALL, 0, 0), &t) else {
            panic!("flush");
        };
        assert_eq!(io.kind, IoKind::Flush);
        assert_eq!(steps(io.then), vec![(IoKind::Flush, 0, 0)]);
        let empty = BTreeMap::new();
        let all = cmd(io_opcode::FLUSH, NSID_ALL, 0, 0);
        assert_eq!(done(plan(&all, &empty)), Status::SUCCESS);
    }

    #[test]
    fn deallocate_discards_each_nonempty_range_in_order() {
        let t = table(1 << 20);
        let mut c = cmd(io_opcode::DATASET_MANAGEMENT, 1, 0, 0);
        c.cdw10 = 2; // three ranges
        c.cdw11 = 1 << 2; // Deallocate
        let Plan::Ranges(ns, d) = plan(&c, &t) else {
            panic!("ranges");
        };
        let mut data = Vec::new();
        for (slba, nlb) in [(8u64, 8u32), (100, 0), (1000, 1)] {
            data.extend_from_slice(
                &Range {
                    attributes: 0,
                    nlb,
                    slba,
                }
                .encode(),
            );
        }
        assert_eq!(data.len(), 3 * RANGE_LEN);
        let Plan::Run(io) = deallocate(NsRef::Table(&ns), &d, &data) else {
            panic!("discards");
        };
        assert_eq!((io.kind, io.offset, io.len), (IoKind::Discard, 4096, 4096));
        assert_eq!(steps(io.then), vec![(IoKind::Discard, 512_000, 512)]);
        // A short list, and a list without Deallocate.
        let short = deallocate(NsRef::Table(&ns), &d, &data[..RANGE_LEN]);
        assert_eq!(done(short), Status::DATA_SGL_LENGTH_INVALID);
        let hint = DatasetManagement {
            deallocate: false,
            ..d
        };
        assert_eq!(done(deallocate(ns, &hint, &data)), Status::SUCCESS);
    }

    #[test]
    fn a_failed_step_drops_the_rest() {
        let t = table(1 << 20);
        let mut c = cmd(io_opcode::DATASET_MANAGEMENT, 1, 0, 0);
        c.cdw10 = 2;
        c.cdw11 = 1 << 2;
        let Plan::Ranges(ns, d) = plan(&c, &t) else {
            panic!("ranges");
        };
        let data: Vec<u8> = (0..3u64)
            .flat_map(|i| {
                Range {
                    attributes: 0,
                    nlb: 1,
                    slba: i,
                }
                .encode()
            })
            .collect();
        let Plan::Run(mut io) = deallocate(ns, &d, &data) else {
            panic!("discards");
        };
        assert!(io.then.next(false).is_none());
        assert!(io.then.is_empty());
    }
}
