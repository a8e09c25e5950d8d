//! `nacre qos set|show|clear`

use anyhow::Result;
use clap::{Args, Subcommand};
use nacre_shared::size::format_size;
use serde_json::{json, Map, Value};

use super::Ctx;
use nacre_shared::table::Table;

/// Exactly one of --volume, --tenant, --global.
#[derive(Args, Debug)]
#[group(required = true, multiple = false)]
pub struct TargetArgs {
    /// A volume's own limits.
    #[arg(long)]
    volume: Option<String>,
    /// A tenant's limits: all of its volumes together.
    #[arg(long)]
    tenant: Option<String>,
    /// The daemon-wide limit, shared between tenants by weight under contention.
    #[arg(long)]
    global: bool,
}

impl TargetArgs {
    fn params(&self) -> Map<String, Value> {
        let mut p = Map::new();
        if let Some(v) = &self.volume {
            p.insert("volume".into(), json!(v));
        }
        if let Some(t) = &self.tenant {
            p.insert("tenant".into(), json!(t));
        }
        if self.global {
            p.insert("global".into(), json!(true));
        }
        p
    }
}

#[derive(Subcommand, Debug)]
pub enum QosCmd {
    /// Set limits; the ones given replace the current ones, the others stay. Takes effect
    /// at once on running I/O and survives restarts.
    #[command(
        after_help = "Examples:\n  nacre qos set --volume db --iops 2000                 # reads+writes+others\n  nacre qos set --volume db --read-bps 200M --write-bps 100M\n  nacre qos set --tenant acme --iops 50000 --burst-ms 500 # all of acme's volumes\n  nacre qos set --global --iops 400000                  # shared by tenants...\n  nacre qos set --tenant acme --weight 300              # ...acme gets 3x a default tenant\n\nRates are per second; byte rates take K/M/G suffixes (powers of 1024). There is no floor:\n--iops 1 means one request per second. Remove limits with `nacre qos clear`."
    )]
    Set {
        #[command(flatten)]
        target: TargetArgs,
        /// Read requests per second.
        #[arg(long)]
        read_iops: Option<u64>,
        /// Write requests per second (Discard and Write Zeroes count too).
        #[arg(long)]
        write_iops: Option<u64>,
        /// All requests per second.
        #[arg(long)]
        iops: Option<u64>,
        /// Read bytes per second, e.g. 200M.
        #[arg(long, value_parser = super::volume::size_arg)]
        read_bps: Option<u64>,
        /// Written bytes per second.
        #[arg(long, value_parser = super::volume::size_arg)]
        write_bps: Option<u64>,
        /// Read and written bytes per second together.
        #[arg(long, value_parser = super::volume::size_arg)]
        bps: Option<u64>,
        /// Milliseconds of each rate allowed at once after idling [default: 100].
        #[arg(long)]
        burst_ms: Option<u32>,
        /// Tenants only: share of the global limit under contention [default: 100].
        #[arg(long)]
        weight: Option<u32>,
    },
    /// Show limits (all, or one target's).
    #[command(
        after_help = "Examples:\n  nacre qos show\n  nacre qos show --volume db\n  nacre qos show --json"
    )]
    Show {
        /// Only this volume's limits.
        #[arg(long)]
        volume: Option<String>,
        /// Only this tenant's limits.
        #[arg(long)]
        tenant: Option<String>,
        /// Only the daemon-wide limit.
        #[arg(long)]
        global: bool,
    },
    /// Remove every limit of a target.
    #[command(after_help = "Examples:\n  nacre qos clear --volume db\n  nacre qos clear --global")]
    Clear {
        #[command(flatten)]
        target: TargetArgs,
    },
}

pub fn run(ctx: &mut Ctx, cmd: QosCmd) -> Result<()> {
    match cmd {
        QosCmd::Set {
            target,
            read_iops,
            write_iops,
            iops,
            read_bps,
            write_bps,
            bps,
            burst_ms,
            weight,
        } => {
            let limits = json!({
                "read_iops": read_iops, "write_iops": write_iops, "iops": iops,
                "read_bps": read_bps, "write_bps": write_bps, "bps": bps,
                "burst_ms": burst_ms, "weight": weight,
            });
            let limits: Map<String, Value> = limits
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if limits.is_empty() {
                anyhow::bail!("give at least one limit, e.g. --iops 2000 (see --help)");
            }
            let mut p = target.params();
            p.insert("limits".into(), Value::Object(limits));
            let v = ctx.call("qos_set", Value::Object(p))?;
            ctx.print(&v, |v| print_table(std::slice::from_ref(v)));
        }
        QosCmd::Show {
            volume,
            tenant,
            global,
        } => {
            let mut p = json!({});
            if let Some(v) = volume {
                p["volume"] = json!(v);
            }
            if let Some(t) = tenant {
                p["tenant"] = json!(t);
            }
            if global {
                p["global"] = json!(true);
            }
            let v = ctx.call("qos_show", p)?;
            ctx.print(&v, |v| print_table(v.as_array().map_or(&[], |a| a)));
        }
        QosCmd::Clear { target } => {
            let v = ctx.call("qos_clear", Value::Object(target.params()))?;
            ctx.print(&v, |_| println!("limits cleared"));
        }
    }
    Ok(())
}

fn print_table(rows: &[Value]) {
    let mut t = Table::new(&[
        "KIND",
        "NAME",
        "READ IOPS",
        "WRITE IOPS",
        "IOPS",
        "READ B/S",
        "WRITE B/S",
        "B/S",
        "BURST MS",
        "WEIGHT",
    ]);
    let n = |v: &Value| v.as_u64().map_or("-".to_string(), |x| x.to_string());
    let b = |v: &Value| v.as_u64().map_or("-".to_string(), format_size);
    for r in rows {
        let l = &r["limits"];
        t.row(vec![
            r["kind"].as_str().unwrap_or("").to_string(),
            r["name"].as_str().unwrap_or("").to_string(),
            n(&l["read_iops"]),
            n(&l["write_iops"]),
            n(&l["iops"]),
            b(&l["read_bps"]),
            b(&l["write_bps"]),
            b(&l["bps"]),
            n(&l["burst_ms"]),
            n(&l["weight"]),
        ]);
    }
    t.print();
}
