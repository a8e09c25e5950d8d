//! OPI's storage API (`opi_api.storage.v1`, the Open Programmable Infrastructure project's
//! vendor-neutral DPU storage API) served over gRPC, so orchestrators written against OPI
//! (godpu, CSI drivers, lab automation) drive nacred directly. Off unless nacred is given
//! `--opi-listen`.
//!
//! Every service is a thin translation onto the [registry](super::registry), through the
//! same operations the JSON-RPC methods call: objects made through either API are one state,
//! persisted in one file and replayed on restart. OPI resource names that are not nacre's
//! own object names (a subsystem's id is not its NQN) are bound in the registry's state
//! ([`crate::control::state::OpiBinding`]), next to the objects.
//!
//! The AIP rules OPI is written to hold for every resource: a client-chosen id (a UUID when
//! empty), `name` as the resource path, idempotent Create (the same id with the same spec
//! returns the resource, another spec is ALREADY_EXISTS), `allow_missing` on Update and
//! Delete, `update_mask`, and `page_size`/`page_token` on List.
//!
//! One submodule per OPI service. The `.proto` files are in `proto/opi/storage/v1`
//! (compiled by `dpu/build.rs`); docs/opi.md is the operator's view.

/// One gRPC method body: the registry handle and the request's message, then `$body` (a
/// registry call, which may block) run by [`blocking`].
macro_rules! run {
    ($self:ident, $req:ident, |$r:ident, $q:ident| $body:expr) => {{
        let $r = $self.0.clone();
        let $q = $req.into_inner();
        $crate::control::opi::blocking(move || $body).await
    }};
}

mod encryption;
mod frontend_nvme;
mod qos;
mod remote;
mod virtio_blk;
mod volumes;

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;

use prost::Message;
use tonic::{Code, Status};

use super::registry::Registry;
use super::RpcError;
use nacre_shared::rpc;

/// The generated messages and servers.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("opi_api.storage.v1");
}

/// Every file of the API (and the well-known types it imports), for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/opi_descriptor.bin"));

/// AIP-158: a List answers at most this many resources a page (a larger page_size is
/// lowered to it); 0 asks for this many.
pub const MAX_PAGE_SIZE: usize = 250;

/// The running gRPC server; dropping it stops it.
pub struct OpiServer {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

/// What the OPI server needs besides the registry.
#[derive(Debug, Clone, Default)]
pub struct OpiConfig {
    /// The tenant whose KEK wraps the data keys of OPI's encrypted volumes.
    pub tenant: Option<String>,
    /// Mutual TLS with the certificates `nacre cert init` made here (`ca.pem`, `server.pem`,
    /// `server.key`): clients need a certificate signed by that CA. None: plain gRPC,
    /// loopback only.
    pub tls_dir: Option<std::path::PathBuf>,
}

/// A TLS handshake not finished in this time is dropped.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The host channel's server configuration (TLS 1.3, a client certificate from the DPU's CA
/// required), offering HTTP/2 by ALPN as gRPC clients require.
fn tls_config(dir: &std::path::Path) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    use nacre_shared::channel::{self, files};
    let read = |name: &str| {
        let p = dir.join(name);
        std::fs::read_to_string(&p).map_err(|e| {
            anyhow::anyhow!(
                "cannot read {}: {e} (make the DPU's certificates with `nacre cert init`)",
                p.display()
            )
        })
    };
    let key = zeroize::Zeroizing::new(read(files::SERVER_KEY)?);
    let config = channel::server_config(&read(files::CA_CERT)?, &read(files::SERVER_CERT)?, &key)?;
    let mut config = (*config).clone();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// A mutual-TLS connection, handed to tonic as its I/O.
struct TlsConn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl tokio::io::AsyncRead for TlsConn {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for TlsConn {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// Accept TCP connections and hand those whose client certificate the CA signed to tonic;
/// a refused handshake is logged with the peer's address.
async fn accept_tls(
    listener: tokio::net::TcpListener,
    config: Arc<rustls::ServerConfig>,
    tx: tokio::sync::mpsc::Sender<std::io::Result<TlsConn>>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "OPI gRPC: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let _ = tcp.set_nodelay(true);
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => {
                    let _ = tx.send(Ok(TlsConn(s))).await;
                }
                Ok(Err(e)) => {
                    tracing::warn!(%peer, error = %e, "OPI gRPC: refused (TLS handshake failed)")
                }
                Err(_) => tracing::warn!(%peer, "OPI gRPC: refused (no TLS handshake in time)"),
            }
        });
    }
}

impl OpiServer {
    /// Bind `addr` and serve every OPI storage service on it: over mutual TLS when
    /// `config.tls_dir` is set, otherwise in the clear and on loopback only.
    pub fn start(
        registry: Arc<Registry>,
        addr: SocketAddr,
        config: OpiConfig,
    ) -> anyhow::Result<Self> {
        let tls = match &config.tls_dir {
            Some(dir) => Some(tls_config(dir)?),
            None if !addr.ip().is_loopback() => anyhow::bail!(
                "--opi-listen {addr}: without --opi-tls-dir the OPI server listens on loopback \
                 only (127.0.0.1 or ::1)"
            ),
            None => None,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("opi-grpc")
            .enable_all()
            .build()?;
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(addr))
            .map_err(|e| anyhow::anyhow!("cannot listen for OPI gRPC on {addr}: {e}"))?;
        let bound = listener.local_addr()?;
        let reflection_v1 = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
            .build_v1()?;
        let reflection_v1alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
            .build_v1alpha()?;
        let r = registry;
        let router = tonic::transport::Server::builder()
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(
                pb::frontend_nvme_service_server::FrontendNvmeServiceServer::new(
                    frontend_nvme::Service(r.clone()),
                ),
            )
            .add_service(
                pb::frontend_virtio_blk_service_server::FrontendVirtioBlkServiceServer::new(
                    virtio_blk::Service(r.clone()),
                ),
            )
            .add_service(
                pb::null_volume_service_server::NullVolumeServiceServer::new(volumes::Null(
                    r.clone(),
                )),
            )
            .add_service(
                pb::malloc_volume_service_server::MallocVolumeServiceServer::new(volumes::Malloc(
                    r.clone(),
                )),
            )
            .add_service(pb::aio_volume_service_server::AioVolumeServiceServer::new(
                volumes::Aio(r.clone()),
            ))
            .add_service(
                pb::middleend_qos_volume_service_server::MiddleendQosVolumeServiceServer::new(
                    qos::Service(r.clone()),
                ),
            )
            .add_service(
                pb::middleend_encryption_service_server::MiddleendEncryptionServiceServer::new(
                    encryption::Service {
                        registry: r.clone(),
                        tenant: config.tenant.clone(),
                    },
                ),
            )
            .add_service(
                pb::nvme_remote_controller_service_server::NvmeRemoteControllerServiceServer::new(
                    remote::Service(r.clone()),
                ),
            );
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = thread::Builder::new()
            .name("opi-grpc".into())
            .spawn(move || {
                rt.block_on(async move {
                    let stop = async {
                        let _ = stop_rx.await;
                    };
                    let served = match tls {
                        Some(config) => {
                            let (tx, rx) = tokio::sync::mpsc::channel(16);
                            let accept = tokio::spawn(accept_tls(listener, config, tx));
                            let incoming = tokio_stream::wrappers::ReceiverStream::new(rx);
                            let r = router.serve_with_incoming_shutdown(incoming, stop).await;
                            accept.abort();
                            r
                        }
                        None => {
                            let incoming = tonic::transport::server::TcpIncoming::from(listener);
                            router.serve_with_incoming_shutdown(incoming, stop).await
                        }
                    };
                    if let Err(e) = served {
                        tracing::warn!(error = %e, "OPI gRPC server stopped");
                    }
                });
            })?;
        tracing::info!(addr = %bound, tls = config.tls_dir.is_some(), "OPI gRPC server listening");
        Ok(OpiServer {
            addr: bound,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The address bound (the port actually bound when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for OpiServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The gRPC status of a registry error: the codes AIP-193 gives the same conditions.
pub(crate) fn status(e: RpcError) -> Status {
    let code = match e.code {
        rpc::NOT_FOUND => Code::NotFound,
        rpc::ALREADY_EXISTS => Code::AlreadyExists,
        rpc::INVALID_PARAMS => Code::InvalidArgument,
        rpc::BUSY | rpc::REFUSED => Code::FailedPrecondition,
        rpc::OPERATION_FAILED => Code::Unavailable,
        _ => Code::Internal,
    };
    Status::new(code, one_line(&e.message))
}

/// Messages are one line.
fn one_line(s: &str) -> String {
    s.lines().collect::<Vec<_>>().join("; ")
}

pub(crate) fn invalid(msg: impl AsRef<str>) -> Status {
    Status::invalid_argument(one_line(msg.as_ref()))
}

pub(crate) fn not_found(name: &str) -> Status {
    Status::not_found(format!("{name} does not exist"))
}

pub(crate) fn exists_differently(name: &str) -> Status {
    Status::already_exists(format!("{name} already exists with another spec"))
}

/// Run a registry call (which may block: files, connections) off the async workers.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("request task failed: {e}")))?
}

/// The id of a new resource: the client's, checked, or a fresh UUID when empty.
pub(crate) fn new_id(client: &str) -> Result<String, Status> {
    if client.is_empty() {
        return Ok(uuid::Uuid::new_v4().to_string());
    }
    check_id(client)?;
    Ok(client.to_string())
}

/// An id is a nacre object name: letters, digits, '_', '-', '.', at most 64.
pub(crate) fn check_id(id: &str) -> Result<(), Status> {
    nacre_shared::api::validate_name("resource id", id).map_err(invalid)
}

/// The id in `collection/{id}` (a name of another form is INVALID_ARGUMENT).
pub(crate) fn id_in<'a>(name: &'a str, collection: &str) -> Result<&'a str, Status> {
    let id = name
        .strip_prefix(collection)
        .and_then(|r| r.strip_prefix('/'))
        .ok_or_else(|| invalid(format!("name {name:?} is not {collection}/{{id}}")))?;
    check_id(id)?;
    Ok(id)
}

/// The volume a `volume_name_ref` names: a nacre volume name, or the resource name of an
/// OPI volume (`nullVolumes/v`, `mallocVolumes/v`, `aioVolumes/v`, `qosVolumes/q` stands for
/// the volume it limits, `encryptedVolumes/e`).
pub(crate) fn volume_ref(registry: &Registry, r: &str) -> Result<String, Status> {
    if r.is_empty() {
        return Err(invalid("volume_name_ref is required"));
    }
    for c in [
        "nullVolumes",
        "mallocVolumes",
        "aioVolumes",
        "encryptedVolumes",
    ] {
        if let Some(id) = r.strip_prefix(c).and_then(|x| x.strip_prefix('/')) {
            check_id(id)?;
            return Ok(id.to_string());
        }
    }
    if r.starts_with("qosVolumes/") {
        return registry
            .opi_binding(r)
            .map(|b| b.object)
            .ok_or_else(|| not_found(r));
    }
    if r.starts_with("nvmeRemoteControllers/") {
        return remote::namespace_volume(registry, r);
    }
    check_id(r)?;
    Ok(r.to_string())
}

/// One List request's page.
pub(crate) struct Page {
    size: usize,
    after: Option<String>,
}

/// AIP-158: page_size 0 is the default, negative is INVALID_ARGUMENT, above the maximum is
/// lowered to it; page_token is what the previous page returned.
pub(crate) fn page(size: i32, token: &str) -> Result<Page, Status> {
    let size = match size {
        s if s < 0 => return Err(invalid(format!("page_size must not be negative (got {s})"))),
        0 => MAX_PAGE_SIZE,
        s => (s as usize).min(MAX_PAGE_SIZE),
    };
    let after = if token.is_empty() {
        None
    } else {
        let bytes =
            from_hex(token).ok_or_else(|| invalid("page_token is not one this server gave"))?;
        Some(
            String::from_utf8(bytes)
                .map_err(|_| invalid("page_token is not one this server gave"))?,
        )
    };
    Ok(Page { size, after })
}

/// One page of `items` (sorted by name here), and the next page's token ("" after the last).
pub(crate) fn paginate<T>(mut items: Vec<(String, T)>, p: &Page) -> (Vec<T>, String) {
    items.sort_by(|a, b| a.0.cmp(&b.0));
    let start = match &p.after {
        Some(after) => items.partition_point(|(n, _)| n <= after),
        None => 0,
    };
    let rest: Vec<(String, T)> = items.into_iter().skip(start).collect();
    let more = rest.len() > p.size;
    let mut page: Vec<(String, T)> = rest.into_iter().take(p.size).collect();
    let token = if more {
        page.last()
            .map(|(n, _)| to_hex(n.as_bytes()))
            .unwrap_or_default()
    } else {
        String::new()
    };
    (page.drain(..).map(|(_, t)| t).collect(), token)
}

/// The update_mask's paths, each one of `allowed` (an empty or absent mask: all of them).
pub(crate) fn mask_paths(
    mask: &Option<prost_types::FieldMask>,
    allowed: &[&str],
) -> Result<Vec<String>, Status> {
    let paths = mask.as_ref().map(|m| m.paths.clone()).unwrap_or_default();
    if paths.is_empty() || paths.iter().any(|p| p == "*") {
        return Ok(allowed.iter().map(|s| s.to_string()).collect());
    }
    for p in &paths {
        if !allowed.contains(&p.as_str()) {
            return Err(invalid(format!(
                "update_mask path {p:?} cannot be updated (these can: {})",
                allowed.join(", ")
            )));
        }
    }
    Ok(paths)
}

/// A message as stored in a binding: its protobuf encoding, in hex.
pub(crate) fn encode<M: Message>(m: &M) -> String {
    to_hex(&m.encode_to_vec())
}

/// A binding's stored message.
pub(crate) fn decode<M: Message + Default>(hex: &str) -> M {
    from_hex(hex)
        .and_then(|b| M::decode(b.as_slice()).ok())
        .unwrap_or_default()
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}

/// OPI's counters are int32: saturate rather than wrap.
pub(crate) fn sat(v: u64) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}

/// The I/O counters of a volume (zero while it is not open).
pub(crate) fn volume_stats(registry: &Registry, volume: &str) -> Result<pb::VolumeStats, Status> {
    let s = registry.stats(Some(volume)).map_err(status)?;
    Ok(s.first()
        .map(|s| pb::VolumeStats {
            read_bytes_count: sat(s.read_bytes),
            read_ops_count: sat(s.read_ops),
            write_bytes_count: sat(s.write_bytes),
            write_ops_count: sat(s.write_ops),
            ..Default::default()
        })
        .unwrap_or_default())
}

/// The sum of several volumes' counters, saturated.
pub(crate) fn sum_stats(all: &[pb::VolumeStats]) -> pb::VolumeStats {
    let add = |f: fn(&pb::VolumeStats) -> i32| {
        all.iter()
            .map(|s| i64::from(f(s)))
            .sum::<i64>()
            .min(i64::from(i32::MAX)) as i32
    };
    pb::VolumeStats {
        read_bytes_count: add(|s| s.read_bytes_count),
        read_ops_count: add(|s| s.read_ops_count),
        write_bytes_count: add(|s| s.write_bytes_count),
        write_ops_count: add(|s| s.write_ops_count),
        ..Default::default()
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn pages_follow_names_and_end_with_an_empty_token() {
        let items: Vec<(String, u32)> = (0..5).map(|i| (format!("v/{i}"), i)).collect();
        let p = page(2, "").unwrap();
        let (a, t) = paginate(items.clone(), &p);
        assert_eq!(a, [0, 1]);
        let (b, t) = paginate(items.clone(), &page(2, &t).unwrap());
        assert_eq!(b, [2, 3]);
        let (c, t) = paginate(items, &page(2, &t).unwrap());
        assert_eq!((c, t.as_str()), (vec![4], ""));
        assert_eq!(page(-1, "").err().unwrap().code(), Code::InvalidArgument);
        assert_eq!(page(1, "zz").err().unwrap().code(), Code::InvalidArgument);
        assert_eq!(page(i32::MAX, "").unwrap().size, MAX_PAGE_SIZE);
    }

    #[test]
    fn counters_saturate() {
        assert_eq!(sat(u64::MAX), i32::MAX);
        assert_eq!(sat(7), 7);
    }

    #[test]
    fn names_parse() {
        assert_eq!(id_in("nullVolumes/a", "nullVolumes").unwrap(), "a");
        assert!(id_in("nullVolumes/", "nullVolumes").is_err());
        assert!(id_in("nullVolumes/a/b", "nullVolumes").is_err());
    }
}
