//! The remote NVMe-oF controllers nacred runs as a host, by remote name, and the names
//! reserved while `remote_attach` connects.
//!
//! Kept outside the control lock's `Inner`: `remote_attach` connects without the control
//! lock (the first attempt may take seconds), and a volume is composed over its controllers
//! while the control lock is held.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nacre_shared::nvme_tcp::Digests;

use crate::control::state::RemoteRecord;
use crate::fabric::tcp::Reactors;
use crate::fabric::{Controller, ControllerConfig};

/// A remote being attached: transport, address, port, subsystem NQN.
type Target = (String, String, u16, String);

#[derive(Default)]
pub(super) struct Controllers {
    /// The NVMe/TCP initiator reactors every controller's queues are served by.
    tcp_reactors: Reactors,
    ctrls: Mutex<HashMap<String, Arc<Controller>>>,
    /// Remotes being attached (name → target): the name and target are reserved here while
    /// `remote_attach` connects without the control lock.
    attaching: Mutex<HashMap<String, Target>>,
}

/// A name reserved in [`Controllers::attaching`]; released on drop.
pub(super) struct Attaching<'a> {
    controllers: &'a Controllers,
    name: String,
}

impl Drop for Attaching<'_> {
    fn drop(&mut self) {
        self.controllers.attaching().remove(&self.name);
    }
}

impl Controllers {
    fn ctrls(&self) -> MutexGuard<'_, HashMap<String, Arc<Controller>>> {
        self.ctrls.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn attaching(&self) -> MutexGuard<'_, HashMap<String, Target>> {
        self.attaching.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, name: &str) -> Option<Arc<Controller>> {
        self.ctrls().get(name).cloned()
    }

    pub fn insert(&self, name: &str, c: Controller) {
        self.ctrls().insert(name.to_string(), Arc::new(c));
    }

    pub fn remove(&self, name: &str) -> Option<Arc<Controller>> {
        self.ctrls().remove(name)
    }

    /// Reserve `rec`'s name and target for the attach in progress. Reservations are made
    /// under the control lock, after the name was checked free ([`Self::is_attaching`]), so
    /// only the target can clash: `Err` names the remote being attached to it.
    pub fn reserve(&self, rec: &RemoteRecord) -> Result<Attaching<'_>, String> {
        let mut attaching = self.attaching();
        if let Some((other, _)) = attaching.iter().find(|(_, (t, a, port, nqn))| {
            *t == rec.transport && *a == rec.address && *port == rec.port && *nqn == rec.subnqn
        }) {
            return Err(other.clone());
        }
        attaching.insert(
            rec.name.clone(),
            (
                rec.transport.clone(),
                rec.address.clone(),
                rec.port,
                rec.subnqn.clone(),
            ),
        );
        Ok(Attaching {
            controllers: self,
            name: rec.name.clone(),
        })
    }

    /// Whether an attach of `name` is in progress.
    pub fn is_attaching(&self, name: &str) -> bool {
        self.attaching().contains_key(name)
    }

    /// Close every controller (nacred shutting down); each close is bounded.
    pub fn close_all(&self) {
        let all: Vec<_> = self.ctrls().drain().collect();
        for (_, c) in all {
            c.close();
        }
    }
}

impl Controllers {
    /// No controllers yet; their NVMe/TCP queues will be served by `tcp_reactors`.
    pub(super) fn new(tcp_reactors: Reactors) -> Controllers {
        Controllers {
            tcp_reactors,
            ..Default::default()
        }
    }

    pub(super) fn tcp_reactors(&self) -> &Reactors {
        &self.tcp_reactors
    }

    /// The fabric's configuration of a persisted remote.
    pub(super) fn config(&self, rec: &RemoteRecord) -> ControllerConfig {
        let mut c = config(rec);
        c.tcp_reactors = self.tcp_reactors.clone();
        c
    }
}

/// The fabric's configuration of a persisted remote (its queues on the shared reactors:
/// [`Controllers::config`] puts them on the daemon's).
fn config(rec: &RemoteRecord) -> ControllerConfig {
    let mut c = ControllerConfig::new(&rec.address, rec.port, &rec.subnqn, &rec.hostnqn);
    // Records from before NVMe/RDMA say "tcp"; an unknown word cannot be persisted
    // (new_record checks it), so TCP is only the fallback of a hand-edited state file.
    c.transport = rec.transport.parse().unwrap_or_default();
    c.hostid = uuid::Uuid::parse_str(&rec.hostid)
        .map(|u| *u.as_bytes())
        .unwrap_or(c.hostid);
    c.io_queues = rec.io_queues;
    c.queue_depth = rec.queue_depth;
    c.digests = Digests {
        header: rec.header_digest,
        data: rec.data_digest,
    };
    c.in_capsule_data_size = rec.in_capsule_data_size as usize;
    c.keep_alive_timeout = Duration::from_millis(rec.keep_alive_timeout_ms as u64);
    c.reconnect_delay = Duration::from_secs(rec.reconnect_delay_sec as u64);
    c.ctrl_loss_timeout = match rec.ctrl_loss_timeout_sec {
        -1 => None,
        n => Some(Duration::from_secs(n.max(0) as u64)),
    };
    c.fast_io_fail_timeout = match rec.fast_io_fail_timeout_sec {
        0 => None,
        n => Some(Duration::from_secs(n as u64)),
    };
    c.io_timeout = match rec.io_timeout_sec {
        0 => None,
        n => Some(Duration::from_secs(n as u64)),
    };
    c.quiesce_time = Duration::from_millis(rec.quiesce_time_ms as u64);
    c.dhchap_secret = rec.dhchap_secret.as_ref().map(Into::into);
    c.dhchap_ctrl_secret = rec.dhchap_ctrl_secret.as_ref().map(Into::into);
    c.tls_psk = rec.psk.as_ref().map(Into::into);
    c
}
