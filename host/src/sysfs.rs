//! The disks this host sees, read from sysfs (never from nvme-cli or udev).
//!
//! Linux's layout, as the NVMe host driver (drivers/nvme/host/core.c, sysfs.c) and
//! virtio_blk build it:
//! * `/sys/class/nvme/nvmeX/` — one per controller: `transport` (pcie, tcp, rdma, fc,
//!   loop), `address` (`traddr=…,trsvcid=…`), `state` (live, connecting, resetting, …),
//!   `subsysnqn`, `serial`, `model` (space padded).
//! * `/sys/block/nvmeXnY/` — one per namespace: `nsid`, `nguid`, `uuid`, `eui`, `wwid`,
//!   `size` (512-byte sectors). Its `device` is the controller (no native multipath) or the
//!   `nvme-subsysN` subsystem (native multipath, whose paths are the `nvmeXcYnZ` hidden
//!   disks); either way the controllers reaching it are the ones with its subsystem NQN.
//! * `/sys/block/vdX/` — virtio-blk: `serial` is the device's GET_ID string.
//!
//! Everything takes a root directory so tests read recorded trees instead of `/sys`.

use std::fs;
use std::path::{Path, PathBuf};

use serde::Serialize;

/// One path (controller) to an NVMe namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NvmePath {
    pub controller: String,
    pub transport: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    pub state: String,
}

/// A disk as the host sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Disk {
    pub name: String,
    pub size: u64,
    /// pcie, tcp, rdma, fc, loop (NVMe); virtio; scsi; other.
    pub transport: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subsysnqn: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nsid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nguid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eui64: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wwid: Option<String>,
    /// NVMe controllers reaching the namespace; empty for other disks.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<NvmePath>,
}

impl Disk {
    pub fn is_nvme(&self) -> bool {
        self.subsysnqn.is_some() || self.name.starts_with("nvme")
    }
}

/// A sysfs attribute: trimmed of the newline, NULs and the padding NVMe strings carry;
/// `None` when absent, unreadable or empty.
pub fn attr(path: &Path) -> Option<String> {
    let s = fs::read_to_string(path).ok()?;
    let s = s.trim_matches(|c: char| c.is_whitespace() || c == '\0');
    (!s.is_empty()).then(|| s.to_string())
}

/// `nvmeXcYnZ`: a multipath path device, not a disk of its own.
fn is_nvme_path_device(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("nvme") else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match rest.split_once('c') {
        Some((x, yz)) => match yz.split_once('n') {
            Some((y, z)) => digits(x) && digits(y) && digits(z),
            None => false,
        },
        None => false,
    }
}

/// The NVMe controllers under `root/class/nvme`, with their attributes.
struct Controller {
    name: String,
    dir: PathBuf,
    subsysnqn: Option<String>,
}

fn controllers(root: &Path) -> Vec<Controller> {
    let mut v: Vec<Controller> = fs::read_dir(root.join("class/nvme"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            let dir = e.path();
            Controller {
                name: e.file_name().to_string_lossy().into_owned(),
                subsysnqn: attr(&dir.join("subsysnqn")),
                dir,
            }
        })
        .collect();
    v.sort_by_key(|c| natural_key(&c.name));
    v
}

fn path_of(c: &Controller) -> NvmePath {
    NvmePath {
        controller: c.name.clone(),
        transport: attr(&c.dir.join("transport")).unwrap_or_else(|| "unknown".into()),
        address: attr(&c.dir.join("address")),
        state: attr(&c.dir.join("state")).unwrap_or_else(|| "unknown".into()),
    }
}

/// Sort `nvme10n1` after `nvme2n1`.
fn natural_key(s: &str) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut text = String::new();
    let mut num = String::new();
    for c in s.chars() {
        if c.is_ascii_digit() {
            num.push(c);
        } else {
            if !num.is_empty() {
                out.push((std::mem::take(&mut text), num.parse().unwrap_or(u64::MAX)));
                num.clear();
            }
            text.push(c);
        }
    }
    out.push((text, num.parse().unwrap_or(0)));
    out
}

/// Every disk under `root` (`/sys` on a live system): NVMe namespaces, virtio-blk and
/// other block devices backed by hardware. Virtual devices (loop, ram, dm, md, zram, which
/// have no `device` link), NVMe path devices and hidden disks are left out.
pub fn disks(root: &Path) -> Vec<Disk> {
    let ctrls = controllers(root);
    let mut names: Vec<String> = fs::read_dir(root.join("block"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort_by_key(|n| natural_key(n));
    let mut out = Vec::new();
    for name in names {
        let dir = root.join("block").join(&name);
        if is_nvme_path_device(&name)
            || attr(&dir.join("hidden")).as_deref() == Some("1")
            || !dir.join("device").exists()
            || name.starts_with("sr")
        {
            continue;
        }
        let size = attr(&dir.join("size"))
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0)
            .saturating_mul(512);
        let dev = dir.join("device");
        let mut d = Disk {
            name: name.clone(),
            size,
            transport: "other".into(),
            serial: None,
            model: None,
            subsysnqn: None,
            nsid: None,
            nguid: None,
            uuid: None,
            eui64: None,
            wwid: None,
            paths: Vec::new(),
        };
        if name.starts_with("nvme") {
            d.subsysnqn = attr(&dev.join("subsysnqn"));
            d.serial = attr(&dev.join("serial"));
            d.model = attr(&dev.join("model"));
            d.nsid = attr(&dir.join("nsid"))
                .and_then(|s| s.parse().ok())
                .or_else(|| name.rsplit_once('n').and_then(|(_, n)| n.parse().ok()));
            d.nguid = attr(&dir.join("nguid"));
            d.uuid = attr(&dir.join("uuid"));
            d.eui64 = attr(&dir.join("eui"));
            d.wwid = attr(&dir.join("wwid"));
            d.paths = if dev.join("transport").exists() {
                // No native multipath: `device` is the one controller.
                let cname = fs::canonicalize(&dev)
                    .ok()
                    .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .unwrap_or_default();
                let c = Controller {
                    name: cname,
                    dir: dev.clone(),
                    subsysnqn: None,
                };
                vec![path_of(&c)]
            } else {
                ctrls
                    .iter()
                    .filter(|c| c.subsysnqn.is_some() && c.subsysnqn == d.subsysnqn)
                    .map(path_of)
                    .collect()
            };
            let mut ts: Vec<String> = d.paths.iter().map(|p| p.transport.clone()).collect();
            ts.dedup();
            d.transport = if ts.is_empty() {
                "unknown".into()
            } else {
                ts.join("+")
            };
        } else if name.starts_with("vd")
            || attr(&dev.join("modalias")).is_some_and(|m| m.starts_with("virtio:"))
        {
            d.transport = "virtio".into();
            d.serial = attr(&dir.join("serial"));
        } else if name.starts_with("sd") {
            d.transport = "scsi".into();
            d.model = attr(&dev.join("model"));
            d.serial = attr(&dir.join("serial"));
        }
        out.push(d);
    }
    out
}

#[cfg(test)]
pub mod test_tree {
    //! Build recorded sysfs trees in a temporary directory.
    use std::path::Path;

    pub fn file(root: &Path, rel: &str, content: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }

    pub fn dir(root: &Path, rel: &str) {
        std::fs::create_dir_all(root.join(rel)).unwrap();
    }

    /// `rel` becomes a symlink to `target` (relative to `rel`'s directory, as in sysfs).
    pub fn link(root: &Path, rel: &str, target: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(target, p).unwrap();
    }
}

#[cfg(test)]
mod test {
    use super::test_tree::{dir, file, link};
    use super::*;

    /// A host with an NVMe/TCP namespace under native multipath (two controllers, one
    /// connecting), a local PCIe NVMe drive without multipath, a virtio-blk disk with a
    /// serial, a SATA disk and virtual devices, laid out as Linux 6.1 shows them.
    fn recorded() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        let sub = "devices/virtual/nvme-subsystem/nvme-subsys1";
        file(r, &format!("{sub}/subsysnqn"), "nqn.2024-01.io.nacre:t1\n");
        file(r, &format!("{sub}/serial"), "NACRE0123456789ABCDE\n");
        file(
            r,
            &format!("{sub}/model"),
            "nacre                                   \n",
        );
        for (c, addr, state) in [
            (
                "nvme1",
                "traddr=10.0.2.100,trsvcid=4420,src_addr=10.0.2.15",
                "live",
            ),
            ("nvme2", "traddr=10.0.2.101,trsvcid=4420", "connecting"),
        ] {
            let cd = format!("devices/virtual/nvme-fabrics/ctl/{c}");
            file(r, &format!("{cd}/transport"), "tcp\n");
            file(r, &format!("{cd}/address"), &format!("{addr}\n"));
            file(r, &format!("{cd}/state"), &format!("{state}\n"));
            file(r, &format!("{cd}/subsysnqn"), "nqn.2024-01.io.nacre:t1\n");
            link(r, &format!("class/nvme/{c}"), &format!("../../{cd}"));
        }
        let ns = format!("{sub}/nvme1n1");
        file(r, &format!("{ns}/size"), "2097152\n");
        file(r, &format!("{ns}/nsid"), "1\n");
        file(
            r,
            &format!("{ns}/nguid"),
            "5e0b3f7a-7d1c-4a8e-9b3e-2f6c1d0a4b77\n",
        );
        file(
            r,
            &format!("{ns}/uuid"),
            "5e0b3f7a-7d1c-4a8e-9b3e-2f6c1d0a4b77\n",
        );
        file(
            r,
            &format!("{ns}/wwid"),
            "uuid.5e0b3f7a-7d1c-4a8e-9b3e-2f6c1d0a4b77\n",
        );
        link(r, &format!("{ns}/device"), "../../nvme-subsys1");
        link(r, "block/nvme1n1", &format!("../{ns}"));
        // The path devices: hidden, not disks of their own.
        let p = "devices/virtual/nvme-fabrics/ctl/nvme1/nvme1c1n1";
        file(r, &format!("{p}/size"), "2097152\n");
        file(r, &format!("{p}/hidden"), "1\n");
        link(r, &format!("{p}/device"), "../../nvme1");
        link(r, "block/nvme1c1n1", &format!("../{p}"));
        // A local PCIe drive, no multipath.
        let c0 = "devices/pci0000:00/0000:00:04.0/nvme/nvme0";
        file(r, &format!("{c0}/transport"), "pcie\n");
        file(r, &format!("{c0}/address"), "0000:00:04.0\n");
        file(r, &format!("{c0}/state"), "live\n");
        file(r, &format!("{c0}/serial"), "S4EWNX0R123456      \n");
        file(r, &format!("{c0}/model"), "Samsung SSD 980 PRO 1TB\n");
        file(
            r,
            &format!("{c0}/subsysnqn"),
            "nqn.1994-11.com.samsung:nvme:980PRO:S4EWNX0R123456\n",
        );
        link(r, "class/nvme/nvme0", &format!("../../{c0}"));
        file(r, &format!("{c0}/nvme0n1/size"), "1953525168\n");
        file(r, &format!("{c0}/nvme0n1/eui"), "00 25 38 5a 11 b2 c3 d4\n");
        file(
            r,
            &format!("{c0}/nvme0n1/nguid"),
            "00000000-0000-0000-0000-000000000000\n",
        );
        link(r, &format!("{c0}/nvme0n1/device"), "../../nvme0");
        link(r, "block/nvme0n1", &format!("../{c0}/nvme0n1"));
        // virtio-blk with a nacre serial; a SATA disk; a loop device.
        let vd = "devices/pci0000:00/0000:00:05.0/virtio2/block/vda";
        file(r, &format!("{vd}/size"), "8388608\n");
        file(r, &format!("{vd}/serial"), "NACRE5E0B3F7A7D1C4A8\n");
        file(
            r,
            "devices/pci0000:00/0000:00:05.0/virtio2/modalias",
            "virtio:d00000002v00001AF4\n",
        );
        link(r, &format!("{vd}/device"), "../../../virtio2");
        link(r, "block/vda", &format!("../{vd}"));
        let sd = "devices/pci0000:00/0000:00:1f.2/ata1/host0/target0:0:0/0:0:0:0";
        file(r, &format!("{sd}/model"), "QEMU HARDDISK   \n");
        file(r, &format!("{sd}/block/sda/size"), "131072\n");
        link(r, &format!("{sd}/block/sda/device"), "../../../0:0:0:0");
        link(r, "block/sda", &format!("../{sd}/block/sda"));
        dir(r, "devices/virtual/block/loop0");
        file(r, "devices/virtual/block/loop0/size", "0\n");
        link(r, "block/loop0", "../devices/virtual/block/loop0");
        t
    }

    #[test]
    fn a_recorded_tree_reads_as_the_disks_the_host_has() {
        let t = recorded();
        let ds = disks(t.path());
        let names: Vec<&str> = ds.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["nvme0n1", "nvme1n1", "sda", "vda"]);

        let tcp = &ds[1];
        assert_eq!(tcp.transport, "tcp");
        assert_eq!(tcp.size, 1 << 30);
        assert_eq!(tcp.subsysnqn.as_deref(), Some("nqn.2024-01.io.nacre:t1"));
        assert_eq!(tcp.nsid, Some(1));
        assert_eq!(tcp.serial.as_deref(), Some("NACRE0123456789ABCDE"));
        assert_eq!(tcp.model.as_deref(), Some("nacre"));
        assert_eq!(
            tcp.nguid.as_deref(),
            Some("5e0b3f7a-7d1c-4a8e-9b3e-2f6c1d0a4b77")
        );
        let states: Vec<(&str, &str)> = tcp
            .paths
            .iter()
            .map(|p| (p.controller.as_str(), p.state.as_str()))
            .collect();
        assert_eq!(states, [("nvme1", "live"), ("nvme2", "connecting")]);
        assert_eq!(
            tcp.paths[0].address.as_deref(),
            Some("traddr=10.0.2.100,trsvcid=4420,src_addr=10.0.2.15")
        );

        let local = &ds[0];
        assert_eq!(local.transport, "pcie");
        assert_eq!(local.paths.len(), 1);
        assert_eq!(local.paths[0].controller, "nvme0");
        assert_eq!(local.eui64.as_deref(), Some("00 25 38 5a 11 b2 c3 d4"));
        assert_eq!(local.serial.as_deref(), Some("S4EWNX0R123456"));
        assert_eq!(
            local.nsid,
            Some(1),
            "from the name when there is no nsid file"
        );

        let vd = &ds[3];
        assert_eq!(vd.transport, "virtio");
        assert_eq!(vd.serial.as_deref(), Some("NACRE5E0B3F7A7D1C4A8"));
        assert_eq!(vd.size, 4 << 30);
        assert!(vd.paths.is_empty());

        assert_eq!(ds[2].transport, "scsi");
        assert_eq!(ds[2].model.as_deref(), Some("QEMU HARDDISK"));
    }

    #[test]
    fn an_empty_or_missing_tree_has_no_disks() {
        let t = tempfile::tempdir().unwrap();
        assert!(disks(t.path()).is_empty());
        assert!(disks(&t.path().join("nope")).is_empty());
    }

    #[test]
    fn path_device_names() {
        assert!(is_nvme_path_device("nvme0c1n1"));
        assert!(is_nvme_path_device("nvme12c3n45"));
        assert!(!is_nvme_path_device("nvme0n1"));
        assert!(!is_nvme_path_device("nvme0c1"));
        assert!(!is_nvme_path_device("vda"));
    }
}
