//! The slot table's close protocol (module docs, steps 3 and 4), made to race on purpose.

use std::cell::RefCell;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::mpsc;
use std::sync::Weak;
use std::time::Duration;

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
fn a_command_stored_after_the_reader_emptied_the_table_comes_back_to_its_submitter() {
    let params = QueueParams {
        qid: 0,
        depth: 4,
        digests: Digests::NONE,
        kato_ms: 0,
        icd_max: ADMIN_ICD,
        timeout: Duration::from_secs(5),
    };
    let connect = ConnectData {
        hostid: [0x42; 16],
        cntlid: CNTLID_DYNAMIC,
        subnqn: "nqn.2024-01.io.nacre:race".into(),
        hostnqn: "nqn.2024-01.io.nacre:host".into(),
    };
    let (q, _) = QueueConn::open(controller(), params, &connect, 1, Weak::<Owner>::new()).unwrap();

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
    // Meanwhile the connection dies and its reader empties the table and exits.
    q.shutdown();
    q.join(Duration::from_secs(10));
    assert!(
        q.closed.load(Ordering::SeqCst),
        "the reader closed the table"
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
