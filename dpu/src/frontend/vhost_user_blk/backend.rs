//! The vhost-user side: what nacre offers the driver (features, protocol features,
//! configuration space) and how vring events reach the queue workers.

use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringMutex, VringState, VringT};
use virtio_bindings::bindings::virtio_blk as vb;
use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use super::queue::QueueWorker;
use super::request::{DeviceParams, Mem};
use super::spec::{self, bit, ConfigSpace};
use crate::volume::BlockDevice;

pub type Gm = GuestMemoryAtomic<Mem>;

/// One connection's device: a fresh one is built for every client, so nothing a previous
/// driver negotiated leaks into the next.
pub struct BlkBackend {
    volume: Arc<dyn BlockDevice>,
    params: Arc<DeviceParams>,
    num_queues: u16,
    queue_size: u16,
    mem: Gm,
    event_idx: AtomicBool,
    workers: Vec<Mutex<QueueWorker>>,
    /// Busy-poll the avail ring briefly after each batch (adaptive, at most 32 µs).
    poll: bool,
    /// The read ends of the exit events handed to the framework, closed when the device is
    /// dropped: see [`ExitEvents`].
    exit_events: ExitEvents,
}

/// vhost-user-backend 0.24 registers the consumer end of each worker thread's exit event with
/// `into_raw_fd()` and never closes it (event_loop.rs, `VringEpollHandler::new`), so every
/// connection would leak one eventfd per queue thread: a VM that reboots often, or a client
/// that reconnects, would run nacred out of descriptors. The device remembers those fds and
/// closes them once the framework's worker threads and epoll instances are gone, which is when
/// the last reference to the device (held by each worker's handler) is dropped.
/// Cargo.toml pins the framework's version because this depends on that behaviour.
#[derive(Default)]
struct ExitEvents(Mutex<Vec<std::os::unix::io::RawFd>>);

impl ExitEvents {
    fn make(&self) -> Option<(EventConsumer, EventNotifier)> {
        let (consumer, notifier) = new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()?;
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(consumer.as_raw_fd());
        Some((consumer, notifier))
    }
}

impl Drop for ExitEvents {
    fn drop(&mut self) {
        for fd in self
            .0
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            // SAFETY: `fd` is the consumer end we created in `make`; the framework turned it
            // into a raw fd it never closes, and every holder of it (the worker epoll
            // instances) is gone, because they hold the device this is part of.
            unsafe { libc::close(fd) };
        }
    }
}

impl BlkBackend {
    pub fn new(
        volume: Arc<dyn BlockDevice>,
        params: DeviceParams,
        num_queues: u16,
        queue_size: u16,
        mem: Gm,
    ) -> std::io::Result<Self> {
        let params = Arc::new(params);
        let workers = (0..num_queues)
            .map(|_| QueueWorker::new(volume.clone(), params.clone(), queue_size).map(Mutex::new))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(BlkBackend {
            volume,
            params,
            num_queues,
            queue_size,
            mem,
            event_idx: AtomicBool::new(false),
            workers,
            poll: std::env::var_os("NACRE_VHOST_NO_POLL").is_none(),
            exit_events: ExitEvents::default(),
        })
    }

    /// The epoll id of a queue thread's completion eventfd: just past the ids the framework
    /// reserves (queues and the exit event).
    pub fn completion_event_id(&self) -> u64 {
        u64::from(self.num_queues) + 1
    }

    /// The completion eventfd of queue `q`'s worker.
    pub fn completion_fd(&self, q: usize) -> std::os::unix::io::RawFd {
        use std::os::unix::io::AsRawFd;
        self.workers[q]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .completer()
            .event()
            .as_raw_fd()
    }

    fn config_space(&self) -> ConfigSpace {
        let geo = self.volume.geometry();
        ConfigSpace {
            capacity_sectors: geo.size >> spec::SECTOR_SHIFT,
            seg_max: self.params.seg_max,
            blk_size: geo.block_size,
            num_queues: self.num_queues,
        }
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringMutex<Gm>;

    fn num_queues(&self) -> usize {
        self.num_queues as usize
    }

    fn max_queue_size(&self) -> usize {
        self.queue_size as usize
    }

    fn features(&self) -> u64 {
        let mut f = bit(VIRTIO_F_VERSION_1)
            | bit(VIRTIO_RING_F_EVENT_IDX)
            // Long requests take one ring slot (virtio 1.2 §2.7.5.3); the queue worker walks
            // the indirect table itself, with its bounds checks (`queue.rs`).
            | bit(VIRTIO_RING_F_INDIRECT_DESC)
            | bit(vb::VIRTIO_BLK_F_SIZE_MAX)
            | bit(vb::VIRTIO_BLK_F_SEG_MAX)
            | bit(vb::VIRTIO_BLK_F_BLK_SIZE)
            | bit(vb::VIRTIO_BLK_F_FLUSH)
            | bit(vb::VIRTIO_BLK_F_DISCARD)
            | bit(vb::VIRTIO_BLK_F_WRITE_ZEROES)
            | bit(vb::VIRTIO_BLK_F_MQ)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if self.params.read_only {
            f |= bit(vb::VIRTIO_BLK_F_RO);
        }
        f
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let cfg = self.config_space().encode();
        let start = (offset as usize).min(cfg.len());
        let end = start.saturating_add(size as usize).min(cfg.len());
        let mut out = cfg[start..end].to_vec();
        // Reads past the fields nacre defines see zeros, as on a device without those
        // features.
        out.resize(size as usize, 0);
        out
    }

    fn update_memory(&self, _mem: Gm) -> std::io::Result<()> {
        // The framework swaps the mapping inside the GuestMemoryAtomic we already share;
        // each batch loads the current one.
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        // One worker thread per queue, so queues run in parallel.
        (0..self.num_queues).map(|q| 1u64 << q).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        // Without an exit event the framework could never stop the worker threads, and
        // dropping the daemon after a disconnect would hang joining them.
        self.exit_events.make()
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Self::Vring],
        thread_id: usize,
    ) -> std::io::Result<()> {
        if evset != EventSet::IN {
            return Ok(());
        }
        let (Some(vring), Some(worker)) = (vrings.first(), self.workers.get(thread_id)) else {
            return Ok(());
        };
        let mem = self.mem.memory().into_inner();
        let mut worker = worker.lock().unwrap_or_else(|p| p.into_inner());
        let mut state = vring.get_mut();
        let call = state.get_call().as_ref().map(|c| c.as_raw_fd());
        let notify = if u64::from(device_event) == self.completion_event_id() {
            worker.run_completions(state.get_queue_mut(), &mem)
        } else if self.poll {
            let current = || self.mem.memory().into_inner();
            worker.run_polling(state.get_queue_mut(), &current, call)
        } else {
            worker.run(state.get_queue_mut(), &mem)
        };
        if notify {
            signal(&state)?;
        }
        Ok(())
    }
}

fn signal(state: &VringState<Gm>) -> std::io::Result<()> {
    state.signal_used_queue()
}
