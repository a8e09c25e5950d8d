//! The PCIe NVMe controller over vfio-user, against real clients: SPDK's NVMe driver
//! (`spdk_nvme_identify`, `spdk_nvme_perf` with `trtype:VFIOUSER`) and a raw vfio-user
//! client (rust-vmm's `vfio_user::Client`) that plays a host driver step by step, including
//! a hostile one.
//!
//! SPDK's binaries come from `$SPDK_DIR` or the team's `../shared/tools/spdk`; without
//! them these tests fail saying so.

use std::path::{Path, PathBuf};
use std::process::Command as Process;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::frontend::nvme_pcie::{Signals, VfioUserPorts};
use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;

const NQN: &str = "nqn.2024-01.io.nacre:pcie";
const SERIAL: &str = "NACREPCIE0001";
const NGUID: [u8; 16] = *b"pcie-nguid-0001!";
const VOL_SIZE: u64 = 64 << 20;

fn spdk_bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("SPDK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/spdk"));
    let p = dir.join("bin").join(name);
    assert!(
        p.is_file(),
        "SPDK's {name} is missing at {} (set SPDK_DIR to an SPDK v25.09 build with vfio-user)",
        p.display()
    );
    p
}

struct Served {
    _target: Arc<NvmfTarget>,
    ports: Arc<VfioUserPorts>,
    vol: Arc<dyn BlockDevice>,
    dir: tempfile::TempDir,
}

fn serve() -> Served {
    serve_with(Signals::Msix)
}

/// A controller whose function signals with `interrupts`.
fn serve_with(interrupts: Signals) -> Served {
    let target = NvmfTarget::new();
    target.create_subsystem(NQN, SERIAL, "nacre", true).unwrap();
    let vol: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(VOL_SIZE, 512).unwrap());
    target
        .add_namespace(NQN, None, vol.clone(), NGUID, "vol0".into())
        .unwrap();
    let ports = VfioUserPorts::new(&target);
    let dir = tempfile::tempdir().unwrap();
    let sock = ports.add_listener(NQN, dir.path(), interrupts).unwrap();
    assert_eq!(sock, dir.path().join("cntrl"));
    Served {
        _target: target,
        ports,
        vol,
        dir,
    }
}

fn trid(dir: &Path) -> String {
    format!("trtype:VFIOUSER traddr:{} subnqn:{NQN}", dir.display())
}

/// SPDK's tools share DPDK's runtime files: one at a time.
static SPDK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run an SPDK tool with a deadline; its output, or a panic with it.
fn run_spdk(name: &str, args: &[&str]) -> String {
    let _one = SPDK.lock().unwrap_or_else(|p| p.into_inner());
    let mut child = Process::new(spdk_bin(name))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{name} failed ({}):\n{text}",
        out.status
    );
    text
}

#[test]
fn spdk_identify_sees_a_pcie_nvme_controller_named_nacre() {
    let s = serve();
    let out = run_spdk(
        "spdk_nvme_identify",
        &["--no-huge", "-s", "1024", "-r", &trid(s.dir.path())],
    );
    let field = |name: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(name))
            .map(|l| l.split_once(':').map_or("", |x| x.1).trim().to_string())
            .unwrap_or_else(|| panic!("no {name} in:\n{out}"))
    };
    assert_eq!(field("Model Number"), "nacre");
    assert_eq!(field("Serial Number"), SERIAL);
    assert_eq!(field("Subsystem NQN"), NQN);
    assert!(out.contains("NVMeoF Controller at VFIOUSER"), "{out}");
    assert_eq!(
        field("Size (in LBAs)"),
        format!("{} (0GiB)", VOL_SIZE / 512)
    );
    assert!(!out.contains("*ERROR*"), "{out}");
    drop(s.ports);
}

/// SPDK's perf over VFIOUSER: random read/write mixes at QD32 of 4 KiB and 16 KiB (PRP
/// list) transfers, error-free. The oracle: every 4 KiB block starts tagged with its own
/// index (each 8-byte word: index, word number); perf writes from buffers it filled with
/// one byte value, or read into earlier, so afterwards every block must hold one whole
/// tagged block (its own or another's, word order intact) or one repeated byte. A read that returned shifted, torn
/// or wrong data, or a write that landed so, breaks that.
#[test]
fn spdk_perf_runs_error_free_and_writes_land_whole() {
    let s = serve();
    // Tag every 4 KiB block with its index.
    let blocks = VOL_SIZE / 4096;
    let mut buf = vec![0u8; VOL_SIZE as usize];
    for b in 0..blocks as usize {
        for (i, chunk) in buf[b * 4096..(b + 1) * 4096].chunks_mut(8).enumerate() {
            chunk.copy_from_slice(&((b as u64) << 16 | i as u64 | 1 << 63).to_le_bytes());
        }
    }
    s.vol.write_at(0, &buf).unwrap();
    for (size, mix) in [("4096", "50"), ("16384", "30")] {
        let out = run_spdk(
            "spdk_nvme_perf",
            &[
                "--no-huge",
                "-s",
                "1024",
                "-q",
                "32",
                "-o",
                size,
                "-w",
                "randrw",
                "-M",
                mix,
                "-t",
                "2",
                "-r",
                &trid(s.dir.path()),
            ],
        );
        assert!(!out.contains("*ERROR*"), "{out}");
        assert!(out.contains("Total"), "no summary from perf:\n{out}");
    }
    // The poller's own account (`nvmf_get_stats`): passes that found work, and the time in
    // them, no more than the time its clock moved. It publishes before pausing, which it
    // does once perf is gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (nqn, dir, st) = loop {
        let v = s.ports.poll_stats();
        assert_eq!(v.len(), 1, "one listener, one poller: {v:?}");
        let (_, _, st) = &v[0];
        if st.pauses > 0 || Instant::now() > deadline {
            break v.into_iter().next().unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!((nqn.as_str(), dir.as_path()), (NQN, s.dir.path()));
    assert!(st.pauses > 0, "the poller never paused after perf: {st:?}");
    assert!(
        st.busy_passes > 0 && st.idle_passes > 0,
        "passes with and without work: {st:?}"
    );
    assert!(
        st.busy_ns > 0 && st.busy_ns < st.at_ns,
        "busy time within the poller's clock: {st:?}"
    );
    s.vol.read_at(0, &mut buf).unwrap();
    let tag = |b: u64, i: usize| (b << 16 | i as u64 | 1 << 63).to_le_bytes();
    let mut moved = 0;
    for b in 0..blocks as usize {
        let blk = &buf[b * 4096..(b + 1) * 4096];
        if blk.iter().all(|&x| x == blk[0]) {
            moved += 1;
            continue;
        }
        let from = u64::from_le_bytes(blk[..8].try_into().unwrap()) >> 16 & 0xFFFF_FFFF;
        let whole = from < blocks && blk.chunks(8).enumerate().all(|(i, c)| c == tag(from, i));
        assert!(
            whole,
            "block {b} is not one whole tagged block: {:02x?}",
            &blk[..64]
        );
        moved += (from != b as u64) as usize;
    }
    assert!(moved > 0, "perf wrote nothing");
}

/// Guest memory the raw client shares with the controller: a memfd mapped here too.
struct GuestMem {
    fd: std::os::fd::OwnedFd,
    ptr: *mut u8,
    len: usize,
}

/// Where the raw client's memory starts in the device's (IO virtual) address space.
const IOVA: u64 = 0x10_0000;
const MEM_LEN: usize = 1 << 20;
const ASQ: u64 = IOVA;
const ACQ: u64 = IOVA + 0x1000;
const IOCQ: u64 = IOVA + 0x2000;
const IOSQ: u64 = IOVA + 0x3000;
const DATA: u64 = IOVA + 0x1_0000;

impl GuestMem {
    fn new() -> Self {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: memfd_create with a NUL-terminated name; checked.
        let raw = unsafe { libc::memfd_create(c"guest".as_ptr(), 0) };
        assert!(raw >= 0);
        // SAFETY: a new descriptor owned once.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
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
            len: MEM_LEN,
        }
    }

    fn at(&mut self, iova: u64, len: usize) -> &mut [u8] {
        let off = (iova - IOVA) as usize;
        assert!(off + len <= self.len);
        // SAFETY: inside the mapping; the controller writes it concurrently only where the
        // test waits for it (completion entries, read data), and the test reads those with
        // volatile loads (`phase`) before looking.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

impl Drop for GuestMem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// A host driver played step by step through rust-vmm's vfio-user client.
struct RawHost {
    c: vfio_user::Client,
    mem: GuestMem,
    sq_tail: [u16; 2],
    cq_head: [u16; 2],
    phase: [bool; 2],
    cid: u16,
}

const BAR0: u32 = 0;
const CONFIG: u32 = 7;
const QSIZE: u16 = 16;

impl RawHost {
    fn connect(dir: &Path) -> Self {
        use std::os::fd::AsRawFd;
        let mut c = vfio_user::Client::new(&dir.join("cntrl")).unwrap();
        let mem = GuestMem::new();
        c.dma_map(0, IOVA, MEM_LEN as u64, mem.fd.as_raw_fd())
            .unwrap();
        // Bus master on.
        c.region_write(CONFIG, 4, &6u16.to_le_bytes()).unwrap();
        let aqa = (QSIZE as u32 - 1) << 16 | (QSIZE as u32 - 1);
        c.region_write(BAR0, 0x24, &aqa.to_le_bytes()).unwrap();
        c.region_write(BAR0, 0x28, &ASQ.to_le_bytes()).unwrap();
        c.region_write(BAR0, 0x30, &ACQ.to_le_bytes()).unwrap();
        let cc: u32 = 1 | 6 << 16 | 4 << 20;
        c.region_write(BAR0, 0x14, &cc.to_le_bytes()).unwrap();
        let mut h = RawHost {
            c,
            mem,
            sq_tail: [0; 2],
            cq_head: [0; 2],
            phase: [true; 2],
            cid: 0,
        };
        h.wait_csts(|v| v & 1 == 1, "CSTS.RDY");
        h
    }

    fn csts(&mut self) -> u32 {
        let mut b = [0u8; 4];
        self.c.region_read(BAR0, 0x1C, &mut b).unwrap();
        u32::from_le_bytes(b)
    }

    fn wait_csts(&mut self, ok: impl Fn(u32) -> bool, what: &str) -> u32 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let v = self.csts();
            if ok(v) {
                return v;
            }
            assert!(Instant::now() < deadline, "{what} never came (CSTS {v:#x})");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Ring queue `q`'s submission doorbell with `value`.
    fn ring(&mut self, q: usize, value: u32) {
        self.c
            .region_write(BAR0, 0x1000 + 8 * q as u64, &value.to_le_bytes())
            .unwrap();
    }

    /// Submit `sqe` (64 bytes, CID filled in) on queue `q` and wait for its completion:
    /// (status field without the phase, Dword 0).
    fn submit(&mut self, q: usize, sqe: [u8; 64]) -> (u16, u32) {
        self.place(q, sqe);
        let tail = self.sq_tail[q] as u32;
        self.ring(q, tail);
        let (cid, st, dw0) = self.reap(q);
        assert_eq!(cid, self.cid, "completion for another command");
        (st, dw0)
    }

    /// Put `sqe` (CID filled in) in queue `q`'s next slot without ringing.
    fn place(&mut self, q: usize, mut sqe: [u8; 64]) {
        self.cid += 1;
        sqe[2..4].copy_from_slice(&self.cid.to_le_bytes());
        let sq = if q == 0 { ASQ } else { IOSQ };
        let slot = self.sq_tail[q] as u64;
        self.mem.at(sq + slot * 64, 64).copy_from_slice(&sqe);
        self.sq_tail[q] = (self.sq_tail[q] + 1) % QSIZE;
    }

    /// Submit `sqes` on I/O queue 1 with one doorbell write; their statuses.
    fn submit_all(&mut self, sqes: &[[u8; 64]]) -> Vec<u16> {
        for e in sqes {
            self.place(1, *e);
        }
        let tail = self.sq_tail[1] as u32;
        self.ring(1, tail);
        (0..sqes.len()).map(|_| self.reap(1).1).collect()
    }

    /// Wait for queue `q`'s next completion and consume it: (CID, status field without the
    /// phase, Dword 0).
    fn reap(&mut self, q: usize) -> (u16, u16, u32) {
        let cq = if q == 0 { ACQ } else { IOCQ };
        let deadline = Instant::now() + Duration::from_secs(10);
        let at = cq + self.cq_head[q] as u64 * 16;
        loop {
            let p = self.mem.at(at, 16).as_ptr();
            // SAFETY: 16 bytes inside the mapping (`at` checked), which the controller
            // writes: read with volatile loads, the status (phase) last-written word first.
            let st = unsafe { std::ptr::read_volatile(p.add(14) as *const u16) };
            // SAFETY: as above.
            let e: [u8; 16] = unsafe { std::ptr::read_volatile(p as *const [u8; 16]) };
            if (st & 1 == 1) == self.phase[q] {
                let cid = u16::from_le_bytes([e[12], e[13]]);
                let dw0 = u32::from_le_bytes(e[0..4].try_into().unwrap());
                self.cq_head[q] = (self.cq_head[q] + 1) % QSIZE;
                if self.cq_head[q] == 0 {
                    self.phase[q] = !self.phase[q];
                }
                let head = self.cq_head[q] as u32;
                self.c
                    .region_write(BAR0, 0x1000 + 8 * q as u64 + 4, &head.to_le_bytes())
                    .unwrap();
                return (cid, st >> 1, dw0);
            }
            assert!(
                Instant::now() < deadline,
                "no completion (CSTS {:#x})",
                self.csts()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn io_queues(&mut self) {
        self.io_queues_on(1);
    }

    /// I/O queue pair 1, its completion queue's Dword 11 `cq_dw11` (PC, IEN, IV).
    fn io_queues_on(&mut self, cq_dw11: u32) {
        let ok = (0, 0);
        let q = (QSIZE as u32 - 1) << 16 | 1;
        assert_eq!(
            self.submit(0, sqe(0x05, 0, IOCQ, 0, q, cq_dw11, 0)).0,
            ok.0,
            "create CQ"
        );
        assert_eq!(
            self.submit(0, sqe(0x01, 0, IOSQ, 0, q, 1 << 16 | 1, 0)).0,
            ok.0,
            "create SQ"
        );
    }
}

/// MSI-X vectors 0 and 1 signal eventfds of the raw host (VFIO_USER_DEVICE_SET_IRQS with
/// ACTION_TRIGGER | DATA_EVENTFD on the MSI-X index), and MSI-X is enabled.
fn msix_eventfds(h: &mut RawHost) -> [std::os::fd::OwnedFd; 2] {
    use std::os::fd::{AsRawFd, FromRawFd};
    let new = || {
        // SAFETY: eventfd(2) with flags only; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor owned once.
        unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }
    };
    let fds = [new(), new()];
    let raw: Vec<_> = fds.iter().map(|f| f.as_raw_fd()).collect();
    const MSIX_INDEX: u32 = 2;
    const TRIGGER_EVENTFD: u32 = 1 << 5 | 1 << 2;
    h.c.set_irqs(MSIX_INDEX, TRIGGER_EVENTFD, 0, 2, &raw)
        .unwrap();
    // MSI-X Message Control (capability at 50h): MSI-X Enable.
    h.c.region_write(CONFIG, 0x52, &0x8000u16.to_le_bytes())
        .unwrap();
    fds
}

/// How many times the eventfd was signalled since the last call (its counter, read and so
/// reset).
fn signals(fd: &std::os::fd::OwnedFd) -> u64 {
    use std::os::fd::AsRawFd;
    let mut v = 0u64;
    // SAFETY: an 8-byte read into `v` from a non-blocking eventfd we own.
    let n = unsafe { libc::read(fd.as_raw_fd(), &mut v as *mut u64 as *mut libc::c_void, 8) };
    if n == 8 {
        v
    } else {
        0
    }
}

/// A submission queue entry: opcode, NSID, PRP1, PRP2, Dwords 10-12.
fn sqe(op: u8, nsid: u32, prp1: u64, prp2: u64, cdw10: u32, cdw11: u32, cdw12: u32) -> [u8; 64] {
    let mut e = [0u8; 64];
    e[0] = op;
    e[4..8].copy_from_slice(&nsid.to_le_bytes());
    e[24..32].copy_from_slice(&prp1.to_le_bytes());
    e[32..40].copy_from_slice(&prp2.to_le_bytes());
    e[40..44].copy_from_slice(&cdw10.to_le_bytes());
    e[44..48].copy_from_slice(&cdw11.to_le_bytes());
    e[48..52].copy_from_slice(&cdw12.to_le_bytes());
    e
}

/// A submission queue entry whose Data Pointer is one SGL descriptor (PSDT = 01b):
/// opcode, NSID, the descriptor (address, length, type << 4 | subtype), Dwords 10 and 12.
fn sgl_sqe(op: u8, nsid: u32, desc: (u64, u32, u8), cdw10: u32, cdw12: u32) -> [u8; 64] {
    let (addr, len, kind) = desc;
    let mut e = sqe(
        op,
        nsid,
        addr,
        len as u64 | (kind as u64) << 56,
        cdw10,
        0,
        cdw12,
    );
    e[1] = 0x40;
    e
}

/// SGL descriptor types (NVMe Base 2.0 Figure 120), as the identifier byte's upper nibble.
const SGL_DATA_BLOCK: u8 = 0x00;
const SGL_BIT_BUCKET: u8 = 0x10;
const SGL_SEGMENT: u8 = 0x20;
const SGL_LAST_SEGMENT: u8 = 0x30;

/// Write SGL descriptors (address, length, identifier byte) as a segment at `at`.
fn put_sgl(mem: &mut GuestMem, at: u64, descs: &[(u64, u32, u8)]) {
    for (i, (addr, len, kind)) in descs.iter().enumerate() {
        let d = mem.at(at + 16 * i as u64, 16);
        d.fill(0);
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[15] = *kind;
    }
}

/// Status field values (status code type << 8 | status code).
const SUCCESS: u16 = 0;
const INVALID_FIELD: u16 = 0x02;
const DATA_TRANSFER_ERROR: u16 = 0x04;
const INVALID_SGL_SEGMENT_DESCRIPTOR: u16 = 0x0D;
const INVALID_NUMBER_OF_SGL_DESCRIPTORS: u16 = 0x0E;
const DATA_SGL_LENGTH_INVALID: u16 = 0x0F;
const SGL_DESCRIPTOR_TYPE_INVALID: u16 = 0x11;
const PRP_OFFSET_INVALID: u16 = 0x13;
/// The status field without DNR.
fn code(st: u16) -> u16 {
    st & 0x7FF
}

#[test]
fn a_raw_host_writes_and_reads_back_through_prp_lists() {
    let s = serve();
    let mut h = RawHost::connect(s.dir.path());
    h.io_queues();
    // 16 KiB: PRP1, then a PRP list at DATA + 0xF000 naming three more pages.
    let pattern: Vec<u8> = (0..16384u32).map(|i| (i * 7 + i / 4096) as u8).collect();
    h.mem.at(DATA, 16384).copy_from_slice(&pattern);
    let list = DATA + 0xF000;
    for (i, page) in [DATA + 0x1000, DATA + 0x2000, DATA + 0x3000]
        .iter()
        .enumerate()
    {
        h.mem
            .at(list + 8 * i as u64, 8)
            .copy_from_slice(&page.to_le_bytes());
    }
    // Write at LBA 64 (512-byte blocks, 32 of them), then read into other pages.
    let (st, _) = h.submit(1, sqe(0x01, 1, DATA, list, 64, 0, 31));
    assert_eq!(code(st), SUCCESS);
    let mut on_vol = vec![0u8; 16384];
    s.vol.read_at(64 * 512, &mut on_vol).unwrap();
    assert_eq!(on_vol, pattern, "the volume holds what the host wrote");
    let back = DATA + 0x8000;
    for (i, page) in [back + 0x1000, back + 0x2000, back + 0x3000]
        .iter()
        .enumerate()
    {
        h.mem
            .at(list + 8 * i as u64, 8)
            .copy_from_slice(&page.to_le_bytes());
    }
    let (st, _) = h.submit(1, sqe(0x02, 1, back, list, 64, 0, 31));
    assert_eq!(code(st), SUCCESS);
    assert_eq!(h.mem.at(back, 16384), &pattern[..]);
    // Flush, Write Zeroes, and Dataset Management (deallocate) complete.
    assert_eq!(code(h.submit(1, sqe(0x00, 1, 0, 0, 0, 0, 0)).0), SUCCESS);
    assert_eq!(code(h.submit(1, sqe(0x08, 1, 0, 0, 64, 0, 7)).0), SUCCESS);
    s.vol.read_at(64 * 512, &mut on_vol).unwrap();
    assert!(on_vol[..4096].iter().all(|&b| b == 0) && on_vol[4096..] == pattern[4096..]);
    // Shutdown notification: SHST reports complete.
    let cc: u32 = 1 | 6 << 16 | 4 << 20 | 1 << 14;
    h.c.region_write(BAR0, 0x14, &cc.to_le_bytes()).unwrap();
    h.wait_csts(|v| v >> 2 & 3 == 2, "CSTS.SHST complete");
}

/// The controller follows the client while it runs: memory mapped for DMA after the
/// controller was enabled carries data, memory unmapped fails the commands that point into
/// it (Data Transfer Error), and while the driver has Bus Master Enable off no command is
/// taken from its queues (the command waits until the bit is set again).
#[test]
fn dma_maps_and_bus_mastering_changed_while_the_controller_runs_take_effect() {
    use std::os::fd::AsRawFd;
    let s = serve();
    let mut h = RawHost::connect(s.dir.path());
    h.io_queues();
    // A second region, mapped once the controller is running and has served commands.
    const IOVA2: u64 = 0x100_0000;
    let extra = GuestMem::new();
    h.c.dma_map(0, IOVA2, MEM_LEN as u64, extra.fd.as_raw_fd())
        .unwrap();
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 5) as u8).collect();
    // SAFETY: the first 4 KiB of the region's mapping; nothing else writes it meanwhile.
    unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), extra.ptr, 4096) };
    let (st, _) = h.submit(1, sqe(0x01, 1, IOVA2, 0, 8, 0, 7));
    assert_eq!(code(st), SUCCESS, "a write from memory mapped after enable");
    let mut on_vol = vec![0u8; 4096];
    s.vol.read_at(8 * 512, &mut on_vol).unwrap();
    assert_eq!(
        on_vol, pattern,
        "the volume holds the data of the new region"
    );
    // Unmapped: a command pointing there fails and the volume is untouched.
    h.c.dma_unmap(IOVA2, MEM_LEN as u64).unwrap();
    let (st, _) = h.submit(1, sqe(0x01, 1, IOVA2, 0, 16, 0, 7));
    assert_eq!(
        code(st),
        DATA_TRANSFER_ERROR,
        "a write from unmapped memory"
    );
    s.vol.read_at(16 * 512, &mut on_vol).unwrap();
    assert!(on_vol.iter().all(|&b| b == 0));
    // Bus Master Enable off (Memory Space on): the command is not taken.
    h.c.region_write(CONFIG, 4, &2u16.to_le_bytes()).unwrap();
    h.mem.at(DATA, 4096).copy_from_slice(&pattern);
    h.place(1, sqe(0x01, 1, DATA, 0, 24, 0, 7));
    let tail = h.sq_tail[1] as u32;
    h.ring(1, tail);
    std::thread::sleep(Duration::from_millis(300));
    s.vol.read_at(24 * 512, &mut on_vol).unwrap();
    assert!(
        on_vol.iter().all(|&b| b == 0),
        "a command ran while bus mastering was off"
    );
    let cq = h.mem.at(IOCQ + h.cq_head[1] as u64 * 16, 16).to_vec();
    assert_ne!(
        (u16::from_le_bytes([cq[14], cq[15]]) & 1 == 1),
        h.phase[1],
        "a completion was posted while bus mastering was off"
    );
    // On again: it runs.
    h.c.region_write(CONFIG, 4, &6u16.to_le_bytes()).unwrap();
    let (_, st, _) = h.reap(1);
    assert_eq!(code(st), SUCCESS);
    s.vol.read_at(24 * 512, &mut on_vol).unwrap();
    assert_eq!(on_vol, pattern);
}

/// SGLs (PSDT = 01b) on I/O commands: a write gathered from byte-aligned blocks of a Last
/// Segment, read back scattered through a Segment → Last Segment chain and through one
/// Data Block in the command; Identify Controller says SGLs are supported.
#[test]
fn a_raw_host_writes_and_reads_back_through_sgls() {
    let s = serve();
    let mut h = RawHost::connect(s.dir.path());
    let (st, _) = h.submit(0, sqe(0x06, 0, DATA, 0, 1, 0, 0));
    assert_eq!(code(st), SUCCESS);
    let sgls = u32::from_le_bytes(h.mem.at(DATA + 536, 4).try_into().unwrap());
    assert_eq!(sgls & 3, 1, "SGLS {sgls:#x}: SGLs without alignment rules");
    h.io_queues();
    // 12 KiB from three blocks at odd addresses and lengths.
    let pattern: Vec<u8> = (0..12288u32).map(|i| (i * 13 + i / 1000) as u8).collect();
    let blocks = [
        (DATA + 1, 5000u32),
        (DATA + 0x3000, 4000),
        (DATA + 0x5003, 3288),
    ];
    let mut at = 0;
    for (addr, len) in blocks {
        h.mem
            .at(addr, len as usize)
            .copy_from_slice(&pattern[at..at + len as usize]);
        at += len as usize;
    }
    let list = DATA + 0xE000;
    let descs: Vec<_> = blocks
        .iter()
        .map(|&(a, l)| (a, l, SGL_DATA_BLOCK))
        .collect();
    put_sgl(&mut h.mem, list, &descs);
    let (st, _) = h.submit(1, sgl_sqe(0x01, 1, (list, 48, SGL_LAST_SEGMENT), 128, 23));
    assert_eq!(code(st), SUCCESS, "SGL write");
    let mut on_vol = vec![0u8; 12288];
    s.vol.read_at(128 * 512, &mut on_vol).unwrap();
    assert!(on_vol == pattern, "the volume holds what the SGL gathered");
    // Read back: a Segment of one block and a Last Segment descriptor, then two blocks.
    let back = DATA + 0x8000;
    put_sgl(
        &mut h.mem,
        list,
        &[
            (back, 2048, SGL_DATA_BLOCK),
            (list + 0x100, 32, SGL_LAST_SEGMENT),
        ],
    );
    put_sgl(
        &mut h.mem,
        list + 0x100,
        &[
            (back + 0x1002, 6000, SGL_DATA_BLOCK),
            (back + 0x3000, 4240, SGL_DATA_BLOCK),
        ],
    );
    let (st, _) = h.submit(1, sgl_sqe(0x02, 1, (list, 32, SGL_SEGMENT), 128, 23));
    assert_eq!(code(st), SUCCESS, "SGL read");
    let mut got = h.mem.at(back, 2048).to_vec();
    got.extend_from_slice(h.mem.at(back + 0x1002, 6000));
    got.extend_from_slice(h.mem.at(back + 0x3000, 4240));
    assert!(got == pattern, "the SGL read scattered the data back");
    // One Data Block in the command, longer than the transfer (SGLS bit 18).
    let one = DATA + 0x20000;
    let (st, _) = h.submit(1, sgl_sqe(0x02, 1, (one, 16384, SGL_DATA_BLOCK), 128, 23));
    assert_eq!(code(st), SUCCESS);
    assert!(h.mem.at(one, 12288) == &pattern[..]);
    assert!(h.mem.at(one + 12288, 4096).iter().all(|&b| b == 0));
}

/// Interrupt Coalescing (Feature 08h) and Interrupt Vector Configuration (09h). Without
/// coalescing, commands completed one at a time raise the I/O vector once each, and a batch
/// completed in one poller pass raises it once. With a threshold, commands completed one at
/// a time raise it fewer times than they complete (every completion still arrives); with
/// fewer completions than the threshold the aggregation time still raises it; Coalescing
/// Disable and the admin queue's vector 0 raise once per command.
#[test]
fn interrupt_coalescing_raises_the_io_vector_less_often() {
    let s = serve();
    let mut h = RawHost::connect(s.dir.path());
    let [admin_irq, io_irq] = msix_eventfds(&mut h);
    // The I/O completion queue: contiguous, interrupts enabled, vector 1.
    h.io_queues_on(1 | 2 | 1 << 16);
    let read = |lba: u32| sqe(0x02, 1, DATA + 0x1000 * (lba as u64 % 8), 0, lba, 0, 7);
    let get = |h: &mut RawHost, f: u32, cdw11: u32| {
        let (st, dw0) = h.submit(0, sqe(0x0A, 0, 0, 0, f, cdw11, 0));
        assert_eq!(code(st), SUCCESS, "Get Features {f:#x}");
        dw0
    };
    let set = |h: &mut RawHost, f: u32, v: u32| {
        let (st, _) = h.submit(0, sqe(0x09, 0, 0, 0, f, v, 0));
        assert_eq!(code(st), SUCCESS, "Set Features {f:#x} {v:#x}");
    };
    // Signals on `fd` until `want` came or 5 s passed, then whatever follows within 60 ms.
    let wait_for = |fd: &std::os::fd::OwnedFd, want: u64| {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut got = 0;
        while got < want && Instant::now() < deadline {
            got += signals(fd);
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(60));
        got + signals(fd)
    };
    let one_at_a_time = |h: &mut RawHost, n: u32| {
        for lba in 0..n {
            assert_eq!(code(h.submit(1, read(lba)).0), SUCCESS);
        }
    };
    // Defaults: Get Features reads 0 (THR 0, TIME 0: no coalescing); vector 1 has CD clear.
    assert_eq!(get(&mut h, 0x08, 0), 0);
    assert_eq!(get(&mut h, 0x09, 1), 1);
    one_at_a_time(&mut h, 14);
    assert_eq!(
        wait_for(&io_irq, 14),
        14,
        "no coalescing: one per completion"
    );
    let batch: Vec<_> = (0..14).map(read).collect();
    assert!(h.submit_all(&batch).iter().all(|&st| code(st) == SUCCESS));
    let raised = wait_for(&io_irq, 1);
    assert!(
        (1..14).contains(&raised),
        "14 completions in one pass raised the vector {raised} times"
    );
    signals(&admin_irq);
    // THR = 6 (seven completions), TIME = 255 (25.5 ms).
    set(&mut h, 0x08, 6 | 255 << 8);
    assert_eq!(get(&mut h, 0x08, 0), 6 | 255 << 8);
    assert_eq!(get(&mut h, 0x08 | 1 << 8, 0), 0, "the default");
    // Set, Get, Get: three admin commands, three interrupts.
    let admin_raised = wait_for(&admin_irq, 3);
    assert_eq!(
        admin_raised, 3,
        "the admin queue's vector is never coalesced"
    );
    one_at_a_time(&mut h, 14);
    let raised = wait_for(&io_irq, 2);
    assert!(
        (1..14).contains(&raised),
        "14 completions with a threshold of 7 raised the vector {raised} times"
    );
    // THR = 255, TIME = 10 (1 ms): three completions, and the time raises the vector.
    set(&mut h, 0x08, 255 | 10 << 8);
    one_at_a_time(&mut h, 3);
    assert!(
        wait_for(&io_irq, 1) >= 1,
        "the aggregation time passed without an interrupt"
    );
    // Coalescing Disable on vector 1: one interrupt per command, submitted one at a time.
    set(&mut h, 0x08, 255 | 255 << 8);
    set(&mut h, 0x09, 1 | 1 << 16);
    assert_eq!(get(&mut h, 0x09, 1), 1 | 1 << 16);
    one_at_a_time(&mut h, 6);
    assert_eq!(
        wait_for(&io_irq, 6),
        6,
        "CD set: every completion raises the vector"
    );
    // A vector the function does not have; a saved value: refused.
    let (st, _) = h.submit(0, sqe(0x09, 0, 0, 0, 0x09, 64, 0));
    assert_eq!(code(st), INVALID_FIELD);
    let (st, _) = h.submit(0, sqe(0x09, 0, 0, 0, 0x08 | 1 << 31, 0, 0));
    assert_eq!(code(st), 0x10D, "Feature Identifier Not Saveable");
    // A controller reset restores the defaults.
    h.c.region_write(BAR0, 0x14, &0u32.to_le_bytes()).unwrap();
    h.wait_csts(|v| v & 1 == 0, "CSTS.RDY clear");
    drop(h);
    let mut h = RawHost::connect(s.dir.path());
    assert_eq!(get(&mut h, 0x08, 0), 0);
    assert_eq!(get(&mut h, 0x09, 1), 1);
}

/// A function with MSI (`Signals::Msi`, what QEMU 11.1.3 can hot-remove): its capability
/// list has MSI and no MSI-X, it has no BAR4 or BAR5, vfio-user offers 32 vectors on the MSI
/// index and none on MSI-X's. With one MSI vector enabled (Linux on x86), a completion queue
/// on vector 1 raises vector 0; INTMS holds a vector's interrupt back and INTMC raises it;
/// with MSI off nothing is raised.
#[test]
fn an_msi_function_signals_through_msi_and_intms_masks_it() {
    use std::os::fd::{AsRawFd, FromRawFd};
    let s = serve_with(Signals::Msi);
    let mut h = RawHost::connect(s.dir.path());
    let mut cfg = [0u8; 256];
    for (i, chunk) in cfg.chunks_mut(64).enumerate() {
        h.c.region_read(CONFIG, 64 * i as u64, chunk).unwrap();
    }
    let (mut at, mut ids) = (cfg[0x34] as usize, Vec::new());
    while at != 0 && ids.len() < 8 {
        ids.push((cfg[at], at));
        at = cfg[at + 1] as usize;
    }
    assert_eq!(
        ids.iter().map(|c| c.0).collect::<Vec<_>>(),
        vec![0x01, 0x05, 0x10],
        "PM, MSI, PCIe and no MSI-X"
    );
    let msi = ids[1].1 as u64;
    let ctrl = u16::from_le_bytes([cfg[msi as usize + 2], cfg[msi as usize + 3]]);
    assert_eq!((ctrl >> 1) & 7, 5, "Multiple Message Capable: 32 vectors");
    assert_ne!(ctrl & 1 << 7, 0, "64-bit message address");
    assert_eq!(h.c.region(4).map(|r| r.size).unwrap_or(0), 0, "no BAR4");
    assert_eq!(h.c.region(5).map(|r| r.size).unwrap_or(0), 0, "no BAR5");
    const MSI_INDEX: u32 = 1;
    const MSIX_INDEX: u32 = 2;
    assert_eq!(h.c.get_irq_info(MSI_INDEX).unwrap().count, 32);
    assert_eq!(h.c.get_irq_info(MSIX_INDEX).unwrap().count, 0);
    // SAFETY: eventfd(2) with flags only; the result is checked, then owned once.
    let irq = unsafe {
        let fd = libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC);
        assert!(fd >= 0);
        std::os::fd::OwnedFd::from_raw_fd(fd)
    };
    const TRIGGER_EVENTFD: u32 = 1 << 5 | 1 << 2;
    h.c.set_irqs(MSI_INDEX, TRIGGER_EVENTFD, 0, 1, &[irq.as_raw_fd()])
        .unwrap();
    // The I/O completion queue on vector 1 (of 32 offered); MSI still off.
    h.io_queues_on(1 | 2 | 1 << 16);
    let read = sqe(0x02, 1, DATA, 0, 0, 0, 7);
    let wait_for = |want: u64| {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut got = 0;
        while got < want && Instant::now() < deadline {
            got += signals(&irq);
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(30));
        got + signals(&irq)
    };
    assert_eq!(code(h.submit(1, read).0), SUCCESS);
    assert_eq!(wait_for(0), 0, "MSI off: no interrupt");
    // MSI Enable with Multiple Message Enable 000b: one vector.
    h.c.region_write(CONFIG, msi + 2, &(ctrl | 1).to_le_bytes())
        .unwrap();
    assert_eq!(code(h.submit(1, read).0), SUCCESS);
    assert_eq!(
        wait_for(1),
        1,
        "vector 1 raised as vector 0, the one enabled"
    );
    // INTMS masks vector 0: the completion arrives, its interrupt waits for INTMC.
    h.c.region_write(BAR0, 0x0C, &1u32.to_le_bytes()).unwrap();
    let mut intms = [0u8; 4];
    h.c.region_read(BAR0, 0x0C, &mut intms).unwrap();
    assert_eq!(u32::from_le_bytes(intms), 1, "INTMS reads the mask");
    assert_eq!(code(h.submit(1, read).0), SUCCESS);
    assert_eq!(code(h.submit(1, read).0), SUCCESS);
    assert_eq!(wait_for(0), 0, "masked: no interrupt");
    h.c.region_write(BAR0, 0x10, &1u32.to_le_bytes()).unwrap();
    assert_eq!(
        wait_for(1),
        1,
        "INTMC raised the vector that came due while masked"
    );
    h.c.region_read(BAR0, 0x0C, &mut intms).unwrap();
    assert_eq!(u32::from_le_bytes(intms), 0);
    // Unmasked again: one interrupt per completion.
    assert_eq!(code(h.submit(1, read).0), SUCCESS);
    assert_eq!(wait_for(1), 1);
}

#[test]
fn a_hostile_host_gets_error_statuses_and_cannot_write_outside_its_memory() {
    let s = serve();
    let mut h = RawHost::connect(s.dir.path());
    h.io_queues();
    let before = {
        let mut b = vec![0u8; 1 << 20];
        s.vol.read_at(0, &mut b).unwrap();
        b
    };
    // PRPs outside the mapped memory: the data pointer, the second page, the list, and an
    // entry of the list.
    let outside = 0x4000_0000u64;
    assert_eq!(
        code(h.submit(1, sqe(0x01, 1, outside, 0, 0, 0, 7)).0),
        DATA_TRANSFER_ERROR
    );
    assert_eq!(
        code(h.submit(1, sqe(0x02, 1, outside, 0, 0, 0, 7)).0),
        DATA_TRANSFER_ERROR
    );
    assert_eq!(
        code(h.submit(1, sqe(0x01, 1, DATA, outside, 0, 0, 15)).0),
        DATA_TRANSFER_ERROR
    );
    assert_eq!(
        code(h.submit(1, sqe(0x01, 1, DATA, outside, 0, 0, 31)).0),
        DATA_TRANSFER_ERROR
    );
    let list = DATA + 0xF000;
    h.mem.at(list, 8).copy_from_slice(&outside.to_le_bytes());
    assert_eq!(
        code(h.submit(1, sqe(0x01, 1, DATA, list, 0, 0, 31)).0),
        DATA_TRANSFER_ERROR
    );
    // A PRP list that is not there (zero pointer), a misaligned one, and a transfer beyond
    // MDTS (128 KiB): no data moves.
    assert_eq!(
        code(h.submit(1, sqe(0x01, 1, DATA, 0, 0, 0, 31)).0),
        PRP_OFFSET_INVALID
    );
    assert_eq!(
        code(h.submit(1, sqe(0x01, 1, DATA, list + 4, 0, 0, 31)).0),
        PRP_OFFSET_INVALID
    );
    assert_eq!(
        code(h.submit(1, sqe(0x01, 1, DATA, list, 0, 0, 511)).0),
        INVALID_FIELD
    );
    // Hostile SGLs: a data block and a segment outside the memory, a block straddling its
    // end, a segment naming itself forever, a Bit Bucket, a segment descriptor inside a
    // last segment, descriptors that add up to less than the transfer; and an SGL on an
    // admin command (PRPs only over PCIe).
    let end = IOVA + MEM_LEN as u64;
    let sgl_list = DATA + 0xE000;
    for (op, desc, want) in [
        (0x01, (outside, 4096, SGL_DATA_BLOCK), DATA_TRANSFER_ERROR),
        (0x02, (outside, 4096, SGL_DATA_BLOCK), DATA_TRANSFER_ERROR),
        (0x02, (end - 512, 4096, SGL_DATA_BLOCK), DATA_TRANSFER_ERROR),
        (0x01, (outside, 16, SGL_LAST_SEGMENT), DATA_TRANSFER_ERROR),
        (
            0x02,
            (DATA, 4096, SGL_BIT_BUCKET),
            SGL_DESCRIPTOR_TYPE_INVALID,
        ),
        (0x01, (DATA, 4095, SGL_DATA_BLOCK), DATA_SGL_LENGTH_INVALID),
    ] {
        assert_eq!(
            code(h.submit(1, sgl_sqe(op, 1, desc, 0, 7)).0),
            want,
            "opcode {op:#x}, SGL {desc:x?}"
        );
    }
    put_sgl(
        &mut h.mem,
        sgl_list,
        &[(DATA, 0, SGL_DATA_BLOCK), (sgl_list, 32, SGL_SEGMENT)],
    );
    assert_eq!(
        code(
            h.submit(1, sgl_sqe(0x01, 1, (sgl_list, 32, SGL_SEGMENT), 0, 7))
                .0
        ),
        INVALID_NUMBER_OF_SGL_DESCRIPTORS
    );
    put_sgl(&mut h.mem, sgl_list, &[(sgl_list, 16, SGL_SEGMENT)]);
    assert_eq!(
        code(
            h.submit(1, sgl_sqe(0x01, 1, (sgl_list, 16, SGL_LAST_SEGMENT), 0, 7))
                .0
        ),
        INVALID_SGL_SEGMENT_DESCRIPTOR
    );
    put_sgl(&mut h.mem, sgl_list, &[(outside, 4096, SGL_DATA_BLOCK)]);
    assert_eq!(
        code(
            h.submit(1, sgl_sqe(0x02, 1, (sgl_list, 16, SGL_LAST_SEGMENT), 0, 7))
                .0
        ),
        DATA_TRANSFER_ERROR
    );
    let mut identify = sgl_sqe(0x06, 0, (DATA, 4096, SGL_DATA_BLOCK), 1, 0);
    identify[44..48].fill(0);
    assert_eq!(code(h.submit(0, identify).0), INVALID_FIELD);
    h.mem.at(sgl_list, 64).fill(0);
    let mut after = vec![0u8; 1 << 20];
    s.vol.read_at(0, &mut after).unwrap();
    assert!(after == before, "a refused write changed the volume");
    // A Read whose data would land outside the memory changed nothing in it either.
    assert!(h.mem.at(DATA, 4096).iter().all(|&b| b == 0));
    // Doorbell Buffer Config with a buffer outside the memory, a misaligned one, or one page
    // for both: Invalid Field, and the registers stay in charge (the I/O below still works).
    for (shadow, event_idx) in [
        (outside, DATA),
        (DATA, outside),
        (DATA + 8, DATA + 0x1000),
        (DATA, DATA),
        (0, DATA),
    ] {
        assert_eq!(
            code(h.submit(0, sqe(0x7C, 0, shadow, event_idx, 0, 0, 0)).0),
            INVALID_FIELD,
            "Doorbell Buffer Config {shadow:#x} {event_idx:#x}"
        );
    }
    assert_eq!(code(h.submit(1, sqe(0x02, 1, DATA, 0, 0, 0, 0)).0), 0);
    // A doorbell beyond the queue's size: Controller Fatal Status, and nothing more is
    // served until the host resets the controller.
    h.ring(1, QSIZE as u32 + 5);
    h.wait_csts(|v| v & 2 == 2, "CSTS.CFS");
    h.c.region_write(BAR0, 0x14, &0u32.to_le_bytes()).unwrap();
    h.wait_csts(|v| v & 3 == 0, "CSTS.RDY and CFS clear after reset");
    drop(h);
    // The controller serves the next host as new.
    let mut h = RawHost::connect(s.dir.path());
    let (st, _) = h.submit(0, sqe(0x06, 0, DATA, 0, 1, 0, 0));
    assert_eq!(code(st), SUCCESS, "Identify after a hostile host");
    assert_eq!(&h.mem.at(DATA + 24, 5)[..], b"nacre");
}

#[test]
fn malformed_vfio_user_messages_close_the_connection_not_the_controller() {
    use std::io::{Read, Write};
    let s = serve();
    let sock = s.dir.path().join("cntrl");
    let header = |id: u16, cmd: u16, size: u32| {
        let mut h = Vec::new();
        h.extend_from_slice(&id.to_le_bytes());
        h.extend_from_slice(&cmd.to_le_bytes());
        h.extend_from_slice(&size.to_le_bytes());
        h.extend_from_slice(&[0; 8]);
        h
    };
    // A size smaller than the header, a size beyond any message, then a region read far
    // out of range and an unknown command (error replies, connection kept).
    for bad in [header(1, 1, 8), header(1, 9, 0xFFFF_FFF0)] {
        let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(&bad).unwrap();
        let mut b = [0u8; 16];
        assert_eq!(
            c.read(&mut b).unwrap(),
            0,
            "the server closes a connection it cannot parse"
        );
    }
    let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = header(7, 9, 32);
    req.extend_from_slice(&u64::MAX.to_le_bytes());
    req.extend_from_slice(&0u32.to_le_bytes());
    req.extend_from_slice(&4096u32.to_le_bytes());
    c.write_all(&req).unwrap();
    let mut reply = [0u8; 16];
    c.read_exact(&mut reply).unwrap();
    assert_eq!(u16::from_le_bytes([reply[0], reply[1]]), 7);
    assert_ne!(
        u32::from_le_bytes(reply[8..12].try_into().unwrap()) & 1 << 5,
        0,
        "error flag"
    );
    c.write_all(&header(8, 200, 16)).unwrap();
    c.read_exact(&mut reply).unwrap();
    assert_ne!(
        u32::from_le_bytes(reply[8..12].try_into().unwrap()) & 1 << 5,
        0,
        "error flag"
    );
    drop(c);
    // A well-formed host is served afterwards.
    let mut h = RawHost::connect(s.dir.path());
    h.io_queues();
    assert_eq!(code(h.submit(1, sqe(0x00, 1, 0, 0, 0, 0, 0)).0), SUCCESS);
}

/// The operator's way: `nacre nvmf add-listener --transport vfio-user --path DIR` on a
/// running nacred, SPDK's driver sees the controller, the listener is persisted and
/// replayed by a restart, and removing it removes the socket.
#[test]
fn nacred_serves_a_vfio_user_listener_added_by_the_cli_and_replays_it() {
    use nacre_tests::daemon::Nacred;
    use serde_json::json;
    let mut n = Nacred::start();
    n.ok(
        "volume_create",
        json!({"name": "pv", "size": 16 << 20, "block_size": 4096}),
    );
    n.ok(
        "nvmf_subsystem_create",
        json!({"nqn": NQN, "serial": SERIAL, "allow_any_host": true}),
    );
    n.ok("nvmf_subsystem_add_ns", json!({"nqn": NQN, "volume": "pv"}));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap();
    // Without --path, and with a directory that does not exist: one-line errors.
    let out = n.cli(&["nvmf", "add-listener", NQN, "--transport", "vfio-user"]);
    assert!(!out.status.success());
    let missing = dir.path().join("missing");
    let out = n.cli(&[
        "nvmf",
        "add-listener",
        NQN,
        "--transport",
        "vfio-user",
        "--path",
        missing.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no such directory"));
    let out = n.cli(&[
        "nvmf",
        "add-listener",
        NQN,
        "--transport",
        "vfio-user",
        "--path",
        path,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("PCIe NVMe controller"));
    let identify = || {
        run_spdk(
            "spdk_nvme_identify",
            &["--no-huge", "-s", "1024", "-r", &trid(dir.path())],
        )
    };
    let out = identify();
    assert!(
        out.contains(&format!("Serial Number:                         {SERIAL}")),
        "{out}"
    );
    // The controller's I/O is counted in its volume's statistics, like every transport's.
    run_spdk(
        "spdk_nvme_perf",
        &[
            "--no-huge",
            "-s",
            "1024",
            "-q",
            "4",
            "-o",
            "4096",
            "-w",
            "randrw",
            "-M",
            "50",
            "-t",
            "1",
            "-r",
            &trid(dir.path()),
        ],
    );
    let st = n.ok("stats_get", json!({"volume": "pv"}))[0].clone();
    assert!(
        st["read_ops"].as_u64() > Some(0) && st["write_ops"].as_u64() > Some(0),
        "PCIe I/O missing from the volume's statistics: {st}"
    );
    // The controller's poller in `nvmf_get_stats` and `nacre nvmf stats`: the passes that
    // found work for perf's commands, and their time.
    let pcie = n.ok("nvmf_get_stats", json!({}))["pcie"].clone();
    let p = &pcie[0];
    assert_eq!(
        (
            p["nqn"].as_str(),
            p["path"].as_str(),
            pcie.as_array().map(Vec::len)
        ),
        (Some(NQN), Some(path), Some(1)),
        "{pcie}"
    );
    assert!(
        p["busy_passes"].as_u64() > Some(0)
            && p["busy_ns"].as_u64() > Some(0)
            && p["busy_ns"].as_u64() < p["at_ns"].as_u64(),
        "{pcie}"
    );
    let out = n.cli(&["nvmf", "stats"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = table
        .lines()
        .skip_while(|l| !l.starts_with("PCIE CONTROLLER"))
        .nth(1)
        .unwrap_or_else(|| panic!("no PCIe table in `nacre nvmf stats`:\n{table}"));
    assert!(
        row.starts_with(path)
            && row.contains(NQN)
            && row.trim_end().ends_with(|c: char| c.is_ascii_digit()),
        "{table}"
    );
    let subs = n.ok("nvmf_get_subsystems", json!({}));
    let listed = format!("vfio-user:{path}");
    assert!(subs.to_string().contains(&listed), "{subs}");
    // A second controller whose function has MSI instead of MSI-X (--interrupts msi); the
    // option is refused for other transports and values other than msix and msi.
    let msi_dir = tempfile::tempdir().unwrap();
    let msi_path = msi_dir.path().to_str().unwrap();
    let out = n.cli(&[
        "nvmf",
        "add-listener",
        NQN,
        "--address",
        "127.0.0.1",
        "--port",
        "0",
        "--interrupts",
        "msi",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--interrupts is for --transport vfio-user"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, msg) = n.err(
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "transport": "vfio-user", "address": msi_path, "interrupts": "intx"}),
    );
    assert!(msg.contains("interrupts \"intx\""), "{msg}");
    let (_, msg) = n.err(
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "address": "127.0.0.1", "port": 0, "interrupts": "msi"}),
    );
    assert!(msg.contains("vfio-user listeners only"), "{msg}");
    let out = n.cli(&[
        "nvmf",
        "add-listener",
        NQN,
        "--transport",
        "vfio-user",
        "--path",
        msi_path,
        "--interrupts",
        "msi",
    ]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("vfio-user, MSI)"),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let interrupts_of = |n: &Nacred| {
        let subs = n.ok("nvmf_get_subsystems", json!({}));
        let sub = subs
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["nqn"] == NQN)
            .unwrap()
            .clone();
        let of = |p: &str| {
            sub["listener_states"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["address"] == format!("vfio-user:{p}"))
                .map(|l| l["interrupts"].clone())
        };
        (of(path), of(msi_path))
    };
    assert_eq!(interrupts_of(&n), (Some(json!("msix")), Some(json!("msi"))));
    let listing = String::from_utf8_lossy(&n.cli(&["nvmf", "list"]).stdout).to_string();
    assert!(
        listing.contains(&format!("vfio-user:{msi_path} msi")),
        "{listing}"
    );
    // Persisted and replayed, each with its interrupts.
    n.restart();
    let out = identify();
    assert!(
        out.contains("Model Number:                          nacre"),
        "{out}"
    );
    assert_eq!(interrupts_of(&n), (Some(json!("msix")), Some(json!("msi"))));
    let mut c = vfio_user::Client::new(&msi_dir.path().join("cntrl")).unwrap();
    assert_eq!(
        c.get_irq_info(1).unwrap().count,
        32,
        "the replayed function has MSI"
    );
    assert_eq!(c.get_irq_info(2).unwrap().count, 0, "and no MSI-X");
    drop(c);
    // A reboot empties /run: the listener's directory is made again at start.
    assert!(n.stop(), "{}", n.log_text());
    std::fs::remove_dir_all(dir.path()).unwrap();
    n.spawn_again();
    let out = identify();
    assert!(
        out.contains("Model Number:                          nacre"),
        "{out}\n{}",
        n.log_text()
    );
    let out = n.cli(&[
        "nvmf",
        "remove-listener",
        NQN,
        "--transport",
        "vfio-user",
        "--path",
        path,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!dir.path().join("cntrl").exists(), "the socket is removed");
    let subs = n.ok("nvmf_get_subsystems", json!({}));
    assert!(!subs.to_string().contains(&listed), "{subs}");
}

#[test]
fn removing_the_listener_disconnects_its_client() {
    let s = serve();
    let mut h = RawHost::connect(s.dir.path());
    h.io_queues();
    s.ports.remove_listener(NQN, s.dir.path()).unwrap();
    assert!(
        !s.dir.path().join("cntrl").exists(),
        "the socket is removed"
    );
    let mut b = [0u8; 4];
    assert!(
        h.c.region_read(BAR0, 0x1C, &mut b).is_err(),
        "the client is disconnected"
    );
    assert!(s.ports.listeners().is_empty());
}
