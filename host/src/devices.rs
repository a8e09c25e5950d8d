//! `nacre-host devices`: every disk this host sees, and the nacre volume behind each.

use anyhow::Result;
use nacre_shared::api::host::{DeviceMatch, MatchedVolume, SeenDevice};
use nacre_shared::size::format_size;
use nacre_shared::table::Table;
use serde::Serialize;
use serde_json::json;

use crate::sysfs::{self, Disk};
use crate::Global;

const EXAMPLES: &str = "\
Examples:
  nacre-host devices
  nacre-host devices --json | jq '.[] | select(.nacre) | .name'
  nacre-host --dpu 192.168.100.2:4424 devices

NVMe namespaces are matched by NGUID/UUID (nacre reports the volume's UUID as both) and
virtio-blk disks by serial (the volume's 20-character serial). Without a DPU address the
disks are listed unmatched. A disk that is not a nacre volume of this host's tenant shows
VOLUME \"-\".";

/// List the host's disks (NVMe, virtio-blk, others) and the nacre volume, tenant and
/// encryption of each, with NVMe path states.
#[derive(clap::Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct Args {}

/// One line of the listing.
#[derive(Debug, Serialize)]
pub struct Listed {
    #[serde(flatten)]
    pub disk: Disk,
    /// The nacre volume, or null when the disk is not one (or was not matched).
    pub nacre: Option<MatchedVolume>,
}

/// What the host sends nacred for a disk: NVMe identifiers for namespaces, the serial for
/// virtio-blk (an NVMe serial is the subsystem's, not the namespace's).
pub fn seen(d: &Disk) -> SeenDevice {
    if d.is_nvme() {
        SeenDevice {
            id: d.name.clone(),
            serial: None,
            nguid: d.nguid.clone(),
            uuid: d.uuid.clone(),
            eui64: d.eui64.clone(),
            subsysnqn: d.subsysnqn.clone(),
            nsid: d.nsid,
        }
    } else {
        SeenDevice {
            id: d.name.clone(),
            serial: d.serial.clone(),
            ..Default::default()
        }
    }
}

/// Pair each disk with nacred's answer for it (by name, whatever order the reply has).
pub fn join(disks: Vec<Disk>, matches: Vec<DeviceMatch>) -> Vec<Listed> {
    disks
        .into_iter()
        .map(|disk| {
            let nacre = matches
                .iter()
                .find(|m| m.id == disk.name)
                .and_then(|m| m.volume.clone());
            Listed { disk, nacre }
        })
        .collect()
}

pub fn render(list: &[Listed], matched: bool) -> String {
    let header = [
        "DEVICE",
        "SIZE",
        "TRANSPORT",
        "SUBSYSTEM/SERIAL",
        "VOLUME",
        "TENANT",
        "ENCRYPTED",
        "PATHS",
    ];
    let mut t = Table::new(&header);
    for l in list {
        let d = &l.disk;
        let ident = d
            .subsysnqn
            .clone()
            .or_else(|| d.serial.clone())
            .unwrap_or_else(|| "-".into());
        let (vol, tenant, enc) = match &l.nacre {
            Some(v) => (
                v.volume.clone(),
                v.tenant.clone().unwrap_or_else(|| "-".into()),
                if v.encrypted { "yes" } else { "no" }.to_string(),
            ),
            None if matched => ("-".into(), "-".into(), "-".into()),
            None => ("?".into(), "?".into(), "?".into()),
        };
        let paths = if d.paths.is_empty() {
            "-".into()
        } else {
            d.paths
                .iter()
                .map(|p| format!("{}:{}", p.controller, p.state))
                .collect::<Vec<_>>()
                .join(",")
        };
        t.row(vec![
            d.name.clone(),
            format_size(d.size),
            d.transport.clone(),
            ident,
            vol,
            tenant,
            enc,
            paths,
        ]);
    }
    t.render()
}

pub fn run(g: &Global, _a: Args) -> Result<()> {
    let disks = sysfs::disks(&g.sysfs);
    let matched = crate::channel::dpu_addr(g).is_some();
    let matches = if matched {
        let devices: Vec<SeenDevice> = disks.iter().map(seen).collect();
        crate::runtime()?.block_on(async {
            let mut c = crate::channel::connect(g).await?;
            let m: Vec<DeviceMatch> =
                crate::channel::call(&mut c, "host_devices_match", json!({ "devices": devices }))
                    .await?;
            c.shutdown().await;
            anyhow::Ok(m)
        })?
    } else {
        eprintln!("nacre-host: no DPU address (--dpu or `nacre-host pair --dpu`): disks are not matched to volumes");
        Vec::new()
    };
    let list = join(disks, matches);
    if g.json {
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else if list.is_empty() {
        println!("no disks");
    } else {
        println!("{}", render(&list, matched));
    }
    Ok(())
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::sysfs::NvmePath;

    fn disk(name: &str, nvme: bool) -> Disk {
        Disk {
            name: name.into(),
            size: 1 << 30,
            transport: if nvme { "tcp" } else { "virtio" }.into(),
            serial: Some("NACRE5E0B3F7A7D1C4A8".into()),
            model: None,
            subsysnqn: nvme.then(|| "nqn.2024-01.io.nacre:t1".into()),
            nsid: nvme.then_some(1),
            nguid: nvme.then(|| "5e0b3f7a-7d1c-4a8e-9b3e-2f6c1d0a4b77".into()),
            uuid: None,
            eui64: None,
            wwid: None,
            paths: if nvme {
                vec![NvmePath {
                    controller: "nvme1".into(),
                    transport: "tcp".into(),
                    address: None,
                    state: "live".into(),
                }]
            } else {
                vec![]
            },
        }
    }

    #[test]
    fn nvme_disks_send_namespace_ids_and_virtio_disks_their_serial() {
        let s = seen(&disk("nvme1n1", true));
        assert_eq!(
            s.serial, None,
            "an NVMe serial names the subsystem, not the volume"
        );
        assert_eq!(s.nsid, Some(1));
        assert!(s.nguid.is_some());
        let s = seen(&disk("vda", false));
        assert_eq!(s.serial.as_deref(), Some("NACRE5E0B3F7A7D1C4A8"));
        assert_eq!(s.nguid, None);
    }

    #[test]
    fn listing_shows_volumes_and_non_nacre_disks() {
        let m = vec![DeviceMatch {
            id: "vda".into(),
            volume: Some(MatchedVolume {
                volume: "data".into(),
                tenant: Some("acme".into()),
                encrypted: true,
                size: 1 << 30,
                block_size: 4096,
                matched_by: "serial".into(),
                exports: vec!["vhost-blk:d0".into()],
            }),
        }];
        let list = join(vec![disk("nvme1n1", true), disk("vda", false)], m);
        let out = render(&list, true);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("DEVICE"), "{out}");
        assert!(lines[1].starts_with("nvme1n1"), "{out}");
        assert!(lines[1].contains("nvme1:live"), "{out}");
        assert!(lines[1].contains(" -  "), "unmatched shows -: {out}");
        assert!(
            lines[2].contains("data") && lines[2].contains("acme") && lines[2].contains("yes"),
            "{out}"
        );
        // Without a DPU, nothing is claimed either way.
        let out = render(&join(vec![disk("vda", false)], vec![]), false);
        assert!(out.lines().nth(1).unwrap().contains('?'), "{out}");
    }
}
