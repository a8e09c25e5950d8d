//! The NVMe PCIe controller over vfio-user: what a hostile vfio-user client (a guest's VMM, or
//! anything that can reach the socket) sends, with guest memory of its choosing
//! ([`vfio_user`]). It covers the message parser (headers, sizes, every command), the region
//! accesses (configuration space, BAR0 registers, the doorbell page), and through them the
//! controller: CC.EN and CC.SHN, the admin queue, queue creation and deletion, PRP walks
//! against the mapped memory and I/O onto a namespace.

use std::sync::{Arc, OnceLock};

use crate::frontend::nvme_pcie::{fuzz_session, Signals, FUZZ_MAX_STREAM};
use crate::frontend::nvmf_tcp::NvmfTarget;
use crate::volume::ram::RamVolume;

use super::{ignore_sigpipe, NS_BYTES, NS_LBA};

/// The subsystem the PCIe controller serves.
pub const PCIE_NQN: &str = "nqn.2024-01.io.nacre:fuzz-pcie";
/// Guest memory is at most this many 4 KiB pages.
pub const PCIE_MAX_PAGES: usize = 8;

fn target() -> &'static Arc<NvmfTarget> {
    static T: OnceLock<Arc<NvmfTarget>> = OnceLock::new();
    T.get_or_init(|| {
        ignore_sigpipe();
        let target = NvmfTarget::new();
        target
            .create_subsystem(PCIE_NQN, "FUZZPCIE", "nacre-fuzz", true)
            .expect("subsystem");
        let vol = Arc::new(RamVolume::new(NS_BYTES, NS_LBA).expect("ram volume"));
        target
            .add_namespace(PCIE_NQN, None, vol, [9; 16], "fuzz-pcie".into())
            .expect("namespace");
        target
    })
}

/// One vfio-user session. Input: byte 0 is the number of 4 KiB pages of guest memory less
/// one (modulo [`PCIE_MAX_PAGES`]), its top bit set for a function with MSI instead of MSI-X
/// (so the fuzzer reaches both kinds' configuration space and interrupt paths); bytes 1..3 a little-endian length L; the next L bytes
/// (at most the memory's size) the start of guest memory, the rest zero; what follows is the
/// client's byte stream (vfio-user messages, 16-byte headers and all). The memory is mapped
/// at guest address 0 before the first message; the controller polls its queues after each
/// message. A panic, a hang, or a write outside the mapping (a fault) is a finding.
pub fn vfio_user(data: &[u8]) {
    vfio_user_session(data);
}

/// [`vfio_user`], returning the guest memory as the session left it (empty for an input
/// too short to have a page count).
pub fn vfio_user_session(data: &[u8]) -> Vec<u8> {
    let Some((&pages, rest)) = data.split_first() else {
        return Vec::new();
    };
    let signals = if pages & 0x80 != 0 {
        Signals::Msi
    } else {
        Signals::Msix
    };
    let pages = pages as usize % PCIE_MAX_PAGES + 1;
    let (len, rest) = match rest {
        [a, b, rest @ ..] => (u16::from_le_bytes([*a, *b]) as usize, rest),
        _ => (0, &[][..]),
    };
    let len = len.min(pages * 4096).min(rest.len());
    let (image, stream) = rest.split_at(len);
    let mut memory = vec![0u8; pages * 4096];
    memory[..image.len()].copy_from_slice(image);
    let stream = &stream[..stream.len().min(FUZZ_MAX_STREAM)];
    let after =
        fuzz_session(target(), PCIE_NQN, &memory, stream, signals).expect("fuzz session setup");
    assert_eq!(after.len(), memory.len(), "guest memory changed size");
    after
}
