//! TLS 1.3 with a pre-shared key on NVMe/TCP listeners (NVMe/TCP Transport §3.6, from TP
//! 8011).
//!
//! A listener is TLS-only or plain, never both: a TLS listener's connections start with the
//! TLS handshake (before the ICReq), and a host that sends a plain ICReq fails it and is
//! closed; a plain listener's reactor sees a ClientHello as a PDU of no known type and ends
//! the connection.
//!
//! Each accepted TLS connection gets a thread that runs the handshake as the TLS server, then
//! relays between the host and the reactors ([`crate::auth::tls_channel`], which the
//! initiator's queues share).
//!
//! The host offers a PSK identity `NVMe0R0S <hostnqn> <subnqn>`
//! ([`crate::auth::tls_psk`]); the handshake finds the PSK configured for that host on that
//! subsystem ([`NvmfTarget::set_host_psk`](super::NvmfTarget::set_host_psk)), derives the TLS
//! PSK, and offers it as a TLS 1.3 session of the identity's cipher suite (OpenSSL's PSK find
//! session callback: its older PSK server callback makes only SHA-256 sessions). An unknown
//! identity, a key of the other suite, or a wrong key ends the handshake.
//!
//! Each queue's Fabrics Connect must then name the identity's host and subsystem NQNs
//! (`command`), or it is refused as an invalid host. The identity's version 1 form (with a
//! PSK digest) is refused.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, c_uchar, c_void};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openssl::ssl::{Ssl, SslContext, SslMethod};
use tracing::{debug, info};
use zeroize::Zeroizing;

use crate::auth::tls_channel::{self, psk_session, Relay, NVME_SUITES};
use crate::auth::tls_psk::{parse_identity, Identity, TlsPsk};
use crate::frontend::nvme::lock;

/// The configured PSKs: (subsystem NQN, host NQN) → key.
#[derive(Default)]
pub(crate) struct PskStore {
    keys: Mutex<HashMap<(String, String), TlsPsk>>,
}

impl PskStore {
    pub(crate) fn set(&self, subnqn: &str, hostnqn: &str, psk: Option<TlsPsk>) {
        let k = (subnqn.to_string(), hostnqn.to_string());
        let mut m = lock(&self.keys);
        match psk {
            Some(p) => {
                m.insert(k, p);
            }
            None => {
                m.remove(&k);
            }
        }
    }

    pub(crate) fn forget_subsystem(&self, subnqn: &str) {
        lock(&self.keys).retain(|(s, _), _| s != subnqn);
    }

    pub(crate) fn has(&self, subnqn: &str, hostnqn: &str) -> bool {
        lock(&self.keys).contains_key(&(subnqn.to_string(), hostnqn.to_string()))
    }

    /// The TLS PSK for the identity a host offered, or why there is none.
    fn find(&self, identity: &[u8]) -> Result<(Identity, Zeroizing<Vec<u8>>), String> {
        let id = parse_identity(identity).map_err(|e| e.to_string())?;
        let m = lock(&self.keys);
        let psk = m
            .get(&(id.subnqn.clone(), id.hostnqn.clone()))
            .ok_or_else(|| format!("no PSK for host {} on {}", id.hostnqn, id.subnqn))?;
        if psk.cipher_suite() != id.suite {
            return Err(format!(
                "host {} asks for {}; its PSK is for {}",
                id.hostnqn,
                id.suite.name(),
                psk.cipher_suite().name()
            ));
        }
        let (_, tls_psk) = psk.tls_psk(&id.hostnqn, &id.subnqn);
        drop(m);
        Ok((id, tls_psk))
    }
}

// The TLS 1.3 external-PSK server hook (OpenSSL 1.1.1+, libssl), which openssl-sys does not
// declare. The handles are opaque here.
extern "C" {
    fn SSL_CTX_set_psk_find_session_callback(
        ctx: *mut c_void,
        cb: Option<
            unsafe extern "C" fn(*mut c_void, *const c_uchar, usize, *mut *mut c_void) -> c_int,
        >,
    );
}

/// What the handshake on this thread looks keys up in, and what it found.
struct Lookup {
    keys: Arc<PskStore>,
    outcome: Option<Result<Identity, String>>,
}

thread_local! {
    /// Set for the duration of a handshake on a relay thread: OpenSSL calls
    /// [`find_session`] on the thread that runs the handshake.
    static LOOKUP: RefCell<Option<Lookup>> = const { RefCell::new(None) };
}

/// OpenSSL's PSK find session callback: a TLS 1.3 session holding the TLS PSK for the
/// offered identity, or none (the handshake then fails: there is no certificate to fall back
/// on).
unsafe extern "C" fn find_session(
    ssl: *mut c_void,
    identity: *const c_uchar,
    identity_len: usize,
    sess: *mut *mut c_void,
) -> c_int {
    // SAFETY: OpenSSL passes `sess` valid for writing and `identity` valid for
    // `identity_len` bytes for the duration of this call.
    let identity = unsafe {
        *sess = std::ptr::null_mut();
        std::slice::from_raw_parts(identity, identity_len)
    };
    let found = LOOKUP.with(|l| {
        let mut l = l.borrow_mut();
        let l = l.as_mut()?;
        let r = l.keys.find(identity);
        l.outcome = Some(r.as_ref().map(|(i, _)| i.clone()).map_err(Clone::clone));
        r.ok()
    });
    let Some((identity, key)) = found else {
        return 1;
    };
    // SAFETY: `ssl` is the connection OpenSSL called us for; OpenSSL takes ownership of the
    // session written to `*sess`.
    let s = unsafe { psk_session(ssl, &key, identity.suite) };
    if s.is_null() {
        return 0;
    }
    // SAFETY: `sess` is valid for writing (above).
    unsafe { *sess = s };
    1
}

/// A TLS listener's OpenSSL context and the keys its handshakes look up.
pub(crate) struct TlsListener {
    ctx: SslContext,
    keys: Arc<PskStore>,
}

impl TlsListener {
    pub(crate) fn new(keys: Arc<PskStore>) -> Result<TlsListener, openssl::error::ErrorStack> {
        let b = tls_channel::nvme_context(SslMethod::tls_server(), NVME_SUITES)?;
        // SAFETY: the context is valid; the callback has OpenSSL's signature and uses only
        // what its arguments and this thread's LOOKUP give it.
        unsafe { SSL_CTX_set_psk_find_session_callback(b.as_ptr().cast(), Some(find_session)) };
        Ok(TlsListener {
            ctx: b.build(),
            keys,
        })
    }

    /// Run the handshake on `sock` (blocking, within `setup`); on success the plaintext end
    /// for the reactor, the identity's (host NQN, subsystem NQN), and the relay to run on
    /// this thread until either side ends.
    pub(crate) fn handshake(
        &self,
        sock: TcpStream,
        setup: Duration,
    ) -> Option<(TcpStream, (String, String), Relay)> {
        let peer = sock.peer_addr().ok();
        let _ = sock.set_read_timeout(Some(setup));
        let _ = sock.set_write_timeout(Some(setup));
        let ssl = Ssl::new(&self.ctx).ok()?;
        LOOKUP.with(|l| {
            *l.borrow_mut() = Some(Lookup {
                keys: self.keys.clone(),
                outcome: None,
            })
        });
        let r = ssl.accept(sock);
        let outcome = LOOKUP
            .with(|l| l.borrow_mut().take())
            .and_then(|l| l.outcome);
        let tls = match r {
            Ok(s) => s,
            Err(e) => {
                let why = match outcome {
                    Some(Err(why)) => why,
                    _ => e.to_string(),
                };
                info!(?peer, "nvmf TLS handshake refused: {why}");
                return None;
            }
        };
        // A handshake that completed went through find_session with a PSK it found.
        let Some(Ok(id)) = outcome else {
            return None;
        };
        debug!(
            ?peer,
            suite = id.suite.name(),
            hostnqn = id.hostnqn,
            "nvmf TLS connection established"
        );
        let (reactor_end, relay) = tls_channel::channel(tls).ok()?;
        Some((reactor_end, (id.hostnqn, id.subnqn), relay))
    }
}
