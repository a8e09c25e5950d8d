//! NVMe in-band authentication with DH-HMAC-CHAP (NVMe Base 2.0 §8.13, TP 8006): the keys,
//! the cryptography, and both roles as state machines that move bytes only, so the
//! initiator (`fabric::controller`) and a target can drive them over any transport.
//!
//! * [`secret`] — `DHHC-1:XX:...:` secrets, their transformation with an NQN, files of mode
//!   0600, and `nvme gen-dhchap-key`-compatible generation.
//! * [`dh`] — the RFC 7919 groups ffdhe2048..ffdhe8192 (aws-lc's constant-time modular
//!   exponentiation).
//! * [`chap`] — [`chap::HostAuth`] (the host: Negotiate, Reply, Success2) and
//!   [`chap::CtrlAuth`] (the controller: Challenge, Success1), with the HMAC inputs the
//!   protocol fixes.
//! * [`queue`] — the controller role at the level of a target's queue: Connect's AUTHREQ,
//!   Authentication Send/Receive commands, and the gate that holds I/O until the host has
//!   authenticated (the hooks nacred's target calls, from `frontend::nvme::fabrics`).
//! * [`tls_psk`] — pre-shared keys for NVMe/TCP over TLS 1.3 (TP 8011): the
//!   `NVMeTLSkey-1:HH:...:` interchange format, the retained PSK, the PSK identity and the
//!   TLS PSK.
//! * [`tls_channel`] — the TLS 1.3 channel with such a PSK, as server (nacred's target) and
//!   as client (its initiator), and the relay between it and a reactor.
//! * `key_text` — the text form both key formats share (prefix, hash identifier, base64 of
//!   the key and its CRC-32).
//!
//! The messages' byte layouts are in `nacre_shared::nvme::auth`. Secrets, transformed keys,
//! DH private values and shared secrets are zeroized when dropped, and no `Debug` form here
//! prints them.

pub mod chap;
pub mod dh;
mod ffdhe;
mod key_text;
pub mod queue;
pub mod secret;
pub mod tls_channel;
pub mod tls_psk;

pub use chap::{AuthFailure, CtrlAuth, CtrlAuthConfig, HostAuth, HostAuthConfig};
pub use secret::{write_secret_file, Secret, SecretError};

use nacre_shared::nvme::auth::HashId;
use ring::hmac as rhmac;
use zeroize::Zeroizing;

fn ring_alg(h: HashId) -> rhmac::Algorithm {
    match h {
        HashId::Sha256 => rhmac::HMAC_SHA256,
        HashId::Sha384 => rhmac::HMAC_SHA384,
        HashId::Sha512 => rhmac::HMAC_SHA512,
    }
}

/// HMAC-`h`(key, the concatenation of `parts`).
pub(crate) fn hmac(h: HashId, key: &[u8], parts: &[&[u8]]) -> Zeroizing<Vec<u8>> {
    let k = rhmac::Key::new(ring_alg(h), key);
    let mut ctx = rhmac::Context::with_key(&k);
    for p in parts {
        ctx.update(p);
    }
    Zeroizing::new(ctx.sign().as_ref().to_vec())
}

/// The hash `h` of `data`.
pub(crate) fn digest(h: HashId, data: &[u8]) -> Zeroizing<Vec<u8>> {
    let alg = match h {
        HashId::Sha256 => &ring::digest::SHA256,
        HashId::Sha384 => &ring::digest::SHA384,
        HashId::Sha512 => &ring::digest::SHA512,
    };
    Zeroizing::new(ring::digest::digest(alg, data).as_ref().to_vec())
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn hmac_known_answers() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let t = hmac(
            HashId::Sha256,
            b"Jefe",
            &[b"what do ya want ", b"for nothing?"],
        );
        assert_eq!(
            t[..8],
            [0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e],
            "HMAC-SHA-256"
        );
        let t = hmac(HashId::Sha512, b"Jefe", &[b"what do ya want for nothing?"]);
        assert_eq!(t[..4], [0x16, 0x4b, 0x7a, 0x7b]);
        assert_eq!(t.len(), 64);
        assert_eq!(digest(HashId::Sha384, b"").len(), 48);
    }
}
