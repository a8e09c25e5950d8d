//! One NVMe/TCP queue: a TCP connection carrying one submission/completion queue pair
//! (NVMe/TCP Transport 1.0 §3.3: one connection per queue).
//!
//! Life of a connection:
//! 1. Connection initialisation (§3.6.2.2-3): the host sends ICReq with HPDA 0 (Linux nvmet
//!    requires it), the digests it wants and MAXR2T 0 (one R2T per command at a time), and
//!    reads ICResp: CPDA (where our data PDUs must start), the digests the controller
//!    enabled (they must be the ones we asked for) and MAXH2CDATA.
//! 2. No thread of its own: the socket is non-blocking and one of a few reactors
//!    (`reactor.rs`) owns its receive side, with many other queues. A submitter appends its
//!    capsule to the send buffer and sends it itself with a non-blocking `send`; inside a
//!    [`plug`] (a vhost-user-blk worker's batch) it only appends, and the batch leaves in one
//!    `send` when the plug closes. One sender at a time (`Tx::sending`), always from the front
//!    of the buffer, so PDUs leave in order; a sender that finds others' bytes appended
//!    meanwhile sends those too. What the socket does not take waits for `EPOLLOUT`, and the
//!    reactor sends it. The reactor parses every PDU (`rx.rs`) and moves C2HData into the
//!    request's memory: the kernel reads a long PDU's data straight there when there is no
//!    data digest (`rxbuf`); the rest is copied from the receive buffer (the memory may be a
//!    guest's, which no Rust reference may cover). It answers R2Ts with H2CData and completes
//!    commands (CapsuleResp, or C2HData with SUCCESS, §3.6.2.8).
//! 3. Commands in flight live in a slot table of `depth` entries. The CID is the slot index
//!    plus a 6-bit generation that changes each time the slot is reused, so a completion for
//!    a command that is not (or no longer) outstanding is recognised as such, and a slot is
//!    only reused after its completion has been fully processed. Commands beyond `depth` wait
//!    in an overflow list and go out as slots free. Each slot has its own lock, and the free
//!    list and overflow another (`SlotAlloc`), held only to pick a slot: the submitting
//!    thread and the reactor meet on a slot only when they handle the same command, which the
//!    protocol already orders (a response follows its capsule), not on every I/O as they
//!    did behind one lock over the whole table (the end-to-end profile in docs/benchmarks.md).
//! 4. Any transport or protocol error (a malformed PDU, a digest mismatch, an unknown CID, a
//!    C2HTermReq, EOF, a shutdown) is fatal to the connection (§3.6.2.4): the host sends
//!    H2CTermReq where it makes sense and closes. The reactor then forgets the queue, marks
//!    the table closed and takes every outstanding command out of it, slot by slot under the
//!    slots' locks, and hands them to the owner; a submitter that stored a command after the
//!    reactor had passed its slot sees the mark under that slot's lock and takes its command
//!    back. Nothing can touch a command's memory after that, so the owner may safely resubmit
//!    it elsewhere.
//!
//! The receive side is in `rx.rs`, its buffer in `rxbuf.rs`, the reactors in `reactor.rs`;
//! connection set-up, submission and sending here.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use nacre_shared::nvme::command::{sgl, PSDT_SGL};
use nacre_shared::nvme::fabrics::{Connect, ConnectData};
use nacre_shared::nvme::{admin_opcode, Completion as Cqe, SglDescriptor};
use nacre_shared::nvme_tcp::{self as pdu, pdu_type, CommonHeader, IcReq, IcResp, CH_LEN, IC_LEN};
use tracing::debug;

use crate::telemetry::clock;
use crate::telemetry::trace::TARGET as TRACE;
use crate::volume::plug::{self, Unplug};

use super::cmd::{AdminWait, Cmd, Dir, Target};
use super::queue::{cid_of, FabricQueue};
pub use super::queue::{QueueOwner, QueueParams, MAX_DEPTH};
use super::FabricError;
use crate::volume::IoError;

mod reactor;
mod rx;
mod rxbuf;

pub use reactor::{Reactors, MAX_DEFAULT_REACTORS};

#[cfg(test)]
mod tests;

/// In-capsule data the admin queue always accepts (NVMe/TCP 1.0 §3.4: 8 KiB).
pub const ADMIN_ICD: usize = 8192;
/// The largest data PDU nacre accepts from a controller. Transfers are split by the host at
/// the maximum transfer size (at most 1 MiB), and a controller never sends more than a
/// command asked for, so this only bounds what a broken peer can make us read.
const MAX_RX_DATA: usize = 1 << 20;

/// Negotiated at ICReq/ICResp.
#[derive(Debug, Clone, Copy)]
struct Negotiated {
    cpda: u8,
    maxh2cdata: usize,
}

struct Slot {
    gen: u8,
    cmd: Option<Cmd>,
    /// When the command went out, on the batch clock (for the I/O timeout, which is
    /// seconds: a submitting vhost worker's batch instant is close enough and costs no
    /// clock read per command).
    issued_ns: u64,
}

/// Which slots are free, and the commands waiting for one.
struct SlotAlloc {
    free: Vec<u16>,
    overflow: VecDeque<Cmd>,
    closed: bool,
}

struct Tx {
    buf: Vec<u8>,
    /// Some thread is sending bytes taken from the front of `buf`: nobody else may send until
    /// it is done (the byte stream would interleave); it sends what was appended meanwhile.
    sending: bool,
    /// The socket refused part of a send: the reactor waits for `EPOLLOUT` and sends the
    /// rest (nobody else sends meanwhile: the socket is full).
    out_armed: bool,
    /// A plug on some submitter's thread will flush this queue when it closes, so later
    /// plugged submits need not register again.
    deferred: bool,
    /// An emptied send buffer kept for the next swap (no allocation per batch).
    spare: Vec<u8>,
    closed: bool,
}

/// Send buffers above this capacity are freed after use rather than kept.
const KEEP_TX_CAPACITY: usize = 4 << 20;

pub struct QueueConn {
    pub qid: u16,
    session: u64,
    stream: TcpStream,
    params: QueueParams,
    neg: Negotiated,
    slots: Box<[Mutex<Slot>]>,
    alloc: Mutex<SlotAlloc>,
    /// Set (under `alloc`) when the reactor takes the commands out for good; see step 4 above.
    closed: AtomicBool,
    tx: Mutex<Tx>,
    /// The receive side: only the queue's reactor takes it.
    rx: Mutex<rx::Rx>,
    /// The reactor serving the queue.
    home: reactor::Home,
    owner: Weak<dyn QueueOwner>,
    dead: AtomicBool,
    /// The reactor is closing the queue (nothing more is read from it).
    finished: AtomicBool,
    /// The reactor has handed the outstanding commands back and forgotten the queue.
    closed_done: AtomicBool,
    /// Commands completed on this connection (observability).
    pub completed: AtomicU64,
    /// This queue as a plug registers it (see [`plug::defer`]).
    me: Weak<QueueConn>,
    /// Batches sent by a submitter closing its plug, and those of them the socket did not
    /// take whole, whose rest the reactor sent (observability, and what the tests check).
    pub inline_sends: AtomicU64,
    pub inline_partial: AtomicU64,
    /// C2HData bytes read straight into the requests' memory, and those copied there from
    /// the receive buffer (observability, and what the tests check: `rxbuf`).
    pub rx_direct: AtomicU64,
    pub rx_copied: AtomicU64,
}

impl std::fmt::Debug for QueueConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueConn")
            .field("qid", &self.qid)
            .field("session", &self.session)
            .finish()
    }
}

/// A fatal protocol error: what to put in the H2CTermReq (if anything) and why.
struct Fatal {
    reason: String,
    term: Option<(u16, u32, Vec<u8>)>,
}

impl Fatal {
    fn io(e: std::io::Error) -> Self {
        Fatal {
            reason: format!("connection lost: {e}"),
            term: None,
        }
    }
    fn proto(reason: impl Into<String>, fes: u16, fei: u32, hdr: &[u8]) -> Self {
        Fatal {
            reason: reason.into(),
            term: Some((fes, fei, hdr.to_vec())),
        }
    }
    fn quiet(reason: impl Into<String>) -> Self {
        Fatal {
            reason: reason.into(),
            term: None,
        }
    }
}

impl QueueConn {
    /// Connect TCP, exchange ICReq/ICResp, hand the queue to one of `reactors`, and send Fabrics
    /// Connect (NVMe-oF 1.1 §3.3). Returns the queue and the Connect completion (CNTLID in
    /// Dword 0 for the admin queue).
    pub fn open(
        addr: SocketAddr,
        params: QueueParams,
        connect_data: &ConnectData,
        session: u64,
        owner: Weak<dyn QueueOwner>,
        reactors: &Reactors,
    ) -> Result<(Arc<QueueConn>, Cqe), FabricError> {
        let deadline = Instant::now() + params.timeout;
        let stream = TcpStream::connect_timeout(&addr, params.timeout)
            .map_err(|e| FabricError::Connect(format!("cannot connect to {addr}: {e}")))?;
        let _ = stream.set_nodelay(true);
        // TLS (§3.6.1): the handshake comes first, then everything, ICReq included, goes
        // through the relay's plaintext end. A refused handshake is not retried: a wrong or
        // missing PSK does not become right by trying again.
        let stream = match &params.tls {
            None => stream,
            Some(psk) => {
                let (plain, relay) = crate::auth::tls_channel::connect(stream, psk, params.timeout)
                    .map_err(|e| {
                        FabricError::Auth(format!(
                            "queue {}: {addr} as {}: {e}",
                            params.qid,
                            psk.identity()
                        ))
                    })?;
                std::thread::Builder::new()
                    .name(format!("fabric-tls-{}", params.qid))
                    .spawn(relay)
                    .map_err(FabricError::io)?;
                plain
            }
        };
        let neg = initialize(&stream, &params)?;
        // From here on the socket never blocks: the reactor reads when it is readable, and
        // senders send what it takes; a silent controller is caught by keep-alive and the
        // I/O timeout, not by a socket timeout.
        stream.set_nonblocking(true).map_err(FabricError::io)?;
        let depth = params.depth.clamp(1, MAX_DEPTH);
        let home = reactors.pick().map_err(FabricError::io)?;
        let q = Arc::new_cyclic(|me| QueueConn {
            qid: params.qid,
            session,
            stream,
            neg,
            slots: (0..depth)
                .map(|_| {
                    Mutex::new(Slot {
                        gen: 0,
                        cmd: None,
                        issued_ns: clock::now_ns(),
                    })
                })
                .collect(),
            alloc: Mutex::new(SlotAlloc {
                free: (0..depth).rev().collect(),
                overflow: VecDeque::new(),
                closed: false,
            }),
            closed: AtomicBool::new(false),
            tx: Mutex::new(Tx {
                buf: Vec::with_capacity(64 << 10),
                sending: false,
                out_armed: false,
                deferred: false,
                spare: Vec::new(),
                closed: false,
            }),
            rx: Mutex::new(rx::Rx::new()),
            home,
            owner,
            dead: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            closed_done: AtomicBool::new(false),
            completed: AtomicU64::new(0),
            me: me.clone(),
            inline_sends: AtomicU64::new(0),
            inline_partial: AtomicU64::new(0),
            rx_direct: AtomicU64::new(0),
            rx_copied: AtomicU64::new(0),
            params,
        });
        // The queue knows its reactor before the reactor can see it (a wake-up may come at
        // once, and closing needs it).
        q.home.add(&q).map_err(FabricError::io)?;

        // Fabrics Connect: SQSIZE is zero-based, and one entry more than the commands we put
        // in flight keeps a full SQ distinguishable from an empty one.
        let sqe = Connect {
            recfmt: 0,
            qid: q.qid,
            sqsize: depth,
            cattr: 0,
            kato: q.params.kato_ms,
        }
        .to_command(0);
        let w = AdminWait::with_buf(connect_data.encode());
        let len = nacre_shared::nvme::fabrics::CONNECT_DATA_LEN;
        if let Err(c) = q.submit(Cmd {
            sqe,
            dir: Dir::H2C,
            len,
            target: Target::Admin(w.clone()),
            release: true,
        }) {
            c.fail(IoError::PathLost);
        }
        let cqe = match w.wait_until(deadline) {
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                q.shutdown();
                return Err(FabricError::Connect(format!("Connect qid {}: {e}", q.qid)));
            }
            None => {
                q.shutdown();
                return Err(FabricError::Timeout(format!("Connect qid {}", q.qid)));
            }
        };
        if !cqe.status().is_success() {
            q.shutdown();
            return Err(FabricError::Refused(format!(
                "controller refused Connect for queue {}: {}",
                q.qid,
                cqe.status()
            )));
        }
        Ok((q, cqe))
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Submit a command. Never blocks on the network. Returns the command back if the
    /// connection is closed (the caller holds or fails it).
    pub fn submit(&self, cmd: Cmd) -> Result<(), Cmd> {
        let idx = {
            let mut a = self.alloc.lock().unwrap_or_else(|p| p.into_inner());
            if a.closed {
                return Err(cmd);
            }
            match a.free.pop() {
                Some(idx) => idx,
                None => {
                    a.overflow.push_back(cmd);
                    return Ok(());
                }
            }
        };
        self.issue_at(idx, cmd)
    }

    /// Issue `cmd` in the free slot `idx`, or hand it back if the reactor has meanwhile
    /// taken the table's commands out for good (then the slot is never used again).
    fn issue_at(&self, idx: u16, cmd: Cmd) -> Result<(), Cmd> {
        #[cfg(test)]
        tests::pause_point();
        let mut slot = self.slots[idx as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let send = self.issue(&mut slot, idx, cmd);
        // The reactor sets `closed` before it empties the slots, each under its lock: if it
        // emptied this one before the command was stored, the flag shows here.
        if self.closed.load(Ordering::SeqCst) {
            return Err(slot.cmd.take().expect("stored above"));
        }
        // Sent only now: the command is in its slot before its answer can be parsed.
        drop(slot);
        if send {
            self.send_pending(false);
        }
        Ok(())
    }

    /// Put `cmd` in `slot` (locked, free) and append its capsule to the send buffer.
    /// Returns whether the caller must send it (it is not held by a plug).
    fn issue(&self, slot: &mut Slot, idx: u16, mut cmd: Cmd) -> bool {
        slot.gen = slot.gen.wrapping_add(1) & 0x3F;
        let cid = cid_of(idx, slot.gen);
        cmd.sqe.cid = cid;
        tracing::trace!(target: TRACE, qid = self.qid, cid = format_args!("{cid:#06x}"),
            opcode = cmd.sqe.opcode, len = cmd.len, "fabric: command sent");
        cmd.sqe.flags = (cmd.sqe.flags & !0xC0) | PSDT_SGL;
        // Fabrics commands (Connect data) always travel in the capsule (NVMe-oF 1.1 §3.3:
        // a controller accepts Connect data in-capsule whatever its IOCCSZ).
        let in_capsule = cmd.dir == Dir::H2C
            && (cmd.len <= self.icd_max() || cmd.sqe.opcode == admin_opcode::FABRICS);
        cmd.sqe.sgl = if in_capsule {
            SglDescriptor::in_capsule(cmd.len as u32)
        } else {
            SglDescriptor {
                addr: 0,
                len: cmd.len as u32,
                kind: sgl::TRANSPORT_DATA_BLOCK,
            }
        };
        let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        // In-capsule data is copied once, from the request's segments straight into the send
        // buffer behind the header (a gather write from guest memory would hold the guest's
        // buffer until the socket took it, past the point a plugged batch is sent).
        let len = if in_capsule { cmd.len } else { 0 };
        pdu::encode_capsule_cmd_with(
            &mut tx.buf,
            &cmd.sqe,
            len,
            self.params.digests,
            self.neg.cpda,
            |d| cmd.read_data(0, d),
        );
        // Inside a plug the submitting thread sends the batch itself when the plug closes
        // (admin commands never wait for that: a thread may block on their answer).
        let plugged = self.qid != 0 && plug::is_open();
        // The first plugged submit registers the queue; later ones ride on that.
        let register = plugged && !tx.deferred;
        tx.deferred |= register;
        let mut send = !plugged;
        drop(tx);
        if register {
            match self.me.upgrade() {
                Some(me) => {
                    let me: Arc<dyn Unplug> = me;
                    plug::defer(&me);
                }
                // Being dropped: nobody would unplug it, so send it now.
                None => send = true,
            }
        }
        slot.cmd = Some(cmd);
        slot.issued_ns = clock::now_ns();
        send
    }

    /// How long the oldest command in a slot has been waiting on the controller. Commands
    /// still waiting for a free slot do not count: as with the kernel's request timeout,
    /// the clock starts when a command is sent (a deep but answering queue is not a hung
    /// controller; a hung one leaves the commands in the slots to time out).
    pub fn oldest_outstanding(&self) -> Option<Duration> {
        let now = clock::read_ns();
        self.slots
            .iter()
            .filter_map(|s| {
                let s = s.lock().unwrap_or_else(|p| p.into_inner());
                s.cmd
                    .is_some()
                    .then(|| Duration::from_nanos(now.saturating_sub(s.issued_ns)))
            })
            .max()
    }

    fn icd_max(&self) -> usize {
        if self.qid == 0 {
            ADMIN_ICD
        } else {
            self.params.icd_max
        }
    }

    /// Close the connection: its reactor hands outstanding commands to the owner and
    /// forgets it. Returns at once; it never waits on the peer.
    pub fn shutdown(&self) {
        self.dead.store(true, Ordering::Release);
        // The reactor sees the socket readable (end of file) and closes the queue.
        let _ = self.stream.shutdown(Shutdown::Both);
        let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        tx.closed = true;
    }

    /// Wait (bounded) for the reactor to have handed the outstanding commands back after
    /// [`QueueConn::shutdown`].
    pub fn join(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.closed_done.load(Ordering::Acquire) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// The reactor's part: `events` happened on the socket.
    fn on_ready(self: &Arc<Self>, events: u32) {
        if self.finished.load(Ordering::Acquire) {
            return;
        }
        if events & libc::EPOLLOUT as u32 != 0 {
            let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
            if tx.out_armed {
                tx.out_armed = false;
                let _ = self.home.want_out(self, false);
            }
            drop(tx);
            self.send_pending(false);
        }
        let (r, answered) = {
            let mut rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
            let r = self.on_readable(&mut rx, self.fd());
            (r, std::mem::take(&mut rx.answered_r2t))
        };
        // H2CData answering R2Ts, appended while parsing, leave in one send.
        if answered {
            self.send_pending(false);
        }
        if let Err(fatal) = r {
            self.close(fatal);
        }
    }

    /// The reactor's part when the connection failed: tell the controller why where that
    /// makes sense (§3.6.2.4), forget the queue and hand its commands back.
    fn close(&self, fatal: Fatal) {
        // Once only (a second call comes only after a panic in the first).
        if self.finished.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some((fes, fei, hdr)) = &fatal.term {
            if !self.is_dead() {
                // Best effort: if the socket does not take it now it is not sent.
                let mut v = Vec::new();
                pdu::encode_term_req(&mut v, false, *fes, *fei, hdr);
                let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
                tx.buf.extend_from_slice(&v);
                drop(tx);
                self.send_pending(false);
            }
        }
        self.home.remove(self);
        // The receive state may hold a command's parent (a C2HData half received): let it go.
        self.rx.lock().unwrap_or_else(|p| p.into_inner()).release();
        self.fail_outstanding(fatal);
        self.closed_done.store(true, Ordering::Release);
    }

    /// Send what is in the send buffer, from this thread, without blocking: what the socket
    /// does not take waits for the reactor (`EPOLLOUT`). `plug`: a closing plug sends (what
    /// `inline_sends` counts).
    fn send_pending(&self, plug: bool) {
        loop {
            let mut out = {
                let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
                // Someone else is sending (and picks these bytes up when done), or the socket
                // is full (the reactor sends when it drains).
                if tx.closed || tx.sending || tx.out_armed || tx.buf.is_empty() {
                    return;
                }
                tx.sending = true;
                let spare = std::mem::take(&mut tx.spare);
                std::mem::replace(&mut tx.buf, spare)
            };
            let r = send_nonblocking(&self.stream, &out);
            if plug {
                self.inline_sends.fetch_add(1, Ordering::Relaxed);
            }
            let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
            tx.sending = false;
            match r {
                Ok(n) if n == out.len() => {
                    out.clear();
                    if tx.spare.capacity() == 0 && out.capacity() <= KEEP_TX_CAPACITY {
                        tx.spare = out;
                    }
                    // Others appended while this thread sent: theirs go next.
                    if tx.buf.is_empty() {
                        return;
                    }
                }
                Ok(n) => {
                    // The socket is full: the rest goes first, before anything appended since,
                    // when the reactor sees it writable.
                    if plug {
                        self.inline_partial.fetch_add(1, Ordering::Relaxed);
                    }
                    out.drain(..n);
                    out.extend_from_slice(&tx.buf);
                    tx.buf = out;
                    tx.out_armed = true;
                    if let Err(e) = self.home.want_out(self, true) {
                        drop(tx);
                        debug!(qid = self.qid, error = %e, "cannot wait for the socket");
                        self.shutdown();
                    }
                    return;
                }
                Err(e) => {
                    drop(tx);
                    if !self.is_dead() {
                        debug!(qid = self.qid, error = %e, "send failed");
                    }
                    self.shutdown();
                    return;
                }
            }
        }
    }
}

impl Unplug for QueueConn {
    /// Send what plugged submitters appended, from this (the submitting) thread, without
    /// blocking: what the socket does not take the reactor sends when it can.
    fn unplug(&self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).deferred = false;
        self.send_pending(true);
    }
}

/// Send as much of `buf` as the socket takes now; the count sent (short when it is full).
fn send_nonblocking(stream: &TcpStream, buf: &[u8]) -> std::io::Result<usize> {
    let mut sent = 0;
    while sent < buf.len() {
        // SAFETY: the pointer and length describe the live slice `buf[sent..]`, which the
        // kernel only reads during the call.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                buf[sent..].as_ptr().cast(),
                buf.len() - sent,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n >= 0 {
            sent += n as usize;
            continue;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => {}
            std::io::ErrorKind::WouldBlock => return Ok(sent),
            _ => return Err(e),
        }
    }
    Ok(sent)
}

impl FabricQueue for QueueConn {
    fn qid(&self) -> u16 {
        self.qid
    }
    fn submit(&self, cmd: Cmd) -> Result<(), Cmd> {
        QueueConn::submit(self, cmd)
    }
    fn oldest_outstanding(&self) -> Option<Duration> {
        QueueConn::oldest_outstanding(self)
    }
    fn shutdown(&self) {
        QueueConn::shutdown(self)
    }
    fn join(&self, timeout: Duration) {
        QueueConn::join(self, timeout)
    }
    fn inline_sends(&self) -> (u64, u64) {
        (
            self.inline_sends.load(Ordering::Relaxed),
            self.inline_partial.load(Ordering::Relaxed),
        )
    }
    fn rx_bytes(&self) -> (u64, u64) {
        (
            self.rx_direct.load(Ordering::Relaxed),
            self.rx_copied.load(Ordering::Relaxed),
        )
    }
}

/// ICReq/ICResp on a fresh socket (§3.6.2.2-3), bounded by the queue's timeout.
fn initialize(stream: &TcpStream, p: &QueueParams) -> Result<Negotiated, FabricError> {
    let _ = stream.set_read_timeout(Some(p.timeout));
    let _ = stream.set_write_timeout(Some(p.timeout));
    let mut v = Vec::new();
    IcReq {
        pfv: 0,
        hpda: 0,
        digests: p.digests,
        maxr2t: 0,
    }
    .encode(&mut v);
    let mut s = stream;
    s.write_all(&v)
        .map_err(|e| FabricError::Connect(format!("ICReq: {e}")))?;
    let mut r = [0u8; IC_LEN];
    s.read_exact(&mut r[..CH_LEN])
        .map_err(|e| FabricError::Connect(format!("no ICResp: {e}")))?;
    let ch = CommonHeader::decode(&r);
    if ch.pdu_type == pdu_type::C2H_TERM_REQ {
        return Err(FabricError::Refused(
            "controller rejected ICReq with a C2HTermReq".into(),
        ));
    }
    if ch.pdu_type != pdu_type::IC_RESP || ch.hlen as usize != IC_LEN || ch.plen as usize != IC_LEN
    {
        return Err(FabricError::Protocol(format!(
            "expected ICResp, got PDU type {:#04x} hlen {} plen {}",
            ch.pdu_type, ch.hlen, ch.plen
        )));
    }
    s.read_exact(&mut r[CH_LEN..])
        .map_err(|e| FabricError::Connect(format!("short ICResp: {e}")))?;
    let ic = IcResp::decode(&r);
    if ic.pfv != 0 {
        return Err(FabricError::Protocol(format!(
            "controller speaks NVMe/TCP PDU format version {}",
            ic.pfv
        )));
    }
    if ic.cpda > pdu::MAX_PDA {
        return Err(FabricError::Protocol(format!(
            "ICResp CPDA {} > 31",
            ic.cpda
        )));
    }
    if ic.digests != p.digests {
        return Err(FabricError::Protocol(format!(
            "controller enabled digests {:?}, host asked for {:?}",
            ic.digests, p.digests
        )));
    }
    let maxh2cdata = ic.maxh2cdata as usize;
    if maxh2cdata < 4096 || maxh2cdata % 4 != 0 {
        return Err(FabricError::Protocol(format!(
            "ICResp MAXH2CDATA {maxh2cdata} is below 4096 or not a multiple of 4"
        )));
    }
    Ok(Negotiated {
        cpda: ic.cpda,
        maxh2cdata,
    })
}
