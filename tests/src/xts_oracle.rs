//! An XTS oracle independent of nacre's engines: Python's `cryptography` package (pyca,
//! backed by the system OpenSSL), driven through `python3`. Tests use it to decrypt what the
//! encrypting volume wrote to its backing file and compare with what was written.
//!
//! The key is passed on the child's stdin, never on its command line.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// Decode a hex string; whitespace is ignored so long vectors can be wrapped.
pub fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    assert!(digits.len() % 2 == 0, "odd-length hex");
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).expect("hex digit"))
        .collect()
}

/// Lower-case hex of `b`.
pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Whether `python3 -c "import cryptography"` works on this machine. Install with
/// `apt-get install python3-cryptography` (or `pip install cryptography`).
pub fn python_cryptography_available() -> bool {
    Command::new("python3")
        .args(["-c", "import cryptography.hazmat.primitives.ciphers"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

const DECRYPT_PY: &str = r#"
import sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
key = bytes.fromhex(sys.stdin.readline().strip())
path, unit, mode, offset, length, first = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
out = sys.stdout.buffer
with open(path, "rb") as f:
    f.seek(offset)
    data = f.read(length)
assert len(data) == length, "short read"
for i in range(0, length, unit):
    n = first + i // unit
    if mode == "plain64":
        tweak = n.to_bytes(8, "little") + bytes(8)
    elif mode == "be64":
        tweak = bytes(8) + n.to_bytes(8, "big")
    else:
        raise SystemExit("bad mode")
    d = Cipher(algorithms.AES(key), modes.XTS(tweak)).decryptor()
    out.write(d.update(data[i:i + unit]) + d.finalize())
"#;

/// Decrypt `length` bytes at byte `offset` of the file at `path`, which holds an XTS volume
/// with data units of `unit` bytes and tweak mode `mode` ("plain64" or "be64"); the first
/// unit read is data unit number `first_unit` (for a volume file: `offset / unit`).
pub fn python_decrypt_file(
    path: &Path,
    key: &[u8],
    unit: usize,
    mode: &str,
    offset: u64,
    length: usize,
    first_unit: u64,
) -> Result<Vec<u8>> {
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(DECRYPT_PY)
        .arg(path)
        .arg(unit.to_string())
        .arg(mode)
        .arg(offset.to_string())
        .arg(length.to_string())
        .arg(first_unit.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting python3")?;
    {
        let mut stdin = child.stdin.take().context("python3 stdin")?;
        writeln!(stdin, "{}", to_hex(key))?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "python3 oracle failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out.stdout)
}
