//! Test peers for nacred's NVMe-oF/TCP initiator (fenced to the tests crate; never built into
//! the product):
//!
//! * [`FakeTarget`] — a small scripted NVMe/TCP target over RAM namespaces. It speaks enough of
//!   the protocol for the initiator (ICReq, Connect, Property Get/Set, Identify, Set Features,
//!   Keep Alive, discovery log, Read/Write/Flush/Write Zeroes/DSM with in-capsule data, R2T
//!   and C2HData with or without SUCCESS) and can be told to misbehave once, on a chosen I/O
//!   command: a malformed PDU, a completion for an unknown command, a data PDU longer than
//!   the command, a C2HTermReq, a dropped connection, or a stall.
//! * [`Proxy`] — a TCP forwarder between initiator and target that a test can sever, restore
//!   and stall, to cut a path deterministically.

mod proxy;
mod storage;
mod target;

pub use proxy::Proxy;
pub use storage::{Ns, Storage};
pub use target::{FakeTarget, Fault, TargetOpts};

/// `len` deterministic bytes for the data at byte offset `off` of a test seeded `seed`: a
/// block written to or read from the wrong place shows as the wrong pattern.
pub fn pattern(seed: u64, off: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut x = seed ^ off.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// A fake target for `storage` behind a [`Proxy`] (to cut, stall or corrupt the link), and a
/// controller configuration for `hostnqn` that points at the proxy; the test sets the rest.
pub fn behind_proxy(
    opts: TargetOpts,
    storage: &Storage,
    hostnqn: &str,
) -> (FakeTarget, Proxy, nacre_dpu::fabric::ControllerConfig) {
    let target = FakeTarget::start(opts.clone(), storage.clone());
    let proxy = Proxy::start(target.addr);
    let config =
        nacre_dpu::fabric::ControllerConfig::new("127.0.0.1", proxy.port(), &opts.subnqn, hostnqn);
    (target, proxy, config)
}

/// Wait until `ctrl` is live, tolerating failed first attempts (the controller keeps retrying
/// after `reconnect_delay`): on a loaded 2-core machine an ICResp can take longer than the
/// short connect timeouts the failure tests use, and that is not what they test.
pub fn wait_live(
    ctrl: &nacre_dpu::fabric::controller::Controller,
    timeout: std::time::Duration,
) -> nacre_dpu::fabric::controller::ControllerInfo {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match ctrl.wait_first_attempt(left) {
            Ok(info) => return info,
            Err(e) if left.is_zero() => panic!("controller not live within {timeout:?}: {e}"),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
}
