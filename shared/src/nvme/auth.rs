//! NVMe in-band authentication on the wire: the Authentication Send and Authentication
//! Receive Fabrics commands (NVMe Base 2.0 §6.2, §6.1) and the DH-HMAC-CHAP protocol's
//! messages (§8.13: AUTH_Negotiate, DH-HMAC-CHAP_Challenge, _Reply, _Success1, _Success2,
//! AUTH_Failure1/2 with their reason codes).
//!
//! This module only encodes and decodes: the hashes, Diffie-Hellman and the HMAC inputs live
//! in nacred (`nacre_dpu::auth`). Every decoder takes an arbitrary byte slice and returns a
//! [`MsgError`] naming the failure reason code explanation a peer is owed,
//! never panics and never reads past the slice.

use super::{admin_opcode, fabrics::fctype, get_u16, get_u32, put_u16, put_u32, Command};

/// SECP of both commands for DH-HMAC-CHAP (NVMe Base 2.0 §6.2: "NVMe-oF in-band
/// authentication").
pub const SECP_NVME_AUTH: u8 = 0xE9;
/// SPSP0/SPSP1 for the authentication protocol messages (§6.2: SPSP = 0101h).
pub const SPSP_AUTH: u8 = 0x01;

/// Connect response Dword 0 bits 31:16 are AUTHREQ (NVMe Base 2.0 §6.3): bit 17 ATR,
/// "authentication transaction required"; bit 18 ASCR, "authentication for a secure channel
/// required" (TLS concatenation, not supported here).
pub const CONNECT_AUTHREQ_ATR: u32 = 1 << 17;
pub const CONNECT_AUTHREQ_ASCR: u32 = 1 << 18;

/// Authentication message types (AUTH-TYPE).
pub mod auth_type {
    pub const COMMON: u8 = 0x00;
    pub const DHCHAP: u8 = 0x01;
}

/// AUTH-ID of each message: common messages and DH-HMAC-CHAP messages.
pub mod auth_id {
    pub const NEGOTIATE: u8 = 0x00;
    pub const CHALLENGE: u8 = 0x01;
    pub const REPLY: u8 = 0x02;
    pub const SUCCESS1: u8 = 0x03;
    pub const SUCCESS2: u8 = 0x04;
    pub const FAILURE2: u8 = 0xF0;
    pub const FAILURE1: u8 = 0xF1;
}

/// AUTHID of the DH-HMAC-CHAP protocol descriptor in AUTH_Negotiate.
pub const AUTHID_DHCHAP: u8 = 0x01;

/// Reason Code of AUTH_Failure1/2: 01h "authentication failure".
pub const FAILURE_REASON_FAILED: u8 = 0x01;

/// Reason Code Explanation of AUTH_Failure1/2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Reason {
    /// 01h: authentication failed (a response did not verify).
    Failed = 0x01,
    /// 02h: authentication protocol not usable.
    ProtocolUnusable = 0x02,
    /// 03h: secure channel concatenation mismatch.
    ConcatMismatch = 0x03,
    /// 04h: hash function not usable.
    HashUnusable = 0x04,
    /// 05h: DH group not usable.
    DhGroupUnusable = 0x05,
    /// 06h: incorrect payload.
    IncorrectPayload = 0x06,
    /// 07h: incorrect protocol message.
    IncorrectMessage = 0x07,
}

impl Reason {
    pub fn from_u8(v: u8) -> Option<Reason> {
        Some(match v {
            0x01 => Reason::Failed,
            0x02 => Reason::ProtocolUnusable,
            0x03 => Reason::ConcatMismatch,
            0x04 => Reason::HashUnusable,
            0x05 => Reason::DhGroupUnusable,
            0x06 => Reason::IncorrectPayload,
            0x07 => Reason::IncorrectMessage,
            _ => return None,
        })
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Failed => "authentication failed",
            Reason::ProtocolUnusable => "authentication protocol not usable",
            Reason::ConcatMismatch => "secure channel concatenation mismatch",
            Reason::HashUnusable => "hash function not usable",
            Reason::DhGroupUnusable => "DH group not usable",
            Reason::IncorrectPayload => "incorrect payload",
            Reason::IncorrectMessage => "incorrect protocol message",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (reason code explanation {:#04x})",
            self.as_str(),
            *self as u8
        )
    }
}

/// Hash function identifiers of DH-HMAC-CHAP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum HashId {
    Sha256 = 0x01,
    Sha384 = 0x02,
    Sha512 = 0x03,
}

impl HashId {
    pub const ALL: [HashId; 3] = [HashId::Sha256, HashId::Sha384, HashId::Sha512];
    pub fn from_u8(v: u8) -> Option<HashId> {
        Some(match v {
            0x01 => HashId::Sha256,
            0x02 => HashId::Sha384,
            0x03 => HashId::Sha512,
            _ => return None,
        })
    }
    /// Output length in bytes (the HL of the messages).
    pub fn digest_len(self) -> usize {
        match self {
            HashId::Sha256 => 32,
            HashId::Sha384 => 48,
            HashId::Sha512 => 64,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            HashId::Sha256 => "sha256",
            HashId::Sha384 => "sha384",
            HashId::Sha512 => "sha512",
        }
    }
}

impl std::str::FromStr for HashId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        HashId::ALL
            .into_iter()
            .find(|h| h.name() == s)
            .ok_or_else(|| format!("hash {s:?} is not sha256, sha384 or sha512"))
    }
}

/// Diffie-Hellman group identifiers of DH-HMAC-CHAP: the null group (no DH
/// exchange) and the RFC 7919 groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum DhGroupId {
    Null = 0x00,
    Ffdhe2048 = 0x01,
    Ffdhe3072 = 0x02,
    Ffdhe4096 = 0x03,
    Ffdhe6144 = 0x04,
    Ffdhe8192 = 0x05,
}

impl DhGroupId {
    pub const ALL: [DhGroupId; 6] = [
        DhGroupId::Null,
        DhGroupId::Ffdhe2048,
        DhGroupId::Ffdhe3072,
        DhGroupId::Ffdhe4096,
        DhGroupId::Ffdhe6144,
        DhGroupId::Ffdhe8192,
    ];
    pub fn from_u8(v: u8) -> Option<DhGroupId> {
        DhGroupId::ALL.into_iter().find(|g| *g as u8 == v)
    }
    /// Bytes of a public value and of the shared secret (the prime's size); 0 for null.
    pub fn value_len(self) -> usize {
        match self {
            DhGroupId::Null => 0,
            DhGroupId::Ffdhe2048 => 256,
            DhGroupId::Ffdhe3072 => 384,
            DhGroupId::Ffdhe4096 => 512,
            DhGroupId::Ffdhe6144 => 768,
            DhGroupId::Ffdhe8192 => 1024,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DhGroupId::Null => "null",
            DhGroupId::Ffdhe2048 => "ffdhe2048",
            DhGroupId::Ffdhe3072 => "ffdhe3072",
            DhGroupId::Ffdhe4096 => "ffdhe4096",
            DhGroupId::Ffdhe6144 => "ffdhe6144",
            DhGroupId::Ffdhe8192 => "ffdhe8192",
        }
    }
}

impl std::str::FromStr for DhGroupId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DhGroupId::ALL
            .into_iter()
            .find(|g| g.name() == s)
            .ok_or_else(|| format!("DH group {s:?} is not null or ffdhe2048..ffdhe8192"))
    }
}

/// The receive buffer a host offers for AUTH_Receive (Linux and SPDK use the same 4 KiB):
/// the largest message, a Challenge with SHA-512 and ffdhe8192, is 16 + 64 + 1024 bytes.
pub const AUTH_RECEIVE_LEN: u32 = 4096;

/// Lengths of the fixed parts of the messages (§8.13).
const NEGOTIATE_HDR: usize = 8;
const PROTOCOL_DESC: usize = 64;
const CHALLENGE_HDR: usize = 16;
const REPLY_HDR: usize = 16;
const SUCCESS1_HDR: usize = 16;
const SUCCESS2_LEN: usize = 16;
const FAILURE_LEN: usize = 8;
/// Hash and DH group identifier lists of the protocol descriptor: 30 bytes each.
const ID_LIST_LEN: usize = 30;

/// A message could not be taken: the reason code explanation a peer is owed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {what}")]
pub struct MsgError {
    pub reason: Reason,
    pub what: String,
}

impl MsgError {
    pub fn new(reason: Reason, what: impl Into<String>) -> Self {
        MsgError {
            reason,
            what: what.into(),
        }
    }
    fn payload(what: impl Into<String>) -> Self {
        Self::new(Reason::IncorrectPayload, what)
    }
}

/// One authentication message (§8.13).
#[derive(Clone, PartialEq, Eq)]
pub enum Message {
    /// AUTH_Negotiate, host to controller: the DH-HMAC-CHAP descriptor's hash
    /// and DH group lists, in the host's order of preference.
    Negotiate {
        t_id: u16,
        sc_c: u8,
        hashes: Vec<u8>,
        dhgroups: Vec<u8>,
    },
    /// DH-HMAC-CHAP_Challenge, controller to host.
    Challenge {
        t_id: u16,
        hash: u8,
        dhgroup: u8,
        seqnum: u32,
        /// C1, HL bytes.
        challenge: Vec<u8>,
        /// The controller's DH public value (empty for the null group).
        dh_value: Vec<u8>,
    },
    /// DH-HMAC-CHAP_Reply, host to controller.
    Reply {
        t_id: u16,
        /// The host's response R1, HL bytes.
        response: Vec<u8>,
        /// C2 when the host asks to authenticate the controller (CVALID set), else `None`
        /// (HL zero bytes on the wire).
        challenge: Option<Vec<u8>>,
        /// S2 (0 when the controller is not authenticated).
        seqnum: u32,
        dh_value: Vec<u8>,
    },
    /// DH-HMAC-CHAP_Success1, controller to host: R2 when the host asked.
    Success1 {
        t_id: u16,
        hl: u8,
        response: Option<Vec<u8>>,
    },
    /// DH-HMAC-CHAP_Success2, host to controller: the controller's response verified.
    Success2 { t_id: u16 },
    /// AUTH_Failure1 (controller to host) or AUTH_Failure2 (host to controller).
    Failure {
        t_id: u16,
        /// True for Failure1.
        from_controller: bool,
        reason_code: u8,
        explanation: u8,
    },
}

impl std::fmt::Debug for Message {
    // Challenges and responses are not secrets, but a log has no use for them either: the
    // Debug form names the message and its identifiers only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Message::Negotiate {
                t_id,
                hashes,
                dhgroups,
                ..
            } => write!(
                f,
                "AUTH_Negotiate(t_id={t_id}, hashes={hashes:?}, dhgroups={dhgroups:?})"
            ),
            Message::Challenge {
                t_id,
                hash,
                dhgroup,
                seqnum,
                dh_value,
                ..
            } => write!(
                f,
                "DH-HMAC-CHAP_Challenge(t_id={t_id}, hash={hash}, dhgroup={dhgroup}, seqnum={seqnum}, dhvlen={})",
                dh_value.len()
            ),
            Message::Reply {
                t_id,
                challenge,
                seqnum,
                dh_value,
                ..
            } => write!(
                f,
                "DH-HMAC-CHAP_Reply(t_id={t_id}, cvalid={}, seqnum={seqnum}, dhvlen={})",
                challenge.is_some(),
                dh_value.len()
            ),
            Message::Success1 { t_id, response, .. } => write!(
                f,
                "DH-HMAC-CHAP_Success1(t_id={t_id}, rvalid={})",
                response.is_some()
            ),
            Message::Success2 { t_id } => write!(f, "DH-HMAC-CHAP_Success2(t_id={t_id})"),
            Message::Failure {
                t_id,
                from_controller,
                reason_code,
                explanation,
            } => write!(
                f,
                "AUTH_Failure{}(t_id={t_id}, rc={reason_code:#04x}, rce={explanation:#04x})",
                if *from_controller { 1 } else { 2 }
            ),
        }
    }
}

impl Message {
    pub fn t_id(&self) -> u16 {
        match self {
            Message::Negotiate { t_id, .. }
            | Message::Challenge { t_id, .. }
            | Message::Reply { t_id, .. }
            | Message::Success1 { t_id, .. }
            | Message::Success2 { t_id }
            | Message::Failure { t_id, .. } => *t_id,
        }
    }

    /// A Failure message with reason code 01h and `reason`.
    pub fn failure(t_id: u16, from_controller: bool, reason: Reason) -> Message {
        Message::Failure {
            t_id,
            from_controller,
            reason_code: FAILURE_REASON_FAILED,
            explanation: reason as u8,
        }
    }

    /// The message's bytes (what AUTH_Send carries, or AUTH_Receive returns).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Message::Negotiate {
                t_id,
                sc_c,
                hashes,
                dhgroups,
            } => {
                let mut b = vec![0u8; NEGOTIATE_HDR + PROTOCOL_DESC];
                b[0] = auth_type::COMMON;
                b[1] = auth_id::NEGOTIATE;
                put_u16(&mut b, 4, *t_id);
                b[6] = *sc_c;
                b[7] = 1; // NAPD: one protocol descriptor
                let d = &mut b[NEGOTIATE_HDR..];
                d[0] = AUTHID_DHCHAP;
                let nh = hashes.len().min(ID_LIST_LEN);
                let nd = dhgroups.len().min(ID_LIST_LEN);
                d[2] = nh as u8;
                d[3] = nd as u8;
                d[4..4 + nh].copy_from_slice(&hashes[..nh]);
                d[4 + ID_LIST_LEN..4 + ID_LIST_LEN + nd].copy_from_slice(&dhgroups[..nd]);
                b
            }
            Message::Challenge {
                t_id,
                hash,
                dhgroup,
                seqnum,
                challenge,
                dh_value,
            } => {
                let mut b = vec![0u8; CHALLENGE_HDR];
                b[0] = auth_type::DHCHAP;
                b[1] = auth_id::CHALLENGE;
                put_u16(&mut b, 4, *t_id);
                b[6] = challenge.len() as u8;
                b[8] = *hash;
                b[9] = *dhgroup;
                put_u16(&mut b, 10, dh_value.len() as u16);
                put_u32(&mut b, 12, *seqnum);
                b.extend_from_slice(challenge);
                b.extend_from_slice(dh_value);
                b
            }
            Message::Reply {
                t_id,
                response,
                challenge,
                seqnum,
                dh_value,
            } => {
                let hl = response.len();
                let mut b = vec![0u8; REPLY_HDR];
                b[0] = auth_type::DHCHAP;
                b[1] = auth_id::REPLY;
                put_u16(&mut b, 4, *t_id);
                b[6] = hl as u8;
                b[8] = challenge.is_some() as u8;
                put_u16(&mut b, 10, dh_value.len() as u16);
                put_u32(&mut b, 12, *seqnum);
                b.extend_from_slice(response);
                match challenge {
                    Some(c) => b.extend_from_slice(c),
                    None => b.resize(b.len() + hl, 0),
                }
                b.extend_from_slice(dh_value);
                b
            }
            Message::Success1 { t_id, hl, response } => {
                let mut b = vec![0u8; SUCCESS1_HDR];
                b[0] = auth_type::DHCHAP;
                b[1] = auth_id::SUCCESS1;
                put_u16(&mut b, 4, *t_id);
                b[6] = *hl;
                if let Some(r) = response {
                    b[8] = 1; // RVALID
                    b.extend_from_slice(r);
                }
                b
            }
            Message::Success2 { t_id } => {
                let mut b = vec![0u8; SUCCESS2_LEN];
                b[0] = auth_type::DHCHAP;
                b[1] = auth_id::SUCCESS2;
                put_u16(&mut b, 4, *t_id);
                b
            }
            Message::Failure {
                t_id,
                from_controller,
                reason_code,
                explanation,
            } => {
                let mut b = vec![0u8; FAILURE_LEN];
                b[0] = auth_type::COMMON;
                b[1] = if *from_controller {
                    auth_id::FAILURE1
                } else {
                    auth_id::FAILURE2
                };
                put_u16(&mut b, 4, *t_id);
                b[6] = *reason_code;
                b[7] = *explanation;
                b
            }
        }
    }

    /// Decode a message. `b` is what the peer sent (AUTH_Send's TL bytes, or the AUTH_Receive
    /// buffer, which may be longer than the message).
    pub fn decode(b: &[u8]) -> Result<Message, MsgError> {
        if b.len() < FAILURE_LEN {
            return Err(MsgError::payload(format!(
                "{} bytes is shorter than any authentication message",
                b.len()
            )));
        }
        let t_id = get_u16(b, 4);
        match (b[0], b[1]) {
            (auth_type::COMMON, auth_id::NEGOTIATE) => {
                need(b, NEGOTIATE_HDR + PROTOCOL_DESC, "AUTH_Negotiate")?;
                let napd = b[7];
                if napd == 0 {
                    return Err(MsgError::new(
                        Reason::ProtocolUnusable,
                        "AUTH_Negotiate offers no authentication protocol",
                    ));
                }
                // Each descriptor is 64 bytes; the DH-HMAC-CHAP one is what we speak.
                let n = (napd as usize).min((b.len() - NEGOTIATE_HDR) / PROTOCOL_DESC);
                for i in 0..n {
                    let d = &b[NEGOTIATE_HDR + i * PROTOCOL_DESC..][..PROTOCOL_DESC];
                    if d[0] != AUTHID_DHCHAP {
                        continue;
                    }
                    let (nh, nd) = (d[2] as usize, d[3] as usize);
                    if nh == 0 || nh > ID_LIST_LEN || nd == 0 || nd > ID_LIST_LEN {
                        return Err(MsgError::payload(format!(
                            "AUTH_Negotiate lists {nh} hashes and {nd} DH groups (1 to 30 each)"
                        )));
                    }
                    return Ok(Message::Negotiate {
                        t_id,
                        sc_c: b[6],
                        hashes: d[4..4 + nh].to_vec(),
                        dhgroups: d[4 + ID_LIST_LEN..4 + ID_LIST_LEN + nd].to_vec(),
                    });
                }
                Err(MsgError::new(
                    Reason::ProtocolUnusable,
                    "AUTH_Negotiate offers no DH-HMAC-CHAP descriptor",
                ))
            }
            (auth_type::DHCHAP, auth_id::CHALLENGE) => {
                need(b, CHALLENGE_HDR, "DH-HMAC-CHAP_Challenge")?;
                let hl = b[6] as usize;
                let dhvlen = get_u16(b, 10) as usize;
                need(b, CHALLENGE_HDR + hl + dhvlen, "DH-HMAC-CHAP_Challenge")?;
                Ok(Message::Challenge {
                    t_id,
                    hash: b[8],
                    dhgroup: b[9],
                    seqnum: get_u32(b, 12),
                    challenge: b[CHALLENGE_HDR..CHALLENGE_HDR + hl].to_vec(),
                    dh_value: b[CHALLENGE_HDR + hl..CHALLENGE_HDR + hl + dhvlen].to_vec(),
                })
            }
            (auth_type::DHCHAP, auth_id::REPLY) => {
                need(b, REPLY_HDR, "DH-HMAC-CHAP_Reply")?;
                let hl = b[6] as usize;
                let cvalid = b[8] & 1 != 0;
                let dhvlen = get_u16(b, 10) as usize;
                need(b, REPLY_HDR + 2 * hl + dhvlen, "DH-HMAC-CHAP_Reply")?;
                let r = &b[REPLY_HDR..];
                Ok(Message::Reply {
                    t_id,
                    response: r[..hl].to_vec(),
                    challenge: cvalid.then(|| r[hl..2 * hl].to_vec()),
                    seqnum: get_u32(b, 12),
                    dh_value: r[2 * hl..2 * hl + dhvlen].to_vec(),
                })
            }
            (auth_type::DHCHAP, auth_id::SUCCESS1) => {
                need(b, SUCCESS1_HDR, "DH-HMAC-CHAP_Success1")?;
                let hl = b[6];
                let rvalid = b[8] & 1 != 0;
                if rvalid {
                    need(b, SUCCESS1_HDR + hl as usize, "DH-HMAC-CHAP_Success1")?;
                }
                Ok(Message::Success1 {
                    t_id,
                    hl,
                    response: rvalid.then(|| b[SUCCESS1_HDR..SUCCESS1_HDR + hl as usize].to_vec()),
                })
            }
            (auth_type::DHCHAP, auth_id::SUCCESS2) => {
                need(b, SUCCESS2_LEN, "DH-HMAC-CHAP_Success2")?;
                Ok(Message::Success2 { t_id })
            }
            (auth_type::COMMON, id @ (auth_id::FAILURE1 | auth_id::FAILURE2)) => {
                Ok(Message::Failure {
                    t_id,
                    from_controller: id == auth_id::FAILURE1,
                    reason_code: b[6],
                    explanation: b[7],
                })
            }
            (t, id) => Err(MsgError::new(
                Reason::IncorrectMessage,
                format!("unknown authentication message (AUTH-TYPE {t:#04x}, AUTH-ID {id:#04x})"),
            )),
        }
    }
}

fn need(b: &[u8], n: usize, what: &str) -> Result<(), MsgError> {
    if b.len() < n {
        return Err(MsgError::payload(format!(
            "{what} needs {n} bytes, got {}",
            b.len()
        )));
    }
    Ok(())
}

/// The Authentication Send / Receive command fields (NVMe Base 2.0 §6.2, §6.1): SECP, SPSP0,
/// SPSP1 and the transfer (TL) or allocation (AL) length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthCommand {
    /// True: Authentication Send (host to controller). False: Authentication Receive.
    pub send: bool,
    pub secp: u8,
    pub spsp0: u8,
    pub spsp1: u8,
    /// TL (send) or AL (receive), bytes.
    pub len: u32,
}

impl AuthCommand {
    pub fn send(len: u32) -> Self {
        AuthCommand {
            send: true,
            secp: SECP_NVME_AUTH,
            spsp0: SPSP_AUTH,
            spsp1: SPSP_AUTH,
            len,
        }
    }
    pub fn receive(len: u32) -> Self {
        AuthCommand {
            send: false,
            ..Self::send(len)
        }
    }

    /// The SQE: Fabrics opcode, FCTYPE 05h/06h, the SGL left for the transport to fill in
    /// (like any command with data), SECP at byte 43, SPSP1/0 at 42/41, TL/AL at 44.
    pub fn to_command(&self) -> Command {
        let mut b = [0u8; 64];
        b[0] = admin_opcode::FABRICS;
        b[4] = if self.send {
            fctype::AUTHENTICATION_SEND
        } else {
            fctype::AUTHENTICATION_RECEIVE
        };
        b[41] = self.spsp0;
        b[42] = self.spsp1;
        b[43] = self.secp;
        put_u32(&mut b, 44, self.len);
        Command::decode(&b)
    }

    /// The fields of an Authentication Send/Receive SQE; `None` for other commands.
    pub fn from_command(c: &Command) -> Option<Self> {
        let b = c.to_bytes();
        if b[0] != admin_opcode::FABRICS {
            return None;
        }
        let send = match b[4] {
            fctype::AUTHENTICATION_SEND => true,
            fctype::AUTHENTICATION_RECEIVE => false,
            _ => return None,
        };
        Some(AuthCommand {
            send,
            secp: b[43],
            spsp0: b[41],
            spsp1: b[42],
            len: get_u32(&b, 44),
        })
    }

    /// Whether SECP/SPSP name the in-band authentication protocol.
    pub fn is_nvme_auth(&self) -> bool {
        self.secp == SECP_NVME_AUTH && self.spsp0 == SPSP_AUTH && self.spsp1 == SPSP_AUTH
    }
}

#[cfg(test)]
mod test {
    use super::*;

    fn round_trip(m: Message) {
        let b = m.encode();
        assert_eq!(Message::decode(&b).unwrap(), m, "{m:?}");
    }

    #[test]
    fn messages_round_trip() {
        round_trip(Message::Negotiate {
            t_id: 7,
            sc_c: 0,
            hashes: vec![1, 2, 3],
            dhgroups: vec![0, 1, 2, 3, 4, 5],
        });
        round_trip(Message::Challenge {
            t_id: 7,
            hash: 1,
            dhgroup: 1,
            seqnum: 99,
            challenge: vec![0xAB; 32],
            dh_value: vec![0xCD; 256],
        });
        round_trip(Message::Reply {
            t_id: 7,
            response: vec![1; 48],
            challenge: Some(vec![2; 48]),
            seqnum: 5,
            dh_value: vec![],
        });
        round_trip(Message::Reply {
            t_id: 7,
            response: vec![1; 32],
            challenge: None,
            seqnum: 0,
            dh_value: vec![3; 384],
        });
        round_trip(Message::Success1 {
            t_id: 7,
            hl: 64,
            response: Some(vec![9; 64]),
        });
        round_trip(Message::Success1 {
            t_id: 7,
            hl: 32,
            response: None,
        });
        round_trip(Message::Success2 { t_id: 7 });
        round_trip(Message::failure(7, true, Reason::HashUnusable));
        round_trip(Message::failure(7, false, Reason::Failed));
    }

    #[test]
    fn byte_layouts() {
        // AUTH_Negotiate: 8-byte header + one 64-byte descriptor; hash list at descriptor
        // byte 4, DH list at byte 34.
        let b = Message::Negotiate {
            t_id: 0x0102,
            sc_c: 0,
            hashes: vec![1, 2, 3],
            dhgroups: vec![0, 1],
        }
        .encode();
        assert_eq!(b.len(), 72);
        assert_eq!(&b[..8], &[0, 0, 0, 0, 2, 1, 0, 1]);
        assert_eq!(&b[8..12], &[1, 0, 3, 2]);
        assert_eq!(&b[12..15], &[1, 2, 3]);
        assert_eq!(&b[42..44], &[0, 1]);
        // Reply: header, R1, C2 (zeros without CVALID), DH value.
        let b = Message::Reply {
            t_id: 1,
            response: vec![0xEE; 32],
            challenge: None,
            seqnum: 0,
            dh_value: vec![0x11; 256],
        }
        .encode();
        assert_eq!(b.len(), 16 + 64 + 256);
        assert_eq!((b[0], b[1], b[6], b[8]), (1, 2, 32, 0));
        assert_eq!(&b[10..12], &256u16.to_le_bytes());
        assert!(b[48..80].iter().all(|&x| x == 0));
        let f = Message::failure(3, true, Reason::DhGroupUnusable).encode();
        assert_eq!(f, vec![0, 0xF1, 0, 0, 3, 0, 1, 5]);
    }

    #[test]
    fn auth_commands() {
        let c = AuthCommand::send(72).to_command();
        let b = c.to_bytes();
        assert_eq!((b[0], b[4], b[41], b[42], b[43]), (0x7F, 0x05, 1, 1, 0xE9));
        assert_eq!(&b[44..48], &72u32.to_le_bytes());
        let a = AuthCommand::from_command(&c).unwrap();
        assert!(a.send && a.is_nvme_auth() && a.len == 72);
        let r = AuthCommand::receive(4096).to_command();
        let a = AuthCommand::from_command(&r).unwrap();
        assert!(!a.send && a.len == 4096);
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        assert_eq!(
            Message::decode(&[]).unwrap_err().reason,
            Reason::IncorrectPayload
        );
        assert_eq!(
            Message::decode(&[9, 9, 0, 0, 0, 0, 0, 0])
                .unwrap_err()
                .reason,
            Reason::IncorrectMessage
        );
        // A Challenge whose DHVLEN runs past the buffer.
        let mut c = Message::Challenge {
            t_id: 1,
            hash: 1,
            dhgroup: 1,
            seqnum: 1,
            challenge: vec![0; 32],
            dh_value: vec![0; 256],
        }
        .encode();
        c[10] = 0xFF;
        c[11] = 0xFF;
        assert_eq!(
            Message::decode(&c).unwrap_err().reason,
            Reason::IncorrectPayload
        );
        // Every truncation and every single-byte corruption of every message decodes to a
        // message or an error.
        let msgs = [
            Message::Negotiate {
                t_id: 1,
                sc_c: 0,
                hashes: vec![1],
                dhgroups: vec![0],
            }
            .encode(),
            c,
            Message::Success1 {
                t_id: 1,
                hl: 32,
                response: Some(vec![1; 32]),
            }
            .encode(),
        ];
        for m in &msgs {
            for n in 0..m.len() {
                let _ = Message::decode(&m[..n]);
            }
            for i in 0..m.len().min(80) {
                for v in [0u8, 1, 0x1F, 0x7F, 0xFF] {
                    let mut x = m.clone();
                    x[i] = v;
                    let _ = Message::decode(&x);
                }
            }
        }
        // A Negotiate without a DH-HMAC-CHAP descriptor is "protocol not usable".
        let mut n = msgs[0].clone();
        n[8] = 0x02;
        assert_eq!(
            Message::decode(&n).unwrap_err().reason,
            Reason::ProtocolUnusable
        );
    }
}
