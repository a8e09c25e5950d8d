//! Plaintext key material: the per-volume XTS data key and the tenant key-encryption key.
//!
//! Both live on the heap in a fixed place (a `Box`), so moving the owner never leaves a copy
//! of the bytes behind on the stack, and both are overwritten with zeros when dropped. Neither
//! type implements `Clone`, `Display` or `Serialize`, and `Debug` prints only the length: a
//! plaintext key cannot reach a log line, an error message or the state directory by accident.
//!
//! Copies made by code that uses a key are cleared too: [`scrub_stack`] overwrites the dead
//! stack frames where AES key schedules were built, and inside a [`ScrubFrees`] scope the
//! [`ScrubbingAllocator`] (nacred's global allocator) zeroes what a library frees (rustls's
//! decrypted records in a KMIP exchange).

use std::fmt;

use zeroize::Zeroize;

use super::CryptoError;

/// Length of an AES-256-XTS key: two AES-256 keys (IEEE 1619 §5.1, Key1 ‖ Key2).
pub const XTS_256_KEY_LEN: usize = 64;
/// Length of an AES-128-XTS key: two AES-128 keys.
pub const XTS_128_KEY_LEN: usize = 32;
/// Length of a key-encryption key: one AES-256-GCM key.
pub const KEK_LEN: usize = 32;

/// An XTS data key: Key1 (data) ‖ Key2 (tweak), 32 or 64 bytes, halves distinct.
///
/// The halves must differ (FIPS 140 IG A.9; aws-lc and OpenSSL 3 refuse such a key with
/// "xts duplicated keys"); every constructor checks it, so no engine ever sees such a key.
pub struct XtsKey {
    bytes: Box<[u8; XTS_256_KEY_LEN]>,
    len: usize,
}

impl XtsKey {
    /// Take a key from bytes: 64 bytes for AES-256-XTS, 32 for AES-128-XTS.
    pub fn from_bytes(key: &[u8]) -> Result<Self, CryptoError> {
        if key.len() != XTS_256_KEY_LEN && key.len() != XTS_128_KEY_LEN {
            return Err(CryptoError::BadKeyLength {
                what: "XTS data key",
                expected: "64 (AES-256-XTS) or 32 (AES-128-XTS)",
                got: key.len(),
            });
        }
        let half = key.len() / 2;
        if ct_eq(&key[..half], &key[half..]) {
            return Err(CryptoError::EqualKeyHalves);
        }
        let mut bytes = Box::new([0u8; XTS_256_KEY_LEN]);
        bytes[..key.len()].copy_from_slice(key);
        Ok(XtsKey {
            bytes,
            len: key.len(),
        })
    }

    /// A fresh random key of `len` bytes (64 or 32) from the operating system's CSPRNG.
    pub fn generate(len: usize) -> Result<Self, CryptoError> {
        if len != XTS_256_KEY_LEN && len != XTS_128_KEY_LEN {
            return Err(CryptoError::BadKeyLength {
                what: "XTS data key",
                expected: "64 (AES-256-XTS) or 32 (AES-128-XTS)",
                got: len,
            });
        }
        let mut bytes = Box::new([0u8; XTS_256_KEY_LEN]);
        loop {
            getrandom::fill(&mut bytes[..len]).map_err(|e| CryptoError::Random(e.to_string()))?;
            let half = len / 2;
            // Equal halves from a CSPRNG are a 2^-128 event, but the invariant is absolute.
            if !ct_eq(&bytes[..half], &bytes[half..len]) {
                return Ok(XtsKey { bytes, len });
            }
        }
    }

    /// Key1 ‖ Key2. Only engines and the wrapping code read this.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// 64 or 32.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Key1, the data-encryption half.
    pub fn key1(&self) -> &[u8] {
        &self.bytes[..self.len / 2]
    }

    /// Key2, the tweak-encryption half.
    pub fn key2(&self) -> &[u8] {
        &self.bytes[self.len / 2..self.len]
    }
}

impl Drop for XtsKey {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

impl fmt::Debug for XtsKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "XtsKey({} bytes, redacted)", self.len)
    }
}

/// A tenant key-encryption key: one AES-256-GCM key that wraps the tenant's data keys.
pub struct Kek {
    bytes: Box<[u8; KEK_LEN]>,
}

impl Kek {
    pub fn from_bytes(key: &[u8]) -> Result<Self, CryptoError> {
        if key.len() != KEK_LEN {
            return Err(CryptoError::BadKeyLength {
                what: "key-encryption key",
                expected: "32",
                got: key.len(),
            });
        }
        let mut bytes = Box::new([0u8; KEK_LEN]);
        bytes.copy_from_slice(key);
        Ok(Kek { bytes })
    }

    /// Fill a KEK in place (for derivations that write their output directly).
    pub(crate) fn with_filler(
        fill: impl FnOnce(&mut [u8; KEK_LEN]) -> Result<(), CryptoError>,
    ) -> Result<Self, CryptoError> {
        let mut bytes = Box::new([0u8; KEK_LEN]);
        fill(&mut bytes)?;
        Ok(Kek { bytes })
    }

    pub fn generate() -> Result<Self, CryptoError> {
        Self::with_filler(|b| getrandom::fill(b).map_err(|e| CryptoError::Random(e.to_string())))
    }

    pub fn as_bytes(&self) -> &[u8; KEK_LEN] {
        &self.bytes
    }
}

impl Drop for Kek {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

impl fmt::Debug for Kek {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Kek(redacted)")
    }
}

/// Compare without an early exit, so the time taken does not say where keys first differ.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

thread_local! {
    /// Set while this thread runs code whose library buffers may hold key bytes.
    static SCRUB_FREES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn scrubbing() -> bool {
    SCRUB_FREES.try_with(std::cell::Cell::get).unwrap_or(false)
}

/// While one is alive, memory this thread frees is zeroed before it goes back to the
/// allocator (with [`ScrubbingAllocator`] as the global allocator, as in nacred).
///
/// For code that copies key bytes into buffers it does not own: rustls keeps each
/// decrypted TLS record in a `Vec` of its own (even through its unbuffered API), and a KMIP
/// Decrypt answer is a plaintext key.
pub struct ScrubFrees {
    prev: bool,
}

impl ScrubFrees {
    pub fn begin() -> Self {
        ScrubFrees {
            prev: SCRUB_FREES.with(|c| c.replace(true)),
        }
    }
}

impl Drop for ScrubFrees {
    fn drop(&mut self) {
        SCRUB_FREES.with(|c| c.set(self.prev));
    }
}

/// A global allocator that zeroes what a thread frees inside a [`ScrubFrees`] scope, and
/// otherwise is `A` (one thread-local flag read per free).
pub struct ScrubbingAllocator<A>(pub A);

/// Overwrite `len` bytes at `p` with volatile writes.
///
/// # Safety
/// `p` must be valid for writes of `len` bytes.
unsafe fn zero(p: *mut u8, len: usize) {
    // SAFETY: the caller guarantees `p` is valid for `len` bytes.
    zeroize::Zeroize::zeroize(unsafe { std::slice::from_raw_parts_mut(p, len) });
}

// SAFETY: every method forwards to `A` with the same layouts; the frees inside a scope
// first overwrite the block, which the caller still owns until `A::dealloc`.
unsafe impl<A: std::alloc::GlobalAlloc> std::alloc::GlobalAlloc for ScrubbingAllocator<A> {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        if scrubbing() {
            // SAFETY: `ptr` is a live block of `layout.size()` bytes until it is freed below.
            unsafe { zero(ptr, layout.size()) };
        }
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        if !scrubbing() {
            // SAFETY: forwarded with the caller's guarantees.
            return unsafe { self.0.realloc(ptr, layout, new_size) };
        }
        // Moved by hand, so the old block is zeroed before it is freed.
        // SAFETY: the caller guarantees `new_size`, rounded up to `layout.align()`, does
        // not overflow `isize` (GlobalAlloc::realloc's contract).
        let new_layout =
            unsafe { std::alloc::Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: `new_layout` has a non-zero size (realloc's contract).
        let new = unsafe { self.0.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are live and distinct; the copy is within both sizes; the
            // old block is then zeroed and freed with its own layout.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                zero(ptr, layout.size());
                self.0.dealloc(ptr, layout);
            }
        }
        new
    }
}

/// Bytes of stack [`scrub_stack`] overwrites.
pub const SCRUB_BYTES: usize = 128 * 1024;

/// Overwrite the stack below the caller's frame with zeros.
///
/// A key in a zeroize-on-drop box is still copied onto the stack by the code that uses it:
/// AES key schedules (whose first round keys are the key itself) are built and moved there,
/// and the frames that held them are dead but not cleared once the call returns. Code that
/// handles KEKs calls this when it is done (every control-plane operation, and each KMS
/// exchange), so a tenant's KEK does not outlive `tenant_lock` in a stack nobody uses.
#[inline(never)]
pub fn scrub_stack() {
    let mut dead = [0u8; SCRUB_BYTES];
    zeroize::Zeroize::zeroize(&mut dead[..]);
    std::hint::black_box(&dead);
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn equal_halves_are_refused_for_both_sizes() {
        let k = [7u8; 64];
        assert!(matches!(
            XtsKey::from_bytes(&k),
            Err(CryptoError::EqualKeyHalves)
        ));
        assert!(matches!(
            XtsKey::from_bytes(&k[..32]),
            Err(CryptoError::EqualKeyHalves)
        ));
        let msg = XtsKey::from_bytes(&k).unwrap_err().to_string();
        assert!(msg.contains("halves must differ"), "{msg}");
    }

    #[test]
    fn wrong_lengths_are_refused() {
        for len in [0, 16, 48, 65] {
            let k: Vec<u8> = (0..len as u8).collect();
            assert!(matches!(
                XtsKey::from_bytes(&k),
                Err(CryptoError::BadKeyLength { got, .. }) if got == len
            ));
        }
        assert!(Kek::from_bytes(&[1u8; 31]).is_err());
    }

    #[test]
    fn generated_keys_have_distinct_halves_and_differ() {
        let a = XtsKey::generate(64).unwrap();
        let b = XtsKey::generate(64).unwrap();
        assert_ne!(a.key1(), a.key2());
        assert_ne!(a.as_bytes(), b.as_bytes());
        assert_eq!(XtsKey::generate(32).unwrap().len(), 32);
    }

    #[test]
    fn debug_output_never_shows_key_bytes() {
        let bytes: Vec<u8> = (0x40..0x80).collect();
        let k = XtsKey::from_bytes(&bytes).unwrap();
        let kek = Kek::from_bytes(&bytes[..32]).unwrap();
        for s in [format!("{k:?}"), format!("{kek:?}")] {
            assert!(s.contains("redacted"));
            assert!(!s.contains("64, 65"), "{s}");
            assert!(!s.to_lowercase().contains("404142"), "{s}");
        }
    }
}
