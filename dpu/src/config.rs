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

/// Make way for a socket nacred binds at `path` (the RPC socket, a vhost-user device's): a
/// socket nothing listens on (left by a crashed or stopped nacred) is removed; a live one
/// (`AddrInUse`), or any other file (`AlreadyExists`), is refused with an error saying which.
/// "Nothing listens" means a stream connect is refused: a socket some program serves (or a
/// datagram socket, such as journald's, which a stream connect cannot reach) is left alone.
pub fn make_way_for_socket(path: &std::path::Path) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => {
                    return Err(Error::new(
                        ErrorKind::AddrInUse,
                        "a program is listening on this socket; refusing to replace it",
                    ))
                }
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
                Err(e) => {
                    return Err(Error::new(
                        ErrorKind::AlreadyExists,
                        format!("not a stale stream socket ({e}); refusing to replace it"),
                    ))
                }
            }
            std::fs::remove_file(path)
        }
        Ok(_) => Err(Error::new(
            ErrorKind::AlreadyExists,
            "exists and is not a socket; refusing to replace it",
        )),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}
