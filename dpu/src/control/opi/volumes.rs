//! NullVolumeService, MallocVolumeService, AioVolumeService: nacre's `null`, `ram` and
//! `file` volumes. The resource id is the volume's name (`nullVolumes/v` is volume `v`), so
//! these need no binding; a volume of another backend is not found under the collection.
//! An AIO volume serves the data of an existing file or block device (`adopt_existing`);
//! deleting it leaves the file.

use std::sync::Arc;

use nacre_shared::api::volume::{BackendKind, VolumeCreate, VolumeInfo};
use tonic::{Request, Response, Status};

use super::pb;
use super::{
    blocking, exists_differently, id_in, invalid, mask_paths, new_id, not_found, page, paginate,
    status, volume_stats,
};
use crate::control::registry::Registry;

/// What OPI's three volume messages have in common.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Spec {
    block_size: i64,
    blocks_count: i64,
    uuid: String,
    filename: String,
}

#[derive(Clone, Copy)]
struct Kind {
    collection: &'static str,
    backend: BackendKind,
}

const NULL: Kind = Kind {
    collection: "nullVolumes",
    backend: BackendKind::Null,
};
const MALLOC: Kind = Kind {
    collection: "mallocVolumes",
    backend: BackendKind::Ram,
};
const AIO: Kind = Kind {
    collection: "aioVolumes",
    backend: BackendKind::File,
};

fn spec_of(v: &VolumeInfo) -> Spec {
    Spec {
        block_size: i64::from(v.block_size),
        blocks_count: (v.size / u64::from(v.block_size.max(1))) as i64,
        uuid: v.uuid.clone(),
        filename: v.path.clone().unwrap_or_default(),
    }
}

fn find(r: &Registry, k: Kind, id: &str) -> Option<VolumeInfo> {
    r.volumes(Some(id))
        .ok()
        .and_then(|v| v.into_iter().next())
        .filter(|v| v.backend == k.backend && v.over.is_none())
}

/// The same spec, as far as the client set it (uuid and, for AIO, the sizes are optional).
fn same(k: Kind, want: &Spec, have: &Spec) -> bool {
    let opt = |w: i64, h: i64| w == 0 || w == h;
    let sizes = if k.backend == BackendKind::File {
        opt(want.block_size, have.block_size) && opt(want.blocks_count, have.blocks_count)
    } else {
        want.block_size == have.block_size && want.blocks_count == have.blocks_count
    };
    // (The uuid is nacre's own: one the client sets is not kept, and not compared.)
    sizes && (k.backend != BackendKind::File || want.filename == have.filename)
}

fn create(r: &Registry, k: Kind, id: &str, s: &Spec) -> Result<(String, Spec), Status> {
    let id = new_id(id)?;
    let name = format!("{}/{id}", k.collection);
    if let Some(v) = find(r, k, &id) {
        let have = spec_of(&v);
        return if same(k, s, &have) {
            Ok((name, have))
        } else {
            Err(exists_differently(&name))
        };
    }
    let aio = k.backend == BackendKind::File;
    if aio && s.filename.is_empty() {
        return Err(invalid("filename is required"));
    }
    if !aio && (s.block_size <= 0 || s.blocks_count <= 0) {
        return Err(invalid("block_size and blocks_count are required"));
    }
    if s.block_size < 0 || s.blocks_count < 0 {
        return Err(invalid("block_size and blocks_count must not be negative"));
    }
    let block_size = u32::try_from(if s.block_size == 0 {
        4096
    } else {
        s.block_size
    })
    .map_err(|_| invalid(format!("block_size {} is not 512 or 4096", s.block_size)))?;
    let size = (s.blocks_count as u64)
        .checked_mul(u64::from(block_size))
        .ok_or_else(|| invalid("block_size × blocks_count is too large"))?;
    let v = r
        .create_volume(&VolumeCreate {
            name: id.clone(),
            size,
            block_size,
            backend: k.backend,
            path: aio.then(|| s.filename.clone()),
            tenant: None,
            encrypt: false,
            remote: None,
            adopt_existing: aio,
        })
        .map_err(status)?;
    Ok((name, spec_of(&v)))
}

fn get(r: &Registry, k: Kind, name: &str) -> Result<(String, Spec), Status> {
    let id = id_in(name, k.collection)?;
    let v = find(r, k, id).ok_or_else(|| not_found(name))?;
    Ok((name.to_string(), spec_of(&v)))
}

fn list(
    r: &Registry,
    k: Kind,
    size: i32,
    token: &str,
) -> Result<(Vec<(String, Spec)>, String), Status> {
    let p = page(size, token)?;
    let all = r
        .volumes(None)
        .map_err(status)?
        .into_iter()
        .filter(|v| v.backend == k.backend && v.over.is_none())
        .map(|v| {
            let n = format!("{}/{}", k.collection, v.name);
            (n.clone(), (n, spec_of(&v)))
        })
        .collect();
    Ok(paginate(all, &p))
}

fn delete(r: &Registry, k: Kind, name: &str, allow_missing: bool) -> Result<(), Status> {
    let id = id_in(name, k.collection)?;
    if find(r, k, id).is_none() {
        return if allow_missing {
            Ok(())
        } else {
            Err(not_found(name))
        };
    }
    // An AIO volume's file is the client's: it stays.
    r.delete_volume(id, false).map_err(status)
}

/// Update: only blocks_count changes (a resize); allow_missing creates.
fn update(
    r: &Registry,
    k: Kind,
    name: &str,
    s: &Spec,
    mask: &Option<prost_types::FieldMask>,
    allow_missing: bool,
) -> Result<(String, Spec), Status> {
    let id = id_in(name, k.collection)?;
    let Some(v) = find(r, k, id) else {
        return if allow_missing {
            create(r, k, id, s)
        } else {
            Err(not_found(name))
        };
    };
    let have = spec_of(&v);
    let paths = mask_paths(
        mask,
        &[
            "block_size",
            "blocks_count",
            "uuid",
            "filename",
            "metadata_size",
        ],
    )?;
    for p in &paths {
        let changed = match p.as_str() {
            "block_size" => s.block_size != have.block_size,
            "filename" => k.backend == BackendKind::File && s.filename != have.filename,
            _ => false,
        };
        if changed {
            return Err(invalid(format!("{p} of {name} cannot change")));
        }
    }
    if paths.iter().any(|p| p == "blocks_count") && s.blocks_count != have.blocks_count {
        let bs = u64::from(v.block_size);
        let size = u64::try_from(s.blocks_count)
            .ok()
            .filter(|&c| c > 0)
            .and_then(|c| c.checked_mul(bs))
            .ok_or_else(|| invalid(format!("blocks_count {} is not a size", s.blocks_count)))?;
        let v = r.resize_volume(id, size).map_err(status)?;
        return Ok((name.to_string(), spec_of(&v)));
    }
    Ok((name.to_string(), have))
}

fn stats(r: &Registry, k: Kind, name: &str) -> Result<pb::VolumeStats, Status> {
    let id = id_in(name, k.collection)?;
    find(r, k, id).ok_or_else(|| not_found(name))?;
    volume_stats(r, id)
}

/// One service per volume message: the generic operations above, converted.
macro_rules! volume_service {
    ($svc:ident, $trait:path, $kind:expr, $msg:ident, $field:ident,
     $create:ident, $create_req:ident, $get:ident, $get_req:ident,
     $list:ident, $list_req:ident, $list_resp:ident, $items:ident,
     $delete:ident, $delete_req:ident, $update:ident, $update_req:ident,
     $stats:ident, $stats_req:ident, $stats_resp:ident,
     $to:expr, $from:expr) => {
        pub struct $svc(pub Arc<Registry>);

        #[tonic::async_trait]
        impl $trait for $svc {
            async fn $create(
                &self,
                req: Request<pb::$create_req>,
            ) -> Result<Response<pb::$msg>, Status> {
                let r = self.0.clone();
                let req = req.into_inner();
                blocking(move || {
                    let id = paste_id(&req);
                    let m = req
                        .$field
                        .ok_or_else(|| invalid(concat!(stringify!($field), " is required")))?;
                    create(&r, $kind, &id, &($from)(&m))
                        .map(|(n, s)| Response::new(($to)(n, s, &m)))
                })
                .await
            }
            async fn $get(&self, req: Request<pb::$get_req>) -> Result<Response<pb::$msg>, Status> {
                let r = self.0.clone();
                let req = req.into_inner();
                blocking(move || {
                    get(&r, $kind, &req.name)
                        .map(|(n, s)| Response::new(($to)(n, s, &pb::$msg::default())))
                })
                .await
            }
            async fn $list(
                &self,
                req: Request<pb::$list_req>,
            ) -> Result<Response<pb::$list_resp>, Status> {
                let r = self.0.clone();
                let req = req.into_inner();
                blocking(move || {
                    let (items, next_page_token) = list(&r, $kind, req.page_size, &req.page_token)?;
                    Ok(Response::new(pb::$list_resp {
                        $items: items
                            .into_iter()
                            .map(|(n, s)| ($to)(n, s, &pb::$msg::default()))
                            .collect(),
                        next_page_token,
                    }))
                })
                .await
            }
            async fn $delete(&self, req: Request<pb::$delete_req>) -> Result<Response<()>, Status> {
                let r = self.0.clone();
                let req = req.into_inner();
                blocking(move || delete(&r, $kind, &req.name, req.allow_missing).map(Response::new))
                    .await
            }
            async fn $update(
                &self,
                req: Request<pb::$update_req>,
            ) -> Result<Response<pb::$msg>, Status> {
                let r = self.0.clone();
                let req = req.into_inner();
                blocking(move || {
                    let m = req
                        .$field
                        .ok_or_else(|| invalid(concat!(stringify!($field), " is required")))?;
                    update(
                        &r,
                        $kind,
                        &m.name,
                        &($from)(&m),
                        &req.update_mask,
                        req.allow_missing,
                    )
                    .map(|(n, s)| Response::new(($to)(n, s, &m)))
                })
                .await
            }
            async fn $stats(
                &self,
                req: Request<pb::$stats_req>,
            ) -> Result<Response<pb::$stats_resp>, Status> {
                let r = self.0.clone();
                let req = req.into_inner();
                blocking(move || {
                    stats(&r, $kind, &req.name)
                        .map(|s| Response::new(pb::$stats_resp { stats: Some(s) }))
                })
                .await
            }
        }
    };
}

/// The client-chosen id of a Create request.
trait CreateId {
    fn id(&self) -> String;
}
impl CreateId for pb::CreateNullVolumeRequest {
    fn id(&self) -> String {
        self.null_volume_id.clone()
    }
}
impl CreateId for pb::CreateMallocVolumeRequest {
    fn id(&self) -> String {
        self.malloc_volume_id.clone()
    }
}
impl CreateId for pb::CreateAioVolumeRequest {
    fn id(&self) -> String {
        self.aio_volume_id.clone()
    }
}
fn paste_id(r: &impl CreateId) -> String {
    r.id()
}

volume_service!(
    Null,
    pb::null_volume_service_server::NullVolumeService,
    NULL,
    NullVolume,
    null_volume,
    create_null_volume,
    CreateNullVolumeRequest,
    get_null_volume,
    GetNullVolumeRequest,
    list_null_volumes,
    ListNullVolumesRequest,
    ListNullVolumesResponse,
    null_volumes,
    delete_null_volume,
    DeleteNullVolumeRequest,
    update_null_volume,
    UpdateNullVolumeRequest,
    stats_null_volume,
    StatsNullVolumeRequest,
    StatsNullVolumeResponse,
    |name, s: Spec, _m: &pb::NullVolume| pb::NullVolume {
        name,
        block_size: s.block_size,
        blocks_count: s.blocks_count,
        uuid: s.uuid,
    },
    |m: &pb::NullVolume| Spec {
        block_size: m.block_size,
        blocks_count: m.blocks_count,
        uuid: m.uuid.clone(),
        filename: String::new(),
    }
);

volume_service!(
    Malloc,
    pb::malloc_volume_service_server::MallocVolumeService,
    MALLOC,
    MallocVolume,
    malloc_volume,
    create_malloc_volume,
    CreateMallocVolumeRequest,
    get_malloc_volume,
    GetMallocVolumeRequest,
    list_malloc_volumes,
    ListMallocVolumesRequest,
    ListMallocVolumesResponse,
    malloc_volumes,
    delete_malloc_volume,
    DeleteMallocVolumeRequest,
    update_malloc_volume,
    UpdateMallocVolumeRequest,
    stats_malloc_volume,
    StatsMallocVolumeRequest,
    StatsMallocVolumeResponse,
    |name, s: Spec, m: &pb::MallocVolume| pb::MallocVolume {
        name,
        block_size: s.block_size,
        blocks_count: s.blocks_count,
        metadata_size: m.metadata_size,
        uuid: s.uuid,
    },
    |m: &pb::MallocVolume| Spec {
        block_size: m.block_size,
        blocks_count: m.blocks_count,
        uuid: m.uuid.clone(),
        filename: String::new(),
    }
);

volume_service!(
    Aio,
    pb::aio_volume_service_server::AioVolumeService,
    AIO,
    AioVolume,
    aio_volume,
    create_aio_volume,
    CreateAioVolumeRequest,
    get_aio_volume,
    GetAioVolumeRequest,
    list_aio_volumes,
    ListAioVolumesRequest,
    ListAioVolumesResponse,
    aio_volumes,
    delete_aio_volume,
    DeleteAioVolumeRequest,
    update_aio_volume,
    UpdateAioVolumeRequest,
    stats_aio_volume,
    StatsAioVolumeRequest,
    StatsAioVolumeResponse,
    |name, s: Spec, _m: &pb::AioVolume| pb::AioVolume {
        name,
        block_size: s.block_size,
        blocks_count: s.blocks_count,
        uuid: s.uuid,
        filename: s.filename,
    },
    |m: &pb::AioVolume| Spec {
        block_size: m.block_size,
        blocks_count: m.blocks_count,
        uuid: m.uuid.clone(),
        filename: m.filename.clone(),
    }
);
