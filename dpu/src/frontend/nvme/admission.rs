//! Connection limits ([`ConnLimits`]) and the accounting of what a listener's connections
//! count against ([`ListenerConns`], [`ConnSlot`]), for the TCP and the RDMA listeners alike.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::lock;

/// How many connections peers may hold (the `--nvmf-max-*` flags of nacred).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections one listener serves at once, whatever their phase; further connections
    /// are closed as soon as they are accepted.
    pub per_listener: usize,
    /// Connections of one listener that have not completed a Fabrics Connect yet. When a new
    /// connection would exceed this, the oldest such connection is closed: a peer that opens
    /// connections and stays silent cannot lock hosts out, it only evicts its own. 0 counts as
    /// 1 (the newest connection may always try; nacred refuses 0 on its command line).
    pub setup_per_listener: usize,
    /// Queues (connections with a successful Fabrics Connect) one host NQN may hold on the
    /// target; a Connect beyond it fails with Connect Controller Busy.
    pub per_host: usize,
}

impl ConnLimits {
    /// 1024 connections per listener, 64 of them setting up, 256 queues per host NQN (two
    /// controllers of 127 I/O queues each, or many smaller ones).
    pub const DEFAULT: ConnLimits = ConnLimits {
        per_listener: 1024,
        setup_per_listener: 64,
        per_host: 256,
    };
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits::DEFAULT
    }
}

/// How a listener closes a connection that is still setting up when a newer one pushes it
/// over [`ConnLimits::setup_per_listener`] (TCP: shut the socket down; RDMA: stop the
/// queue's thread, which disconnects). Called without any lock held.
pub(crate) type Evict = Box<dyn FnOnce() + Send>;

/// What a listener's connections count against ([`ConnLimits`]). Transport-independent: the
/// TCP and the RDMA listeners admit through [`ListenerConns::admit`].
#[derive(Default)]
pub(crate) struct ListenerConns {
    live: std::sync::atomic::AtomicUsize,
    /// Connections not yet past Fabrics Connect, oldest first.
    setup: Mutex<std::collections::VecDeque<(u64, Evict)>>,
}

impl ListenerConns {
    /// Take a place for connection `id` under `limits`, or `None` when the listener already
    /// serves [`ConnLimits::per_listener`] connections (the caller closes or rejects it).
    /// The new connection counts as setting up, with `evict` as the way to close it (a
    /// listener that cannot make one must refuse the connection: one it could not evict
    /// would escape the setup cap); if that makes more than
    /// [`ConnLimits::setup_per_listener`], the oldest ones still setting up are evicted —
    /// a peer that opens connections and stays silent only evicts its own.
    pub(crate) fn admit(
        self: &Arc<Self>,
        id: u64,
        limits: &ConnLimits,
        evict: Evict,
    ) -> Option<ConnSlot> {
        // Check and take in one step: two listeners' threads never race here today, but
        // the count must not overshoot if one ever does.
        let taken = self
            .live
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < limits.per_listener).then_some(n + 1)
            });
        if taken.is_err() {
            return None;
        }
        let slot = ConnSlot {
            conns: self.clone(),
            id,
        };
        let evicted: Vec<Evict> = {
            let mut setup = lock(&self.setup);
            setup.push_back((id, evict));
            let over = setup.len().saturating_sub(limits.setup_per_listener.max(1));
            setup.drain(..over).map(|(_, e)| e).collect()
        };
        for e in evicted {
            e();
        }
        Some(slot)
    }
}

/// One accepted connection's place in its listener's counts; given back on drop.
pub(crate) struct ConnSlot {
    conns: Arc<ListenerConns>,
    id: u64,
}

impl ConnSlot {
    /// The connection completed a Fabrics Connect: it no longer counts as setting up.
    pub(crate) fn connected(&self) {
        // The evict handle is dropped outside the lock (it may own a socket).
        let gone = {
            let mut setup = lock(&self.conns.setup);
            setup
                .iter()
                .position(|(id, _)| *id == self.id)
                .and_then(|i| setup.remove(i))
        };
        drop(gone);
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.connected();
        self.conns.live.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// An evict handle that records in `log` which connection (by its id) was evicted.
    fn evict(log: &Arc<Mutex<Vec<u64>>>, id: u64) -> Evict {
        let log = log.clone();
        Box::new(move || lock(&log).push(id))
    }

    #[test]
    fn listener_caps_evict_the_oldest_setup_and_refuse_past_the_cap() {
        let limits = ConnLimits {
            per_listener: 3,
            setup_per_listener: 2,
            per_host: 256,
        };
        let conns = Arc::new(ListenerConns::default());
        let log = Arc::new(Mutex::new(Vec::new()));
        let a = conns.admit(1, &limits, evict(&log, 1)).unwrap();
        let b = conns.admit(2, &limits, evict(&log, 2)).unwrap();
        assert!(lock(&log).is_empty());
        // A third silent connection pushes the oldest one still setting up out.
        let c = conns.admit(3, &limits, evict(&log, 3)).unwrap();
        assert_eq!(*lock(&log), vec![1]);
        // The listener is full whatever the phase of its connections.
        assert_eq!(conns.live.load(Ordering::SeqCst), 3);
        assert!(conns.admit(4, &limits, evict(&log, 4)).is_none());
        assert_eq!(conns.live.load(Ordering::SeqCst), 3);
        // A connection past Connect is never evicted.
        b.connected();
        drop(a);
        let d = conns.admit(5, &limits, evict(&log, 5)).unwrap();
        drop(c);
        let e = conns.admit(6, &limits, evict(&log, 6)).unwrap();
        assert_eq!(
            *lock(&log),
            vec![1],
            "only setting-up connections are evicted"
        );
        let f = conns.admit(7, &limits, evict(&log, 7));
        assert!(f.is_none(), "b, d and e fill the listener");
        drop((b, d, e));
        assert_eq!(conns.live.load(Ordering::SeqCst), 0);
        assert!(lock(&conns.setup).is_empty());
    }

    #[test]
    fn a_connected_slot_drops_its_evict_handle() {
        let conns = Arc::new(ListenerConns::default());
        let drops = Arc::new(AtomicUsize::new(0));
        struct Guard(Arc<AtomicUsize>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let g = Guard(drops.clone());
        let s = conns
            .admit(1, &ConnLimits::DEFAULT, Box::new(move || drop(g)))
            .unwrap();
        s.connected();
        // The handle (for TCP, a clone of the socket) is released at Connect, not kept for
        // the connection's life.
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        drop(s);
        assert_eq!(conns.live.load(Ordering::SeqCst), 0);
    }
}
