//! NVMe in-band authentication (DH-HMAC-CHAP, NVMe Base 2.0 §8.13) on nacred's NVMe-oF
//! target: SPDK's `spdk_nvme_perf` and nacred's own initiator as hosts with right, wrong
//! and missing keys; hostile Authentication Send/Receive commands written by hand over
//! NVMe/TCP; key files, persistence across a restart, and no secret in the state, the log
//! or `--json` output.
//!
//! SPDK's binaries come from `$SPDK_DIR` or the team folder's `tools/spdk` (see its
//! README). A missing one fails the test, saying so.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::auth::queue::AUTHENTICATION_REQUIRED;
use nacre_dpu::auth::{HostAuth, HostAuthConfig, Secret};
use nacre_dpu::frontend::nvmf_tcp::{HostKeys, NvmfTarget, AUTH_DHGROUPS, AUTH_HASHES};
use nacre_dpu::volume::ram::RamVolume;
use nacre_shared::nvme::auth::{
    AuthCommand, DhGroupId, HashId, Message, Reason, AUTH_RECEIVE_LEN, CONNECT_AUTHREQ_ATR,
};
use nacre_shared::nvme::fabrics::CNTLID_DYNAMIC;
use nacre_shared::nvme::identify::IdentifyController;
use nacre_shared::nvme::{admin_opcode, Command as Sqe, Status};
use nacre_shared::nvme_tcp::Digests;
use nacre_tests::daemon::Nacred;
use nacre_tests::nvmf_host::{HostOptions, NvmfHost, Queue};
use serde_json::json;

const NQN: &str = "nqn.2024-01.io.nacre:auth-target";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:5b0e6a51-93c2-4d0e-8f31-7a1c2d3e4f50";
const OTHER: &str = "nqn.2014-08.org.nvmexpress:uuid:5b0e6a51-93c2-4d0e-8f31-7a1c2d3e4f51";

// ---- hostile input over NVMe/TCP, against the target in this process ----

fn secret(fill: u8) -> Secret {
    Secret::new(0, &[fill; 32]).unwrap()
}

/// A target whose subsystem lets HOST in with a secret (bidirectional keys too) and OTHER
/// without one.
fn target() -> (Arc<NvmfTarget>, SocketAddr) {
    let t = NvmfTarget::with_reactors(1);
    t.create_subsystem(NQN, "S", "M", false).unwrap();
    t.add_namespace(
        NQN,
        None,
        Arc::new(RamVolume::new(1 << 20, 512).unwrap()),
        [2; 16],
        "v".into(),
    )
    .unwrap();
    t.add_host(NQN, HOST).unwrap();
    t.add_host(NQN, OTHER).unwrap();
    t.set_host_keys(
        NQN,
        HOST,
        Some(HostKeys {
            key: secret(0x11),
            ctrl_key: Some(secret(0x22)),
            hashes: AUTH_HASHES.to_vec(),
            dhgroups: AUTH_DHGROUPS.to_vec(),
        }),
    )
    .unwrap();
    let addr = t.add_listener(NQN, "127.0.0.1:0".parse().unwrap()).unwrap();
    (t, addr)
}

fn opts(hostnqn: &str) -> HostOptions {
    HostOptions {
        hostnqn: hostnqn.into(),
        ..Default::default()
    }
}

/// A connected admin queue (not authenticated) and the Connect response's Dword 0.
fn connect_admin(addr: SocketAddr, hostnqn: &str) -> (Queue, u32) {
    let o = opts(hostnqn);
    let mut q = Queue::open(addr, Digests::NONE).unwrap();
    let r = q
        .connect(NQN, hostnqn, o.hostid, 0, 32, CNTLID_DYNAMIC, 0, 0)
        .unwrap()
        .ok()
        .unwrap();
    (q, r.cqe.dw0)
}

fn send(q: &mut Queue, msg: &[u8]) -> Status {
    q.call(AuthCommand::send(msg.len() as u32).to_command(), msg, 0)
        .unwrap()
        .status()
}

fn receive(q: &mut Queue) -> Vec<u8> {
    let r = q
        .call(
            AuthCommand::receive(AUTH_RECEIVE_LEN).to_command(),
            &[],
            AUTH_RECEIVE_LEN as usize,
        )
        .unwrap();
    assert_eq!(r.status(), Status::SUCCESS);
    r.data
}

/// The reason code explanation of an AUTH_Failure1 (NVMe Base 2.0 Figure 576).
fn failure1_reason(b: &[u8]) -> u8 {
    match Message::decode(b).unwrap() {
        Message::Failure {
            reason_code,
            explanation,
            ..
        } => {
            assert_eq!(b[1], 0xF1, "AUTH_Failure1");
            assert_eq!(reason_code, 1, "reason code: authentication failure");
            explanation
        }
        m => panic!("expected AUTH_Failure1, got {m:?}"),
    }
}

/// Authenticate queue `q` as `cfg`'s host; the host's view of the outcome.
fn authenticate(q: &mut Queue, cfg: &HostAuthConfig, t_id: u16) -> Result<(), String> {
    let mut h = HostAuth::new(cfg, t_id);
    assert_eq!(send(q, &h.negotiate()), Status::SUCCESS);
    let c = receive(q);
    let reply = h.on_challenge(&c).map_err(|e| e.to_string())?;
    assert_eq!(send(q, &reply), Status::SUCCESS);
    let s1 = receive(q);
    if let Some(s2) = h.on_success1(&s1).map_err(|e| e.to_string())? {
        assert_eq!(send(q, &s2), Status::SUCCESS);
    }
    Ok(())
}

/// Property Get of CAP: what an authenticated admin queue may do before it is enabled.
fn property(q: &mut Queue) -> Status {
    let get = nacre_shared::nvme::fabrics::Property::get_command(0, 0, true);
    q.call(get, &[], 0).unwrap().status()
}

fn identify(q: &mut Queue) -> Status {
    let cmd = Sqe {
        opcode: admin_opcode::IDENTIFY,
        cdw10: 1,
        ..Default::default()
    };
    q.call(cmd, &[], 4096).unwrap().status()
}

/// A host that authenticates (bidirectionally, with a DH group) gets its controller and
/// its I/O queue, each queue authenticated by itself; another connection that skips
/// authentication gets nothing but Authentication Required.
fn full_host(addr: SocketAddr) -> NvmfHost {
    let cfg = HostAuthConfig::new(HOST, NQN, secret(0x11), Some(secret(0x22)));
    let (mut admin, dw0) = connect_admin(addr, HOST);
    assert_ne!(
        dw0 & CONNECT_AUTHREQ_ATR,
        0,
        "Connect asks for authentication"
    );
    authenticate(&mut admin, &cfg, 1).unwrap();
    let mut h = NvmfHost {
        admin,
        io: Vec::new(),
        cntlid: dw0 as u16,
        id: IdentifyController::default(),
        opts: opts(HOST),
        addr,
        subnqn: NQN.into(),
    };
    h.enable().unwrap();
    h.id = h.identify_controller().unwrap();
    let mut io = h.connect_io_queue(1, 32).unwrap();
    authenticate(&mut io, &cfg, 2).unwrap();
    h.io.push(io);
    h
}

#[test]
fn hosts_with_a_secret_authenticate_before_anything_else() {
    let (_t, addr) = target();

    // Authentication before Connect: a Command Sequence Error, and the connection goes on.
    let mut q = Queue::open(addr, Digests::NONE).unwrap();
    let cfg = HostAuthConfig::new(HOST, NQN, secret(0x11), None);
    let n = HostAuth::new(&cfg, 1).negotiate();
    assert_eq!(send(&mut q, &n), Status::COMMAND_SEQUENCE_ERROR);
    let r = q
        .call(
            AuthCommand::receive(64).to_command(),
            &[],
            AUTH_RECEIVE_LEN as usize,
        )
        .unwrap();
    assert_eq!(r.status(), Status::COMMAND_SEQUENCE_ERROR);

    // Connected but not authenticated: Identify, Property Get and I/O are refused.
    let (mut admin, dw0) = connect_admin(addr, HOST);
    assert_ne!(dw0 & CONNECT_AUTHREQ_ATR, 0);
    assert_eq!(identify(&mut admin), AUTHENTICATION_REQUIRED);
    let get = nacre_shared::nvme::fabrics::Property::get_command(0, 0, true);
    assert_eq!(
        admin.call(get, &[], 0).unwrap().status(),
        AUTHENTICATION_REQUIRED
    );

    // The right keys: the controller and an I/O queue carry data.
    let mut h = full_host(addr);
    h.write(0, 1, 0, &[0xA5; 512], 512).unwrap();
    assert_eq!(h.read(0, 1, 0, 1, 512).unwrap(), vec![0xA5; 512]);

    // An I/O queue of that controller connected without authenticating: no I/O.
    let mut io = h.connect_io_queue(2, 32).unwrap();
    let read = Sqe {
        opcode: nacre_shared::nvme::io_opcode::READ,
        nsid: 1,
        ..Default::default()
    };
    assert_eq!(
        io.call(read, &[], 512).unwrap().status(),
        AUTHENTICATION_REQUIRED
    );
    // A write is refused before its data is asked for.
    let write = Sqe {
        opcode: nacre_shared::nvme::io_opcode::WRITE,
        nsid: 1,
        ..Default::default()
    };
    assert_eq!(
        io.call(write, &vec![1; 65536], 0).unwrap().status(),
        AUTHENTICATION_REQUIRED
    );

    // Re-authentication on a queue in use: I/O goes on, then the new transaction succeeds.
    let mut h2 = HostAuth::new(&cfg, 7);
    assert_eq!(send(&mut h.io[0], &h2.negotiate()), Status::SUCCESS);
    assert_eq!(h.read(0, 1, 0, 1, 512).unwrap(), vec![0xA5; 512]);
    let c = receive(&mut h.io[0]);
    let reply = h2.on_challenge(&c).unwrap();
    assert_eq!(send(&mut h.io[0], &reply), Status::SUCCESS);
    assert!(h2.on_success1(&receive(&mut h.io[0])).is_ok());
    assert_eq!(h.read(0, 1, 0, 1, 512).unwrap(), vec![0xA5; 512]);

    // A host with no secret here connects and works as before; authentication commands on
    // its queues are out of sequence.
    let mut plain = NvmfHost::connect(addr, NQN, opts(OTHER)).unwrap();
    assert_eq!(plain.read(0, 1, 0, 1, 512).unwrap(), vec![0xA5; 512]);
    assert_eq!(
        send(&mut plain.admin, &HostAuth::new(&cfg, 1).negotiate()),
        Status::COMMAND_SEQUENCE_ERROR
    );
}

#[test]
fn wrong_keys_and_hostile_messages_get_their_reason_codes() {
    let (_t, addr) = target();
    let expect = |r: Reason| r as u8;

    // The wrong host key: AUTH_Failure1 "authentication failed", and no access.
    let (mut q, _) = connect_admin(addr, HOST);
    let bad = HostAuthConfig::new(HOST, NQN, secret(0x12), None);
    let e = authenticate(&mut q, &bad, 1).unwrap_err();
    assert!(e.contains("authentication failed"), "{e}");
    assert_eq!(property(&mut q), AUTHENTICATION_REQUIRED);

    // The wrong controller key: the host refuses the controller (and tells it).
    let (mut q, _) = connect_admin(addr, HOST);
    let cfg = HostAuthConfig::new(HOST, NQN, secret(0x11), Some(secret(0x23)));
    let mut h = HostAuth::new(&cfg, 3);
    send(&mut q, &h.negotiate());
    let reply = h.on_challenge(&receive(&mut q)).unwrap();
    send(&mut q, &reply);
    let f = h.on_success1(&receive(&mut q)).unwrap_err();
    assert_eq!(f.reason(), Some(Reason::Failed));
    assert_eq!(send(&mut q, &h.failure2(&f).unwrap()), Status::SUCCESS);
    assert_eq!(property(&mut q), AUTHENTICATION_REQUIRED);

    let good = HostAuthConfig::new(HOST, NQN, secret(0x11), None);
    // A Reply with another transaction id: incorrect payload.
    let (mut q, _) = connect_admin(addr, HOST);
    let mut h = HostAuth::new(&good, 9);
    send(&mut q, &h.negotiate());
    let mut reply = h.on_challenge(&receive(&mut q)).unwrap();
    reply[4] ^= 0x40;
    assert_eq!(send(&mut q, &reply), Status::SUCCESS);
    assert_eq!(
        failure1_reason(&receive(&mut q)),
        expect(Reason::IncorrectPayload)
    );
    assert_eq!(property(&mut q), AUTHENTICATION_REQUIRED);

    // An oversized DH value (4,000 bytes where ffdhe2048 takes 256): incorrect payload.
    let (mut q, _) = connect_admin(addr, HOST);
    let mut h = HostAuth::new(&good, 4);
    send(&mut q, &h.negotiate());
    let reply = h.on_challenge(&receive(&mut q)).unwrap();
    let Message::Reply {
        t_id,
        response,
        challenge,
        seqnum,
        ..
    } = Message::decode(&reply).unwrap()
    else {
        panic!("a reply")
    };
    let huge = Message::Reply {
        t_id,
        response,
        challenge,
        seqnum,
        dh_value: vec![0xFF; 4000],
    }
    .encode();
    assert_eq!(send(&mut q, &huge), Status::SUCCESS);
    assert_eq!(
        failure1_reason(&receive(&mut q)),
        expect(Reason::IncorrectPayload)
    );

    // A Reply replayed from an authenticated queue onto a new transaction: its response
    // was for another challenge, so it does not verify.
    let (mut q1, _) = connect_admin(addr, HOST);
    let mut h = HostAuth::new(&good, 5);
    send(&mut q1, &h.negotiate());
    let old = h.on_challenge(&receive(&mut q1)).unwrap();
    send(&mut q1, &old);
    assert!(h.on_success1(&receive(&mut q1)).is_ok());
    let (mut q2, _) = connect_admin(addr, HOST);
    send(&mut q2, &HostAuth::new(&good, 5).negotiate());
    let _challenge = receive(&mut q2);
    send(&mut q2, &old);
    assert_eq!(failure1_reason(&receive(&mut q2)), expect(Reason::Failed));
    assert_eq!(property(&mut q2), AUTHENTICATION_REQUIRED);
    // And replayed again on the queue it came from, after its transaction ended: out of
    // sequence, and the queue loses its access until it authenticates again.
    assert_eq!(property(&mut q1), Status::SUCCESS);
    send(&mut q1, &old);
    assert_eq!(
        failure1_reason(&receive(&mut q1)),
        expect(Reason::IncorrectMessage)
    );
    assert_eq!(property(&mut q1), AUTHENTICATION_REQUIRED);
    authenticate(&mut q1, &good, 6).unwrap();
    assert_eq!(property(&mut q1), Status::SUCCESS);

    // Offers the target takes none of: hash and DH group unusable.
    let (mut q, _) = connect_admin(addr, HOST);
    let n = Message::Negotiate {
        t_id: 1,
        sc_c: 0,
        hashes: vec![0x7F],
        dhgroups: vec![DhGroupId::Null as u8],
    }
    .encode();
    send(&mut q, &n);
    assert_eq!(
        failure1_reason(&receive(&mut q)),
        expect(Reason::HashUnusable)
    );
    let n = Message::Negotiate {
        t_id: 1,
        sc_c: 0,
        hashes: vec![HashId::Sha256 as u8],
        dhgroups: vec![0x30],
    }
    .encode();
    send(&mut q, &n);
    assert_eq!(
        failure1_reason(&receive(&mut q)),
        expect(Reason::DhGroupUnusable)
    );

    // Garbage, a Receive with nothing pending, a message out of order.
    let (mut q, _) = connect_admin(addr, HOST);
    assert_eq!(
        failure1_reason(&receive(&mut q)),
        expect(Reason::IncorrectMessage)
    );
    assert_eq!(send(&mut q, &[0xEE; 40]), Status::SUCCESS);
    let r = failure1_reason(&receive(&mut q));
    assert!(
        r == expect(Reason::IncorrectMessage) || r == expect(Reason::IncorrectPayload),
        "{r:#x}"
    );
    // (Transaction id 0: no Negotiate has set another.)
    send(&mut q, &Message::Success2 { t_id: 0 }.encode());
    assert_eq!(
        failure1_reason(&receive(&mut q)),
        expect(Reason::IncorrectMessage)
    );
    // Command fields: a wrong security protocol, a TL that disagrees with the data.
    let mut c = AuthCommand::send(8);
    c.secp = 0xEA;
    assert_eq!(
        q.call(c.to_command(), &[0; 8], 0).unwrap().status(),
        Status::INVALID_FIELD
    );
    assert_eq!(
        q.call(AuthCommand::send(9).to_command(), &[0; 8], 0)
            .unwrap()
            .status(),
        Status::INVALID_FIELD
    );
    // Still the same queue, still able to authenticate.
    authenticate(&mut q, &good, 8).unwrap();
    assert_eq!(property(&mut q), Status::SUCCESS);

    // Messages sent by R2T rather than in the capsule take the same path; a 100 KiB one
    // (a 60,000-byte DH value, then padding) is an incorrect payload.
    let (mut q, _) = connect_admin(addr, HOST);
    q.inline_max = 0;
    authenticate(&mut q, &good, 10).unwrap();
    assert_eq!(property(&mut q), Status::SUCCESS);
    let mut h = HostAuth::new(&good, 11);
    send(&mut q, &h.negotiate());
    let reply = h.on_challenge(&receive(&mut q)).unwrap();
    let Message::Reply {
        t_id,
        response,
        challenge,
        seqnum,
        ..
    } = Message::decode(&reply).unwrap()
    else {
        panic!("a reply")
    };
    let mut huge = Message::Reply {
        t_id,
        response,
        challenge,
        seqnum,
        dh_value: vec![0x5A; 60000],
    }
    .encode();
    huge.resize(100 << 10, 0x5A);
    assert_eq!(send(&mut q, &huge), Status::SUCCESS);
    assert_eq!(
        failure1_reason(&receive(&mut q)),
        expect(Reason::IncorrectPayload)
    );
    assert_eq!(property(&mut q), AUTHENTICATION_REQUIRED);

    // The target is unharmed: a whole host still works.
    let mut h = full_host(addr);
    h.write(0, 1, 8, &[0x3C; 512], 512).unwrap();
    assert_eq!(h.read(0, 1, 8, 1, 512).unwrap(), vec![0x3C; 512]);
}

#[test]
fn a_queue_that_does_not_authenticate_in_time_is_closed() {
    let (t, addr) = target();
    t.set_setup_timeout(Duration::from_millis(700));
    let good = HostAuthConfig::new(HOST, NQN, secret(0x11), None);
    let (mut idle, _) = connect_admin(addr, HOST);
    let (mut failed, _) = connect_admin(addr, HOST);
    authenticate(
        &mut failed,
        &HostAuthConfig::new(HOST, NQN, secret(0x12), None),
        1,
    )
    .unwrap_err();
    let (mut done, _) = connect_admin(addr, HOST);
    authenticate(&mut done, &good, 1).unwrap();
    let (mut plain, _) = connect_admin(addr, OTHER);
    std::thread::sleep(Duration::from_millis(1500));
    for (what, q) in [("idle", &mut idle), ("failed", &mut failed)] {
        // Closed by the target: end of stream (or a reset), not a read that times out.
        let mut sock = q.socket();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let r = std::io::Read::read(&mut sock, &mut [0u8; 64]);
        assert!(
            matches!(r, Ok(0))
                || matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "the {what} queue is still open: {r:?}"
        );
    }
    // Queues that authenticated, and those of hosts without a key, stay.
    assert_eq!(property(&mut done), Status::SUCCESS);
    assert_eq!(property(&mut plain), Status::SUCCESS);
}

// ---- nacred with real peers: SPDK's perf, nacred's own initiator ----

fn spdk_dir() -> PathBuf {
    let dir = std::env::var_os("SPDK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/spdk"));
    assert!(
        dir.join("bin/spdk_nvme_perf").exists(),
        "SPDK's bin/spdk_nvme_perf is missing under {}: set SPDK_DIR to an SPDK v25.09 build",
        dir.display()
    );
    dir
}

/// `spdk_nvme_perf` as HOST: a one-second 4 KiB random read/write run with the key files
/// given. Its output, and whether it succeeded.
fn perf(addr: SocketAddr, key: Option<&Path>, ctrl_key: Option<&Path>) -> (bool, String) {
    perf_to(addr, NQN, key, ctrl_key)
}

/// [`perf`] to subsystem `nqn`.
fn perf_to(
    addr: SocketAddr,
    nqn: &str,
    key: Option<&Path>,
    ctrl_key: Option<&Path>,
) -> (bool, String) {
    let mut c = Command::new(spdk_dir().join("bin/spdk_nvme_perf"));
    c.args([
        "-c",
        "0x1",
        "--no-huge",
        "-s",
        "256",
        "-q",
        "8",
        "-o",
        "4096",
        "-w",
        "randrw",
        "-M",
        "50",
        "-t",
        "1",
        "-r",
    ])
    .arg(format!(
        "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:{} subnqn:{nqn} hostnqn:{HOST}",
        addr.port()
    ));
    if let Some(k) = key {
        c.arg("--dhchap-key").arg(k);
    }
    if let Some(k) = ctrl_key {
        c.arg("--dhchap-ctrlr-key").arg(k);
    }
    let t = Instant::now();
    let out = run_with_timeout(c, Duration::from_secs(60));
    let took = t.elapsed();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // A run that reached I/O prints its totals line with a non-zero IOPS figure.
    let did_io = text
        .lines()
        .find(|l| l.trim_start().starts_with("Total"))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|v| v.parse::<f64>().ok())
        .is_some_and(|iops| iops > 0.0);
    let ok = out.status.success() && did_io;
    eprintln!(
        "perf key={:?} ctrl_key={:?}: {} ({took:?})",
        key.map(|k| k.file_name().unwrap_or_default()),
        ctrl_key.map(|k| k.file_name().unwrap_or_default()),
        if ok { "did I/O" } else { "no I/O" }
    );
    for l in text.lines().filter(|l| {
        l.trim_start().starts_with("Total") || l.contains("auth") || l.contains("Failed")
    }) {
        eprintln!("  | {l}");
    }
    (ok, text)
}

fn run_with_timeout(mut c: Command, limit: Duration) -> Output {
    let mut child = c
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start spdk_nvme_perf");
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// A fresh secret from nacre's CLI in a 0600 file: (path, representation).
fn gen_key(n: &Nacred, dir: &Path, name: &str, args: &[&str]) -> (PathBuf, String) {
    let p = dir.join(name);
    let mut a = vec!["nvmf", "gen-dhchap-key", "--output", p.to_str().unwrap()];
    a.extend_from_slice(args);
    let out = n.cli(&a);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let key = std::fs::read_to_string(&p).unwrap().trim().to_string();
    (p, key)
}

fn cli_ok(n: &Nacred, args: &[&str]) -> String {
    let out = n.cli(args);
    assert!(
        out.status.success(),
        "nacre {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Secret bytes (the base64 body of each representation, and the raw key) must not appear.
fn assert_no_secret(what: &str, text: &str, keys: &[&str]) {
    for k in keys {
        let body = k.trim_end_matches(':').rsplit(':').next().unwrap();
        assert!(
            !text.contains(body) && !text.contains(k),
            "{what} contains a DH-HMAC-CHAP secret"
        );
        let raw = Secret::parse(k).unwrap();
        let hex: String = raw.key().iter().map(|b| format!("{b:02x}")).collect();
        assert!(!text.contains(&hex), "{what} contains a key in hex");
    }
}

/// nacred logged queues (at least the admin and an I/O queue) authenticated with `hash`
/// and `dhgroup`.
fn assert_authenticated_with(n: &Nacred, hash: &str, dhgroup: &str) {
    let log = n.log_text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("queue authenticated (DH-HMAC-CHAP)"))
        .collect();
    let with = lines
        .iter()
        .filter(|l| l.contains(hash) && l.contains(&format!("{dhgroup}\"")))
        .count();
    assert!(
        with >= 2,
        "{hash}/{dhgroup}: {with} queues; authenticated queues logged:\n{}",
        lines.join("\n")
    );
}

fn add_host(n: &Nacred, extra: &[&str]) -> Output {
    let mut a = vec!["nvmf", "add-host", NQN, HOST];
    a.extend_from_slice(extra);
    n.cli(&a)
}

#[test]
fn spdk_perf_and_nacreds_initiator_authenticate_to_nacreds_target() {
    let mut n = Nacred::start_args(&["--no-default"]);
    let tmp = tempfile::tempdir().unwrap();
    n.ok(
        "volume_create",
        json!({"name": "av", "size": 16 << 20, "block_size": 512}),
    );
    n.ok("nvmf_subsystem_create", json!({"nqn": NQN}));
    n.ok("nvmf_subsystem_add_ns", json!({"nqn": NQN, "volume": "av"}));
    let l = n.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "address": "127.0.0.1", "port": 0}),
    );
    let addr = SocketAddr::from(([127, 0, 0, 1], l["port"].as_u64().unwrap() as u16));

    let (host, host_key) = gen_key(&n, tmp.path(), "host.key", &["--hmac", "1", "--nqn", HOST]);
    let (ctrl, ctrl_key) = gen_key(&n, tmp.path(), "ctrl.key", &["--key-length", "64"]);
    let (wrong, wrong_key) = gen_key(&n, tmp.path(), "wrong.key", &[]);
    let (h, c) = (host.to_str().unwrap(), ctrl.to_str().unwrap());

    // A key file others may read is refused, with the fix in the message.
    let loose = tmp.path().join("loose.key");
    std::fs::copy(&host, &loose).unwrap();
    std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = add_host(&n, &["--dhchap-key", loose.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("chmod 600"), "{e}");
    assert_eq!(e.trim().lines().count(), 1, "{e}");

    // SHA-512 with ffdhe2048 (the target's first choice; perf offers every hash and group),
    // bidirectional: perf with both keys does I/O; with a wrong host key, with a wrong
    // controller key, or with none it does not.
    cli_ok(
        &n,
        &[
            "nvmf",
            "add-host",
            NQN,
            HOST,
            "--dhchap-key",
            h,
            "--dhchap-ctrl-key",
            c,
        ],
    );
    let subs = n.ok("nvmf_get_subsystems", json!({}));
    let sub = subs
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == NQN)
        .unwrap();
    assert_eq!(sub["dhchap"], json!({HOST: "bidirectional"}), "{sub}");
    let (ok, text) = perf(addr, Some(&host), Some(&ctrl));
    assert!(ok, "perf with the right keys:\n{text}");
    assert_authenticated_with(&n, "sha512", "ffdhe2048");
    let (ok, text) = perf(addr, Some(&wrong), None);
    assert!(!ok, "perf with a wrong key did I/O:\n{text}");
    assert!(
        text.contains("received AUTH_failure1: rc=1, rce=1"),
        "SPDK reports nacred's reason code:\n{text}"
    );
    let (ok, text) = perf(addr, Some(&host), Some(&wrong));
    assert!(!ok, "perf accepted a wrong controller key:\n{text}");
    assert!(text.contains("controller challenge mismatch"), "{text}");
    let (ok, text) = perf(addr, None, None);
    assert!(!ok, "perf without a key did I/O:\n{text}");
    assert!(text.contains("missing DH-HMAC-CHAP key"), "{text}");
    // Unidirectional with the same host key.
    let (ok, text) = perf(addr, Some(&host), None);
    assert!(ok, "perf with the host key only:\n{text}");
    let log = n.log_text();
    assert!(
        log.contains("DH-HMAC-CHAP authentication failed"),
        "the refusals are logged"
    );

    // SHA-256 with the null group, then SHA-384 with ffdhe4096: only what the host is
    // configured for is accepted.
    cli_ok(
        &n,
        &[
            "nvmf",
            "add-host",
            NQN,
            HOST,
            "--dhchap-key",
            h,
            "--dhchap-digests",
            "sha256",
            "--dhchap-dhgroups",
            "null",
        ],
    );
    let (ok, text) = perf(addr, Some(&host), None);
    assert!(ok, "perf with sha256/null:\n{text}");
    assert_authenticated_with(&n, "sha256", "null");
    cli_ok(
        &n,
        &[
            "nvmf",
            "add-host",
            NQN,
            HOST,
            "--dhchap-key",
            h,
            "--dhchap-ctrl-key",
            c,
            "--dhchap-digests",
            "sha384",
            "--dhchap-dhgroups",
            "ffdhe4096",
        ],
    );
    let (ok, text) = perf(addr, Some(&host), Some(&ctrl));
    assert!(ok, "perf with sha384/ffdhe4096:\n{text}");
    assert_authenticated_with(&n, "sha384", "ffdhe4096");

    // nacred's own initiator against its own target: the right keys attach and read the
    // namespace; a wrong key is one clear error.
    let attach = |name: &str, key: &Path, ctrl: Option<&Path>| {
        let mut p = json!({"name": name, "address": "127.0.0.1", "port": addr.port(),
            "subnqn": NQN, "hostnqn": HOST, "io_queues": 2, "queue_depth": 16,
            "ctrl_loss_timeout_sec": 3, "dhchap_secret": key});
        if let Some(c) = ctrl {
            p["dhchap_ctrl_secret"] = json!(c);
        }
        n.call("remote_attach", p).map_err(|e| e.to_string())
    };
    let t = Instant::now();
    let r = attach("self", &host, Some(&ctrl)).unwrap();
    eprintln!(
        "nacred's initiator to its own target, sha384/ffdhe4096 bidirectional: attach (admin + 2 I/O queues) took {:?}",
        t.elapsed()
    );
    assert_eq!(
        (r["state"].as_str(), r["dhchap"].as_str()),
        (Some("live"), Some("bidirectional")),
        "{r}"
    );
    assert_eq!(r["io_queues"], 2);
    n.ok("remote_detach", json!({"name": "self"}));
    let e = attach("self-bad", &wrong, None).unwrap_err();
    assert!(
        e.contains("authentication failed") && !e.contains('\n'),
        "{e}"
    );

    // The keys outlive a restart (replayed from their files); the secrets are nowhere in
    // the state, the log or --json output.
    n.restart();
    let (ok, text) = perf(n.nvmf_listener(NQN), Some(&host), Some(&ctrl));
    assert!(ok, "perf after nacred restarted:\n{text}");
    let (ok, _) = perf(n.nvmf_listener(NQN), None, None);
    assert!(!ok, "the key is required again after a restart");
    let state = std::fs::read_to_string(n.state_dir.join("state.json")).unwrap();
    assert!(state.contains(h), "the state keeps the key file's path");
    let subs = cli_ok(&n, &["--json", "nvmf", "list"]);
    let keys = [host_key.as_str(), ctrl_key.as_str(), wrong_key.as_str()];
    assert_no_secret("state.json", &state, &keys);
    assert_no_secret("nacred's log", &n.log_text(), &keys);
    assert_no_secret("nvmf list --json", &subs, &keys);

    // A key file that became readable by others is not used at the next start, and the
    // host is not let in without it.
    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o640)).unwrap();
    n.restart();
    assert!(
        n.log_text()
            .contains("DH-HMAC-CHAP key not restored: the host is refused"),
        "the log says why"
    );
    let (ok, _) = perf(n.nvmf_listener(NQN), Some(&host), Some(&ctrl));
    assert!(!ok, "a host whose key was not restored got in");
    let (ok, _) = perf(n.nvmf_listener(NQN), None, None);
    assert!(!ok, "a host whose key was not restored got in without one");
    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o600)).unwrap();

    // Unknown hash or group names, and controller keys without a host key, are refused.
    let (_, e) = n.err(
        "nvmf_subsystem_add_host",
        json!({"nqn": NQN, "host": HOST, "dhchap_key": host, "dhchap_digests": ["md5"]}),
    );
    assert!(
        e.contains("\"md5\" is not one of sha512, sha384, sha256"),
        "{e}"
    );
    let (_, e) = n.err(
        "nvmf_subsystem_add_host",
        json!({"nqn": NQN, "host": HOST, "dhchap_key": host, "dhchap_dhgroups": []}),
    );
    assert!(e.contains("name at least one"), "{e}");
    let (_, e) = n.err(
        "nvmf_subsystem_add_host",
        json!({"nqn": NQN, "host": HOST, "dhchap_ctrlr_key": ctrl}),
    );
    assert!(e.contains("need dhchap_key"), "{e}");

    // Adding the host without a key lifts the requirement.
    cli_ok(&n, &["nvmf", "add-host", NQN, HOST]);
    let (ok, text) = perf(n.nvmf_listener(NQN), None, None);
    assert!(ok, "perf without a key once none is required:\n{text}");
    let state = std::fs::read_to_string(n.state_dir.join("state.json")).unwrap();
    assert!(
        !state.contains("dhchap"),
        "no key file is kept for the host"
    );
}

/// The embedded default's subsystem: any host may connect to it unless `--default-host`.
const DEFAULT_NQN: &str = "nqn.2014-08.io.nacre:default";

/// A secret made by `nacre nvmf gen-dhchap-key` (nacred need not run) in a 0600 file.
fn gen_key_file(path: &Path, nqn: &str) {
    let out = Command::new(nacre_tests::daemon::bin("nacre"))
        .args(["nvmf", "gen-dhchap-key", "--nqn", nqn, "--output"])
        .arg(path)
        .output()
        .expect("nacre");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The embedded default's NVMe/TCP listener, and whether it admits any host.
fn default_subsystem(n: &Nacred) -> (SocketAddr, bool) {
    let subs = n.ok("nvmf_get_subsystems", serde_json::Value::Null);
    let sub = subs
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == DEFAULT_NQN)
        .unwrap_or_else(|| panic!("no default subsystem in {subs}"))
        .clone();
    let addr = sub["listeners"][0].as_str().unwrap().parse().unwrap();
    (addr, sub["allow_any_host"].as_bool().unwrap())
}

/// `nacred --default-host HOSTNQN --default-dhchap-key FILE [--default-dhchap-ctrl-key FILE]`
/// (docs/nvme-auth.md): the embedded default then admits that host only, once it
/// authenticates, at every start; without the switch it admits any host; a key file others
/// may read stops nacred with one line.
#[test]
fn the_embedded_defaults_switch_requires_authentication() {
    let tmp = tempfile::tempdir().unwrap();
    let (key, ctrl) = (tmp.path().join("host.key"), tmp.path().join("ctrl.key"));
    gen_key_file(&key, HOST);
    gen_key_file(&ctrl, DEFAULT_NQN);

    // Without the switch: any host, no key.
    let plain = Nacred::start();
    let (addr, any) = default_subsystem(&plain);
    assert!(any, "the embedded default admits any host by default");
    assert!(
        perf_to(addr, DEFAULT_NQN, None, None).0,
        "a plain host is let in"
    );
    drop(plain);

    let mut n = Nacred::start_args(&[
        "--default-host",
        HOST,
        "--default-dhchap-key",
        key.to_str().unwrap(),
        "--default-dhchap-ctrl-key",
        ctrl.to_str().unwrap(),
    ]);
    for round in ["first start", "restart"] {
        let (addr, any) = default_subsystem(&n);
        assert!(!any, "{round}: the default still admits any host");
        let (ok, text) = perf_to(addr, DEFAULT_NQN, None, None);
        assert!(!ok, "{round}: a host without the key did I/O:\n{text}");
        let (ok, text) = perf_to(addr, DEFAULT_NQN, Some(&key), Some(&ctrl));
        assert!(ok, "{round}: the host with its keys did no I/O:\n{text}");
        if round == "first start" {
            n.restart();
        }
    }
    assert_authenticated_with(&n, "sha512", "ffdhe2048");
    let keys = [
        std::fs::read_to_string(&key).unwrap().trim().to_string(),
        std::fs::read_to_string(&ctrl).unwrap().trim().to_string(),
    ];
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    assert_no_secret("nacred's log", &n.log_text(), &keys);
    drop(n);

    // A key file others may read: nacred does not start, and says why in one line.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new(nacre_tests::daemon::bin("nacred"))
        .arg("--state-dir")
        .arg(tmp.path().join("state"))
        .arg("--run-dir")
        .arg(tmp.path().join("run"))
        .args(["--nvmf-listen", "127.0.0.1:0", "--default-host", HOST])
        .arg("--default-dhchap-key")
        .arg(&key)
        .output()
        .expect("nacred");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("--default-host") && e.contains("chmod 600"),
        "nacred with a 0644 key file: {:?}\n{e}",
        out.status
    );
}
