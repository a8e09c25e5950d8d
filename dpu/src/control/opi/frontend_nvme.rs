//! FrontendNvmeService: NVMe-oF subsystems, their namespaces, and their controllers — a
//! controller with a TCP or RDMA endpoint is a listener of the subsystem on that address; a
//! controller with a PCIe endpoint (`pcie_id`) is a PCIe NVMe controller served over
//! vfio-user (`frontend::nvme_pcie`), its socket `cntrl` in
//! `<run-dir>/vfio-user/<port>-<pf>-<vf>`, a directory made on Create and removed on Delete.
//!
//! Names bound in the registry: `nvmeSubsystems/s` → the NQN; `…/nvmeNamespaces/n` →
//! `NQN NSID`; `…/nvmeControllers/c` → `NQN tcp|rdma ADDR` or `NQN vfio-user DIR`. Objects
//! made through JSON-RPC have no binding and are listed under derived ids: the NQN, the
//! NSID, and `tcp-ADDR-PORT` / `rdma-ADDR-PORT` / `vfio-user-DIR` (`/` as `.`).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nacre_shared::api::nvmf::NvmfSubsystemCreate;
use tonic::{Request, Response, Status};

use super::pb::{self, frontend_nvme_service_server::FrontendNvmeService};
use super::{
    decode, encode, exists_differently, invalid, mask_paths, new_id, not_found, page, paginate,
    status, sum_stats, volume_ref, volume_stats,
};
use crate::control::registry::{ListenerTransport, Registry};
use crate::control::state::{NvmfSubsystemRecord, OpiBinding};
use crate::frontend::nvme_pcie::Signals;

const SUBSYSTEMS: &str = "nvmeSubsystems";

/// Under the run directory: one directory per PCIe endpoint, holding its vfio-user socket.
const VFIO_USER_DIR: &str = "vfio-user";

pub struct Service(pub Arc<Registry>);

/// A subsystem as OPI sees it.
struct Sub {
    name: String,
    spec: pb::NvmeSubsystemSpec,
    rec: NvmfSubsystemRecord,
}

/// A namespace as OPI sees it.
struct Ns {
    name: String,
    nqn: String,
    nsid: u32,
    volume: String,
    spec: pb::NvmeNamespaceSpec,
}

/// A controller (listener) as OPI sees it.
struct Ctrl {
    name: String,
    nqn: String,
    at: At,
    spec: pb::NvmeControllerSpec,
}

/// Where a controller listens: a fabric address, or a vfio-user directory (PCIe).
#[derive(Clone, PartialEq, Eq)]
enum At {
    Fabric(ListenerTransport, SocketAddr),
    VfioUser(PathBuf),
}

impl At {
    /// Whether `want` (a request's endpoint, port 0: any) names this listener.
    fn matches(&self, want: &At) -> bool {
        match (self, want) {
            (At::Fabric(t, a), At::Fabric(wt, w)) => {
                t == wt && a.ip() == w.ip() && (w.port() == 0 || w.port() == a.port())
            }
            (At::VfioUser(d), At::VfioUser(w)) => d == w,
            _ => false,
        }
    }
}

/// Remove a controller's listener from subsystem `nqn`.
fn remove_listener(r: &Registry, nqn: &str, at: &At) -> Result<(), crate::control::RpcError> {
    match at {
        At::Fabric(t, a) => r.remove_listener(nqn, *a, *t),
        At::VfioUser(d) => r.remove_vfio_user_listener(nqn, d),
    }
}

fn records(r: &Registry) -> BTreeMap<String, NvmfSubsystemRecord> {
    r.read_state(|s| s.nvmf.subsystems.clone())
}

/// Every subsystem: bound names first, then the NQNs of unbound ones.
fn subsystems(r: &Registry) -> Vec<Sub> {
    let mut recs = records(r);
    let mut out = Vec::new();
    for (name, b) in r.opi_bindings(&format!("{SUBSYSTEMS}/")) {
        if name.matches('/').count() != 1 {
            continue;
        }
        if let Some(rec) = recs.remove(&b.object) {
            out.push(Sub {
                name,
                spec: decode(&b.spec),
                rec,
            });
        }
    }
    out.extend(recs.into_values().map(|rec| Sub {
        name: format!("{SUBSYSTEMS}/{}", rec.nqn),
        spec: pb::NvmeSubsystemSpec {
            nqn: rec.nqn.clone(),
            serial_number: rec.serial.clone(),
            model_number: rec.model.clone(),
            ..Default::default()
        },
        rec,
    }));
    out
}

fn subsystem(r: &Registry, name: &str) -> Result<Sub, Status> {
    if name.is_empty() {
        return Err(invalid(
            "a subsystem name (nvmeSubsystems/{id}) is required",
        ));
    }
    if !name.starts_with("nvmeSubsystems/") || name.matches('/').count() != 1 {
        return Err(invalid(format!(
            "name {name:?} is not nvmeSubsystems/{{id}}"
        )));
    }
    subsystems(r)
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| not_found(name))
}

fn sub_to_pb(s: &Sub) -> pb::NvmeSubsystem {
    let mut spec = s.spec.clone();
    spec.psk.clear();
    pb::NvmeSubsystem {
        name: s.name.clone(),
        spec: Some(spec),
        status: Some(pb::NvmeSubsystemStatus {
            firmware_revision: env!("CARGO_PKG_VERSION").into(),
            fru_guid: Vec::new(),
        }),
    }
}

fn namespaces(r: &Registry, sub: &Sub) -> Vec<Ns> {
    let mut left = sub.rec.namespaces.clone();
    let mut out = Vec::new();
    for (name, b) in r.opi_bindings(&format!("{}/nvmeNamespaces/", sub.name)) {
        let Some((nqn, nsid)) = b.object.split_once(' ') else {
            continue;
        };
        let Ok(nsid) = nsid.parse::<u32>() else {
            continue;
        };
        if nqn != sub.rec.nqn {
            continue;
        }
        if let Some(volume) = left.remove(&nsid) {
            let mut spec: pb::NvmeNamespaceSpec = decode(&b.spec);
            spec.host_nsid = nsid as i32;
            out.push(Ns {
                name,
                nqn: nqn.to_string(),
                nsid,
                volume,
                spec,
            });
        }
    }
    out.extend(left.into_iter().map(|(nsid, volume)| Ns {
        name: format!("{}/nvmeNamespaces/{nsid}", sub.name),
        nqn: sub.rec.nqn.clone(),
        nsid,
        spec: pb::NvmeNamespaceSpec {
            host_nsid: nsid as i32,
            volume_name_ref: volume.clone(),
            ..Default::default()
        },
        volume,
    }));
    out
}

fn ns_to_pb(n: &Ns) -> pb::NvmeNamespace {
    use pb::nvme_namespace_status::{OperState, State};
    pb::NvmeNamespace {
        name: n.name.clone(),
        spec: Some(n.spec.clone()),
        status: Some(pb::NvmeNamespaceStatus {
            state: State::Enabled as i32,
            oper_state: OperState::Online as i32,
        }),
    }
}

fn listener_key(at: &At) -> String {
    match at {
        At::Fabric(ListenerTransport::Tcp, a) => format!("tcp {a}"),
        At::Fabric(ListenerTransport::Rdma, a) => format!("rdma {a}"),
        At::Fabric(ListenerTransport::Tls, a) => format!("tls {a}"),
        At::VfioUser(d) => format!("vfio-user {}", d.display()),
    }
}

fn controllers(r: &Registry, sub: &Sub) -> Vec<Ctrl> {
    let mut left: BTreeMap<String, At> = sub
        .rec
        .listeners
        .iter()
        .map(|a| At::Fabric(ListenerTransport::Tcp, *a))
        .chain(
            sub.rec
                .rdma_listeners
                .iter()
                .map(|a| At::Fabric(ListenerTransport::Rdma, *a)),
        )
        .chain(
            sub.rec
                .vfio_user_listeners
                .iter()
                .cloned()
                .map(At::VfioUser),
        )
        .map(|at| (listener_key(&at), at))
        .collect();
    let mut out = Vec::new();
    for (name, b) in r.opi_bindings(&format!("{}/nvmeControllers/", sub.name)) {
        let Some((nqn, key)) = b.object.split_once(' ') else {
            continue;
        };
        if nqn != sub.rec.nqn {
            continue;
        }
        if let Some(at) = left.remove(key) {
            out.push(Ctrl {
                name,
                nqn: nqn.to_string(),
                at,
                spec: decode(&b.spec),
            });
        }
    }
    out.extend(left.into_values().map(|at| {
        let (id, spec) = match &at {
            At::Fabric(transport, addr) => {
                let (t, prefix) = match transport {
                    ListenerTransport::Tcp => (pb::NvmeTransportType::Tcp, "tcp"),
                    ListenerTransport::Rdma => (pb::NvmeTransportType::Rdma, "rdma"),
                    ListenerTransport::Tls => (pb::NvmeTransportType::Tcp, "tls"),
                };
                let id = format!(
                    "{prefix}-{}-{}",
                    addr.ip().to_string().replace(':', "."),
                    addr.port()
                );
                let spec = pb::NvmeControllerSpec {
                    trtype: t as i32,
                    endpoint: Some(pb::nvme_controller_spec::Endpoint::FabricsId(fabrics_of(
                        addr,
                    ))),
                    ..Default::default()
                };
                (id, spec)
            }
            At::VfioUser(d) => {
                let id = format!(
                    "vfio-user-{}",
                    d.display().to_string().trim_matches('/').replace('/', ".")
                );
                let spec = pb::NvmeControllerSpec {
                    trtype: pb::NvmeTransportType::Pcie as i32,
                    ..Default::default()
                };
                (id, spec)
            }
        };
        Ctrl {
            name: format!("{}/nvmeControllers/{id}", sub.name),
            nqn: sub.rec.nqn.clone(),
            at,
            spec,
        }
    }));
    out
}

fn fabrics_of(a: &SocketAddr) -> pb::FabricsEndpoint {
    pb::FabricsEndpoint {
        traddr: a.ip().to_string(),
        trsvcid: a.port().to_string(),
        adrfam: if a.is_ipv4() {
            pb::NvmeAddressFamily::Ipv4
        } else {
            pb::NvmeAddressFamily::Ipv6
        } as i32,
    }
}

fn ctrl_to_pb(c: &Ctrl, active: bool) -> pb::NvmeController {
    pb::NvmeController {
        name: c.name.clone(),
        spec: Some(c.spec.clone()),
        status: Some(pb::NvmeControllerStatus { active }),
    }
}

/// The parent and child of `nvmeSubsystems/{s}/{children}/{c}`.
fn split_child<'a>(name: &'a str, children: &str) -> Result<(&'a str, &'a str), Status> {
    let bad = || {
        invalid(format!(
            "name {name:?} is not nvmeSubsystems/{{id}}/{children}/{{id}}"
        ))
    };
    let marker = format!("/{children}/");
    let (parent, child) = name.split_once(&marker).ok_or_else(bad)?;
    if !parent.starts_with("nvmeSubsystems/") || child.is_empty() || child.contains('/') {
        return Err(bad());
    }
    Ok((parent, child))
}

fn bind_or_undo(
    r: &Registry,
    name: &str,
    b: OpiBinding,
    undo: impl FnOnce(),
) -> Result<(), Status> {
    r.bind_opi(name, b).map_err(|e| {
        undo();
        status(e)
    })
}

fn create_subsystem(
    r: &Registry,
    id: &str,
    m: &pb::NvmeSubsystem,
) -> Result<pb::NvmeSubsystem, Status> {
    let id = new_id(id)?;
    let name = format!("{SUBSYSTEMS}/{id}");
    let spec = m
        .spec
        .clone()
        .ok_or_else(|| invalid("nvme_subsystem.spec is required"))?;
    if spec.nqn.is_empty() {
        return Err(invalid("spec.nqn is required"));
    }
    if !spec.psk.is_empty() {
        return Err(invalid(
            "spec.psk: NVMe/TCP TLS is not supported by nacre's target",
        ));
    }
    let all = subsystems(r);
    if let Some(s) = all.iter().find(|s| s.name == name) {
        return if encode(&s.spec) == encode(&spec) {
            Ok(sub_to_pb(s))
        } else {
            Err(exists_differently(&name))
        };
    }
    if let Some(s) = all.iter().find(|s| s.rec.nqn == spec.nqn) {
        return Err(Status::already_exists(format!(
            "subsystem {} already exists as {}",
            spec.nqn, s.name
        )));
    }
    let nonempty = |s: &str| (!s.is_empty()).then(|| s.to_string());
    r.create_subsystem(&NvmfSubsystemCreate {
        nqn: spec.nqn.clone(),
        serial: nonempty(&spec.serial_number),
        model: nonempty(&spec.model_number),
        allow_any_host: spec.hostnqn.is_empty(),
    })
    .map_err(status)?;
    let undo = || {
        let _ = r.delete_subsystem(&spec.nqn);
    };
    if !spec.hostnqn.is_empty() {
        if let Err(e) = r.add_host(&spec.nqn, &spec.hostnqn) {
            undo();
            return Err(status(e));
        }
    }
    bind_or_undo(
        r,
        &name,
        OpiBinding {
            object: spec.nqn.clone(),
            spec: encode(&spec),
        },
        undo,
    )?;
    subsystem(r, &name).map(|s| sub_to_pb(&s))
}

fn create_namespace(
    r: &Registry,
    parent: &str,
    id: &str,
    m: &pb::NvmeNamespace,
) -> Result<pb::NvmeNamespace, Status> {
    let sub = subsystem(r, parent)?;
    let id = new_id(id)?;
    let name = format!("{parent}/nvmeNamespaces/{id}");
    let mut spec = m
        .spec
        .clone()
        .ok_or_else(|| invalid("nvme_namespace.spec is required"))?;
    let volume = volume_ref(r, &spec.volume_name_ref)?;
    if spec.host_nsid < 0 {
        return Err(invalid(format!(
            "host_nsid must not be negative (got {})",
            spec.host_nsid
        )));
    }
    if let Some(n) = namespaces(r, &sub).into_iter().find(|n| n.name == name) {
        let same = n.volume == volume && (spec.host_nsid == 0 || spec.host_nsid as u32 == n.nsid);
        return if same {
            Ok(ns_to_pb(&n))
        } else {
            Err(exists_differently(&name))
        };
    }
    let want = (spec.host_nsid > 0).then_some(spec.host_nsid as u32);
    let nsid = r
        .add_namespace(&sub.rec.nqn, &volume, want)
        .map_err(status)?;
    spec.host_nsid = nsid as i32;
    let nqn = sub.rec.nqn.clone();
    bind_or_undo(
        r,
        &name,
        OpiBinding {
            object: format!("{nqn} {nsid}"),
            spec: encode(&spec),
        },
        || {
            let _ = r.remove_namespace(&nqn, nsid);
        },
    )?;
    let sub = subsystem(r, parent)?;
    namespaces(r, &sub)
        .into_iter()
        .find(|n| n.name == name)
        .map(|n| ns_to_pb(&n))
        .ok_or_else(|| not_found(&name))
}

/// A controller's listener: its transport and address (port 0: any free port), or for a
/// PCIe endpoint its vfio-user directory `<run_dir>/vfio-user/<port>-<pf>-<vf>`.
fn endpoint(spec: &pb::NvmeControllerSpec, run_dir: &Path) -> Result<At, Status> {
    use pb::nvme_controller_spec::Endpoint;
    let pcie = spec.trtype == pb::NvmeTransportType::Pcie as i32;
    if let Some(Endpoint::PcieId(p)) = &spec.endpoint {
        if !pcie && spec.trtype != pb::NvmeTransportType::Unspecified as i32 {
            return Err(invalid(format!(
                "trtype {} does not go with spec.pcie_id: use NVME_TRANSPORT_TYPE_PCIE",
                spec.trtype
            )));
        }
        let field = |v: Option<i32>, what: &str| {
            let v = v.unwrap_or(0);
            u32::try_from(v).map_err(|_| invalid(format!("pcie_id.{what} {v} is negative")))
        };
        let port = field(p.port_id, "port_id")?;
        let pf = field(p.physical_function, "physical_function")?;
        let vf = field(p.virtual_function, "virtual_function")?;
        return Ok(At::VfioUser(
            run_dir
                .join(VFIO_USER_DIR)
                .join(format!("{port}-{pf}-{vf}")),
        ));
    }
    if pcie {
        return Err(invalid("spec.pcie_id is required for PCIe controllers"));
    }
    let transport = match pb::NvmeTransportType::try_from(spec.trtype) {
        Ok(pb::NvmeTransportType::Tcp) => ListenerTransport::Tcp,
        Ok(pb::NvmeTransportType::Rdma) => ListenerTransport::Rdma,
        _ => {
            return Err(invalid(format!(
                "trtype {} is not one nacre serves: use NVME_TRANSPORT_TYPE_TCP or _RDMA",
                spec.trtype
            )))
        }
    };
    let Some(Endpoint::FabricsId(f)) = &spec.endpoint else {
        return Err(invalid(
            "spec.fabrics_id is required for TCP and RDMA controllers",
        ));
    };
    let ip: IpAddr = f
        .traddr
        .parse()
        .map_err(|_| invalid(format!("traddr {:?} is not an IP address", f.traddr)))?;
    let port: u16 = if f.trsvcid.is_empty() {
        4420
    } else {
        f.trsvcid
            .parse()
            .map_err(|_| invalid(format!("trsvcid {:?} is not a port", f.trsvcid)))?
    };
    Ok(At::Fabric(transport, SocketAddr::new(ip, port)))
}

fn create_controller(
    r: &Registry,
    parent: &str,
    id: &str,
    m: &pb::NvmeController,
) -> Result<pb::NvmeController, Status> {
    let sub = subsystem(r, parent)?;
    let id = new_id(id)?;
    let name = format!("{parent}/nvmeControllers/{id}");
    let mut spec = m
        .spec
        .clone()
        .ok_or_else(|| invalid("nvme_controller.spec is required"))?;
    let want = endpoint(&spec, r.run_dir())?;
    if let Some(c) = controllers(r, &sub).into_iter().find(|c| c.name == name) {
        return if c.at.matches(&want) {
            Ok(ctrl_to_pb(&c, sub.rec.namespaces.is_empty()))
        } else {
            Err(exists_differently(&name))
        };
    }
    let nqn = sub.rec.nqn.clone();
    let bound = match want {
        At::Fabric(transport, addr) => {
            let bound = r.add_listener(&nqn, addr, transport).map_err(status)?;
            spec.endpoint = Some(pb::nvme_controller_spec::Endpoint::FabricsId(fabrics_of(
                &bound,
            )));
            At::Fabric(transport, bound)
        }
        At::VfioUser(dir) => {
            let owner = records(r)
                .into_values()
                .find(|s| s.vfio_user_listeners.contains(&dir));
            if let Some(owner) = owner {
                return Err(Status::already_exists(format!(
                    "the PCIe endpoint {} is already a controller of {}",
                    dir.display(),
                    owner.nqn
                )));
            }
            std::fs::create_dir_all(&dir)
                .map_err(|e| Status::unavailable(format!("cannot make {}: {e}", dir.display())))?;
            if let Err(e) = r.add_vfio_user_listener(&nqn, &dir, Signals::Msix) {
                let _ = std::fs::remove_dir(&dir);
                return Err(status(e));
            }
            At::VfioUser(dir)
        }
    };
    bind_or_undo(
        r,
        &name,
        OpiBinding {
            object: format!("{nqn} {}", listener_key(&bound)),
            spec: encode(&spec),
        },
        || {
            let _ = remove_listener(r, &nqn, &bound);
        },
    )?;
    Ok(pb::NvmeController {
        name,
        spec: Some(spec),
        status: Some(pb::NvmeControllerStatus { active: false }),
    })
}

/// Whether a host is connected to the subsystem.
fn active(r: &Registry, nqn: &str) -> bool {
    r.subsystems()
        .iter()
        .any(|s| s.info.nqn == nqn && s.info.controllers > 0)
}

fn no_change(paths: Vec<String>, name: &str, differs: impl Fn(&str) -> bool) -> Result<(), Status> {
    for p in paths {
        if differs(&p) {
            return Err(invalid(format!(
                "{p} of {name} cannot change while it exists: delete and create it"
            )));
        }
    }
    Ok(())
}

#[tonic::async_trait]
impl FrontendNvmeService for Service {
    async fn create_nvme_subsystem(
        &self,
        req: Request<pb::CreateNvmeSubsystemRequest>,
    ) -> Result<Response<pb::NvmeSubsystem>, Status> {
        run!(self, req, |r, q| {
            let m = q
                .nvme_subsystem
                .ok_or_else(|| invalid("nvme_subsystem is required"))?;
            create_subsystem(&r, &q.nvme_subsystem_id, &m).map(Response::new)
        })
    }

    async fn delete_nvme_subsystem(
        &self,
        req: Request<pb::DeleteNvmeSubsystemRequest>,
    ) -> Result<Response<()>, Status> {
        run!(self, req, |r, q| {
            let sub = match subsystem(&r, &q.name) {
                Err(e) if e.code() == tonic::Code::NotFound && q.allow_missing => {
                    return Ok(Response::new(()))
                }
                s => s?,
            };
            if !sub.rec.namespaces.is_empty()
                || !sub.rec.listeners.is_empty()
                || !sub.rec.rdma_listeners.is_empty()
            {
                return Err(Status::failed_precondition(format!(
                    "{} still has namespaces or controllers: delete them first",
                    q.name
                )));
            }
            r.delete_subsystem(&sub.rec.nqn).map_err(status)?;
            r.unbind_opi(&q.name).map_err(status)?;
            Ok(Response::new(()))
        })
    }

    async fn update_nvme_subsystem(
        &self,
        req: Request<pb::UpdateNvmeSubsystemRequest>,
    ) -> Result<Response<pb::NvmeSubsystem>, Status> {
        run!(self, req, |r, q| {
            let m = q
                .nvme_subsystem
                .ok_or_else(|| invalid("nvme_subsystem is required"))?;
            let sub = match subsystem(&r, &m.name) {
                Err(e) if e.code() == tonic::Code::NotFound && q.allow_missing => {
                    let id = m.name.trim_start_matches("nvmeSubsystems/").to_string();
                    return create_subsystem(&r, &id, &m).map(Response::new);
                }
                s => s?,
            };
            let want = m.spec.clone().unwrap_or_default();
            let paths = mask_paths(
                &q.update_mask,
                &[
                    "spec.nqn",
                    "spec.serial_number",
                    "spec.model_number",
                    "spec.max_namespaces",
                    "spec.hostnqn",
                    "spec.psk",
                ],
            )?;
            let have = &sub.spec;
            let host_changes =
                paths.iter().any(|p| p == "spec.hostnqn") && want.hostnqn != have.hostnqn;
            no_change(paths, &m.name, |p| match p {
                "spec.nqn" => want.nqn != have.nqn,
                "spec.serial_number" => {
                    !want.serial_number.is_empty() && want.serial_number != sub.rec.serial
                }
                "spec.model_number" => {
                    !want.model_number.is_empty() && want.model_number != sub.rec.model
                }
                "spec.psk" => !want.psk.is_empty(),
                _ => false,
            })?;
            if host_changes {
                // The allowed host: one host NQN, or any host when empty.
                let nqn = &sub.rec.nqn;
                if !have.hostnqn.is_empty() {
                    r.remove_host(nqn, &have.hostnqn).map_err(status)?;
                }
                if !want.hostnqn.is_empty() {
                    r.add_host(nqn, &want.hostnqn).map_err(status)?;
                }
                r.set_allow_any_host(nqn, want.hostnqn.is_empty())
                    .map_err(status)?;
                let mut spec = have.clone();
                spec.hostnqn = want.hostnqn.clone();
                r.bind_opi(
                    &m.name,
                    OpiBinding {
                        object: nqn.clone(),
                        spec: encode(&spec),
                    },
                )
                .map_err(status)?;
            }
            subsystem(&r, &m.name).map(|s| Response::new(sub_to_pb(&s)))
        })
    }

    async fn list_nvme_subsystems(
        &self,
        req: Request<pb::ListNvmeSubsystemsRequest>,
    ) -> Result<Response<pb::ListNvmeSubsystemsResponse>, Status> {
        run!(self, req, |r, q| {
            let p = page(q.page_size, &q.page_token)?;
            let all = subsystems(&r)
                .iter()
                .map(|s| (s.name.clone(), sub_to_pb(s)))
                .collect();
            let (nvme_subsystems, next_page_token) = paginate(all, &p);
            Ok(Response::new(pb::ListNvmeSubsystemsResponse {
                nvme_subsystems,
                next_page_token,
            }))
        })
    }

    async fn get_nvme_subsystem(
        &self,
        req: Request<pb::GetNvmeSubsystemRequest>,
    ) -> Result<Response<pb::NvmeSubsystem>, Status> {
        run!(self, req, |r, q| subsystem(&r, &q.name)
            .map(|s| Response::new(sub_to_pb(&s))))
    }

    async fn stats_nvme_subsystem(
        &self,
        req: Request<pb::StatsNvmeSubsystemRequest>,
    ) -> Result<Response<pb::StatsNvmeSubsystemResponse>, Status> {
        run!(self, req, |r, q| {
            let sub = subsystem(&r, &q.name)?;
            let all = sub
                .rec
                .namespaces
                .values()
                .map(|v| volume_stats(&r, v))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Response::new(pb::StatsNvmeSubsystemResponse {
                stats: Some(sum_stats(&all)),
            }))
        })
    }

    async fn create_nvme_controller(
        &self,
        req: Request<pb::CreateNvmeControllerRequest>,
    ) -> Result<Response<pb::NvmeController>, Status> {
        run!(self, req, |r, q| {
            let m = q
                .nvme_controller
                .ok_or_else(|| invalid("nvme_controller is required"))?;
            create_controller(&r, &q.parent, &q.nvme_controller_id, &m).map(Response::new)
        })
    }

    async fn delete_nvme_controller(
        &self,
        req: Request<pb::DeleteNvmeControllerRequest>,
    ) -> Result<Response<()>, Status> {
        run!(self, req, |r, q| {
            let (parent, _) = split_child(&q.name, "nvmeControllers")?;
            let found = subsystem(&r, parent)
                .ok()
                .and_then(|s| controllers(&r, &s).into_iter().find(|c| c.name == q.name));
            let Some(c) = found else {
                return if q.allow_missing {
                    Ok(Response::new(()))
                } else {
                    Err(not_found(&q.name))
                };
            };
            remove_listener(&r, &c.nqn, &c.at).map_err(status)?;
            r.unbind_opi(&q.name).map_err(status)?;
            if let At::VfioUser(d) = &c.at {
                // Only the directory this module made, and only when empty.
                if d.parent() == Some(&r.run_dir().join(VFIO_USER_DIR)) {
                    let _ = std::fs::remove_dir(d);
                }
            }
            Ok(Response::new(()))
        })
    }

    async fn update_nvme_controller(
        &self,
        req: Request<pb::UpdateNvmeControllerRequest>,
    ) -> Result<Response<pb::NvmeController>, Status> {
        run!(self, req, |r, q| {
            let m = q
                .nvme_controller
                .ok_or_else(|| invalid("nvme_controller is required"))?;
            let (parent, child) = split_child(&m.name, "nvmeControllers")?;
            let sub = subsystem(&r, parent)?;
            let Some(c) = controllers(&r, &sub).into_iter().find(|c| c.name == m.name) else {
                return if q.allow_missing {
                    create_controller(&r, parent, child, &m).map(Response::new)
                } else {
                    Err(not_found(&m.name))
                };
            };
            let want = m.spec.clone().unwrap_or_default();
            let paths = mask_paths(&q.update_mask, &["spec"])?;
            if !paths.is_empty() {
                let at = endpoint(&want, r.run_dir())?;
                no_change(paths, &m.name, |_| !c.at.matches(&at))?;
            }
            Ok(Response::new(ctrl_to_pb(&c, active(&r, &c.nqn))))
        })
    }

    async fn list_nvme_controllers(
        &self,
        req: Request<pb::ListNvmeControllersRequest>,
    ) -> Result<Response<pb::ListNvmeControllersResponse>, Status> {
        run!(self, req, |r, q| {
            let p = page(q.page_size, &q.page_token)?;
            let sub = subsystem(&r, &q.parent)?;
            let on = active(&r, &sub.rec.nqn);
            let all = controllers(&r, &sub)
                .iter()
                .map(|c| (c.name.clone(), ctrl_to_pb(c, on)))
                .collect();
            let (nvme_controllers, next_page_token) = paginate(all, &p);
            Ok(Response::new(pb::ListNvmeControllersResponse {
                nvme_controllers,
                next_page_token,
            }))
        })
    }

    async fn get_nvme_controller(
        &self,
        req: Request<pb::GetNvmeControllerRequest>,
    ) -> Result<Response<pb::NvmeController>, Status> {
        run!(self, req, |r, q| {
            let (parent, _) = split_child(&q.name, "nvmeControllers")?;
            let sub = subsystem(&r, parent)?;
            let c = controllers(&r, &sub)
                .into_iter()
                .find(|c| c.name == q.name)
                .ok_or_else(|| not_found(&q.name))?;
            Ok(Response::new(ctrl_to_pb(&c, active(&r, &c.nqn))))
        })
    }

    async fn stats_nvme_controller(
        &self,
        req: Request<pb::StatsNvmeControllerRequest>,
    ) -> Result<Response<pb::StatsNvmeControllerResponse>, Status> {
        run!(self, req, |r, q| {
            let (parent, _) = split_child(&q.name, "nvmeControllers")?;
            let sub = subsystem(&r, parent)?;
            controllers(&r, &sub)
                .into_iter()
                .find(|c| c.name == q.name)
                .ok_or_else(|| not_found(&q.name))?;
            // Counted per volume, not per listener: the subsystem's namespaces.
            let all = sub
                .rec
                .namespaces
                .values()
                .map(|v| volume_stats(&r, v))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Response::new(pb::StatsNvmeControllerResponse {
                stats: Some(sum_stats(&all)),
            }))
        })
    }

    async fn create_nvme_namespace(
        &self,
        req: Request<pb::CreateNvmeNamespaceRequest>,
    ) -> Result<Response<pb::NvmeNamespace>, Status> {
        run!(self, req, |r, q| {
            let m = q
                .nvme_namespace
                .ok_or_else(|| invalid("nvme_namespace is required"))?;
            create_namespace(&r, &q.parent, &q.nvme_namespace_id, &m).map(Response::new)
        })
    }

    async fn delete_nvme_namespace(
        &self,
        req: Request<pb::DeleteNvmeNamespaceRequest>,
    ) -> Result<Response<()>, Status> {
        run!(self, req, |r, q| {
            let (parent, _) = split_child(&q.name, "nvmeNamespaces")?;
            let found = subsystem(&r, parent)
                .ok()
                .and_then(|s| namespaces(&r, &s).into_iter().find(|n| n.name == q.name));
            let Some(n) = found else {
                return if q.allow_missing {
                    Ok(Response::new(()))
                } else {
                    Err(not_found(&q.name))
                };
            };
            r.remove_namespace(&n.nqn, n.nsid).map_err(status)?;
            r.unbind_opi(&q.name).map_err(status)?;
            Ok(Response::new(()))
        })
    }

    async fn update_nvme_namespace(
        &self,
        req: Request<pb::UpdateNvmeNamespaceRequest>,
    ) -> Result<Response<pb::NvmeNamespace>, Status> {
        run!(self, req, |r, q| {
            let m = q
                .nvme_namespace
                .ok_or_else(|| invalid("nvme_namespace is required"))?;
            let (parent, child) = split_child(&m.name, "nvmeNamespaces")?;
            let sub = subsystem(&r, parent)?;
            let Some(n) = namespaces(&r, &sub).into_iter().find(|n| n.name == m.name) else {
                return if q.allow_missing {
                    create_namespace(&r, parent, child, &m).map(Response::new)
                } else {
                    Err(not_found(&m.name))
                };
            };
            let want = m.spec.clone().unwrap_or_default();
            let paths = mask_paths(
                &q.update_mask,
                &[
                    "spec.host_nsid",
                    "spec.volume_name_ref",
                    "spec.nguid",
                    "spec.eui64",
                    "spec.uuid",
                ],
            )?;
            let vol = if want.volume_name_ref.is_empty() {
                n.volume.clone()
            } else {
                volume_ref(&r, &want.volume_name_ref)?
            };
            no_change(paths, &m.name, |p| match p {
                "spec.host_nsid" => want.host_nsid != 0 && want.host_nsid as u32 != n.nsid,
                "spec.volume_name_ref" => vol != n.volume,
                _ => false,
            })?;
            Ok(Response::new(ns_to_pb(&n)))
        })
    }

    async fn list_nvme_namespaces(
        &self,
        req: Request<pb::ListNvmeNamespacesRequest>,
    ) -> Result<Response<pb::ListNvmeNamespacesResponse>, Status> {
        run!(self, req, |r, q| {
            let p = page(q.page_size, &q.page_token)?;
            let sub = subsystem(&r, &q.parent)?;
            let all = namespaces(&r, &sub)
                .iter()
                .map(|n| (n.name.clone(), ns_to_pb(n)))
                .collect();
            let (nvme_namespaces, next_page_token) = paginate(all, &p);
            Ok(Response::new(pb::ListNvmeNamespacesResponse {
                nvme_namespaces,
                next_page_token,
            }))
        })
    }

    async fn get_nvme_namespace(
        &self,
        req: Request<pb::GetNvmeNamespaceRequest>,
    ) -> Result<Response<pb::NvmeNamespace>, Status> {
        run!(self, req, |r, q| {
            let (parent, _) = split_child(&q.name, "nvmeNamespaces")?;
            let sub = subsystem(&r, parent)?;
            namespaces(&r, &sub)
                .into_iter()
                .find(|n| n.name == q.name)
                .map(|n| Response::new(ns_to_pb(&n)))
                .ok_or_else(|| not_found(&q.name))
        })
    }

    async fn stats_nvme_namespace(
        &self,
        req: Request<pb::StatsNvmeNamespaceRequest>,
    ) -> Result<Response<pb::StatsNvmeNamespaceResponse>, Status> {
        run!(self, req, |r, q| {
            let (parent, _) = split_child(&q.name, "nvmeNamespaces")?;
            let sub = subsystem(&r, parent)?;
            let n = namespaces(&r, &sub)
                .into_iter()
                .find(|n| n.name == q.name)
                .ok_or_else(|| not_found(&q.name))?;
            Ok(Response::new(pb::StatsNvmeNamespaceResponse {
                stats: Some(volume_stats(&r, &n.volume)?),
            }))
        })
    }
}
