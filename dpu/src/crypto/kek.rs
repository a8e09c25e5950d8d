//! Where a tenant's key-encryption key comes from.
//!
//! [`KekSource`] is the seam for key management: today a key file (32 random bytes) or a
//! passphrase stretched with Argon2id (RFC 9106); or an envelope key encrypted by a key
//! manager over KMIP ([`super::kmip::KmsKek`]). Nothing in the data path or the key records
//! depends on which.
//! What is persisted about a source is its [`KekSpec`]: never the key, never the passphrase.

use std::path::{Path, PathBuf};

use argon2::{Algorithm, Argon2, Params, Version};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use super::keys::{Kek, KEK_LEN};
use super::wrap::hex_bytes;
use super::CryptoError;

/// Something that can produce a tenant's KEK.
pub trait KekSource: Send + Sync {
    /// The non-secret description to persist, from which the same source can be rebuilt
    /// (given the passphrase again, for passphrase sources).
    fn spec(&self) -> KekSpec;
    /// Produce the KEK.
    fn load(&self) -> Result<Kek, CryptoError>;
}

/// Argon2id cost parameters (RFC 9106 §3.1 names): memory in KiB, passes, lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Argon2Params {
    pub m_cost_kib: u32,
    pub t_cost: u32,
    pub p_cost: u32,
}

impl Default for Argon2Params {
    /// RFC 9106 §4's second recommended option (64 MiB, 3 passes), single lane because
    /// nacred runs on few cores: about a quarter second per derivation.
    fn default() -> Self {
        Argon2Params {
            m_cost_kib: 64 * 1024,
            t_cost: 3,
            p_cost: 1,
        }
    }
}

/// Upper bounds on what an operator (or a malformed request) may ask Argon2id for: the
/// memory cost is allocated in one piece, so an unbounded value would abort nacred, and the
/// time cost runs on the control plane's thread. 4 GiB and 64 passes are far beyond RFC
/// 9106's recommendations (2 GiB/1 pass, 64 MiB/3 passes).
pub const ARGON2_MAX_M_COST_KIB: u32 = 4 << 20;
pub const ARGON2_MAX_T_COST: u32 = 64;
pub const ARGON2_MAX_P_COST: u32 = 16;

impl Argon2Params {
    /// Refuse costs beyond the bounds above (and below Argon2's minimums).
    pub fn check(&self) -> Result<(), CryptoError> {
        let bad = |what: &str, v: u32, lo: u32, hi: u32| {
            Err(CryptoError::KekSource(format!(
                "Argon2id {what} {v} is outside {lo}..={hi}"
            )))
        };
        if !(1..=ARGON2_MAX_P_COST).contains(&self.p_cost) {
            return bad("lanes (p_cost)", self.p_cost, 1, ARGON2_MAX_P_COST);
        }
        // Argon2 needs at least 8 KiB per lane.
        let m_min = 8 * self.p_cost;
        if !(m_min..=ARGON2_MAX_M_COST_KIB).contains(&self.m_cost_kib) {
            return bad(
                "memory (m_cost, KiB)",
                self.m_cost_kib,
                m_min,
                ARGON2_MAX_M_COST_KIB,
            );
        }
        if !(1..=ARGON2_MAX_T_COST).contains(&self.t_cost) {
            return bad("passes (t_cost)", self.t_cost, 1, ARGON2_MAX_T_COST);
        }
        Ok(())
    }
}

/// Length of the random Argon2 salt (RFC 9106 recommends 16 bytes).
pub const SALT_LEN: usize = 16;

/// The persisted, non-secret description of a KEK source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum KekSpec {
    /// A file holding exactly 32 random bytes (`head -c 32 /dev/urandom > FILE`).
    KeyFile { path: PathBuf },
    /// A passphrase stretched with Argon2id (version 0x13) into 32 bytes.
    Passphrase {
        #[serde(with = "hex_bytes")]
        salt: Vec<u8>,
        params: Argon2Params,
    },
    /// A random envelope key, encrypted by key `key_id` of the configured key manager `kms`
    /// (KMIP Encrypt, AES-CBC/PKCS#5, IV `iv`); only the key manager can decrypt `blob`.
    Kms {
        kms: String,
        key_id: String,
        #[serde(with = "hex_bytes")]
        iv: Vec<u8>,
        #[serde(with = "hex_bytes")]
        blob: Vec<u8>,
    },
}

impl KekSpec {
    pub fn kind(&self) -> &'static str {
        match self {
            KekSpec::KeyFile { .. } => "key-file",
            KekSpec::Passphrase { .. } => "passphrase",
            KekSpec::Kms { .. } => "kms",
        }
    }
}

/// A KEK read from a key file.
#[derive(Debug, Clone)]
pub struct KeyFileKek {
    path: PathBuf,
}

impl KeyFileKek {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        KeyFileKek { path: path.into() }
    }
}

impl KekSource for KeyFileKek {
    fn spec(&self) -> KekSpec {
        KekSpec::KeyFile {
            path: self.path.clone(),
        }
    }

    fn load(&self) -> Result<Kek, CryptoError> {
        use std::io::Read;
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let io_err = |e| CryptoError::io(format!("key file {}", self.path.display()), e);
        // The path comes from an RPC, read under the control plane's lock: opened without
        // blocking (a FIFO would wait for a writer forever), accepted only as a regular file
        // (/dev/zero would be read until memory ran out), and read no further than one byte
        // past a key.
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&self.path)
            .map_err(io_err)?;
        let meta = f.metadata().map_err(io_err)?;
        if !meta.is_file() {
            return Err(CryptoError::KekSource(format!(
                "key file {} is not a regular file",
                self.path.display()
            )));
        }
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(
                path = %self.path.display(),
                "key file is readable or writable by group/others: chmod 600 it"
            );
        }
        let mut bytes = Zeroizing::new(Vec::with_capacity(KEK_LEN + 1));
        f.take(KEK_LEN as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(io_err)?;
        if bytes.len() != KEK_LEN {
            return Err(CryptoError::KekSource(format!(
                "key file {} holds {} bytes; it must hold exactly {KEK_LEN} random bytes (head -c 32 /dev/urandom > FILE)",
                self.path.display(),
                // (What was read stops one byte past a key: the file's own length.)
                meta.len()
            )));
        }
        Kek::from_bytes(&bytes)
    }
}

/// A KEK derived from a passphrase with Argon2id.
pub struct PassphraseKek {
    passphrase: Zeroizing<Vec<u8>>,
    salt: Vec<u8>,
    params: Argon2Params,
}

impl std::fmt::Debug for PassphraseKek {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PassphraseKek")
            .field("passphrase", &"redacted")
            .field("params", &self.params)
            .finish()
    }
}

impl PassphraseKek {
    /// A new passphrase source with a fresh random salt (tenant creation, KEK rotation).
    pub fn new(passphrase: &[u8], params: Argon2Params) -> Result<Self, CryptoError> {
        let mut salt = vec![0u8; SALT_LEN];
        getrandom::fill(&mut salt).map_err(|e| CryptoError::Random(e.to_string()))?;
        Self::with_salt(passphrase, salt, params)
    }

    /// The source a recorded spec describes, given the passphrase again.
    pub fn with_salt(
        passphrase: &[u8],
        salt: Vec<u8>,
        params: Argon2Params,
    ) -> Result<Self, CryptoError> {
        if passphrase.is_empty() {
            return Err(CryptoError::KekSource("the passphrase is empty".into()));
        }
        params.check()?;
        Ok(PassphraseKek {
            passphrase: Zeroizing::new(passphrase.to_vec()),
            salt,
            params,
        })
    }

    /// Read a passphrase from a file; one trailing newline (as `echo` writes) is dropped.
    pub fn read_passphrase_file(path: &Path) -> Result<Zeroizing<Vec<u8>>, CryptoError> {
        let mut bytes = Zeroizing::new(
            std::fs::read(path)
                .map_err(|e| CryptoError::io(format!("passphrase file {}", path.display()), e))?,
        );
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
            if bytes.last() == Some(&b'\r') {
                bytes.pop();
            }
        }
        Ok(bytes)
    }
}

impl KekSource for PassphraseKek {
    fn spec(&self) -> KekSpec {
        KekSpec::Passphrase {
            salt: self.salt.clone(),
            params: self.params,
        }
    }

    fn load(&self) -> Result<Kek, CryptoError> {
        let params = Params::new(
            self.params.m_cost_kib,
            self.params.t_cost,
            self.params.p_cost,
            Some(KEK_LEN),
        )
        .map_err(|e| CryptoError::KekSource(format!("bad Argon2id parameters: {e}")))?;
        let argon = Argon2::new(Algorithm::Argon2id, Version::V0x13, params);
        Kek::with_filler(|out| {
            argon
                .hash_password_into(&self.passphrase, &self.salt, out)
                .map_err(|e| CryptoError::KekSource(format!("Argon2id failed: {e}")))
        })
    }
}

#[cfg(test)]
mod test {
    use super::*;

    /// Small costs keep unit tests fast; the production default is tested for sanity only.
    pub(crate) const TEST_PARAMS: Argon2Params = Argon2Params {
        m_cost_kib: 64,
        t_cost: 1,
        p_cost: 1,
    };

    #[test]
    fn key_file_must_hold_exactly_32_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("kek");
        std::fs::write(&p, [9u8; 31]).unwrap();
        let e = KeyFileKek::new(&p).load().unwrap_err().to_string();
        assert!(e.contains("exactly 32"), "{e}");
        std::fs::write(&p, [9u8; 32]).unwrap();
        assert_eq!(KeyFileKek::new(&p).load().unwrap().as_bytes(), &[9u8; 32]);
        let missing = KeyFileKek::new(dir.path().join("nope")).load().unwrap_err();
        assert!(missing.to_string().contains("key file"), "{missing}");
        std::fs::write(&p, [9u8; 4096]).unwrap();
        let e = KeyFileKek::new(&p).load().unwrap_err().to_string();
        assert!(
            e.contains("holds 4096 bytes") && e.contains("exactly 32"),
            "{e}"
        );
    }

    /// What an RPC may name as a key file: neither a device that never ends nor a FIFO that
    /// never gets a writer holds the control plane (both once did: read to the end, under
    /// its lock).
    #[test]
    fn key_file_that_is_not_a_regular_file_is_refused_at_once() {
        let e = KeyFileKek::new("/dev/zero").load().unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo(3) with a NUL-terminated path; no memory is retained.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = KeyFileKek::new(&fifo).load().unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn passphrase_derivation_is_deterministic_per_salt() {
        let a = PassphraseKek::new(b"correct horse", TEST_PARAMS).unwrap();
        let KekSpec::Passphrase { salt, params } = a.spec() else {
            panic!("spec kind")
        };
        assert_eq!(salt.len(), SALT_LEN);
        let again = PassphraseKek::with_salt(b"correct horse", salt.clone(), params).unwrap();
        assert_eq!(
            a.load().unwrap().as_bytes(),
            again.load().unwrap().as_bytes()
        );
        let wrong = PassphraseKek::with_salt(b"correct horsf", salt, params).unwrap();
        assert_ne!(
            a.load().unwrap().as_bytes(),
            wrong.load().unwrap().as_bytes()
        );
        let other_salt = PassphraseKek::new(b"correct horse", TEST_PARAMS).unwrap();
        assert_ne!(
            a.load().unwrap().as_bytes(),
            other_salt.load().unwrap().as_bytes()
        );
        assert!(!format!("{a:?}").contains("horse"));
        assert!(PassphraseKek::new(b"", TEST_PARAMS).is_err());
    }

    #[test]
    fn argon2_costs_are_bounded() {
        let ok = Argon2Params::default();
        assert!(PassphraseKek::new(b"pw", ok).is_ok());
        for bad in [
            Argon2Params {
                m_cost_kib: u32::MAX,
                ..ok
            },
            Argon2Params {
                m_cost_kib: 7,
                ..ok
            },
            Argon2Params { t_cost: 0, ..ok },
            Argon2Params {
                t_cost: ARGON2_MAX_T_COST + 1,
                ..ok
            },
            Argon2Params { p_cost: 0, ..ok },
            Argon2Params { p_cost: 1000, ..ok },
        ] {
            let e = PassphraseKek::new(b"pw", bad).unwrap_err().to_string();
            assert!(e.contains("outside"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn spec_serialises_without_secrets() {
        let s = PassphraseKek::new(b"hunter2", TEST_PARAMS).unwrap().spec();
        let j = serde_json::to_string(&s).unwrap();
        assert!(
            j.contains("\"kind\":\"passphrase\"") && j.contains("m_cost_kib"),
            "{j}"
        );
        assert!(!j.contains("hunter2"));
        assert_eq!(serde_json::from_str::<KekSpec>(&j).unwrap(), s);
    }
}
