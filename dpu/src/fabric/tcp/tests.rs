//! The slot table's close protocol (module docs, steps 3 and 4), made to race on purpose.

use std::cell::RefCell;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::mpsc;
use std::sync::{Mutex, Weak};
use std::time::Duration;
use std::time::Instant;

use nacre_shared::nvme::fabrics::{ConnectData, CNTLID_DYNAMIC};
use nacre_shared::nvme::{Command, Completion as Cqe, Status};
use nacre_shared::nvme_tcp::{self as pdu, CommonHeader, Digests, IcReq, IcResp, CH_LEN, IC_LEN};

use super::*;

thread_local! {
    /// Run by [`QueueConn::issue_at`] on this thread after a slot was picked and before
    /// the command is stored in it.
    static PAUSE: RefCell<Option<Box<dyn FnMut()>>> = const { RefCell::new(None) };
}

pub(super) fn pause_point() {
    PAUSE.with(|p| {
        if let Some(f) = p.borrow_mut().as_mut() {
            f()
        }
    });
}

/// A controller that completes initialisation and Connect, then reads and drops whatever
/// comes until the connection closes.
fn controller() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut ic = [0u8; IC_LEN];
        s.read_exact(&mut ic).unwrap();
        let mut v = Vec::new();
        IcResp {
            pfv: 0,
            cpda: 0,
            digests: IcReq::decode(&ic).digests,
            maxh2cdata: 8192,
        }
        .encode(&mut v);
        s.write_all(&v).unwrap();
        let mut ch = [0u8; CH_LEN];
        s.read_exact(&mut ch).unwrap();
        let mut rest = vec![0u8; CommonHeader::decode(&ch).plen as usize - CH_LEN];
        s.read_exact(&mut rest).unwrap();
        let mut cqe = Cqe::new(u16::from_le_bytes([rest[2], rest[3]]), Status::SUCCESS);
        cqe.dw0 = 1;
        let mut r = Vec::new();
        pdu::encode_capsule_resp(&mut r, &cqe, Digests::NONE);
        s.write_all(&r).unwrap();
        let mut sink = [0u8; 4096];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    });
    addr
}

struct Owner;
impl QueueOwner for Owner {
    fn queue_closed(&self, _: u64, _: u16, _: String, cmds: Vec<Cmd>) {
        cmds.into_iter().for_each(|c| c.fail(IoError::PathLost));
    }
}

#[test]
fn a_command_stored_after_the_reactor_emptied_the_table_comes_back_to_its_submitter() {
    let params = QueueParams {
        qid: 0,
        depth: 4,
        digests: Digests::NONE,
        kato_ms: 0,
        icd_max: ADMIN_ICD,
        timeout: Duration::from_secs(5),
        tls: None,
    };
    let connect = ConnectData {
        hostid: [0x42; 16],
        cntlid: CNTLID_DYNAMIC,
        subnqn: "nqn.2024-01.io.nacre:race".into(),
        hostnqn: "nqn.2024-01.io.nacre:host".into(),
    };
    let (q, _) = QueueConn::open(
        controller(),
        params,
        &connect,
        1,
        Weak::<Owner>::new(),
        &Reactors::shared(),
    )
    .unwrap();

    // The submitter stops between taking a free slot and storing its command there.
    let (at_tx, at_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let submitter = {
        let q = q.clone();
        std::thread::spawn(move || {
            PAUSE.with(|p| {
                *p.borrow_mut() = Some(Box::new(move || {
                    at_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                }))
            });
            let wait = AdminWait::with_buf(vec![0u8; 4096]);
            let mut sqe = Command::decode(&[0u8; 64]);
            sqe.opcode = admin_opcode::IDENTIFY;
            let r = q.submit(Cmd {
                sqe,
                dir: Dir::C2H,
                len: 4096,
                target: Target::Admin(wait.clone()),
                release: true,
            });
            (r.map_err(|c| c.len), wait)
        })
    };
    at_rx.recv().unwrap();
    // Meanwhile the connection dies and its reactor empties the table and forgets it.
    q.shutdown();
    q.join(Duration::from_secs(10));
    assert!(
        q.closed.load(Ordering::SeqCst),
        "the reactor closed the table"
    );
    go_tx.send(()).unwrap();
    let (r, wait) = submitter.join().unwrap();
    assert_eq!(
        r,
        Err(4096),
        "the command comes back to its submitter instead of sitting in a dead table"
    );
    assert!(!wait.is_done(), "and nobody else completed or failed it");
    assert!(q.slots.iter().all(|s| s.lock().unwrap().cmd.is_none()));
}

/// Byte `i` of what the fragmenting controller returns for a command with `opcode`.
fn byte(opcode: u8, i: usize) -> u8 {
    (i.wrapping_mul(7) as u8).wrapping_add(opcode) ^ (i >> 8) as u8
}

/// Data length of the reads the fragmenting controller answers: Identify, NVM Read.
fn read_len(opcode: u8) -> usize {
    if opcode == admin_opcode::IDENTIFY {
        4096
    } else {
        64 << 10
    }
}

/// Read one command capsule: its opcode and CID.
fn read_sqe(s: &mut std::net::TcpStream) -> (u8, u16) {
    let mut ch = [0u8; CH_LEN];
    s.read_exact(&mut ch).unwrap();
    let mut rest = vec![0u8; CommonHeader::decode(&ch).plen as usize - CH_LEN];
    s.read_exact(&mut rest).unwrap();
    (rest[0], u16::from_le_bytes([rest[2], rest[3]]))
}

/// A controller that accepts `conns` connections, completes initialisation and Connect on
/// each, reads `cmds` read commands, and answers them all in one byte stream written in
/// fragments of 1 to 4101 bytes with a pause after each, so that headers, data and digests
/// arrive split across many of the host's wake-ups: Identify with two C2HData PDUs and a
/// CapsuleResp, NVM Read with one 64 KiB C2HData carrying SUCCESS. `cut`: send only that
/// many bytes of the answers, then wait for the host to close.
fn fragmenting_controller(conns: usize, cmds: usize, cut: Option<usize>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for _ in 0..conns {
            let (mut s, _) = l.accept().unwrap();
            std::thread::spawn(move || {
                let mut ic = [0u8; IC_LEN];
                s.read_exact(&mut ic).unwrap();
                let dg = IcReq::decode(&ic).digests;
                let mut v = Vec::new();
                IcResp {
                    pfv: 0,
                    cpda: 0,
                    digests: dg,
                    maxh2cdata: 8192,
                }
                .encode(&mut v);
                s.write_all(&v).unwrap();
                let (_, cid) = read_sqe(&mut s);
                let mut r = Vec::new();
                pdu::encode_capsule_resp(&mut r, &Cqe::new(cid, Status::SUCCESS), dg);
                s.write_all(&r).unwrap();
                let mut out = Vec::new();
                for _ in 0..cmds {
                    let (opcode, cid) = read_sqe(&mut s);
                    let data: Vec<u8> = (0..read_len(opcode)).map(|i| byte(opcode, i)).collect();
                    if opcode == admin_opcode::IDENTIFY {
                        pdu::encode_c2h_data(&mut out, cid, 0, &data[..1000], false, false, dg, 0);
                        pdu::encode_c2h_data(
                            &mut out,
                            cid,
                            1000,
                            &data[1000..],
                            true,
                            false,
                            dg,
                            0,
                        );
                        pdu::encode_capsule_resp(&mut out, &Cqe::new(cid, Status::SUCCESS), dg);
                    } else {
                        pdu::encode_c2h_data(&mut out, cid, 0, &data, true, true, dg, 0);
                    }
                }
                out.truncate(cut.unwrap_or(out.len()));
                let sizes = [1, 3, 7, 50, 333, 4101, 2, 24];
                let mut at = 0;
                for n in sizes.iter().cycle() {
                    if at == out.len() {
                        break;
                    }
                    let end = (at + n).min(out.len());
                    if s.write_all(&out[at..end]).is_err() {
                        return;
                    }
                    at = end;
                    std::thread::sleep(Duration::from_micros(300));
                }
                let mut sink = [0u8; 4096];
                while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
            });
        }
    });
    addr
}

fn params(qid: u16, digests: Digests) -> QueueParams {
    QueueParams {
        qid,
        depth: 4,
        digests,
        kato_ms: 0,
        icd_max: 0,
        timeout: Duration::from_secs(10),
        tls: None,
    }
}

fn connect_data(cntlid: u16) -> ConnectData {
    ConnectData {
        hostid: [0x42; 16],
        cntlid,
        subnqn: "nqn.2024-01.io.nacre:fragments".into(),
        hostnqn: "nqn.2024-01.io.nacre:host".into(),
    }
}

/// Open queue `qid` to `addr` (an I/O queue names controller 1; the admin queue asks for a
/// dynamic one), owned by nobody: closing fails its commands with PathLost.
fn open(addr: SocketAddr, qid: u16, dg: Digests) -> Arc<QueueConn> {
    let cntlid = if qid == 0 { CNTLID_DYNAMIC } else { 1 };
    QueueConn::open(
        addr,
        params(qid, dg),
        &connect_data(cntlid),
        1,
        Weak::<Owner>::new(),
        &Reactors::shared(),
    )
    .unwrap()
    .0
}

fn identify(q: &QueueConn) -> Arc<AdminWait> {
    let wait = AdminWait::with_buf(vec![0u8; 4096]);
    let mut sqe = Command::decode(&[0u8; 64]);
    sqe.opcode = admin_opcode::IDENTIFY;
    q.submit(Cmd {
        sqe,
        dir: Dir::C2H,
        len: 4096,
        target: Target::Admin(wait.clone()),
        release: true,
    })
    .map_err(|_| "queue closed")
    .unwrap();
    wait
}

/// Guard bytes before a test read's segments, and the bytes of the request before the
/// command's part of it (a request split into several commands: this is a later one).
const GUARD: usize = 16;
const SKIP: usize = 1500;

/// An NVM Read of `len` bytes into three segments of odd lengths, its data starting
/// [`SKIP`] bytes into them; the memory (0xEE) has [`GUARD`] bytes before the segments and
/// 48 after. The memory must outlive the command: callers wait for its completion (or its
/// queue's close) before they read or drop it.
fn read_cmd(len: usize, done: Arc<dyn crate::volume::IoCompletion>) -> (Cmd, Box<[u8]>) {
    let total = SKIP + len;
    let mut mem = vec![0xEEu8; GUARD + total + 48].into_boxed_slice();
    let base = mem.as_mut_ptr();
    // SAFETY: the three segments lie inside `mem` (GUARD .. GUARD + total), a heap buffer
    // that does not move when the box does, and outlives the command (above).
    let segs: crate::volume::Segments = unsafe {
        [(0, 1000), (1000, 30_000), (31_000, total - 31_000)]
            .into_iter()
            .map(|(o, n)| crate::volume::Segment::new(base.add(GUARD + o), n))
            .collect()
    };
    let mut sqe = Command::decode(&[0u8; 64]);
    sqe.opcode = 0x02;
    sqe.nsid = 1;
    let cmd = Cmd {
        sqe,
        dir: Dir::C2H,
        len,
        target: Target::Io {
            parent: crate::fabric::cmd::IoParent::new(segs, 9, done, 1),
            data: crate::fabric::cmd::IoData::Segs { off: SKIP },
        },
        release: true,
    };
    (cmd, mem)
}

#[derive(Default)]
struct Done(Mutex<Vec<Result<(), IoError>>>);
impl crate::volume::IoCompletion for Done {
    fn complete(&self, _: u64, r: crate::volume::IoResult) {
        self.0.lock().unwrap().push(r);
    }
}

/// The reactor parses PDUs whose headers, data and digests arrive a few bytes at a time:
/// admin data through the receive buffer, I/O data into its part of the request's segments
/// (straight from the socket when there is no data digest), with and without digests.
#[test]
fn pdus_arriving_in_fragments_are_parsed_across_wake_ups() {
    for dg in [
        Digests::NONE,
        Digests {
            header: true,
            data: true,
        },
    ] {
        let addr = fragmenting_controller(1, 2, None);
        let q = open(addr, 1, dg);
        let admin = identify(&q);
        let len = 64 << 10;
        let done = Arc::new(Done::default());
        let (io, mem) = read_cmd(len, done.clone());
        q.submit(io).map_err(|_| "queue closed").unwrap();

        let cqe = admin
            .wait_until(Instant::now() + Duration::from_secs(20))
            .expect("Identify answered")
            .expect("Identify succeeded");
        assert!(cqe.status().is_success());
        let want: Vec<u8> = (0..4096).map(|i| byte(admin_opcode::IDENTIFY, i)).collect();
        assert!(*admin.buf.lock().unwrap() == want, "Identify data ({dg:?})");
        let deadline = Instant::now() + Duration::from_secs(20);
        while done.0.lock().unwrap().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            *done.0.lock().unwrap(),
            [Ok(())],
            "the read completed once ({dg:?})"
        );
        let want: Vec<u8> = (0..len).map(|i| byte(0x02, i)).collect();
        let at = GUARD + SKIP;
        assert!(mem[at..at + len] == want[..], "read data ({dg:?})");
        assert!(
            mem[..at].iter().chain(&mem[at + len..]).all(|&b| b == 0xEE),
            "bytes outside the command's part of the request changed ({dg:?})"
        );
        let (direct, copied) = (
            q.rx_direct.load(Ordering::Relaxed),
            q.rx_copied.load(Ordering::Relaxed),
        );
        assert_eq!(direct + copied, len as u64, "{dg:?}");
        if dg.data {
            assert_eq!(direct, 0, "data under a digest passes through the buffer");
        } else {
            assert!(direct > 0, "nothing was read straight into the segments");
        }
        q.shutdown();
        q.join(Duration::from_secs(10));
        assert!(q.closed_done.load(Ordering::Acquire));
    }
}

fn fabric_threads() -> (usize, usize) {
    let mut reactors = 0;
    let mut per_queue = 0;
    for t in std::fs::read_dir("/proc/self/task").unwrap() {
        let comm = std::fs::read_to_string(t.unwrap().path().join("comm")).unwrap_or_default();
        if comm.starts_with("fabric-tcp-") {
            reactors += 1;
        } else if comm.starts_with("nvmf-q") {
            per_queue += 1;
        }
    }
    (reactors, per_queue)
}

/// Twelve queues are served by the few reactor threads, not by threads of their own, and
/// each gets its own answer.
#[test]
fn many_queues_share_a_few_reactor_threads() {
    let n = 12;
    let addr = fragmenting_controller(n, 1, None);
    let queues: Vec<_> = (0..n).map(|_| open(addr, 0, Digests::NONE)).collect();
    let (reactors, per_queue) = fabric_threads();
    assert_eq!(per_queue, 0, "a queue has a thread of its own");
    assert!(
        (1..=MAX_DEFAULT_REACTORS).contains(&reactors),
        "{reactors} reactor threads for {n} queues"
    );
    let waits: Vec<_> = queues.iter().map(|q| identify(q)).collect();
    let want: Vec<u8> = (0..4096).map(|i| byte(admin_opcode::IDENTIFY, i)).collect();
    for w in &waits {
        w.wait_until(Instant::now() + Duration::from_secs(30))
            .expect("answered")
            .expect("succeeded");
        assert!(*w.buf.lock().unwrap() == want);
    }
    for q in &queues {
        q.shutdown();
    }
    for q in &queues {
        q.join(Duration::from_secs(10));
        assert!(
            q.closed_done.load(Ordering::Acquire),
            "a queue was not closed"
        );
    }
}

/// A queue closed while a C2HData PDU is half received fails its command once, and what
/// had arrived stays within the command's part of the request.
#[test]
fn a_queue_closed_mid_pdu_fails_its_command_once() {
    // The header and 10,000 of 65,536 data bytes.
    let addr = fragmenting_controller(1, 1, Some(pdu::DATA_HLEN + 10_000));
    let q = open(addr, 1, Digests::NONE);
    let len = 64 << 10;
    let done = Arc::new(Done::default());
    let (io, mem) = read_cmd(len, done.clone());
    q.submit(io).map_err(|_| "queue closed").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while q.rx_direct.load(Ordering::Relaxed) + q.rx_copied.load(Ordering::Relaxed) < 10_000
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        q.rx_direct.load(Ordering::Relaxed) + q.rx_copied.load(Ordering::Relaxed),
        10_000
    );
    assert!(
        done.0.lock().unwrap().is_empty(),
        "completed on half its data"
    );
    q.shutdown();
    q.join(Duration::from_secs(10));
    assert!(q.closed_done.load(Ordering::Acquire));
    assert_eq!(*done.0.lock().unwrap(), [Err(IoError::PathLost)]);
    assert!(
        !q.rx.lock().unwrap().in_pdu_data(),
        "the closed queue still holds the request"
    );
    let at = GUARD + SKIP;
    let want: Vec<u8> = (0..10_000).map(|i| byte(0x02, i)).collect();
    assert!(mem[at..at + 10_000] == want[..]);
    assert!(mem[..at]
        .iter()
        .chain(&mem[at + 10_000..])
        .all(|&b| b == 0xEE));
}

/// Completes by panicking, as a bug in code above the fabric would.
struct Panics;
impl crate::volume::IoCompletion for Panics {
    fn complete(&self, _: u64, _: crate::volume::IoResult) {
        panic!("a completion panicked (on purpose)");
    }
}

/// A completion that panics costs its own queue, not the other queues its reactor serves.
#[test]
fn a_panicking_completion_costs_only_its_queue() {
    // Two queues on the same reactor (there are at most MAX_DEFAULT_REACTORS).
    let n = MAX_DEFAULT_REACTORS + 1;
    let addr = fragmenting_controller(n, 1, None);
    let queues: Vec<_> = (0..n).map(|_| open(addr, 1, Digests::NONE)).collect();
    let (a, b) = (0..n)
        .flat_map(|i| (i + 1..n).map(move |j| (i, j)))
        .find(|&(i, j)| queues[i].home.same_reactor(&queues[j].home))
        .expect("two queues share a reactor");
    let (qa, qb) = (&queues[a], &queues[b]);
    let (io, _mem) = read_cmd(64 << 10, Arc::new(Panics));
    qa.submit(io).map_err(|_| "queue closed").unwrap();
    qa.join(Duration::from_secs(20));
    assert!(
        qa.closed_done.load(Ordering::Acquire),
        "the queue survived its panic"
    );
    // The reactor goes on serving the other queue.
    let w = identify(qb);
    w.wait_until(Instant::now() + Duration::from_secs(20))
        .expect("the other queue was answered")
        .expect("succeeded");
    assert!(!qb.is_dead());
    for (i, q) in queues.iter().enumerate() {
        if i != a && i != b {
            identify(q);
        }
        q.shutdown();
    }
}
