//! The DH-HMAC-CHAP transaction (NVMe Base 2.0 §8.13) as two state machines that take and
//! return message bytes; the caller moves them with Authentication Send (host to
//! controller) and Authentication Receive (controller to host) on the queue being
//! authenticated.
//!
//! ```text
//!  host                                         controller
//!  AUTH_Negotiate (hashes, DH groups)     ──▶   picks one of each
//!                                         ◀──   Challenge: T_ID, hash, group, S1, C1, g^y
//!  Reply: R1, [C2, S2], g^x               ──▶   checks R1
//!                                         ◀──   Success1 [R2]
//!  checks R2; Success2 (bidirectional)    ──▶
//! ```
//!
//! With a DH group, both sides compute the session key g^xy mod p, and each challenge C is
//! replaced by C' = HMAC(H(g^xy), C) before use. The responses are
//! * R1 = HMAC(Kh', C1' || S1 || T_ID || SC_C || "HostHost" || host NQN || 00h || subsystem NQN)
//! * R2 = HMAC(Kc', C2' || S2 || T_ID || 00h || "Controller" || subsystem NQN || 00h || host NQN)
//!
//! where Kh' is the host secret transformed with the host NQN and Kc' the controller secret
//! transformed with the subsystem NQN ([`super::Secret::transform`]); integers are
//! little-endian. Responses are compared in constant time. Anything unexpected — a wrong
//! transaction identifier, a length that does not match the hash, a group or hash not
//! offered, an oversized or out-of-range DH value — ends the transaction with the reason
//! code the peer is owed, and no input panics.

use nacre_shared::nvme::auth::{DhGroupId, HashId, Message, MsgError, Reason};
use zeroize::Zeroizing;

use super::dh::KeyPair;
use super::{digest, hmac, Secret};

/// Why a transaction ended without authenticating.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthFailure {
    /// This side refused; the peer is owed a Failure message with this reason
    /// ([`HostAuth::failure2`]; [`CtrlAuth`] queues its Failure1 itself).
    #[error("{0}")]
    Local(MsgError),
    /// The peer refused with AUTH_Failure1/2.
    #[error("the peer refused: {}", peer_reason(*reason_code, *explanation))]
    Peer { reason_code: u8, explanation: u8 },
}

fn peer_reason(rc: u8, rce: u8) -> String {
    match Reason::from_u8(rce) {
        Some(r) if rc == nacre_shared::nvme::auth::FAILURE_REASON_FAILED => r.to_string(),
        _ => format!("reason code {rc:#04x}, explanation {rce:#04x}"),
    }
}

impl AuthFailure {
    fn local(reason: Reason, what: impl Into<String>) -> Self {
        AuthFailure::Local(MsgError::new(reason, what))
    }
    /// The reason code explanation (ours or the peer's).
    pub fn reason(&self) -> Option<Reason> {
        match self {
            AuthFailure::Local(e) => Some(e.reason),
            AuthFailure::Peer { explanation, .. } => Reason::from_u8(*explanation),
        }
    }
}

impl From<MsgError> for AuthFailure {
    fn from(e: MsgError) -> Self {
        AuthFailure::Local(e)
    }
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn random(n: usize) -> Result<Zeroizing<Vec<u8>>, AuthFailure> {
    let mut v = Zeroizing::new(vec![0u8; n]);
    getrandom::fill(&mut v).map_err(|e| AuthFailure::local(Reason::Failed, e.to_string()))?;
    Ok(v)
}

/// A sequence number: random and never zero (a zero S2 means "no controller
/// authentication", and SPDK refuses a zero S1).
fn new_seqnum() -> Result<u32, AuthFailure> {
    let b = random(4)?;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]).max(1))
}

/// C' = HMAC(H(session key), C) with a DH group; C itself with the null group.
fn augment(h: HashId, session: Option<&[u8]>, c: &[u8]) -> Zeroizing<Vec<u8>> {
    match session {
        None => Zeroizing::new(c.to_vec()),
        Some(k) => hmac(h, &digest(h, k), &[c]),
    }
}

/// Everything a response covers but the key.
struct ResponseInput<'a> {
    hash: HashId,
    challenge: &'a [u8],
    session: Option<&'a [u8]>,
    seqnum: u32,
    t_id: u16,
    sc_c: u8,
}

/// R1: the host's response to C1.
fn host_response(key: &[u8], i: &ResponseInput, hostnqn: &str, subnqn: &str) -> Zeroizing<Vec<u8>> {
    let c = augment(i.hash, i.session, i.challenge);
    hmac(
        i.hash,
        key,
        &[
            &c,
            &i.seqnum.to_le_bytes(),
            &i.t_id.to_le_bytes(),
            &[i.sc_c],
            b"HostHost",
            hostnqn.as_bytes(),
            &[0],
            subnqn.as_bytes(),
        ],
    )
}

/// R2: the controller's response to C2.
fn ctrl_response(key: &[u8], i: &ResponseInput, hostnqn: &str, subnqn: &str) -> Zeroizing<Vec<u8>> {
    let c = augment(i.hash, i.session, i.challenge);
    hmac(
        i.hash,
        key,
        &[
            &c,
            &i.seqnum.to_le_bytes(),
            &i.t_id.to_le_bytes(),
            &[0],
            b"Controller",
            subnqn.as_bytes(),
            &[0],
            hostnqn.as_bytes(),
        ],
    )
}

/// What the host side knows.
#[derive(Debug, Clone)]
pub struct HostAuthConfig {
    pub hostnqn: String,
    pub subnqn: String,
    /// The host's secret (the controller checks the host with it).
    pub secret: Secret,
    /// The controller's secret: when set, the host also authenticates the controller.
    pub ctrl_secret: Option<Secret>,
    /// Hashes and DH groups offered, in order of preference.
    pub hashes: Vec<HashId>,
    pub dhgroups: Vec<DhGroupId>,
}

impl HostAuthConfig {
    /// Every hash and group, strongest hash first and the DH groups before the null group
    /// (the controller picks; Linux offers the same lists).
    pub fn new(hostnqn: &str, subnqn: &str, secret: Secret, ctrl_secret: Option<Secret>) -> Self {
        HostAuthConfig {
            hostnqn: hostnqn.into(),
            subnqn: subnqn.into(),
            secret,
            ctrl_secret,
            hashes: vec![HashId::Sha256, HashId::Sha384, HashId::Sha512],
            dhgroups: DhGroupId::ALL.to_vec(),
        }
    }
}

#[derive(Debug)]
enum HostState {
    Start,
    AwaitChallenge,
    AwaitSuccess1 {
        hash: HashId,
        /// C2 and S2 when the controller is to be authenticated.
        c2: Option<(Zeroizing<Vec<u8>>, u32)>,
        session: Option<Zeroizing<Vec<u8>>>,
    },
    Done,
}

/// The host's side of one transaction on one queue.
#[derive(Debug)]
pub struct HostAuth<'a> {
    cfg: &'a HostAuthConfig,
    t_id: u16,
    state: HostState,
    /// The hash and group the controller chose (reported once known).
    pub chosen: Option<(HashId, DhGroupId)>,
}

impl<'a> HostAuth<'a> {
    pub fn new(cfg: &'a HostAuthConfig, t_id: u16) -> Self {
        HostAuth {
            cfg,
            t_id,
            state: HostState::Start,
            chosen: None,
        }
    }

    pub fn t_id(&self) -> u16 {
        self.t_id
    }

    /// Whether the controller will be checked (a controller secret is configured).
    pub fn bidirectional(&self) -> bool {
        self.cfg.ctrl_secret.is_some()
    }

    /// Step 1: AUTH_Negotiate.
    pub fn negotiate(&mut self) -> Vec<u8> {
        self.state = HostState::AwaitChallenge;
        Message::Negotiate {
            t_id: self.t_id,
            sc_c: 0,
            hashes: self.cfg.hashes.iter().map(|h| *h as u8).collect(),
            dhgroups: self.cfg.dhgroups.iter().map(|g| *g as u8).collect(),
        }
        .encode()
    }

    /// The Failure2 message owed to the controller for `f` (none when the controller itself
    /// refused).
    pub fn failure2(&self, f: &AuthFailure) -> Option<Vec<u8>> {
        match f {
            AuthFailure::Local(e) => Some(Message::failure(self.t_id, false, e.reason).encode()),
            AuthFailure::Peer { .. } => None,
        }
    }

    fn decode(&self, b: &[u8]) -> Result<Message, AuthFailure> {
        let m = Message::decode(b)?;
        if let Message::Failure {
            reason_code,
            explanation,
            ..
        } = m
        {
            return Err(AuthFailure::Peer {
                reason_code,
                explanation,
            });
        }
        if m.t_id() != self.t_id {
            return Err(AuthFailure::local(
                Reason::IncorrectPayload,
                format!(
                    "transaction id {} where {} was expected",
                    m.t_id(),
                    self.t_id
                ),
            ));
        }
        Ok(m)
    }

    /// Step 2: the controller's Challenge in, the host's Reply out.
    pub fn on_challenge(&mut self, b: &[u8]) -> Result<Vec<u8>, AuthFailure> {
        if !matches!(self.state, HostState::AwaitChallenge) {
            return Err(AuthFailure::local(
                Reason::IncorrectMessage,
                "challenge out of sequence",
            ));
        }
        self.state = HostState::Done;
        let Message::Challenge {
            hash,
            dhgroup,
            seqnum,
            challenge,
            dh_value,
            ..
        } = self.decode(b)?
        else {
            return Err(AuthFailure::local(
                Reason::IncorrectMessage,
                "expected DH-HMAC-CHAP_Challenge",
            ));
        };
        let hash = HashId::from_u8(hash)
            .filter(|h| self.cfg.hashes.contains(h))
            .ok_or_else(|| {
                AuthFailure::local(
                    Reason::HashUnusable,
                    format!("the controller chose hash {hash:#04x}, which was not offered"),
                )
            })?;
        let group = DhGroupId::from_u8(dhgroup)
            .filter(|g| self.cfg.dhgroups.contains(g))
            .ok_or_else(|| {
                AuthFailure::local(
                    Reason::DhGroupUnusable,
                    format!("the controller chose DH group {dhgroup:#04x}, which was not offered"),
                )
            })?;
        if challenge.len() != hash.digest_len() {
            return Err(AuthFailure::local(
                Reason::IncorrectPayload,
                format!(
                    "challenge of {} bytes for {} ({} expected)",
                    challenge.len(),
                    hash.name(),
                    hash.digest_len()
                ),
            ));
        }
        if seqnum == 0 {
            return Err(AuthFailure::local(
                Reason::IncorrectPayload,
                "challenge with sequence number 0",
            ));
        }
        if (group == DhGroupId::Null) != dh_value.is_empty() {
            return Err(AuthFailure::local(
                Reason::IncorrectPayload,
                format!(
                    "{}-byte DH value with group {}",
                    dh_value.len(),
                    group.name()
                ),
            ));
        }
        self.chosen = Some((hash, group));
        let kp = KeyPair::generate(group)
            .map_err(|e| AuthFailure::local(Reason::Failed, e.to_string()))?;
        let session = match &kp {
            Some(kp) => Some(
                kp.shared_secret(&dh_value)
                    .map_err(|e| AuthFailure::local(Reason::IncorrectPayload, e.to_string()))?,
            ),
            None => None,
        };
        let key = self.cfg.secret.transform(&self.cfg.hostnqn);
        let r1 = host_response(
            &key,
            &ResponseInput {
                hash,
                challenge: &challenge,
                session: session.as_deref().map(|s| s.as_slice()),
                seqnum,
                t_id: self.t_id,
                sc_c: 0,
            },
            &self.cfg.hostnqn,
            &self.cfg.subnqn,
        );
        let c2 = match self.cfg.ctrl_secret {
            Some(_) => Some((random(hash.digest_len())?, new_seqnum()?)),
            None => None,
        };
        let reply = Message::Reply {
            t_id: self.t_id,
            response: r1.to_vec(),
            challenge: c2.as_ref().map(|(c, _)| c.to_vec()),
            seqnum: c2.as_ref().map_or(0, |(_, s)| *s),
            dh_value: kp.as_ref().map_or(Vec::new(), |k| k.public().to_vec()),
        };
        self.state = HostState::AwaitSuccess1 { hash, c2, session };
        Ok(reply.encode())
    }

    /// Step 3: the controller's Success1 in; out, the Success2 to send when the controller
    /// was checked (bidirectional), else nothing. `Ok` means authenticated.
    pub fn on_success1(&mut self, b: &[u8]) -> Result<Option<Vec<u8>>, AuthFailure> {
        let HostState::AwaitSuccess1 { hash, c2, session } =
            std::mem::replace(&mut self.state, HostState::Done)
        else {
            return Err(AuthFailure::local(
                Reason::IncorrectMessage,
                "success1 out of sequence",
            ));
        };
        let Message::Success1 { hl, response, .. } = self.decode(b)? else {
            return Err(AuthFailure::local(
                Reason::IncorrectMessage,
                "expected DH-HMAC-CHAP_Success1",
            ));
        };
        let (Some((c2, s2)), Some(ctrl_secret)) = (c2, &self.cfg.ctrl_secret) else {
            return Ok(None);
        };
        let Some(r2) = response.filter(|_| hl as usize == hash.digest_len()) else {
            return Err(AuthFailure::local(
                Reason::Failed,
                "the controller did not answer the host's challenge",
            ));
        };
        let key = ctrl_secret.transform(&self.cfg.subnqn);
        let want = ctrl_response(
            &key,
            &ResponseInput {
                hash,
                challenge: &c2,
                session: session.as_deref().map(|s| s.as_slice()),
                seqnum: s2,
                t_id: self.t_id,
                sc_c: 0,
            },
            &self.cfg.hostnqn,
            &self.cfg.subnqn,
        );
        if !ct_eq(&want, &r2) {
            return Err(AuthFailure::local(
                Reason::Failed,
                "the controller's response does not verify (wrong controller key?)",
            ));
        }
        Ok(Some(Message::Success2 { t_id: self.t_id }.encode()))
    }
}

/// What the controller side knows about one host.
#[derive(Debug, Clone)]
pub struct CtrlAuthConfig {
    pub hostnqn: String,
    pub subnqn: String,
    /// The host's secret, to check the host's response.
    pub host_secret: Secret,
    /// The controller's own secret, to answer a host that asks (bidirectional).
    pub ctrl_secret: Option<Secret>,
    /// Hashes and DH groups the controller accepts, in its order of preference.
    pub hashes: Vec<HashId>,
    pub dhgroups: Vec<DhGroupId>,
}

#[derive(Debug)]
enum CtrlState {
    AwaitNegotiate,
    /// A message is ready for the host's Authentication Receive.
    Pending(Vec<u8>, Box<CtrlState>),
    AwaitReply {
        hash: HashId,
        c1: Zeroizing<Vec<u8>>,
        s1: u32,
        kp: Option<KeyPair>,
    },
    AwaitSuccess2,
    Authenticated,
    Failed,
}

/// The controller's side of transactions on one queue.
///
/// A target calls [`CtrlAuth::on_send`] with each Authentication Send's data and
/// [`CtrlAuth::on_receive`] for each Authentication Receive, and lets the queue carry I/O
/// only once [`CtrlAuth::authenticated`] holds (the "authenticated" flag of the queue).
#[derive(Debug)]
pub struct CtrlAuth {
    cfg: CtrlAuthConfig,
    state: CtrlState,
    t_id: u16,
    sc_c: u8,
    failure: Option<AuthFailure>,
    /// The hash and DH group of the last transaction that got as far as a Challenge.
    chosen: Option<(HashId, DhGroupId)>,
}

impl CtrlAuth {
    pub fn new(cfg: CtrlAuthConfig) -> Self {
        CtrlAuth {
            cfg,
            state: CtrlState::AwaitNegotiate,
            t_id: 0,
            sc_c: 0,
            failure: None,
            chosen: None,
        }
    }

    /// The hash and DH group the last transaction chose.
    pub fn chosen(&self) -> Option<(HashId, DhGroupId)> {
        self.chosen
    }

    pub fn authenticated(&self) -> bool {
        matches!(self.state, CtrlState::Authenticated)
    }

    /// The host this controller side authenticates.
    pub fn hostnqn(&self) -> &str {
        &self.cfg.hostnqn
    }

    /// Why the last transaction failed, if it did.
    pub fn failure(&self) -> Option<&AuthFailure> {
        self.failure.as_ref()
    }

    fn fail(&mut self, f: AuthFailure) -> AuthFailure {
        if let AuthFailure::Local(e) = &f {
            // The host reads the Failure1 with its next Authentication Receive.
            let msg = Message::failure(self.t_id, true, e.reason).encode();
            self.state = CtrlState::Pending(msg, Box::new(CtrlState::Failed));
        } else {
            self.state = CtrlState::Failed;
        }
        self.failure = Some(f.clone());
        f
    }

    /// The data of an Authentication Send. An `Err` is also remembered, and its Failure1
    /// answers the next Authentication Receive.
    pub fn on_send(&mut self, b: &[u8]) -> Result<(), AuthFailure> {
        let r = self.step(b);
        r.map_err(|f| self.fail(f))
    }

    fn step(&mut self, b: &[u8]) -> Result<(), AuthFailure> {
        let m = Message::decode(b)?;
        if let Message::Failure {
            reason_code,
            explanation,
            ..
        } = m
        {
            return Err(AuthFailure::Peer {
                reason_code,
                explanation,
            });
        }
        // A Negotiate starts a new transaction whatever came before (re-authentication);
        // anything else must carry the transaction's identifier.
        if let Message::Negotiate {
            t_id,
            sc_c,
            hashes,
            dhgroups,
        } = m
        {
            self.t_id = t_id;
            self.sc_c = sc_c;
            // A new transaction: the last one's outcome no longer stands.
            self.failure = None;
            if sc_c != 0 {
                return Err(AuthFailure::local(
                    Reason::ConcatMismatch,
                    "secure channel concatenation is not supported",
                ));
            }
            let hash = self
                .cfg
                .hashes
                .iter()
                .find(|h| hashes.contains(&(**h as u8)))
                .copied()
                .ok_or_else(|| {
                    AuthFailure::local(Reason::HashUnusable, "no offered hash is acceptable")
                })?;
            let group = self
                .cfg
                .dhgroups
                .iter()
                .find(|g| dhgroups.contains(&(**g as u8)))
                .copied()
                .ok_or_else(|| {
                    AuthFailure::local(Reason::DhGroupUnusable, "no offered DH group is acceptable")
                })?;
            let kp = KeyPair::generate(group)
                .map_err(|e| AuthFailure::local(Reason::Failed, e.to_string()))?;
            self.chosen = Some((hash, group));
            let c1 = random(hash.digest_len())?;
            let s1 = new_seqnum()?;
            let msg = Message::Challenge {
                t_id,
                hash: hash as u8,
                dhgroup: group as u8,
                seqnum: s1,
                challenge: c1.to_vec(),
                dh_value: kp.as_ref().map_or(Vec::new(), |k| k.public().to_vec()),
            }
            .encode();
            self.state =
                CtrlState::Pending(msg, Box::new(CtrlState::AwaitReply { hash, c1, s1, kp }));
            return Ok(());
        }
        if m.t_id() != self.t_id {
            return Err(AuthFailure::local(
                Reason::IncorrectPayload,
                format!(
                    "transaction id {} where {} was expected",
                    m.t_id(),
                    self.t_id
                ),
            ));
        }
        match (std::mem::replace(&mut self.state, CtrlState::Failed), m) {
            (
                CtrlState::AwaitReply { hash, c1, s1, kp },
                Message::Reply {
                    response,
                    challenge,
                    seqnum,
                    dh_value,
                    ..
                },
            ) => {
                if response.len() != hash.digest_len() {
                    return Err(AuthFailure::local(
                        Reason::IncorrectPayload,
                        format!("response of {} bytes for {}", response.len(), hash.name()),
                    ));
                }
                let session = match &kp {
                    Some(kp) => Some(kp.shared_secret(&dh_value).map_err(|e| {
                        AuthFailure::local(Reason::IncorrectPayload, e.to_string())
                    })?),
                    None if dh_value.is_empty() => None,
                    None => {
                        return Err(AuthFailure::local(
                            Reason::IncorrectPayload,
                            "DH value with the null group",
                        ))
                    }
                };
                let session = session.as_deref().map(|s| s.as_slice());
                let key = self.cfg.host_secret.transform(&self.cfg.hostnqn);
                let want = host_response(
                    &key,
                    &ResponseInput {
                        hash,
                        challenge: &c1,
                        session,
                        seqnum: s1,
                        t_id: self.t_id,
                        sc_c: self.sc_c,
                    },
                    &self.cfg.hostnqn,
                    &self.cfg.subnqn,
                );
                if !ct_eq(&want, &response) {
                    return Err(AuthFailure::local(
                        Reason::Failed,
                        "the host's response does not verify",
                    ));
                }
                let r2 = match challenge {
                    None => None,
                    Some(c2) => {
                        let Some(cs) = &self.cfg.ctrl_secret else {
                            return Err(AuthFailure::local(
                                Reason::Failed,
                                "the host asks the controller to authenticate, but it has no controller key",
                            ));
                        };
                        if seqnum == 0 {
                            return Err(AuthFailure::local(
                                Reason::IncorrectPayload,
                                "controller challenge with sequence number 0",
                            ));
                        }
                        let key = cs.transform(&self.cfg.subnqn);
                        Some(ctrl_response(
                            &key,
                            &ResponseInput {
                                hash,
                                challenge: &c2,
                                session,
                                seqnum,
                                t_id: self.t_id,
                                sc_c: 0,
                            },
                            &self.cfg.hostnqn,
                            &self.cfg.subnqn,
                        ))
                    }
                };
                let next = if r2.is_some() {
                    CtrlState::AwaitSuccess2
                } else {
                    CtrlState::Authenticated
                };
                let msg = Message::Success1 {
                    t_id: self.t_id,
                    hl: hash.digest_len() as u8,
                    response: r2.map(|r| r.to_vec()),
                }
                .encode();
                self.state = CtrlState::Pending(msg, Box::new(next));
                Ok(())
            }
            (CtrlState::AwaitSuccess2, Message::Success2 { .. }) => {
                self.state = CtrlState::Authenticated;
                Ok(())
            }
            (_, m) => Err(AuthFailure::local(
                Reason::IncorrectMessage,
                format!("{m:?} out of sequence"),
            )),
        }
    }

    /// An Authentication Receive of `al` bytes: the pending message, or a Failure1
    /// (incorrect protocol message) when nothing is pending.
    pub fn on_receive(&mut self, al: usize) -> Vec<u8> {
        match std::mem::replace(&mut self.state, CtrlState::Failed) {
            CtrlState::Pending(msg, next) if msg.len() <= al => {
                self.state = *next;
                msg
            }
            CtrlState::Pending(..) => {
                let f = AuthFailure::local(Reason::IncorrectPayload, "allocation length too small");
                self.failure = Some(f);
                Message::failure(self.t_id, true, Reason::IncorrectPayload).encode()
            }
            _ => {
                self.failure = Some(AuthFailure::local(
                    Reason::IncorrectMessage,
                    "authentication receive out of sequence",
                ));
                Message::failure(self.t_id, true, Reason::IncorrectMessage).encode()
            }
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0e0d0c-0b0a-0908-0706-050403020100";
    const SUB: &str = "nqn.2024-01.io.nacre:shelf";

    fn secret(hash: u8, fill: u8, len: usize) -> Secret {
        Secret::new(hash, &vec![fill; len]).unwrap()
    }

    fn ctrl_cfg(host: Secret, ctrl: Option<Secret>, h: HashId, g: DhGroupId) -> CtrlAuthConfig {
        CtrlAuthConfig {
            hostnqn: HOST.into(),
            subnqn: SUB.into(),
            host_secret: host,
            ctrl_secret: ctrl,
            hashes: vec![h],
            dhgroups: vec![g],
        }
    }

    /// Run one transaction; Ok(chosen) or the host's and the controller's view of failure.
    fn run(
        host: &HostAuthConfig,
        ctrl: &mut CtrlAuth,
        t_id: u16,
    ) -> Result<(HashId, DhGroupId), AuthFailure> {
        let mut h = HostAuth::new(host, t_id);
        let n = h.negotiate();
        let _ = ctrl.on_send(&n);
        let challenge = ctrl.on_receive(4096);
        let reply = h.on_challenge(&challenge)?;
        let _ = ctrl.on_send(&reply);
        let s1 = ctrl.on_receive(4096);
        match h.on_success1(&s1) {
            Ok(Some(s2)) => ctrl.on_send(&s2)?,
            Ok(None) => {}
            Err(e) => {
                if let Some(f2) = h.failure2(&e) {
                    let _ = ctrl.on_send(&f2);
                }
                return Err(e);
            }
        }
        assert!(ctrl.authenticated());
        Ok(h.chosen.unwrap())
    }

    #[test]
    fn host_and_controller_agree_for_every_hash_and_group() {
        for (i, h) in HashId::ALL.into_iter().enumerate() {
            for g in [
                DhGroupId::Null,
                DhGroupId::Ffdhe2048,
                [
                    DhGroupId::Ffdhe3072,
                    DhGroupId::Ffdhe4096,
                    DhGroupId::Ffdhe8192,
                ][i],
            ] {
                for bidi in [false, true] {
                    let hs = secret(i as u8, 0x11, 32 + 16 * i);
                    let cs = secret(3, 0x22, 64);
                    let host = HostAuthConfig::new(HOST, SUB, hs.clone(), bidi.then(|| cs.clone()));
                    let mut ctrl = CtrlAuth::new(ctrl_cfg(hs, Some(cs), h, g));
                    assert_eq!(
                        run(&host, &mut ctrl, 3).unwrap(),
                        (h, g),
                        "{h:?} {g:?} {bidi}"
                    );
                    // Re-authentication on the same queue: a new transaction.
                    assert_eq!(run(&host, &mut ctrl, 4).unwrap(), (h, g));
                }
            }
        }
    }

    #[test]
    fn wrong_keys_fail_with_their_reason() {
        let good = secret(1, 0x11, 32);
        let bad = secret(1, 0x12, 32);
        let cs = secret(0, 0x22, 48);
        // Wrong host key: the controller answers Failure1 "authentication failed".
        let host = HostAuthConfig::new(HOST, SUB, bad.clone(), None);
        let mut ctrl = CtrlAuth::new(ctrl_cfg(
            good.clone(),
            None,
            HashId::Sha256,
            DhGroupId::Ffdhe2048,
        ));
        let e = run(&host, &mut ctrl, 1).unwrap_err();
        assert_eq!(
            e,
            AuthFailure::Peer {
                reason_code: 1,
                explanation: 1
            }
        );
        assert!(!ctrl.authenticated());
        assert!(e.to_string().contains("authentication failed"), "{e}");
        // Wrong controller key: the host refuses the controller.
        let host = HostAuthConfig::new(HOST, SUB, good.clone(), Some(secret(0, 0x23, 48)));
        let mut ctrl = CtrlAuth::new(ctrl_cfg(
            good.clone(),
            Some(cs),
            HashId::Sha512,
            DhGroupId::Null,
        ));
        let e = run(&host, &mut ctrl, 1).unwrap_err();
        assert_eq!(e.reason(), Some(Reason::Failed));
        assert!(matches!(e, AuthFailure::Local(_)));
        assert!(!ctrl.authenticated());
        // A host NQN other than the key's: the transformed keys differ.
        let mut other = HostAuthConfig::new(HOST, SUB, good.clone(), None);
        other.hostnqn = "nqn.2014-08.org.nvmexpress:uuid:other".into();
        let mut ctrl = CtrlAuth::new(ctrl_cfg(good, None, HashId::Sha256, DhGroupId::Null));
        assert!(run(&other, &mut ctrl, 1).is_err());
    }

    #[test]
    fn negotiation_failures_carry_reason_codes() {
        let s = secret(0, 1, 32);
        let mut host = HostAuthConfig::new(HOST, SUB, s.clone(), None);
        host.hashes = vec![HashId::Sha256];
        let mut ctrl = CtrlAuth::new(ctrl_cfg(s.clone(), None, HashId::Sha512, DhGroupId::Null));
        assert_eq!(
            run(&host, &mut ctrl, 1).unwrap_err().reason(),
            Some(Reason::HashUnusable)
        );
        host.dhgroups = vec![DhGroupId::Null];
        let mut ctrl = CtrlAuth::new(ctrl_cfg(s, None, HashId::Sha256, DhGroupId::Ffdhe2048));
        assert_eq!(
            run(&host, &mut ctrl, 1).unwrap_err().reason(),
            Some(Reason::DhGroupUnusable)
        );
    }

    #[test]
    fn hostile_messages_get_reason_codes() {
        let s = secret(0, 1, 32);
        let host = HostAuthConfig::new(HOST, SUB, s.clone(), None);
        let cfg = ctrl_cfg(s, None, HashId::Sha256, DhGroupId::Ffdhe2048);

        // A challenge with another transaction id.
        let mut ctrl = CtrlAuth::new(cfg.clone());
        let mut h = HostAuth::new(&host, 9);
        ctrl.on_send(&h.negotiate()).unwrap();
        let mut c = ctrl.on_receive(4096);
        c[4] ^= 1;
        let e = h.on_challenge(&c).unwrap_err();
        assert_eq!(e.reason(), Some(Reason::IncorrectPayload));
        assert_eq!(h.failure2(&e).unwrap()[1], 0xF0);

        // A reply with another transaction id, and one with an oversized DH value.
        for corrupt in [0usize, 1] {
            let mut ctrl = CtrlAuth::new(cfg.clone());
            let mut h = HostAuth::new(&host, 9);
            ctrl.on_send(&h.negotiate()).unwrap();
            let c = ctrl.on_receive(4096);
            let mut r = h.on_challenge(&c).unwrap();
            if corrupt == 0 {
                r[4] ^= 1;
            } else {
                let big = 300u16;
                r[10..12].copy_from_slice(&big.to_le_bytes());
                r.resize(16 + 64 + 300, 0xFF);
            }
            let e = ctrl.on_send(&r).unwrap_err();
            assert_eq!(e.reason(), Some(Reason::IncorrectPayload), "{e}");
            let f1 = ctrl.on_receive(4096);
            assert_eq!((f1[0], f1[1], f1[6], f1[7]), (0, 0xF1, 1, 6));
            assert!(!ctrl.authenticated());
        }

        // A replayed Reply (from an earlier transaction) does not verify against a new C1.
        let mut ctrl = CtrlAuth::new(cfg.clone());
        let mut h = HostAuth::new(&host, 5);
        ctrl.on_send(&h.negotiate()).unwrap();
        let c = ctrl.on_receive(4096);
        let old = h.on_challenge(&c).unwrap();
        ctrl.on_send(&old).unwrap();
        let _ = ctrl.on_receive(4096);
        assert!(ctrl.authenticated());
        let mut h2 = HostAuth::new(&host, 5);
        ctrl.on_send(&h2.negotiate()).unwrap();
        let _ = ctrl.on_receive(4096);
        assert_eq!(
            ctrl.on_send(&old).unwrap_err().reason(),
            Some(Reason::Failed)
        );

        // Messages out of order and garbage.
        let mut ctrl = CtrlAuth::new(cfg);
        assert_eq!(
            ctrl.on_send(&Message::Success2 { t_id: 0 }.encode())
                .unwrap_err()
                .reason(),
            Some(Reason::IncorrectMessage)
        );
        let f = ctrl.on_receive(4096);
        assert_eq!(f[1], 0xF1);
        let f = ctrl.on_receive(4096);
        assert_eq!((f[1], f[7]), (0xF1, 7), "receive with nothing pending");
        for junk in [&[][..], &[1, 2, 3], &[0xFF; 64]] {
            assert!(ctrl.on_send(junk).is_err());
        }
        let mut h = HostAuth::new(&host, 1);
        assert!(h.on_challenge(&[1, 1, 0, 0, 1, 0]).is_err());
        assert!(h.on_success1(&[1, 3, 0, 0, 1, 0, 0, 0]).is_err());
    }
}
