//! PCIe distance between two functions, from the sysfs device tree, in the terms
//! `nvidia-smi topo -m` uses:
//!
//! | | the path between the two crosses … |
//! |---|---|
//! | PIX | at most one PCIe switch |
//! | PXB | several PCIe switches, but not a host bridge |
//! | PHB | a PCIe host bridge (different root ports of one root complex) |
//! | NODE | the interconnect between host bridges within one NUMA node |
//! | SYS | the SMP interconnect between NUMA nodes (QPI/UPI, xGMI) |
//!
//! `/sys/bus/pci/devices/BDF` links into `/sys/devices/pciDDDD:BB/<root port>/<switch
//! upstream port>/<switch downstream port>/…/<function>`: the directory names from the
//! root bus down are the bridges a transaction crosses. Below a root port, bridges come in
//! switch pairs (an upstream port, then one of its downstream ports), so a switch is named
//! by its upstream port: the bridge at an odd depth below the root port.

use std::collections::BTreeSet;
use std::path::Path;

use serde::Serialize;

/// How far apart two PCIe functions are (nearest first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Distance {
    #[serde(rename = "PIX")]
    Pix,
    #[serde(rename = "PXB")]
    Pxb,
    #[serde(rename = "PHB")]
    Phb,
    #[serde(rename = "NODE")]
    Node,
    #[serde(rename = "SYS")]
    Sys,
}

impl std::fmt::Display for Distance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Distance::Pix => "PIX",
            Distance::Pxb => "PXB",
            Distance::Phb => "PHB",
            Distance::Node => "NODE",
            Distance::Sys => "SYS",
        })
    }
}

/// Where a function sits in the PCIe tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub bdf: String,
    /// The root bus (`pci0000:00`): one host bridge.
    pub root: String,
    /// The bridges from the root port down, the function itself excluded.
    pub bridges: Vec<String>,
    /// `numa_node`; `None` when the platform reports -1 (no NUMA).
    pub numa: Option<u32>,
}

/// Whether `s` looks like a PCI function address `DDDD:BB:DD.F`.
pub fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.'
}

/// `00000000:3B:00.0` (NVML's 32-bit domain) or `3b:00.0` → `0000:3b:00.0`.
pub fn normalize_bdf(s: &str) -> String {
    let s = s.trim().to_ascii_lowercase();
    let parts: Vec<&str> = s.split(':').collect();
    match parts.as_slice() {
        [dom, bus, devfn] => {
            let dom = u32::from_str_radix(dom, 16).unwrap_or(0);
            format!("{dom:04x}:{bus}:{devfn}")
        }
        [bus, devfn] => format!("0000:{bus}:{devfn}"),
        _ => s,
    }
}

/// Locate `bdf` under `sys` (`/sys` on a live system).
pub fn locate(sys: &Path, bdf: &str) -> std::io::Result<Location> {
    let link = sys.join("bus/pci/devices").join(bdf);
    let real = std::fs::canonicalize(&link)?;
    let devices = std::fs::canonicalize(sys.join("devices"))?;
    let rel = real.strip_prefix(&devices).map_err(|_| {
        std::io::Error::other(format!("{} is not under the device tree", real.display()))
    })?;
    let mut parts = rel.iter().map(|c| c.to_string_lossy().into_owned());
    let root = parts
        .next()
        .filter(|r| r.starts_with("pci"))
        .ok_or_else(|| std::io::Error::other(format!("{bdf} is not below a PCI root bus")))?;
    let mut chain: Vec<String> = parts.filter(|p| is_bdf(p)).collect();
    chain.pop();
    let numa = crate::sysfs::attr(&real.join("numa_node"))
        .and_then(|s| s.parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok());
    Ok(Location {
        bdf: bdf.to_string(),
        root,
        bridges: chain,
        numa,
    })
}

/// The switches (named by their upstream port) the bridges `b[from..]` belong to. Depth 0
/// is the root port, which belongs to the host bridge, not a switch.
fn switches(b: &[String], from: usize, out: &mut BTreeSet<String>) {
    for i in from.max(1)..b.len() {
        let up = if i % 2 == 1 { i } else { i - 1 };
        out.insert(b[up].clone());
    }
}

/// The distance between two located functions.
pub fn distance(a: &Location, b: &Location) -> Distance {
    if a.root != b.root {
        return match (a.numa, b.numa) {
            (Some(x), Some(y)) if x != y => Distance::Sys,
            _ => Distance::Node,
        };
    }
    let common = a
        .bridges
        .iter()
        .zip(&b.bridges)
        .take_while(|(x, y)| x == y)
        .count();
    if common == 0 {
        // Different root ports (or root-complex integrated functions): through the host
        // bridge.
        return Distance::Phb;
    }
    let mut sw = BTreeSet::new();
    switches(&a.bridges, common - 1, &mut sw);
    switches(&b.bridges, common - 1, &mut sw);
    if sw.len() <= 1 {
        Distance::Pix
    } else {
        Distance::Pxb
    }
}

/// PCI functions of the DPU: NVIDIA/Mellanox (vendor or subsystem vendor 0x15b3), which
/// covers a BlueField's network functions and the NVMe and virtio-blk functions it emulates.
pub fn dpu_functions(sys: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(sys.join("bus/pci/devices"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let p = e.path();
            let is = |f: &str| crate::sysfs::attr(&p.join(f)).as_deref() == Some("0x15b3");
            is("vendor") || is("subsystem_vendor")
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::sysfs::test_tree::{file, link};

    /// Record a layout: each entry is a device path under `devices/` and its NUMA node;
    /// every path component that is a BDF gets its `bus/pci/devices` link, as in sysfs.
    fn layout(paths: &[(&str, i32)]) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        for (path, numa) in paths {
            let mut cur = String::from("devices");
            for comp in path.split('/') {
                cur = format!("{cur}/{comp}");
                file(r, &format!("{cur}/numa_node"), &format!("{numa}\n"));
                let l = r.join("bus/pci/devices").join(comp);
                if is_bdf(comp) && !l.exists() {
                    link(
                        r,
                        &format!("bus/pci/devices/{comp}"),
                        &format!("../../../{cur}"),
                    );
                }
            }
        }
        t
    }

    fn d(t: &tempfile::TempDir, a: &str, b: &str) -> Distance {
        let a = locate(t.path(), a).unwrap();
        let b = locate(t.path(), b).unwrap();
        let ab = distance(&a, &b);
        assert_eq!(ab, distance(&b, &a), "distance is symmetric");
        ab
    }

    #[test]
    fn gpu_and_nic_under_one_switch_are_pix() {
        // A PLX/Broadcom switch under root port 00:01.0: upstream 01:00.0, downstream ports
        // 02:00.0 (GPU) and 02:08.0 (ConnectX/BlueField, two functions).
        let t = layout(&[
            (
                "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0",
                0,
            ),
            (
                "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:04:00.0",
                0,
            ),
            (
                "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:04:00.1",
                0,
            ),
        ]);
        assert_eq!(d(&t, "0000:03:00.0", "0000:04:00.0"), Distance::Pix);
        assert_eq!(d(&t, "0000:04:00.0", "0000:04:00.1"), Distance::Pix);
        let l = locate(t.path(), "0000:03:00.0").unwrap();
        assert_eq!(l.root, "pci0000:00");
        assert_eq!(l.bridges, ["0000:00:01.0", "0000:01:00.0", "0000:02:00.0"]);
        assert_eq!(l.numa, Some(0));
    }

    #[test]
    fn two_levels_of_switches_are_pxb_unless_under_the_same_lower_switch() {
        // DGX A100-like: root port 00:01.1 → upstream 0b:00.0 → downstream 0c:00.0 →
        // lower switch upstream 0d:00.0 → downstream 0e:00.0 (GPU 0f:00.0) and 0e:08.0 (NIC
        // 10:00.0); another lower switch under 0c:04.0 holds a second NIC.
        let base = "pci0000:00/0000:00:01.1/0000:0b:00.0";
        let t = layout(&[
            (
                &format!("{base}/0000:0c:00.0/0000:0d:00.0/0000:0e:00.0/0000:0f:00.0"),
                1,
            ),
            (
                &format!("{base}/0000:0c:00.0/0000:0d:00.0/0000:0e:08.0/0000:10:00.0"),
                1,
            ),
            (
                &format!("{base}/0000:0c:04.0/0000:11:00.0/0000:12:00.0/0000:13:00.0"),
                1,
            ),
        ]);
        assert_eq!(d(&t, "0000:0f:00.0", "0000:10:00.0"), Distance::Pix);
        assert_eq!(d(&t, "0000:0f:00.0", "0000:13:00.0"), Distance::Pxb);
    }

    #[test]
    fn across_root_ports_is_phb() {
        // GPU behind root port 00:02.0, BlueField directly on root port 00:03.0.
        let t = layout(&[
            ("pci0000:00/0000:00:02.0/0000:17:00.0", 0),
            ("pci0000:00/0000:00:03.0/0000:18:00.0", 0),
            ("pci0000:00/0000:00:03.0/0000:18:00.1", 0),
        ]);
        assert_eq!(d(&t, "0000:17:00.0", "0000:18:00.0"), Distance::Phb);
        assert_eq!(d(&t, "0000:18:00.0", "0000:18:00.1"), Distance::Pix);
    }

    #[test]
    fn across_host_bridges_is_node_within_a_socket_and_sys_across_sockets() {
        // Two-socket server: root buses 0000:00 and 0000:3a on node 0, 0000:ae on node 1.
        let t = layout(&[
            ("pci0000:00/0000:00:01.0/0000:01:00.0", 0),
            ("pci0000:3a/0000:3a:00.0/0000:3b:00.0", 0),
            ("pci0000:ae/0000:ae:00.0/0000:af:00.0", 1),
        ]);
        assert_eq!(d(&t, "0000:01:00.0", "0000:3b:00.0"), Distance::Node);
        assert_eq!(d(&t, "0000:01:00.0", "0000:af:00.0"), Distance::Sys);
        assert_eq!(d(&t, "0000:3b:00.0", "0000:af:00.0"), Distance::Sys);
    }

    #[test]
    fn no_numa_information_counts_as_one_node() {
        let t = layout(&[
            ("pci0000:00/0000:00:01.0/0000:01:00.0", -1),
            ("pci0000:80/0000:80:01.0/0000:81:00.0", -1),
        ]);
        assert_eq!(d(&t, "0000:01:00.0", "0000:81:00.0"), Distance::Node);
        assert_eq!(locate(t.path(), "0000:01:00.0").unwrap().numa, None);
    }

    #[test]
    fn a_missing_function_is_an_error_not_a_panic() {
        let t = layout(&[("pci0000:00/0000:00:01.0", 0)]);
        assert!(locate(t.path(), "0000:99:00.0").is_err());
    }

    #[test]
    fn dpu_functions_are_found_by_vendor() {
        let t = layout(&[
            ("pci0000:00/0000:00:01.0/0000:01:00.0", 0),
            ("pci0000:00/0000:00:02.0/0000:02:00.0", 0),
            ("pci0000:00/0000:00:02.0/0000:02:00.2", 0),
        ]);
        let dev = |b: &str| format!("devices/pci0000:00/{b}");
        file(
            t.path(),
            &format!("{}/vendor", dev("0000:00:01.0/0000:01:00.0")),
            "0x10de\n",
        );
        file(
            t.path(),
            &format!("{}/vendor", dev("0000:00:02.0/0000:02:00.0")),
            "0x15b3\n",
        );
        file(
            t.path(),
            &format!("{}/vendor", dev("0000:00:02.0/0000:02:00.2")),
            "0x1af4\n",
        );
        file(
            t.path(),
            &format!("{}/subsystem_vendor", dev("0000:00:02.0/0000:02:00.2")),
            "0x15b3\n",
        );
        assert_eq!(dpu_functions(t.path()), ["0000:02:00.0", "0000:02:00.2"]);
    }

    #[test]
    fn bdf_forms() {
        assert_eq!(normalize_bdf("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bdf("3b:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bdf("0001:af:00.1"), "0001:af:00.1");
    }
}
