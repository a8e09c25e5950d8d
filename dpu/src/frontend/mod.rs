//! Frontends: what a host sees. Each turns a wire protocol into [`crate::volume::IoRequest`]s.
//!
//! * [`vhost_user_blk`] — virtio-blk (virtio 1.2 §5.2) served over vhost-user.
//! * [`nvme`] — the NVMe target core every NVMe transport serves: subsystems, namespaces,
//!   controllers, admin commands, discovery, admission and limits.
//! * [`nvmf_tcp`] — the target's transport over TCP (NVMe/TCP Transport Specification 1.0),
//!   and its management API ([`nvmf_tcp::NvmfTarget`]).
//! * [`nvmf_rdma`] — the same target's subsystems over RDMA (NVMe RDMA Transport
//!   Specification 1.0, RoCEv2).
//! * [`nvme_pcie`] — the same target's subsystems as PCIe NVMe controllers, emulated over
//!   vfio-user.
//! * [`virtio_pcie`] — virtio-blk as a PCI function (the virtio PCI modern transport),
//!   emulated over vfio-user, on the vhost-user-blk device's virtqueue code.
//! * [`vfio_user`] — the vfio-user server and PCI configuration space every emulated PCI
//!   function shares.

pub mod nvme;
pub mod nvme_pcie;
pub mod nvmf_rdma;
pub mod nvmf_tcp;
pub mod vfio_user;
pub mod vhost_user_blk;
pub mod virtio_pcie;
