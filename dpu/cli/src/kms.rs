//! `nacre kms ...`: the KMIP key managers KMS tenants' envelope keys are encrypted by.

use std::path::PathBuf;

use anyhow::Result;
use clap::Subcommand;
use serde_json::{json, Value};

use super::Ctx;
use nacre_shared::table::Table;

#[derive(Subcommand, Debug)]
pub enum KmsCmd {
    /// Configure a key manager that speaks KMIP (1.2 or later) over mutual TLS.
    #[command(
        after_help = "The server's certificate must chain to --ca (no other CA is trusted) and name HOST.\nnacred reads the three files at each connection, so they can be renewed in place.\nThe key must allow Encrypt and Decrypt with AES-CBC/PKCS5 for nacred's client identity.\n\nExamples:\n  nacre kms add vault --address kms.example.com:5696 --ca /etc/nacre/kms/ca.pem \\\n      --cert /etc/nacre/kms/client.pem --key /etc/nacre/kms/client.key\n  nacre tenant create acme --kms vault --kms-key-id 3f1c9a"
    )]
    Add {
        /// A name for it (what `tenant create --kms` refers to).
        name: String,
        /// HOST:PORT of the KMIP server (port 5696 by convention).
        #[arg(long)]
        address: String,
        /// The CA certificate (PEM) the server's certificate must chain to.
        #[arg(long)]
        ca: PathBuf,
        /// nacred's client certificate (PEM, with the clientAuth extended key usage).
        #[arg(long)]
        cert: PathBuf,
        /// The client certificate's private key (PEM; keep it mode 0600).
        #[arg(long)]
        key: PathBuf,
        /// Bound on one KMIP request, connect to answer, in milliseconds [default 5000].
        #[arg(long)]
        timeout_ms: Option<u64>,
    },
    /// List the configured key managers and the tenants each holds the KEK of.
    #[command(after_help = "Examples:\n  nacre kms list")]
    List,
    /// Remove a key manager (refused while a tenant's KEK is held by it).
    #[command(after_help = "Examples:\n  nacre kms delete vault")]
    Delete {
        /// The key manager.
        name: String,
    },
}

fn absolute(p: &std::path::Path) -> Result<String> {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()?.join(p)
    };
    Ok(abs.display().to_string())
}

pub fn run(ctx: &mut Ctx, cmd: KmsCmd) -> Result<()> {
    match cmd {
        KmsCmd::Add {
            name,
            address,
            ca,
            cert,
            key,
            timeout_ms,
        } => {
            let mut p = json!({
                "name": name,
                "address": address,
                "ca": absolute(&ca)?,
                "cert": absolute(&cert)?,
                "key": absolute(&key)?,
            });
            if let Some(t) = timeout_ms {
                p["timeout_ms"] = json!(t);
            }
            let v = ctx.call("kms_add", p)?;
            ctx.print(&v, |v| {
                println!(
                    "added KMS {name} at {} (timeout {} ms)",
                    v["address"].as_str().unwrap_or(""),
                    v["timeout_ms"]
                )
            });
        }
        KmsCmd::List => {
            let v = ctx.call("kms_list", Value::Null)?;
            ctx.print(&v, |v| {
                let mut t = Table::new(&["NAME", "ADDRESS", "TIMEOUT MS", "TENANTS"]);
                for x in v.as_array().into_iter().flatten() {
                    t.row(vec![
                        x["name"].as_str().unwrap_or("").into(),
                        x["address"].as_str().unwrap_or("").into(),
                        x["timeout_ms"].to_string(),
                        x["tenants"]
                            .as_array()
                            .map(|a| {
                                a.iter()
                                    .filter_map(Value::as_str)
                                    .collect::<Vec<_>>()
                                    .join(",")
                            })
                            .unwrap_or_default(),
                    ]);
                }
                t.print();
            });
        }
        KmsCmd::Delete { name } => {
            let v = ctx.call("kms_delete", json!({ "name": name }))?;
            ctx.print(&v, |_| println!("deleted KMS {name}"));
        }
    }
    Ok(())
}
