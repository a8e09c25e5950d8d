//! Per-thread credit: tokens one thread takes ahead from the buckets, so that the requests
//! they cover are admitted without the limiter's lock.

use std::time::Duration;

use super::bucket::Dir;

/// How much of a bucket's rate one thread may take ahead for its lock-free fast path. Tokens
/// only move (bucket → credit → request, or back): the long-run rate stays exact, and a
/// limit change or queueing costs at most this much extra per thread.
pub(super) const CREDIT_GRANT: Duration = Duration::from_millis(1);

/// Tokens one thread slot took ahead from the buckets of one volume, its tenant and the
/// daemon ([`Buckets::grant`]): requests they cover are admitted without the limiter's lock.
/// Valid while `generation` matches [`Qos::generation`] (every limit change bumps it).
///
/// Two levels, both private to the thread: `tokens` is what the grant moved out of each
/// bucket; `budget` is what was carved out of `tokens` for one [`Dir`] alone — whole
/// operations and bytes, taken from every bucket that direction counts against at once. A
/// request then costs one direction-indexed pair of integer compares ([`Credit::try_take`]);
/// the buckets are looked at again only when that direction's budget runs short
/// ([`Credit::carve`]), and carved budget goes back to the buckets exactly as it came
/// ([`Credit::fold`]).
///
/// [`Buckets::grant`]: super::bucket::Buckets::grant
/// [`Qos::generation`]: super::Qos::generation
#[derive(Default)]
pub(super) struct Credit {
    pub(super) generation: u64,
    /// Volume, tenant, daemon; by bucket index. A bucket that does not exist is infinite.
    pub(super) tokens: [[f64; 6]; 3],
    /// Per [`Dir`]: the finite entries of `tokens` it takes from, so carving looks at the one
    /// or two buckets a typical limit has, not at all eighteen.
    pub(super) need: [Need; 4],
    /// Per [`Dir`]: operations and bytes carved for it; [`UNBOUNDED`] where no bucket of that
    /// kind applies.
    pub(super) budget: [Budget; 4],
}

#[derive(Default, Clone, Copy)]
pub(super) struct Need {
    n: usize,
    /// (index into the flattened `tokens`, costs bytes).
    at: [(u8, bool); 12],
}

#[derive(Default, Clone, Copy)]
pub(super) struct Budget {
    ops: u64,
    bytes: u64,
}

/// A budget no run exhausts: the direction is not limited in that dimension.
const UNBOUNDED: u64 = u64::MAX / 2;

impl Credit {
    /// Recompute `need` after a grant; nothing is carved yet.
    pub(super) fn plan(&mut self) {
        for dir in [Dir::Read, Dir::Write, Dir::WriteNoData, Dir::Other] {
            let mut need = Need::default();
            for (lvl, tokens) in self.tokens.iter().enumerate() {
                for &(i, by_bytes) in dir.buckets() {
                    if tokens[i].is_finite() {
                        need.at[need.n] = ((lvl * 6 + i) as u8, by_bytes);
                        need.n += 1;
                    }
                }
            }
            self.need[dir as usize] = need;
        }
        self.budget = Default::default();
    }

    /// Void: nothing left, until the next grant.
    pub(super) fn clear(&mut self) {
        self.generation = 0;
        self.tokens = Default::default();
        self.budget = Default::default();
    }

    /// Admit from this direction's budget alone, carving more from the buckets' credit when
    /// it runs short.
    #[inline(always)]
    pub(super) fn try_take(&mut self, dir: Dir, bytes: u64) -> bool {
        let b = &mut self.budget[dir as usize];
        if b.ops >= 1 && b.bytes >= bytes {
            b.ops -= 1;
            b.bytes -= bytes;
            return true;
        }
        self.carve(dir, bytes)
    }

    /// Move credit from `tokens` into `dir`'s budget so it covers one request of `bytes`,
    /// plus half again of what is left (so a thread alternating directions carves rarely,
    /// and leaves the other directions something), and take the request. Carves nothing when
    /// the credit cannot cover it: the locked path folds everything back then.
    #[cold]
    #[inline(never)]
    fn carve(&mut self, dir: Dir, bytes: u64) -> bool {
        let need = self.need[dir as usize];
        let at = &need.at[..need.n];
        let tokens = self.tokens.as_flattened_mut();
        let b = &mut self.budget[dir as usize];
        // Per dimension (operations, bytes): what this direction holds, what one request costs,
        // and the least credit among the buckets of that kind it counts against.
        let avail = |by_bytes: bool| {
            at.iter()
                .filter(|&&(_, bb)| bb == by_bytes)
                .map(|&(p, _)| tokens[p as usize].max(0.0).floor() as u64)
                .min()
        };
        let dims = [
            (false, b.ops, 1, avail(false)),
            (true, b.bytes, bytes, avail(true)),
        ];
        if dims
            .iter()
            .any(|&(_, have, cost, avail)| avail.is_some_and(|a| have + a < cost))
        {
            return false;
        }
        for (by_bytes, have, cost, avail) in dims {
            let carved = match avail {
                None => UNBOUNDED,
                Some(a) => {
                    let short = cost.saturating_sub(have);
                    let take = (short + (a - short).div_ceil(2)).min(a);
                    for &(p, bb) in at {
                        if bb == by_bytes {
                            tokens[p as usize] -= take as f64;
                        }
                    }
                    have + take
                }
            };
            if by_bytes {
                b.bytes = carved;
            } else {
                b.ops = carved;
            }
        }
        b.ops -= 1;
        b.bytes -= bytes;
        true
    }

    /// Put every direction's carved budget back into `tokens`, each bucket getting back what
    /// was carved from it.
    pub(super) fn fold(&mut self) {
        let tokens = self.tokens.as_flattened_mut();
        for (need, b) in self.need.iter().zip(&mut self.budget) {
            for &(p, by_bytes) in &need.at[..need.n] {
                tokens[p as usize] += if by_bytes { b.bytes } else { b.ops } as f64;
            }
            *b = Budget::default();
        }
    }
}
