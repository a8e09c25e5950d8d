//! Dev server for the vhost-user-blk benchmark: serves one nacre volume through
//! `VhostBlkServer` until killed, independent of the control plane.
//!
//! `vhost-serve --socket PATH [--backend null|ram|file] [--size BYTES] [--block-size N]
//!  [--queues N] [--queue-size N] [--file PATH] [--read-only]`

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use nacre_dpu::frontend::vhost_user_blk::{VhostBlkConfig, VhostBlkServer};
use nacre_dpu::volume::file::FileVolume;
use nacre_dpu::volume::null::NullVolume;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;

fn main() -> Result<()> {
    let mut socket = None;
    let mut backend = "null".to_string();
    let mut size: u64 = 1 << 30;
    let mut bs: u32 = 512;
    let mut queues: u16 = 1;
    let mut queue_size: u16 = 1024;
    let mut file: Option<PathBuf> = None;
    let mut read_only = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--socket" => socket = Some(PathBuf::from(val()?)),
            "--backend" => backend = val()?,
            "--size" => size = val()?.parse()?,
            "--block-size" => bs = val()?.parse()?,
            "--queues" => queues = val()?.parse()?,
            "--queue-size" => queue_size = val()?.parse()?,
            "--file" => file = Some(PathBuf::from(val()?)),
            "--read-only" => read_only = true,
            other => bail!("unknown argument {other}"),
        }
    }
    let socket = socket.context("--socket is required")?;
    let volume: Arc<dyn BlockDevice> = match backend.as_str() {
        "null" => Arc::new(NullVolume::new(size, bs)),
        "ram" => Arc::new(RamVolume::new(size, bs).map_err(anyhow::Error::msg)?),
        "file" => {
            let path = file.context("--backend file needs --file")?;
            Arc::new(FileVolume::open(&path, size, bs, true).map_err(anyhow::Error::msg)?)
        }
        other => bail!("unknown backend {other}"),
    };
    let server = VhostBlkServer::start(
        VhostBlkConfig {
            socket,
            queues,
            queue_size,
            read_only,
            serial: "vhost-serve".into(),
        },
        volume,
    )?;
    eprintln!("serving {}", server.socket().display());
    loop {
        std::thread::park();
    }
}
