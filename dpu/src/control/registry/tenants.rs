//! Tenants, their encryption policy and KEK, and the key operations on encrypted volumes
//! (crypto-erase, key export). KMS tenants' key-manager calls happen before the control lock
//! is taken ([`Registry::kms_source_new`], [`Registry::kms_unlock`]).

use std::path::Path;
use std::sync::{Arc, Weak};

use nacre_shared::api::tenant::{
    KekParams, PolicyInfo, PolicyParams, TenantInfo, TenantVolumeInfo,
};
use nacre_shared::api::validate_name;
use tracing::{info, warn};

use super::compose::{open_existing, with_qos, FailedVolume};
use super::exporters::refuse_if_exported;
use super::keys::{
    new_source, now_secs, recognise_kms, recorded_source, rpc_err, tenant_of, unlocked,
};
use super::store::{Inner, Registry};
use crate::control::error::RpcError;
use crate::control::state::VolumeRecord;
use crate::crypto::kek::{KekSource, KekSpec};
use crate::crypto::tenant::{TenantRecord, UnlockedKek};
use crate::crypto::{CipherKind, CryptoError, EncryptionPolicy, TweakMode};

impl Registry {
    /// `tenant_create`: a new tenant with its KEK (held unlocked) and policy.
    pub fn create_tenant(
        &self,
        name: &str,
        kek: &KekParams,
        policy: &PolicyParams,
    ) -> Result<TenantInfo, RpcError> {
        validate_name("tenant", name).map_err(RpcError::invalid_params)?;
        let policy = apply_policy(EncryptionPolicy::default(), policy)?;
        if self.with(|inner| Ok(inner.state.tenants.contains_key(name)))? {
            return Err(RpcError::exists("tenant", name));
        }
        let source = match kek.kms_key_id {
            Some(_) => self.kms_source_new(kek, None)?,
            None => new_source(kek)?,
        };
        self.with(|inner| {
            if inner.state.tenants.contains_key(name) {
                return Err(RpcError::exists("tenant", name));
            }
            let (rec, kek) = TenantRecord::create(name, policy, &*source).map_err(rpc_err)?;
            let mut next = inner.state.clone();
            next.tenants.insert(name.to_string(), rec.clone());
            self.commit(inner, next, || {})?;
            inner.live.keks.insert(name.to_string(), Arc::new(kek));
            if matches!(rec.kek.spec, KekSpec::Kms { .. }) {
                inner.live.tenant_status.insert(
                    name.to_string(),
                    super::store::TenantStatus {
                        last_contact: Some(now_secs()),
                        locked_reason: None,
                    },
                );
            }
            info!(tenant = %name, kek = rec.kek.spec.kind(), "tenant created");
            Ok(tenant_info(inner, &rec))
        })
    }

    /// `tenant_list` (every tenant, or the one named) and `tenant_show`.
    pub fn tenants(&self, name: Option<&str>) -> Result<Vec<TenantInfo>, RpcError> {
        self.with(|inner| match name {
            Some(n) => Ok(vec![tenant_info(inner, tenant_of(&inner.state, n)?)]),
            None => Ok(inner
                .state
                .tenants
                .values()
                .map(|t| tenant_info(inner, t))
                .collect()),
        })
    }

    /// `tenant_delete`: refused while the tenant owns volumes unless `force`, and always
    /// while one of them is exported. Its KEK and its open encrypted volumes go.
    pub fn delete_tenant(&self, name: &str, force: bool) -> Result<(), RpcError> {
        self.with(|inner| {
            let t = tenant_of(&inner.state, name)?.clone();
            t.check_delete(force).map_err(rpc_err)?;
            let owned: Vec<String> = inner
                .state
                .volumes
                .values()
                .filter(|v| v.tenant.as_deref() == Some(name))
                .map(|v| v.name.clone())
                .collect();
            if !owned.is_empty() && !force {
                return Err(RpcError::refused(format!(
                    "tenant {name:?} still owns volumes ({}): delete them first or use --force",
                    owned.join(", ")
                )));
            }
            for v in &owned {
                refuse_if_exported(&inner.state, v, |users| {
                    format!(
                        "volume {v:?} of tenant {name:?} is exported by {users}; delete those first"
                    )
                })?;
            }
            let mut next = inner.state.clone();
            next.tenants.remove(name);
            self.commit(inner, next, || {})?;
            inner.live.keks.remove(name);
            inner.live.tenant_status.remove(name);
            for v in &owned {
                if inner.state.volumes.get(v).is_some_and(|r| r.encrypted) {
                    inner.live.volumes.remove(v);
                }
            }
            warn!(tenant = %name, forced = force, volumes = owned.len(), "tenant deleted");
            Ok(())
        })
    }

    /// `tenant_unlock`: take the tenant's KEK (mid-rotation, the pending one is tried too)
    /// and open its encrypted volumes that are not open. Returns the volumes opened.
    pub fn unlock_tenant(&self, name: &str, kek: &KekParams) -> Result<Vec<String>, RpcError> {
        let t = self.with(|inner| Ok(tenant_of(&inner.state, name)?.clone()))?;
        // A KMS tenant: the key manager answers before the control lock is taken.
        let from_kms = match t.kek.spec {
            KekSpec::Kms { .. } => Some(self.kms_unlock(&t)?),
            _ => None,
        };
        self.with(|inner| {
            let t = tenant_of(&inner.state, name)?.clone();
            if let Some(k) = from_kms {
                // Checked against the record as it is now (a rotation may have run meanwhile).
                let unlocked = recognise_kms(inner, &t, k)?;
                return Ok(self.open_unlocked(inner, name, unlocked));
            }
            let src = recorded_source(&t, &t.kek.spec, Some(kek))?;
            let unlocked = match t.unlock(&*src) {
                Ok(k) => k,
                Err(CryptoError::WrongKek { .. }) if t.pending_kek.is_some() => {
                    // Mid-rotation the pending KEK may have another salt: try its spec too.
                    let pending = t.pending_kek.as_ref().expect("checked");
                    let src = recorded_source(&t, &pending.spec, Some(kek))?;
                    t.unlock(&*src).map_err(rpc_err)?
                }
                Err(e) => return Err(rpc_err(e)),
            };
            Ok(self.open_unlocked(inner, name, unlocked))
        })
    }

    /// Hold a tenant's checked KEK and open its encrypted volumes that are not open.
    fn open_unlocked(&self, inner: &mut Inner, name: &str, unlocked: UnlockedKek) -> Vec<String> {
        {
            inner.live.keks.insert(name.to_string(), Arc::new(unlocked));
            if let Some(st) = inner.live.tenant_status.get_mut(name) {
                st.locked_reason = None;
            }
            let closed: Vec<VolumeRecord> = inner
                .state
                .volumes
                .values()
                .filter(|v| {
                    v.encrypted
                        && v.tenant.as_deref() == Some(name)
                        && (!inner.live.volumes.contains_key(&v.name)
                            || inner.live.failed.contains_key(&v.name))
                })
                .cloned()
                .collect();
            let mut opened = Vec::new();
            for rec in closed {
                match open_existing(self, inner, &rec) {
                    Ok(dev) => {
                        // A volume served failed through its key gate has it opened
                        // inside (open_existing); one not served at all gets served now.
                        if !inner.live.volumes.contains_key(&rec.name) {
                            let dev = with_qos(self, &rec, dev);
                            inner.live.volumes.insert(rec.name.clone(), dev);
                        }
                        inner.live.failed.remove(&rec.name);
                        opened.push(rec.name.clone());
                    }
                    Err(e) => warn!(volume = %rec.name, error = %e, "volume not opened"),
                }
            }
            info!(tenant = %name, opened = opened.len(), "tenant unlocked");
            opened
        }
    }

    /// `tenant_lock`: forget a KMS or passphrase tenant's KEK and withdraw its encrypted
    /// volumes' data keys: each volume's key gate is switched to a volume that fails every
    /// request ("tenant locked"), so devices exporting it stay up and their hosts see I/O
    /// errors, and the data key is zeroed as the encrypted volume drops. `tenant_unlock`
    /// swaps them back. Returns the volumes locked.
    pub fn lock_tenant(&self, name: &str) -> Result<Vec<String>, RpcError> {
        self.with(|inner| {
            let t = tenant_of(&inner.state, name)?.clone();
            if matches!(t.kek.spec, KekSpec::KeyFile { .. }) {
                return Err(RpcError::refused(format!(
                    "tenant {name:?} takes its KEK from a key file, which unlocks it whenever \
                     needed: only KMS and passphrase tenants can be locked"
                )));
            }
            let owned: Vec<VolumeRecord> = inner
                .state
                .volumes
                .values()
                .filter(|v| v.encrypted && v.tenant.as_deref() == Some(name))
                .cloned()
                .collect();
            let why = "locked by `nacre tenant lock`".to_string();
            inner.live.keks.remove(name);
            inner
                .live
                .tenant_status
                .entry(name.to_string())
                .or_default()
                .locked_reason = Some(why.clone());
            let mut locked = Vec::new();
            for rec in owned {
                let reason = format!("tenant locked: {why}; run `nacre tenant unlock {name}`");
                if let Some(g) = inner.live.gates.get(&rec.name).and_then(Weak::upgrade) {
                    g.set(Arc::new(FailedVolume::new(&rec, reason.clone())));
                    locked.push(rec.name.clone());
                }
                inner.live.failed.insert(rec.name.clone(), reason);
            }
            warn!(tenant = %name, volumes = locked.len(), "tenant locked");
            Ok(locked)
        })
    }

    /// `tenant_policy_set`: the given fields replace the tenant's policy for new volumes.
    /// Requiring encryption is refused while the tenant has unencrypted volumes.
    pub fn set_tenant_policy(
        &self,
        name: &str,
        policy: &PolicyParams,
    ) -> Result<PolicyInfo, RpcError> {
        self.with(|inner| {
            let t = tenant_of(&inner.state, name)?.clone();
            let policy = apply_policy(t.policy, policy)?;
            if policy.require_encryption {
                let plain: Vec<String> = inner
                    .state
                    .volumes
                    .values()
                    .filter(|v| !v.encrypted && v.tenant.as_deref() == Some(name))
                    .map(|v| v.name.clone())
                    .collect();
                if !plain.is_empty() {
                    return Err(RpcError::refused(format!(
                        "tenant {name:?} has unencrypted volumes ({}): delete them before requiring encryption",
                        plain.join(", ")
                    )));
                }
            }
            let mut next = inner.state.clone();
            next.tenants.get_mut(name).expect("exists").policy = policy;
            self.commit(inner, next, || {})?;
            info!(tenant = %name, "tenant policy changed");
            Ok(policy_info(&policy))
        })
    }

    /// `tenant_policy_show`.
    pub fn tenant_policy(&self, name: &str) -> Result<PolicyInfo, RpcError> {
        self.with(|inner| Ok(policy_info(&tenant_of(&inner.state, name)?.policy)))
    }

    /// `tenant_rotate_kek`: re-wrap every data key under a new KEK, persisting each step
    /// (an interrupted rotation resumes: see [`TenantRecord::rotate_kek`]).
    pub fn rotate_tenant_kek(
        &self,
        name: &str,
        new_kek: &KekParams,
    ) -> Result<TenantInfo, RpcError> {
        let new_src = match new_kek.kms_key_id {
            Some(_) => {
                let current = self.with(|inner| {
                    Ok(match &tenant_of(&inner.state, name)?.kek.spec {
                        KekSpec::Kms { kms, .. } => Some(kms.clone()),
                        _ => None,
                    })
                })?;
                // The key manager answers before the control lock is taken.
                self.kms_source_new(new_kek, current.as_deref())?
            }
            None => new_source(new_kek)?,
        };
        self.with(|inner| {
            let mut t = tenant_of(&inner.state, name)?.clone();
            let old = unlocked(inner, &t)?;
            if old.generation != t.kek.generation {
                return Err(RpcError::refused(
                    "nacred holds the pending KEK of an interrupted rotation: unlock the tenant with its current KEK first",
                ));
            }
            // A resumed rotation must reuse the pending KEK's salt for passphrases.
            let new_src: Box<dyn KekSource> = match (&t.pending_kek, &new_kek.passphrase) {
                (Some(pending), Some(_)) if matches!(pending.spec, KekSpec::Passphrase { .. }) => {
                    let resumed = recorded_source(&t, &pending.spec, Some(new_kek))?;
                    match t.recognise(resumed.load().map_err(rpc_err)?) {
                        Ok(k) if k.generation != t.kek.generation => resumed,
                        _ => new_src,
                    }
                }
                _ => new_src,
            };
            let new = t
                .rotate_kek(&old, &*new_src, &mut |rec| {
                    let mut next = inner.state.clone();
                    next.tenants.insert(name.to_string(), rec.clone());
                    self.commit(inner, next, || {})
                        .map_err(|e| CryptoError::Refused(e.message))
                })
                .map_err(rpc_err)?;
            inner.live.keks.insert(name.to_string(), Arc::new(new));
            if matches!(t.kek.spec, KekSpec::Kms { .. }) {
                let st = inner.live.tenant_status.entry(name.to_string()).or_default();
                st.last_contact = Some(now_secs());
                st.locked_reason = None;
            }
            info!(tenant = %name, generation = t.kek.generation, volumes = t.volumes.len(), "tenant KEK rotated");
            Ok(tenant_info(inner, &t))
        })
    }

    /// `volume_crypto_erase`: destroy an unexported encrypted volume's data key; the open
    /// volume, holding the last plaintext copy of it, goes too.
    pub fn crypto_erase_volume(&self, name: &str) -> Result<(), RpcError> {
        self.with(|inner| {
            let (rec, t) = encrypted_volume(inner, name)?;
            refuse_if_exported(&inner.state, name, |users| {
                format!("volume {name:?} is exported by {users}; delete those first")
            })?;
            let erased = t.crypto_erase(&rec.name).map_err(rpc_err)?;
            let mut next = inner.state.clone();
            next.tenants.insert(t.name.clone(), erased);
            self.commit(inner, next, || {})?;
            // Dropping the open volume drops (and zeroes) the last plaintext copy of the key.
            inner.live.volumes.remove(name);
            warn!(volume = %name, tenant = %t.name, "volume crypto-erased");
            Ok(())
        })
    }

    /// `volume_export_key`: write an encrypted volume's plaintext data key to a new file.
    pub fn export_volume_key(
        &self,
        name: &str,
        path: &Path,
        confirm: bool,
    ) -> Result<(), RpcError> {
        self.with(|inner| {
            let (rec, t) = encrypted_volume(inner, name)?;
            let kek = unlocked(inner, &t)?;
            t.export_key(&rec.name, &kek, path, confirm)
                .map_err(rpc_err)?;
            warn!(volume = %name, path = %path.display(), "plaintext data key exported");
            Ok(())
        })
    }
}

fn encrypted_volume(inner: &Inner, name: &str) -> Result<(VolumeRecord, TenantRecord), RpcError> {
    let rec = inner.volume(name)?.clone();
    if !rec.encrypted {
        return Err(RpcError::invalid_params(format!(
            "volume {name:?} is not encrypted"
        )));
    }
    let t = tenant_of(&inner.state, rec.tenant.as_deref().unwrap_or_default())?.clone();
    Ok((rec, t))
}

fn policy_info(p: &EncryptionPolicy) -> PolicyInfo {
    PolicyInfo {
        cipher: p.cipher.as_str().into(),
        data_unit: p.data_unit,
        tweak: p.tweak.as_str().into(),
        require_encryption: p.require_encryption,
    }
}

fn tenant_info(inner: &Inner, t: &TenantRecord) -> TenantInfo {
    let unlocked =
        inner.live.keks.contains_key(&t.name) || matches!(t.kek.spec, KekSpec::KeyFile { .. });
    let status = inner.live.tenant_status.get(&t.name);
    let (kms, kms_key_id) = match &t.kek.spec {
        KekSpec::Kms { kms, key_id, .. } => (Some(kms.clone()), Some(key_id.clone())),
        _ => (None, None),
    };
    TenantInfo {
        locked_reason: if unlocked {
            None
        } else {
            Some(
                status
                    .and_then(|s| s.locked_reason.clone())
                    .unwrap_or_else(|| "its KEK is not in memory".into()),
            )
        },
        kms_last_contact: status.and_then(|s| s.last_contact),
        kms,
        kms_key_id,
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
