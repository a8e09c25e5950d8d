//! What the seeded random tests share: a small seedable generator (so a failing case can be
//! rerun from its seed), a process-wide panic counter (a panic on a server thread must fail
//! the test even though the thread's owner never joins it), and knobs from the environment.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

/// xorshift64*: small, seedable, good enough to pick bytes. Not for anything secret.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        // Zero is xorshift's one fixed point.
        Rng(seed | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in 0..n (0 when n is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }
    pub fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize].clone()
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Count every panic in this process from now on (the default hook still prints it).
pub fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            default(info);
        }));
    });
}

/// Panics counted since [`count_panics`].
pub fn panics() -> usize {
    PANICS.load(Ordering::SeqCst)
}

/// A number from the environment (NACRE_FUZZ_SEED, NACRE_FUZZ_CASES), or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}
