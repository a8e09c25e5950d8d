//! `nacre nvmf ...`: NVMe-oF/TCP subsystems.

use anyhow::Result;
use clap::Subcommand;
use serde_json::{json, Value};

use super::Ctx;
use nacre_shared::table::Table;

#[derive(Subcommand, Debug)]
pub enum NvmfCmd {
    /// Create a subsystem.
    #[command(
        after_help = "Examples:\n  nacre nvmf create nqn.2024-01.io.nacre:data --allow-any-host\n  nacre nvmf add-ns nqn.2024-01.io.nacre:data --volume data\n  nacre nvmf add-listener nqn.2024-01.io.nacre:data --address 127.0.0.1 --port 4420\n\nOn a Linux host:\n  nvme discover -t tcp -a ADDRESS -s PORT\n  nvme connect -t tcp -a ADDRESS -s PORT -n NQN\n  nvme list"
    )]
    Create {
        /// Subsystem NQN (nqn.YYYY-MM.reverse-domain:name).
        nqn: String,
        /// Serial number (at most 20 ASCII characters) [default: generated].
        #[arg(long)]
        serial: Option<String>,
        /// Model number (at most 40 ASCII characters) [default: nacre].
        #[arg(long)]
        model: Option<String>,
        /// Let any host connect (otherwise only hosts added with add-host).
        #[arg(long)]
        allow_any_host: bool,
    },
    /// Delete a subsystem; connected hosts are disconnected.
    #[command(after_help = "Examples:\n  nacre nvmf delete nqn.2024-01.io.nacre:data")]
    Delete {
        /// Subsystem NQN.
        nqn: String,
    },
    /// Export a volume as a namespace.
    #[command(
        after_help = "Examples:\n  nacre nvmf add-ns nqn.2024-01.io.nacre:data --volume data\n  nacre nvmf add-ns nqn.2024-01.io.nacre:data --volume logs --nsid 7"
    )]
    AddNs {
        /// Subsystem NQN.
        nqn: String,
        /// The volume to export (see `nacre volume list`).
        #[arg(long)]
        volume: String,
        /// Namespace ID [default: lowest free].
        #[arg(long)]
        nsid: Option<u32>,
    },
    /// Remove a namespace (hosts see a namespace-changed event).
    #[command(after_help = "Examples:\n  nacre nvmf remove-ns nqn.2024-01.io.nacre:data 1")]
    RemoveNs {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID.
        nsid: u32,
    },
    /// Listen for NVMe/TCP (or NVMe/RDMA) connections to the subsystem, or serve it as a PCIe
    /// NVMe controller over vfio-user (a QEMU guest's own nvme driver binds it).
    #[command(
        after_help = "Examples:\n  nacre nvmf add-listener nqn.2024-01.io.nacre:data --address 127.0.0.1 --port 4420\n  nacre nvmf add-listener nqn.2024-01.io.nacre:data --address ::1 --port 4421\n  nacre nvmf add-listener nqn.2024-01.io.nacre:data --transport rdma --address 192.0.2.1\n  nacre nvmf add-listener nqn.2024-01.io.nacre:data --transport vfio-user --path /run/nacre/vfu/data\n\nRDMA needs an RDMA device with that address (RoCE NIC, or soft-RoCE:\n  rdma link add rxe0 type rxe netdev eth0)\n\nvfio-user: the directory must exist; the controller's socket is DIR/cntrl, as with SPDK's\nVFIOUSER transport. QEMU >= 10.1.1: -device vfio-user-pci,socket=DIR/cntrl (guest memory\nshared: -object memory-backend-memfd,...,share=on). See docs/nvme-pcie.md.\n\n--interrupts msi gives the function MSI instead of MSI-X (fewer vectors: Linux on x86\nshares one among all queues). QEMU 11.1.3 aborts on device_del of a vfio-user-pci\nfunction with MSI-X and removes one with MSI: use msi where the guest must be able to\nlet the function go while it runs:\n  nacre nvmf add-listener nqn.2024-01.io.nacre:data --transport vfio-user --path /run/nacre/vfu/data --interrupts msi\n\nTLS (NVMe/TCP with TLS 1.3 and a pre-shared key): --secure-channel tls makes a TLS-only\nlistener; hosts need a PSK (nacre nvmf add-host NQN HOST --psk FILE). A listener is TLS-only\nor plain, never both:\n  nacre nvmf add-listener nqn.2024-01.io.nacre:data --address 127.0.0.1 --port 4421 --secure-channel tls\nSee docs/nvme-tls.md."
    )]
    AddListener {
        /// Subsystem NQN.
        nqn: String,
        /// IPv4 or IPv6 address to listen on (0.0.0.0: every interface).
        #[arg(long, required_unless_present = "path", conflicts_with = "path")]
        address: Option<String>,
        /// With --transport vfio-user: the directory the controller's socket (cntrl) goes in.
        #[arg(long)]
        path: Option<std::path::PathBuf>,
        /// TCP port, or the RDMA CM port with --transport rdma (4420 is NVMe-oF's IANA port; 0
        /// picks a free one).
        #[arg(long, default_value_t = 4420)]
        port: u16,
        /// NVMe-oF transport: tcp or rdma (RDMA needs an RDMA device with the address); or
        /// vfio-user, a PCIe NVMe controller (give --path).
        #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma", "vfio-user"])]
        transport: String,
        /// NVMe/TCP only: `tls` for a TLS-only listener (TLS 1.3, pre-shared keys), `none`
        /// for a plain one.
        #[arg(long, default_value = "none", value_parser = ["none", "tls"])]
        secure_channel: String,
        /// vfio-user only: how the PCIe function signals its host, msix (a vector per queue)
        /// or msi (one vector on most x86 guests; QEMU 11.1.3 can hot-remove it).
        #[arg(long, value_parser = ["msix", "msi"])]
        interrupts: Option<String>,
    },
    /// Stop offering the subsystem on an address.
    #[command(
        after_help = "Examples:\n  nacre nvmf remove-listener nqn.2024-01.io.nacre:data --address 127.0.0.1 --port 4420"
    )]
    RemoveListener {
        /// Subsystem NQN.
        nqn: String,
        /// The listener's address.
        #[arg(long, required_unless_present = "path", conflicts_with = "path")]
        address: Option<String>,
        /// A vfio-user listener's directory.
        #[arg(long)]
        path: Option<std::path::PathBuf>,
        /// The listener's port.
        #[arg(long, default_value_t = 4420)]
        port: u16,
        /// tcp, rdma or vfio-user.
        #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma", "vfio-user"])]
        transport: String,
    },
    /// Allow a host NQN to connect, optionally only once it authenticates (DH-HMAC-CHAP).
    ///
    /// With --dhchap-key the host's queues must authenticate with that secret before they
    /// carry any command (NVMe in-band authentication, NVMe Base 2.0 §8.13); with
    /// --dhchap-ctrl-key too, a host that asks is answered with the controller's secret
    /// (bidirectional). Key files hold one `DHHC-1:XX:<base64>:` secret (make one with
    /// `nacre nvmf gen-dhchap-key`) and must be mode 0600; nacred keeps their paths and reads
    /// them again when it restarts. Adding a host again replaces its keys.
    #[command(
        after_help = "With --psk the host may also connect through TLS listeners (--secure-channel tls): the file\n(mode 0600) holds its configured PSK, NVMeTLSkey-1:01:...: (32 bytes, TLS_AES_128_GCM_SHA256)\nor NVMeTLSkey-1:02:...: (48 bytes, TLS_AES_256_GCM_SHA384), as nacre nvmf gen-tls-key and\nnvme gen-tls-key make it. nacred keeps the path, not the key; the host is given the same key\n(SPDK: --psk-path; Linux: nvme connect --tls-key).\n\nExamples:\n  nacre nvmf add-host nqn.2024-01.io.nacre:data nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427\n  nacre nvmf gen-dhchap-key --nqn nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427 -o /etc/nacre/host1.key\n  nacre nvmf add-host nqn.2024-01.io.nacre:data nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427 --dhchap-key /etc/nacre/host1.key --dhchap-ctrl-key /etc/nacre/ctrl.key\n  nacre nvmf add-host nqn.2024-01.io.nacre:data nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427 \\\n      --psk /etc/nacre/keys/host1.psk"
    )]
    AddHost {
        /// Subsystem NQN.
        nqn: String,
        /// The host's NQN (Linux: /etc/nvme/hostnqn).
        host: String,
        /// File holding the host's DH-HMAC-CHAP secret (mode 0600): the host must
        /// authenticate.
        #[arg(long, value_name = "FILE")]
        dhchap_key: Option<std::path::PathBuf>,
        /// File holding the controller's secret (mode 0600), for bidirectional
        /// authentication.
        #[arg(long, value_name = "FILE", requires = "dhchap_key")]
        dhchap_ctrl_key: Option<std::path::PathBuf>,
        /// Hashes the host may use (default all; the strongest it offers is chosen).
        #[arg(long, value_delimiter = ',', requires = "dhchap_key",
              value_parser = ["sha256", "sha384", "sha512"])]
        dhchap_digests: Vec<String>,
        /// DH groups the host may use (default all; ffdhe2048 first, null last).
        #[arg(long, value_delimiter = ',', requires = "dhchap_key",
              value_parser = ["null", "ffdhe2048", "ffdhe3072", "ffdhe4096", "ffdhe6144", "ffdhe8192"])]
        dhchap_dhgroups: Vec<String>,
        /// The host's TLS pre-shared key: a file of mode 0600 in the interchange format.
        #[arg(long)]
        psk: Option<std::path::PathBuf>,
    },
    /// Stop allowing a host NQN.
    #[command(
        after_help = "Examples:\n  nacre nvmf remove-host nqn.2024-01.io.nacre:data nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    )]
    RemoveHost {
        /// Subsystem NQN.
        nqn: String,
        /// The host's NQN.
        host: String,
    },
    /// Let any host connect (true) or only listed ones (false).
    #[command(
        after_help = "Examples:\n  nacre nvmf allow-any-host nqn.2024-01.io.nacre:data false"
    )]
    AllowAnyHost {
        /// Subsystem NQN.
        nqn: String,
        /// true or false.
        #[arg(action = clap::ArgAction::Set)]
        allow: bool,
    },
    /// List subsystems: namespaces, listeners (and why one is not listening), hosts.
    #[command(after_help = "Examples:\n  nacre nvmf list\n  nacre --json nvmf list")]
    List,
    /// What the pollers did: the poll policy; per NVMe/TCP reactor its connections, busy
    /// passes, idle polls, sleeps and deep sleeps; per PCIe (vfio-user) controller its busy
    /// and idle passes, busy time and pauses.
    #[command(
        after_help = "Idle polls are the busy-poll's cost: empty looks for work. Deep sleeps are sleeps the\nadaptive policy took at once because a host keeps 8 or more commands in flight\n(nacred --nvmf-poll adaptive|always|off sets the policy).\n\nA PCIe controller's BUSY is the time its poller spent in passes that found work since\nthe listener started (SPDK's thread_get_stats busy ticks); its load between two readings\nis the difference of busy_ns over the difference of at_ns (nacre --json nvmf stats).\n\nExamples:\n  nacre nvmf stats\n  nacre --json nvmf stats"
    )]
    Stats,
    /// Generate a DH-HMAC-CHAP secret (NVMe in-band authentication), as `nvme
    /// gen-dhchap-key` does; no daemon needed.
    #[command(
        name = "gen-dhchap-key",
        after_help = "The secret is printed in the NVMe representation DHHC-1:XX:<base64>: that Linux\n(nvme connect --dhchap-secret), SPDK (keyring_file_add_key) and nacre read. With --hmac 1-3\nthe stored key is the random secret already transformed with --nqn (nvme-cli does the\nsame), and --key-length must be that hash's length (32, 48, 64).\n\nExamples:\n  nacre nvmf gen-dhchap-key --output /etc/nacre/keys/shelf1.key\n  nacre nvmf gen-dhchap-key --hmac 2 --key-length 48 --nqn nqn.2014-08.org.nvmexpress:uuid:... \\\n      --output /etc/nacre/keys/host.key\n  nacre remote attach shelf1 ... --dhchap-secret /etc/nacre/keys/shelf1.key"
    )]
    GenDhchapKey {
        /// Transformation hash: 0 none, 1 SHA-256, 2 SHA-384, 3 SHA-512.
        #[arg(long, short = 'm', default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
        hmac: u8,
        /// Key length in bytes: 32, 48 or 64 [default: the hash's length, 32 without one].
        #[arg(long, short = 'l', value_parser = ["32", "48", "64"])]
        key_length: Option<String>,
        /// The NQN the key belongs to (needed with --hmac 1-3).
        #[arg(long, short = 'n')]
        nqn: Option<String>,
        /// Use this secret (hexadecimal) instead of a random one (known-answer checks).
        #[arg(long, short = 's')]
        secret: Option<String>,
        /// Write the secret to this file (created mode 0600) instead of printing it.
        #[arg(long, short = 'o')]
        output: Option<std::path::PathBuf>,
    },
    /// Check a DH-HMAC-CHAP secret's representation and CRC; prints its hash and length,
    /// never the key.
    #[command(
        name = "check-dhchap-key",
        after_help = "Examples:\n  nacre nvmf check-dhchap-key --file /etc/nacre/keys/shelf1.key\n  nacre nvmf check-dhchap-key DHHC-1:00:...:"
    )]
    CheckDhchapKey {
        /// The secret, DHHC-1:XX:...: (or give --file).
        #[arg(required_unless_present = "file", conflicts_with = "file")]
        key: Option<String>,
        /// Read the secret from this file (must not be readable by group or others).
        #[arg(long)]
        file: Option<std::path::PathBuf>,
    },
    /// Generate a TLS pre-shared key for NVMe/TCP in the interchange format, as `nvme
    /// gen-tls-key` does; no daemon needed.
    #[command(
        name = "gen-tls-key",
        after_help = "The key is printed as NVMeTLSkey-1:HH:<base64 of the key and its CRC-32>: that Linux\n(nvme connect --tls-key), SPDK (--psk-path, keyring_file_add_key) and nacre read. --hmac 1:\na 32-byte key (SHA-256, TLS_AES_128_GCM_SHA256); --hmac 2: 48 bytes (SHA-384,\nTLS_AES_256_GCM_SHA384).\n\nExamples:\n  nacre nvmf gen-tls-key --output /etc/nacre/keys/host1.psk\n  nacre nvmf gen-tls-key --hmac 2 --output /etc/nacre/keys/host1.psk\n  nacre nvmf add-host nqn.2024-01.io.nacre:data HOSTNQN --psk /etc/nacre/keys/host1.psk"
    )]
    GenTlsKey {
        /// The PSK hash: 1 SHA-256 (32-byte key), 2 SHA-384 (48-byte key).
        #[arg(long, short = 'm', default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
        hmac: u8,
        /// Use this key (hexadecimal) instead of a random one (known-answer checks).
        #[arg(long, short = 's')]
        secret: Option<String>,
        /// Write the key to this file (created mode 0600) instead of printing it.
        #[arg(long, short = 'o')]
        output: Option<std::path::PathBuf>,
    },
    /// Check a TLS PSK's interchange format and CRC; prints its hash and length (never the
    /// key), and with --hostnqn and --subnqn the PSK identity a host offers.
    #[command(
        name = "check-tls-key",
        after_help = "Examples:\n  nacre nvmf check-tls-key --file /etc/nacre/keys/host1.psk\n  nacre nvmf check-tls-key NVMeTLSkey-1:01:...: --hostnqn HOSTNQN --subnqn SUBNQN\n  nacre nvmf check-tls-key --file host1.psk --hostnqn HOSTNQN --subnqn SUBNQN --keyfile host1.keys\n    then on the Linux host: nvme tls-key --import --keyfile host1.keys"
    )]
    CheckTlsKey {
        /// The key, NVMeTLSkey-1:HH:...: (or give --file).
        #[arg(required_unless_present = "file", conflicts_with = "file")]
        key: Option<String>,
        /// Read the key from this file (must not be readable by group or others).
        #[arg(long)]
        file: Option<std::path::PathBuf>,
        /// The host NQN, to print the PSK identity.
        #[arg(long, requires = "subnqn")]
        hostnqn: Option<String>,
        /// The subsystem NQN, to print the PSK identity.
        #[arg(long, requires = "hostnqn")]
        subnqn: Option<String>,
        /// Also write the TLS PSK this host derives for this subsystem, with its identity, to
        /// this file (mode 0600) in the format of nvme-cli's key file, for `nvme tls-key
        /// --import --keyfile FILE` on a Linux host whose nvme-cli derives another key
        /// (nvme-cli 2.13, Debian 13's: see docs/nvme-tls.md). The file holds a key.
        #[arg(long, value_name = "FILE", requires = "hostnqn")]
        keyfile: Option<std::path::PathBuf>,
    },
}

impl NvmfCmd {
    /// Commands that need no daemon.
    pub fn is_local(&self) -> bool {
        matches!(
            self,
            NvmfCmd::GenDhchapKey { .. }
                | NvmfCmd::CheckDhchapKey { .. }
                | NvmfCmd::GenTlsKey { .. }
                | NvmfCmd::CheckTlsKey { .. }
        )
    }
}

/// The commands [`NvmfCmd::is_local`] names.
pub fn run_local(cmd: NvmfCmd, json: bool) -> Result<()> {
    use nacre_dpu::auth::{write_secret_file, Secret};
    match cmd {
        NvmfCmd::GenDhchapKey {
            hmac,
            key_length,
            nqn,
            secret,
            output,
        } => {
            let key_len = match key_length {
                Some(l) => l.parse().unwrap_or(32),
                None => [32, 32, 48, 64][hmac as usize],
            };
            let raw = match &secret {
                None => None,
                Some(h) => Some(zeroize::Zeroizing::new(parse_hex(h)?)),
            };
            let s = Secret::generate(
                hmac,
                key_len,
                nqn.as_deref(),
                raw.as_deref().map(|v| &v[..]),
            )?;
            match output {
                Some(path) => {
                    write_secret_file(&path, &s)?;
                    let v = json!({"path": path, "hmac": hmac, "key_length": key_len});
                    if json {
                        println!("{}", serde_json::to_string_pretty(&v)?);
                    } else {
                        println!(
                            "wrote a {key_len}-byte DH-HMAC-CHAP secret (hmac {hmac}) to {} (mode 0600)",
                            path.display()
                        );
                    }
                }
                None if json => anyhow::bail!(
                    "--json never prints a secret: give --output FILE to write it to a file"
                ),
                None => println!("{}", &*s.to_representation()),
            }
        }
        NvmfCmd::CheckDhchapKey { key, file } => {
            let s = match (&key, &file) {
                (_, Some(f)) => Secret::load(f)?,
                (Some(k), None) => Secret::parse(k)?,
                (None, None) => anyhow::bail!("give a key or --file"),
            };
            let v = json!({"valid": true, "hmac": s.hash(), "key_length": s.key_len()});
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("Key is valid (HMAC {}, length {})", s.hash(), s.key_len());
            }
        }
        NvmfCmd::GenTlsKey {
            hmac,
            secret,
            output,
        } => {
            use nacre_dpu::auth::tls_psk::TlsPsk;
            let raw = match &secret {
                None => None,
                Some(h) => Some(zeroize::Zeroizing::new(parse_hex(h)?)),
            };
            let k = TlsPsk::generate(hmac, raw.as_deref().map(|v| &v[..]))?;
            match output {
                Some(path) => {
                    k.write_file(&path)?;
                    let v = json!({"path": path, "hmac": hmac, "key_length": k.key_len()});
                    if json {
                        println!("{}", serde_json::to_string_pretty(&v)?);
                    } else {
                        println!(
                            "wrote a {}-byte NVMe TLS PSK (hmac {hmac}, {}) to {} (mode 0600)",
                            k.key_len(),
                            k.cipher_suite().name(),
                            path.display()
                        );
                    }
                }
                None if json => anyhow::bail!(
                    "--json never prints a key: give --output FILE to write it to a file"
                ),
                None => println!("{}", &*k.to_interchange()),
            }
        }
        NvmfCmd::CheckTlsKey {
            key,
            file,
            hostnqn,
            subnqn,
            keyfile,
        } => {
            use nacre_dpu::auth::tls_psk::{identity, TlsPsk};
            let k = match (&key, &file) {
                (_, Some(f)) => TlsPsk::load(f)?,
                (Some(k), None) => TlsPsk::parse(k)?,
                (None, None) => anyhow::bail!("give a key or --file"),
            };
            let id = match (&hostnqn, &subnqn) {
                (Some(h), Some(s)) => Some(identity(k.cipher_suite(), h, s)),
                _ => None,
            };
            if let (Some(out), Some(h), Some(s)) = (&keyfile, &hostnqn, &subnqn) {
                k.write_keyring_line(h, s, out)?;
            }
            let v = json!({
                "valid": true, "hmac": k.hash(), "key_length": k.key_len(),
                "cipher_suite": k.cipher_suite().name(), "identity": id,
            });
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!(
                    "Key is valid (HMAC {}, length {}, {})",
                    k.hash(),
                    k.key_len(),
                    k.cipher_suite().name()
                );
                if let Some(id) = id {
                    println!("PSK identity: {id}");
                }
            }
        }
        _ => anyhow::bail!("this command needs nacred"),
    }
    Ok(())
}

fn parse_hex(h: &str) -> Result<Vec<u8>> {
    let h = h.trim();
    if h.len() % 2 != 0 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
        anyhow::bail!("--secret must be hexadecimal digits, two per byte");
    }
    Ok((0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap_or(0))
        .collect())
}

pub fn run(ctx: &mut Ctx, cmd: NvmfCmd) -> Result<()> {
    let ack = |ctx: &Ctx, v: &Value, what: String| ctx.print(v, |_| println!("{what}"));
    match cmd {
        NvmfCmd::Create {
            nqn,
            serial,
            model,
            allow_any_host,
        } => {
            let mut p = json!({"nqn": nqn, "allow_any_host": allow_any_host});
            if let Some(s) = serial {
                p["serial"] = json!(s);
            }
            if let Some(m) = model {
                p["model"] = json!(m);
            }
            let v = ctx.call("nvmf_subsystem_create", p)?;
            ack(ctx, &v, format!("created subsystem {nqn}"));
        }
        NvmfCmd::Delete { nqn } => {
            let v = ctx.call("nvmf_subsystem_delete", json!({ "nqn": nqn }))?;
            ack(ctx, &v, format!("deleted subsystem {nqn}"));
        }
        NvmfCmd::AddNs { nqn, volume, nsid } => {
            let mut p = json!({"nqn": nqn, "volume": volume});
            if let Some(n) = nsid {
                p["nsid"] = json!(n);
            }
            let v = ctx.call("nvmf_subsystem_add_ns", p)?;
            let msg = format!("volume {volume} is namespace {} of {nqn}", v["nsid"]);
            ack(ctx, &v, msg);
        }
        NvmfCmd::RemoveNs { nqn, nsid } => {
            let v = ctx.call(
                "nvmf_subsystem_remove_ns",
                json!({"nqn": nqn, "nsid": nsid}),
            )?;
            ack(ctx, &v, format!("removed namespace {nsid} from {nqn}"));
        }
        NvmfCmd::AddListener {
            nqn,
            address,
            path,
            port,
            transport,
            secure_channel,
            interrupts,
        } => {
            let address = listener_address(&transport, address, path)?;
            let secure = secure_channel == "tls";
            if secure && transport != "tcp" {
                anyhow::bail!("--secure-channel tls is for NVMe/TCP listeners only");
            }
            if interrupts.is_some() && transport != "vfio-user" {
                anyhow::bail!("--interrupts is for --transport vfio-user only");
            }
            if transport == "vfio-user" {
                let mut params = json!({"nqn": nqn, "address": address, "transport": transport});
                if let Some(i) = interrupts {
                    params["interrupts"] = json!(i);
                }
                let v = ctx.call("nvmf_subsystem_add_listener", params)?;
                let msg = format!(
                    "{nqn} is a PCIe NVMe controller on {} (vfio-user, {})",
                    v["socket"].as_str().unwrap_or(""),
                    if v["interrupts"] == "msi" {
                        "MSI"
                    } else {
                        "MSI-X"
                    }
                );
                ack(ctx, &v, msg);
                return Ok(());
            }
            let mut params =
                json!({"nqn": nqn, "address": address, "port": port, "transport": transport});
            if secure {
                params["secure_channel"] = json!(true);
            }
            let v = ctx.call("nvmf_subsystem_add_listener", params)?;
            let msg = format!(
                "{nqn} listens for NVMe/{}{} on {}:{}",
                transport.to_uppercase(),
                if secure { " with TLS (TLS-only)" } else { "" },
                v["address"].as_str().unwrap_or(""),
                v["port"]
            );
            ack(ctx, &v, msg);
        }
        NvmfCmd::RemoveListener {
            nqn,
            address,
            path,
            port,
            transport,
        } => {
            let address = listener_address(&transport, address, path)?;
            let v = ctx.call(
                "nvmf_subsystem_remove_listener",
                json!({"nqn": nqn, "address": address, "port": port, "transport": transport}),
            )?;
            ack(
                ctx,
                &v,
                format!("{nqn} no longer listens on {address}:{port}"),
            );
        }
        NvmfCmd::AddHost {
            nqn,
            host,
            dhchap_key,
            dhchap_ctrl_key,
            dhchap_digests,
            dhchap_dhgroups,
            psk,
        } => {
            let mut params = json!({"nqn": nqn, "host": host});
            if !dhchap_digests.is_empty() {
                params["dhchap_digests"] = json!(dhchap_digests);
            }
            if !dhchap_dhgroups.is_empty() {
                params["dhchap_dhgroups"] = json!(dhchap_dhgroups);
            }
            let authenticate = dhchap_key.is_some();
            let tls = psk.is_some();
            // nacred reads the files itself: it is given absolute paths.
            for (field, path) in [
                ("dhchap_key", dhchap_key),
                ("dhchap_ctrlr_key", dhchap_ctrl_key),
                ("psk", psk),
            ] {
                if let Some(p) = path {
                    let abs = std::path::absolute(&p)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
                    params[field] = json!(abs);
                }
            }
            let v = ctx.call("nvmf_subsystem_add_host", params)?;
            let how = match (authenticate, tls) {
                (true, true) => " once it authenticates (DH-HMAC-CHAP), with a TLS PSK",
                (true, false) => " once it authenticates (DH-HMAC-CHAP)",
                (false, true) => " (with a TLS PSK)",
                (false, false) => "",
            };
            ack(ctx, &v, format!("host {host} may connect to {nqn}{how}"));
        }
        NvmfCmd::RemoveHost { nqn, host } => {
            let v = ctx.call(
                "nvmf_subsystem_remove_host",
                json!({"nqn": nqn, "host": host}),
            )?;
            ack(ctx, &v, format!("host {host} removed from {nqn}"));
        }
        NvmfCmd::AllowAnyHost { nqn, allow } => {
            let v = ctx.call(
                "nvmf_subsystem_allow_any_host",
                json!({"nqn": nqn, "allow_any_host": allow}),
            )?;
            ack(ctx, &v, format!("{nqn}: allow any host = {allow}"));
        }
        NvmfCmd::List => {
            let v = ctx.call("nvmf_get_subsystems", Value::Null)?;
            ctx.print(&v, |v| {
                let mut t = Table::new(&[
                    "NQN",
                    "TYPE",
                    "SERIAL",
                    "NAMESPACES",
                    "LISTENERS",
                    "HOSTS",
                    "CTRLS",
                ]);
                for s in v.as_array().into_iter().flatten() {
                    let list = |k: &str| {
                        s[k].as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(|x| x.as_str().map(str::to_string))
                            .collect::<Vec<_>>()
                            .join(",")
                    };
                    let ns = s["namespaces"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|n| format!("{}:{}", n["nsid"], n["name"].as_str().unwrap_or("")))
                        .collect::<Vec<_>>()
                        .join(",");
                    let hosts = if s["allow_any_host"].as_bool().unwrap_or(false) {
                        "any".to_string()
                    } else {
                        list("hosts")
                    };
                    // Hosts that must authenticate: "(dhchap: NQN unidirectional, ...)".
                    let auth = s["dhchap"]
                        .as_object()
                        .into_iter()
                        .flatten()
                        .map(|(h, how)| format!("{h} {}", how.as_str().unwrap_or("")))
                        .collect::<Vec<_>>()
                        .join(", ");
                    let hosts = if auth.is_empty() {
                        hosts
                    } else {
                        format!("{hosts} (dhchap: {auth})")
                    };
                    t.row(vec![
                        s["nqn"].as_str().unwrap_or("").into(),
                        s["subtype"].as_str().unwrap_or("").into(),
                        s["serial"].as_str().unwrap_or("").into(),
                        ns,
                        listeners(s),
                        hosts,
                        s["controllers"].to_string(),
                    ]);
                }
                t.print();
            });
        }
        c @ (NvmfCmd::GenDhchapKey { .. }
        | NvmfCmd::CheckDhchapKey { .. }
        | NvmfCmd::GenTlsKey { .. }
        | NvmfCmd::CheckTlsKey { .. }) => {
            run_local(c, ctx.json)?;
        }
        NvmfCmd::Stats => {
            let v = ctx.call("nvmf_get_stats", Value::Null)?;
            ctx.print(&v, |v| {
                println!("poll policy: {}", v["poll"].as_str().unwrap_or("?"));
                let mut t = Table::new(&[
                    "REACTOR",
                    "CONNS",
                    "BUSY PASSES",
                    "IDLE POLLS",
                    "SLEEPS",
                    "DEEP SLEEPS",
                ]);
                for (i, r) in v["reactors"].as_array().into_iter().flatten().enumerate() {
                    t.row(vec![
                        i.to_string(),
                        r["connections"].to_string(),
                        r["busy_passes"].to_string(),
                        r["idle_polls"].to_string(),
                        r["sleeps"].to_string(),
                        r["deep_sleeps"].to_string(),
                    ]);
                }
                t.print();
                // The PCIe controllers' pollers, when there are any.
                if let Some(pcie) = v["pcie"].as_array().filter(|a| !a.is_empty()) {
                    let mut t = Table::new(&[
                        "PCIE CONTROLLER",
                        "SUBSYSTEM",
                        "BUSY PASSES",
                        "IDLE PASSES",
                        "BUSY",
                        "PAUSES",
                    ]);
                    for p in pcie {
                        t.row(vec![
                            p["path"].as_str().unwrap_or("?").to_string(),
                            p["nqn"].as_str().unwrap_or("?").to_string(),
                            p["busy_passes"].to_string(),
                            p["idle_passes"].to_string(),
                            format!("{:.3} s", p["busy_ns"].as_u64().unwrap_or(0) as f64 / 1e9),
                            p["pauses"].to_string(),
                        ]);
                    }
                    println!();
                    t.print();
                }
            });
        }
    }
    Ok(())
}

/// The LISTENERS column: each configured listener, and why one that does not listen does not.
fn listeners(s: &Value) -> String {
    let Some(states) = s["listener_states"].as_array().filter(|a| !a.is_empty()) else {
        // The discovery subsystem has no configured listeners of its own.
        return s["listeners"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(",");
    };
    states
        .iter()
        .map(|l| {
            let mut addr = l["address"].as_str().unwrap_or("").to_string();
            // A PCIe function with MSI says so (MSI-X is the default, not shown).
            if l["interrupts"] == "msi" {
                addr.push_str(" msi");
            }
            match l["state"].as_str() {
                Some("listening") | None => addr,
                Some(st) => format!(
                    "{addr} ({st}: {})",
                    l["reason"].as_str().unwrap_or("unknown reason")
                ),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The listener's address: `--path` for vfio-user (required there), `--address` otherwise.
fn listener_address(
    transport: &str,
    address: Option<String>,
    path: Option<std::path::PathBuf>,
) -> Result<String> {
    match (transport, address, path) {
        ("vfio-user", None, Some(p)) => {
            let p = std::path::absolute(&p).unwrap_or(p);
            Ok(p.display().to_string())
        }
        ("vfio-user", _, None) => anyhow::bail!("--transport vfio-user needs --path DIR"),
        (_, _, Some(_)) => anyhow::bail!("--path is for --transport vfio-user"),
        (_, Some(a), None) => Ok(a),
        (_, None, None) => anyhow::bail!("--address is required"),
    }
}
