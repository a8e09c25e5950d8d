//! PCI configuration space of an emulated function (PCI Local Bus 3.0 §6.1, type 0
//! header), with three capabilities: Power Management (PCI PM 1.2 §3.2), one interrupt
//! capability (MSI-X, §6.8.2, or MSI, §6.8.1: see [`Interrupts`]) and PCI Express (PCIe
//! Base 4.0 §7.5.3, an endpoint with nothing to report), then any vendor-specific
//! capabilities the function adds (§6.7, ID 09h: virtio's structure locations).
//!
//! The client (QEMU's `vfio-user-pci`, SPDK's NVMe driver) sizes and places the BARs itself
//! from the region information; what this space must get right is the identity (IDs and
//! class code), the BAR types, and the capability chain the client emulates MSI-X or MSI
//! from. Writes reach only the bits a driver may change: the Command register, the
//! interrupt line, MSI-X Enable and Function Mask (or MSI Enable, Multiple Message Enable,
//! the message address and data), and the PM control bits.

/// Size of the configuration space served (the conventional 256 bytes).
pub const CONFIG_LEN: usize = 256;

/// Who the function is: the header's identity fields.
#[derive(Debug, Clone, Copy)]
pub struct Identity {
    pub vendor: u16,
    pub device: u16,
    pub revision: u8,
    /// Base class, sub-class, programming interface.
    pub class: [u8; 3],
    pub subsystem_vendor: u16,
    pub subsystem: u16,
}

/// Header offsets (§6.1).
mod hdr {
    pub const COMMAND: usize = 0x04;
    pub const STATUS: usize = 0x06;
    pub const REVISION: usize = 0x08;
    pub const CLASS: usize = 0x09;
    pub const BAR0: usize = 0x10;
    pub const BAR4: usize = 0x20;
    pub const BAR5: usize = 0x24;
    pub const SUBSYS_VENDOR: usize = 0x2C;
    pub const CAP_PTR: usize = 0x34;
    pub const INT_LINE: usize = 0x3C;
    pub const INT_PIN: usize = 0x3D;
}

/// Capability offsets in this space. The interrupt capability, MSI-X or MSI, sits at
/// `MSIX_CAP` either way (one or the other, never both).
pub const PM_CAP: usize = 0x40;
pub const MSIX_CAP: usize = 0x50;
pub const MSI_CAP: usize = MSIX_CAP;
pub const PCIE_CAP: usize = 0x60;
/// Where the vendor-specific capabilities a function adds start.
pub const VENDOR_CAPS: usize = 0x70;
/// Vendor-specific capability ID (PCI Local Bus 3.0 Appendix H).
pub const CAP_ID_VENDOR: u8 = 0x09;

/// Status register: Capabilities List.
const STATUS_CAP_LIST: u16 = 1 << 4;
/// Command register bits a driver may set: I/O space, memory space, bus master, and
/// Interrupt Disable.
const COMMAND_WRITABLE: u16 = 0b111 | 1 << 10;
/// MSI-X Message Control: MSI-X Enable and Function Mask.
const MSIX_CTRL_WRITABLE: u16 = 0xC000;
/// MSI capability ID (PCI Local Bus 3.0 Appendix H).
const CAP_ID_MSI: u8 = 0x05;
/// MSI Message Control (§6.8.1.3): MSI Enable (bit 0) and Multiple Message Enable (bits
/// 6:4) are the driver's; Multiple Message Capable (3:1), 64-bit Address Capable (7) and
/// Per-Vector Masking Capable (8, clear: nacre's functions have no mask bits) are read-only.
const MSI_CTRL_WRITABLE: u16 = 0x0071;
const MSI_CTRL_64BIT: u16 = 1 << 7;
/// The most vectors MSI can give one function (Multiple Message Capable 101b).
pub const MSI_MAX_VECTORS: u16 = 32;

/// How a function signals its host (PCI Local Bus 3.0 §6.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interrupts {
    /// MSI-X with this many vectors (table in BAR4, pending bits in BAR5, both emulated by
    /// the client): one vector per queue, the kind every NVMe driver asks for first.
    Msix(u16),
    /// MSI with this many vectors (a power of two, at most [`MSI_MAX_VECTORS`]); the host
    /// enables a power of two of them, often one (x86 gives a function more than one MSI
    /// vector only with interrupt remapping). No BAR4 or BAR5.
    Msi(u16),
}

impl Interrupts {
    /// Vectors the function offers.
    pub fn vectors(self) -> u16 {
        match self {
            Interrupts::Msix(n) | Interrupts::Msi(n) => n,
        }
    }

    /// The vfio-user (VFIO) interrupt index of this kind: `VFIO_PCI_MSI_IRQ_INDEX` or
    /// `VFIO_PCI_MSIX_IRQ_INDEX`.
    pub fn irq_index(self) -> u32 {
        match self {
            Interrupts::Msix(_) => 2,
            Interrupts::Msi(_) => 1,
        }
    }
}

/// The configuration space of one function with the interrupt capability of `interrupts`
/// and a 64-bit BAR0 of `bar0_len` bytes (and, with MSI-X, BAR4 and BAR5 of `msix_bar_len`).
pub struct ConfigSpace {
    bytes: [u8; CONFIG_LEN],
    /// Size masks of the BARs the function has (BAR0, 64-bit: BAR0 and BAR1; BAR4 and BAR5
    /// with MSI-X), for BAR sizing writes.
    bar_sizes: Vec<(usize, u64)>,
    interrupts: Interrupts,
}

impl ConfigSpace {
    pub fn new(id: Identity, interrupts: Interrupts, bar0_len: u64, msix_bar_len: u64) -> Self {
        let mut b = [0u8; CONFIG_LEN];
        put16(&mut b, 0, id.vendor);
        put16(&mut b, 2, id.device);
        put16(&mut b, hdr::STATUS, STATUS_CAP_LIST);
        b[hdr::REVISION] = id.revision;
        b[hdr::CLASS] = id.class[2];
        b[hdr::CLASS + 1] = id.class[1];
        b[hdr::CLASS + 2] = id.class[0];
        // BAR0: 64-bit memory, not prefetchable.
        put32(&mut b, hdr::BAR0, 0b100);
        // BAR4 and BAR5 (MSI-X only): 32-bit memory (MSI-X table and PBA).
        put16(&mut b, hdr::SUBSYS_VENDOR, id.subsystem_vendor);
        put16(&mut b, hdr::SUBSYS_VENDOR + 2, id.subsystem);
        b[hdr::CAP_PTR] = PM_CAP as u8;
        b[hdr::INT_PIN] = 1;
        // Power Management: version 3 (PM 1.2), next MSI-X; PMCSR No_Soft_Reset.
        b[PM_CAP] = 0x01;
        b[PM_CAP + 1] = MSIX_CAP as u8;
        put16(&mut b, PM_CAP + 2, 0x0003);
        put16(&mut b, PM_CAP + 4, 0x0008);
        let mut bar_sizes = vec![(hdr::BAR0, bar0_len)];
        match interrupts {
            Interrupts::Msix(vectors) => {
                // MSI-X: table size N-1, table at BAR4 offset 0, PBA at BAR5 offset 0.
                b[MSIX_CAP] = 0x11;
                put16(&mut b, MSIX_CAP + 2, vectors.saturating_sub(1) & 0x7FF);
                put32(&mut b, MSIX_CAP + 4, 4);
                put32(&mut b, MSIX_CAP + 8, 5);
                bar_sizes.push((hdr::BAR4, msix_bar_len));
                bar_sizes.push((hdr::BAR5, msix_bar_len));
            }
            Interrupts::Msi(vectors) => {
                // MSI: 64-bit message address, Multiple Message Capable = log2(vectors).
                let log2 = vectors.clamp(1, MSI_MAX_VECTORS).ilog2() as u16;
                b[MSI_CAP] = CAP_ID_MSI;
                put16(&mut b, MSI_CAP + 2, MSI_CTRL_64BIT | log2 << 1);
            }
        }
        b[MSIX_CAP + 1] = PCIE_CAP as u8;
        // PCI Express: capability version 2, endpoint; the rest reads as zero.
        b[PCIE_CAP] = 0x10;
        b[PCIE_CAP + 1] = 0;
        put16(&mut b, PCIE_CAP + 2, 0x0002);
        ConfigSpace {
            bytes: b,
            bar_sizes,
            interrupts,
        }
    }

    /// Append vendor-specific capabilities after the PCIe capability: each `body` is a
    /// capability's bytes from its length byte on (ID and next pointer are filled in here),
    /// placed 4-byte aligned from [`VENDOR_CAPS`]. Returns each one's offset, or None if
    /// they do not fit the conventional space.
    pub fn add_vendor_caps(&mut self, bodies: &[Vec<u8>]) -> Option<Vec<usize>> {
        let mut at = VENDOR_CAPS;
        let mut offsets = Vec::with_capacity(bodies.len());
        for body in bodies {
            if at + 2 + body.len() > CONFIG_LEN {
                return None;
            }
            offsets.push(at);
            at = (at + 2 + body.len()).next_multiple_of(4);
        }
        let mut prev_next = PCIE_CAP + 1;
        for (body, &off) in bodies.iter().zip(&offsets) {
            self.bytes[prev_next] = off as u8;
            self.bytes[off] = CAP_ID_VENDOR;
            self.bytes[off + 1] = 0;
            self.bytes[off + 2..off + 2 + body.len()].copy_from_slice(body);
            prev_next = off + 1;
        }
        Some(offsets)
    }

    /// Read `out.len()` bytes at `offset`; bytes beyond the space read as zero.
    pub fn read(&self, offset: u64, out: &mut [u8]) {
        for (i, o) in out.iter_mut().enumerate() {
            *o = usize::try_from(offset)
                .ok()
                .and_then(|off| off.checked_add(i))
                .and_then(|at| self.bytes.get(at).copied())
                .unwrap_or(0);
        }
    }

    /// A driver's write: only the writable fields change, the rest is ignored.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let Ok(off) = usize::try_from(offset) else {
            return;
        };
        for (i, &v) in data.iter().enumerate() {
            let Some(at) = off.checked_add(i) else { return };
            let mask = self.writable_mask(at);
            if let Some(b) = self.bytes.get_mut(at) {
                *b = (*b & !mask) | (v & mask);
            }
        }
        // BAR sizing: a BAR reads back its size mask after all-ones is written; the low
        // type bits are read-only (masked above).
        for &(bar, len) in &self.bar_sizes {
            if (bar..bar + 4).contains(&off)
                || (bar == hdr::BAR0 && (bar + 4..bar + 8).contains(&off))
            {
                let lo = get32(&self.bytes, bar) & !0xF;
                let keep = get32(&self.bytes, bar) & 0xF;
                let mask = !(len.max(16) - 1);
                put32(&mut self.bytes, bar, (lo & mask as u32) | keep);
                if bar == hdr::BAR0 {
                    let hi = get32(&self.bytes, bar + 4);
                    put32(&mut self.bytes, bar + 4, hi & (mask >> 32) as u32);
                }
            }
        }
    }

    fn writable_mask(&self, at: usize) -> u8 {
        let byte_of = |v: u16, base: usize| (v >> (8 * (at - base))) as u8;
        match at {
            a if (hdr::COMMAND..hdr::COMMAND + 2).contains(&a) => {
                byte_of(COMMAND_WRITABLE, hdr::COMMAND)
            }
            a if (hdr::BAR0..hdr::BAR0 + 8).contains(&a) => {
                if a == hdr::BAR0 {
                    0xF0
                } else {
                    0xFF
                }
            }
            a if (hdr::BAR4..hdr::BAR5 + 4).contains(&a) => match self.interrupts {
                Interrupts::Msix(_) if a == hdr::BAR4 || a == hdr::BAR5 => 0xF0,
                Interrupts::Msix(_) => 0xFF,
                // No BAR4 or BAR5: they read as zero whatever is written.
                Interrupts::Msi(_) => 0,
            },
            hdr::INT_LINE => 0xFF,
            a if (MSIX_CAP + 2..MSIX_CAP + 4).contains(&a) => match self.interrupts {
                Interrupts::Msix(_) => byte_of(MSIX_CTRL_WRITABLE, MSIX_CAP + 2),
                Interrupts::Msi(_) => byte_of(MSI_CTRL_WRITABLE, MSI_CAP + 2),
            },
            // MSI Message Address (dword aligned), Upper Address and Data (§6.8.1.4-6).
            a if matches!(self.interrupts, Interrupts::Msi(_))
                && (MSI_CAP + 4..MSI_CAP + 14).contains(&a) =>
            {
                if a == MSI_CAP + 4 {
                    0xFC
                } else {
                    0xFF
                }
            }
            // PMCSR PowerState (bits 1:0).
            a if a == PM_CAP + 4 => 0x03,
            _ => 0,
        }
    }

    /// MSI-X Enable and not Function Mask.
    pub fn msix_enabled(&self) -> bool {
        let ctrl = get16(&self.bytes, MSIX_CAP + 2);
        matches!(self.interrupts, Interrupts::Msix(_)) && ctrl & 0x8000 != 0 && ctrl & 0x4000 == 0
    }

    /// How many vectors the function may raise now: with MSI-X all of them once MSI-X is
    /// enabled and the function not masked; with MSI, once MSI is enabled, the 2^MME the
    /// host enabled (never more than offered). None: interrupts are off.
    pub fn vectors_enabled(&self) -> Option<u16> {
        let ctrl = get16(&self.bytes, MSIX_CAP + 2);
        match self.interrupts {
            Interrupts::Msix(n) => self.msix_enabled().then_some(n),
            Interrupts::Msi(n) => {
                (ctrl & 1 != 0).then(|| (1u16 << ((ctrl >> 4) & 0x7).min(5)).min(n.max(1)))
            }
        }
    }

    /// The function's interrupt kind.
    pub fn interrupts(&self) -> Interrupts {
        self.interrupts
    }

    /// Bus Master Enable: the device may touch host memory.
    pub fn bus_master(&self) -> bool {
        get16(&self.bytes, hdr::COMMAND) & 0b100 != 0
    }
}

fn put16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn get16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
fn get32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    const NVME_LIKE: Identity = Identity {
        vendor: 0x4e58,
        device: 1,
        revision: 0,
        class: [1, 8, 2],
        subsystem_vendor: 0x4e58,
        subsystem: 1,
    };

    #[test]
    fn identity_capabilities_and_bar_sizing() {
        let id = NVME_LIKE;
        let mut c = ConfigSpace::new(id, Interrupts::Msix(33), 0x4000, 0x1000);
        let mut b = [0u8; CONFIG_LEN];
        c.read(0, &mut b);
        assert_eq!(&b[0..4], &[0x58, 0x4e, 0x01, 0x00]);
        assert_eq!(&b[9..12], &[0x02, 0x08, 0x01], "NVM Express class code");
        // The chain: PM -> MSI-X -> PCIe -> end.
        assert_eq!((b[0x34], b[0x40], b[0x41]), (0x40, 0x01, 0x50));
        assert_eq!((b[0x50], b[0x51], b[0x60], b[0x61]), (0x11, 0x60, 0x10, 0));
        assert_eq!(get16(&b, 0x52) & 0x7FF, 32, "table size is N-1");
        // Sizing BAR0: all ones reads back the size mask, type bits kept.
        c.write(0x10, &[0xFF; 4]);
        c.write(0x14, &[0xFF; 4]);
        let mut bar = [0u8; 8];
        c.read(0x10, &mut bar);
        assert_eq!(u64::from_le_bytes(bar), !0x3FFFu64 | 0b100);
        // Read-only fields ignore writes; reads past the end are zero.
        c.write(0, &[0; 4]);
        c.read(0, &mut bar[..2]);
        assert_eq!(&bar[..2], &[0x58, 0x4e]);
        let mut far = [0xAAu8; 8];
        c.read(u64::MAX - 2, &mut far);
        assert_eq!(far, [0; 8]);
        assert!(!c.msix_enabled() && !c.bus_master());
        c.write(0x52, &[0, 0x80]);
        c.write(0x04, &[0x06, 0]);
        assert!(c.msix_enabled() && c.bus_master());
    }

    #[test]
    fn an_msi_function_has_no_msix_and_no_bar4_or_bar5() {
        let id = NVME_LIKE;
        let mut c = ConfigSpace::new(id, Interrupts::Msi(32), 0x4000, 0x1000);
        let mut b = [0u8; CONFIG_LEN];
        c.read(0, &mut b);
        // PM -> MSI (05h) -> PCIe; Message Control: 64-bit, Multiple Message Capable 101b.
        assert_eq!(
            (b[0x41], b[0x50], b[0x51], b[0x60]),
            (0x50, 0x05, 0x60, 0x10)
        );
        assert_eq!(get16(&b, 0x52), 0x008A);
        let (mut at, mut ids) = (b[0x34] as usize, Vec::new());
        while at != 0 {
            ids.push(b[at]);
            at = b[at + 1] as usize;
        }
        assert_eq!(
            ids,
            vec![0x01, 0x05, 0x10],
            "PM, MSI, PCIe: no MSI-X capability"
        );
        // BAR4 and BAR5 do not exist: sizing them reads back zero.
        c.write(0x20, &[0xFF; 8]);
        c.read(0x20, &mut b[..8]);
        assert_eq!(&b[..8], &[0; 8]);
        // Off until MSI Enable; then 2^MME vectors, MMC and 64-bit bits unchanged by writes.
        assert_eq!(c.vectors_enabled(), None);
        c.write(0x52, &[0x01, 0xFF]);
        assert_eq!(c.vectors_enabled(), Some(1));
        c.write(0x52, &[0x21 | 0x0E, 0]);
        assert_eq!(c.vectors_enabled(), Some(4));
        c.read(0x52, &mut b[..2]);
        assert_eq!(
            get16(&b, 0),
            0x00AB,
            "MME 010b, MMC and 64-bit kept, enable set"
        );
        // An MME above what is offered gives no more than is offered.
        let mut one = ConfigSpace::new(id, Interrupts::Msi(1), 0x4000, 0x1000);
        one.write(0x52, &[0x51, 0]);
        assert_eq!(one.vectors_enabled(), Some(1));
        // Address (dword aligned), upper address and data are the driver's.
        c.write(0x54, &[0xFF; 10]);
        c.read(0x54, &mut b[..10]);
        assert_eq!(
            &b[..10],
            &[0xFC, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]
        );
        assert!(!c.msix_enabled());
    }

    #[test]
    fn vendor_caps_chain_after_pcie_and_must_fit() {
        let id = Identity {
            vendor: 0x1af4,
            device: 0x1042,
            revision: 1,
            class: [1, 0x80, 0],
            subsystem_vendor: 0x1af4,
            subsystem: 2,
        };
        let mut c = ConfigSpace::new(id, Interrupts::Msix(2), 0x4000, 0x1000);
        let offs = c
            .add_vendor_caps(&[vec![16, 1], vec![20, 2, 0, 0, 0]])
            .unwrap();
        assert_eq!(offs, vec![0x70, 0x74]);
        let mut b = [0u8; CONFIG_LEN];
        c.read(0, &mut b);
        assert_eq!((b[8], b[9], b[10], b[11]), (1, 0, 0x80, 1));
        assert_eq!(b[0x61], 0x70, "PCIe -> first vendor capability");
        assert_eq!((b[0x70], b[0x71], b[0x72]), (9, 0x74, 16));
        assert_eq!((b[0x74], b[0x75], b[0x76]), (9, 0, 20));
        assert!(c.add_vendor_caps(&[vec![0; 200]]).is_none());
    }
}
