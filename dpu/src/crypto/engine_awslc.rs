//! The data-path XTS engine: aws-lc's `EVP_aes_256_xts` through `aws-lc-sys`.
//!
//! aws-lc carries AVX-512 VAES code for XTS (`aes_hw_xts_encrypt_avx512`) that processes a
//! whole data unit per call; on this project's reference machine it runs 2–3× faster than
//! any other engine measured (`scripts/bench-xts`). Its symbols are prefixed, so it links
//! beside the system OpenSSL.
//!
//! An `EVP_CIPHER_CTX` holds the expanded key schedules of both halves. Setting only the IV
//! on an initialised context (`EVP_EncryptInit_ex(ctx, NULL, NULL, NULL, iv)`) resets the
//! tweak without re-expanding the key, which is what a disk workload needs once per data
//! unit. Contexts are not safe to share between threads, so a pool lends one pair
//! (encrypt, decrypt) to each concurrent request. aws-lc clears a context's memory when it
//! is freed (`OPENSSL_free` zeroes allocations), so dropping the engine leaves no key
//! schedule behind.

use std::ptr;
use std::sync::Mutex;

use aws_lc_sys as ffi;

use super::keys::{XtsKey, XTS_256_KEY_LEN};
use super::xts::{EngineKind, UnitLayout, XtsEngine};
use super::CryptoError;

/// An initialised aws-lc cipher context, freed on drop.
struct Ctx(*mut ffi::EVP_CIPHER_CTX);

// SAFETY: an EVP_CIPHER_CTX is plain heap memory owned by this wrapper; it may be used from
// any thread as long as only one thread uses it at a time, which the pool guarantees (a
// context is either in the pool's Vec or exclusively borrowed by one `run`).
unsafe impl Send for Ctx {}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: self.0 came from EVP_CIPHER_CTX_new and is freed exactly once here.
        unsafe { ffi::EVP_CIPHER_CTX_free(self.0) };
    }
}

/// AES-256-XTS by aws-lc. AES-128-XTS keys are refused (aws-lc has no `EVP_aes_128_xts`).
pub struct AwsLcXts {
    /// The raw key, kept only to initialise more contexts when concurrency grows.
    key: XtsKey,
    pool: Mutex<Vec<(Ctx, Ctx)>>,
}

fn last_error() -> String {
    // SAFETY: ERR_get_error only reads the thread-local error queue.
    let code = unsafe { ffi::ERR_get_error() };
    let mut buf = [0 as std::os::raw::c_char; 256];
    // SAFETY: buf is writable for its full length, which is passed.
    unsafe { ffi::ERR_error_string_n(code, buf.as_mut_ptr(), buf.len()) };
    // SAFETY: ERR_error_string_n always NUL-terminates within the given length.
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    format!("aws-lc: {}", s.to_string_lossy())
}

impl AwsLcXts {
    pub fn new(key: &XtsKey) -> Result<Self, CryptoError> {
        if key.len() != XTS_256_KEY_LEN {
            return Err(CryptoError::Unsupported(
                "the aws-lc engine supports AES-256-XTS (64-byte keys) only",
            ));
        }
        let me = AwsLcXts {
            key: XtsKey::from_bytes(key.as_bytes())?,
            pool: Mutex::new(Vec::new()),
        };
        let pair = me.make()?;
        me.pool.lock().unwrap_or_else(|p| p.into_inner()).push(pair);
        Ok(me)
    }

    fn make_one(&self, encrypt: bool) -> Result<Ctx, CryptoError> {
        // SAFETY: plain allocation; null is checked below.
        let raw = unsafe { ffi::EVP_CIPHER_CTX_new() };
        if raw.is_null() {
            return Err(CryptoError::Engine("aws-lc: out of memory".into()));
        }
        let ctx = Ctx(raw);
        // SAFETY: ctx is a fresh context; the cipher is a static; the key pointer is valid
        // for 64 bytes, the key length of EVP_aes_256_xts; a null IV is allowed at init.
        let ok = unsafe {
            ffi::EVP_CipherInit_ex(
                ctx.0,
                ffi::EVP_aes_256_xts(),
                ptr::null_mut(),
                self.key.as_bytes().as_ptr(),
                ptr::null(),
                encrypt as i32,
            )
        };
        if ok != 1 {
            return Err(CryptoError::Engine(last_error()));
        }
        Ok(ctx)
    }

    fn make(&self) -> Result<(Ctx, Ctx), CryptoError> {
        Ok((self.make_one(true)?, self.make_one(false)?))
    }

    fn with_ctx<R>(
        &self,
        encrypt: bool,
        f: impl FnOnce(&Ctx) -> Result<R, CryptoError>,
    ) -> Result<R, CryptoError> {
        let taken = self.pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let pair = match taken {
            Some(p) => p,
            None => self.make()?,
        };
        let r = f(if encrypt { &pair.0 } else { &pair.1 });
        self.pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(pair);
        r
    }

    /// XTS over `len` bytes from `src` to `dst` (which may be equal: aws-lc's XTS supports
    /// in-place operation), one `EVP_CipherUpdate` per data unit with the IV reset before it.
    ///
    /// # Safety
    /// `src` must be readable and `dst` writable for `len` bytes; they are equal or disjoint.
    unsafe fn run_raw(
        &self,
        layout: UnitLayout,
        first_unit: u64,
        src: *const u8,
        dst: *mut u8,
        len: usize,
        encrypt: bool,
    ) -> Result<(), CryptoError> {
        layout.check(len)?;
        let unit = layout.unit_len;
        let unit_c = i32::try_from(unit).map_err(|_| CryptoError::Misaligned { len, unit })?;
        self.with_ctx(encrypt, |ctx| {
            for i in 0..len / unit {
                let iv = layout.tweak.tweak(first_unit.wrapping_add(i as u64));
                let mut outl: i32 = 0;
                // SAFETY: ctx is initialised with key and cipher (make_one); cipher NULL
                // keeps it, key NULL keeps the key schedules, iv points to 16 bytes. The
                // caller guarantees src/dst cover `len` bytes, and i*unit + unit <= len.
                let ok = unsafe {
                    ffi::EVP_CipherInit_ex(
                        ctx.0,
                        ptr::null(),
                        ptr::null_mut(),
                        ptr::null(),
                        iv.as_ptr(),
                        -1,
                    ) == 1
                        && ffi::EVP_CipherUpdate(
                            ctx.0,
                            dst.add(i * unit),
                            &mut outl,
                            src.add(i * unit),
                            unit_c,
                        ) == 1
                };
                if !ok || outl != unit_c {
                    return Err(CryptoError::Engine(last_error()));
                }
            }
            Ok(())
        })
    }
}

impl XtsEngine for AwsLcXts {
    fn name(&self) -> &'static str {
        EngineKind::AwsLc.name()
    }

    fn crypt_in_place(
        &self,
        layout: UnitLayout,
        first_unit: u64,
        buf: &mut [u8],
        encrypt: bool,
    ) -> Result<(), CryptoError> {
        // SAFETY: buf is valid for its length; source and destination are the same buffer.
        unsafe {
            self.run_raw(
                layout,
                first_unit,
                buf.as_ptr(),
                buf.as_mut_ptr(),
                buf.len(),
                encrypt,
            )
        }
    }

    /// One pass from `src` to `dst`: a write's plaintext is read from guest memory and its
    /// ciphertext lands in the bounce buffer, with no copy in between (the provided method
    /// would copy 4 KiB first, which costs a third of the cipher itself).
    fn encrypt(
        &self,
        layout: UnitLayout,
        first_unit: u64,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<(), CryptoError> {
        layout.check_pair(src, dst)?;
        // SAFETY: src and dst are valid for their (equal) lengths; a shared and an exclusive
        // borrow cannot overlap, so they are disjoint.
        unsafe {
            self.run_raw(
                layout,
                first_unit,
                src.as_ptr(),
                dst.as_mut_ptr(),
                dst.len(),
                true,
            )
        }
    }
}
