//! Durability under kill -9: random writes and flushes through each frontend against a
//! file volume of the real nacred, SIGKILL at a random moment, restart on the same state
//! directory, and check every block.
//!
//! What must hold for every block after each restart:
//! * a block written and acknowledged before a flush that completed reads back exactly as
//!   written then (or as a later write to it);
//! * any other block reads back as one of the versions it could have: the last durable
//!   one or one written (acknowledged or still in flight) since — never anything else
//!   (garbage, zeros where zeros were never written, another block's data).
//!
//! Every block carries its own identity (block number, version, a fill derived from both),
//! so a misplaced or torn block is told apart from an old one. A SIGKILL leaves whatever
//! nacred had handed the kernel in the page cache, so this catches what nacred itself holds
//! back or acknowledges too early (a write acknowledged before it was written, a flush
//! acknowledged before the data was handed down, a volume that comes back empty or not at
//! all after the restart).
//!
//! The kill moments and the writes come from a seed (printed; NACRE_DURABILITY_SEED=N
//! reruns it); NACRE_DURABILITY_TRIALS=N changes the number of trials per frontend (20).

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use blkio::{Blkioq, ReqFlags};
use nacre_tests::blkio_client::{BlkioClient, ClientOptions};
use nacre_tests::daemon::Nacred;
use nacre_tests::fuzz::{env_u64, Rng};
use nacre_tests::nvmf_host::{HostOptions, NvmfHost};
use serde_json::json;

const BLOCK: usize = 4096;
const BLOCKS: u64 = 256;
const VOLUME: &str = "durable";
const NQN: &str = "nqn.2024-01.io.nacre:durability";

/// The contents of `block` at `version` (version 0: never written, zeros).
fn pattern(block: u64, version: u64) -> Vec<u8> {
    if version == 0 {
        return vec![0; BLOCK];
    }
    let mut b = Vec::with_capacity(BLOCK);
    b.extend_from_slice(b"NACREDUR");
    b.extend_from_slice(&block.to_le_bytes());
    b.extend_from_slice(&version.to_le_bytes());
    let mut r = Rng::new(block.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ version);
    while b.len() < BLOCK {
        b.extend_from_slice(&r.next_u64().to_le_bytes());
    }
    b
}

/// What the test knows about each block.
#[derive(Default, Clone)]
struct BlockState {
    /// The version that must be there (durable: acknowledged before a completed flush, or
    /// read back after a restart).
    durable: u64,
    /// Versions written since, acknowledged or not: each may be there instead.
    since: Vec<u64>,
}

#[derive(Default)]
struct Model {
    blocks: HashMap<u64, BlockState>,
    next_version: u64,
    /// Writes acknowledged since the last completed flush, in order.
    acked: Vec<(u64, u64)>,
}

impl Model {
    /// A write of `versions` (one per block from `first`) is about to be submitted.
    fn submit(&mut self, first: u64, versions: &[u64]) {
        for (i, v) in versions.iter().enumerate() {
            self.blocks
                .entry(first + i as u64)
                .or_default()
                .since
                .push(*v);
        }
    }

    fn acked(&mut self, first: u64, versions: &[u64]) {
        for (i, v) in versions.iter().enumerate() {
            self.acked.push((first + i as u64, *v));
        }
    }

    /// A flush completed: every write acknowledged before it is durable.
    fn flushed(&mut self) {
        for (b, v) in std::mem::take(&mut self.acked) {
            let s = self.blocks.entry(b).or_default();
            // Only versions written after `v` may still replace it.
            if let Some(pos) = s.since.iter().position(|&x| x == v) {
                s.durable = v;
                s.since.drain(..=pos);
            }
        }
    }

    /// Check what a block holds after a restart; it becomes the block's durable version.
    fn check(&mut self, block: u64, data: &[u8], seed: u64, trial: u32, frontend: &str) {
        let s = self.blocks.entry(block).or_default();
        let allowed: Vec<u64> = std::iter::once(s.durable)
            .chain(s.since.iter().copied())
            .collect();
        let found = allowed.iter().copied().find(|&v| pattern(block, v) == data);
        let Some(v) = found else {
            let what = if data.iter().all(|&b| b == 0) {
                "zeros".to_string()
            } else if data.starts_with(b"NACREDUR") {
                let mut n = [0u8; 8];
                n.copy_from_slice(&data[8..16]);
                let b = u64::from_le_bytes(n);
                n.copy_from_slice(&data[16..24]);
                format!("block {b} version {}", u64::from_le_bytes(n))
            } else {
                "garbage".to_string()
            };
            panic!(
                "{frontend}: seed {seed}, trial {trial}: block {block} holds {what}; \
                 durable version {}, possible since: {:?}",
                s.durable, s.since
            );
        };
        s.durable = v;
        s.since.clear();
    }
}

/// The I/O a frontend offers the workload.
trait Disk {
    /// Write `data` at block `first`; Err when the daemon is gone.
    fn write(&mut self, first: u64, data: &[u8]) -> Result<()>;
    fn flush(&mut self) -> Result<()>;
    fn read(&mut self, first: u64, n: u64) -> Result<Vec<u8>>;
}

// ---- vhost-user-blk through libblkio ----

struct Vhost {
    // Queue before client: dropped first.
    q: Blkioq,
    client: BlkioClient,
    killed: Arc<AtomicBool>,
}

impl Vhost {
    fn connect(socket: &Path, killed: Arc<AtomicBool>) -> Result<Self> {
        let mut client = BlkioClient::connect(
            socket,
            &ClientOptions {
                mem_len: 1 << 20,
                ..ClientOptions::default()
            },
        )?;
        let q = client.take_queues().pop().expect("one queue");
        Ok(Vhost { q, client, killed })
    }

    /// One request's result; Err if nacred was killed before it completed (libblkio does
    /// not notice a dead backend, so wait in slices and look).
    fn wait(&mut self) -> Result<i32> {
        loop {
            let mut c = [MaybeUninit::<blkio::Completion>::uninit()];
            let mut t = Duration::from_millis(100);
            // A slice that ends with nothing completed is ETIME ("Timed out"), not 0: the
            // request is still in flight (a loaded machine), so look at `killed` and go on.
            let n = match self.q.do_io(&mut c, 1, Some(&mut t), None) {
                Ok(n) => n,
                Err(e) if e.errno() == blkio::Errno::TIME => 0,
                Err(e) => bail!("libblkio: {}", e.message()),
            };
            if n == 1 {
                // SAFETY: do_io initialised the first n entries.
                let ret = unsafe { c[0].assume_init_read() }.ret;
                if ret != 0 {
                    bail!("request failed: {ret}");
                }
                return Ok(ret);
            }
            if self.killed.load(Ordering::SeqCst) {
                bail!("nacred was killed");
            }
        }
    }
}

impl Disk for Vhost {
    fn write(&mut self, first: u64, data: &[u8]) -> Result<()> {
        let mem = self.client.mem();
        mem[..data.len()].copy_from_slice(data);
        self.q.write(
            first * BLOCK as u64,
            mem.as_ptr(),
            data.len(),
            0,
            ReqFlags::empty(),
        );
        self.wait().map(drop)
    }

    fn flush(&mut self) -> Result<()> {
        self.q.flush(0, ReqFlags::empty());
        self.wait().map(drop)
    }

    fn read(&mut self, first: u64, n: u64) -> Result<Vec<u8>> {
        let len = n as usize * BLOCK;
        let mem = self.client.mem();
        self.q.read(
            first * BLOCK as u64,
            mem.as_mut_ptr(),
            len,
            0,
            ReqFlags::empty(),
        );
        self.wait()?;
        Ok(self.client.mem()[..len].to_vec())
    }
}

// ---- NVMe/TCP through the kernel-free host ----

struct Nvmf(NvmfHost);

impl Disk for Nvmf {
    fn write(&mut self, first: u64, data: &[u8]) -> Result<()> {
        let lbas = (BLOCK / 512) as u64;
        Ok(self.0.write(0, 1, first * lbas, data, 512)?)
    }

    fn flush(&mut self) -> Result<()> {
        Ok(self.0.flush(0, 1)?)
    }

    fn read(&mut self, first: u64, n: u64) -> Result<Vec<u8>> {
        let lbas = (BLOCK / 512) as u64;
        Ok(self.0.read(0, 1, first * lbas, (n * lbas) as u32, 512)?)
    }
}

/// A nacred with a file volume exported through both frontends.
fn daemon(dir: &Path) -> (Nacred, PathBuf) {
    let n = Nacred::start_args(&["--no-default"]);
    let img = dir.join("durable.img");
    n.ok(
        "volume_create",
        json!({"name": VOLUME, "size": BLOCKS * BLOCK as u64, "block_size": 512,
               "backend": "file", "path": img}),
    );
    let socket = n.run_dir.join("durable.sock");
    n.ok(
        "vhost_blk_create",
        json!({"name": "d0", "volume": VOLUME, "socket": socket, "queues": 1}),
    );
    n.ok(
        "nvmf_subsystem_create",
        json!({"nqn": NQN, "allow_any_host": true}),
    );
    n.ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": NQN, "volume": VOLUME, "nsid": 1}),
    );
    n.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "address": "127.0.0.1", "port": 0}),
    );
    (n, socket)
}

fn connect(frontend: &str, n: &Nacred, socket: &Path, killed: &Arc<AtomicBool>) -> Box<dyn Disk> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r: Result<Box<dyn Disk>> = if frontend == "vhost" {
            Vhost::connect(socket, killed.clone()).map(|d| Box::new(d) as Box<dyn Disk>)
        } else {
            NvmfHost::connect(n.nvmf_listener(NQN), NQN, HostOptions::default())
                .map(|h| Box::new(Nvmf(h)) as Box<dyn Disk>)
                .map_err(Into::into)
        };
        match r {
            Ok(d) => return d,
            Err(e) if Instant::now() > deadline => {
                panic!(
                    "{frontend}: cannot connect after restart: {e:#}\n{}",
                    n.log_text()
                )
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Random writes (1 to 4 blocks) and flushes until the daemon dies under them.
fn workload(disk: &mut dyn Disk, m: &mut Model, r: &mut Rng, deadline: Instant) -> u64 {
    let mut ops = 0;
    loop {
        if Instant::now() > deadline {
            panic!("the workload ran past its deadline: nacred was not killed?");
        }
        if r.chance(6) {
            if disk.flush().is_err() {
                return ops;
            }
            m.flushed();
        } else {
            let n = 1 + r.below(4);
            let first = r.below(BLOCKS - n + 1);
            let versions: Vec<u64> = (0..n)
                .map(|_| {
                    m.next_version += 1;
                    m.next_version
                })
                .collect();
            let data: Vec<u8> = versions
                .iter()
                .enumerate()
                .flat_map(|(i, &v)| pattern(first + i as u64, v))
                .collect();
            m.submit(first, &versions);
            if disk.write(first, &data).is_err() {
                return ops;
            }
            m.acked(first, &versions);
        }
        ops += 1;
    }
}

fn run(frontend: &str) {
    let seed = env_u64(
        "NACRE_DURABILITY_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    );
    let trials = env_u64("NACRE_DURABILITY_TRIALS", 20) as u32;
    println!("{frontend}: seed {seed} (NACRE_DURABILITY_SEED={seed} reruns it), {trials} trials");
    let mut r = Rng::new(seed);
    let dir = tempfile::tempdir().unwrap();
    let (mut n, socket) = daemon(dir.path());
    let mut m = Model::default();
    let killed = Arc::new(AtomicBool::new(false));
    let mut total_ops = 0;
    let started = Instant::now();
    for trial in 0..trials {
        killed.store(false, Ordering::SeqCst);
        let mut disk = connect(frontend, &n, &socket, &killed);
        // Kill at a random moment: sometimes at once, mostly in the middle of the I/O.
        let delay = Duration::from_millis(if r.chance(5) {
            r.below(5)
        } else {
            5 + r.below(300)
        });
        let pid = n.pid() as i32;
        let k = killed.clone();
        let killer = std::thread::spawn(move || {
            std::thread::sleep(delay);
            // SAFETY: kill(2) on our own child's pid; it is reaped only after this thread
            // is joined, so the pid cannot have been reused.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            k.store(true, Ordering::SeqCst);
        });
        let mut wr = Rng::new(r.next_u64());
        let ops = workload(
            &mut *disk,
            &mut m,
            &mut wr,
            Instant::now() + Duration::from_secs(60),
        );
        killer.join().unwrap();
        total_ops += ops;
        drop(disk);
        n.crash_restart();
        // Every block, through the same frontend, from the restarted nacred (alive: a read
        // that is merely slow must be waited for, not taken for the kill).
        killed.store(false, Ordering::SeqCst);
        let mut disk = connect(frontend, &n, &socket, &killed);
        const CHUNK: u64 = 16;
        for first in (0..BLOCKS).step_by(CHUNK as usize) {
            let data = disk.read(first, CHUNK).unwrap_or_else(|e| {
                panic!(
                    "{frontend}: seed {seed}, trial {trial}: read after restart failed: {e:#}\n{}",
                    n.log_text()
                )
            });
            for i in 0..CHUNK {
                let at = i as usize * BLOCK;
                m.check(first + i, &data[at..at + BLOCK], seed, trial, frontend);
            }
        }
        // What was read is what the file holds now: nothing is pending any more.
        m.acked.clear();
    }
    println!(
        "{frontend}: {trials} kill -9 trials, {total_ops} acknowledged operations, \
         {BLOCKS} blocks checked after each, no loss ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn vhost_user_blk_writes_survive_kill_9() {
    run("vhost");
}

#[test]
fn nvmf_tcp_writes_survive_kill_9() {
    run("nvmf");
}
