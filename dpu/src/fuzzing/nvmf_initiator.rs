//! NVMe/TCP initiator: what a controller sends to one of the initiator's queues.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use nacre_shared::nvme::fabrics::{self, ConnectData};
use nacre_shared::nvme::{Command, Completion as Cqe, Status};
use nacre_shared::nvme_tcp::{self as tcp, pdu_type, CommonHeader, Digests, IcReq, IcResp};

use super::{helper, ignore_sigpipe, HOSTNQN, NQN, NS_LBA};
use crate::fabric::cmd::{AdminWait, Cmd, Dir, IoData, IoParent, Target};
use crate::fabric::tcp::{QueueConn, QueueOwner, QueueParams, Reactors};
use crate::volume::{IoCompletion, IoResult, Segment, Segments};

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
/// Checks: no panic on the receiving reactor, no request completed twice, and no data written
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
        tls: None,
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
    let q = match QueueConn::open(addr, params, &connect, 1, owner, &Reactors::shared()) {
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
    // The reactor fails what is still outstanding when it sees the connection closed.
    q.shutdown();
}
