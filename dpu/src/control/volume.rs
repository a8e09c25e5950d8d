//! `volume_*` methods.

use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nacre_shared::api::volume::{
    BackendKind, VolumeCreate, VolumeDelete, VolumeInfo, VolumeList, VolumeResize, VolumeState,
    BLOCK_SIZES,
};
use nacre_shared::api::{validate_name, Ack};
use serde_json::Value;
use tracing::info;

use super::state::VolumeRecord;
use super::{parse_params, to_value, Daemon, Inner, Method, RpcError};
use crate::volume::{file::FileVolume, null::NullVolume, ram::RamVolume, BlockDevice};

pub const METHODS: &[Method] = &[
    Method {
        name: "volume_create",
        handler: volume_create,
        help: "Create a volume: name, size (bytes), block_size (512|4096), backend (ram|file|null), path, tenant, encrypt.",
    },
    Method {
        name: "volume_list",
        handler: volume_list,
        help: "List volumes (optionally one: name), each with its state (online|failed) and the reason a failed one gives.",
    },
    Method {
        name: "volume_delete",
        handler: volume_delete,
        help: "Delete an unexported volume: name; delete_data also removes a file volume's backing file.",
    },
    Method {
        name: "volume_resize",
        handler: volume_resize,
        help: "Change a volume's size: name, size (bytes). Shrinking an exported volume is refused.",
    },
];

/// Where a file volume lives unless told otherwise.
pub fn default_volume_path(d: &Daemon, name: &str) -> PathBuf {
    d.state_dir().join("volumes").join(format!("{name}.img"))
}

/// Open the backing store of a volume record (ciphertext for encrypted volumes: open
/// volumes through `tenant::open_existing`, which adds the crypto layer).
pub fn open_backend(d: &Daemon, rec: &VolumeRecord) -> Result<Arc<dyn BlockDevice>, RpcError> {
    let dev: Arc<dyn BlockDevice> = match rec.backend {
        BackendKind::Ram => Arc::new(
            RamVolume::new(rec.size, rec.block_size)
                .map_err(|e| RpcError::failed(format!("cannot allocate RAM volume: {e}")))?,
        ),
        BackendKind::Null => Arc::new(NullVolume::new(rec.size, rec.block_size)),
        BackendKind::Remote => super::remote::open_volume(d, rec)?,
        BackendKind::File => {
            let path = rec
                .path
                .clone()
                .unwrap_or_else(|| default_volume_path(d, &rec.name));
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
pub fn check_backing_file(path: &Path) -> Result<(), RpcError> {
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
fn create_backing_file(path: &Path, size: u64) -> Result<(), RpcError> {
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

/// Validate and normalise a `volume_create` request into a record.
pub fn new_record(d: &Daemon, p: &VolumeCreate) -> Result<VolumeRecord, RpcError> {
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
        (BackendKind::File, None) => Some(default_volume_path(d, &p.name)),
        _ => None,
    };
    let size = match (&path, p.backend) {
        (_, BackendKind::Remote) => super::remote::volume_size(d, p)?,
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
    })
}

/// The serial devices report: 20 ASCII characters, the NVMe Identify Controller SN width and
/// the virtio-blk GET_ID length, so both frontends show the same string.
pub fn serial_from_uuid(uuid: &uuid::Uuid) -> String {
    let hex = uuid.simple().to_string().to_ascii_uppercase();
    format!("NACRE{}", &hex[..15])
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
    if size == 0 || size % block_size as u64 != 0 {
        return Err(RpcError::invalid_params(format!(
            "size must be a positive multiple of the block size {block_size} (got {size})"
        )));
    }
    Ok(())
}

fn volume_create(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeCreate = parse_params(params)?;
    create(d, &p).and_then(to_value)
}

/// `volume_create`, callable from the embedded default too.
pub fn create(d: &Daemon, p: &VolumeCreate) -> Result<VolumeInfo, RpcError> {
    let rec = new_record(d, p)?;
    d.with_inner(|inner| {
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
        let (dev, tenant) = super::tenant::open_for_create(d, inner, &rec).map_err(undo)?;
        let mut next = inner.state.clone();
        next.volumes.insert(rec.name.clone(), rec.clone());
        if let Some(t) = tenant {
            next.tenants.insert(t.name.clone(), t);
        }
        if let Err(e) = d.persist(&next) {
            drop(dev);
            return Err(undo(e));
        }
        inner.state = next;
        let dev = super::qos::wrap(d, &rec, dev);
        inner.live.volumes.insert(rec.name.clone(), dev);
        info!(volume = %rec.name, size = rec.size, backend = %rec.backend, "volume created");
        Ok(info_of(inner, &rec))
    })
}

/// The names of devices exporting a volume.
pub fn exporters(inner: &Inner, volume: &str) -> Vec<String> {
    inner
        .state
        .vhost_blk
        .values()
        .filter(|v| v.volume == volume)
        .map(|v| format!("vhost-blk:{}", v.name))
        .chain(super::nvmf::exporters(inner, volume))
        .collect()
}

pub fn info_of(inner: &Inner, rec: &VolumeRecord) -> VolumeInfo {
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
        exported_by: exporters(inner, &rec.name),
        remote: rec.remote.clone(),
        state: if inner.live.failed.contains_key(&rec.name) {
            VolumeState::Failed
        } else {
            VolumeState::Online
        },
        reason: inner.live.failed.get(&rec.name).cloned(),
    }
}

fn volume_list(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeList = parse_params(params)?;
    d.with_inner(|inner| {
        if let Some(name) = &p.name {
            let rec = inner
                .state
                .volumes
                .get(name)
                .ok_or_else(|| RpcError::not_found("volume", name))?;
            return to_value(vec![info_of(inner, rec)]);
        }
        to_value(
            inner
                .state
                .volumes
                .values()
                .map(|r| info_of(inner, r))
                .collect::<Vec<_>>(),
        )
    })
}

fn volume_delete(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeDelete = parse_params(params)?;
    d.with_inner(|inner| {
        let rec = inner
            .state
            .volumes
            .get(&p.name)
            .cloned()
            .ok_or_else(|| RpcError::not_found("volume", &p.name))?;
        let users = exporters(inner, &p.name);
        if !users.is_empty() {
            return Err(RpcError::busy(format!(
                "volume {:?} is exported by {}; delete those first",
                p.name,
                users.join(", ")
            )));
        }
        let mut next = inner.state.clone();
        next.volumes.remove(&p.name);
        next.qos.volumes.remove(&p.name);
        super::tenant::forget_volume(&mut next, &rec);
        d.persist(&next)?;
        inner.state = next;
        inner.live.volumes.remove(&p.name);
        inner.live.failed.remove(&p.name);
        if p.delete_data {
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
        info!(volume = %p.name, "volume deleted");
        to_value(Ack { ok: true })
    })
}

fn volume_resize(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeResize = parse_params(params)?;
    d.with_inner(|inner| {
        let rec = inner
            .state
            .volumes
            .get(&p.name)
            .cloned()
            .ok_or_else(|| RpcError::not_found("volume", &p.name))?;
        check_size(p.size, rec.block_size)?;
        let users = exporters(inner, &p.name);
        if p.size < rec.size && !users.is_empty() {
            return Err(RpcError::busy(format!(
                "volume {:?} is exported by {}; shrinking it under a host would lose data the host thinks it has",
                p.name,
                users.join(", ")
            )));
        }
        let dev = inner
            .live
            .volumes
            .get(&p.name)
            .cloned()
            .ok_or_else(|| RpcError::failed(format!("volume {:?} is not open", p.name)))?;
        dev.resize(p.size)
            .map_err(|e| RpcError::failed(format!("cannot resize volume {:?}: {e}", p.name)))?;
        let mut next = inner.state.clone();
        next.volumes.get_mut(&p.name).expect("checked above").size = p.size;
        if let Err(e) = d.persist(&next) {
            // Keep what runs and what would be replayed in step.
            let _ = dev.resize(rec.size);
            return Err(e);
        }
        inner.state = next;
        info!(volume = %p.name, size = p.size, "volume resized");
        let rec = inner.state.volumes[&p.name].clone();
        to_value(info_of(inner, &rec))
    })
}

/// What a volume that could not be opened serves: its geometry, and an error for every
/// request (virtio-blk IOERR, an NVMe error status), so devices exporting it come back and
/// their hosts see failed I/O instead of a missing disk or zeros.
pub struct FailedVolume {
    geometry: crate::volume::Geometry,
    reason: String,
}

impl FailedVolume {
    pub fn new(rec: &VolumeRecord, reason: String) -> Self {
        FailedVolume {
            geometry: crate::volume::Geometry {
                size: rec.size,
                block_size: rec.block_size,
            },
            reason,
        }
    }
}

impl BlockDevice for FailedVolume {
    fn geometry(&self) -> crate::volume::Geometry {
        self.geometry
    }

    fn submit(&self, req: crate::volume::IoRequest, done: &Arc<dyn crate::volume::Completion>) {
        done.complete(
            req.tag,
            Err(crate::volume::IoError::Media(format!(
                "volume failed: {}",
                self.reason
            ))),
        );
    }
}
