//! One NVMe/TCP connection = one NVMe queue (NVMe/TCP 1.0 §3.3), as a reactor serves it:
//! its state, receiving, deadlines and closing. The PDUs themselves are [`super::pdu`],
//! data transfer and replies [`super::transfer`], commands [`super::command`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::Read;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_shared::nvme::{Command, Status};
use nacre_shared::nvme_tcp::{self as tcp, Digests};
use tracing::{debug, warn};
use vmm_sys_util::epoll::ControlOperation;

use super::command::Slot;
use super::pdu::End;
use super::reactor::{Mail, NewConn, Shared};
use super::transfer::{BufPool, H2cPending, Out};
use crate::auth::queue::QueueAuth;
use crate::frontend::nvme::ctrl::{CtrlQueue, TargetController};
use crate::frontend::nvme::fabrics::HostQueue;
use crate::frontend::nvme::subsystem::{Namespace, Subsystem};
use crate::frontend::nvme::{limits, ConnSlot, TargetInner};
use crate::volume::{self, IoResult};

/// Reply coalescing ([`Conn::hold_replies`]): the fewest commands since the last decision
/// that keep replies held, the longest they are held, and the most bytes held.
const HOLD_MIN_CMDS: u32 = 2;
const MAX_HOLD: Duration = Duration::from_micros(10);
const HOLD_MAX_BYTES: usize = 128 * 1024;

/// The coalescing rule of a serving connection whose socket takes more: hold `pending` bytes
/// of replies another pass when `fresh` commands arrived since the last decision, and they
/// have been held `held_for` (`None`: not yet).
fn should_hold(fresh: u32, pending: usize, held_for: Option<Duration>) -> bool {
    fresh >= HOLD_MIN_CMDS
        && pending > 0
        && pending < HOLD_MAX_BYTES
        && held_for.is_none_or(|d| d < MAX_HOLD)
}

/// Receive buffer of a connected queue: large enough for a whole H2CData PDU carrying
/// MAXH2CDATA bytes, plus room to read ahead.
pub(super) const RBUF_LEN: usize = limits::MAX_TRANSFER + 64 * 1024;
/// Receive buffer until the queue is connected: a Fabrics Connect capsule (72 + 1024 bytes)
/// or any admin capsule with in-capsule data fits; a connection that never connects costs
/// its peer little.
const SETUP_RBUF_LEN: usize = 2 * limits::ADMIN_INLINE_DATA;
/// Replies waiting to be sent beyond which the connection stops reading (and so stops
/// taking commands) until the host has read some: a host that does not read cannot make
/// the target buffer without bound (per queue: this, plus the data of commands already at
/// the volumes, which their slots hold anyway).
const OUT_HIGH: usize = 1 << 20;
/// ... and below which it reads again.
const OUT_LOW: usize = 256 << 10;
/// How long replies may wait on a host that reads nothing before the connection is
/// dropped.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a closing connection may take to deliver its last replies (a C2HTermReq).
const LINGER: Duration = Duration::from_secs(5);

const EV_IN: u32 = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
const EV_OUT: u32 = libc::EPOLLOUT as u32;

/// The part of a queue other threads reach: the controller (keep-alive, SMART log,
/// teardown), volumes completing requests and asynchronous events. Everything else about
/// the queue belongs to its reactor.
pub(crate) struct Queue {
    token: u64,
    reactor: Arc<Shared>,
    last_rx_ms: AtomicU64,
    // Host read/write commands and bytes, for the SMART log.
    pub(super) reads: AtomicU64,
    pub(super) writes: AtomicU64,
    pub(super) read_bytes: AtomicU64,
    pub(super) write_bytes: AtomicU64,
}

impl Queue {
    pub(crate) fn last_rx_ms(&self) -> u64 {
        self.last_rx_ms.load(Ordering::Relaxed)
    }

    pub(crate) fn stats(&self) -> (u64, u64, u64, u64) {
        (
            self.reads.load(Ordering::Relaxed),
            self.writes.load(Ordering::Relaxed),
            self.read_bytes.load(Ordering::Relaxed),
            self.write_bytes.load(Ordering::Relaxed),
        )
    }

    /// Close the connection (its reactor does, at once).
    pub(crate) fn shutdown(&self) {
        self.reactor.post(Mail::Close(self.token));
    }

    /// Complete a parked command from outside the reactor (asynchronous events): the
    /// reactor sends it, so the caller never waits on the host's socket.
    pub(crate) fn complete_async(&self, cid: u16, status: Status, dw0: u32) {
        self.reactor.post(Mail::Async {
            token: self.token,
            cid,
            status,
            dw0,
        });
    }
}

impl volume::IoCompletion for Queue {
    fn complete(&self, tag: u64, result: IoResult) {
        self.reactor.complete(self.token, tag, result);
    }
}

/// Where a connection is in its life.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Phase {
    /// Waiting for the ICReq (NVMe/TCP 1.0 §3.3.1).
    Init,
    /// PDUs flow; before a successful Fabrics Connect the setup deadline applies.
    Serving,
    /// Delivering its last replies (or a C2HTermReq), reading nothing more.
    Closing { until: Instant },
    /// Socket closed; kept only until the volumes have completed what they hold (their
    /// requests point into this connection's buffers).
    Draining,
}

pub(crate) struct Conn {
    pub(super) target: Arc<TargetInner>,
    pub(super) q: Arc<Queue>,
    /// `q` as the completion handle requests carry (made once, not per request).
    pub(super) done: Arc<dyn volume::IoCompletion>,
    pub(super) sock: Option<TcpStream>,
    pub(super) phase: Phase,
    /// Events asked of epoll now.
    interest: u32,
    /// Replies are queued and a flush is due.
    flush_queued: bool,
    /// Commands parsed since the reactor last decided whether to send or hold the replies
    /// ([`Conn::hold_replies`]).
    pub(super) fresh_cmds: u32,
    /// Commands whose replies are queued since the last flush decision that sent them: the
    /// depth the host keeps in flight, as the reactor's poll policy reads it.
    run_cmds: u32,
    /// Since when replies have been held back.
    held_since: Option<Instant>,
    /// Output backed up past [`OUT_HIGH`]: not reading until it drains below [`OUT_LOW`].
    pub(super) backpressure: bool,
    /// Until a queue is connected: when it must be.
    setup_deadline: Option<Instant>,
    /// When the PDU being received must be complete (set once part of it has arrived).
    pub(super) pdu_deadline: Option<Instant>,
    /// This connection's place in its listener's connection counts.
    conn_slot: Option<ConnSlot>,
    /// The TLS PSK identity's (host NQN, subsystem NQN), on a TLS listener.
    pub(super) tls_peer: Option<Box<(String, String)>>,
    /// The host NQN this queue counts against ([`super::ConnLimits::per_host`]).
    pub(super) host_counted: Option<HostQueue>,
    /// DH-HMAC-CHAP on this queue, from its Connect on (NVMe Base 2.0 §8.13).
    pub(super) auth: Option<QueueAuth>,
    pub(super) listener: SocketAddr,
    pub(super) local_ip: IpAddr,
    pub(super) digests: Digests,
    pub(super) hpda: u8,
    pub(super) qid: u16,
    pub(super) sq_flow_disabled: bool,
    pub(super) rbuf: Vec<u8>,
    pub(super) rstart: usize,
    pub(super) rend: usize,
    pub(super) ctrl: Option<Arc<TargetController>>,
    pub(super) subsys: Option<Arc<Subsystem>>,
    pub(super) ns_gen: u64,
    pub(super) ns: BTreeMap<u32, Arc<Namespace>>,
    pub(super) sqsize: u32,
    pub(super) head: u32,
    pub(super) max_inline: usize,
    pub(super) h2c: HashMap<u16, H2cPending>,
    /// Bytes of the R2Ts outstanding (buffers allocated, data not yet all here).
    pub(super) r2t_bytes: usize,
    /// Writes whose R2T waits for budget, oldest first.
    pub(super) r2t_waiting: VecDeque<Command>,
    pub(super) next_ttag: u16,
    /// Commands at the volumes, indexed by request tag.
    pub(super) slots: Vec<Slot>,
    pub(super) free: Vec<u16>,
    pub(super) outstanding: usize,
    /// Data buffers for commands (slots and R2T data), bounded in what it keeps idle.
    pub(super) pool: BufPool,
    pub(super) out: Out,
}

impl Conn {
    pub(super) fn new(token: u64, reactor: Arc<Shared>, nc: NewConn) -> std::io::Result<Conn> {
        let NewConn {
            target,
            sock,
            listener,
            slot,
            tls_peer,
        } = nc;
        sock.set_nonblocking(true)?;
        reactor.ctl(ControlOperation::Add, sock.as_raw_fd(), EV_IN, token)?;
        let local_ip = sock.local_addr().map(|a| a.ip()).unwrap_or(listener.ip());
        // A peer that connects and says nothing must not hold the connection forever: the
        // deadline stays until the queue's Fabrics Connect succeeds; from then on
        // keep-alive watches the controller.
        let setup = Duration::from_millis(target.setup_timeout_ms.load(Ordering::Relaxed));
        let q = Arc::new(Queue {
            token,
            reactor,
            last_rx_ms: AtomicU64::new(target.clock.now_ms()),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            write_bytes: AtomicU64::new(0),
        });
        debug!(peer = ?sock.peer_addr().ok(), "nvmf connection opened");
        Ok(Conn {
            target,
            done: q.clone(),
            q,
            sock: Some(sock),
            phase: Phase::Init,
            interest: EV_IN,
            flush_queued: false,
            fresh_cmds: 0,
            run_cmds: 0,
            held_since: None,
            backpressure: false,
            setup_deadline: Some(Instant::now() + setup),
            pdu_deadline: None,
            conn_slot: Some(slot),
            tls_peer,
            host_counted: None,
            auth: None,
            listener,
            local_ip,
            digests: Digests::NONE,
            hpda: 0,
            qid: 0,
            sq_flow_disabled: false,
            rbuf: vec![0u8; SETUP_RBUF_LEN],
            rstart: 0,
            rend: 0,
            ctrl: None,
            subsys: None,
            ns_gen: 0,
            ns: BTreeMap::new(),
            sqsize: 0,
            head: 0,
            max_inline: limits::ADMIN_INLINE_DATA,
            h2c: HashMap::new(),
            r2t_bytes: 0,
            r2t_waiting: VecDeque::new(),
            next_ttag: 0,
            slots: Vec::new(),
            free: Vec::new(),
            outstanding: 0,
            pool: BufPool::default(),
            out: Out::default(),
        })
    }

    pub(super) fn peer(&self) -> Option<SocketAddr> {
        self.sock.as_ref().and_then(|s| s.peer_addr().ok())
    }

    /// Readiness from epoll.
    pub(super) fn on_ready(&mut self, events: u32) {
        // A hang-up or error while not reading shows when sending fails.
        let hup = (libc::EPOLLHUP | libc::EPOLLERR) as u32;
        if events & EV_OUT != 0 || (events & hup != 0 && !self.reading()) {
            self.flush();
        }
        let readable = (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLHUP | libc::EPOLLERR) as u32;
        if events & readable != 0 && self.reading() {
            self.receive();
        }
    }

    fn reading(&self) -> bool {
        matches!(self.phase, Phase::Init | Phase::Serving) && !self.backpressure
    }

    /// One read (as much as the buffer takes), then every complete PDU in the buffer.
    fn receive(&mut self) {
        if self.rend == self.rbuf.len() {
            if self.rstart == 0 {
                // Cannot happen: PDU validation bounds a PDU by the buffer, and the buffer
                // grows before a PDU that needs more is awaited.
                self.end(End::Closed);
                return;
            }
            self.rbuf.copy_within(self.rstart..self.rend, 0);
            self.rend -= self.rstart;
            self.rstart = 0;
        }
        let Some(sock) = self.sock.as_mut() else {
            return;
        };
        match sock.read(&mut self.rbuf[self.rend..]) {
            Ok(0) => {
                self.end(End::Closed);
                return;
            }
            Ok(k) => {
                self.rend += k;
                self.q
                    .last_rx_ms
                    .store(self.target.clock.now_ms(), Ordering::Relaxed);
            }
            // Level-triggered: a signal or a spurious wake-up is retried on the next pass.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) =>
            {
                return
            }
            Err(_) => {
                self.end(End::Closed);
                return;
            }
        }
        if self.ctrl.as_ref().is_some_and(|c| c.is_dead()) {
            self.end(End::Closed);
            return;
        }
        self.parse();
    }

    /// Handle every complete PDU in the receive buffer, unless output is backed up.
    pub(super) fn parse(&mut self) {
        let mut consumed = false;
        // Commands for a remote volume leave in one send once every PDU read is handled
        // (volume::plug).
        let _plug = crate::volume::plug::Plug::open();
        // One clock read for every PDU this read brought (telemetry::clock): they arrived
        // together. Within a reactor pass, the pass's batch already holds that instant.
        let _batch = crate::telemetry::clock::join();
        while self.reading() {
            if self.out.pending() > OUT_HIGH {
                self.flush();
                if self.out.pending() > OUT_HIGH {
                    self.backpressure = true;
                    self.pdu_deadline = None;
                    self.update_interest();
                    break;
                }
            }
            match self.next_pdu() {
                Ok(true) => consumed = true,
                Ok(false) => break,
                Err(e) => {
                    self.end(e);
                    return;
                }
            }
        }
        self.arm_pdu_deadline(consumed);
    }

    /// A PDU deadline, not a per-read timeout, so a host trickling bytes cannot hold the
    /// connection: it starts when the first bytes of a PDU arrive and ends when the PDU is
    /// complete. Between PDUs an idle queue is keep-alive's business; before Connect the
    /// setup deadline covers it; while the connection is not reading (its replies backed
    /// up) the host is not to blame.
    fn arm_pdu_deadline(&mut self, consumed: bool) {
        if self.ctrl.is_none() || self.backpressure || !self.reading() {
            self.pdu_deadline = None;
            return;
        }
        if self.rend == self.rstart {
            self.pdu_deadline = None;
        } else if consumed || self.pdu_deadline.is_none() {
            let ms = self.target.pdu_timeout_ms.load(Ordering::Relaxed);
            self.pdu_deadline = Some(Instant::now() + Duration::from_millis(ms));
        }
    }

    /// The queue completed its Fabrics Connect: no setup deadline, a full receive buffer.
    pub(super) fn connected(&mut self) {
        self.setup_deadline = None;
        if let Some(s) = &self.conn_slot {
            s.connected();
        }
        if self.rbuf.len() < RBUF_LEN {
            self.rbuf.resize(RBUF_LEN, 0);
        }
    }

    /// The queue's host must authenticate first (DH-HMAC-CHAP): it has the setup timeout
    /// again to do so, or the connection is closed.
    pub(super) fn await_authentication(&mut self) {
        let ms = self.target.setup_timeout_ms.load(Ordering::Relaxed);
        self.setup_deadline = Some(Instant::now() + Duration::from_millis(ms));
    }

    /// The queue authenticated: no deadline any more (a later re-authentication that fails
    /// takes the queue's access away, not its connection).
    pub(super) fn authenticated(&mut self) {
        self.setup_deadline = None;
    }

    /// Send what can be sent now; the rest waits for EPOLLOUT.
    pub(super) fn flush(&mut self) {
        self.flush_queued = false;
        let Some(sock) = self.sock.as_ref() else {
            self.out.discard(&mut self.pool);
            return;
        };
        if let Err(e) = self.out.send(sock, &mut self.pool) {
            debug!(peer = ?self.peer(), "nvmf send failed: {e}");
            self.close_now();
            return;
        }
        if self.out.pending() == 0 {
            if let Phase::Closing { .. } = self.phase {
                self.close_now();
                return;
            }
        }
        if self.backpressure && self.out.pending() < OUT_LOW {
            self.backpressure = false;
            self.update_interest();
            self.parse();
        }
        self.update_interest();
    }

    /// Reply coalescing, decided at the end of each reactor pass: keep the replies queued
    /// for another pass, rather than send them now, while commands keep coming (at least
    /// [`HOLD_MIN_CMDS`] since the last decision), for at most [`MAX_HOLD`] and
    /// [`HOLD_MAX_BYTES`].
    ///
    /// Why: answering every read at once settles host and target into sending a few commands
    /// per system call each way (about 3 at QD32 against `spdk_nvme_perf`, where SPDK's
    /// target settles at about 23), and on TCP the kernel's cost per send and per segment is
    /// most of a target's CPU. A pass that brings one command (QD1) or none is answered at
    /// once, so latency at low depth does not pay for it.
    pub(super) fn hold_replies(&mut self, now: Instant) -> (bool, u32) {
        let fresh = std::mem::take(&mut self.fresh_cmds);
        self.run_cmds += fresh;
        let hold = matches!(self.phase, Phase::Serving)
            && !self.out.blocked()
            && should_hold(
                fresh,
                self.out.pending(),
                self.held_since.map(|t| now.saturating_duration_since(t)),
            );
        if hold {
            self.held_since.get_or_insert(now);
            (true, 0)
        } else {
            self.held_since = None;
            (false, std::mem::take(&mut self.run_cmds))
        }
    }

    /// Whether the reactor should flush this connection at the end of its pass (queued
    /// once per pass).
    pub(super) fn wants_flush(&mut self) -> bool {
        if self.flush_queued || self.out.pending() == 0 || self.sock.is_none() {
            return false;
        }
        // Waiting for EPOLLOUT already: the flush happens when the socket takes more.
        if self.interest & EV_OUT != 0 && self.out.blocked() {
            return false;
        }
        self.flush_queued = true;
        true
    }

    fn update_interest(&mut self) {
        let Some(sock) = self.sock.as_ref() else {
            return;
        };
        let mut want = 0;
        if self.reading() {
            want |= EV_IN;
        }
        if self.out.pending() > 0 && self.out.blocked() {
            want |= EV_OUT;
        }
        if want != self.interest {
            let fd = sock.as_raw_fd();
            if self
                .q
                .reactor
                .ctl(ControlOperation::Modify, fd, want, self.q.token)
                .is_ok()
            {
                self.interest = want;
            }
        }
    }

    /// The connection ends: a fatal error is reported with a C2HTermReq after the replies
    /// already queued; either way what is queued is still delivered (for a while).
    pub(super) fn end(&mut self, e: End) {
        if !matches!(self.phase, Phase::Init | Phase::Serving) {
            return;
        }
        if let End::Fatal { fes, fei, hdr } = e {
            warn!(
                peer = ?self.peer(),
                fes, fei, "fatal NVMe/TCP transport error: terminating the connection"
            );
            tcp::encode_term_req(self.out.buf(), true, fes, fei, &hdr);
        }
        self.phase = Phase::Closing {
            until: Instant::now() + LINGER,
        };
        self.pdu_deadline = None;
        self.flush();
    }

    /// The controller asked for the connection to close.
    pub(super) fn request_close(&mut self) {
        self.close_now();
    }

    /// Close the socket now and leave the controller, the host's queue count and the
    /// listener's count; the connection lingers only while volumes hold its buffers.
    pub(super) fn close_now(&mut self) {
        if let Some(sock) = self.sock.take() {
            let _ = self
                .q
                .reactor
                .ctl(ControlOperation::Delete, sock.as_raw_fd(), 0, 0);
            let _ = sock.shutdown(Shutdown::Both);
            debug!(peer = ?sock.peer_addr().ok(), "nvmf connection closed");
        }
        self.out.discard(&mut self.pool);
        self.phase = Phase::Draining;
        self.setup_deadline = None;
        self.pdu_deadline = None;
        self.leave();
        self.conn_slot = None;
    }

    fn leave(&mut self) {
        self.host_counted = None;
        self.auth = None;
        if let Some(c) = self.ctrl.take() {
            if self.qid == 0 {
                // The admin queue ends the association (NVMe-oF 1.1 §3.6).
                if let Some(s) = &self.subsys {
                    s.remove_controller(c.cntlid);
                }
                c.teardown();
                debug!(cntlid = c.cntlid, "controller destroyed");
            } else {
                c.detach_queue(self.qid);
            }
        }
    }

    /// The connection is gone and nothing of it is at a volume: drop it.
    pub(super) fn finished(&self) -> bool {
        self.phase == Phase::Draining && self.outstanding == 0
    }

    /// The earliest deadline of this connection (setup, PDU, stalled send, linger).
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        match self.phase {
            Phase::Closing { until } => Some(until),
            Phase::Draining => None,
            _ => [
                self.setup_deadline,
                self.pdu_deadline,
                self.out.stalled_since().map(|t| t + WRITE_TIMEOUT),
            ]
            .into_iter()
            .flatten()
            .min(),
        }
    }

    pub(super) fn on_deadline(&mut self, now: Instant) {
        if let Phase::Closing { .. } = self.phase {
            debug!(peer = ?self.peer(), "nvmf connection could not deliver its last replies");
            self.close_now();
            return;
        }
        let past = |d: Option<Instant>| d.is_some_and(|d| now >= d);
        if past(self.setup_deadline) && self.ctrl.is_some() {
            warn!(
                peer = ?self.peer(),
                "nvmf queue did not authenticate in time: closing it"
            );
        } else if past(self.setup_deadline) {
            debug!(peer = ?self.peer(), "nvmf connection did not connect a queue in time: closing it");
        } else if past(self.pdu_deadline) {
            warn!(
                peer = ?self.peer(),
                "host stalled in the middle of a PDU: closing the connection"
            );
        } else if self.out.stalled_for(now) > WRITE_TIMEOUT {
            warn!(peer = ?self.peer(), "host has read nothing for {WRITE_TIMEOUT:?}: closing the connection");
        }
        self.close_now();
    }

    /// The reactor is stopping: close, and if volumes still hold buffers of this
    /// connection, leave those buffers to them (leaked) rather than free memory a request
    /// may still write.
    pub(super) fn abandon(&mut self) {
        self.close_now();
        for s in &mut self.slots {
            if s.busy {
                std::mem::forget(std::mem::take(&mut s.buf));
            }
        }
    }
}

/// What the controller needs of a TCP queue (keep-alive, SMART counters, teardown, AENs).
impl CtrlQueue for Queue {
    fn last_rx_ms(&self) -> u64 {
        Queue::last_rx_ms(self)
    }
    fn stats(&self) -> (u64, u64, u64, u64) {
        Queue::stats(self)
    }
    fn shutdown(&self) {
        Queue::shutdown(self)
    }
    fn complete_async(&self, cid: u16, status: Status, dw0: u32) {
        Queue::complete_async(self, cid, status, dw0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_held_only_while_commands_keep_coming_and_briefly() {
        let us = Duration::from_micros;
        // QD1: one command per pass is answered at once (latency does not pay).
        assert!(!should_hold(1, 4096, None));
        // A pass that brought nothing new: the host waits for us.
        assert!(!should_hold(0, 4096, Some(us(3))));
        // Commands keep coming: hold, also on the next pass.
        assert!(should_hold(4, 16 * 1024, None));
        assert!(should_hold(3, 40 * 1024, Some(us(5))));
        // Never past the time or byte bound, and never with nothing to send.
        assert!(!should_hold(8, 16 * 1024, Some(MAX_HOLD)));
        assert!(!should_hold(8, HOLD_MAX_BYTES, None));
        assert!(!should_hold(8, 0, None));
    }
}
