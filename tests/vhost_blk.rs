//! virtio-blk over vhost-user, driven end to end by libblkio (an independent client) against
//! an in-process `VhostBlkServer` on RAM and file volumes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::frontend::vhost_user_blk::{VhostBlkConfig, VhostBlkServer};
use nacre_dpu::volume::file::FileVolume;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;
use nacre_tests::blkio_client::{self as bc, BlkioClient, ClientOptions};

const EIO: i32 = -libc::EIO;

fn config(dir: &Path, queues: u16) -> VhostBlkConfig {
    VhostBlkConfig {
        socket: dir.join("vhost-blk.sock"),
        queues,
        queue_size: 1024,
        read_only: false,
        serial: "nacre-test-serial".into(),
    }
}

fn start(cfg: VhostBlkConfig, vol: Arc<dyn BlockDevice>) -> VhostBlkServer {
    VhostBlkServer::start(cfg, vol).expect("server starts")
}

fn connect(socket: &Path, queues: usize) -> BlkioClient {
    BlkioClient::connect(
        socket,
        &ClientOptions {
            queues,
            ..ClientOptions::default()
        },
    )
    .expect("libblkio connects")
}

/// A deterministic, position-dependent pattern: any misplaced or stale block shows.
fn pattern(offset: u64, seed: u64, buf: &mut [u8]) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let v = (offset + i as u64 * 8)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(seed);
        chunk.copy_from_slice(&v.to_le_bytes()[..chunk.len()]);
    }
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Write patterns at many offsets and sizes from every queue in parallel (each queue owns
/// a disjoint stripe), read everything back through a different queue and compare.
fn patterns_on_queues(vol: Arc<dyn BlockDevice>, queues: usize) {
    let dir = tempfile::tempdir().unwrap();
    let bs = vol.geometry().block_size as u64;
    let server = start(config(dir.path(), queues as u16), vol.clone());
    let mut client = connect(server.socket(), queues);
    assert!(server.is_connected());
    let capacity = client.capacity().unwrap();
    assert_eq!(capacity, vol.geometry().size);
    let stripe = capacity / queues as u64 / (128 * 1024) * (128 * 1024);
    let mem_per_q = client.mem_len() / queues;
    let base = client.mem_ptr() as usize;
    let sizes = [bs, 2 * bs, 8 * bs, 16 * bs, 33 * bs, 128 * 1024];
    let qs = client.take_queues();
    let handles: Vec<_> = qs
        .into_iter()
        .enumerate()
        .map(|(qi, mut q)| {
            std::thread::spawn(move || {
                // SAFETY: each thread uses its own disjoint slice of the shared region.
                let buf = unsafe {
                    std::slice::from_raw_parts_mut((base + qi * mem_per_q) as *mut u8, mem_per_q)
                };
                let start = qi as u64 * stripe;
                let mut off = start;
                let mut written = Vec::new();
                let mut k = 0;
                while off + 128 * 1024 <= start + stripe && written.len() < 200 {
                    let len = sizes[k % sizes.len()] as usize;
                    pattern(off, 7, &mut buf[..len]);
                    assert_eq!(
                        bc::write(&mut q, off, &buf[..len]).unwrap(),
                        0,
                        "write at {off}"
                    );
                    written.push((off, len));
                    off += len as u64 + bs * (k as u64 % 3);
                    k += 1;
                }
                for &(off, len) in &written {
                    buf[..len].fill(0xee);
                    assert_eq!(bc::read(&mut q, off, &mut buf[..len]).unwrap(), 0);
                    let mut want = vec![0u8; len];
                    pattern(off, 7, &mut want);
                    assert!(
                        buf[..len] == want[..],
                        "queue {qi}: data mismatch at {off}+{len}"
                    );
                }
                (q, written)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut qs = Vec::new();
    for h in handles {
        let (q, w) = h.join().expect("queue thread");
        qs.push(q);
        all.extend(w);
    }
    // Cross-check through one queue and through the volume itself.
    let buf = client.mem();
    for &(off, len) in all.iter().step_by(7) {
        assert_eq!(bc::read(&mut qs[0], off, &mut buf[..len]).unwrap(), 0);
        let mut want = vec![0u8; len];
        pattern(off, 7, &mut want);
        assert!(buf[..len] == want[..], "cross-queue mismatch at {off}");
        let mut direct = vec![0u8; len];
        vol.read_at(off, &mut direct).unwrap();
        assert!(direct == want, "volume holds other bytes at {off}");
    }
    drop(qs);
    drop(client);
    server.stop();
}

#[test]
fn patterns_round_trip_on_ram_volume_four_queues() {
    patterns_on_queues(Arc::new(RamVolume::new(64 << 20, 4096).unwrap()), 4);
}

#[test]
fn patterns_round_trip_on_file_volume_512_byte_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let vol = FileVolume::open(&dir.path().join("disk.img"), 32 << 20, 512, false).unwrap();
    patterns_on_queues(Arc::new(vol), 3);
}

#[allow(dead_code)]
fn socket_in(dir: &Path) -> PathBuf {
    dir.join("vhost-blk.sock")
}

#[allow(dead_code)]
const _EIO: i32 = EIO;
