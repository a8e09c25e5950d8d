//! Key managers (KMIP over mutual TLS) that KMS tenants' envelope keys are encrypted by:
//! `kms_add`, `kms_list`, `kms_delete`. Only addresses and certificate paths are recorded;
//! the client key stays in its file, read at each connection.

use std::path::PathBuf;

use nacre_shared::api::tenant::{KmsAdd, KmsInfo};
use nacre_shared::api::validate_name;
use tracing::{info, warn};

use super::store::{Inner, Registry};
use crate::control::error::RpcError;
use crate::crypto::kek::KekSpec;
use crate::crypto::kmip::{KmsEndpoint, DEFAULT_TIMEOUT_MS};

/// Longest operation bound an operator may set (a KMS call delays a tenant's unlock, and
/// nacred's start, by at most this).
const MAX_TIMEOUT_MS: u64 = 120_000;

impl Registry {
    /// `kms_add`: record a key manager. Its files must be readable now (they are read again
    /// at each connection, so they can be renewed in place).
    pub fn add_kms(&self, p: &KmsAdd) -> Result<KmsInfo, RpcError> {
        validate_name("KMS", &p.name).map_err(RpcError::invalid_params)?;
        match p.address.rsplit_once(':') {
            Some((h, port)) if !h.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0) => {}
            _ => {
                return Err(RpcError::invalid_params(format!(
                    "address {:?} must be HOST:PORT (KMIP's port is 5696)",
                    p.address
                )))
            }
        }
        let file = |what: &str, v: &str| -> Result<PathBuf, RpcError> {
            let path = PathBuf::from(v);
            if !path.is_absolute() {
                return Err(RpcError::invalid_params(format!(
                    "{what} must be an absolute path (got {v})"
                )));
            }
            std::fs::metadata(&path)
                .ok()
                .filter(|m| m.is_file())
                .ok_or_else(|| {
                    RpcError::invalid_params(format!("{what} {v} is not a readable file"))
                })?;
            Ok(path)
        };
        let timeout_ms = p.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS);
        if !(1..=MAX_TIMEOUT_MS).contains(&timeout_ms) {
            return Err(RpcError::invalid_params(format!(
                "timeout_ms {timeout_ms} is outside 1..={MAX_TIMEOUT_MS}"
            )));
        }
        let ep = KmsEndpoint {
            name: p.name.clone(),
            address: p.address.clone(),
            ca: file("ca", &p.ca)?,
            cert: file("cert", &p.cert)?,
            key: file("key", &p.key)?,
            timeout_ms,
        };
        self.with(|inner| {
            if inner.state.kms.contains_key(&p.name) {
                return Err(RpcError::exists("KMS", &p.name));
            }
            let mut next = inner.state.clone();
            next.kms.insert(p.name.clone(), ep.clone());
            self.commit(inner, next, || {})?;
            info!(kms = %p.name, address = %p.address, "KMS added");
            Ok(kms_info(inner, &ep))
        })
    }

    /// `kms_list`.
    pub fn kms_list(&self) -> Vec<KmsInfo> {
        let inner = self.lock();
        inner
            .state
            .kms
            .values()
            .map(|e| kms_info(&inner, e))
            .collect()
    }

    /// `kms_delete`: refused while a tenant's KEK (or pending KEK) is held by it.
    pub fn delete_kms(&self, name: &str) -> Result<(), RpcError> {
        self.with(|inner| {
            let ep = inner
                .state
                .kms
                .get(name)
                .cloned()
                .ok_or_else(|| RpcError::not_found("KMS", name))?;
            let users = users(inner, &ep.name);
            if !users.is_empty() {
                return Err(RpcError::busy(format!(
                    "KMS {name:?} holds the KEK of tenants {}: rotate them to another KEK first",
                    users.join(", ")
                )));
            }
            let mut next = inner.state.clone();
            next.kms.remove(name);
            self.commit(inner, next, || {})?;
            warn!(kms = %name, "KMS deleted");
            Ok(())
        })
    }
}

fn users(inner: &Inner, kms: &str) -> Vec<String> {
    inner
        .state
        .tenants
        .values()
        .filter(|t| {
            std::iter::once(&t.kek)
                .chain(t.pending_kek.as_ref())
                .any(|k| matches!(&k.spec, KekSpec::Kms { kms: n, .. } if n == kms))
        })
        .map(|t| t.name.clone())
        .collect()
}

fn kms_info(inner: &Inner, e: &KmsEndpoint) -> KmsInfo {
    KmsInfo {
        name: e.name.clone(),
        address: e.address.clone(),
        ca: e.ca.display().to_string(),
        cert: e.cert.display().to_string(),
        key: e.key.display().to_string(),
        timeout_ms: e.timeout_ms,
        tenants: users(inner, &e.name),
    }
}
