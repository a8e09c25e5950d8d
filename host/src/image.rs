//! `nacre-host image`: build, inspect, verify, extract and flash BlueField boot streams (BFB).
//!
//! The format lives in the `nacre-bfb` library; this module is the operator's side of it:
//! argument parsing, listings, and the rshim flashing protocol ([`flash`]).

pub mod flash;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use nacre_bfb::{ids, Bundle, ImageId};
use nacre_shared::table::Table;

const EXAMPLES: &str = "\
Examples:
  nacre-host image build -o nacre.bfb --kernel Image --initramfs initrd.cpio.gz \\
      --boot-args 'console=ttyAMA0 console=hvc0'
  nacre-host image build -o site.bfb --base DOCA_vendor.bfb --kernel Image --initramfs initrd.img \\
      --boot-args-file cmdline.txt     # vendor firmware kept byte for byte, our OS images put in
  nacre-host image inspect site.bfb
  nacre-host image verify site.bfb
  nacre-host image extract site.bfb -o out/
  nacre-host image flash --rshim /dev/rshim0 site.bfb --config bf.cfg

A BFB is a stream of images (ATF firmware, UEFI capsule, boot arguments, kernel, initramfs),
each a 24-byte header with a CRC-32, as Mellanox's mlx-mkbfb writes it.";

/// BlueField boot streams (BFB): build, inspect, verify, extract, flash over rshim.
#[derive(Subcommand, Debug)]
#[command(after_help = EXAMPLES)]
pub enum ImageCmd {
    /// Build a BFB from a kernel, an initramfs and boot arguments (optionally into a vendor BFB).
    #[command(after_help = "Examples:
  nacre-host image build -o nacre.bfb --kernel Image --initramfs initrd.cpio.gz \\
      --boot-args 'console=ttyAMA0 earlycon=pl011,0x9000000'
  nacre-host image build -o site.bfb --base DOCA_vendor.bfb --kernel Image \\
      --initramfs initrd.cpio.gz --boot-args-file cmdline.txt

The images get the ids the BlueField's UEFI reads them by: 62 (boot image), 63 (initramfs),
59 (boot arguments). With --base, every other image of the vendor BFB (ATF, certificates, UEFI
capsule, DDR tables...) is kept byte for byte; vendor images with our ids, all versions, are
replaced. The output is written to a temporary file and renamed, so a failed build leaves none.")]
    Build(BuildArgs),
    /// List the images of a BFB (id, name, version, length, CRC) after verifying it.
    #[command(after_help = "Examples:
  nacre-host image inspect nacre.bfb
  nacre-host image inspect nacre.bfb --json | jq '.[] | select(.id == 62)'")]
    Inspect(InspectArgs),
    /// Check every header, CRC-32 and following-images bitmap; exit 1 on the first problem.
    #[command(after_help = "Examples:
  nacre-host image verify nacre.bfb && echo good")]
    Verify(VerifyArgs),
    /// Write each image of a BFB to a file (names as `mlx-mkbfb -x` gives them: image-v0, ...).
    #[command(after_help = "Examples:
  nacre-host image extract nacre.bfb -o out/          # out/image-v0, out/initramfs-v0, ...
  nacre-host image extract vendor.bfb -o out/ --prefix dump-")]
    Extract(ExtractArgs),
    /// Install a BFB on a DPU through its rshim: stream it to <rshim>/boot and follow the boot log.
    #[command(after_help = flash::HELP)]
    Flash(flash::FlashArgs),
}

#[derive(Args, Debug)]
pub struct BuildArgs {
    /// Output file.
    #[arg(short, long, value_name = "OUT.bfb")]
    pub output: PathBuf,
    /// The arm64 Linux boot image (`Image`, an EFI stub kernel): image id 62.
    #[arg(long, value_name = "FILE")]
    pub kernel: PathBuf,
    /// The initramfs (a cpio archive, compressed or not): image id 63.
    #[arg(long, value_name = "FILE")]
    pub initramfs: PathBuf,
    /// The kernel command line: image id 59.
    #[arg(long, value_name = "ARGS", conflicts_with = "boot_args_file")]
    pub boot_args: Option<String>,
    /// Read the kernel command line from a file (one line; a trailing newline is dropped).
    #[arg(long, value_name = "FILE")]
    pub boot_args_file: Option<PathBuf>,
    /// A vendor BFB whose other images are kept byte for byte.
    #[arg(long, value_name = "VENDOR.bfb")]
    pub base: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    pub file: PathBuf,
}

#[derive(Args, Debug)]
pub struct VerifyArgs {
    pub file: PathBuf,
}

#[derive(Args, Debug)]
pub struct ExtractArgs {
    pub file: PathBuf,
    /// Directory to write into (created if missing).
    #[arg(short, long, default_value = ".", value_name = "DIR")]
    pub output: PathBuf,
    /// Prefix for every file name.
    #[arg(long, default_value = "")]
    pub prefix: String,
}

/// Run one `image` subcommand; returns the process exit status (errors are printed here, one
/// line each, as `nacre-host: ...`). `json` is nacre-host's global `--json`: `inspect` prints one
/// object per image instead of a table.
pub fn run(cmd: ImageCmd, json: bool) -> i32 {
    let res = match cmd {
        ImageCmd::Build(a) => build(&a).map(|()| 0),
        ImageCmd::Inspect(a) => inspect(&a, json).map(|()| 0),
        ImageCmd::Verify(a) => verify(&a).map(|()| 0),
        ImageCmd::Extract(a) => extract(&a).map(|()| 0),
        ImageCmd::Flash(a) => return flash::run(&a),
    };
    match res {
        Ok(code) => code,
        Err(e) => {
            eprintln!("nacre-host: {}", one_line(&e));
            1
        }
    }
}

/// An error chain on one line ("context: cause: cause").
pub fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}").replace('\n', " ")
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("{what} {}", path.display()))
}

fn build(a: &BuildArgs) -> Result<()> {
    let kernel = read(&a.kernel, "--kernel")?;
    let initramfs = read(&a.initramfs, "--initramfs")?;
    let args = match (&a.boot_args, &a.boot_args_file) {
        (Some(s), None) => s.clone(),
        (None, Some(f)) => {
            let s = String::from_utf8(read(f, "--boot-args-file")?)
                .with_context(|| format!("--boot-args-file {}: not UTF-8", f.display()))?;
            s.trim_end_matches(['\n', '\r']).to_string()
        }
        _ => bail!("give the kernel command line with --boot-args or --boot-args-file"),
    };
    if args.contains('\n') {
        bail!("boot arguments must be one line");
    }
    if kernel.is_empty() || initramfs.is_empty() {
        bail!("--kernel and --initramfs must not be empty");
    }
    let ours = vec![
        (ids::IMAGE, kernel),
        (ids::INITRAMFS, initramfs),
        (ids::BOOT_ARGS, args.into_bytes()),
    ];
    let bundle = match &a.base {
        Some(base) => Bundle::read(base)
            .with_context(|| format!("--base {}", base.display()))?
            .replace(ours)?,
        None => Bundle::build(ours)?,
    };
    bundle.write(&a.output)?;
    // read back what landed on disk: the file, not our memory, is what gets flashed
    let back = Bundle::read(&a.output).context("reading the new bundle back")?;
    if back != bundle {
        bail!(
            "{}: read back differs from what was written",
            a.output.display()
        );
    }
    println!(
        "{}: {} images, {} bytes",
        a.output.display(),
        back.images.len(),
        back.to_bytes().len()
    );
    Ok(())
}

fn open(path: &Path) -> Result<Bundle> {
    Bundle::read(path).map_err(|e| match e {
        nacre_bfb::Error::Io { .. } => anyhow::Error::new(e),
        e => anyhow::Error::new(e).context(path.display().to_string()),
    })
}

/// `mlx-mkbfb`'s image name (or `id N`) for listings.
fn label(id: ImageId) -> String {
    id.option_name()
        .map_or_else(|| format!("id{}", id.0), str::to_string)
}

fn inspect(a: &InspectArgs, json: bool) -> Result<()> {
    let b = open(&a.file)?;
    let entries = b.entries();
    if json {
        let v: Vec<serde_json::Value> = entries
            .iter()
            .map(|e| {
                let id = ImageId(e.header.image_id);
                serde_json::json!({
                    "offset": e.offset,
                    "id": id.0,
                    "name": id.option_name(),
                    "description": id.name(),
                    "version": e.header.cur_img_ver,
                    "next_version": e.header.next_img_ver,
                    "header_version": format!("{}.{}", e.header.major, e.header.minor),
                    "length": e.header.image_len,
                    "crc32": format!("{:08x}", e.header.image_crc),
                    "following_images": format!("{:#x}", e.header.following_images),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mut t = Table::new(&[
        "OFFSET",
        "ID",
        "NAME",
        "VER",
        "LENGTH",
        "CRC32",
        "DESCRIPTION",
    ])
    .right(&[0, 1, 3, 4]);
    for e in &entries {
        let id = ImageId(e.header.image_id);
        t.row(vec![
            e.offset.to_string(),
            id.0.to_string(),
            label(id),
            e.header.cur_img_ver.to_string(),
            e.header.image_len.to_string(),
            format!("{:08x}", e.header.image_crc),
            id.name().to_string(),
        ]);
    }
    t.print();
    println!(
        "{} images, {} bytes, every CRC-32 verified",
        entries.len(),
        b.images.iter().map(|i| i.stream_len()).sum::<u64>()
    );
    Ok(())
}

fn verify(a: &VerifyArgs) -> Result<()> {
    let b = open(&a.file)?;
    println!(
        "{}: OK ({} images; headers, CRC-32s and following-images bitmaps verified)",
        a.file.display(),
        b.images.len()
    );
    Ok(())
}

fn extract(a: &ExtractArgs) -> Result<()> {
    let b = open(&a.file)?;
    let files = b.extract(&a.output, &a.prefix)?;
    let mut t = Table::new(&[]).right(&[0]);
    for (f, img) in files.iter().zip(&b.images) {
        t.row(vec![img.data.len().to_string(), f.display().to_string()]);
    }
    t.print();
    Ok(())
}
