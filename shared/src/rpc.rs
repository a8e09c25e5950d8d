//! JSON-RPC 2.0 envelope of nacred's control plane.
//!
//! The transport is a Unix stream socket (mode 0600). Requests are JSON objects; they may be
//! separated by newlines or simply concatenated, as SPDK's `rpc.py` sends them. Each response
//! is one JSON object followed by a newline. Error codes follow the JSON-RPC 2.0
//! specification section 5.1; nacre's own codes sit in the implementation-defined
//! server-error range (-32000 to -32099).

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub const JSONRPC_VERSION: &str = "2.0";

/// JSON-RPC 2.0 §5.1: invalid JSON was received.
pub const PARSE_ERROR: i64 = -32700;
/// JSON-RPC 2.0 §5.1: the JSON sent is not a valid request object.
pub const INVALID_REQUEST: i64 = -32600;
/// JSON-RPC 2.0 §5.1: the method does not exist.
pub const METHOD_NOT_FOUND: i64 = -32601;
/// JSON-RPC 2.0 §5.1: invalid method parameters.
pub const INVALID_PARAMS: i64 = -32602;
/// JSON-RPC 2.0 §5.1: internal error.
pub const INTERNAL_ERROR: i64 = -32603;
/// nacre: the named object does not exist.
pub const NOT_FOUND: i64 = -32001;
/// nacre: an object with that name already exists.
pub const ALREADY_EXISTS: i64 = -32002;
/// nacre: the object is in use (e.g. a volume exported by a device).
pub const BUSY: i64 = -32003;
/// nacre: the request is well-formed but the daemon could not carry it out (I/O, resources).
pub const OPERATION_FAILED: i64 = -32004;
/// nacre: a security rule refused the request (policy, key checks).
pub const REFUSED: i64 = -32005;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Request {
    pub jsonrpc: String,
    pub method: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Value>,
    /// Absent for notifications (no response is sent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<Value>,
}

impl Request {
    pub fn new(method: &str, params: Option<Value>, id: u64) -> Self {
        Request {
            jsonrpc: JSONRPC_VERSION.into(),
            method: method.into(),
            params,
            id: Some(Value::from(id)),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorObject {
    pub code: i64,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Response {
    pub jsonrpc: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorObject>,
    pub id: Value,
}

impl Response {
    pub fn ok(id: Value, result: Value) -> Self {
        Response {
            jsonrpc: JSONRPC_VERSION.into(),
            result: Some(result),
            error: None,
            id,
        }
    }

    pub fn err(id: Value, code: i64, message: impl Into<String>) -> Self {
        Response {
            jsonrpc: JSONRPC_VERSION.into(),
            result: None,
            error: Some(ErrorObject {
                code,
                message: message.into(),
                data: None,
            }),
            id,
        }
    }
}

/// A blocking JSON-RPC client for nacred's Unix socket, for the CLI, tests and tools.
pub struct Client {
    reader: std::io::BufReader<std::os::unix::net::UnixStream>,
    writer: std::os::unix::net::UnixStream,
    calls: Calls,
}

/// Why a call failed: the transport, or an error object from nacred.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach nacred at {path}: {source} (is nacred running? set --rpc or NACRE_RPC)")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("lost the connection to nacred: {0}")]
    Io(#[from] std::io::Error),
    #[error("nacred sent an invalid reply: {0}")]
    BadReply(String),
    #[error("{message}")]
    Rpc { code: i64, message: String },
}

impl Client {
    pub fn connect(path: &std::path::Path) -> Result<Self, ClientError> {
        let s = std::os::unix::net::UnixStream::connect(path).map_err(|source| {
            ClientError::Connect {
                path: path.display().to_string(),
                source,
            }
        })?;
        Ok(Client {
            reader: std::io::BufReader::new(s.try_clone()?),
            writer: s,
            calls: Calls::default(),
        })
    }

    /// Call `method` and return its result, or nacred's error.
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value, ClientError> {
        use std::io::{BufRead, Write};
        let (id, line) = self.calls.encode(method, params)?;
        self.writer.write_all(&line)?;
        let mut reply = String::new();
        if self.reader.read_line(&mut reply)? == 0 {
            return Err(ClientError::BadReply("connection closed".into()));
        }
        Calls::decode(id, &reply)
    }
}

/// What every nacre JSON-RPC client does whatever carries its bytes (the Unix socket's
/// [`Client`], the host channel's TLS client): it numbers requests, encodes each as one line,
/// and takes the result or the error object out of the reply to it.
#[derive(Debug)]
pub struct Calls {
    next_id: u64,
}

impl Default for Calls {
    fn default() -> Self {
        Calls { next_id: 1 }
    }
}

impl Calls {
    /// A call to `method` as one newline-terminated line, and its id. `Null` params are left
    /// out. Params may carry a passphrase: the line is serialized into a buffer of the exact
    /// size (a growing Vec would free copies as it reallocates) that is zeroed when dropped,
    /// and the params are scrubbed once encoded.
    pub fn encode(
        &mut self,
        method: &str,
        params: Value,
    ) -> Result<(u64, zeroize::Zeroizing<Vec<u8>>), ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        let params = (!params.is_null()).then_some(params);
        let mut req = Request::new(method, params, id);
        let mut size = ByteCount(0);
        let encoded = serde_json::to_writer(&mut size, &req).and_then(|()| {
            let mut line = zeroize::Zeroizing::new(Vec::with_capacity(size.0 + 1));
            serde_json::to_writer(&mut *line, &req)?;
            line.push(b'\n');
            Ok(line)
        });
        if let Some(p) = req.params.as_mut() {
            scrub(p);
        }
        let line = encoded.map_err(|e| ClientError::BadReply(e.to_string()))?;
        Ok((id, line))
    }

    /// The result of request `id` from the reply line `reply`, or the error object it carries
    /// as [`ClientError::Rpc`].
    pub fn decode(id: u64, reply: &str) -> Result<Value, ClientError> {
        let r: Response =
            serde_json::from_str(reply).map_err(|e| ClientError::BadReply(e.to_string()))?;
        if r.id != id {
            return Err(ClientError::BadReply(format!(
                "reply id {} for request {id}",
                r.id
            )));
        }
        match (r.result, r.error) {
            (_, Some(e)) => Err(ClientError::Rpc {
                code: e.code,
                message: e.message,
            }),
            (Some(v), None) => Ok(v),
            (None, None) => Err(ClientError::BadReply("neither result nor error".into())),
        }
    }
}

/// Counts the bytes written to it.
struct ByteCount(usize);

impl std::io::Write for ByteCount {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0 += b.len();
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Overwrite every string in a JSON tree with zeros (and empty it). Request params can carry
/// passphrases; serde_json's `Value` would free them as they are.
pub fn scrub(v: &mut Value) {
    use zeroize::Zeroize;
    match v {
        Value::String(s) => s.zeroize(),
        Value::Array(items) => items.iter_mut().for_each(scrub),
        Value::Object(map) => map.values_mut().for_each(scrub),
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
}

#[cfg(test)]
mod test {
    use serde_json::{json, Value};

    use super::{Calls, ClientError};

    #[test]
    fn calls_are_numbered_one_line_each_and_leave_null_params_out() {
        let mut c = Calls::default();
        let (id, line) = c.encode("volume_list", Value::Null).unwrap();
        assert_eq!(id, 1);
        assert_eq!(
            &line[..],
            &b"{\"jsonrpc\":\"2.0\",\"method\":\"volume_list\",\"id\":1}\n"[..]
        );
        let (id, line) = c.encode("tenant_create", json!({"name": "acme"})).unwrap();
        assert_eq!(id, 2);
        let sent: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(sent["params"], json!({"name": "acme"}));
        assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
    }

    #[test]
    fn replies_give_the_result_or_the_error_and_refuse_anything_else() {
        let ok = r#"{"jsonrpc":"2.0","result":[1],"id":3}"#;
        assert_eq!(Calls::decode(3, ok).unwrap(), json!([1]));
        let err = r#"{"jsonrpc":"2.0","error":{"code":-32601,"message":"no such method"},"id":3}"#;
        match Calls::decode(3, err) {
            Err(ClientError::Rpc { code, message }) => {
                assert_eq!((code, message.as_str()), (-32601, "no such method"))
            }
            other => panic!("{other:?}"),
        }
        for (id, bad) in [(4, ok), (3, r#"{"jsonrpc":"2.0","id":3}"#), (3, "not json")] {
            assert!(
                matches!(Calls::decode(id, bad), Err(ClientError::BadReply(_))),
                "{bad}"
            );
        }
    }
}
