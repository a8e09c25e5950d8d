//! nacre-host: the host agent. It lists the disks nacre presents to this host (matched to
//! their volumes and tenants through the DPU), shows the GPUs and their PCIe distance to the
//! DPU, registers GPU memory windows for the zero-copy RDMA path, and runs as a small daemon.
//!
//! One module per subcommand; each has a `run`.

mod agent;
mod channel;
mod cuda;
mod devices;
mod generate_docs;
mod gpus;
mod image;
mod pair;
mod register;
mod sysfs;
mod topology;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

const EXAMPLES: &str = "\
Examples:
  # Pair with the DPU once (see `nacre-host pair --help`), then:
  nacre-host devices                  # disks, which nacre volume and tenant each one is
  nacre-host devices --json
  nacre-host gpus                     # GPUs, BAR1, PCIe distance to the DPU's functions
  nacre-host register-gpu --size 256M # pin a GPU buffer and register it as a peer window
  nacre-host agent                    # the daemon (host/systemd/nacre-host.service)

The DPU is reached over nacred's host channel (TCP, mutual TLS): --dpu ADDR:PORT, or
NACRE_HOST_DPU, or the address `nacre-host pair --dpu` saved in the configuration
directory (/etc/nacre-host, or --config-dir / NACRE_HOST_DIR).";

/// The nacre host agent: which of this host's disks are nacre volumes (of which tenant,
/// encrypted or not, over which path), and GPU memory windows registered with the DPU for
/// GPUDirect Storage.
#[derive(Parser, Debug)]
#[command(name = "nacre-host", version, about, after_help = EXAMPLES)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Args, Debug, Clone)]
pub struct Global {
    /// nacred's host channel, ADDR:PORT [default: the address saved by `pair`].
    #[arg(long, global = true, env = "NACRE_HOST_DPU")]
    pub dpu: Option<String>,

    /// Keys, certificates and the saved DPU address.
    #[arg(
        long,
        global = true,
        env = "NACRE_HOST_DIR",
        default_value = "/etc/nacre-host"
    )]
    pub config_dir: PathBuf,

    /// Where sysfs is (tests point it at recorded trees).
    #[arg(
        long,
        global = true,
        env = "NACRE_HOST_SYSFS",
        default_value = "/sys",
        hide = true
    )]
    pub sysfs: PathBuf,

    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    Devices(devices::Args),
    Gpus(gpus::Args),
    #[command(name = "register-gpu")]
    RegisterGpu(register::RegisterArgs),
    #[command(name = "unregister-gpu")]
    UnregisterGpu(register::UnregisterArgs),
    Pair(pair::Args),
    Agent(agent::Args),
    /// DPU images (BlueField boot streams): build, inspect, verify, extract, flash over rshim.
    #[command(subcommand)]
    Image(image::ImageCmd),
    /// Write the man pages and shell completions (packaging; scripts/package).
    #[command(name = "generate-docs", hide = true)]
    GenerateDocs(generate_docs::Args),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let log = std::env::var("NACRE_HOST_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&log)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let g = cli.global;
    let r = match cli.command {
        Command::Devices(a) => devices::run(&g, a),
        Command::Gpus(a) => gpus::run(&g, a),
        Command::RegisterGpu(a) => register::run_register(&g, a),
        Command::UnregisterGpu(a) => register::run_unregister(&g, a),
        Command::Pair(a) => pair::run(&g, a),
        Command::Agent(a) => agent::run(&g, a),
        Command::Image(cmd) => return ExitCode::from(image::run(cmd, g.json) as u8),
        Command::GenerateDocs(a) => generate_docs::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nacre-host: {}", one_line(&e));
            ExitCode::from(1)
        }
    }
}

/// An error and its causes on one line.
fn one_line(e: &anyhow::Error) -> String {
    let mut s = e.to_string();
    for c in e.chain().skip(1) {
        let c = c.to_string();
        if !s.contains(&c) {
            s.push_str(": ");
            s.push_str(&c);
        }
    }
    s.replace('\n', " ")
}

/// A current-thread runtime for one-shot commands.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}
