//! The `/metrics` endpoint: a minimal HTTP/1.1 responder for Prometheus scrapes.
//!
//! One thread accepts; each scrape is answered on that thread and the connection closed
//! (Prometheus opens a new one per scrape or reuses it — `Connection: close` makes both
//! work). Requests are read with a deadline and a size cap so a client that trickles or
//! floods cannot hold the thread: it answers the next scrape after at most [`IO_TIMEOUT`].

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::Telemetry;

/// Longest a client may take to send its request or accept the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest request head accepted.
const MAX_REQUEST: usize = 8192;
/// The exposition format version Prometheus expects for text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Bind `addr` and serve `/metrics` from a thread; returns the bound address (port 0 picks a
/// free one).
pub fn serve(addr: SocketAddr, telemetry: Arc<Telemetry>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    if !bound.ip().is_loopback() {
        warn!(%bound, "metrics endpoint is reachable from other hosts: it names volumes and tenants");
    }
    info!(%bound, "serving Prometheus metrics on /metrics");
    std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => {
                        if let Err(e) = answer(s, &telemetry) {
                            debug!(error = %e, "metrics scrape failed");
                        }
                    }
                    Err(e) => {
                        warn!(error = %e, "metrics endpoint: accept failed");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })?;
    Ok(bound)
}

fn answer(mut s: TcpStream, telemetry: &Telemetry) -> std::io::Result<()> {
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_REQUEST {
            return respond(
                &mut s,
                "431 Request Header Fields Too Large",
                "text/plain",
                "",
            );
        }
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => respond(&mut s, "200 OK", CONTENT_TYPE, &telemetry.render()),
        ("GET", _) => respond(&mut s, "404 Not Found", "text/plain", "try /metrics\n"),
        _ => respond(&mut s, "405 Method Not Allowed", "text/plain", ""),
    }
}

fn respond(s: &mut TcpStream, status: &str, ctype: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    s.flush()
}

#[cfg(test)]
mod test {
    use super::*;

    fn get(addr: SocketAddr, req: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_metrics_and_refuses_the_rest() {
        let t = Arc::new(Telemetry::new());
        let _v = t.volume("v0", None);
        let addr = serve("127.0.0.1:0".parse().unwrap(), t).unwrap();
        let r = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.contains(CONTENT_TYPE));
        assert!(r.contains(r#"volume="v0""#));
        assert!(get(addr, "GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get(addr, "POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        // An oversized head is refused; the server closes with bytes unread, so the client
        // may see the reset instead of the answer. Either way the next scrape is served.
        let big = format!("GET /metrics HTTP/1.1\r\nX: {}", "a".repeat(20_000));
        let mut s = TcpStream::connect(addr).unwrap();
        let _ = s.write_all(big.as_bytes());
        let mut out = String::new();
        if s.read_to_string(&mut out).is_ok() {
            assert!(out.starts_with("HTTP/1.1 431"), "{out}");
        }
        assert!(get(addr, "GET /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200"));
    }
}
