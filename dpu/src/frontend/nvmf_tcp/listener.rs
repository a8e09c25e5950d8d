//! The TCP listeners subsystems share: binding one (port 0 picks a free port), its accept
//! loop handing connections to the reactors (a TLS listener's through [`super::tls`] first),
//! and stopping it.

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::tls::TlsListener;
use super::{reactor, NvmfTarget, TcpPorts};
use crate::frontend::nvme::{lock, ConnLimits, Evict, ListenerConns, NvmfError};

pub(super) struct Listener {
    subsystems: BTreeSet<String>,
    stop: Arc<AtomicBool>,
    /// The listening socket (a second descriptor for it): shut down to end the accept loop.
    sock: TcpListener,
    thread: Option<JoinHandle<()>>,
    /// TLS-only (NVMe/TCP §3.6) rather than plain.
    tls: bool,
}

impl TcpPorts {
    /// Start a listener on `addr` for `nqn`, or add `nqn` to the one running there; its
    /// PORTID comes from the target core (discovery log entries name it). `tls`: TLS-only;
    /// a running listener of the other kind is an error (a listener never falls back).
    pub(super) fn acquire_listener(
        self: &Arc<Self>,
        addr: SocketAddr,
        nqn: &str,
        tls: bool,
    ) -> Result<SocketAddr, NvmfError> {
        let mut ls = lock(&self.listeners);
        if addr.port() != 0 {
            if let Some(l) = ls.get_mut(&addr) {
                if l.tls != tls {
                    return Err(NvmfError::Listen {
                        addr,
                        source: std::io::Error::other(format!(
                            "a {} listener runs there; a listener is TLS-only or plain",
                            if l.tls { "TLS" } else { "plain" }
                        )),
                    });
                }
                l.subsystems.insert(nqn.to_string());
                return Ok(addr);
            }
        }
        let tls_ctx = match tls {
            false => None,
            true => Some(Arc::new(TlsListener::new(self.psks.clone()).map_err(
                |e| NvmfError::Listen {
                    addr,
                    source: std::io::Error::other(format!("TLS: {e}")),
                },
            )?)),
        };
        let tl = TcpListener::bind(addr).map_err(|source| NvmfError::Listen { addr, source })?;
        let bound = tl
            .local_addr()
            .map_err(|source| NvmfError::Listen { addr, source })?;
        let sock = tl
            .try_clone()
            .map_err(|source| NvmfError::Listen { addr, source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let weak = Arc::downgrade(self);
        let thread = std::thread::Builder::new()
            .name(format!("nvmf-listen-{}", bound.port()))
            .spawn(move || accept_loop(tl, bound, st, weak, Arc::default(), tls_ctx))
            .map_err(|source| NvmfError::Listen { addr, source })?;
        self.target.alloc_portid(bound);
        ls.insert(
            bound,
            Listener {
                subsystems: BTreeSet::from([nqn.to_string()]),
                stop,
                sock,
                thread: Some(thread),
                tls,
            },
        );
        Ok(bound)
    }

    pub(super) fn release_listener(&self, addr: SocketAddr, nqn: &str) {
        let stopped = {
            let mut ls = lock(&self.listeners);
            let empty = match ls.get_mut(&addr) {
                Some(l) => {
                    l.subsystems.remove(nqn);
                    l.subsystems.is_empty()
                }
                None => false,
            };
            if empty {
                ls.remove(&addr)
            } else {
                None
            }
        };
        if let Some(l) = stopped {
            stop_listener(l);
            self.target.free_portid(&addr);
            info!(%addr, "nvmf listener stopped");
        }
    }
}

/// Stop a listener's accept loop and wait for it: the port is free when this returns.
pub(super) fn stop_listener(mut l: Listener) {
    l.stop.store(true, Ordering::SeqCst);
    // Shutting a listening socket down makes a blocked accept() fail with EINVAL on Linux,
    // which ends the loop (it sees `stop`). A throw-away connection to the address, the
    // earlier way, left the loop blocked (and the removal waiting on it) whenever the
    // address could not be reached from here.
    // SAFETY: shutdown(2) on a descriptor `l.sock` owns; no memory is passed.
    if unsafe { libc::shutdown(l.sock.as_raw_fd(), libc::SHUT_RDWR) } != 0 {
        warn!(
            "nvmf listener: shutdown failed ({}); its accept thread ends with the next connection",
            std::io::Error::last_os_error()
        );
    }
    if let Some(t) = l.thread.take() {
        let _ = t.join();
    }
}

fn accept_loop(
    tl: TcpListener,
    bound: SocketAddr,
    stop: Arc<AtomicBool>,
    t: Weak<TcpPorts>,
    counts: Arc<ListenerConns>,
    tls: Option<Arc<TlsListener>>,
) {
    for s in tl.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Some(ports) = t.upgrade() else { break };
        let target = &ports.target;
        let stream = match s {
            Ok(s) => s,
            Err(e) => {
                warn!(%bound, "nvmf accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let limits = *lock(&target.limits);
        let id = target.next_conn.fetch_add(1, Ordering::Relaxed);
        // The way to evict it while it sets up: a second handle on its socket. Without one
        // (out of descriptors) it is refused, not admitted beyond the setup cap's reach.
        let c = match stream.try_clone() {
            Ok(c) => c,
            Err(e) => {
                warn!(%bound, "nvmf listener: closing a new connection: {e}");
                continue;
            }
        };
        let evict: Evict = Box::new(move || {
            // Its reactor sees the connection end and closes it.
            debug!(
                "nvmf listener at its setup cap: closing the oldest connection still setting up"
            );
            let _ = c.shutdown(std::net::Shutdown::Both);
        });
        let Some(slot) = counts.admit(id, &limits, evict) else {
            // Dropping the stream closes it: the peer sees the connection end at once.
            debug!(%bound, "nvmf listener at its connection cap: closing a new connection");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let mut nc = reactor::NewConn {
            target: target.clone(),
            sock: stream,
            listener: bound,
            slot,
            tls_peer: None,
        };
        let Some(tls) = &tls else {
            ports.reactors.assign(nc);
            continue;
        };
        // The handshake and then the relay run on a thread of the connection's own, so a
        // slow handshake holds up no other connection.
        let (tls, weak) = (tls.clone(), t.clone());
        let setup = Duration::from_millis(target.setup_timeout_ms.load(Ordering::Relaxed));
        let spawned = std::thread::Builder::new()
            .name(format!("nvmf-tls-{}", bound.port()))
            .spawn(move || {
                let Some((plain, peer, relay)) = tls.handshake(nc.sock, setup) else {
                    return;
                };
                nc.sock = plain;
                nc.tls_peer = Some(Box::new(peer));
                let Some(ports) = weak.upgrade() else { return };
                ports.reactors.assign(nc);
                drop(ports);
                relay();
            });
        if let Err(e) = spawned {
            warn!(%bound, "nvmf TLS listener: closing a new connection: {e}");
        }
    }
}

impl NvmfTarget {
    /// Serve one already-connected stream on the calling thread (a reactor of its own) until
    /// it ends, as if `listener` had accepted it (the fuzz targets' way in:
    /// dpu/src/fuzzing/).
    #[doc(hidden)]
    pub fn serve_stream(&self, sock: TcpStream, listener: SocketAddr) {
        // A listener of its own, holding just this connection: the caps do not apply (its
        // one connection is never evicted, so the handle does nothing).
        let Some(slot) =
            Arc::new(ListenerConns::default()).admit(0, &ConnLimits::DEFAULT, Box::new(|| {}))
        else {
            return;
        };
        reactor::serve_here(
            reactor::NewConn {
                target: self.inner.clone(),
                sock,
                listener,
                slot,
                tls_peer: None,
            },
            self.tcp.reactors.policy,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_listeners_portid_is_not_given_to_another_address() {
        let t = NvmfTarget::new();
        let nqn = "nqn.2024-01.io.nacre:portid";
        t.create_subsystem(nqn, "S1", "nacre", true).unwrap();
        let any = "127.0.0.1:0".parse().unwrap();
        let a = t.add_listener(nqn, any).unwrap();
        let b = t.add_listener(nqn, any).unwrap();
        assert_eq!((t.inner.portid(&a), t.inner.portid(&b)), (1, 2));
        t.remove_listener(nqn, b).unwrap();
        let c = t.add_listener(nqn, any).unwrap();
        assert_eq!(t.inner.portid(&c), 3, "2 named the removed port");
        assert_eq!(t.inner.portid(&a), 1);
    }

    #[test]
    fn a_listener_stops_without_a_connection_to_its_address() {
        let tl = TcpListener::bind("127.0.0.1:0").unwrap();
        let bound = tl.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let l = Listener {
            subsystems: BTreeSet::new(),
            stop,
            sock: tl.try_clone().unwrap(),
            thread: Some(std::thread::spawn(move || {
                accept_loop(tl, bound, st, Weak::new(), Arc::default(), None)
            })),
            tls: false,
        };
        // Stopping must not depend on reaching the address (an address that went away).
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            stop_listener(l);
            let _ = done_tx.send(());
        });
        done_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the accept thread ended");
        // And the port is free again.
        TcpListener::bind(bound).expect("the port was released");
    }
}
