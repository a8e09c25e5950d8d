//! Show that a running nacred's embedded default disk works, without a VM or a kernel with
//! nvme-tcp: read it through both of its frontends and compare.
//!
//!   disk-check [--run-dir DIR] [--nvmf IP:PORT] [--nqn NQN] [--mib N]
//!
//! Connects to `<run-dir>/vhost-default.sock` as a read-only vhost-user-blk client
//! (libblkio, what QEMU's virtio-blk device does) and to the NVMe/TCP subsystem
//! `nqn.2014-08.io.nacre:default` (nacre's kernel-free NVMe/TCP host), reads N MiB (default:
//! one) at the start, the middle and the end of the disk through each, and checks that both
//! return the same bytes. It never writes. Defaults follow nacred's: `NACRE_RUN_DIR` or
//! /run/nacre, `NACRE_NVMF_LISTEN` or 127.0.0.1:4420. `scripts/check` builds and runs it.
//! The vhost-user-blk socket serves one client at a time: with a VM attached, stop it first.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use nacre_tests::blkio_client::{self, BlkioClient, ClientOptions};
use nacre_tests::nvmf_host::{HostOptions, NvmfHost};

const DEFAULT_NQN: &str = "nqn.2014-08.io.nacre:default";
/// NVMe reads go in pieces well under any MDTS a target reports.
const NVME_CHUNK: usize = 128 << 10;

fn main() {
    if let Err(e) = run() {
        eprintln!("disk-check: error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let mut run_dir = PathBuf::from(std::env::var("NACRE_RUN_DIR").unwrap_or("/run/nacre".into()));
    let mut nvmf: SocketAddr = std::env::var("NACRE_NVMF_LISTEN")
        .unwrap_or("127.0.0.1:4420".into())
        .parse()
        .context("NACRE_NVMF_LISTEN is not IP:PORT")?;
    let mut nqn = DEFAULT_NQN.to_string();
    let mut mib: usize = 1;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--run-dir" => run_dir = val()?.into(),
            "--nvmf" => nvmf = val()?.parse().context("--nvmf wants IP:PORT")?,
            "--nqn" => nqn = val()?,
            "--mib" => mib = val()?.parse().context("--mib wants a number")?,
            "-h" | "--help" => {
                println!("disk-check [--run-dir DIR] [--nvmf IP:PORT] [--nqn NQN] [--mib N]");
                return Ok(());
            }
            _ => bail!("unknown argument {a:?} (--run-dir, --nvmf, --nqn, --mib)"),
        }
    }
    let len = mib << 20;

    // vhost-user-blk through libblkio, read-only.
    let sock = run_dir.join("vhost-default.sock");
    let mut c = BlkioClient::connect(
        &sock,
        &ClientOptions {
            read_only: true,
            mem_len: len,
            ..Default::default()
        },
    )
    .with_context(|| format!("cannot connect to {} (is nacred running?)", sock.display()))?;
    let size = c.capacity()?;
    ensure!(
        size >= 3 * len as u64,
        "the disk ({size} bytes) is smaller than 3 x {mib} MiB"
    );
    let offsets = [0, (size / 2) & !0xfff, size - len as u64];
    let mut queues = c.take_queues();
    let mut via_vhost = Vec::new();
    for &off in &offsets {
        let buf = &mut c.mem()[..len];
        let r = blkio_client::read(&mut queues[0], off, buf)?;
        ensure!(r == 0, "vhost-user-blk read at {off} failed: {r}");
        via_vhost.push(buf.to_vec());
    }
    drop(queues);
    drop(c);
    println!(
        "vhost-user-blk {}: {} bytes, read {} x {mib} MiB",
        sock.display(),
        size,
        offsets.len()
    );

    // NVMe/TCP through nacre's kernel-free host.
    let mut h = NvmfHost::connect(nvmf, &nqn, HostOptions::default())
        .with_context(|| format!("cannot connect to {nqn} on {nvmf} over NVMe/TCP"))?;
    let ns = h.identify_namespace(1)?;
    let bs = (size / ns.nsze.max(1)) as usize;
    ensure!(
        ns.nsze * bs as u64 == size && bs.is_power_of_two(),
        "namespace 1 has {} blocks, which does not match the vhost-user-blk capacity {size}",
        ns.nsze
    );
    for (&off, want) in offsets.iter().zip(&via_vhost) {
        let mut got = Vec::with_capacity(len);
        for piece in (0..len).step_by(NVME_CHUNK) {
            let n = NVME_CHUNK.min(len - piece);
            let lba = (off + piece as u64) / bs as u64;
            got.extend(h.read(0, 1, lba, (n / bs) as u32, bs)?);
        }
        ensure!(
            &got == want,
            "NVMe/TCP and vhost-user-blk return different data at byte {off}"
        );
    }
    println!(
        "NVMe/TCP {nvmf} {nqn}: namespace 1, {} x {bs}-byte blocks, serial {}, model {:?}",
        ns.nsze,
        h.id.serial.trim(),
        h.id.model.trim()
    );
    println!(
        "OK: the default disk answers over vhost-user-blk and NVMe/TCP, and the {} MiB read \
         through each are the same bytes",
        3 * mib
    );
    Ok(())
}
