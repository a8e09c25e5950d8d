//! nacre-host: the host agent. For now it answers `--help` and `--version`; listing
//! nacre-backed disks and registering GPUs as DMA peers come with their issues.

mod image;

use clap::{Parser, Subcommand};

/// The nacre host agent: lists the disks nacre presents to this host (NVMe and virtio-blk)
/// and registers GPUs as DMA peers for GPUDirect.
///
/// Not yet implemented beyond --help and --version.
#[derive(Parser, Debug)]
#[command(name = "nacre-host", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// DPU images (BlueField boot streams): build, inspect, verify, extract, flash over rshim.
    #[command(subcommand)]
    Image(image::ImageCmd),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Image(cmd)) => std::process::exit(image::run(cmd)),
        None => eprintln!("nacre-host: no commands yet; see --help"),
    }
    Ok(())
}
