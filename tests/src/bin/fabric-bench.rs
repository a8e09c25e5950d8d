//! End-to-end reads or writes (4 KiB random reads by default) through nacre's whole stack,
//! and the same with a RAM volume:
//!
//! ```text
//!  libblkio ──vhost-user-blk──▶ nacred frontend ──▶ [AES-XTS] ──▶ NVMe/TCP initiator
//!     ──loopback TCP──▶ nacred's NVMe-oF/TCP target ──▶ RAM volume
//! ```
//!
//! Everything runs in this one process, so its CPU time (getrusage) is the total cost of a
//! request across client, frontend, crypto, initiator and target. Reported per
//! configuration: IOPS, cores busy (CPU seconds / wall seconds) and IOPS per total core, with
//! the ratio to the RAM volume measured in the same run.
//!
//! The same CPU time is also split by thread into the three machines a deployment has: the
//! *host* (this process's main thread, the libblkio client standing in for the guest), the
//! *shelf* (the target's reactor, listener and keep-alive threads: the remote storage) and
//! the *DPU* (everything else: the vhost-user-blk worker, XTS, the initiator's threads).
//! IOPS per DPU core is what a BlueField's Arm cores would spend; the total includes a shelf
//! that in a deployment is another machine.
//!
//!   fabric-bench [--seconds S] [--qd N] [--bs BYTES] [--seq] [--write] [--io-queues N] [--digests]
//!                [--nvmf-poll adaptive|always|off] [--fabric-reactors N] [--only VOLUME,...]
//!
//! `--bs 131072 --seq --qd 8` is the large sequential read of GPU training's data loaders.

use std::mem::MaybeUninit;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use blkio::{Blkioq, Completion, ReqFlags};
use nacre_dpu::crypto::volume::EncryptedVolume;
use nacre_dpu::crypto::{EncryptionPolicy, XtsKey};
use nacre_dpu::fabric::{Controller, ControllerConfig, RemoteNamespace};
use nacre_dpu::frontend::nvmf_tcp::{self, NvmfTarget, PollPolicy};
use nacre_dpu::frontend::vhost_user_blk::{VhostBlkConfig, VhostBlkServer};
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;
use nacre_shared::nvme_tcp::Digests;
use nacre_tests::blkio_client::{BlkioClient, ClientOptions};

/// The allocator nacred runs with (dpu/src/bin/nacred.rs), so the stack measured here
/// allocates as the daemon does.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SIZE: u64 = 256 << 20;
/// The volumes' logical block size (requests are multiples of it).
const LBA: u32 = 4096;
const NQN: &str = "nqn.2024-01.io.nacre:bench";

struct Opts {
    seconds: f64,
    qd: usize,
    bs: usize,
    seq: bool,
    /// Writes instead of reads.
    write: bool,
    io_queues: u16,
    digests: bool,
    /// Run only these volumes (for profiling one path); the ratio needs `ram` among them.
    only: Option<Vec<String>>,
    /// Print each thread's cores busy after each volume's line.
    threads: bool,
    /// The initiator's reactor threads (0: the default).
    fabric_reactors: usize,
    /// The shelf target's poll policy.
    nvmf_poll: PollPolicy,
}

/// The volumes measured, in order; `ram` is the baseline of the ratio column.
const VOLUMES: [&str; 4] = ["ram", "ram+xts", "nvme-tcp", "nvme-tcp+xts"];

fn parse() -> Result<Opts> {
    let mut o = Opts {
        seconds: 5.0,
        qd: 32,
        bs: 4096,
        seq: false,
        write: false,
        io_queues: 1,
        digests: false,
        only: None,
        threads: false,
        fabric_reactors: 0,
        nvmf_poll: PollPolicy::default(),
    };
    let mut a = std::env::args().skip(1);
    while let Some(k) = a.next() {
        match k.as_str() {
            "--seconds" => o.seconds = a.next().context("--seconds N")?.parse()?,
            "--qd" => o.qd = a.next().context("--qd N")?.parse()?,
            "--bs" => o.bs = a.next().context("--bs BYTES")?.parse()?,
            "--seq" => o.seq = true,
            "--write" => o.write = true,
            "--io-queues" => o.io_queues = a.next().context("--io-queues N")?.parse()?,
            "--digests" => o.digests = true,
            "--threads" => o.threads = true,
            "--fabric-reactors" => {
                o.fabric_reactors = a
                    .next()
                    .context("--fabric-reactors N")?
                    .parse()
                    .context("--fabric-reactors N")?
            }
            "--nvmf-poll" => {
                let v = a.next().context("--nvmf-poll adaptive|always|off")?;
                let p = PollPolicy::ALL
                    .into_iter()
                    .find(|p| p.as_str() == v)
                    .with_context(|| {
                        format!("--nvmf-poll: {v:?} is not adaptive, always or off")
                    })?;
                o.nvmf_poll = p;
            }
            "--only" => {
                let v = a.next().context("--only VOLUME[,VOLUME...]")?;
                let names: Vec<String> = v.split(',').map(str::to_string).collect();
                if let Some(n) = names.iter().find(|n| !VOLUMES.contains(&n.as_str())) {
                    bail!("--only: no volume {n:?} (there are {})", VOLUMES.join(", "));
                }
                o.only = Some(names);
            }
            "-h" | "--help" => {
                println!("fabric-bench [--seconds S] [--qd N] [--bs BYTES] [--seq] [--write] [--io-queues N] [--digests] [--nvmf-poll P] [--fabric-reactors N] [--only VOLUME,...] [--threads]");
                println!(
                    "  volumes: {} (--only runs a subset, e.g. to profile one path)",
                    VOLUMES.join(", ")
                );
                println!("  --fabric-reactors N: the initiator's reactor threads (as nacred's; 0: one per core, at most 4)");
                println!("  --threads: each thread's cores busy too (host = the libblkio client, shelf = the target's threads, dpu = the rest)");
                std::process::exit(0);
            }
            _ => bail!("unknown argument {k}"),
        }
    }
    if o.bs == 0 || o.bs % LBA as usize != 0 || o.bs as u64 > SIZE {
        bail!("--bs must be a multiple of {LBA} bytes, at most the volume's {SIZE}");
    }
    Ok(o)
}

fn cpu_seconds() -> f64 {
    let mut ru = MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    // SAFETY: initialised by getrusage (or zeroed).
    let ru = unsafe { ru.assume_init() };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// Which machine of a deployment a thread stands for (module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Host,
    Dpu,
    Shelf,
}

impl Role {
    fn of(tid: i32, comm: &str) -> Role {
        // SAFETY: getpid has no preconditions.
        if tid == unsafe { libc::getpid() } {
            Role::Host
        } else if ["nvmf-reactor", "nvmf-listen", "nvmf-keepalive"]
            .iter()
            .any(|p| comm.starts_with(p))
        {
            Role::Shelf
        } else {
            Role::Dpu
        }
    }
}

/// One thread's CPU time at a [`thread_cpu`] snapshot.
struct ThreadCpu {
    tid: i32,
    comm: String,
    role: Role,
    secs: f64,
}

/// CPU seconds of each thread of this process now.
fn thread_cpu() -> Vec<ThreadCpu> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut v = Vec::new();
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|t| t.parse::<i32>().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        // The CPU-time clock of thread `tid` (Linux's encoding, the one glibc's
        // pthread_getcpuclockid returns: CPUCLOCK_SCHED | CPUCLOCK_PERTHREAD): nanoseconds,
        // where /proc's utime and stime count 10 ms ticks.
        let clock = ((!tid) << 3) | 6;
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: ts is a valid timespec to fill; a thread that has exited meanwhile makes
        // the call fail, and is skipped.
        if unsafe { libc::clock_gettime(clock, &mut ts) } == 0 {
            let comm = comm.trim_end().to_string();
            v.push(ThreadCpu {
                tid,
                role: Role::of(tid, &comm),
                comm,
                secs: ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9,
            });
        }
    }
    v
}

/// Cores busy per thread between two [`thread_cpu`] snapshots `wall` seconds apart (a
/// thread born meanwhile counts from zero; one that ended meanwhile is not counted).
fn thread_cores(before: &[ThreadCpu], after: Vec<ThreadCpu>, wall: f64) -> Vec<ThreadCpu> {
    after
        .into_iter()
        .map(|mut t| {
            let t0 = before
                .iter()
                .find(|b| b.tid == t.tid)
                .map_or(0.0, |b| b.secs);
            t.secs = (t.secs - t0).max(0.0) / wall;
            t
        })
        .collect()
}

struct Result1 {
    iops: f64,
    cores: f64,
    /// Cores busy per thread (`secs` holds cores).
    threads: Vec<ThreadCpu>,
}

impl Result1 {
    /// Cores busy as host, DPU and shelf ([`Role`]).
    fn roles(&self) -> [f64; 3] {
        let mut c = [0.0; 3];
        for t in &self.threads {
            c[t.role as usize] += t.secs;
        }
        c
    }
}

/// Serve `vol` over vhost-user-blk and drive it with libblkio: `bs`-byte reads at `qd`, random
/// or sequential.
fn run(vol: Arc<dyn BlockDevice>, dir: &Path, name: &str, o: &Opts) -> Result<Result1> {
    let sock = dir.join(format!("{name}.sock"));
    let server = VhostBlkServer::start(
        VhostBlkConfig {
            socket: sock.clone(),
            queues: 1,
            queue_size: 256,
            read_only: false,
            serial: "BENCH".into(),
        },
        vol,
    )?;
    let mut client = None;
    for _ in 0..200 {
        match BlkioClient::connect(
            &sock,
            &ClientOptions {
                queues: 1,
                poll: false,
                read_only: false,
                queue_size: 256,
                mem_len: o.qd * o.bs,
            },
        ) {
            Ok(c) => {
                client = Some(c);
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    let mut c = client.context("libblkio could not connect")?;
    let mut qs = c.take_queues();
    let q = &mut qs[0];
    let base = c.mem_ptr();
    let bs = o.bs;
    let blocks = SIZE / bs as u64;
    let (mut x, mut n_seq) = (0x1234_5678_9abc_def1u64, 0u64);
    let seq = o.seq;
    let mut next_off = || {
        let b = if seq {
            n_seq += 1;
            n_seq % blocks
        } else {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % blocks
        };
        b * bs as u64
    };
    let write = o.write;
    // A request's segments may not exceed the device's max-segment-len (virtio-blk's
    // size_max): longer blocks go as several segments, as a guest's kernel splits them.
    let seg_max_len = match c.get_i32("max-segment-len")? {
        n if n > 0 => n as usize,
        _ => bs,
    };
    // Request `i` uses slot i of the mapped region, qd * bs bytes long.
    let iovs: Vec<Vec<libc::iovec>> = (0..o.qd)
        .map(|i| {
            (0..bs)
                .step_by(seg_max_len)
                .map(|at| libc::iovec {
                    // SAFETY: slot i lies inside the mapped region (i < qd).
                    iov_base: unsafe { base.add(i * bs + at) }.cast(),
                    iov_len: seg_max_len.min(bs - at),
                })
                .collect()
        })
        .collect();
    let issue = |q: &mut Blkioq, off: u64, i: usize| {
        let iov = &iovs[i];
        match (write, iov.len()) {
            // One segment: the plain calls, as every earlier figure was measured with.
            (true, 1) => q.write(off, iov[0].iov_base.cast(), bs, i, ReqFlags::empty()),
            (false, 1) => q.read(off, iov[0].iov_base.cast(), bs, i, ReqFlags::empty()),
            (true, n) => q.writev(off, iov.as_ptr(), n as u32, i, ReqFlags::empty()),
            (false, n) => q.readv(off, iov.as_ptr(), n as u32, i, ReqFlags::empty()),
        }
    };
    for i in 0..o.qd {
        issue(q, next_off(), i);
    }
    let mut comps: Vec<MaybeUninit<Completion>> =
        (0..o.qd).map(|_| MaybeUninit::uninit()).collect();
    let mut measure = |secs: f64| -> Result<(u64, f64, f64, Vec<ThreadCpu>)> {
        let threads0 = thread_cpu();
        let (t0, c0) = (Instant::now(), cpu_seconds());
        let mut n = 0u64;
        while t0.elapsed().as_secs_f64() < secs {
            let got = q
                .do_io(&mut comps, 1, None, None)
                .map_err(|e| anyhow::anyhow!("do_io: {}", e.message()))?;
            for cm in &comps[..got] {
                // SAFETY: do_io initialised the first `got` entries.
                let cm = unsafe { cm.assume_init_read() };
                if cm.ret != 0 {
                    bail!("request failed: {}", cm.ret);
                }
                issue(q, next_off(), cm.user_data);
            }
            n += got as u64;
        }
        let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        Ok((n, wall, cpu, thread_cores(&threads0, thread_cpu(), wall)))
    };
    measure(0.5)?; // warm-up
    let (n, wall, cpu, threads) = measure(o.seconds)?;
    // Drain what is in flight before tearing down.
    let mut left = o.qd;
    while left > 0 {
        let got = q.do_io(&mut comps, 1, None, None).unwrap_or(left);
        left = left.saturating_sub(got);
    }
    drop(qs);
    drop(c);
    server.stop();
    Ok(Result1 {
        iops: n as f64 / wall,
        cores: cpu / wall,
        threads,
    })
}

fn main() -> Result<()> {
    let o = parse()?;
    let dir = tempfile::tempdir()?;
    let key = XtsKey::from_bytes(&(0..64u8).collect::<Vec<_>>())?;

    // The shelf: nacred's own NVMe-oF/TCP target over a RAM volume, on loopback.
    let target = NvmfTarget::with_config(nvmf_tcp::TargetConfig {
        poll: o.nvmf_poll,
        ..Default::default()
    });
    target.create_subsystem(NQN, "BENCH", "nacre bench shelf", true)?;
    let shelf_vol: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(SIZE, LBA)?);
    target.add_namespace(NQN, Some(1), shelf_vol, [0xBE; 16], "bench".into())?;
    let addr = target.add_listener(NQN, "127.0.0.1:0".parse()?)?;
    let mut cfg = ControllerConfig::new(
        "127.0.0.1",
        addr.port(),
        NQN,
        "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000bec4",
    );
    cfg.io_queues = o.io_queues;
    cfg.queue_depth = 128;
    cfg.tcp_reactors = nacre_dpu::fabric::tcp::Reactors::new(o.fabric_reactors);
    if o.digests {
        cfg.digests = Digests {
            header: true,
            data: true,
        };
    }
    let ctrl = Controller::start("bench", cfg, None);
    let info = ctrl
        .wait_first_attempt(Duration::from_secs(10))
        .map_err(|e| anyhow::anyhow!("initiator: {e}"))?;
    let remote: Arc<dyn BlockDevice> = Arc::new(RemoteNamespace::new(
        ctrl.core().clone(),
        info.namespaces[0].clone(),
    ));

    let ram: Arc<dyn BlockDevice> = Arc::new(RamVolume::new(SIZE, LBA)?);
    let configs: Vec<(&str, Arc<dyn BlockDevice>)> = vec![
        ("ram", ram.clone()),
        (
            "ram+xts",
            Arc::new(EncryptedVolume::new(
                ram,
                &key,
                EncryptionPolicy::default(),
            )?),
        ),
        ("nvme-tcp", remote.clone()),
        (
            "nvme-tcp+xts",
            Arc::new(EncryptedVolume::new(
                remote,
                &key,
                EncryptionPolicy::default(),
            )?),
        ),
    ];
    println!(
        "{} KiB {} {}, QD{}, 1 vhost-user-blk queue, {} NVMe/TCP I/O queue(s){}, {} s each, {} CPUs online",
        o.bs / 1024,
        if o.seq { "sequential" } else { "random" },
        if o.write { "write" } else { "read" },
        o.qd,
        info.io_queues,
        if o.digests { ", header+data digests" } else { "" },
        o.seconds,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:<14} {:>10} {:>9} {:>7} {:>12} {:>14} | {:>5} {:>5} {:>5} {:>13} {:>7}",
        "volume",
        "IOPS",
        "MiB/s",
        "cores",
        "IOPS/core",
        "per-core vs ram",
        "host",
        "dpu",
        "shelf",
        "IOPS/dpu-core",
        "vs ram"
    );
    let (mut ram_per_core, mut ram_per_dpu_core) = (None, None);
    for (name, vol) in configs {
        if o.only
            .as_ref()
            .is_some_and(|v| !v.iter().any(|n| n == name))
        {
            continue;
        }
        let r = run(vol, dir.path(), name, &o)?;
        let per_core = r.iops / r.cores.max(1e-9);
        let [host, dpu, shelf] = r.roles();
        let per_dpu_core = r.iops / dpu.max(1e-9);
        if name == "ram" {
            ram_per_core = Some(per_core);
            ram_per_dpu_core = Some(per_dpu_core);
        }
        let ratio =
            |base: Option<f64>, v: f64| base.map_or("-".to_string(), |b| format!("{:.2}x", v / b));
        println!(
            "{:<14} {:>10.0} {:>9.0} {:>7.2} {:>12.0} {:>14} | {:>5.2} {:>5.2} {:>5.2} {:>13.0} {:>7}",
            name,
            r.iops,
            r.iops * o.bs as f64 / (1 << 20) as f64,
            r.cores,
            per_core,
            ratio(ram_per_core, per_core),
            host,
            dpu,
            shelf,
            per_dpu_core,
            ratio(ram_per_dpu_core, per_dpu_core)
        );
        if o.threads {
            // Every thread that ran at all: on a busy machine a short run can leave a thread's
            // share below what the table's two decimals show.
            let mut ts: Vec<&ThreadCpu> = r.threads.iter().filter(|t| t.secs > 0.0).collect();
            ts.sort_by(|a, b| b.secs.total_cmp(&a.secs));
            for t in ts {
                let role = match t.role {
                    Role::Host => "host",
                    Role::Dpu => "dpu",
                    Role::Shelf => "shelf",
                };
                println!("    {:<20} {:<5} {:>8.5} cores", t.comm, role, t.secs);
            }
        }
    }
    ctrl.close();
    Ok(())
}
