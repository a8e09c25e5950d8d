//! Tenants' key-encryption keys as the registry holds them: where a KEK comes from, and the
//! cache of unlocked ones.
//!
//! Tenant records (policy, KEK description and check, wrapped data keys) live in the
//! persisted state; plaintext KEKs live only in [`Live::keks`](super::store::Live), and
//! plaintext data keys only inside the open encrypted volumes. A key-file tenant's KEK is
//! re-read from its file whenever needed (so its volumes reopen on restart); a passphrase
//! tenant's KEK is derived once per `tenant_create`/`tenant_unlock` and held until nacred
//! exits or `tenant_lock`. A KMS tenant's KEK (an envelope key: [`crate::crypto::kmip`]) is
//! decrypted by its key manager at start and at `tenant_unlock`, always outside the control
//! lock ([`Registry::kms_unlock`]): with the lock held, a KMS tenant without a cached KEK is
//! locked, never a reason to call the key manager.

use std::path::PathBuf;
use std::sync::Arc;

use nacre_shared::api::tenant::KekParams;

use super::store::{Inner, Registry, TenantStatus};
use crate::control::error::RpcError;
use crate::control::state::State;
use crate::crypto::kek::{Argon2Params, KekSource, KekSpec, KeyFileKek, PassphraseKek};
use crate::crypto::kmip::{KmsEndpoint, KmsKek};
use crate::crypto::tenant::{TenantRecord, UnlockedKek};
use crate::crypto::CryptoError;
use crate::crypto::Kek;

/// Map a crypto-layer error to the JSON-RPC error the operator sees.
pub(super) fn rpc_err(e: CryptoError) -> RpcError {
    match e {
        CryptoError::NotFound(what) => {
            RpcError::new(nacre_shared::rpc::NOT_FOUND, format!("{what} not found"))
        }
        CryptoError::Policy(_)
        | CryptoError::BadKeyLength { .. }
        | CryptoError::EqualKeyHalves
        | CryptoError::KekSource(_) => RpcError::invalid_params(e.to_string()),
        CryptoError::WrongKek { .. } | CryptoError::Tampered { .. } | CryptoError::Refused(_) => {
            RpcError::refused(e.to_string())
        }
        _ => RpcError::failed(e.to_string()),
    }
}

/// Build a KEK source from request params: exactly one of a key file or a passphrase.
pub(super) fn new_source(p: &KekParams) -> Result<Box<dyn KekSource>, RpcError> {
    match (&p.key_file, &p.passphrase) {
        (Some(path), None) => {
            let path = PathBuf::from(path);
            if !path.is_absolute() {
                return Err(RpcError::invalid_params(format!(
                    "key_file must be an absolute path (got {})",
                    path.display()
                )));
            }
            Ok(Box::new(KeyFileKek::new(path)))
        }
        (None, Some(pass)) => {
            let mut params = Argon2Params::default();
            if let Some(m) = p.argon2_m_cost_kib {
                params.m_cost_kib = m;
            }
            if let Some(t) = p.argon2_t_cost {
                params.t_cost = t;
            }
            Ok(Box::new(
                PassphraseKek::new(pass.as_bytes(), params).map_err(rpc_err)?,
            ))
        }
        _ => Err(RpcError::invalid_params(
            "give exactly one KEK source: key_file, passphrase or kms_key_id",
        )),
    }
}

/// The source that recreates a recorded KEK, with the secret from `p` where one is needed.
pub(super) fn recorded_source(
    t: &TenantRecord,
    spec: &KekSpec,
    p: Option<&KekParams>,
) -> Result<Box<dyn KekSource>, RpcError> {
    match spec {
        KekSpec::KeyFile { path } => {
            let path = match p.and_then(|p| p.key_file.as_ref()) {
                Some(given) => PathBuf::from(given),
                None => path.clone(),
            };
            Ok(Box::new(KeyFileKek::new(path)))
        }
        KekSpec::Passphrase { salt, params } => match p.and_then(|p| p.passphrase.as_ref()) {
            Some(pass) => Ok(Box::new(
                PassphraseKek::with_salt(pass.as_bytes(), salt.clone(), *params)
                    .map_err(rpc_err)?,
            )),
            None => Err(RpcError::refused(format!(
                "tenant {:?} is locked: its KEK comes from a passphrase; run `nacre tenant unlock {} --passphrase-file FILE`",
                t.name, t.name
            ))),
        },
        // Never called with the control lock held: see `Registry::kms_unlock`.
        KekSpec::Kms { .. } => Err(locked_error(t, None)),
    }
}

/// The refusal for a tenant whose KEK nacred does not hold: "tenant locked: why", and how
/// to unlock it. Volumes that cannot open show it as their failure reason.
pub(super) fn locked_error(t: &TenantRecord, status: Option<&TenantStatus>) -> RpcError {
    let why = status
        .and_then(|s| s.locked_reason.clone())
        .unwrap_or_else(|| "its KEK is not in memory".into());
    RpcError::refused(format!(
        "tenant locked: {why}; run `nacre tenant unlock {}`",
        t.name
    ))
}

/// A key manager's failure as the operator sees it: the key manager's own line ("KMS NAME
/// at ADDRESS unreachable: …", "KMS NAME refused Decrypt with key ID: …").
fn kms_err(e: CryptoError) -> RpcError {
    match e {
        CryptoError::KekSource(m) => RpcError::failed(m),
        e => RpcError::failed(e.to_string()),
    }
}

/// Check an envelope key from the key manager against the tenant's KEK check. A key that
/// fails it (the recorded blob, IV or key id altered, or a key manager answering with other
/// bytes) is refused and recorded as why the tenant is locked.
pub(super) fn recognise_kms(
    inner: &mut Inner,
    t: &TenantRecord,
    k: Kek,
) -> Result<UnlockedKek, RpcError> {
    t.recognise(k).map_err(|e| {
        let e = match e {
            CryptoError::WrongKek { .. } => RpcError::refused(format!(
                "the key manager's answer is not tenant {}'s KEK (its KEK check fails: the \
                 recorded blob or key id was altered, or the key manager answered with another \
                 key); nothing was opened",
                t.name
            )),
            e => rpc_err(e),
        };
        inner
            .live
            .tenant_status
            .entry(t.name.clone())
            .or_default()
            .locked_reason = Some(e.message.clone());
        e
    })
}

/// Seconds since the Unix epoch, for last-contact times.
pub(super) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Registry {
    /// A configured key manager (a short look under the control lock).
    pub(super) fn kms_endpoint(&self, name: &str) -> Result<KmsEndpoint, RpcError> {
        self.with(|inner| {
            inner.state.kms.get(name).cloned().ok_or_else(|| {
                RpcError::new(
                    nacre_shared::rpc::NOT_FOUND,
                    format!("KMS {name:?} not found: add it with `nacre kms add`"),
                )
            })
        })
    }

    /// A new KMS KEK for `tenant_create` or `tenant_rotate_kek`: a random envelope key,
    /// encrypted by the key manager (the control lock is not held while it answers).
    /// `default_kms` is the tenant's current key manager, for rotations.
    pub(super) fn kms_source_new(
        &self,
        p: &KekParams,
        default_kms: Option<&str>,
    ) -> Result<Box<dyn KekSource>, RpcError> {
        if p.key_file.is_some() || p.passphrase.is_some() {
            return Err(RpcError::invalid_params(
                "give exactly one KEK source: key_file, passphrase or kms_key_id",
            ));
        }
        let key_id = p.kms_key_id.as_deref().unwrap_or_default();
        let kms = p.kms.as_deref().or(default_kms).ok_or_else(|| {
            RpcError::invalid_params("kms_key_id needs kms: the configured key manager holding it")
        })?;
        let ep = self.kms_endpoint(kms)?;
        let r = KmsKek::generate(ep, key_id)
            .map(|k| Box::new(k) as Box<dyn KekSource>)
            .map_err(kms_err);
        crate::crypto::keys::scrub_stack();
        r
    }

    /// Ask the key manager for a KMS tenant's envelope key, without the control lock: the
    /// current KEK's, or mid-rotation the pending one's. The key is returned unverified
    /// (the caller recognises it against the record under the lock: a key manager that
    /// answers with another key yields `WrongKek`, never a key in use). The outcome is
    /// recorded in the tenant's status.
    pub(super) fn kms_unlock(&self, t: &TenantRecord) -> Result<Kek, RpcError> {
        let r = self.kms_unlock_inner(t);
        crate::crypto::keys::scrub_stack();
        r
    }

    fn kms_unlock_inner(&self, t: &TenantRecord) -> Result<Kek, RpcError> {
        let mut first_err = None;
        for rec in std::iter::once(&t.kek).chain(t.pending_kek.as_ref()) {
            let KekSpec::Kms {
                kms,
                key_id,
                iv,
                blob,
            } = &rec.spec
            else {
                continue;
            };
            let r = self.kms_endpoint(kms).and_then(|ep| {
                KmsKek::recorded(ep, key_id.clone(), iv.clone(), blob.clone())
                    .load()
                    .map_err(kms_err)
            });
            match r {
                Ok(k) => {
                    self.kms_status(&t.name, |s| s.last_contact = Some(now_secs()));
                    return Ok(k);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let e = first_err.unwrap_or_else(|| {
            RpcError::invalid_params(format!("tenant {:?} does not use a KMS", t.name))
        });
        self.kms_status(&t.name, |s| s.locked_reason = Some(e.message.clone()));
        Err(e)
    }

    /// Update a tenant's status under the control lock.
    pub(super) fn kms_status(&self, tenant: &str, f: impl FnOnce(&mut TenantStatus)) {
        let mut inner = self.lock();
        f(inner
            .live
            .tenant_status
            .entry(tenant.to_string())
            .or_default());
    }
}

/// The tenant's KEK: from the in-memory cache, or re-read from its key file.
pub(super) fn unlocked(inner: &mut Inner, t: &TenantRecord) -> Result<Arc<UnlockedKek>, RpcError> {
    if let Some(k) = inner.live.keks.get(&t.name) {
        // A rotation may have moved on since; the cached KEK must still be recognised.
        if k.generation == t.kek.generation
            || t.pending_kek.as_ref().map(|p| p.generation) == Some(k.generation)
        {
            return Ok(k.clone());
        }
    }
    if matches!(t.kek.spec, KekSpec::Kms { .. }) {
        return Err(locked_error(t, inner.live.tenant_status.get(&t.name)));
    }
    let src = recorded_source(t, &t.kek.spec, None)?;
    let k = Arc::new(t.unlock(&*src).map_err(rpc_err)?);
    inner.live.keks.insert(t.name.clone(), k.clone());
    Ok(k)
}

pub(super) fn tenant_of<'a>(state: &'a State, name: &str) -> Result<&'a TenantRecord, RpcError> {
    state
        .tenants
        .get(name)
        .ok_or_else(|| RpcError::not_found("tenant", name))
}
