//! Volumes: create, list, delete, resize.

use std::path::{Path, PathBuf};

use nacre_shared::api::validate_name;
use nacre_shared::api::volume::{BackendKind, VolumeCreate, VolumeInfo, VolumeState, BLOCK_SIZES};
use tracing::info;

use super::compose::{create_backing_file, default_volume_path, gated, open_for_create, with_qos};
use super::exporters::{exporter_names, refuse_if_exported};
use super::keys::{rpc_err, tenant_of, unlocked};
use super::remote_volume;
use super::store::{Inner, Registry};
use crate::control::error::RpcError;
use crate::control::state::{serial_from_uuid, VolumeRecord};
use crate::crypto::keys::{ct_eq, XtsKey, XTS_128_KEY_LEN};
use crate::crypto::policy::{CipherKind, EncryptionPolicy};
use crate::crypto::volume::EncryptedVolume;
use crate::crypto::xts::TweakMode;

impl Registry {
    /// Where a file volume lives unless told otherwise.
    pub fn default_volume_path(&self, name: &str) -> PathBuf {
        default_volume_path(self.state_dir(), name)
    }

    /// `volume_create`: validate; make a file volume's backing file (or adopt the one
    /// asked for); open the volume; persist it (with its tenant's new wrapped key, for an
    /// encrypted one); only then serve it. A failed create leaves no file behind.
    pub fn create_volume(&self, p: &VolumeCreate) -> Result<VolumeInfo, RpcError> {
        let rec = self.new_volume_record(p)?;
        self.with(|inner| {
            if inner.state.volumes.contains_key(&rec.name) {
                return Err(RpcError::exists("volume", &rec.name));
            }
            if let Some(path) = &rec.path {
                if let Some(other) = inner
                    .state
                    .volumes
                    .values()
                    .find(|v| v.path.as_ref() == Some(path))
                {
                    return Err(RpcError::busy(format!(
                        "{} already backs volume {:?}",
                        path.display(),
                        other.name
                    )));
                }
            }
            // A file volume's file: made new here, or (asked for) an existing one adopted.
            let made = match &rec.path {
                Some(path) if !p.adopt_existing => {
                    create_backing_file(path, rec.size)?;
                    Some(path.clone())
                }
                _ => None,
            };
            // A failed create leaves no file behind (it would block the retry).
            let undo = |e: RpcError| {
                if let Some(path) = &made {
                    let _ = std::fs::remove_file(path);
                }
                e
            };
            let (dev, tenant) = open_for_create(self, inner, &rec).map_err(undo)?;
            let mut next = inner.state.clone();
            next.volumes.insert(rec.name.clone(), rec.clone());
            if let Some(t) = tenant {
                next.tenants.insert(t.name.clone(), t);
            }
            if let Err(e) = self.persist(&next) {
                drop(dev);
                return Err(undo(e));
            }
            inner.state = next;
            let dev = with_qos(self, &rec, dev);
            inner.live.volumes.insert(rec.name.clone(), dev);
            info!(volume = %rec.name, size = rec.size, backend = %rec.backend, "volume created");
            Ok(volume_info(inner, &rec))
        })
    }

    /// Validate and normalise a `volume_create` request into a record.
    fn new_volume_record(&self, p: &VolumeCreate) -> Result<VolumeRecord, RpcError> {
        validate_name("volume", &p.name).map_err(RpcError::invalid_params)?;
        if !BLOCK_SIZES.contains(&p.block_size) {
            return Err(RpcError::invalid_params(format!(
                "block_size must be 512 or 4096 (got {})",
                p.block_size
            )));
        }
        if p.adopt_existing && p.backend != BackendKind::File {
            return Err(RpcError::invalid_params(format!(
                "adopt_existing only applies to file volumes (backend is {})",
                p.backend
            )));
        }
        if p.remote.is_some() && p.backend != BackendKind::Remote {
            return Err(RpcError::invalid_params(format!(
                "remote only applies to remote volumes (backend is {})",
                p.backend
            )));
        }
        if p.path.is_some() && p.backend != BackendKind::File {
            return Err(RpcError::invalid_params(format!(
                "path only applies to file volumes (backend is {})",
                p.backend
            )));
        }
        let path = match (p.backend, &p.path) {
            (BackendKind::File, Some(path)) => {
                let path = PathBuf::from(path);
                if !path.is_absolute() {
                    return Err(RpcError::invalid_params(format!(
                        "path must be absolute (got {path:?})"
                    )));
                }
                Some(path)
            }
            (BackendKind::File, None) => Some(self.default_volume_path(&p.name)),
            _ => None,
        };
        let size = match (&path, p.backend) {
            (_, BackendKind::Remote) => remote_volume::size(&self.controllers, p)?,
            (Some(path), BackendKind::File) if p.adopt_existing => adopted_size(path, p)?,
            _ => {
                check_size(p.size, p.block_size)?;
                p.size
            }
        };
        let uuid = uuid::Uuid::new_v4();
        Ok(VolumeRecord {
            name: p.name.clone(),
            size,
            block_size: p.block_size,
            backend: p.backend,
            path,
            serial: serial_from_uuid(&uuid),
            uuid: uuid.to_string(),
            tenant: p.tenant.clone(),
            encrypted: p.encrypt,
            remote: p.remote.clone(),
            over: None,
        })
    }

    /// An encryption layer over an existing volume with a data key the caller gives (OPI's
    /// `CreateEncryptedVolume`): a new volume `name`, the XTS view of `base`'s blocks (one
    /// data unit per block, tweak = LBA, little-endian: SPDK's crypto bdev layout). The key
    /// is wrapped under `tenant`'s KEK at once, exactly like nacre's own data keys, and
    /// stored only wrapped; the layer is persisted and replayed after its base. Deleting it
    /// (`delete_volume`) leaves the base and its data; the base cannot be deleted under it.
    pub fn create_encrypted_layer(
        &self,
        name: &str,
        base: &str,
        tenant: &str,
        key: &XtsKey,
    ) -> Result<VolumeInfo, RpcError> {
        validate_name("volume", name).map_err(RpcError::invalid_params)?;
        self.with(|inner| {
            if inner.state.volumes.contains_key(name) {
                return Err(RpcError::exists("volume", name));
            }
            let b = inner.volume(base)?.clone();
            if inner.live.failed.contains_key(base) {
                return Err(RpcError::refused(format!(
                    "volume {base:?} is failed; an encryption layer needs it online"
                )));
            }
            let base_dev = inner
                .live
                .volumes
                .get(base)
                .cloned()
                .ok_or_else(|| RpcError::failed(format!("volume {base:?} is not open")))?;
            let t = tenant_of(&inner.state, tenant)?.clone();
            let kek = unlocked(inner, &t)?;
            let policy = EncryptionPolicy {
                cipher: if key.len() == XTS_128_KEY_LEN {
                    CipherKind::AesXts128
                } else {
                    CipherKind::AesXts256
                },
                data_unit: b.block_size,
                tweak: TweakMode::Plain64,
                require_encryption: false,
            };
            let next_tenant = t
                .add_volume_with_key(name, key, policy, &kek)
                .map_err(rpc_err)?;
            let dev = EncryptedVolume::new(base_dev, key, policy).map_err(rpc_err)?;
            let uuid = uuid::Uuid::new_v4();
            let rec = VolumeRecord {
                name: name.to_string(),
                size: b.size,
                block_size: b.block_size,
                backend: b.backend,
                path: None,
                uuid: uuid.to_string(),
                serial: serial_from_uuid(&uuid),
                tenant: Some(t.name.clone()),
                encrypted: true,
                remote: None,
                over: Some(base.to_string()),
            };
            let mut next = inner.state.clone();
            next.volumes.insert(rec.name.clone(), rec.clone());
            next.tenants.insert(t.name.clone(), next_tenant);
            self.persist(&next)?;
            inner.state = next;
            let dev = gated(inner, name, std::sync::Arc::new(dev));
            let dev = with_qos(self, &rec, dev);
            inner.live.volumes.insert(rec.name.clone(), dev);
            info!(volume = %name, base = %base, tenant = %t.name, cipher = policy.cipher.as_str(),
                  "encryption layer created");
            Ok(volume_info(inner, &rec))
        })
    }

    /// Whether `key` is the data key of encrypted volume `name` (compared in constant time
    /// after unwrapping): an idempotent create with the same key is the same resource.
    pub fn volume_key_is(&self, name: &str, key: &XtsKey) -> Result<bool, RpcError> {
        self.with(|inner| {
            let rec = inner.volume(name)?.clone();
            let Some(tname) = rec.tenant.as_ref().filter(|_| rec.encrypted) else {
                return Ok(false);
            };
            let t = tenant_of(&inner.state, tname)?.clone();
            let kek = unlocked(inner, &t)?;
            let (have, _) = t.open_volume(name, &kek).map_err(rpc_err)?;
            Ok(ct_eq(have.as_bytes(), key.as_bytes()))
        })
    }

    /// `volume_list`: every volume, or the one named.
    pub fn volumes(&self, name: Option<&str>) -> Result<Vec<VolumeInfo>, RpcError> {
        self.with(|inner| {
            if let Some(name) = name {
                return Ok(vec![volume_info(inner, inner.volume(name)?)]);
            }
            Ok(inner
                .state
                .volumes
                .values()
                .map(|r| volume_info(inner, r))
                .collect())
        })
    }

    /// `volume_delete`: refused while frontends export it. Its key record goes from its
    /// tenant and its QoS limits from the state; `delete_data` also removes a file volume's
    /// backing file (after the state no longer names it).
    pub fn delete_volume(&self, name: &str, delete_data: bool) -> Result<(), RpcError> {
        self.with(|inner| {
            let rec = inner.volume(name)?.clone();
            refuse_if_exported(&inner.state, name, |users| {
                format!("volume {name:?} is exported by {users}; delete those first")
            })?;
            let mut next = inner.state.clone();
            next.volumes.remove(name);
            next.qos.volumes.remove(name);
            if let Some(t) = rec.tenant.as_ref().and_then(|t| next.tenants.get_mut(t)) {
                t.volumes.remove(&rec.name);
            }
            self.commit(inner, next, || {})?;
            inner.live.volumes.remove(name);
            inner.live.failed.remove(name);
            if delete_data {
                if let Some(path) = &rec.path {
                    if let Err(e) = std::fs::remove_file(path) {
                        if e.kind() != std::io::ErrorKind::NotFound {
                            return Err(RpcError::failed(format!(
                                "volume deleted, but its backing file {} could not be removed: {e}",
                                path.display()
                            )));
                        }
                    }
                }
            }
            info!(volume = %name, "volume deleted");
            Ok(())
        })
    }

    /// `volume_resize`: the live volume first, then the state (the live size is put back
    /// if persisting fails). Shrinking an exported volume is refused.
    pub fn resize_volume(&self, name: &str, size: u64) -> Result<VolumeInfo, RpcError> {
        self.with(|inner| {
            let rec = inner.volume(name)?.clone();
            check_size(size, rec.block_size)?;
            if size < rec.size {
                refuse_if_exported(&inner.state, name, |users| {
                    format!(
                        "volume {name:?} is exported by {users}; shrinking it under a host would lose data the host thinks it has"
                    )
                })?;
            }
            let dev = inner
                .live
                .volumes
                .get(name)
                .cloned()
                .ok_or_else(|| RpcError::failed(format!("volume {name:?} is not open")))?;
            dev.resize(size)
                .map_err(|e| RpcError::failed(format!("cannot resize volume {name:?}: {e}")))?;
            let mut next = inner.state.clone();
            next.volumes.get_mut(name).expect("checked above").size = size;
            // Keep what runs and what would be replayed in step.
            self.commit(inner, next, || {
                let _ = dev.resize(rec.size);
            })?;
            info!(volume = %name, size, "volume resized");
            let rec = inner.state.volumes[name].clone();
            Ok(volume_info(inner, &rec))
        })
    }
}

pub(super) fn volume_info(inner: &Inner, rec: &VolumeRecord) -> VolumeInfo {
    VolumeInfo {
        name: rec.name.clone(),
        size: rec.size,
        block_size: rec.block_size,
        backend: rec.backend,
        path: rec.path.as_ref().map(|p| p.display().to_string()),
        serial: rec.serial.clone(),
        uuid: rec.uuid.clone(),
        tenant: rec.tenant.clone(),
        encrypted: rec.encrypted,
        exported_by: exporter_names(&inner.state, &rec.name),
        remote: rec.remote.clone(),
        over: rec.over.clone(),
        state: if inner.live.failed.contains_key(&rec.name) {
            VolumeState::Failed
        } else {
            VolumeState::Online
        },
        reason: inner.live.failed.get(&rec.name).cloned(),
    }
}

/// The size of a volume adopting `path`: the file's, which a given size must match.
fn adopted_size(path: &Path, p: &VolumeCreate) -> Result<u64, RpcError> {
    let m = std::fs::metadata(path).map_err(|e| {
        RpcError::failed(format!("cannot adopt backing file {}: {e}", path.display()))
    })?;
    if !m.is_file() {
        return Err(RpcError::failed(format!(
            "cannot adopt {}: not a regular file",
            path.display()
        )));
    }
    let len = m.len();
    if p.size != 0 && p.size != len {
        return Err(RpcError::invalid_params(format!(
            "{} is {len} bytes but size says {}; give its size or none to take the file's",
            path.display(),
            p.size
        )));
    }
    check_size(len, p.block_size).map_err(|_| {
        RpcError::invalid_params(format!(
            "{} is {len} bytes, not a positive multiple of the block size {}",
            path.display(),
            p.block_size
        ))
    })?;
    Ok(len)
}

fn check_size(size: u64, block_size: u32) -> Result<(), RpcError> {
    if size == 0 {
        return Err(RpcError::invalid_params(format!(
            "size is required: a positive multiple of the block size {block_size}"
        )));
    }
    if size % block_size as u64 != 0 {
        return Err(RpcError::invalid_params(format!(
            "size must be a positive multiple of the block size {block_size} (got {size})"
        )));
    }
    Ok(())
}
