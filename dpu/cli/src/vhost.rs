//! `nacre vhost-blk ...`

use anyhow::Result;
use clap::Subcommand;
use serde_json::{json, Value};

use super::Ctx;
use nacre_shared::table::Table;

#[derive(Subcommand, Debug)]
pub enum VhostBlkCmd {
    /// Serve a volume as a virtio-blk device: a vhost-user-blk backend on a Unix socket, or
    /// (--transport vfio-user) a whole virtio-blk PCI function over vfio-user.
    #[command(
        after_help = "Examples:\n  nacre vhost-blk create vm1 --volume data --queues 4\n  nacre vhost-blk create ro --volume golden --read-only --socket /run/vm/golden.sock\n  nacre vhost-blk create fn0 --volume data --transport vfio-user --socket /run/nacre/vblk0\n\nAttach in QEMU with a shared-memory backend:\n  -object memory-backend-memfd,id=mem,size=4G,share=on -numa node,memdev=mem\n  -chardev socket,id=c0,path=SOCKET -device vhost-user-blk-pci,chardev=c0,num-queues=N\n(num-queues must not exceed --queues.)\n\nWith --transport vfio-user the host sees a virtio-blk PCI device (1af4:1042) and its own\nvirtio_blk driver binds it; --socket is an existing directory, the socket is DIR/cntrl:\n  -device '{\"driver\":\"vfio-user-pci\",\"socket\":{\"path\":\"DIR/cntrl\",\"type\":\"unix\"}}'\n(the same shared-memory backend as above). See docs/virtio-pcie.md."
    )]
    Create {
        /// Device name.
        name: String,
        /// The volume to serve.
        #[arg(long)]
        volume: String,
        /// Virtqueues (VIRTIO_BLK_F_MQ), each served by its own thread.
        /// The default matches the embedded default device; QEMU's num-queues must not exceed it.
        #[arg(long, default_value_t = 4)]
        queues: u16,
        /// Largest virtqueue size accepted (power of two).
        #[arg(long, default_value_t = 1024)]
        queue_size: u16,
        /// Socket path [default: <run-dir>/vhost-NAME.sock].
        #[arg(long)]
        socket: Option<String>,
        /// Offer VIRTIO_BLK_F_RO; writes fail with VIRTIO_BLK_S_IOERR.
        #[arg(long)]
        read_only: bool,
        /// How the host reaches the device: vhost-user (a backend for the VMM's
        /// vhost-user-blk device) or vfio-user (a whole PCI function; --socket is then the
        /// directory its socket `cntrl` goes in).
        #[arg(long, value_parser = ["vhost-user", "vfio-user"])]
        transport: Option<String>,
    },
    /// List vhost-user-blk devices.
    #[command(after_help = "Examples:\n  nacre vhost-blk list\n  nacre --json vhost-blk list")]
    List,
    /// Stop a device and remove its socket.
    #[command(after_help = "Examples:\n  nacre vhost-blk delete vm1")]
    Delete {
        /// The device.
        name: String,
    },
}

pub fn run(ctx: &mut Ctx, cmd: VhostBlkCmd) -> Result<()> {
    match cmd {
        VhostBlkCmd::Create {
            name,
            volume,
            queues,
            queue_size,
            socket,
            read_only,
            transport,
        } => {
            let mut p = json!({"name": name, "volume": volume, "queues": queues,
                               "queue_size": queue_size, "read_only": read_only});
            if let Some(s) = socket {
                p["socket"] = json!(s);
            }
            if let Some(t) = transport {
                p["transport"] = json!(t);
            }
            let v = ctx.call("vhost_blk_create", p)?;
            ctx.print(&v, |v| {
                let (name, volume, socket) = (
                    v["name"].as_str().unwrap_or(""),
                    v["volume"].as_str().unwrap_or(""),
                    v["socket"].as_str().unwrap_or(""),
                );
                if v["transport"] == "vfio-user" {
                    println!(
                        "vhost-blk {name} serves volume {volume} as a virtio-blk PCI function on {socket}/cntrl (vfio-user)"
                    )
                } else {
                    println!("vhost-blk {name} serves volume {volume} on {socket}")
                }
            });
        }
        VhostBlkCmd::List => {
            let v = ctx.call("vhost_blk_list", Value::Null)?;
            ctx.print(&v, |v| {
                let mut t = Table::new(&[
                    "NAME",
                    "VOLUME",
                    "QUEUES",
                    "RO",
                    "CONNECTED",
                    "TRANSPORT",
                    "SOCKET",
                ]);
                for d in v.as_array().into_iter().flatten() {
                    let b = |k: &str| {
                        if d[k].as_bool().unwrap_or(false) {
                            "yes"
                        } else {
                            "no"
                        }
                    };
                    t.row(vec![
                        d["name"].as_str().unwrap_or("").into(),
                        d["volume"].as_str().unwrap_or("").into(),
                        d["queues"].to_string(),
                        b("read_only").into(),
                        b("connected").into(),
                        d["transport"].as_str().unwrap_or("vhost-user").into(),
                        d["socket"].as_str().unwrap_or("").into(),
                    ]);
                }
                t.print();
            });
        }
        VhostBlkCmd::Delete { name } => {
            let v = ctx.call("vhost_blk_delete", json!({ "name": name }))?;
            ctx.print(&v, |_| println!("deleted vhost-blk {name}"));
        }
    }
    Ok(())
}
