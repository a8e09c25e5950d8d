//! Tenants and encrypted volumes in the real nacred, driven by the `nacre` CLI and written by
//! libblkio through vhost-user-blk: ciphertext at rest checked by pyca/cryptography with the
//! exported key, KEK rotation across a restart, passphrase tenants that stay locked until
//! unlocked, crypto-erase, and — after all of it — no key byte in the logs or anywhere in the
//! state directory.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use nacre_tests::blkio_client::{self, BlkioClient, ClientOptions};
use nacre_tests::daemon::{bin, Nacred};
use nacre_tests::xts_oracle::{python_cryptography_available, python_decrypt_file, to_hex};
use serde_json::json;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn fails(out: &Output, needle: &str) {
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let e = text(&out.stderr);
    assert!(e.contains(needle), "expected {needle:?} in: {e}");
    assert_eq!(e.trim_end().lines().count(), 1, "errors are one line: {e}");
}

fn random(n: usize) -> Vec<u8> {
    let mut f = std::fs::File::open("/dev/urandom").unwrap();
    let mut b = vec![0u8; n];
    std::io::Read::read_exact(&mut f, &mut b).unwrap();
    b
}

fn cli_stdin(n: &Nacred, args: &[&str], input: &[u8]) -> Output {
    let mut child = Command::new(bin("nacre"))
        .arg("--rpc")
        .arg(&n.rpc)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

/// Every file under `dir`, recursively.
fn files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Whether any 12-byte window of `secret` appears in `hay`, raw or as hex (either case).
fn leaks(hay: &[u8], secret: &[u8]) -> bool {
    let hay_lower = hay.to_ascii_lowercase();
    secret.windows(12).any(|w| {
        let hex = to_hex(w);
        hay.windows(12).any(|h| h == w) || hay_lower.windows(hex.len()).any(|h| h == hex.as_bytes())
    })
}

#[test]
fn tenant_workflow_with_vhost_user_blk_and_no_key_bytes_left_behind() {
    assert!(
        python_cryptography_available(),
        "needs python3 with cryptography (apt-get install python3-cryptography)"
    );
    let mut n = Nacred::start_args(&["--no-default"]);
    let keys = tempfile::tempdir().unwrap();
    let kek1 = random(32);
    let kek2 = random(32);
    let kek1_path = keys.path().join("acme.kek");
    let kek2_path = keys.path().join("acme-2.kek");
    std::fs::write(&kek1_path, &kek1).unwrap();
    std::fs::write(&kek2_path, &kek2).unwrap();
    let k1 = kek1_path.to_str().unwrap();
    let k2 = kek2_path.to_str().unwrap();

    ok(
        &n.cli(&[
            "tenant",
            "create",
            "acme",
            "--key-file",
            k1,
            "--require-encryption",
        ]),
        "tenant create",
    );
    // require-encryption refuses a plaintext volume, and nothing is created.
    fails(
        &n.cli(&[
            "volume", "create", "plain", "--size", "8M", "--tenant", "acme",
        ]),
        "requires encryption",
    );
    assert!(!n.state_dir.join("volumes/plain.img").exists());
    // A policy the volume cannot satisfy: 4096-byte data units on 512-byte blocks.
    fails(
        &n.cli(&[
            "volume",
            "create",
            "small",
            "--size",
            "8M",
            "--block-size",
            "512",
            "--tenant",
            "acme",
            "--encrypt",
        ]),
        "data unit 4096",
    );
    assert!(!n.state_dir.join("volumes/small.img").exists());
    ok(
        &n.cli(&[
            "volume",
            "create",
            "v1",
            "--size",
            "8M",
            "--tenant",
            "acme",
            "--encrypt",
        ]),
        "volume create --encrypt",
    );
    n.ok("vhost_blk_create", json!({"name": "d", "volume": "v1"}));

    // Write through vhost-user-blk with libblkio.
    let sock = n.run_dir.join("vhost-d.sock");
    let writes: Vec<(u64, Vec<u8>)> = vec![
        (0, random(64 * 1024)),
        ((1 << 20) + 4096, random(12 * 1024)),
        ((8 << 20) - 8192, random(8192)),
    ];
    {
        let mut c = BlkioClient::connect(&sock, &ClientOptions::default()).unwrap();
        let mut q = c.take_queues().remove(0);
        for (off, data) in &writes {
            let buf = &mut c.mem()[..data.len()];
            buf.copy_from_slice(data);
            assert_eq!(blkio_client::write(&mut q, *off, buf).unwrap(), 0);
        }
        assert_eq!(blkio_client::flush(&mut q).unwrap(), 0);
        drop(q);
    }

    // Export the data key: confirmation, 0600, never overwrite.
    let key_out = keys.path().join("v1.key");
    let ko = key_out.to_str().unwrap();
    fails(
        &n.cli(&["volume", "export-key", "v1", "--out", ko]),
        "--yes-export-plaintext-key",
    );
    ok(
        &n.cli(&[
            "volume",
            "export-key",
            "v1",
            "--out",
            ko,
            "--yes-export-plaintext-key",
        ]),
        "export-key",
    );
    let data_key = std::fs::read(&key_out).unwrap();
    assert_eq!(data_key.len(), 64);
    assert_eq!(
        std::fs::metadata(&key_out).unwrap().permissions().mode() & 0o777,
        0o600
    );
    fails(
        &n.cli(&[
            "volume",
            "export-key",
            "v1",
            "--out",
            ko,
            "--yes-export-plaintext-key",
        ]),
        "must not exist",
    );

    // Ciphertext at rest, decrypted by the independent oracle.
    let img = n.state_dir.join("volumes/v1.img");
    let raw = std::fs::read(&img).unwrap();
    for (off, data) in &writes {
        let stored = &raw[*off as usize..*off as usize + data.len()];
        for (c, p) in stored.chunks(4096).zip(data.chunks(4096)) {
            assert_ne!(c, p, "plaintext at rest near offset {off}");
        }
        let pt = python_decrypt_file(
            &img,
            &data_key,
            4096,
            "plain64",
            *off,
            data.len(),
            off / 4096,
        )
        .unwrap();
        assert!(pt == *data, "oracle disagrees at offset {off}");
    }

    // Rotate the KEK, restart: the key-file tenant reopens its volume by itself.
    ok(
        &n.cli(&["tenant", "rotate-kek", "acme", "--new-key-file", k2]),
        "rotate-kek",
    );
    let show = n.ok("tenant_show", json!({"name": "acme"}));
    assert_eq!(show["kek_generation"], 2, "{show}");
    assert_eq!(show["kek_path"], k2, "{show}");
    n.restart();
    {
        let mut c = BlkioClient::connect(&sock, &ClientOptions::default()).unwrap();
        let mut q = c.take_queues().remove(0);
        for (off, data) in &writes {
            let buf = &mut c.mem()[..data.len()];
            buf.fill(0);
            assert_eq!(blkio_client::read(&mut q, *off, buf).unwrap(), 0);
            assert!(
                *buf == data[..],
                "read back after rotation and restart at {off}"
            );
        }
        drop(q);
    }
    fails(
        &n.cli(&["tenant", "unlock", "acme", "--key-file", k1]),
        "wrong key-encryption key",
    );

    // A passphrase tenant: locked after a restart until unlocked with the passphrase.
    let pass = "correct horse battery staple";
    let pass_path = keys.path().join("glob.pass");
    std::fs::write(&pass_path, format!("{pass}\n")).unwrap();
    ok(
        &n.cli(&[
            "tenant",
            "create",
            "glob",
            "--passphrase-file",
            pass_path.to_str().unwrap(),
            "--argon2-memory-kib",
            "256",
            "--argon2-passes",
            "1",
            "--tweak",
            "be64",
            "--data-unit",
            "512",
        ]),
        "tenant create (passphrase)",
    );
    ok(
        &n.cli(&[
            "volume",
            "create",
            "g1",
            "--size",
            "4M",
            "--block-size",
            "512",
            "--tenant",
            "glob",
            "--encrypt",
        ]),
        "volume create g1",
    );
    n.restart();
    assert!(
        n.log_text().contains("is locked"),
        "g1 should wait for unlock"
    );
    fails(
        &cli_stdin(
            &n,
            &["tenant", "unlock", "glob", "--passphrase-stdin"],
            b"wrong horse\n",
        ),
        "wrong key-encryption key",
    );
    let out = ok(
        &cli_stdin(
            &n,
            &["tenant", "unlock", "glob", "--passphrase-stdin"],
            format!("{pass}\n").as_bytes(),
        ),
        "unlock",
    );
    assert!(out.contains("opened 1 volume"), "{out}");

    // Deleting a tenant with volumes is refused.
    fails(&n.cli(&["tenant", "delete", "acme"]), "--force");

    // Crypto-erase: refused while exported, then final.
    fails(&n.cli(&["volume", "crypto-erase", "v1"]), "--yes");
    fails(
        &n.cli(&["volume", "crypto-erase", "v1", "--yes"]),
        "exported by",
    );
    n.ok("vhost_blk_delete", json!({"name": "d"}));
    ok(
        &n.cli(&["volume", "crypto-erase", "v1", "--yes"]),
        "crypto-erase",
    );
    let again = keys.path().join("v1-again.key");
    fails(
        &n.cli(&[
            "volume",
            "export-key",
            "v1",
            "--out",
            again.to_str().unwrap(),
            "--yes-export-plaintext-key",
        ]),
        "crypto-erased",
    );
    assert!(!again.exists());
    n.restart();
    assert!(n.log_text().contains("crypto-erased"));

    // No key material anywhere nacred writes: every state file, the log. (The scanner
    // itself finds a key written raw or as hex.)
    assert!(leaks(to_hex(&kek1).to_uppercase().as_bytes(), &kek1));
    assert!(leaks(
        &[b"x".as_slice(), &data_key, b"y"].concat(),
        &data_key
    ));
    n.stop();
    let mut scanned = 0;
    for f in files(&n.state_dir)
        .into_iter()
        .filter(|f| f.extension().is_none_or(|e| e != "img"))
        .chain([n.log.clone()])
    {
        let hay = std::fs::read(&f).unwrap();
        for (what, secret) in [
            ("KEK 1", &kek1[..]),
            ("KEK 2", &kek2[..]),
            ("data key", &data_key[..]),
            ("passphrase", pass.as_bytes()),
        ] {
            assert!(!leaks(&hay, secret), "{what} found in {}", f.display());
        }
        scanned += 1;
    }
    assert!(scanned >= 2, "state file and log scanned");
    // The state does hold the wrapped keys (so the scan looked at real content).
    let state = std::fs::read_to_string(n.state_dir.join("state.json")).unwrap();
    assert!(
        state.contains("\"wrapped\"") && state.contains("\"g1\""),
        "{state}"
    );
}

#[test]
fn tenant_rpc_refuses_bad_input_with_clear_errors() {
    let n = Nacred::start_args(&["--no-default"]);
    let dir = tempfile::tempdir().unwrap();
    let kek = dir.path().join("t.kek");
    std::fs::write(&kek, random(32)).unwrap();
    let k = kek.to_str().unwrap();
    for (params, needle) in [
        (json!({"name": "t", "kek": {}}), "exactly one KEK source"),
        (
            json!({"name": "t", "kek": {"key_file": k, "passphrase": "x"}}),
            "exactly one KEK source",
        ),
        (
            json!({"name": "t", "kek": {"key_file": "rel.kek"}}),
            "absolute",
        ),
        (
            json!({"name": "t", "kek": {"key_file": k}, "policy": {"tweak": "be32"}}),
            "plain64 or be64",
        ),
        (
            json!({"name": "t", "kek": {"key_file": k}, "policy": {"data_unit": 1024}}),
            "512 or 4096",
        ),
        (
            json!({"name": "t", "kek": {"key_file": k}, "policy": {"cipher": "des"}}),
            "aes-xts-256",
        ),
        (json!({"name": "../t", "kek": {"key_file": k}}), "invalid"),
        // Argon2id costs are bounded: 4 TiB of memory would abort nacred, 2^32 passes would
        // hold the control plane for days.
        (
            json!({"name": "t", "kek": {"passphrase": "pw", "argon2_m_cost_kib": u32::MAX}}),
            "memory (m_cost, KiB) 4294967295 is outside",
        ),
        (
            json!({"name": "t", "kek": {"passphrase": "pw", "argon2_t_cost": u32::MAX}}),
            "passes (t_cost)",
        ),
        (
            json!({"name": "t", "kek": {"passphrase": "pw", "argon2_t_cost": 0}}),
            "passes (t_cost)",
        ),
        (
            json!({"name": "t", "kek": {"key_file": dir.path().join("missing").to_str()}}),
            "key file",
        ),
    ] {
        let (_, msg) = n.err("tenant_create", params.clone());
        assert!(msg.contains(needle), "{params}: {msg}");
    }
    assert!(n
        .ok("tenant_list", json!({}))
        .as_array()
        .unwrap()
        .is_empty());

    // A 31-byte key file, and a good one.
    std::fs::write(&kek, random(31)).unwrap();
    let (_, msg) = n.err(
        "tenant_create",
        json!({"name": "t", "kek": {"key_file": k}}),
    );
    assert!(msg.contains("exactly 32"), "{msg}");
    std::fs::write(&kek, random(32)).unwrap();
    n.ok(
        "tenant_create",
        json!({"name": "t", "kek": {"key_file": k}}),
    );
    let (_, msg) = n.err(
        "tenant_create",
        json!({"name": "t", "kek": {"key_file": k}}),
    );
    assert!(msg.contains("already exists"), "{msg}");

    // Encryption needs an existing tenant; a plaintext volume of t blocks require-encryption.
    let (_, msg) = n.err(
        "volume_create",
        json!({"name": "v", "size": 1 << 20, "backend": "ram", "tenant": "nobody", "encrypt": true}),
    );
    assert!(msg.contains("does not exist"), "{msg}");
    let (_, msg) = n.err(
        "volume_create",
        json!({"name": "v", "size": 1 << 20, "backend": "ram", "encrypt": true}),
    );
    assert!(msg.contains("needs a tenant"), "{msg}");
    n.ok(
        "volume_create",
        json!({"name": "p", "size": 1 << 20, "backend": "ram", "tenant": "t"}),
    );
    let (_, msg) = n.err(
        "tenant_policy_set",
        json!({"name": "t", "require_encryption": true}),
    );
    assert!(msg.contains("unencrypted volumes (p)"), "{msg}");
    let pol = n.ok(
        "tenant_policy_set",
        json!({"name": "t", "tweak": "be64", "data_unit": 512}),
    );
    assert_eq!(pol["tweak"], "be64");
    // Key operations need an encrypted volume and explicit confirmation.
    let (_, msg) = n.err("volume_crypto_erase", json!({"name": "p"}));
    assert!(msg.contains("confirm"), "{msg}");
    let (_, msg) = n.err("volume_crypto_erase", json!({"name": "p", "confirm": true}));
    assert!(msg.contains("not encrypted"), "{msg}");
    n.ok(
        "volume_create",
        json!({"name": "e", "size": 1 << 20, "block_size": 512, "backend": "ram", "tenant": "t", "encrypt": true}),
    );
    let out = dir.path().join("e.key");
    let (_, msg) = n.err(
        "volume_export_key",
        json!({"name": "e", "path": out.to_str(), "confirm": false}),
    );
    assert!(msg.contains("confirmation"), "{msg}");
    assert!(!out.exists());
    let (_, msg) = n.err(
        "volume_export_key",
        json!({"name": "e", "path": "e.key", "confirm": true}),
    );
    assert!(msg.contains("absolute"), "{msg}");
    // The volume was created with the be64/512 policy in force at the time.
    let show = n.ok("tenant_show", json!({"name": "t"}));
    assert_eq!(show["volumes"][0]["tweak"], "be64", "{show}");
    assert_eq!(show["volumes"][0]["data_unit"], 512, "{show}");
    // Deletion: refused with volumes, allowed with force.
    let (_, msg) = n.err("tenant_delete", json!({"name": "t"}));
    assert!(msg.contains("--force"), "{msg}");
    n.ok("tenant_delete", json!({"name": "t", "force": true}));
    assert!(n
        .ok("tenant_list", json!({}))
        .as_array()
        .unwrap()
        .is_empty());
}
