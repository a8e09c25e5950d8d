//! The controller as a vfio-user PCI function ([`Function`]): its regions (BAR0 with the
//! doorbell page mmappable, the MSI-X BARs the client emulates when the function has MSI-X,
//! the configuration space) and where their accesses go.

use std::fs::File;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use vfio_bindings::bindings::vfio::*;
use vm_memory::GuestMemoryMmap;

use super::ctrl::PcieController;
use super::queue::DOORBELLS;
use crate::frontend::nvme::lock;
use crate::frontend::vfio_user::config::Interrupts;
use crate::frontend::vfio_user::{
    Function, Region, SharedRegion, REGION_BAR0, REGION_BAR4, REGION_BAR5, REGION_CONFIG,
};

/// BAR0: registers (4 KiB) and the doorbell page (4 KiB).
pub const BAR0_LEN: u64 = 0x2000;
/// BAR4 (MSI-X table) and BAR5 (pending bits), each one page; the client emulates both.
pub const MSIX_BAR_LEN: u64 = 0x1000;

/// BAR0's backing memory: the client maps the doorbell page of it.
pub fn bar0() -> std::io::Result<SharedRegion> {
    SharedRegion::new(BAR0_LEN as usize)
}

/// The doorbell page inside BAR0's memory.
pub fn doorbell_page(bar0: &SharedRegion) -> *mut u8 {
    bar0.at(DOORBELLS as usize)
        .expect("the doorbell page lies inside BAR0")
}

/// The regions of the function: BAR0 (doorbell page mmappable), BAR4/5 (MSI-X only),
/// config.
pub fn regions(bar0: &SharedRegion, interrupts: Interrupts) -> Vec<Region> {
    let rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
    let plain = |flags, size| Region {
        flags,
        size,
        sparse: Vec::new(),
        fd: None,
    };
    (0..VFIO_PCI_NUM_REGIONS)
        .map(|i| match i {
            REGION_BAR0 => Region {
                flags: rw | VFIO_REGION_INFO_FLAG_MMAP,
                size: BAR0_LEN,
                sparse: vec![(DOORBELLS, 0x1000)],
                fd: Some(bar0.raw_fd()),
            },
            REGION_BAR4 | REGION_BAR5 if matches!(interrupts, Interrupts::Msix(_)) => {
                plain(rw, MSIX_BAR_LEN)
            }
            REGION_CONFIG => plain(rw, crate::frontend::vfio_user::config::CONFIG_LEN as u64),
            _ => plain(0, 0),
        })
        .collect()
}

impl Function for PcieController {
    fn region_read(&self, region: u32, offset: u64, data: &mut [u8]) {
        match region {
            REGION_BAR0 if offset >= DOORBELLS => self.doorbells.load(offset - DOORBELLS, data),
            REGION_BAR0 => self.read_regs(offset, data),
            _ => data.fill(0),
        }
    }

    fn region_write(this: &Arc<Self>, region: u32, offset: u64, data: &[u8]) {
        match region {
            REGION_BAR0 if offset >= DOORBELLS => this.doorbells.store(offset - DOORBELLS, data),
            REGION_BAR0 => this.write_regs(offset, data),
            _ => {}
        }
    }

    fn config_read(&self, offset: u64, data: &mut [u8]) {
        lock(&self.config).read(offset, data)
    }

    fn config_write(&self, offset: u64, data: &[u8]) {
        lock(&self.config).write(offset, data);
        // Bus Master Enable may have changed: the poller reads it again.
        self.changed();
    }

    fn interrupts(&self) -> Interrupts {
        self.interrupts
    }

    fn dma(&self) -> &Mutex<Arc<GuestMemoryMmap>> {
        &self.mem
    }

    fn dma_changed(&self) {
        self.changed();
    }

    fn irqs(&self) -> &Mutex<Vec<Option<File>>> {
        &self.irqs
    }

    fn client(&self) -> &Mutex<Option<UnixStream>> {
        &self.client
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    fn reset(&self) {
        PcieController::reset(self)
    }
}
