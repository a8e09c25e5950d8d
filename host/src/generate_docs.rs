//! `nacre-host generate-docs --out DIR` (hidden): nacre-host's man pages (one per command and
//! subcommand, section 1) and its bash, zsh and fish completions, rendered from its clap
//! definition by clap_mangen and clap_complete; `scripts/package` installs them. Layout of DIR:
//! `man/nacre-host*.1`, `completions/{bash/nacre-host, zsh/_nacre-host, fish/nacre-host.fish}`.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::CommandFactory;
use clap_complete::Shell;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Directory to write man/ and completions/ into.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    let cmd = crate::Cli::command();
    let name = cmd.get_name().to_string();
    let man = a.out.join("man");
    fs::create_dir_all(&man).with_context(|| format!("cannot create {}", man.display()))?;
    // build() gives every subcommand its display name ("nacre-host-image-build"), the page's name
    let mut built = cmd.clone().disable_help_subcommand(true);
    built.build();
    pages(&built, &man)?;
    for (shell, dir, file) in [
        (Shell::Bash, "bash", name.clone()),
        (Shell::Zsh, "zsh", format!("_{name}")),
        (Shell::Fish, "fish", format!("{name}.fish")),
    ] {
        let d = a.out.join("completions").join(dir);
        fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
        let path = d.join(file);
        let mut f =
            fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        clap_complete::generate(shell, &mut cmd.clone(), &name, &mut f);
    }
    Ok(())
}

fn pages(cmd: &clap::Command, dir: &Path) -> Result<()> {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        pages(sub, dir)?;
    }
    let page = clap_mangen::Man::new(cmd.clone()).section("1");
    page.generate_to(dir)
        .with_context(|| format!("cannot write {}", dir.join(page.get_filename()).display()))?;
    Ok(())
}
