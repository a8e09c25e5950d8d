//! nacred's /metrics scraped by a real Prometheus server (Debian's `prometheus`, started here on
//! loopback with a free port and a temporary storage directory): Prometheus counts exactly the
//! requests the client completed, and the latency quantiles it computes with
//! `histogram_quantile` agree with the client's own measurement of the same run within the
//! bound the histogram's buckets allow (derived at [`assert_quantile`]).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nacre_tests::daemon::Nacred;
use nacre_tests::load::Load;
use serde_json::{json, Value};

/// Ratio between neighbouring latency bucket bounds (nacre_dpu::telemetry::latency_buckets).
const BUCKET_RATIO: f64 = 1.2599210498948732; // 2^(1/3)

/// What the client sees beyond what nacred measures: the vhost-user round trip outside the
/// volume (virtqueue kick, nacred's queue thread picking the request up, the used-ring update
/// and the call eventfd back). Generous for a loaded 2-core machine; the quantiles compared here
/// are tens of milliseconds of QoS wait, so it is small beside them.
const TRANSPORT_ALLOWANCE: Duration = Duration::from_millis(5);

fn prometheus_binary() -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("prometheus"))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!("prometheus not found in PATH: `scripts/setup --test` installs it (Debian package prometheus)")
    })
}

/// A Prometheus server for the test; killed on drop.
struct Prometheus {
    child: Child,
    addr: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Start Prometheus scraping `target` (host:port) every second.
    fn start(target: &str) -> Prometheus {
        let bin = prometheus_binary();
        let dir = tempfile::Builder::new()
            .prefix("nacre-prom-")
            .tempdir()
            .unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: nacre\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let log = dir.path().join("prometheus.log");
        // A free port: another test may take it between here and Prometheus binding it, so a
        // start that exits early is retried with a new one.
        for _ in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let addr = format!("127.0.0.1:{port}");
            let out = std::fs::File::create(&log).unwrap();
            let child = Command::new(&bin)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=warn")
                .stdin(Stdio::null())
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
            let mut p = Prometheus {
                child,
                addr,
                log: log.clone(),
                _dir: tempfile::tempdir().unwrap(),
            };
            if p.wait_ready() {
                p._dir = dir;
                return p;
            }
        }
        panic!(
            "prometheus did not become ready:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if self.child.try_wait().unwrap().is_some() {
                return false;
            }
            if get(&self.addr, "/-/ready").is_ok_and(|(code, _)| code == 200) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// An instant query; the single sample's value (None: empty result).
    fn query(&self, promql: &str) -> Option<f64> {
        let (code, body) = get(
            &self.addr,
            &format!("/api/v1/query?query={}", encode(promql)),
        )
        .unwrap_or_else(|e| panic!("query {promql}: {e}"));
        let v: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("query {promql}: HTTP {code}, {e}: {body}"));
        assert_eq!(v["status"], "success", "{promql}: {v}");
        let result = v["data"]["result"].as_array().expect("vector result");
        assert!(result.len() <= 1, "{promql}: more than one series: {v}");
        result
            .first()
            .map(|s| s["value"][1].as_str().unwrap().parse::<f64>().unwrap())
    }

    /// An instant query's whole result vector.
    fn query_all(&self, promql: &str) -> Vec<Value> {
        let (code, body) = get(
            &self.addr,
            &format!("/api/v1/query?query={}", encode(promql)),
        )
        .unwrap_or_else(|e| panic!("query {promql}: {e}"));
        let v: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("query {promql}: HTTP {code}, {e}: {body}"));
        assert_eq!(v["status"], "success", "{promql}: {v}");
        v["data"]["result"]
            .as_array()
            .expect("vector result")
            .clone()
    }

    /// Poll `promql` until `ok` holds for its value.
    fn wait_for(&self, promql: &str, what: &str, ok: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let v = self.query(promql);
            if let Some(v) = v.filter(|v| ok(*v)) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: {promql} = {v:?} after 30 s\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

/// Percent-encode a query string value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A plain HTTP/1.0 GET: (status, body).
fn get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, body.to_string()))
}

/// The bound, for a quantile q of the same set of requests:
///
/// * Per request, nacred's latency s (arrival at the volume → completion) and the client's c
///   satisfy s ≤ c ≤ s + δ (δ = [`TRANSPORT_ALLOWANCE`]), so the quantiles do too:
///   S_q ≤ C_q ≤ S_q + δ.
/// * `histogram_quantile` finds the bucket (lo, hi] in which rank q·N falls and interpolates
///   inside it; the true S_q (nearest rank ⌈q·N⌉) lies in that same bucket, and hi/lo = r =
///   2^(1/3). So S_q/r < P ≤ r·S_q.
///
/// Together: (C_q − δ)/r < P ≤ r·C_q.
fn assert_quantile(q: f64, prom: f64, client: Duration) {
    let c = client.as_secs_f64();
    let lo = (c - TRANSPORT_ALLOWANCE.as_secs_f64()) / BUCKET_RATIO;
    let hi = c * BUCKET_RATIO;
    assert!(
        prom > lo && prom <= hi,
        "p{}: Prometheus {:.3} ms, client {:.3} ms: outside ({:.3}, {:.3}] ms",
        q * 100.0,
        prom * 1e3,
        c * 1e3,
        lo * 1e3,
        hi * 1e3
    );
    eprintln!(
        "p{}: Prometheus {:.3} ms, client {:.3} ms (bound ({:.3}, {:.3}] ms)",
        q * 100.0,
        prom * 1e3,
        c * 1e3,
        lo * 1e3,
        hi * 1e3
    );
}

fn socket_of(n: &Nacred, volume: &str) -> PathBuf {
    n.ok(
        "volume_create",
        json!({"name": volume, "size": 1u64 << 30, "backend": "null"}),
    );
    let d = n.ok(
        "vhost_blk_create",
        json!({"name": format!("{volume}-dev"), "volume": volume}),
    );
    Path::new(d["socket"].as_str().unwrap()).to_path_buf()
}

#[test]
fn prometheus_scrapes_nacred_and_its_quantiles_match_the_client() {
    let n = Nacred::start_args(&["--no-default", "--metrics-listen", "127.0.0.1:0"]);
    let target = n.ok("metrics_endpoint", json!({}))["listen"]
        .as_str()
        .expect("metrics endpoint is on")
        .to_string();
    assert!(target.starts_with("127.0.0.1:"), "{target}");
    let sock = socket_of(&n, "vp");
    let prom = Prometheus::start(&target);
    prom.wait_for(r#"up{job="nacre"}"#, "nacred scraped", |v| v == 1.0);

    // Two phases at different QoS rates give two latency levels (QD32 at 1000/s waits ~32 ms,
    // at 250/s ~128 ms): p50 falls in the first, p99 in the second.
    n.ok("qos_set", json!({"volume": "vp", "limits": {"iops": 1000}}));
    let load = Load::start(&sock, 32);
    std::thread::sleep(Duration::from_millis(2500));
    n.ok("qos_set", json!({"volume": "vp", "limits": {"iops": 250}}));
    std::thread::sleep(Duration::from_millis(1500));
    let trace = load.finish();
    let total = trace.latency.len() as f64;

    // Every request the client completed, counted once, and nothing else.
    let count_q = r#"sum(nacre_volume_latency_seconds_count{volume="vp"})"#;
    prom.wait_for(count_q, "all requests scraped", |v| v == total);
    let ops = prom.query(r#"sum(nacre_volume_ops_total{volume="vp",op="read"})"#);
    assert_eq!(ops, Some(total));

    for q in [0.5, 0.99] {
        let promql = format!(
            r#"histogram_quantile({q}, sum by (le) (nacre_volume_latency_seconds_bucket{{volume="vp"}}))"#
        );
        let p = prom.query(&promql).expect("a quantile");
        assert_quantile(q, p, trace.quantile(q));
    }
}

/// Every query of the Grafana dashboard in scripts/grafana, with its variables set to "all",
/// is valid PromQL to this Prometheus and finds series from a running nacred.
#[test]
fn grafana_dashboard_queries_work_against_prometheus() {
    let n = Nacred::start_args(&["--no-default", "--metrics-listen", "127.0.0.1:0"]);
    let target = n.ok("metrics_endpoint", json!({}))["listen"]
        .as_str()
        .expect("metrics endpoint is on")
        .to_string();
    let sock = socket_of(&n, "vg");
    // The same volume as an NVMe-oF namespace too: a second device of it.
    let nqn = "nqn.2024-01.io.nacre:grafana";
    n.ok(
        "nvmf_subsystem_create",
        json!({"nqn": nqn, "allow_any_host": true}),
    );
    n.ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": nqn, "volume": "vg", "nsid": 3}),
    );
    // And a remote controller (a path to remote storage): nacred's own NVMe/TCP target on
    // loopback stands in for a storage shelf.
    let l = n.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": nqn, "address": "127.0.0.1", "port": 0}),
    );
    let r = n.ok(
        "remote_attach",
        json!({"name": "shelf", "address": "127.0.0.1", "port": l["port"], "subnqn": nqn}),
    );
    assert_eq!(r["state"], "live", "{r}");
    let prom = Prometheus::start(&target);
    n.ok("qos_set", json!({"volume": "vg", "limits": {"iops": 2000}}));
    let load = Load::start(&sock, 8);
    // Enough scrapes for rate() over the dashboard's window.
    prom.wait_for(
        r#"count_over_time(nacre_volume_queue_depth{volume="vg"}[1m])"#,
        "five scrapes",
        |v| v >= 5.0,
    );
    load.finish();
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(
            nacre_tests::testbed::repo_root().join("scripts/grafana/nacre-dashboard.json"),
        )
        .unwrap(),
    )
    .unwrap();
    // What nacred declares (# TYPE lines), samples or not.
    let (_, text) = get(&target, "/metrics").unwrap();
    let declared: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let mut checked = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            let expr = t["expr"]
                .as_str()
                .unwrap()
                .replace("$tenant", ".*")
                .replace("$volume", ".*")
                .replace("$__rate_interval", "1m");
            let names: Vec<&str> = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("nacre_"))
                .collect();
            for n in &names {
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| n.strip_suffix(s).filter(|b| declared.contains(b)))
                    .unwrap_or(n);
                assert!(
                    declared.contains(&base),
                    "{expr}: nacred does not export {n}"
                );
            }
            let result = prom.query_all(&expr);
            assert!(
                !result.is_empty(),
                "panel {}: {expr} found nothing",
                panel["title"]
            );
            checked += 1;
        }
    }
    assert!(checked >= 12, "{checked} queries");
    // The remote is one live path, connected once.
    assert_eq!(
        prom.query(r#"nacre_remote_path_state{remote="shelf",state="live"}"#),
        Some(1.0)
    );
    assert_eq!(
        prom.query(r#"sum(nacre_remote_path_state{remote="shelf"})"#),
        Some(1.0)
    );
    assert_eq!(
        prom.query(r#"nacre_remote_connects_total{remote="shelf"}"#),
        Some(1.0)
    );
    // Over NVMe/TCP nothing is copied through transport buffers, nothing moved by RDMA.
    assert_eq!(
        prom.query(r#"nacre_remote_bounce_copy_bytes_total{remote="shelf"}"#),
        Some(0.0)
    );
    assert_eq!(
        prom.query(r#"nacre_remote_direct_bytes_total{remote="shelf"}"#),
        Some(0.0)
    );
    // The device series name the volume they serve, and the limit set above is exported.
    assert_eq!(
        prom.query(r#"nacre_device_info{device="vg-dev",kind="vhost-blk",volume="vg"}"#),
        Some(1.0)
    );
    assert_eq!(
        prom.query(&format!(
            r#"nacre_device_info{{device="{nqn}/3",kind="nvmf",volume="vg"}}"#
        )),
        Some(1.0)
    );
    assert_eq!(
        prom.query(r#"nacre_qos_limit{kind="volume",name="vg",rate="iops"}"#),
        Some(2000.0)
    );
}
