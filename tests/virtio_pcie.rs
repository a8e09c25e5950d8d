//! The virtio-blk PCI function over vfio-user, against a raw vfio-user client (rust-vmm's
//! `vfio_user::Client`) that plays a host's `virtio_pci` and `virtio_blk` drivers step by
//! step (virtio 1.2 §3.1.1, §4.1.5), including a hostile one; and the operator's way, on a
//! running nacred. A Linux guest binding it with its own driver is in the test bed
//! (`tests/testbed.rs`, `nvme_pcie_over_vfio_user_in_a_guest`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::frontend::virtio_pcie::{VirtioBlkPci, VirtioBlkPciConfig};
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;

const VOL_SIZE: u64 = 16 << 20;
const BAR0: u32 = 0;
const CONFIG: u32 = 7;
/// BAR0's layout as the capabilities give it (checked in the first test).
const COMMON: u64 = 0x0000;
const ISR: u64 = 0x1000;
const DEVICE: u64 = 0x2000;
const NOTIFY: u64 = 0x3000;

/// Common configuration offsets (virtio 1.2 §4.1.4.3).
const DFSELECT: u64 = 0x00;
const DF: u64 = 0x04;
const GFSELECT: u64 = 0x08;
const GF: u64 = 0x0C;
const MSIX_CONFIG: u64 = 0x10;
const STATUS: u64 = 0x14;
const Q_SELECT: u64 = 0x16;
const Q_SIZE: u64 = 0x18;
const Q_MSIX: u64 = 0x1A;
const Q_ENABLE: u64 = 0x1C;
const Q_DESC: u64 = 0x20;
const Q_DRIVER: u64 = 0x28;
const Q_DEVICE: u64 = 0x30;

const ACK: u8 = 1;
const DRIVER: u8 = 2;
const DRIVER_OK: u8 = 4;
const FEATURES_OK: u8 = 8;
const NEEDS_RESET: u8 = 0x40;

const F_VERSION_1: u64 = 1 << 32;
const F_BLK_SIZE: u64 = 1 << 6;
const F_FLUSH: u64 = 1 << 9;
const F_DISCARD: u64 = 1 << 13;

/// Guest memory the client shares: a memfd mapped here too, at this IOVA.
const IOVA: u64 = 0x10_0000;
const MEM_LEN: usize = 1 << 20;
const DESC: u64 = IOVA;
const AVAIL: u64 = IOVA + 0x1000;
const USED: u64 = IOVA + 0x2000;
const HDR: u64 = IOVA + 0x3000;
const STATUS_BYTE: u64 = IOVA + 0x3100;
const DATA: u64 = IOVA + 0x1_0000;
const QSIZE: u16 = 16;

struct Served {
    f: Option<VirtioBlkPci>,
    vol: Arc<dyn BlockDevice>,
    dir: tempfile::TempDir,
}

fn serve(read_only: bool) -> Served {
    let vol: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(VOL_SIZE, 512).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let f = VirtioBlkPci::start(
        VirtioBlkPciConfig {
            dir: dir.path().to_path_buf(),
            queues: 2,
            queue_size: 256,
            read_only,
            serial: "VBLKPCI0".into(),
        },
        vol.clone(),
    )
    .unwrap();
    assert_eq!(f.socket(), dir.path().join("cntrl"));
    Served {
        f: Some(f),
        vol,
        dir,
    }
}

struct GuestMem {
    fd: OwnedFd,
    ptr: *mut u8,
}

impl GuestMem {
    fn new() -> Self {
        // SAFETY: memfd_create with a NUL-terminated name; checked.
        let raw = unsafe { libc::memfd_create(c"guest".as_ptr(), 0) };
        assert!(raw >= 0);
        // SAFETY: a new descriptor owned once.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate and a shared mapping of our own memfd, both checked.
        let ptr = unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), MEM_LEN as i64), 0);
            libc::mmap(
                std::ptr::null_mut(),
                MEM_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        GuestMem {
            fd,
            ptr: ptr as *mut u8,
        }
    }

    fn write(&self, iova: u64, b: &[u8]) {
        let off = (iova - IOVA) as usize;
        assert!(off + b.len() <= MEM_LEN);
        // SAFETY: inside the mapping; the device reads it only after the avail index
        // publishes it.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.ptr.add(off), b.len()) };
    }

    fn read(&self, iova: u64, len: usize) -> Vec<u8> {
        let off = (iova - IOVA) as usize;
        assert!(off + len <= MEM_LEN);
        let mut v = vec![0u8; len];
        for (i, b) in v.iter_mut().enumerate() {
            // SAFETY: inside the mapping; the device writes it concurrently, so volatile.
            *b = unsafe { std::ptr::read_volatile(self.ptr.add(off + i)) };
        }
        v
    }
}

impl Drop for GuestMem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, MEM_LEN) };
    }
}

fn eventfd() -> OwnedFd {
    // SAFETY: a new eventfd, checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK) };
    assert!(fd >= 0);
    // SAFETY: owned once.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// The eventfd's count (0: not signalled), cleared.
fn take(fd: &OwnedFd) -> u64 {
    let mut v = 0u64;
    // SAFETY: 8 bytes into a local u64 from our eventfd.
    let n = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    if n == 8 {
        v
    } else {
        0
    }
}

/// A host's virtio drivers, played step by step.
struct RawDriver {
    c: vfio_user::Client,
    mem: GuestMem,
    /// MSI-X vector 0 (configuration changes) and 1 (queue 0).
    irqs: [OwnedFd; 2],
    avail_idx: u16,
}

impl RawDriver {
    fn connect(dir: &Path) -> Self {
        let mut c = vfio_user::Client::new(&dir.join("cntrl")).unwrap();
        let mem = GuestMem::new();
        c.dma_map(0, IOVA, MEM_LEN as u64, mem.fd.as_raw_fd())
            .unwrap();
        // Bus master, MSI-X on, vectors 0 and 1 to our eventfds.
        c.region_write(CONFIG, 4, &6u16.to_le_bytes()).unwrap();
        c.region_write(CONFIG, 0x53, &[0x80]).unwrap();
        let irqs = [eventfd(), eventfd()];
        let fds = [irqs[0].as_raw_fd(), irqs[1].as_raw_fd()];
        // VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER, MSI-X.
        c.set_irqs(2, 1 << 2 | 1 << 5, 0, 2, &fds).unwrap();
        RawDriver {
            c,
            mem,
            irqs,
            avail_idx: 0,
        }
    }

    fn r8(&mut self, off: u64) -> u8 {
        let mut b = [0u8; 1];
        self.c.region_read(BAR0, off, &mut b).unwrap();
        b[0]
    }
    fn r16(&mut self, off: u64) -> u16 {
        let mut b = [0u8; 2];
        self.c.region_read(BAR0, off, &mut b).unwrap();
        u16::from_le_bytes(b)
    }
    fn r32(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.c.region_read(BAR0, off, &mut b).unwrap();
        u32::from_le_bytes(b)
    }
    fn w8(&mut self, off: u64, v: u8) {
        self.c.region_write(BAR0, off, &[v]).unwrap();
    }
    fn w16(&mut self, off: u64, v: u16) {
        self.c.region_write(BAR0, off, &v.to_le_bytes()).unwrap();
    }
    fn w32(&mut self, off: u64, v: u32) {
        self.c.region_write(BAR0, off, &v.to_le_bytes()).unwrap();
    }
    /// A 64-bit field as Linux writes it: two 32-bit halves.
    fn w64(&mut self, off: u64, v: u64) {
        self.w32(off, v as u32);
        self.w32(off + 4, (v >> 32) as u32);
    }

    fn device_features(&mut self) -> u64 {
        self.w32(COMMON + DFSELECT, 0);
        let lo = self.r32(COMMON + DF) as u64;
        self.w32(COMMON + DFSELECT, 1);
        let hi = self.r32(COMMON + DF) as u64;
        hi << 32 | lo
    }

    /// §3.1.1 up to FEATURES_OK; returns the status read back.
    fn negotiate(&mut self, features: u64) -> u8 {
        self.w8(COMMON + STATUS, 0);
        self.w8(COMMON + STATUS, ACK);
        self.w8(COMMON + STATUS, ACK | DRIVER);
        self.w32(COMMON + GFSELECT, 0);
        self.w32(COMMON + GF, features as u32);
        self.w32(COMMON + GFSELECT, 1);
        self.w32(COMMON + GF, (features >> 32) as u32);
        self.w8(COMMON + STATUS, ACK | DRIVER | FEATURES_OK);
        self.r8(COMMON + STATUS)
    }

    fn setup_queue0(&mut self, size: u16, desc: u64, avail: u64, used: u64) {
        self.w16(COMMON + MSIX_CONFIG, 0);
        self.w16(COMMON + Q_SELECT, 0);
        self.w16(COMMON + Q_SIZE, size);
        self.w64(COMMON + Q_DESC, desc);
        self.w64(COMMON + Q_DRIVER, avail);
        self.w64(COMMON + Q_DEVICE, used);
        self.w16(COMMON + Q_MSIX, 1);
        self.w16(COMMON + Q_ENABLE, 1);
    }

    /// The whole bring-up of a well-behaved driver.
    fn bring_up(dir: &Path) -> Self {
        let mut d = RawDriver::connect(dir);
        let st = d.negotiate(F_VERSION_1 | F_BLK_SIZE | F_FLUSH);
        assert_ne!(st & FEATURES_OK, 0, "features refused: status {st:#x}");
        d.setup_queue0(QSIZE, DESC, AVAIL, USED);
        d.w8(COMMON + STATUS, ACK | DRIVER | FEATURES_OK | DRIVER_OK);
        assert_eq!(
            d.r8(COMMON + STATUS),
            ACK | DRIVER | FEATURES_OK | DRIVER_OK
        );
        d
    }

    /// Put a chain of (addr, len, device-writable) descriptors at slot 0.. and make it
    /// available; kick queue 0.
    fn submit(&mut self, chain: &[(u64, u32, bool)]) {
        for (i, &(addr, len, w)) in chain.iter().enumerate() {
            let mut d = [0u8; 16];
            d[0..8].copy_from_slice(&addr.to_le_bytes());
            d[8..12].copy_from_slice(&len.to_le_bytes());
            let next = i + 1 < chain.len();
            let flags: u16 = (next as u16) | (w as u16) << 1;
            d[12..14].copy_from_slice(&flags.to_le_bytes());
            d[14..16].copy_from_slice(&((i + 1) as u16).to_le_bytes());
            self.mem.write(DESC + 16 * i as u64, &d);
        }
        let slot = self.avail_idx % QSIZE;
        self.mem
            .write(AVAIL + 4 + 2 * slot as u64, &0u16.to_le_bytes());
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem.write(AVAIL + 2, &self.avail_idx.to_le_bytes());
        // Queue 0's notification address: NOTIFY + 0 * multiplier.
        self.w16(NOTIFY, 0);
    }

    /// Wait until the used index reaches ours; the used length of the last element.
    fn wait_used(&mut self) -> u32 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let idx = u16::from_le_bytes(self.mem.read(USED + 2, 2).try_into().unwrap());
            if idx == self.avail_idx {
                let slot = (idx.wrapping_sub(1) % QSIZE) as u64;
                let e = self.mem.read(USED + 4 + 8 * slot, 8);
                return u32::from_le_bytes(e[4..8].try_into().unwrap());
            }
            assert!(
                Instant::now() < deadline,
                "no used element (used idx {idx}, status {:#x})",
                self.r8(COMMON + STATUS)
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// One request: header (type, sector), data descriptors, status; returns the status
    /// byte.
    fn request(&mut self, kind: u32, sector: u64, data: &[(u64, u32, bool)]) -> u8 {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write(HDR, &h);
        self.mem.write(STATUS_BYTE, &[0xEE]);
        let mut chain = vec![(HDR, 16, false)];
        chain.extend_from_slice(data);
        chain.push((STATUS_BYTE, 1, true));
        self.submit(&chain);
        self.wait_used();
        self.mem.read(STATUS_BYTE, 1)[0]
    }
}

const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const S_OK: u8 = 0;
const S_IOERR: u8 = 1;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn a_driver_finds_a_modern_virtio_blk_function_and_its_structures() {
    let s = serve(false);
    let mut d = RawDriver::connect(s.dir.path());
    let mut cfg = [0u8; 256];
    d.c.region_read(CONFIG, 0, &mut cfg).unwrap();
    assert_eq!(&cfg[0..4], &[0xF4, 0x1A, 0x42, 0x10], "1AF4:1042");
    assert_eq!(cfg[8], 1, "revision 1: modern only");
    assert_eq!(&cfg[9..12], &[0x00, 0x80, 0x01], "mass storage, other");
    assert_eq!(&cfg[0x2C..0x30], &[0xF4, 0x1A, 0x00, 0x11], "subsystem IDs");
    // Walk the capability list: every virtio structure is there, in BAR0, where the
    // constants above say.
    let mut found = std::collections::BTreeMap::new();
    let mut at = cfg[0x34] as usize;
    let mut hops = 0;
    while at != 0 {
        hops += 1;
        assert!(hops < 16, "capability list loops");
        if cfg[at] == 0x09 {
            let off = u32::from_le_bytes(cfg[at + 8..at + 12].try_into().unwrap()) as u64;
            assert_eq!(cfg[at + 4], 0, "in BAR0");
            found.insert(cfg[at + 3], (off, at));
        }
        at = cfg[at + 1] as usize;
    }
    assert_eq!(found[&1].0, COMMON);
    assert_eq!(found[&2].0, NOTIFY);
    assert_eq!(found[&3].0, ISR);
    assert_eq!(found[&4].0, DEVICE);
    let notify_cap = found[&2].1;
    assert_eq!(
        u32::from_le_bytes(cfg[notify_cap + 16..notify_cap + 20].try_into().unwrap()),
        4,
        "notify_off_multiplier"
    );
    // Features: what the vhost-user-blk device offers, VERSION_1 among them.
    let f = d.device_features();
    for bit in [
        F_VERSION_1,
        F_BLK_SIZE,
        F_FLUSH,
        F_DISCARD,
        1 << 2,
        1 << 12,
        1 << 14,
    ] {
        assert_ne!(f & bit, 0, "feature {bit:#x} missing from {f:#x}");
    }
    assert_eq!(f & 1 << 5, 0, "not read-only");
    // The device configuration: capacity in sectors, blk_size, num_queues.
    let cap = d.r32(DEVICE) as u64 | (d.r32(DEVICE + 4) as u64) << 32;
    assert_eq!(cap, VOL_SIZE / 512);
    assert_eq!(d.r32(DEVICE + 20), 512, "blk_size");
    assert_eq!(d.r16(DEVICE + 34), 2, "num_queues");
    assert_eq!(d.r16(COMMON + 0x12), 2, "common num_queues");
}

#[test]
fn a_raw_driver_writes_flushes_and_reads_back_through_the_volume() {
    let s = serve(false);
    let mut d = RawDriver::bring_up(s.dir.path());
    take(&d.irqs[1]);
    // Write 12 KiB at sector 8 in two data descriptors, then read it back in one.
    let data = pattern(12288, 7);
    d.mem.write(DATA, &data[..4096]);
    d.mem.write(DATA + 0x8000, &data[4096..]);
    let st = d.request(
        T_OUT,
        8,
        &[(DATA, 4096, false), (DATA + 0x8000, 8192, false)],
    );
    assert_eq!(st, S_OK);
    assert!(take(&d.irqs[1]) > 0, "queue 0's MSI-X vector was raised");
    assert_eq!(d.request(T_FLUSH, 0, &[]), S_OK);
    d.mem.write(DATA + 0x4_0000, &[0u8; 12288]);
    assert_eq!(d.request(T_IN, 8, &[(DATA + 0x4_0000, 12288, true)]), S_OK);
    assert_eq!(d.mem.read(DATA + 0x4_0000, 12288), data);
    // The bytes are the volume's, where the sector says.
    let mut back = vec![0u8; 12288];
    s.vol.read_at(8 * 512, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn bad_chains_fail_with_ioerr_and_touch_nothing_outside_guest_memory() {
    let s = serve(false);
    let mut d = RawDriver::bring_up(s.dir.path());
    // A read whose buffer lies outside the mapped memory.
    assert_eq!(
        d.request(T_IN, 0, &[(0xDEAD_0000_0000, 4096, true)]),
        S_IOERR
    );
    // A read into a device-readable buffer (wrong direction).
    assert_eq!(d.request(T_IN, 0, &[(DATA, 4096, false)]), S_IOERR);
    // A write past the end of the volume.
    assert_eq!(
        d.request(T_OUT, VOL_SIZE / 512, &[(DATA, 4096, false)]),
        S_IOERR
    );
    // A chain without a writable status byte is returned unused, and the queue goes on.
    let before = d.avail_idx;
    d.submit(&[(HDR, 16, false)]);
    assert_eq!(d.wait_used(), 0);
    assert_eq!(d.avail_idx, before + 1);
    assert_eq!(d.request(T_FLUSH, 0, &[]), S_OK, "the queue still serves");
}

#[test]
fn hostile_queue_setups_need_a_reset_and_a_reset_recovers() {
    let s = serve(false);
    let mut d = RawDriver::connect(s.dir.path());
    // Features the device did not offer: FEATURES_OK does not stick.
    let st = d.negotiate(F_VERSION_1 | 1 << 3);
    assert_eq!(st & FEATURES_OK, 0, "status {st:#x}");
    // Rings outside the mapped memory: DRIVER_OK finds them and asks for a reset, with the
    // configuration interrupt.
    assert_ne!(d.negotiate(F_VERSION_1) & FEATURES_OK, 0);
    take(&d.irqs[0]);
    d.setup_queue0(QSIZE, 0x4000_0000, 0x4000_1000, 0x4000_2000);
    d.w8(COMMON + STATUS, ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    assert_ne!(d.r8(COMMON + STATUS) & NEEDS_RESET, 0);
    assert!(take(&d.irqs[0]) > 0, "configuration change interrupt");
    assert_eq!(d.r8(ISR) & 2, 2, "ISR: configuration change");
    // A queue size that is not a power of two, one above the maximum.
    for size in [100u16, 512] {
        assert_ne!(d.negotiate(F_VERSION_1) & FEATURES_OK, 0);
        d.setup_queue0(size, DESC, AVAIL, USED);
        assert_ne!(d.r8(COMMON + STATUS) & NEEDS_RESET, 0, "size {size}");
        d.w16(COMMON + Q_SELECT, 0);
        assert_eq!(d.r16(COMMON + Q_ENABLE), 0, "queue not enabled");
    }
    // Writing 0 resets; a proper setup then serves.
    d.w8(COMMON + STATUS, 0);
    assert_eq!(d.r8(COMMON + STATUS), 0);
    drop(d);
    let mut d = RawDriver::bring_up(s.dir.path());
    assert_eq!(d.request(T_FLUSH, 0, &[]), S_OK);
}

#[test]
fn a_read_only_function_offers_ro_and_fails_writes() {
    let s = serve(true);
    let mut d = RawDriver::connect(s.dir.path());
    assert_ne!(d.device_features() & 1 << 5, 0, "VIRTIO_BLK_F_RO");
    drop(d);
    let mut d = RawDriver::bring_up(s.dir.path());
    d.mem.write(DATA, &pattern(512, 1));
    assert_eq!(d.request(T_OUT, 0, &[(DATA, 512, false)]), S_IOERR);
    let mut back = vec![0u8; 512];
    s.vol.read_at(0, &mut back).unwrap();
    assert_eq!(back, vec![0u8; 512], "nothing written");
}

#[test]
fn malformed_vfio_user_messages_close_the_connection_not_the_function() {
    use std::io::{Read, Write};
    let s = serve(false);
    let sock = s.dir.path().join("cntrl");
    let header = |id: u16, cmd: u16, size: u32| {
        let mut h = Vec::new();
        h.extend_from_slice(&id.to_le_bytes());
        h.extend_from_slice(&cmd.to_le_bytes());
        h.extend_from_slice(&size.to_le_bytes());
        h.extend_from_slice(&[0; 8]);
        h
    };
    for bad in [header(1, 1, 8), header(1, 9, 0xFFFF_FFF0)] {
        let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(&bad).unwrap();
        let mut b = [0u8; 16];
        assert_eq!(c.read(&mut b).unwrap(), 0, "closed");
    }
    // A region write far outside BAR0: an error reply, the connection kept.
    let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = header(7, 10, 16 + 16 + 4);
    req.extend_from_slice(&(u64::MAX - 1).to_le_bytes());
    req.extend_from_slice(&0u32.to_le_bytes());
    req.extend_from_slice(&4u32.to_le_bytes());
    req.extend_from_slice(&[0xFF; 4]);
    c.write_all(&req).unwrap();
    let mut reply = [0u8; 16];
    c.read_exact(&mut reply).unwrap();
    assert_eq!(u16::from_le_bytes([reply[0], reply[1]]), 7);
    assert_ne!(
        u32::from_le_bytes(reply[8..12].try_into().unwrap()) & 1 << 5,
        0,
        "error flag"
    );
    drop(c);
    let mut d = RawDriver::bring_up(s.dir.path());
    assert_eq!(d.request(T_FLUSH, 0, &[]), S_OK);
}

#[test]
fn stopping_the_function_disconnects_its_client_and_removes_the_socket() {
    let mut s = serve(false);
    let mut d = RawDriver::bring_up(s.dir.path());
    assert_eq!(d.request(T_FLUSH, 0, &[]), S_OK);
    s.f.take().unwrap().stop();
    assert!(!s.dir.path().join("cntrl").exists());
    let mut b = [0u8; 1];
    assert!(d.c.region_read(BAR0, COMMON + STATUS, &mut b).is_err());
}

/// A driver that writes whatever it likes: random widths and values at random places of
/// BAR0 and the configuration space, random bytes for its rings and requests, queues live
/// on them and notified. Every access gets an answer (a panic would end the connection),
/// and a well-behaved driver is served afterwards.
#[test]
fn a_random_driver_never_takes_the_function_down() {
    let s = serve(false);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..12 {
        let mut d = RawDriver::connect(s.dir.path());
        let mut junk = vec![0u8; 0x4000];
        junk.iter_mut().for_each(|b| *b = next() as u8);
        d.mem.write(IOVA, &junk);
        // Half the rounds bring a queue up on random ring contents first.
        if round % 2 == 0 {
            d.negotiate(F_VERSION_1 | F_FLUSH);
            d.setup_queue0(QSIZE, DESC, AVAIL, USED);
            d.w8(COMMON + STATUS, ACK | DRIVER | FEATURES_OK | DRIVER_OK);
        }
        for _ in 0..400 {
            let r = next();
            let width = [1usize, 2, 4, 8][(r % 4) as usize];
            let value = next().to_le_bytes();
            let (region, offset) = match (r >> 8) % 8 {
                0 => (CONFIG, (r >> 16) % 256),
                // The common configuration and the notify page most often.
                1..=4 => (BAR0, COMMON + (r >> 16) % 0x40),
                5 => (BAR0, NOTIFY + (r >> 16) % 16),
                _ => (BAR0, (r >> 16) % 0x4000),
            };
            let offset = offset.min(if region == CONFIG { 256 } else { 0x4000 } - width as u64);
            // Keep the function's MSI-X capability and BARs as the driver set them.
            if region == CONFIG && offset < 0x60 {
                continue;
            }
            if (r >> 40) % 3 == 0 {
                let mut b = vec![0u8; width];
                d.c.region_read(region, offset, &mut b)
                    .unwrap_or_else(|e| panic!("read {region}:{offset:#x}: {e:?}"));
            } else {
                d.c.region_write(region, offset, &value[..width])
                    .unwrap_or_else(|e| panic!("write {region}:{offset:#x}: {e:?}"));
            }
        }
    }
    let mut d = RawDriver::bring_up(s.dir.path());
    assert_eq!(d.request(T_FLUSH, 0, &[]), S_OK);
}

/// The operator's way: `nacre vhost-blk create --transport vfio-user` on a running nacred;
/// listed with its transport, persisted and replayed (its directory made again), deleted
/// with its socket; one-line errors for what cannot work.
#[test]
fn nacred_serves_a_virtio_blk_function_created_by_the_cli_and_replays_it() {
    use nacre_tests::daemon::Nacred;
    use serde_json::json;
    let mut n = Nacred::start();
    n.ok(
        "volume_create",
        json!({"name": "vv", "size": 8 << 20, "block_size": 512}),
    );
    let dir = tempfile::tempdir().unwrap();
    let fdir = dir.path().join("vblk0");
    std::fs::create_dir(&fdir).unwrap();
    let path = fdir.to_str().unwrap();
    // No directory, an unknown transport: one-line errors.
    let out = n.cli(&[
        "vhost-blk",
        "create",
        "f0",
        "--volume",
        "vv",
        "--transport",
        "vfio-user",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs socket"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let (_, msg) = n.err(
        "vhost_blk_create",
        json!({"name": "f0", "volume": "vv", "transport": "pcie", "socket": path}),
    );
    assert!(msg.contains("transport must be"), "{msg}");
    let out = n.cli(&[
        "vhost-blk",
        "create",
        "f0",
        "--volume",
        "vv",
        "--queues",
        "1",
        "--transport",
        "vfio-user",
        "--socket",
        path,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list = n.ok("vhost_blk_list", json!(null));
    let f0 = list
        .as_array()
        .and_then(|l| l.iter().find(|d| d["name"] == "f0"))
        .unwrap_or_else(|| panic!("f0 not listed: {list}"));
    assert_eq!(f0["transport"], "vfio-user", "{list}");
    let out = n.cli(&["vhost-blk", "list"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("vfio-user"));
    let check = || {
        let mut d = RawDriver::bring_up(&fdir);
        let cap = d.r32(DEVICE) as u64 | (d.r32(DEVICE + 4) as u64) << 32;
        assert_eq!(cap, (8 << 20) / 512);
        d.mem.write(DATA, &pattern(4096, 3));
        assert_eq!(d.request(T_OUT, 0, &[(DATA, 4096, false)]), S_OK);
        assert_eq!(d.request(T_IN, 0, &[(DATA + 0x1000, 4096, true)]), S_OK);
        assert_eq!(d.mem.read(DATA + 0x1000, 4096), pattern(4096, 3));
    };
    check();
    // The volume is in use: it cannot be deleted under the function.
    let (_, msg) = n.err("volume_delete", json!({"name": "vv"}));
    assert!(msg.contains("vhost-blk:f0"), "{msg}");
    // Persisted and replayed, the directory made again after a "reboot".
    assert!(n.stop(), "{}", n.log_text());
    std::fs::remove_dir_all(&fdir).unwrap();
    n.spawn_again();
    check();
    n.ok("vhost_blk_delete", json!({"name": "f0"}));
    assert!(!fdir.join("cntrl").exists(), "the socket is removed");
}

/// An encrypted volume (AES-XTS under a tenant's key) behind the function: the same volume
/// path as every frontend's. The driver reads back what it wrote; the volume's file holds
/// none of it in the clear.
#[test]
fn an_encrypted_volume_is_served_through_the_function() {
    use nacre_tests::daemon::Nacred;
    use serde_json::json;
    let n = Nacred::start_args(&["--no-default"]);
    let dir = tempfile::tempdir().unwrap();
    let kek = dir.path().join("t.kek");
    std::fs::write(&kek, [0x5a; 32]).unwrap();
    n.ok(
        "tenant_create",
        json!({"name": "t", "kek": {"key_file": kek}}),
    );
    n.ok(
        "volume_create",
        json!({"name": "ev", "size": 4 << 20, "block_size": 4096, "backend": "file",
               "tenant": "t", "encrypt": true}),
    );
    let fdir = dir.path().join("fn");
    std::fs::create_dir(&fdir).unwrap();
    n.ok(
        "vhost_blk_create",
        json!({"name": "ef", "volume": "ev", "queues": 1, "transport": "vfio-user",
               "socket": fdir}),
    );
    let mut d = RawDriver::bring_up(&fdir);
    let secret: Vec<u8> = b"nacre-virtio-pcie-plaintext-block"
        .iter()
        .copied()
        .cycle()
        .take(8192)
        .collect();
    d.mem.write(DATA, &secret);
    assert_eq!(d.request(T_OUT, 16, &[(DATA, 8192, false)]), S_OK);
    assert_eq!(d.request(T_FLUSH, 0, &[]), S_OK);
    assert_eq!(d.request(T_IN, 16, &[(DATA + 0x4000, 8192, true)]), S_OK);
    assert_eq!(d.mem.read(DATA + 0x4000, 8192), secret);
    let mut files = 0;
    for e in std::fs::read_dir(n.state_dir.join("volumes")).unwrap() {
        let bytes = std::fs::read(e.unwrap().path()).unwrap();
        if bytes.len() >= 4 << 20 {
            files += 1;
            assert!(
                !bytes.windows(32).any(|w| w == &secret[..32]),
                "plaintext in the volume's file"
            );
            assert!(
                bytes[16 * 512..16 * 512 + 8192].iter().any(|&b| b != 0),
                "nothing written where the sector says"
            );
        }
    }
    assert_eq!(files, 1, "one volume file");
}
