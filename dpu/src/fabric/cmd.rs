//! Commands as the initiator tracks them from submission to completion.
//!
//! A [`Cmd`] is one NVMe command plus where its data lives and whom to tell when it ends.
//! Block I/O is split into commands (at the controller's maximum transfer size); each command
//! of one [`IoRequest`](crate::volume::IoRequest) points at a shared [`IoParent`] that holds the
//! request's segments and completes the request once, when the last command ends (first
//! error wins). Admin commands carry their own buffer and a [`AdminWait`] a thread can block
//! on with a deadline.
//!
//! A command survives the connection it was sent on: when a connection dies, the commands it
//! had in flight are handed back (never completed by the dying connection) so the controller
//! can hold them for a new connection or fail them, per the reconnect knobs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nacre_shared::nvme::{Command, Completion as Cqe, Status};

use crate::volume::{
    copy_from_segments, copy_to_segments, IoCompletion, IoError, IoResult, Segments,
};

/// Which way a command's data moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    None,
    /// Host to controller (writes, Connect data, DSM ranges).
    H2C,
    /// Controller to host (reads, Identify, log pages).
    C2H,
}

/// The request a block I/O command belongs to.
pub struct IoParent {
    segs: Segments,
    tag: u64,
    done: Arc<dyn IoCompletion>,
    pending: AtomicUsize,
    err: Mutex<Option<IoError>>,
}

impl IoParent {
    /// A parent that completes `done` after `children` calls to [`IoParent::child_done`].
    pub fn new(
        segs: Segments,
        tag: u64,
        done: Arc<dyn IoCompletion>,
        children: usize,
    ) -> Arc<Self> {
        Arc::new(IoParent {
            segs,
            tag,
            done,
            pending: AtomicUsize::new(children.max(1)),
            err: Mutex::new(None),
        })
    }

    pub fn segments(&self) -> &[crate::volume::Segment] {
        &self.segs
    }

    /// One child ended. The first error is the request's error.
    pub fn child_done(&self, r: IoResult) {
        if let Err(e) = r {
            let mut g = self.err.lock().unwrap_or_else(|p| p.into_inner());
            if g.is_none() {
                *g = Some(e);
            }
        }
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            let e = self.err.lock().unwrap_or_else(|p| p.into_inner()).take();
            self.done.complete(self.tag, e.map_or(Ok(()), Err));
        }
    }
}

/// Data of a block I/O command.
pub enum IoData {
    /// Bytes `off..off+len` of the parent's segment list.
    Segs { off: usize },
    /// Bytes the initiator built itself (Dataset Management ranges).
    Inline(Box<[u8]>),
}

/// A thread waiting for an admin command (Connect, Property Get/Set, Identify, Keep Alive).
#[derive(Default)]
pub struct AdminWait {
    /// C2H data lands here; H2C data is sent from here.
    pub buf: Mutex<Vec<u8>>,
    res: Mutex<Option<Result<Cqe, String>>>,
    cv: Condvar,
}

impl AdminWait {
    pub fn with_buf(buf: Vec<u8>) -> Arc<Self> {
        Arc::new(AdminWait {
            buf: Mutex::new(buf),
            ..Default::default()
        })
    }

    pub fn finish(&self, r: Result<Cqe, String>) {
        let mut g = self.res.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(r);
        }
        self.cv.notify_all();
    }

    /// Whether the command has ended (keep-alive polling).
    pub fn is_done(&self) -> bool {
        self.res.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Wait until `deadline`; `None` when the command has not ended by then.
    pub fn wait_until(&self, deadline: Instant) -> Option<Result<Cqe, String>> {
        // The command may still be held by this thread's plug (volume::plug).
        crate::volume::plug::flush();
        let mut g = self.res.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = g.take() {
                return Some(r);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            g = self
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    pub fn wait_for(&self, d: Duration) -> Option<Result<Cqe, String>> {
        self.wait_until(Instant::now() + d)
    }
}

/// Where a command's data lives and whom its end is reported to.
pub enum Target {
    Io { parent: Arc<IoParent>, data: IoData },
    Admin(Arc<AdminWait>),
}

/// One NVMe command (its CID is assigned by the queue that sends it).
pub struct Cmd {
    pub sqe: Command,
    pub dir: Dir,
    /// Data length in bytes.
    pub len: usize,
    pub target: Target,
    /// Fail instead of holding while the controller reconnects (multipath members: another
    /// path can serve it now).
    pub release: bool,
}

impl Cmd {
    pub fn is_io(&self) -> bool {
        matches!(self.target, Target::Io { .. })
    }

    /// Where the command's data lies when it is one contiguous range of one of its request's
    /// segments: the memory a transport may hand its device directly instead of copying
    /// (NVMe/RDMA zero copy). `None` for data spread over several segments, data the
    /// initiator built, admin buffers, and commands without data.
    pub fn contiguous_data(&self) -> Option<*mut u8> {
        let Target::Io {
            parent,
            data: IoData::Segs { off },
        } = &self.target
        else {
            return None;
        };
        if self.len == 0 {
            return None;
        }
        let mut at = 0usize;
        for s in parent.segments() {
            let end = at + s.len();
            if *off < end {
                // The command starts in this segment: it must end in it too.
                return (*off + self.len <= end).then(|| s.as_ptr().wrapping_add(*off - at));
            }
            at = end;
        }
        None
    }

    /// Copy bytes `off..off+out.len()` of the command's outgoing data into `out` (what a
    /// transport sends: in-capsule data, H2CData, or the registered buffer the controller
    /// reads with RDMA READ). Bytes past an admin buffer's end read as zero.
    pub fn read_data(&self, off: usize, out: &mut [u8]) {
        match &self.target {
            Target::Io {
                parent,
                data: IoData::Segs { off: base },
            } => {
                // SAFETY: the command is outstanding (its holder calls this), so its
                // request's segments are valid.
                unsafe { copy_from_segments(parent.segments(), base + off, out) }
            }
            Target::Io {
                data: IoData::Inline(b),
                ..
            } => {
                let n = out.len().min(b.len().saturating_sub(off));
                out[..n].copy_from_slice(&b[off..off + n]);
                out[n..].fill(0);
            }
            Target::Admin(w) => {
                let b = w.buf.lock().unwrap_or_else(|p| p.into_inner());
                let n = out.len().min(b.len().saturating_sub(off));
                out[..n].copy_from_slice(&b[off..off + n]);
                out[n..].fill(0);
            }
        }
    }

    /// Copy `src` into the command's incoming data at byte `off` (read data that arrived in
    /// a registered buffer). Admin buffers grow to fit; inline data takes none.
    pub fn write_data(&self, off: usize, src: &[u8]) {
        match &self.target {
            Target::Io {
                parent,
                data: IoData::Segs { off: base },
            } => {
                // SAFETY: the command is outstanding (its holder calls this, once, before
                // completing it), so its request's segments are valid and ours to write.
                unsafe { copy_to_segments(parent.segments(), base + off, src) }
            }
            Target::Io {
                data: IoData::Inline(_),
                ..
            } => {}
            Target::Admin(w) => {
                let mut b = w.buf.lock().unwrap_or_else(|p| p.into_inner());
                if b.len() < off + src.len() {
                    b.resize(off + src.len(), 0);
                }
                b[off..off + src.len()].copy_from_slice(src);
            }
        }
    }

    /// End the command with an NVMe completion.
    pub fn complete(self, cqe: Cqe) {
        match self.target {
            Target::Io { parent, .. } => {
                let st = cqe.status();
                parent.child_done(if st.is_success() {
                    Ok(())
                } else {
                    Err(io_error_of(st))
                })
            }
            Target::Admin(w) => w.finish(Ok(cqe)),
        }
    }

    /// End the command without a completion from the controller.
    pub fn fail(self, e: IoError) {
        match self.target {
            Target::Io { parent, .. } => parent.child_done(Err(e)),
            Target::Admin(w) => w.finish(Err(e.to_string())),
        }
    }
}

/// Map an NVMe status to what the volume layer reports upward (and frontends turn into
/// virtio/NVMe status again).
pub fn io_error_of(st: Status) -> IoError {
    use nacre_shared::nvme::status::sct;
    match st {
        Status::INVALID_OPCODE => IoError::Unsupported,
        Status::WRITE_TO_READ_ONLY => IoError::ReadOnly,
        _ if st.sct == sct::PATH && st.dnr => IoError::PathFailed,
        _ if st.sct == sct::PATH => IoError::PathLost,
        _ => IoError::Media(format!("remote controller returned {st}")),
    }
}
