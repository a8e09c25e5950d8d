//! The host ↔ DPU channel: nacred's JSON-RPC over TCP, inside TLS 1.3 with mutual
//! authentication (RFC 8446 §4.3.2 CertificateRequest: the server always asks the host for
//! its certificate).
//!
//! Trust is private to one DPU: `nacre cert init` makes a CA on the DPU and a server
//! certificate signed by it; `nacre-host pair` makes the host's key and a certificate
//! signing request (the key never leaves the host); `nacre cert issue` signs the request,
//! writing the host's name and its tenant into the certificate as URI subject alternative
//! names (RFC 5280 §4.2.1.6) — [`HOST_URI`] and [`TENANT_URI`]. nacred takes the caller's
//! identity from those, never from anything the host says.
//!
//! Because the CA belongs to one DPU, the server certificate's name means nothing beyond
//! "signed by this CA": it always carries the DNS name [`DPU_SERVER_NAME`], which the host
//! checks, whatever address (tmfifo, OOB port, a test bed forward) it dials.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::Value;
use time::{Duration, OffsetDateTime};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};

use crate::rpc::{Calls, ClientError};

/// The DNS name in every nacred server certificate, and the name the host verifies.
pub const DPU_SERVER_NAME: &str = "nacred";
/// URI SAN prefix naming the host a certificate was issued to.
pub const HOST_URI: &str = "urn:nacre:host:";
/// URI SAN prefix naming the tenant the host works for.
pub const TENANT_URI: &str = "urn:nacre:tenant:";
/// Default lifetime of certificates `nacre cert` makes.
pub const DEFAULT_VALIDITY_DAYS: i64 = 365;

/// File names, in nacred's TLS directory and the host's configuration directory.
pub mod files {
    pub const CA_CERT: &str = "ca.pem";
    pub const CA_KEY: &str = "ca.key";
    pub const SERVER_CERT: &str = "server.pem";
    pub const SERVER_KEY: &str = "server.key";
    pub const HOST_KEY: &str = "host.key";
    pub const HOST_CSR: &str = "host.csr";
    pub const HOST_CERT: &str = "host.pem";

    /// Write one of these files whole or not at all (a temporary file, fsynced, renamed over
    /// the old one): readable by its owner only (keys) or by anyone (certificates).
    pub fn write(path: &std::path::Path, text: &str, private: bool) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let named = |p: &std::path::Path| {
            let p = p.display().to_string();
            move |e: std::io::Error| std::io::Error::new(e.kind(), format!("cannot write {p}: {e}"))
        };
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(if private { 0o600 } else { 0o644 })
            .open(&tmp)
            .map_err(named(&tmp))?;
        f.write_all(text.as_bytes())
            .and_then(|_| f.sync_all())
            .map_err(named(&tmp))?;
        std::fs::rename(&tmp, path).map_err(named(path))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("{0}")]
    Cert(String),
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("nacred sent an invalid reply: {0}")]
    BadReply(String),
    #[error("{message}")]
    Rpc { code: i64, message: String },
}

impl From<ClientError> for ChannelError {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Rpc { code, message } => ChannelError::Rpc { code, message },
            ClientError::BadReply(r) => ChannelError::BadReply(r),
            ClientError::Io(e) => ChannelError::Io(e),
            ClientError::Connect { path, source } => ChannelError::Io(std::io::Error::new(
                source.kind(),
                format!("cannot reach nacred at {path}: {source}"),
            )),
        }
    }
}

fn cert_err(what: &str) -> impl Fn(rcgen::Error) -> ChannelError + '_ {
    move |e| ChannelError::Cert(format!("{what}: {e}"))
}

/// Who a host certificate speaks for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HostIdentity {
    pub host: String,
    pub tenant: String,
}

/// A certificate and its private key, PEM-encoded. The key is zeroed when dropped.
pub struct PemPair {
    pub cert: String,
    pub key: zeroize::Zeroizing<String>,
}

fn validity(params: &mut CertificateParams, not_before: OffsetDateTime, days: i64) {
    params.not_before = not_before;
    params.not_after = not_before + Duration::days(days);
}

/// A fresh CA for one DPU (ECDSA P-256), valid ten years.
pub fn make_ca(name: &str) -> Result<PemPair, ChannelError> {
    let key = KeyPair::generate().map_err(cert_err("cannot make a key"))?;
    let mut p = CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name
        .push(DnType::CommonName, format!("nacre CA {name}"));
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut p, OffsetDateTime::now_utc() - Duration::hours(1), 3650);
    let cert = p
        .self_signed(&key)
        .map_err(cert_err("cannot sign the CA"))?;
    Ok(PemPair {
        cert: cert.pem(),
        key: key.serialize_pem().into(),
    })
}

fn issuer(ca: &PemPair) -> Result<Issuer<'static, KeyPair>, ChannelError> {
    let key = KeyPair::from_pem(&ca.key).map_err(cert_err("cannot read the CA key"))?;
    Issuer::from_ca_cert_pem(&ca.cert, key).map_err(cert_err("cannot read the CA certificate"))
}

/// nacred's server certificate: DNS name [`DPU_SERVER_NAME`] plus `extra_names` (DNS names
/// or IP addresses), signed by `ca`.
pub fn make_server_cert(ca: &PemPair, extra_names: &[String]) -> Result<PemPair, ChannelError> {
    let key = KeyPair::generate().map_err(cert_err("cannot make a key"))?;
    let mut names = vec![DPU_SERVER_NAME.to_string()];
    names.extend(extra_names.iter().cloned());
    let mut p = CertificateParams::new(names).map_err(cert_err("bad server name"))?;
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name
        .push(DnType::CommonName, DPU_SERVER_NAME);
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    validity(&mut p, OffsetDateTime::now_utc() - Duration::hours(1), 3650);
    let cert = p
        .signed_by(&key, &issuer(ca)?)
        .map_err(cert_err("cannot sign the server certificate"))?;
    Ok(PemPair {
        cert: cert.pem(),
        key: key.serialize_pem().into(),
    })
}

/// The host's side of pairing: a fresh key and a certificate signing request (PKCS #10)
/// naming `host`. Returns (request PEM, key PEM).
pub fn make_host_request(host: &str) -> Result<(String, zeroize::Zeroizing<String>), ChannelError> {
    let key = KeyPair::generate().map_err(cert_err("cannot make a key"))?;
    let mut p = CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, host);
    let csr = p
        .serialize_request(&key)
        .map_err(cert_err("cannot make the signing request"))?;
    let pem = csr
        .pem()
        .map_err(cert_err("cannot encode the signing request"))?;
    Ok((pem, key.serialize_pem().into()))
}

/// The DPU's side of pairing: sign the host's request. Only the request's public key is
/// used (its signature proves the host holds the key); names, tenant and validity are the
/// operator's, from `id`, `not_before` and `days`.
pub fn issue_host_cert(
    ca: &PemPair,
    csr_pem: &str,
    id: &HostIdentity,
    not_before: OffsetDateTime,
    days: i64,
) -> Result<String, ChannelError> {
    crate::api::validate_name("host", &id.host).map_err(ChannelError::Cert)?;
    crate::api::validate_name("tenant", &id.tenant).map_err(ChannelError::Cert)?;
    let csr = CertificateSigningRequestParams::from_pem(csr_pem)
        .map_err(cert_err("not a valid certificate signing request"))?;
    let mut p = CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, &id.host);
    p.subject_alt_names = vec![
        SanType::URI(
            format!("{HOST_URI}{}", id.host)
                .try_into()
                .map_err(cert_err("bad host name"))?,
        ),
        SanType::URI(
            format!("{TENANT_URI}{}", id.tenant)
                .try_into()
                .map_err(cert_err("bad tenant name"))?,
        ),
    ];
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    validity(&mut p, not_before, days);
    let cert = p
        .signed_by(&csr.public_key, &issuer(ca)?)
        .map_err(cert_err("cannot sign the host certificate"))?;
    Ok(cert.pem())
}

/// The identity in a host certificate (already verified against the CA by the handshake).
pub fn host_identity(cert: &[u8]) -> Result<HostIdentity, ChannelError> {
    use x509_parser::extensions::GeneralName;
    let (_, c) = x509_parser::parse_x509_certificate(cert)
        .map_err(|e| ChannelError::Cert(format!("cannot parse the host certificate: {e}")))?;
    let mut host = None;
    let mut tenant = None;
    if let Ok(Some(san)) = c.subject_alternative_name() {
        for n in &san.value.general_names {
            if let GeneralName::URI(u) = n {
                if let Some(h) = u.strip_prefix(HOST_URI) {
                    host = Some(h.to_string());
                } else if let Some(t) = u.strip_prefix(TENANT_URI) {
                    tenant = Some(t.to_string());
                }
            }
        }
    }
    match (host, tenant) {
        (Some(host), Some(tenant)) => Ok(HostIdentity { host, tenant }),
        _ => Err(ChannelError::Cert(
            "the certificate names no nacre host and tenant (not issued by `nacre cert issue`)"
                .into(),
        )),
    }
}

/// Install ring as the process's crypto provider (once; later calls are no-ops).
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()))
}

fn certs(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, ChannelError> {
    let v = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ChannelError::Cert(format!("{what}: {e}")))?;
    if v.is_empty() {
        return Err(ChannelError::Cert(format!("{what}: no certificate in it")));
    }
    Ok(v)
}

fn key(pem: &str, what: &str) -> Result<PrivateKeyDer<'static>, ChannelError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| ChannelError::Cert(format!("{what}: {e}")))
}

fn roots(ca_pem: &str) -> Result<rustls::RootCertStore, ChannelError> {
    let mut r = rustls::RootCertStore::empty();
    for c in certs(ca_pem, "CA certificate")? {
        r.add(c)?;
    }
    Ok(r)
}

/// nacred's TLS configuration: TLS 1.3 only, a client certificate signed by `ca_pem`
/// required (none, a wrong CA, an expired or not-yet-valid one fail the handshake).
pub fn server_config(
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Result<Arc<rustls::ServerConfig>, ChannelError> {
    let p = provider();
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots(ca_pem)?),
        p.clone(),
    )
    .build()
    .map_err(|e| ChannelError::Cert(format!("CA certificate: {e}")))?;
    let cfg = rustls::ServerConfig::builder_with_provider(p)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            certs(cert_pem, "server certificate")?,
            key(key_pem, "server key")?,
        )?;
    Ok(Arc::new(cfg))
}

/// The host's TLS configuration: nacred's certificate must chain to `ca_pem`.
pub fn client_config(
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Result<Arc<rustls::ClientConfig>, ChannelError> {
    let cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(ca_pem)?)
        .with_client_auth_cert(
            certs(cert_pem, "host certificate")?,
            key(key_pem, "host key")?,
        )?;
    Ok(Arc::new(cfg))
}

/// The server name the host verifies.
pub fn dpu_server_name() -> ServerName<'static> {
    ServerName::try_from(DPU_SERVER_NAME).expect("a valid DNS name")
}

/// Connect to nacred's host listener at `addr` and complete the TLS handshake.
pub async fn connect(
    addr: &str,
    config: Arc<rustls::ClientConfig>,
) -> Result<RpcClient<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>, ChannelError> {
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot reach nacred at {addr}: {e}"))
    })?;
    let _ = tcp.set_nodelay(true);
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(dpu_server_name(), tcp)
        .await
        .map_err(|e| {
            std::io::Error::new(e.kind(), format!("TLS handshake with {addr} failed: {e}"))
        })?;
    Ok(RpcClient::new(tls))
}

/// A JSON-RPC client over any byte stream (one request, one newline-terminated reply): the
/// Unix socket's [`rpc::Client`](crate::rpc::Client), asynchronous, on the same [`Calls`].
pub struct RpcClient<S> {
    reader: BufReader<tokio::io::ReadHalf<S>>,
    writer: tokio::io::WriteHalf<S>,
    calls: Calls,
}

impl<S: AsyncRead + AsyncWrite> RpcClient<S> {
    pub fn new(stream: S) -> Self {
        let (r, w) = tokio::io::split(stream);
        RpcClient {
            reader: BufReader::new(r),
            writer: w,
            calls: Calls::default(),
        }
    }

    pub async fn call(&mut self, method: &str, params: Value) -> Result<Value, ChannelError> {
        let (id, line) = self.calls.encode(method, params)?;
        self.writer.write_all(&line).await?;
        self.writer.flush().await?;
        let mut reply = String::new();
        if self.reader.read_line(&mut reply).await? == 0 {
            return Err(ChannelError::BadReply(
                "nacred closed the connection (was the certificate refused?)".into(),
            ));
        }
        Ok(Calls::decode(id, &reply)?)
    }

    /// Close the write side so nacred sees the end of the channel.
    pub async fn shutdown(&mut self) {
        let _ = self.writer.shutdown().await;
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn issued_certificates_carry_the_operators_identity_not_the_requests() {
        let ca = make_ca("dpu0").unwrap();
        let (csr, _key) = make_host_request("whatever-the-host-claims").unwrap();
        let id = HostIdentity {
            host: "host7".into(),
            tenant: "acme".into(),
        };
        let pem = issue_host_cert(&ca, &csr, &id, OffsetDateTime::now_utc(), 30).unwrap();
        let der = certs(&pem, "x").unwrap();
        assert_eq!(host_identity(&der[0]).unwrap(), id);
        // A server certificate names no host: refused as an identity.
        let server = make_server_cert(&ca, &[]).unwrap();
        let der = certs(&server.cert, "x").unwrap();
        assert!(host_identity(&der[0]).is_err());
        // A malformed request or bad names are errors, not panics.
        assert!(issue_host_cert(&ca, "junk", &id, OffsetDateTime::now_utc(), 1).is_err());
        let bad = HostIdentity {
            host: "../x".into(),
            tenant: "acme".into(),
        };
        assert!(issue_host_cert(&ca, &csr, &bad, OffsetDateTime::now_utc(), 1).is_err());
    }
}
