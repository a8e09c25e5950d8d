//! The controller role on one queue of a target, at the level of submission queue entries:
//! what an NVMe-oF target core calls to require DH-HMAC-CHAP of a host (NVMe Base 2.0
//! §8.13). nacred's target core calls it (`frontend::nvme::fabrics`): a Connect gives each
//! queue one, and every transport asks it before running a command. The hooks:
//!
//! 1. At Connect, for a host with a secret, [`QueueAuth::required`] and OR
//!    [`QueueAuth::connect_dw0`] into the Connect response's Dword 0 (AUTHREQ.ATR).
//! 2. For each command, [`QueueAuth::may_execute`]: until the queue is authenticated only
//!    Authentication Send and Receive run; anything else completes with
//!    [`AUTHENTICATION_REQUIRED`].
//! 3. Authentication Send (Fabrics type 05h): [`QueueAuth::auth_send`] with the TL bytes of
//!    data. Authentication Receive (06h): [`QueueAuth::auth_receive`], whose bytes are the
//!    command's data to the host.
//! 4. When [`QueueAuth::failed`] holds after a Receive delivered the AUTH_Failure1, the
//!    target may close the queue (Linux and SPDK do); nacred keeps it open, refusing all but
//!    a new authentication transaction, and its transports close a queue that has not
//!    authenticated within the setup timeout of its Connect.
//!
//! Re-authentication: a host may start a new transaction (AUTH_Negotiate) on a queue that
//! has authenticated. The queue keeps carrying commands while it runs; if it fails, the
//! queue loses its access until a later transaction succeeds.

use nacre_shared::nvme::auth::{AuthCommand, DhGroupId, HashId, CONNECT_AUTHREQ_ATR};
use nacre_shared::nvme::status::sct;
use nacre_shared::nvme::{Command, Status};

use super::{AuthFailure, CtrlAuth, CtrlAuthConfig};

/// Command Specific status 91h, Authentication Required: what a command other than
/// Authentication Send/Receive gets on a queue that has not authenticated (the status SPDK's
/// target gives).
pub const AUTHENTICATION_REQUIRED: Status = Status::new(sct::COMMAND_SPECIFIC, 0x91, false);

/// A queue's authentication state.
#[derive(Debug)]
pub struct QueueAuth {
    auth: Option<CtrlAuth>,
    /// Whether commands other than authentication may run: set by a successful
    /// transaction, cleared by a failed one.
    granted: bool,
}

impl QueueAuth {
    /// A queue of a host without a secret: usable at once.
    pub fn not_required() -> Self {
        QueueAuth {
            auth: None,
            granted: true,
        }
    }

    /// A queue of a host with a secret: nothing but authentication runs until it succeeds.
    pub fn required(cfg: CtrlAuthConfig) -> Self {
        QueueAuth {
            auth: Some(CtrlAuth::new(cfg)),
            granted: false,
        }
    }

    /// Bits for the Connect response's Dword 0.
    pub fn connect_dw0(&self) -> u32 {
        if self.auth.is_some() {
            CONNECT_AUTHREQ_ATR
        } else {
            0
        }
    }

    /// Whether the queue may carry commands other than authentication: no secret is
    /// required, or the last completed transaction succeeded.
    pub fn authenticated(&self) -> bool {
        self.granted
    }

    /// Whether a secret is required of this queue's host.
    pub fn is_required(&self) -> bool {
        self.auth.is_some()
    }

    /// Follow the transaction's outcome into the queue's access.
    fn update(&mut self) {
        if let Some(a) = &self.auth {
            if a.authenticated() {
                self.granted = true;
            } else if a.failure().is_some() {
                self.granted = false;
            }
        }
    }

    /// Whether the last transaction failed.
    pub fn failed(&self) -> bool {
        self.auth.as_ref().is_some_and(|a| a.failure().is_some())
    }

    /// The hash and DH group of the last transaction.
    pub fn chosen(&self) -> Option<(HashId, DhGroupId)> {
        self.auth.as_ref()?.chosen()
    }

    /// Why the last transaction failed, and whose host it was.
    pub fn failure(&self) -> Option<(&str, &AuthFailure)> {
        let a = self.auth.as_ref()?;
        Some((a.hostnqn(), a.failure()?))
    }

    /// Whether `sqe` may run now (authentication commands always may).
    pub fn may_execute(&self, sqe: &Command) -> Result<(), Status> {
        if self.authenticated() || AuthCommand::from_command(sqe).is_some() {
            Ok(())
        } else {
            Err(AUTHENTICATION_REQUIRED)
        }
    }

    fn check(&mut self, sqe: &Command, send: bool) -> Result<(&mut CtrlAuth, u32), Status> {
        let a = AuthCommand::from_command(sqe)
            .filter(|a| a.send == send && a.is_nvme_auth())
            .ok_or(Status::INVALID_FIELD)?;
        // A host without a secret has nothing to authenticate with here.
        let auth = self.auth.as_mut().ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
        Ok((auth, a.len))
    }

    /// Authentication Send with its data (TL bytes). A protocol failure is not a command
    /// failure: the host reads the AUTH_Failure1 with its next Receive.
    pub fn auth_send(&mut self, sqe: &Command, data: &[u8]) -> Result<(), Status> {
        let (auth, tl) = self.check(sqe, true)?;
        if tl as usize != data.len() {
            return Err(Status::INVALID_FIELD);
        }
        let _ = auth.on_send(data);
        self.update();
        Ok(())
    }

    /// Authentication Receive: the message to return (at most AL bytes).
    pub fn auth_receive(&mut self, sqe: &Command) -> Result<Vec<u8>, Status> {
        let (auth, al) = self.check(sqe, false)?;
        let msg = auth.on_receive(al as usize);
        self.update();
        Ok(msg)
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::auth::{HostAuth, HostAuthConfig, Secret};
    use nacre_shared::nvme::auth::{Message, Reason, AUTH_RECEIVE_LEN};
    use nacre_shared::nvme::io_opcode;

    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:q";
    const SUB: &str = "nqn.2024-01.io.nacre:q";

    fn queue(key: &Secret) -> QueueAuth {
        QueueAuth::required(CtrlAuthConfig {
            hostnqn: HOST.into(),
            subnqn: SUB.into(),
            host_secret: key.clone(),
            ctrl_secret: None,
            hashes: vec![HashId::Sha384],
            dhgroups: vec![DhGroupId::Ffdhe2048],
        })
    }

    /// The host's side through SQEs, as an initiator sends them.
    fn authenticate(q: &mut QueueAuth, key: &Secret) -> bool {
        let cfg = HostAuthConfig::new(HOST, SUB, key.clone(), None);
        let mut h = HostAuth::new(&cfg, 1);
        let send = |q: &mut QueueAuth, m: Vec<u8>| {
            q.auth_send(&AuthCommand::send(m.len() as u32).to_command(), &m)
                .unwrap()
        };
        let recv = |q: &mut QueueAuth| {
            q.auth_receive(&AuthCommand::receive(AUTH_RECEIVE_LEN).to_command())
                .unwrap()
        };
        send(q, h.negotiate());
        let c = recv(q);
        send(q, h.on_challenge(&c).unwrap());
        let s1 = recv(q);
        h.on_success1(&s1).is_ok()
    }

    #[test]
    fn io_waits_for_authentication() {
        let key = Secret::new(0, &[7; 32]).unwrap();
        let read = Command {
            opcode: io_opcode::READ,
            ..Default::default()
        };
        let mut q = queue(&key);
        assert_eq!(q.connect_dw0(), CONNECT_AUTHREQ_ATR);
        assert_eq!(q.may_execute(&read), Err(AUTHENTICATION_REQUIRED));
        assert!(q.may_execute(&AuthCommand::send(8).to_command()).is_ok());
        assert!(authenticate(&mut q, &key));
        assert!(q.authenticated() && q.may_execute(&read).is_ok());

        // The wrong key: still no I/O, and the transaction is marked failed.
        let mut q = queue(&key);
        assert!(!authenticate(&mut q, &Secret::new(0, &[8; 32]).unwrap()));
        assert!(q.failed());
        assert_eq!(q.may_execute(&read), Err(AUTHENTICATION_REQUIRED));

        // Malformed commands: wrong SECP, TL that does not match the data, direction.
        let mut bad = AuthCommand::send(8);
        bad.secp = 0xEA;
        assert_eq!(
            q.auth_send(&bad.to_command(), &[0; 8]),
            Err(Status::INVALID_FIELD)
        );
        assert_eq!(
            q.auth_send(&AuthCommand::send(9).to_command(), &[0; 8]),
            Err(Status::INVALID_FIELD)
        );
        assert_eq!(
            q.auth_receive(&AuthCommand::send(8).to_command()),
            Err(Status::INVALID_FIELD)
        );
        let open = QueueAuth::not_required();
        assert!(open.authenticated() && open.connect_dw0() == 0);
    }

    #[test]
    fn reauthentication_keeps_access_until_it_fails() {
        let key = Secret::new(0, &[7; 32]).unwrap();
        let read = Command {
            opcode: io_opcode::READ,
            ..Default::default()
        };
        let mut q = queue(&key);
        assert!(authenticate(&mut q, &key));
        assert_eq!(q.chosen(), Some((HashId::Sha384, DhGroupId::Ffdhe2048)));
        // A new transaction under way: commands still run.
        let cfg = HostAuthConfig::new(HOST, SUB, key.clone(), None);
        let n = HostAuth::new(&cfg, 2).negotiate();
        q.auth_send(&AuthCommand::send(n.len() as u32).to_command(), &n)
            .unwrap();
        assert!(q.may_execute(&read).is_ok() && !q.failed());
        // It fails (a message out of sequence): access is gone, and the failure reported.
        let junk = Message::Success2 { t_id: 2 }.encode();
        q.auth_send(&AuthCommand::send(junk.len() as u32).to_command(), &junk)
            .unwrap();
        assert_eq!(q.may_execute(&read), Err(AUTHENTICATION_REQUIRED));
        let (host, why) = q.failure().unwrap();
        assert_eq!((host, why.reason()), (HOST, Some(Reason::IncorrectMessage)));
        // A later transaction that succeeds gives it back and clears the failure.
        assert!(authenticate(&mut q, &key));
        assert!(q.may_execute(&read).is_ok() && !q.failed());
    }
}
