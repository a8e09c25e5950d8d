//! Finite-field Diffie-Hellman over the RFC 7919 groups DH-HMAC-CHAP names (NVMe Base 2.0
//! §8.13: ffdhe2048 to ffdhe8192), with aws-lc's constant-time modular exponentiation
//! (`BN_mod_exp_mont_consttime`, the one the TLS stacks use) through `aws-lc-sys`, which
//! nacred already links for AES-XTS.
//!
//! Public values go on the wire big-endian, padded to the prime's size (as Linux sends
//! them); a peer's value may come shorter (SPDK strips leading zeros) but never longer, and
//! must lie in 2..=p-2 (RFC 7919 §5.1), else the message is refused as an incorrect payload.
//! The shared secret is padded to the prime's size too: it is what both sides hash.

use aws_lc_sys as ffi;
use nacre_shared::nvme::auth::DhGroupId;
use zeroize::Zeroizing;

use super::ffdhe;

/// Private exponents are this many bytes: 512 bits, over twice the ~200-bit strength of
/// ffdhe8192 (RFC 7919 §5.2 asks for at least twice the group's security strength).
const PRIVATE_LEN: usize = 64;

/// A DH value could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DhError {
    #[error("DH value of {0} bytes is larger than the group's {1}")]
    Oversized(usize, usize),
    #[error("DH value is outside 2..p-2")]
    OutOfRange,
    #[error("aws-lc bignum operation failed")]
    Bignum,
}

/// The prime of `g` as big-endian bytes (`None` for the null group).
pub fn prime(g: DhGroupId) -> Option<Vec<u8>> {
    let hex = match g {
        DhGroupId::Null => return None,
        DhGroupId::Ffdhe2048 => ffdhe::FFDHE2048_P,
        DhGroupId::Ffdhe3072 => ffdhe::FFDHE3072_P,
        DhGroupId::Ffdhe4096 => ffdhe::FFDHE4096_P,
        DhGroupId::Ffdhe6144 => ffdhe::FFDHE6144_P,
        DhGroupId::Ffdhe8192 => ffdhe::FFDHE8192_P,
    };
    Some(
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("constant hex"))
            .collect(),
    )
}

/// One side's ephemeral key pair in a group.
pub struct KeyPair {
    group: DhGroupId,
    p: Vec<u8>,
    private: Zeroizing<Vec<u8>>,
    public: Vec<u8>,
}

impl std::fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyPair({}, private: <redacted>)", self.group.name())
    }
}

impl KeyPair {
    /// A fresh key pair; `None` for the null group.
    pub fn generate(group: DhGroupId) -> Result<Option<KeyPair>, DhError> {
        let Some(p) = prime(group) else {
            return Ok(None);
        };
        let mut x = Zeroizing::new(vec![0u8; PRIVATE_LEN]);
        getrandom::fill(&mut x).map_err(|_| DhError::Bignum)?;
        let public = mod_exp(&[2], &x, &p)?;
        Ok(Some(KeyPair {
            group,
            p,
            private: x,
            public: public.to_vec(),
        }))
    }

    /// g^x mod p, padded to the prime's size.
    pub fn public(&self) -> &[u8] {
        &self.public
    }

    /// The shared secret y^x mod p for the peer's public value `y`, padded to the prime's size.
    pub fn shared_secret(&self, peer: &[u8]) -> Result<Zeroizing<Vec<u8>>, DhError> {
        let len = self.group.value_len();
        let first = peer.iter().position(|&b| b != 0).unwrap_or(peer.len());
        let y = &peer[first..];
        if y.len() > len {
            return Err(DhError::Oversized(peer.len(), len));
        }
        let mut padded = vec![0u8; len];
        padded[len - y.len()..].copy_from_slice(y);
        // 2 <= y <= p - 2: p ends in FFh (RFC 7919 primes end in 64 one bits), so p - 2 is p
        // with its last byte FDh.
        let mut p_minus_2 = self.p.clone();
        p_minus_2[len - 1] = 0xFD;
        if y.is_empty() || (y.len() == 1 && y[0] < 2) || padded > p_minus_2 {
            return Err(DhError::OutOfRange);
        }
        mod_exp(&padded, &self.private, &self.p)
    }
}

/// An aws-lc BIGNUM owned by this wrapper, cleared when dropped.
struct Bn(*mut ffi::BIGNUM);

impl Bn {
    fn from_be(b: &[u8]) -> Result<Bn, DhError> {
        // SAFETY: `b` is a valid slice for its length; a null `ret` asks aws-lc to allocate.
        let p = unsafe { ffi::BN_bin2bn(b.as_ptr(), b.len(), std::ptr::null_mut()) };
        if p.is_null() {
            return Err(DhError::Bignum);
        }
        Ok(Bn(p))
    }
}

impl Drop for Bn {
    fn drop(&mut self) {
        // SAFETY: the pointer came from BN_bin2bn/BN_new and is freed once, here.
        unsafe { ffi::BN_clear_free(self.0) }
    }
}

struct BnCtx(*mut ffi::BN_CTX);

impl Drop for BnCtx {
    fn drop(&mut self) {
        // SAFETY: the pointer came from BN_CTX_new and is freed once, here.
        unsafe { ffi::BN_CTX_free(self.0) }
    }
}

/// base^exp mod m, constant time in `exp`, padded to m's length.
fn mod_exp(base: &[u8], exp: &[u8], m: &[u8]) -> Result<Zeroizing<Vec<u8>>, DhError> {
    let (a, e, n) = (Bn::from_be(base)?, Bn::from_be(exp)?, Bn::from_be(m)?);
    // SAFETY: BN_new and BN_CTX_new return owned objects or null (checked).
    let r = Bn(unsafe { ffi::BN_new() });
    // SAFETY: as above.
    let ctx = BnCtx(unsafe { ffi::BN_CTX_new() });
    if r.0.is_null() || ctx.0.is_null() {
        return Err(DhError::Bignum);
    }
    // SAFETY: every pointer is a live object owned above; a null MONT_CTX makes aws-lc build
    // its own. The modulus is odd (an RFC 7919 prime), as the function requires.
    let ok =
        unsafe { ffi::BN_mod_exp_mont_consttime(r.0, a.0, e.0, n.0, ctx.0, std::ptr::null_mut()) };
    if ok != 1 {
        return Err(DhError::Bignum);
    }
    let mut out = Zeroizing::new(vec![0u8; m.len()]);
    // SAFETY: `out` has room for m.len() bytes and r < m fits in them.
    if unsafe { ffi::BN_bn2bin_padded(out.as_mut_ptr(), out.len(), r.0) } != 1 {
        return Err(DhError::Bignum);
    }
    Ok(out)
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn primes_have_the_rfc7919_shape() {
        for g in &DhGroupId::ALL[1..] {
            let p = prime(*g).unwrap();
            assert_eq!(p.len(), g.value_len(), "{g:?}");
            // Top and bottom 64 bits are all ones; the next bits are e's (0xADF85458...).
            assert!(p[..8].iter().chain(&p[p.len() - 8..]).all(|&b| b == 0xFF));
            assert_eq!(&p[8..12], &[0xAD, 0xF8, 0x54, 0x58], "{g:?}");
        }
        assert!(prime(DhGroupId::Null).is_none());
    }

    #[test]
    fn both_sides_agree_and_bad_values_are_refused() {
        for g in [DhGroupId::Ffdhe2048, DhGroupId::Ffdhe6144] {
            let a = KeyPair::generate(g).unwrap().unwrap();
            let b = KeyPair::generate(g).unwrap().unwrap();
            assert_eq!(a.public().len(), g.value_len());
            let s1 = a.shared_secret(b.public()).unwrap();
            let s2 = b.shared_secret(a.public()).unwrap();
            assert_eq!(*s1, *s2);
            assert_eq!(s1.len(), g.value_len());
            // A value without its leading zero bytes is the same value.
            let first = b.public().iter().position(|&x| x != 0).unwrap();
            assert_eq!(*a.shared_secret(&b.public()[first..]).unwrap(), *s1);
            // Oversized, zero, one, p-1 and p are refused.
            let len = g.value_len();
            assert_eq!(
                a.shared_secret(&vec![1u8; len + 1]).unwrap_err(),
                DhError::Oversized(len + 1, len)
            );
            assert_eq!(a.shared_secret(&[]).unwrap_err(), DhError::OutOfRange);
            assert_eq!(a.shared_secret(&[0, 1]).unwrap_err(), DhError::OutOfRange);
            let p = prime(g).unwrap();
            assert_eq!(a.shared_secret(&p).unwrap_err(), DhError::OutOfRange);
            let mut pm1 = p.clone();
            pm1[len - 1] = 0xFE;
            assert_eq!(a.shared_secret(&pm1).unwrap_err(), DhError::OutOfRange);
            assert!(!format!("{a:?}").contains(&format!("{:?}", &a.private[..4])));
        }
    }

    #[test]
    fn known_answer_small_exponent() {
        // 2^10 mod p = 1024 for any p this large.
        let p = prime(DhGroupId::Ffdhe2048).unwrap();
        let r = mod_exp(&[2], &[10], &p).unwrap();
        assert_eq!(&r[r.len() - 2..], &[0x04, 0x00]);
        assert!(r[..r.len() - 2].iter().all(|&b| b == 0));
    }
}
