//! The data path of a `remote` volume, composed over the remote controllers: each extent is
//! one namespace or a multipath device over several, several extents are striped, and a
//! namespace whose block size differs from the volume's is viewed through
//! [`BlockSizeView`].

use std::sync::Arc;

use nacre_shared::api::remote::{parse_extent, MultipathPolicy, RemoteLayout, DEFAULT_STRIPE_SIZE};
use nacre_shared::api::volume::VolumeCreate;
use tracing::warn;

use super::controllers::Controllers;
use crate::control::error::RpcError;
use crate::control::state::VolumeRecord;
use crate::fabric::controller::NamespaceInfo;
use crate::fabric::namespace::BlockSizeView;
use crate::fabric::{MultipathDevice, PathPolicy, RemoteNamespace};
use crate::volume::stripe::StripeVolume;
use crate::volume::BlockDevice;

/// Build the data path of a remote volume. Returns the device and its size.
fn build(
    ctrls: &Controllers,
    layout: &RemoteLayout,
    block_size: u32,
) -> Result<(Arc<dyn BlockDevice>, u64), RpcError> {
    if layout.extents.is_empty() {
        return Err(RpcError::invalid_params(
            "a remote volume needs at least one extent (REMOTE:NSID)",
        ));
    }
    let policy = match layout.multipath {
        MultipathPolicy::Failover => PathPolicy::Failover,
        MultipathPolicy::RoundRobin => PathPolicy::RoundRobin,
    };
    let mut devs: Vec<Arc<dyn BlockDevice>> = Vec::new();
    // Namespaces the extents so far use: one in two extents would put two stripe units on
    // the same blocks, each write overwriting the other's.
    let mut used: Vec<(String, NamespaceInfo)> = Vec::new();
    for e in &layout.extents {
        let paths = parse_extent(e).map_err(RpcError::invalid_params)?;
        let mut members = Vec::new();
        let first_used = used.len();
        for (remote, nsid) in &paths {
            let ctrl = ctrls.get(remote).ok_or_else(|| {
                RpcError::invalid_params(format!(
                    "extent {e:?}: remote {remote:?} is not attached (remote_attach it first)"
                ))
            })?;
            let all = ctrl.core().namespaces();
            let ns = all
                .iter()
                .find(|n| n.nsid == *nsid)
                .cloned()
                .ok_or_else(|| {
                    RpcError::invalid_params(format!(
                        "extent {e:?}: remote {remote:?} has no namespace {nsid} (it has {})",
                        all.iter()
                            .map(|n| n.nsid.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })?;
            // (What a live controller reports is checked when it identifies the namespace;
            // this also covers what a saved state file says.)
            if !(512..=65536).contains(&ns.block_size)
                || !ns.block_size.is_power_of_two()
                || ns.blocks.checked_mul(u64::from(ns.block_size)).is_none()
            {
                return Err(RpcError::invalid_params(format!(
                    "extent {e:?}: namespace {nsid} of {remote:?} reports {} blocks of {} bytes, which no namespace has",
                    ns.blocks, ns.block_size
                )));
            }
            if let Some((other, _)) = used[..first_used]
                .iter()
                .find(|(r, u)| (r == remote && u.nsid == ns.nsid) || u.same_namespace(&ns))
            {
                return Err(RpcError::invalid_params(format!(
                    "extent {e:?}: namespace {nsid} of {remote:?} is already an extent of this volume (through {other:?}): its stripe units would overwrite each other"
                )));
            }
            used.push((remote.clone(), ns.clone()));
            if block_size % ns.block_size != 0 {
                return Err(RpcError::invalid_params(format!(
                    "extent {e:?}: namespace block size {} does not divide the volume block size {block_size}",
                    ns.block_size
                )));
            }
            members.push(if paths.len() > 1 {
                Arc::new(RemoteNamespace::as_path(ctrl.core().clone(), ns))
            } else {
                Arc::new(RemoteNamespace::new(ctrl.core().clone(), ns))
            });
        }
        let dev: Arc<dyn BlockDevice> = if members.len() == 1 {
            members.pop().expect("one member")
        } else {
            Arc::new(
                MultipathDevice::new(members, policy)
                    .map_err(|err| RpcError::invalid_params(format!("extent {e:?}: {err}")))?,
            )
        };
        let dev: Arc<dyn BlockDevice> = if dev.geometry().block_size == block_size {
            dev
        } else {
            Arc::new(BlockSizeView::new(dev, block_size))
        };
        devs.push(dev);
    }
    let dev: Arc<dyn BlockDevice> = if devs.len() == 1 {
        devs.pop().expect("one extent")
    } else {
        let ss = layout.stripe_size.unwrap_or(DEFAULT_STRIPE_SIZE);
        Arc::new(StripeVolume::new(devs, ss).map_err(|e| RpcError::invalid_params(e.to_string()))?)
    };
    if layout.extents.len() == 1 && layout.stripe_size.is_some() {
        warn!("stripe_size ignored for a single-extent remote volume");
    }
    let size = dev.geometry().size;
    Ok((dev, size))
}

/// The size of a new remote volume: the extents' capacity, or the requested size if it fits.
pub(super) fn size(ctrls: &Controllers, p: &VolumeCreate) -> Result<u64, RpcError> {
    let layout = p.remote.as_ref().ok_or_else(|| {
        RpcError::invalid_params(
            "a remote volume needs \"remote\": {\"extents\": [\"REMOTE:NSID\", …]}",
        )
    })?;
    let (_, cap) = build(ctrls, layout, p.block_size)?;
    match p.size {
        0 => Ok(cap),
        s if s % p.block_size as u64 != 0 => Err(RpcError::invalid_params(format!(
            "size must be a multiple of the block size {} (got {s})",
            p.block_size
        ))),
        s if s > cap => Err(RpcError::invalid_params(format!(
            "size {s} exceeds the {cap} bytes the extents hold"
        ))),
        s => Ok(s),
    }
}

/// Open a remote volume's data path (create and replay). Its controllers may be down: the
/// device exists anyway and I/O waits or fails per their knobs.
pub(super) fn open(
    ctrls: &Controllers,
    rec: &VolumeRecord,
) -> Result<Arc<dyn BlockDevice>, RpcError> {
    let layout = rec.remote.as_ref().ok_or_else(|| {
        RpcError::failed(format!(
            "remote volume {:?} has no layout in the state",
            rec.name
        ))
    })?;
    let (dev, cap) = build(ctrls, layout, rec.block_size)?;
    if cap < rec.size {
        return Err(RpcError::failed(format!(
            "remote volume {:?}: its extents now hold {cap} bytes, less than its {} bytes",
            rec.name, rec.size
        )));
    }
    Ok(if cap == rec.size {
        dev
    } else {
        Arc::new(BlockSizeView::with_size(dev, rec.block_size, rec.size))
    })
}
