//! Tenants and their key records: key creation, unwrapping for open, KEK rotation,
//! crypto-erase, disaster-recovery export and deletion.
//!
//! Everything here works on [`TenantRecord`]s, which are what the control plane persists.
//! Operations that must survive a crash take a `persist` callback and call it at each point
//! where the record on disk must change; the in-memory record is only updated after the
//! callback succeeded, so memory never runs ahead of disk.
//!
//! ## KEK rotation and crashes
//! A volume's record holds a *list* of wrapped copies of its data key, each tagged with the
//! KEK generation that wrapped it. Rotation is two persisted steps:
//! 1. add the new KEK's check value as `pending`, and to every volume a copy wrapped under
//!    the new KEK (generation g+1), keeping the old copy; persist;
//! 2. make the new KEK current, drop the old copies; persist.
//!
//! On disk there is therefore always either only-old, old-and-new, or only-new: every volume
//! opens with the old KEK or the new one at any crash point. Re-running the rotation with the
//! new KEK after a crash between the steps finishes it; with any other KEK it starts over.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::kek::{KekSource, KekSpec};
use super::keys::{Kek, XtsKey};
use super::policy::EncryptionPolicy;
use super::wrap::{kek_check, unwrap_key, verify_kek_check, wrap_key, KeyContext, Sealed};
use super::CryptoError;

/// Tenant and volume names: what the control plane accepts as ids.
pub fn check_name(what: &str, name: &str) -> Result<(), CryptoError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(CryptoError::Refused(format!(
            "invalid {what} name {name:?}: use 1-64 letters, digits, '-', '_' or '.'"
        )))
    }
}

/// A KEK generation as recorded: how to obtain it and a check value that recognises it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KekRecord {
    pub generation: u32,
    pub spec: KekSpec,
    pub check: Sealed,
}

/// One wrapped copy of a volume's data key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrappedEntry {
    pub kek_generation: u32,
    pub wrapped: Sealed,
}

/// A volume's key record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeKeyRecord {
    /// The cipher, data unit and tweak mode the volume's ciphertext was written with.
    pub policy: EncryptionPolicy,
    pub key_version: u32,
    /// One entry normally; two while a KEK rotation is between its steps; none once erased.
    #[serde(default)]
    pub wrapped: Vec<WrappedEntry>,
    /// Set by crypto-erase: the data key is gone and the volume can never be opened again.
    #[serde(default)]
    pub erased: bool,
}

/// A tenant: its policy, its KEK and its volumes' wrapped keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantRecord {
    pub name: String,
    pub policy: EncryptionPolicy,
    pub kek: KekRecord,
    /// The KEK a rotation is moving to, between the rotation's two steps.
    #[serde(default)]
    pub pending_kek: Option<KekRecord>,
    #[serde(default)]
    pub volumes: BTreeMap<String, VolumeKeyRecord>,
}

/// A KEK that has been checked against a tenant record, with the generation it matched.
#[derive(Debug)]
pub struct UnlockedKek {
    pub kek: Kek,
    pub generation: u32,
}

impl TenantRecord {
    /// Create a tenant whose KEK comes from `source`.
    pub fn create(
        name: &str,
        policy: EncryptionPolicy,
        source: &dyn KekSource,
    ) -> Result<(TenantRecord, UnlockedKek), CryptoError> {
        check_name("tenant", name)?;
        policy.validate()?;
        let kek = source.load()?;
        let record = TenantRecord {
            name: name.to_string(),
            policy,
            kek: KekRecord {
                generation: 1,
                spec: source.spec(),
                check: kek_check(&kek, name, 1)?,
            },
            pending_kek: None,
            volumes: BTreeMap::new(),
        };
        Ok((record, UnlockedKek { kek, generation: 1 }))
    }

    /// Load a KEK from `source` and check it is this tenant's current (or, mid-rotation,
    /// pending) KEK.
    pub fn unlock(&self, source: &dyn KekSource) -> Result<UnlockedKek, CryptoError> {
        let kek = source.load()?;
        self.recognise(kek)
    }

    /// Check an already-loaded KEK.
    pub fn recognise(&self, kek: Kek) -> Result<UnlockedKek, CryptoError> {
        for rec in std::iter::once(&self.kek).chain(self.pending_kek.as_ref()) {
            if verify_kek_check(&kek, &rec.check, &self.name, rec.generation) {
                return Ok(UnlockedKek {
                    kek,
                    generation: rec.generation,
                });
            }
        }
        Err(CryptoError::WrongKek {
            tenant: self.name.clone(),
        })
    }

    fn ctx<'a>(&'a self, volume: &'a str, key_version: u32, gen: u32) -> KeyContext<'a> {
        KeyContext {
            tenant: &self.name,
            volume,
            key_version,
            kek_generation: gen,
        }
    }

    /// Create the data key of a new encrypted volume with block size `block_size` under
    /// the tenant's policy. Returns the updated record (to persist) and the plaintext key
    /// (to open the volume with).
    pub fn add_volume(
        &self,
        volume: &str,
        block_size: u32,
        kek: &UnlockedKek,
    ) -> Result<(TenantRecord, XtsKey), CryptoError> {
        check_name("volume", volume)?;
        if self.volumes.contains_key(volume) {
            return Err(CryptoError::Refused(format!(
                "volume {volume} already has a key in tenant {}",
                self.name
            )));
        }
        if kek.generation != self.kek.generation || self.pending_kek.is_some() {
            return Err(CryptoError::Refused(format!(
                "tenant {} is in the middle of a KEK rotation: finish it first (tenant_rotate_kek)",
                self.name
            )));
        }
        self.policy.check_volume(block_size)?;
        let key = XtsKey::generate(self.policy.cipher.key_len())?;
        let next = self.with_volume_key(volume, &key, self.policy, kek)?;
        Ok((next, key))
    }

    /// Record a data key the caller supplies (an encryption layer over an existing volume,
    /// whose key an outside API hands over) for `volume`, written with `policy`: wrapped
    /// under the KEK exactly like [`Self::add_volume`]'s own keys. Returns the updated
    /// record to persist; the plaintext key stays the caller's (and is zeroized with it).
    pub fn add_volume_with_key(
        &self,
        volume: &str,
        key: &XtsKey,
        policy: EncryptionPolicy,
        kek: &UnlockedKek,
    ) -> Result<TenantRecord, CryptoError> {
        check_name("volume", volume)?;
        if self.volumes.contains_key(volume) {
            return Err(CryptoError::Refused(format!(
                "volume {volume} already has a key in tenant {}",
                self.name
            )));
        }
        if kek.generation != self.kek.generation || self.pending_kek.is_some() {
            return Err(CryptoError::Refused(format!(
                "tenant {} is in the middle of a KEK rotation: finish it first (tenant_rotate_kek)",
                self.name
            )));
        }
        policy.validate()?;
        if key.len() != policy.cipher.key_len() {
            return Err(CryptoError::Refused(format!(
                "a {}-byte key does not fit cipher {}",
                key.len(),
                policy.cipher.as_str()
            )));
        }
        self.with_volume_key(volume, key, policy, kek)
    }

    fn with_volume_key(
        &self,
        volume: &str,
        key: &XtsKey,
        policy: EncryptionPolicy,
        kek: &UnlockedKek,
    ) -> Result<TenantRecord, CryptoError> {
        let wrapped = wrap_key(&kek.kek, key, self.ctx(volume, 1, kek.generation))?;
        let mut next = self.clone();
        next.volumes.insert(
            volume.to_string(),
            VolumeKeyRecord {
                policy,
                key_version: 1,
                wrapped: vec![WrappedEntry {
                    kek_generation: kek.generation,
                    wrapped,
                }],
                erased: false,
            },
        );
        Ok(next)
    }

    /// Unwrap a volume's data key for opening it; also returns the layout it was written with.
    pub fn open_volume(
        &self,
        volume: &str,
        kek: &UnlockedKek,
    ) -> Result<(XtsKey, EncryptionPolicy), CryptoError> {
        let rec = self.volumes.get(volume).ok_or_else(|| {
            CryptoError::NotFound(format!("volume {volume} in tenant {}", self.name))
        })?;
        if rec.erased {
            return Err(CryptoError::Refused(format!(
                "volume {volume} was crypto-erased: its data can no longer be decrypted"
            )));
        }
        let entry = rec
            .wrapped
            .iter()
            .find(|e| e.kek_generation == kek.generation)
            .ok_or_else(|| CryptoError::Tampered {
                volume: volume.to_string(),
            })?;
        let key = unwrap_key(
            &kek.kek,
            &entry.wrapped,
            self.ctx(volume, rec.key_version, kek.generation),
        )?;
        if key.len() != rec.policy.cipher.key_len() {
            return Err(CryptoError::Tampered {
                volume: volume.to_string(),
            });
        }
        Ok((key, rec.policy))
    }

    /// Rotate the KEK: re-wrap every data key under the KEK from `new_source`; no data is
    /// rewritten. `persist` is called after each of the two steps (module docs).
    pub fn rotate_kek(
        &mut self,
        old: &UnlockedKek,
        new_source: &dyn KekSource,
        persist: &mut dyn FnMut(&TenantRecord) -> Result<(), CryptoError>,
    ) -> Result<UnlockedKek, CryptoError> {
        if old.generation != self.kek.generation {
            return Err(CryptoError::Refused(
                "rotation must start from the current KEK".into(),
            ));
        }
        let new_kek = new_source.load()?;
        let mut next = self.clone();
        // A rotation interrupted between its steps: finish it if this is the same new KEK.
        let resume = match &self.pending_kek {
            Some(p) if verify_kek_check(&new_kek, &p.check, &self.name, p.generation) => true,
            Some(p) => {
                let stale = p.generation;
                next.pending_kek = None;
                for v in next.volumes.values_mut() {
                    v.wrapped.retain(|e| e.kek_generation != stale);
                }
                false
            }
            None => false,
        };
        let new_gen = self.kek.generation + 1;
        if !resume {
            if verify_kek_check(&new_kek, &self.kek.check, &self.name, self.kek.generation) {
                return Err(CryptoError::Refused(
                    "the new KEK is the same as the current one".into(),
                ));
            }
            // Step 1: the new KEK and a second wrapped copy of every data key.
            next.pending_kek = Some(KekRecord {
                generation: new_gen,
                spec: new_source.spec(),
                check: kek_check(&new_kek, &self.name, new_gen)?,
            });
            let names: Vec<String> = next.volumes.keys().cloned().collect();
            for name in names {
                if next.volumes[&name].erased {
                    continue;
                }
                let (key, _) = self.open_volume(&name, old)?;
                let rec = &next.volumes[&name];
                let wrapped = wrap_key(&new_kek, &key, self.ctx(&name, rec.key_version, new_gen))?;
                next.volumes
                    .get_mut(&name)
                    .expect("listed")
                    .wrapped
                    .push(WrappedEntry {
                        kek_generation: new_gen,
                        wrapped,
                    });
            }
            persist(&next)?;
            *self = next.clone();
        }
        // Step 2: the new KEK becomes current; the old copies go.
        let pending = next.pending_kek.take().expect("pending after step 1");
        next.kek = pending;
        for v in next.volumes.values_mut() {
            v.wrapped.retain(|e| e.kek_generation == new_gen);
        }
        persist(&next)?;
        *self = next;
        Ok(UnlockedKek {
            kek: new_kek,
            generation: new_gen,
        })
    }

    /// Crypto-erase a volume: destroy every wrapped copy of its data key. Once the returned
    /// record is persisted (and any open instance of the volume closed), nothing can decrypt
    /// the volume's data: the only copies of the key were these wrapped ones.
    pub fn crypto_erase(&self, volume: &str) -> Result<TenantRecord, CryptoError> {
        let mut next = self.clone();
        let rec = next.volumes.get_mut(volume).ok_or_else(|| {
            CryptoError::NotFound(format!("volume {volume} in tenant {}", self.name))
        })?;
        rec.wrapped.clear();
        rec.erased = true;
        Ok(next)
    }

    /// Forget a volume's key record (when the volume itself is deleted).
    pub fn remove_volume(&self, volume: &str) -> Result<TenantRecord, CryptoError> {
        let mut next = self.clone();
        next.volumes.remove(volume).ok_or_else(|| {
            CryptoError::NotFound(format!("volume {volume} in tenant {}", self.name))
        })?;
        Ok(next)
    }

    /// Export a volume's plaintext data key for disaster recovery: only with `confirm`, only
    /// into a new file (never overwriting) created with mode 0600. The file holds the raw
    /// key (Key1 ‖ Key2), usable as `cryptsetup --key-file`.
    pub fn export_key(
        &self,
        volume: &str,
        kek: &UnlockedKek,
        path: &Path,
        confirm: bool,
    ) -> Result<(), CryptoError> {
        if !confirm {
            return Err(CryptoError::Refused(
                "exporting a plaintext data key needs explicit confirmation (--yes-export-plaintext-key)".into(),
            ));
        }
        let (key, _) = self.open_volume(volume, kek)?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| {
                CryptoError::io(
                    format!(
                        "creating export file {} (it must not exist)",
                        path.display()
                    ),
                    e,
                )
            })?;
        let written = f.write_all(key.as_bytes()).and_then(|()| f.sync_all());
        if let Err(e) = written {
            let _ = std::fs::remove_file(path);
            return Err(CryptoError::io(format!("writing {}", path.display()), e));
        }
        Ok(())
    }

    /// Check that the tenant may be deleted: refused while it has volumes unless `force`.
    pub fn check_delete(&self, force: bool) -> Result<(), CryptoError> {
        let live: Vec<&str> = self
            .volumes
            .iter()
            .filter(|(_, v)| !v.erased)
            .map(|(k, _)| k.as_str())
            .collect();
        if !live.is_empty() && !force {
            return Err(CryptoError::Refused(format!(
                "tenant {} still has volumes ({}): delete them first or use --force (their data becomes unreadable)",
                self.name,
                live.join(", ")
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod test {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::crypto::kek::{Argon2Params, KeyFileKek, PassphraseKek};
    use crate::crypto::policy::CipherKind;
    use crate::crypto::wrap::hex_bytes;

    const FAST: Argon2Params = Argon2Params {
        m_cost_kib: 64,
        t_cost: 1,
        p_cost: 1,
    };

    fn key_file(dir: &Path, name: &str) -> KeyFileKek {
        let p = dir.join(name);
        let mut b = [0u8; 32];
        getrandom::fill(&mut b).unwrap();
        std::fs::write(&p, b).unwrap();
        KeyFileKek::new(p)
    }

    fn tenant_with_volumes(dir: &Path, vols: &[&str]) -> (TenantRecord, UnlockedKek, Vec<XtsKey>) {
        let (mut t, kek) =
            TenantRecord::create("acme", EncryptionPolicy::default(), &key_file(dir, "k1"))
                .unwrap();
        let mut keys = Vec::new();
        for v in vols {
            let (next, key) = t.add_volume(v, 4096, &kek).unwrap();
            t = next;
            keys.push(key);
        }
        (t, kek, keys)
    }

    #[test]
    fn volumes_open_with_the_right_kek_only() {
        let dir = tempfile::tempdir().unwrap();
        let (t, kek, keys) = tenant_with_volumes(dir.path(), &["v1", "v2"]);
        let (k, pol) = t.open_volume("v1", &kek).unwrap();
        assert_eq!(k.as_bytes(), keys[0].as_bytes());
        assert_eq!(pol, EncryptionPolicy::default());
        assert_ne!(keys[0].as_bytes(), keys[1].as_bytes());
        let e = t.unlock(&key_file(dir.path(), "other")).unwrap_err();
        assert!(matches!(e, CryptoError::WrongKek { .. }), "{e}");
        assert!(e.to_string().contains("wrong key-encryption key"));
    }

    /// A key the caller gives is wrapped like the tenant's own and opens with its policy;
    /// one that does not fit the cipher, or a name that has a key, is refused.
    #[test]
    fn a_given_key_is_wrapped_like_a_made_one() {
        let dir = tempfile::tempdir().unwrap();
        let (t, kek, _) = tenant_with_volumes(dir.path(), &["v1"]);
        let given = XtsKey::from_bytes(&(0..32).collect::<Vec<u8>>()).unwrap();
        let policy = EncryptionPolicy {
            cipher: CipherKind::AesXts128,
            data_unit: 512,
            ..EncryptionPolicy::default()
        };
        let next = t.add_volume_with_key("l1", &given, policy, &kek).unwrap();
        let wrapped = &next.volumes["l1"].wrapped[0].wrapped.0;
        assert!(!wrapped.windows(32).any(|w| w == given.as_bytes()));
        let (k, pol) = next.open_volume("l1", &kek).unwrap();
        assert_eq!(k.as_bytes(), given.as_bytes());
        assert_eq!(pol, policy);
        let wide = EncryptionPolicy::default();
        assert!(t.add_volume_with_key("l2", &given, wide, &kek).is_err());
        assert!(next
            .add_volume_with_key("l1", &given, policy, &kek)
            .is_err());
    }

    #[test]
    fn wrong_passphrase_is_reported_as_such() {
        let src = PassphraseKek::new(b"open sesame", FAST).unwrap();
        let (t, _) = TenantRecord::create("p", EncryptionPolicy::default(), &src).unwrap();
        let KekSpec::Passphrase { salt, params } = t.kek.spec.clone() else {
            panic!("spec")
        };
        let good = PassphraseKek::with_salt(b"open sesame", salt.clone(), params).unwrap();
        assert_eq!(t.unlock(&good).unwrap().generation, 1);
        let bad = PassphraseKek::with_salt(b"open sesame!", salt, params).unwrap();
        assert!(matches!(t.unlock(&bad), Err(CryptoError::WrongKek { .. })));
    }

    #[test]
    fn tampered_or_moved_wrapped_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (mut t, kek, _) = tenant_with_volumes(dir.path(), &["v1", "v2"]);
        let mut bad = t.clone();
        let last = bad.volumes.get_mut("v1").unwrap().wrapped[0]
            .wrapped
            .0
            .len()
            - 1;
        bad.volumes.get_mut("v1").unwrap().wrapped[0].wrapped.0[last] ^= 0x80;
        let e = bad.open_volume("v1", &kek).unwrap_err();
        assert!(matches!(e, CryptoError::Tampered { .. }), "{e}");
        // v2's wrapped key pasted into v1's record does not authenticate as v1's.
        let v2 = t.volumes["v2"].clone();
        t.volumes.insert("v1".into(), v2);
        assert!(matches!(
            t.open_volume("v1", &kek),
            Err(CryptoError::Tampered { .. })
        ));
    }

    #[test]
    fn policy_the_volume_cannot_satisfy_creates_no_key() {
        let dir = tempfile::tempdir().unwrap();
        let (t, kek, _) = tenant_with_volumes(dir.path(), &[]);
        let e = t.add_volume("v", 512, &kek).unwrap_err();
        assert!(e.to_string().contains("data unit 4096"), "{e}");
        assert!(t.volumes.is_empty());
        assert!(t.add_volume("../etc", 4096, &kek).is_err());
    }

    #[test]
    fn rotation_rewraps_and_every_crash_point_leaves_volumes_readable() {
        let dir = tempfile::tempdir().unwrap();
        let (t0, old, keys) = tenant_with_volumes(dir.path(), &["a", "b", "c"]);
        let new_src = key_file(dir.path(), "k2");
        // Crash at step 1 (nothing persisted) and at step 2 (only step 1 persisted).
        for fail_at in [1usize, 2] {
            let mut t = t0.clone();
            let mut on_disk: Option<TenantRecord> = None;
            let mut calls = 0;
            let r = t.rotate_kek(&old, &new_src, &mut |rec| {
                calls += 1;
                if calls == fail_at {
                    return Err(CryptoError::Refused("simulated crash".into()));
                }
                on_disk = Some(rec.clone());
                Ok(())
            });
            assert!(r.is_err());
            let disk = on_disk.unwrap_or_else(|| t0.clone());
            // The old KEK opens every volume; after a step-1 persist so does the new one.
            for (i, v) in ["a", "b", "c"].iter().enumerate() {
                let u = disk
                    .unlock(&KeyFileKek::new(dir.path().join("k1")))
                    .unwrap();
                assert_eq!(
                    disk.open_volume(v, &u).unwrap().0.as_bytes(),
                    keys[i].as_bytes()
                );
                if fail_at == 2 {
                    let n = disk.unlock(&new_src).unwrap();
                    assert_eq!(n.generation, 2);
                    assert_eq!(
                        disk.open_volume(v, &n).unwrap().0.as_bytes(),
                        keys[i].as_bytes()
                    );
                }
            }
            if fail_at == 2 {
                // Re-running with the new KEK finishes the interrupted rotation.
                let mut resumed = disk.clone();
                let u = resumed
                    .unlock(&KeyFileKek::new(dir.path().join("k1")))
                    .unwrap();
                resumed.rotate_kek(&u, &new_src, &mut |_| Ok(())).unwrap();
                assert!(resumed.pending_kek.is_none());
                assert_eq!(resumed.kek.generation, 2);
            }
        }
        // A clean rotation: only the new KEK works, data keys unchanged, one copy each.
        let mut t = t0.clone();
        let mut persisted = 0;
        let new = t
            .rotate_kek(&old, &new_src, &mut |_| {
                persisted += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(persisted, 2);
        assert!(matches!(
            t.unlock(&KeyFileKek::new(dir.path().join("k1"))),
            Err(CryptoError::WrongKek { .. })
        ));
        for (i, v) in ["a", "b", "c"].iter().enumerate() {
            assert_eq!(t.volumes[*v].wrapped.len(), 1);
            assert_eq!(
                t.open_volume(v, &new).unwrap().0.as_bytes(),
                keys[i].as_bytes()
            );
        }
        // Rotating to the same KEK is refused.
        assert!(t.rotate_kek(&new, &new_src, &mut |_| Ok(())).is_err());
    }

    #[test]
    fn crypto_erase_destroys_every_wrapped_copy() {
        let dir = tempfile::tempdir().unwrap();
        let (t, kek, _) = tenant_with_volumes(dir.path(), &["v1", "v2"]);
        let t = t.crypto_erase("v1").unwrap();
        assert!(t.volumes["v1"].wrapped.is_empty() && t.volumes["v1"].erased);
        let e = t.open_volume("v1", &kek).unwrap_err();
        assert!(e.to_string().contains("crypto-erased"), "{e}");
        assert!(t.open_volume("v2", &kek).is_ok());
        // Erased volumes no longer block deletion; live ones do unless forced.
        let t = t.remove_volume("v2").unwrap();
        assert!(t.check_delete(false).is_ok());
    }

    #[test]
    fn delete_is_refused_while_volumes_exist_unless_forced() {
        let dir = tempfile::tempdir().unwrap();
        let (t, _, _) = tenant_with_volumes(dir.path(), &["v1"]);
        let e = t.check_delete(false).unwrap_err().to_string();
        assert!(e.contains("v1") && e.contains("--force"), "{e}");
        assert!(t.check_delete(true).is_ok());
    }

    #[test]
    fn export_needs_confirmation_creates_0600_and_never_overwrites() {
        let dir = tempfile::tempdir().unwrap();
        let (t, kek, keys) = tenant_with_volumes(dir.path(), &["v1"]);
        let out = dir.path().join("v1.key");
        assert!(t.export_key("v1", &kek, &out, false).is_err());
        assert!(!out.exists());
        t.export_key("v1", &kek, &out, true).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), keys[0].as_bytes());
        let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        std::fs::write(&out, b"keep").unwrap();
        let e = t.export_key("v1", &kek, &out, true).unwrap_err();
        assert!(e.to_string().contains("must not exist"), "{e}");
        assert_eq!(std::fs::read(&out).unwrap(), b"keep");
    }

    #[test]
    fn records_and_debug_output_hold_no_key_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (t, kek, keys) = tenant_with_volumes(dir.path(), &["v1", "v2"]);
        let json = serde_json::to_string_pretty(&t).unwrap();
        let debug = format!("{t:?} {kek:?} {:?}", keys[0]);
        let kek_hex = hex_bytes::encode(kek.kek.as_bytes());
        for text in [&json, &debug] {
            assert!(!text.contains(&kek_hex[..16]));
            for k in &keys {
                let h = hex_bytes::encode(k.as_bytes());
                // No 8-byte window of any key appears, in hex or as decimal byte lists.
                for w in (0..h.len() - 16).step_by(16) {
                    assert!(!text.contains(&h[w..w + 16]), "key bytes leaked");
                }
                let dec = format!("{:?}", &k.as_bytes()[..6]);
                assert!(!text.contains(dec.trim_matches(|c| c == '[' || c == ']')));
            }
        }
        // And the record survives a serde round trip.
        let back: TenantRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
        assert!(back.open_volume("v2", &kek).is_ok());
    }
}
