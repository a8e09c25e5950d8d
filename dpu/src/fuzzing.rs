//! Entry points for coverage-guided fuzzing (the cargo-fuzz crate in `fuzz/`) and for the
//! corpus replay test (`tests/fuzz_corpus.rs`), which runs every committed corpus file
//! through the same functions on stable Rust.
//!
//! Each entry point takes the raw bytes of one input, drives the real code with them the
//! way a peer would (a guest's descriptor chains, a host's or a controller's NVMe/TCP byte
//! stream, an RPC client's bytes), and panics when an invariant breaks. A panic anywhere
//! inside — even one the code under test catches, like the NVMe/TCP target's per-connection
//! `catch_unwind` — is a finding: libFuzzer's panic hook aborts on it, and the replay test
//! counts panics.
//!
//! Input formats are documented on each function; [`seed`] builds well-formed inputs for
//! the seed generator (`tests/src/bin/fuzz-seeds.rs`).
//!
//! Not part of nacre's API: it exists for the fuzzers and may change with them.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{FromRawFd, IntoRawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use nacre_shared::nvme::command::PSDT_SGL;
use nacre_shared::nvme::fabrics::{self, Connect, ConnectData, Property};
use nacre_shared::nvme::{registers, Command, Completion as Cqe, SglDescriptor, Status};
use nacre_shared::nvme_tcp::{self as tcp, pdu_type, CommonHeader, Digests, IcReq, IcResp};
use serde_json::Value;

use crate::control::{Daemon, DaemonConfig};
use crate::fabric::cmd::{AdminWait, Cmd, Dir, IoData, IoParent, Target};
use crate::fabric::tcp::{QueueConn, QueueOwner, QueueParams};
use crate::frontend::nvmf_tcp::NvmfTarget;
use crate::frontend::vhost_user_blk::queue::{serial_bytes, QueueWorker};
use crate::frontend::vhost_user_blk::request::DeviceParams;
use crate::volume::ram::RamVolume;
use crate::volume::{BlockDevice, IoCompletion, IoResult, Segment, Segments};

/// The subsystem the NVMe/TCP targets serve.
pub const NQN: &str = "nqn.2024-01.io.nacre:fuzz";
/// The host NQN the harnesses connect with.
pub const HOSTNQN: &str = "nqn.2024-01.io.nacre:fuzz-host";
/// The namespace behind [`NQN`]: small, so reads stay small.
pub const NS_BYTES: u64 = 64 << 10;
/// Its logical block size.
pub const NS_LBA: u32 = 512;

// ---------------------------------------------------------------------------------------
// virtqueue: descriptor chains through the vhost-user-blk queue worker
// ---------------------------------------------------------------------------------------

/// Queue size of the virtqueue target (a power of two).
pub const VQ_SIZE: u16 = 16;
/// Guest memory: two regions with a hole between them, so chains can straddle a hole.
pub const VQ_REGIONS: [(u64, usize); 2] = [(0, 0x1_0000), (0x2_0000, 0x8000)];
/// Where the rings lie (inside region 0, aligned as §2.7 requires).
pub const VQ_DESC: u64 = 0x0;
pub const VQ_AVAIL: u64 = 0x100;
pub const VQ_USED: u64 = 0x200;
/// Where the input's free-form bytes (headers, data, indirect tables) are copied.
pub const VQ_DATA: u64 = 0x1000;
/// Size of the volume behind the queue.
pub const VQ_VOLUME: u64 = 64 << 10;

/// One batch of descriptor chains through [`QueueWorker`] against a RAM volume.
///
/// Input: `flags` (bit 0 read-only device, bit 1 VIRTIO_F_EVENT_IDX, bits 4..8 `seg_max - 1`),
/// `avail_idx` (one byte), the avail ring's [`VQ_SIZE`] entries (le16 each), the descriptor
/// table ([`VQ_SIZE`] × 16 bytes, §2.7.5 layout), then bytes copied into guest memory at
/// [`VQ_DATA`] (request headers, data, status bytes, indirect tables). Short inputs are
/// zero-padded.
///
/// Checks: no panic; every available chain whose head is inside the queue is returned in
/// the used ring exactly once (completed, failed or dropped), and none stays in flight.
pub fn virtqueue(data: &[u8]) {
    use virtio_queue::{Queue, QueueT};
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    let fixed = 2 + 2 * VQ_SIZE as usize + 16 * VQ_SIZE as usize;
    let mut head = vec![0u8; fixed];
    let n = data.len().min(fixed);
    head[..n].copy_from_slice(&data[..n]);
    let rest = data.get(fixed..).unwrap_or(&[]);
    let flags = head[0];
    let avail_idx = u16::from(head[1]);
    let ring = &head[2..2 + 2 * VQ_SIZE as usize];
    let table = &head[2 + 2 * VQ_SIZE as usize..];

    let ranges: Vec<(GuestAddress, usize)> = VQ_REGIONS
        .iter()
        .map(|&(a, l)| (GuestAddress(a), l))
        .collect();
    let mem = Arc::new(GuestMemoryMmap::<()>::from_ranges(&ranges).expect("guest memory"));
    mem.write_slice(table, GuestAddress(VQ_DESC)).unwrap();
    mem.write_slice(ring, GuestAddress(VQ_AVAIL + 4)).unwrap();
    mem.write_obj(avail_idx.to_le(), GuestAddress(VQ_AVAIL + 2))
        .unwrap();
    let room = VQ_REGIONS[0].1 - VQ_DATA as usize;
    mem.write_slice(&rest[..rest.len().min(room)], GuestAddress(VQ_DATA))
        .unwrap();

    let mut queue = Queue::new(VQ_SIZE).expect("queue");
    queue.set_size(VQ_SIZE);
    queue.set_desc_table_address(Some(VQ_DESC as u32), Some(0));
    queue.set_avail_ring_address(Some(VQ_AVAIL as u32), Some(0));
    queue.set_used_ring_address(Some(VQ_USED as u32), Some(0));
    queue.set_event_idx(flags & 2 != 0);
    queue.set_ready(true);

    let vol: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(VQ_VOLUME, 512).expect("ram volume"));
    let params = Arc::new(DeviceParams {
        read_only: flags & 1 != 0,
        seg_max: u32::from(flags >> 4) + 1,
        serial: serial_bytes("nacre-fuzz").expect("serial"),
    });
    let mut worker = QueueWorker::new(vol, params, VQ_SIZE).expect("queue worker");
    worker.run(&mut queue, &mem);
    // A second kick with nothing new must change nothing.
    worker.run(&mut queue, &mem);

    assert_eq!(worker.in_flight(), 0, "a RAM volume completes inline");
    // A chain's device-writable buffers may lie over the avail ring itself (guest memory is
    // the guest's): the count below holds only when the ring still reads as written.
    let mut avail_now = vec![0u8; 2 + 2 * VQ_SIZE as usize];
    mem.read_slice(&mut avail_now, GuestAddress(VQ_AVAIL + 2))
        .unwrap();
    if avail_now[..2] != avail_idx.to_le_bytes() || avail_now[2..] != *ring {
        return;
    }
    let mut expect = 0u16;
    if avail_idx <= VQ_SIZE {
        for i in 0..avail_idx as usize {
            let h = u16::from_le_bytes([ring[2 * i], ring[2 * i + 1]]);
            if h < VQ_SIZE {
                expect += 1;
            }
        }
    }
    let used: u16 = u16::from_le(mem.read_obj(GuestAddress(VQ_USED + 2)).unwrap());
    assert_eq!(
        used, expect,
        "every chain with a head inside the queue is used exactly once"
    );
    assert_eq!(queue.next_used(), used);
}

// ---------------------------------------------------------------------------------------
// NVMe/TCP target: what a host sends
// ---------------------------------------------------------------------------------------

struct TargetFixture {
    target: Arc<NvmfTarget>,
    listener: SocketAddr,
    vol: Arc<RamVolume>,
}

fn target_fixture() -> &'static TargetFixture {
    static T: OnceLock<TargetFixture> = OnceLock::new();
    T.get_or_init(|| {
        ignore_sigpipe();
        let target = NvmfTarget::new();
        target
            .create_subsystem(NQN, "FUZZ0001", "nacre-fuzz", true)
            .expect("subsystem");
        let vol = Arc::new(RamVolume::new(NS_BYTES, NS_LBA).expect("ram volume"));
        target
            .add_namespace(NQN, None, vol.clone(), [7; 16], "fuzz".into())
            .expect("namespace");
        // The subsystem must be reachable on the listener a connection came through.
        let listener = target
            .add_listener(NQN, "127.0.0.1:0".parse().expect("addr"))
            .expect("listener");
        TargetFixture {
            target,
            listener,
            vol,
        }
    })
}

/// The fuzz processes are not Rust binaries (libFuzzer owns `main`), so nothing set SIGPIPE
/// to ignored: a write to a closed socket would kill the process instead of failing.
fn ignore_sigpipe() {
    // SAFETY: setting a signal disposition to SIG_IGN has no memory-safety preconditions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
}

/// A connected pair: `(host end, target end as the TcpStream the target serves)`.
fn stream_pair() -> (UnixStream, TcpStream) {
    let (host, target) = UnixStream::pair().expect("socketpair");
    // SAFETY: `into_raw_fd` hands over sole ownership of a valid socket descriptor. The
    // target only uses socket calls that work on any stream socket (read, write, shutdown,
    // timeouts); the address queries fail on a Unix socket, which it tolerates.
    let target = unsafe { TcpStream::from_raw_fd(target.into_raw_fd()) };
    (host, target)
}

/// Threads the harnesses hand the peer's side of a connection to, kept from one input to
/// the next. Spawning them afresh for every input cost more than the code under test
/// (three threads an input: `clone`, stack mapping, scheduler wake-up and exit), which held
/// the socket harnesses to about 2,000 executions a second.
mod helper {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::mpsc;
    use std::sync::Mutex;

    /// Work for a helper: runs the job and returns how to hand its result over. The helper
    /// files itself as idle between the two steps, so a caller that starts the next job as
    /// soon as it has the result finds it idle instead of spawning another.
    type Job = Box<dyn FnOnce() -> Box<dyn FnOnce() + Send> + Send>;

    /// Helpers waiting for work: each is the sending end of its job channel.
    static IDLE: Mutex<Vec<mpsc::Sender<Job>>> = Mutex::new(Vec::new());

    /// The result of a job handed to a helper, like [`std::thread::JoinHandle`].
    pub struct Handle<T>(mpsc::Receiver<std::thread::Result<T>>);

    impl<T> Handle<T> {
        /// Wait for the job; `Err` carries its panic, as a thread's join would.
        pub fn join(self) -> std::thread::Result<T> {
            self.0
                .recv()
                .unwrap_or_else(|_| Err(Box::new("fuzz helper thread vanished")))
        }
    }

    /// Run `f` on an idle helper (a new one when none is idle).
    pub fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Handle<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move || {
            let r = catch_unwind(AssertUnwindSafe(f));
            Box::new(move || {
                let _ = tx.send(r);
            })
        });
        let idle = IDLE.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match idle {
            Some(h) => {
                if let Err(mpsc::SendError(job)) = h.send(job) {
                    spawn(job);
                }
            }
            None => spawn(job),
        }
        Handle(rx)
    }

    fn spawn(first: Job) {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::spawn(move || {
            let mut job = first;
            loop {
                let deliver = job();
                IDLE.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(tx.clone());
                deliver();
                match rx.recv() {
                    Ok(j) => job = j,
                    Err(_) => return,
                }
            }
        });
    }
}

/// Send `input` from a helper thread (so neither side blocks on a full socket buffer) and
/// collect what comes back until the target closes.
fn feed(mut host: UnixStream, input: Vec<u8>, close: bool) -> helper::Handle<Vec<u8>> {
    helper::run(move || {
        let _ = host.write_all(&input);
        if close {
            let _ = host.shutdown(Shutdown::Write);
        }
        let mut out = Vec::new();
        let _ = host.read_to_end(&mut out);
        out
    })
}

/// Check that `out` is a sequence of well-framed controller-to-host PDUs (ICResp first).
fn check_c2h_stream(out: &[u8], digests: Option<Digests>) {
    let mut at = 0;
    let mut first = true;
    while at < out.len() {
        assert!(
            out.len() - at >= tcp::CH_LEN,
            "target sent a truncated PDU header"
        );
        let ch = CommonHeader::decode(&out[at..]);
        let plen = ch.plen as usize;
        let expected = tcp::expected_hlen(ch.pdu_type);
        assert!(
            matches!(
                ch.pdu_type,
                pdu_type::IC_RESP
                    | pdu_type::C2H_TERM_REQ
                    | pdu_type::CAPSULE_RESP
                    | pdu_type::C2H_DATA
                    | pdu_type::R2T
            ),
            "target sent PDU type {:#x}",
            ch.pdu_type
        );
        if first {
            assert!(
                matches!(ch.pdu_type, pdu_type::IC_RESP | pdu_type::C2H_TERM_REQ),
                "the target's first PDU is ICResp or C2HTermReq, not {:#x}",
                ch.pdu_type
            );
        } else {
            assert_ne!(ch.pdu_type, pdu_type::IC_RESP, "ICResp comes once, first");
        }
        assert_eq!(
            Some(ch.hlen as usize),
            expected,
            "HLEN of {:#x}",
            ch.pdu_type
        );
        assert!(plen >= ch.hlen as usize, "PLEN below HLEN");
        assert!(out.len() - at >= plen, "target sent a truncated PDU");
        if let (Some(dg), false) = (digests, first) {
            if ch.pdu_type != pdu_type::C2H_TERM_REQ {
                assert_eq!(ch.flags & tcp::flags::HDGSTF != 0, dg.header);
            }
        }
        first = false;
        at += plen;
    }
}

/// A raw host byte stream into one NVMe/TCP target connection, as if accepted from the
/// network: ICReq, capsules, H2CData, garbage, in any order. The target serves the
/// subsystem [`NQN`] (any host allowed) with one [`NS_BYTES`] RAM namespace.
///
/// Checks: no panic (a caught one too), the connection ends when the host closes, and
/// what the target sent back is a sequence of well-framed controller-to-host PDUs.
pub fn nvmf_target(data: &[u8]) {
    let f = target_fixture();
    let (host, tgt) = stream_pair();
    let feeder = feed(host, data.to_vec(), true);
    f.target.serve_stream(tgt, f.listener);
    let out = feeder.join().expect("feeder");
    let digests = (data.len() >= tcp::IC_LEN && data[0] == pdu_type::IC_REQ)
        .then(|| IcReq::decode(&data[..tcp::IC_LEN]).digests);
    check_c2h_stream(&out, digests);
}

// ---------------------------------------------------------------------------------------
// NVMe admin and I/O commands on connected queues
// ---------------------------------------------------------------------------------------

/// I/O opcodes that change data (NVM Command Set 1.0 and the ZNS set's Zone Append).
pub const IO_WRITES: [u8; 6] = [0x01, 0x04, 0x08, 0x09, 0x19, 0x7d];
/// Admin opcodes that change data or namespaces (Base 2.0 §5).
pub const ADMIN_WRITES: [u8; 4] = [0x0d, 0x15, 0x80, 0x84];

/// One command record of [`nvme_commands`] input.
#[derive(Debug, Clone)]
pub struct CmdRecord {
    /// Send on the I/O queue (else the admin queue).
    pub io: bool,
    /// Replace the SGL by an in-capsule descriptor over `data` (and set PSDT to SGL).
    pub fix_sgl: bool,
    pub sqe: [u8; 64],
    pub data: Vec<u8>,
}

/// Parse [`nvme_commands`] input: records of `kind` (bit 0 I/O queue, bit 1 fix the SGL),
/// the 64-byte SQE, le16 data length, data (cut at the end of the input).
pub fn parse_cmd_records(data: &[u8]) -> Vec<CmdRecord> {
    let mut v = Vec::new();
    let mut at = 0;
    while data.len() - at > 64 {
        let kind = data[at];
        let mut sqe = [0u8; 64];
        sqe.copy_from_slice(&data[at + 1..at + 65]);
        at += 65;
        let mut len = 0usize;
        if data.len() - at >= 2 {
            len = usize::from(u16::from_le_bytes([data[at], data[at + 1]]));
            at += 2;
        }
        let len = len.min(data.len() - at);
        v.push(CmdRecord {
            io: kind & 1 != 0,
            fix_sgl: kind & 2 != 0,
            sqe,
            data: data[at..at + len].to_vec(),
        });
        at += len;
    }
    v
}

fn capsule_of(r: &CmdRecord, cid: u16, out: &mut Vec<u8>) {
    let mut cmd = Command::decode(&r.sqe);
    cmd.cid = cid;
    if r.fix_sgl {
        cmd.flags = (cmd.flags & !0xC0) | PSDT_SGL;
        cmd.sgl = SglDescriptor::in_capsule(r.data.len() as u32);
    }
    tcp::encode_capsule_cmd(out, &cmd, &r.data, Digests::NONE, 0);
}

fn connect_capsule(qid: u16, cntlid: u16, out: &mut Vec<u8>) {
    let sqe = Connect {
        recfmt: 0,
        qid,
        sqsize: 31,
        cattr: 0,
        kato: 0,
    }
    .to_command(0xC000 | qid);
    let data = ConnectData {
        hostid: [0x42; 16],
        cntlid,
        subnqn: NQN.into(),
        hostnqn: HOSTNQN.into(),
    }
    .encode();
    tcp::encode_capsule_cmd(out, &sqe, &data, Digests::NONE, 0);
}

fn icreq(digests: Digests, out: &mut Vec<u8>) {
    IcReq {
        pfv: 0,
        hpda: 0,
        digests,
        maxr2t: 0,
    }
    .encode(out);
}

/// Read one PDU from `s` (no digests).
fn read_pdu(s: &mut UnixStream) -> Option<Vec<u8>> {
    let mut b = vec![0u8; tcp::CH_LEN];
    s.read_exact(&mut b).ok()?;
    let plen = CommonHeader::decode(&b).plen as usize;
    if !(tcp::CH_LEN..=1 << 20).contains(&plen) {
        return None;
    }
    b.resize(plen, 0);
    s.read_exact(&mut b[tcp::CH_LEN..]).ok()?;
    Some(b)
}

fn namespace_bytes(v: &RamVolume) -> Vec<u8> {
    let mut b = vec![0u8; NS_BYTES as usize];
    v.read_at(0, &mut b).expect("read namespace");
    b
}

/// NVMe admin and I/O commands on a connected, enabled controller: the harness opens an
/// admin queue (ICReq, Connect, Property Set CC.EN=1) and an I/O queue (Connect qid 1),
/// then sends each record of the input (see [`parse_cmd_records`]) as a command capsule on
/// its queue — the I/O commands first, then the admin commands — and closes.
///
/// Checks: no panic; replies are well-framed; and when no record carries a data-changing
/// opcode ([`IO_WRITES`], [`ADMIN_WRITES`]) not one byte of the namespace changed.
pub fn nvme_commands(data: &[u8]) {
    let f = target_fixture();
    let recs = parse_cmd_records(data);
    static PATTERN: OnceLock<Vec<u8>> = OnceLock::new();
    let pattern =
        PATTERN.get_or_init(|| (0..NS_BYTES as usize).map(|i| (i * 7 + 3) as u8).collect());
    f.vol.write_at(0, pattern).expect("reset namespace");

    // Admin queue, served on its own thread for as long as the I/O queue needs it.
    let (mut admin, admin_tgt) = stream_pair();
    let target = f.target.clone();
    let listener = f.listener;
    let admin_thread = helper::run(move || target.serve_stream(admin_tgt, listener));
    let mut setup = Vec::new();
    icreq(Digests::NONE, &mut setup);
    connect_capsule(0, fabrics::CNTLID_DYNAMIC, &mut setup);
    let cc = 1 | (6 << 16) | (4 << 20);
    let set = Property::set_command(0xC100, registers::CC, false, cc);
    tcp::encode_capsule_cmd(&mut setup, &set, &[], Digests::NONE, 0);
    admin.write_all(&setup).expect("admin setup");
    let mut admin_out = Vec::new();
    let mut cntlid = None;
    for _ in 0..3 {
        let Some(p) = read_pdu(&mut admin) else { break };
        if p[0] == pdu_type::CAPSULE_RESP && cntlid.is_none() {
            let cqe = Cqe::decode(&p[tcp::CH_LEN..]);
            assert!(cqe.status().is_success(), "admin Connect failed");
            cntlid = Some(cqe.dw0 as u16);
        }
        admin_out.extend_from_slice(&p);
    }
    let cntlid = cntlid.expect("admin Connect answered");

    // I/O queue, served on this thread.
    let (io, io_tgt) = stream_pair();
    let mut io_in = Vec::new();
    icreq(Digests::NONE, &mut io_in);
    connect_capsule(1, cntlid, &mut io_in);
    for (i, r) in recs.iter().enumerate().filter(|(_, r)| r.io) {
        capsule_of(r, i as u16, &mut io_in);
    }
    let feeder = feed(io, io_in, true);
    f.target.serve_stream(io_tgt, f.listener);
    let io_out = feeder.join().expect("io feeder");
    check_c2h_stream(&io_out, Some(Digests::NONE));

    let mut admin_in = Vec::new();
    for (i, r) in recs.iter().enumerate().filter(|(_, r)| !r.io) {
        capsule_of(r, i as u16, &mut admin_in);
    }
    let rest = feed(admin, admin_in, true).join().expect("admin feeder");
    admin_thread.join().expect("admin queue thread");
    admin_out.extend_from_slice(&rest);
    check_c2h_stream(&admin_out, Some(Digests::NONE));

    let writes = recs.iter().any(|r| {
        let banned: &[u8] = if r.io { &IO_WRITES } else { &ADMIN_WRITES };
        banned.contains(&r.sqe[0])
    });
    if !writes {
        assert!(
            namespace_bytes(&f.vol) == *pattern,
            "the namespace changed although no command asked for a write"
        );
    }
}

// ---------------------------------------------------------------------------------------
// NVMe/TCP initiator: what a controller sends
// ---------------------------------------------------------------------------------------

struct NoOwner;

impl QueueOwner for NoOwner {
    fn queue_closed(&self, _: u64, _: u16, _: String, cmds: Vec<Cmd>) {
        cmds.into_iter()
            .for_each(|c| c.fail(crate::volume::IoError::PathLost));
    }
}

/// The buffer an I/O read lands in, with guard bytes either side; owned by the request's
/// completion so it lives as long as the command can touch it.
struct ReadBuf {
    buf: Mutex<Vec<u8>>,
    completions: AtomicUsize,
}

/// Guard bytes either side of [`ReadBuf`]'s data.
const GUARD: usize = 64;
/// Bytes of the initiator target's I/O read.
pub const INIT_READ: usize = 8192;

impl IoCompletion for ReadBuf {
    fn complete(&self, _tag: u64, _result: IoResult) {
        let n = self.completions.fetch_add(1, Ordering::SeqCst);
        assert_eq!(n, 0, "an I/O request completed twice");
    }
}

impl Drop for ReadBuf {
    fn drop(&mut self) {
        let b = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        let guards_intact = b[..GUARD].iter().all(|&x| x == 0xEE)
            && b[GUARD + INIT_READ..].iter().all(|&x| x == 0xEE);
        assert!(guards_intact, "C2HData landed outside the read's buffer");
    }
}

fn init_listener() -> &'static TcpListener {
    static L: OnceLock<TcpListener> = OnceLock::new();
    L.get_or_init(|| {
        ignore_sigpipe();
        TcpListener::bind("127.0.0.1:0").expect("bind loopback")
    })
}

/// Options byte of [`nvmf_initiator`] input.
pub mod init_flags {
    pub const HEADER_DIGEST: u8 = 1;
    pub const DATA_DIGEST: u8 = 2;
    /// The next 128 bytes are the ICResp (else the harness sends a valid one).
    pub const RAW_ICRESP: u8 = 4;
    /// Open I/O queue 1 (else the admin queue).
    pub const IO_QUEUE: u8 = 8;
}

/// The commands [`nvmf_initiator`] has outstanding when the fuzzed bytes arrive, in slot
/// order, and the CIDs they carry: an admin-style read of 4096 bytes (slot 0, its second
/// use after Connect), an admin-style write of 12288 bytes (slot 1: beyond the in-capsule
/// limit, so it waits for R2T) and an I/O read of [`INIT_READ`] bytes into two segments
/// (slot 2). CID = slot | generation << 10.
pub const INIT_CIDS: [u16; 3] = [2 << 10, 1 << 10 | 1, 1 << 10 | 2];
/// CNTLID the harness's Connect response reports.
pub const INIT_CNTLID: u16 = 1;

/// The controller side of one initiator queue (NVMe-oF/TCP host in `fabric/tcp.rs`): the
/// harness accepts the queue's TCP connection, answers ICReq (with the input's ICResp when
/// asked) and Connect, waits until the initiator has [`INIT_CIDS`] outstanding, then sends
/// the rest of the input as the controller's byte stream and closes.
///
/// Input: one options byte ([`init_flags`]), the raw ICResp if asked, then the stream.
///
/// Checks: no panic on the reader thread, no request completed twice, and no data written
/// outside the read's buffer.
pub fn nvmf_initiator(data: &[u8]) {
    let Some((&opts, mut rest)) = data.split_first() else {
        return;
    };
    let raw_icresp = if opts & init_flags::RAW_ICRESP != 0 {
        if rest.len() < tcp::IC_LEN {
            return;
        }
        let (ic, r) = rest.split_at(tcp::IC_LEN);
        rest = r;
        Some(ic.to_vec())
    } else {
        None
    };
    let digests = Digests {
        header: opts & init_flags::HEADER_DIGEST != 0,
        data: opts & init_flags::DATA_DIGEST != 0,
    };
    let qid = u16::from(opts & init_flags::IO_QUEUE != 0);
    let stream = rest.to_vec();
    let l = init_listener();
    let addr = l.local_addr().expect("listener address");
    let (go_tx, go_rx) = std::sync::mpsc::channel::<bool>();

    let peer = helper::run(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
        let mut ic = [0u8; tcp::IC_LEN];
        if s.read_exact(&mut ic).is_err() {
            return;
        }
        let resp = raw_icresp.unwrap_or_else(|| {
            let mut v = Vec::new();
            IcResp {
                pfv: 0,
                cpda: 0,
                digests: IcReq::decode(&ic).digests,
                maxh2cdata: 8192,
            }
            .encode(&mut v);
            v
        });
        if s.write_all(&resp).is_err() {
            return;
        }
        // The Connect capsule: answer it with success and a CNTLID.
        let mut ch = [0u8; tcp::CH_LEN];
        if s.read_exact(&mut ch).is_err() {
            return;
        }
        let plen = CommonHeader::decode(&ch).plen as usize;
        let mut rest = vec![0u8; plen.saturating_sub(tcp::CH_LEN)];
        if plen > 1 << 16 || s.read_exact(&mut rest).is_err() || rest.len() < 4 {
            return;
        }
        let cid = u16::from_le_bytes([rest[2], rest[3]]);
        let mut cqe = Cqe::new(cid, Status::SUCCESS);
        cqe.dw0 = u32::from(INIT_CNTLID);
        let mut r = Vec::new();
        tcp::encode_capsule_resp(&mut r, &cqe, digests);
        if s.write_all(&r).is_err() {
            return;
        }
        if !go_rx.recv().unwrap_or(false) {
            return;
        }
        let _ = s.write_all(&stream);
        let _ = s.shutdown(Shutdown::Write);
        // Until the initiator closes, or tells us it gave up (H2CTermReq); its H2CData and
        // capsules are read and dropped.
        loop {
            let mut ch = [0u8; tcp::CH_LEN];
            if s.read_exact(&mut ch).is_err() {
                return;
            }
            let h = CommonHeader::decode(&ch);
            if h.pdu_type == pdu_type::H2C_TERM_REQ {
                return;
            }
            let n = (h.plen as usize).saturating_sub(tcp::CH_LEN);
            let mut skip = vec![0u8; n.min(1 << 21)];
            if n < tcp::CH_LEN || s.read_exact(&mut skip).is_err() {
                return;
            }
        }
    });

    let params = QueueParams {
        qid,
        depth: 4,
        digests,
        kato_ms: 0,
        icd_max: 4096,
        timeout: Duration::from_secs(5),
    };
    let connect = ConnectData {
        hostid: [0x42; 16],
        cntlid: if qid == 0 {
            fabrics::CNTLID_DYNAMIC
        } else {
            INIT_CNTLID
        },
        subnqn: NQN.into(),
        hostnqn: HOSTNQN.into(),
    };
    let owner: Weak<dyn QueueOwner> = Weak::<NoOwner>::new();
    let q = match QueueConn::open(addr, params, &connect, 1, owner) {
        Ok((q, _)) => q,
        Err(_) => {
            let _ = go_tx.send(false);
            peer.join().expect("peer");
            return;
        }
    };
    let read = AdminWait::with_buf(vec![0u8; 4096]);
    let write = AdminWait::with_buf(vec![0x5A; 12288]);
    let io_buf = Arc::new(ReadBuf {
        buf: Mutex::new(vec![0xEE; INIT_READ + 2 * GUARD]),
        completions: AtomicUsize::new(0),
    });
    let segs: Segments = {
        let mut b = io_buf.buf.lock().unwrap_or_else(|p| p.into_inner());
        let base = b.as_mut_ptr();
        // SAFETY: both halves lie inside the buffer's data part; the buffer is owned by
        // `io_buf`, which the request's parent holds (as its completion) until the last
        // reference to the command is gone, so it outlives every access; the harness does
        // not touch the data part while the command is outstanding.
        unsafe {
            [
                Segment::new(base.add(GUARD), INIT_READ / 2),
                Segment::new(base.add(GUARD + INIT_READ / 2), INIT_READ / 2),
            ]
            .into_iter()
            .collect()
        }
    };
    let done: Arc<dyn IoCompletion> = io_buf.clone();
    let mut read_sqe = Command::decode(&[0u8; 64]);
    read_sqe.opcode = 0x06;
    let mut write_sqe = Command::decode(&[0u8; 64]);
    write_sqe.opcode = 0x09;
    let mut io_sqe = Command::decode(&[0u8; 64]);
    io_sqe.opcode = 0x02;
    io_sqe.nsid = 1;
    io_sqe.cdw12 = (INIT_READ / NS_LBA as usize - 1) as u32;
    let cmds = [
        Cmd {
            sqe: read_sqe,
            dir: Dir::C2H,
            len: 4096,
            target: Target::Admin(read),
            release: true,
        },
        Cmd {
            sqe: write_sqe,
            dir: Dir::H2C,
            len: 12288,
            target: Target::Admin(write),
            release: true,
        },
        Cmd {
            sqe: io_sqe,
            dir: Dir::C2H,
            len: INIT_READ,
            target: Target::Io {
                parent: IoParent::new(segs, 7, done, 1),
                data: IoData::Segs { off: 0 },
            },
            release: true,
        },
    ];
    drop(io_buf);
    for c in cmds {
        if let Err(c) = q.submit(c) {
            c.fail(crate::volume::IoError::PathLost);
        }
    }
    let _ = go_tx.send(true);
    peer.join().expect("peer");
    // The reader fails what is still outstanding as it exits, on its own thread.
    q.shutdown();
}

// ---------------------------------------------------------------------------------------
// JSON-RPC: what a client sends to the control socket
// ---------------------------------------------------------------------------------------

/// Methods the RPC target does not dispatch: `remote_*` open connections to addresses
/// from the input (the harness must not reach out of the machine, and a connect timeout
/// would cost seconds per input), and the tenant methods that derive a key with Argon2
/// (a fraction of a second each, by design).
pub const RPC_SKIPPED: [&str; 7] = [
    "remote_attach",
    "remote_detach",
    "remote_discover",
    "tenant_create",
    "tenant_unlock",
    "tenant_rotate_kek",
    "tenant_policy_set",
];

struct RpcFixture {
    root: PathBuf,
    daemon: Option<Arc<Daemon>>,
    generation: u64,
}

impl RpcFixture {
    fn dirs(&self) -> (PathBuf, PathBuf) {
        let g = self.root.join(format!("g{}", self.generation));
        (g.join("state"), g.join("run"))
    }

    fn daemon(&mut self) -> Arc<Daemon> {
        if let Some(d) = &self.daemon {
            return d.clone();
        }
        let (state_dir, run_dir) = self.dirs();
        let (d, _) = Daemon::open(DaemonConfig { state_dir, run_dir }).expect("daemon");
        self.daemon = Some(d.clone());
        d
    }

    /// Start over with an empty scratch directory (after any call changed the state).
    fn reset(&mut self) {
        if let Some(d) = self.daemon.take() {
            d.shutdown();
        }
        let _ = std::fs::remove_dir_all(&self.root);
        let _ = std::fs::create_dir_all(&self.root);
        self.generation += 1;
    }
}

/// What RPC input writes for the scratch directory: the harness puts the real (per-process)
/// directory in its place, so corpus files work in any process.
pub const RPC_DIR: &str = "/nacre-fuzz/";

/// The scratch directory of this process's RPC target: daemons' state and every path the
/// input names live in it.
pub fn rpc_root() -> PathBuf {
    // tmpfs where there is one: state is written with fsync on every change.
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    base.join(format!("nacre-fuzz-rpc-{}", std::process::id()))
}

fn rpc_fixture() -> &'static Mutex<RpcFixture> {
    static F: OnceLock<Mutex<RpcFixture>> = OnceLock::new();
    F.get_or_init(|| {
        ignore_sigpipe();
        let root = rpc_root();
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("rpc fuzz root");
        Mutex::new(RpcFixture {
            root,
            daemon: None,
            generation: 0,
        })
    })
}

/// Whether every string in `v` is safe to hand the daemon: a path only inside `root`, an
/// address only on loopback, and no method from [`RPC_SKIPPED`].
fn rpc_input_allowed(v: &Value, root: &str) -> bool {
    match v {
        Value::String(s) => {
            if RPC_SKIPPED.contains(&s.as_str()) {
                return false;
            }
            let outside = !s.starts_with(root) || s.contains("..");
            if s.contains('/') && outside {
                return false;
            }
            if let Ok(a) = s.parse::<SocketAddr>() {
                return a.ip().is_loopback();
            }
            if let Ok(ip) = s.parse::<std::net::IpAddr>() {
                return ip.is_loopback();
            }
            true
        }
        Value::Array(a) => a.iter().all(|x| rpc_input_allowed(x, root)),
        Value::Object(o) => o.values().all(|x| rpc_input_allowed(x, root)),
        _ => true,
    }
}

/// Bytes a client writes to nacred's control socket: the real per-connection server loop
/// (request framing, parse errors, batches, dispatch to every method) against a control
/// plane on a scratch state directory.
///
/// [`RPC_DIR`] in the input stands for the scratch directory. Inputs that name another
/// path, a non-loopback address or one of [`RPC_SKIPPED`] are not run (the harness must
/// stay inside its sandbox, and fast).
///
/// Checks: no panic; every reply line is a JSON-RPC response object (or a batch of them)
/// with `jsonrpc: "2.0"` and exactly one of `result` and `error`; and the state the calls
/// left behind opens again (replay) without error.
pub fn json_rpc(data: &[u8]) {
    let mut fx = rpc_fixture().lock().unwrap_or_else(|p| p.into_inner());
    let root = format!("{}/", fx.root.to_string_lossy());
    let data = replace_all(data, RPC_DIR.as_bytes(), root.as_bytes());
    for v in serde_json::Deserializer::from_slice(&data).into_iter::<Value>() {
        match v {
            Ok(v) if !rpc_input_allowed(&v, &root) => return,
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let d = fx.daemon();
    let (client, server) = UnixStream::pair().expect("socketpair");
    let feeder = helper::run({
        let input = data.to_vec();
        move || {
            let mut c = client;
            let _ = c.write_all(&input);
            let _ = c.shutdown(Shutdown::Write);
            let mut out = Vec::new();
            let _ = c.read_to_end(&mut out);
            out
        }
    });
    crate::control::server::serve_stream(&d, server);
    let out = feeder.join().expect("rpc feeder");
    for line in out.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let v: Value = serde_json::from_slice(line).expect("a reply line is JSON");
        match &v {
            Value::Array(items) => items.iter().for_each(check_response),
            other => check_response(other),
        }
    }
    let (state_dir, run_dir) = fx.dirs();
    if state_dir.join("state.json").exists() {
        // Whatever the calls left, nacred must come back from it.
        d.shutdown();
        drop(d);
        fx.daemon = None;
        crate::control::state::load(&state_dir).expect("saved state loads again");
        let (again, existed) =
            Daemon::open(DaemonConfig { state_dir, run_dir }).expect("daemon reopens");
        assert!(existed);
        again.shutdown();
        fx.reset();
    }
}

fn replace_all(data: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len());
    let mut i = 0;
    while i < data.len() {
        if data[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(data[i]);
            i += 1;
        }
    }
    out
}

fn check_response(v: &Value) {
    let o = v.as_object().expect("a response is an object");
    assert_eq!(o.get("jsonrpc"), Some(&Value::from("2.0")), "{v}");
    assert!(
        o.contains_key("result") != o.contains_key("error"),
        "exactly one of result and error: {v}"
    );
    if let Some(e) = o.get("error") {
        assert!(e.get("code").is_some_and(Value::is_i64), "error code: {v}");
        assert!(
            e.get("message").is_some_and(Value::is_string),
            "error message: {v}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Seeds: well-formed inputs for the generator
// ---------------------------------------------------------------------------------------

/// Builders of well-formed inputs, for the seed generator.
pub mod seed {
    use super::*;

    /// One descriptor for [`virtqueue`] input.
    #[derive(Debug, Clone, Copy)]
    pub struct Desc {
        pub addr: u64,
        pub len: u32,
        pub flags: u16,
        pub next: u16,
    }

    /// [`virtqueue`] input: `table` (at most [`VQ_SIZE`] descriptors), the avail ring's
    /// heads, and `data` placed at [`VQ_DATA`].
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

    /// [`nvme_commands`] input from records.
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

    /// A host's opening for [`nvmf_target`]: ICReq, admin Connect and Property Set
    /// CC.EN=1, with `digests`.
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

    /// [`nvmf_initiator`] input: options and the controller's stream.
    pub fn initiator(opts: u8, stream: &[u8]) -> Vec<u8> {
        let mut v = vec![opts & !init_flags::RAW_ICRESP];
        v.extend_from_slice(stream);
        v
    }
}
