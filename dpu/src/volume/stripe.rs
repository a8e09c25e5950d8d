//! Striping (RAID-0): a volume laid across several extents — remote namespaces on different
//! targets, or any other [`BlockDevice`]s — so that bandwidth adds up as extents are added,
//! the way the seeds' storage shelves scale out.
//!
//! Layout: the volume is cut into stripe units of `stripe_size` bytes (a power of two, at
//! least the block size); unit `u` lives on extent `u % n` at byte `(u / n) * stripe_size`.
//! Each extent contributes the same number of whole units (the smallest extent, rounded
//! down to the stripe size), so the volume is `n × units × stripe_size` bytes.
//!
//! A request is split at stripe-unit boundaries into child requests, each over a slice of
//! the parent's segments; the parent completes once, after every child completed, with the
//! first error any child reported. Flush goes to every extent. Children complete in any
//! order and on any thread (inline for RAM, null and buffered file extents, from the io_uring
//! reaper for O_DIRECT ones, from the initiator's reactor or completion threads for remote
//! ones).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use thiserror::Error;

use super::{
    BlockDevice, Geometry, IoCompletion, IoError, IoKind, IoRequest, IoResult, Segment, Segments,
};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum StripeError {
    #[error("a stripe needs at least one extent")]
    NoExtents,
    #[error("extents have different block sizes ({0} and {1}): stripe only like with like")]
    MixedBlockSizes(u32, u32),
    #[error("stripe size {0} must be a power of two of at least the block size {1}")]
    BadStripeSize(u64, u32),
    #[error("extent {0} ({1} bytes) is smaller than one stripe unit of {2} bytes")]
    ExtentTooSmall(usize, u64, u64),
    #[error("the extents together hold more than 2^64 bytes")]
    TooLarge,
}

pub struct StripeVolume {
    extents: Vec<Arc<dyn BlockDevice>>,
    /// log2 of the stripe size.
    shift: u32,
    geo: Geometry,
}

impl StripeVolume {
    pub fn new(extents: Vec<Arc<dyn BlockDevice>>, stripe_size: u64) -> Result<Self, StripeError> {
        let first = extents.first().ok_or(StripeError::NoExtents)?.geometry();
        let bs = first.block_size;
        for e in &extents {
            let g = e.geometry();
            if g.block_size != bs {
                return Err(StripeError::MixedBlockSizes(bs, g.block_size));
            }
        }
        if !stripe_size.is_power_of_two() || stripe_size < bs as u64 {
            return Err(StripeError::BadStripeSize(stripe_size, bs));
        }
        let mut units = u64::MAX;
        for (i, e) in extents.iter().enumerate() {
            let size = e.geometry().size;
            if size < stripe_size {
                return Err(StripeError::ExtentTooSmall(i, size, stripe_size));
            }
            units = units.min(size / stripe_size);
        }
        let size = units
            .checked_mul(stripe_size)
            .and_then(|s| s.checked_mul(extents.len() as u64))
            .ok_or(StripeError::TooLarge)?;
        Ok(StripeVolume {
            shift: stripe_size.trailing_zeros(),
            geo: Geometry {
                size,
                block_size: bs,
            },
            extents,
        })
    }

    pub fn stripe_size(&self) -> u64 {
        1 << self.shift
    }

    pub fn extents(&self) -> &[Arc<dyn BlockDevice>] {
        &self.extents
    }

    /// Where byte `off` of the volume lives: (extent index, byte offset in the extent).
    pub fn map(&self, off: u64) -> (usize, u64) {
        let n = self.extents.len() as u64;
        let unit = off >> self.shift;
        let within = off & (self.stripe_size() - 1);
        ((unit % n) as usize, ((unit / n) << self.shift) + within)
    }

    /// The child ranges of `offset..offset+len`: (extent, extent offset, byte offset into the
    /// request, length), each within one stripe unit.
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (usize, u64, u64, u64)> + '_ {
        let ss = self.stripe_size();
        let end = offset + len;
        let mut pos = offset;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let unit_end = (pos | (ss - 1)) + 1;
            let n = unit_end.min(end) - pos;
            let (e, eoff) = self.map(pos);
            let piece = (e, eoff, pos - offset, n);
            pos += n;
            Some(piece)
        })
    }
}

/// The parent request of a split: completes `done` once, after `pending` children.
struct Parent {
    tag: u64,
    done: Arc<dyn IoCompletion>,
    pending: AtomicUsize,
    err: Mutex<Option<IoError>>,
}

impl IoCompletion for Parent {
    fn complete(&self, _child: u64, result: IoResult) {
        if let Err(e) = result {
            let mut g = self.err.lock().unwrap_or_else(|p| p.into_inner());
            // First error wins: it is the one that says what went wrong first.
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

/// The part `skip..skip+len` of a segment list, as a new segment list over the same memory.
fn slice_segments(segs: &[Segment], mut skip: usize, mut len: usize) -> Segments {
    let mut out = Segments::new();
    for s in segs {
        if len == 0 {
            break;
        }
        if skip >= s.len() {
            skip -= s.len();
            continue;
        }
        let n = (s.len() - skip).min(len);
        // SAFETY: a sub-range of a segment of an in-flight request (skip + n <= s.len()); the
        // child request completes before its parent, so the submitter's guarantee covers it.
        out.push(unsafe { Segment::new(s.as_ptr().add(skip), n) });
        len -= n;
        skip = 0;
    }
    out
}

// SAFETY: the pieces' segments are sub-ranges of the request's, and the request's
// completion is reported only when the last piece completed (`Parent`).
unsafe impl BlockDevice for StripeVolume {
    fn geometry(&self) -> Geometry {
        self.geo
    }

    fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
        if let Err(e) = self.geo.check(&req) {
            done.complete(req.tag, Err(e));
            return;
        }
        if req.kind == IoKind::Flush {
            let parent: Arc<dyn IoCompletion> = Arc::new(Parent {
                tag: req.tag,
                done: done.clone(),
                pending: AtomicUsize::new(self.extents.len()),
                err: Mutex::new(None),
            });
            for e in &self.extents {
                e.submit(IoRequest::new(IoKind::Flush, 0, 0, 0), &parent);
            }
            return;
        }
        if req.len == 0 {
            done.complete(req.tag, Ok(()));
            return;
        }
        let count = self.pieces(req.offset, req.len).count();
        // Set the count before the first child is submitted: a child may complete inline.
        let parent: Arc<dyn IoCompletion> = Arc::new(Parent {
            tag: req.tag,
            done: done.clone(),
            pending: AtomicUsize::new(count),
            err: Mutex::new(None),
        });
        let data = matches!(req.kind, IoKind::Read | IoKind::Write);
        for (i, (e, eoff, skip, n)) in self.pieces(req.offset, req.len).enumerate() {
            let mut child = IoRequest::new(req.kind, eoff, n, i as u64);
            if data {
                child.segments = slice_segments(&req.segments, skip as usize, n as usize);
            }
            self.extents[e].submit(child, &parent);
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::volume::ram::RamVolume;

    fn rams(n: usize, size: u64, bs: u32) -> Vec<Arc<RamVolume>> {
        (0..n)
            .map(|_| Arc::new(RamVolume::new(size, bs).unwrap()))
            .collect()
    }

    fn dyns(v: &[Arc<RamVolume>]) -> Vec<Arc<dyn BlockDevice>> {
        v.iter()
            .map(|r| r.clone() as Arc<dyn BlockDevice>)
            .collect()
    }

    fn pattern(seed: u32, len: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    #[test]
    fn geometry_and_refusals() {
        let r = rams(3, 1 << 20, 512);
        let mut d = dyns(&r);
        d.push(Arc::new(RamVolume::new((1 << 20) + 4096 * 3, 512).unwrap()));
        let s = StripeVolume::new(d, 65536).unwrap();
        assert_eq!(s.geometry().size, 4 << 20, "smallest extent, whole units");
        assert_eq!(
            StripeVolume::new(dyns(&r), 3000).err(),
            Some(StripeError::BadStripeSize(3000, 512))
        );
        assert_eq!(
            StripeVolume::new(dyns(&r), 256).err(),
            Some(StripeError::BadStripeSize(256, 512))
        );
        let mut mixed = dyns(&r);
        mixed.push(Arc::new(RamVolume::new(1 << 20, 4096).unwrap()));
        assert_eq!(
            StripeVolume::new(mixed, 65536).err(),
            Some(StripeError::MixedBlockSizes(512, 4096))
        );
        assert_eq!(
            StripeVolume::new(vec![], 4096).err(),
            Some(StripeError::NoExtents)
        );
        assert!(matches!(
            StripeVolume::new(dyns(&r), 2 << 20),
            Err(StripeError::ExtentTooSmall(0, _, _))
        ));
    }

    #[test]
    fn units_land_round_robin_on_the_extents() {
        let r = rams(3, 1 << 20, 512);
        let s = StripeVolume::new(dyns(&r), 4096).unwrap();
        // One write across 7 units, starting mid-unit.
        let data = pattern(1, 7 * 4096);
        s.write_at(4096, &data).unwrap();
        for u in 0..7u64 {
            let vol_off = 4096 + u * 4096;
            let (e, eoff) = s.map(vol_off);
            assert_eq!(e as u64, (1 + u) % 3);
            assert_eq!(eoff, ((1 + u) / 3) * 4096);
            let mut got = vec![0u8; 4096];
            r[e].read_at(eoff, &mut got).unwrap();
            assert!(
                got[..] == data[(u * 4096) as usize..((u + 1) * 4096) as usize],
                "unit {u} on extent {e}"
            );
        }
    }

    #[test]
    fn matches_a_flat_model_for_any_split() {
        let r = rams(4, 256 << 10, 512);
        let s = StripeVolume::new(dyns(&r), 8192).unwrap();
        let size = s.geometry().size as usize;
        let mut model = vec![0u8; size];
        let mut x = 12345u64;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for i in 0..200u32 {
            let blocks = (size / 512) as u64;
            let start = rnd(blocks);
            let len = 1 + rnd((blocks - start).min(200));
            let (off, len) = ((start * 512) as usize, (len * 512) as usize);
            let data = pattern(i, len);
            // Several segments of odd sizes, crossing unit boundaries independently.
            let mut bufs: Vec<Vec<u8>> = Vec::new();
            let mut p = 0;
            while p < len {
                let n = (1 + rnd(9000) as usize).min(len - p);
                bufs.push(data[p..p + n].to_vec());
                p += n;
            }
            let segs: Vec<Segment> = bufs
                .iter_mut()
                // SAFETY: submit_wait below returns after completion; `bufs` outlives it.
                .map(|b| unsafe { Segment::from_slice(b) })
                .collect();
            s.submit_wait(
                IoRequest::new(IoKind::Write, off as u64, len as u64, 0).with_segments(segs),
            )
            .unwrap();
            model[off..off + len].copy_from_slice(&data);
            if i % 7 == 0 {
                let zl = 512 * (1 + rnd(64) as usize).min((size - off) / 512);
                s.submit_wait(IoRequest::new(
                    IoKind::WriteZeroes,
                    off as u64,
                    zl as u64,
                    0,
                ))
                .unwrap();
                model[off..off + zl].fill(0);
            }
        }
        let mut back = vec![0u8; size];
        s.read_at(0, &mut back).unwrap();
        assert!(back == model);
        s.submit_wait(IoRequest::new(IoKind::Flush, 0, 0, 0))
            .unwrap();
    }

    /// An extent that completes from another thread, and fails where told.
    struct Later {
        inner: Arc<RamVolume>,
        fail: Option<IoError>,
    }
    // SAFETY: the request runs to completion on the inner RAM volume before the completion
    // is reported from the spawned thread.
    unsafe impl BlockDevice for Later {
        fn geometry(&self) -> Geometry {
            self.inner.geometry()
        }
        fn submit(&self, req: IoRequest, done: &Arc<dyn IoCompletion>) {
            let done = done.clone();
            let tag = req.tag;
            let r = match &self.fail {
                Some(e) => Err(e.clone()),
                None => self.inner.submit_wait(req),
            };
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(2));
                done.complete(tag, r);
            });
        }
    }

    #[test]
    fn asynchronous_children_and_first_error() {
        let r = rams(2, 1 << 20, 512);
        let ok: Vec<Arc<dyn BlockDevice>> = r
            .iter()
            .map(|v| {
                Arc::new(Later {
                    inner: v.clone(),
                    fail: None,
                }) as Arc<dyn BlockDevice>
            })
            .collect();
        let s = StripeVolume::new(ok, 4096).unwrap();
        let data = pattern(5, 64 << 10);
        s.write_at(0, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        s.read_at(0, &mut back).unwrap();
        assert!(back == data);

        let bad: Vec<Arc<dyn BlockDevice>> = vec![
            Arc::new(Later {
                inner: r[0].clone(),
                fail: None,
            }),
            Arc::new(Later {
                inner: r[1].clone(),
                fail: Some(IoError::PathLost),
            }),
        ];
        let s = StripeVolume::new(bad, 4096).unwrap();
        assert_eq!(s.read_at(0, &mut back), Err(IoError::PathLost));
        // A request that stays on the healthy extent succeeds.
        assert_eq!(s.read_at(0, &mut back[..4096]), Ok(()));
        // Out of range is refused before any child is sent.
        let size = s.geometry().size;
        assert!(matches!(
            s.read_at(size - 512, &mut back[..1024]),
            Err(IoError::OutOfRange { .. })
        ));
    }
}
