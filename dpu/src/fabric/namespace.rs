//! A remote namespace as a [`BlockDevice`]: block requests become NVM commands (NVM Command
//! Set 1.0 §3.2: Read 02h, Write 01h, Flush 00h, Write Zeroes 08h, Dataset Management 09h).
//!
//! Requests are split at the controller's maximum transfer size (MDTS, capped at 1 MiB) and
//! at the 16-bit NLB limit; the parts complete the request together (first error wins).
//! Submission never waits: commands go to a queue's send buffer, or are held by the
//! controller while it reconnects, and complete from the thread that receives the queue's
//! answers (an NVMe/TCP reactor, an RDMA queue's completion thread).

use std::sync::Arc;

use nacre_shared::nvme::dsm::{self, DatasetManagement};
use nacre_shared::nvme::identify::oncs;
use nacre_shared::nvme::{io_opcode, Command};

use super::cmd::{Cmd, Dir, IoData, IoParent, Target};
use super::controller::{Ctrl, NamespaceInfo};
use crate::volume::{BlockDevice, Geometry, IoCompletion, IoError, IoKind, IoRequest};

/// Most blocks one Read/Write/Write Zeroes can name (NLB is 16 bits, zero-based).
const MAX_NLB: u64 = 1 << 16;

pub struct RemoteNamespace {
    ctrl: Arc<Ctrl>,
    info: NamespaceInfo,
    shift: u32,
    release: bool,
}

impl RemoteNamespace {
    pub fn new(ctrl: Arc<Ctrl>, info: NamespaceInfo) -> Self {
        RemoteNamespace {
            shift: info.block_size.trailing_zeros(),
            ctrl,
            info,
            release: false,
        }
    }

    /// A path of a multipath device: while its controller reconnects, I/O fails at once with
    /// `PathLost` (for the multipath layer to send elsewhere) instead of being held here.
    pub fn as_path(ctrl: Arc<Ctrl>, info: NamespaceInfo) -> Self {
        RemoteNamespace {
            release: true,
            ..Self::new(ctrl, info)
        }
    }

    pub fn info(&self) -> &NamespaceInfo {
        &self.info
    }

    pub fn controller(&self) -> &Arc<Ctrl> {
        &self.ctrl
    }

    fn rw(&self, op: u8, slba: u64, nlb: u64, dir: Dir, len: usize, target: Target) -> Cmd {
        let mut sqe = Command::rw(op, 0, self.info.nsid, slba, nlb as u32, Default::default());
        if op == io_opcode::FLUSH {
            sqe.cdw10 = 0;
            sqe.cdw11 = 0;
            sqe.cdw12 = 0;
        }
        Cmd {
            sqe,
            dir,
            len,
            target,
            release: self.release,
        }
    }
}

// SAFETY: the commands built from a request hold its segments until the controller
// completes them (or fails them when its path goes), and the request completes only when
// its last command has.
unsafe impl BlockDevice for RemoteNamespace {
    fn geometry(&self) -> Geometry {
        Geometry {
            size: self.info.size(),
            block_size: self.info.block_size,
        }
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        if let Err(e) = self.geometry().check(&req) {
            done.complete(req.tag, Err(e));
            return;
        }
        let oncs_bits = self.ctrl.oncs();
        let shift = self.shift;
        let bs = self.info.block_size as u64;
        // Plan the commands: (slba, nlb, byte offset into the request).
        let unit: u64 = match req.kind {
            IoKind::Read | IoKind::Write => {
                (self.ctrl.max_transfer() as u64).min(MAX_NLB * bs).max(bs)
            }
            IoKind::WriteZeroes => {
                if oncs_bits & oncs::WRITE_ZEROES == 0 {
                    done.complete(req.tag, Err(IoError::Unsupported));
                    return;
                }
                MAX_NLB * bs
            }
            IoKind::Discard => {
                if oncs_bits & oncs::DATASET_MANAGEMENT == 0 {
                    done.complete(req.tag, Err(IoError::Unsupported));
                    return;
                }
                // One range of at most 2^32-1 blocks per command.
                (u32::MAX as u64) * bs / bs * bs
            }
            IoKind::Flush => 0,
        };
        if req.kind == IoKind::Flush {
            let parent = IoParent::new(Default::default(), req.tag, done.clone(), 1);
            let c = self.rw(
                io_opcode::FLUSH,
                0,
                1,
                Dir::None,
                0,
                Target::Io {
                    parent,
                    data: IoData::Inline(Box::new([])),
                },
            );
            self.ctrl.submit_io(c);
            return;
        }
        if req.len == 0 {
            done.complete(req.tag, Ok(()));
            return;
        }
        let n = req.len.div_ceil(unit) as usize;
        let kind = req.kind;
        let (offset, total) = (req.offset, req.len);
        let parent = IoParent::new(req.segments, req.tag, done.clone(), n);
        let mut pos = 0u64;
        while pos < total {
            let len = unit.min(total - pos);
            let slba = (offset + pos) >> shift;
            let nlb = len >> shift;
            let c = match kind {
                IoKind::Read | IoKind::Write => {
                    let (op, dir) = if kind == IoKind::Read {
                        (io_opcode::READ, Dir::C2H)
                    } else {
                        (io_opcode::WRITE, Dir::H2C)
                    };
                    self.rw(
                        op,
                        slba,
                        nlb,
                        dir,
                        len as usize,
                        Target::Io {
                            parent: parent.clone(),
                            data: IoData::Segs { off: pos as usize },
                        },
                    )
                }
                IoKind::WriteZeroes => self.rw(
                    io_opcode::WRITE_ZEROES,
                    slba,
                    nlb,
                    Dir::None,
                    0,
                    Target::Io {
                        parent: parent.clone(),
                        data: IoData::Inline(Box::new([])),
                    },
                ),
                IoKind::Discard => {
                    let r = dsm::Range {
                        attributes: 0,
                        nlb: nlb as u32,
                        slba,
                    }
                    .encode();
                    let mut sqe = Command {
                        opcode: io_opcode::DATASET_MANAGEMENT,
                        nsid: self.info.nsid,
                        ..Default::default()
                    };
                    DatasetManagement {
                        ranges: 1,
                        deallocate: true,
                        integral_write: false,
                        integral_read: false,
                    }
                    .apply(&mut sqe);
                    Cmd {
                        sqe,
                        dir: Dir::H2C,
                        len: dsm::RANGE_LEN,
                        target: Target::Io {
                            parent: parent.clone(),
                            data: IoData::Inline(Box::new(r)),
                        },
                        release: self.release,
                    }
                }
                IoKind::Flush => unreachable!("handled above"),
            };
            self.ctrl.submit_io(c);
            pos += len;
        }
    }
}

/// A device seen with a larger logical block size than it has (a 512-byte namespace under a
/// 4096-byte volume), or only its first `size` bytes: every request aligned to the larger
/// block size is aligned to the smaller and checked against the smaller size, so requests
/// pass through unchanged; only the geometry differs.
pub struct BlockSizeView {
    inner: Arc<dyn BlockDevice>,
    geo: Geometry,
}

impl BlockSizeView {
    /// `block_size` must be a multiple of the inner device's block size.
    pub fn new(inner: Arc<dyn BlockDevice>, block_size: u32) -> Self {
        let g = inner.geometry();
        debug_assert_eq!(block_size % g.block_size, 0);
        BlockSizeView {
            geo: Geometry {
                size: g.size / block_size as u64 * block_size as u64,
                block_size,
            },
            inner,
        }
    }
}

impl BlockSizeView {
    /// Also cut the device to its first `size` bytes (at most its size, a multiple of
    /// `block_size`).
    pub fn with_size(inner: Arc<dyn BlockDevice>, block_size: u32, size: u64) -> Self {
        let mut v = Self::new(inner, block_size);
        v.geo.size = v.geo.size.min(size);
        v
    }
}

// SAFETY: checks the request and hands it unchanged to the inner device.
unsafe impl BlockDevice for BlockSizeView {
    fn geometry(&self) -> Geometry {
        self.geo
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        if let Err(e) = self.geo.check(&req) {
            done.complete(req.tag, Err(e));
            return;
        }
        self.inner.submit(req, done)
    }
}
