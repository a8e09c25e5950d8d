//! Which engine should a file volume use? Measures 4 KiB random reads (or writes) on one
//! thread at a given queue depth, with synchronous `pread`/`pwrite` (what `FileVolume` does on
//! each frontend queue thread) and with io_uring keeping QD requests in flight.
//!
//! usage: file-engine-bench PATH [--direct] [--write] [--qd N] [--secs S] [--size BYTES]
//! Prints IOPS and CPU time per request for each engine, and the ratio io_uring ÷ sync.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const BS: usize = 4096;

struct Opts {
    path: String,
    direct: bool,
    write: bool,
    qd: usize,
    secs: f64,
    size: u64,
}

fn parse() -> Result<Opts> {
    let mut a = std::env::args().skip(1);
    let mut o = Opts {
        path: String::new(),
        direct: false,
        write: false,
        qd: 32,
        secs: 3.0,
        size: 1 << 30,
    };
    while let Some(x) = a.next() {
        match x.as_str() {
            "--direct" => o.direct = true,
            "--write" => o.write = true,
            "--qd" => o.qd = a.next().context("--qd N")?.parse()?,
            "--secs" => o.secs = a.next().context("--secs S")?.parse()?,
            "--size" => o.size = a.next().context("--size BYTES")?.parse()?,
            "-h" | "--help" => {
                println!("usage: file-engine-bench PATH [--direct] [--write] [--qd N] [--secs S] [--size BYTES]");
                std::process::exit(0);
            }
            p if o.path.is_empty() => o.path = p.to_string(),
            other => bail!("unexpected argument {other:?}"),
        }
    }
    if o.path.is_empty() {
        bail!("give a file path (it is created and filled if short)");
    }
    Ok(o)
}

fn cpu_secs() -> f64 {
    // SAFETY: getrusage with a valid out pointer.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage through a valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self, blocks: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % blocks
    }
}

fn aligned(n: usize) -> &'static mut [u8] {
    let layout = std::alloc::Layout::from_size_align(n, 4096).unwrap();
    // SAFETY: non-zero layout; leaked on purpose for the life of the benchmark.
    unsafe { std::slice::from_raw_parts_mut(std::alloc::alloc_zeroed(layout), n) }
}

fn main() -> Result<()> {
    let o = parse()?;
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .custom_flags(if o.direct { libc::O_DIRECT } else { 0 })
        .open(&o.path)
        .with_context(|| format!("open {} (O_DIRECT={})", o.path, o.direct))?;
    if f.metadata()?.len() < o.size {
        // Fill with data so reads hit allocated blocks, not holes.
        let chunk = aligned(1 << 20);
        chunk.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let mut off = 0;
        while off < o.size {
            use std::os::unix::fs::FileExt;
            f.write_all_at(chunk, off)?;
            off += chunk.len() as u64;
        }
        f.sync_all()?;
    }
    let _ = &mut f;
    let blocks = o.size / BS as u64;
    let fd = f.as_raw_fd();
    let dur = Duration::from_secs_f64(o.secs);

    // Synchronous: one request at a time on this thread.
    let buf = aligned(BS);
    let mut rng = Rng(0x1234_5678);
    let (t0, c0) = (Instant::now(), cpu_secs());
    let mut n_sync = 0u64;
    while t0.elapsed() < dur {
        for _ in 0..64 {
            let off = (rng.next(blocks) * BS as u64) as libc::off_t;
            // SAFETY: buf is a live aligned buffer of BS bytes.
            let r = unsafe {
                if o.write {
                    libc::pwrite(fd, buf.as_ptr() as *const _, BS, off)
                } else {
                    libc::pread(fd, buf.as_mut_ptr() as *mut _, BS, off)
                }
            };
            if r != BS as isize {
                bail!("sync I/O returned {r}: {}", std::io::Error::last_os_error());
            }
        }
        n_sync += 64;
    }
    let (sync_wall, sync_cpu) = (t0.elapsed().as_secs_f64(), cpu_secs() - c0);

    // io_uring: keep qd requests in flight, reap what is done, resubmit.
    let mut ring = io_uring::IoUring::new((o.qd as u32).next_power_of_two())?;
    let bufs = aligned(BS * o.qd);
    let (t0, c0) = (Instant::now(), cpu_secs());
    let mut n_uring = 0u64;
    let push = |ring: &mut io_uring::IoUring, slot: usize, rng: &mut Rng| {
        let off = rng.next(blocks) * BS as u64;
        // SAFETY: slot < qd, so the pointer is inside bufs, which lives until exit.
        let p = unsafe { bufs.as_ptr().add(slot * BS) as *mut u8 };
        let e = if o.write {
            io_uring::opcode::Write::new(io_uring::types::Fd(fd), p, BS as u32)
                .offset(off)
                .build()
        } else {
            io_uring::opcode::Read::new(io_uring::types::Fd(fd), p, BS as u32)
                .offset(off)
                .build()
        };
        // SAFETY: the buffer outlives the request (never freed).
        unsafe {
            ring.submission()
                .push(&e.user_data(slot as u64))
                .expect("sq full")
        };
    };
    for slot in 0..o.qd {
        push(&mut ring, slot, &mut rng);
    }
    while t0.elapsed() < dur {
        ring.submit_and_wait(1)?;
        let done: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (slot, res) in done {
            if res != BS as i32 {
                bail!("io_uring I/O returned {res}");
            }
            n_uring += 1;
            push(&mut ring, slot as usize, &mut rng);
        }
    }
    let (ur_wall, ur_cpu) = (t0.elapsed().as_secs_f64(), cpu_secs() - c0);

    let kind = if o.write { "write" } else { "read" };
    println!(
        "{} 4KiB random {kind}, O_DIRECT={}, QD{} (io_uring) vs QD1 (sync, one thread)",
        o.path, o.direct, o.qd
    );
    let line = |name: &str, n: u64, wall: f64, cpu: f64| {
        println!(
            "  {name:<9} {:>10.0} IOPS  {:>6.2} us CPU/request",
            n as f64 / wall,
            cpu / n as f64 * 1e6
        );
        n as f64 / wall
    };
    let s = line("sync", n_sync, sync_wall, sync_cpu);
    let u = line("io_uring", n_uring, ur_wall, ur_cpu);
    println!("  ratio io_uring/sync IOPS: {:.2}", u / s);
    Ok(())
}
