//! The JSON-RPC server on nacred's Unix socket.
//!
//! The socket is created with mode 0600 (the umask is narrowed around `bind`, so there is no
//! window in which another user could connect). Each connection gets a thread; requests on a
//! connection are answered in order. Requests may be newline-separated or concatenated (as
//! SPDK's rpc.py sends them); batches (JSON arrays) are answered with arrays. Invalid JSON
//! gets a Parse error and the connection is closed, since the stream cannot be resynchronised.

use std::io::{BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use nacre_shared::rpc::{self, Response};
use serde_json::Value;
use tracing::{debug, warn};

use super::Daemon;

pub struct RpcServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl RpcServer {
    /// Bind `path` (a stale socket left by a crashed nacred is replaced; a live one is refused)
    /// and serve `daemon` on it.
    pub fn start(daemon: Arc<Daemon>, path: &Path) -> anyhow::Result<Self> {
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                anyhow::bail!(
                    "{} is in use: another nacred is running with this run directory",
                    path.display()
                );
            }
            std::fs::remove_file(path)
                .map_err(|e| anyhow::anyhow!("cannot remove stale {}: {e}", path.display()))?;
        }
        // SAFETY: umask only changes this process's file-creation mask; restored right after.
        let old = unsafe { libc::umask(0o177) };
        let bound = UnixListener::bind(path);
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        let listener =
            bound.map_err(|e| anyhow::anyhow!("cannot bind RPC socket {}: {e}", path.display()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = thread::Builder::new()
            .name("rpc-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Acquire) {
                        break;
                    }
                    match conn {
                        Ok(s) => {
                            let d = daemon.clone();
                            let _ = thread::Builder::new()
                                .name("rpc-conn".into())
                                .spawn(move || serve_connection(&d, s));
                        }
                        Err(e) => warn!(error = %e, "RPC accept failed"),
                    }
                }
            })?;
        Ok(RpcServer {
            path: path.to_path_buf(),
            stop,
            thread: Some(thread),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve_connection(d: &Daemon, stream: UnixStream) {
    let mut out = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "RPC connection setup failed");
            return;
        }
    };
    let values = serde_json::Deserializer::from_reader(BufReader::new(stream)).into_iter::<Value>();
    for v in values {
        let reply = match v {
            Ok(v) => handle_value(d, v),
            Err(e) if e.is_eof() => return,
            Err(e) => {
                let r = Response::err(Value::Null, rpc::PARSE_ERROR, format!("parse error: {e}"));
                let _ = write_reply(&mut out, &serde_json::to_value(r).unwrap_or(Value::Null));
                return;
            }
        };
        if let Some(reply) = reply {
            if write_reply(&mut out, &reply).is_err() {
                return;
            }
        }
    }
}

fn write_reply(out: &mut UnixStream, reply: &Value) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(reply).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    out.write_all(&bytes)
}

/// Answer one JSON value: a request, a notification (no answer) or a batch.
pub fn handle_value(d: &Daemon, v: Value) -> Option<Value> {
    match v {
        Value::Array(items) if items.is_empty() => Some(error_value(
            Value::Null,
            rpc::INVALID_REQUEST,
            "empty batch".into(),
        )),
        Value::Array(items) => {
            let replies: Vec<Value> = items.into_iter().filter_map(|i| handle_one(d, i)).collect();
            (!replies.is_empty()).then_some(Value::Array(replies))
        }
        other => handle_one(d, other),
    }
}

fn error_value(id: Value, code: i64, message: String) -> Value {
    serde_json::to_value(Response::err(id, code, message)).unwrap_or(Value::Null)
}

fn handle_one(d: &Daemon, v: Value) -> Option<Value> {
    let Value::Object(mut obj) = v else {
        return Some(error_value(
            Value::Null,
            rpc::INVALID_REQUEST,
            "a request must be a JSON object".into(),
        ));
    };
    let id = obj.remove("id");
    let reply_id = id.clone().unwrap_or(Value::Null);
    if obj.get("jsonrpc").and_then(Value::as_str) != Some(rpc::JSONRPC_VERSION) {
        return Some(error_value(
            reply_id,
            rpc::INVALID_REQUEST,
            "\"jsonrpc\" must be \"2.0\"".into(),
        ));
    }
    let Some(method) = obj.get("method").and_then(Value::as_str).map(str::to_owned) else {
        return Some(error_value(
            reply_id,
            rpc::INVALID_REQUEST,
            "\"method\" must be a string".into(),
        ));
    };
    let params = obj.remove("params").unwrap_or(Value::Null);
    if !(params.is_null() || params.is_object()) {
        return Some(error_value(
            reply_id,
            rpc::INVALID_PARAMS,
            "params must be an object of named parameters".into(),
        ));
    }
    debug!(%method, "rpc");
    let result = d.call(&method, params);
    // A notification (no id) gets no reply, per JSON-RPC 2.0 §4.1.
    id.as_ref()?;
    Some(
        serde_json::to_value(match result {
            Ok(v) => Response::ok(reply_id, v),
            Err(e) => Response::err(reply_id, e.code, e.message),
        })
        .unwrap_or(Value::Null),
    )
}
