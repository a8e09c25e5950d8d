//! [`FakeTarget`]: the scripted NVMe/TCP target, its options and its faults. A connection's
//! PDU loop is in `conn`, the I/O queue in `io`, Fabrics and admin commands in `admin`.

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nacre_shared::nvme::Command;
use nacre_shared::nvme_tcp::Digests;

use super::Storage;
use conn::serve;

mod admin;
mod conn;
mod io;

/// A misbehaviour, fired once on the `after`-th I/O command (counted over all connections).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A PDU with an impossible header length.
    Malformed,
    /// A CapsuleResp for a command id that is not outstanding.
    UnknownCid,
    /// A C2HData longer than the command asked for.
    WrongLength,
    /// A C2HTermReq.
    TermReq,
    /// Close the connection without a word.
    Drop,
    /// Stop answering on this connection (still reading, never replying).
    Stall,
    /// A CapsuleResp whose header digest is wrong (needs header digests).
    BadHeaderDigest,
    /// A read's C2HData whose data digest is wrong (needs data digests; the command must be a
    /// read).
    BadDataDigest,
    /// Execute this (in-capsule) write only after `TargetOpts::late_ms`, as a target with
    /// commands queued deep inside may still do after the host gave up on the connection.
    LateWrite,
}

#[derive(Debug, Clone)]
pub struct TargetOpts {
    pub subnqn: String,
    /// Use C2HData SUCCESS instead of a CapsuleResp for reads.
    pub c2h_success: bool,
    /// Split read data into C2HData PDUs of at most this size.
    pub c2h_chunk: usize,
    /// Ask for write data in R2Ts of at most this size.
    pub r2t_chunk: usize,
    pub maxh2cdata: u32,
    /// In-capsule data the I/O queues accept (IOCCSZ).
    pub icd: usize,
    pub mdts: u8,
    pub cqt_ms: u16,
    pub fault: Option<(Fault, u64)>,
    pub model: String,
    /// Delay of [`Fault::LateWrite`].
    pub late_ms: u64,
}

impl Default for TargetOpts {
    fn default() -> Self {
        TargetOpts {
            subnqn: "nqn.2024-01.io.nacre.test:shelf".into(),
            c2h_success: false,
            c2h_chunk: 64 << 10,
            r2t_chunk: 64 << 10,
            maxh2cdata: 32 << 10,
            icd: 8192,
            mdts: 5,
            cqt_ms: 0,
            fault: None,
            model: "nacre-fake-target".into(),
            late_ms: 300,
        }
    }
}

struct TState {
    opts: TargetOpts,
    storage: Storage,
    io_cmds: AtomicU64,
    fault_fired: AtomicBool,
    next_cntlid: AtomicUsize,
    stop: AtomicBool,
    conns: Mutex<Vec<TcpStream>>,
    /// Digest errors seen in what the host sent (must stay 0).
    digest_errors: AtomicU64,
    connects: AtomicU64,
    writes_in_capsule: AtomicU64,
    writes_r2t: AtomicU64,
    late_writes_done: AtomicU64,
}

pub struct FakeTarget {
    pub addr: SocketAddr,
    st: Arc<TState>,
    listener: Option<std::thread::JoinHandle<()>>,
}

impl FakeTarget {
    pub fn start(opts: TargetOpts, storage: Storage) -> FakeTarget {
        Self::start_on("127.0.0.1:0", opts, storage)
    }

    /// Listen on a given address (e.g. the port a previous instance used).
    pub fn start_on(bind: &str, opts: TargetOpts, storage: Storage) -> FakeTarget {
        let l = bind_retry(bind);
        let addr = l.local_addr().unwrap();
        let st = Arc::new(TState {
            opts,
            storage,
            io_cmds: AtomicU64::new(0),
            fault_fired: AtomicBool::new(false),
            next_cntlid: AtomicUsize::new(1),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            digest_errors: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            writes_in_capsule: AtomicU64::new(0),
            writes_r2t: AtomicU64::new(0),
            late_writes_done: AtomicU64::new(0),
        });
        l.set_nonblocking(true).unwrap();
        let s2 = st.clone();
        let listener = std::thread::spawn(move || {
            while !s2.stop.load(Ordering::Acquire) {
                match l.accept() {
                    Ok((c, _)) => {
                        c.set_nonblocking(false).unwrap();
                        let _ = c.set_nodelay(true);
                        s2.conns.lock().unwrap().push(c.try_clone().unwrap());
                        let s3 = s2.clone();
                        std::thread::spawn(move || {
                            let _ = serve(&s3, c);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        FakeTarget {
            addr,
            st,
            listener: Some(listener),
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn digest_errors(&self) -> u64 {
        self.st.digest_errors.load(Ordering::Relaxed)
    }
    pub fn connects(&self) -> u64 {
        self.st.connects.load(Ordering::Relaxed)
    }
    pub fn writes_in_capsule(&self) -> u64 {
        self.st.writes_in_capsule.load(Ordering::Relaxed)
    }
    pub fn writes_r2t(&self) -> u64 {
        self.st.writes_r2t.load(Ordering::Relaxed)
    }
    pub fn late_writes_done(&self) -> u64 {
        self.st.late_writes_done.load(Ordering::Relaxed)
    }
    pub fn fault_fired(&self) -> bool {
        self.st.fault_fired.load(Ordering::Relaxed)
    }

    /// Stop listening and close every connection (the target "dies").
    pub fn kill(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        self.st.stop.store(true, Ordering::Release);
        for c in self.st.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.listener.take() {
            let _ = h.join();
        }
    }
}

impl Drop for FakeTarget {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

fn bind_retry(bind: &str) -> TcpListener {
    for _ in 0..200 {
        if let Ok(l) = TcpListener::bind(bind) {
            return l;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    TcpListener::bind(bind).expect("bind")
}

struct Conn {
    s: TcpStream,
    dg: Digests,
    qid: u16,
    cntlid: u16,
    cc: u32,
    /// Writes waiting for H2CData: cid -> (command, buffer, received, requested so far).
    pending: HashMap<u16, (Command, Vec<u8>, usize, usize)>,
    stalled: bool,
}
