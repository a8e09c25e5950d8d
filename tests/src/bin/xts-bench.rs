//! AES-XTS throughput per core: every engine, and the encrypting volume path, at 4 KiB and
//! 512 B data units, measured in the same run so the ratios are fair.
//!
//! Usage: `xts-bench [--seconds S] [--buf-kib N]` (run by `scripts/bench-xts`, built with
//! `--release`). One thread; each engine encrypts a `buf-kib` buffer in place over and over
//! with the tweak reset per data unit, as a disk workload does (`openssl speed` does not, and
//! overstates XTS). The volume path writes and reads that buffer as 128 KiB requests through
//! `EncryptedVolume` over a `NullVolume`, so it measures the wrapper's own cost (bounce
//! buffer, tweak derivation, completion) on top of the engine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nacre_dpu::crypto::volume::EncryptedVolume;
use nacre_dpu::crypto::xts::EngineKind;
use nacre_dpu::crypto::{CipherKind, EncryptionPolicy, TweakMode, UnitLayout, XtsKey};
use nacre_dpu::volume::null::NullVolume;
use nacre_dpu::volume::{BlockDevice, IoKind, IoRequest, Segment};

struct Args {
    seconds: f64,
    buf_kib: usize,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        seconds: 1.0,
        buf_kib: 1024,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seconds" => a.seconds = it.next().context("--seconds S")?.parse()?,
            "--buf-kib" => a.buf_kib = it.next().context("--buf-kib N")?.parse()?,
            "-h" | "--help" => {
                println!("xts-bench [--seconds S] [--buf-kib N]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (try --help)"),
        }
    }
    if a.buf_kib < 128 || a.buf_kib % 128 != 0 {
        bail!("--buf-kib must be a multiple of 128");
    }
    Ok(a)
}

/// Run `f` (which processes `bytes` bytes) repeatedly for about `secs`; bytes per second.
fn measure(secs: f64, bytes: usize, mut f: impl FnMut()) -> f64 {
    // Warm up: page in the buffer, let the CPU reach its AVX frequency.
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_millis(100) {
        f();
    }
    let start = Instant::now();
    let mut iters = 0u64;
    while start.elapsed().as_secs_f64() < secs {
        f();
        iters += 1;
    }
    (iters as f64 * bytes as f64) / start.elapsed().as_secs_f64()
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let key = XtsKey::generate(64)?;
    let len = args.buf_kib * 1024;
    let mut buf: Vec<u8> = (0..len).map(|i| i as u8).collect();
    println!(
        "# AES-256-XTS, one core, {} KiB buffer, tweak reset per data unit, {} s per figure",
        args.buf_kib, args.seconds
    );
    println!(
        "{:<28} {:>12} {:>12}",
        "engine", "4096 B GB/s", "512 B GB/s"
    );
    let mut rows: Vec<(String, f64, f64)> = Vec::new();
    for kind in EngineKind::all() {
        let engine = kind.build(&key)?;
        let mut row = (kind.name().to_string(), 0.0, 0.0);
        for (slot, unit) in [(1, 4096usize), (2, 512)] {
            let layout = UnitLayout::new(unit, TweakMode::Plain64);
            let mut first = 0u64;
            let gbs = measure(args.seconds, len, || {
                engine
                    .encrypt_in_place(layout, first, &mut buf)
                    .expect("encrypt");
                first += (len / unit) as u64;
            }) / 1e9;
            if slot == 1 {
                row.1 = gbs;
            } else {
                row.2 = gbs;
            }
        }
        println!("{:<28} {:>12.2} {:>12.2}", row.0, row.1, row.2);
        rows.push(row);
    }

    // The volume path: EncryptedVolume over NullVolume, 128 KiB requests.
    const REQ: usize = 128 * 1024;
    for (dir, kind) in [("write", IoKind::Write), ("read", IoKind::Read)] {
        let mut row = (format!("volume path ({dir})"), 0.0, 0.0);
        for (slot, unit) in [(1, 4096u32), (2, 512)] {
            let policy = EncryptionPolicy {
                cipher: CipherKind::AesXts256,
                data_unit: unit,
                tweak: TweakMode::Plain64,
                require_encryption: true,
            };
            let inner: Arc<dyn BlockDevice> = Arc::new(NullVolume::new(1 << 40, unit));
            let vol = EncryptedVolume::new(inner, &key, policy)?;
            let mut off = 0u64;
            let gbs = measure(args.seconds, len, || {
                for chunk in buf.chunks_mut(REQ) {
                    let req = IoRequest::new(kind, off, chunk.len() as u64, 0)
                        .with_segments([Segment::from_slice(chunk)]);
                    vol.submit_wait(req).expect("volume I/O");
                    off = (off + REQ as u64) % (1 << 40);
                }
            }) / 1e9;
            if slot == 1 {
                row.1 = gbs;
            } else {
                row.2 = gbs;
            }
        }
        println!("{:<28} {:>12.2} {:>12.2}", row.0, row.1, row.2);
        rows.push(row);
    }

    let best4 = rows[..EngineKind::all().len()]
        .iter()
        .map(|r| r.1)
        .fold(0.0, f64::max);
    let best512 = rows[..EngineKind::all().len()]
        .iter()
        .map(|r| r.2)
        .fold(0.0, f64::max);
    println!("\n# ratio to the fastest engine measured in this run");
    println!("{:<28} {:>12} {:>12}", "", "4096 B", "512 B");
    for r in &rows {
        println!("{:<28} {:>12.2} {:>12.2}", r.0, r.1 / best4, r.2 / best512);
    }
    Ok(())
}
