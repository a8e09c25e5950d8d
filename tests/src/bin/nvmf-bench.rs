//! NVMe/TCP load generator: random reads at a fixed queue depth through the user-space
//! host of `nacre_tests::nvmf_host`, reporting IOPS and, given the target's PID, IOPS per
//! target CPU core (requests per second of target CPU time, from /proc/PID/stat).
//!
//!   nvmf-bench --addr IP:PORT [--nqn NQN] [--qd 32] [--seconds 5] [--queues 1]
//!              [--io-size 4096] [--target-pid PID] [--sq-flow] [--digests]
//!
//! `--sq-flow` keeps SQ flow control on, so every read ends with a CapsuleResp instead of
//! C2HData's SUCCESS flag.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nacre_shared::nvme::{io_opcode, Command, SglDescriptor};
use nacre_shared::nvme_tcp::Digests;
use nacre_tests::nvmf_host::{HostOptions, NvmfHost};

struct Args {
    addr: std::net::SocketAddr,
    nqn: String,
    qd: usize,
    seconds: f64,
    queues: u16,
    io_size: usize,
    target_pid: Option<u32>,
    sq_flow: bool,
    digests: bool,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        addr: "127.0.0.1:4420".parse()?,
        nqn: "nqn.2024-01.io.nacre:bench".into(),
        qd: 32,
        seconds: 5.0,
        queues: 1,
        io_size: 4096,
        target_pid: None,
        sq_flow: false,
        digests: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().context(format!("{k} needs a value"));
        match k.as_str() {
            "--addr" => a.addr = v()?.parse()?,
            "--nqn" => a.nqn = v()?,
            "--qd" => a.qd = v()?.parse()?,
            "--seconds" => a.seconds = v()?.parse()?,
            "--queues" => a.queues = v()?.parse()?,
            "--io-size" => a.io_size = v()?.parse()?,
            "--target-pid" => a.target_pid = Some(v()?.parse()?),
            "--sq-flow" => a.sq_flow = true,
            "--digests" => a.digests = true,
            _ => bail!("unknown argument {k}; see the doc comment of nvmf-bench"),
        }
    }
    Ok(a)
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: &str) -> Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &s[s.rfind(')').context("stat format")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks as f64 / hz)
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn main() -> Result<()> {
    let a = parse()?;
    let opts = HostOptions {
        io_queues: a.queues,
        queue_size: (a.qd as u16 + 1).max(32),
        disable_sq_flow: !a.sq_flow,
        digests: if a.digests {
            Digests {
                header: true,
                data: true,
            }
        } else {
            Digests::NONE
        },
        ..Default::default()
    };
    let mut h = NvmfHost::connect(a.addr, &a.nqn, opts).context("connect")?;
    let ns = h.identify_namespace(1)?;
    let bs = 1usize << ns.lbads;
    let nlb = (a.io_size / bs) as u32;
    let blocks = ns.nsze - nlb as u64;
    let queues = std::mem::take(&mut h.io);
    let dur = Duration::from_secs_f64(a.seconds);
    let t_cpu0 = a
        .target_pid
        .map(|p| cpu_seconds(&p.to_string()))
        .transpose()?;
    let c_cpu0 = cpu_seconds("self")?;
    let start = Instant::now();
    let handles: Vec<_> = queues
        .into_iter()
        .enumerate()
        .map(|(i, mut q)| {
            let qd = a.qd;
            let io_size = a.io_size;
            std::thread::spawn(move || -> Result<u64> {
                let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (i as u64 + 1);
                let cmd = |x: &mut u64| {
                    let lba = xorshift(x) % blocks / nlb as u64 * nlb as u64;
                    Command::rw(io_opcode::READ, 0, 1, lba, nlb, SglDescriptor::default())
                };
                for _ in 0..qd {
                    q.submit(cmd(&mut x), &[], io_size);
                }
                q.flush()?;
                let mut done = 0u64;
                let end = Instant::now() + dur;
                loop {
                    let (_, r) = q.next_completion()?;
                    if !r.status().is_success() {
                        bail!("read failed: {}", r.status());
                    }
                    done += 1;
                    if done % 1024 == 0 && Instant::now() >= end {
                        break;
                    }
                    q.submit(cmd(&mut x), &[], io_size);
                }
                Ok(done)
            })
        })
        .collect();
    let mut total = 0;
    for h in handles {
        total += h.join().map_err(|_| anyhow::anyhow!("worker panicked"))??;
    }
    let el = start.elapsed().as_secs_f64();
    let c_cpu = cpu_seconds("self")? - c_cpu0;
    let iops = total as f64 / el;
    print!(
        "io_size={} qd={} queues={} iops={:.0} MiB/s={:.0} client_cpu={:.2}",
        a.io_size,
        a.qd,
        a.queues,
        iops,
        iops * a.io_size as f64 / (1 << 20) as f64,
        c_cpu / el
    );
    if let (Some(p), Some(t0)) = (a.target_pid, t_cpu0) {
        let t_cpu = cpu_seconds(&p.to_string())? - t0;
        let cores = t_cpu / el;
        print!(
            " target_cpu={:.2} iops_per_target_core={:.0} target_us_per_io={:.2}",
            cores,
            total as f64 / t_cpu.max(1e-9),
            t_cpu * 1e6 / total as f64
        );
    }
    println!();
    Ok(())
}
