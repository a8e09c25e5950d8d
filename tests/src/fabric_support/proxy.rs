//! [`Proxy`]: a TCP forwarder a test can sever, restore and stall, or have it flip bits.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const PASS: u8 = 0;
const SEVER: u8 = 1;
const STALL: u8 = 2;

/// A TCP forwarder to `upstream` that can be cut.
pub struct Proxy {
    pub addr: SocketAddr,
    mode: Arc<AtomicU8>,
    /// Flip one bit in about one of this many bytes flowing from the target (0: never).
    corrupt_one_in: Arc<AtomicU64>,
    /// The same for bytes flowing to the target.
    corrupt_up_one_in: Arc<AtomicU64>,
    /// Bits flipped so far.
    pub flipped: Arc<AtomicU64>,
    socks: Arc<Mutex<Vec<TcpStream>>>,
    stop: Arc<AtomicBool>,
    pub accepted: Arc<AtomicU64>,
}

impl Proxy {
    pub fn start(upstream: SocketAddr) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let mode = Arc::new(AtomicU8::new(PASS));
        let socks = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicU64::new(0));
        let corrupt_one_in = Arc::new(AtomicU64::new(0));
        let corrupt_up_one_in = Arc::new(AtomicU64::new(0));
        let flipped = Arc::new(AtomicU64::new(0));
        let (m, so, sp, acc) = (mode.clone(), socks.clone(), stop.clone(), accepted.clone());
        let (co, cu, fl) = (
            corrupt_one_in.clone(),
            corrupt_up_one_in.clone(),
            flipped.clone(),
        );
        std::thread::spawn(move || {
            while !sp.load(Ordering::Acquire) {
                let (down, _) = match l.accept() {
                    Ok(x) => x,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                };
                down.set_nonblocking(false).unwrap();
                if m.load(Ordering::Acquire) == SEVER {
                    let _ = down.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(up) = TcpStream::connect(upstream) else {
                    let _ = down.shutdown(Shutdown::Both);
                    continue;
                };
                acc.fetch_add(1, Ordering::Relaxed);
                let _ = up.set_nodelay(true);
                let _ = down.set_nodelay(true);
                {
                    let mut g = so.lock().unwrap();
                    g.push(down.try_clone().unwrap());
                    g.push(up.try_clone().unwrap());
                }
                let n = acc.load(Ordering::Relaxed);
                for (a, b, corrupt) in [
                    (
                        down.try_clone().unwrap(),
                        up.try_clone().unwrap(),
                        Some((cu.clone(), fl.clone(), n ^ 0xff)),
                    ),
                    (up, down, Some((co.clone(), fl.clone(), n))),
                ] {
                    let m = m.clone();
                    std::thread::spawn(move || pump(a, b, m, corrupt));
                }
            }
        });
        Proxy {
            addr,
            mode,
            corrupt_one_in,
            corrupt_up_one_in,
            flipped,
            socks,
            stop,
            accepted,
        }
    }

    /// Flip a random bit in about one of `one_in` bytes the target sends (0 stops it), on
    /// connections open now and later: a flaky link or NIC that the digests must catch.
    pub fn corrupt(&self, one_in: u64) {
        self.corrupt_one_in.store(one_in, Ordering::Release);
    }

    /// [`Proxy::corrupt`] for the bytes the host sends to the target.
    pub fn corrupt_upstream(&self, one_in: u64) {
        self.corrupt_up_one_in.store(one_in, Ordering::Release);
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Cut every connection and refuse new ones until [`Proxy::restore`].
    pub fn sever(&self) {
        self.mode.store(SEVER, Ordering::Release);
        for s in self.socks.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Let connections through again.
    pub fn restore(&self) {
        self.mode.store(PASS, Ordering::Release);
    }

    /// Stop forwarding bytes (connections stay open): a target that stalls. Returns once
    /// the pumps have noticed (they poll every 20 ms), so nothing sent afterwards gets through.
    pub fn stall(&self) {
        self.mode.store(STALL, Ordering::Release);
        std::thread::sleep(Duration::from_millis(60));
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.sever();
    }
}

/// (one-in rate, flip counter, seed) for a pump that corrupts.
type Corrupt = Option<(Arc<AtomicU64>, Arc<AtomicU64>, u64)>;

fn pump(mut from: TcpStream, mut to: TcpStream, mode: Arc<AtomicU8>, corrupt: Corrupt) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(20)));
    let mut buf = vec![0u8; 64 << 10];
    let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ corrupt.as_ref().map_or(0, |c| c.2 << 32);
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    loop {
        match mode.load(Ordering::Acquire) {
            SEVER => break,
            STALL => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            _ => {}
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if let Some((one_in, flipped, _)) = &corrupt {
                    let k = one_in.load(Ordering::Acquire);
                    if k > 0 {
                        for b in &mut buf[..n] {
                            if next() % k == 0 {
                                *b ^= 1 << (next() % 8);
                                flipped.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
                if mode.load(Ordering::Acquire) == SEVER || to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
