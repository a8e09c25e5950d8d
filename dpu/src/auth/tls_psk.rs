//! Pre-shared keys for NVMe/TCP over TLS 1.3 (NVMe/TCP Transport §3.6, from TP 8011): the
//! PSK interchange format, the retained PSK, the PSK identity and the TLS PSK, as Linux
//! (nvme-cli `gen-tls-key`/`check-tls-key`) and SPDK make them.
//!
//! ```text
//! configured PSK   NVMeTLSkey-1:HH:<base64 of the key followed by its CRC-32, little-endian>:
//!                  HH: 00 the key is used as is; 01 SHA-256 (32-byte key); 02 SHA-384 (48 bytes)
//! retained PSK     HKDF-Expand-Label(HKDF-Extract(0, configured), "HostNQN", host NQN, L)
//!                  with HH's hash (00: the configured PSK itself)
//! PSK identity     "NVMe0R0" S " " host NQN " " subsystem NQN
//!                  S: 1 TLS_AES_128_GCM_SHA256, 2 TLS_AES_256_GCM_SHA384
//! TLS PSK          HKDF-Expand-Label(HKDF-Extract(0, retained), "nvme-tls-psk", identity, L)
//!                  with the cipher suite's hash
//! ```
//!
//! `HKDF-Expand-Label` is TLS 1.3's (RFC 8446 §7.1: the label gets the "tls13 " prefix, L is the
//! key's length). The cipher suite follows the key's length: a 32-byte key makes
//! TLS_AES_128_GCM_SHA256, a 48-byte key TLS_AES_256_GCM_SHA384, which is what SPDK's host
//! (`spdk_nvme_perf --psk-path`) and target do. The TLS PSK is the external PSK both ends
//! hand to TLS 1.3 under the identity above.
//!
//! The newer identity form `NVMe1R0S <host NQN> <subsystem NQN> <PSK digest>` (TP 8018) is
//! recognised and refused: SPDK v25.09 does not send it, and nacred does not derive its digest.
//!
//! A [`TlsPsk`] holds the key zeroized on drop; its `Debug` form shows only the hash and the
//! length. Files holding keys must not be readable by group or others ([`TlsPsk::load`]).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use nacre_shared::nvme::auth::HashId;
use zeroize::Zeroizing;

use super::hmac;
use super::key_text::KeyTextError;

/// The interchange format's prefix (its version 1).
pub const INTERCHANGE_PREFIX: &str = "NVMeTLSkey-1:";
/// The prefix of the version-0 PSK identity (a retained PSK, "R"), before the suite digit.
pub const IDENTITY_PREFIX: &str = "NVMe0R0";
/// The HKDF label the retained PSK is derived with.
const LABEL_RETAINED: &[u8] = b"HostNQN";
/// The HKDF label the TLS PSK is derived with.
const LABEL_TLS_PSK: &[u8] = b"nvme-tls-psk";

/// A key, identity or file could not be read or used.
#[derive(Debug, thiserror::Error)]
pub enum TlsPskError {
    #[error("not an NVMe TLS PSK: {0} (expected NVMeTLSkey-1:HH:<base64>:)")]
    Format(&'static str),
    #[error("NVMe TLS PSK has a bad CRC-32 (mistyped or truncated)")]
    Crc,
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: {err}")]
    File { path: String, err: String },
}

/// The two TLS 1.3 cipher suites NVMe/TCP uses (§3.6.1.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CipherSuite {
    Aes128GcmSha256,
    Aes256GcmSha384,
}

impl CipherSuite {
    /// The suite a configured PSK of `len` bytes makes.
    pub fn for_key_len(len: usize) -> Option<CipherSuite> {
        match len {
            32 => Some(CipherSuite::Aes128GcmSha256),
            48 => Some(CipherSuite::Aes256GcmSha384),
            _ => None,
        }
    }

    /// The digit the PSK identity names it by.
    pub fn identity_digit(self) -> char {
        match self {
            CipherSuite::Aes128GcmSha256 => '1',
            CipherSuite::Aes256GcmSha384 => '2',
        }
    }

    pub fn hash(self) -> HashId {
        match self {
            CipherSuite::Aes128GcmSha256 => HashId::Sha256,
            CipherSuite::Aes256GcmSha384 => HashId::Sha384,
        }
    }

    /// The IANA name (and OpenSSL's TLS 1.3 cipher suite name).
    pub fn name(self) -> &'static str {
        match self {
            CipherSuite::Aes128GcmSha256 => "TLS_AES_128_GCM_SHA256",
            CipherSuite::Aes256GcmSha384 => "TLS_AES_256_GCM_SHA384",
        }
    }

    /// The two bytes TLS names it by on the wire (RFC 8446 Appendix B.4).
    pub fn id(self) -> [u8; 2] {
        match self {
            CipherSuite::Aes128GcmSha256 => [0x13, 0x01],
            CipherSuite::Aes256GcmSha384 => [0x13, 0x02],
        }
    }
}

/// A configured PSK: the hash of its retained-PSK derivation (0: none) and the key.
#[derive(Clone)]
pub struct TlsPsk {
    hash: u8,
    key: Zeroizing<Vec<u8>>,
}

impl std::fmt::Debug for TlsPsk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TlsPsk(NVMeTLSkey-1:{:02x}, {} bytes, <redacted>)",
            self.hash,
            self.key.len()
        )
    }
}

fn hash_of(h: u8) -> Option<HashId> {
    match h {
        1 => Some(HashId::Sha256),
        2 => Some(HashId::Sha384),
        _ => None,
    }
}

impl TlsPsk {
    /// A configured PSK from its hash (0-2) and key (32 or 48 bytes; hash 1 needs 32 and hash
    /// 2 needs 48).
    pub fn new(hash: u8, key: &[u8]) -> Result<TlsPsk, TlsPskError> {
        let want = match hash {
            0 => None,
            1 => Some(32),
            2 => Some(48),
            _ => {
                return Err(TlsPskError::Invalid(format!(
                    "PSK hash {hash:02x} is not 00, 01 (SHA-256) or 02 (SHA-384)"
                )))
            }
        };
        if CipherSuite::for_key_len(key.len()).is_none() || want.is_some_and(|w| w != key.len()) {
            return Err(TlsPskError::Invalid(format!(
                "PSK is {} bytes; hash {hash:02x} takes {}",
                key.len(),
                match want {
                    Some(32) => "32",
                    Some(_) => "48",
                    None => "32 or 48",
                }
            )));
        }
        Ok(TlsPsk {
            hash,
            key: Zeroizing::new(key.to_vec()),
        })
    }

    /// A new configured PSK as `nvme gen-tls-key --hmac=H` makes one: `secret` (random when
    /// `None`) of the hash's length, 32 bytes for 1 and 48 for 2.
    pub fn generate(hash: u8, secret: Option<&[u8]>) -> Result<TlsPsk, TlsPskError> {
        let len = match hash {
            1 => 32,
            2 => 48,
            _ => {
                return Err(TlsPskError::Invalid(format!(
                    "--hmac {hash} is not 1 (SHA-256) or 2 (SHA-384)"
                )))
            }
        };
        match secret {
            Some(s) => TlsPsk::new(hash, s),
            None => {
                let mut r = Zeroizing::new(vec![0u8; len]);
                getrandom::fill(&mut r)
                    .map_err(|e| TlsPskError::Invalid(format!("no randomness: {e}")))?;
                TlsPsk::new(hash, &r)
            }
        }
    }

    /// Parse the interchange format (surrounding whitespace allowed; the final ':' required,
    /// as SPDK and nvme-cli require it).
    pub fn parse(s: &str) -> Result<TlsPsk, TlsPskError> {
        let (hash, key) =
            super::key_text::parse(s, INTERCHANGE_PREFIX, false).map_err(|e| match e {
                KeyTextError::Prefix => TlsPskError::Format("it does not start with NVMeTLSkey-1:"),
                KeyTextError::Format(what) => TlsPskError::Format(what),
                KeyTextError::Crc => TlsPskError::Crc,
            })?;
        TlsPsk::new(hash, &key)
    }

    /// The interchange format, `NVMeTLSkey-1:HH:...:`. It holds the key: never log it.
    pub fn to_interchange(&self) -> Zeroizing<String> {
        super::key_text::format(INTERCHANGE_PREFIX, self.hash, &self.key)
    }

    /// The hash of the retained-PSK derivation (0: none).
    pub fn hash(&self) -> u8 {
        self.hash
    }

    pub fn key_len(&self) -> usize {
        self.key.len()
    }

    /// The cipher suite this key is used with.
    pub fn cipher_suite(&self) -> CipherSuite {
        CipherSuite::for_key_len(self.key.len()).expect("checked by TlsPsk::new")
    }

    /// The retained PSK for `hostnqn`: HKDF-Expand-Label(HKDF-Extract(0, key), "HostNQN",
    /// hostnqn, L) with the key's hash, or the key itself for hash 00.
    pub fn retained(&self, hostnqn: &str) -> Zeroizing<Vec<u8>> {
        match hash_of(self.hash) {
            None => Zeroizing::new(self.key.to_vec()),
            Some(h) => hkdf_label(
                h,
                &self.key,
                LABEL_RETAINED,
                hostnqn.as_bytes(),
                self.key.len(),
            ),
        }
    }

    /// The TLS PSK a connection from `hostnqn` to `subnqn` uses, and the identity it is
    /// offered under.
    pub fn tls_psk(&self, hostnqn: &str, subnqn: &str) -> (String, Zeroizing<Vec<u8>>) {
        let suite = self.cipher_suite();
        let id = identity(suite, hostnqn, subnqn);
        let retained = self.retained(hostnqn);
        let psk = tls_psk(&retained, &id, suite);
        (id, psk)
    }

    /// Write the TLS PSK `hostnqn` uses toward `subnqn` as one line of the key file Linux's
    /// nvme-cli reads (`nvme tls-key --import --keyfile`): the identity, a space, and the
    /// derived key in the interchange format (`NVMeTLSkey-1:HH:...:`; nvme-cli 2.13 exports
    /// `NVMeTLSkey-0:` there but imports only version 1), created mode 0600. nvme-cli imports
    /// such a line into the
    /// kernel's `.nvme` keyring as it is, without deriving anything: the way to give a Linux
    /// host the key nacred derives when its own nvme-cli derives another one (nvme-cli 2.13
    /// and libnvme 1.13, Debian 13's, encode HKDF-Expand-Label without its length prefixes,
    /// so `nvme check-tls-key --insert` makes a key neither nacred nor SPDK accepts).
    pub fn write_keyring_line(
        &self,
        hostnqn: &str,
        subnqn: &str,
        path: &Path,
    ) -> Result<(), TlsPskError> {
        let (id, psk) = self.tls_psk(hostnqn, subnqn);
        let hash = match self.cipher_suite() {
            CipherSuite::Aes128GcmSha256 => 1,
            CipherSuite::Aes256GcmSha384 => 2,
        };
        let key = super::key_text::format(INTERCHANGE_PREFIX, hash, &psk);
        let line = Zeroizing::new(format!("{id} {}\n", &*key));
        super::key_text::write_private_file(path, line.as_bytes()).map_err(|err| {
            TlsPskError::File {
                path: path.display().to_string(),
                err,
            }
        })
    }

    /// Read a configured PSK from a file that only its owner may read (mode 0600 or
    /// stricter).
    pub fn load(path: &Path) -> Result<TlsPsk, TlsPskError> {
        let file_err = |err: String| TlsPskError::File {
            path: path.display().to_string(),
            err,
        };
        let meta = std::fs::metadata(path).map_err(|e| file_err(e.to_string()))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(file_err(format!(
                "mode {mode:04o} lets others read this key; chmod 600 it"
            )));
        }
        let text =
            Zeroizing::new(std::fs::read_to_string(path).map_err(|e| file_err(e.to_string()))?);
        TlsPsk::parse(&text).map_err(|e| file_err(e.to_string()))
    }

    /// Write the interchange format, without a newline, to a new file of mode 0600 (an
    /// existing file is replaced only if it already has no group/other permissions).
    pub fn write_file(&self, path: &Path) -> Result<(), TlsPskError> {
        let file_err = |err: String| TlsPskError::File {
            path: path.display().to_string(),
            err,
        };
        // No newline after it: SPDK's `--psk-path` takes the file's bytes as the key, and
        // the format's last character must be ':'.
        super::key_text::write_private_file(path, self.to_interchange().as_bytes())
            .map_err(file_err)
    }
}

/// The version-0 PSK identity: `NVMe0R0S <hostnqn> <subnqn>`.
pub fn identity(suite: CipherSuite, hostnqn: &str, subnqn: &str) -> String {
    format!(
        "{IDENTITY_PREFIX}{} {hostnqn} {subnqn}",
        suite.identity_digit()
    )
}

/// A PSK identity a host offered, taken apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub suite: CipherSuite,
    pub hostnqn: String,
    pub subnqn: String,
}

/// Parse a version-0 identity; the version-1 form (with a PSK digest) and anything else are
/// refused with the reason.
pub fn parse_identity(id: &[u8]) -> Result<Identity, TlsPskError> {
    let id = std::str::from_utf8(id)
        .map_err(|_| TlsPskError::Invalid("PSK identity is not UTF-8".into()))?;
    if id.starts_with("NVMe1R0") {
        return Err(TlsPskError::Invalid(
            "PSK identity version 1 (with a PSK digest) is not supported".into(),
        ));
    }
    let rest = id
        .strip_prefix(IDENTITY_PREFIX)
        .ok_or_else(|| TlsPskError::Invalid("PSK identity does not start with NVMe0R0".into()))?;
    let mut parts = rest.split(' ');
    let suite = match parts.next() {
        Some("1") => CipherSuite::Aes128GcmSha256,
        Some("2") => CipherSuite::Aes256GcmSha384,
        _ => {
            return Err(TlsPskError::Invalid(
                "PSK identity names no cipher suite 01 or 02".into(),
            ))
        }
    };
    let (Some(hostnqn), Some(subnqn), None) = (parts.next(), parts.next(), parts.next()) else {
        return Err(TlsPskError::Invalid(
            "PSK identity is not NVMe0R0S <hostnqn> <subnqn>".into(),
        ));
    };
    if hostnqn.is_empty() || subnqn.is_empty() {
        return Err(TlsPskError::Invalid("PSK identity has an empty NQN".into()));
    }
    Ok(Identity {
        suite,
        hostnqn: hostnqn.to_string(),
        subnqn: subnqn.to_string(),
    })
}

/// The TLS PSK from a retained PSK: HKDF-Expand-Label(HKDF-Extract(0, retained),
/// "nvme-tls-psk", identity, L) with the suite's hash.
pub fn tls_psk(retained: &[u8], identity: &str, suite: CipherSuite) -> Zeroizing<Vec<u8>> {
    hkdf_label(
        suite.hash(),
        retained,
        LABEL_TLS_PSK,
        identity.as_bytes(),
        retained.len(),
    )
}

/// HKDF-Expand-Label(HKDF-Extract(salt = none, ikm), label, context, len) (RFC 5869, RFC 8446
/// §7.1). A missing salt is a hash-length string of zeros, which HMAC treats as the empty key.
fn hkdf_label(
    h: HashId,
    ikm: &[u8],
    label: &[u8],
    context: &[u8],
    len: usize,
) -> Zeroizing<Vec<u8>> {
    let prk = hmac(h, &[], &[ikm]);
    let full_label = [b"tls13 ", label].concat();
    // The HkdfLabel structure: uint16 length, opaque label<7..255>, opaque context<0..255>.
    // Labels and NQNs (at most 223 bytes) fit their one-byte lengths.
    let mut info = Vec::with_capacity(4 + full_label.len() + context.len());
    info.extend_from_slice(&(len as u16).to_be_bytes());
    info.push(full_label.len() as u8);
    info.extend_from_slice(&full_label);
    info.push(context.len().min(255) as u8);
    info.extend_from_slice(&context[..context.len().min(255)]);
    let mut out = Zeroizing::new(Vec::with_capacity(len));
    let mut t: Zeroizing<Vec<u8>> = Zeroizing::new(Vec::new());
    let mut counter = 1u8;
    while out.len() < len {
        t = hmac(h, &prk, &[&t, &info, &[counter]]);
        let take = (len - out.len()).min(t.len());
        out.extend_from_slice(&t[..take]);
        counter += 1;
    }
    out
}

#[cfg(test)]
mod test {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    const HOST: &str = "nqn.2016-06.io.spdk:host1";
    const SUB: &str = "nqn.2016-06.io.spdk:cnode1";

    /// nvme-cli's key-file line: the identity, a space, the derived TLS PSK in the
    /// interchange format (what `nvme tls-key --import` splits at the last space), mode 0600.
    #[test]
    fn keyring_line_holds_the_identity_and_the_derived_key() {
        use std::os::unix::fs::PermissionsExt;
        for hash in [1, 2] {
            let k = TlsPsk::generate(hash, None).unwrap();
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("keys");
            k.write_keyring_line(HOST, SUB, &p).unwrap();
            let text = std::fs::read_to_string(&p).unwrap();
            let (id, key) = text.trim_end().rsplit_once(' ').unwrap();
            let (want_id, want_key) = k.tls_psk(HOST, SUB);
            assert_eq!(id, want_id);
            let got = TlsPsk::parse(key).unwrap();
            assert_eq!(got.hash(), hash);
            assert_eq!(&*got.key, &*want_key);
            assert_eq!(
                std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
                0o600
            );
        }
    }
    /// The key SPDK's TLS tests configure (test/nvmf/target/tls.sh): the ASCII string
    /// "00112233445566778899aabbccddeeff" with hash 01.
    const SPDK_KEY: &str = "NVMeTLSkey-1:01:MDAxMTIyMzM0NDU1NjY3Nzg4OTlhYWJiY2NkZGVlZmZwJEiQ:";

    #[test]
    fn interchange_format_round_trips_spdks_test_key() {
        let k = TlsPsk::parse(SPDK_KEY).unwrap();
        assert_eq!(k.hash(), 1);
        assert_eq!(&*k.key, b"00112233445566778899aabbccddeeff");
        assert_eq!(&*k.to_interchange(), SPDK_KEY);
        assert_eq!(k.cipher_suite(), CipherSuite::Aes128GcmSha256);
        // 48 bytes 00..2f with hash 02 (CRC-32 from Python's zlib).
        let k = TlsPsk::generate(2, Some(&(0u8..48).collect::<Vec<_>>())).unwrap();
        assert_eq!(
            &*k.to_interchange(),
            "NVMeTLSkey-1:02:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vcSEgBQ==:"
        );
        assert_eq!(k.cipher_suite(), CipherSuite::Aes256GcmSha384);
    }

    #[test]
    fn malformed_keys_are_refused_with_the_reason() {
        let bad_crc = SPDK_KEY.replace("EiQ", "EiR");
        assert!(matches!(TlsPsk::parse(&bad_crc), Err(TlsPskError::Crc)));
        for s in [
            "DHHC-1:01:MDAx:",
            "NVMeTLSkey-1:1:MDAx:",
            "NVMeTLSkey-1:01:MDAxMTIyMzM0NDU1NjY3Nzg4OTlhYWJiY2NkZGVlZmZwJEiQ",
            "NVMeTLSkey-1:01:!!!!:",
            "NVMeTLSkey-1:01::",
        ] {
            assert!(
                matches!(TlsPsk::parse(s), Err(TlsPskError::Format(_))),
                "{s}"
            );
        }
        // Hash 02 with a 32-byte key, hash 03, a 16-byte key.
        assert!(TlsPsk::parse(&SPDK_KEY.replace(":01:", ":02:")).is_err());
        assert!(TlsPsk::parse(&SPDK_KEY.replace(":01:", ":03:")).is_err());
        assert!(TlsPsk::new(0, &[0; 16]).is_err());
        assert!(TlsPsk::new(0, &[0; 48]).is_ok());
        assert!(format!("{:?}", TlsPsk::parse(SPDK_KEY).unwrap()).contains("redacted"));
    }

    /// Known answers computed with Python `cryptography`'s HKDF over the HkdfLabel layout
    /// SPDK's `nvme_tcp_derive_retained_psk` / `nvme_tcp_derive_tls_psk` build.
    #[test]
    fn derivations_match_an_independent_hkdf() {
        let k = TlsPsk::parse(SPDK_KEY).unwrap();
        assert_eq!(
            *k.retained(HOST),
            hex("1fec2d4b69d3cb88e56214d464f00b168d2a635024b7a893aa6fad2840f49f2a")
        );
        let (id, psk) = k.tls_psk(HOST, SUB);
        assert_eq!(id, format!("NVMe0R01 {HOST} {SUB}"));
        assert_eq!(
            *psk,
            hex("45956d30221db43e664e8d6e78a79c31a81824cbd12acfdaca0e6032b335bbd9")
        );

        let k = TlsPsk::new(2, &(0u8..48).collect::<Vec<_>>()).unwrap();
        assert_eq!(
            *k.retained(HOST),
            hex("f5ea5a564fe603263adfa29f56413f0ccfef77253f5f9453f3b1cbd713647df6c12a219bf584377651a9281aa441b7b3")
        );
        let (id, psk) = k.tls_psk(HOST, SUB);
        assert_eq!(id, format!("NVMe0R02 {HOST} {SUB}"));
        assert_eq!(
            *psk,
            hex("20efe643239f00f8e8bcc2b6899c2799127f10c8c9cb11ecf0996b5a56e5b38786e2899a275ea73968ef20008662bae6")
        );
        // Hash 00: the configured PSK is the retained PSK.
        let k = TlsPsk::new(0, &(0u8..48).collect::<Vec<_>>()).unwrap();
        assert_eq!(*k.retained(HOST), (0u8..48).collect::<Vec<_>>());
    }

    #[test]
    fn identities_parse_and_the_digest_form_is_refused() {
        let id = parse_identity(format!("NVMe0R02 {HOST} {SUB}").as_bytes()).unwrap();
        assert_eq!(
            id,
            Identity {
                suite: CipherSuite::Aes256GcmSha384,
                hostnqn: HOST.into(),
                subnqn: SUB.into()
            }
        );
        for bad in [
            format!("NVMe1R01 {HOST} {SUB} abcd"),
            format!("NVMe0R03 {HOST} {SUB}"),
            format!("NVMe0R01 {HOST}"),
            format!("NVMe0R01 {HOST} {SUB} x"),
            "psk.spdk.io".to_string(),
        ] {
            assert!(parse_identity(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn key_files_must_be_private() {
        let dir = std::env::temp_dir().join(format!("nacre-tls-psk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("k");
        let k = TlsPsk::parse(SPDK_KEY).unwrap();
        k.write_file(&p).unwrap();
        assert_eq!(TlsPsk::load(&p).unwrap().key_len(), 32);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = TlsPsk::load(&p).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
