//! DH-HMAC-CHAP secrets in the NVMe secret representation (NVMe Base 2.0 §8.13, the
//! format `nvme gen-dhchap-key` writes and Linux and SPDK read):
//!
//! ```text
//! DHHC-1:XX:<base64 of the key followed by the CRC-32 of the key, little-endian>:
//! ```
//!
//! `XX` names the hash the key is transformed with before use: 00 none, 01 SHA-256, 02
//! SHA-384, 03 SHA-512. The transformed key is HMAC-hash(key, NQN || "NVMe-over-Fabrics")
//! — the host's NQN for a host key, the subsystem's for a controller key ([`Secret::transform`]).
//!
//! A [`Secret`] holds the key bytes zeroized on drop; its `Debug` form shows only the hash
//! and length. Files holding secrets must not be readable by group or others
//! ([`Secret::load`]), and [`write_secret_file`] creates them mode 0600.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use nacre_shared::nvme::auth::HashId;
use zeroize::Zeroizing;

use super::hmac;
use super::key_text::KeyTextError;

/// The label of the transformation (§8.13).
const TRANSFORM_LABEL: &[u8] = b"NVMe-over-Fabrics";
/// Key lengths the representation allows.
pub const KEY_LENGTHS: [usize; 3] = [32, 48, 64];

/// A secret could not be read or used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("not a DH-HMAC-CHAP secret: {0} (expected DHHC-1:XX:<base64>:)")]
    Format(&'static str),
    #[error("DH-HMAC-CHAP secret has a bad CRC-32 (mistyped or truncated)")]
    Crc,
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: {err}")]
    File { path: String, err: String },
}

/// A DH-HMAC-CHAP secret: the transformation hash (0: none) and the key.
#[derive(Clone)]
pub struct Secret {
    hash: u8,
    key: Zeroizing<Vec<u8>>,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Secret(DHHC-1:{:02x}, {} bytes, <redacted>)",
            self.hash,
            self.key.len()
        )
    }
}

impl Secret {
    /// A secret from its key bytes (32, 48 or 64) and transformation hash (0-3).
    pub fn new(hash: u8, key: &[u8]) -> Result<Secret, SecretError> {
        if hash > 3 {
            return Err(SecretError::Invalid(format!(
                "transformation hash {hash:02x} is not 00-03"
            )));
        }
        if !KEY_LENGTHS.contains(&key.len()) {
            return Err(SecretError::Invalid(format!(
                "key is {} bytes; DH-HMAC-CHAP keys are 32, 48 or 64 bytes",
                key.len()
            )));
        }
        Ok(Secret {
            hash,
            key: Zeroizing::new(key.to_vec()),
        })
    }

    /// Parse the representation (surrounding whitespace allowed; the final ':' optional).
    pub fn parse(s: &str) -> Result<Secret, SecretError> {
        let (hash, key) = super::key_text::parse(s, "DHHC-1:", true).map_err(|e| match e {
            KeyTextError::Prefix => SecretError::Format("it does not start with DHHC-1:"),
            KeyTextError::Format(what) => SecretError::Format(what),
            KeyTextError::Crc => SecretError::Crc,
        })?;
        Secret::new(hash, &key)
    }

    /// The representation, `DHHC-1:XX:...:`. It holds the key: never log it.
    pub fn to_representation(&self) -> Zeroizing<String> {
        super::key_text::format("DHHC-1:", self.hash, &self.key)
    }

    /// The transformation hash (0: none).
    pub fn hash(&self) -> u8 {
        self.hash
    }

    pub fn key_len(&self) -> usize {
        self.key.len()
    }

    /// The key bytes.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The key as DH-HMAC-CHAP uses it: HMAC-hash(key, nqn || "NVMe-over-Fabrics") with the
    /// secret's transformation hash, or the key itself for hash 00.
    pub fn transform(&self, nqn: &str) -> Zeroizing<Vec<u8>> {
        match HashId::from_u8(self.hash) {
            None => Zeroizing::new(self.key.to_vec()),
            Some(h) => hmac(h, &self.key, &[nqn.as_bytes(), TRANSFORM_LABEL]),
        }
    }

    /// A new secret as `nvme gen-dhchap-key` makes one: `secret` (random when `None`) of
    /// `key_len` bytes; with a transformation hash the stored key is the secret already
    /// transformed with `nqn` (so the hash's length must be `key_len`).
    pub fn generate(
        hash: u8,
        key_len: usize,
        nqn: Option<&str>,
        secret: Option<&[u8]>,
    ) -> Result<Secret, SecretError> {
        if !KEY_LENGTHS.contains(&key_len) {
            return Err(SecretError::Invalid(format!(
                "key length {key_len} is not 32, 48 or 64"
            )));
        }
        let raw = match secret {
            Some(s) if s.len() != key_len => {
                return Err(SecretError::Invalid(format!(
                    "the secret is {} bytes, not the key length {key_len}",
                    s.len()
                )))
            }
            Some(s) => Zeroizing::new(s.to_vec()),
            None => {
                let mut r = Zeroizing::new(vec![0u8; key_len]);
                getrandom::fill(&mut r)
                    .map_err(|e| SecretError::Invalid(format!("no randomness: {e}")))?;
                r
            }
        };
        if hash == 0 {
            return Secret::new(0, &raw);
        }
        let h = HashId::from_u8(hash).ok_or_else(|| {
            SecretError::Invalid(format!("transformation hash {hash} is not 0-3"))
        })?;
        if h.digest_len() != key_len {
            return Err(SecretError::Invalid(format!(
                "key length {key_len} does not fit {} (its keys are {} bytes)",
                h.name(),
                h.digest_len()
            )));
        }
        let nqn = nqn.ok_or_else(|| {
            SecretError::Invalid(
                "a transformation hash needs the NQN the key belongs to (--nqn)".into(),
            )
        })?;
        nacre_shared::nvme::validate_nqn(nqn).map_err(SecretError::Invalid)?;
        Secret::new(hash, &Secret::new(hash, &raw)?.transform(nqn))
    }

    /// Read a secret from a file that only its owner may read (mode 0600 or stricter).
    pub fn load(path: &Path) -> Result<Secret, SecretError> {
        let file_err = |err: String| SecretError::File {
            path: path.display().to_string(),
            err,
        };
        let meta = std::fs::metadata(path).map_err(|e| file_err(e.to_string()))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(file_err(format!(
                "mode {mode:04o} lets others read this secret; chmod 600 it"
            )));
        }
        let text =
            Zeroizing::new(std::fs::read_to_string(path).map_err(|e| file_err(e.to_string()))?);
        Secret::parse(&text).map_err(|e| file_err(e.to_string()))
    }
}

/// Write `secret`'s representation to a new file of mode 0600 (an existing file is
/// replaced only if it already has no group/other permissions).
pub fn write_secret_file(path: &Path, secret: &Secret) -> Result<(), SecretError> {
    let file_err = |err: String| SecretError::File {
        path: path.display().to_string(),
        err,
    };
    let mut text = Zeroizing::new(secret.to_representation().to_string());
    text.push('\n');
    super::key_text::write_private_file(path, text.as_bytes()).map_err(file_err)
}

#[cfg(test)]
mod test {
    use super::*;

    const S32: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn representation_matches_nvme_cli() {
        // `nvme gen-dhchap-key --secret=<S32> --hmac=0 --key-length=32` (nvme-cli 2.3).
        let s = Secret::generate(0, 32, None, Some(&hex(S32))).unwrap();
        assert_eq!(
            &*s.to_representation(),
            "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"
        );
        // ... --hmac=1 --nqn=nqn.2014-08.org.nvmexpress:uuid:test
        let s = Secret::generate(
            1,
            32,
            Some("nqn.2014-08.org.nvmexpress:uuid:test"),
            Some(&hex(S32)),
        )
        .unwrap();
        assert_eq!(
            &*s.to_representation(),
            "DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:"
        );
        let p =
            Secret::parse("DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:\n").unwrap();
        assert_eq!((p.hash(), p.key()), (1, s.key()));
    }

    #[test]
    fn bad_representations_are_refused() {
        for bad in [
            "",
            "DHHC-2:00:AAAA:",
            "DHHC-1:0:AAAA:",
            "DHHC-1:zz:AAAA:",
            "DHHC-1:00:!!!!:",
            "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaS:",
            "DHHC-1:04:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
            "DHHC-1:00:AAECAwQF:",
        ] {
            assert!(Secret::parse(bad).is_err(), "{bad:?}");
        }
        assert!(matches!(
            Secret::parse("DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaS:"),
            Err(SecretError::Crc)
        ));
        assert!(Secret::generate(2, 32, Some("nqn.x"), None).is_err());
        assert!(Secret::generate(1, 32, None, None).is_err());
    }

    #[test]
    fn debug_is_redacted_and_files_are_private() {
        let s = Secret::generate(0, 32, None, Some(&hex(S32))).unwrap();
        let d = format!("{s:?}");
        assert!(!d.contains("AAEC") && !d.contains("0, 1, 2"), "{d}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("key");
        write_secret_file(&p, &s).unwrap();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(Secret::load(&p).unwrap().key(), s.key());
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Secret::load(&p).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        assert!(write_secret_file(&p, &s).is_err());
    }
}
