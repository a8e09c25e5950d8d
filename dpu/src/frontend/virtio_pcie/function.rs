//! The virtio-blk PCI function: its identity (virtio 1.2 §4.1.2), its regions as a
//! [`Function`] the vfio-user server serves, and the queue thread that runs the
//! vhost-user-blk device's virtqueue code ([`QueueWorker`]) on the rings the driver set up.
//!
//! Notifications arrive as vfio-user region writes to the notify page (BAR0 is not
//! mmappable): each wakes the queue thread through an eventfd. The thread also wakes on
//! the queues' completion eventfds (a remote or encrypted volume completes on other
//! threads), runs every live queue, and raises the queue's MSI-X vector when
//! [`QueueWorker::run`] says the driver is due an interrupt (EVENT_IDX honoured there).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tracing::{info, warn};
use vfio_bindings::bindings::vfio::*;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::transport::{self, bar0, status, Effect, QueueConfig, Transport, NO_VECTOR};
use crate::frontend::nvme::lock;
use crate::frontend::vfio_user::config::{ConfigSpace, Identity, Interrupts};
use crate::frontend::vfio_user::{
    self, Function, Region, REGION_BAR0, REGION_BAR4, REGION_BAR5, REGION_CONFIG,
};
use crate::frontend::vhost_user_blk::queue::QueueWorker;
use crate::frontend::vhost_user_blk::request::DeviceParams;
use crate::frontend::vhost_user_blk::spec;
use crate::volume::BlockDevice;

/// §4.1.2: vendor 1AF4h, device 1040h + the device ID (virtio-blk: 2), a modern-only
/// device (revision 1); subsystem vendor and ID as QEMU's modern devices report them;
/// class: mass storage, other (the class QEMU gives virtio-blk).
pub const IDENTITY: Identity = Identity {
    vendor: 0x1AF4,
    device: 0x1042,
    revision: 1,
    class: [0x01, 0x80, 0x00],
    subsystem_vendor: 0x1AF4,
    subsystem: 0x1100,
};

/// BAR4 (MSI-X table) and BAR5 (pending bits), each one page; the client emulates both.
pub const MSIX_BAR_LEN: u64 = 0x1000;

/// One queue being served.
struct LiveQueue {
    index: u16,
    queue: Queue,
    worker: QueueWorker,
    vector: u16,
}

/// One emulated virtio-blk PCI function.
pub struct VirtioBlkFunction {
    volume: Arc<dyn BlockDevice>,
    params: Arc<DeviceParams>,
    num_queues: u16,
    pub(super) transport: Mutex<Transport>,
    config: Mutex<ConfigSpace>,
    live: Mutex<Vec<LiveQueue>>,
    /// Written on every notification and whenever the live queues change.
    kick: EventFd,
    mem: Mutex<Arc<GuestMemoryMmap>>,
    irqs: Mutex<Vec<Option<File>>>,
    pub(super) stop: AtomicBool,
    pub(super) client: Mutex<Option<UnixStream>>,
}

/// The features the function offers: those of the vhost-user-blk device, less the
/// vhost-user protocol's own bit.
pub fn device_features(read_only: bool) -> u64 {
    use virtio_bindings::bindings::virtio_blk as vb;
    use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;
    use virtio_bindings::bindings::virtio_ring::{
        VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
    };
    let bit = spec::bit;
    let mut f = bit(VIRTIO_F_VERSION_1)
        | bit(VIRTIO_RING_F_EVENT_IDX)
        | bit(VIRTIO_RING_F_INDIRECT_DESC)
        | bit(vb::VIRTIO_BLK_F_SIZE_MAX)
        | bit(vb::VIRTIO_BLK_F_SEG_MAX)
        | bit(vb::VIRTIO_BLK_F_BLK_SIZE)
        | bit(vb::VIRTIO_BLK_F_FLUSH)
        | bit(vb::VIRTIO_BLK_F_DISCARD)
        | bit(vb::VIRTIO_BLK_F_WRITE_ZEROES)
        | bit(vb::VIRTIO_BLK_F_MQ);
    if read_only {
        f |= bit(vb::VIRTIO_BLK_F_RO);
    }
    f
}

impl VirtioBlkFunction {
    pub fn new(
        volume: Arc<dyn BlockDevice>,
        params: DeviceParams,
        num_queues: u16,
        queue_size: u16,
    ) -> std::io::Result<Arc<Self>> {
        let vectors = num_queues + 1;
        let mut config =
            ConfigSpace::new(IDENTITY, Interrupts::Msix(vectors), bar0::LEN, MSIX_BAR_LEN);
        config
            .add_vendor_caps(&transport::capabilities())
            .ok_or_else(|| std::io::Error::other("virtio capabilities do not fit"))?;
        Ok(Arc::new(VirtioBlkFunction {
            transport: Mutex::new(Transport::new(
                device_features(params.read_only),
                num_queues,
                queue_size,
                vectors,
            )),
            volume,
            params: Arc::new(params),
            num_queues,
            config: Mutex::new(config),
            live: Mutex::new(Vec::new()),
            kick: EventFd::new(EFD_NONBLOCK)?,
            mem: Mutex::new(Arc::new(GuestMemoryMmap::new())),
            irqs: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            client: Mutex::new(None),
        }))
    }

    /// The regions: BAR0 (the virtio structures, reached by region accesses), BAR4/5
    /// (MSI-X, emulated by the client), the configuration space.
    pub fn regions() -> Vec<Region> {
        let rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
        let plain = |flags, size| Region {
            flags,
            size,
            sparse: Vec::new(),
            fd: None,
        };
        (0..VFIO_PCI_NUM_REGIONS)
            .map(|i| match i {
                REGION_BAR0 => plain(rw, bar0::LEN),
                REGION_BAR4 | REGION_BAR5 => plain(rw, MSIX_BAR_LEN),
                REGION_CONFIG => plain(rw, vfio_user::config::CONFIG_LEN as u64),
                _ => plain(0, 0),
            })
            .collect()
    }

    fn blk_config(&self) -> [u8; spec::cfg::LEN] {
        let geo = self.volume.geometry();
        spec::ConfigSpace {
            capacity_sectors: geo.size >> spec::SECTOR_SHIFT,
            seg_max: self.params.seg_max,
            blk_size: geo.block_size,
            num_queues: self.num_queues,
        }
        .encode()
    }

    /// Raise MSI-X vector `vector` (when the driver has MSI-X on and mapped it).
    fn interrupt(&self, vector: u16) {
        if vector == NO_VECTOR || !lock(&self.config).msix_enabled() {
            return;
        }
        vfio_user::signal(&self.irqs, vector);
    }

    fn apply(&self, effect: Effect) {
        match effect {
            Effect::None => {}
            Effect::Reset => self.reset(),
            Effect::NeedsReset => {
                let v = lock(&self.transport).config_vector();
                self.interrupt(v);
            }
            Effect::Start(queues) => self.start(&queues),
        }
    }

    /// Serve `queues` (DRIVER_OK): each one's rings must lie in the mapped memory, or the
    /// device needs a reset and serves none of them.
    fn start(&self, queues: &[u16]) {
        let mem = lock(&self.mem).clone();
        let t = lock(&self.transport);
        let event_idx = t.negotiated() & spec::bit(VIRTIO_RING_F_EVENT_IDX_BIT) != 0;
        let mut started = Vec::new();
        for &q in queues {
            let Some(cfg) = t.queue(q).copied() else {
                continue;
            };
            if !rings_mapped(&mem, &cfg) {
                warn!(
                    queue = q,
                    "virtio-pci: queue rings outside the mapped memory; device needs reset"
                );
                drop(t);
                let effect = lock(&self.transport).needs_reset();
                self.apply(effect);
                return;
            }
            let mut queue = match Queue::new(cfg.size) {
                Ok(queue) => queue,
                Err(e) => {
                    warn!(queue = q, "virtio-pci: {e}");
                    continue;
                }
            };
            queue.set_size(cfg.size);
            queue.set_desc_table_address(Some(cfg.desc as u32), Some((cfg.desc >> 32) as u32));
            queue.set_avail_ring_address(Some(cfg.driver as u32), Some((cfg.driver >> 32) as u32));
            queue.set_used_ring_address(Some(cfg.device as u32), Some((cfg.device >> 32) as u32));
            queue.set_event_idx(event_idx);
            queue.set_ready(true);
            match QueueWorker::new(self.volume.clone(), self.params.clone(), cfg.size) {
                Ok(worker) => started.push(LiveQueue {
                    index: q,
                    queue,
                    worker,
                    vector: cfg.msix_vector,
                }),
                Err(e) => warn!(queue = q, "virtio-pci: cannot start the queue: {e}"),
            }
        }
        drop(t);
        if !started.is_empty() {
            info!(
                queues = started.len(),
                "virtio-pci: driver ready, serving queues"
            );
        }
        lock(&self.live).extend(started);
        let _ = self.kick.write(1);
    }

    /// One pass of the queue thread: every live queue's available chains and finished
    /// requests; the interrupts due.
    fn run_queues(&self) {
        let mem = lock(&self.mem).clone();
        let mut due = Vec::new();
        {
            let mut live = lock(&self.live);
            for q in live.iter_mut() {
                let _ = q.worker.completer().event().read();
                if q.worker.run(&mut q.queue, &mem) {
                    due.push(q.vector);
                }
            }
        }
        if !due.is_empty() {
            lock(&self.transport).queue_interrupt();
            for v in due {
                self.interrupt(v);
            }
        }
    }

    /// The descriptors the queue thread waits on: the kick, then each queue's completions.
    fn wait_fds(&self) -> Vec<libc::pollfd> {
        let pfd = |fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let mut fds = vec![pfd(self.kick.as_raw_fd())];
        fds.extend(
            lock(&self.live)
                .iter()
                .map(|q| pfd(q.worker.completer().event().as_raw_fd())),
        );
        fds
    }
}

/// The virtio ring feature bit for EVENT_IDX.
const VIRTIO_RING_F_EVENT_IDX_BIT: u32 =
    virtio_bindings::bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

/// Each of the queue's three rings lies inside one mapped region.
fn rings_mapped(mem: &GuestMemoryMmap, q: &QueueConfig) -> bool {
    q.ring_lengths().iter().all(|&(addr, len)| {
        mem.iter().any(|r| {
            let start = r.start_addr().0;
            addr >= start
                && addr
                    .checked_add(len)
                    .is_some_and(|end| end <= start.saturating_add(r.len()))
        })
    })
}

impl Function for VirtioBlkFunction {
    fn region_read(&self, region: u32, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if region != REGION_BAR0 {
            return;
        }
        let page = offset & !(bar0::PAGE - 1);
        let within = offset - page;
        match page {
            bar0::COMMON => lock(&self.transport).read_common(within, data),
            bar0::ISR => lock(&self.transport).read_isr(data),
            bar0::DEVICE => {
                let cfg = self.blk_config();
                for (i, b) in data.iter_mut().enumerate() {
                    *b = cfg.get(within as usize + i).copied().unwrap_or(0);
                }
            }
            _ => {}
        }
    }

    fn region_write(this: &Arc<Self>, region: u32, offset: u64, data: &[u8]) {
        if region != REGION_BAR0 {
            return;
        }
        let page = offset & !(bar0::PAGE - 1);
        match page {
            bar0::COMMON => {
                let effect = lock(&this.transport).write_common(offset - page, data);
                this.apply(effect);
            }
            // Any store to the notify page: the queue thread looks at every live queue.
            bar0::NOTIFY => {
                let _ = this.kick.write(1);
            }
            // The device configuration is read-only (no VIRTIO_BLK_F_CONFIG_WCE); the ISR
            // is read-only.
            _ => {}
        }
    }

    fn config_read(&self, offset: u64, data: &mut [u8]) {
        lock(&self.config).read(offset, data)
    }

    fn config_write(&self, offset: u64, data: &[u8]) {
        lock(&self.config).write(offset, data)
    }

    fn interrupts(&self) -> Interrupts {
        // virtio over PCI signals through MSI-X or INTx, not MSI; nacre's function offers
        // MSI-X, a vector per queue and one for configuration changes.
        Interrupts::Msix(self.num_queues + 1)
    }

    fn dma(&self) -> &Mutex<Arc<GuestMemoryMmap>> {
        &self.mem
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

    /// Stop the queues (each waits for its requests still in the volume), forget the
    /// driver's setup.
    fn reset(&self) {
        let gone: Vec<LiveQueue> = lock(&self.live).drain(..).collect();
        let served: Vec<u16> = gone.iter().map(|q| q.index).collect();
        drop(gone);
        lock(&self.transport).reset();
        if !served.is_empty() {
            info!(queues = ?served, "virtio-pci: device reset");
        }
        let _ = self.kick.write(1);
    }
}

/// The queue thread: sleeps until a notification or a completion, then runs the queues.
pub fn queue_thread(dev: Weak<VirtioBlkFunction>) {
    loop {
        let Some(d) = dev.upgrade() else { return };
        if d.stop.load(Ordering::SeqCst) {
            return;
        }
        let mut fds = d.wait_fds();
        drop(d);
        // SAFETY: `fds` is a valid array of pollfd for the call; the descriptors belong to
        // the function, which a closed one only makes report POLLNVAL.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        if n <= 0 {
            continue;
        }
        let Some(d) = dev.upgrade() else { return };
        let _ = d.kick.read();
        if d.transport
            .lock()
            .map(|t| t.status() & status::DRIVER_OK != 0)
            .unwrap_or(false)
        {
            d.run_queues();
        }
    }
}
