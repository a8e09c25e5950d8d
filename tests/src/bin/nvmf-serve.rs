//! A minimal NVMe-oF/TCP target for benchmarks: one subsystem with one namespace on a null
//! or RAM volume, listening on loopback, until stdin closes or it is killed.
//!
//!   nvmf-serve [--volume null|ram] [--size BYTES] [--block-size N] [--addr IP:PORT]
//!
//! Prints `listening on IP:PORT nqn NQN` once ready.

use std::io::{BufRead, Write};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::null::NullVolume;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;

pub const NQN: &str = "nqn.2024-01.io.nacre:bench";

fn main() -> Result<()> {
    let mut kind = "null".to_string();
    let mut size: u64 = 1 << 30;
    let mut bs: u32 = 4096;
    let mut addr = "127.0.0.1:0".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().context(format!("{a} needs a value"));
        match a.as_str() {
            "--volume" => kind = val()?,
            "--size" => size = val()?.parse()?,
            "--block-size" => bs = val()?.parse()?,
            "--addr" => addr = val()?,
            _ => bail!("unknown argument {a}; see the doc comment of nvmf-serve"),
        }
    }
    let vol: Arc<dyn BlockDevice> = match kind.as_str() {
        "null" => Arc::new(NullVolume::new(size, bs)),
        "ram" => Arc::new(RamVolume::new(size, bs).context("RAM volume")?),
        k => bail!("unknown volume kind {k}: use null or ram"),
    };
    let t = NvmfTarget::new();
    t.create_subsystem(NQN, "NACREBENCH", "nacre bench", true)?;
    t.add_namespace(NQN, Some(1), vol, [0x42; 16], kind.clone())?;
    let bound = t.add_listener(NQN, addr.parse().context("--addr")?)?;
    println!("listening on {bound} nqn {NQN}");
    std::io::stdout().flush()?;
    // Serve until stdin reaches EOF.
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        if line.is_err() {
            break;
        }
    }
    drop(t);
    Ok(())
}
