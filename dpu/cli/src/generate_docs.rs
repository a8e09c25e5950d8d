//! `nacre generate-docs --out DIR` (hidden): the man pages and the bash, zsh and fish
//! completions of `nacre` and of `nacred` (whose command line, `dpu/src/bin/nacred/args.rs`,
//! is compiled into this binary for that), rendered from their clap definitions by clap_mangen
//! and clap_complete. `scripts/package` runs it and installs what it writes. It lives in the
//! CLI, not in nacred, so the daemon links neither generator.
//!
//! Layout of DIR: `man/<page>.<section>` (one page per command and subcommand, e.g.
//! `nacre-volume-create.1`; nacred's in section 8, the daemons' section), and
//! `completions/{bash/NAME, zsh/_NAME, fish/NAME.fish}`.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Arg, CommandFactory};
use clap_complete::Shell;

/// The hidden subcommand's name.
pub(crate) const NAME: &str = "generate-docs";

/// `generate-docs --out DIR`, hidden from help and completions.
pub(crate) fn command() -> clap::Command {
    clap::Command::new(NAME)
        .hide(true)
        .about("Write nacre's and nacred's man pages and shell completions (packaging)")
        .arg(
            Arg::new("out")
                .long("out")
                .required(true)
                .value_name("DIR")
                .value_parser(clap::value_parser!(PathBuf))
                .help("Directory to write man/ and completions/ into"),
        )
}

pub(crate) fn run(out: &Path) -> Result<()> {
    write(nacre_cli::Cli::command(), "1", out)?;
    write(crate::nacred_args::Args::command(), "8", out)
}

/// The pages of `cmd` and its subcommands (hidden ones left out) in `section`, and its
/// completions for each shell.
fn write(cmd: clap::Command, section: &str, out: &Path) -> Result<()> {
    let name = cmd.get_name().to_string();
    let man = out.join("man");
    fs::create_dir_all(&man).with_context(|| format!("cannot create {}", man.display()))?;
    // build() gives every subcommand its display name ("nacre-volume-create"), the page's name
    let mut built = cmd.clone().disable_help_subcommand(true);
    built.build();
    pages(&built, section, &man)?;
    for (shell, dir, file) in [
        (Shell::Bash, "bash", name.clone()),
        (Shell::Zsh, "zsh", format!("_{name}")),
        (Shell::Fish, "fish", format!("{name}.fish")),
    ] {
        let d = out.join("completions").join(dir);
        fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
        let path = d.join(file);
        let mut f =
            fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        clap_complete::generate(shell, &mut cmd.clone(), &name, &mut f);
    }
    Ok(())
}

fn pages(cmd: &clap::Command, section: &str, dir: &Path) -> Result<()> {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        pages(sub, section, dir)?;
    }
    let page = clap_mangen::Man::new(cmd.clone()).section(section);
    page.generate_to(dir)
        .with_context(|| format!("cannot write {}", dir.join(page.get_filename()).display()))?;
    Ok(())
}
