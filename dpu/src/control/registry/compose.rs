//! Opening a volume: the live device a volume record stands for, composed bottom-up from
//! its backing store (RAM, null, a file, or remote namespaces: [`super::remote_volume`]),
//! the crypto layer of an encrypted volume (its data key unwrapped by the tenant's KEK:
//! [`super::keys`]) and the QoS and statistics layer.

use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nacre_shared::api::volume::BackendKind;
use tracing::{info, warn};

use super::keys::{rpc_err, tenant_of, unlocked};
use super::remote_volume;
use super::store::{Inner, Registry};
use crate::control::error::RpcError;
use crate::control::state::VolumeRecord;
use crate::crypto::gate::KeyGate;
use crate::crypto::tenant::TenantRecord;
use crate::crypto::volume::EncryptedVolume;
use crate::volume::{
    file::FileVolume, null::NullVolume, ram::RamVolume, BlockDevice, Geometry, IoCompletion,
    IoError, IoRequest,
};

/// Where a file volume lives unless told otherwise.
pub fn default_volume_path(state_dir: &Path, name: &str) -> PathBuf {
    state_dir.join("volumes").join(format!("{name}.img"))
}

/// Open the backing store of a volume record (ciphertext for encrypted volumes: open
/// volumes through [`open_existing`], which adds the crypto layer).
fn open_backend(reg: &Registry, rec: &VolumeRecord) -> Result<Arc<dyn BlockDevice>, RpcError> {
    let dev: Arc<dyn BlockDevice> = match rec.backend {
        BackendKind::Ram => Arc::new(
            RamVolume::new(rec.size, rec.block_size)
                .map_err(|e| RpcError::failed(format!("cannot allocate RAM volume: {e}")))?,
        ),
        BackendKind::Null => Arc::new(NullVolume::new(rec.size, rec.block_size)),
        BackendKind::Remote => remote_volume::open(&reg.controllers, rec)?,
        BackendKind::File => {
            let path = rec
                .path
                .clone()
                .unwrap_or_else(|| default_volume_path(reg.state_dir(), &rec.name));
            // Never create it here: a missing file (deleted, or on a file system not mounted
            // yet) must fail the volume, not come back empty and be served as zeros.
            // `volume_create` makes new files ([`create_backing_file`]).
            check_backing_file(&path)?;
            Arc::new(
                FileVolume::open(&path, rec.size, rec.block_size, true).map_err(|e| {
                    RpcError::failed(format!("cannot open backing file {}: {e}", path.display()))
                })?,
            )
        }
    };
    Ok(dev)
}

/// The backing file must exist and be a regular file (or a block device).
pub(super) fn check_backing_file(path: &Path) -> Result<(), RpcError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() || m.file_type().is_block_device() => Ok(()),
        Ok(_) => Err(RpcError::failed(format!(
            "backing file {} is not a regular file",
            path.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(RpcError::failed(format!(
            "backing file {} is missing (deleted, or its file system is not mounted); nacre \
             never recreates it empty: restore it and restart nacred, or delete the volume",
            path.display()
        ))),
        Err(e) => Err(RpcError::failed(format!(
            "cannot stat backing file {}: {e}",
            path.display()
        ))),
    }
}

/// Make a new, empty backing file of `size` bytes (sparse) for `volume_create`, refusing one
/// that exists. The file, and every directory entry made on the way to it, is fsynced before
/// the volume is acknowledged, so a crash cannot lose a volume whose state was saved.
pub(super) fn create_backing_file(path: &Path, size: u64) -> Result<(), RpcError> {
    let failed = |what: &str, p: &Path, e: std::io::Error| {
        RpcError::failed(format!("cannot {what} {}: {e}", p.display()))
    };
    // The directories that do not exist yet, outermost first.
    let mut new_dirs = Vec::new();
    let mut dir = path.parent();
    while let Some(d) = dir {
        if d.as_os_str().is_empty() || d.exists() {
            break;
        }
        new_dirs.push(d.to_path_buf());
        dir = d.parent();
    }
    for d in new_dirs.iter().rev() {
        match std::fs::create_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(failed("create", d, e)),
        }
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                exists_error(path)
            } else {
                failed("create", path, e)
            }
        })?;
    file.set_len(size)
        .and_then(|()| file.sync_all())
        .map_err(|e| failed("size", path, e))?;
    // The new file's entry, and those of the directories made for it.
    let mut sync = vec![path.parent().map(Path::to_path_buf)];
    sync.extend(new_dirs.iter().map(|d| d.parent().map(Path::to_path_buf)));
    for d in sync.into_iter().flatten() {
        let d = if d.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            d
        };
        std::fs::File::open(&d)
            .and_then(|f| f.sync_all())
            .map_err(|e| failed("fsync directory", &d, e))?;
    }
    Ok(())
}

fn exists_error(path: &Path) -> RpcError {
    RpcError::new(
        nacre_shared::rpc::ALREADY_EXISTS,
        format!(
            "backing file {} already exists (data of an earlier volume?); nacre does not reuse \
             data implicitly: pass --adopt-existing (\"adopt_existing\": true) to serve it, or \
             remove the file",
            path.display()
        ),
    )
}

/// Open an existing volume record's data path; encrypted volumes are unwrapped and wrapped
/// in an [`EncryptedVolume`]. The key is unwrapped before the backing store is touched, so a
/// wrong KEK or a tampered record opens (and writes) nothing. Without the QoS layer: see
/// [`with_qos`].
pub(super) fn open_existing(
    reg: &Registry,
    inner: &mut Inner,
    rec: &VolumeRecord,
) -> Result<Arc<dyn BlockDevice>, RpcError> {
    if !rec.encrypted {
        if let Some(t) = rec.tenant.as_ref().and_then(|t| inner.state.tenants.get(t)) {
            t.policy.check_plaintext_allowed(&t.name).map_err(rpc_err)?;
        }
        return open_backend(reg, rec);
    }
    let tname = rec.tenant.as_ref().ok_or_else(|| {
        RpcError::failed(format!("encrypted volume {:?} names no tenant", rec.name))
    })?;
    let t = tenant_of(&inner.state, tname)?.clone();
    let kek = unlocked(inner, &t)?;
    let (key, policy) = t.open_volume(&rec.name, &kek).map_err(rpc_err)?;
    let raw = match &rec.over {
        // An encryption layer: the base volume's live device (opened before it).
        Some(base) => inner.live.volumes.get(base).cloned().ok_or_else(|| {
            RpcError::failed(format!(
                "volume {:?} is an encryption layer over {base:?}, which is not open",
                rec.name
            ))
        })?,
        None => open_backend(reg, rec)?,
    };
    let dev = EncryptedVolume::new(raw, &key, policy).map_err(rpc_err)?;
    Ok(gated(inner, &rec.name, Arc::new(dev)))
}

/// Serve `dev` through the volume's key gate: the existing one (a volume that was locked
/// and is being unlocked: its devices see the change) or a new one.
pub(super) fn gated(
    inner: &mut Inner,
    name: &str,
    dev: Arc<dyn BlockDevice>,
) -> Arc<dyn BlockDevice> {
    if let Some(g) = inner
        .live
        .gates
        .get(name)
        .and_then(std::sync::Weak::upgrade)
    {
        g.set(dev);
        return g;
    }
    let g = Arc::new(KeyGate::new(dev));
    inner
        .live
        .gates
        .insert(name.to_string(), Arc::downgrade(&g));
    g
}

/// For `volume_create`: check the tenant and its policy, create the data key of an encrypted
/// volume, and open the data path. Returns the device and the tenant record to persist with
/// the volume (for encrypted volumes).
pub(super) fn open_for_create(
    reg: &Registry,
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
        return Ok((open_backend(reg, rec)?, None));
    }
    let t = tenant.ok_or_else(|| {
        RpcError::invalid_params("encrypt needs a tenant: the tenant's KEK wraps the volume key")
    })?;
    let kek = unlocked(inner, &t)?;
    let (next, key) = t
        .add_volume(&rec.name, rec.block_size, &kek)
        .map_err(rpc_err)?;
    let raw = open_backend(reg, rec)?;
    let dev = EncryptedVolume::new(raw, &key, next.volumes[&rec.name].policy).map_err(rpc_err)?;
    info!(volume = %rec.name, tenant = %t.name, engine = dev.engine_name(), "encrypted volume created");
    Ok((gated(inner, &rec.name, Arc::new(dev)), Some(next)))
}

/// The QoS and statistics layer over a freshly opened volume (unless nacred runs without it:
/// [`super::DataPathConfig::qos`]).
pub(super) fn with_qos(
    reg: &Registry,
    rec: &VolumeRecord,
    dev: Arc<dyn BlockDevice>,
) -> Arc<dyn BlockDevice> {
    if !reg.config.data_path.qos {
        return dev;
    }
    reg.qos.wrap(&rec.name, rec.tenant.as_deref(), dev)
}

/// Reopen a persisted volume at replay and register it as live. One that cannot be opened
/// is recorded as failed (`volume_list` gives the reason); a file volume whose file is
/// missing comes up as a [`FailedVolume`], served (so its devices come back) but failing
/// every I/O, never recreated empty.
pub(super) fn reopen(reg: &Registry, inner: &mut Inner, rec: &VolumeRecord) {
    if let Some(path) = rec
        .path
        .as_ref()
        .filter(|_| rec.backend == BackendKind::File)
    {
        if let Err(e) = check_backing_file(path) {
            warn!(volume = %rec.name, error = %e, "volume failed");
            let failed = FailedVolume::new(rec, e.message.clone());
            inner
                .live
                .volumes
                .insert(rec.name.clone(), Arc::new(failed));
            inner.live.failed.insert(rec.name.clone(), e.message);
            return;
        }
    }
    match open_existing(reg, inner, rec) {
        Ok(dev) => {
            let dev = with_qos(reg, rec, dev);
            inner.live.volumes.insert(rec.name.clone(), dev);
        }
        Err(e) if rec.encrypted => {
            // Served all the same, failing every request, through its key gate: its
            // devices come back, and `tenant_unlock` swaps the opened volume in.
            warn!(volume = %rec.name, error = %e, "encrypted volume failed");
            let failed = gated(
                inner,
                &rec.name,
                Arc::new(FailedVolume::new(rec, e.message.clone())),
            );
            let dev = with_qos(reg, rec, failed);
            inner.live.volumes.insert(rec.name.clone(), dev);
            inner.live.failed.insert(rec.name.clone(), e.message);
        }
        Err(e) => {
            warn!(volume = %rec.name, error = %e, "volume not reopened");
            inner.live.failed.insert(rec.name.clone(), e.message);
        }
    }
}

/// What a volume that could not be opened serves: its geometry, and an error for every
/// request (virtio-blk IOERR, an NVMe error status), so devices exporting it come back and
/// their hosts see failed I/O instead of a missing disk or zeros.
pub struct FailedVolume {
    geometry: Geometry,
    reason: String,
}

impl FailedVolume {
    pub fn new(rec: &VolumeRecord, reason: String) -> Self {
        FailedVolume {
            geometry: Geometry {
                size: rec.size,
                block_size: rec.block_size,
            },
            reason,
        }
    }
}

// SAFETY: completes every request at once and never touches its segments.
unsafe impl BlockDevice for FailedVolume {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        done.complete(
            req.tag,
            Err(IoError::Media(format!("volume failed: {}", self.reason))),
        );
    }
}
