//! `tenant_*` methods, the key operations on encrypted volumes (`volume_crypto_erase`,
//! `volume_export_key`), and the encrypted open path of volumes.
//!
//! Tenant records (policy, KEK description and check, wrapped data keys) live in the
//! persisted state; plaintext KEKs live only in [`super::Live::keks`], and plaintext data
//! keys only inside the open [`EncryptedVolume`]s. A key-file tenant's KEK is re-read from
//! its file whenever needed (so its volumes reopen on restart); a passphrase tenant's KEK is
//! derived once per `tenant_create`/`tenant_unlock` and held until nacred exits.

use std::path::PathBuf;
use std::sync::Arc;

use nacre_shared::api::tenant::{
    KekParams, PolicyInfo, PolicyParams, TenantCreate, TenantDelete, TenantInfo, TenantList,
    TenantName, TenantPolicySet, TenantRotateKek, TenantUnlock, TenantVolumeInfo,
    VolumeCryptoErase, VolumeExportKey,
};
use nacre_shared::api::{validate_name, Ack};
use serde_json::{json, Value};
use tracing::{info, warn};

use super::state::{State, VolumeRecord};
use super::volume::{exporters, open_backend};
use super::{parse_params, to_value, Daemon, Inner, Method, RpcError};
use crate::crypto::kek::{Argon2Params, KekSource, KekSpec, KeyFileKek, PassphraseKek};
use crate::crypto::tenant::{TenantRecord, UnlockedKek};
use crate::crypto::volume::EncryptedVolume;
use crate::crypto::{CipherKind, CryptoError, EncryptionPolicy, TweakMode};
use crate::volume::BlockDevice;

pub const METHODS: &[Method] = &[
    Method {
        name: "tenant_create",
        handler: tenant_create,
        help: "Create a tenant: name, kek {key_file | passphrase}, policy {cipher, data_unit, tweak, require_encryption}.",
    },
    Method {
        name: "tenant_list",
        handler: tenant_list,
        help: "List tenants (optionally one: name).",
    },
    Method {
        name: "tenant_show",
        handler: tenant_show,
        help: "Show a tenant, its KEK source, policy and volumes: name.",
    },
    Method {
        name: "tenant_delete",
        handler: tenant_delete,
        help: "Delete a tenant: name; refused while it has volumes unless force.",
    },
    Method {
        name: "tenant_unlock",
        handler: tenant_unlock,
        help: "Give nacred a tenant's KEK (passphrase tenants after a restart) and open its encrypted volumes: name, kek.",
    },
    Method {
        name: "tenant_policy_set",
        handler: tenant_policy_set,
        help: "Change a tenant's encryption policy for new volumes: name, cipher, data_unit, tweak, require_encryption.",
    },
    Method {
        name: "tenant_policy_show",
        handler: tenant_policy_show,
        help: "Show a tenant's encryption policy: name.",
    },
    Method {
        name: "tenant_rotate_kek",
        handler: tenant_rotate_kek,
        help: "Re-wrap every data key of a tenant under a new KEK (no data rewritten): name, new_kek.",
    },
    Method {
        name: "volume_crypto_erase",
        handler: volume_crypto_erase,
        help: "Destroy an encrypted volume's data key so its data can never be read again: name, confirm.",
    },
    Method {
        name: "volume_export_key",
        handler: volume_export_key,
        help: "Write an encrypted volume's plaintext data key to a new 0600 file for disaster recovery: name, path, confirm.",
    },
];

/// Map a crypto-layer error to the JSON-RPC error the operator sees.
pub fn rpc_err(e: CryptoError) -> RpcError {
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
fn new_source(p: &KekParams) -> Result<Box<dyn KekSource>, RpcError> {
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
fn recorded_source(
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
fn unlocked(inner: &mut Inner, t: &TenantRecord) -> Result<Arc<UnlockedKek>, RpcError> {
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

fn tenant_of<'a>(state: &'a State, name: &str) -> Result<&'a TenantRecord, RpcError> {
    state
        .tenants
        .get(name)
        .ok_or_else(|| RpcError::not_found("tenant", name))
}

/// Open an existing volume record's data path; encrypted volumes are unwrapped and wrapped
/// in an [`EncryptedVolume`]. The key is unwrapped before the backing store is touched, so a
/// wrong KEK or a tampered record opens (and writes) nothing.
pub fn open_existing(
    d: &Daemon,
    inner: &mut Inner,
    rec: &VolumeRecord,
) -> Result<Arc<dyn BlockDevice>, RpcError> {
    if !rec.encrypted {
        if let Some(t) = rec.tenant.as_ref().and_then(|t| inner.state.tenants.get(t)) {
            t.policy.check_plaintext_allowed(&t.name).map_err(rpc_err)?;
        }
        return open_backend(d, rec);
    }
    let tname = rec.tenant.as_ref().ok_or_else(|| {
        RpcError::failed(format!("encrypted volume {:?} names no tenant", rec.name))
    })?;
    let t = tenant_of(&inner.state, tname)?.clone();
    let kek = unlocked(inner, &t)?;
    let (key, policy) = t.open_volume(&rec.name, &kek).map_err(rpc_err)?;
    let raw = open_backend(d, rec)?;
    let dev = EncryptedVolume::new(raw, &key, policy).map_err(rpc_err)?;
    Ok(Arc::new(dev))
}

/// For `volume_create`: check the tenant and its policy, create the data key of an encrypted
/// volume, and open the data path. Returns the device and the tenant record to persist with
/// the volume (for encrypted volumes).
pub fn open_for_create(
    d: &Daemon,
    inner: &mut Inner,
    rec: &VolumeRecord,
) -> Result<(Arc<dyn BlockDevice>, Option<TenantRecord>), RpcError> {
    let tenant = match &rec.tenant {
        Some(name) => Some(
            inner
                .state
                .tenants
                .get(name)
                .cloned()
                .ok_or_else(|| RpcError::not_found("tenant", name))
                .map_err(|e| {
                    RpcError::new(
                        e.code,
                        format!("{}: create it with `nacre tenant create`", e.message),
                    )
                })?,
        ),
        None => None,
    };
    if !rec.encrypted {
        if let Some(t) = &tenant {
            t.policy.check_plaintext_allowed(&t.name).map_err(rpc_err)?;
        }
        return Ok((open_backend(d, rec)?, None));
    }
    let t = tenant.ok_or_else(|| {
        RpcError::invalid_params("encrypt needs a tenant: the tenant's KEK wraps the volume key")
    })?;
    let kek = unlocked(inner, &t)?;
    let (next, key) = t
        .add_volume(&rec.name, rec.block_size, &kek)
        .map_err(rpc_err)?;
    let raw = open_backend(d, rec)?;
    let dev = EncryptedVolume::new(raw, &key, next.volumes[&rec.name].policy).map_err(rpc_err)?;
    info!(volume = %rec.name, tenant = %t.name, engine = dev.engine_name(), "encrypted volume created");
    Ok((Arc::new(dev), Some(next)))
}

/// For `volume_delete`: drop the volume's key record from its tenant in `next`.
pub fn forget_volume(next: &mut State, rec: &VolumeRecord) {
    if let Some(t) = rec.tenant.as_ref().and_then(|t| next.tenants.get_mut(t)) {
        t.volumes.remove(&rec.name);
    }
}

fn policy_info(p: &EncryptionPolicy) -> PolicyInfo {
    PolicyInfo {
        cipher: p.cipher.as_str().into(),
        data_unit: p.data_unit,
        tweak: p.tweak.as_str().into(),
        require_encryption: p.require_encryption,
    }
}

fn info_of(inner: &Inner, t: &TenantRecord) -> TenantInfo {
    let unlocked =
        inner.live.keks.contains_key(&t.name) || matches!(t.kek.spec, KekSpec::KeyFile { .. });
    TenantInfo {
        name: t.name.clone(),
        kek_source: t.kek.spec.kind().into(),
        kek_path: match &t.kek.spec {
            KekSpec::KeyFile { path } => Some(path.display().to_string()),
            _ => None,
        },
        kek_generation: t.kek.generation,
        rotation_pending: t.pending_kek.is_some(),
        unlocked,
        policy: policy_info(&t.policy),
        volumes: t
            .volumes
            .iter()
            .map(|(name, v)| TenantVolumeInfo {
                name: name.clone(),
                key_version: v.key_version,
                cipher: v.policy.cipher.as_str().into(),
                data_unit: v.policy.data_unit,
                tweak: v.policy.tweak.as_str().into(),
                erased: v.erased,
            })
            .collect(),
    }
}

fn apply_policy(base: EncryptionPolicy, p: &PolicyParams) -> Result<EncryptionPolicy, RpcError> {
    let mut out = base;
    if let Some(c) = &p.cipher {
        out.cipher = CipherKind::parse(c).map_err(rpc_err)?;
    }
    if let Some(u) = p.data_unit {
        out.data_unit = u;
    }
    if let Some(t) = &p.tweak {
        out.tweak = match t.as_str() {
            "plain64" => TweakMode::Plain64,
            "be64" => TweakMode::Be64,
            other => {
                return Err(RpcError::invalid_params(format!(
                    "unknown tweak mode {other:?}: use plain64 or be64"
                )))
            }
        };
    }
    if let Some(r) = p.require_encryption {
        out.require_encryption = r;
    }
    out.validate().map_err(rpc_err)?;
    Ok(out)
}

fn tenant_create(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantCreate = parse_params(params)?;
    validate_name("tenant", &p.name).map_err(RpcError::invalid_params)?;
    let policy = apply_policy(EncryptionPolicy::default(), &p.policy)?;
    let source = new_source(&p.kek)?;
    d.with_inner(|inner| {
        if inner.state.tenants.contains_key(&p.name) {
            return Err(RpcError::exists("tenant", &p.name));
        }
        let (rec, kek) = TenantRecord::create(&p.name, policy, &*source).map_err(rpc_err)?;
        let mut next = inner.state.clone();
        next.tenants.insert(p.name.clone(), rec.clone());
        d.persist(&next)?;
        inner.state = next;
        inner.live.keks.insert(p.name.clone(), Arc::new(kek));
        info!(tenant = %p.name, kek = rec.kek.spec.kind(), "tenant created");
        to_value(info_of(inner, &rec))
    })
}

fn tenant_list(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantList = parse_params(params)?;
    d.with_inner(|inner| {
        let list: Vec<TenantInfo> = match &p.name {
            Some(n) => vec![info_of(inner, tenant_of(&inner.state, n)?)],
            None => inner
                .state
                .tenants
                .values()
                .map(|t| info_of(inner, t))
                .collect(),
        };
        to_value(list)
    })
}

fn tenant_show(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantName = parse_params(params)?;
    d.with_inner(|inner| to_value(info_of(inner, tenant_of(&inner.state, &p.name)?)))
}

fn tenant_delete(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantDelete = parse_params(params)?;
    d.with_inner(|inner| {
        let t = tenant_of(&inner.state, &p.name)?.clone();
        t.check_delete(p.force).map_err(rpc_err)?;
        let owned: Vec<String> = inner
            .state
            .volumes
            .values()
            .filter(|v| v.tenant.as_deref() == Some(p.name.as_str()))
            .map(|v| v.name.clone())
            .collect();
        if !owned.is_empty() && !p.force {
            return Err(RpcError::refused(format!(
                "tenant {:?} still owns volumes ({}): delete them first or use --force",
                p.name,
                owned.join(", ")
            )));
        }
        for v in &owned {
            let users = exporters(inner, v);
            if !users.is_empty() {
                return Err(RpcError::busy(format!(
                    "volume {v:?} of tenant {:?} is exported by {}; delete those first",
                    p.name,
                    users.join(", ")
                )));
            }
        }
        let mut next = inner.state.clone();
        next.tenants.remove(&p.name);
        d.persist(&next)?;
        inner.state = next;
        inner.live.keks.remove(&p.name);
        for v in &owned {
            if inner.state.volumes.get(v).is_some_and(|r| r.encrypted) {
                inner.live.volumes.remove(v);
            }
        }
        warn!(tenant = %p.name, forced = p.force, volumes = owned.len(), "tenant deleted");
        to_value(Ack { ok: true })
    })
}

fn tenant_unlock(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantUnlock = parse_params(params)?;
    d.with_inner(|inner| {
        let t = tenant_of(&inner.state, &p.name)?.clone();
        let src = recorded_source(&t, &t.kek.spec, Some(&p.kek))?;
        let kek = match t.unlock(&*src) {
            Ok(k) => k,
            Err(CryptoError::WrongKek { .. }) if t.pending_kek.is_some() => {
                // Mid-rotation the pending KEK may have another salt: try its spec too.
                let pending = t.pending_kek.as_ref().expect("checked");
                let src = recorded_source(&t, &pending.spec, Some(&p.kek))?;
                t.unlock(&*src).map_err(rpc_err)?
            }
            Err(e) => return Err(rpc_err(e)),
        };
        inner.live.keks.insert(p.name.clone(), Arc::new(kek));
        let closed: Vec<VolumeRecord> = inner
            .state
            .volumes
            .values()
            .filter(|v| {
                v.encrypted
                    && v.tenant.as_deref() == Some(p.name.as_str())
                    && !inner.live.volumes.contains_key(&v.name)
            })
            .cloned()
            .collect();
        let mut opened = Vec::new();
        for rec in closed {
            match open_existing(d, inner, &rec) {
                Ok(dev) => {
                    let dev = super::qos::wrap(d, &rec, dev);
                    inner.live.volumes.insert(rec.name.clone(), dev);
                    inner.live.failed.remove(&rec.name);
                    opened.push(rec.name.clone());
                }
                Err(e) => warn!(volume = %rec.name, error = %e, "volume not opened"),
            }
        }
        info!(tenant = %p.name, opened = opened.len(), "tenant unlocked");
        to_value(json!({"ok": true, "opened": opened}))
    })
}

fn tenant_policy_set(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantPolicySet = parse_params(params)?;
    d.with_inner(|inner| {
        let t = tenant_of(&inner.state, &p.name)?.clone();
        let policy = apply_policy(t.policy, &p.policy())?;
        if policy.require_encryption {
            let plain: Vec<String> = inner
                .state
                .volumes
                .values()
                .filter(|v| !v.encrypted && v.tenant.as_deref() == Some(p.name.as_str()))
                .map(|v| v.name.clone())
                .collect();
            if !plain.is_empty() {
                return Err(RpcError::refused(format!(
                    "tenant {:?} has unencrypted volumes ({}): delete them before requiring encryption",
                    p.name,
                    plain.join(", ")
                )));
            }
        }
        let mut next = inner.state.clone();
        next.tenants.get_mut(&p.name).expect("exists").policy = policy;
        d.persist(&next)?;
        inner.state = next;
        info!(tenant = %p.name, "tenant policy changed");
        to_value(policy_info(&policy))
    })
}

fn tenant_policy_show(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantName = parse_params(params)?;
    d.with_inner(|inner| to_value(policy_info(&tenant_of(&inner.state, &p.name)?.policy)))
}

fn tenant_rotate_kek(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantRotateKek = parse_params(params)?;
    let new_src = new_source(&p.new_kek)?;
    d.with_inner(|inner| {
        let mut t = tenant_of(&inner.state, &p.name)?.clone();
        let old = unlocked(inner, &t)?;
        if old.generation != t.kek.generation {
            return Err(RpcError::refused(
                "nacred holds the pending KEK of an interrupted rotation: unlock the tenant with its current KEK first",
            ));
        }
        // A resumed rotation must reuse the pending KEK's salt for passphrases.
        let new_src: Box<dyn KekSource> = match (&t.pending_kek, &p.new_kek.passphrase) {
            (Some(pending), Some(_)) if matches!(pending.spec, KekSpec::Passphrase { .. }) => {
                let resumed = recorded_source(&t, &pending.spec, Some(&p.new_kek))?;
                match t.recognise(resumed.load().map_err(rpc_err)?) {
                    Ok(k) if k.generation != t.kek.generation => resumed,
                    _ => new_src,
                }
            }
            _ => new_src,
        };
        let name = p.name.clone();
        let new = t
            .rotate_kek(&old, &*new_src, &mut |rec| {
                let mut next = inner.state.clone();
                next.tenants.insert(name.clone(), rec.clone());
                d.persist(&next)
                    .map_err(|e| CryptoError::Refused(e.message))?;
                inner.state = next;
                Ok(())
            })
            .map_err(rpc_err)?;
        inner.live.keks.insert(p.name.clone(), Arc::new(new));
        info!(tenant = %p.name, generation = t.kek.generation, volumes = t.volumes.len(), "tenant KEK rotated");
        to_value(info_of(inner, &t))
    })
}

fn encrypted_volume(inner: &Inner, name: &str) -> Result<(VolumeRecord, TenantRecord), RpcError> {
    let rec = inner
        .state
        .volumes
        .get(name)
        .cloned()
        .ok_or_else(|| RpcError::not_found("volume", name))?;
    if !rec.encrypted {
        return Err(RpcError::invalid_params(format!(
            "volume {name:?} is not encrypted"
        )));
    }
    let t = tenant_of(&inner.state, rec.tenant.as_deref().unwrap_or_default())?.clone();
    Ok((rec, t))
}

fn volume_crypto_erase(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeCryptoErase = parse_params(params)?;
    if !p.confirm {
        return Err(RpcError::invalid_params(
            "crypto-erase makes the volume's data permanently unreadable: set confirm (--yes)",
        ));
    }
    d.with_inner(|inner| {
        let (rec, t) = encrypted_volume(inner, &p.name)?;
        let users = exporters(inner, &p.name);
        if !users.is_empty() {
            return Err(RpcError::busy(format!(
                "volume {:?} is exported by {}; delete those first",
                p.name,
                users.join(", ")
            )));
        }
        let erased = t.crypto_erase(&rec.name).map_err(rpc_err)?;
        let mut next = inner.state.clone();
        next.tenants.insert(t.name.clone(), erased);
        d.persist(&next)?;
        inner.state = next;
        // Dropping the open volume drops (and zeroes) the last plaintext copy of the key.
        inner.live.volumes.remove(&p.name);
        warn!(volume = %p.name, tenant = %t.name, "volume crypto-erased");
        to_value(Ack { ok: true })
    })
}

fn volume_export_key(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeExportKey = parse_params(params)?;
    let path = PathBuf::from(&p.path);
    if !path.is_absolute() {
        return Err(RpcError::invalid_params(format!(
            "path must be absolute (got {})",
            p.path
        )));
    }
    d.with_inner(|inner| {
        let (rec, t) = encrypted_volume(inner, &p.name)?;
        let kek = unlocked(inner, &t)?;
        t.export_key(&rec.name, &kek, &path, p.confirm)
            .map_err(rpc_err)?;
        warn!(volume = %p.name, path = %path.display(), "plaintext data key exported");
        to_value(json!({"ok": true, "path": p.path}))
    })
}
