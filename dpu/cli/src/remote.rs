//! `nacre remote ...`: remote NVMe-oF controllers and the volumes built on them.

use anyhow::Result;
use clap::{Args, Subcommand};
use nacre_shared::size::format_size;
use serde_json::{json, Value};

use super::volume::size_arg;
use super::Ctx;
use nacre_shared::table::Table;

#[derive(Subcommand, Debug)]
pub enum RemoteCmd {
    /// Connect to a remote NVMe-oF controller over TCP or RDMA (SPDK:
    /// bdev_nvme_attach_controller).
    #[command(
        after_help = "Examples:\n  nacre remote attach shelf1 --address 10.0.0.5 --subnqn nqn.2024-01.com.example:shelf1\n  nacre remote attach shelf1r --transport rdma --address 192.0.2.5 \\\n      --subnqn nqn.2024-01.com.example:shelf1\n  nacre remote attach shelf1b --address 10.0.1.5 --subnqn nqn.2024-01.com.example:shelf1 \\\n      --reconnect-delay-sec 2 --ctrl-loss-timeout-sec 60 --fast-io-fail-timeout-sec 10\n  nacre remote attach shelf2 --address 10.0.0.6 --subnqn nqn.2024-01.com.example:shelf2 \\\n      --dhchap-secret /etc/nacre/keys/host.key --dhchap-ctrl-secret /etc/nacre/keys/shelf2.key\n\nRDMA (RoCEv2) needs an RDMA device with a route to the address (a RoCE NIC, or soft-RoCE:\n  rdma link add rxe0 type rxe netdev eth0); digests are NVMe/TCP only."
    )]
    Attach(AttachArgs),
    /// Disconnect a remote controller that no volume uses.
    #[command(after_help = "Examples:\n  nacre remote detach shelf1")]
    Detach {
        /// The remote controller.
        name: String,
    },
    /// List remote controllers: state, namespaces, resets.
    #[command(after_help = "Examples:\n  nacre remote list\n  nacre remote list shelf1")]
    List {
        /// Only this remote.
        name: Option<String>,
    },
    /// List the subsystems a portal's discovery controller offers.
    #[command(after_help = "Examples:\n  nacre remote discover --address 192.0.2.10 --port 4420")]
    Discover {
        /// Transport: tcp or rdma.
        #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma"])]
        transport: String,
        /// The portal's address.
        #[arg(long)]
        address: String,
        /// The portal's port (discovery controllers also listen on 8009).
        #[arg(long, default_value_t = 4420)]
        port: u16,
    },
    /// Create a volume on remote namespaces: one extent, a multipath extent, or a stripe.
    #[command(
        name = "volume-create",
        after_help = "Extents are REMOTE:NSID; the same namespace through several remotes is\nREMOTE:NSID+REMOTE:NSID (multipath); several --extent are striped.\n\nExamples:\n  nacre remote volume-create vol1 --extent shelf1:1\n  nacre remote volume-create vol2 --extent shelf1:1+shelf1b:1 --multipath round_robin\n  nacre remote volume-create big --extent shelf1:2 --extent shelf2:2 --stripe-size 128K"
    )]
    VolumeCreate(VolumeArgs),
}

#[derive(Args, Debug)]
pub struct AttachArgs {
    /// nacre's name for the controller (volumes say NAME:NSID).
    pub name: String,
    /// Transport: tcp (NVMe/TCP) or rdma (NVMe/RDMA, e.g. RoCEv2).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma"])]
    pub transport: String,
    /// The target's address.
    #[arg(long)]
    pub address: String,
    /// The target's port.
    #[arg(long, default_value_t = 4420)]
    pub port: u16,
    /// Subsystem NQN.
    #[arg(long, alias = "nqn")]
    pub subnqn: String,
    /// Host NQN [default: nacred's own].
    #[arg(long)]
    pub hostnqn: Option<String>,
    /// I/O queues (TCP or RDMA connections) [default: 4].
    #[arg(long)]
    pub io_queues: Option<u16>,
    /// Commands in flight per queue [default: 128].
    #[arg(long)]
    pub queue_depth: Option<u16>,
    /// CRC32C header digests on every PDU.
    #[arg(long)]
    pub header_digest: bool,
    /// CRC32C data digests on every PDU carrying data.
    #[arg(long)]
    pub data_digest: bool,
    /// Largest write sent in the command capsule, bytes [default: 8192].
    #[arg(long)]
    pub in_capsule_data_size: Option<u32>,
    /// Keep Alive Timeout in ms, 0 = off [default: 10000].
    #[arg(long)]
    pub keep_alive_timeout_ms: Option<u32>,
    /// Seconds between reconnection attempts [default: 2].
    #[arg(long)]
    pub reconnect_delay_sec: Option<u32>,
    /// Give up after this many seconds disconnected; -1 never, 0 no reconnect [default: 30].
    #[arg(long, allow_negative_numbers = true)]
    pub ctrl_loss_timeout_sec: Option<i32>,
    /// Fail I/O instead of holding it after this many seconds disconnected, 0 = off.
    #[arg(long)]
    pub fast_io_fail_timeout_sec: Option<u32>,
    /// Reset the controller when a command is outstanding this long, 0 = off [default: 30].
    #[arg(long)]
    pub io_timeout_sec: Option<u32>,
    /// Wait this long after a connection loss before resending its commands [default: 1000].
    #[arg(long)]
    pub quiesce_time_ms: Option<u32>,
    /// DH-HMAC-CHAP: a file (mode 0600) holding this host's secret, DHHC-1:XX:...: (see
    /// `nacre nvmf gen-dhchap-key`). Authenticates every queue when the shelf asks.
    #[arg(long, value_name = "FILE")]
    pub dhchap_secret: Option<std::path::PathBuf>,
    /// A file (mode 0600) holding the shelf's secret: nacre then also checks the shelf, on
    /// every queue, whether the shelf asks for authentication or not.
    #[arg(long, value_name = "FILE", requires = "dhchap_secret")]
    pub dhchap_ctrl_secret: Option<std::path::PathBuf>,
    /// NVMe/TCP over TLS 1.3: a file (mode 0600) holding the PSK the shelf has for this host,
    /// NVMeTLSkey-1:HH:...: (see `nacre nvmf gen-tls-key`; nvme-cli's and SPDK's keys are the
    /// same format). Every queue starts with a TLS handshake; a shelf that refuses it fails
    /// the attach, without retries. TCP only.
    #[arg(long, value_name = "FILE")]
    pub psk: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
pub struct VolumeArgs {
    /// Volume name.
    pub name: String,
    /// REMOTE:NSID or REMOTE:NSID+REMOTE:NSID (multipath); repeat to stripe.
    #[arg(long = "extent", required = true)]
    pub extents: Vec<String>,
    /// Stripe unit for several extents, e.g. 128K.
    #[arg(long, value_parser = size_arg)]
    pub stripe_size: Option<u64>,
    /// failover (active-passive) or round_robin (active-active).
    #[arg(long, default_value = "failover")]
    pub multipath: String,
    /// Use only the first SIZE bytes [default: all the extents hold].
    #[arg(long, value_parser = size_arg, allow_hyphen_values = true)]
    pub size: Option<u64>,
    /// Logical block size: 512 or 4096 (a multiple of the namespaces').
    #[arg(long, default_value_t = 4096)]
    pub block_size: u32,
    /// Owning tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Encrypt with a per-volume AES-XTS key wrapped by the tenant's KEK (the shelf sees
    /// only ciphertext).
    #[arg(long, requires = "tenant")]
    pub encrypt: bool,
}

pub fn run(ctx: &mut Ctx, cmd: RemoteCmd) -> Result<()> {
    match cmd {
        RemoteCmd::Attach(a) => {
            let mut p = json!({
                "name": a.name, "transport": a.transport, "address": a.address,
                "port": a.port, "subnqn": a.subnqn,
                "header_digest": a.header_digest, "data_digest": a.data_digest,
            });
            let opt = |p: &mut Value, k: &str, v: Option<Value>| {
                if let Some(v) = v {
                    p[k] = v;
                }
            };
            opt(&mut p, "hostnqn", a.hostnqn.map(|v| json!(v)));
            // nacred reads the files itself: send absolute paths, never the secrets.
            for (k, path) in [
                ("dhchap_secret", &a.dhchap_secret),
                ("dhchap_ctrl_secret", &a.dhchap_ctrl_secret),
                ("psk", &a.psk),
            ] {
                if let Some(path) = path {
                    let abs = std::fs::canonicalize(path)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                    p[k] = json!(abs);
                }
            }
            opt(&mut p, "io_queues", a.io_queues.map(|v| json!(v)));
            opt(&mut p, "queue_depth", a.queue_depth.map(|v| json!(v)));
            opt(
                &mut p,
                "in_capsule_data_size",
                a.in_capsule_data_size.map(|v| json!(v)),
            );
            opt(
                &mut p,
                "keep_alive_timeout_ms",
                a.keep_alive_timeout_ms.map(|v| json!(v)),
            );
            opt(
                &mut p,
                "reconnect_delay_sec",
                a.reconnect_delay_sec.map(|v| json!(v)),
            );
            opt(
                &mut p,
                "ctrl_loss_timeout_sec",
                a.ctrl_loss_timeout_sec.map(|v| json!(v)),
            );
            opt(
                &mut p,
                "fast_io_fail_timeout_sec",
                a.fast_io_fail_timeout_sec.map(|v| json!(v)),
            );
            opt(&mut p, "io_timeout_sec", a.io_timeout_sec.map(|v| json!(v)));
            opt(
                &mut p,
                "quiesce_time_ms",
                a.quiesce_time_ms.map(|v| json!(v)),
            );
            let v = ctx.call("remote_attach", p)?;
            ctx.print(&v, |v| {
                println!(
                    "attached remote {} ({} {}, {} namespace(s))",
                    v["name"].as_str().unwrap_or(""),
                    v["model"].as_str().unwrap_or("?"),
                    v["subnqn"].as_str().unwrap_or(""),
                    v["namespaces"].as_array().map_or(0, |a| a.len())
                );
                print_namespaces(v);
            });
        }
        RemoteCmd::Detach { name } => {
            let v = ctx.call("remote_detach", json!({ "name": name }))?;
            ctx.print(&v, |_| println!("detached remote {name}"));
        }
        RemoteCmd::List { name } => {
            let p = name.map(|n| json!({ "name": n })).unwrap_or(Value::Null);
            let v = ctx.call("remote_list", p)?;
            ctx.print(&v, print_remotes);
        }
        RemoteCmd::Discover {
            transport,
            address,
            port,
        } => {
            let v = ctx.call(
                "remote_discover",
                json!({"transport": transport, "address": address, "port": port}),
            )?;
            ctx.print(&v, |v| {
                let mut t = Table::new(&["SUBNQN", "TYPE", "TRANSPORT", "ADDRESS", "PORT"]);
                for e in v.as_array().into_iter().flatten() {
                    let s = |k: &str| e[k].as_str().unwrap_or("").to_string();
                    t.row(vec![
                        s("subnqn"),
                        s("subtype"),
                        s("transport"),
                        s("address"),
                        s("port"),
                    ]);
                }
                t.print();
            });
        }
        RemoteCmd::VolumeCreate(a) => {
            let mut remote = json!({ "extents": a.extents, "multipath": a.multipath });
            if let Some(ss) = a.stripe_size {
                remote["stripe_size"] = json!(ss);
            }
            let mut p = json!({
                "name": a.name, "backend": "remote", "block_size": a.block_size,
                "size": a.size.unwrap_or(0), "remote": remote,
            });
            if let Some(t) = a.tenant {
                p["tenant"] = json!(t);
            }
            if a.encrypt {
                p["encrypt"] = json!(true);
            }
            let v = ctx.call("volume_create", p)?;
            ctx.print(&v, |v| {
                println!(
                    "created volume {} ({}, remote, serial {})",
                    v["name"].as_str().unwrap_or(""),
                    format_size(v["size"].as_u64().unwrap_or(0)),
                    v["serial"].as_str().unwrap_or("")
                )
            });
        }
    }
    Ok(())
}

fn print_namespaces(r: &Value) {
    for n in r["namespaces"].as_array().into_iter().flatten() {
        println!(
            "  nsid {:<4} {:>8} x {:<5} {}",
            n["nsid"],
            format_size(n["size"].as_u64().unwrap_or(0)),
            n["block_size"],
            n["id"].as_str().unwrap_or("")
        );
    }
}

fn print_remotes(v: &Value) {
    let mut t = Table::new(&[
        "NAME",
        "STATE",
        "TRANSPORT",
        "ADDRESS",
        "SUBNQN",
        "NAMESPACES",
        "RESETS",
        "USED BY",
    ]);
    for r in v.as_array().into_iter().flatten() {
        let s = |k: &str| r[k].as_str().unwrap_or("").to_string();
        t.row(vec![
            s("name"),
            s("state"),
            s("transport"),
            format!("{}:{}", s("address"), r["port"]),
            s("subnqn"),
            r["namespaces"]
                .as_array()
                .map_or(0, |a| a.len())
                .to_string(),
            r["resets"].to_string(),
            r["used_by"]
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
    for r in v.as_array().into_iter().flatten() {
        if let Some(e) = r["last_error"].as_str() {
            if r["state"] != "live" {
                println!("{}: {e}", r["name"].as_str().unwrap_or(""));
            }
        }
    }
}
