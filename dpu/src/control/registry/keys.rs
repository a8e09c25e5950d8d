//! Tenants' key-encryption keys as the registry holds them: where a KEK comes from, and the
//! cache of unlocked ones.
//!
//! Tenant records (policy, KEK description and check, wrapped data keys) live in the
//! persisted state; plaintext KEKs live only in [`Live::keks`](super::store::Live), and
//! plaintext data keys only inside the open encrypted volumes. A key-file tenant's KEK is
//! re-read from its file whenever needed (so its volumes reopen on restart); a passphrase
//! tenant's KEK is derived once per `tenant_create`/`tenant_unlock` and held until nacred
//! exits.

use std::path::PathBuf;
use std::sync::Arc;

use nacre_shared::api::tenant::KekParams;

use super::store::Inner;
use crate::control::error::RpcError;
use crate::control::state::State;
use crate::crypto::kek::{Argon2Params, KekSource, KekSpec, KeyFileKek, PassphraseKek};
use crate::crypto::tenant::{TenantRecord, UnlockedKek};
use crate::crypto::CryptoError;

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
            "give exactly one KEK source: key_file or passphrase",
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
