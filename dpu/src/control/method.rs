//! What a method handler is, and the two things every handler does besides calling the
//! registry: parse its params, serialise its result.

use nacre_shared::rpc;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::daemon::Daemon;
use super::error::RpcError;

pub use nacre_shared::rpc::scrub;

pub type Handler = fn(&Daemon, Value) -> Result<Value, RpcError>;

/// One control-plane method.
pub struct Method {
    pub name: &'static str,
    pub handler: Handler,
    /// One line, shown by `rpc_get_methods` with `"verbose": true` and by `nacre methods`.
    pub help: &'static str,
}

/// Parse a method's params into its typed struct; `null`/absent means `{}`.
///
/// The typed struct gets its own copies of the strings (types holding secrets zeroize them on
/// drop), and the JSON tree is scrubbed before it is freed, so a passphrase leaves no copy
/// behind in freed heap memory.
pub fn parse_params<T: DeserializeOwned>(mut params: Value) -> Result<T, RpcError> {
    if params.is_null() {
        params = Value::Object(Default::default());
    }
    let parsed = T::deserialize(&params)
        .map_err(|e| RpcError::invalid_params(format!("invalid params: {e}")));
    scrub(&mut params);
    parsed
}

/// Turn any serializable result into the JSON-RPC result value.
pub fn to_value<T: serde::Serialize>(v: T) -> Result<Value, RpcError> {
    serde_json::to_value(v).map_err(|e| RpcError::new(rpc::INTERNAL_ERROR, e.to_string()))
}

/// Params of methods that take none: anything but `{}`/null is an error, so a misspelt
/// filter is not silently ignored.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}
