//! The JSON-RPC server on nacred's Unix socket.
//!
//! The socket is created with mode 0600 (the umask is narrowed around `bind`, so there is no
//! window in which another user could connect). Each connection gets a thread; requests on a
//! connection are answered in order. Requests may be newline-separated or concatenated (as
//! SPDK's rpc.py sends them); batches (JSON arrays) are answered with arrays. Invalid JSON
//! gets a Parse error and the connection is closed, since the stream cannot be resynchronised;
//! so does a request larger than [`MAX_REQUEST`].
//!
//! Requests can carry passphrases (`tenant_create`, `tenant_unlock`, `tenant_rotate_kek`), so
//! the bytes read from the socket live in a buffer that is zeroed before it is freed or
//! grown, and each parsed request is scrubbed ([`super::scrub`]) once answered.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use nacre_shared::rpc::{self, Response};
use serde_json::Value;
use tracing::{debug, warn};
use zeroize::{Zeroize, Zeroizing};

use super::{scrub, Daemon};

/// The largest single request (or batch) nacred reads; anything larger is a parse error.
pub const MAX_REQUEST: usize = 16 << 20;

/// Bytes read per `read` call, and the buffer's initial capacity.
const READ_CHUNK: usize = 16 << 10;

pub struct RpcServer {
    path: PathBuf,
    /// The listening socket (a second descriptor of it), shut down to stop the accept thread.
    waker: UnixListener,
    /// The socket file's inode, so that stopping never removes a socket someone else bound.
    ino: Option<u64>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl RpcServer {
    /// Bind `path` (a stale socket left by a crashed nacred is replaced; a live one, or a
    /// file that is no stream socket, is refused) and serve `daemon` on it.
    pub fn start(daemon: Arc<Daemon>, path: &Path) -> anyhow::Result<Self> {
        if let Err(e) = crate::config::make_way_for_socket(path) {
            if e.kind() == std::io::ErrorKind::AddrInUse {
                anyhow::bail!(
                    "{} is in use: another nacred is running with this run directory",
                    path.display()
                );
            }
            anyhow::bail!("cannot use {} for the RPC socket: {e}", path.display());
        }
        // SAFETY: umask only changes this process's file-creation mask; restored right after.
        let old = unsafe { libc::umask(0o177) };
        let bound = UnixListener::bind(path);
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        let listener =
            bound.map_err(|e| anyhow::anyhow!("cannot bind RPC socket {}: {e}", path.display()))?;
        // Stopping must not depend on the socket's path still naming this socket (someone
        // may have removed or replaced it): shutdown(2) on the listening socket itself wakes
        // a blocked accept (Linux answers it with EINVAL).
        let waker = listener
            .try_clone()
            .map_err(|e| anyhow::anyhow!("cannot set up RPC socket {}: {e}", path.display()))?;
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
                        Err(e) => {
                            warn!(error = %e, "RPC accept failed");
                            // EMFILE and friends: do not spin at full speed.
                            thread::sleep(std::time::Duration::from_millis(10));
                        }
                    }
                }
            })?;
        Ok(RpcServer {
            path: path.to_path_buf(),
            ino: {
                use std::os::unix::fs::MetadataExt;
                std::fs::symlink_metadata(path).ok().map(|m| m.ino())
            },
            waker,
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
        // SAFETY: shutdown(2) on a descriptor we own; it only changes the socket's state.
        unsafe { libc::shutdown(self.waker.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Remove the socket only if the path still names ours.
        use std::os::unix::fs::MetadataExt;
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| Some(m.ino()) == self.ino) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Serve one already-connected client stream on the calling thread, as the accept loop
/// does (the fuzz targets' way in: dpu/src/fuzzing/).
#[doc(hidden)]
pub fn serve_stream(d: &Daemon, stream: UnixStream) {
    serve_connection(d, stream)
}

fn serve_connection(d: &Daemon, stream: UnixStream) {
    let mut out = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "RPC connection setup failed");
            return;
        }
    };
    let mut reader = RequestReader::new(stream);
    loop {
        let reply = match reader.next_value() {
            Ok(Some(mut v)) => {
                let reply = handle_value(d, &mut v);
                scrub(&mut v);
                reply
            }
            Ok(None) => return,
            Err(message) => {
                let r = Response::err(Value::Null, rpc::PARSE_ERROR, message);
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

/// Splits a byte stream into JSON values, keeping unparsed bytes in a buffer that never
/// leaves a copy behind: it is zeroed when it is dropped, when it grows (by hand, since `Vec`
/// would free the old allocation as it is) and where consumed bytes are shifted out.
///
/// A request is parsed once its bytes are all there: a small scanner follows strings and
/// bracket depth over each byte once, so a large request arriving in many reads costs linear,
/// not quadratic, time.
struct RequestReader<R> {
    inner: R,
    buf: Zeroizing<Vec<u8>>,
    scan: Scanner,
    eof: bool,
}

/// Where the first value in the buffer ends, as far as the bytes read so far tell.
#[derive(Default)]
struct Scanner {
    /// Bytes of the buffer already looked at.
    pos: usize,
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// The value is not an object or array (or the brackets do not match): let the parser
    /// judge it on every read, there is no end to look for.
    parse_now: bool,
}

impl Scanner {
    /// Whether the bytes scanned so far may hold a complete value.
    fn ready(&mut self, buf: &[u8]) -> bool {
        while self.pos < buf.len() && !self.parse_now {
            let b = buf[self.pos];
            self.pos += 1;
            if self.in_string {
                match b {
                    _ if self.escaped => self.escaped = false,
                    b'\\' => self.escaped = true,
                    b'"' => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' if self.depth > 0 => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' if self.depth > 0 => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        return true;
                    }
                }
                _ if self.depth == 0 && !b.is_ascii_whitespace() => self.parse_now = true,
                _ => {}
            }
        }
        self.parse_now
    }
}

impl<R: Read> RequestReader<R> {
    fn new(inner: R) -> Self {
        RequestReader {
            inner,
            buf: Zeroizing::new(Vec::with_capacity(READ_CHUNK)),
            scan: Scanner::default(),
            eof: false,
        }
    }

    /// The next complete value; `None` at a clean end of stream; `Err` (a message for the
    /// Parse error) for invalid JSON, a request over [`MAX_REQUEST`], or a stream cut inside
    /// a value.
    fn next_value(&mut self) -> Result<Option<Value>, String> {
        loop {
            if self.scan.ready(&self.buf) {
                let mut values =
                    serde_json::Deserializer::from_slice(&self.buf).into_iter::<Value>();
                match values.next() {
                    // A number running to the end of what was read may go on in the
                    // next read.
                    Some(Ok(v))
                        if v.is_number() && values.byte_offset() == self.buf.len() && !self.eof => {
                    }
                    Some(Ok(v)) => {
                        let used = values.byte_offset();
                        self.consume(used);
                        return Ok(Some(v));
                    }
                    Some(Err(e)) if !e.is_eof() => return Err(format!("parse error: {e}")),
                    // A scalar not yet complete: read on.
                    None | Some(Err(_)) => {}
                }
            }
            if self.eof {
                return if self.buf.iter().all(u8::is_ascii_whitespace) {
                    Ok(None)
                } else {
                    Err("parse error: the stream ended inside a request".into())
                };
            }
            if self.buf.len() >= MAX_REQUEST {
                return Err(format!(
                    "parse error: request larger than {MAX_REQUEST} bytes"
                ));
            }
            self.fill();
        }
    }

    /// Read what the stream has, up to one chunk. A broken connection ends the stream like
    /// a clean close.
    fn fill(&mut self) {
        if self.buf.capacity() - self.buf.len() < READ_CHUNK {
            let mut grown = Zeroizing::new(Vec::with_capacity(
                (self.buf.capacity() * 2).max(self.buf.len() + READ_CHUNK),
            ));
            grown.extend_from_slice(&self.buf);
            // The old buffer is zeroed as it drops.
            self.buf = grown;
        }
        let len = self.buf.len();
        self.buf.resize(len + READ_CHUNK, 0);
        let n = loop {
            match self.inner.read(&mut self.buf[len..]) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Ok(n) => break n,
                Err(_) => break 0,
            }
        };
        self.buf[len + n..].zeroize();
        self.buf.truncate(len + n);
        if n == 0 {
            self.eof = true;
        }
    }

    /// Drop the first `n` bytes (one parsed value), zeroing what they leave behind.
    fn consume(&mut self, n: usize) {
        let len = self.buf.len();
        self.buf.copy_within(n.., 0);
        self.buf[len - n..].zeroize();
        self.buf.truncate(len - n);
        self.scan = Scanner::default();
    }
}

fn write_reply(out: &mut UnixStream, reply: &Value) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(reply).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    out.write_all(&bytes)
}

/// Answer one JSON value: a request, a notification (no answer) or a batch. The value's
/// params are taken out of it; the caller scrubs what is left.
pub fn handle_value(d: &Daemon, v: &mut Value) -> Option<Value> {
    match v {
        Value::Array(items) if items.is_empty() => Some(error_value(
            Value::Null,
            rpc::INVALID_REQUEST,
            "empty batch".into(),
        )),
        Value::Array(items) => {
            let replies: Vec<Value> = items.iter_mut().filter_map(|i| handle_one(d, i)).collect();
            (!replies.is_empty()).then_some(Value::Array(replies))
        }
        other => handle_one(d, other),
    }
}

fn error_value(id: Value, code: i64, message: String) -> Value {
    serde_json::to_value(Response::err(id, code, message)).unwrap_or(Value::Null)
}

fn handle_one(d: &Daemon, v: &mut Value) -> Option<Value> {
    let Value::Object(obj) = v else {
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
    let mut params = obj.remove("params").unwrap_or(Value::Null);
    if !(params.is_null() || params.is_object()) {
        scrub(&mut params);
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A stream that hands out its bytes a few at a time, as a socket may.
    struct Trickle {
        data: Vec<u8>,
        pos: usize,
        step: usize,
    }

    impl Read for Trickle {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            let n = self.step.min(out.len()).min(self.data.len() - self.pos);
            out[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }

    fn reader(data: &[u8], step: usize) -> RequestReader<Trickle> {
        RequestReader::new(Trickle {
            data: data.to_vec(),
            pos: 0,
            step,
        })
    }

    fn all(data: &[u8], step: usize) -> Result<Vec<Value>, String> {
        let mut r = reader(data, step);
        let mut out = Vec::new();
        while let Some(v) = r.next_value()? {
            out.push(v);
        }
        Ok(out)
    }

    #[test]
    fn values_are_split_however_the_bytes_arrive() {
        let stream = br#" {"a":"x}\"{"} [1,{"b":[]}]
{"c":"\\"}"#;
        let want = vec![
            json!({"a": "x}\"{"}),
            json!([1, {"b": []}]),
            json!({"c": "\\"}),
        ];
        for step in [1, 2, 3, 7, 4096] {
            assert_eq!(all(stream, step).unwrap(), want, "step {step}");
        }
        // Scalars are values too (handle_value answers them with Invalid Request).
        assert_eq!(all(b"42 \"s\" ", 1).unwrap(), vec![json!(42), json!("s")]);
        assert_eq!(all(b"  \n ", 1).unwrap(), Vec::<Value>::new());
    }

    #[test]
    fn bad_streams_are_parse_errors() {
        let e = all(br#"{"a": oops}"#, 3).unwrap_err();
        assert!(e.starts_with("parse error"), "{e}");
        let e = all(br#"{"a": "cut"#, 5).unwrap_err();
        assert!(e.contains("ended inside a request"), "{e}");
        let e = all(b"}{", 1).unwrap_err();
        assert!(e.starts_with("parse error"), "{e}");
    }

    #[test]
    fn an_oversized_request_is_refused_without_reading_it_all() {
        let mut big = br#"{"jsonrpc":"2.0","method":"x","params":{"s":""#.to_vec();
        big.resize(MAX_REQUEST + 2 * READ_CHUNK, b'a');
        let mut r = reader(&big, 1 << 20);
        let e = r.next_value().unwrap_err();
        assert!(e.contains("larger than"), "{e}");
        assert!(r.inner.pos < big.len(), "read the whole stream");
    }

    #[test]
    fn consumed_bytes_leave_zeros_behind() {
        let mut r = reader(br#"{"passphrase":"hunter2-hunter2"} {"n":1}"#, 4096);
        r.next_value().unwrap().unwrap();
        let len = r.buf.len();
        // The spare capacity must hold no byte of the first request.
        let spare = &r.buf.spare_capacity_mut()[..READ_CHUNK - len];
        // SAFETY: `fill` resized the buffer to READ_CHUNK bytes (all written) before
        // truncating it, so the first READ_CHUNK bytes of the allocation are initialised.
        let spare: Vec<u8> = spare.iter().map(|b| unsafe { b.assume_init() }).collect();
        assert!(spare.iter().all(|&b| b == 0));
        assert_eq!(r.next_value().unwrap(), Some(json!({"n": 1})));
    }

    #[test]
    fn scrub_empties_every_string() {
        let mut v = json!({"kek": {"passphrase": "secret"}, "list": ["a", {"b": "c"}], "n": 1});
        crate::control::scrub(&mut v);
        assert_eq!(
            v,
            json!({"kek": {"passphrase": ""}, "list": ["", {"b": ""}], "n": 1})
        );
    }
}
