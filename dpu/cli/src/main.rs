//! nacre: the operator CLI for nacred.

mod generate_docs;
// nacred's command line, compiled here as well for its man page and completions only.
#[path = "../../src/bin/nacred/args.rs"]
#[allow(dead_code)] // only its clap definition is read here (nacred's man page, completions)
mod nacred_args;

use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{CommandFactory, FromArgMatches};

/// What the command line asks for.
enum Request {
    Run(Box<nacre_cli::Cli>),
    GenerateDocs(PathBuf),
}

fn parse() -> Result<Request, clap::Error> {
    let m = nacre_cli::Cli::command()
        .subcommand(generate_docs::command())
        .try_get_matches()?;
    match m.subcommand() {
        Some((generate_docs::NAME, sub)) => Ok(Request::GenerateDocs(
            sub.get_one::<PathBuf>("out")
                .cloned()
                .expect("clap requires --out"),
        )),
        _ => nacre_cli::Cli::from_arg_matches(&m).map(|c| Request::Run(Box::new(c))),
    }
}

fn main() {
    let result = match parse() {
        Ok(Request::Run(cli)) => nacre_cli::run(*cli),
        Ok(Request::GenerateDocs(out)) => generate_docs::run(&out),
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            e.exit()
        }
        Err(e) => {
            // A malformed command line: one line, exit status 2.
            eprintln!("{}", nacre_cli::usage_error_line(&e));
            std::process::exit(2);
        }
    };
    if let Err(e) = result {
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
