//! `nacre volume ...`

use anyhow::Result;
use clap::{Args, Subcommand};
use nacre_shared::api::volume::BackendKind;
use nacre_shared::size::{format_size, parse_size};
use serde_json::{json, Value};

use super::Ctx;
use nacre_shared::table::Table;

#[derive(Subcommand, Debug)]
pub enum VolumeCmd {
    /// Create a volume.
    #[command(
        after_help = "Examples:\n  nacre volume create data --size 10G\n  nacre volume create fast --size 2G --backend ram --block-size 512\n  nacre volume create ext --size 100G --path /srv/nacre/ext.img\n  # serve a file kept by `volume delete` (without --delete-data), at its own size\n  nacre volume create data --adopt-existing"
    )]
    Create(CreateArgs),
    /// List volumes: state (online, or failed and why), size, backend, who exports them.
    #[command(
        after_help = "Examples:\n  nacre volume list\n  nacre volume list data\n  nacre --json volume list"
    )]
    List {
        /// Only this volume.
        name: Option<String>,
    },
    /// Delete a volume that no device exports.
    #[command(
        after_help = "Examples:\n  nacre volume delete scratch\n  # also remove the backing file (the data is gone)\n  nacre volume delete old --delete-data"
    )]
    Delete {
        /// The volume.
        name: String,
        /// Also remove the backing file of a file volume.
        #[arg(long)]
        delete_data: bool,
    },
    /// Grow (or, when unexported, shrink) a volume.
    #[command(after_help = "Examples:\n  nacre volume resize data --size 20G")]
    Resize {
        /// The volume.
        name: String,
        /// New size, e.g. 20G.
        #[arg(long, value_parser = size_arg, allow_hyphen_values = true)]
        size: u64,
    },
    /// Destroy an encrypted volume's data key: its data becomes permanently unreadable.
    #[command(
        name = "crypto-erase",
        after_help = "Examples:\n  nacre volume crypto-erase secret --yes"
    )]
    CryptoErase(super::tenant::CryptoEraseArgs),
    /// Write an encrypted volume's plaintext data key to a new 0600 file (disaster recovery).
    #[command(
        name = "export-key",
        after_help = "Examples:\n  nacre volume export-key secret --out /root/secret.key --yes-export-plaintext-key"
    )]
    ExportKey(super::tenant::ExportKeyArgs),
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Volume name: letters, digits, '_', '-', '.'.
    pub name: String,
    /// Size with an optional binary suffix: 512M, 1G, 2T (with --adopt-existing: the file's
    /// size when left out).
    #[arg(
        long,
        value_parser = size_arg,
        required_unless_present = "adopt_existing",
        allow_hyphen_values = true
    )]
    pub size: Option<u64>,
    /// Logical block size in bytes: 512 or 4096.
    #[arg(long, default_value_t = 4096, value_parser = block_size_arg)]
    pub block_size: u32,
    /// Where the blocks live: file (sparse file, default), ram (lost on exit), null (benchmarks).
    #[arg(long, default_value = "file", value_parser = backend_arg)]
    pub backend: BackendKind,
    /// Backing file for a file volume [default: <state-dir>/volumes/NAME.img].
    #[arg(long)]
    pub path: Option<String>,
    /// Owning tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Encrypt with a per-volume AES-XTS key wrapped by the tenant's KEK.
    #[arg(long, requires = "tenant")]
    pub encrypt: bool,
    /// Serve the data of a backing file that already exists (e.g. kept by `volume delete`
    /// without --delete-data). Without it an existing file is refused.
    #[arg(long)]
    pub adopt_existing: bool,
}

pub fn size_arg(s: &str) -> Result<u64, String> {
    if s.trim_start().starts_with('-') {
        return Err(format!("a size cannot be negative (got {s})"));
    }
    parse_size(s).map_err(|e| e.to_string())
}

fn block_size_arg(s: &str) -> Result<u32, String> {
    match s {
        "512" => Ok(512),
        "4096" => Ok(4096),
        _ => Err(format!("block size must be 512 or 4096 (got {s})")),
    }
}

fn backend_arg(s: &str) -> Result<BackendKind, String> {
    match s {
        "file" => Ok(BackendKind::File),
        "ram" => Ok(BackendKind::Ram),
        "null" => Ok(BackendKind::Null),
        _ => Err(format!("unknown backend {s:?}: use file, ram or null")),
    }
}

pub fn run(ctx: &mut Ctx, cmd: VolumeCmd) -> Result<()> {
    match cmd {
        VolumeCmd::CryptoErase(a) => return super::tenant::crypto_erase(ctx, a),
        VolumeCmd::ExportKey(a) => return super::tenant::export_key(ctx, a),
        VolumeCmd::Create(a) => {
            let mut p = json!({
                "name": a.name, "size": a.size.unwrap_or(0), "block_size": a.block_size,
                "backend": a.backend,
            });
            if a.adopt_existing {
                p["adopt_existing"] = json!(true);
            }
            if let Some(path) = a.path {
                p["path"] = json!(path);
            }
            if let Some(t) = a.tenant {
                p["tenant"] = json!(t);
            }
            if a.encrypt {
                p["encrypt"] = json!(true);
            }
            let v = ctx.call("volume_create", p)?;
            ctx.print(&v, |v| {
                println!(
                    "created volume {} ({}, {}, serial {})",
                    v["name"].as_str().unwrap_or(""),
                    format_size(v["size"].as_u64().unwrap_or(0)),
                    v["backend"].as_str().unwrap_or(""),
                    v["serial"].as_str().unwrap_or("")
                )
            });
        }
        VolumeCmd::List { name } => {
            let p = name.map(|n| json!({ "name": n })).unwrap_or(Value::Null);
            let v = ctx.call("volume_list", p)?;
            ctx.print(&v, print_volumes);
        }
        VolumeCmd::Delete { name, delete_data } => {
            let v = ctx.call(
                "volume_delete",
                json!({"name": name, "delete_data": delete_data}),
            )?;
            ctx.print(&v, |_| println!("deleted volume {name}"));
        }
        VolumeCmd::Resize { name, size } => {
            let v = ctx.call("volume_resize", json!({"name": name, "size": size}))?;
            ctx.print(&v, |v| {
                println!(
                    "volume {name} is now {}",
                    format_size(v["size"].as_u64().unwrap_or(0))
                )
            });
        }
    }
    Ok(())
}

fn print_volumes(v: &Value) {
    let mut t = Table::new(&[
        "NAME",
        "STATE",
        "SIZE",
        "BLOCK",
        "BACKEND",
        "TENANT",
        "ENCRYPTED",
        "SERIAL",
        "EXPORTED BY",
    ]);
    for vol in v.as_array().into_iter().flatten() {
        let s = |k: &str| vol[k].as_str().unwrap_or("").to_string();
        let state = match vol["reason"].as_str() {
            Some(r) => format!("{} ({r})", s("state")),
            None => s("state"),
        };
        t.row(vec![
            s("name"),
            state,
            format_size(vol["size"].as_u64().unwrap_or(0)),
            vol["block_size"].to_string(),
            s("backend"),
            vol["tenant"].as_str().unwrap_or("-").to_string(),
            if vol["encrypted"].as_bool().unwrap_or(false) {
                "yes"
            } else {
                "no"
            }
            .into(),
            s("serial"),
            vol["exported_by"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "-".into()),
        ]);
    }
    t.print();
}
