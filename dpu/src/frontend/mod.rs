//! Frontends: what a host sees. Each turns a wire protocol into [`crate::volume::IoRequest`]s.
//!
//! * [`vhost_user_blk`] — virtio-blk (virtio 1.2 §5.2) served over vhost-user.
//! * [`nvmf_tcp`] — an NVMe-oF target over TCP (NVMe/TCP Transport Specification 1.0).
//! * [`nvmf_rdma`] — the same target's subsystems over RDMA (NVMe RDMA Transport
//!   Specification 1.0, RoCEv2), sharing controllers and discovery with [`nvmf_tcp`].

pub mod nvmf_rdma;
pub mod nvmf_tcp;
pub mod vhost_user_blk;
