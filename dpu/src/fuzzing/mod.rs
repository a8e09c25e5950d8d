//! Entry points for coverage-guided fuzzing (the cargo-fuzz crate in `fuzz/`) and for the
//! corpus replay test (`tests/fuzz_corpus.rs`), which runs every committed corpus file
//! through the same functions on stable Rust.
//!
//! Each entry point takes the raw bytes of one input, drives the real code with them the
//! way a peer would (a guest's descriptor chains, a host's or a controller's NVMe/TCP byte
//! stream, an RPC client's bytes, a peer's authentication messages, a vfio-user client's
//! messages and guest memory), and panics when an invariant breaks. A panic anywhere
//! inside — even one the code under test catches, like the NVMe/TCP target's per-connection
//! `catch_unwind` — is a finding: libFuzzer's panic hook aborts on it, and the replay test
//! counts panics.
//!
//! Input formats are documented on each function; [`seed`] builds well-formed inputs for
//! the seed generator (`tests/src/bin/fuzz-seeds.rs`).
//!
//! Not part of nacre's API: it exists for the fuzzers and may change with them.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{FromRawFd, IntoRawFd};
use std::os::unix::net::UnixStream;

// One file per harness family; what the fuzz targets, the replay test and the seed generator
// use is re-exported here, at the paths they name.
mod json_rpc;
mod nvme_auth;
mod nvmf_initiator;
mod nvmf_target;
pub mod seed;
mod vfio_user;
mod virtqueue;

pub use json_rpc::{json_rpc, rpc_root, RPC_DIR, RPC_SKIPPED};
pub use nvme_auth::nvme_auth;
pub use nvmf_initiator::{init_flags, nvmf_initiator, INIT_CIDS, INIT_CNTLID, INIT_READ};
pub use nvmf_target::{
    nvme_commands, nvmf_target, parse_cmd_records, CmdRecord, ADMIN_WRITES, IO_WRITES,
};
pub use vfio_user::{vfio_user, vfio_user_session, PCIE_MAX_PAGES, PCIE_NQN};
pub use virtqueue::{
    virtqueue, VQ_AVAIL, VQ_DATA, VQ_DESC, VQ_REGIONS, VQ_SIZE, VQ_USED, VQ_VOLUME,
};

/// The subsystem the NVMe/TCP targets serve.
pub const NQN: &str = "nqn.2024-01.io.nacre:fuzz";
/// The host NQN the harnesses connect with.
pub const HOSTNQN: &str = "nqn.2024-01.io.nacre:fuzz-host";
/// The namespace behind [`NQN`]: small, so reads stay small.
pub const NS_BYTES: u64 = 64 << 10;
/// Its logical block size.
pub const NS_LBA: u32 = 512;

/// The fuzz processes are not Rust binaries (libFuzzer owns `main`), so nothing set SIGPIPE
/// to ignored: a write to a closed socket would kill the process instead of failing.
fn ignore_sigpipe() {
    // SAFETY: setting a signal disposition to SIG_IGN has no memory-safety preconditions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
}

/// A connected pair: `(host end, target end as the TcpStream the target serves)`.
fn stream_pair() -> (UnixStream, TcpStream) {
    let (host, target) = UnixStream::pair().expect("socketpair");
    // SAFETY: `into_raw_fd` hands over sole ownership of a valid socket descriptor. The
    // target only uses socket calls that work on any stream socket (read, write, shutdown,
    // timeouts); the address queries fail on a Unix socket, which it tolerates.
    let target = unsafe { TcpStream::from_raw_fd(target.into_raw_fd()) };
    (host, target)
}

/// Threads the harnesses hand the peer's side of a connection to, kept from one input to
/// the next. Spawning them afresh for every input cost more than the code under test
/// (three threads an input: `clone`, stack mapping, scheduler wake-up and exit), which held
/// the socket harnesses to about 2,000 executions a second.
mod helper {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::mpsc;
    use std::sync::Mutex;

    /// Work for a helper: runs the job and returns how to hand its result over. The helper
    /// files itself as idle between the two steps, so a caller that starts the next job as
    /// soon as it has the result finds it idle instead of spawning another.
    type Job = Box<dyn FnOnce() -> Box<dyn FnOnce() + Send> + Send>;

    /// Helpers waiting for work: each is the sending end of its job channel.
    static IDLE: Mutex<Vec<mpsc::Sender<Job>>> = Mutex::new(Vec::new());

    /// The result of a job handed to a helper, like [`std::thread::JoinHandle`].
    pub struct Handle<T>(mpsc::Receiver<std::thread::Result<T>>);

    impl<T> Handle<T> {
        /// Wait for the job; `Err` carries its panic, as a thread's join would.
        pub fn join(self) -> std::thread::Result<T> {
            self.0
                .recv()
                .unwrap_or_else(|_| Err(Box::new("fuzz helper thread vanished")))
        }
    }

    /// Run `f` on an idle helper (a new one when none is idle).
    pub fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Handle<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move || {
            let r = catch_unwind(AssertUnwindSafe(f));
            Box::new(move || {
                let _ = tx.send(r);
            })
        });
        let idle = IDLE.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match idle {
            Some(h) => {
                if let Err(mpsc::SendError(job)) = h.send(job) {
                    spawn(job);
                }
            }
            None => spawn(job),
        }
        Handle(rx)
    }

    fn spawn(first: Job) {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::spawn(move || {
            let mut job = first;
            loop {
                let deliver = job();
                IDLE.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(tx.clone());
                deliver();
                match rx.recv() {
                    Ok(j) => job = j,
                    Err(_) => return,
                }
            }
        });
    }
}

/// Send `input` from a helper thread (so neither side blocks on a full socket buffer) and
/// collect what comes back until the target closes.
fn feed(mut host: UnixStream, input: Vec<u8>, close: bool) -> helper::Handle<Vec<u8>> {
    helper::run(move || {
        let _ = host.write_all(&input);
        if close {
            let _ = host.shutdown(Shutdown::Write);
        }
        let mut out = Vec::new();
        let _ = host.read_to_end(&mut out);
        out
    })
}
