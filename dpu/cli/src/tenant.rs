//! `nacre tenant ...`, and the key operations `nacre volume crypto-erase|export-key`.
//!
//! Secrets never go on the command line (where `ps` and shell history would see them): a
//! KEK comes from `--key-file PATH` (32 random bytes), `--passphrase-file PATH` or
//! `--passphrase-stdin`, or is an envelope key a KMIP key manager encrypts (`--kms NAME
//! --kms-key-id ID`; `nacre kms add` configures the key manager). Relative paths are made
//! absolute, because nacred resolves them.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use zeroize::Zeroizing;

use super::Ctx;
use nacre_dpu::crypto::kek::PassphraseKek;
use nacre_shared::table::Table;

const TENANT_EXAMPLES: &str = "\
Examples:
  head -c 32 /dev/urandom > /etc/nacre/acme.kek && chmod 600 /etc/nacre/acme.kek
  nacre tenant create acme --key-file /etc/nacre/acme.kek --require-encryption
  nacre tenant create globex --passphrase-file /root/globex.pass --tweak be64 --data-unit 512
  nacre tenant create initech --kms vault --kms-key-id 3f1c9a   # see `nacre kms add --help`
  nacre volume create acme-db --size 100G --tenant acme --encrypt
  nacre tenant rotate-kek acme --new-key-file /etc/nacre/acme-2.kek
  nacre tenant unlock globex --passphrase-stdin < /root/globex.pass   # after a restart
  nacre tenant unlock initech          # asks its key manager again
  nacre tenant lock initech            # forget the KEK; its volumes fail until unlock";

#[derive(Subcommand, Debug)]
#[command(after_help = TENANT_EXAMPLES)]
pub enum TenantCmd {
    /// Create a tenant with a key-encryption key and an encryption policy.
    #[command(
        after_help = "Examples:\n  head -c 32 /dev/urandom > /etc/nacre/acme.kek && chmod 600 /etc/nacre/acme.kek\n  nacre tenant create acme --key-file /etc/nacre/acme.kek\n  nacre tenant create beta --passphrase-file /etc/nacre/beta.pass --require-encryption"
    )]
    Create(CreateArgs),
    /// List tenants.
    #[command(after_help = "Examples:\n  nacre tenant list")]
    List {
        /// Only this tenant.
        name: Option<String>,
    },
    /// Show a tenant: KEK source, policy, volumes.
    #[command(after_help = "Examples:\n  nacre tenant show acme")]
    Show {
        /// The tenant.
        name: String,
    },
    /// Delete a tenant (refused while it has volumes, unless --force).
    #[command(after_help = "Examples:\n  nacre tenant delete acme")]
    Delete {
        /// The tenant.
        name: String,
        /// Delete anyway: the tenant's encrypted volumes become permanently unreadable.
        #[arg(long)]
        force: bool,
    },
    /// Give nacred a tenant's KEK and open its volumes: a passphrase tenant's after a
    /// restart, or a KMS tenant's (nacred asks its key manager; no option needed).
    #[command(
        after_help = "Examples:\n  nacre tenant unlock beta --passphrase-file /etc/nacre/beta.pass\n  nacre tenant unlock beta --passphrase-stdin < /run/secrets/beta\n  nacre tenant unlock initech        # a KMS tenant"
    )]
    Unlock {
        /// The tenant.
        name: String,
        #[command(flatten)]
        kek: KekArgs,
    },
    /// Forget a KMS or passphrase tenant's KEK and withdraw its volumes' data keys: the
    /// volumes (and the devices exporting them) fail every I/O ("tenant locked") until
    /// `tenant unlock`.
    #[command(
        after_help = "Examples:\n  nacre tenant lock initech\n  nacre tenant unlock initech"
    )]
    Lock {
        /// The tenant.
        name: String,
    },
    /// Show or change a tenant's encryption policy.
    #[command(
        subcommand,
        after_help = "Examples:\n  nacre tenant policy show acme\n  nacre tenant policy set acme --data-unit 4096 --tweak plain64"
    )]
    Policy(PolicyCmd),
    /// Re-wrap every data key of the tenant under a new KEK (no data is rewritten).
    #[command(
        name = "rotate-kek",
        after_help = "Examples:\n  nacre tenant rotate-kek acme --new-key-file /etc/nacre/acme-2.kek\n  nacre tenant rotate-kek initech --kms-key-id 77ab10          # another key, same KMS\n  nacre tenant rotate-kek initech --kms thales --kms-key-id 5  # another KMS"
    )]
    RotateKek {
        /// The tenant.
        name: String,
        /// With --kms-key-id: a key manager other than the tenant's current one.
        #[arg(long, requires = "kms_key_id")]
        kms: Option<String>,
        #[command(flatten)]
        new_kek: NewKekArgs,
    },
}

#[derive(Subcommand, Debug)]
pub enum PolicyCmd {
    /// Change the policy for volumes created from now on (existing volumes keep theirs).
    #[command(
        after_help = "Examples:\n  nacre tenant policy set acme --data-unit 4096 --tweak plain64 --require-encryption"
    )]
    Set {
        /// The tenant.
        name: String,
        #[command(flatten)]
        policy: PolicyArgs,
    },
    /// Show the policy.
    #[command(after_help = "Examples:\n  nacre tenant policy show acme")]
    Show {
        /// The tenant.
        name: String,
    },
}

/// Where a KEK comes from; exactly one (none for `unlock` of a KMS tenant).
#[derive(Args, Debug)]
#[group(required = false, multiple = false)]
pub struct KekArgs {
    /// File holding exactly 32 random bytes.
    #[arg(long)]
    pub key_file: Option<PathBuf>,
    /// File holding the passphrase (one trailing newline is ignored).
    #[arg(long)]
    pub passphrase_file: Option<PathBuf>,
    /// Read the passphrase from standard input.
    #[arg(long)]
    pub passphrase_stdin: bool,
    /// (create) The unique identifier of an active AES-256 key in the key manager `--kms`:
    /// the tenant's KEK is a random envelope key that only this key can decrypt.
    #[arg(long)]
    pub kms_key_id: Option<String>,
}

/// The new KEK of a rotation; exactly one.
#[derive(Args, Debug)]
#[group(required = true, multiple = false)]
pub struct NewKekArgs {
    /// File holding exactly 32 random bytes.
    #[arg(long)]
    pub new_key_file: Option<PathBuf>,
    /// File holding the new passphrase.
    #[arg(long)]
    pub new_passphrase_file: Option<PathBuf>,
    /// Read the new passphrase from standard input.
    #[arg(long)]
    pub new_passphrase_stdin: bool,
    /// A key in the key manager (the tenant's current one unless --kms says another).
    #[arg(long)]
    pub kms_key_id: Option<String>,
}

#[derive(Args, Debug, Default)]
pub struct PolicyArgs {
    /// aes-xts-256 (default) or aes-xts-128.
    #[arg(long)]
    pub cipher: Option<String>,
    /// Data-unit size: 512 or 4096 (default 4096).
    #[arg(long)]
    pub data_unit: Option<u32>,
    /// plain64 (dm-crypt aes-xts-plain64 layout, default) or be64 (BlueField mlx5 layout).
    #[arg(long)]
    pub tweak: Option<String>,
    /// Refuse unencrypted volumes for this tenant (true/false).
    #[arg(long)]
    pub require_encryption: Option<bool>,
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Tenant name: letters, digits, '_', '-', '.'.
    pub name: String,
    #[command(flatten)]
    pub kek: KekArgs,
    /// The key manager (`nacre kms add`) holding --kms-key-id.
    #[arg(long, requires = "kms_key_id")]
    pub kms: Option<String>,
    /// aes-xts-256 (default) or aes-xts-128.
    #[arg(long)]
    pub cipher: Option<String>,
    /// Data-unit size: 512 or 4096 (default 4096; must not exceed the volumes' block size).
    #[arg(long)]
    pub data_unit: Option<u32>,
    /// plain64 (dm-crypt aes-xts-plain64 layout, default) or be64 (BlueField mlx5 layout).
    #[arg(long)]
    pub tweak: Option<String>,
    /// Refuse unencrypted volumes for this tenant.
    #[arg(long)]
    pub require_encryption: bool,
    /// Argon2id memory cost in KiB for passphrase KEKs [default 65536].
    #[arg(long)]
    pub argon2_memory_kib: Option<u32>,
    /// Argon2id passes for passphrase KEKs [default 3].
    #[arg(long)]
    pub argon2_passes: Option<u32>,
}

#[derive(Args, Debug)]
pub struct CryptoEraseArgs {
    /// The encrypted volume.
    pub name: String,
    /// Confirm: the volume's data becomes permanently unreadable.
    #[arg(long)]
    pub yes: bool,
}

#[derive(Args, Debug)]
pub struct ExportKeyArgs {
    /// The encrypted volume.
    pub name: String,
    /// File to create (mode 0600); an existing file is never overwritten.
    #[arg(long)]
    pub out: PathBuf,
    /// Confirm that the plaintext data key may leave nacred.
    #[arg(long)]
    pub yes_export_plaintext_key: bool,
}

fn absolute(p: &Path) -> Result<String> {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()?.join(p)
    };
    abs.to_str()
        .map(str::to_string)
        .context("path is not valid UTF-8")
}

fn read_passphrase(file: Option<&Path>, stdin: bool) -> Result<Zeroizing<String>> {
    let bytes = match (file, stdin) {
        (Some(f), _) => PassphraseKek::read_passphrase_file(f)?,
        (None, true) => {
            let mut b = Zeroizing::new(Vec::new());
            std::io::stdin()
                .read_to_end(&mut b)
                .context("reading the passphrase from stdin")?;
            while matches!(b.last(), Some(b'\n' | b'\r')) {
                b.pop();
            }
            b
        }
        (None, false) => bail!("no passphrase source"),
    };
    if bytes.is_empty() {
        bail!("the passphrase is empty");
    }
    let s = std::str::from_utf8(&bytes).context("the passphrase must be UTF-8")?;
    Ok(Zeroizing::new(s.to_string()))
}

/// The `kek` params object. Holds the passphrase; never printed.
fn kek_params(
    key_file: Option<&Path>,
    pass_file: Option<&Path>,
    pass_stdin: bool,
) -> Result<Value> {
    if let Some(k) = key_file {
        return Ok(json!({ "key_file": absolute(k)? }));
    }
    let pass = read_passphrase(pass_file, pass_stdin)?;
    Ok(json!({ "passphrase": pass.as_str() }))
}

fn policy_params(p: &PolicyArgs) -> Value {
    let mut v = json!({});
    if let Some(c) = &p.cipher {
        v["cipher"] = json!(c);
    }
    if let Some(u) = p.data_unit {
        v["data_unit"] = json!(u);
    }
    if let Some(t) = &p.tweak {
        v["tweak"] = json!(t);
    }
    if let Some(r) = p.require_encryption {
        v["require_encryption"] = json!(r);
    }
    v
}

pub fn run(ctx: &mut Ctx, cmd: TenantCmd) -> Result<()> {
    match cmd {
        TenantCmd::Create(a) => {
            let mut kek = match &a.kek.kms_key_id {
                Some(id) => json!({"kms": a.kms, "kms_key_id": id}),
                None if a.kek.key_file.is_none()
                    && a.kek.passphrase_file.is_none()
                    && !a.kek.passphrase_stdin =>
                {
                    bail!("give the KEK: --key-file, --passphrase-file, --passphrase-stdin or --kms with --kms-key-id")
                }
                None => kek_params(
                    a.kek.key_file.as_deref(),
                    a.kek.passphrase_file.as_deref(),
                    a.kek.passphrase_stdin,
                )?,
            };
            if let Some(m) = a.argon2_memory_kib {
                kek["argon2_m_cost_kib"] = json!(m);
            }
            if let Some(t) = a.argon2_passes {
                kek["argon2_t_cost"] = json!(t);
            }
            let policy = policy_params(&PolicyArgs {
                cipher: a.cipher,
                data_unit: a.data_unit,
                tweak: a.tweak,
                require_encryption: a.require_encryption.then_some(true),
            });
            let v = ctx.call(
                "tenant_create",
                json!({"name": a.name, "kek": kek, "policy": policy}),
            )?;
            ctx.print(&v, |v| {
                println!(
                    "created tenant {} (KEK from {}, {})",
                    v["name"].as_str().unwrap_or(""),
                    v["kek_source"].as_str().unwrap_or(""),
                    policy_line(&v["policy"])
                )
            });
        }
        TenantCmd::List { name } => {
            let p = name.map(|n| json!({ "name": n })).unwrap_or(Value::Null);
            let v = ctx.call("tenant_list", p)?;
            ctx.print(&v, print_tenants);
        }
        TenantCmd::Show { name } => {
            let v = ctx.call("tenant_show", json!({ "name": name }))?;
            ctx.print(&v, print_tenant);
        }
        TenantCmd::Delete { name, force } => {
            let v = ctx.call("tenant_delete", json!({"name": name, "force": force}))?;
            ctx.print(&v, |_| println!("deleted tenant {name}"));
        }
        TenantCmd::Unlock { name, kek } => {
            if kek.kms_key_id.is_some() {
                bail!("a KMS tenant unlocks with no option: nacred asks the key manager recorded for it");
            }
            // No option: a KMS tenant (nacred asks its key manager).
            let kek =
                if kek.key_file.is_none() && kek.passphrase_file.is_none() && !kek.passphrase_stdin
                {
                    json!({})
                } else {
                    kek_params(
                        kek.key_file.as_deref(),
                        kek.passphrase_file.as_deref(),
                        kek.passphrase_stdin,
                    )?
                };
            let v = ctx.call("tenant_unlock", json!({"name": name, "kek": kek}))?;
            ctx.print(&v, |v| {
                println!(
                    "unlocked tenant {name}; opened {} volume(s)",
                    v["opened"].as_array().map_or(0, Vec::len)
                )
            });
        }
        TenantCmd::Lock { name } => {
            let v = ctx.call("tenant_lock", json!({ "name": name }))?;
            ctx.print(&v, |v| {
                println!(
                    "locked tenant {name}; {} volume(s) now fail I/O until unlocked",
                    v["locked"].as_array().map_or(0, Vec::len)
                )
            });
        }
        TenantCmd::Policy(PolicyCmd::Set { name, policy }) => {
            let mut p = policy_params(&policy);
            p["name"] = json!(name);
            let v = ctx.call("tenant_policy_set", p)?;
            ctx.print(&v, |v| println!("tenant {name}: {}", policy_line(v)));
        }
        TenantCmd::Policy(PolicyCmd::Show { name }) => {
            let v = ctx.call("tenant_policy_show", json!({ "name": name }))?;
            ctx.print(&v, |v| println!("{}", policy_line(v)));
        }
        TenantCmd::RotateKek { name, kms, new_kek } => {
            let kek = match &new_kek.kms_key_id {
                Some(id) => {
                    let mut k = json!({ "kms_key_id": id });
                    if let Some(kms) = kms {
                        k["kms"] = json!(kms);
                    }
                    k
                }
                None => kek_params(
                    new_kek.new_key_file.as_deref(),
                    new_kek.new_passphrase_file.as_deref(),
                    new_kek.new_passphrase_stdin,
                )?,
            };
            let v = ctx.call("tenant_rotate_kek", json!({"name": name, "new_kek": kek}))?;
            ctx.print(&v, |v| {
                println!(
                    "rotated the KEK of tenant {name} (generation {}, {} volume key(s) re-wrapped)",
                    v["kek_generation"],
                    v["volumes"].as_array().map_or(0, Vec::len)
                )
            });
        }
    }
    Ok(())
}

/// `nacre volume crypto-erase NAME --yes`
pub fn crypto_erase(ctx: &mut Ctx, a: CryptoEraseArgs) -> Result<()> {
    if !a.yes {
        bail!(
            "crypto-erase destroys volume {}'s key and makes its data permanently unreadable: add --yes",
            a.name
        );
    }
    let v = ctx.call(
        "volume_crypto_erase",
        json!({"name": a.name, "confirm": true}),
    )?;
    ctx.print(&v, |_| println!("crypto-erased volume {}", a.name));
    Ok(())
}

/// `nacre volume export-key NAME --out FILE --yes-export-plaintext-key`
pub fn export_key(ctx: &mut Ctx, a: ExportKeyArgs) -> Result<()> {
    if !a.yes_export_plaintext_key {
        bail!("exporting writes the plaintext data key to a file: add --yes-export-plaintext-key");
    }
    let path = absolute(&a.out)?;
    let v = ctx.call(
        "volume_export_key",
        json!({"name": a.name, "path": path, "confirm": true}),
    )?;
    ctx.print(&v, |_| {
        println!(
            "wrote the data key of volume {} to {path} (mode 0600)",
            a.name
        )
    });
    Ok(())
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn policy_line(p: &Value) -> String {
    format!(
        "{}, {}-byte data units, tweak {}{}",
        p["cipher"].as_str().unwrap_or(""),
        p["data_unit"],
        p["tweak"].as_str().unwrap_or(""),
        if p["require_encryption"].as_bool().unwrap_or(false) {
            ", encryption required"
        } else {
            ""
        }
    )
}

fn print_tenants(v: &Value) {
    let mut t = Table::new(&["NAME", "KEK", "GEN", "UNLOCKED", "POLICY", "VOLUMES"]);
    for x in v.as_array().into_iter().flatten() {
        t.row(vec![
            x["name"].as_str().unwrap_or("").into(),
            x["kek_source"].as_str().unwrap_or("").into(),
            x["kek_generation"].to_string(),
            if x["unlocked"].as_bool().unwrap_or(false) {
                "yes"
            } else {
                "no"
            }
            .into(),
            policy_line(&x["policy"]),
            x["volumes"].as_array().map_or(0, Vec::len).to_string(),
        ]);
    }
    t.print();
}

fn print_tenant(x: &Value) {
    println!("tenant      {}", x["name"].as_str().unwrap_or(""));
    println!(
        "kek         {}{} (generation {}{})",
        x["kek_source"].as_str().unwrap_or(""),
        x["kek_path"]
            .as_str()
            .map(|p| format!(" {p}"))
            .unwrap_or_default(),
        x["kek_generation"],
        if x["rotation_pending"].as_bool().unwrap_or(false) {
            ", rotation interrupted: re-run rotate-kek"
        } else {
            ""
        }
    );
    if let Some(kms) = x["kms"].as_str() {
        println!("kms         {kms}");
        println!("kms key id  {}", x["kms_key_id"].as_str().unwrap_or(""));
        println!(
            "last contact {}",
            x["kms_last_contact"]
                .as_u64()
                .map(|t| format!("{t} (Unix time, {}s ago)", now_secs().saturating_sub(t)))
                .unwrap_or_else(|| "none since nacred started".into())
        );
    }
    if let Some(why) = x["locked_reason"].as_str() {
        println!("locked      {why}");
    }
    println!("policy      {}", policy_line(&x["policy"]));
    let mut t = Table::new(&["VOLUME", "CIPHER", "UNIT", "TWEAK", "KEY VERSION", "STATE"]);
    for v in x["volumes"].as_array().into_iter().flatten() {
        t.row(vec![
            v["name"].as_str().unwrap_or("").into(),
            v["cipher"].as_str().unwrap_or("").into(),
            v["data_unit"].to_string(),
            v["tweak"].as_str().unwrap_or("").into(),
            v["key_version"].to_string(),
            if v["erased"].as_bool().unwrap_or(false) {
                "crypto-erased"
            } else {
                "active"
            }
            .into(),
        ]);
    }
    t.print();
}
