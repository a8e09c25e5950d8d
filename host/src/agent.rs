//! `nacre-host agent`: the host agent as a daemon (host/systemd/nacre-host.service).
//!
//! It keeps the host channel to nacred open: on each connection it logs the nacre disks
//! this host sees and registers the GPU windows it was asked to hold; a keepalive call
//! notices a dead channel and reconnects (with backoff), registering the windows again,
//! since nacred drops a channel's windows when it closes. On SIGTERM or SIGINT it
//! unregisters them and exits 0.

use std::time::Duration;

use anyhow::Result;
use nacre_shared::api::host::DeviceMatch;
use nacre_shared::api::peer::PeerWindowInfo;
use serde_json::json;
use tracing::{info, warn};

use crate::cuda::Cuda;
use crate::register::{allocate, parse_size_arg, stop_signal, Window};
use crate::Global;

const EXAMPLES: &str = "\
Examples:
  nacre-host agent
  nacre-host agent --gpu GPU-5f0c9a3e-1234-5678-9abc-def001234567 --size 1G
  systemctl enable --now nacre-host      # with host/systemd/nacre-host.service

Logs go to stderr (the journal under systemd); NACRE_HOST_LOG sets the filter.";

/// Run as a daemon: hold the channel to nacred, keep GPU windows registered.
#[derive(clap::Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct Args {
    /// GPUs (by UUID) to hold a window on; repeat for several.
    #[arg(long)]
    gpu: Vec<String>,
    /// Size of each GPU window.
    #[arg(long, default_value = "64M", value_parser = parse_size_arg)]
    size: u64,
    /// Seconds between keepalive calls.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..=3600))]
    keepalive: u64,
}

pub fn run(g: &Global, a: Args) -> Result<()> {
    let cuda = if a.gpu.is_empty() {
        None
    } else {
        Some(Cuda::load()?)
    };
    let mut windows: Vec<Window<'_>> = Vec::new();
    if let Some(c) = &cuda {
        for u in &a.gpu {
            windows.push(allocate(c, &g.sysfs, Some(u), a.size)?);
        }
    }
    crate::runtime()?.block_on(serve(g, &a, &windows))
}

enum Ended {
    Stop,
    Lost,
}

async fn serve(g: &Global, a: &Args, windows: &[Window<'_>]) -> Result<()> {
    // One watcher for the stop signals; each session and the backoff wait look at it.
    let (tx, stop) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        stop_signal().await;
        let _ = tx.send(true);
    });
    let mut backoff = Duration::from_secs(1);
    loop {
        match session(g, a, windows, stop.clone()).await {
            Ok(Ended::Stop) => {
                info!("stopping");
                return Ok(());
            }
            Ok(Ended::Lost) => backoff = Duration::from_secs(1),
            Err(e) => warn!(error = %format!("{e:#}"), "cannot reach nacred"),
        }
        info!(retry_in_s = backoff.as_secs(), "reconnecting");
        let mut s = stop.clone();
        tokio::select! {
            _ = s.wait_for(|v| *v) => return Ok(()),
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// One connection: register, then keep alive until it fails or a stop signal comes.
async fn session(
    g: &Global,
    a: &Args,
    windows: &[Window<'_>],
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Ended> {
    let mut c = tokio::select! {
        c = crate::channel::connect(g) => c?,
        _ = stop.wait_for(|v| *v) => return Ok(Ended::Stop),
    };
    let disks = crate::sysfs::disks(&g.sysfs);
    let seen: Vec<_> = disks.iter().map(crate::devices::seen).collect();
    let m: Vec<DeviceMatch> =
        crate::channel::call(&mut c, "host_devices_match", json!({ "devices": seen })).await?;
    for d in m.iter() {
        if let Some(v) = &d.volume {
            info!(device = %d.id, volume = %v.volume, tenant = ?v.tenant, encrypted = v.encrypted, "nacre disk");
        }
    }
    info!(
        disks = disks.len(),
        nacre = m.iter().filter(|d| d.volume.is_some()).count(),
        "connected to nacred"
    );
    let mut ids = Vec::new();
    for w in windows {
        let info: PeerWindowInfo = crate::channel::call(
            &mut c,
            "peer_window_register",
            serde_json::to_value(w.params())?,
        )
        .await?;
        info!(window = info.id, gpu = %info.gpu_uuid, length = info.length, "GPU window registered");
        ids.push(info.id);
    }
    loop {
        tokio::select! {
            _ = stop.wait_for(|v| *v) => {
                for id in ids {
                    let _ = c.call("peer_window_unregister", json!({ "id": id })).await;
                }
                c.shutdown().await;
                info!("windows unregistered");
                return Ok(Ended::Stop);
            }
            _ = tokio::time::sleep(Duration::from_secs(a.keepalive)) => {
                if let Err(e) = c.call("host_whoami", serde_json::Value::Null).await {
                    warn!(error = %e, "lost the channel to nacred");
                    return Ok(Ended::Lost);
                }
            }
        }
    }
}
