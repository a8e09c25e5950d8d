//! The host channel: nacred's JSON-RPC for host agents, over TCP inside mutual TLS
//! ([`nacre_shared::channel`]). Off unless nacred is given `--host-listen`.
//!
//! On a BlueField the address is on the rshim tmfifo network or the OOB port — a link the
//! host reaches but the tenant's workloads should not be trusted with the operator's Unix
//! socket. So the channel differs from the Unix socket in three ways:
//! * every connection must present a host certificate signed by this DPU's CA; a missing,
//!   foreign, expired or not-yet-valid one fails the handshake, and the refusal is logged
//!   with the peer's address;
//! * the caller's host and tenant come from the certificate ([`super::peer::Caller`]);
//! * only [`super::peer::HOST_METHODS`] are answered; any other method (tenant, key,
//!   volume or device management) is refused with `REFUSED` and logged.
//!
//! Requests are newline-terminated JSON objects, one reply line each, as on the Unix
//! socket; batches are not accepted here. When a connection ends, the peer windows it
//! registered are removed.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use nacre_shared::channel::{self, files, HostIdentity};
use nacre_shared::rpc::{self, Response};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use super::peer::{Caller, HOST_METHODS};
use super::{Daemon, RpcError};

/// The longest request line a host may send.
pub const MAX_HOST_REQUEST: usize = 1 << 20;
/// A handshake not finished in this time is dropped (a silent peer holds nothing).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The running listener; dropping it stops accepting and closes every host connection.
pub struct HostListener {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl HostListener {
    /// Load `ca.pem`, `server.pem` and `server.key` from `tls_dir` (made by `nacre cert
    /// init`), bind `addr` and serve `daemon`'s host methods on it.
    pub fn start(daemon: Arc<Daemon>, addr: SocketAddr, tls_dir: &Path) -> anyhow::Result<Self> {
        let read = |name: &str| {
            let p = tls_dir.join(name);
            std::fs::read_to_string(&p).map_err(|e| {
                anyhow::anyhow!(
                    "cannot read {}: {e} (make the DPU's certificates with `nacre cert init`)",
                    p.display()
                )
            })
        };
        let key = zeroize::Zeroizing::new(read(files::SERVER_KEY)?);
        let config =
            channel::server_config(&read(files::CA_CERT)?, &read(files::SERVER_CERT)?, &key)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("host-channel")
            .enable_all()
            .build()?;
        let listener = rt
            .block_on(TcpListener::bind(addr))
            .map_err(|e| anyhow::anyhow!("cannot listen for hosts on {addr}: {e}"))?;
        let bound = listener.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let thread = thread::Builder::new()
            .name("host-channel".into())
            .spawn(move || {
                rt.block_on(async move {
                    tokio::select! {
                        _ = accept_loop(daemon, listener, config) => {}
                        _ = stop_rx => {}
                    }
                });
                // Dropping the runtime cancels the connection tasks.
                rt.shutdown_timeout(Duration::from_secs(2));
            })?;
        info!(address = %bound, "host channel listening (mutual TLS)");
        Ok(HostListener {
            addr: bound,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for HostListener {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(
    daemon: Arc<Daemon>,
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "host channel: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let d = daemon.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let _ = tcp.set_nodelay(true);
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    warn!(%peer, error = %e, "host channel: refused (TLS handshake failed)");
                    return;
                }
                Err(_) => {
                    warn!(%peer, "host channel: refused (no TLS handshake in time)");
                    return;
                }
            };
            let id = {
                let (_, conn) = tls.get_ref();
                match conn.peer_certificates().and_then(|c| c.first()) {
                    Some(cert) => channel::host_identity(cert),
                    None => Err(channel::ChannelError::Cert("no client certificate".into())),
                }
            };
            let id = match id {
                Ok(id) => id,
                Err(e) => {
                    warn!(%peer, error = %e, "host channel: refused (certificate names no host)");
                    return;
                }
            };
            serve(d, tls, peer, id).await;
        });
    }
}

async fn serve<S>(d: Arc<Daemon>, stream: S, peer: SocketAddr, id: HostIdentity)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let conn = d.registry.next_host_conn();
    info!(%peer, host = %id.host, tenant = %id.tenant, conn, "host connected");
    let caller = Caller::Host {
        id: id.clone(),
        conn,
    };
    let (r, mut w) = tokio::io::split(stream);
    let mut r = BufReader::new(r);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = match (&mut r)
            .take(MAX_HOST_REQUEST as u64 + 1)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(n) => n,
            Err(e) => {
                debug!(%peer, error = %e, "host channel read failed");
                break;
            }
        };
        if n == 0 {
            break;
        }
        if line.len() > MAX_HOST_REQUEST {
            let r = Response::err(
                Value::Null,
                rpc::PARSE_ERROR,
                format!("parse error: request larger than {MAX_HOST_REQUEST} bytes"),
            );
            let _ = write(&mut w, &r).await;
            break;
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let v: Value = match serde_json::from_slice(&line) {
            Ok(v) => v,
            Err(e) => {
                let r = Response::err(Value::Null, rpc::PARSE_ERROR, format!("parse error: {e}"));
                let _ = write(&mut w, &r).await;
                break;
            }
        };
        let d2 = d.clone();
        let c2 = caller.clone();
        let reply = tokio::task::spawn_blocking(move || handle(&d2, &c2, v))
            .await
            .unwrap_or_else(|e| {
                Some(Response::err(
                    Value::Null,
                    rpc::INTERNAL_ERROR,
                    format!("internal error: {e}"),
                ))
            });
        if let Some(reply) = reply {
            if write(&mut w, &reply).await.is_err() {
                break;
            }
        }
    }
    let removed = d.registry.host_conn_closed(conn);
    info!(%peer, host = %id.host, tenant = %id.tenant, conn, windows_removed = removed,
        "host disconnected");
}

async fn write<W: tokio::io::AsyncWrite + Unpin>(w: &mut W, r: &Response) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(r).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    w.write_all(&bytes).await?;
    w.flush().await
}

/// Answer one request from a host: only host methods, with the caller's identity.
pub fn handle(d: &Daemon, caller: &Caller, v: Value) -> Option<Response> {
    let Value::Object(mut obj) = v else {
        return Some(Response::err(
            Value::Null,
            rpc::INVALID_REQUEST,
            "a request must be a JSON object (batches are not accepted on the host channel)",
        ));
    };
    let id = obj.remove("id");
    let reply_id = id.clone().unwrap_or(Value::Null);
    if obj.get("jsonrpc").and_then(Value::as_str) != Some(rpc::JSONRPC_VERSION) {
        return Some(Response::err(
            reply_id,
            rpc::INVALID_REQUEST,
            "\"jsonrpc\" must be \"2.0\"",
        ));
    }
    let Some(method) = obj.get("method").and_then(Value::as_str).map(str::to_owned) else {
        return Some(Response::err(
            reply_id,
            rpc::INVALID_REQUEST,
            "\"method\" must be a string",
        ));
    };
    let params = obj.remove("params").unwrap_or(Value::Null);
    let result = call(d, caller, &method, params);
    id.as_ref()?;
    Some(match result {
        Ok(v) => Response::ok(reply_id, v),
        Err(e) => Response::err(reply_id, e.code, e.message),
    })
}

/// Dispatch one host-channel method; anything outside [`HOST_METHODS`] is refused.
pub fn call(d: &Daemon, caller: &Caller, method: &str, params: Value) -> Result<Value, RpcError> {
    if !(params.is_null() || params.is_object()) {
        return Err(RpcError::invalid_params(
            "params must be an object of named parameters",
        ));
    }
    if method == "rpc_get_methods" {
        return super::to_value(HOST_METHODS.iter().map(|(n, _)| *n).collect::<Vec<_>>());
    }
    match HOST_METHODS.iter().find(|(n, _)| *n == method) {
        Some((_, h)) => h(d, caller, params),
        None => {
            if let Caller::Host { id, .. } = caller {
                warn!(host = %id.host, tenant = %id.tenant, %method,
                    "host channel: method refused (not a host method)");
            }
            Err(RpcError::refused(format!(
                "method {method:?} is not allowed on the host channel (rpc_get_methods lists \
                 what a host may call)"
            )))
        }
    }
}
