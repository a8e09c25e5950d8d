//! TLS 1.3 with a pre-shared key on NVMe/TCP listeners (NVMe/TCP Transport §3.6, from TP
//! 8011).
//!
//! A listener is TLS-only or plain, never both: a TLS listener's connections start with the
//! TLS handshake (before the ICReq), and a host that sends a plain ICReq fails it and is
//! closed; a plain listener's reactor sees a ClientHello as a PDU of no known type and ends
//! the connection.
//!
//! ```text
//!  host ══TLS records══ TCP socket ── relay thread (OpenSSL) ── socket pair ── reactor
//!                                     handshake, then decrypt ⇄ encrypt      (plain PDUs)
//! ```
//!
//! Each accepted TLS connection gets a thread that runs the handshake as the TLS server
//! (OpenSSL, TLS 1.3 only, TLS_AES_128_GCM_SHA256 and TLS_AES_256_GCM_SHA384, external PSKs
//! only: no certificates, no session tickets), then relays: records from the host are
//! decrypted into one end of a Unix socket pair, whose other end the reactors serve exactly as
//! they serve a TCP socket (reads, gathered writes, shutdown), and what the reactor writes is
//! encrypted back. The reactors stay as they are; the price is a thread and a copy per TLS
//! connection (docs/nvme-tls.md measures it). Kernel TLS (the `tls` ULP, handing the
//! handshake's keys to the socket) would remove both where the kernel has it.
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
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openssl::ssl::{ErrorCode, Ssl, SslContext, SslMethod, SslStream, SslVersion};
use tracing::{debug, info};
use zeroize::Zeroizing;

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

// The TLS 1.3 external-PSK server hook and the session calls it needs (OpenSSL 1.1.1+,
// libssl), which openssl-sys does not declare. The handles are opaque here.
extern "C" {
    fn SSL_CTX_set_psk_find_session_callback(
        ctx: *mut c_void,
        cb: Option<
            unsafe extern "C" fn(*mut c_void, *const c_uchar, usize, *mut *mut c_void) -> c_int,
        >,
    );
    fn SSL_SESSION_new() -> *mut c_void;
    fn SSL_SESSION_free(s: *mut c_void);
    fn SSL_SESSION_set1_master_key(s: *mut c_void, key: *const c_uchar, len: usize) -> c_int;
    fn SSL_SESSION_set_cipher(s: *mut c_void, cipher: *const c_void) -> c_int;
    fn SSL_SESSION_set_protocol_version(s: *mut c_void, version: c_int) -> c_int;
    fn SSL_CIPHER_find(ssl: *mut c_void, id: *const c_uchar) -> *const c_void;
}

/// TLS1_3_VERSION (ssl.h).
const TLS1_3_VERSION: c_int = 0x0304;

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
    let id = identity.suite.id();
    // SAFETY: `ssl` is the connection OpenSSL called us for; `id` is the two-byte suite
    // identifier SSL_CIPHER_find reads. The session is freed unless handed to OpenSSL, which
    // takes ownership of `*sess`; set1_master_key copies the key.
    unsafe {
        let cipher = SSL_CIPHER_find(ssl, id.as_ptr());
        if cipher.is_null() {
            return 0;
        }
        let s = SSL_SESSION_new();
        if s.is_null() {
            return 0;
        }
        if SSL_SESSION_set1_master_key(s, key.as_ptr(), key.len()) != 1
            || SSL_SESSION_set_cipher(s, cipher) != 1
            || SSL_SESSION_set_protocol_version(s, TLS1_3_VERSION) != 1
        {
            SSL_SESSION_free(s);
            return 0;
        }
        *sess = s;
    }
    1
}

/// A TLS listener's OpenSSL context and the keys its handshakes look up.
pub(crate) struct TlsListener {
    ctx: SslContext,
    keys: Arc<PskStore>,
}

impl TlsListener {
    pub(crate) fn new(keys: Arc<PskStore>) -> Result<TlsListener, openssl::error::ErrorStack> {
        let mut b = SslContext::builder(SslMethod::tls_server())?;
        b.set_min_proto_version(Some(SslVersion::TLS1_3))?;
        b.set_max_proto_version(Some(SslVersion::TLS1_3))?;
        b.set_ciphersuites("TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384")?;
        // No resumption: every connection proves the PSK afresh.
        b.set_num_tickets(0)?;
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
    ) -> Option<(TcpStream, (String, String), impl FnOnce())> {
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
        let tcp = tls.get_ref();
        if tcp.set_read_timeout(None).is_err() || tcp.set_nonblocking(true).is_err() {
            return None;
        }
        let (mine, theirs) = UnixStream::pair().ok()?;
        mine.set_nonblocking(true).ok()?;
        // The reactor reads, writes (gathered) and shuts down its end as it does a TCP
        // socket's; what it asks of TCP alone (addresses, Nagle) it does without.
        let reactor_end = TcpStream::from(OwnedFd::from(theirs));
        Some((reactor_end, (id.hostnqn, id.subnqn), move || {
            relay(tls, mine)
        }))
    }
}

/// Bytes buffered per direction.
const RELAY_BUF: usize = 256 * 1024;

/// Move bytes between the TLS connection and the reactor's end until either ends.
fn relay(mut tls: SslStream<TcpStream>, plain: UnixStream) {
    let mut inb = vec![0u8; RELAY_BUF];
    let (mut in_off, mut in_len) = (0usize, 0usize);
    let mut outb = vec![0u8; RELAY_BUF];
    let (mut out_off, mut out_len) = (0usize, 0usize);
    let (mut host_done, mut reactor_done) = (false, false);
    loop {
        let mut progress = false;
        let (mut tcp_ev, mut plain_ev) = (0i16, 0i16);
        // Host → reactor: decrypt what arrived, then hand it on.
        while in_len < inb.len() && !host_done {
            match tls.ssl_read(&mut inb[in_len..]) {
                Ok(0) => host_done = true,
                Ok(n) => {
                    in_len += n;
                    progress = true;
                }
                Err(e) if e.code() == ErrorCode::WANT_READ => {
                    tcp_ev |= libc::POLLIN;
                    break;
                }
                Err(e) if e.code() == ErrorCode::WANT_WRITE => {
                    tcp_ev |= libc::POLLOUT;
                    break;
                }
                Err(_) => host_done = true,
            }
        }
        while in_off < in_len {
            match (&plain).write(&inb[in_off..in_len]) {
                Ok(n) => {
                    in_off += n;
                    progress = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    plain_ev |= libc::POLLOUT;
                    break;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
        if in_off == in_len {
            (in_off, in_len) = (0, 0);
            if host_done {
                // The reactor sees the connection end and closes the queue.
                let _ = plain.shutdown(std::net::Shutdown::Both);
                return;
            }
        }
        // Reactor → host: take what it wrote, then encrypt it.
        while out_len < outb.len() && !reactor_done {
            match (&plain).read(&mut outb[out_len..]) {
                Ok(0) => reactor_done = true,
                Ok(n) => {
                    out_len += n;
                    progress = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    plain_ev |= libc::POLLIN;
                    break;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => reactor_done = true,
            }
        }
        while out_off < out_len {
            match tls.ssl_write(&outb[out_off..out_len]) {
                Ok(n) => {
                    out_off += n;
                    progress = true;
                }
                Err(e) if e.code() == ErrorCode::WANT_WRITE => {
                    tcp_ev |= libc::POLLOUT;
                    break;
                }
                Err(e) if e.code() == ErrorCode::WANT_READ => {
                    tcp_ev |= libc::POLLIN;
                    break;
                }
                Err(_) => {
                    let _ = plain.shutdown(std::net::Shutdown::Both);
                    return;
                }
            }
        }
        if out_off == out_len {
            (out_off, out_len) = (0, 0);
            if reactor_done {
                // The queue was closed: tell the host (close_notify), then close.
                let _ = tls.shutdown();
                return;
            }
        }
        if !progress {
            let mut fds = [
                libc::pollfd {
                    fd: tls.get_ref().as_raw_fd(),
                    events: tcp_ev,
                    revents: 0,
                },
                libc::pollfd {
                    fd: plain.as_raw_fd(),
                    events: plain_ev,
                    revents: 0,
                },
            ];
            // SAFETY: `fds` is a valid array of two pollfd for the call's duration. The
            // timeout only bounds a wait whose wake-up a state change could have missed.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
        }
    }
}
