//! nacred: the nacre DPU daemon.

#[path = "nacred/args.rs"]
mod args;

use std::io::IsTerminal;
use std::net::SocketAddr;

use anyhow::Context;
use args::{Args, MetricsListen, DEFAULT_METRICS_LISTEN};
use clap::Parser;
use nacre_dpu::config;
use nacre_dpu::control::host_channel::HostListener;
use nacre_dpu::control::opi::{OpiConfig, OpiServer};
use nacre_dpu::control::{server::RpcServer, Daemon, DaemonConfig, DataPathConfig};
use nacre_dpu::frontend::nvmf_tcp::{self, ConnLimits};
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
/// (`fabric-bench`, docs/benchmarks.md); the target alone, whose buffers are pooled, did not move.
///
/// Wrapped so that a KMIP exchange (whose TLS library keeps decrypted records, a tenant's
/// key among them, in buffers of its own) leaves no key bytes in freed memory: see
/// `nacre_dpu::crypto::keys::ScrubFrees`.
#[global_allocator]
static GLOBAL: nacre_dpu::crypto::keys::ScrubbingAllocator<mimalloc::MiMalloc> =
    nacre_dpu::crypto::keys::ScrubbingAllocator(mimalloc::MiMalloc);

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
    let (daemon, existed) = Daemon::open(DaemonConfig {
        state_dir: args.state_dir.clone(),
        run_dir: args.run_dir.clone(),
        data_path: DataPathConfig {
            nvmf: nvmf_tcp::TargetConfig {
                reactors: args.nvmf_reactors,
                poll: args.nvmf_poll,
                conn_limits: ConnLimits {
                    per_listener: args.nvmf_max_connections,
                    setup_per_listener: args.nvmf_max_setup_connections,
                    per_host: args.nvmf_max_connections_per_host,
                },
            },
            fabric_reactors: args.fabric_reactors,
            qos: !args.no_qos,
        },
    })?;
    let rpc_path = args
        .rpc
        .clone()
        .unwrap_or_else(|| args.run_dir.join(config::RPC_SOCKET_NAME));
    if !existed && !args.no_default {
        embedded_default(&daemon, args.nvmf_listen)
            .context("cannot set up the embedded default")?;
    }
    if let (Some(host), Some(key)) = (&args.default_host, &args.default_dhchap_key) {
        require_default_auth(&daemon, host, key, args.default_dhchap_ctrl_key.as_deref())
            .context("--default-host")?;
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
        transport: None,
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

/// `--default-host`: the embedded default's subsystem admits that host only, once it has
/// authenticated (DH-HMAC-CHAP, NVMe Base 2.0 §8.13). Applied at every start, over what the
/// state holds, so that the switch (nacred.env) decides; the key file is checked (mode 0600,
/// a valid secret) before any host is turned away.
fn require_default_auth(
    d: &Daemon,
    host: &str,
    key: &std::path::Path,
    ctrl_key: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let abs =
        |p: &std::path::Path| std::path::absolute(p).with_context(|| format!("{}", p.display()));
    let mut params = json!({"nqn": DEFAULT_NQN, "host": host, "dhchap_key": abs(key)?});
    if let Some(c) = ctrl_key {
        params["dhchap_ctrlr_key"] = json!(abs(c)?);
    }
    d.call("nvmf_subsystem_add_host", params)?;
    d.call(
        "nvmf_subsystem_allow_any_host",
        json!({"nqn": DEFAULT_NQN, "allow_any_host": false}),
    )?;
    info!(
        host,
        bidirectional = ctrl_key.is_some(),
        "embedded default: admits only this host, once it authenticates (DH-HMAC-CHAP)"
    );
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
