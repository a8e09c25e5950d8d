//! Tenant KEKs kept by a key manager that speaks KMIP (OASIS KMIP 1.2) over mutual TLS.
//!
//! ## Envelope scheme
//! The key manager's AES key never leaves it. A KMIP tenant's KEK (the 32-byte AES-256-GCM
//! key that wraps its data keys exactly as for key-file tenants: [`super::wrap`]) is a
//! random *envelope key* made by nacred. nacred asks the key manager to encrypt it with its
//! key (KMIP `Encrypt`, AES-CBC with PKCS#5 padding and a fresh random IV), and persists only
//! the key manager's name, the key's unique identifier, the IV and the ciphertext
//! ([`KekSpec::Kms`]). To unlock, nacred sends the ciphertext back (KMIP `Decrypt`) and holds
//! the envelope key in zeroize-on-drop memory until the tenant is locked or deleted.
//!
//! CBC carries no integrity. The envelope key that comes back is therefore only used after
//! the tenant's KEK check (an AES-256-GCM tag under the envelope key, in the tenant record)
//! has verified it; every data key is itself GCM-authenticated under it. A tampered blob, a
//! different key at the key manager, or a lying key manager yields `WrongKek`, never a key
//! that is used. (CBC with a random IV, not GCM: PyKMIP, the reference server the tests run
//! against, has no authenticated mode, and CBC is in every KMIP server's profile.)
//!
//! ## Transport
//! One TLS connection per operation: TCP connect, handshake (TLS 1.2 or 1.3; the server's
//! certificate must chain to the endpoint's CA and only to it, nacred's client certificate
//! is sent), one request, one response. Everything is bounded by the endpoint's timeout,
//! counted from the start of the operation. Callers never hold the control plane's lock
//! while this runs. Requests and answers are encoded with [`ttlv`] (`kmip-protocol` has no
//! Encrypt/Decrypt, and two fixed messages do not need a serde mapping).

pub mod ttlv;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::unbuffered::{ConnectionState, UnbufferedStatus};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use self::ttlv::{tag, Item};
use super::kek::{KekSource, KekSpec};
use super::keys::{Kek, KEK_LEN};
use super::CryptoError;

/// The IANA-registered KMIP port.
pub const KMIP_PORT: u16 = 5696;
/// Default bound on one KMIP operation, connect to answer.
pub const DEFAULT_TIMEOUT_MS: u64 = 5000;
/// Largest answer accepted (an Encrypt/Decrypt answer is a few hundred bytes).
const MAX_MESSAGE: usize = 64 * 1024;
/// Room for TLS records in and out (a record is at most 16 KiB of plaintext plus 2 KiB).
const TLS_BUFFER: usize = 20 * 1024;
/// AES block (and CBC IV) length.
const IV_LEN: usize = 16;

/// KMIP enumerations (KMIP 1.2 Specification §9.1.3.2).
mod enums {
    /// Operation (§9.1.3.2.27).
    pub const OP_ENCRYPT: u32 = 0x1F;
    pub const OP_DECRYPT: u32 = 0x20;
    /// Block Cipher Mode: CBC.
    pub const MODE_CBC: u32 = 0x01;
    /// Padding Method: PKCS5.
    pub const PADDING_PKCS5: u32 = 0x03;
    /// Cryptographic Algorithm: AES.
    pub const ALG_AES: u32 = 0x03;
    /// Result Status: Success.
    pub const STATUS_SUCCESS: u32 = 0;
}

/// A configured key manager, as persisted in the state (paths only: the client key stays
/// in its file, read at each connection).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KmsEndpoint {
    pub name: String,
    /// `HOST:PORT`; the host is also the name the server's certificate must carry.
    pub address: String,
    /// The CA the server's certificate must chain to (PEM); no other CA is trusted.
    pub ca: PathBuf,
    /// nacred's client certificate (PEM) and its private key (PEM).
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Bound on one operation, connect to answer.
    #[serde(default = "default_timeout")]
    pub timeout_ms: u64,
}

fn default_timeout() -> u64 {
    DEFAULT_TIMEOUT_MS
}

/// What went wrong talking to a key manager. Messages never contain key material.
#[derive(Debug, Clone, thiserror::Error)]
pub enum KmsError {
    #[error("KMS {kms}: {msg}")]
    Config { kms: String, msg: String },
    #[error("KMS {kms} at {address} unreachable: {msg}")]
    Unreachable {
        kms: String,
        address: String,
        msg: String,
    },
    #[error("KMS {kms} at {address}: TLS failed: {msg}")]
    Tls {
        kms: String,
        address: String,
        msg: String,
    },
    #[error("KMS {kms} at {address} did not answer within {ms} ms")]
    Timeout {
        kms: String,
        address: String,
        ms: u64,
    },
    #[error("KMS {kms} refused {op} with key {key_id}: {reason}: {msg}")]
    Refused {
        kms: String,
        op: &'static str,
        key_id: String,
        reason: String,
        msg: String,
    },
    #[error("KMS {kms}: {msg}")]
    Protocol { kms: String, msg: String },
}

impl From<KmsError> for CryptoError {
    fn from(e: KmsError) -> Self {
        CryptoError::KekSource(e.to_string())
    }
}

/// Result Reason names (§9.1.3.2.29) for the answers an operator will meet.
fn reason_name(r: u32) -> String {
    match r {
        0x01 => "item not found".into(),
        0x03 => "authentication not successful".into(),
        0x04 => "invalid message".into(),
        0x05 => "operation not supported".into(),
        0x07 => "invalid field".into(),
        0x08 => "feature not supported".into(),
        0x0A => "cryptographic failure".into(),
        0x0B => "illegal operation".into(),
        0x0C => "permission denied".into(),
        0x0D => "object archived".into(),
        0x100 => "general failure".into(),
        other => format!("result reason {other:#x}"),
    }
}

/// Per key manager and operation: answers, failures and time spent (Prometheus).
#[derive(Debug, Default, Clone, Copy)]
pub struct OpStats {
    pub ok: u64,
    pub errors: u64,
    pub seconds_sum: f64,
}

static STATS: Mutex<BTreeMap<(String, &'static str), OpStats>> = Mutex::new(BTreeMap::new());

/// A copy of the statistics, for the metrics endpoint.
pub fn stats() -> BTreeMap<(String, &'static str), OpStats> {
    STATS.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

fn record(kms: &str, op: &'static str, ok: bool, took: Duration) {
    let mut s = STATS.lock().unwrap_or_else(|p| p.into_inner());
    let e = s.entry((kms.to_string(), op)).or_default();
    if ok {
        e.ok += 1;
    } else {
        e.errors += 1;
    }
    e.seconds_sum += took.as_secs_f64();
}

/// A TCP stream whose every read and write is bounded by what is left of one deadline.
struct Bounded {
    tcp: TcpStream,
    deadline: Instant,
}

impl Bounded {
    fn left(&self) -> std::io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(std::io::ErrorKind::TimedOut.into())
        } else {
            Ok(left)
        }
    }
}

impl Read for Bounded {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.tcp.set_read_timeout(Some(self.left()?))?;
        self.tcp.read(buf)
    }
}

impl Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tcp.set_write_timeout(Some(self.left()?))?;
        self.tcp.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.tcp.flush()
    }
}

enum Recv {
    Io(std::io::Error),
    Eof,
    Full,
}

/// Read more TLS bytes into `buf[*used..]`.
fn recv(tcp: &mut Bounded, buf: &mut [u8], used: &mut usize) -> Result<(), Recv> {
    if *used == buf.len() {
        return Err(Recv::Full);
    }
    match tcp.read(&mut buf[*used..]) {
        Ok(0) => Err(Recv::Eof),
        Ok(n) => {
            *used += n;
            Ok(())
        }
        Err(e) => Err(Recv::Io(e)),
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
    )
}

/// A KMIP client for one endpoint.
pub struct KmipClient {
    ep: KmsEndpoint,
}

impl KmipClient {
    pub fn new(ep: KmsEndpoint) -> Self {
        KmipClient { ep }
    }

    fn config_err(&self, msg: String) -> KmsError {
        KmsError::Config {
            kms: self.ep.name.clone(),
            msg,
        }
    }

    fn tls_config(&self) -> Result<Arc<rustls::ClientConfig>, KmsError> {
        let read = |p: &PathBuf, what: &str| {
            std::fs::read(p)
                .map(Zeroizing::new)
                .map_err(|e| self.config_err(format!("cannot read {what} {}: {e}", p.display())))
        };
        let certs = |pem: &[u8], what: &str, p: &PathBuf| {
            let v = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| self.config_err(format!("{what} {}: {e}", p.display())))?;
            if v.is_empty() {
                return Err(self.config_err(format!("{what} {}: no certificate", p.display())));
            }
            Ok(v)
        };
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(
            &read(&self.ep.ca, "CA certificate")?,
            "CA certificate",
            &self.ep.ca,
        )? {
            roots
                .add(c)
                .map_err(|e| self.config_err(format!("CA certificate: {e}")))?;
        }
        let chain = certs(
            &read(&self.ep.cert, "client certificate")?,
            "client certificate",
            &self.ep.cert,
        )?;
        let key = PrivateKeyDer::from_pem_slice(&read(&self.ep.key, "client key")?)
            .map_err(|e| self.config_err(format!("client key {}: {e}", self.ep.key.display())))?;
        let _ = rustls::crypto::ring::default_provider().install_default();
        let provider = rustls::crypto::CryptoProvider::get_default()
            .cloned()
            .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .and_then(|b| {
                b.with_root_certificates(roots)
                    .with_client_auth_cert(chain, key)
            })
            .map_err(|e| self.config_err(format!("TLS configuration: {e}")))?;
        Ok(Arc::new(cfg))
    }

    /// Send one request message and return the batch item of the answer.
    fn exchange(&self, op: &'static str, request: &Item) -> Result<Item, KmsError> {
        // rustls copies each decrypted record into a buffer of its own: freed zeroed.
        let _scrub = super::keys::ScrubFrees::begin();
        let start = Instant::now();
        let r = self.exchange_inner(start, request);
        record(&self.ep.name, op, r.is_ok(), start.elapsed());
        r
    }

    fn exchange_inner(&self, start: Instant, request: &Item) -> Result<Item, KmsError> {
        let ep = &self.ep;
        let limit = Duration::from_millis(ep.timeout_ms.max(1));
        let deadline = start + limit;
        let timeout = || KmsError::Timeout {
            kms: ep.name.clone(),
            address: ep.address.clone(),
            ms: ep.timeout_ms,
        };
        let unreachable = |msg: String| KmsError::Unreachable {
            kms: ep.name.clone(),
            address: ep.address.clone(),
            msg,
        };
        let config = self.tls_config()?;
        let host = ep
            .address
            .rsplit_once(':')
            .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))
            .ok_or_else(|| self.config_err(format!("address {:?} is not HOST:PORT", ep.address)))?;
        let server_name = ServerName::try_from(host.to_string())
            .map_err(|e| self.config_err(format!("server name {host:?}: {e}")))?;
        let addrs: Vec<_> = ep
            .address
            .to_socket_addrs()
            .map_err(|e| unreachable(format!("cannot resolve: {e}")))?
            .collect();
        let mut tcp = None;
        let mut last = String::from("no address");
        for a in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timeout());
            }
            match TcpStream::connect_timeout(&a, left) {
                Ok(s) => {
                    tcp = Some(s);
                    break;
                }
                Err(e) if is_timeout(&e) => return Err(timeout()),
                Err(e) => last = e.to_string(),
            }
        }
        let tcp = tcp.ok_or_else(|| unreachable(last))?;
        let _ = tcp.set_nodelay(true);
        let mut tcp = Bounded { tcp, deadline };
        let tls_err = |msg: String| KmsError::Tls {
            kms: ep.name.clone(),
            address: ep.address.clone(),
            msg,
        };
        let io_err = |e: std::io::Error| {
            if is_timeout(&e) {
                timeout()
            } else {
                unreachable(e.to_string())
            }
        };
        let mut request_bytes = Zeroizing::new(Vec::with_capacity(512));
        request.encode(&mut request_bytes);
        // rustls's unbuffered API: the TLS records, and the answer (a plaintext key for
        // Decrypt), live in these buffers, which are zeroed when dropped; the copy of each
        // decrypted record rustls keeps is zeroed as it is freed (`ScrubFrees`, above).
        let mut conn = rustls::client::UnbufferedClientConnection::new(config, server_name)
            .map_err(|e| tls_err(e.to_string()))?;
        let mut incoming = Zeroizing::new(vec![0u8; TLS_BUFFER]);
        let mut in_used = 0usize;
        let mut outgoing = Zeroizing::new(vec![0u8; TLS_BUFFER]);
        let mut out_used = 0usize;
        // Reserved once so that growing it never leaves a copy behind in freed memory.
        let mut answer: Zeroizing<Vec<u8>> = Zeroizing::new(Vec::with_capacity(MAX_MESSAGE + 8));
        let complete =
            |a: &[u8]| ttlv::announced_len(a).is_some_and(|len| a.len() >= len.saturating_add(8));
        let mut sent = false;
        loop {
            let UnbufferedStatus { mut discard, state } =
                conn.process_tls_records(&mut incoming[..in_used]);
            match state.map_err(|e| tls_err(e.to_string()))? {
                ConnectionState::ReadTraffic(mut st) => {
                    while let Some(rec) = st.next_record() {
                        let rec = rec.map_err(|e| tls_err(e.to_string()))?;
                        discard += rec.discard;
                        if answer.len() + rec.payload.len() > MAX_MESSAGE + 8 {
                            return Err(KmsError::Protocol {
                                kms: ep.name.clone(),
                                msg: format!("answer over the {MAX_MESSAGE}-byte limit"),
                            });
                        }
                        answer.extend_from_slice(rec.payload);
                    }
                }
                ConnectionState::EncodeTlsData(mut st) => {
                    out_used += st
                        .encode(&mut outgoing[out_used..])
                        .map_err(|e| tls_err(e.to_string()))?;
                }
                ConnectionState::TransmitTlsData(st) => {
                    tcp.write_all(&outgoing[..out_used]).map_err(io_err)?;
                    out_used = 0;
                    st.done();
                }
                ConnectionState::BlockedHandshake => {
                    recv(&mut tcp, &mut incoming, &mut in_used).map_err(|e| match e {
                        Recv::Io(e) => io_err(e),
                        Recv::Eof => tls_err(
                            "the server closed the connection during the handshake \
                             (it does not accept nacred's client certificate?)"
                                .into(),
                        ),
                        Recv::Full => tls_err("handshake record too large".into()),
                    })?;
                }
                ConnectionState::WriteTraffic(mut st) => {
                    if !sent {
                        let n = st
                            .encrypt(&request_bytes, &mut outgoing[out_used..])
                            .map_err(|e| tls_err(e.to_string()))?;
                        tcp.write_all(&outgoing[..out_used + n]).map_err(io_err)?;
                        out_used = 0;
                        sent = true;
                    } else if complete(&answer) {
                        if let Ok(n) = st.queue_close_notify(&mut outgoing[..]) {
                            let _ = tcp.write_all(&outgoing[..n]);
                        }
                        break;
                    } else {
                        recv(&mut tcp, &mut incoming, &mut in_used).map_err(|e| match e {
                            Recv::Io(e) => io_err(e),
                            Recv::Eof => tls_err(
                                "the server closed the connection without answering (it \
                                 does not accept nacred's client certificate?)"
                                    .into(),
                            ),
                            Recv::Full => tls_err("record too large".into()),
                        })?;
                    }
                }
                ConnectionState::PeerClosed | ConnectionState::Closed => break,
                _ => return Err(tls_err("unexpected TLS state".into())),
            }
            if discard > 0 {
                incoming.copy_within(discard..in_used, 0);
                in_used -= discard;
            }
        }
        if !complete(&answer) {
            return Err(tls_err(
                "the server closed the connection before a whole answer".into(),
            ));
        }
        let len = ttlv::announced_len(&answer).unwrap_or(0) + 8;
        let full = &answer[..len];
        let proto = |msg: String| KmsError::Protocol {
            kms: ep.name.clone(),
            msg,
        };
        let msg = Item::decode(full).map_err(|e| proto(e.to_string()))?;
        if msg.tag() != tag::RESPONSE_MESSAGE {
            return Err(proto("the answer is not a Response Message".into()));
        }
        let Item::Structure(_, items) = msg else {
            return Err(proto("the answer is not a structure".into()));
        };
        items
            .into_iter()
            .find(|i| i.tag() == tag::BATCH_ITEM)
            .ok_or_else(|| proto("the answer has no batch item".into()))
    }

    fn request(op: u32, payload: Vec<Item>) -> Item {
        Item::Structure(
            tag::REQUEST_MESSAGE,
            vec![
                Item::Structure(
                    tag::REQUEST_HEADER,
                    vec![
                        Item::Structure(
                            tag::PROTOCOL_VERSION,
                            vec![
                                Item::Integer(tag::PROTOCOL_VERSION_MAJOR, 1),
                                Item::Integer(tag::PROTOCOL_VERSION_MINOR, 2),
                            ],
                        ),
                        Item::Integer(tag::BATCH_COUNT, 1),
                    ],
                ),
                Item::Structure(
                    tag::BATCH_ITEM,
                    vec![
                        Item::Enumeration(tag::OPERATION, op),
                        Item::Structure(tag::REQUEST_PAYLOAD, payload),
                    ],
                ),
            ],
        )
    }

    fn cbc_params() -> Item {
        Item::Structure(
            tag::CRYPTOGRAPHIC_PARAMETERS,
            vec![
                Item::Enumeration(tag::BLOCK_CIPHER_MODE, enums::MODE_CBC),
                Item::Enumeration(tag::PADDING_METHOD, enums::PADDING_PKCS5),
                Item::Enumeration(tag::CRYPTOGRAPHIC_ALGORITHM, enums::ALG_AES),
            ],
        )
    }

    /// The response payload of a successful batch item, or the key manager's refusal.
    fn payload(&self, op: &'static str, key_id: &str, item: Item) -> Result<Item, KmsError> {
        let status = match item.child(tag::RESULT_STATUS) {
            Some(Item::Enumeration(_, s)) => *s,
            _ => u32::MAX,
        };
        if status != enums::STATUS_SUCCESS {
            let reason = match item.child(tag::RESULT_REASON) {
                Some(Item::Enumeration(_, r)) => reason_name(*r),
                _ => "no reason given".into(),
            };
            let msg = match item.child(tag::RESULT_MESSAGE) {
                Some(Item::Text(_, m)) => m.chars().take(300).collect(),
                _ => String::new(),
            };
            return Err(KmsError::Refused {
                kms: self.ep.name.clone(),
                op,
                key_id: key_id.to_string(),
                reason,
                msg,
            });
        }
        let Item::Structure(_, items) = item else {
            unreachable!("a batch item with a status is a structure")
        };
        items
            .into_iter()
            .find(|i| i.tag() == tag::RESPONSE_PAYLOAD)
            .ok_or_else(|| KmsError::Protocol {
                kms: self.ep.name.clone(),
                msg: format!("{op} answer has no payload"),
            })
    }

    fn bytes_of(&self, payload: &Item, t: u32, what: &str) -> Result<Zeroizing<Vec<u8>>, KmsError> {
        match payload.child(t) {
            Some(Item::Bytes(_, b)) => Ok(b.clone()),
            _ => Err(KmsError::Protocol {
                kms: self.ep.name.clone(),
                msg: format!("answer has no {what}"),
            }),
        }
    }

    /// KMIP Encrypt with AES-CBC/PKCS#5 under `key_id`, with a random IV made here.
    /// Returns (IV, ciphertext).
    pub fn encrypt(&self, key_id: &str, plaintext: &[u8]) -> Result<(Vec<u8>, Vec<u8>), KmsError> {
        let mut iv = vec![0u8; IV_LEN];
        getrandom::fill(&mut iv).map_err(|e| self.config_err(format!("random IV: {e}")))?;
        let req = Self::request(
            enums::OP_ENCRYPT,
            vec![
                Item::Text(tag::UNIQUE_IDENTIFIER, key_id.to_string()),
                Self::cbc_params(),
                Item::Bytes(tag::DATA, Zeroizing::new(plaintext.to_vec())),
                Item::Bytes(tag::IV_COUNTER_NONCE, Zeroizing::new(iv.clone())),
            ],
        );
        let item = self.exchange("encrypt", &req)?;
        let p = self.payload("Encrypt", key_id, item)?;
        let ct = self.bytes_of(&p, tag::DATA, "ciphertext")?;
        // A server that picked its own IV says so; otherwise it used ours.
        let iv = match p.child(tag::IV_COUNTER_NONCE) {
            Some(Item::Bytes(_, b)) => b.to_vec(),
            _ => iv,
        };
        Ok((iv, ct.to_vec()))
    }

    /// KMIP Decrypt with AES-CBC/PKCS#5 under `key_id`.
    pub fn decrypt(
        &self,
        key_id: &str,
        iv: &[u8],
        ciphertext: &[u8],
    ) -> Result<Zeroizing<Vec<u8>>, KmsError> {
        let req = Self::request(
            enums::OP_DECRYPT,
            vec![
                Item::Text(tag::UNIQUE_IDENTIFIER, key_id.to_string()),
                Self::cbc_params(),
                Item::Bytes(tag::DATA, Zeroizing::new(ciphertext.to_vec())),
                Item::Bytes(tag::IV_COUNTER_NONCE, Zeroizing::new(iv.to_vec())),
            ],
        );
        let item = self.exchange("decrypt", &req)?;
        let p = self.payload("Decrypt", key_id, item)?;
        self.bytes_of(&p, tag::DATA, "plaintext")
    }
}

/// A tenant KEK that is an envelope key encrypted by a key manager (module docs).
pub struct KmsKek {
    endpoint: KmsEndpoint,
    key_id: String,
    iv: Vec<u8>,
    blob: Vec<u8>,
    /// Set for a new envelope key (creation, rotation): it is known without asking.
    fresh: Option<Kek>,
}

impl std::fmt::Debug for KmsKek {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KmsKek")
            .field("kms", &self.endpoint.name)
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

impl KmsKek {
    /// A new random envelope key, encrypted by the key manager under `key_id` (one KMIP
    /// Encrypt; the control plane's lock must not be held).
    pub fn generate(endpoint: KmsEndpoint, key_id: &str) -> Result<Self, CryptoError> {
        if key_id.is_empty() || key_id.len() > 256 {
            return Err(CryptoError::KekSource(
                "the KMS key id must be 1-256 characters".into(),
            ));
        }
        let kek = Kek::with_filler(|out| {
            getrandom::fill(out).map_err(|e| CryptoError::Random(e.to_string()))
        })?;
        let (iv, blob) = KmipClient::new(endpoint.clone()).encrypt(key_id, kek.as_bytes())?;
        Ok(KmsKek {
            endpoint,
            key_id: key_id.to_string(),
            iv,
            blob,
            fresh: Some(kek),
        })
    }

    /// The source a recorded spec describes; [`KekSource::load`] asks the key manager.
    pub fn recorded(endpoint: KmsEndpoint, key_id: String, iv: Vec<u8>, blob: Vec<u8>) -> Self {
        KmsKek {
            endpoint,
            key_id,
            iv,
            blob,
            fresh: None,
        }
    }
}

impl KekSource for KmsKek {
    fn spec(&self) -> KekSpec {
        KekSpec::Kms {
            kms: self.endpoint.name.clone(),
            key_id: self.key_id.clone(),
            iv: self.iv.clone(),
            blob: self.blob.clone(),
        }
    }

    fn load(&self) -> Result<Kek, CryptoError> {
        if let Some(k) = &self.fresh {
            return Kek::from_bytes(k.as_bytes());
        }
        let pt =
            KmipClient::new(self.endpoint.clone()).decrypt(&self.key_id, &self.iv, &self.blob)?;
        if pt.len() != KEK_LEN {
            // Not an envelope key of ours (another key's decryption is caught by the check).
            return Err(CryptoError::KekSource(format!(
                "KMS {} returned {} bytes for key {}; expected a {KEK_LEN}-byte envelope key",
                self.endpoint.name,
                pt.len(),
                self.key_id
            )));
        }
        Kek::from_bytes(&pt)
    }
}

#[cfg(test)]
mod test {
    use std::net::TcpListener;

    use super::*;

    fn endpoint(address: String, timeout_ms: u64) -> (tempfile::TempDir, KmsEndpoint) {
        // Certificate files that parse: a throwaway CA and leaf made here.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let ca = nacre_shared::channel::make_ca("kmip unit test").unwrap();
        let leaf = nacre_shared::channel::make_server_cert(&ca, &[]).unwrap();
        let write = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let ep = KmsEndpoint {
            name: "unit".into(),
            address,
            ca: write("ca.pem", &ca.cert),
            cert: write("client.pem", &leaf.cert),
            key: write("client.key", &leaf.key),
            timeout_ms,
        };
        (tmp, ep)
    }

    /// An Encrypt request is the KMIP 1.2 message the specification describes, and carries
    /// the IV nacred chose.
    #[test]
    fn encrypt_request_layout() {
        let req = KmipClient::request(
            enums::OP_ENCRYPT,
            vec![
                Item::Text(tag::UNIQUE_IDENTIFIER, "7".into()),
                KmipClient::cbc_params(),
            ],
        );
        let mut buf = Zeroizing::new(Vec::new());
        req.encode(&mut buf);
        let back = Item::decode(&buf).unwrap();
        assert_eq!(back, req);
        let version = back
            .child(tag::REQUEST_HEADER)
            .and_then(|h| h.child(tag::PROTOCOL_VERSION))
            .unwrap();
        assert_eq!(
            version.child(tag::PROTOCOL_VERSION_MAJOR),
            Some(&Item::Integer(tag::PROTOCOL_VERSION_MAJOR, 1))
        );
        let item = back.child(tag::BATCH_ITEM).unwrap();
        assert_eq!(
            item.child(tag::OPERATION),
            Some(&Item::Enumeration(tag::OPERATION, 0x1F))
        );
        let params = item
            .child(tag::REQUEST_PAYLOAD)
            .and_then(|p| p.child(tag::CRYPTOGRAPHIC_PARAMETERS))
            .unwrap();
        assert_eq!(
            params.child(tag::BLOCK_CIPHER_MODE),
            Some(&Item::Enumeration(tag::BLOCK_CIPHER_MODE, 1))
        );
        assert_eq!(
            params.child(tag::PADDING_METHOD),
            Some(&Item::Enumeration(tag::PADDING_METHOD, 3))
        );
    }

    /// A refusal names the operation, the key, the KMIP reason and the server's message.
    #[test]
    fn refusal_is_one_clear_line() {
        let (_tmp, ep) = endpoint("127.0.0.1:1".into(), 100);
        let c = KmipClient::new(ep);
        let item = Item::Structure(
            tag::BATCH_ITEM,
            vec![
                Item::Enumeration(tag::OPERATION, enums::OP_DECRYPT),
                Item::Enumeration(tag::RESULT_STATUS, 1),
                Item::Enumeration(tag::RESULT_REASON, 0x0C),
                Item::Text(tag::RESULT_MESSAGE, "The key must be Active".into()),
            ],
        );
        let e = c.payload("Decrypt", "42", item).unwrap_err().to_string();
        assert_eq!(
            e,
            "KMS unit refused Decrypt with key 42: permission denied: The key must be Active"
        );
        let ok = Item::Structure(
            tag::BATCH_ITEM,
            vec![
                Item::Enumeration(tag::RESULT_STATUS, 0),
                Item::Structure(tag::RESPONSE_PAYLOAD, vec![]),
            ],
        );
        assert_eq!(
            c.payload("Decrypt", "42", ok).unwrap().tag(),
            tag::RESPONSE_PAYLOAD
        );
    }

    /// Nothing listening: unreachable. A listener that accepts and never answers: the
    /// operation ends at its bound, and the error says so. (Loopback only.)
    #[test]
    fn unreachable_and_silent_servers_are_bounded() {
        let closed = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        let (_tmp, ep) = endpoint(addr.to_string(), 2000);
        let e = KmipClient::new(ep)
            .decrypt("1", &[0; 16], &[0; 48])
            .unwrap_err();
        assert!(matches!(e, KmsError::Unreachable { .. }), "{e}");

        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap();
        let (_tmp2, ep) = endpoint(addr.to_string(), 300);
        let e = KmipClient::new(ep)
            .decrypt("1", &[0; 16], &[0; 48])
            .unwrap_err();
        assert!(matches!(e, KmsError::Timeout { .. }), "{e}");
        assert!(
            e.to_string().contains("did not answer within 300 ms"),
            "{e}"
        );
        drop(silent);
        let s = stats();
        assert!(s.get(&("unit".to_string(), "decrypt")).unwrap().errors >= 2);
    }
}
