//! The emulated BlueField: the product's topology, host ↔ DPU, in two QEMU guests.
//!
//! `images/dpu/build` builds the DPU image (Debian's arm64 kernel, a busybox initramfs with
//! nacred and nacre from nacre's arm64 Debian package, boot arguments) into a BFB; `scripts/testbed-arm64` boots that BFB's own
//! images in qemu-system-aarch64 (-M virt -cpu cortex-a72, TCG), where /init starts nacred with
//! the embedded default on 192.0.2.2:4420. The x86 test-bed guest — the diskless host — shares a
//! QEMU socket network with it (127.0.0.1 only), runs `nvme connect`, sees nacre in `nvme list`,
//! and writes, reads back and (after a reconnect) re-reads data on the DPU's volume.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nacre_tests::daemon::bin;
use nacre_tests::testbed::{self, free_port, repo_root, skipped, Boot};

/// The DPU guest (scripts/testbed-arm64 boot), stopped with SIGTERM when dropped (the script
/// then stops QEMU).
struct Dpu {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Dpu {
    fn boot(bfb: &str, port: u16) -> Dpu {
        let mut child = Command::new(repo_root().join("scripts/testbed-arm64"))
            .args(["boot", bfb, "--timeout", "900", "--"])
            .arg("-netdev")
            .arg(format!("socket,id=dpu0,listen=127.0.0.1:{port}"))
            .args([
                "-device",
                "virtio-net-pci,netdev=dpu0,mac=52:54:00:c0:00:02",
            ])
            .env("NACRE_HOST_BIN", bin("nacre-host"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("scripts/testbed-arm64");
        let lines = Arc::new(Mutex::new(Vec::new()));
        for r in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(r).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(l);
                }
            });
        }
        Dpu { child, lines }
    }

    /// The first console line containing `needle`, within `timeout`.
    fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        let t = Instant::now();
        loop {
            if let Some(l) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.contains(needle))
            {
                return l.clone();
            }
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!(
                    "the DPU guest ended ({st}) before '{needle}':\n{}",
                    self.tail(60)
                );
            }
            assert!(
                t.elapsed() < timeout,
                "no '{needle}' from the DPU in {timeout:?}:\n{}",
                self.tail(60)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn tail(&self, n: usize) -> String {
        let l = self.lines.lock().unwrap();
        l[l.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Dpu {
    fn drop(&mut self) {
        // SAFETY: signalling our own child process by its pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while self.child.try_wait().ok().flatten().is_none()
            && t.elapsed() < Duration::from_secs(20)
        {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Seconds since QEMU started, from the host-side timestamp testbed-arm64 puts on each line.
fn stamp(line: &str) -> f64 {
    line.split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(f64::NAN)
}

#[test]
fn diskless_host_reaches_nacred_on_the_emulated_bluefield() {
    if skipped("diskless_host_reaches_nacred_on_the_emulated_bluefield") {
        return;
    }
    let _one = testbed::exclusive();
    testbed::setup().expect("scripts/testbed setup");

    let t = Instant::now();
    let out = Command::new(repo_root().join("images/dpu/build"))
        .env("NACRE_HOST_BIN", bin("nacre-host"))
        // The image's code as release has it, without LTO and at opt-level 1 (Cargo.toml's
        // image-test profile): what this test checks is behaviour, and the aarch64 build is
        // the suite's largest single cost.
        .env("NACRE_ARM64_PROFILE", "image-test")
        // scripts/test's runner sets it for libtest's per-test times; the aarch64 build must
        // see what a plain build sees (build scripts probe it), or it rebuilds from scratch.
        .env_remove("RUSTC_BOOTSTRAP")
        .stdin(Stdio::null())
        .output()
        .expect("images/dpu/build");
    assert!(
        out.status.success(),
        "images/dpu/build failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bfb = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap()
        .to_string();
    eprintln!(
        "DPU image {bfb} built in {:.0} s",
        t.elapsed().as_secs_f64()
    );
    // NVMe/RDMA on the DPU: nacred links libibverbs and librdmacm (it would not start in the
    // guest without them), and libibverbs dlopens its provider, which no NEEDED entry names:
    // the image must carry mlx5 (BlueField's ConnectX) and rxe, each with its .driver file,
    // all from Debian's arm64 packages.
    let manifest = std::fs::read_to_string(Path::new(&bfb).with_file_name("MANIFEST"))
        .expect("the image's MANIFEST");
    for (file, package) in [
        (
            "/usr/lib/aarch64-linux-gnu/libibverbs.so.1",
            "debian:libibverbs1",
        ),
        (
            "/usr/lib/aarch64-linux-gnu/librdmacm.so.1",
            "debian:librdmacm1",
        ),
        (
            "/usr/lib/aarch64-linux-gnu/libibverbs/libmlx5-rdmav34.so",
            "debian:ibverbs-providers",
        ),
        (
            "/usr/lib/aarch64-linux-gnu/libibverbs/librxe-rdmav34.so",
            "debian:ibverbs-providers",
        ),
        ("/etc/libibverbs.d/mlx5.driver", "debian:ibverbs-providers"),
        ("/etc/libibverbs.d/rxe.driver", "debian:ibverbs-providers"),
    ] {
        let line = manifest
            .lines()
            .find(|l| l.split(' ').next() == Some(file))
            .unwrap_or_else(|| panic!("the DPU image lacks {file}:\n{manifest}"));
        assert!(
            line.ends_with(package),
            "{file} is not from {package}: {line}"
        );
    }

    // One way in: the image's nacred and nacre are those of the arm64 Debian package, built
    // beside the BFB by scripts/package, whose control data must name arm64 and the libraries
    // the binaries load.
    let deb = std::fs::read_dir(Path::new(&bfb).parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with("nacre_") && n.ends_with("_arm64.deb")
        })
        .unwrap_or_else(|| panic!("images/dpu/build left no nacre_*_arm64.deb beside {bfb}"));
    let info = Command::new("dpkg-deb")
        .arg("-I")
        .arg(&deb)
        .output()
        .expect("dpkg-deb");
    assert!(
        info.status.success(),
        "dpkg-deb -I {}: {}",
        deb.display(),
        String::from_utf8_lossy(&info.stderr)
    );
    let info = String::from_utf8_lossy(&info.stdout);
    let field = |name: &str| {
        info.lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix(&format!("{name}: "))
                    .map(str::to_string)
            })
            .unwrap_or_else(|| panic!("{} has no {name} field:\n{info}", deb.display()))
    };
    assert_eq!(field("Architecture"), "arm64", "{}:\n{info}", deb.display());
    let depends = field("Depends");
    for lib in ["libc6 ", "libgcc-s1 ", "libibverbs1 ", "librdmacm1 "] {
        assert!(
            depends.split(", ").any(|d| d.starts_with(lib)),
            "{}'s Depends lacks {}: {depends}",
            deb.display(),
            lib.trim()
        );
    }
    let deb_name = deb.file_name().unwrap().to_string_lossy().into_owned();
    for file in ["/usr/sbin/nacred", "/usr/bin/nacre"] {
        let line = manifest
            .lines()
            .find(|l| l.split(' ').next() == Some(file))
            .unwrap_or_else(|| panic!("the DPU image lacks {file}:\n{manifest}"));
        assert!(
            line.ends_with(&format!("deb:{deb_name}")),
            "{file} is not from {deb_name}: {line}"
        );
    }

    let port = free_port().unwrap();
    let mut dpu = Dpu::boot(&bfb, port);
    let init = dpu.wait_for("NACRE-DPU init", Duration::from_secs(300));
    let ready = dpu.wait_for("nacred: ready", Duration::from_secs(300));
    dpu.wait_for("listens on 192.0.2.2:4420", Duration::from_secs(10));
    eprintln!(
        "emulated BlueField: /init at {:.1} s, nacred ready at {:.1} s after QEMU start",
        stamp(&init),
        stamp(&ready)
    );

    let host = Boot::new("dpu-host")
        .name("dpu-host")
        .param("mib", 8)
        .qemu([
            "-netdev".to_string(),
            format!("socket,id=dpu0,connect=127.0.0.1:{port}"),
            "-device".to_string(),
            "virtio-net-pci,netdev=dpu0,mac=52:54:00:c0:00:01".to_string(),
        ])
        .timeout(Duration::from_secs(400))
        .run()
        .expect("x86 host guest");
    if !host.success() {
        panic!(
            "the x86 host guest failed ({:?}):\n{}\n--- DPU console:\n{}",
            host.code(),
            host.tail(60),
            dpu.tail(60)
        );
    }
    assert_eq!(host.fact("model"), "nacre");
    assert_eq!(host.fact("ns1_bytes"), (1u64 << 30).to_string());
    assert_eq!(host.fact("verified"), "8MiB");
    assert_eq!(host.fact("reverified"), "8MiB");
    eprintln!(
        "x86 host reached the DPU {} s after its init; whole test {:.0} s",
        host.fact("dpu_reached_after"),
        t.elapsed().as_secs_f64()
    );
}
