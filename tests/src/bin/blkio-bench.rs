//! Load generator for `scripts/bench-vhost`: drives any vhost-user-blk server through
//! libblkio and prints one line of results.
//!
//! `blkio-bench --socket PATH [--rw randread|randwrite|read] [--bs BYTES] [--qd N]
//!  [--secs S] [--poll] [--server-pid PID]`
//!
//! Output: `iops=… p50_us=… p99_us=… p999_us=… server_cpu_s=… wall_s=…`; the server CPU
//! time is read from /proc/PID/stat (utime+stime of every thread) over the measured window.

use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use blkio::{Completion, ReqFlags};
use nacre_tests::blkio_client::{BlkioClient, ClientOptions};

/// Latency histogram: 50 ns buckets up to 10 ms, then one overflow bucket.
struct Hist {
    buckets: Vec<u64>,
    n: u64,
}

const BUCKET_NS: u64 = 50;
const NBUCKETS: usize = 200_000;

impl Hist {
    fn new() -> Self {
        Hist {
            buckets: vec![0; NBUCKETS + 1],
            n: 0,
        }
    }
    fn add(&mut self, ns: u64) {
        let i = ((ns / BUCKET_NS) as usize).min(NBUCKETS);
        self.buckets[i] += 1;
        self.n += 1;
    }
    fn pct(&self, p: f64) -> f64 {
        let want = ((self.n as f64) * p).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= want {
                return ((i as u64 + 1) * BUCKET_NS) as f64 / 1000.0;
            }
        }
        f64::NAN
    }
}

fn cpu_seconds(pid: u32) -> Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &s[s.rfind(')').context("bad stat")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn main() -> Result<()> {
    let mut socket = None;
    let mut rw = "randread".to_string();
    let mut bs: usize = 4096;
    let mut qd: usize = 32;
    let mut secs: f64 = 3.0;
    let mut warmup: f64 = 0.5;
    let mut poll = false;
    let mut pid: Option<u32> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--socket" => socket = Some(PathBuf::from(val()?)),
            "--rw" => rw = val()?,
            "--bs" => bs = val()?.parse()?,
            "--qd" => qd = val()?.parse()?,
            "--secs" => secs = val()?.parse()?,
            "--warmup" => warmup = val()?.parse()?,
            "--poll" => poll = true,
            "--server-pid" => pid = Some(val()?.parse()?),
            other => bail!("unknown argument {other}"),
        }
    }
    let socket = socket.context("--socket is required")?;
    let (write, random) = match rw.as_str() {
        "randread" => (false, true),
        "randwrite" => (true, true),
        "read" => (false, false),
        "write" => (true, false),
        other => bail!("unknown --rw {other}"),
    };
    let mut client = BlkioClient::connect(
        &socket,
        &ClientOptions {
            queues: 1,
            poll,
            read_only: false,
            queue_size: 1024,
            mem_len: qd * bs,
        },
    )?;
    let capacity = client.capacity()?;
    let blocks = capacity / bs as u64;
    let base = client.mem_ptr();
    // Pseudo-random contents: a constant pattern would flatter any layer below that compresses
    // or deduplicates (and an encrypted volume's writes never look constant).
    let mut fill = Rng(0x9e37_79b9_7f4a_7c15);
    for chunk in client.mem().chunks_mut(8) {
        let r = fill.next().to_le_bytes();
        chunk.copy_from_slice(&r[..chunk.len()]);
    }
    let mut q = client.take_queues().pop().context("no queue")?;
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut seq = 0u64;
    let mut next_off = |rng: &mut Rng| {
        let b = if random {
            rng.next() % blocks
        } else {
            seq = (seq + 1) % blocks;
            seq
        };
        b * bs as u64
    };
    let mut started = vec![Instant::now(); qd];
    let submit = |q: &mut blkio::Blkioq, slot: usize, off: u64| {
        // SAFETY: slot `slot` owns bytes [slot*bs, (slot+1)*bs) of the mapped region.
        let buf = unsafe { base.add(slot * bs) };
        if write {
            q.write(off, buf, bs, slot, ReqFlags::empty());
        } else {
            q.read(off, buf, bs, slot, ReqFlags::empty());
        }
    };
    for (slot, t) in started.iter_mut().enumerate() {
        *t = Instant::now();
        submit(&mut q, slot, next_off(&mut rng));
    }
    let mut comps: Vec<MaybeUninit<Completion>> = (0..qd).map(|_| MaybeUninit::uninit()).collect();
    let mut hist = Hist::new();
    let t0 = Instant::now();
    let measure_at = t0 + Duration::from_secs_f64(warmup);
    let end_at = measure_at + Duration::from_secs_f64(secs);
    let mut measuring = false;
    let mut cpu0 = 0.0;
    let mut tm = t0;
    let mut done = 0u64;
    let mut errors = 0u64;
    loop {
        let n = q
            .do_io(&mut comps, 1, None, None)
            .map_err(|e| anyhow::anyhow!("do_io: {}", e.message()))?;
        let now = Instant::now();
        if !measuring && now >= measure_at {
            measuring = true;
            tm = now;
            cpu0 = pid.map(cpu_seconds).transpose()?.unwrap_or(0.0);
        }
        if measuring && now >= end_at {
            break;
        }
        for c in &comps[..n] {
            // SAFETY: do_io initialised the first n entries.
            let c = unsafe { c.assume_init_read() };
            let slot = c.user_data;
            if c.ret != 0 {
                errors += 1;
            }
            if measuring {
                hist.add((now - started[slot]).as_nanos() as u64);
                done += 1;
            }
            started[slot] = now;
            submit(&mut q, slot, next_off(&mut rng));
        }
    }
    let wall = tm.elapsed().as_secs_f64();
    let cpu = pid.map(cpu_seconds).transpose()?.unwrap_or(0.0) - cpu0;
    if errors > 0 {
        bail!("{errors} requests failed");
    }
    println!(
        "iops={:.0} p50_us={:.2} p99_us={:.2} p999_us={:.2} server_cpu_s={:.3} wall_s={:.3}",
        done as f64 / wall,
        hist.pct(0.50),
        hist.pct(0.99),
        hist.pct(0.999),
        cpu,
        wall
    );
    Ok(())
}
