//! `nacre-host register-gpu` / `unregister-gpu`: GPU memory windows as DPU peers.
//!
//! `register-gpu` allocates and pins a buffer on a GPU (CUDA driver API, loaded at run
//! time), exports it as a dma-buf where the driver can, and registers the window with
//! nacred over the host channel. The buffer belongs to this process, so the window lives
//! as long as it does: the command stays in the foreground and unregisters on SIGINT or
//! SIGTERM, and nacred drops the window by itself if the channel goes away. For a window
//! that outlives a shell, run `nacre-host agent --gpu UUID`.

use std::path::Path;

use anyhow::{Context, Result};
use nacre_shared::api::peer::{PeerWindowInfo, PeerWindowRegister};
use nacre_shared::size::{format_size, parse_size};
use serde_json::json;

use crate::cuda::{Cuda, CudaDevice, GpuBuffer};
use crate::Global;

const REGISTER_EXAMPLES: &str = "\
Examples:
  nacre-host register-gpu                      # 64 MiB on the first GPU
  nacre-host register-gpu --gpu GPU-5f0c9a3e-1234-5678-9abc-def001234567 --size 1G

Stays in the foreground holding the buffer; Ctrl-C unregisters it. `nacre peer list` on
the DPU shows it. Needs the NVIDIA driver (libcuda.so.1); without it this is an error.";

/// Pin a GPU buffer and register it with nacred as a peer window (GPUDirect).
#[derive(clap::Args, Debug)]
#[command(after_help = REGISTER_EXAMPLES)]
pub struct RegisterArgs {
    /// The GPU's UUID (as `nacre-host gpus` prints it) [default: the first GPU].
    #[arg(long)]
    pub gpu: Option<String>,
    /// Buffer size (rounded up to 2 MiB), e.g. 64M, 1G.
    #[arg(long, default_value = "64M", value_parser = parse_size_arg)]
    pub size: u64,
}

/// Remove a peer window registered from this host.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  nacre-host unregister-gpu 3\n\nThe id is the one register-gpu printed (also in `nacre peer list`)."
)]
pub struct UnregisterArgs {
    /// The window's id.
    pub id: u64,
}

pub fn parse_size_arg(s: &str) -> Result<u64, String> {
    match parse_size(s) {
        Ok(0) => Err("size must be positive".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A BAR's bus address range from a PCI function's `resource` file (one `start end flags`
/// line per BAR, hex): `(start, length)`, or `None` when the BAR is unused.
pub fn bar_range(resource: &str, bar: usize) -> Option<(u64, u64)> {
    let line = resource.lines().nth(bar)?;
    let mut f = line
        .split_whitespace()
        .map(|x| u64::from_str_radix(x.trim_start_matches("0x"), 16));
    let (start, end) = (f.next()?.ok()?, f.next()?.ok()?);
    (end > start).then(|| (start, end - start + 1))
}

/// BAR1 of an NVIDIA GPU (resource index 1): the aperture peers reach its memory through.
pub fn bar1(sys: &Path, bdf: &str) -> Option<(u64, u64)> {
    let r = std::fs::read_to_string(sys.join("bus/pci/devices").join(bdf).join("resource")).ok()?;
    bar_range(&r, 1)
}

/// A buffer allocated on a GPU, ready to register.
pub struct Window<'a> {
    pub dev: CudaDevice,
    pub buf: GpuBuffer<'a>,
    pub bar1: (u64, u64),
}

impl Window<'_> {
    pub fn params(&self) -> PeerWindowRegister {
        PeerWindowRegister {
            gpu_uuid: self.dev.uuid.clone(),
            bdf: self.dev.bdf.clone(),
            bar1_start: self.bar1.0,
            bar1_len: self.bar1.1,
            length: self.buf.len,
            device_address: self.buf.ptr,
            handle_kind: if self.buf.dmabuf.is_some() {
                "dmabuf"
            } else {
                "none"
            }
            .into(),
            handle: self.buf.dmabuf.map(i64::from),
            host: None,
            tenant: None,
        }
    }
}

/// Allocate a window of `size` bytes on the GPU `uuid` (or the first one).
pub fn allocate<'a>(
    cuda: &'a Cuda,
    sys: &Path,
    uuid: Option<&str>,
    size: u64,
) -> Result<Window<'a>> {
    let devs = cuda.devices()?;
    let dev = match uuid {
        Some(u) => devs
            .into_iter()
            .find(|d| d.uuid.eq_ignore_ascii_case(u))
            .with_context(|| format!("no GPU {u} (nacre-host gpus lists them)"))?,
        None => devs
            .into_iter()
            .next()
            .context("the CUDA driver reports no GPU")?,
    };
    let buf = cuda
        .alloc_window(&dev, size)
        .with_context(|| format!("cannot allocate {} on {}", format_size(size), dev.uuid))?;
    let bar1 = bar1(sys, &dev.bdf).unwrap_or((0, 0));
    Ok(Window { dev, buf, bar1 })
}

/// Resolves when SIGINT or SIGTERM arrives.
pub async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut i), Ok(mut t)) => {
            tokio::select! {
                _ = i.recv() => {}
                _ = t.recv() => {}
            }
        }
        _ => std::future::pending::<()>().await,
    }
}

pub fn run_register(g: &Global, a: RegisterArgs) -> Result<()> {
    let cuda = Cuda::load()?;
    let w = allocate(&cuda, &g.sysfs, a.gpu.as_deref(), a.size)?;
    crate::runtime()?.block_on(async {
        let mut c = crate::channel::connect(g).await?;
        let info: PeerWindowInfo =
            crate::channel::call(&mut c, "peer_window_register", serde_json::to_value(w.params())?)
                .await?;
        if g.json {
            println!("{}", serde_json::to_string_pretty(&info)?);
        } else {
            println!(
                "window {} registered: {} on {} ({}), {} at {:#x}, BAR1 {:#x}+{}, handle {}; Ctrl-C unregisters",
                info.id,
                format_size(info.length),
                info.gpu_uuid,
                info.bdf,
                info.tenant,
                info.device_address,
                info.bar1_start,
                format_size(info.bar1_len),
                info.handle_kind
            );
        }
        stop_signal().await;
        let _ = c.call("peer_window_unregister", json!({ "id": info.id })).await;
        c.shutdown().await;
        eprintln!("nacre-host: window {} unregistered", info.id);
        anyhow::Ok(())
    })?;
    drop(w);
    Ok(())
}

pub fn run_unregister(g: &Global, a: UnregisterArgs) -> Result<()> {
    crate::runtime()?.block_on(async {
        let mut c = crate::channel::connect(g).await?;
        c.call("peer_window_unregister", json!({ "id": a.id }))
            .await
            .with_context(|| format!("cannot unregister window {}", a.id))?;
        c.shutdown().await;
        println!("window {} unregistered", a.id);
        anyhow::Ok(())
    })
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn bar1_comes_from_the_resource_file() {
        // An A100's resource file: BAR0 16 MiB registers, BAR1 64 GiB (64-bit, prefetchable,
        // occupying indexes 1 and 2), BAR3 32 MiB.
        let r = "0x00000000d0000000 0x00000000d0ffffff 0x0000000000040200\n\
                 0x0000380000000000 0x0000380fffffffff 0x000000000014220c\n\
                 0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                 0x0000381000000000 0x0000381001ffffff 0x000000000014220c\n";
        assert_eq!(bar_range(r, 1), Some((0x3800_0000_0000, 64 << 30)));
        assert_eq!(bar_range(r, 0), Some((0xd000_0000, 16 << 20)));
        assert_eq!(bar_range(r, 2), None, "unused BAR");
        assert_eq!(bar_range(r, 9), None);
        assert_eq!(bar_range("junk\n", 0), None);
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size_arg("64M"), Ok(64 << 20));
        assert!(parse_size_arg("0").is_err());
        assert!(parse_size_arg("lots").is_err());
    }
}
