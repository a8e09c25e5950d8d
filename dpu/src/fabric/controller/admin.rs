//! Bringing a controller up with admin commands.
//!
//! ## Bringing a controller up (NVMe-oF 1.1 §3.3, NVMe Base 2.0 §3.5.1)
//! Admin queue Connect (dynamic controller, KATO) → DH-HMAC-CHAP when the controller asks
//! or a controller key is configured (`super::auth`) → Property Get CAP → Property Set CC
//! (EN, 64-byte SQEs, 16-byte CQEs) → poll CSTS.RDY within CAP.TO → Identify Controller →
//! Set Features Number of Queues → Identify active namespace list, each namespace and its
//! identification descriptors (NGUID/UUID/EUI-64) → Connect each I/O queue with the CNTLID
//! (and authenticate it like the admin queue).
//!

use std::time::{Duration, Instant};

use nacre_shared::nvme::fabrics::Property;
use nacre_shared::nvme::features::{self, fid, SetFeatures};
use nacre_shared::nvme::identify::{
    self, cns, nidt, Identify, IdentifyController, IdentifyNamespace,
};
use nacre_shared::nvme::registers::{self, cc, csts};
use nacre_shared::nvme::{admin_opcode, get_u16, Command, Completion as Cqe};
use tracing::warn;

use super::{ControllerConfig, ControllerInfo, NamespaceInfo, MAX_TRANSFER};
use crate::fabric::cmd::{AdminWait, Cmd, Dir, Target};
use crate::fabric::queue::FabricQueue;
use crate::fabric::FabricError;

pub(super) fn queue_entry_sizes() -> u32 {
    cc::IOSQES_64 << cc::IOSQES_SHIFT | cc::IOCQES_16 << cc::IOCQES_SHIFT
}

/// Send one admin command and wait for it until `deadline`.
pub(crate) fn admin_cmd(
    q: &dyn FabricQueue,
    sqe: Command,
    dir: Dir,
    buf: Vec<u8>,
    deadline: Instant,
) -> Result<(Cqe, Vec<u8>), FabricError> {
    let len = buf.len();
    let w = AdminWait::with_buf(buf);
    let op = sqe.opcode;
    q.submit(Cmd {
        sqe,
        dir,
        len,
        target: Target::Admin(w.clone()),
        release: true,
    })
    .map_err(|_| FabricError::Connect("admin queue closed".into()))?;
    match w.wait_until(deadline) {
        Some(Ok(cqe)) => {
            let data = std::mem::take(&mut *w.buf.lock().unwrap_or_else(|p| p.into_inner()));
            if cqe.status().is_success() {
                Ok((cqe, data))
            } else {
                Err(FabricError::Status(op, cqe.status()))
            }
        }
        Some(Err(e)) => Err(FabricError::Connect(format!(
            "admin command {op:#04x}: {e}"
        ))),
        None => {
            q.shutdown();
            Err(FabricError::Timeout(format!("admin command {op:#04x}")))
        }
    }
}

pub(crate) fn property_get(
    q: &dyn FabricQueue,
    off: u32,
    eight: bool,
    deadline: Instant,
) -> Result<u64, FabricError> {
    let (cqe, _) = admin_cmd(
        q,
        Property::get_command(0, off, eight),
        Dir::None,
        Vec::new(),
        deadline,
    )?;
    Ok(if eight {
        cqe.dw0 as u64 | (cqe.dw1 as u64) << 32
    } else {
        cqe.dw0 as u64
    })
}

pub(crate) fn property_set(
    q: &dyn FabricQueue,
    off: u32,
    v: u32,
    deadline: Instant,
) -> Result<(), FabricError> {
    admin_cmd(
        q,
        Property::set_command(0, off, false, v as u64),
        Dir::None,
        Vec::new(),
        deadline,
    )
    .map(|_| ())
}

/// Enable the controller (CC.EN, wait CSTS.RDY).
pub(crate) fn enable(q: &dyn FabricQueue, deadline: Instant) -> Result<u16, FabricError> {
    let cap = property_get(q, registers::CAP, true, deadline)?;
    let mqes = registers::cap_mqes(cap);
    let to = Duration::from_millis(500 * ((cap >> 24) & 0xFF).max(1));
    property_set(q, registers::CC, cc::EN | queue_entry_sizes(), deadline)?;
    let rdy_deadline = deadline.min(Instant::now() + to);
    loop {
        let s = property_get(q, registers::CSTS, false, deadline)? as u32;
        if s & csts::CFS != 0 {
            return Err(FabricError::Failed(
                "controller reports fatal status (CSTS.CFS)".into(),
            ));
        }
        if s & csts::RDY != 0 {
            return Ok(mqes);
        }
        if Instant::now() >= rdy_deadline {
            return Err(FabricError::Timeout("CSTS.RDY after CC.EN".into()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub(crate) fn identify(
    q: &dyn FabricQueue,
    cns_v: u8,
    nsid: u32,
    deadline: Instant,
) -> Result<Vec<u8>, FabricError> {
    let mut sqe = Command {
        opcode: admin_opcode::IDENTIFY,
        nsid,
        ..Default::default()
    };
    Identify {
        cns: cns_v,
        ..Default::default()
    }
    .apply(&mut sqe);
    admin_cmd(
        q,
        sqe,
        Dir::C2H,
        vec![0u8; identify::IDENTIFY_LEN],
        deadline,
    )
    .map(|r| r.1)
}

/// Enable, Identify Controller and every active namespace. Returns the info and CAP.MQES.
pub(super) fn bring_up(
    q: &dyn FabricQueue,
    cfg: &ControllerConfig,
    deadline: Instant,
) -> Result<(ControllerInfo, u16), FabricError> {
    let mqes = enable(q, deadline)?;
    let raw = identify(q, cns::CONTROLLER, 0, deadline)?;
    let id = IdentifyController::decode(&raw);
    if id.cntrltype == identify::cntrltype::DISCOVERY {
        return Err(FabricError::Refused(format!(
            "{} is a discovery controller, not an I/O controller",
            cfg.subnqn
        )));
    }
    if !id.subnqn.is_empty() && id.subnqn != cfg.subnqn {
        return Err(FabricError::Refused(format!(
            "controller reports subsystem {:?}, expected {:?}",
            id.subnqn, cfg.subnqn
        )));
    }
    // MDTS is a power of two in units of the minimum page size (4 KiB; 0 = no limit).
    let max_transfer = if id.mdts == 0 || id.mdts >= 20 {
        MAX_TRANSFER
    } else {
        (4096usize << id.mdts).min(MAX_TRANSFER)
    };
    let cqt_ms = get_u16(&raw, 386);
    let list = if id.nn > 0 {
        identify::decode_ns_list(&identify(q, cns::ACTIVE_NS_LIST, 0, deadline)?)
    } else {
        Vec::new()
    };
    let mut namespaces = Vec::new();
    for nsid in list {
        let ns = IdentifyNamespace::decode(&identify(q, cns::NAMESPACE, nsid, deadline)?);
        // A broken controller must not make nacre compute an impossible size.
        if ns.nsze == 0
            || !(9..=16).contains(&ns.lbads)
            || ns.nsze.checked_mul(1u64 << ns.lbads).is_none()
        {
            warn!(
                nsid,
                lbads = ns.lbads,
                nsze = ns.nsze,
                "skipping namespace with no size, an impossible size or an unsupported block size"
            );
            continue;
        }
        let mut info = NamespaceInfo {
            nsid,
            block_size: 1 << ns.lbads,
            blocks: ns.nsze,
            nguid: (ns.nguid != [0; 16]).then_some(ns.nguid),
            uuid: None,
            eui64: (ns.eui64 != [0; 8]).then_some(ns.eui64),
        };
        // Descriptors are optional before NVMe 1.3; their absence is not an error.
        if let Ok(d) = identify(q, cns::NS_DESCRIPTOR_LIST, nsid, deadline) {
            for desc in identify::decode_ns_descriptors(&d) {
                match (desc.nidt, desc.nid.len()) {
                    (nidt::NGUID, 16) => info.nguid = desc.nid.try_into().ok(),
                    (nidt::UUID, 16) => info.uuid = desc.nid.try_into().ok(),
                    (nidt::EUI64, 8) => info.eui64 = desc.nid.try_into().ok(),
                    _ => {}
                }
            }
        }
        namespaces.push(info);
    }
    Ok((
        ControllerInfo {
            cntlid: id.cntlid,
            model: id.model,
            serial: id.serial,
            firmware: id.firmware,
            subnqn: id.subnqn,
            max_transfer,
            oncs: id.oncs,
            cqt_ms,
            ioccsz: id.ioccsz,
            sgls: id.sgls,
            io_queues: 0,
            queue_depth: 0,
            namespaces,
        },
        mqes,
    ))
}

pub(super) fn set_queue_count(
    q: &dyn FabricQueue,
    want: u16,
    deadline: Instant,
) -> Result<u16, FabricError> {
    let mut sqe = Command {
        opcode: admin_opcode::SET_FEATURES,
        ..Default::default()
    };
    SetFeatures {
        fid: fid::NUMBER_OF_QUEUES,
        save: false,
        value: features::number_of_queues(want, want),
    }
    .apply(&mut sqe);
    let (cqe, _) = admin_cmd(q, sqe, Dir::None, Vec::new(), deadline)?;
    // What was allocated (NSQA, NCQA), which may be fewer or more than asked.
    let (nsqa, ncqa) = features::parse_number_of_queues(cqe.dw0);
    Ok((want as u32).min(nsqa).min(ncqa).max(1) as u16)
}

/// A reconnect must find the namespaces it had: same NSID, same identity, same geometry
/// (never send I/O meant for one namespace to another that reuses the NSID).
pub(super) fn check_identity(
    expected: &[NamespaceInfo],
    found: &[NamespaceInfo],
) -> Result<(), FabricError> {
    for e in expected {
        let Some(f) = found.iter().find(|f| f.nsid == e.nsid) else {
            return Err(FabricError::IdentityChanged(format!(
                "namespace {} is gone from the controller",
                e.nsid
            )));
        };
        let id_ok = if e.has_id() || f.has_id() {
            e.same_namespace(f)
        } else {
            true
        };
        if !id_ok || f.block_size != e.block_size || f.blocks < e.blocks {
            return Err(FabricError::IdentityChanged(format!(
                "namespace {} changed ({} {}x{} -> {} {}x{}): refusing to send I/O to a different namespace",
                e.nsid,
                e.id_string(),
                e.blocks,
                e.block_size,
                f.id_string(),
                f.blocks,
                f.block_size
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod test {
    use super::*;

    fn ns(nsid: u32, g: u8) -> NamespaceInfo {
        NamespaceInfo {
            nsid,
            block_size: 512,
            blocks: 100,
            nguid: Some([g; 16]),
            uuid: None,
            eui64: None,
        }
    }

    #[test]
    fn identity_rules() {
        assert!(ns(1, 1).same_namespace(&ns(2, 1)));
        assert!(!ns(1, 1).same_namespace(&ns(1, 2)));
        let mut none = ns(1, 1);
        none.nguid = None;
        assert!(
            !none.same_namespace(&none.clone()),
            "no ids: never the same"
        );
        let mut u = ns(1, 1);
        u.uuid = Some([9; 16]);
        let mut u2 = ns(1, 1);
        u2.uuid = Some([8; 16]);
        assert!(!u.same_namespace(&u2), "one identifier differs");
        assert!(check_identity(&[ns(1, 1)], &[ns(1, 1)]).is_ok());
        assert!(check_identity(&[ns(1, 1)], &[ns(1, 2)]).is_err());
        assert!(check_identity(&[ns(1, 1)], &[ns(2, 1)]).is_err());
        let mut small = ns(1, 1);
        small.blocks = 10;
        assert!(check_identity(&[ns(1, 1)], &[small]).is_err());
    }
}
