//! nacred and qemu-storage-daemon, QEMU's own vhost-user-blk server, as interchangeable peers:
//! the same libblkio workload against both, on one disk image, each reading back exactly what
//! the other wrote.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nacre_tests::blkio_client::{flush, read, write, BlkioClient, ClientOptions};
use nacre_tests::daemon::Nacred;
use serde_json::json;

const SIZE: u64 = 16 << 20;
const CHUNK: usize = 64 << 10;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// qemu-storage-daemon exporting `image` as vhost-user-blk on `sock`.
struct Qsd(Child);

impl Qsd {
    fn start(image: &Path, sock: &Path) -> Qsd {
        let _ = std::fs::remove_file(sock);
        let child = Command::new("qemu-storage-daemon")
            .arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=n0,filename={},cache.direct=off",
                image.display()
            ))
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e0,node-name=n0,addr.type=unix,addr.path={},writable=on,num-queues=2",
                sock.display()
            ))
            .stdin(Stdio::null())
            .spawn()
            .expect("qemu-storage-daemon (scripts/setup --test installs it, from qemu-utils)");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !sock.exists() {
            assert!(
                Instant::now() < deadline,
                "qemu-storage-daemon did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Qsd(child)
    }
}

impl Drop for Qsd {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

fn opts() -> ClientOptions {
    ClientOptions {
        queues: 2,
        ..Default::default()
    }
}

/// Write a distinct chunk at each offset (alternating queues), then flush.
fn write_all(sock: &Path, seed: u64, offsets: &[u64]) {
    let mut c = BlkioClient::connect(sock, &opts()).unwrap();
    assert_eq!(c.capacity().unwrap(), SIZE);
    let mut queues = c.take_queues();
    for (i, &off) in offsets.iter().enumerate() {
        let buf = &mut c.mem()[..CHUNK];
        buf.copy_from_slice(&pattern(seed + off, CHUNK));
        assert_eq!(
            write(&mut queues[i % 2], off, buf).unwrap(),
            0,
            "write @{off}"
        );
    }
    assert_eq!(flush(&mut queues[0]).unwrap(), 0);
}

fn verify_all(sock: &Path, seed: u64, offsets: &[u64], who: &str) {
    let mut c = BlkioClient::connect(sock, &opts()).unwrap();
    assert_eq!(c.capacity().unwrap(), SIZE, "{who}");
    let mut queues = c.take_queues();
    for (i, &off) in offsets.iter().enumerate() {
        let buf = &mut c.mem()[..CHUNK];
        buf.fill(0);
        assert_eq!(
            read(&mut queues[i % 2], off, buf).unwrap(),
            0,
            "read @{off}"
        );
        assert!(
            *buf == pattern(seed + off, CHUNK)[..],
            "{who}: data at {off} is not what was written"
        );
    }
}

#[test]
fn nacred_and_qemu_storage_daemon_read_each_others_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("disk.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    let a: Vec<u64> = (0..16).map(|k| k * 3 * CHUNK as u64 % SIZE).collect();
    let b: Vec<u64> = (0..16).map(|k| (k * 3 + 1) * CHUNK as u64 % SIZE).collect();

    // 1. qemu-storage-daemon writes A.
    let qsd_sock = tmp.path().join("qsd.sock");
    {
        let _q = Qsd::start(&image, &qsd_sock);
        write_all(&qsd_sock, 1, &a);
        verify_all(&qsd_sock, 1, &a, "qemu-storage-daemon");
    }

    // 2. nacred adopts the image, reads A and writes B.
    let mut n = Nacred::start_args(&["--no-default"]);
    n.ok(
        "volume_create",
        json!({"name": "d", "path": image, "adopt_existing": true, "block_size": 512}),
    );
    let dev = n.ok(
        "vhost_blk_create",
        json!({"name": "d0", "volume": "d", "queues": 2}),
    );
    let sock = std::path::PathBuf::from(dev["socket"].as_str().unwrap());
    verify_all(&sock, 1, &a, "nacred reading qemu-storage-daemon's writes");
    write_all(&sock, 2, &b);
    assert!(n.stop());

    // 3. qemu-storage-daemon reads both.
    let _q = Qsd::start(&image, &qsd_sock);
    verify_all(&qsd_sock, 1, &a, "qemu-storage-daemon after nacred");
    verify_all(
        &qsd_sock,
        2,
        &b,
        "qemu-storage-daemon reading nacred's writes",
    );
}
