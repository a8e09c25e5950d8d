//! DH-HMAC-CHAP messages from a hostile peer (`crate::auth`, `nacre_shared::nvme::auth`).
//!
//! Input: records `[kind: u8][len: u16 LE][len bytes]` until the input ends. Each record's
//! bytes are decoded as a message (a decoded message must encode and decode to itself),
//! then given to one side of a transaction:
//! * even `kind` — the controller: an Authentication Send with those bytes, then an
//!   Authentication Receive (whose answer must decode);
//! * odd `kind` — the host, which negotiated first: the next message it expects (the
//!   Challenge, then Success1).
//!
//! Neither side may panic, and the controller must never count the host as authenticated:
//! the fuzzer does not know the host's key, so any Reply that verifies is a finding.

use nacre_shared::nvme::auth::{DhGroupId, HashId, Message};

use crate::auth::{CtrlAuth, CtrlAuthConfig, HostAuth, HostAuthConfig, Secret};

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:fuzz";

pub fn nvme_auth(data: &[u8]) {
    let secret = Secret::new(1, &[0x5A; 32]).expect("valid secret");
    let ctrl_secret = Secret::new(0, &[0xA5; 48]).expect("valid secret");
    let mut ctrl = CtrlAuth::new(CtrlAuthConfig {
        hostnqn: HOSTNQN.into(),
        subnqn: super::NQN.into(),
        host_secret: secret.clone(),
        ctrl_secret: Some(ctrl_secret.clone()),
        hashes: HashId::ALL.to_vec(),
        // The null group and the smallest DH group keep an execution short.
        dhgroups: vec![DhGroupId::Null, DhGroupId::Ffdhe2048],
    });
    let mut host_cfg = HostAuthConfig::new(HOSTNQN, super::NQN, secret, Some(ctrl_secret));
    host_cfg.dhgroups = vec![DhGroupId::Null, DhGroupId::Ffdhe2048];
    let mut host = HostAuth::new(&host_cfg, 1);
    let _ = host.negotiate();
    let mut host_step = 0;
    let mut rest = data;
    while rest.len() >= 3 {
        let kind = rest[0];
        let len = (u16::from_le_bytes([rest[1], rest[2]]) as usize).min(rest.len() - 3);
        let msg = &rest[3..3 + len];
        rest = &rest[3 + len..];
        if let Ok(m) = Message::decode(msg) {
            let again = Message::decode(&m.encode()).expect("an encoded message decodes");
            assert!(again == m, "{m:?} does not survive encode and decode");
        }
        if kind & 1 == 0 {
            let _ = ctrl.on_send(msg);
            let answer = ctrl.on_receive(4096);
            Message::decode(&answer).expect("the controller's answer decodes");
            assert!(
                !ctrl.authenticated(),
                "a forged Reply authenticated the host"
            );
        } else {
            let _ = match host_step {
                0 => host.on_challenge(msg).map(|_| ()),
                _ => host.on_success1(msg).map(|_| ()),
            };
            host_step += 1;
        }
    }
}
