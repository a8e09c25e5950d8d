//! nacre-host: the host agent. For now it answers `--help` and `--version`; listing
//! nacre-backed disks and registering GPUs as DMA peers come with their issues.

use clap::Parser;

/// The nacre host agent: lists the disks nacre presents to this host (NVMe and virtio-blk)
/// and registers GPUs as DMA peers for GPUDirect.
///
/// Not yet implemented beyond --help and --version.
#[derive(Parser, Debug)]
#[command(name = "nacre-host", version, about, long_about = None)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    eprintln!("nacre-host: no commands yet; see --help");
    Ok(())
}
