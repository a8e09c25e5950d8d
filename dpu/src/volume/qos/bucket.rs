//! Token buckets: the limiter's clock, one bucket, and the six buckets of one limit set, with
//! which of them each kind of operation counts against.

use std::time::Duration;

use nacre_shared::api::qos::{QosLimits, DEFAULT_BURST_MS};

use super::credit::CREDIT_GRANT;
use crate::telemetry;
use crate::volume::{IoKind, IoRequest};

/// Time as the limiter sees it: injectable so tests are deterministic.
pub trait Clock: Send + Sync {
    /// Time since an arbitrary fixed origin; never goes backwards.
    fn now(&self) -> Duration;

    /// The same clock at `ns`, an instant of [`telemetry::clock`] the caller already read
    /// (the request's arrival: no clock read of the limiter's own on the data path). Clocks
    /// other than the monotonic one ignore it.
    fn at_ns(&self, _ns: u64) -> Duration {
        self.now()
    }
}

/// The monotonic clock ([`telemetry::clock`]'s, so arrival instants need no conversion).
#[derive(Default)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(telemetry::clock::read_ns())
    }

    fn at_ns(&self, ns: u64) -> Duration {
        Duration::from_nanos(ns)
    }
}

/// One token bucket.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: f64,
    depth: f64,
    tokens: f64,
    last: Duration,
}

/// Floating-point slack when comparing tokens, so a pacer that wakes exactly on time admits.
const EPS: f64 = 1e-6;

impl TokenBucket {
    /// A full bucket of `rate` per second holding `burst` worth of it (at least one token).
    pub fn new(rate: u64, burst: Duration, now: Duration) -> Self {
        let depth = Self::depth_of(rate, burst);
        TokenBucket {
            rate: rate as f64,
            depth,
            tokens: depth,
            last: now,
        }
    }

    fn depth_of(rate: u64, burst: Duration) -> f64 {
        (rate as f64 * burst.as_secs_f64()).max(1.0)
    }

    /// Change rate and burst, keeping the tokens earned so far (clamped to the new depth).
    pub fn reconfigure(&mut self, rate: u64, burst: Duration, now: Duration) {
        self.refill(now);
        self.rate = rate as f64;
        self.depth = Self::depth_of(rate, burst);
        self.tokens = self.tokens.min(self.depth);
    }

    pub fn refill(&mut self, now: Duration) {
        if now > self.last {
            let dt = (now - self.last).as_secs_f64();
            self.tokens = (self.tokens + self.rate * dt).min(self.depth);
            self.last = now;
        }
    }

    /// How long until `cost` may be admitted (zero: now). Call after [`refill`](Self::refill).
    pub fn wait(&self, cost: f64) -> Duration {
        let need = cost.min(self.depth);
        if self.tokens + EPS >= need {
            Duration::ZERO
        } else {
            // Round up to the microsecond so the pacer never wakes a hair too early.
            Duration::from_secs_f64((need - self.tokens) / self.rate + 1e-6)
        }
    }

    pub fn take(&mut self, cost: f64) {
        self.tokens -= cost;
    }

    pub fn tokens(&self) -> f64 {
        self.tokens
    }
}

/// Which buckets an operation counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dir {
    Read,
    Write,
    /// Discard and Write Zeroes: write IOPS and total IOPS, no bytes.
    WriteNoData,
    /// Flush: total IOPS only.
    Other,
}

/// Bucket indices in [`Buckets::b`].
pub(super) const IOPS: usize = 0;
const READ_IOPS: usize = 1;
const WRITE_IOPS: usize = 2;
const BPS: usize = 3;
pub(super) const READ_BPS: usize = 4;
pub(super) const WRITE_BPS: usize = 5;

impl Dir {
    pub(super) fn of(kind: IoKind) -> Dir {
        match kind {
            IoKind::Read => Dir::Read,
            IoKind::Write => Dir::Write,
            IoKind::Discard | IoKind::WriteZeroes => Dir::WriteNoData,
            IoKind::Flush => Dir::Other,
        }
    }

    /// The buckets this direction counts against, each with whether it costs bytes (else 1).
    pub(super) fn buckets(self) -> &'static [(usize, bool)] {
        match self {
            Dir::Read => &[
                (IOPS, false),
                (READ_IOPS, false),
                (BPS, true),
                (READ_BPS, true),
            ],
            Dir::Write => &[
                (IOPS, false),
                (WRITE_IOPS, false),
                (BPS, true),
                (WRITE_BPS, true),
            ],
            Dir::WriteNoData => &[(IOPS, false), (WRITE_IOPS, false)],
            Dir::Other => &[(IOPS, false)],
        }
    }
}

/// The six buckets of one limit set.
#[derive(Debug, Clone, Default)]
pub(super) struct Buckets {
    limits: QosLimits,
    /// Indexed by [`IOPS`] … [`WRITE_BPS`]; `None`: no such limit.
    b: [Option<TokenBucket>; 6],
}

impl Buckets {
    pub(super) fn active(&self) -> bool {
        !self.limits.is_unlimited()
    }

    pub(super) fn configure(&mut self, limits: &QosLimits, now: Duration) {
        let burst = Duration::from_millis(limits.burst_ms.unwrap_or(DEFAULT_BURST_MS) as u64);
        let rates = [
            limits.iops,
            limits.read_iops,
            limits.write_iops,
            limits.bps,
            limits.read_bps,
            limits.write_bps,
        ];
        for (b, rate) in self.b.iter_mut().zip(rates) {
            match (b.as_mut(), rate) {
                (_, None) => *b = None,
                (Some(tb), Some(r)) => tb.reconfigure(r, burst, now),
                (None, Some(r)) => *b = Some(TokenBucket::new(r, burst, now)),
            }
        }
        self.limits = limits.clone();
    }

    /// The buckets `dir` counts against, with each one's index and cost.
    fn each(&mut self, dir: Dir, bytes: u64, mut f: impl FnMut(usize, &mut TokenBucket, f64)) {
        for &(i, by_bytes) in dir.buckets() {
            if let Some(tb) = &mut self.b[i] {
                f(i, tb, if by_bytes { bytes as f64 } else { 1.0 })
            }
        }
    }

    pub(super) fn wait(&mut self, dir: Dir, bytes: u64, now: Duration) -> Duration {
        let mut w = Duration::ZERO;
        self.each(dir, bytes, |_, tb, cost| {
            tb.refill(now);
            w = w.max(tb.wait(cost));
        });
        w
    }

    pub(super) fn take(&mut self, dir: Dir, bytes: u64) {
        self.each(dir, bytes, |_, tb, cost| tb.take(cost));
    }

    /// Hand back a thread's unused credit (see [`Credit`]); the bucket stays within its depth.
    ///
    /// [`Credit`]: super::credit::Credit
    pub(super) fn give_back(&mut self, credit: &mut [f64; 6]) {
        for (b, c) in self.b.iter_mut().zip(credit.iter_mut()) {
            if let Some(tb) = b {
                if c.is_finite() && *c > 0.0 {
                    tb.tokens = (tb.tokens + *c).min(tb.depth);
                }
            }
            *c = 0.0;
        }
    }

    /// Move up to [`CREDIT_GRANT`] worth of each bucket's tokens to a thread's credit; a
    /// bucket that does not exist is unlimited credit.
    pub(super) fn grant(&mut self, credit: &mut [f64; 6]) {
        for (b, c) in self.b.iter_mut().zip(credit.iter_mut()) {
            *c = match b {
                None => f64::INFINITY,
                Some(tb) => {
                    let g = tb.tokens.min(tb.rate * CREDIT_GRANT.as_secs_f64()).max(0.0);
                    tb.tokens -= g;
                    g
                }
            };
        }
    }
}

pub(super) fn bytes_of(dir: Dir, req: &IoRequest) -> u64 {
    match dir {
        Dir::Read | Dir::Write => req.len,
        _ => 0,
    }
}
