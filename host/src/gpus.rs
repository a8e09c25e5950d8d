//! `nacre-host gpus`: the GPUs NVML reports, and how far each is from the DPU on PCIe.

use anyhow::Result;
use nacre_shared::size::format_size;
use serde::Serialize;

use crate::topology::{self, Distance};
use crate::Global;

/// The library the NVIDIA driver installs; `NACRE_HOST_LIBNVML` overrides it.
pub const LIBNVML: &str = "libnvidia-ml.so.1";

const EXAMPLES: &str = "\
Examples:
  nacre-host gpus
  nacre-host gpus --json

Distances are those of `nvidia-smi topo -m`: PIX (one PCIe switch between them), PXB
(several switches), PHB (through the CPU's host bridge), NODE (between host bridges of
one NUMA node), SYS (across sockets). GPUDirect Storage wants PIX or PXB. The DPU's
functions are the PCI functions of vendor 0x15b3 (NVIDIA/Mellanox). Without an NVIDIA
driver this says so and exits 0.";

/// List GPUs: name, UUID, PCIe address, NUMA node, BAR1 size and use, distance to the DPU.
#[derive(clap::Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct Args {}

#[derive(Debug, Serialize)]
pub struct DpuDistance {
    pub function: String,
    pub distance: Option<Distance>,
}

#[derive(Debug, Serialize)]
pub struct Gpu {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub bdf: String,
    pub numa_node: Option<u32>,
    pub bar1_total: u64,
    pub bar1_used: u64,
    pub dpu: Vec<DpuDistance>,
}

/// Load NVML, or say why not.
pub fn nvml() -> Result<nvml_wrapper::Nvml, String> {
    let lib = std::env::var("NACRE_HOST_LIBNVML").unwrap_or_else(|_| LIBNVML.into());
    nvml_wrapper::Nvml::builder()
        .lib_path(std::ffi::OsStr::new(&lib))
        .init()
        .map_err(|e| match e {
            nvml_wrapper::error::NvmlError::LibloadingError(_) => {
                format!("no NVIDIA driver ({lib} cannot be loaded)")
            }
            nvml_wrapper::error::NvmlError::DriverNotLoaded => {
                "the NVIDIA driver is not loaded".to_string()
            }
            other => format!("NVML cannot start: {other}"),
        })
}

/// The distance from a GPU to each DPU function under `sys`.
pub fn distances(sys: &std::path::Path, gpu_bdf: &str) -> Vec<DpuDistance> {
    let gpu = topology::locate(sys, gpu_bdf).ok();
    topology::dpu_functions(sys)
        .into_iter()
        .map(|f| DpuDistance {
            distance: match (&gpu, topology::locate(sys, &f)) {
                (Some(g), Ok(d)) => Some(topology::distance(g, &d)),
                _ => None,
            },
            function: f,
        })
        .collect()
}

pub fn list(g: &Global, nvml: &nvml_wrapper::Nvml) -> Result<Vec<Gpu>> {
    let n = nvml.device_count()?;
    let mut out = Vec::new();
    for index in 0..n {
        let d = nvml.device_by_index(index)?;
        let bdf = topology::normalize_bdf(&d.pci_info()?.bus_id);
        let bar1 = d.bar1_memory_info().ok();
        out.push(Gpu {
            index,
            name: d.name().unwrap_or_else(|_| "?".into()),
            uuid: d.uuid()?,
            numa_node: topology::locate(&g.sysfs, &bdf).ok().and_then(|l| l.numa),
            bar1_total: bar1.as_ref().map_or(0, |b| b.total),
            bar1_used: bar1.as_ref().map_or(0, |b| b.used),
            dpu: distances(&g.sysfs, &bdf),
            bdf,
        });
    }
    Ok(out)
}

pub fn run(g: &Global, _a: Args) -> Result<()> {
    let nvml = match nvml() {
        Ok(n) => n,
        Err(why) => {
            if g.json {
                println!("[]");
            }
            eprintln!("nacre-host: {why}; no GPUs to list");
            return Ok(());
        }
    };
    let gpus = list(g, &nvml)?;
    if g.json {
        println!("{}", serde_json::to_string_pretty(&gpus)?);
        return Ok(());
    }
    if gpus.is_empty() {
        println!("no GPUs");
        return Ok(());
    }
    for gpu in &gpus {
        println!(
            "GPU {} {}  {}  {}  NUMA {}  BAR1 {} ({} used)",
            gpu.index,
            gpu.name,
            gpu.uuid,
            gpu.bdf,
            gpu.numa_node.map_or("-".into(), |n| n.to_string()),
            format_size(gpu.bar1_total),
            format_size(gpu.bar1_used)
        );
        if gpu.dpu.is_empty() {
            println!("  no DPU functions on this host's PCIe");
        }
        for d in &gpu.dpu {
            println!(
                "  {}  {}",
                d.distance.map_or("?".into(), |x| x.to_string()),
                d.function
            );
        }
    }
    Ok(())
}
