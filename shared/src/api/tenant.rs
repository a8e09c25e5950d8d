//! `tenant_*` methods: tenants, their key-encryption keys (KEK) and encryption policy, plus
//! the key operations on encrypted volumes (`volume_crypto_erase`, `volume_export_key`).
//!
//! A KEK comes from a key file (32 random bytes; nacred reads it whenever it needs the KEK,
//! so such tenants unlock themselves on restart) or from a passphrase stretched with
//! Argon2id (nacred keeps the derived KEK in memory only; after a restart the tenant's
//! encrypted volumes stay closed until `tenant_unlock`). The passphrase travels only in
//! the RPC request over nacred's private Unix socket; the CLI reads it from a file or stdin,
//! never from its command line. Or it is a random envelope key encrypted by a key manager
//! over KMIP (`kms`, `kms_key_id`): nacred asks the key manager to decrypt it at start and
//! at `tenant_unlock`, and forgets it at `tenant_lock`.

use serde::{Deserialize, Serialize};

/// Where a tenant's KEK comes from: exactly one of `key_file`, `passphrase` or
/// `kms_key_id` (with `kms`, the configured key manager; a rotation defaults to the
/// tenant's current one).
/// `Debug` never prints the passphrase.
#[derive(Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct KekParams {
    /// Absolute path of a file holding exactly 32 random bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<String>,
    /// A passphrase, stretched with Argon2id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passphrase: Option<String>,
    /// Argon2id memory cost in KiB [default 65536].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argon2_m_cost_kib: Option<u32>,
    /// Argon2id passes [default 3].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argon2_t_cost: Option<u32>,
    /// A key manager configured with `kms_add`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kms: Option<String>,
    /// The unique identifier of an active AES key in that key manager.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kms_key_id: Option<String>,
}

/// The passphrase is overwritten when the params are dropped (copies the JSON layers made
/// before parsing are outside this type's reach).
impl Drop for KekParams {
    fn drop(&mut self) {
        use zeroize::Zeroize;
        if let Some(p) = self.passphrase.as_mut() {
            p.zeroize();
        }
    }
}

impl std::fmt::Debug for KekParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KekParams")
            .field("key_file", &self.key_file)
            .field("passphrase", &self.passphrase.as_ref().map(|_| "redacted"))
            .field("argon2_m_cost_kib", &self.argon2_m_cost_kib)
            .field("argon2_t_cost", &self.argon2_t_cost)
            .field("kms", &self.kms)
            .field("kms_key_id", &self.kms_key_id)
            .finish()
    }
}

/// Policy fields; absent ones keep their current (or default) value.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PolicyParams {
    /// `aes-xts-256` (default) or `aes-xts-128`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cipher: Option<String>,
    /// Data-unit size: 512 or 4096 (default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_unit: Option<u32>,
    /// `plain64` (dm-crypt aes-xts-plain64 compatible, default) or `be64` (BlueField mlx5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tweak: Option<String>,
    /// Refuse unencrypted volumes for this tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub require_encryption: Option<bool>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantCreate {
    pub name: String,
    pub kek: KekParams,
    #[serde(default)]
    pub policy: PolicyParams,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantName {
    pub name: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantList {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantDelete {
    pub name: String,
    /// Delete even though the tenant still has volumes (their data becomes unreadable).
    #[serde(default)]
    pub force: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantUnlock {
    pub name: String,
    pub kek: KekParams,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantPolicySet {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cipher: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_unit: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tweak: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub require_encryption: Option<bool>,
}

impl TenantPolicySet {
    pub fn policy(&self) -> PolicyParams {
        PolicyParams {
            cipher: self.cipher.clone(),
            data_unit: self.data_unit,
            tweak: self.tweak.clone(),
            require_encryption: self.require_encryption,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantRotateKek {
    pub name: String,
    /// The new KEK.
    pub new_kek: KekParams,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VolumeCryptoErase {
    pub name: String,
    /// Must be true: the volume's data becomes permanently unreadable.
    #[serde(default)]
    pub confirm: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VolumeExportKey {
    pub name: String,
    /// Absolute path of a file to create (mode 0600); an existing file is never overwritten.
    pub path: String,
    /// Must be true: the plaintext data key leaves nacred.
    #[serde(default)]
    pub confirm: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PolicyInfo {
    pub cipher: String,
    pub data_unit: u32,
    pub tweak: String,
    pub require_encryption: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TenantVolumeInfo {
    pub name: String,
    pub key_version: u32,
    pub cipher: String,
    pub data_unit: u32,
    pub tweak: String,
    pub erased: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TenantInfo {
    pub name: String,
    /// `key-file` or `passphrase`.
    pub kek_source: String,
    /// The key file's path, for key-file tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kek_path: Option<String>,
    pub kek_generation: u32,
    /// A KEK rotation was interrupted between its two steps.
    pub rotation_pending: bool,
    /// nacred holds the KEK now (always true for key-file tenants whose file is readable).
    pub unlocked: bool,
    /// Why the tenant is locked (KMS tenants: the key manager's answer, or `tenant_lock`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locked_reason: Option<String>,
    /// KMS tenants: the key manager and the key id of the current KEK.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kms: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kms_key_id: Option<String>,
    /// KMS tenants: when nacred last had a successful answer for this tenant from the key
    /// manager (seconds since the Unix epoch; none since nacred started if absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kms_last_contact: Option<u64>,
    pub policy: PolicyInfo,
    pub volumes: Vec<TenantVolumeInfo>,
}

/// `kms_add`: a key manager speaking KMIP over mutual TLS.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct KmsAdd {
    pub name: String,
    /// `HOST:PORT` (KMIP's port is 5696); HOST must be a name or address in the server's
    /// certificate.
    pub address: String,
    /// Absolute paths: the CA the server's certificate must chain to, nacred's client
    /// certificate and its private key (PEM).
    pub ca: String,
    pub cert: String,
    pub key: String,
    /// Bound on one KMIP operation, connect to answer [default 5000].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// A configured key manager as `kms_list` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KmsInfo {
    pub name: String,
    pub address: String,
    pub ca: String,
    pub cert: String,
    pub key: String,
    pub timeout_ms: u64,
    /// Tenants whose KEK (or pending KEK) this key manager holds.
    pub tenants: Vec<String>,
}
