//! `nacre`, the operator CLI. It only speaks nacred's JSON-RPC; it never touches data.
//!
//! One module per object family builds requests and prints results; `--json` prints the raw
//! result for scripts. Errors are one line on stderr and exit status 1 (2 for usage errors,
//! from clap).

pub mod cert;
pub mod kms;
pub mod nvmf;
pub mod peer;
pub mod qos;
pub mod remote;
pub mod stats;
pub mod tenant;
pub mod top;
pub mod vhost;
pub mod volume;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use nacre_shared::rpc::Client;
use serde_json::Value;

const EXAMPLES: &str = "\
Examples:
  nacre volume create data --size 10G                 # sparse file in the state dir
  nacre volume create scratch --size 1G --backend ram --block-size 512
  nacre volume list
  nacre vhost-blk create vm1-disk --volume data --queues 4
  nacre vhost-blk list --json
  nacre rpc rpc_get_methods                           # any method, raw JSON params
  nacre rpc volume_list '{\"name\": \"data\"}'

The RPC socket is <run-dir>/nacred.sock (default /run/nacre/nacred.sock); point nacre at
another nacred with --rpc PATH or NACRE_RPC.";

/// Operate nacred: volumes, vhost-user-blk devices, NVMe-oF subsystems, tenants and keys.
#[derive(Parser, Debug)]
#[command(name = "nacre", version, after_help = EXAMPLES)]
pub struct Cli {
    /// nacred's RPC socket [default: $NACRE_RUN_DIR/nacred.sock or /run/nacre/nacred.sock].
    #[arg(long, global = true, env = "NACRE_RPC")]
    pub rpc: Option<PathBuf>,

    /// Print raw JSON results instead of tables.
    #[arg(long, global = true)]
    pub json: bool,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Volumes: named block devices (file, ram or null backends).
    #[command(
        subcommand,
        after_help = "Examples:\n  nacre volume create data --size 10G\n  nacre volume list\n  nacre volume create --help"
    )]
    Volume(volume::VolumeCmd),
    /// virtio-blk devices: serve a volume to a VM or any vhost-user client, or as a
    /// virtio-blk PCI function over vfio-user (--transport vfio-user).
    #[command(
        subcommand,
        name = "vhost-blk",
        after_help = "Examples:\n  nacre vhost-blk create vm1 --volume data\n  nacre vhost-blk list"
    )]
    VhostBlk(vhost::VhostBlkCmd),
    /// NVMe-oF/TCP subsystems: namespaces, listeners, allowed hosts.
    #[command(
        subcommand,
        after_help = "Examples:\n  nacre nvmf create nqn.2024-01.io.nacre:data --allow-any-host\n  nacre nvmf add-ns nqn.2024-01.io.nacre:data --volume data\n  nacre nvmf add-listener nqn.2024-01.io.nacre:data --address 127.0.0.1 --port 4420\n  nacre nvmf list"
    )]
    Nvmf(nvmf::NvmfCmd),
    /// Tenants: key-encryption keys, encryption policy, KEK rotation.
    #[command(
        subcommand,
        after_help = "Examples:\n  nacre tenant create acme --key-file /etc/nacre/acme.kek\n  nacre volume create secret --size 10G --tenant acme --encrypt\n  nacre tenant list"
    )]
    Tenant(tenant::TenantCmd),
    /// KMIP key managers that hold KMS tenants' KEKs (mutual TLS, pinned CA).
    #[command(
        subcommand,
        after_help = "Examples:\n  nacre kms add vault --address kms.example.com:5696 --ca ca.pem --cert client.pem --key client.key\n  nacre tenant create acme --kms vault --kms-key-id 3f1c9a\n  nacre kms list"
    )]
    Kms(kms::KmsCmd),
    /// Remote NVMe-oF controllers (storage shelves) and volumes on their namespaces.
    #[command(
        subcommand,
        after_help = "Examples:\n  nacre remote attach shelf1 --address 192.0.2.10 --port 4420 --subnqn nqn.2024-01.io.example:shelf\n  nacre remote volume-create big --extent shelf1:1\n  nacre remote list"
    )]
    Remote(remote::RemoteCmd),
    /// QoS limits of volumes, tenants and the daemon: IOPS and bytes/s, bursts, weights.
    #[command(
        subcommand,
        after_help = "Examples:\n  nacre qos set --volume db --iops 2000\n  nacre qos set --tenant acme --write-bps 100M --burst-ms 500\n  nacre qos show\n  nacre qos clear --volume db"
    )]
    Qos(qos::QosCmd),
    /// I/O counters, queue depth, throttling and latency quantiles per volume.
    Stats(stats::StatsArgs),
    /// Live per-volume rates, refreshed in place.
    Top(top::TopArgs),
    /// GPU peer windows hosts registered for the zero-copy RDMA path.
    #[command(
        subcommand,
        after_help = "Examples:\n  nacre peer list\n  nacre --json peer list --tenant acme"
    )]
    Peer(peer::PeerCmd),
    /// Certificates of the host channel (files only; nacred need not run).
    #[command(
        subcommand,
        after_help = "Examples:\n  nacre cert init --dir /var/lib/nacre/tls\n  nacre cert issue --csr node17.csr --host node17 --tenant acme --out node17.pem"
    )]
    Cert(cert::CertCmd),
    /// List the methods nacred answers, with a line of help each.
    #[command(after_help = "Examples:\n  nacre methods\n  nacre --json methods")]
    Methods,
    /// Call any RPC method with raw JSON params and print the raw result.
    #[command(
        after_help = "Examples:\n  nacre rpc rpc_get_methods\n  nacre rpc volume_list '{\"name\": \"data\"}'"
    )]
    Rpc {
        /// Method name, e.g. volume_list.
        method: String,
        /// Params as a JSON object, e.g. '{"name": "data"}'.
        params: Option<String>,
    },
}

/// What a subcommand needs: a connection and the output mode.
pub struct Ctx {
    pub client: Client,
    pub json: bool,
}

impl Ctx {
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value> {
        Ok(self.client.call(method, params)?)
    }

    /// Print `v` as JSON when --json, else with `human`.
    pub fn print(&self, v: &Value, human: impl FnOnce(&Value)) {
        if self.json {
            println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
        } else {
            human(v);
        }
    }
}

pub fn run(cli: Cli) -> Result<()> {
    if let Command::Cert(c) = cli.command {
        return cert::run(c);
    }
    if let Command::Nvmf(c) = &cli.command {
        if c.is_local() {
            let Command::Nvmf(c) = cli.command else {
                unreachable!("matched above")
            };
            return nvmf::run_local(c, cli.json);
        }
    }
    let path = cli
        .rpc
        .clone()
        .unwrap_or_else(nacre_dpu::config::default_rpc_path);
    let mut ctx = Ctx {
        client: Client::connect(&path)?,
        json: cli.json,
    };
    match cli.command {
        Command::Volume(c) => volume::run(&mut ctx, c),
        Command::VhostBlk(c) => vhost::run(&mut ctx, c),
        Command::Nvmf(c) => nvmf::run(&mut ctx, c),
        Command::Tenant(c) => tenant::run(&mut ctx, c),
        Command::Kms(c) => kms::run(&mut ctx, c),
        Command::Remote(c) => remote::run(&mut ctx, c),
        Command::Qos(c) => qos::run(&mut ctx, c),
        Command::Stats(a) => stats::run(&mut ctx, a),
        Command::Top(a) => top::run(&mut ctx, a),
        Command::Peer(c) => peer::run(&mut ctx, c),
        Command::Cert(_) => unreachable!("handled above"),
        Command::Methods => {
            let v = ctx.call("rpc_get_methods", serde_json::json!({"verbose": true}))?;
            ctx.print(&v, print_methods);
            Ok(())
        }
        Command::Rpc { method, params } => {
            let params = match params {
                Some(p) => serde_json::from_str(&p)
                    .map_err(|e| anyhow::anyhow!("params are not valid JSON: {e}"))?,
                None => Value::Null,
            };
            let v = ctx.call(&method, params)?;
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(())
        }
    }
}

/// `nacre methods`: every method with its whole line of help, the names in one column as wide
/// as the longest (nothing is cut; a terminal narrower than a line wraps it).
fn print_methods(v: &Value) {
    let mut t = nacre_shared::table::Table::new(&[]);
    for m in v.as_array().into_iter().flatten() {
        t.row(vec![
            m["name"].as_str().unwrap_or("").to_string(),
            m["help"].as_str().unwrap_or("").to_string(),
        ]);
    }
    t.print();
}

/// A command-line error as one line: `nacre: error: WHAT (tip: ...); see 'nacre ... --help'`,
/// for clap's multi-line rendering (help and version requests are printed as they are).
pub fn usage_error_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut what = String::new();
    let mut tips = Vec::new();
    let mut usage = None;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(w) = line.strip_prefix("error: ") {
            what = w.to_string();
        } else if let Some(t) = line.strip_prefix("tip: ") {
            tips.push(t.to_string());
        } else if let Some(u) = line.strip_prefix("Usage: ") {
            let words: Vec<&str> = u
                .split_whitespace()
                .take_while(|w| !w.starts_with(['[', '<', '-']))
                .collect();
            usage = Some(words.join(" "));
        } else if !line.starts_with("For more information") {
            // The lines an error lists (e.g. the missing arguments).
            if !what.is_empty() {
                what.push(' ');
            }
            what.push_str(line);
        }
    }
    let mut out = format!("nacre: error: {what}");
    if !tips.is_empty() {
        out.push_str(&format!(" (tip: {})", tips.join("; ")));
    }
    out.push_str(&format!(
        "; see '{} --help'",
        usage.unwrap_or_else(|| "nacre".into())
    ));
    out
}

#[cfg(test)]
mod test {
    use clap::CommandFactory;

    /// Every subcommand's --help teaches: examples, and a description of every argument.
    #[test]
    fn every_help_has_examples_and_described_arguments() {
        let mut missing = Vec::new();
        fn walk(cmd: &clap::Command, path: String, missing: &mut Vec<String>) {
            let examples = cmd
                .get_after_help()
                .or(cmd.get_after_long_help())
                .is_some_and(|h| h.to_string().contains("Examples:"));
            if !examples {
                missing.push(format!("{path}: no examples"));
            }
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" || a.is_global_set() && path != "nacre" {
                    continue;
                }
                let described = a
                    .get_help()
                    .or(a.get_long_help())
                    .is_some_and(|h| !h.to_string().trim().is_empty());
                if !described {
                    missing.push(format!("{path}: argument {id} has no description"));
                }
            }
            for sub in cmd.get_subcommands() {
                if sub.get_name() == "help" {
                    continue;
                }
                walk(sub, format!("{path} {}", sub.get_name()), missing);
            }
        }
        let cmd = super::Cli::command();
        walk(&cmd, "nacre".into(), &mut missing);
        assert!(missing.is_empty(), "{}", missing.join("\n"));
    }
}
