//! Sessions of a controller: losing one, reconnecting, keep-alive and teardown.
//!
//! ## Losing it, and the knobs SPDK users know
//! A *session* is one association: the admin queue and the I/O queues. Any queue failing
//! (transport error, protocol violation, keep-alive timeout) ends the whole session — its
//! other queues are shut down at once — and the controller goes to `Connecting`:
//! * Outstanding and new I/O is **held**, not failed. The commands have not been completed
//!   to anyone, and a held command is resent on the next association as if new.
//! * Reconnection is tried at once (after the controller's Command Quiesce Time, CQT), then
//!   every `reconnect_delay`.
//! * After `fast_io_fail_timeout` held I/O fails with [`IoError::PathLost`] and new I/O fails
//!   at once, while reconnection goes on.
//! * After `ctrl_loss_timeout` the controller is `Failed`: every I/O fails with
//!   [`IoError::PathFailed`] (an NVMe host behind nacred sees DNR), reconnection stops. `None`
//!   means retry forever; zero means fail on the first loss.
//!
//! ## Why resending an unacknowledged write is safe
//! A block device promises nothing about the order of writes that are in flight together: a
//! submitter that needs one write to land before another waits for the first completion
//! before issuing the second (that is what filesystems and databases do; virtio-blk and NVMe
//! give no other guarantee). A write that was never completed to the submitter may thus
//! land once, twice or — if the connection died before the target saw it — not at all before
//! the resend; each outcome leaves the range holding the data of that one write, which is
//! what the submitter asked for. The danger is the *old* copy landing late, after the resend
//! completed and the submitter issued a newer write to the same blocks (SPDK #3593 is what
//! ignoring it costs). So the old session's sockets are shut down before anything is resent,
//! and nothing it sent is resent — on a new session or, for multipath, on another path —
//! before `quiesce_time` has passed since the loss, or the controller's Command Quiesce Time
//! (Identify Controller bytes 386-387) if that is longer: the bound the spec gives for a
//! controller to stop processing commands of a lost association. Commands that never went
//! out need no such wait.
//!
//! ## Keep-alive (NVMe Base 2.0 §3.9)
//! A Keep Alive command goes out every KATO/2 on the admin queue; if one has not completed
//! within KATO, the session is declared dead. This is also what catches a controller that
//! stalls without closing the connection.
//!
//! ## Teardown
//! Closing never waits on the network for long: a live controller gets a normal shutdown
//! notification (CC.SHN) bounded by `shutdown_timeout`, then every socket is shut down and the
//! queues' receiving threads hand back what was outstanding, which fails with `PathFailed`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use nacre_shared::nvme::fabrics::{ConnectData, CNTLID_DYNAMIC};
use nacre_shared::nvme::identify;
use nacre_shared::nvme::registers::{self, cc};
use nacre_shared::nvme::{admin_opcode, Command};
use tracing::{info, warn};

use super::admin::{bring_up, check_identity, property_set, queue_entry_sizes, set_queue_count};
use super::auth;
use super::{ControllerConfig, ControllerInfo, Ctrl, NamespaceInfo, Phase, Session, St};
use crate::fabric::cmd::{AdminWait, Cmd, Dir, Target};
use crate::fabric::queue::{self, Queue, QueueOwner, QueueParams, Transport, MAX_DEPTH};
use crate::fabric::FabricError;
use crate::volume::IoError;

/// Admin queue depth (commands in flight; the SQ has one entry more: 32 like Linux).
const ADMIN_DEPTH: u16 = 31;

impl Ctrl {
    /// End the current session (if it is `session`) and start reconnecting.
    pub(super) fn lose_session(&self, session: u64, reason: &str) {
        let mut st = self.lock();
        let Some(s) = st.session.clone() else { return };
        if s.id != session {
            return;
        }
        st.session = None;
        self.publish(&st, None);
        st.resets += 1;
        st.last_error = Some(reason.to_string());
        let mut to_fail = Vec::new();
        if st.phase == Phase::Live {
            st.phase = Phase::Connecting;
            let now = Instant::now();
            st.since = now;
            st.fail_fast = false;
            st.next_attempt = self.quiesce_deadline(&st);
            if st.cfg_zero_loss(&self.cfg) {
                st.phase = Phase::Failed;
                to_fail.extend(st.held.drain(..));
            }
        }
        drop(st);
        warn!(controller = %self.name, reason, "session lost; reconnecting per reconnect_delay/ctrl_loss_timeout");
        s.shutdown();
        for c in to_fail {
            c.fail(IoError::PathFailed);
        }
        self.notify();
    }

    /// Reset on request (OPI's `ResetNvmeRemoteController`): end the live session and
    /// connect again, as when a session is lost (its commands in flight are held and resent
    /// on the new session, after the quiesce time), with one difference: the controller
    /// gets at least one attempt even under `ctrl_loss_timeout` 0, which would fail it on a
    /// loss. A controller that is connecting tries at once; a failed one starts connecting
    /// again (the loss timeout counted from now). A closed one is an error.
    pub(super) fn reset(&self) -> Result<(), FabricError> {
        let mut st = self.lock();
        let now = Instant::now();
        let session = match st.phase {
            Phase::Closed => return Err(FabricError::Failed("controller is closed".into())),
            Phase::Live => {
                let s = st.session.take();
                self.publish(&st, None);
                st.resets += 1;
                s
            }
            Phase::Connecting | Phase::Failed => None,
        };
        let was_live = session.is_some();
        st.phase = Phase::Connecting;
        st.last_error = Some("reset on request".into());
        st.since = now;
        st.fail_fast = false;
        // The loss timeout gives up only after an attempt (see `supervise`): the reset's.
        st.attempts = 0;
        st.next_attempt = if was_live {
            self.quiesce_deadline(&st)
        } else {
            now
        };
        drop(st);
        info!(controller = %self.name, "controller reset on request; reconnecting");
        if let Some(s) = session {
            s.shutdown();
        }
        self.notify();
        Ok(())
    }

    pub(super) fn close(&self) {
        let mut st = self.lock();
        if st.phase == Phase::Closed {
            return;
        }
        let was_live = st.phase == Phase::Live;
        st.phase = Phase::Closed;
        let session = st.session.take();
        self.publish(&st, None);
        let held: Vec<_> = st.held.drain(..).collect();
        drop(st);
        self.notify();
        for c in held {
            c.fail(IoError::PathFailed);
        }
        if let Some(s) = session {
            if was_live {
                // Normal shutdown notification (§3.6.2), bounded: a dead controller costs
                // at most shutdown_timeout, never tens of seconds.
                let deadline = Instant::now() + self.cfg.shutdown_timeout;
                let _ = property_set(
                    &*s.admin,
                    registers::CC,
                    cc::EN | cc::SHN_NORMAL << cc::SHN_SHIFT | queue_entry_sizes(),
                    deadline,
                );
            }
            s.shutdown();
            let bound = self.cfg.shutdown_timeout;
            s.admin.join(bound);
            for q in &s.io {
                q.join(bound);
            }
        }
        info!(controller = %self.name, "controller closed");
    }

    /// The supervisor: connects, reconnects, keeps alive, and applies the timeouts.
    pub(super) fn supervise(self: Arc<Self>) {
        loop {
            let mut st = self.lock();
            match st.phase {
                Phase::Closed => return,
                Phase::Failed => {
                    drop(self.cv.wait(st));
                    continue;
                }
                Phase::Live => {
                    let kato = self.cfg.keep_alive_timeout;
                    let mut tick = Duration::from_secs(3600);
                    if !kato.is_zero() {
                        tick = tick.min(kato / 2);
                    }
                    if let Some(t) = self.cfg.io_timeout {
                        tick = tick.min(t / 4);
                    }
                    let s = st.session.clone().expect("live has a session");
                    drop(
                        self.cv
                            .wait_timeout(st, tick.max(Duration::from_millis(1)))
                            .unwrap_or_else(|p| p.into_inner()),
                    );
                    if self.phase() != Phase::Live {
                        continue;
                    }
                    if let Some(t) = self.cfg.io_timeout {
                        let oldest = s.io.iter().filter_map(|q| q.oldest_outstanding()).max();
                        if oldest.is_some_and(|o| o >= t) {
                            self.lose_session(
                                s.id,
                                &format!(
                                    "I/O timeout: a command has been outstanding for over {:.1} s",
                                    t.as_secs_f64()
                                ),
                            );
                            continue;
                        }
                    }
                    if !kato.is_zero() {
                        self.keep_alive(&s, kato);
                    }
                    continue;
                }
                Phase::Connecting => {}
            }
            let now = Instant::now();
            let lost_for = now - st.since;
            if let Some(loss) = self.cfg.ctrl_loss_timeout {
                // The very first connection of a controller also gives up after the loss
                // timeout (a replayed remote that never comes back ends up Failed, visibly).
                if lost_for >= loss && st.attempts > 0 {
                    st.phase = Phase::Failed;
                    st.last_error = Some(format!(
                        "controller lost for {:.1} s (ctrl_loss_timeout): {}",
                        lost_for.as_secs_f64(),
                        st.last_error.clone().unwrap_or_default()
                    ));
                    let held: Vec<_> = st.held.drain(..).collect();
                    let msg = st.last_error.clone().unwrap_or_default();
                    drop(st);
                    warn!(controller = %self.name, error = %msg, "controller failed");
                    for c in held {
                        c.fail(IoError::PathFailed);
                    }
                    self.notify();
                    continue;
                }
            }
            if let Some(ff) = self.cfg.fast_io_fail_timeout {
                if lost_for >= ff && !st.fail_fast {
                    st.fail_fast = true;
                    let held: Vec<_> = st.held.drain(..).collect();
                    drop(st);
                    info!(controller = %self.name, "fast_io_fail_timeout: failing I/O while reconnecting");
                    for c in held {
                        c.fail(IoError::PathLost);
                    }
                    self.notify();
                    continue;
                }
            }
            let quiesced = self.quiesce_deadline(&st);
            if now >= quiesced && st.held.iter().any(|c| c.release) {
                let (go, keep): (Vec<Cmd>, Vec<Cmd>) = st.held.drain(..).partition(|c| c.release);
                st.held = keep.into();
                drop(st);
                for c in go {
                    c.fail(IoError::PathLost);
                }
                continue;
            }
            if now < st.next_attempt {
                let mut wake = st.next_attempt;
                if st.held.iter().any(|c| c.release) {
                    wake = wake.min(quiesced);
                }
                if let Some(l) = self.cfg.ctrl_loss_timeout {
                    wake = wake.min(st.since + l);
                }
                if let (Some(f), false) = (self.cfg.fast_io_fail_timeout, st.fail_fast) {
                    wake = wake.min(st.since + f);
                }
                let d = wake
                    .saturating_duration_since(now)
                    .max(Duration::from_millis(1));
                let _ = self.cv.wait_timeout(st, d);
                continue;
            }
            let id = st.next_session;
            st.next_session += 1;
            let expected = st.expected.clone();
            drop(st);
            let res = self.establish(id, expected.as_deref());
            let mut st = self.lock();
            st.attempts += 1;
            match res {
                Ok((s, info)) => {
                    if st.phase != Phase::Connecting {
                        drop(st);
                        s.shutdown();
                        continue;
                    }
                    self.max_transfer
                        .store(info.max_transfer, Ordering::Relaxed);
                    self.oncs.store(info.oncs as usize, Ordering::Relaxed);
                    if st.expected.is_none() {
                        st.expected = Some(info.namespaces.clone());
                    }
                    st.info = Some(info);
                    st.session = Some(s.clone());
                    st.phase = Phase::Live;
                    st.fail_fast = false;
                    st.connects += 1;
                    self.publish(&st, Some(s.clone()));
                    let held: Vec<_> = st.held.drain(..).collect();
                    drop(st);
                    info!(controller = %self.name, session = id, resent = held.len(), "controller live");
                    for c in held {
                        if let Err(c) = s.pick_rr().submit(c) {
                            self.hold(c);
                        }
                    }
                    self.notify();
                }
                Err(FabricError::IdentityChanged(msg) | FabricError::Auth(msg)) => {
                    st.phase = Phase::Failed;
                    st.last_error = Some(msg.clone());
                    let held: Vec<_> = st.held.drain(..).collect();
                    drop(st);
                    warn!(controller = %self.name, error = %msg, "controller failed");
                    for c in held {
                        c.fail(IoError::PathFailed);
                    }
                    self.notify();
                }
                Err(e) => {
                    st.last_error = Some(e.to_string());
                    st.next_attempt = Instant::now() + self.cfg.reconnect_delay;
                    drop(st);
                    info!(controller = %self.name, error = %e, "connection attempt failed");
                    self.notify();
                }
            }
        }
    }

    fn keep_alive(&self, s: &Arc<Session>, kato: Duration) {
        let mut ka = s.ka.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((sent, w)) = ka.as_ref() {
            if !w.is_done() {
                if sent.elapsed() >= kato {
                    drop(ka);
                    self.lose_session(s.id, "keep-alive timeout: the controller stopped answering");
                }
                return;
            }
        }
        let w = AdminWait::with_buf(Vec::new());
        let sqe = Command {
            opcode: admin_opcode::KEEP_ALIVE,
            ..Default::default()
        };
        *ka = Some((Instant::now(), w.clone()));
        drop(ka);
        if let Err(c) = s.admin.submit(Cmd {
            sqe,
            dir: Dir::None,
            len: 0,
            target: Target::Admin(w),
            release: true,
        }) {
            c.fail(IoError::PathLost);
        }
    }

    /// Build a new session (module docs: bringing a controller up).
    fn establish(
        self: &Arc<Self>,
        id: u64,
        expected: Option<&[NamespaceInfo]>,
    ) -> Result<(Arc<Session>, ControllerInfo), FabricError> {
        let cfg = &self.cfg;
        let deadline = Instant::now() + cfg.connect_timeout * 4;
        let owner: Weak<dyn QueueOwner> = Arc::downgrade(&(self.clone() as Arc<dyn QueueOwner>));
        let mut cd = ConnectData {
            hostid: cfg.hostid,
            cntlid: CNTLID_DYNAMIC,
            subnqn: cfg.subnqn.clone(),
            hostnqn: cfg.hostnqn.clone(),
        };
        let params = QueueParams {
            qid: 0,
            depth: ADMIN_DEPTH,
            digests: cfg.digests,
            kato_ms: cfg.keep_alive_timeout.as_millis().min(u32::MAX as u128) as u32,
            icd_max: 0,
            timeout: cfg.connect_timeout,
            tls: auth::load_tls_psk(cfg)?,
        };
        let tls = params.tls.clone();
        let keys = auth::load_keys(cfg)?;
        let (admin, cqe) = queue::open(cfg, params, &cd, id, owner.clone())?;
        let guard = ShutdownGuard(vec![admin.clone()]);
        let mut guard = guard;
        auth::authenticate(&*admin, cqe.dw0, keys.as_ref(), self.next_t_id(), deadline)?;
        let cntlid = cqe.dw0 as u16;
        let info = bring_up(&*admin, cfg, deadline)?;
        if let Some(exp) = expected {
            check_identity(exp, &info.0.namespaces)?;
        }
        let (mut info, mqes) = info;
        info.cntlid = cntlid;
        if cfg.transport == Transport::Rdma {
            // Each NVMe/RDMA slot has a registered buffer of this size (rdma.rs).
            info.max_transfer = info.max_transfer.min(crate::fabric::rdma::MAX_TRANSFER);
        }
        // I/O queues.
        let want = cfg.io_queues.max(1);
        let granted = set_queue_count(&*admin, want, deadline)?;
        let depth = cfg.queue_depth.clamp(1, MAX_DEPTH - 1).min(mqes.max(1));
        cd.cntlid = cntlid;
        let mut io = Vec::new();
        for qid in 1..=granted {
            let p = QueueParams {
                qid,
                depth,
                digests: cfg.digests,
                kato_ms: 0,
                icd_max: info_icd(cfg, &info),
                timeout: cfg.connect_timeout,
                tls: tls.clone(),
            };
            let (q, cqe) = queue::open(cfg, p, &cd, id, owner.clone())?;
            guard.0.push(q.clone());
            auth::authenticate(&*q, cqe.dw0, keys.as_ref(), self.next_t_id(), deadline)?;
            io.push(q);
        }
        info.io_queues = granted;
        info.queue_depth = depth;
        guard.0.clear();
        Ok((
            Arc::new(Session {
                id,
                admin,
                io,
                rr: AtomicUsize::new(0),
                ka: Mutex::new(None),
                bounced: self.bounced.clone(),
                direct: self.direct.clone(),
            }),
            info,
        ))
    }
}

/// Shuts queues down if a session fails half-way through being built.
struct ShutdownGuard(Vec<Queue>);
impl Drop for ShutdownGuard {
    fn drop(&mut self) {
        for q in &self.0 {
            q.shutdown();
        }
    }
}

impl St {
    fn cfg_zero_loss(&self, cfg: &ControllerConfig) -> bool {
        cfg.ctrl_loss_timeout == Some(Duration::ZERO)
    }
}

impl QueueOwner for Ctrl {
    fn queue_closed(&self, session: u64, qid: u16, reason: String, cmds: Vec<Cmd>) {
        self.lose_session(session, &format!("queue {qid}: {reason}"));
        for c in cmds {
            if c.is_io() {
                self.hold_cmd(c, true);
            } else {
                c.fail(IoError::PathLost);
            }
        }
    }
}

/// In-capsule data for I/O queues: what the host wants, capped by what the controller takes
/// — IOCCSZ (16-byte units, including the 64-byte SQE) and SGLS bit 20 (Offset SGLs, the
/// only form in-capsule data can take). A controller without it gets every write by R2T.
pub(super) fn info_icd(cfg: &ControllerConfig, info: &ControllerInfo) -> usize {
    if info.sgls & identify::SGLS_OFFSET == 0 {
        return 0;
    }
    let ctrl = (info.ioccsz as usize * 16).saturating_sub(64);
    cfg.in_capsule_data_size.min(ctrl)
}
