//! The NVMe controller's PCI configuration space: the generic function's
//! ([`crate::frontend::vfio_user::config`]) with an NVM Express identity.

use std::ops::{Deref, DerefMut};

use crate::frontend::vfio_user::config::{self as pci, Identity, Interrupts};

/// Vendor and device ID: the pair libvfio-user's (and so SPDK's) emulated NVMe controller
/// reports; Linux binds NVMe controllers by class code and knows no quirks for it.
pub const VENDOR_ID: u16 = 0x4e58;
pub const DEVICE_ID: u16 = 0x0001;

/// Class code: mass storage (01h), non-volatile memory (08h), NVM Express (02h).
const IDENTITY: Identity = Identity {
    vendor: VENDOR_ID,
    device: DEVICE_ID,
    revision: 0,
    class: [0x01, 0x08, 0x02],
    subsystem_vendor: VENDOR_ID,
    subsystem: DEVICE_ID,
};

/// The controller's configuration space.
pub struct ConfigSpace(pci::ConfigSpace);

impl ConfigSpace {
    pub fn new(interrupts: Interrupts, bar0_len: u64, msix_bar_len: u64) -> Self {
        ConfigSpace(pci::ConfigSpace::new(
            IDENTITY,
            interrupts,
            bar0_len,
            msix_bar_len,
        ))
    }
}

impl Deref for ConfigSpace {
    type Target = pci::ConfigSpace;
    fn deref(&self) -> &pci::ConfigSpace {
        &self.0
    }
}

impl DerefMut for ConfigSpace {
    fn deref_mut(&mut self) -> &mut pci::ConfigSpace {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_nvm_express_identity() {
        let c = ConfigSpace::new(Interrupts::Msix(33), 0x4000, 0x1000);
        let mut b = [0u8; 12];
        c.read(0, &mut b);
        assert_eq!(&b[0..4], &[0x58, 0x4e, 0x01, 0x00]);
        assert_eq!(&b[9..12], &[0x02, 0x08, 0x01], "NVM Express class code");
    }
}
