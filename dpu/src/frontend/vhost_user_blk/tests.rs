//! Request-level tests: descriptor chains crafted by hand in guest memory, driven through the real queue worker, with the status byte, the used
//! ring and the volume checked afterwards. These cover what no well-behaved client (libblkio,
//! Linux) would ever send.

use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::queue::{serial_bytes, QueueWorker, MAX_POLL_NS, SLEEP_IN_FLIGHT};
use super::request::{DeviceParams, Mem};
use super::spec::{self, S_IOERR, S_OK, S_UNSUPP};
use crate::volume::ram::RamVolume;
use crate::volume::{BlockDevice, IoCompletion, IoRequest};

const QSIZE: u16 = 16;
const MEM_SIZE: usize = 4 << 20;
/// Where crafted buffers live (the rings sit at the bottom of guest memory).
const HDR: u64 = 0x10_0000;
const DATA: u64 = 0x20_0000;
const STATUS: u64 = 0x3f_0000;
const VOL_SIZE: u64 = 1 << 20;
const SEG_MAX: u32 = 4;

#[derive(Clone, Copy)]
struct D {
    addr: u64,
    len: u32,
    writable: bool,
}

fn r(addr: u64, len: u32) -> D {
    D {
        addr,
        len,
        writable: false,
    }
}

fn w(addr: u64, len: u32) -> D {
    D {
        addr,
        len,
        writable: true,
    }
}

struct Harness {
    mem: Arc<Mem>,
    vol: Arc<dyn BlockDevice>,
    worker: QueueWorker,
    queue: Queue,
    desc_addr: u64,
    used_addr: u64,
    avail_addr: u64,
    chains: u16,
}

impl Harness {
    fn new(read_only: bool, block_size: u32) -> Self {
        let vol: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(VOL_SIZE, block_size).unwrap());
        Self::with_volume(vol, read_only)
    }

    fn with_volume(vol: Arc<dyn BlockDevice>, read_only: bool) -> Self {
        let mem =
            Arc::new(GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap());
        // The rings are laid out by hand: virtio-queue 0.18's MockSplitQueue places the
        // used ring over the tail of the avail ring (it measures the avail ring in entries,
        // not bytes), which would alias used_event with the used ring's flags.
        let (desc_addr, avail_addr, used_addr) = (0x0u64, 0x1000u64, 0x2000u64);
        let mut queue = Queue::new(QSIZE).unwrap();
        queue.set_size(QSIZE);
        queue.set_desc_table_address(Some(desc_addr as u32), Some(0));
        queue.set_avail_ring_address(Some(avail_addr as u32), Some(0));
        queue.set_used_ring_address(Some(used_addr as u32), Some(0));
        queue.set_ready(true);
        assert!(queue.is_valid(&*mem));
        let params = Arc::new(DeviceParams {
            read_only,
            seg_max: SEG_MAX,
            serial: serial_bytes("nacre-serial-0001").unwrap(),
        });
        let worker = QueueWorker::new(vol.clone(), params, QSIZE).unwrap();
        Harness {
            mem,
            vol,
            worker,
            queue,
            desc_addr,
            used_addr,
            avail_addr,
            chains: 0,
        }
    }

    fn header(&self, rtype: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&rtype.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(HDR)).unwrap();
    }

    /// Make one chain available (descriptors placed after the previous chains') and run the
    /// worker. Returns whether it asked to interrupt the driver.
    fn submit(&mut self, descs: &[D]) -> bool {
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let base = self.chains * 8 % QSIZE;
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let mut flags = if d.writable { VRING_DESC_F_WRITE } else { 0 } as u16;
                let mut next = 0;
                if i + 1 < descs.len() {
                    flags |= VRING_DESC_F_NEXT as u16;
                    next = base + i as u16 + 1;
                }
                RawDescriptor::from(SplitDescriptor::new(d.addr, d.len, flags, next))
            })
            .collect();
        for (i, d) in raw.iter().enumerate() {
            let a = self.desc_addr + 16 * u64::from(base + i as u16);
            self.mem.write_obj(*d, GuestAddress(a)).unwrap();
        }
        // avail ring: flags, idx, ring[]; publish the head, then the new index.
        let idx: u16 = self
            .mem
            .read_obj(GuestAddress(self.avail_addr + 2))
            .unwrap();
        let slot = self.avail_addr + 4 + 2 * u64::from(idx % QSIZE);
        self.mem.write_obj(base, GuestAddress(slot)).unwrap();
        self.mem
            .write_obj(idx.wrapping_add(1), GuestAddress(self.avail_addr + 2))
            .unwrap();
        self.chains += 1;
        self.worker.run(&mut self.queue, &self.mem)
    }

    /// Place raw descriptors (addr, len, flags, next) at table index `base` and make the chain
    /// starting at `head` available.
    fn submit_raw(&mut self, base: u16, head: u16, raw: &[(u64, u32, u16, u16)]) -> bool {
        for (i, &(addr, len, flags, next)) in raw.iter().enumerate() {
            let d = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
            let a = self.desc_addr + 16 * u64::from(base + i as u16);
            self.mem.write_obj(d, GuestAddress(a)).unwrap();
        }
        let idx: u16 = self
            .mem
            .read_obj(GuestAddress(self.avail_addr + 2))
            .unwrap();
        let slot = self.avail_addr + 4 + 2 * u64::from(idx % QSIZE);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.mem
            .write_obj(idx.wrapping_add(1), GuestAddress(self.avail_addr + 2))
            .unwrap();
        self.worker.run(&mut self.queue, &self.mem)
    }

    fn status(&self) -> u8 {
        self.mem.read_obj(GuestAddress(STATUS)).unwrap()
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(self.used_addr + 2)).unwrap()
    }

    /// (head, len) of used element `i`.
    fn used(&self, i: u16) -> (u32, u32) {
        let a = self.used_addr + 4 + 8 * u64::from(i % QSIZE);
        (
            self.mem.read_obj(GuestAddress(a)).unwrap(),
            self.mem.read_obj(GuestAddress(a + 4)).unwrap(),
        )
    }

    fn set_used_event(&self, v: u16) {
        let a = self.avail_addr + 4 + 2 * u64::from(QSIZE);
        self.mem.write_obj(v, GuestAddress(a)).unwrap();
    }

    /// Run one request and return (status, used length); asserts it was returned to the
    /// used ring exactly once.
    fn one(&mut self, descs: &[D]) -> (u8, u32) {
        let before = self.used_idx();
        self.submit(descs);
        assert_eq!(
            self.used_idx(),
            before.wrapping_add(1),
            "request not returned"
        );
        let (_, len) = self.used(before);
        (self.status(), len)
    }

    fn fill(&self, addr: u64, len: usize, byte: u8) {
        self.mem
            .write_slice(&vec![byte; len], GuestAddress(addr))
            .unwrap();
    }

    fn vol_bytes(&self, off: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.vol.read_at(off, &mut v).unwrap();
        v
    }
}

#[test]
fn read_and_write_round_trip() {
    let mut h = Harness::new(false, 512);
    h.fill(DATA, 4096, 0x5a);
    h.header(spec::T_OUT, 8);
    assert_eq!(h.one(&[r(HDR, 16), r(DATA, 4096), w(STATUS, 1)]), (S_OK, 1));
    assert!(h.vol_bytes(4096, 4096).iter().all(|&b| b == 0x5a));
    h.fill(DATA, 4096, 0);
    h.header(spec::T_IN, 8);
    // Two data segments of a read.
    assert_eq!(
        h.one(&[
            r(HDR, 16),
            w(DATA, 1024),
            w(DATA + 1024, 3072),
            w(STATUS, 1)
        ]),
        (S_OK, 4097)
    );
    let mut back = vec![0u8; 4096];
    h.mem.read_slice(&mut back, GuestAddress(DATA)).unwrap();
    assert!(back.iter().all(|&b| b == 0x5a));
}

#[test]
fn any_layout_header_split_and_status_inside_data_descriptor() {
    let mut h = Harness::new(false, 512);
    h.vol.write_at(0, &[0x33; 512]).unwrap();
    h.header(spec::T_IN, 0);
    // Header split 8 + 8; data and status share one writable descriptor.
    let data_and_status = STATUS - 512;
    h.fill(data_and_status, 512, 0);
    assert_eq!(
        h.one(&[r(HDR, 8), r(HDR + 8, 8), w(data_and_status, 513)]),
        (S_OK, 513)
    );
    let mut back = vec![0u8; 512];
    h.mem
        .read_slice(&mut back, GuestAddress(data_and_status))
        .unwrap();
    assert!(back.iter().all(|&b| b == 0x33));
    // A write whose data follows the header inside the same descriptor.
    h.header(spec::T_OUT, 1);
    h.fill(HDR + 16, 512, 0x44);
    assert_eq!(h.one(&[r(HDR, 16 + 512), w(STATUS, 1)]), (S_OK, 1));
    assert!(h.vol_bytes(512, 512).iter().all(|&b| b == 0x44));
}

#[test]
fn chain_without_writable_status_is_dropped_not_panicking() {
    let mut h = Harness::new(false, 512);
    h.header(spec::T_IN, 0);
    // Header only.
    let before = h.used_idx();
    h.submit(&[r(HDR, 16)]);
    assert_eq!(h.used_idx(), before.wrapping_add(1));
    assert_eq!(
        h.used(before).1,
        0,
        "dropped chains are returned with length 0"
    );
    assert_eq!(h.status(), 0xff, "nothing written");
    // Status descriptor device-readable.
    h.header(spec::T_OUT, 0);
    let (st, len) = h.one(&[r(HDR, 16), r(DATA, 512), r(STATUS, 1)]);
    assert_eq!((st, len), (0xff, 0));
    // Status descriptor of length 0.
    let (st, len) = h.one(&[r(HDR, 16), r(DATA, 512), w(STATUS, 0)]);
    assert_eq!((st, len), (0xff, 0));
    // Status byte outside guest memory.
    let (st, len) = h.one(&[r(HDR, 16), w(MEM_SIZE as u64 + 4096, 1)]);
    assert_eq!((st, len), (0xff, 0));
    assert!(h.vol_bytes(0, 512).iter().all(|&b| b == 0));
}

#[test]
fn short_header_and_wrong_directions_fail_with_ioerr() {
    let mut h = Harness::new(false, 512);
    h.header(spec::T_IN, 0);
    // Header shorter than 16 bytes.
    assert_eq!(
        h.one(&[r(HDR, 8), w(DATA, 512), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    // Read whose data buffer is device-readable.
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, 512), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    // Write whose data buffer is device-writable: must not be written to the volume.
    h.header(spec::T_OUT, 0);
    h.fill(DATA, 512, 0x77);
    assert_eq!(
        h.one(&[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    // A readable descriptor after a writable one.
    assert_eq!(
        h.one(&[r(HDR, 16), w(DATA, 512), r(DATA + 512, 512), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    // Read with no data at all.
    h.header(spec::T_IN, 0);
    assert_eq!(h.one(&[r(HDR, 16), w(STATUS, 1)]), (S_IOERR, 1));
    assert!(h.vol_bytes(0, 512).iter().all(|&b| b == 0));
}

/// A data segment longer than the advertised size_max fails the request (a driver that
/// ignores it could otherwise claim ~4 GiB per descriptor); the same bytes in segments
/// within it are served.
#[test]
fn segments_beyond_size_max_fail_with_ioerr() {
    let vol: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(4 << 20, 4096).unwrap());
    let mut h = Harness::with_volume(vol, false);
    let max = spec::SIZE_MAX;
    h.header(spec::T_IN, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), w(DATA, max + 4096), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    h.header(spec::T_OUT, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, max + 4096), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    h.header(spec::T_IN, 0);
    assert_eq!(
        h.one(&[
            r(HDR, 16),
            w(DATA, max),
            w(DATA + u64::from(max), 4096),
            w(STATUS, 1)
        ]),
        (S_OK, max + 4096 + 1)
    );
}

#[test]
fn out_of_range_oversize_and_unaligned_fail_with_ioerr() {
    let mut h = Harness::new(false, 4096);
    let last_sector = VOL_SIZE / 512;
    // Starts at the end.
    h.header(spec::T_IN, last_sector);
    assert_eq!(
        h.one(&[r(HDR, 16), w(DATA, 4096), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    // Straddles the end.
    h.header(spec::T_IN, last_sector - 8);
    assert_eq!(
        h.one(&[r(HDR, 16), w(DATA, 8192), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    // sector * 512 overflows u64.
    h.header(spec::T_IN, u64::MAX / 256);
    assert_eq!(
        h.one(&[r(HDR, 16), w(DATA, 4096), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    // Too many segments (seg_max is 4).
    h.header(spec::T_OUT, 0);
    let segs: Vec<D> = std::iter::once(r(HDR, 16))
        .chain((0..5).map(|i| r(DATA + i * 4096, 4096)))
        .chain(std::iter::once(w(STATUS, 1)))
        .collect();
    assert_eq!(h.one(&segs), (S_IOERR, 1));
    // Not a multiple of 512 bytes.
    h.header(spec::T_IN, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), w(DATA, 100), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    // A multiple of 512 but not of the 4096-byte block size, and a misaligned sector.
    assert_eq!(
        h.one(&[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    h.header(spec::T_OUT, 1);
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, 4096), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    // Data buffer outside guest memory.
    h.header(spec::T_IN, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), w(MEM_SIZE as u64 - 2048, 4096), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    assert!(h.vol_bytes(0, 8192).iter().all(|&b| b == 0));
}

fn dwz(h: &Harness, addr: u64, sector: u64, num: u32, flags: u32) {
    let mut s = [0u8; 16];
    s[0..8].copy_from_slice(&sector.to_le_bytes());
    s[8..12].copy_from_slice(&num.to_le_bytes());
    s[12..16].copy_from_slice(&flags.to_le_bytes());
    h.mem.write_slice(&s, GuestAddress(addr)).unwrap();
}

#[test]
fn discard_and_write_zeroes_are_validated_and_zero_the_range() {
    let mut h = Harness::new(false, 4096);
    h.vol.write_at(0, &vec![0xabu8; 65536]).unwrap();
    // Write zeroes over 16 KiB at 8 KiB, with unmap allowed.
    h.header(spec::T_WRITE_ZEROES, 0);
    dwz(&h, DATA, 16, 32, spec::DWZ_FLAG_UNMAP);
    assert_eq!(h.one(&[r(HDR, 16), r(DATA, 16), w(STATUS, 1)]), (S_OK, 1));
    let v = h.vol_bytes(0, 65536);
    assert!(v[..8192].iter().all(|&b| b == 0xab));
    assert!(v[8192..24576].iter().all(|&b| b == 0));
    assert!(v[24576..].iter().all(|&b| b == 0xab));
    // Discard of 4 KiB at 32 KiB.
    h.header(spec::T_DISCARD, 0);
    dwz(&h, DATA, 64, 8, 0);
    assert_eq!(h.one(&[r(HDR, 16), r(DATA, 16), w(STATUS, 1)]), (S_OK, 1));
    assert!(h.vol_bytes(32768, 4096).iter().all(|&b| b == 0));
    // Discard with unmap, and unknown flags: UNSUPP (§5.2.6.2).
    dwz(&h, DATA, 0, 8, spec::DWZ_FLAG_UNMAP);
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, 16), w(STATUS, 1)]),
        (S_UNSUPP, 1)
    );
    h.header(spec::T_WRITE_ZEROES, 0);
    dwz(&h, DATA, 0, 8, 0x4);
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, 16), w(STATUS, 1)]),
        (S_UNSUPP, 1)
    );
    // Two segments (max_write_zeroes_seg is 1), a truncated segment, no segment.
    dwz(&h, DATA, 0, 8, 0);
    dwz(&h, DATA + 16, 8, 8, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, 32), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, 15), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    assert_eq!(h.one(&[r(HDR, 16), w(STATUS, 1)]), (S_IOERR, 1));
    // Beyond the end, more than max_write_zeroes_sectors, unaligned to the block size.
    dwz(&h, DATA, VOL_SIZE / 512 - 8, 16, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, 16), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    dwz(&h, DATA, 0, spec::MAX_DWZ_SECTORS + 8, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, 16), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    dwz(&h, DATA, 1, 8, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, 16), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    // Segment in a writable descriptor.
    dwz(&h, DATA, 0, 8, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), w(DATA, 16), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    assert!(h.vol_bytes(0, 8192).iter().all(|&b| b == 0xab));
}

#[test]
fn read_only_device_fails_writes_with_ioerr_and_writes_nothing() {
    let mut h = Harness::new(true, 512);
    h.fill(DATA, 4096, 0x11);
    h.header(spec::T_OUT, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, 4096), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    h.header(spec::T_WRITE_ZEROES, 0);
    dwz(&h, DATA + 8192, 0, 8, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA + 8192, 16), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    h.header(spec::T_DISCARD, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA + 8192, 16), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    assert!(h.vol_bytes(0, 4096).iter().all(|&b| b == 0));
    // Reads and flushes still work.
    h.header(spec::T_IN, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), w(DATA, 4096), w(STATUS, 1)]),
        (S_OK, 4097)
    );
    h.header(spec::T_FLUSH, 0);
    assert_eq!(h.one(&[r(HDR, 16), w(STATUS, 1)]), (S_OK, 1));
}

#[test]
fn get_id_returns_the_serial_and_unknown_types_are_unsupported() {
    let mut h = Harness::new(false, 512);
    h.fill(DATA, 64, 0xcc);
    h.header(spec::T_GET_ID, 0);
    assert_eq!(h.one(&[r(HDR, 16), w(DATA, 20), w(STATUS, 1)]), (S_OK, 21));
    let mut id = [0u8; 21];
    h.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id[..17], b"nacre-serial-0001");
    assert_eq!(&id[17..20], &[0, 0, 0], "NUL padded");
    assert_eq!(id[20], 0xcc, "nothing written past 20 bytes");
    // A GET_ID with a readable data buffer.
    assert_eq!(
        h.one(&[r(HDR, 16), r(DATA, 20), w(STATUS, 1)]),
        (S_IOERR, 1)
    );
    for t in [2u32, 3, 10, 14, 15, 16, 99, 0x8000_0000] {
        h.header(t, 0);
        assert_eq!(
            h.one(&[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]),
            (S_UNSUPP, 1),
            "type {t}"
        );
    }
}

/// A volume that completes every request later, from another thread, as a remote backend
/// would.
type Handoff = (IoRequest, Arc<dyn IoCompletion>);

struct LaterVolume {
    inner: RamVolume,
    tx: Mutex<mpsc::Sender<Handoff>>,
}

impl LaterVolume {
    fn new() -> (Arc<Self>, mpsc::Receiver<Handoff>) {
        let (tx, rx) = mpsc::channel();
        (
            Arc::new(LaterVolume {
                inner: RamVolume::new(VOL_SIZE, 512).unwrap(),
                tx: Mutex::new(tx),
            }),
            rx,
        )
    }
}

// SAFETY: the test that receives a held request submits it to the inner RAM volume with its
// completion, so the segments are used no later than that completion.
unsafe impl BlockDevice for LaterVolume {
    fn geometry(&self) -> crate::volume::Geometry {
        self.inner.geometry()
    }
    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        self.tx.lock().unwrap().send((req, done.clone())).unwrap();
    }
}

/// Two 512-byte writes of `byte`, submitted to a volume that completes them only when told;
/// the harness, the volume, the receiver of later hand-offs and the two hand-offs.
fn two_writes_in_flight(
    byte: u8,
) -> (
    Harness,
    Arc<LaterVolume>,
    mpsc::Receiver<Handoff>,
    Handoff,
    Handoff,
) {
    let (vol, rx) = LaterVolume::new();
    let mut h = Harness::with_volume(vol.clone(), false);
    h.fill(DATA, 512, byte);
    h.header(spec::T_OUT, 0);
    // (the harness places two chains' descriptors apart in its 16-entry table)
    for _ in 0..2 {
        assert!(!h.submit(&[r(HDR, 16), r(DATA, 512), w(STATUS, 1)]));
    }
    assert_eq!(h.worker.in_flight(), 2);
    let (a, b) = (rx.recv().unwrap(), rx.recv().unwrap());
    (h, vol, rx, a, b)
}

/// Complete a held request from another thread, as a remote volume's receive thread does.
fn complete_on_other_thread(vol: &Arc<LaterVolume>, (req, done): Handoff) {
    let v = vol.clone();
    std::thread::spawn(move || v.inner.submit(req, &done))
        .join()
        .unwrap();
}

/// A volume that holds each request until the worker's plug closes, then completes it there,
/// on the worker's thread (as a remote volume would if its batched send failed at once).
struct AtUnplugVolume {
    inner: RamVolume,
    held: Mutex<Vec<Handoff>>,
    me: std::sync::Weak<AtUnplugVolume>,
}

// SAFETY: a held request goes to the inner RAM volume, with its completion, when the plug
// closes.
unsafe impl BlockDevice for AtUnplugVolume {
    fn geometry(&self) -> crate::volume::Geometry {
        self.inner.geometry()
    }
    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        self.held.lock().unwrap().push((req, done.clone()));
        let me: Arc<dyn crate::volume::plug::Unplug> = self.me.upgrade().unwrap();
        assert!(
            crate::volume::plug::defer(&me),
            "the worker submits inside a plug"
        );
    }
}

impl crate::volume::plug::Unplug for AtUnplugVolume {
    fn unplug(&self) {
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        for (req, done) in held {
            self.inner.submit(req, &done);
        }
    }
}

#[test]
fn a_completion_delivered_as_the_plug_closes_is_published_in_the_same_pass() {
    let vol = Arc::new_cyclic(|me| AtUnplugVolume {
        inner: RamVolume::new(VOL_SIZE, 512).unwrap(),
        held: Mutex::new(Vec::new()),
        me: me.clone(),
    });
    let mut h = Harness::with_volume(vol.clone(), false);
    h.fill(DATA, 512, 0x6b);
    h.header(spec::T_OUT, 0);
    let (status, len) = h.one(&[r(HDR, 16), r(DATA, 512), w(STATUS, 1)]);
    assert_eq!((status, len), (S_OK, 1));
    assert_eq!(h.worker.in_flight(), 0);
    let mut back = [0u8; 512];
    vol.inner.read_at(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x6b));
}

/// Completions that arrive from another thread while the worker has not drained yet wake it
/// once (one eventfd write), and it publishes them all; the next completion after that drain
/// wakes it again.
#[test]
fn completions_from_another_thread_wake_the_worker_once_per_batch() {
    let (mut h, vol, rx, a, b) = two_writes_in_flight(0x5a);
    complete_on_other_thread(&vol, a);
    complete_on_other_thread(&vol, b);
    assert_eq!(
        h.worker.completer().event().read().unwrap(),
        1,
        "two completions, one wake-up"
    );
    h.worker.run_completions(&mut h.queue, &h.mem);
    assert_eq!(h.used_idx(), 2);
    assert_eq!(h.worker.in_flight(), 0);
    // Drained: the next completion wakes the worker again.
    assert!(!h.submit(&[r(HDR, 16), r(DATA, 512), w(STATUS, 1)]));
    complete_on_other_thread(&vol, rx.recv().unwrap());
    assert_eq!(h.worker.completer().event().read().unwrap(), 1);
    h.worker.run_completions(&mut h.queue, &h.mem);
    assert_eq!(h.used_idx(), 3);
    assert_eq!(h.worker.in_flight(), 0);
    assert_eq!(h.status(), S_OK);
    let mut back = [0u8; 512];
    vol.inner.read_at(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x5a));
}

/// While the worker is awake (mid-pass or polling) a completion from another thread writes no
/// eventfd: the worker drains it itself. One the worker has not drained when it goes back to
/// sleep gets its wake-up written then, so it is never left behind.
#[test]
fn completions_while_the_worker_is_awake_skip_the_eventfd_and_are_never_left_behind() {
    let (mut h, vol, _rx, a, b) = two_writes_in_flight(0x3c);
    // Awake and draining: no wake-up written, and nothing left over after the drain.
    h.worker.completer().wake_up();
    complete_on_other_thread(&vol, a);
    assert!(
        h.worker.completer().event().read().is_err(),
        "an awake worker was sent a wake-up"
    );
    h.worker.run_completions(&mut h.queue, &h.mem);
    assert_eq!(h.used_idx(), 1);
    assert!(
        h.worker.completer().event().read().is_err(),
        "a drained worker wrote itself a wake-up"
    );
    // Awake but going to sleep before draining: the worker writes the wake-up itself.
    h.worker.completer().wake_up();
    complete_on_other_thread(&vol, b);
    assert!(h.worker.completer().event().read().is_err());
    h.worker.completer().fall_asleep();
    assert_eq!(
        h.worker.completer().event().read().unwrap(),
        1,
        "a completion was left behind when the worker slept"
    );
    h.worker.run_completions(&mut h.queue, &h.mem);
    assert_eq!(h.used_idx(), 2);
    assert_eq!(h.worker.in_flight(), 0);
}

#[test]
fn completions_from_another_thread_are_published_with_event_idx() {
    let (vol, rx) = LaterVolume::new();
    let mut h = Harness::with_volume(vol.clone(), false);
    h.queue.set_event_idx(true);
    // The driver wants an interrupt once the first used entry is published.
    h.set_used_event(0);
    h.fill(DATA, 512, 0x21);
    h.header(spec::T_OUT, 0);
    let notify = h.submit(&[r(HDR, 16), r(DATA, 512), w(STATUS, 1)]);
    assert!(!notify, "nothing completed yet");
    assert_eq!(h.used_idx(), 0);
    assert_eq!(h.worker.in_flight(), 1);
    let (req, done) = rx.recv().unwrap();
    let completer = vol.clone();
    std::thread::spawn(move || {
        let inner: Arc<dyn IoCompletion> = done;
        completer.inner.submit(req, &inner);
    })
    .join()
    .unwrap();
    assert_eq!(
        h.worker.completer().event().read().unwrap(),
        1,
        "worker woken"
    );
    h.worker.completer().event().write(1).unwrap();
    let notify = h.worker.run_completions(&mut h.queue, &h.mem);
    assert!(notify, "used_event 0 was crossed");
    assert_eq!(h.used_idx(), 1);
    assert_eq!(h.status(), S_OK);
    assert_eq!(h.worker.in_flight(), 0);
    let mut back = [0u8; 512];
    vol.inner.read_at(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x21));
}

#[test]
fn event_idx_suppresses_interrupts_until_used_event_is_crossed() {
    let mut h = Harness::new(false, 512);
    h.queue.set_event_idx(true);
    h.header(spec::T_FLUSH, 0);
    // Driver asks to be interrupted when entry 2 is used (after the third completion).
    h.set_used_event(2);
    assert!(
        !h.submit(&[r(HDR, 16), w(STATUS, 1)]),
        "entry 0: no interrupt"
    );
    assert!(
        !h.submit(&[r(HDR, 16), w(STATUS, 1)]),
        "entry 1: no interrupt"
    );
    assert!(h.submit(&[r(HDR, 16), w(STATUS, 1)]), "entry 2: interrupt");
    assert!(!h.submit(&[r(HDR, 16), w(STATUS, 1)]), "entry 3: past it");
    // The device re-armed kicks: avail_event equals the next index it will look at.
    let avail_event: u16 = h
        .mem
        .read_obj(GuestAddress(h.used_addr + 4 + 8 * u64::from(QSIZE)))
        .unwrap();
    assert_eq!(avail_event, 4);
    // Without EVENT_IDX every batch that used something interrupts.
    let mut h = Harness::new(false, 512);
    h.header(spec::T_FLUSH, 0);
    assert!(h.submit(&[r(HDR, 16), w(STATUS, 1)]));
    assert!(h.submit(&[r(HDR, 16), w(STATUS, 1)]));
}

#[test]
fn looping_indirect_and_out_of_table_chains_are_dropped() {
    let mut h = Harness::new(false, 512);
    h.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    h.header(spec::T_IN, 0);
    let next = VRING_DESC_F_NEXT as u16;
    let write = VRING_DESC_F_WRITE as u16;
    // A chain whose last descriptor points back to the first: must not spin forever.
    h.submit_raw(0, 0, &[(HDR, 16, next, 1), (DATA, 512, write | next, 0)]);
    assert_eq!(h.used_idx(), 1);
    assert_eq!(h.used(0), (0, 0));
    // An indirect descriptor that also has NEXT set (§2.7.5.3.1 forbids it).
    h.submit_raw(
        4,
        4,
        &[(
            HDR,
            16,
            virtio_bindings::bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16 | next,
            5,
        )],
    );
    assert_eq!(h.used(1), (4, 0));
    // A next index beyond the queue.
    h.submit_raw(6, 6, &[(HDR, 16, next, QSIZE + 3)]);
    assert_eq!(h.used(2), (6, 0));
    // An available head beyond the queue is skipped (it cannot be returned).
    h.submit_raw(8, QSIZE + 1, &[]);
    assert_eq!(h.used_idx(), 3);
    assert_eq!(h.status(), 0xff, "no status written for any of them");
    // The queue still works afterwards.
    h.vol.write_at(0, &[0x42; 512]).unwrap();
    h.submit_raw(
        10,
        10,
        &[
            (HDR, 16, next, 11),
            (DATA, 512, write | next, 12),
            (STATUS, 1, write, 0),
        ],
    );
    assert_eq!(h.used_idx(), 4);
    assert_eq!(h.used(3), (10, 513));
    assert_eq!(h.status(), S_OK);
}

/// A driver adds a memory region and, once that is acknowledged, makes a request with
/// buffers in it available while the worker is already running: the worker must translate it
/// with the new table, not the one it started with. (A stale table made such requests drop
/// without a status byte, which a client whose status byte happened to be 0 took as success.)
#[test]
fn memory_table_swapped_during_a_run_is_used_for_later_chains() {
    let mut h = Harness::new(false, 512);
    let extra = 0x100_0000u64;
    let region =
        vm_memory::GuestRegionMmap::<()>::from_range(GuestAddress(extra), 1 << 20, None).unwrap();
    let bigger = Arc::new(h.mem.insert_region(Arc::new(region)).unwrap());
    h.vol.write_at(0, &[0x6d; 512]).unwrap();
    h.header(spec::T_IN, 0);
    // Make the chain available (through the original table, which holds the rings).
    let next = VRING_DESC_F_NEXT as u16;
    let write = VRING_DESC_F_WRITE as u16;
    for (i, &(addr, len, flags, nx)) in [
        (HDR, 16, next, 1),
        (extra, 512, write | next, 2),
        (extra + 512, 1, write, 0),
    ]
    .iter()
    .enumerate()
    {
        let d = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, nx));
        h.mem
            .write_obj(d, GuestAddress(h.desc_addr + 16 * i as u64))
            .unwrap();
    }
    h.mem
        .write_obj(0u16, GuestAddress(h.avail_addr + 4))
        .unwrap();
    h.mem
        .write_obj(1u16, GuestAddress(h.avail_addr + 2))
        .unwrap();
    // The first look at the table still sees the old one; every later look the new one.
    let calls = std::cell::Cell::new(0);
    let old = h.mem.clone();
    let current = || {
        calls.set(calls.get() + 1);
        if calls.get() == 1 {
            old.clone()
        } else {
            bigger.clone()
        }
    };
    h.worker.run_polling(&mut h.queue, &current, None);
    assert_eq!(h.used_idx(), 1);
    assert_eq!(h.used(0), (0, 513), "served, not dropped");
    let mut back = [0u8; 513];
    bigger.read_slice(&mut back, GuestAddress(extra)).unwrap();
    assert!(back[..512].iter().all(|&b| b == 0x6d));
    assert_eq!(back[512], S_OK);
}

/// A RAM volume that records, for each data segment it is handed, whether the segment lies
/// in memory announced to `volume::dma`.
struct DmaProbe {
    inner: RamVolume,
    seen: Mutex<Vec<bool>>,
}

// SAFETY: only looks the segments' addresses up, then hands the request to the inner volume.
unsafe impl BlockDevice for DmaProbe {
    fn geometry(&self) -> crate::volume::Geometry {
        self.inner.geometry()
    }
    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let mut seen = self.seen.lock().unwrap();
        for s in req.segments.iter() {
            seen.push(crate::volume::dma::lookup(s.as_ptr(), s.len()).is_some());
        }
        drop(seen);
        self.inner.submit(req, done)
    }
}

#[test]
fn guest_memory_is_announced_for_direct_access_while_mapped() {
    let probe = Arc::new(DmaProbe {
        inner: RamVolume::new(VOL_SIZE, 512).unwrap(),
        seen: Mutex::new(Vec::new()),
    });
    let mut h = Harness::with_volume(probe.clone(), false);
    h.fill(DATA, 8192, 0x42);
    h.header(spec::T_OUT, 0);
    assert_eq!(
        h.one(&[
            r(HDR, 16),
            r(DATA, 4096),
            r(DATA + 4096, 4096),
            w(STATUS, 1)
        ]),
        (S_OK, 1)
    );
    h.header(spec::T_IN, 0);
    assert_eq!(
        h.one(&[r(HDR, 16), w(DATA, 8192), w(STATUS, 1)]),
        (S_OK, 8193)
    );
    assert_eq!(*probe.seen.lock().unwrap(), vec![true, true, true]);
    // The whole table is one region; it is withdrawn with the worker's map.
    let host = vm_memory::GuestMemoryBackend::get_host_address(&*h.mem, GuestAddress(0)).unwrap();
    let region = crate::volume::dma::lookup(host, MEM_SIZE).expect("announced");
    assert_eq!(region.len(), MEM_SIZE);
    drop(h);
    assert!(crate::volume::dma::lookup(host, MEM_SIZE).is_none());
}

/// Where the indirect tables of the test below live in guest memory.
const TABLE: u64 = 0x30_0000;

/// A descriptor as the driver writes it: (addr, len, flags, next).
type RawDesc = (u64, u32, u16, u16);

fn write_table(h: &Harness, at: u64, raw: &[RawDesc]) {
    for (i, &(addr, len, flags, next)) in raw.iter().enumerate() {
        let d = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
        h.mem
            .write_obj(d, GuestAddress(at + 16 * i as u64))
            .unwrap();
    }
}

/// VIRTIO_RING_F_INDIRECT_DESC is offered: Linux puts a whole request in an indirect table
/// (one ring slot however many segments), and the device walks it. Malformed tables — nested
/// indirect, a loop, a bad length, a table outside guest memory, an indirect descriptor after
/// the head — are dropped without a status byte and the queue keeps working.
#[test]
fn indirect_tables_carry_whole_requests_and_malformed_ones_are_dropped() {
    use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_INDIRECT;
    let ind = VRING_DESC_F_INDIRECT as u16;
    let next = VRING_DESC_F_NEXT as u16;
    let write = VRING_DESC_F_WRITE as u16;
    let mut h = Harness::new(false, 512);
    h.vol.write_at(1024, &[0x5a; 1024]).unwrap();
    h.header(spec::T_IN, 2);
    // A read of two sectors in two segments, all inside one table.
    write_table(
        &h,
        TABLE,
        &[
            (HDR, 16, next, 1),
            (DATA, 512, write | next, 2),
            (DATA + 512, 512, write | next, 3),
            (STATUS, 1, write, 0),
        ],
    );
    h.submit_raw(0, 0, &[(TABLE, 64, ind, 0)]);
    assert_eq!(h.used(0), (0, 1025));
    assert_eq!(h.status(), S_OK);
    let mut got = [0u8; 1024];
    h.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(got, [0x5a; 1024]);

    h.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    let bad: [(&str, u64, u32, &[RawDesc]); 4] = [
        (
            "nested",
            TABLE + 0x100,
            32,
            &[(HDR, 16, next, 1), (TABLE, 64, ind, 0)],
        ),
        (
            "loop",
            TABLE + 0x200,
            32,
            &[(HDR, 16, next, 1), (DATA, 512, write | next, 0)],
        ),
        (
            "next beyond table",
            TABLE + 0x300,
            32,
            &[(HDR, 16, next, 5), (STATUS, 1, write, 0)],
        ),
        (
            "length not a multiple of 16",
            TABLE + 0x400,
            40,
            &[(HDR, 16, next, 1), (STATUS, 1, write, 0)],
        ),
    ];
    let mut used = 1;
    for (what, at, len, table) in bad {
        write_table(&h, at, table);
        h.submit_raw(2, 2, &[(at, len, ind, 0)]);
        assert_eq!(h.used_idx(), used + 1, "{what}");
        assert_eq!(h.used(used), (2, 0), "{what}: dropped, nothing written");
        used += 1;
    }
    // A table outside guest memory, and an indirect descriptor after a direct one.
    h.submit_raw(2, 2, &[(MEM_SIZE as u64 - 16, 64, ind, 0)]);
    assert_eq!(h.used(used), (2, 0));
    h.submit_raw(3, 3, &[(HDR, 16, next, 4), (TABLE, 64, ind, 0)]);
    assert_eq!(h.used(used + 1), (3, 0));
    assert_eq!(
        h.status(),
        0xff,
        "no status written for any malformed chain"
    );
    // The queue still works.
    h.submit_raw(5, 5, &[(TABLE, 64, ind, 0)]);
    assert_eq!(h.used(used + 2), (5, 1025));
    assert_eq!(h.status(), S_OK);
}

/// Seeded random requests through the real queue worker: mostly well-formed chains (header,
/// data segments, status; in the descriptor table or an indirect table) with one field
/// broken now and then, and a quarter of fully random tables. Whatever the driver writes: no
/// panic or endless loop; each available head inside the queue comes back on the used ring
/// exactly once; the device writes guest memory only inside buffers marked device-writable
/// (and the used ring); a read-only device's volume never changes; a write changes the volume
/// only inside the range its header names; an intact, valid request succeeds.
/// NACRE_FUZZ_CASES=N runs more cases.
#[test]
fn random_descriptor_chains_never_write_outside_their_buffers() {
    use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_INDIRECT;
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn chance(&mut self, one_in: u64) -> bool {
            self.below(one_in) == 0
        }
    }
    /// Offsets of the bytes that differ, comparing 4 KiB at a time first (this runs
    /// unoptimised).
    fn changed(a: &[u8], b: &[u8]) -> Vec<u64> {
        let mut out = Vec::new();
        for (k, (x, y)) in a.chunks(4096).zip(b.chunks(4096)).enumerate() {
            if x != y {
                out.extend(
                    (0..x.len())
                        .filter(|&i| x[i] != y[i])
                        .map(|i| (k * 4096 + i) as u64),
                );
            }
        }
        out
    }
    /// Any descriptor at all, fields near interesting values.
    fn chaotic(rng: &mut Rng, table_len: u64, allow_indirect: bool) -> RawDesc {
        let addr = match rng.below(8) {
            0..=2 => HDR + 0x100 * rng.below(4) + rng.below(3) * 8,
            3 | 4 => DATA + rng.below(16) * 512,
            5 => STATUS,
            6 => MEM_SIZE as u64 - rng.below(1024),
            _ => rng.next(),
        };
        let len = match rng.below(7) {
            0 => 0,
            1 => 1,
            2 => 16,
            3 => rng.next() as u32,
            _ => 512 * rng.below(9) as u32 + rng.below(3) as u32,
        };
        let mut flags = 0u16;
        if !rng.chance(3) {
            flags |= VRING_DESC_F_NEXT as u16;
        }
        if rng.chance(2) {
            flags |= VRING_DESC_F_WRITE as u16;
        }
        let (addr, len) = if allow_indirect && rng.chance(6) {
            flags |= VRING_DESC_F_INDIRECT as u16;
            (TABLE, 16 * (1 + rng.below(N_INDIRECT as u64)) as u32)
        } else {
            (addr, len)
        };
        let next = if rng.chance(8) {
            rng.next() as u16
        } else {
            rng.below(table_len) as u16
        };
        (addr, len, flags, next)
    }
    const N_INDIRECT: usize = 8;
    let cases: u64 = std::env::var("NACRE_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(400);
    let next_f = VRING_DESC_F_NEXT as u16;
    let write_f = VRING_DESC_F_WRITE as u16;
    let pattern: Vec<u8> = (0..VOL_SIZE as usize).map(|i| (i * 13 + 1) as u8).collect();
    let mut rng = Rng(0x7669_7274_696f_2121);
    let mut succeeded = 0u64;
    for case in 0..cases {
        let read_only = rng.chance(2);
        let mut h = Harness::new(read_only, 512);
        h.vol.write_at(0, &pattern).unwrap();
        // Guest memory above the rings: a pattern no header type decodes from.
        h.fill(0x4000, MEM_SIZE - 0x4000, 0xa5);
        let mut table: Vec<RawDesc> = vec![(0, 0, 0, 0); QSIZE as usize];
        let mut indirect: Vec<RawDesc> = vec![(0, 0, 0, 0); N_INDIRECT];
        let mut heads = Vec::new();
        // Per head: (status address, whether the request is intact and valid, so must
        // succeed).
        let mut statuses = Vec::new();
        let mut write_ranges = Vec::new();
        if rng.chance(4) {
            for d in table.iter_mut() {
                *d = chaotic(&mut rng, u64::from(QSIZE), true);
            }
            for d in indirect.iter_mut() {
                // Nested indirect is forbidden (§2.7.5.3.1); offer it now and then.
                let nested = rng.chance(8);
                *d = chaotic(&mut rng, N_INDIRECT as u64, nested);
            }
            for _ in 0..1 + rng.below(4) {
                heads.push(if rng.chance(10) {
                    rng.next() as u16
                } else {
                    rng.below(u64::from(QSIZE)) as u16
                });
            }
        }
        let mut slot = 0usize;
        let mut indirect_used = false;
        let mut broken_before = false;
        for c in 0..if heads.is_empty() {
            1 + rng.below(3)
        } else {
            0
        } {
            let hdr_addr = HDR + 0x100 * c;
            let status_addr = STATUS + 16 * c;
            let data_base = DATA + 0x8000 * c;
            let t = match rng.below(8) {
                0 | 1 => spec::T_IN,
                2 | 3 => spec::T_OUT,
                4 => spec::T_FLUSH,
                5 => spec::T_GET_ID,
                6 if read_only => spec::T_DISCARD,
                6 => spec::T_IN,
                _ => rng.next() as u32,
            };
            let blocks = VOL_SIZE / 512;
            let sector = match rng.below(6) {
                0 => rng.next(),
                1 => blocks - rng.below(4),
                _ => rng.below(blocks),
            };
            let mut hdr = [0u8; 16];
            hdr[0..4].copy_from_slice(&t.to_le_bytes());
            hdr[8..16].copy_from_slice(&sector.to_le_bytes());
            h.mem.write_slice(&hdr, GuestAddress(hdr_addr)).unwrap();
            // (addr, len, device-writable)
            let mut descs: Vec<(u64, u32, bool)> = vec![(hdr_addr, 16, false)];
            let n_data = match t {
                spec::T_FLUSH => 0,
                spec::T_GET_ID => 1,
                _ => rng.below(u64::from(SEG_MAX) + 2),
            };
            let mut total = 0u64;
            for _ in 0..n_data {
                let len = if t == spec::T_GET_ID {
                    20
                } else {
                    512 * (1 + rng.below(4)) as u32
                };
                descs.push((data_base + total, len, t != spec::T_OUT));
                total += u64::from(len);
            }
            descs.push((status_addr, 1, true));
            let mutated = rng.chance(4);
            if mutated {
                let i = rng.below(descs.len() as u64) as usize;
                let d = &mut descs[i];
                match rng.below(4) {
                    0 => d.0 = chaotic(&mut rng, 1, false).0,
                    1 => d.1 = chaotic(&mut rng, 1, false).1,
                    2 => d.2 = !d.2,
                    _ => {
                        descs.remove(i);
                    }
                }
            }
            let raw = |i: usize, d: &(u64, u32, bool), last: bool, base: usize| -> RawDesc {
                let mut flags = if d.2 { write_f } else { 0 };
                if !last {
                    flags |= next_f;
                }
                (d.0, d.1, flags, (base + i + 1) as u16)
            };
            let head;
            if !indirect_used && descs.len() <= N_INDIRECT && rng.chance(4) {
                indirect_used = true;
                for (i, d) in descs.iter().enumerate() {
                    indirect[i] = raw(i, d, i + 1 == descs.len(), 0);
                }
                if slot >= table.len() {
                    break;
                }
                let len = 16 * descs.len() as u32;
                table[slot] = (TABLE, len, VRING_DESC_F_INDIRECT as u16, 0);
                head = slot;
                slot += 1;
            } else {
                if slot + descs.len() > table.len() {
                    break;
                }
                for (i, d) in descs.iter().enumerate() {
                    table[slot + i] = raw(i, d, i + 1 == descs.len(), slot);
                }
                head = slot;
                slot += descs.len();
            }
            let in_range = sector
                .checked_add(total / 512)
                .is_some_and(|end| end <= blocks);
            // A broken chain may scribble over a later chain's header or buffers (its
            // writable buffer can point anywhere), so only chains before any broken one
            // must succeed.
            let valid = !mutated
                && !broken_before
                && in_range
                && (1..=u64::from(SEG_MAX)).contains(&n_data)
                && (t == spec::T_IN || (t == spec::T_OUT && !read_only));
            if t == spec::T_OUT && !read_only {
                write_ranges.push((
                    sector.saturating_mul(512),
                    sector.saturating_mul(512).saturating_add(total + 512 * 8),
                ));
            }
            broken_before |= mutated;
            heads.push(head as u16);
            statuses.push((status_addr, valid));
        }
        write_table(&h, h.desc_addr, &table);
        write_table(&h, TABLE, &indirect);
        // What the device may write: every device-writable buffer anywhere in either table.
        let writable: Vec<(u64, u64)> = table
            .iter()
            .chain(indirect.iter())
            .filter(|d| d.2 & write_f != 0)
            .map(|d| (d.0, d.0.saturating_add(u64::from(d.1))))
            .collect();
        let mem_before = {
            let mut m = vec![0u8; MEM_SIZE];
            h.mem.read_slice(&mut m, GuestAddress(0)).unwrap();
            m
        };
        for (k, &head) in heads.iter().enumerate() {
            let before = h.used_idx();
            let idx: u16 = h.mem.read_obj(GuestAddress(h.avail_addr + 2)).unwrap();
            let slot = h.avail_addr + 4 + 2 * u64::from(idx % QSIZE);
            h.mem.write_obj(head, GuestAddress(slot)).unwrap();
            h.mem
                .write_obj(idx.wrapping_add(1), GuestAddress(h.avail_addr + 2))
                .unwrap();
            h.worker.run(&mut h.queue, &h.mem);
            let returned = h.used_idx().wrapping_sub(before);
            assert_eq!(
                returned,
                u16::from(head < QSIZE),
                "case {case}: head {head} returned {returned} times"
            );
            // Read now: a later, broken chain may point its status byte here.
            if let Some(&(addr, true)) = statuses.get(k) {
                let st: u8 = h.mem.read_obj(GuestAddress(addr)).unwrap();
                assert_eq!(st, S_OK, "case {case}: an intact, valid request failed");
                succeeded += 1;
            }
        }
        let mut mem_after = vec![0u8; MEM_SIZE];
        h.mem.read_slice(&mut mem_after, GuestAddress(0)).unwrap();
        // The used ring is the device's to write; the avail ring is this test's (the driver).
        let used_ring = h.used_addr..h.used_addr + 4 + 8 * u64::from(QSIZE) + 2;
        let avail_ring = h.avail_addr..h.avail_addr + 4 + 2 * u64::from(QSIZE) + 2;
        for i in changed(&mem_before, &mem_after) {
            if used_ring.contains(&i) || avail_ring.contains(&i) {
                continue;
            }
            assert!(
                writable.iter().any(|&(s, e)| s <= i && i < e),
                "case {case}: the device wrote guest byte {i:#x}, outside every writable buffer"
            );
        }
        let after = h.vol_bytes(0, VOL_SIZE as usize);
        for i in changed(&pattern, &after) {
            assert!(!read_only, "case {case}: a read-only volume changed at {i}");
            assert!(
                write_ranges.iter().any(|&(lo, hi)| lo <= i && i < hi),
                "case {case}: volume byte {i} changed outside every range a write named"
            );
        }
    }
    // The generator must keep producing requests that do real work, or the checks above
    // would hold vacuously.
    assert!(
        succeeded >= cases / 8,
        "only {succeeded} of {cases} cases carried a request that succeeded"
    );
}

/// Adaptive polling stops at depth: a worker with few requests in flight on another thread
/// polls after its batch, one with `SLEEP_IN_FLIGHT` or more goes straight back to sleep
/// (their completions will wake it).
#[test]
fn a_deep_queue_sleeps_instead_of_polling() {
    let (vol, rx) = LaterVolume::new();
    let mut h = Harness::with_volume(vol, false);
    h.header(spec::T_FLUSH, 0);
    let call = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let flush = |h: &mut Harness, head: u16| {
        let (wr, next) = (VRING_DESC_F_WRITE as u16, VRING_DESC_F_NEXT as u16);
        h.submit_raw(head, head, &[(HDR, 16, next, head + 1), (STATUS, 1, wr, 0)]);
    };
    let poll = |h: &mut Harness| {
        h.worker.set_poll_window(MAX_POLL_NS);
        let mem = h.mem.clone();
        let before = h.worker.poll_windows();
        h.worker
            .run_polling(&mut h.queue, &|| mem.clone(), Some(call.as_raw_fd()));
        h.worker.poll_windows() - before
    };
    flush(&mut h, 0);
    assert_eq!(h.worker.in_flight(), 1);
    assert_eq!(poll(&mut h), 1, "one request in flight: the worker polls");
    for head in (2..2 * SLEEP_IN_FLIGHT as u16).step_by(2) {
        flush(&mut h, head);
    }
    assert_eq!(h.worker.in_flight(), SLEEP_IN_FLIGHT);
    assert_eq!(poll(&mut h), 0, "a deep queue: no poll");
    // Completed, the queue is shallow again and the worker polls.
    let held: Vec<Handoff> = rx.try_iter().collect();
    assert_eq!(held.len(), SLEEP_IN_FLIGHT);
    std::thread::spawn(move || {
        for (req, done) in held {
            done.complete(req.tag, Ok(()));
        }
    })
    .join()
    .unwrap();
    assert_eq!(poll(&mut h), 1);
    assert_eq!(h.worker.in_flight(), 0);
}
