//! Where nacred keeps things, and the defaults an operator can override.

use std::path::PathBuf;

/// Persistent state: `state.json`, file volumes, wrapped keys.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/nacre";
/// Sockets: the RPC socket and vhost-user sockets.
pub const DEFAULT_RUN_DIR: &str = "/run/nacre";
/// Name of the RPC socket inside the run directory.
pub const RPC_SOCKET_NAME: &str = "nacred.sock";
pub const ENV_STATE_DIR: &str = "NACRE_STATE_DIR";
pub const ENV_RUN_DIR: &str = "NACRE_RUN_DIR";
pub const ENV_RPC: &str = "NACRE_RPC";

/// The embedded default: a 1 GiB file volume named `default`, served on
/// `<run-dir>/vhost-default.sock` when nacred starts with nothing configured.
pub const DEFAULT_VOLUME_NAME: &str = "default";
pub const DEFAULT_VOLUME_SIZE: u64 = 1 << 30;

/// The RPC socket path nacre clients use when not told otherwise.
pub fn default_rpc_path() -> PathBuf {
    if let Some(p) = std::env::var_os(ENV_RPC) {
        return PathBuf::from(p);
    }
    let run = std::env::var_os(ENV_RUN_DIR)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_RUN_DIR));
    run.join(RPC_SOCKET_NAME)
}
