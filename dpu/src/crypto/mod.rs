//! Per-tenant AES-XTS encryption of volumes.
//!
//! ```text
//!  tenant ── KEK (key file | Argon2id passphrase | KMIP envelope)   kek.rs, kmip/
//!    │         wraps, AES-256-GCM, AAD = tenant ‖ volume ‖ version   wrap.rs
//!    ├── policy: cipher, data unit, tweak mode, require-encryption  policy.rs
//!    └── volume ── wrapped data key (64 bytes XTS, halves distinct)  tenant.rs, keys.rs
//!                    │ unwrapped only in memory
//!                    ▼
//!  frontend ─▶ EncryptedVolume (BlockDevice) ─▶ inner BlockDevice    volume.rs
//!               XTS per data unit, tweak from the absolute position  xts.rs, engine_awslc.rs
//! ```
//!
//! Key layout, stated once so nobody has to guess (SPDK users file issues about exactly
//! this): a data key is Key1 ‖ Key2 as in IEEE 1619 — the first half encrypts data, the
//! second encrypts the tweak; 64 bytes for AES-256-XTS, 32 for AES-128-XTS. With tweak mode
//! `plain64` the bytes on disk are those dm-crypt writes with the same key, so a backing file
//! and the file `nacre volume export-key` writes open with
//!
//! ```text
//! cryptsetup open --type plain --cipher aes-xts-plain64 --key-size 512 \
//!     --sector-size 4096 --iv-large-sectors --key-file VOL.key VOL.img NAME
//! # or, exactly: dmsetup create NAME --table \
//! #   "0 <512-byte sectors> crypt aes-xts-plain64 <key hex> 0 <dev> 0 2 sector_size:4096 iv_large_sectors"
//! ```
//!
//! (4096-byte data units; for 512-byte units drop `--sector-size`/`--iv-large-sectors`, and
//! the two optional table parameters.) In plain mode cryptsetup uses a key file's bytes
//! as the key, unhashed. Tweak mode `be64` is the BlueField mlx5 layout, which dm-crypt has
//! no IV generator for.

pub mod engine_awslc;
pub mod gate;
pub mod kek;
pub mod keys;
pub mod kmip;
pub mod policy;
pub mod tenant;
pub mod volume;
pub mod wrap;
pub mod xts;

use thiserror::Error;

pub use keys::{Kek, XtsKey};
pub use policy::{CipherKind, EncryptionPolicy};
pub use xts::{EngineKind, TweakMode, UnitLayout, XtsEngine};

/// Everything that can go wrong in the crypto layer. Messages name the problem and the fix;
/// none ever contains key material.
#[derive(Debug, Error)]
pub enum CryptoError {
    /// A key of the wrong size was supplied.
    #[error("{what} must be {expected} bytes, got {got}")]
    BadKeyLength {
        what: &'static str,
        expected: &'static str,
        got: usize,
    },
    /// Key1 = Key2 makes XTS insecure (FIPS 140 IG A.9).
    #[error("XTS key halves must differ: generate a new 64-byte key")]
    EqualKeyHalves,
    /// A buffer is not a whole number of data units.
    #[error("{len} bytes is not a whole number of {unit}-byte data units")]
    Misaligned { len: usize, unit: usize },
    /// The engine cannot do what was asked (e.g. aws-lc and AES-128-XTS).
    #[error("unsupported: {0}")]
    Unsupported(&'static str),
    /// The engine library reported a failure.
    #[error("XTS engine failure: {0}")]
    Engine(String),
    /// The operating system's random number generator failed.
    #[error("random number generator failed: {0}")]
    Random(String),
    /// The KEK given does not match the one the tenant's keys were wrapped with.
    #[error("wrong key-encryption key for tenant {tenant}: check the key file or passphrase")]
    WrongKek { tenant: String },
    /// A wrapped key failed authentication although the KEK is right: the record was
    /// altered or belongs to another tenant/volume/version.
    #[error("wrapped key of volume {volume} failed authentication (tampered or misplaced record)")]
    Tampered { volume: String },
    /// A KEK source could not produce a key.
    #[error("cannot load key-encryption key: {0}")]
    KekSource(String),
    /// The encryption policy cannot be met by this volume or request.
    #[error("encryption policy violated: {0}")]
    Policy(String),
    /// A tenant or volume operation was refused.
    #[error("{0}")]
    Refused(String),
    /// Not found.
    #[error("{0} not found")]
    NotFound(String),
    /// An I/O error while reading a key file or writing an export.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl CryptoError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        CryptoError::Io {
            context: context.into(),
            source,
        }
    }
}
