//! The encrypting volume as a specification of behaviour:
//! ciphertext at rest checked by an independent oracle (pyca/cryptography decrypting the
//! backing file with the exported data key), transparency for reads and writes of any
//! segment layout, asynchronous devices below, zeroing, and refusal of bad input.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nacre_dpu::crypto::kek::KeyFileKek;
use nacre_dpu::crypto::tenant::{TenantRecord, UnlockedKek};
use nacre_dpu::crypto::volume::EncryptedVolume;
use nacre_dpu::crypto::xts::EngineKind;
use nacre_dpu::crypto::{CipherKind, CryptoError, EncryptionPolicy, TweakMode, XtsKey};
use nacre_dpu::volume::file::FileVolume;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::{
    BlockDevice, Geometry, IoCompletion, IoError, IoKind, IoRequest, IoResult, Segment,
};
use nacre_tests::xts_oracle::{python_cryptography_available, python_decrypt_file};

const VOL_SIZE: u64 = 4 << 20;

fn require_oracle() {
    assert!(
        python_cryptography_available(),
        "the XTS oracle needs python3 with the cryptography package: apt-get install python3-cryptography (or pip install cryptography)"
    );
}

/// Deterministic, unit-distinct test data.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

fn key_file(dir: &Path) -> KeyFileKek {
    let p = dir.join("tenant.kek");
    let mut b = [0u8; 32];
    for (i, v) in b.iter_mut().enumerate() {
        *v = pattern(32, 77)[i];
    }
    std::fs::write(&p, b).unwrap();
    KeyFileKek::new(p)
}

/// Tenant with one encrypted volume over a file; returns what a control plane would hold.
struct Setup {
    _dir: tempfile::TempDir,
    dir: std::path::PathBuf,
    file: std::path::PathBuf,
    tenant: TenantRecord,
    kek: UnlockedKek,
    vol: EncryptedVolume,
}

fn setup(block_size: u32, data_unit: u32, tweak: TweakMode) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let policy = EncryptionPolicy {
        cipher: CipherKind::AesXts256,
        data_unit,
        tweak,
        require_encryption: true,
    };
    let (tenant, kek) = TenantRecord::create("acme", policy, &key_file(&dir)).unwrap();
    let (tenant, key) = tenant.add_volume("vol0", block_size, &kek).unwrap();
    let file = dir.join("vol0.img");
    let inner: Arc<dyn BlockDevice> =
        Arc::new(FileVolume::open(&file, VOL_SIZE, block_size, false).unwrap());
    let vol = EncryptedVolume::new(inner, &key, tenant.volumes["vol0"].policy).unwrap();
    assert_eq!(vol.engine_name(), "aws-lc");
    Setup {
        _dir: tmp,
        dir,
        file,
        tenant,
        kek,
        vol,
    }
}

/// Write `data` at `offset` split into segments of the given sizes (the last takes the rest).
fn write_split(dev: &dyn BlockDevice, offset: u64, data: &[u8], sizes: &[usize]) -> IoResult {
    let mut bufs: Vec<Vec<u8>> = Vec::new();
    let mut rest = data;
    for &s in sizes {
        let s = s.min(rest.len());
        bufs.push(rest[..s].to_vec());
        rest = &rest[s..];
    }
    if !rest.is_empty() {
        bufs.push(rest.to_vec());
    }
    // SAFETY: the request is waited for (or completes inline) while the buffer lives.
    let segs: Vec<Segment> = bufs
        .iter_mut()
        .map(|b| unsafe { Segment::from_slice(b) })
        .collect();
    let r = dev.submit_wait(
        IoRequest::new(IoKind::Write, offset, data.len() as u64, 1).with_segments(segs),
    );
    // Writes never touch the submitter's memory (it is guest memory).
    let joined: Vec<u8> = bufs.concat();
    assert_eq!(joined, data, "the write modified its source buffers");
    r
}

fn read_split(dev: &dyn BlockDevice, offset: u64, len: usize, sizes: &[usize]) -> Vec<u8> {
    let mut bufs: Vec<Vec<u8>> = Vec::new();
    let mut left = len;
    for &s in sizes {
        let s = s.min(left);
        bufs.push(vec![0xee; s]);
        left -= s;
    }
    if left > 0 {
        bufs.push(vec![0xee; left]);
    }
    // SAFETY: the request is waited for (or completes inline) while the buffer lives.
    let segs: Vec<Segment> = bufs
        .iter_mut()
        .map(|b| unsafe { Segment::from_slice(b) })
        .collect();
    dev.submit_wait(IoRequest::new(IoKind::Read, offset, len as u64, 2).with_segments(segs))
        .unwrap();
    bufs.concat()
}

fn export(s: &Setup) -> Vec<u8> {
    let path = s.dir.join("vol0.key");
    s.tenant.export_key("vol0", &s.kek, &path, true).unwrap();
    std::fs::read(path).unwrap()
}

/// Write through the wrapper, decrypt the backing file with pyca/cryptography, compare.
fn oracle_round(block_size: u32, data_unit: u32, tweak: TweakMode) {
    require_oracle();
    let s = setup(block_size, data_unit, tweak);
    let bs = block_size as usize;
    // Several writes: aligned single segment, segments that split data units, a write at
    // the very end of the volume.
    let writes: Vec<(u64, Vec<u8>, Vec<usize>)> = vec![
        (0, pattern(64 * 1024, 1), vec![]),
        (
            (16 * bs) as u64 + 128 * 1024,
            pattern(8 * bs, 2),
            vec![bs / 2 + 16, 3 * bs, 100],
        ),
        (VOL_SIZE - 2 * bs as u64, pattern(2 * bs, 3), vec![1]),
    ];
    for (off, data, sizes) in &writes {
        write_split(&s.vol, *off, data, sizes).unwrap();
    }
    s.vol
        .submit_wait(IoRequest::new(IoKind::Flush, 0, 0, 9))
        .unwrap();
    let key = export(&s);
    assert_eq!(key.len(), 64);
    let unit = data_unit as usize;
    for (off, data, _) in &writes {
        let raw = {
            let f = std::fs::read(&s.file).unwrap();
            f[*off as usize..*off as usize + data.len()].to_vec()
        };
        for (i, (c, p)) in raw.chunks(unit).zip(data.chunks(unit)).enumerate() {
            assert_ne!(c, p, "data unit {i} at {off} is stored in plaintext");
        }
        let mode = match tweak {
            TweakMode::Plain64 => "plain64",
            TweakMode::Be64 => "be64",
        };
        let pt = python_decrypt_file(
            &s.file,
            &key,
            unit,
            mode,
            *off,
            data.len(),
            *off / unit as u64,
        )
        .unwrap();
        assert!(
            pt == *data,
            "oracle disagrees at offset {off} ({mode}, unit {unit})"
        );
        // And the wrapper reads back the plaintext, with segments that split units too.
        assert!(read_split(&s.vol, *off, data.len(), &[bs / 2 + 16, 7 * 16]) == *data);
    }
}

#[test]
fn oracle_decrypts_plain64_4096_units() {
    oracle_round(4096, 4096, TweakMode::Plain64);
}

#[test]
fn oracle_decrypts_plain64_512_units() {
    oracle_round(512, 512, TweakMode::Plain64);
}

#[test]
fn oracle_decrypts_be64_4096_units() {
    oracle_round(4096, 4096, TweakMode::Be64);
}

#[test]
fn oracle_decrypts_512_units_on_4096_blocks() {
    oracle_round(4096, 512, TweakMode::Plain64);
}

#[test]
fn every_engine_writes_identical_ciphertext() {
    let key = XtsKey::generate(64).unwrap();
    let policy = EncryptionPolicy::default();
    let data = pattern(256 * 1024, 5);
    let mut images = Vec::new();
    for kind in EngineKind::all() {
        let ram: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(1 << 20, 4096).unwrap());
        let vol = EncryptedVolume::with_engine(ram.clone(), &key, policy, *kind).unwrap();
        write_split(&vol, 4096 * 3, &data, &[5000, 4096 * 3]).unwrap();
        let mut raw = vec![0u8; data.len()];
        ram.read_at(4096 * 3, &mut raw).unwrap();
        images.push((kind.name(), raw));
    }
    for (name, img) in &images[1..] {
        assert!(*img == images[0].1, "{name} differs from {}", images[0].0);
    }
}

/// A device below that completes every request later, on another thread, holding the
/// segments meanwhile: as a remote fabric backend does.
struct LateDevice {
    inner: Arc<dyn BlockDevice>,
    pending: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

// SAFETY: the spawned thread submits the request, with its completion, to the inner volume.
unsafe impl BlockDevice for LateDevice {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let inner = self.inner.clone();
        let done = done.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            inner.submit(req, &done);
        });
        self.pending.lock().unwrap().push(h);
    }
}

#[test]
fn asynchronous_device_below_keeps_bounce_buffers_alive() {
    let ram: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(1 << 20, 4096).unwrap());
    let late: Arc<dyn BlockDevice> = Arc::new(LateDevice {
        inner: ram.clone(),
        pending: Mutex::new(Vec::new()),
    });
    let key = XtsKey::generate(64).unwrap();
    let vol = EncryptedVolume::new(late, &key, EncryptionPolicy::default()).unwrap();
    let data = pattern(64 * 1024, 9);
    // Submit several writes without waiting, then let the source buffers go out of scope:
    // what reaches the device must be the bounce buffers' ciphertext.
    let waiters: Vec<_> = (0..4u64)
        .map(|i| {
            let w = Arc::new(nacre_dpu::volume::Waiter::default());
            let c: Arc<dyn IoCompletion> = w.clone();
            let mut src = data.clone();
            vol.submit(
                IoRequest::new(IoKind::Write, i * 65536, 65536, i)
                    // SAFETY: the request is waited for (or completes inline) while the buffer lives.
                    .with_segments([unsafe { Segment::from_slice(&mut src) }]),
                &c,
            );
            drop(src); // allowed for the purpose of this test: writes only read before submit returns
            w
        })
        .collect();
    for w in waiters {
        w.wait().unwrap();
    }
    for i in 0..4u64 {
        let mut raw = vec![0u8; 65536];
        ram.read_at(i * 65536, &mut raw).unwrap();
        assert!(raw != data, "plaintext reached the device");
        let back = read_split(&vol, i * 65536, 65536, &[]);
        assert!(
            back == data,
            "round trip through a late device failed at {i}"
        );
    }
}

/// A device below that records the longest request it was handed, completing inline or,
/// `late`, on another thread as a remote backend does.
struct Longest {
    inner: Arc<dyn BlockDevice>,
    late: bool,
    longest: std::sync::atomic::AtomicU64,
}

// SAFETY: only reads the length, then the request goes, with its completion, to the inner
// volume (from another thread when `late`).
unsafe impl BlockDevice for Longest {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        self.longest
            .fetch_max(req.len, std::sync::atomic::Ordering::Relaxed);
        if !self.late {
            return self.inner.submit(req, done);
        }
        let (inner, done) = (self.inner.clone(), done.clone());
        std::thread::spawn(move || inner.submit(req, &done));
    }
}

/// Reads and writes longer than one chunk are served a chunk at a time through one bounce
/// buffer: the device below never sees more than `CHUNK` bytes at once (a guest that claims
/// gigabytes cannot make the layer allocate them), and the data is the same as through the
/// one-buffer path of short requests, whichever way the device below completes.
#[test]
fn long_requests_go_down_a_chunk_at_a_time_and_read_back_exactly() {
    use nacre_dpu::crypto::volume::RW_CHUNK as CHUNK;
    for late in [false, true] {
        let below = Arc::new(Longest {
            inner: Arc::new(RamVolume::new(4 * CHUNK as u64, 4096).unwrap()),
            late,
            longest: Default::default(),
        });
        let key = XtsKey::generate(64).unwrap();
        let vol = EncryptedVolume::new(below.clone(), &key, EncryptionPolicy::default()).unwrap();
        // 3.5 chunks, from 4 KiB in, in segments that split data units and chunks.
        let len = 3 * CHUNK + CHUNK / 2;
        let data = pattern(len, 21);
        let sizes = [CHUNK - 100, 4196, 2 * CHUNK + 7];
        write_split(&vol, 4096, &data, &sizes).unwrap();
        assert!(
            below.longest.load(std::sync::atomic::Ordering::Relaxed) <= CHUNK as u64,
            "late {late}: a write went down whole"
        );
        // Read back whole (chunked), and in 64 KiB requests (one bounce each): both agree.
        let whole = read_split(&vol, 4096, len, &[3000, CHUNK, 77]);
        assert!(whole == data, "late {late}: long read differs");
        for (i, piece) in data.chunks(65536).enumerate() {
            let off = 4096 + (i * 65536) as u64;
            assert!(
                read_split(&vol, off, piece.len(), &[]) == piece,
                "late {late}: short read at {off} differs"
            );
        }
        assert!(below.longest.load(std::sync::atomic::Ordering::Relaxed) <= CHUNK as u64);
        // Written in short requests, read back in one long one.
        let other = pattern(len, 22);
        for (i, piece) in other.chunks(65536).enumerate() {
            write_split(&vol, 4096 + (i * 65536) as u64, piece, &[]).unwrap();
        }
        assert!(read_split(&vol, 4096, len, &[]) == other, "late {late}");
    }
}

#[test]
fn write_zeroes_reads_back_zeros_and_discard_passes_through() {
    let ram: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(8 << 20, 4096).unwrap());
    let key = XtsKey::generate(64).unwrap();
    let vol = EncryptedVolume::new(ram.clone(), &key, EncryptionPolicy::default()).unwrap();
    vol.write_at(0, &pattern(8 << 20, 4)).unwrap();
    // Small range (one encrypted write) and a range above the 1 MiB chunk.
    for (off, len) in [(4096u64, 8192u64), (1 << 20, (3 << 20) + 4096)] {
        vol.submit_wait(IoRequest::new(IoKind::WriteZeroes, off, len, 3))
            .unwrap();
        let back = read_split(&vol, off, len as usize, &[]);
        assert!(
            back.iter().all(|&b| b == 0),
            "zeroed range at {off} is not zero"
        );
        let mut raw = vec![0u8; len as usize];
        ram.read_at(off, &mut raw).unwrap();
        assert!(
            raw.iter().any(|&b| b != 0),
            "zeros must be stored encrypted"
        );
    }
    // Neighbours untouched.
    assert_eq!(read_split(&vol, 0, 4096, &[]), pattern(8 << 20, 4)[..4096]);
    // Discard reaches the device: the RAM backend returns zeros there, which decrypt to
    // garbage (documented: discarded contents are undefined).
    vol.submit_wait(IoRequest::new(IoKind::Discard, 6 << 20, 4096, 4))
        .unwrap();
    let mut raw = vec![1u8; 4096];
    ram.read_at(6 << 20, &mut raw).unwrap();
    assert!(raw.iter().all(|&b| b == 0));
    let back = read_split(&vol, 6 << 20, 4096, &[]);
    assert!(back.iter().any(|&b| b != 0));
}

#[test]
fn policy_the_volume_cannot_satisfy_is_refused_before_any_write() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("img");
    let inner: Arc<dyn BlockDevice> =
        Arc::new(FileVolume::open(&file, 1 << 20, 512, false).unwrap());
    let key = XtsKey::generate(64).unwrap();
    let e = EncryptedVolume::new(inner.clone(), &key, EncryptionPolicy::default())
        .err()
        .expect("4096-byte units on 512-byte blocks must be refused");
    assert!(matches!(e, CryptoError::Policy(_)), "{e}");
    // A 32-byte key under an aes-xts-256 policy is refused too.
    let short = XtsKey::generate(32).unwrap();
    let p512 = EncryptionPolicy {
        data_unit: 512,
        ..Default::default()
    };
    assert!(EncryptedVolume::new(inner.clone(), &short, p512).is_err());
    assert!(std::fs::read(&file).unwrap().iter().all(|&b| b == 0));
}

#[test]
fn bad_requests_fail_cleanly_and_write_nothing() {
    let ram: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(1 << 20, 4096).unwrap());
    let key = XtsKey::generate(64).unwrap();
    let vol = EncryptedVolume::new(ram.clone(), &key, EncryptionPolicy::default()).unwrap();
    let mut buf = vec![7u8; 8192];
    // Segments shorter than the length, misaligned offset, past the end.
    let short =
        // SAFETY: the request is waited for (or completes inline) while the buffer lives.
        IoRequest::new(IoKind::Write, 0, 16384, 1).with_segments([unsafe { Segment::from_slice(&mut buf) }]);
    assert!(matches!(vol.submit_wait(short), Err(IoError::Invalid(_))));
    let mis =
        // SAFETY: the request is waited for (or completes inline) while the buffer lives.
        IoRequest::new(IoKind::Write, 512, 8192, 1).with_segments([unsafe { Segment::from_slice(&mut buf) }]);
    assert!(matches!(vol.submit_wait(mis), Err(IoError::Invalid(_))));
    let past = IoRequest::new(IoKind::Write, 1 << 20, 8192, 1)
        // SAFETY: the request is waited for (or completes inline) while the buffer lives.
        .with_segments([unsafe { Segment::from_slice(&mut buf) }]);
    assert!(matches!(
        vol.submit_wait(past),
        Err(IoError::OutOfRange { .. })
    ));
    let mut raw = vec![1u8; 1 << 20];
    ram.read_at(0, &mut raw).unwrap();
    assert!(raw.iter().all(|&b| b == 0), "a refused request wrote");
}

#[test]
fn wrong_kek_or_tampered_key_opens_nothing_and_crypto_erase_is_final() {
    let s = setup(4096, 4096, TweakMode::Plain64);
    let data = pattern(32 * 1024, 11);
    s.vol.write_at(0, &data).unwrap();
    let before = std::fs::read(&s.file).unwrap();
    // Wrong KEK.
    let other = s.dir.join("other.kek");
    std::fs::write(&other, [3u8; 32]).unwrap();
    assert!(matches!(
        s.tenant.unlock(&KeyFileKek::new(&other)),
        Err(CryptoError::WrongKek { .. })
    ));
    // Tampered wrapped key (GCM tag).
    let mut bad = s.tenant.clone();
    let w = &mut bad.volumes.get_mut("vol0").unwrap().wrapped[0].wrapped.0;
    let n = w.len();
    w[n - 3] ^= 0x10;
    assert!(matches!(
        bad.open_volume("vol0", &s.kek),
        Err(CryptoError::Tampered { .. })
    ));
    // Crypto-erase: afterwards no record holds any copy of the key, opening fails, the
    // ciphertext stays where it was and still is not the plaintext.
    let erased = s.tenant.crypto_erase("vol0").unwrap();
    let json = serde_json::to_string(&erased).unwrap();
    assert!(erased.volumes["vol0"].wrapped.is_empty());
    assert!(erased.open_volume("vol0", &s.kek).is_err());
    assert!(erased
        .export_key("vol0", &s.kek, &s.dir.join("x.key"), true)
        .is_err());
    assert!(!s.dir.join("x.key").exists());
    assert!(!json.is_empty());
    assert_eq!(std::fs::read(&s.file).unwrap(), before);
    assert!(before[..data.len()] != data[..]);
}

/// A device below that records, for every data segment it is handed, whether the segment
/// lies in memory announced to `volume::dma` (what an RDMA transport may hand its device
/// without a bounce copy).
struct DmaProbe {
    inner: Arc<dyn BlockDevice>,
    seen: Mutex<Vec<bool>>,
}

// SAFETY: only looks the segments' addresses up, then hands the request to the inner volume.
unsafe impl BlockDevice for DmaProbe {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        let mut seen = self.seen.lock().unwrap();
        for s in req.segments.iter() {
            seen.push(nacre_dpu::volume::dma::lookup(s.as_ptr(), s.len()).is_some());
        }
        drop(seen);
        self.inner.submit(req, done)
    }
}

/// The ciphertext an encrypted volume sends down and receives from below sits in its bounce
/// buffers, which are announced for direct device access: over NVMe/RDMA the XTS copy is
/// the only copy of an encrypted I/O. The plaintext the caller handed in (not announced
/// here) never reaches the device below.
#[test]
fn ciphertext_buffers_are_announced_for_direct_device_access() {
    let key = XtsKey::generate(64).unwrap();
    let probe = Arc::new(DmaProbe {
        inner: Arc::new(RamVolume::new(1 << 20, 4096).unwrap()),
        seen: Mutex::new(Vec::new()),
    });
    let vol = EncryptedVolume::new(probe.clone(), &key, EncryptionPolicy::default()).unwrap();
    let data = pattern(64 * 1024, 9);
    write_split(&vol, 8192, &data, &[4096, 60 * 1024]).unwrap();
    assert_eq!(read_split(&vol, 8192, data.len(), &[8192, 56 * 1024]), data);
    let seen = probe.seen.lock().unwrap().clone();
    assert!(!seen.is_empty(), "nothing reached the device below");
    assert!(
        seen.iter().all(|&s| s),
        "segments below not announced: {seen:?}"
    );
    // The caller's own buffer is not announced: it is not what went down.
    assert!(nacre_dpu::volume::dma::lookup(data.as_ptr(), data.len()).is_none());
}
