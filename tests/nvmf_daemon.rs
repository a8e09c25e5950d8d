//! The real nacred serving NVMe-oF/TCP: subsystems, namespaces, listeners and hosts made
//! over RPC and the CLI, driven by the user-space host, persisted and replayed on restart.

use std::net::SocketAddr;

use nacre_shared::nvme::identify::nidt;
use nacre_shared::nvme::{io_opcode, Command, SglDescriptor, Status};
use nacre_tests::daemon::Nacred;
use nacre_tests::nvmf_host::{HostError, HostOptions, NvmfHost};
use serde_json::json;

const NQN: &str = "nqn.2024-01.io.nacre:daemon";

fn setup(n: &Nacred) -> SocketAddr {
    n.ok(
        "volume_create",
        json!({"name": "nv", "size": 16 << 20, "block_size": 4096}),
    );
    let s = n.ok(
        "nvmf_subsystem_create",
        json!({"nqn": NQN, "serial": "NACRE-D1", "model": "nacre daemon"}),
    );
    assert_eq!(s["serial"], "NACRE-D1");
    let ns = n.ok("nvmf_subsystem_add_ns", json!({"nqn": NQN, "volume": "nv"}));
    assert_eq!(ns["nsid"], 1);
    let l = n.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "address": "127.0.0.1", "port": 0}),
    );
    let port = l["port"].as_u64().unwrap() as u16;
    assert_ne!(port, 0);
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[test]
fn rpc_made_subsystem_serves_io_and_survives_restart() {
    let mut n = Nacred::start();
    let addr = setup(&n);
    // Not allowed yet: Connect Invalid Host.
    let r = NvmfHost::connect(addr, NQN, HostOptions::default());
    assert!(matches!(
        r,
        Err(HostError::Nvme(Status::CONNECT_INVALID_HOST, _))
    ));
    n.ok(
        "nvmf_subsystem_add_host",
        json!({"nqn": NQN, "host": HostOptions::default().hostnqn}),
    );
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
    let nguid = {
        let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
        assert_eq!(h.id.serial, "NACRE-D1");
        assert_eq!(h.id.model, "nacre daemon");
        h.write(0, 1, 10, &data, 4096).unwrap();
        h.flush(0, 1).unwrap();
        let d = h.ns_descriptors(1).unwrap();
        d.into_iter().find(|d| d.nidt == nidt::NGUID).unwrap().nid
    };
    // The volume cannot be deleted while exported.
    let (code, msg) = n.err("volume_delete", json!({"name": "nv"}));
    assert_ne!(code, 0);
    assert!(msg.contains("nvmf:"), "{msg}");

    let subs = n.ok("nvmf_get_subsystems", json!({}));
    let ours = subs
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == NQN)
        .unwrap();
    assert_eq!(ours["namespaces"][0]["name"], "nv");
    assert_eq!(ours["listeners"][0], addr.to_string());

    // Restart: the same port, the same namespace identity, the data.
    n.restart();
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    assert_eq!(h.read(0, 1, 10, 2, 4096).unwrap(), data);
    let d = h.ns_descriptors(1).unwrap();
    assert_eq!(
        d.into_iter().find(|d| d.nidt == nidt::NGUID).unwrap().nid,
        nguid
    );
    // Removing the namespace and the subsystem is persisted too.
    n.ok("nvmf_subsystem_remove_ns", json!({"nqn": NQN, "nsid": 1}));
    assert_eq!(h.active_namespaces().unwrap(), Vec::<u32>::new());
    n.ok("nvmf_subsystem_delete", json!({"nqn": NQN}));
    n.restart();
    let subs = n.ok("nvmf_get_subsystems", json!({}));
    let nqns: Vec<&str> = subs
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["nqn"].as_str().unwrap())
        .collect();
    assert_eq!(
        nqns,
        [
            "nqn.2014-08.org.nvmexpress.discovery",
            "nqn.2014-08.io.nacre:default"
        ],
        "only discovery and the embedded default: {subs}"
    );
    n.ok("volume_delete", json!({"name": "nv"}));
}

#[test]
fn bad_requests_are_clear_errors() {
    let n = Nacred::start();
    let (_, m) = n.err("nvmf_subsystem_create", json!({"nqn": "iqn.bad"}));
    assert!(m.contains("nqn."), "{m}");
    n.ok("nvmf_subsystem_create", json!({"nqn": NQN}));
    let (_, m) = n.err("nvmf_subsystem_create", json!({"nqn": NQN}));
    assert!(m.contains("already exists"), "{m}");
    let (_, m) = n.err(
        "nvmf_subsystem_add_ns",
        json!({"nqn": NQN, "volume": "missing"}),
    );
    assert!(m.contains("does not exist"), "{m}");
    let (_, m) = n.err(
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "address": "localhost"}),
    );
    assert!(m.contains("not an IPv4 or IPv6"), "{m}");
    let (_, m) = n.err(
        "nvmf_subsystem_create",
        json!({"nqn": "nqn.2024-01.io.nacre:x", "serial": "X".repeat(21)}),
    );
    assert!(m.contains("serial"), "{m}");
    let (_, m) = n.err(
        "nvmf_subsystem_delete",
        json!({"nqn": "nqn.2024-01.io.nacre:nope"}),
    );
    assert!(m.contains("does not exist"), "{m}");
    let (_, m) = n.err("nvmf_subsystem_create", json!({"nqn": NQN, "typo": 1}));
    assert!(m.contains("typo"), "{m}");
}

#[test]
fn cli_manages_subsystems() {
    let n = Nacred::start();
    n.ok(
        "volume_create",
        json!({"name": "c", "size": 1 << 20, "block_size": 512, "backend": "ram"}),
    );
    let ok = |args: &[&str]| {
        let o = n.cli(args);
        assert!(
            o.status.success(),
            "nacre {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    ok(&["nvmf", "create", NQN, "--allow-any-host"]);
    let out = ok(&["nvmf", "add-ns", NQN, "--volume", "c", "--nsid", "7"]);
    assert!(out.contains("namespace 7"), "{out}");
    let out = ok(&[
        "nvmf",
        "add-listener",
        NQN,
        "--address",
        "127.0.0.1",
        "--port",
        "0",
    ]);
    let port: u16 = out.trim().rsplit(':').next().unwrap().parse().unwrap();
    let list = ok(&["nvmf", "list"]);
    assert!(list.contains(NQN) && list.contains("7:c"), "{list}");
    let mut h = NvmfHost::connect(
        SocketAddr::from(([127, 0, 0, 1], port)),
        NQN,
        HostOptions::default(),
    )
    .unwrap();
    assert_eq!(h.active_namespaces().unwrap(), vec![7]);
    let o = n.cli(&["nvmf", "remove-ns", NQN, "8"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("does not exist"));
}

/// Hosts that connect (admin and two I/O queues), do I/O and go away, over and over (an
/// initiator's reconnect loop, `nvme connect`/`disconnect` in a job script), must leave no
/// socket, thread or controller behind in nacred; half of them vanish without a
/// Disconnect-style goodbye (the socket just closes mid-session).
#[test]
fn reconnecting_hosts_leak_no_descriptors_or_threads() {
    let n = Nacred::start_args(&["--no-default"]);
    let addr = setup(&n);
    n.ok(
        "nvmf_subsystem_add_host",
        json!({"nqn": NQN, "host": HostOptions::default().hostnqn}),
    );
    let opts = || HostOptions {
        io_queues: 2,
        ..Default::default()
    };
    let cycle = |round: u32| {
        let mut h = NvmfHost::connect(addr, NQN, opts())
            .unwrap_or_else(|e| panic!("connect {round}: {e}\n{}", n.log_text()));
        let data = vec![round as u8; 4096];
        h.write((round % 2) as usize, 1, u64::from(round), &data, 4096)
            .unwrap();
        assert_eq!(h.read(0, 1, u64::from(round), 1, 4096).unwrap(), data);
        if round % 2 == 0 {
            // leave a command outstanding on the way out
            let cmd = nacre_shared::nvme::Command::default();
            let _ = h.io[1].submit(cmd, &[], 0);
            let _ = h.io[1].flush();
        }
    };
    cycle(0);
    let before = n.settled_footprint(|| true);
    const ROUNDS: u32 = 30;
    for round in 1..=ROUNDS {
        cycle(round);
    }
    let after = n.footprint_back_to(before, || true);
    after.assert_no_more_than(before, ROUNDS as usize, "host sessions");
}

/// NVMe/RDMA listeners on a machine where they cannot work (this one has no RDMA device; on a
/// machine with one, 127.0.0.1 belongs to none): one clear, one-line error naming the address,
/// nothing persisted, and the subsystem keeps serving NVMe/TCP. A transport nacre does not
/// serve is an invalid parameter. Also: the subsystem's TCP controller does not claim keyed SGL
/// support, which only the RDMA transport has.
#[test]
fn rdma_listener_without_a_device_is_one_clear_error() {
    let n = Nacred::start();
    let addr = setup(&n);
    n.ok(
        "nvmf_subsystem_add_host",
        json!({"nqn": NQN, "host": HostOptions::default().hostnqn}),
    );
    let (code, m) = n.err(
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "address": "127.0.0.1", "port": 4420, "transport": "rdma"}),
    );
    assert_eq!(code, -32004, "{m}");
    assert!(
        m.starts_with("cannot listen for NVMe/RDMA on 127.0.0.1:4420: "),
        "{m}"
    );
    assert!(!m.contains('\n'), "{m}");
    let (code, m) = n.err(
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "address": "127.0.0.1", "transport": "fc"}),
    );
    assert_eq!(code, -32602, "{m}");
    assert!(m.contains("\"fc\""), "{m}");
    let (_, m) = n.err(
        "nvmf_subsystem_remove_listener",
        json!({"nqn": NQN, "address": "127.0.0.1", "port": 4420, "transport": "rdma"}),
    );
    assert!(
        m.contains("does not exist") || m.contains("not found"),
        "{m}"
    );
    let subs = n.ok("nvmf_get_subsystems", json!({}));
    let sub = subs
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == NQN)
        .expect("subsystem listed");
    let listeners: Vec<&str> = sub["listeners"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l.as_str())
        .collect();
    assert_eq!(listeners, [addr.to_string()], "{sub}");
    // NVMe/TCP still serves the subsystem.
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).expect("connect over TCP");
    let id = h.identify_controller().expect("identify");
    assert_eq!(id.serial, "NACRE-D1");
    assert_eq!(
        id.sgls & nacre_shared::nvme::identify::SGLS_KEYED,
        0,
        "a TCP controller must not claim keyed SGLs"
    );
}

/// A persisted NVMe/RDMA listener that cannot listen at start (no RDMA device here; or none with
/// 127.0.0.1) is one `NOT listening` line at start-up and `failed` with its reason in
/// `nvmf_get_subsystems` (retried in the background, which adds no log lines); the
/// subsystem's NVMe/TCP listener and everything else come up.
#[test]
fn persisted_rdma_listener_without_a_device_fails_alone_at_start() {
    let mut n = Nacred::start();
    let addr = setup(&n);
    n.ok(
        "nvmf_subsystem_add_host",
        json!({"nqn": NQN, "host": HostOptions::default().hostnqn}),
    );
    assert!(n.stop(), "nacred did not stop:\n{}", n.log_text());
    n.edit_state(|state| {
        state["nvmf"]["subsystems"][NQN]["rdma_listeners"] = json!(["127.0.0.1:4420"]);
    });
    n.spawn_again();
    let subs = n.ok("nvmf_get_subsystems", json!({}));
    let sub = subs
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == NQN)
        .expect("subsystem replayed")
        .clone();
    let states = sub["listener_states"].as_array().unwrap();
    let rdma = states
        .iter()
        .find(|l| l["address"] == "rdma:127.0.0.1:4420")
        .unwrap_or_else(|| panic!("no RDMA listener state: {sub}"));
    assert_eq!(rdma["state"], "failed", "{sub}");
    assert!(
        rdma["reason"]
            .as_str()
            .unwrap()
            .starts_with("cannot listen for NVMe/RDMA on 127.0.0.1:4420: "),
        "{sub}"
    );
    // Retried in the background, as a TCP listener whose port was taken (an RDMA device may
    // come up after nacred; tests/testbed.rs::nvme_rdma_against_nacred sees one do so).
    assert!(
        rdma["reason"].as_str().unwrap().ends_with("; retrying"),
        "{sub}"
    );
    let tcp = states
        .iter()
        .find(|l| l["address"] == addr.to_string())
        .unwrap_or_else(|| panic!("no TCP listener state: {sub}"));
    assert_eq!(tcp["state"], "listening", "{sub}");
    let log = n.log_text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("NVMe/RDMA subsystem") && l.contains("NOT listening"))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).expect("TCP after replay");
    assert_eq!(h.identify_controller().unwrap().serial, "NACRE-D1");
    // Removing the failed listener works and is persisted.
    n.ok(
        "nvmf_subsystem_remove_listener",
        json!({"nqn": NQN, "address": "127.0.0.1", "port": 4420, "transport": "rdma"}),
    );
    n.restart();
    let subs = n.ok("nvmf_get_subsystems", json!({}));
    assert!(!subs.to_string().contains("rdma:"), "{subs}");
}

/// A connected host on `setup`'s subsystem, its I/O queue's replies awaited at most 20 s (a
/// reply the target never sends fails the test instead of hanging it).
fn host(n: &Nacred, addr: SocketAddr) -> NvmfHost {
    n.ok(
        "nvmf_subsystem_allow_any_host",
        json!({"nqn": NQN, "allow_any_host": true}),
    );
    let h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    h.io[0]
        .socket()
        .set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    h
}

/// `reads` one-block reads sent in one write, all awaited.
fn burst(h: &mut NvmfHost, reads: u64) {
    let cids: Vec<u16> = (0..reads)
        .map(|lba| {
            let cmd = Command::rw(io_opcode::READ, 0, 1, lba, 1, SglDescriptor::default());
            h.io[0].submit(cmd, &[], 4096)
        })
        .collect();
    h.io[0].flush().unwrap();
    for c in cids {
        h.io[0].wait(c).unwrap().ok().unwrap();
    }
}

/// `bursts` rounds of 16 reads sent in one write (a deep host), each round awaited whole.
/// 16 replies of 4 KiB are few enough bytes for the target to hold them back a pass.
fn deep_bursts(h: &mut NvmfHost, bursts: usize) {
    for _ in 0..bursts {
        burst(h, 16);
    }
}

/// `nvmf_get_stats` summed over the reactors.
struct Totals {
    policy: String,
    reactors: u64,
    busy_passes: u64,
    idle_polls: u64,
    sleeps: u64,
    deep_sleeps: u64,
}

fn reactor_totals(n: &Nacred) -> Totals {
    reactor_totals_once(n, |_| true)
}

/// The totals once `done` holds of them, or whatever they are after 10 s: counts are
/// published when a reactor sleeps or every 10 ms of its passes, and a reactor a loaded
/// machine holds off its core publishes late.
fn reactor_totals_once(n: &Nacred, done: impl Fn(&Totals) -> bool) -> Totals {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        // Let the reactors go idle (and so publish) after what the test sent.
        std::thread::sleep(std::time::Duration::from_millis(100));
        let t = reactor_totals_now(n);
        if done(&t) || std::time::Instant::now() > deadline {
            return t;
        }
    }
}

fn reactor_totals_now(n: &Nacred) -> Totals {
    let s = n.ok("nvmf_get_stats", json!({}));
    let r = s["reactors"].as_array().unwrap();
    assert!(!r.is_empty(), "{s}");
    let sum = |k: &str| r.iter().map(|x| x[k].as_u64().unwrap()).sum::<u64>();
    Totals {
        policy: s["poll"].as_str().unwrap().to_string(),
        reactors: r.len() as u64,
        busy_passes: sum("busy_passes"),
        idle_polls: sum("idle_polls"),
        sleeps: sum("sleeps"),
        deep_sleeps: sum("deep_sleeps"),
    }
}

/// The default poll policy: a host waiting on each reply is answered by a polling reactor
/// (no deep sleeps), one keeping 16 commands in flight lets it sleep at once after each
/// flush instead of burning its core.
#[test]
fn adaptive_poll_sleeps_for_deep_hosts_only() {
    let n = Nacred::start();
    let addr = setup(&n);
    let mut h = host(&n, addr);
    for lba in 0..200 {
        h.read(0, 1, lba % 64, 1, 4096).unwrap();
    }
    let t = reactor_totals_once(&n, |t| t.busy_passes >= 200);
    assert_eq!(t.policy, "adaptive");
    assert!(
        t.busy_passes >= 200,
        "{} busy passes for 200 reads",
        t.busy_passes
    );
    assert_eq!(
        t.deep_sleeps, 0,
        "QD1 reads must not put the reactor to sleep early"
    );
    deep_bursts(&mut h, 20);
    let t = reactor_totals_once(&n, |t| t.deep_sleeps >= 10);
    assert!(
        t.deep_sleeps >= 10,
        "{} deep sleeps after 20 flushes of 16 replies",
        t.deep_sleeps
    );
    // The CLI's table: the policy, a header, then one row per reactor ending in its deep
    // sleeps.
    let o = n.cli(&["nvmf", "stats"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("poll policy: adaptive"), "{out}");
    assert!(lines.next().unwrap().contains("DEEP SLEEPS"), "{out}");
    let deep: u64 = lines
        .map(|l| l.split_whitespace().last().unwrap().parse::<u64>().unwrap())
        .sum();
    assert!(deep >= t.deep_sleeps, "{out}");
}

/// `--nvmf-poll always` keeps polling at any depth.
#[test]
fn poll_always_never_sleeps_for_depth() {
    let n = Nacred::start_args(&["--nvmf-poll", "always"]);
    let addr = setup(&n);
    let mut h = host(&n, addr);
    deep_bursts(&mut h, 20);
    let t = reactor_totals(&n);
    assert_eq!(t.policy, "always");
    assert_eq!(t.deep_sleeps, 0);
}

/// `--nvmf-poll off`: the reactor sleeps whenever idle, yet replies it holds back to coalesce
/// them (a pass that brought several commands) still go out at the end of the next pass,
/// not when some later event happens to wake it. Single reads and bursts both complete.
#[test]
fn poll_off_still_sends_held_replies() {
    let n = Nacred::start_args(&["--nvmf-poll", "off"]);
    let addr = setup(&n);
    let mut h = host(&n, addr);
    deep_bursts(&mut h, 20);
    for lba in 0..50 {
        h.read(0, 1, lba, 1, 4096).unwrap();
    }
    // Two commands in one write: coalesced, then nothing more from the host.
    burst(&mut h, 2);
    let t = reactor_totals(&n);
    assert_eq!(t.policy, "off");
    assert!(t.sleeps > 0);
    // No busy-poll window: an idle check only in the pass right after a busy one (or a
    // reactor's first pass), never two in a row. Not "one per sleep": a busy pass that
    // submitted a read earns a check, and when the volume's completion arrives by mail
    // after it, the pass that takes the mail is busy and earns another before the sleep.
    assert!(
        t.idle_polls <= t.busy_passes + t.reactors,
        "{} idle polls against {} busy passes on {} reactors",
        t.idle_polls,
        t.busy_passes,
        t.reactors
    );
    assert_eq!(t.deep_sleeps, 0, "no depth rule without polling");
}

#[test]
fn poll_policy_is_checked() {
    let out = std::process::Command::new(nacre_tests::daemon::bin("nacred"))
        .args(["--nvmf-poll", "sometimes"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("sometimes") && err.contains("adaptive"),
        "{err}"
    );
}
