//! `nacre-host image` against an independent reader: scripts/bfb-reader.py, a Python reader and
//! writer of the documented BFB layout that shares no code with nacre-bfb. Both must agree on
//! every header field of our bundles, reject the same corruptions, and a bundle the Python side
//! writes must be byte for byte the one we build.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use nacre_tests::daemon::bin;
use nacre_tests::testbed::repo_root;
use serde_json::Value;

/// python3 runs the independent reader; without it these tests fail, saying so
/// (`scripts/setup --test` installs it).
fn require_python() {
    let ok = Command::new("python3")
        .arg("-c")
        .arg("import zlib, struct")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "python3 (with zlib and struct) is missing: the independent BFB reader \
         scripts/bfb-reader.py cannot run (scripts/setup --test installs python3)"
    );
}

fn reader(args: &[&str]) -> Output {
    Command::new("python3")
        .arg(repo_root().join("scripts/bfb-reader.py"))
        .args(args)
        .output()
        .unwrap()
}

fn host(args: &[&str]) -> Output {
    Command::new(bin("nacre-host"))
        .arg("image")
        .args(args)
        .output()
        .unwrap()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

struct Inputs {
    dir: tempfile::TempDir,
    kernel: PathBuf,
    initramfs: PathBuf,
    args: &'static str,
}

fn inputs() -> Inputs {
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("Image");
    let initramfs = dir.path().join("initramfs.cpio");
    // lengths that need padding (not multiples of 8), content that is not all zeros
    std::fs::write(
        &kernel,
        (0..70_001u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    std::fs::write(
        &initramfs,
        (0..33_333u32).map(|i| (i % 253) as u8).collect::<Vec<_>>(),
    )
    .unwrap();
    Inputs {
        dir,
        kernel,
        initramfs,
        args: "console=ttyAMA0 earlycon quiet",
    }
}

fn build(i: &Inputs, out: &Path, base: Option<&Path>) {
    let mut a = vec![
        "build",
        "-o",
        s(out),
        "--kernel",
        s(&i.kernel),
        "--initramfs",
        s(&i.initramfs),
        "--boot-args",
        i.args,
    ];
    if let Some(b) = base {
        a.extend(["--base", s(b)]);
    }
    ok(&host(&a));
}

#[test]
fn our_bundle_reads_the_same_in_the_independent_reader() {
    require_python();
    let i = inputs();
    let out = i.dir.path().join("nacre.bfb");
    build(&i, &out, None);

    // every header field agrees
    let ours: Value = serde_json::from_str(&ok(&host(&["inspect", "--json", s(&out)]))).unwrap();
    let theirs: Value = serde_json::from_str(&ok(&reader(&["json", s(&out)]))).unwrap();
    let (ours, theirs) = (ours.as_array().unwrap(), theirs.as_array().unwrap());
    assert_eq!(ours.len(), 3);
    assert_eq!(ours.len(), theirs.len());
    for (o, t) in ours.iter().zip(theirs) {
        assert_eq!(o["offset"], t["offset"]);
        assert_eq!(o["id"], t["id"]);
        assert_eq!(o["version"], t["version"]);
        assert_eq!(o["next_version"], t["next_version"]);
        assert_eq!(o["length"], t["length"]);
        assert_eq!(
            o["crc32"].as_str().unwrap(),
            format!("{:08x}", t["crc32"].as_u64().unwrap())
        );
        assert_eq!(
            o["following_images"].as_str().unwrap(),
            format!("{:#x}", t["following"].as_u64().unwrap())
        );
    }
    let ids: Vec<u64> = theirs.iter().map(|t| t["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, vec![59, 62, 63]);
    ok(&reader(&["check", s(&out)]));

    // extract (both tools) returns every image byte for byte
    let ex = i.dir.path().join("ours");
    ok(&host(&["extract", s(&out), "-o", s(&ex)]));
    let px = i.dir.path().join("theirs");
    ok(&reader(&["extract", s(&out), s(&px)]));
    for d in [&ex, &px] {
        assert_eq!(
            std::fs::read(d.join("image-v0")).unwrap(),
            std::fs::read(&i.kernel).unwrap()
        );
        assert_eq!(
            std::fs::read(d.join("initramfs-v0")).unwrap(),
            std::fs::read(&i.initramfs).unwrap()
        );
        assert_eq!(
            std::fs::read(d.join("boot-args-v0")).unwrap(),
            i.args.as_bytes()
        );
    }

    // the independent writer, given the same images, writes the same bytes
    let py = i.dir.path().join("py.bfb");
    ok(&reader(&[
        "make",
        s(&py),
        &format!("63={}", s(&i.initramfs)),
        &format!("59=={}", i.args),
        &format!("62={}", s(&i.kernel)),
    ]));
    assert!(
        std::fs::read(&py).unwrap() == std::fs::read(&out).unwrap(),
        "the Python writer and nacre-host built different bytes"
    );
}

#[test]
fn corruptions_are_one_line_errors_in_both_readers() {
    require_python();
    let i = inputs();
    let out = i.dir.path().join("nacre.bfb");
    build(&i, &out, None);
    let good = std::fs::read(&out).unwrap();
    let second = 24 + 32; // boot args: 30 bytes + 2 padding
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "crc",
            {
                let mut b = good.clone();
                b[second + 24 + 1000] ^= 0x40;
                b
            },
            "CRC mismatch",
        ),
        ("truncated", good[..good.len() - 100].to_vec(), "truncated"),
        (
            "truncated-header",
            good[..second + 12].to_vec(),
            "truncated BFB header",
        ),
        (
            "magic",
            {
                let mut b = good.clone();
                b[second + 2] = 0;
                b
            },
            "bad magic",
        ),
        (
            "version",
            {
                let mut b = good.clone();
                b[4] = 0x22;
                b
            },
            "unsupported BFB header version 2.2",
        ),
        (
            "minor",
            {
                let mut b = good.clone();
                b[4] = 0x31;
                b
            },
            "unsupported BFB header version 1.3",
        ),
    ];
    for (name, bytes, want) in cases {
        let p = i.dir.path().join(format!("{name}.bfb"));
        std::fs::write(&p, &bytes).unwrap();
        for cmd in ["verify", "inspect", "extract"] {
            let x = i.dir.path().join("x");
            let o = match cmd {
                "extract" => host(&[cmd, s(&p), "-o", s(&x)]),
                _ => host(&[cmd, s(&p)]),
            };
            assert_eq!(o.status.code(), Some(1), "{name} {cmd}");
            let e = String::from_utf8_lossy(&o.stderr);
            assert_eq!(e.lines().count(), 1, "{name} {cmd}: {e}");
            assert!(
                e.starts_with("nacre-host: ") && e.contains(want),
                "{name} {cmd}: {e}"
            );
        }
        let o = reader(&["check", s(&p)]);
        assert_eq!(o.status.code(), Some(1), "python reader accepted {name}");
    }
}

#[test]
fn a_vendor_bundle_keeps_its_firmware_byte_for_byte() {
    require_python();
    let i = inputs();
    let d = i.dir.path();
    for (f, n) in [
        ("bl2", 4000usize),
        ("bl31", 12_345),
        ("bl33", 99_999),
        ("capsule", 7),
    ] {
        std::fs::write(
            d.join(f),
            (0..n).map(|k| (k * 13 + f.len()) as u8).collect::<Vec<_>>(),
        )
        .unwrap();
    }
    let vendor = d.join("vendor.bfb");
    ok(&reader(&[
        "make",
        s(&vendor),
        &format!("1={}", s(&d.join("bl2"))),
        &format!("3={}", s(&d.join("bl31"))),
        &format!("5={}", s(&d.join("bl33"))),
        &format!("52={}", s(&d.join("capsule"))),
        "59==vendor args",
        "62==vendor kernel",
        "63==vendor initramfs",
    ]));
    let out = d.join("site.bfb");
    build(&i, &out, Some(&vendor));
    ok(&reader(&["check", s(&out)]));
    let v = std::fs::read(&vendor).unwrap();
    let o = std::fs::read(&out).unwrap();
    // the four firmware images come first in both; their headers and data are identical
    let theirs: Value = serde_json::from_str(&ok(&reader(&["json", s(&vendor)]))).unwrap();
    let fw_end = theirs[4]["offset"].as_u64().unwrap() as usize;
    assert!(o[..fw_end] == v[..fw_end], "vendor firmware bytes changed");
    let ids: Vec<u64> = serde_json::from_str::<Value>(&ok(&reader(&["json", s(&out)])))
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, vec![1, 3, 5, 52, 59, 62, 63]);
    let px = d.join("px");
    ok(&reader(&["extract", s(&out), s(&px)]));
    assert_eq!(
        std::fs::read(px.join("image-v0")).unwrap(),
        std::fs::read(&i.kernel).unwrap()
    );
    assert_eq!(
        std::fs::read(px.join("boot-args-v0")).unwrap(),
        i.args.as_bytes()
    );
}

#[test]
fn every_image_subcommand_teaches_with_examples() {
    for sub in ["build", "inspect", "verify", "extract", "flash"] {
        let o = host(&[sub, "--help"]);
        let s = ok(&o);
        assert!(s.contains("Examples:\n  nacre-host image"), "{sub}: {s}");
    }
    let o = host(&["build", "--kernel", "k"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "a malformed command line is exit 2"
    );
    let o = host(&["verify", "/nonexistent/x.bfb"]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.starts_with("nacre-host: /nonexistent/x.bfb: ") && e.lines().count() == 1,
        "{e}"
    );
}
