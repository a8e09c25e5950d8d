//! Closed-loop load through libblkio for the QoS and telemetry tests: keep `qd` 4 KiB reads in
//! flight on a vhost-user-blk device and record, for every request, when it completed and how
//! long it took as the client saw it (submission to completion).

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use blkio::{Completion, ReqFlags};

use crate::blkio_client::{BlkioClient, ClientOptions};

pub const BS: usize = 4096;

/// What one run recorded.
#[derive(Debug, Default)]
pub struct Trace {
    /// Completion instants, in completion order.
    pub done: Vec<Instant>,
    /// Client-side latency of each request, in completion order.
    pub latency: Vec<Duration>,
}

impl Trace {
    /// Requests completed in [from, to).
    pub fn count(&self, from: Instant, to: Instant) -> usize {
        let lo = self.done.partition_point(|t| *t < from);
        let hi = self.done.partition_point(|t| *t < to);
        hi - lo
    }

    /// Completions per second over [from, to).
    pub fn rate(&self, from: Instant, to: Instant) -> f64 {
        self.count(from, to) as f64 / (to - from).as_secs_f64()
    }

    /// Completions in consecutive `step` windows from `from` (for the record in messages).
    pub fn histogram(&self, from: Instant, step: Duration, n: usize) -> Vec<usize> {
        (0..n as u32)
            .map(|i| self.count(from + step * i, from + step * (i + 1)))
            .collect()
    }

    /// The exact client-side `q`-quantile of latency (nearest rank).
    pub fn quantile(&self, q: f64) -> Duration {
        let mut l = self.latency.clone();
        l.sort();
        let rank = ((l.len() as f64 * q).ceil() as usize).clamp(1, l.len());
        l[rank - 1]
    }
}

/// A running load; [`Load::finish`] stops submitting, drains what is in flight and returns the
/// trace (every submitted request completed).
pub struct Load {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<Trace>>,
    socket: PathBuf,
}

impl Load {
    /// Connect to `socket` and start keeping `qd` reads in flight. Returns once connected.
    pub fn start(socket: &Path, qd: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let s = stop.clone();
        let path = socket.to_path_buf();
        let thread = std::thread::spawn(move || run(&path, qd, &s, tx));
        rx.recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("load on {} did not connect", socket.display()));
        Load {
            stop,
            thread,
            socket: socket.to_path_buf(),
        }
    }

    pub fn finish(self) -> Trace {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .expect("load thread")
            .unwrap_or_else(|e| panic!("load on {}: {e:#}", self.socket.display()))
    }
}

fn run(
    socket: &Path,
    qd: usize,
    stop: &AtomicBool,
    ready: std::sync::mpsc::Sender<()>,
) -> Result<Trace> {
    let mut client = BlkioClient::connect(
        socket,
        &ClientOptions {
            mem_len: qd * BS,
            ..Default::default()
        },
    )?;
    let blocks = client.capacity()? / BS as u64;
    if blocks == 0 {
        bail!("device smaller than one block");
    }
    let base = client.mem_ptr();
    let mut q = client.take_queues().pop().context("no queue")?;
    let _ = ready.send(());
    let mut trace = Trace::default();
    let mut started = vec![Instant::now(); qd];
    let mut next = 0u64;
    let mut submit = |q: &mut blkio::Blkioq, slot: usize| {
        next = (next + 7919) % blocks;
        // SAFETY: slot `slot` owns bytes [slot*BS, (slot+1)*BS) of the mapped region.
        let buf = unsafe { base.add(slot * BS) };
        q.read(next * BS as u64, buf, BS, slot, ReqFlags::empty());
    };
    for (slot, t) in started.iter_mut().enumerate() {
        *t = Instant::now();
        submit(&mut q, slot);
    }
    let mut inflight = qd;
    let mut comps: Vec<MaybeUninit<Completion>> = (0..qd).map(|_| MaybeUninit::uninit()).collect();
    while inflight > 0 {
        let n = q
            .do_io(&mut comps, 1, None, None)
            .map_err(|e| anyhow::anyhow!("do_io: {}", e.message()))?;
        let now = Instant::now();
        let stopping = stop.load(Ordering::Relaxed);
        for c in &comps[..n] {
            // SAFETY: do_io initialised the first n entries.
            let c = unsafe { c.assume_init_read() };
            if c.ret != 0 {
                bail!("read failed: {}", c.ret);
            }
            let slot = c.user_data;
            trace.done.push(now);
            trace.latency.push(now - started[slot]);
            inflight -= 1;
            if !stopping {
                started[slot] = Instant::now();
                submit(&mut q, slot);
                inflight += 1;
            }
        }
    }
    drop(q);
    drop(client);
    Ok(trace)
}
