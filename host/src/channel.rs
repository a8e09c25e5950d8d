//! The host's end of the host channel: its credentials in the configuration directory and
//! the connection to nacred (see `nacre_shared::channel`).

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use nacre_shared::channel::{self, files, RpcClient};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::Global;

/// The file `pair --dpu` saves the DPU's address in.
pub const DPU_FILE: &str = "dpu";

pub type Client = RpcClient<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

fn read(dir: &Path, name: &str) -> Result<String> {
    let p = dir.join(name);
    std::fs::read_to_string(&p).with_context(|| {
        format!(
            "cannot read {} (pair this host first: nacre-host pair --help)",
            p.display()
        )
    })
}

/// The DPU address: --dpu / NACRE_HOST_DPU, else the one `pair` saved; `None` if neither.
pub fn dpu_addr(g: &Global) -> Option<String> {
    g.dpu.clone().or_else(|| {
        std::fs::read_to_string(g.config_dir.join(DPU_FILE))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    })
}

/// The TLS configuration from `ca.pem`, `host.pem` and `host.key`.
pub fn client_config(dir: &Path) -> Result<Arc<rustls::ClientConfig>> {
    let key = zeroize::Zeroizing::new(read(dir, files::HOST_KEY)?);
    Ok(channel::client_config(
        &read(dir, files::CA_CERT)?,
        &read(dir, files::HOST_CERT)?,
        &key,
    )?)
}

/// Connect to nacred and check the channel works (`host_whoami`).
pub async fn connect(g: &Global) -> Result<Client> {
    let addr = dpu_addr(g).context(
        "no DPU address: give --dpu ADDR:PORT (or NACRE_HOST_DPU), or save one with `nacre-host pair --dpu`",
    )?;
    let cfg = client_config(&g.config_dir)?;
    let mut c = channel::connect(&addr, cfg).await?;
    // TLS 1.3 servers check the client certificate after the handshake completes on the
    // client's side: a refusal shows on the first call.
    c.call("host_whoami", Value::Null)
        .await
        .with_context(|| format!("nacred at {addr} refused this host"))?;
    Ok(c)
}

/// Call and decode the result.
pub async fn call<T: DeserializeOwned>(c: &mut Client, method: &str, params: Value) -> Result<T> {
    let v = c
        .call(method, params)
        .await
        .with_context(|| method.to_string())?;
    serde_json::from_value(v).with_context(|| format!("{method}: unexpected reply"))
}
