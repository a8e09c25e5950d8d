//! AES-XTS throughput per core: every engine, and the encrypting volume path, at 4 KiB and
//! 512 B data units, measured in the same run so the ratios are fair.
//!
//! Usage: `xts-bench [--seconds S] [--buf-kib N] [--rounds N]` (run by
//! `scripts/bench-xts`, built with `--release`). One thread; each engine encrypts a `buf-kib`
//! buffer in place over and over with the tweak reset per data unit, as a disk workload does
//! (`openssl speed` does not, and overstates XTS). The volume path writes and reads that
//! buffer as 128 KiB and 4 KiB requests through `EncryptedVolume` over a `NullVolume`, so it
//! measures the wrapper's own cost (bounce buffer, tweak derivation, completion) on top of
//! the engine; the bare `NullVolume` rows show what a 4 KiB request costs without crypto.
//! Figures are bytes per CPU-second of the measuring thread. What the cipher costs a
//! vhost-user-blk client (encrypted ÷ plain IOPS through nacred) is `scripts/bench-crypt`.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use nacre_dpu::crypto::volume::EncryptedVolume;
use nacre_dpu::crypto::xts::EngineKind;
use nacre_dpu::crypto::{CipherKind, EncryptionPolicy, TweakMode, UnitLayout, XtsKey};
use nacre_dpu::volume::null::NullVolume;
use nacre_dpu::volume::{BlockDevice, IoKind, IoRequest, Segment};

struct Args {
    seconds: f64,
    buf_kib: usize,
    rounds: usize,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        seconds: 0.5,
        buf_kib: 1024,
        rounds: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seconds" => a.seconds = it.next().context("--seconds S")?.parse()?,
            "--buf-kib" => a.buf_kib = it.next().context("--buf-kib N")?.parse()?,
            "--rounds" => a.rounds = it.next().context("--rounds N")?.parse()?,
            "-h" | "--help" => {
                println!("xts-bench [--seconds S] [--buf-kib N] [--rounds N]");
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

/// CPU time this thread has used: the machine is shared, so throughput per core is bytes
/// per CPU-second of the measuring thread, not per wall-clock second (time spent descheduled
/// while other processes run would otherwise count against the engine).
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; CLOCK_THREAD_CPUTIME_ID is always available on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Run `f` (which processes `bytes` bytes) repeatedly for about `secs` of this thread's CPU
/// time; bytes per CPU-second.
fn measure(secs: f64, bytes: usize, mut f: impl FnMut()) -> f64 {
    // Warm up: page in the buffer, let the CPU reach its AVX frequency.
    let warm = thread_cpu();
    while thread_cpu() - warm < 0.1 {
        f();
    }
    let start = thread_cpu();
    let mut iters = 0u64;
    while thread_cpu() - start < secs {
        f();
        iters += 1;
    }
    (iters as f64 * bytes as f64) / (thread_cpu() - start)
}

/// One thing measured: a name and a closure that processes the buffer once.
type Subject<'a> = (String, Box<dyn FnMut(&mut [u8]) + 'a>);

fn main() -> Result<()> {
    let args = parse_args()?;
    let key = XtsKey::generate(64)?;
    let len = args.buf_kib * 1024;
    let mut buf: Vec<u8> = (0..len).map(|i| i as u8).collect();
    println!(
        "# AES-256-XTS, one thread, {} KiB buffer, tweak reset per data unit; GB per CPU-second of the thread, best of {} rounds of {} s",
        args.buf_kib, args.rounds, args.seconds
    );
    let engines: Vec<_> = EngineKind::all()
        .iter()
        .map(|k| k.build(&key).map(|e| (k.name(), e)))
        .collect::<Result<_, _>>()?;
    // The volume path: EncryptedVolume over NullVolume, 128 KiB and 4 KiB requests.
    const REQ: usize = 128 * 1024;
    let mut vols = Vec::new();
    for unit in [4096u32, 512] {
        let policy = EncryptionPolicy {
            cipher: CipherKind::AesXts256,
            data_unit: unit,
            tweak: TweakMode::Plain64,
            require_encryption: true,
        };
        let inner: Arc<dyn BlockDevice> = Arc::new(NullVolume::new(1 << 40, unit));
        vols.push(EncryptedVolume::new(inner, &key, policy)?);
    }
    let bare: Vec<Arc<dyn BlockDevice>> = [4096u32, 512]
        .iter()
        .map(|u| Arc::new(NullVolume::new(1 << 40, *u)) as Arc<dyn BlockDevice>)
        .collect();
    let units = [4096usize, 512];
    let mut subjects: Vec<Subject> = Vec::new();
    let n_engines = engines.len();
    for (name, e) in &engines {
        for unit in units {
            let layout = UnitLayout::new(unit, TweakMode::Plain64);
            let mut first = 0u64;
            subjects.push((
                format!("{name}@{unit}"),
                Box::new(move |b: &mut [u8]| {
                    e.encrypt_in_place(layout, first, b).expect("encrypt");
                    first += (b.len() / unit) as u64;
                }),
            ));
        }
    }
    for (req_len, req_name) in [(REQ, "128K"), (4096, "4K")] {
        for (dir, kind) in [("write", IoKind::Write), ("read", IoKind::Read)] {
            for (i, unit) in units.iter().enumerate() {
                let vol = &vols[i];
                let mut off = 0u64;
                subjects.push((
                    format!("volume path ({dir} {req_name})@{unit}"),
                    Box::new(move |b: &mut [u8]| {
                        for chunk in b.chunks_mut(req_len) {
                            let req = IoRequest::new(kind, off, chunk.len() as u64, 0)
                                // SAFETY: the request is waited for (or completes inline) while the buffer lives.
                                .with_segments([unsafe { Segment::from_slice(chunk) }]);
                            vol.submit_wait(req).expect("volume I/O");
                            off = (off + req_len as u64) % (1 << 40);
                        }
                    }),
                ));
            }
        }
    }
    // The same requests on the bare NullVolume: what the path costs without crypto.
    for (req_len, req_name) in [(REQ, "128K"), (4096, "4K")] {
        for (dir, kind) in [("write", IoKind::Write), ("read", IoKind::Read)] {
            for dev in &bare {
                let mut off = 0u64;
                subjects.push((
                    format!("null volume alone ({dir} {req_name})"),
                    Box::new(move |b: &mut [u8]| {
                        for chunk in b.chunks_mut(req_len) {
                            let req = IoRequest::new(kind, off, chunk.len() as u64, 0)
                                // SAFETY: the request is waited for (or completes inline) while the buffer lives.
                                .with_segments([unsafe { Segment::from_slice(chunk) }]);
                            dev.submit_wait(req).expect("volume I/O");
                            off = (off + req_len as u64) % (1 << 40);
                        }
                    }),
                ));
            }
        }
    }
    // Rounds interleave every subject, so a burst of load from other processes hits all of
    // them alike; the best round of each is reported.
    let mut best = vec![0f64; subjects.len()];
    for _ in 0..args.rounds {
        for (i, (_, f)) in subjects.iter_mut().enumerate() {
            let gbs = measure(args.seconds, len, || f(&mut buf)) / 1e9;
            best[i] = best[i].max(gbs);
        }
    }
    let rows: Vec<(String, f64, f64)> = best
        .chunks(2)
        .zip(subjects.chunks(2))
        .map(|(b, s)| {
            (
                s[0].0.split('@').next().unwrap_or("").to_string(),
                b[0],
                b[1],
            )
        })
        .collect();
    println!("{:<34} {:>12} {:>12}", "GB/s", "4096 B", "512 B");
    for r in &rows {
        println!("{:<34} {:>12.2} {:>12.2}", r.0, r.1, r.2);
    }
    let best4 = rows[..n_engines].iter().map(|r| r.1).fold(0.0, f64::max);
    let best512 = rows[..n_engines].iter().map(|r| r.2).fold(0.0, f64::max);
    println!("\n# ratio to the fastest engine measured in this run");
    println!("{:<34} {:>12} {:>12}", "", "4096 B", "512 B");
    for r in &rows {
        println!("{:<34} {:>12.2} {:>12.2}", r.0, r.1 / best4, r.2 / best512);
    }
    Ok(())
}
