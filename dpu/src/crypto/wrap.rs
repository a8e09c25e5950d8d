//! Wrapping data keys under a tenant KEK with AES-256-GCM (NIST SP 800-38D).
//!
//! A wrapped key is `nonce (12 bytes, random) ‖ ciphertext ‖ tag (16 bytes)`; the associated
//! data binds it to where it belongs — tenant, volume, data-key version and the KEK
//! generation that wrapped it — so a wrapped key copied to another volume's record, or an
//! altered record, fails authentication instead of yielding a wrong key. Only wrapped keys
//! are ever serialised.
//!
//! A KEK *check* is the GCM tag of an empty message under the KEK with its own associated
//! data: it lets the daemon tell "wrong key file or passphrase" apart from "tampered key
//! record" without storing anything derived from the KEK that would help an attacker.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use super::keys::{Kek, XtsKey};
use super::CryptoError;

/// GCM nonce length (96 bits, SP 800-38D §5.2.1.1 recommended size).
pub const NONCE_LEN: usize = 12;

/// Domain separation for the associated data of wrapped data keys.
const AAD_DATA_KEY: &[u8] = b"nacre/xts-data-key/v1";
/// Domain separation for KEK checks.
const AAD_KEK_CHECK: &[u8] = b"nacre/kek-check/v1";

/// A sealed blob: `nonce ‖ ciphertext ‖ tag`, serialised as lower-case hex.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Sealed(#[serde(with = "hex_bytes")] pub Vec<u8>);

impl std::fmt::Debug for Sealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Ciphertext is not secret, but there is no reason to print it either.
        write!(f, "Sealed({} bytes)", self.0.len())
    }
}

/// Where a wrapped data key belongs; all of it goes into the associated data.
#[derive(Debug, Clone, Copy)]
pub struct KeyContext<'a> {
    pub tenant: &'a str,
    pub volume: &'a str,
    /// Version of the data key (a new data key gets a new version).
    pub key_version: u32,
    /// Generation of the KEK that wraps it (incremented by every KEK rotation).
    pub kek_generation: u32,
}

/// Length-prefix each field so ("ab","c") and ("a","bc") differ.
fn push_field(aad: &mut Vec<u8>, field: &[u8]) {
    aad.extend_from_slice(&(field.len() as u32).to_be_bytes());
    aad.extend_from_slice(field);
}

impl KeyContext<'_> {
    fn aad(&self) -> Vec<u8> {
        let mut aad = Vec::with_capacity(64);
        push_field(&mut aad, AAD_DATA_KEY);
        push_field(&mut aad, self.tenant.as_bytes());
        push_field(&mut aad, self.volume.as_bytes());
        aad.extend_from_slice(&self.key_version.to_be_bytes());
        aad.extend_from_slice(&self.kek_generation.to_be_bytes());
        aad
    }
}

fn seal(kek: &Kek, plaintext: &[u8], aad: &[u8]) -> Result<Sealed, CryptoError> {
    let cipher = Aes256Gcm::new(kek.as_bytes().into());
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| CryptoError::Random(e.to_string()))?;
    let ct = cipher
        .encrypt(
            &Nonce::from(nonce),
            Payload {
                msg: plaintext,
                aad,
            },
        )
        .map_err(|_| CryptoError::Engine("AES-GCM encryption failed".into()))?;
    let mut out = Vec::with_capacity(NONCE_LEN + ct.len());
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&ct);
    Ok(Sealed(out))
}

/// Open a sealed blob; `None` when authentication fails (wrong KEK or altered blob).
fn open(kek: &Kek, sealed: &Sealed, aad: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
    if sealed.0.len() < NONCE_LEN + 16 {
        return None;
    }
    let (nonce, ct) = sealed.0.split_at(NONCE_LEN);
    let nonce: [u8; NONCE_LEN] = nonce.try_into().ok()?;
    let cipher = Aes256Gcm::new(kek.as_bytes().into());
    cipher
        .decrypt(&Nonce::from(nonce), Payload { msg: ct, aad })
        .ok()
        .map(Zeroizing::new)
}

/// Wrap a data key for `ctx` under `kek`.
pub fn wrap_key(kek: &Kek, key: &XtsKey, ctx: KeyContext<'_>) -> Result<Sealed, CryptoError> {
    seal(kek, key.as_bytes(), &ctx.aad())
}

/// Unwrap a data key. Authentication failure is reported as [`CryptoError::Tampered`]:
/// callers verify the KEK first ([`verify_kek_check`]), so a wrong KEK is reported as such.
pub fn unwrap_key(kek: &Kek, sealed: &Sealed, ctx: KeyContext<'_>) -> Result<XtsKey, CryptoError> {
    let pt = open(kek, sealed, &ctx.aad()).ok_or_else(|| CryptoError::Tampered {
        volume: ctx.volume.to_string(),
    })?;
    XtsKey::from_bytes(&pt)
}

fn check_aad(tenant: &str, generation: u32) -> Vec<u8> {
    let mut aad = Vec::new();
    push_field(&mut aad, AAD_KEK_CHECK);
    push_field(&mut aad, tenant.as_bytes());
    aad.extend_from_slice(&generation.to_be_bytes());
    aad
}

/// A check value for KEK generation `generation` of `tenant`.
pub fn kek_check(kek: &Kek, tenant: &str, generation: u32) -> Result<Sealed, CryptoError> {
    seal(kek, &[], &check_aad(tenant, generation))
}

/// Whether `kek` is the KEK `check` was made with.
pub fn verify_kek_check(kek: &Kek, check: &Sealed, tenant: &str, generation: u32) -> bool {
    open(kek, check, &check_aad(tenant, generation)).is_some()
}

/// Hex (de)serialisation for byte vectors.
pub(crate) mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn encode(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    pub fn decode(s: &str) -> Result<Vec<u8>, String> {
        if s.len() % 2 != 0 {
            return Err("odd number of hex digits".into());
        }
        (0..s.len())
            .step_by(2)
            .map(|i| {
                s.get(i..i + 2)
                    .and_then(|p| u8::from_str_radix(p, 16).ok())
                    .ok_or_else(|| format!("invalid hex at {i}"))
            })
            .collect()
    }

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        decode(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod test {
    use super::*;

    fn ctx<'a>(tenant: &'a str, volume: &'a str) -> KeyContext<'a> {
        KeyContext {
            tenant,
            volume,
            key_version: 1,
            kek_generation: 1,
        }
    }

    #[test]
    fn wrap_unwrap_round_trip_and_bindings() {
        let kek = Kek::generate().unwrap();
        let key = XtsKey::generate(64).unwrap();
        let w = wrap_key(&kek, &key, ctx("t", "v")).unwrap();
        assert_eq!(w.0.len(), NONCE_LEN + 64 + 16);
        assert!(!w.0.windows(16).any(|x| x == &key.as_bytes()[..16]));
        let back = unwrap_key(&kek, &w, ctx("t", "v")).unwrap();
        assert_eq!(back.as_bytes(), key.as_bytes());
        // Every bound field matters.
        for other in [
            ctx("t2", "v"),
            ctx("t", "v2"),
            KeyContext {
                key_version: 2,
                ..ctx("t", "v")
            },
            KeyContext {
                kek_generation: 2,
                ..ctx("t", "v")
            },
        ] {
            assert!(matches!(
                unwrap_key(&kek, &w, other),
                Err(CryptoError::Tampered { .. })
            ));
        }
    }

    #[test]
    fn tampered_tag_or_body_fails_authentication() {
        let kek = Kek::generate().unwrap();
        let key = XtsKey::generate(64).unwrap();
        let w = wrap_key(&kek, &key, ctx("t", "v")).unwrap();
        for i in [0, NONCE_LEN, NONCE_LEN + 40, w.0.len() - 1] {
            let mut bad = w.clone();
            bad.0[i] ^= 1;
            let e = unwrap_key(&kek, &bad, ctx("t", "v")).unwrap_err();
            assert!(e.to_string().contains("failed authentication"), "{e}");
        }
        assert!(unwrap_key(&kek, &Sealed(vec![1, 2, 3]), ctx("t", "v")).is_err());
    }

    #[test]
    fn kek_check_tells_keks_apart() {
        let a = Kek::generate().unwrap();
        let b = Kek::generate().unwrap();
        let c = kek_check(&a, "t", 1).unwrap();
        assert!(verify_kek_check(&a, &c, "t", 1));
        assert!(!verify_kek_check(&b, &c, "t", 1));
        assert!(!verify_kek_check(&a, &c, "t", 2));
        assert!(!verify_kek_check(&a, &c, "u", 1));
    }

    #[test]
    fn sealed_serialises_as_hex() {
        let s = Sealed(vec![0, 0xab, 0xff]);
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"00abff\"");
        let back: Sealed = serde_json::from_str("\"00abff\"").unwrap();
        assert_eq!(back, s);
        assert!(serde_json::from_str::<Sealed>("\"0g\"").is_err());
    }
}
