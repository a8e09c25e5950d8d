//! Interrupt Coalescing (NVMe Base 2.0 §5.27.1.8, Feature 08h) and Interrupt Vector
//! Configuration (§5.27.1.9, Feature 09h) for the PCIe controller's MSI-X vectors: when a
//! completion posted to a completion queue raises its vector.
//!
//! An I/O completion queue's vector is raised once Aggregation Threshold + 1 completions
//! (THR, 0's based, Dword 11 bits 7:0) have gathered on it unsignalled, or once Aggregation
//! Time (TIME, Dword 11 bits 15:8, in 100 µs) has passed since the first of them; TIME = 0
//! means no delay, so the default (THR = 0, TIME = 0) raises a vector for every completion.
//! A vector with Coalescing Disable (CD, Feature 09h Dword 11 bit 16) set is raised at once.
//! The admin completion queue, and vector 0 which serves it, are never coalesced (the
//! specification excludes the admin queue). The controller's poller raises vectors whose
//! time has come even when no other work arrives (see `ctrl::poller`): while one waits, it
//! sleeps at most 100 µs between passes.
//!
//! Within one poller pass every vector is raised at most once, at the end of the pass:
//! completions posted during the pass (by the poller or the volumes' threads) that want a
//! vector raised are gathered and raised together.
//!
//! Both features are PCIe only: a fabrics controller refuses them (Invalid Field).

use std::time::{Duration, Instant};

use nacre_shared::nvme::Status;

/// The coalescing settings and each vector's completions not yet signalled.
pub struct Coalescing {
    /// Feature 08h as set: THR (bits 7:0), TIME (bits 15:8).
    thr: u8,
    time: u8,
    vectors: Vec<Vector>,
    /// A poller pass is running: vectors to raise wait for its end.
    in_pass: bool,
}

#[derive(Default, Clone)]
struct Vector {
    /// Coalescing Disable (Feature 09h bit 16).
    cd: bool,
    /// Completions posted since the vector was last raised.
    unsignalled: u32,
    /// When the first of them was posted.
    since: Option<Instant>,
    /// Raise at the end of the running pass.
    deferred: bool,
}

/// Feature 09h Dword 11 bit 16: Coalescing Disable.
const CD: u32 = 1 << 16;
/// One unit of Aggregation Time.
const TIME_UNIT: Duration = Duration::from_micros(100);

impl Coalescing {
    /// The controller-reset state of a function with `vectors` MSI-X vectors: no
    /// coalescing, CD clear on every vector.
    pub fn new(vectors: u16) -> Self {
        Coalescing {
            thr: 0,
            time: 0,
            vectors: vec![Vector::default(); vectors as usize],
            in_pass: false,
        }
    }

    /// Back to the reset state (a controller reset loses features that are not saved).
    pub fn reset(&mut self) {
        *self = Coalescing::new(self.vectors.len() as u16);
    }

    /// Feature 08h's value (Set Features Dword 11; Get Features Dword 0).
    pub fn feature(&self) -> u32 {
        self.thr as u32 | (self.time as u32) << 8
    }

    /// Set Features 08h: bits 31:16 are reserved and ignored.
    pub fn set_feature(&mut self, v: u32) {
        self.thr = v as u8;
        self.time = (v >> 8) as u8;
    }

    /// Get Features 09h for the vector in `v` bits 15:0: IV and CD, or Invalid Field for a
    /// vector the function does not have. Vector 0 reads as CD set: it is never coalesced.
    pub fn vector_config(&self, v: u32) -> Result<u32, Status> {
        let iv = v as u16;
        let vec = self.vectors.get(iv as usize).ok_or(Status::INVALID_FIELD)?;
        Ok(iv as u32 | if vec.cd || iv == 0 { CD } else { 0 })
    }

    /// Set Features 09h: CD for the vector in bits 15:0.
    pub fn set_vector_config(&mut self, v: u32) -> Result<(), Status> {
        let vec = self
            .vectors
            .get_mut(v as u16 as usize)
            .ok_or(Status::INVALID_FIELD)?;
        vec.cd = v & CD != 0;
        Ok(())
    }

    fn coalesced(&self, iv: u16, admin: bool) -> bool {
        !admin && iv != 0 && self.time != 0 && self.vectors.get(iv as usize).is_some_and(|v| !v.cd)
    }

    /// `n` completions were posted to a completion queue (the admin queue if `admin`) whose
    /// vector is `iv`: whether to raise `iv` now. During a pass the answer is no and the
    /// vector waits for [`Coalescing::end_pass`].
    pub fn posted(&mut self, iv: u16, admin: bool, n: u32, now: Instant) -> bool {
        let coalesced = self.coalesced(iv, admin);
        let thr = self.thr as u32 + 1;
        let in_pass = self.in_pass;
        let Some(v) = self.vectors.get_mut(iv as usize) else {
            return false;
        };
        if coalesced {
            v.unsignalled = v.unsignalled.saturating_add(n);
            v.since.get_or_insert(now);
            if v.unsignalled < thr {
                return false;
            }
        }
        v.unsignalled = 0;
        v.since = None;
        if in_pass {
            v.deferred = true;
            return false;
        }
        true
    }

    /// Whether an aggregation time is set: only then do [`Coalescing::posted`] and
    /// [`Coalescing::end_pass`] need the time (without one, any instant gives the same answer).
    pub fn timed(&self) -> bool {
        self.time != 0
    }

    /// A poller pass begins: vectors to raise wait for its end.
    pub fn begin_pass(&mut self) {
        self.in_pass = true;
    }

    /// A poller pass ended (or the poller found nothing to do): the vectors to raise now,
    /// those the pass gathered and those whose aggregation time has passed.
    pub fn end_pass(&mut self, now: Instant) -> Vec<u16> {
        self.in_pass = false;
        let wait = TIME_UNIT * self.time as u32;
        let mut out = Vec::new();
        for (iv, v) in self.vectors.iter_mut().enumerate() {
            let due = v
                .since
                .is_some_and(|t| now.saturating_duration_since(t) >= wait);
            if v.deferred || due {
                v.deferred = false;
                v.unsignalled = 0;
                v.since = None;
                out.push(iv as u16);
            }
        }
        out
    }

    /// Whether a vector waits on time or on the pass (the poller then checks again soon).
    pub fn waiting(&self) -> bool {
        self.vectors.iter().any(|v| v.since.is_some() || v.deferred)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_raise_every_completion_at_once() {
        let mut c = Coalescing::new(4);
        let t = Instant::now();
        assert_eq!(c.feature(), 0);
        assert!((0..5).all(|_| c.posted(1, false, 1, t)));
        assert!(c.end_pass(t).is_empty());
        // THR without TIME: TIME = 0 means no delay.
        c.set_feature(7);
        assert!(c.posted(1, false, 1, t));
    }

    #[test]
    fn threshold_or_time_whichever_comes_first() {
        let mut c = Coalescing::new(4);
        let t = Instant::now();
        // THR = 3 (four completions), TIME = 10 (1 ms).
        c.set_feature(3 | 10 << 8);
        assert_eq!(c.feature(), 0x0A03);
        assert!(!c.posted(1, false, 1, t));
        assert!(!c.posted(1, false, 2, t));
        assert!(c.posted(1, false, 1, t), "the fourth completion");
        // Two completions, then time passes: the poller raises the vector.
        assert!(!c.posted(2, false, 2, t));
        assert!(c.waiting());
        assert!(c.end_pass(t + Duration::from_micros(999)).is_empty());
        assert_eq!(c.end_pass(t + Duration::from_millis(1)), [2]);
        assert!(!c.waiting());
        assert!(c.end_pass(t + Duration::from_secs(1)).is_empty());
    }

    #[test]
    fn the_admin_queue_vector_zero_and_cd_vectors_are_not_coalesced() {
        let mut c = Coalescing::new(4);
        let t = Instant::now();
        c.set_feature(255 | 255 << 8);
        assert!(c.posted(0, true, 1, t));
        assert!(c.posted(0, false, 1, t), "vector 0 serves the admin queue");
        assert!(c.posted(3, true, 1, t), "the admin queue on another vector");
        assert_eq!(c.vector_config(0).unwrap(), CD);
        assert_eq!(c.vector_config(2).unwrap(), 2);
        c.set_vector_config(2 | CD).unwrap();
        assert_eq!(c.vector_config(2).unwrap(), 2 | CD);
        assert!(c.posted(2, false, 1, t));
        assert!(!c.posted(1, false, 1, t));
        // A vector the function does not have.
        assert_eq!(c.vector_config(4).unwrap_err(), Status::INVALID_FIELD);
        assert_eq!(
            c.set_vector_config(9 | CD).unwrap_err(),
            Status::INVALID_FIELD
        );
        // A reset forgets everything.
        c.reset();
        assert_eq!((c.feature(), c.vector_config(2).unwrap()), (0, 2));
        assert!(!c.waiting());
    }

    #[test]
    fn a_pass_raises_each_vector_once_at_its_end() {
        let mut c = Coalescing::new(4);
        let t = Instant::now();
        c.begin_pass();
        assert!(!c.posted(1, false, 1, t));
        assert!(!c.posted(1, false, 1, t));
        assert!(!c.posted(0, true, 1, t));
        assert!(c.waiting());
        assert_eq!(c.end_pass(t), [0, 1]);
        assert!(c.posted(1, false, 1, t), "outside a pass: at once");
    }
}
