//! Setting an NVMe/RDMA host queue up (module docs of [`super`], NVMe RDMA 1.0 §3.1): the
//! RDMA CM steps, the verbs objects and registered buffers, the RECV ring, the completion
//! thread and Fabrics Connect; and tearing the queue down when its last reference goes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use nacre_shared::nvme::command::SQE_LEN;
use nacre_shared::nvme::fabrics::{Connect, ConnectData, CONNECT_DATA_LEN};
use nacre_shared::nvme::Completion as Cqe;
use rdma_sys::*;
use tracing::debug;

use super::connect::{no_rdma, wait_cm};
use super::pd::Pd;
use super::{RdmaQueue, Slot, Slots, MAX_RESPONDER_RESOURCES, MAX_TRANSFER, RSP_LEN};
use crate::fabric::cmd::{AdminWait, Cmd, Dir, Target};
use crate::fabric::queue::{FabricQueue, Queue, QueueOwner, QueueParams, MAX_DEPTH};
use crate::fabric::{ControllerConfig, FabricError};
use crate::rdma::cm::{self, CmRequest};
use crate::rdma::verbs::{self, EventChannel, RawAddr, RegBuf};
use crate::telemetry::clock;
use crate::volume::IoError;

impl Drop for RdmaQueue {
    fn drop(&mut self) {
        // SAFETY: the last reference is gone: nothing polls or posts any more, and the
        // completion thread acknowledged every completion channel event.
        unsafe { verbs::destroy_queue_objects(self.id, self.cq, self.comp) };
        // Memory regions before their protection domain: what slots of commands handed
        // back when the queue died still hold, the queue's own buffers, and (if this was
        // the device's last queue) the zero-copy registrations of announced memory.
        for slot in &mut self
            .slots
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .entries
        {
            slot.direct = None;
        }
        self.recv = None;
        self.send = None;
        self.data.clear();
        if let Some(pd) = self.shared_pd.take() {
            pd.queue_gone();
        }
        // SAFETY: the id goes after every object made on its device context (the shared
        // domain may outlive it: librdmacm keeps the context open), and before its channel
        // (a field, dropped after this body).
        unsafe {
            if !self.id.is_null() {
                rdma_destroy_id(self.id);
            }
        }
    }
}

impl RdmaQueue {
    /// Set up the queue pair (module docs), start its completion thread and send Fabrics
    /// Connect. Returns the queue and the Connect completion (CNTLID in Dword 0 for the
    /// admin queue).
    pub fn open(
        cfg: &ControllerConfig,
        params: QueueParams,
        connect_data: &ConnectData,
        session: u64,
        owner: Weak<dyn QueueOwner>,
    ) -> Result<(Queue, Cqe), FabricError> {
        if verbs::device_count() == 0 {
            return Err(no_rdma(""));
        }
        let addr = cfg.socket_addr()?;
        let qid = params.qid;
        let deadline = Instant::now() + params.timeout;
        let step_ms = params.timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        let depth = params.depth.clamp(1, MAX_DEPTH - 1) as usize;
        let icd_max = if qid == 0 { 0 } else { params.icd_max };
        let ch = EventChannel::new().map_err(|e| no_rdma(&format!(" usable ({e})")))?;
        let mut q = RdmaQueue {
            qid,
            session,
            addr,
            ch,
            id: std::ptr::null_mut(),
            pd: std::ptr::null_mut(),
            comp: std::ptr::null_mut(),
            cq: std::ptr::null_mut(),
            recv: None,
            // HRQSIZE: responses we can take at once, one per SQ entry (HSQSIZE + 1).
            recv_n: depth + 1,
            send: None,
            capsule_len: SQE_LEN + icd_max,
            data: Vec::new(),
            icd_max,
            slots: Mutex::new(Slots {
                entries: Vec::new(),
                free: Vec::new(),
                overflow: VecDeque::new(),
                closed: false,
            }),
            owner,
            dead: AtomicBool::new(false),
            disconnected: AtomicBool::new(false),
            completed: AtomicU64::new(0),
            bounced_bytes: AtomicU64::new(0),
            in_capsule: AtomicU64::new(0),
            direct_bytes: AtomicU64::new(0),
            shared_pd: None,
            thread: Mutex::new(None),
        };
        let os = |what: &str, e: std::io::Error| {
            FabricError::Connect(format!("NVMe/RDMA queue {qid} to {addr}: {what}: {e}"))
        };
        // SAFETY: `ch` is a valid channel; on success the id is recorded in `q` at once, so
        // Drop destroys it.
        let rc = unsafe {
            rdma_create_id(
                q.ch.raw(),
                &mut q.id,
                std::ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        verbs::check(rc).map_err(|e| os("rdma_create_id", e))?;
        let mut dst = RawAddr::new(addr);
        // SAFETY: valid id; `dst` is a valid address for the call (librdmacm copies it).
        let rc =
            unsafe { rdma_resolve_addr(q.id, std::ptr::null_mut(), dst.as_mut_ptr(), step_ms) };
        verbs::check(rc).map_err(|e| os("rdma_resolve_addr", e))?;
        use rdma_cm_event_type::*;
        wait_cm(
            &q.ch,
            RDMA_CM_EVENT_ADDR_RESOLVED,
            deadline,
            addr,
            qid,
            "address resolution",
        )?;
        // SAFETY: valid id with a resolved address.
        let rc = unsafe { rdma_resolve_route(q.id, step_ms) };
        verbs::check(rc).map_err(|e| os("rdma_resolve_route", e))?;
        wait_cm(
            &q.ch,
            RDMA_CM_EVENT_ROUTE_RESOLVED,
            deadline,
            addr,
            qid,
            "route resolution",
        )?;
        q.create_resources(depth).map_err(|(w, e)| os(w, e))?;

        let req = CmRequest {
            recfmt: cm::RECFMT_1_0,
            qid,
            hrqsize: q.recv_n as u16,
            // HSQSIZE is 0's based like Connect's SQSIZE: one entry more than we put in
            // flight keeps a full SQ distinguishable from an empty one.
            hsqsize: depth as u16,
            cntlid: connect_data.cntlid,
        }
        .encode();
        // SAFETY: plain query on the id's device context into a zeroed structure.
        let max_resp = unsafe {
            let mut da: ibv_device_attr = std::mem::zeroed();
            if ibv_query_device((*q.id).verbs, &mut da) == 0 {
                da.max_qp_rd_atom
            } else {
                1
            }
        };
        // SAFETY: plain data; all-zero is valid.
        let mut p: rdma_conn_param = unsafe { std::mem::zeroed() };
        p.private_data = req.as_ptr() as *const _;
        p.private_data_len = req.len() as u8;
        // The controller reads our write data with RDMA READ; we issue none ourselves.
        p.responder_resources = max_resp.clamp(1, MAX_RESPONDER_RESOURCES) as u8;
        p.initiator_depth = 0;
        p.flow_control = 1;
        p.retry_count = 7;
        p.rnr_retry_count = 7;
        // SAFETY: the id has its queue pair; `req` outlives the call (librdmacm copies it).
        let rc = unsafe { rdma_connect(q.id, &mut p) };
        verbs::check(rc).map_err(|e| os("rdma_connect", e))?;
        let ev = wait_cm(
            &q.ch,
            RDMA_CM_EVENT_ESTABLISHED,
            deadline,
            addr,
            qid,
            "connect",
        )?;
        // RDMA_CM_ACCEPT (Figure 6): CRQSIZE, the capsules the controller can take at once;
        // never keep more than that in flight.
        let crqsize = (ev.private_data.len() >= 4)
            .then(|| u16::from_le_bytes([ev.private_data[2], ev.private_data[3]]) as usize)
            .filter(|&n| n > 0)
            .unwrap_or(depth);
        let usable = depth.min(crqsize);
        {
            let mut s = q.lock();
            s.entries = (0..depth)
                .map(|_| Slot {
                    gen: 0,
                    cmd: None,
                    issued_ns: clock::now_ns(),
                    sending: false,
                    answered: false,
                    direct: None,
                })
                .collect();
            s.free = (0..usable as u16).rev().collect();
        }
        debug!(qid, %addr, depth, crqsize, icd_max, "NVMe/RDMA queue established");

        let q = Arc::new(q);
        let qt = q.clone();
        let t = std::thread::Builder::new()
            .name(format!("nvmf-rdma-q{qid}"))
            .spawn(move || qt.run())
            .map_err(FabricError::io)?;
        *q.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);

        let sqe = Connect {
            recfmt: 0,
            qid,
            sqsize: depth as u16,
            cattr: 0,
            kato: params.kato_ms,
        }
        .to_command(0);
        let w = AdminWait::with_buf(connect_data.encode());
        if let Err(c) = q.submit(Cmd {
            sqe,
            dir: Dir::H2C,
            len: CONNECT_DATA_LEN,
            target: Target::Admin(w.clone()),
            release: true,
        }) {
            c.fail(IoError::PathLost);
        }
        // Fabrics Connect gets a bound of its own after the CM steps, as on TCP.
        let cqe = match w.wait_until(Instant::now() + params.timeout) {
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                q.shutdown();
                return Err(FabricError::Connect(format!("Connect qid {qid}: {e}")));
            }
            None => {
                q.shutdown();
                return Err(FabricError::Timeout(format!("Connect qid {qid}")));
            }
        };
        if !cqe.status().is_success() {
            q.shutdown();
            return Err(FabricError::Refused(format!(
                "controller refused Connect for queue {qid}: {}",
                cqe.status()
            )));
        }
        Ok((q, cqe))
    }

    /// Protection domain, completion channel and queue, queue pair, registered buffers, and
    /// the RECV ring posted (before connecting: the controller may answer at once).
    fn create_resources(&mut self, depth: usize) -> Result<(), (&'static str, std::io::Error)> {
        // SAFETY: the id has a resolved route, so `verbs` is its device context; each
        // object is recorded in `self` at once, so Drop frees it.
        unsafe {
            let ctx = (*self.id).verbs;
            let pd = Pd::for_queue(ctx).map_err(|e| ("ibv_alloc_pd", e))?;
            self.pd = pd.pd;
            self.shared_pd = Some(pd);
            // Every RECV and every (signaled) SEND; a SEND carries the SQE and in-capsule
            // data sent straight from request memory.
            let shape = verbs::QueueShape {
                cqe: self.recv_n + depth + 16,
                send_wr: depth + 1,
                recv_wr: self.recv_n,
                send_sge: 2,
            };
            verbs::create_queue_objects(self.id, self.pd, shape, &mut self.comp, &mut self.cq)?;
        }
        let remote = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0 as i32;
        let reg = |e| ("registering buffers", e);
        self.recv = Some(RegBuf::new(self.pd, self.recv_n * RSP_LEN).map_err(reg)?);
        self.send = Some(RegBuf::new(self.pd, depth * self.capsule_len).map_err(reg)?);
        for _ in 0..depth {
            self.data
                .push(RegBuf::with_access(self.pd, MAX_TRANSFER, remote).map_err(reg)?);
        }
        for r in 0..self.recv_n {
            if !self.post_recv(r) {
                return Err(("ibv_post_recv", verbs::errno()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use std::time::Duration;

    #[test]
    fn without_an_rdma_device_opening_a_queue_says_so_in_one_line() {
        if verbs::device_count() > 0 {
            return; // a machine with RDMA: the test bed covers it
        }
        let cfg = ControllerConfig::new("192.0.2.1", 4420, "nqn.2024-01.io.nacre:x", "nqn.h");
        let params = QueueParams {
            qid: 0,
            depth: 31,
            digests: Default::default(),
            kato_ms: 0,
            icd_max: 0,
            timeout: Duration::from_millis(200),
            tls: None,
        };
        let cd = ConnectData {
            hostid: [0; 16],
            cntlid: 0xFFFF,
            subnqn: "nqn.2024-01.io.nacre:x".into(),
            hostnqn: "nqn.h".into(),
        };
        struct O;
        impl QueueOwner for O {
            fn queue_closed(&self, _: u64, _: u16, _: String, _: Vec<Cmd>) {}
        }
        let o: Arc<dyn QueueOwner> = Arc::new(O);
        let e = RdmaQueue::open(&cfg, params, &cd, 1, Arc::downgrade(&o))
            .unwrap_err()
            .to_string();
        assert!(e.contains("NVMe/RDMA needs an RDMA device"), "{e}");
        assert!(!e.contains('\n'));
    }
}
