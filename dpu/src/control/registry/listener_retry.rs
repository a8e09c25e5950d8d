//! NVMe-oF listeners that could not be restored.
//!
//! A listener saved in the state may find its port taken when nacred restarts (another
//! service, a previous nacred still exiting), or, for NVMe/RDMA, no RDMA device with its
//! address yet (the NIC's driver or a soft-RoCE link comes up after nacred). Its subsystem is
//! restored without it, the banner and `nvmf_get_subsystems` say it is not listening and why,
//! and a background thread tries to listen again every [`RETRY_INTERVAL`] until it succeeds,
//! the listener is removed, or nacred stops. Listening is local (no network round trip), so
//! the retry takes the control lock only for the moment of each attempt.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tracing::{info, warn};

use super::store::{Inner, Registry};
use super::target::{ListenerTransport, Port};

pub const RETRY_INTERVAL: Duration = Duration::from_secs(2);

/// Start the retry thread if replay left listeners unbound.
pub fn start(registry: &Arc<Registry>) {
    {
        let inner = registry.lock();
        if inner.live.listeners_failed.is_empty() && inner.live.rdma_listeners_failed.is_empty() {
            return;
        }
    }
    let weak = Arc::downgrade(registry);
    let spawned = std::thread::Builder::new()
        .name("nvmf-listen-retry".into())
        .spawn(move || retry_loop(weak));
    if let Err(e) = spawned {
        warn!(error = %e, "cannot start the NVMe-oF listener retry");
    }
}

fn retry_loop(weak: Weak<Registry>) {
    loop {
        std::thread::sleep(RETRY_INTERVAL);
        let Some(r) = weak.upgrade() else { return };
        let mut inner = r.lock();
        if !retry_once(&mut inner) {
            return;
        }
    }
}

/// One attempt at every failed listener still configured; whether any is left to retry.
fn retry_once(inner: &mut Inner) -> bool {
    let mut left = false;
    for transport in [
        ListenerTransport::Tcp,
        ListenerTransport::Rdma,
        ListenerTransport::Tls,
    ] {
        let pending: Vec<_> = transport.failed(inner).keys().cloned().collect();
        for (nqn, addr) in pending {
            let configured = inner
                .state
                .nvmf
                .subsystems
                .get(&nqn)
                .is_some_and(|s| transport.listeners(s).contains(&addr));
            if !configured {
                transport.failed(inner).remove(&(nqn, addr));
                continue;
            }
            match Port::of(inner, transport).add(&nqn, addr) {
                Ok(_) => {
                    info!(nqn = %nqn, listener = %addr, ?transport, "nvmf listener restored");
                    transport.failed(inner).remove(&(nqn, addr));
                }
                Err(e) => {
                    transport.failed(inner).insert((nqn, addr), e.message);
                }
            }
        }
        left |= !transport.failed(inner).is_empty();
    }
    left
}
