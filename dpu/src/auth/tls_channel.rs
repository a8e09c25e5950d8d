//! The TLS 1.3 channel NVMe/TCP runs on when a PSK secures it (NVMe/TCP Transport §3.6, from
//! TP 8011), for both of nacred's roles: the target's listener (`frontend::nvmf_tcp::tls`,
//! the server) and the initiator's queues (`fabric::tcp`, the client, [`connect`]).
//!
//! ```text
//!  peer ══TLS records══ TCP socket ── relay thread (OpenSSL) ── socket pair ── reactor
//!                                     handshake, then decrypt ⇄ encrypt      (plain PDUs)
//! ```
//!
//! Both sides use OpenSSL with TLS 1.3 only, the two suites of §3.6.1.1 and external PSKs only
//! (no certificates, no session tickets). A TLS PSK reaches OpenSSL as a TLS 1.3 session
//! holding it ([`psk_session`]): the server's PSK find-session callback and the client's PSK
//! use-session callback both take one; OpenSSL's older PSK callbacks make only SHA-256
//! sessions.
//!
//! After the handshake a thread relays ([`relay`]): records from the peer are decrypted into
//! one end of a Unix socket pair, whose other end the reactors serve exactly as they serve a
//! TCP socket, and what the reactor writes is encrypted back. The reactors stay as they are;
//! the price is a thread and a copy per connection (docs/nvme-tls.md measures it). Kernel TLS
//! would remove both where the kernel has it.

use std::cell::RefCell;
use std::ffi::{c_int, c_uchar, c_void};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use openssl::ssl::{
    ErrorCode, Ssl, SslContext, SslContextBuilder, SslMethod, SslStream, SslVerifyMode, SslVersion,
};
use zeroize::Zeroizing;

use super::tls_psk::{CipherSuite, TlsPsk};

// The TLS 1.3 external-PSK hooks and the session calls they need (OpenSSL 1.1.1+, libssl),
// which openssl-sys does not declare. The handles are opaque here.
extern "C" {
    fn SSL_CTX_set_psk_use_session_callback(
        ctx: *mut c_void,
        cb: Option<
            unsafe extern "C" fn(
                *mut c_void,
                *const c_void,
                *mut *const c_uchar,
                *mut usize,
                *mut *mut c_void,
            ) -> c_int,
        >,
    );
    fn SSL_SESSION_new() -> *mut c_void;
    fn SSL_SESSION_free(s: *mut c_void);
    fn SSL_SESSION_set1_master_key(s: *mut c_void, key: *const c_uchar, len: usize) -> c_int;
    fn SSL_SESSION_set_cipher(s: *mut c_void, cipher: *const c_void) -> c_int;
    fn SSL_SESSION_set_protocol_version(s: *mut c_void, version: c_int) -> c_int;
    fn SSL_CIPHER_find(ssl: *mut c_void, id: *const c_uchar) -> *const c_void;
    fn SSL_CIPHER_get_handshake_digest(cipher: *const c_void) -> *const c_void;
}

/// TLS1_3_VERSION (ssl.h).
const TLS1_3_VERSION: c_int = 0x0304;

/// The suites NVMe/TCP allows (§3.6.1.1), in OpenSSL's TLS 1.3 cipher-suite list form.
pub(crate) const NVME_SUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384";

/// A TLS 1.3 session holding `key` as its PSK for `suite`, or null when OpenSSL has no such
/// suite or no memory. The caller owns the result (OpenSSL's PSK callbacks take it over).
///
/// # Safety
/// `ssl` must be a valid `SSL *` (the connection a PSK callback was called for).
pub(crate) unsafe fn psk_session(ssl: *mut c_void, key: &[u8], suite: CipherSuite) -> *mut c_void {
    let id = suite.id();
    // SAFETY: `ssl` is valid (the caller's contract); `id` is the two-byte suite identifier
    // SSL_CIPHER_find reads. The session is freed unless returned; set1_master_key copies
    // the key.
    unsafe {
        let cipher = SSL_CIPHER_find(ssl, id.as_ptr());
        if cipher.is_null() {
            return std::ptr::null_mut();
        }
        let s = SSL_SESSION_new();
        if s.is_null() {
            return s;
        }
        if SSL_SESSION_set1_master_key(s, key.as_ptr(), key.len()) != 1
            || SSL_SESSION_set_cipher(s, cipher) != 1
            || SSL_SESSION_set_protocol_version(s, TLS1_3_VERSION) != 1
        {
            SSL_SESSION_free(s);
            return std::ptr::null_mut();
        }
        s
    }
}

/// TLS 1.3 only, the NVMe suites, no tickets: what both roles' contexts share.
pub(crate) fn nvme_context(
    method: SslMethod,
    suites: &str,
) -> Result<SslContextBuilder, openssl::error::ErrorStack> {
    let mut b = SslContext::builder(method)?;
    b.set_min_proto_version(Some(SslVersion::TLS1_3))?;
    b.set_max_proto_version(Some(SslVersion::TLS1_3))?;
    b.set_ciphersuites(suites)?;
    // No resumption: every connection proves the PSK afresh.
    b.set_num_tickets(0)?;
    Ok(b)
}

/// What a host offers: the PSK identity (`NVMe0R0S <hostnqn> <subnqn>`), the TLS PSK derived
/// for it and its suite. Its `Debug` form shows the identity only.
#[derive(Clone)]
pub struct ClientPsk {
    identity: String,
    key: Zeroizing<Vec<u8>>,
    suite: CipherSuite,
}

impl std::fmt::Debug for ClientPsk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClientPsk({:?}, <redacted>)", self.identity)
    }
}

impl ClientPsk {
    /// The identity and TLS PSK host `hostnqn` offers subsystem `subnqn` with the configured
    /// PSK `psk`; the suite follows the key's length.
    pub fn new(psk: &TlsPsk, hostnqn: &str, subnqn: &str) -> ClientPsk {
        let (identity, key) = psk.tls_psk(hostnqn, subnqn);
        ClientPsk {
            identity,
            key,
            suite: psk.cipher_suite(),
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    pub fn suite(&self) -> CipherSuite {
        self.suite
    }
}

thread_local! {
    /// Set for the duration of a client handshake: OpenSSL calls [`use_session`] on the
    /// thread that runs it, and the identity it hands OpenSSL must live until the handshake
    /// ends.
    static OFFER: RefCell<Option<ClientPsk>> = const { RefCell::new(None) };
}

/// OpenSSL's PSK use-session callback (the client): offer the identity and a session holding
/// its TLS PSK. `md`, when set, is the hash the server's HelloRetryRequest chose: a PSK of
/// another hash is not offered then.
unsafe extern "C" fn use_session(
    ssl: *mut c_void,
    md: *const c_void,
    id: *mut *const c_uchar,
    idlen: *mut usize,
    sess: *mut *mut c_void,
) -> c_int {
    // SAFETY: OpenSSL passes `id`, `idlen` and `sess` valid for writing for this call.
    unsafe {
        *sess = std::ptr::null_mut();
        *id = std::ptr::null();
        *idlen = 0;
    }
    OFFER.with(|o| {
        let o = o.borrow();
        let Some(ClientPsk {
            identity,
            key,
            suite,
        }) = o.as_ref()
        else {
            return 1;
        };
        // SAFETY: `ssl` is the connection OpenSSL called us for.
        let s = unsafe { psk_session(ssl, key, *suite) };
        if s.is_null() {
            return 0;
        }
        if !md.is_null() {
            let sid = suite.id();
            // SAFETY: as above; the cipher is OpenSSL's static table entry.
            let matches = unsafe {
                let c = SSL_CIPHER_find(ssl, sid.as_ptr());
                !c.is_null() && SSL_CIPHER_get_handshake_digest(c) == md
            };
            if !matches {
                // SAFETY: `s` is ours, not handed to OpenSSL.
                unsafe { SSL_SESSION_free(s) };
                return 1;
            }
        }
        // SAFETY: the identity lives in OFFER until the handshake is over; OpenSSL takes
        // ownership of the session.
        unsafe {
            *id = identity.as_ptr();
            *idlen = identity.len();
            *sess = s;
        }
        1
    })
}

/// What relays a secured connection: run it on a thread of its own for as long as the
/// connection lives.
pub(crate) type Relay = Box<dyn FnOnce() + Send>;

/// The plaintext end of a secured connection, for the reactor, and its relay.
pub(crate) type Channel = (TcpStream, Relay);

/// Hand a connection whose handshake is done to a relay: the reactor's end of a socket pair,
/// and the relay to run.
pub(crate) fn channel(tls: SslStream<TcpStream>) -> std::io::Result<Channel> {
    let tcp = tls.get_ref();
    tcp.set_read_timeout(None)?;
    tcp.set_write_timeout(None)?;
    tcp.set_nonblocking(true)?;
    let (mine, theirs) = UnixStream::pair()?;
    mine.set_nonblocking(true)?;
    // The reactor reads, writes (gathered) and shuts down its end as it does a TCP socket's;
    // what it asks of TCP alone (addresses, Nagle) it does without.
    let reactor_end = TcpStream::from(OwnedFd::from(theirs));
    Ok((reactor_end, Box::new(move || relay(tls, mine))))
}

/// The host's side: run the TLS 1.3 handshake on `sock` (connected, blocking, each step within
/// `timeout`) offering `psk`, and make sure the server accepted the PSK (a server that answers
/// with a certificate instead fails: there is no CA to check it against, and a session not
/// resumed from the PSK is refused). On success the plaintext channel.
pub fn connect(sock: TcpStream, psk: &ClientPsk, timeout: Duration) -> Result<Channel, String> {
    let ctx = (|| {
        let mut b = nvme_context(SslMethod::tls_client(), psk.suite.name())?;
        b.set_verify(SslVerifyMode::PEER);
        // SAFETY: the context is valid; the callback has OpenSSL's signature and uses only
        // what its arguments and this thread's OFFER give it.
        unsafe { SSL_CTX_set_psk_use_session_callback(b.as_ptr().cast(), Some(use_session)) };
        Ok::<_, openssl::error::ErrorStack>(b.build())
    })()
    .map_err(|e| format!("TLS setup: {e}"))?;
    let ssl = Ssl::new(&ctx).map_err(|e| format!("TLS setup: {e}"))?;
    let _ = sock.set_read_timeout(Some(timeout));
    let _ = sock.set_write_timeout(Some(timeout));
    OFFER.with(|o| *o.borrow_mut() = Some(psk.clone()));
    let r = ssl.connect(sock);
    OFFER.with(|o| o.borrow_mut().take());
    let tls = r.map_err(|e| match e {
        openssl::ssl::HandshakeError::Failure(m) => match m.error().ssl_error() {
            // The peer's alert, or what OpenSSL found wrong: its reason text, without the
            // source locations of the full error stack.
            Some(stack) => format!(
                "TLS handshake refused: {}",
                stack
                    .errors()
                    .iter()
                    .find_map(|e| e.reason())
                    .unwrap_or("no reason given")
            ),
            None => format!("TLS handshake failed: {}", m.error()),
        },
        openssl::ssl::HandshakeError::WouldBlock(_) => "TLS handshake timed out".to_string(),
        openssl::ssl::HandshakeError::SetupFailure(e) => format!("TLS setup: {e}"),
    })?;
    if !tls.ssl().session_reused() {
        return Err("TLS handshake did not use the PSK".into());
    }
    channel(tls).map_err(|e| format!("TLS channel: {e}"))
}

/// Bytes buffered per direction.
const RELAY_BUF: usize = 256 * 1024;

/// Move bytes between the TLS connection and the reactor's end until either ends.
fn relay(mut tls: SslStream<TcpStream>, plain: UnixStream) {
    let mut inb = vec![0u8; RELAY_BUF];
    let (mut in_off, mut in_len) = (0usize, 0usize);
    let mut outb = vec![0u8; RELAY_BUF];
    let (mut out_off, mut out_len) = (0usize, 0usize);
    let (mut peer_done, mut reactor_done) = (false, false);
    loop {
        let mut progress = false;
        let (mut tcp_ev, mut plain_ev) = (0i16, 0i16);
        // Peer → reactor: decrypt what arrived, then hand it on.
        while in_len < inb.len() && !peer_done {
            match tls.ssl_read(&mut inb[in_len..]) {
                Ok(0) => peer_done = true,
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
                Err(_) => peer_done = true,
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
            if peer_done {
                // The reactor sees the connection end and closes the queue.
                let _ = plain.shutdown(std::net::Shutdown::Both);
                return;
            }
        }
        // Reactor → peer: take what it wrote, then encrypt it.
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
                // The queue was closed: tell the peer (close_notify), then close.
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
