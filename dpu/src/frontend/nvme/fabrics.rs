//! Fabrics commands (NVMe-oF 1.1 §3), the part no transport changes.
//!
//! * Connect (§3.3, §5.3): the SQE's record format, the Connect data, the subsystem and
//!   whether the queue arrived where that subsystem listens, the host allow list and the
//!   per-host queue count, and then either a new controller (an admin queue) or the I/O
//!   queue joining the controller it names.
//! * Property Get and Set (§3.4, §3.5): the controller's registers, through the admin queue.
//! * Authentication Send and Receive (NVMe Base 2.0 §6.2, §6.3) carrying DH-HMAC-CHAP
//!   (§8.13) on any queue of a host that has a secret: the Connect response asks for it
//!   (AUTHREQ.ATR) and the queue's [`QueueAuth`] holds every other command until it
//!   succeeded ([`authentication`], [`QueueAuth::may_execute`]).
//!
//! NVMe/TCP (`frontend/nvmf_tcp/command.rs`) and NVMe/RDMA (`frontend::nvmf_rdma::queue`) each bring what only
//! they know: where the queue arrived, and the limits the transport sets on the queue's
//! QID and SQSIZE (an RDMA queue was sized by its CM request already). What they do once
//! connected (slots, flow control) stays with them.

use std::net::IpAddr;
use std::sync::Arc;

use nacre_shared::nvme::fabrics::{
    self, connect_data_offset, connect_invalid_param_dw0, connect_sqe_offset, fctype, Connect,
    ConnectData, Property,
};
use nacre_shared::nvme::{Command, Status};
use tracing::{debug, warn};

use super::ctrl::{CtrlQueue, TargetController};
use super::subsystem::Subsystem;
use super::TargetInner;
use crate::auth::queue::QueueAuth;
use crate::volume::IoError;

/// A refused Connect: its status and the completion's DW0 (which field was invalid).
pub(crate) type Refusal = (Status, u64);

/// Connect Invalid Parameters naming the byte `off` of the Connect data (`in_data`) or of
/// the SQE (NVMe-oF 1.1 Figure 21).
pub(crate) fn invalid_param(in_data: bool, off: u16) -> Refusal {
    (
        Status::CONNECT_INVALID_PARAMETERS,
        connect_invalid_param_dw0(in_data, off) as u64,
    )
}

/// One queue of a host counted against [`super::ConnLimits::per_host`]; given back on drop.
pub(crate) struct HostQueue {
    target: Arc<TargetInner>,
    hostnqn: String,
}

impl HostQueue {
    fn acquire(target: &Arc<TargetInner>, hostnqn: &str) -> Option<HostQueue> {
        target.acquire_host_queue(hostnqn).then(|| HostQueue {
            target: target.clone(),
            hostnqn: hostnqn.to_string(),
        })
    }
}

impl Drop for HostQueue {
    fn drop(&mut self) {
        self.target.release_host_queue(&self.hostnqn);
    }
}

/// A Connect the target accepted: the queue belongs to `ctrl` from here.
pub(crate) struct Connected {
    pub ctrl: Arc<TargetController>,
    pub subsys: Arc<Subsystem>,
    pub connect: Connect,
    /// Held for as long as the queue lives.
    pub host: HostQueue,
    /// The queue's DH-HMAC-CHAP state; `connect_dw0` already carries its AUTHREQ bits.
    pub auth: QueueAuth,
    /// Dword 0 of the Connect response: the CNTLID and AUTHREQ (NVMe-oF 1.1 Figure 22,
    /// NVMe Base 2.0 §6.3).
    pub connect_dw0: u64,
}

/// What one transport adds to the checks of a Connect.
pub(crate) struct QueueRules<R, S> {
    /// Whether `subsystem` listens where this queue arrived.
    pub reachable: R,
    /// The transport's own limits on the SQE (QID, SQSIZE): `Some` refuses.
    pub sqe: S,
    /// The queue's local address (reported by the controller, e.g. in discovery).
    pub local_ip: IpAddr,
}

/// Carry out the Connect in `cmd` with its Connect data `data` for queue `q`.
pub(crate) fn fabrics_connect<Q, R, S>(
    target: &Arc<TargetInner>,
    q: &Arc<Q>,
    cmd: &Command,
    data: &[u8],
    rules: QueueRules<R, S>,
) -> Result<Connected, Refusal>
where
    Q: CtrlQueue + 'static,
    R: Fn(&Subsystem) -> bool,
    S: Fn(&Connect) -> Option<Refusal>,
{
    let c = Connect::from_command(cmd);
    if c.recfmt != 0 {
        return Err((Status::CONNECT_INCOMPATIBLE_FORMAT, 0));
    }
    if data.len() < fabrics::CONNECT_DATA_LEN {
        return Err((Status::DATA_SGL_LENGTH_INVALID, 0));
    }
    let d = ConnectData::decode(data);
    let Some(subsys) = target
        .find_subsystem(&d.subnqn)
        .filter(|s| (rules.reachable)(s))
    else {
        return Err(invalid_param(true, connect_data_offset::SUBNQN));
    };
    if !subsys.host_allowed(&d.hostnqn) {
        warn!(
            subnqn = d.subnqn,
            hostnqn = d.hostnqn,
            "connect refused: host not allowed"
        );
        return Err((Status::CONNECT_INVALID_HOST, 0));
    }
    // Counted from here; a refusal below drops the count again.
    let Some(host) = HostQueue::acquire(target, &d.hostnqn) else {
        warn!(
            subnqn = d.subnqn,
            hostnqn = d.hostnqn,
            "connect refused: the host holds as many queues as it may"
        );
        return Err((Status::CONNECT_CONTROLLER_BUSY, 0));
    };
    if let Some(r) = (rules.sqe)(&c) {
        return Err(r);
    }
    let ctrl = if c.qid == 0 {
        if d.cntlid != fabrics::CNTLID_DYNAMIC {
            return Err(invalid_param(true, connect_data_offset::CNTLID));
        }
        let ctrl = TargetController::new(
            target,
            subsys.clone(),
            d.hostnqn.clone(),
            c.kato,
            rules.local_ip,
            q,
        );
        subsys.insert_controller(ctrl.clone());
        ctrl
    } else {
        if subsys.discovery {
            return Err(invalid_param(false, connect_sqe_offset::QID));
        }
        let Some(ctrl) = subsys.controller(d.cntlid) else {
            return Err(invalid_param(true, connect_data_offset::CNTLID));
        };
        if ctrl.hostnqn != d.hostnqn {
            return Err(invalid_param(true, connect_data_offset::HOSTNQN));
        }
        if !ctrl.ready() {
            return Err((Status::COMMAND_SEQUENCE_ERROR, 0));
        }
        if !ctrl.attach_io_queue(c.qid, q) {
            return Err(invalid_param(false, connect_sqe_offset::QID));
        }
        ctrl
    };
    let auth = subsys.queue_auth(&d.hostnqn);
    debug!(
        cntlid = ctrl.cntlid,
        qid = c.qid,
        sqsize = c.sqsize,
        authenticate = auth.is_required(),
        "queue connected"
    );
    let connect_dw0 = (ctrl.cntlid as u32 | auth.connect_dw0()) as u64;
    Ok(Connected {
        ctrl,
        subsys,
        connect: c,
        host,
        auth,
        connect_dw0,
    })
}

/// Whether `cmd` is Authentication Send or Receive.
pub(crate) fn is_authentication(cmd: &Command) -> bool {
    cmd.opcode == nacre_shared::nvme::admin_opcode::FABRICS
        && matches!(
            cmd.fctype(),
            fctype::AUTHENTICATION_SEND | fctype::AUTHENTICATION_RECEIVE
        )
}

/// Authentication Send (with its `data`) or Receive on a queue whose state is `auth`
/// (`None`: the queue has not connected, a Command Sequence Error). Returns the status and,
/// for a Receive, the message for the host. A protocol failure is not a command failure:
/// the command succeeds and the host reads an AUTH_Failure1 with its reason code.
pub(crate) fn authentication(
    auth: Option<&mut QueueAuth>,
    cmd: &Command,
    data: &[u8],
) -> (Status, Vec<u8>) {
    let Some(auth) = auth else {
        return (Status::COMMAND_SEQUENCE_ERROR, Vec::new());
    };
    let (was_failed, was_granted) = (auth.failed(), auth.authenticated());
    let r = if cmd.fctype() == fctype::AUTHENTICATION_SEND {
        auth.auth_send(cmd, data).map(|()| Vec::new())
    } else {
        auth.auth_receive(cmd)
    };
    if !was_failed {
        if let Some((hostnqn, why)) = auth.failure() {
            warn!(hostnqn, reason = %why, "DH-HMAC-CHAP authentication failed");
        }
    }
    if !was_granted && auth.authenticated() {
        if let Some((hash, dhgroup)) = auth.chosen() {
            debug!(
                hash = hash.name(),
                dhgroup = dhgroup.name(),
                "queue authenticated (DH-HMAC-CHAP)"
            );
        }
    }
    match r {
        Ok(out) => (Status::SUCCESS, out),
        Err(s) => (s, Vec::new()),
    }
}

/// Property Get or Set on queue `qid` of controller `ctrl` (`None` before Connect); any
/// other Fabrics command type is Invalid Opcode. The value read is returned in CQE Dwords
/// 0-1 (NVMe-oF 1.1 Figure 26).
pub(crate) fn property(
    ctrl: Option<&Arc<TargetController>>,
    qid: u16,
    cmd: &Command,
) -> (Status, u64) {
    let get = match cmd.fctype() {
        fctype::PROPERTY_GET => true,
        fctype::PROPERTY_SET => false,
        _ => return (Status::INVALID_OPCODE, 0),
    };
    let Some(ctrl) = ctrl else {
        return (Status::COMMAND_SEQUENCE_ERROR, 0);
    };
    // Properties are reached only through the admin queue, 4 or 8 bytes at a time.
    if qid != 0 || Property::size_field(cmd) > 1 {
        return (Status::INVALID_FIELD, 0);
    }
    let p = Property::from_command(cmd);
    if get {
        match ctrl.property_get(p.offset, p.eight_bytes) {
            Ok(v) => (Status::SUCCESS, v),
            Err(s) => (s, 0),
        }
    } else {
        (ctrl.property_set(p.offset, p.value), 0)
    }
}

/// The NVMe status a host sees for a volume's error (NVMe Base 2.0 §4.6.1.2): the same on
/// every transport.
///
/// The path errors (SCT 3h, Internal Path Error) are about the path from nacred to its remote
/// storage, which the host cannot see. While that path may come back ([`IoError::PathLost`]:
/// the remote is reconnecting) the status leaves DNR clear, so the host retries; Linux's
/// native multipath requeues such a command until a path answers, which is what holding I/O
/// over a reconnect means. Once the path is gone for good ([`IoError::PathFailed`]) DNR is
/// set: without it, a multipath host would requeue the command forever.
pub(crate) fn io_status(e: &IoError, read: bool) -> Status {
    match e {
        IoError::OutOfRange { .. } => Status::LBA_OUT_OF_RANGE,
        IoError::Invalid(_) => Status::INVALID_FIELD,
        IoError::ReadOnly => Status::WRITE_TO_READ_ONLY,
        IoError::Unsupported => Status::INVALID_OPCODE,
        IoError::Media(_) | IoError::Crypto(_) if read => Status::UNRECOVERED_READ_ERROR,
        IoError::Media(_) | IoError::Crypto(_) => Status::WRITE_FAULT,
        IoError::PathLost => Status::INTERNAL_PATH_ERROR,
        IoError::PathFailed => Status::INTERNAL_PATH_ERROR.do_not_retry(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nacre_shared::nvme::status::sct;

    #[test]
    fn a_path_lost_for_good_says_do_not_retry() {
        for read in [false, true] {
            let now = io_status(&IoError::PathLost, read);
            let ever = io_status(&IoError::PathFailed, read);
            assert_eq!((now.sct, now.sc, now.dnr), (sct::PATH, 0x00, false));
            assert_eq!((ever.sct, ever.sc, ever.dnr), (sct::PATH, 0x00, true));
        }
        // CQE bytes 14-15 (phase tag in bit 0); nvme-cli prints them shifted right: 0x4300
        assert_eq!(
            Status::INTERNAL_PATH_ERROR.do_not_retry().to_field() >> 1,
            0x4300
        );
    }
}
