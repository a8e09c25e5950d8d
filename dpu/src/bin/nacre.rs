//! nacre: the operator CLI for nacred.

use clap::Parser;

fn main() {
    let cli = nacre_dpu::cli::Cli::parse();
    if let Err(e) = nacre_dpu::cli::run(cli) {
        eprintln!("nacre: error: {e:#}");
        std::process::exit(1);
    }
}
