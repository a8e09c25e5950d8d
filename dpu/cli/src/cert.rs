//! `nacre cert ...`: the certificates of the host channel (see
//! `nacre_dpu::control::host_channel`). These work on files only, never through nacred.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Subcommand;
use nacre_shared::channel::{self, files, HostIdentity, PemPair};

const INIT_HELP: &str = "Examples:
  nacre cert init                                   # CA + server cert in /var/lib/nacre/tls
  nacre cert init --dir /tmp/nacre/tls --name 192.0.2.1

Then start nacred with --host-listen ADDR (e.g. the tmfifo address 192.168.100.2:4424).
An existing CA is kept (so issued host certificates stay valid); the server certificate is
made anew.";

const ISSUE_HELP: &str = "Examples:
  # On the host:   nacre-host pair --host node17          (writes host.csr)
  # On the DPU:
  nacre cert issue --csr node17.csr --host node17 --tenant acme --out node17.pem
  # Back on the host: nacre-host pair --cert node17.pem --ca ca.pem

The host's name and tenant come from these options, never from the request: a host
certificate may call only the host methods, for its own tenant.";

#[derive(Subcommand, Debug)]
pub enum CertCmd {
    /// Make this DPU's CA (if there is none) and nacred's server certificate.
    #[command(after_help = INIT_HELP)]
    Init {
        /// Directory of ca.pem, ca.key, server.pem, server.key [default: <state-dir>/tls].
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Extra names (DNS or IP) for the server certificate; hosts always check "nacred".
        #[arg(long = "name")]
        names: Vec<String>,
    },
    /// Sign a host's certificate request (from `nacre-host pair`) for one tenant.
    #[command(after_help = ISSUE_HELP)]
    Issue {
        /// The request, as written by `nacre-host pair`.
        #[arg(long)]
        csr: PathBuf,
        /// The host's name (becomes its identity on the channel).
        #[arg(long)]
        host: String,
        /// The tenant the host works for.
        #[arg(long)]
        tenant: String,
        /// Validity in days.
        #[arg(long, default_value_t = channel::DEFAULT_VALIDITY_DAYS)]
        days: i64,
        /// Where to write the certificate.
        #[arg(long)]
        out: PathBuf,
        /// The CA's directory [default: <state-dir>/tls].
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

fn default_dir() -> PathBuf {
    std::env::var_os(nacre_dpu::config::ENV_STATE_DIR)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(nacre_dpu::config::DEFAULT_STATE_DIR))
        .join("tls")
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

fn load_ca(dir: &Path) -> Result<PemPair> {
    Ok(PemPair {
        cert: read(&dir.join(files::CA_CERT)).context("no CA here: run `nacre cert init` first")?,
        key: read(&dir.join(files::CA_KEY))?.into(),
    })
}

pub fn run(cmd: CertCmd) -> Result<()> {
    match cmd {
        CertCmd::Init { dir, names } => {
            let dir = dir.unwrap_or_else(default_dir);
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            let ca = if dir.join(files::CA_KEY).exists() {
                load_ca(&dir)?
            } else {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|s| s.trim().to_string())
                    .unwrap_or_else(|_| "dpu".into());
                let ca = channel::make_ca(&host)?;
                files::write(&dir.join(files::CA_KEY), &ca.key, true)?;
                files::write(&dir.join(files::CA_CERT), &ca.cert, false)?;
                ca
            };
            let server = channel::make_server_cert(&ca, &names)?;
            files::write(&dir.join(files::SERVER_KEY), &server.key, true)?;
            files::write(&dir.join(files::SERVER_CERT), &server.cert, false)?;
            println!(
                "CA and server certificate in {}; give hosts {}",
                dir.display(),
                dir.join(files::CA_CERT).display()
            );
            Ok(())
        }
        CertCmd::Issue {
            csr,
            host,
            tenant,
            days,
            out,
            dir,
        } => {
            if !(1..=3650).contains(&days) {
                anyhow::bail!("--days must be 1 to 3650 (got {days})");
            }
            let ca = load_ca(&dir.unwrap_or_else(default_dir))?;
            let now = time::OffsetDateTime::now_utc() - time::Duration::minutes(5);
            let pem = channel::issue_host_cert(
                &ca,
                &read(&csr)?,
                &HostIdentity {
                    host: host.clone(),
                    tenant: tenant.clone(),
                },
                now,
                days,
            )?;
            files::write(&out, &pem, false)?;
            println!(
                "host {host} (tenant {tenant}) certificate in {}, valid {days} days",
                out.display()
            );
            Ok(())
        }
    }
}
