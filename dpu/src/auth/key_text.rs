//! The text form the two NVMe key formats share: `PREFIX HH:<base64>:`, where `HH` is a
//! two-hex-digit hash identifier and the base64 holds the key followed by its CRC-32 (IEEE,
//! little-endian). DH-HMAC-CHAP secrets use it with the prefix `DHHC-1:` (NVMe Base 2.0
//! §8.13.5.8, the secret representation; [`super::secret`]), TLS pre-shared keys with
//! `NVMeTLSkey-1:` (NVMe/TCP §3.6.1.5, the PSK interchange format; [`super::tls_psk`]). Each
//! format's module says what its hash identifier and key lengths mean.

use base64::Engine;
use zeroize::Zeroizing;

/// Why a text is not a key of the format.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum KeyTextError {
    /// It does not start with the format's prefix.
    Prefix,
    /// Malformed, with what is wrong.
    Format(&'static str),
    /// The CRC-32 does not match the key.
    Crc,
}

/// Parse `PREFIX HH:<base64>:` into the hash identifier and the key bytes (CRC checked).
/// Surrounding white space is ignored; `final_colon_optional` accepts a text without its
/// closing ':' (nvme-cli writes DH-HMAC-CHAP secrets with it, and older tools without).
pub(super) fn parse(
    s: &str,
    prefix: &str,
    final_colon_optional: bool,
) -> Result<(u8, Zeroizing<Vec<u8>>), KeyTextError> {
    let rest = s.trim().strip_prefix(prefix).ok_or(KeyTextError::Prefix)?;
    let (hx, b64) = rest
        .split_once(':')
        .ok_or(KeyTextError::Format("no ':' after the hash"))?;
    if hx.len() != 2 || !hx.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(KeyTextError::Format("the hash is not two hex digits"));
    }
    let hash = u8::from_str_radix(hx, 16)
        .map_err(|_| KeyTextError::Format("the hash is not two hex digits"))?;
    let b64 = match b64.strip_suffix(':') {
        Some(b) => b,
        None if final_colon_optional => b64,
        None => return Err(KeyTextError::Format("it does not end with ':'")),
    };
    let mut raw = Zeroizing::new(
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|_| KeyTextError::Format("the key is not base64"))?,
    );
    if raw.len() < 4 {
        return Err(KeyTextError::Format("the key is empty"));
    }
    let at = raw.len() - 4;
    if crc32fast::hash(&raw[..at]).to_le_bytes() != raw[at..] {
        return Err(KeyTextError::Crc);
    }
    raw.truncate(at);
    Ok((hash, raw))
}

/// `PREFIX HH:<base64 of key || CRC-32>:`. It holds the key: never log it.
pub(super) fn format(prefix: &str, hash: u8, key: &[u8]) -> Zeroizing<String> {
    let mut raw = Zeroizing::new(Vec::with_capacity(key.len() + 4));
    raw.extend_from_slice(key);
    raw.extend_from_slice(&crc32fast::hash(key).to_le_bytes());
    Zeroizing::new(format!(
        "{prefix}{hash:02x}:{}:",
        base64::engine::general_purpose::STANDARD.encode(&*raw)
    ))
}

/// Write `text` to a new file of mode 0600 and sync it; an existing file is replaced only if it
/// already has no group/other permissions. The error says why, for the caller's file error.
pub(super) fn write_private_file(path: &std::path::Path, text: &[u8]) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    if let Ok(m) = std::fs::metadata(path) {
        if m.permissions().mode() & 0o077 != 0 {
            return Err("exists and is readable by others; remove it first".into());
        }
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| e.to_string())?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(|e| e.to_string())?;
    f.write_all(text)
        .and_then(|_| f.sync_all())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let text = format("T-1:", 2, &[7; 32]);
        assert!(text.starts_with("T-1:02:") && text.ends_with(':'));
        let (hash, key) = parse(&text, "T-1:", false).unwrap();
        assert_eq!((hash, key.as_slice()), (2, &[7u8; 32][..]));
        let open = text.trim_end_matches(':');
        assert!(parse(open, "T-1:", true).is_ok());
        assert_eq!(
            parse(open, "T-1:", false),
            Err(KeyTextError::Format("it does not end with ':'"))
        );
        assert_eq!(parse(&text, "U-1:", false), Err(KeyTextError::Prefix));
        assert_eq!(
            parse("T-1:+1:AAAA:", "T-1:", false),
            Err(KeyTextError::Format("the hash is not two hex digits"))
        );
        let mut flipped = text.to_string();
        let i = "T-1:02:".len();
        let c = if &flipped[i..=i] == "A" { "B" } else { "A" };
        flipped.replace_range(i..=i, c);
        assert_eq!(parse(&flipped, "T-1:", false), Err(KeyTextError::Crc));
    }
}
