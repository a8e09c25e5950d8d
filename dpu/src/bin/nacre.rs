//! nacre: the operator CLI for nacred.

use clap::error::ErrorKind;
use clap::Parser;

fn main() {
    let cli = match nacre_dpu::cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            e.exit()
        }
        Err(e) => {
            // A malformed command line: one line, exit status 2.
            eprintln!("{}", nacre_dpu::cli::usage_error_line(&e));
            std::process::exit(2);
        }
    };
    if let Err(e) = nacre_dpu::cli::run(cli) {
        eprintln!("nacre: error: {}", one_line(&e));
        std::process::exit(1);
    }
}

/// The error and its causes joined with ": ", leaving out a cause whose text the message
/// before it already carries (an I/O error quoted in its context's message would otherwise
/// print twice).
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out.replace('\n', " ")
}
