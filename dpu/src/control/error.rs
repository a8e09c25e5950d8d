//! The control plane's one error type: what a JSON-RPC method answers when it fails.
//!
//! A leaf module: the registry and the method handlers both return it, so it depends on
//! neither.

use nacre_shared::rpc;
use thiserror::Error;

/// A JSON-RPC error: a code from [`nacre_shared::rpc`] and a message that says what to fix.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{message}")]
pub struct RpcError {
    pub code: i64,
    pub message: String,
}

impl RpcError {
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }
    pub fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(rpc::INVALID_PARAMS, message)
    }
    pub fn not_found(kind: &str, name: &str) -> Self {
        Self::new(rpc::NOT_FOUND, format!("{kind} {name:?} does not exist"))
    }
    pub fn exists(kind: &str, name: &str) -> Self {
        Self::new(
            rpc::ALREADY_EXISTS,
            format!("{kind} {name:?} already exists"),
        )
    }
    pub fn busy(message: impl Into<String>) -> Self {
        Self::new(rpc::BUSY, message)
    }
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(rpc::OPERATION_FAILED, message)
    }
    pub fn refused(message: impl Into<String>) -> Self {
        Self::new(rpc::REFUSED, message)
    }
}
