//! `nacre-host pair`: this host's credentials for the host channel.
//!
//! Step 1 (host): a fresh key and a certificate signing request; the key never leaves the
//! host. Step 2 (DPU): `nacre cert issue` signs it for a host name and tenant. Step 3
//! (host): install the certificate and the DPU's CA, and save the DPU's address.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use nacre_shared::channel::{self, files};

use crate::Global;

const EXAMPLES: &str = "\
Examples:
  # 1. On the host: make a key and a signing request (in /etc/nacre-host).
  nacre-host pair --host node17
  # 2. On the DPU: sign it for a tenant.
  nacre cert issue --csr node17.csr --host node17 --tenant acme --out node17.pem
  # 3. On the host: install the certificate and the DPU's CA; save its address and test.
  nacre-host pair --cert node17.pem --ca ca.pem --dpu 192.168.100.2:4424";

/// Make this host's key and certificate request, or install the certificate the DPU
/// issued.
#[derive(clap::Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct Args {
    /// Step 1: the name to put in the request [default: the hostname].
    #[arg(long, conflicts_with_all = ["cert", "ca"])]
    host: Option<String>,
    /// Step 1: replace an existing key.
    #[arg(long)]
    new_key: bool,
    /// Step 3: the certificate `nacre cert issue` wrote.
    #[arg(long, requires = "ca")]
    cert: Option<PathBuf>,
    /// Step 3: the DPU's CA certificate (ca.pem from `nacre cert init`).
    #[arg(long, requires = "cert")]
    ca: Option<PathBuf>,
}

fn read(p: &Path) -> Result<String> {
    std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
}

pub fn run(g: &Global, a: Args) -> Result<()> {
    let dir = &g.config_dir;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if let (Some(cert), Some(ca)) = (a.cert, a.ca) {
        let cert = read(&cert)?;
        let ca = read(&ca)?;
        // Check the pieces fit before installing them: the key, the certificate, the CA.
        let key = zeroize::Zeroizing::new(read(&dir.join(files::HOST_KEY)).context(
            "no host key here: run step 1 (nacre-host pair --host NAME) on this host first",
        )?);
        channel::client_config(&ca, &cert, &key)?;
        files::write(&dir.join(files::HOST_CERT), &cert, false)?;
        files::write(&dir.join(files::CA_CERT), &ca, false)?;
        if let Some(dpu) = &g.dpu {
            files::write(&dir.join(crate::channel::DPU_FILE), dpu, false)?;
        }
        println!(
            "installed the host certificate and the DPU's CA in {}",
            dir.display()
        );
        if crate::channel::dpu_addr(g).is_some() {
            let who = crate::runtime()?.block_on(async {
                let mut c = crate::channel::connect(g).await?;
                let w: nacre_shared::api::host::WhoAmI =
                    crate::channel::call(&mut c, "host_whoami", serde_json::Value::Null).await?;
                c.shutdown().await;
                anyhow::Ok(w)
            })?;
            println!(
                "nacred knows this host as {} (tenant {})",
                who.host.unwrap_or_default(),
                who.tenant.unwrap_or_default()
            );
        }
        return Ok(());
    }
    let host = match a.host {
        Some(h) => h,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .context("cannot read the hostname; give --host")?,
    };
    nacre_shared::api::validate_name("host", &host).map_err(anyhow::Error::msg)?;
    let key_path = dir.join(files::HOST_KEY);
    if key_path.exists() && !a.new_key {
        anyhow::bail!(
            "{} exists (this host is paired or pairing); --new-key replaces it",
            key_path.display()
        );
    }
    let (csr, key) = channel::make_host_request(&host)?;
    files::write(&key_path, &key, true)?;
    let csr_path = dir.join(files::HOST_CSR);
    files::write(&csr_path, &csr, false)?;
    println!(
        "key in {}, request in {}\nOn the DPU: nacre cert issue --csr {host}.csr --host {host} --tenant TENANT --out {host}.pem",
        key_path.display(),
        csr_path.display()
    );
    Ok(())
}
