//! virtqueue: descriptor chains through the vhost-user-blk queue worker.

use std::sync::Arc;

use crate::frontend::vhost_user_blk::queue::{serial_bytes, QueueWorker};
use crate::frontend::vhost_user_blk::request::DeviceParams;
use crate::volume::ram::RamVolume;
use crate::volume::BlockDevice;

/// Queue size of the virtqueue target (a power of two).
pub const VQ_SIZE: u16 = 16;
/// Guest memory: two regions with a hole between them, so chains can straddle a hole.
pub const VQ_REGIONS: [(u64, usize); 2] = [(0, 0x1_0000), (0x2_0000, 0x8000)];
/// Where the rings lie (inside region 0, aligned as §2.7 requires).
pub const VQ_DESC: u64 = 0x0;
pub const VQ_AVAIL: u64 = 0x100;
pub const VQ_USED: u64 = 0x200;
/// Where the input's free-form bytes (headers, data, indirect tables) are copied.
pub const VQ_DATA: u64 = 0x1000;
/// Size of the volume behind the queue.
pub const VQ_VOLUME: u64 = 64 << 10;

/// One batch of descriptor chains through [`QueueWorker`] against a RAM volume.
///
/// Input: `flags` (bit 0 read-only device, bit 1 VIRTIO_F_EVENT_IDX, bits 4..8 `seg_max - 1`),
/// `avail_idx` (one byte), the avail ring's [`VQ_SIZE`] entries (le16 each), the descriptor
/// table ([`VQ_SIZE`] × 16 bytes, §2.7.5 layout), then bytes copied into guest memory at
/// [`VQ_DATA`] (request headers, data, status bytes, indirect tables). Short inputs are
/// zero-padded.
///
/// Checks: no panic; every available chain whose head is inside the queue is returned in
/// the used ring exactly once (completed, failed or dropped), and none stays in flight.
pub fn virtqueue(data: &[u8]) {
    use virtio_queue::{Queue, QueueT};
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    let fixed = 2 + 2 * VQ_SIZE as usize + 16 * VQ_SIZE as usize;
    let mut head = vec![0u8; fixed];
    let n = data.len().min(fixed);
    head[..n].copy_from_slice(&data[..n]);
    let rest = data.get(fixed..).unwrap_or(&[]);
    let flags = head[0];
    let avail_idx = u16::from(head[1]);
    let ring = &head[2..2 + 2 * VQ_SIZE as usize];
    let table = &head[2 + 2 * VQ_SIZE as usize..];

    let ranges: Vec<(GuestAddress, usize)> = VQ_REGIONS
        .iter()
        .map(|&(a, l)| (GuestAddress(a), l))
        .collect();
    let mem = Arc::new(GuestMemoryMmap::<()>::from_ranges(&ranges).expect("guest memory"));
    mem.write_slice(table, GuestAddress(VQ_DESC)).unwrap();
    mem.write_slice(ring, GuestAddress(VQ_AVAIL + 4)).unwrap();
    mem.write_obj(avail_idx.to_le(), GuestAddress(VQ_AVAIL + 2))
        .unwrap();
    let room = VQ_REGIONS[0].1 - VQ_DATA as usize;
    mem.write_slice(&rest[..rest.len().min(room)], GuestAddress(VQ_DATA))
        .unwrap();

    let mut queue = Queue::new(VQ_SIZE).expect("queue");
    queue.set_size(VQ_SIZE);
    queue.set_desc_table_address(Some(VQ_DESC as u32), Some(0));
    queue.set_avail_ring_address(Some(VQ_AVAIL as u32), Some(0));
    queue.set_used_ring_address(Some(VQ_USED as u32), Some(0));
    queue.set_event_idx(flags & 2 != 0);
    queue.set_ready(true);

    let vol: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(VQ_VOLUME, 512).expect("ram volume"));
    let params = Arc::new(DeviceParams {
        read_only: flags & 1 != 0,
        seg_max: u32::from(flags >> 4) + 1,
        serial: serial_bytes("nacre-fuzz").expect("serial"),
    });
    let mut worker = QueueWorker::new(vol, params, VQ_SIZE).expect("queue worker");
    worker.run(&mut queue, &mem);
    // A second kick with nothing new must change nothing.
    worker.run(&mut queue, &mem);

    assert_eq!(worker.in_flight(), 0, "a RAM volume completes inline");
    // A chain's device-writable buffers may lie over the avail ring itself (guest memory is
    // the guest's): the count below holds only when the ring still reads as written.
    let mut avail_now = vec![0u8; 2 + 2 * VQ_SIZE as usize];
    mem.read_slice(&mut avail_now, GuestAddress(VQ_AVAIL + 2))
        .unwrap();
    if avail_now[..2] != avail_idx.to_le_bytes() || avail_now[2..] != *ring {
        return;
    }
    let mut expect = 0u16;
    if avail_idx <= VQ_SIZE {
        for i in 0..avail_idx as usize {
            let h = u16::from_le_bytes([ring[2 * i], ring[2 * i + 1]]);
            if h < VQ_SIZE {
                expect += 1;
            }
        }
    }
    let used: u16 = u16::from_le(mem.read_obj(GuestAddress(VQ_USED + 2)).unwrap());
    assert_eq!(
        used, expect,
        "every chain with a head inside the queue is used exactly once"
    );
    assert_eq!(queue.next_used(), used);
}
