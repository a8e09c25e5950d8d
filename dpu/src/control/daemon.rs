//! The daemon: its directories (locked for its life) and the registry over them.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use super::lock;
use super::registry::{listener_retry, DaemonConfig, Registry};
use super::state;

pub struct Daemon {
    /// Every object nacred serves, persisted and live.
    pub registry: Arc<Registry>,
    /// Where the Prometheus endpoint listens, once nacred started it.
    pub metrics_addr: OnceLock<std::net::SocketAddr>,
    /// `nacred.lock` in the state and run directories, held for the daemon's life.
    _locks: Vec<lock::DirLock>,
}

impl Daemon {
    /// Create the daemon over its directories, and replay the persisted state: volumes are
    /// reopened and devices restarted (`Registry::replay`). Returns the daemon and
    /// whether state existed before.
    ///
    /// Before anything else in the directories is touched, takes their locks
    /// ([`lock::acquire_all`]): a second nacred over the same state or run directory fails here
    /// and leaves the first one's sockets and files alone.
    pub fn open(config: DaemonConfig) -> anyhow::Result<(Arc<Daemon>, bool)> {
        for dir in [&config.state_dir, &config.run_dir] {
            std::fs::create_dir_all(dir)
                .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
        }
        let locks = lock::acquire_all(&[&config.state_dir, &config.run_dir])?;
        restrict_dir(&config.state_dir)?;
        let loaded = state::load(&config.state_dir)?;
        let existed = loaded.is_some();
        let registry = Arc::new(Registry::new(config, loaded.unwrap_or_default()));
        registry.replay();
        listener_retry::start(&registry);
        let daemon = Arc::new(Daemon {
            registry,
            metrics_addr: Default::default(),
            _locks: locks,
        });
        Ok((daemon, existed))
    }

    /// Stop every device (clients are disconnected, sockets removed). Volumes close as
    /// their last reference drops.
    pub fn shutdown(&self) {
        self.registry.shutdown();
    }

    pub fn state_dir(&self) -> &Path {
        self.registry.state_dir()
    }

    pub fn run_dir(&self) -> &Path {
        self.registry.run_dir()
    }
}

/// The state directory holds wrapped keys and tenant names: owner only.
fn restrict_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| anyhow::anyhow!("cannot restrict {} to mode 0700: {e}", dir.display()))
}
