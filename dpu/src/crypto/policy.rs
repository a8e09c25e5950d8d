//! A tenant's encryption policy: which cipher, data-unit size and tweak layout its volumes
//! use, and whether unencrypted volumes are refused.

use serde::{Deserialize, Serialize};

use super::keys::{XTS_128_KEY_LEN, XTS_256_KEY_LEN};
use super::xts::{TweakMode, UnitLayout};
use super::CryptoError;

/// The XTS cipher of a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CipherKind {
    /// AES-256-XTS, 64-byte data keys (the default).
    #[serde(rename = "aes-xts-256")]
    AesXts256,
    /// AES-128-XTS, 32-byte data keys.
    #[serde(rename = "aes-xts-128")]
    AesXts128,
}

impl CipherKind {
    pub fn key_len(self) -> usize {
        match self {
            CipherKind::AesXts256 => XTS_256_KEY_LEN,
            CipherKind::AesXts128 => XTS_128_KEY_LEN,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CipherKind::AesXts256 => "aes-xts-256",
            CipherKind::AesXts128 => "aes-xts-128",
        }
    }

    pub fn parse(s: &str) -> Result<Self, CryptoError> {
        match s {
            "aes-xts-256" => Ok(CipherKind::AesXts256),
            "aes-xts-128" => Ok(CipherKind::AesXts128),
            _ => Err(CryptoError::Policy(format!(
                "unknown cipher {s:?}: use aes-xts-256 or aes-xts-128"
            ))),
        }
    }
}

/// Data-unit sizes nacre supports: the two logical block sizes, which are also what
/// BlueField's crypto engines and dm-crypt's `sector_size` accept.
pub const DATA_UNIT_SIZES: [u32; 2] = [512, 4096];

/// Per-tenant encryption policy. Recorded with every encrypted volume too (a volume keeps
/// the layout it was created with even if the tenant's policy changes later, because its
/// ciphertext depends on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct EncryptionPolicy {
    pub cipher: CipherKind,
    /// 512 or 4096 bytes.
    pub data_unit: u32,
    pub tweak: TweakMode,
    /// Refuse to create or open an unencrypted volume for this tenant.
    #[serde(default)]
    pub require_encryption: bool,
}

impl Default for EncryptionPolicy {
    fn default() -> Self {
        EncryptionPolicy {
            cipher: CipherKind::AesXts256,
            data_unit: 4096,
            tweak: TweakMode::Plain64,
            require_encryption: false,
        }
    }
}

impl EncryptionPolicy {
    /// Check the policy on its own.
    pub fn validate(&self) -> Result<(), CryptoError> {
        if !DATA_UNIT_SIZES.contains(&self.data_unit) {
            return Err(CryptoError::Policy(format!(
                "data unit {} is not supported: use 512 or 4096",
                self.data_unit
            )));
        }
        Ok(())
    }

    /// Check that a volume with logical block size `block_size` can be encrypted under this
    /// policy: every I/O is a whole number of blocks, so a data unit must not be larger
    /// than a block (else a single-block write would need a read-modify-write of a unit).
    pub fn check_volume(&self, block_size: u32) -> Result<(), CryptoError> {
        self.validate()?;
        if self.data_unit > block_size || block_size % self.data_unit != 0 {
            return Err(CryptoError::Policy(format!(
                "data unit {} does not fit the volume's {}-byte blocks: use a data unit of at most the block size",
                self.data_unit, block_size
            )));
        }
        Ok(())
    }

    /// Check whether an unencrypted volume is allowed.
    pub fn check_plaintext_allowed(&self, tenant: &str) -> Result<(), CryptoError> {
        if self.require_encryption {
            return Err(CryptoError::Policy(format!(
                "tenant {tenant} requires encryption: create the volume with --encrypt"
            )));
        }
        Ok(())
    }

    pub fn layout(&self) -> UnitLayout {
        UnitLayout::new(self.data_unit as usize, self.tweak)
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn data_unit_larger_than_block_is_refused() {
        let p = EncryptionPolicy::default();
        assert!(p.check_volume(4096).is_ok());
        let e = p.check_volume(512).unwrap_err().to_string();
        assert!(e.contains("data unit 4096"), "{e}");
        let small = EncryptionPolicy {
            data_unit: 512,
            ..p
        };
        assert!(small.check_volume(4096).is_ok());
        assert!(small.check_volume(512).is_ok());
        let odd = EncryptionPolicy {
            data_unit: 1024,
            ..p
        };
        assert!(odd.validate().is_err());
    }

    #[test]
    fn require_encryption_refuses_plaintext() {
        let p = EncryptionPolicy {
            require_encryption: true,
            ..Default::default()
        };
        assert!(p.check_plaintext_allowed("t1").is_err());
        assert!(EncryptionPolicy::default()
            .check_plaintext_allowed("t1")
            .is_ok());
    }

    #[test]
    fn serde_names_are_the_documented_ones() {
        let p = EncryptionPolicy {
            tweak: TweakMode::Be64,
            ..Default::default()
        };
        let j = serde_json::to_string(&p).unwrap();
        assert!(
            j.contains("\"aes-xts-256\"") && j.contains("\"be64\""),
            "{j}"
        );
        let back: EncryptionPolicy = serde_json::from_str(&j).unwrap();
        assert_eq!(back, p);
    }
}
