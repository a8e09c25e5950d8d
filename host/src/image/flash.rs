//! `nacre-host image flash`: install a BFB through a DPU's rshim, as `bfb-install`
//! (rshim-user-space) does.
//!
//! The rshim protocol, host side:
//! 1. `<rshim>/boot` takes the boot stream. The driver feeds the DPU's boot FIFO in 8-byte words
//!    (`rshim_boot_write` buffers a partial word; `rshim_boot_release` pads it with zeros), so we
//!    write 8-byte-aligned chunks and zero-pad the end of the stream (BFB, then the optional
//!    `bf.cfg`) ourselves: what reaches the FIFO is the same, and no write leaves a partial word.
//!    A write interrupted by a signal (EINTR) is retried; EAGAIN and a 0-byte write (the driver's
//!    "the DPU has not drained the FIFO yet") are retried after a pause until the silence timeout;
//!    ETIMEDOUT is the driver's own boot timeout (the DPU stopped taking data): it ends the flash.
//! 2. `<rshim>/misc` takes commands (`DISPLAY_LEVEL 2` shows the boot log, `SW_RESET 1` resets the
//!    Arm cores) and, read, shows the settings and the DPU's boot log. We snapshot it before the
//!    push, so a success line left by an earlier boot is never taken for this one, then follow
//!    the new lines until a success line, a failure line, or silence past `--timeout`.

use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use nacre_bfb::Bundle;

pub const HELP: &str = "\
Examples:
  nacre-host image flash --rshim /dev/rshim0 nacre.bfb
  nacre-host image flash --rshim /dev/rshim0 nacre.bfb --config bf.cfg --reset --timeout 1800

The BFB is verified (every CRC-32) before anything is written. The stream (BFB, then bf.cfg,
zero-padded to 8 bytes) goes to <rshim>/boot in 8-byte-aligned chunks with a progress bar;
then `DISPLAY_LEVEL 2` is set in <rshim>/misc and the DPU's boot log is followed there.

Verdict, one line, and exit status:
  0  a success line: 'Rebooting...', 'DPU is ready' or 'Linux up'
  1  a failure line (starting ERR or ASSERT, or saying 'error', 'failed' or 'panic'),
     an unreadable or corrupt BFB, or an rshim write error (e.g. its boot timeout)
  3  no new log line for --timeout seconds (the DPU's state is unknown)
  2  a malformed command line";

#[derive(Args, Debug)]
pub struct FlashArgs {
    /// The rshim device directory (holds `boot` and `misc`).
    #[arg(long, value_name = "DIR", default_value = "/dev/rshim0")]
    pub rshim: PathBuf,
    /// The BFB to install.
    pub file: PathBuf,
    /// A bf.cfg appended to the stream (read by the BFB's installer).
    #[arg(long, value_name = "bf.cfg")]
    pub config: Option<PathBuf>,
    /// Reset the DPU's Arm cores first (`SW_RESET 1` to <rshim>/misc).
    #[arg(long)]
    pub reset: bool,
    /// Give up after this many seconds without a new log line (or without progress writing).
    #[arg(long, value_name = "SECONDS", default_value_t = 900)]
    pub timeout: u64,
}

/// How much goes to `boot` per write: a multiple of 8 (one FIFO word).
pub const CHUNK: usize = 256 * 1024;
const _: () = assert!(CHUNK % 8 == 0);
/// How often `misc` is read, and the pause before retrying EAGAIN / a 0-byte write.
const POLL: Duration = Duration::from_millis(200);
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// A line of the boot log that means the install finished (`bfb-install`'s filter).
pub fn is_success(line: &str) -> bool {
    ["Rebooting...", "DPU is ready", "Linux up"]
        .iter()
        .any(|s| line.contains(s))
}

/// A line of the boot log that means the install failed: the rshim log's ERR/ASSERT levels, or
/// an installer message saying so.
pub fn is_failure(line: &str) -> bool {
    let t = line.trim_start();
    let l = t.to_ascii_lowercase();
    t.starts_with("ERR")
        || t.starts_with("ASSERT")
        || l.contains("error")
        || l.contains("failed")
        || l.contains("panic")
}

/// Why a stream stopped.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("the DPU stopped taking the boot stream after {written} of {total} bytes (rshim boot timeout, ETIMEDOUT): is it powered, and is this its rshim?")]
    DpuTimeout { written: u64, total: u64 },
    #[error("no progress writing the boot stream for {secs} s after {written} of {total} bytes")]
    Stalled { written: u64, total: u64, secs: u64 },
    #[error("writing the boot stream after {written} of {total} bytes: {source}")]
    Io {
        written: u64,
        total: u64,
        #[source]
        source: io::Error,
    },
}

/// Write `parts` (then zero padding to a multiple of 8) to `w` in [`CHUNK`]-sized,
/// 8-byte-aligned writes. `progress` is called with the bytes written so far.
pub fn stream(
    w: &mut impl Write,
    parts: &[&[u8]],
    stall: Duration,
    mut progress: impl FnMut(u64),
) -> Result<u64, StreamError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let pad = [0u8; 8];
    let pad = &pad[..(8 - len % 8) % 8];
    let total = (len + pad.len()) as u64;
    let mut src = parts
        .iter()
        .fold(Box::new(io::empty()) as Box<dyn Read>, |r, p| {
            Box::new(r.chain(*p))
        })
        .chain(pad);
    let mut buf = vec![0u8; CHUNK];
    let mut written = 0u64;
    loop {
        // fill a whole chunk (the last one is shorter, still a multiple of 8)
        let mut n = 0;
        while n < CHUNK {
            let r = src.read(&mut buf[n..]).expect("reading memory");
            if r == 0 {
                break;
            }
            n += r;
        }
        if n == 0 {
            return Ok(written);
        }
        debug_assert_eq!(n % 8, 0);
        let mut chunk = &buf[..n];
        let mut last_progress = Instant::now();
        while !chunk.is_empty() {
            let stalled = |written| StreamError::Stalled {
                written,
                total,
                secs: stall.as_secs(),
            };
            match w.write(chunk) {
                Ok(0) => {
                    // rshim: the FIFO is full and the DPU has not drained it yet
                    if last_progress.elapsed() > stall {
                        return Err(stalled(written));
                    }
                    std::thread::sleep(RETRY_PAUSE);
                }
                Ok(k) => {
                    chunk = &chunk[k..];
                    written += k as u64;
                    last_progress = Instant::now();
                    progress(written);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if last_progress.elapsed() > stall {
                        return Err(stalled(written));
                    }
                    std::thread::sleep(RETRY_PAUSE);
                }
                Err(e) if e.raw_os_error() == Some(libc::ETIMEDOUT) => {
                    return Err(StreamError::DpuTimeout { written, total });
                }
                Err(source) => {
                    return Err(StreamError::Io {
                        written,
                        total,
                        source,
                    })
                }
            }
        }
    }
}

/// The outcome of following the boot log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Success(String),
    Failure(String),
    Silence { secs: u64, last: Option<String> },
}

/// Follows `<rshim>/misc`: each read shows the whole log; new lines are those past what the
/// previous read (or the snapshot taken before the push) showed. A log that no longer starts
/// with the previous one was cleared (the DPU reset): all of it is new.
pub struct LogFollower {
    misc: PathBuf,
    seen: Vec<String>,
}

impl LogFollower {
    pub fn new(misc: &Path) -> Result<LogFollower> {
        let mut f = LogFollower {
            misc: misc.to_path_buf(),
            seen: Vec::new(),
        };
        f.seen = f.read()?;
        Ok(f)
    }

    fn read(&self) -> Result<Vec<String>> {
        let bytes = std::fs::read(&self.misc)
            .with_context(|| format!("reading {}", self.misc.display()))?;
        Ok(String::from_utf8_lossy(&bytes)
            .lines()
            .map(|l| l.trim_end().to_string())
            .filter(|l| !l.trim().is_empty())
            .collect())
    }

    /// New lines since the last call.
    pub fn poll(&mut self) -> Result<Vec<String>> {
        let cur = self.read()?;
        let new = if cur.len() >= self.seen.len() && cur[..self.seen.len()] == self.seen[..] {
            cur[self.seen.len()..].to_vec()
        } else {
            cur.clone()
        };
        self.seen = cur;
        Ok(new)
    }

    /// Follow until a verdict; every new line goes to `echo`.
    pub fn follow(&mut self, silence: Duration, mut echo: impl FnMut(&str)) -> Result<Verdict> {
        let mut last_line = Instant::now();
        let mut last: Option<String> = None;
        loop {
            for l in self.poll()? {
                echo(&l);
                last_line = Instant::now();
                if is_failure(&l) {
                    return Ok(Verdict::Failure(l));
                }
                if is_success(&l) {
                    return Ok(Verdict::Success(l));
                }
                last = Some(l);
            }
            if last_line.elapsed() > silence {
                return Ok(Verdict::Silence {
                    secs: silence.as_secs(),
                    last,
                });
            }
            std::thread::sleep(POLL);
        }
    }
}

/// Write one command line to `<rshim>/misc`.
fn misc_command(misc: &Path, cmd: &str) -> Result<()> {
    let mut f = OpenOptions::new()
        .append(true)
        .open(misc)
        .with_context(|| format!("opening {}", misc.display()))?;
    f.write_all(format!("{cmd}\n").as_bytes())
        .with_context(|| format!("writing '{cmd}' to {}", misc.display()))
}

/// The whole flash; returns the exit status after printing the verdict.
pub fn run(a: &FlashArgs) -> i32 {
    match flash(a) {
        Ok(Verdict::Success(l)) => {
            println!(
                "nacre-host: flashed {}: the DPU says '{}'",
                a.file.display(),
                l.trim()
            );
            0
        }
        Ok(Verdict::Failure(l)) => {
            eprintln!(
                "nacre-host: flash of {} failed: the DPU says '{}'",
                a.file.display(),
                l.trim()
            );
            1
        }
        Ok(Verdict::Silence { secs, last }) => {
            eprintln!(
                "nacre-host: flash of {}: no word from the DPU for {secs} s (last line: {}); its state is unknown, see <rshim>/misc",
                a.file.display(),
                last.map_or("none".to_string(), |l| format!("'{}'", l.trim()))
            );
            3
        }
        Err(e) => {
            eprintln!("nacre-host: {}", super::one_line(&e));
            1
        }
    }
}

fn flash(a: &FlashArgs) -> Result<Verdict> {
    let bfb = std::fs::read(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    Bundle::parse(&bfb).with_context(|| format!("{}: refusing to flash", a.file.display()))?;
    let cfg = match &a.config {
        Some(p) => std::fs::read(p).with_context(|| format!("--config {}", p.display()))?,
        None => Vec::new(),
    };
    let boot = a.rshim.join("boot");
    let misc = a.rshim.join("misc");
    if !boot.exists() || !misc.exists() {
        anyhow::bail!(
            "{}: no rshim device there (need boot and misc; is the rshim service running?)",
            a.rshim.display()
        );
    }
    if a.reset {
        misc_command(&misc, "SW_RESET 1")?;
    }
    misc_command(&misc, "DISPLAY_LEVEL 2")?;
    let mut follower = LogFollower::new(&misc)?;

    let total = bfb.len() + cfg.len();
    let bar = ProgressBar::new(total.div_ceil(8) as u64 * 8);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("boot stream -> {}", boot.display()));
    let mut w = OpenOptions::new()
        .write(true)
        .open(&boot)
        .with_context(|| format!("opening {}", boot.display()))?;
    let stall = Duration::from_secs(a.timeout);
    let res = stream(&mut w, &[&bfb, &cfg], stall, |n| bar.set_position(n));
    bar.finish_and_clear();
    res?;
    // closing boot ends the stream (the driver flushes its last word then)
    drop(w);
    eprintln!(
        "nacre-host: {} bytes sent to {}; following {}",
        total,
        boot.display(),
        misc.display()
    );
    follower.follow(stall, |l| println!("{l}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that answers as a busy rshim does: signals, a full FIFO, short writes.
    struct Rshim {
        script: Vec<io::Result<usize>>,
        got: Vec<u8>,
        writes: Vec<usize>,
    }

    impl Write for Rshim {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            assert_eq!(buf.len() % 8, 0, "a write of {} bytes", buf.len());
            let r = if self.script.is_empty() {
                Ok(buf.len())
            } else {
                self.script.remove(0)
            };
            if let Ok(n) = r {
                let n = n.min(buf.len());
                self.got.extend_from_slice(&buf[..n]);
                self.writes.push(n);
                return Ok(n);
            }
            r
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn retries_eintr_eagain_zero_and_short_writes() {
        let bfb = data(3 * CHUNK + 800);
        let cfg = b"ENABLE_SFC_HBN=yes\n".to_vec();
        let mut w = Rshim {
            script: vec![
                Err(io::Error::from_raw_os_error(libc::EINTR)),
                Err(io::Error::from_raw_os_error(libc::EAGAIN)),
                Ok(0),
                Ok(4096),
                Err(io::Error::from_raw_os_error(libc::EINTR)),
            ],
            got: vec![],
            writes: vec![],
        };
        let mut seen = 0;
        let n = stream(&mut w, &[&bfb, &cfg], Duration::from_secs(5), |p| seen = p).unwrap();
        let mut want = bfb.clone();
        want.extend(&cfg);
        want.resize(want.len().div_ceil(8) * 8, 0);
        assert_eq!(w.got, want);
        assert_eq!(n, want.len() as u64);
        assert_eq!(seen, n);
        assert!(w.writes.contains(&4096));
    }

    #[test]
    fn etimedout_ends_the_stream_with_a_clear_error() {
        let mut w = Rshim {
            script: vec![
                Ok(CHUNK),
                Err(io::Error::from_raw_os_error(libc::ETIMEDOUT)),
            ],
            got: vec![],
            writes: vec![],
        };
        let e = stream(&mut w, &[&data(2 * CHUNK)], Duration::from_secs(5), |_| {}).unwrap_err();
        assert!(matches!(e, StreamError::DpuTimeout { written, .. } if written == CHUNK as u64));
        assert!(e.to_string().contains("rshim boot timeout"));
    }

    #[test]
    fn a_fifo_that_never_drains_is_a_stall_not_a_hang() {
        let mut w = Rshim {
            script: (0..10_000)
                .map(|_| Err(io::Error::from_raw_os_error(libc::EAGAIN)))
                .collect(),
            got: vec![],
            writes: vec![],
        };
        let e = stream(&mut w, &[&data(64)], Duration::from_millis(100), |_| {}).unwrap_err();
        assert!(matches!(e, StreamError::Stalled { written: 0, .. }), "{e}");
    }

    #[test]
    fn log_lines_are_classified() {
        assert!(is_success(" INFO[MISC]: Linux up"));
        assert!(is_success("INFO[BL31]: Rebooting..."));
        assert!(is_success(" INFO[MISC]: DPU is ready"));
        assert!(is_failure(" ERR[BL2]: DDR training failed"));
        assert!(is_failure(" INFO[MISC]: Installation failed"));
        assert!(is_failure("ASSERT[BL31]: something"));
        assert!(!is_failure(" INFO[BL2]: start"));
        assert!(!is_success("DISPLAY_LEVEL 2"));
        assert!(!is_failure("DISPLAY_LEVEL 2"));
    }
}
