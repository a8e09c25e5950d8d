//! The completion side of an NVMe/RDMA host queue: the thread that polls the completion
//! queue (bounded busy-poll, then the completion channel), takes response capsules,
//! releases slots, notices disconnects, and at the end hands every outstanding command
//! back to the owner (module docs of [`super`]).

use std::ffi::CStr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use nacre_shared::nvme::Completion as Cqe;
use rdma_sys::*;
use tracing::debug;

use super::connect::event_name;
use super::{RdmaQueue, BUSY_POLL, IDLE_WAKE_MS, POLL_BATCH, RSP_LEN, WR_RECV, WR_SEND};
use crate::fabric::cmd::{Cmd, Dir};
use crate::fabric::queue::split_cid;
use crate::rdma::verbs;
use crate::volume::IoError;

impl RdmaQueue {
    /// The completion thread (module docs).
    pub(super) fn run(self: Arc<Self>) {
        // SAFETY: ibv_wc is plain data; zeroed entries are overwritten by ibv_poll_cq.
        let mut wcs: Vec<ibv_wc> = (0..POLL_BATCH)
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        // SAFETY: the channel lives as long as self.
        let comp_fd = unsafe { (*self.comp).fd };
        let mut last_work = Instant::now();
        let reason = loop {
            if self.dead.load(Ordering::Acquire) {
                break "queue shut down".to_string();
            }
            match self.poll(&mut wcs) {
                Err(r) => break r,
                Ok(n) if n > 0 => {
                    last_work = Instant::now();
                    continue;
                }
                Ok(_) => {}
            }
            if last_work.elapsed() < BUSY_POLL {
                std::hint::spin_loop();
                continue;
            }
            // Arm, then poll once more: a completion between the last poll and the arming
            // would otherwise raise no event.
            // SAFETY: valid CQ.
            unsafe { ibv_req_notify_cq(self.cq, 0) };
            match self.poll(&mut wcs) {
                Err(r) => break r,
                Ok(n) if n > 0 => {
                    last_work = Instant::now();
                    continue;
                }
                Ok(_) => {}
            }
            let _ = verbs::wait_readable(&[comp_fd, self.ch.fd()], IDLE_WAKE_MS);
            self.drain_cq_events();
            if let Some(r) = self.cm_events() {
                break r;
            }
        };
        self.dead.store(true, Ordering::Release);
        self.disconnect();
        self.drain_cq_events();
        // Hand every outstanding command back; nothing completes them here any more.
        let cmds: Vec<Cmd> = {
            let mut s = self.lock();
            s.closed = true;
            let mut v: Vec<Cmd> = s.entries.iter_mut().filter_map(|e| e.cmd.take()).collect();
            v.extend(s.overflow.drain(..));
            v
        };
        debug!(
            qid = self.qid,
            reason = %reason,
            outstanding = cmds.len(),
            completed = self.completed.load(Ordering::Relaxed),
            in_capsule = self.in_capsule.load(Ordering::Relaxed),
            bounced_bytes = self.bounced_bytes.load(Ordering::Relaxed),
            "NVMe/RDMA queue closed"
        );
        match self.owner.upgrade() {
            Some(o) => o.queue_closed(self.session, self.qid, reason, cmds),
            None => {
                for c in cmds {
                    c.fail(IoError::PathLost);
                }
            }
        }
    }

    pub(super) fn disconnect(&self) {
        if !self.disconnected.swap(true, Ordering::AcqRel) {
            // SAFETY: valid id; moves the queue pair to the error state (outstanding work
            // requests flush) and tells the controller.
            unsafe { rdma_disconnect(self.id) };
        }
    }

    /// Acknowledge completion channel events (the CQ is polled right after).
    fn drain_cq_events(&self) {
        let mut n = 0;
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut libc::c_void = std::ptr::null_mut();
            // SAFETY: non-blocking channel of ours; returns -1 (EAGAIN) when empty.
            if unsafe { ibv_get_cq_event(self.comp, &mut cq, &mut ctx) } != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: acknowledges the events just taken from this CQ's channel.
            unsafe { ibv_ack_cq_events(self.cq, n) };
        }
    }

    /// CM events after establishment: any disconnect ends the queue.
    fn cm_events(&self) -> Option<String> {
        while let Ok(Some(ev)) = self.ch.get(0) {
            use rdma_cm_event_type::*;
            match ev.kind {
                RDMA_CM_EVENT_DISCONNECTED
                | RDMA_CM_EVENT_DEVICE_REMOVAL
                | RDMA_CM_EVENT_TIMEWAIT_EXIT
                | RDMA_CM_EVENT_ADDR_CHANGE => {
                    self.disconnected.store(true, Ordering::Release);
                    return Some(format!("RDMA connection lost: {}", event_name(ev.kind)));
                }
                k => debug!(qid = self.qid, event = %event_name(k), "RDMA CM event ignored"),
            }
        }
        None
    }

    fn poll(&self, wcs: &mut [ibv_wc]) -> Result<usize, String> {
        // SAFETY: `wcs` has room for its length of entries.
        let n = unsafe { ibv_poll_cq(self.cq, wcs.len() as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err("ibv_poll_cq failed".into());
        }
        for w in &wcs[..n as usize] {
            let (wr_id, status, byte_len) = (w.wr_id, w.status, w.byte_len);
            self.completion(wr_id, status, byte_len)?;
        }
        Ok(n as usize)
    }

    fn completion(&self, wr_id: u64, status: u32, byte_len: u32) -> Result<(), String> {
        let idx = (wr_id & 0xFFFF_FFFF) as usize;
        let kind = wr_id & !0xFFFF_FFFF;
        if status != ibv_wc_status::IBV_WC_SUCCESS {
            // SAFETY: ibv_wc_status_str returns a static string for any value.
            let what = unsafe { CStr::from_ptr(ibv_wc_status_str(status)) }.to_string_lossy();
            return Err(format!(
                "{} work request failed: {what}",
                if kind == WR_RECV { "RECV" } else { "SEND" }
            ));
        }
        match kind {
            WR_RECV => self.on_response(idx, byte_len as usize),
            WR_SEND => {
                let failed = {
                    let mut s = self.lock();
                    let Some(slot) = s.entries.get_mut(idx) else {
                        return Err(format!("SEND completion for unknown slot {idx}"));
                    };
                    slot.sending = false;
                    self.release_when_done(&mut s, idx)
                };
                if !failed.is_empty() {
                    return Err(self.give_back(failed));
                }
                Ok(())
            }
            _ => Err(format!(
                "completion with unknown work request id {wr_id:#x}"
            )),
        }
    }

    /// Commands a failed post handed back go into the table's hand-back at close.
    fn give_back(&self, cmds: Vec<Cmd>) -> String {
        let mut s = self.lock();
        s.overflow.extend(cmds);
        "ibv_post_send failed".into()
    }

    /// A response capsule arrived in RECV buffer `r` (NVMe RDMA 1.0 §3.2: one CQE).
    fn on_response(&self, r: usize, len: usize) -> Result<(), String> {
        if r >= self.recv_n {
            return Err(format!("RECV completion for unknown buffer {r}"));
        }
        if len < RSP_LEN {
            return Err(format!("response capsule of {len} bytes (a CQE is 16)"));
        }
        let cqe = {
            let b = self.recv.as_ref().expect("registered at setup");
            // SAFETY: RECV buffer r is ours until re-posted below; 16 bytes in bounds.
            let raw = unsafe { std::slice::from_raw_parts(b.ptr.add(r * RSP_LEN), RSP_LEN) };
            Cqe::decode(raw)
        };
        if !self.post_recv(r) {
            return Err("cannot re-post a RECV buffer".into());
        }
        let (idx, gen) = split_cid(cqe.cid);
        let taken = {
            let mut s = self.lock();
            match s.entries.get_mut(idx) {
                Some(slot) if slot.gen == gen && slot.cmd.is_some() => {
                    slot.answered = true;
                    slot.cmd.take().map(|c| (c, slot.direct.take()))
                }
                _ => None,
            }
        };
        let Some((cmd, direct)) = taken else {
            return Err(format!(
                "response for CID {:#06x}, which is not outstanding",
                cqe.cid
            ));
        };
        // Data moved straight into the request's memory needs no copy; its registration is
        // held until here (the controller's RDMA WRITEs precede its response).
        let copy_out = direct.is_none();
        drop(direct);
        if copy_out && cmd.dir == Dir::C2H && cmd.len > 0 && cqe.status().is_success() {
            // SAFETY: the slot is answered but not released (only this thread releases),
            // and the controller's RDMA WRITEs precede its response on the queue pair.
            let b = unsafe { self.data_buf(idx, cmd.len) };
            cmd.write_data(0, b);
            self.bounced_bytes
                .fetch_add(cmd.len as u64, Ordering::Relaxed);
        }
        self.completed.fetch_add(1, Ordering::Relaxed);
        cmd.complete(cqe);
        let failed = self.release_when_done(&mut self.lock(), idx);
        if !failed.is_empty() {
            return Err(self.give_back(failed));
        }
        Ok(())
    }
}
