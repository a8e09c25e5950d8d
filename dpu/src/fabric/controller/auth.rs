//! DH-HMAC-CHAP on one queue, right after its Connect (NVMe Base 2.0 §8.13).
//!
//! The Connect response's AUTHREQ field says whether the controller requires an
//! authentication transaction (ATR) before the queue may be used. nacre authenticates when
//! it does, and also whenever a controller secret is configured — a host that wants to
//! check its shelf must not depend on the shelf asking. The transaction is
//! [`HostAuth`]'s messages carried by Authentication Send and Authentication Receive on the
//! queue itself (the admin queue and each I/O queue alike).
//!
//! A failure is [`FabricError::Auth`]: the controller is failed at once, not retried, and
//! the error names the queue and the reason code. A controller that refuses this host
//! hears why in an AUTH_Failure2 first. Secrets are read from their files here, for each
//! connection, and dropped (zeroized) when the session is built; nothing here logs them.

use std::time::Instant;

use nacre_shared::nvme::auth::{
    AuthCommand, AUTH_RECEIVE_LEN, CONNECT_AUTHREQ_ASCR, CONNECT_AUTHREQ_ATR,
};
use tracing::debug;

use super::admin::admin_cmd;
use super::ControllerConfig;
use crate::auth::tls_channel::ClientPsk;
use crate::auth::tls_psk::TlsPsk;
use crate::auth::{AuthFailure, HostAuth, HostAuthConfig, Secret};
use crate::fabric::cmd::Dir;
use crate::fabric::queue::FabricQueue;
use crate::fabric::FabricError;

/// The configured secrets, read from their files (`None`: no authentication configured).
pub(super) fn load_keys(cfg: &ControllerConfig) -> Result<Option<HostAuthConfig>, FabricError> {
    let Some(path) = &cfg.dhchap_secret else {
        if cfg.dhchap_ctrl_secret.is_some() {
            return Err(FabricError::Auth(
                "a DH-HMAC-CHAP controller secret needs the host secret too".into(),
            ));
        }
        return Ok(None);
    };
    let load = |p: &std::path::Path, what: &str| {
        Secret::load(p).map_err(|e| FabricError::Auth(format!("DH-HMAC-CHAP {what}: {e}")))
    };
    let host = load(path, "secret")?;
    let ctrl = match &cfg.dhchap_ctrl_secret {
        Some(p) => Some(load(p, "controller secret")?),
        None => None,
    };
    Ok(Some(HostAuthConfig::new(
        &cfg.hostnqn,
        &cfg.subnqn,
        host,
        ctrl,
    )))
}

/// The TLS PSK the queues offer (NVMe/TCP Transport §3.6), read from its file (`None`: plain
/// NVMe/TCP). Read at each session, like the DH-HMAC-CHAP secrets, and kept only as the
/// derived TLS PSK.
pub(super) fn load_tls_psk(
    cfg: &ControllerConfig,
) -> Result<Option<std::sync::Arc<ClientPsk>>, FabricError> {
    let Some(path) = &cfg.tls_psk else {
        return Ok(None);
    };
    if cfg.transport != crate::fabric::queue::Transport::Tcp {
        return Err(FabricError::Auth(
            "a TLS PSK secures NVMe/TCP only (NVMe/RDMA has no TLS)".into(),
        ));
    }
    let psk = TlsPsk::load(path).map_err(|e| FabricError::Auth(format!("TLS PSK: {e}")))?;
    Ok(Some(std::sync::Arc::new(ClientPsk::new(
        &psk,
        &cfg.hostnqn,
        &cfg.subnqn,
    ))))
}

/// Authenticate queue `q` if its Connect response (`connect_dw0`) requires it or a
/// controller secret is configured.
pub(super) fn authenticate(
    q: &dyn FabricQueue,
    connect_dw0: u32,
    keys: Option<&HostAuthConfig>,
    t_id: u16,
    deadline: Instant,
) -> Result<(), FabricError> {
    let qid = q.qid();
    let required = connect_dw0 & CONNECT_AUTHREQ_ATR != 0;
    if connect_dw0 & CONNECT_AUTHREQ_ASCR != 0 {
        return Err(FabricError::Auth(format!(
            "queue {qid}: the controller requires authentication over a secure channel (TLS), which nacre's initiator does not offer"
        )));
    }
    let keys = match keys {
        None if required => {
            return Err(FabricError::Auth(format!(
                "queue {qid}: the controller requires DH-HMAC-CHAP authentication: attach with --dhchap-secret FILE"
            )))
        }
        None => return Ok(()),
        Some(k) if !required && k.ctrl_secret.is_none() => return Ok(()),
        Some(k) => k,
    };
    let mut h = HostAuth::new(keys, t_id);
    let fail = |h: &HostAuth, e: AuthFailure| -> FabricError {
        if let Some(f2) = h.failure2(&e) {
            // Tell the controller why; the queue is given up whatever it answers.
            let _ = send(q, f2, deadline);
        }
        FabricError::Auth(format!(
            "DH-HMAC-CHAP authentication failed on queue {qid}: {e}"
        ))
    };
    send(q, h.negotiate(), deadline)?;
    let challenge = receive(q, deadline)?;
    let reply = h.on_challenge(&challenge).map_err(|e| fail(&h, e))?;
    send(q, reply, deadline).map_err(|e| closed_after_reply(e, qid))?;
    let success1 = receive(q, deadline).map_err(|e| closed_after_reply(e, qid))?;
    if let Some(success2) = h.on_success1(&success1).map_err(|e| fail(&h, e))? {
        send(q, success2, deadline)?;
    }
    if let Some((hash, group)) = h.chosen {
        debug!(
            qid,
            hash = hash.name(),
            dhgroup = group.name(),
            bidirectional = h.bidirectional(),
            "DH-HMAC-CHAP authenticated"
        );
    }
    Ok(())
}

/// The connection ended between the host's Reply and the controller's Success1 or Failure1.
/// Linux's nvmet does that to a Reply it refuses: it declares the controller failed while it
/// completes the Authentication Receive that carries Failure1, and the teardown can close the
/// connection before Failure1 is sent. So the error names authentication as the likely cause;
/// it stays a connection error (the reconnect knobs apply), since a path lost at that moment
/// looks the same.
fn closed_after_reply(e: FabricError, qid: u16) -> FabricError {
    match e {
        FabricError::Connect(why) => FabricError::Connect(format!(
            "DH-HMAC-CHAP authentication failed on queue {qid}: the controller closed the connection after the host's Reply, before its Success1 or Failure1 ({why})"
        )),
        e => e,
    }
}

/// A refusal in the command's status (rather than a Failure message) is an authentication
/// failure too; a transport error stays what it is (the reconnect knobs apply).
fn status_to_auth(e: FabricError, what: &str, qid: u16) -> FabricError {
    match e {
        FabricError::Status(_, st) => FabricError::Auth(format!(
            "DH-HMAC-CHAP authentication failed on queue {qid}: {what} completed with {st}"
        )),
        e => e,
    }
}

fn send(q: &dyn FabricQueue, msg: Vec<u8>, deadline: Instant) -> Result<(), FabricError> {
    let sqe = AuthCommand::send(msg.len() as u32).to_command();
    admin_cmd(q, sqe, Dir::H2C, msg, deadline)
        .map(|_| ())
        .map_err(|e| status_to_auth(e, "Authentication Send", q.qid()))
}

fn receive(q: &dyn FabricQueue, deadline: Instant) -> Result<Vec<u8>, FabricError> {
    let sqe = AuthCommand::receive(AUTH_RECEIVE_LEN).to_command();
    admin_cmd(
        q,
        sqe,
        Dir::C2H,
        vec![0u8; AUTH_RECEIVE_LEN as usize],
        deadline,
    )
    .map(|(_, data)| data)
    .map_err(|e| status_to_auth(e, "Authentication Receive", q.qid()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection closed right after the host's Reply reads as the authentication failure
    /// it most likely is (Linux's nvmet may close before its Failure1 is sent), and stays a
    /// connection error; other errors pass unchanged.
    #[test]
    fn a_connection_closed_after_the_reply_names_authentication() {
        let e = closed_after_reply(
            FabricError::Connect("admin command 0x7f: path to storage lost".into()),
            0,
        );
        let FabricError::Connect(msg) = &e else {
            panic!("not a connection error: {e:?}");
        };
        assert!(msg.starts_with("DH-HMAC-CHAP authentication failed on queue 0: "));
        assert!(msg.contains("path to storage lost"));
        let timeout = closed_after_reply(FabricError::Timeout("x".into()), 0);
        assert!(matches!(timeout, FabricError::Timeout(_)));
    }
}
