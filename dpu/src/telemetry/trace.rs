//! Following one request through nacred: tracing spans and events under the target
//! [`TARGET`] (`nacre::io`), at TRACE level, so they cost one level check per call site
//! unless asked for: `nacred --log info,nacre::io=trace`.
//!
//! Submission runs on one thread from the frontend down to the wire, so its spans nest:
//!
//! ```text
//! vhost{dev=NACRE0ADB531C2F3347C head=3}:volume{volume="ev" op=Write offset=1048576 len=4096}:
//!     crypt{step="encrypt" unit=256 len=4096}: nacre::io: fabric: command sent qid=1 cid=0x0041
//!     opcode=1 len=4096
//! ```
//!
//! Completion runs on whichever thread sees the remote controller's answer, so its spans
//! nest the other way, from the wire up to the frontend, and carry the same identifiers:
//!
//! ```text
//! fabric_cpl{qid=1 cid=0x0041 sct=0 sc=0}:crypt{step="decrypt" unit=256 len=4096}:
//!     nacre::io: vhost: completion queued for the queue worker head=3
//! nacre::io: vhost: done dev=NACRE0ADB531C2F3347C head=3 status=0 latency_us=812.4
//! ```
//!
//! A slow request is found by its `latency_us` in the frontend's `done` event (vhost-user-blk:
//! device serial and descriptor head; NVMe/TCP: `qid` and `cid`), and followed back through
//! the lines that carry the same identifiers: the fabric's `qid`/`cid` pair ties the command
//! sent to its completion.

use std::fmt;

/// The tracing target of every per-request span and event.
pub const TARGET: &str = "nacre::io";

/// A virtio-blk serial (GET_ID bytes, NUL padded) as text, formatted only when traced.
pub struct Serial<'a>(pub &'a [u8]);

impl fmt::Display for Serial<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let end = self.0.iter().position(|&b| b == 0).unwrap_or(self.0.len());
        f.write_str(&String::from_utf8_lossy(&self.0[..end]))
    }
}

/// Whether per-request tracing is on (for work only a trace needs, such as a clock read).
#[inline]
pub fn enabled() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::TRACE)
}
