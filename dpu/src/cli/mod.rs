//! `nacre`, the operator CLI. It only speaks nacred's JSON-RPC; it never touches data.
//!
//! One module per object family builds requests and prints results; `--json` prints the raw
//! result for scripts. Errors are one line on stderr and exit status 1 (2 for usage errors,
//! from clap).

pub mod nvmf;
pub mod qos;
pub mod remote;
pub mod stats;
pub mod table;
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
#[command(name = "nacre", version, about, after_help = EXAMPLES)]
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
    #[command(subcommand)]
    Volume(volume::VolumeCmd),
    /// vhost-user-blk devices: serve a volume to a VM or any vhost-user client.
    #[command(subcommand, name = "vhost-blk")]
    VhostBlk(vhost::VhostBlkCmd),
    /// NVMe-oF/TCP subsystems: namespaces, listeners, allowed hosts.
    #[command(subcommand)]
    Nvmf(nvmf::NvmfCmd),
    /// Tenants: key-encryption keys, encryption policy, KEK rotation.
    #[command(subcommand)]
    Tenant(tenant::TenantCmd),
    /// Remote NVMe-oF controllers (storage shelves) and volumes on their namespaces.
    #[command(subcommand)]
    Remote(remote::RemoteCmd),
    /// QoS limits of volumes, tenants and the daemon: IOPS and bytes/s, bursts, weights.
    #[command(subcommand)]
    Qos(qos::QosCmd),
    /// I/O counters, queue depth, throttling and latency quantiles per volume.
    Stats(stats::StatsArgs),
    /// Live per-volume rates, refreshed in place.
    Top(top::TopArgs),
    /// List the methods nacred answers, with a line of help each.
    Methods,
    /// Call any RPC method with raw JSON params and print the raw result.
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
    let path = cli
        .rpc
        .clone()
        .unwrap_or_else(crate::config::default_rpc_path);
    let mut ctx = Ctx {
        client: Client::connect(&path)?,
        json: cli.json,
    };
    match cli.command {
        Command::Volume(c) => volume::run(&mut ctx, c),
        Command::VhostBlk(c) => vhost::run(&mut ctx, c),
        Command::Nvmf(c) => nvmf::run(&mut ctx, c),
        Command::Tenant(c) => tenant::run(&mut ctx, c),
        Command::Remote(c) => remote::run(&mut ctx, c),
        Command::Qos(c) => qos::run(&mut ctx, c),
        Command::Stats(a) => stats::run(&mut ctx, a),
        Command::Top(a) => top::run(&mut ctx, a),
        Command::Methods => {
            let v = ctx.call("rpc_get_methods", serde_json::json!({"verbose": true}))?;
            ctx.print(&v, |v| {
                for m in v.as_array().into_iter().flatten() {
                    println!(
                        "{:<28} {}",
                        m["name"].as_str().unwrap_or(""),
                        m["help"].as_str().unwrap_or("")
                    );
                }
            });
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
