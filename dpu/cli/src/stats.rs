//! `nacre stats`: per-volume I/O counters, queue depth, QoS throttling and latency quantiles.

use anyhow::Result;
use clap::Args;
use nacre_shared::api::qos::VolumeStats;
use nacre_shared::size::format_size;
use serde_json::{json, Value};

use super::Ctx;
use nacre_shared::table::Table;

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  nacre stats                 # every open volume since nacred started\n  nacre stats --volume db\n  nacre stats --json          # raw counters, for scripts\n\nCounters are totals since nacred started; `nacre top` shows rates. Latency quantiles are\nhistogram bucket bounds (within +26% of the true value); Prometheus gets the same histograms\nfrom nacred --metrics-listen."
)]
pub struct StatsArgs {
    /// Only this volume.
    #[arg(long)]
    volume: Option<String>,
}

/// Fetch `stats_get`.
pub fn fetch(ctx: &mut Ctx, volume: Option<&str>) -> Result<Vec<VolumeStats>> {
    let mut p = json!({});
    if let Some(v) = volume {
        p["volume"] = json!(v);
    }
    let v = ctx.call("stats_get", p)?;
    Ok(serde_json::from_value(v)?)
}

pub fn run(ctx: &mut Ctx, a: StatsArgs) -> Result<()> {
    let stats = fetch(ctx, a.volume.as_deref())?;
    let v: Value = serde_json::to_value(&stats)?;
    ctx.print(&v, |_| {
        let mut t = Table::new(&[
            "VOLUME",
            "TENANT",
            "READS",
            "WRITES",
            "OTHER",
            "READ",
            "WRITTEN",
            "ERRORS",
            "QD",
            "THROTTLED",
            "P50 US",
            "P99 US",
            "P99.9 US",
        ]);
        for s in &stats {
            t.row(vec![
                s.volume.clone(),
                s.tenant.clone().unwrap_or_else(|| "-".into()),
                s.read_ops.to_string(),
                s.write_ops.to_string(),
                s.other_ops.to_string(),
                format_size(s.read_bytes),
                format_size(s.write_bytes),
                s.errors.to_string(),
                s.queue_depth.to_string(),
                s.throttled_total.to_string(),
                us(s.p50_us),
                us(s.p99_us),
                us(s.p999_us),
            ]);
        }
        println!("{}", t.render());
    });
    Ok(())
}

pub fn us(x: f64) -> String {
    if x == 0.0 {
        "-".into()
    } else if x < 100.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.0}")
    }
}
