//! nacred's command line: its options, their environment variables and defaults. Shared by the
//! daemon (`nacred.rs`) and by `nacre generate-docs`, which writes nacred's man page and shell
//! completions from it without linking the generators into the daemon.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use nacre_dpu::config;
use nacre_dpu::frontend::nvmf_tcp::{ConnLimits, PollPolicy};

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
pub(crate) const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9444";

/// `--metrics-listen`: an address, or `off` (None).
#[derive(Debug, Clone, Copy)]
pub(crate) struct MetricsListen(pub(crate) Option<SocketAddr>);

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
pub(crate) struct Args {
    /// Persistent state: state.json, file volumes, wrapped keys (mode 0700).
    #[arg(long, env = config::ENV_STATE_DIR, default_value = config::DEFAULT_STATE_DIR)]
    pub(crate) state_dir: PathBuf,

    /// Sockets: the RPC socket and vhost-user sockets.
    #[arg(long, env = config::ENV_RUN_DIR, default_value = config::DEFAULT_RUN_DIR)]
    pub(crate) run_dir: PathBuf,

    /// RPC socket path [default: <run-dir>/nacred.sock].
    #[arg(long, env = config::ENV_RPC)]
    pub(crate) rpc: Option<PathBuf>,

    /// Do not create the embedded default volume and device on a fresh state directory.
    #[arg(long)]
    pub(crate) no_default: bool,

    /// Where the embedded default's NVMe/TCP subsystem listens (port 0: any free port).
    #[arg(long, env = "NACRE_NVMF_LISTEN", default_value = "127.0.0.1:4420")]
    pub(crate) nvmf_listen: SocketAddr,

    /// Make the embedded default's NVMe/TCP subsystem admit this one host only, and only once
    /// it authenticates with DH-HMAC-CHAP (needs --default-dhchap-key). Applied at every
    /// start, over what the state holds. Without it the default admits any host that reaches
    /// its listener (loopback only unless --nvmf-listen says otherwise).
    #[arg(
        long,
        env = "NACRE_DEFAULT_HOST",
        value_name = "HOSTNQN",
        requires = "default_dhchap_key"
    )]
    pub(crate) default_host: Option<String>,

    /// The --default-host's DH-HMAC-CHAP secret: a file of mode 0600 holding one
    /// `DHHC-1:XX:...:` secret (`nacre nvmf gen-dhchap-key`); nacred reads it at each start.
    #[arg(
        long,
        env = "NACRE_DEFAULT_DHCHAP_KEY",
        value_name = "FILE",
        requires = "default_host"
    )]
    pub(crate) default_dhchap_key: Option<PathBuf>,

    /// The controller's secret for the --default-host (mode 0600): a host that asks is
    /// answered with it (bidirectional authentication).
    #[arg(
        long,
        env = "NACRE_DEFAULT_DHCHAP_CTRL_KEY",
        value_name = "FILE",
        requires = "default_dhchap_key"
    )]
    pub(crate) default_dhchap_ctrl_key: Option<PathBuf>,

    /// Listen for host agents (nacre-host) on this TCP address, mutual TLS only (see
    /// `nacre cert`); on a BlueField, the tmfifo or OOB address. Default: off.
    #[arg(long, env = "NACRE_HOST_LISTEN")]
    pub(crate) host_listen: Option<SocketAddr>,

    /// The host channel's certificates (`nacre cert init`) [default: <state-dir>/tls].
    #[arg(long, env = "NACRE_HOST_TLS_DIR")]
    pub(crate) host_tls_dir: Option<PathBuf>,

    /// Serve OPI's storage API (opi_api.storage.v1) over gRPC on this address, with server
    /// reflection (docs/opi.md). Without --opi-tls-dir, loopback only. Default: off.
    #[arg(long, env = "NACRE_OPI_LISTEN")]
    pub(crate) opi_listen: Option<SocketAddr>,

    /// Serve OPI over mutual TLS with the certificates `nacre cert init` made in this
    /// directory: clients need a certificate signed by that CA.
    #[arg(long, env = "NACRE_OPI_TLS_DIR")]
    pub(crate) opi_tls_dir: Option<PathBuf>,

    /// The tenant whose KEK wraps the data keys OPI clients hand over for encrypted volumes.
    #[arg(long, env = "NACRE_OPI_TENANT")]
    pub(crate) opi_tenant: Option<String>,

    /// NVMe/TCP: connections one listener serves at once; more are closed on accept.
    #[arg(long, env = "NACRE_NVMF_MAX_CONNECTIONS", default_value_t = ConnLimits::DEFAULT.per_listener)]
    pub(crate) nvmf_max_connections: usize,

    /// NVMe/TCP: connections of one listener not yet past Fabrics Connect (at least 1); a new
    /// one beyond this closes the oldest such connection.
    #[arg(long, env = "NACRE_NVMF_MAX_SETUP_CONNECTIONS", default_value_t = ConnLimits::DEFAULT.setup_per_listener,
          value_parser = at_least_one)]
    pub(crate) nvmf_max_setup_connections: usize,

    /// NVMe/TCP: queues (admin and I/O) one host NQN may hold; a Connect beyond it fails
    /// with Connect Controller Busy.
    #[arg(long, env = "NACRE_NVMF_MAX_CONNECTIONS_PER_HOST", default_value_t = ConnLimits::DEFAULT.per_host)]
    pub(crate) nvmf_max_connections_per_host: usize,

    /// NVMe/TCP: threads serving the target's connections, each many of them through epoll
    /// (busy-polling briefly after work, then sleeping). 0: one per core, at most 4.
    #[arg(long, env = "NACRE_NVMF_REACTORS", default_value_t = 0)]
    pub(crate) nvmf_reactors: usize,

    /// Remote storage over NVMe/TCP: threads serving the initiator's queues (every queue of
    /// every remote controller), each many of them through epoll, sleeping when idle; the
    /// thread that submits a command sends it. Reads of encrypted volumes are decrypted on
    /// these threads: on a DPU with many cores and fast shelves, give more. 0: one per core,
    /// at most 4.
    #[arg(long, env = "NACRE_FABRIC_REACTORS", default_value_t = 0)]
    pub(crate) fabric_reactors: usize,

    /// NVMe/TCP: when a reactor busy-polls after work rather than sleeping in epoll_wait.
    /// `adaptive`: poll (up to 50 µs) for hosts that wait on each reply (QD1, QD2), sleep at
    /// once for hosts that keep 8 or more commands in flight, whose throughput a wake-up
    /// does not cost; `always`: poll at any depth (lowest latency, a core kept busy while
    /// hosts are); `off`: never poll. `nacre nvmf stats` shows what the reactors did.
    /// PCIe controllers (vfio-user) follow the same policy: `adaptive` pauses 4 µs between
    /// passes while a host leaves 8 or more completions unconsumed, `always` spins while
    /// there is work, `off` pauses after every pass; under `adaptive` and `always` an idle
    /// controller's poller spins 50 µs after its last work, then yields, then sleeps in
    /// growing steps up to 1 ms. `nacre nvmf stats` shows each poller's busy time.
    #[arg(long, env = "NACRE_NVMF_POLL", value_enum, default_value_t = PollPolicy::Adaptive)]
    pub(crate) nvmf_poll: PollPolicy,

    /// Serve Prometheus metrics on http://ADDR/metrics (port 0: any free one; `nacre rpc
    /// metrics_endpoint` tells which), or `off`. Keep it on loopback. When the default port is
    /// taken (a second nacred on this machine) nacred warns and runs without the endpoint; an
    /// address given explicitly must bind.
    #[arg(long, env = "NACRE_METRICS_LISTEN", default_value = DEFAULT_METRICS_LISTEN,
          value_parser = parse_metrics_listen)]
    pub(crate) metrics_listen: MetricsListen,

    /// Serve volumes without the QoS and statistics layer (limits are kept, not enforced):
    /// the baseline of scripts/bench-qos.
    #[arg(long)]
    pub(crate) no_qos: bool,

    /// Log filter (tracing's EnvFilter syntax), e.g. info, debug, nacre_dpu=trace.
    #[arg(long, env = "NACRE_LOG", default_value = "info")]
    pub(crate) log: String,
}
