//! `nacre top`: per-volume rates, refreshed in place (a plain refresh: no terminal UI crate).

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use nacre_shared::api::qos::VolumeStats;
use nacre_shared::size::format_size;

use super::stats::{fetch, us};
use super::Ctx;
use nacre_shared::table::Table;

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  nacre top                   # refresh every second until Ctrl-C\n  nacre top --interval 5\n  nacre top --count 3 --no-clear > log   # three samples, appended, for scripts\n\nRates are differences of `nacre stats` counters over the interval; tails (P99, P99.9) are\ncumulative since nacred started."
)]
pub struct TopArgs {
    /// Seconds between refreshes (0.1 to 3600).
    #[arg(long, default_value_t = 1.0, value_parser = interval_secs)]
    interval: f64,
    /// Stop after this many refreshes [default: run until interrupted].
    #[arg(long)]
    count: Option<u64>,
    /// Print each sample below the last instead of redrawing the screen.
    #[arg(long)]
    no_clear: bool,
}

/// Refresh interval bounds: faster than 0.1 s the table cannot be read; the upper bound keeps
/// the value a `Duration` can hold (1e20 seconds cannot be one).
const MIN_INTERVAL: f64 = 0.1;
const MAX_INTERVAL: f64 = 3600.0;

fn interval_secs(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("not a number of seconds: {s}"))?;
    if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&v) {
        return Err(format!(
            "must be between {MIN_INTERVAL} and {MAX_INTERVAL} seconds"
        ));
    }
    Ok(v)
}

pub fn run(ctx: &mut Ctx, a: TopArgs) -> Result<()> {
    let mut prev: HashMap<String, VolumeStats> = fetch(ctx, None)?
        .into_iter()
        .map(|s| (s.volume.clone(), s))
        .collect();
    let mut last = Instant::now();
    let mut n = 0;
    loop {
        std::thread::sleep(Duration::from_secs_f64(a.interval));
        let now = fetch(ctx, None)?;
        let dt = last.elapsed().as_secs_f64();
        last = Instant::now();
        let mut t = Table::new(&[
            "VOLUME",
            "TENANT",
            "R IOPS",
            "W IOPS",
            "R B/S",
            "W B/S",
            "QD",
            "THROTTLED",
            "ERR/S",
            "P99 US",
            "P99.9 US",
        ]);
        for s in &now {
            let p = prev.get(&s.volume);
            let rate = |f: fn(&VolumeStats) -> u64| {
                let before = p.map_or(0, f);
                (f(s).saturating_sub(before)) as f64 / dt
            };
            t.row(vec![
                s.volume.clone(),
                s.tenant.clone().unwrap_or_else(|| "-".into()),
                format!("{:.0}", rate(|s| s.read_ops)),
                format!("{:.0}", rate(|s| s.write_ops)),
                format_size(rate(|s| s.read_bytes) as u64),
                format_size(rate(|s| s.write_bytes) as u64),
                s.queue_depth.to_string(),
                s.throttled.to_string(),
                format!("{:.0}", rate(|s| s.errors)),
                us(s.p99_us),
                us(s.p999_us),
            ]);
        }
        let mut out = std::io::stdout().lock();
        if !a.no_clear {
            // Home and clear: a plain refresh any terminal understands.
            write!(out, "\x1b[H\x1b[2J")?;
        }
        writeln!(
            out,
            "nacre top: {} volumes, every {:.1} s",
            now.len(),
            a.interval
        )?;
        writeln!(out, "{}", t.render())?;
        out.flush()?;
        prev = now.into_iter().map(|s| (s.volume.clone(), s)).collect();
        n += 1;
        if a.count.is_some_and(|c| n >= c) {
            return Ok(());
        }
    }
}
