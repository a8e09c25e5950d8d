//! Submission plugging: a thread that submits a batch of requests in one pass opens a
//! [`Plug`], and devices that send requests over a connection hold what they would send
//! until the plug closes, then send it once, from the submitting thread itself.
//!
//! The idea and the name are the Linux block layer's (`blk_start_plug`/`blk_finish_plug`).
//! Here it is what lets a vhost-user-blk queue worker that pops 32 chains hand the NVMe/TCP
//! initiator 32 capsules and have them leave in one `send` from the worker's own thread.
//! Without it each capsule cost its own `send` (and before the initiator's reactors, each
//! batch woke the queue's writer thread: a futex wake and a context switch on a 2-core DPU
//! slice).
//!
//! Rules that keep it from losing or stalling I/O:
//! * A plug only defers, never drops: closing it (dropping the guard, also while unwinding)
//!   calls every deferred device's [`Unplug::unplug`], and a device with nothing to send
//!   ignores the call.
//! * A thread must not wait for a request it submitted while its plug is open: the request
//!   may not have left. Blocking waits in the data path call [`flush`] first
//!   (`volume::Waiter`, the fabric's admin waits), as Linux flushes a plug when the task
//!   sleeps.
//! * Plugs nest: an inner plug is a no-op, and the outermost one flushes.

use std::cell::RefCell;
use std::sync::Arc;

use smallvec::SmallVec;

/// A device that held sends while a plug was open, called once when the plug closes.
pub trait Unplug: Send + Sync {
    /// Send what was held. Must not block on the peer (a non-blocking send; what the
    /// socket does not take goes to the device's own sender).
    fn unplug(&self);
}

type Deferred = SmallVec<[Arc<dyn Unplug>; 4]>;

thread_local! {
    /// `None`: no plug open on this thread.
    static PLUG: RefCell<Option<Deferred>> = const { RefCell::new(None) };
}

/// An open plug on this thread; dropping it sends what devices held.
#[must_use = "a plug defers sends only while the guard lives"]
pub struct Plug {
    outermost: bool,
}

impl Plug {
    /// Open a plug on this thread (a no-op inside one already open).
    pub fn open() -> Plug {
        let outermost = PLUG.with(|p| {
            let mut p = p.borrow_mut();
            if p.is_some() {
                false
            } else {
                *p = Some(SmallVec::new());
                true
            }
        });
        Plug { outermost }
    }
}

impl Drop for Plug {
    fn drop(&mut self) {
        if self.outermost {
            // Closed before the devices run: one that submits again from `unplug` (none does
            // today) sends at once rather than into a plug nobody will flush.
            let deferred = PLUG.with(|p| p.borrow_mut().take());
            for d in deferred.into_iter().flatten() {
                d.unplug();
            }
        }
    }
}

/// Whether a plug is open on this thread: a device then holds its send and calls [`defer`].
pub fn is_open() -> bool {
    PLUG.with(|p| p.borrow().is_some())
}

/// Remember `dev` to be unplugged when this thread's plug closes (once, however often it is
/// deferred). Returns false, and remembers nothing, when no plug is open: the caller sends
/// now.
pub fn defer(dev: &Arc<dyn Unplug>) -> bool {
    PLUG.with(|p| {
        let mut p = p.borrow_mut();
        let Some(list) = p.as_mut() else {
            return false;
        };
        if !list.iter().any(|d| Arc::ptr_eq(d, dev)) {
            list.push(dev.clone());
        }
        true
    })
}

/// Send everything this thread's plug holds now, keeping the plug open (called before a
/// blocking wait, which would otherwise wait for a request that has not left).
pub fn flush() {
    let deferred = PLUG.with(|p| p.borrow_mut().as_mut().map(std::mem::take));
    for d in deferred.into_iter().flatten() {
        d.unplug();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Unplug for Count {
        fn unplug(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn calls(c: &Arc<Count>) -> usize {
        c.0.load(Ordering::Relaxed)
    }

    #[test]
    fn without_a_plug_nothing_is_deferred() {
        let c = Arc::new(Count::default());
        let d: Arc<dyn Unplug> = c.clone();
        assert!(!is_open());
        assert!(!defer(&d));
        assert_eq!(calls(&c), 0);
    }

    #[test]
    fn the_outermost_plug_unplugs_each_device_once() {
        let (a, b) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let (da, db): (Arc<dyn Unplug>, Arc<dyn Unplug>) = (a.clone(), b.clone());
        {
            let _outer = Plug::open();
            assert!(defer(&da));
            {
                let _inner = Plug::open();
                assert!(defer(&da) && defer(&db));
            }
            assert_eq!((calls(&a), calls(&b)), (0, 0), "the inner plug flushed");
            assert!(defer(&da));
        }
        assert_eq!((calls(&a), calls(&b)), (1, 1));
        assert!(!is_open());
    }

    #[test]
    fn flush_sends_now_and_keeps_the_plug() {
        let a = Arc::new(Count::default());
        let da: Arc<dyn Unplug> = a.clone();
        let plug = Plug::open();
        assert!(defer(&da));
        flush();
        assert_eq!(calls(&a), 1);
        assert!(is_open());
        assert!(defer(&da));
        drop(plug);
        assert_eq!(calls(&a), 2);
    }

    #[test]
    fn a_plug_dropped_while_unwinding_still_unplugs() {
        let a = Arc::new(Count::default());
        let da: Arc<dyn Unplug> = a.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _plug = Plug::open();
            defer(&da);
            panic!("a request handler panicked");
        }));
        assert!(r.is_err());
        assert_eq!(calls(&a), 1);
        assert!(!is_open());
    }
}
