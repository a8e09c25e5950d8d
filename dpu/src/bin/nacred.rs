//! nacred: the nacre DPU daemon.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use nacre_dpu::config;
use nacre_dpu::control::host_channel::HostListener;
use nacre_dpu::control::opi::{OpiConfig, OpiServer};
use nacre_dpu::control::{server::RpcServer, Daemon, DaemonConfig};
use nacre_dpu::frontend::nvmf_tcp::{self, ConnLimits, PollPolicy};
use nacre_shared::api::vhost::VhostBlkCreate;
use nacre_shared::api::volume::{BackendKind, VolumeCreate};
use nacre_shared::size::format_size;
use serde_json::json;
use tracing::{info, warn};

/// mimalloc, not glibc's malloc: the data path allocates a request's completion state on the
/// thread that submits it (a vhost-user-blk worker) and frees it on the thread that completes
/// it (an initiator's reactor); glibc returns such frees to the allocating thread's
/// arena under that arena's lock, mimalloc through a lock-free per-page list. End to end
/// through XTS and NVMe/TCP it measured 4-25% more IOPS per core in six alternations
/// (`fabric-bench`, README); the target alone, whose buffers are pooled, did not move.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const EXAMPLES: &str = "\
Examples:
  # Start with the embedded default: a 1 GiB file volume \"default\" served over
  # vhost-user-blk on /run/nacre/vhost-default.sock (state in /var/lib/nacre).
  nacred

  # Keep everything under one directory, as the tests do.
  nacred --state-dir /tmp/nacre/state --run-dir /tmp/nacre/run

  # Then drive it with the CLI:
  nacre volume create scratch --size 4G --backend ram
  nacre vhost-blk create scratch0 --volume scratch --queues 4

nacred replays its state directory on start: volumes, devices and their sockets come back
as they were, so a VM whose vhost-user-blk backend restarted reconnects and finds its data.
Stop it with SIGTERM or SIGINT.";

/// Where `/metrics` is served unless `--metrics-listen` says otherwise (loopback only).
const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9444";

/// `--metrics-listen`: an address, or `off` (None).
#[derive(Debug, Clone, Copy)]
struct MetricsListen(Option<SocketAddr>);

/// A count that must be at least 1 (0 would refuse every host, silently).
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn parse_metrics_listen(s: &str) -> Result<MetricsListen, String> {
    if s == "off" {
        return Ok(MetricsListen(None));
    }
    s.parse()
        .map(|a| MetricsListen(Some(a)))
        .map_err(|e| format!("{e}: expected ADDR:PORT (e.g. 127.0.0.1:9444) or off"))
}

/// nacre's DPU daemon: serves encrypted, per-tenant volumes to hosts as vhost-user-blk
/// devices (and NVMe-oF), driven over a JSON-RPC socket by the `nacre` CLI.
#[derive(Parser, Debug)]
#[command(name = "nacred", version, after_help = EXAMPLES)]
struct Args {
    /// Persistent state: state.json, file volumes, wrapped keys (mode 0700).
    #[arg(long, env = config::ENV_STATE_DIR, default_value = config::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,

    /// Sockets: the RPC socket and vhost-user sockets.
    #[arg(long, env = config::ENV_RUN_DIR, default_value = config::DEFAULT_RUN_DIR)]
    run_dir: PathBuf,

    /// RPC socket path [default: <run-dir>/nacred.sock].
    #[arg(long, env = config::ENV_RPC)]
    rpc: Option<PathBuf>,

    /// Do not create the embedded default volume and device on a fresh state directory.
    #[arg(long)]
    no_default: bool,

    /// Where the embedded default's NVMe/TCP subsystem listens (port 0: any free port).
    #[arg(long, env = "NACRE_NVMF_LISTEN", default_value = "127.0.0.1:4420")]
    nvmf_listen: SocketAddr,

    /// Listen for host agents (nacre-host) on this TCP address, mutual TLS only (see
    /// `nacre cert`); on a BlueField, the tmfifo or OOB address. Default: off.
    #[arg(long, env = "NACRE_HOST_LISTEN")]
    host_listen: Option<SocketAddr>,

    /// The host channel's certificates (`nacre cert init`) [default: <state-dir>/tls].
    #[arg(long, env = "NACRE_HOST_TLS_DIR")]
    host_tls_dir: Option<PathBuf>,

    /// Serve OPI's storage API (opi_api.storage.v1) over gRPC on this address, with server
    /// reflection (docs/opi.md). Without --opi-tls-dir, loopback only. Default: off.
    #[arg(long, env = "NACRE_OPI_LISTEN")]
    opi_listen: Option<SocketAddr>,

    /// Serve OPI over mutual TLS with the certificates `nacre cert init` made in this
    /// directory: clients need a certificate signed by that CA.
    #[arg(long, env = "NACRE_OPI_TLS_DIR")]
    opi_tls_dir: Option<PathBuf>,

    /// The tenant whose KEK wraps the data keys OPI clients hand over for encrypted volumes.
    #[arg(long, env = "NACRE_OPI_TENANT")]
    opi_tenant: Option<String>,

    /// NVMe/TCP: connections one listener serves at once; more are closed on accept.
    #[arg(long, env = "NACRE_NVMF_MAX_CONNECTIONS", default_value_t = ConnLimits::DEFAULT.per_listener)]
    nvmf_max_connections: usize,

    /// NVMe/TCP: connections of one listener not yet past Fabrics Connect (at least 1); a new
    /// one beyond this closes the oldest such connection.
    #[arg(long, env = "NACRE_NVMF_MAX_SETUP_CONNECTIONS", default_value_t = ConnLimits::DEFAULT.setup_per_listener,
          value_parser = at_least_one)]
    nvmf_max_setup_connections: usize,

    /// NVMe/TCP: queues (admin and I/O) one host NQN may hold; a Connect beyond it fails
    /// with Connect Controller Busy.
    #[arg(long, env = "NACRE_NVMF_MAX_CONNECTIONS_PER_HOST", default_value_t = ConnLimits::DEFAULT.per_host)]
    nvmf_max_connections_per_host: usize,

    /// NVMe/TCP: threads serving the target's connections, each many of them through epoll
    /// (busy-polling briefly after work, then sleeping). 0: one per core, at most 4.
    #[arg(long, env = "NACRE_NVMF_REACTORS", default_value_t = 0)]
    nvmf_reactors: usize,

    /// Remote storage over NVMe/TCP: threads serving the initiator's queues (every queue of
    /// every remote controller), each many of them through epoll, sleeping when idle; the
    /// thread that submits a command sends it. Reads of encrypted volumes are decrypted on
    /// these threads: on a DPU with many cores and fast shelves, give more. 0: one per core,
    /// at most 4.
    #[arg(long, env = "NACRE_FABRIC_REACTORS", default_value_t = 0)]
    fabric_reactors: usize,

    /// NVMe/TCP: when a reactor busy-polls after work rather than sleeping in epoll_wait.
    /// `adaptive`: poll (up to 50 µs) for hosts that wait on each reply (QD1, QD2), sleep at
    /// once for hosts that keep 8 or more commands in flight, whose throughput a wake-up
    /// does not cost; `always`: poll at any depth (lowest latency, a core kept busy while
    /// hosts are); `off`: never poll. `nacre nvmf stats` shows what the reactors did.
    #[arg(long, env = "NACRE_NVMF_POLL", value_enum, default_value_t = PollPolicy::Adaptive)]
    nvmf_poll: PollPolicy,

    /// Serve Prometheus metrics on http://ADDR/metrics (port 0: any free one; `nacre rpc
    /// metrics_endpoint` tells which), or `off`. Keep it on loopback. When the default port is
    /// taken (a second nacred on this machine) nacred warns and runs without the endpoint; an
    /// address given explicitly must bind.
    #[arg(long, env = "NACRE_METRICS_LISTEN", default_value = DEFAULT_METRICS_LISTEN,
          value_parser = parse_metrics_listen)]
    metrics_listen: MetricsListen,

    /// Serve volumes without the QoS and statistics layer (limits are kept, not enforced):
    /// the baseline of scripts/bench-qos.
    #[arg(long)]
    no_qos: bool,

    /// Log filter (tracing's EnvFilter syntax), e.g. info, debug, nacre_dpu=trace.
    #[arg(long, env = "NACRE_LOG", default_value = "info")]
    log: String,
}

/// Every vhost-user connection holds a kick and a call eventfd per queue and a memory-table fd
/// per region, and every NVMe-oF queue a socket: a DPU serving many VMs and hosts outgrows the
/// soft limit of 1,024 that service managers usually start daemons with. Raise the soft limit
/// to the hard one, as QEMU does for itself, and say so when that is still low.
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit with a valid out pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    // The kernel refuses a soft limit above fs.nr_open (1 Mi by default), infinity included.
    let target = lim.rlim_max.min(1 << 20);
    let mut now = lim.rlim_cur;
    if now < target {
        let want = libc::rlimit {
            rlim_cur: target,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit with a valid, initialised struct; raising the soft limit up to the
        // hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            info!(from = now, to = target, "raised the open-file limit");
            now = target;
        }
    }
    if now < 4096 {
        warn!(
            limit = now,
            "the open-file limit is low for a storage daemon (every VM queue and NVMe-oF queue \
             takes descriptors); raise it (LimitNOFILE= in the service unit)"
        );
    }
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        // One line, like every nacre tool's errors: the chain joined with ": ".
        eprintln!("nacred: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&args.log)
                .with_context(|| format!("invalid --log filter {:?}", args.log))?,
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();

    // Block the stop signals in every thread (threads inherit the mask), so that only the
    // main thread's sigwait sees them and can shut down in order.
    let signals = stop_signals();
    // SAFETY: pthread_sigmask with a valid, initialised set.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &signals, std::ptr::null_mut()) };

    // Refused before anything is opened (OpiServer::start checks it again).
    if let (Some(addr), None) = (args.opi_listen, &args.opi_tls_dir) {
        if !addr.ip().is_loopback() {
            anyhow::bail!(
                "--opi-listen {addr}: without --opi-tls-dir the OPI server listens on loopback \
                 only (127.0.0.1 or ::1)"
            );
        }
    }
    raise_fd_limit();
    nvmf_tcp::set_default_reactors(args.nvmf_reactors);
    nacre_dpu::fabric::tcp::set_reactors(args.fabric_reactors);
    nvmf_tcp::set_poll_policy(args.nvmf_poll);
    nvmf_tcp::set_default_conn_limits(ConnLimits {
        per_listener: args.nvmf_max_connections,
        setup_per_listener: args.nvmf_max_setup_connections,
        per_host: args.nvmf_max_connections_per_host,
    });

    if args.no_qos {
        nacre_dpu::control::registry::QOS_DISABLED
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let (daemon, existed) = Daemon::open(DaemonConfig {
        state_dir: args.state_dir.clone(),
        run_dir: args.run_dir.clone(),
    })?;
    let rpc_path = args
        .rpc
        .clone()
        .unwrap_or_else(|| args.run_dir.join(config::RPC_SOCKET_NAME));
    if !existed && !args.no_default {
        embedded_default(&daemon, args.nvmf_listen)
            .context("cannot set up the embedded default")?;
    }
    if let MetricsListen(Some(addr)) = args.metrics_listen {
        nacre_dpu::control::metrics::export_daemon_series(&daemon.registry);
        match nacre_dpu::telemetry::http::serve(addr, daemon.registry.qos().telemetry().clone()) {
            Ok(bound) => {
                let _ = daemon.metrics_addr.set(bound);
            }
            Err(e) if addr.to_string() == DEFAULT_METRICS_LISTEN => {
                warn!(%addr, error = %e, "metrics endpoint off: the default address is taken \
                    (another nacred?); pass --metrics-listen ADDR or off");
            }
            Err(e) => return Err(e).with_context(|| format!("cannot serve metrics on {addr}")),
        }
    }
    // Before the RPC socket, so that once it answers the OPI server is up (and logged).
    let opi_server = match args.opi_listen {
        Some(addr) => {
            let s = OpiServer::start(
                daemon.registry.clone(),
                addr,
                OpiConfig {
                    tenant: args.opi_tenant.clone(),
                    tls_dir: args.opi_tls_dir.clone(),
                },
            )?;
            eprintln!("nacred: OPI gRPC on {}", s.local_addr());
            Some(s)
        }
        None => None,
    };
    // Last: a client that reaches the RPC socket finds every device already serving.
    let server = RpcServer::start(daemon.clone(), &rpc_path)?;
    let host_listener = match args.host_listen {
        Some(addr) => {
            let dir = args
                .host_tls_dir
                .clone()
                .unwrap_or_else(|| args.state_dir.join("tls"));
            let l = HostListener::start(daemon.clone(), addr, &dir)?;
            eprintln!("nacred: host channel on {}", l.local_addr());
            Some(l)
        }
        None => None,
    };
    print_attach_hints(&daemon);
    info!(rpc = %rpc_path.display(), state_dir = %args.state_dir.display(), "nacred ready");
    eprintln!("nacred: ready; RPC on {}", rpc_path.display());

    let mut sig: libc::c_int = 0;
    // SAFETY: sigwait with the same valid set; sig is a valid out pointer.
    unsafe { libc::sigwait(&signals, &mut sig) };
    info!(signal = sig, "stopping");
    drop(opi_server);
    drop(host_listener);
    drop(server);
    daemon.shutdown();
    eprintln!("nacred: stopped");
    Ok(())
}

fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before use.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// A fresh nacred with nothing configured serves a 1 GiB file volume `default` (reopening
/// `<state-dir>/volumes/default.img` if it is there) on `<run-dir>/vhost-default.sock`, and
/// exports it as namespace 1 of [`DEFAULT_NQN`] over NVMe/TCP on `listen`, open to any host,
/// so that `nvme connect -t tcp -a 127.0.0.1 -n nqn.2014-08.io.nacre:default` shows it.
/// A listen address already in use is a warning, not a failed start: the volume and the
/// vhost-user-blk device are still served.
fn embedded_default(d: &Daemon, listen: SocketAddr) -> anyhow::Result<()> {
    let name = config::DEFAULT_VOLUME_NAME;
    // The embedded default is documented to reopen its own file (a state directory whose
    // state.json was removed to reset the configuration keeps the default disk's data): an
    // explicit adoption, said out loud, of the file's size.
    let path = d.registry.default_volume_path(name);
    let adopt = path.exists();
    if adopt {
        eprintln!(
            "nacred: the embedded default adopts the existing {} (remove it for an empty disk)",
            path.display()
        );
    }
    let vol = d.registry.create_volume(&VolumeCreate {
        name: name.into(),
        size: if adopt {
            0
        } else {
            config::DEFAULT_VOLUME_SIZE
        },
        adopt_existing: adopt,
        block_size: 4096,
        backend: BackendKind::File,
        path: None,
        tenant: None,
        encrypt: false,
        remote: None,
    })?;
    d.registry.create_vhost_blk(&VhostBlkCreate {
        name: name.into(),
        volume: name.into(),
        queues: DEFAULT_DEVICE_QUEUES,
        queue_size: nacre_shared::api::vhost::DEFAULT_QUEUE_SIZE,
        socket: None,
        read_only: false,
    })?;
    d.call(
        "nvmf_subsystem_create",
        json!({"nqn": DEFAULT_NQN, "serial": vol.serial, "allow_any_host": true}),
    )?;
    d.call(
        "nvmf_subsystem_add_ns",
        json!({"nqn": DEFAULT_NQN, "volume": name, "nsid": 1}),
    )?;
    if let Err(e) = d.call(
        "nvmf_subsystem_add_listener",
        json!({"nqn": DEFAULT_NQN, "address": listen.ip().to_string(), "port": listen.port()}),
    ) {
        warn!(%listen, error = %e, "embedded default: no NVMe/TCP listener");
        eprintln!(
            "nacred: warning: cannot listen for NVMe/TCP on {listen}: {e}; add one with \
             `nacre nvmf add-listener {DEFAULT_NQN} --address A --port P`"
        );
    }
    Ok(())
}

/// The subsystem the embedded default exports its volume in.
pub const DEFAULT_NQN: &str = "nqn.2014-08.io.nacre:default";

/// Queues of the embedded default device: QEMU refuses a vhost-user-blk-pci whose
/// num-queues exceeds the backend's, and defaults num-queues to the vCPU count, so offer
/// enough for a typical small VM.
const DEFAULT_DEVICE_QUEUES: u16 = 4;

fn print_attach_hints(d: &Daemon) {
    let state = d.registry.read_state(Clone::clone);
    for dev in state.vhost_blk.values() {
        let Some(vol) = state.volumes.get(&dev.volume) else {
            continue;
        };
        eprintln!(
            "nacred: vhost-blk {:?} serves volume {:?} ({}, {}) on {}\n\
             nacred: attach it to a QEMU VM with:\n  \
             qemu-system-x86_64 ... -object memory-backend-memfd,id=mem,size=2G,share=on -numa node,memdev=mem \\\n    \
             -chardev socket,id={name},path={sock},reconnect-ms=1000 \\\n    \
             -device vhost-user-blk-pci,chardev={name},num-queues={q}",
            dev.name,
            vol.name,
            format_size(vol.size),
            vol.backend,
            dev.socket.display(),
            name = format!("nacre-{}", dev.name),
            sock = dev.socket.display(),
            q = dev.queues,
        );
    }
    for sub in state.nvmf.subsystems.values() {
        for l in &sub.listeners {
            if let Some(reason) = d.registry.listener_failure(&sub.nqn, *l) {
                eprintln!(
                    "nacred: NVMe/TCP subsystem {} is NOT listening on {l}: {reason}; retrying \
                     every {} s in the background (`nacre nvmf list` shows its state)",
                    sub.nqn,
                    nacre_dpu::control::registry::listener_retry::RETRY_INTERVAL.as_secs()
                );
                continue;
            }
            eprintln!(
                "nacred: NVMe/TCP subsystem {} ({} namespace(s)) listens on {l}; from a host with nvme-tcp:\n  \
                 nvme connect -t tcp -a {} -s {} -n {}",
                sub.nqn,
                sub.namespaces.len(),
                l.ip(),
                l.port(),
                sub.nqn
            );
        }
        for l in &sub.rdma_listeners {
            if let Some(reason) = d.registry.rdma_listener_failure(&sub.nqn, *l) {
                // One line: a machine without RDMA still serves everything else.
                eprintln!(
                    "nacred: NVMe/RDMA subsystem {} is NOT listening: {reason}; retrying every {} s \
                     in the background (an RDMA device may come up later)",
                    sub.nqn,
                    nacre_dpu::control::registry::listener_retry::RETRY_INTERVAL.as_secs()
                );
                continue;
            }
            eprintln!(
                "nacred: NVMe/RDMA subsystem {} ({} namespace(s)) listens on {l}; from a host with nvme-rdma:\n  \
                 nvme connect -t rdma -a {} -s {} -n {}",
                sub.nqn,
                sub.namespaces.len(),
                l.ip(),
                l.port(),
                sub.nqn
            );
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    /// The endpoint is on by default, on loopback only, at the documented port; `off` and an
    /// explicit address are taken; a typo gets a message that shows the expected form.
    #[test]
    fn metrics_endpoint_defaults_to_loopback_9444() {
        // SAFETY: this test alone in this binary touches the environment.
        unsafe { std::env::remove_var("NACRE_METRICS_LISTEN") };
        let a = Args::try_parse_from(["nacred"]).unwrap();
        let addr = a.metrics_listen.0.expect("on by default");
        assert!(addr.ip().is_loopback(), "{addr}");
        assert_eq!(addr.port(), 9444);
        let a = Args::try_parse_from(["nacred", "--metrics-listen", "off"]).unwrap();
        assert!(a.metrics_listen.0.is_none());
        let a = Args::try_parse_from(["nacred", "--metrics-listen", "127.0.0.1:0"]).unwrap();
        assert_eq!(a.metrics_listen.0, Some("127.0.0.1:0".parse().unwrap()));
        let e = Args::try_parse_from(["nacred", "--metrics-listen", "9444"]).unwrap_err();
        assert!(e.to_string().contains("expected ADDR:PORT"), "{e}");
    }

    #[test]
    fn help_describes_the_daemon() {
        let help = <Args as clap::CommandFactory>::command()
            .render_help()
            .to_string();
        assert!(help.starts_with("nacre's DPU daemon"), "{help}");
    }
}
