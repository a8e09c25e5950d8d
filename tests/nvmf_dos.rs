//! What a peer can make the real nacred hold is bounded: connections per listener, silent
//! connections that never Connect, queues per host NQN, buffers for data a host announces
//! and never sends, and no host's socket (or remote shelf) can hold the control plane.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::frontend::nvmf_tcp::limits;
use nacre_shared::nvme::command::PSDT_SGL;
use nacre_shared::nvme::features::{fid, AEC_NS_ATTR};
use nacre_shared::nvme::log::{aen, lid};
use nacre_shared::nvme::{admin_opcode, io_opcode, Command, Completion, SglDescriptor, Status};
use nacre_shared::nvme_tcp::{self as tcp, pdu_type, CommonHeader, DataHeader, Digests};
use nacre_tests::daemon::Nacred;
use nacre_tests::nvmf_host::{HostError, HostOptions, NvmfHost, Queue};
use serde_json::json;

const NQN: &str = "nqn.2024-01.io.nacre:dos";

/// A 16 MiB RAM namespace any host may reach, on a listener on a free port.
fn setup(n: &Nacred) -> SocketAddr {
    n.ok(
        "volume_create",
        json!({"name": "nv", "size": 16 << 20, "block_size": 512, "backend": "ram"}),
    );
    n.export_nvmf(NQN, "nv")
}

fn host(nqn_suffix: &str) -> HostOptions {
    HostOptions {
        hostnqn: format!("nqn.2014-08.io.nacre:test-host-{nqn_suffix}"),
        ..Default::default()
    }
}

/// Works end to end: a write and its read-back.
fn serves(h: &mut NvmfHost, lba: u64, byte: u8) {
    h.write(0, 1, lba, &[byte; 512], 512).unwrap();
    assert_eq!(h.read(0, 1, lba, 1, 512).unwrap(), vec![byte; 512]);
}

/// True once the target has closed `s` (EOF or reset); waits up to 20 s, well below the
/// 30 s setup timeout that would close it anyway.
fn closed_by_target(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

/// Retry `f` until it succeeds (nacred gives a closed connection's place back when that
/// connection's thread has ended, asynchronously); panics after 20 s.
fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: still not after 20 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn silent_connections_beyond_the_setup_cap_are_closed_while_hosts_still_connect() {
    let n = Nacred::start_args(&["--no-default", "--nvmf-max-setup-connections", "4"]);
    let addr = setup(&n);
    // Ten peers that connect and say nothing (each used to get a thread and ~700 KiB for
    // the 30 s setup timeout, with no limit on their number).
    let mut silent: Vec<TcpStream> = (0..10).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // A real host still gets in, and is served.
    let mut h = NvmfHost::connect(addr, NQN, host("good")).unwrap();
    serves(&mut h, 1, 0x11);
    // The oldest silent ones made room: at most 4 connections are ever setting up.
    for (i, s) in silent.iter_mut().take(6).enumerate() {
        assert!(closed_by_target(s), "silent connection {i} was kept");
    }
    // Connected queues do not count as setting up: more hosts connect.
    let mut h2 = NvmfHost::connect(addr, NQN, host("second")).unwrap();
    serves(&mut h2, 2, 0x22);
    serves(&mut h, 3, 0x33);
}

#[test]
fn connections_beyond_the_listener_cap_are_refused_until_one_closes() {
    let n = Nacred::start_args(&["--no-default", "--nvmf-max-connections", "3"]);
    let addr = setup(&n);
    // A host with one I/O queue holds two connections, a silent peer the third.
    let mut h = NvmfHost::connect(addr, NQN, host("a")).unwrap();
    let silent = TcpStream::connect(addr).unwrap();
    // A fourth connection is closed as soon as it is accepted: no ICResp.
    let mut extra = TcpStream::connect(addr).unwrap();
    assert!(
        closed_by_target(&mut extra),
        "a fourth connection was served"
    );
    match Queue::open(addr, Digests::NONE) {
        Err(HostError::Io(_)) => {}
        Err(e) => panic!("expected the connection to be closed, got {e}"),
        Ok(_) => panic!("a connection beyond the cap got an ICResp"),
    }
    serves(&mut h, 1, 0x44);
    // Once a connection ends its place is free again: a new admin queue connects.
    drop(silent);
    let mut q = eventually("a connection accepted after another closed", || {
        Queue::open(addr, Digests::NONE).ok()
    });
    let b = host("b");
    let r = q
        .connect(NQN, &b.hostnqn, b.hostid, 0, 32, 0xFFFF, 0, 0)
        .unwrap();
    assert_eq!(r.status(), Status::SUCCESS);
    serves(&mut h, 2, 0x55);
}

#[test]
fn queues_per_host_nqn_are_capped() {
    let n = Nacred::start_args(&["--no-default", "--nvmf-max-connections-per-host", "3"]);
    let addr = setup(&n);
    let opts = HostOptions {
        io_queues: 2,
        ..host("capped")
    };
    let mut h = NvmfHost::connect(addr, NQN, opts.clone()).unwrap();
    assert_eq!(h.io.len(), 2);
    serves(&mut h, 1, 0x66);
    // A second controller of the same host NQN would be its fourth queue.
    match NvmfHost::connect(addr, NQN, opts.clone()) {
        Err(HostError::Nvme(s, _)) => assert_eq!(s, Status::CONNECT_CONTROLLER_BUSY),
        Err(e) => panic!("expected Connect Controller Busy, got {e}"),
        Ok(_) => panic!("a host NQN got more queues than the cap"),
    }
    // Other hosts are not affected.
    let mut other = NvmfHost::connect(addr, NQN, host("other")).unwrap();
    serves(&mut other, 2, 0x77);
    serves(&mut h, 3, 0x88);
    // The host's queues are given back when it disconnects.
    drop(h);
    let mut again = eventually("the host reconnecting after it disconnected", || {
        NvmfHost::connect(addr, NQN, opts.clone()).ok()
    });
    serves(&mut again, 4, 0x99);
}

/// A host announces 256 writes of 128 KiB (R2T transfers) and sends no data: the target asks
/// for at most R2T_BUDGET bytes at a time (it used to allocate a buffer for each, 32 MiB
/// here and up to 128 MiB per queue), and serves the rest as the data arrives.
#[test]
fn buffers_for_announced_write_data_are_bounded_per_queue() {
    const WRITES: usize = 256;
    const LEN: usize = limits::MAX_TRANSFER;
    let n = Nacred::start_args(&["--no-default"]);
    n.ok(
        "volume_create",
        json!({"name": "nv", "size": 64 << 20, "block_size": 512, "backend": "ram"}),
    );
    n.ok(
        "nvmf_subsystem_create",
        json!({"nqn": NQN, "allow_any_host": true}),
    );
    n.ok("nvmf_subsystem_add_ns", json!({"nqn": NQN, "volume": "nv"}));
    let l = n.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "address": "127.0.0.1", "port": 0}),
    );
    let addr = SocketAddr::from(([127, 0, 0, 1], l["port"].as_u64().unwrap() as u16));
    let opts = HostOptions {
        queue_size: 1024,
        ..host("r2t")
    };
    let mut h = NvmfHost::connect(addr, NQN, opts).unwrap();
    let data = |i: usize| -> Vec<u8> { (0..LEN).map(|j| (i * 7 + j / 512) as u8).collect() };
    let mut b = Vec::new();
    for i in 0..WRITES {
        let mut cmd = Command::rw(
            io_opcode::WRITE,
            i as u16,
            1,
            (i * LEN / 512) as u64,
            (LEN / 512) as u32,
            SglDescriptor::transport(LEN as u32),
        );
        cmd.flags |= PSDT_SGL;
        tcp::encode_capsule_cmd(&mut b, &cmd, &[], Digests::NONE, 0);
    }
    // A Flush after them: the target handles a queue's commands in order, so every R2T it
    // sends for the writes before its buffers run out precedes the Flush's response.
    let flush_cid = 4000u16;
    let mut flush = Command {
        opcode: io_opcode::FLUSH,
        cid: flush_cid,
        nsid: 1,
        ..Default::default()
    };
    flush.flags |= PSDT_SGL;
    tcp::encode_capsule_cmd(&mut b, &flush, &[], Digests::NONE, 0);
    let q = &mut h.io[0];
    q.send_raw(&b).unwrap();
    q.socket()
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut r2ts: Vec<DataHeader> = Vec::new();
    loop {
        let p = q.recv_pdu_raw().unwrap();
        match p[0] {
            pdu_type::R2T => r2ts.push(DataHeader::decode(&p)),
            pdu_type::CAPSULE_RESP => {
                let c = Completion::decode(&p[tcp::CH_LEN..]);
                assert_eq!(c.cid, flush_cid, "only the Flush can complete yet");
                assert_eq!(c.status >> 1, 0, "Flush failed: {c:?}");
                break;
            }
            t => panic!("unexpected PDU type {t:#x}"),
        }
    }
    let asked: usize = r2ts.iter().map(|r| r.datal as usize).sum();
    assert!(
        asked <= limits::R2T_BUDGET,
        "the target asked for {asked} bytes at once ({} R2Ts), more than its {} byte budget",
        r2ts.len(),
        limits::R2T_BUDGET
    );
    assert!(!r2ts.is_empty(), "no R2T at all");
    // Answer every R2T as it comes; every write completes, in whatever order.
    let mut completed = 0;
    while completed < WRITES {
        for r in r2ts.drain(..) {
            let mut out = Vec::new();
            let d = data(r.cccid as usize);
            let (o, len) = (r.datao as usize, r.datal as usize);
            tcp::encode_h2c_data(
                &mut out,
                r.cccid,
                r.ttag,
                o as u32,
                &d[o..o + len],
                true,
                Digests::NONE,
                0,
            );
            q.send_raw(&out).unwrap();
        }
        let p = q.recv_pdu_raw().unwrap();
        match p[0] {
            pdu_type::R2T => r2ts.push(DataHeader::decode(&p)),
            pdu_type::CAPSULE_RESP => {
                let c = Completion::decode(&p[tcp::CH_LEN..]);
                assert_eq!(c.status >> 1, 0, "write {} failed: {c:?}", c.cid);
                completed += 1;
            }
            t => panic!("unexpected PDU type {t:#x}"),
        }
    }
    for i in [0, 1, 17, 128, WRITES - 1] {
        let back = h
            .read(0, 1, (i * LEN / 512) as u64, (LEN / 512) as u32, 512)
            .unwrap();
        assert!(back == data(i), "write {i} did not land");
    }
}

/// A host that stops reading its admin queue while an Asynchronous Event Request is
/// outstanding: raising the event (nvmf_subsystem_add_ns, under the control-plane lock) used
/// to write the completion to that socket from the RPC thread, blocking every RPC until the
/// stalled send gave up or moved (up to the 30 s write timeout). Now the RPC answers while
/// the host's connection is still stalled (the target holds the replies, and stops taking
/// commands while too many wait), and the host gets every reply and the event once it
/// reads.
#[test]
fn a_host_that_does_not_read_never_holds_the_control_plane() {
    let n = Nacred::start_args(&["--no-default"]);
    let addr = setup(&n);
    n.ok(
        "volume_create",
        json!({"name": "nv2", "size": 1 << 20, "block_size": 512, "backend": "ram"}),
    );
    let mut h = NvmfHost::connect(addr, NQN, host("aen")).unwrap();
    h.set_features(fid::ASYNC_EVENT_CONFIG, AEC_NS_ATTR)
        .unwrap();
    let aer = h.submit_aer().unwrap();
    // 8,000 Identify commands whose 4 KiB answers the host does not read: more than every
    // socket buffer between the two can hold, so the target's sends toward the host stall.
    const FLOOD: u16 = 8000;
    let mut b = Vec::new();
    for i in 0..FLOOD {
        let cmd = Command {
            opcode: admin_opcode::IDENTIFY,
            cid: 10_000 + i,
            cdw10: 1,
            flags: PSDT_SGL,
            sgl: SglDescriptor::transport(4096),
            ..Default::default()
        };
        tcp::encode_capsule_cmd(&mut b, &cmd, &[], Digests::NONE, 0);
    }
    let mut w = h.admin.socket().try_clone().unwrap();
    let sender = std::thread::spawn(move || w.write_all(&b));
    let fd = std::os::fd::AsRawFd::as_raw_fd(h.admin.socket());
    let queued = || {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD on an open socket writes one int.
        assert_eq!(unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) }, 0);
        n
    };
    // Stalled: the host's receive buffer is full and stays so, over three samples 300 ms
    // apart (one unchanged pair could be a reactor held off its core a moment).
    let (mut last, mut same) = (-1, 0);
    eventually("nacred's replies filling the host's socket", || {
        std::thread::sleep(Duration::from_millis(300));
        let now = queued();
        same = if now > 0 && now == last { same + 1 } else { 0 };
        last = now;
        (same >= 2).then_some(())
    });
    // The event is raised by the RPC; the RPC answers, and another after it, while the host
    // has still read nothing and nothing more has reached it.
    let before = queued();
    let asked = Instant::now();
    n.ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": NQN, "volume": "nv2", "nsid": 2}),
    );
    n.ok("volume_list", json!({}));
    // A target whose control plane waited for the stalled send would answer only when the
    // send gave up (the 30 s write timeout); half of that is an ample bound on a loaded
    // machine.
    assert!(
        asked.elapsed() < Duration::from_secs(15),
        "the RPCs waited {:?} for a host that does not read",
        asked.elapsed()
    );
    // No byte moved: the RPCs did not wait for the stalled send to make progress.
    assert_eq!(
        queued(),
        before,
        "the RPC waited for the target's send to move"
    );
    // Now read: every Identify answer, then the event, on a connection that survived.
    h.admin
        .socket()
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut identified = 0;
    let mut event = None;
    while identified < FLOOD as usize || event.is_none() {
        let p = h.admin.recv_pdu_raw().expect("the connection survived");
        let ch = CommonHeader::decode(&p);
        if ch.pdu_type != pdu_type::CAPSULE_RESP {
            continue;
        }
        let c = Completion::decode(&p[tcp::CH_LEN..]);
        if c.cid == aer {
            event = Some(c);
        } else {
            assert_eq!(c.status >> 1, 0, "{c:?}");
            identified += 1;
        }
    }
    sender.join().unwrap().unwrap();
    let c = event.unwrap();
    assert_eq!(
        c.dw0,
        aen::dw0(
            aen::TYPE_NOTICE,
            aen::INFO_NS_ATTR_CHANGED,
            lid::CHANGED_NS_LIST
        )
    );
}

/// `remote_attach` to a shelf that accepts the connection and never answers: the attach
/// waits (up to 15 s), other RPCs do not.
#[test]
fn a_silent_shelf_does_not_hold_the_control_plane() {
    let n = Arc::new(Nacred::start_args(&["--no-default"]));
    let shelf = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = shelf.local_addr().unwrap().port();
    let done = Arc::new(AtomicBool::new(false));
    let attach = std::thread::spawn({
        let (n, done) = (n.clone(), done.clone());
        move || {
            let r = n.call(
                "remote_attach",
                json!({"name": "silent", "address": "127.0.0.1", "port": port,
                       "subnqn": "nqn.2024-01.io.nacre:silent-shelf"}),
            );
            done.store(true, Ordering::SeqCst);
            r
        }
    });
    // nacred is inside remote_attach once it has connected to the shelf.
    let (conn, _) = shelf.accept().unwrap();
    n.ok("volume_list", json!({}));
    let listed = n.ok("remote_list", json!({}));
    assert!(
        !done.load(Ordering::SeqCst),
        "other RPCs waited for remote_attach to give up"
    );
    assert_eq!(listed.as_array().map(|a| a.len()), Some(0));
    // The same name cannot be attached twice while the first attach runs.
    let (_, msg) = n.err(
        "remote_attach",
        json!({"name": "silent", "address": "127.0.0.1", "port": port,
               "subnqn": "nqn.2024-01.io.nacre:other"}),
    );
    assert!(msg.contains("silent"), "{msg}");
    drop(conn);
    drop(shelf);
    assert!(
        attach.join().unwrap().is_err(),
        "attach to a shelf that never answered succeeded"
    );
    assert_eq!(
        n.ok("remote_list", json!({})).as_array().map(|a| a.len()),
        Some(0)
    );
}

/// A PDU that arrives in parts while nacred is stopped and continued (SIGSTOP/SIGCONT, as a
/// debugger or a cgroup freezer does): a read with a timeout returns EINTR afterwards,
/// which must not end the connection. (The per-PDU deadline was first landed treating every
/// read error as the host leaving; in the test bed the guest kernel then saw a healthy
/// queue drop in the middle of a transfer.)
#[test]
fn a_pdu_split_across_a_stop_and_continue_of_nacred_is_served() {
    let n = Nacred::start_args(&["--no-default"]);
    let addr = setup(&n);
    let mut h = NvmfHost::connect(addr, NQN, host("sigstop")).unwrap();
    let mut cmd = Command::rw(
        io_opcode::WRITE,
        0x77,
        1,
        40,
        8,
        SglDescriptor::in_capsule(4096),
    );
    cmd.flags |= PSDT_SGL;
    let mut pdu = Vec::new();
    tcp::encode_capsule_cmd(&mut pdu, &cmd, &[0xC3; 4096], Digests::NONE, 0);
    let mut s = h.io[0].socket().try_clone().unwrap();
    s.write_all(&pdu[..100]).unwrap();
    let pid = n.pid() as i32;
    for _ in 0..20 {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        std::thread::sleep(Duration::from_millis(20));
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        std::thread::sleep(Duration::from_millis(20));
    }
    s.write_all(&pdu[100..]).unwrap();
    h.io[0]
        .socket()
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let p = h.io[0].recv_pdu_raw().expect("the queue survived");
    assert_eq!(p[0], pdu_type::CAPSULE_RESP);
    let c = Completion::decode(&p[tcp::CH_LEN..]);
    assert_eq!((c.cid, c.status >> 1), (0x77, 0));
    assert_eq!(h.read(0, 1, 40, 8, 512).unwrap(), vec![0xC3; 4096]);
}

#[test]
fn a_setup_cap_of_zero_is_refused_on_the_command_line() {
    // 0 would let no connection set up: nacred says so and does not start.
    let out = std::process::Command::new(nacre_tests::daemon::bin("nacred"))
        .args(["--no-default", "--nvmf-max-setup-connections", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--nvmf-max-setup-connections") && err.contains("at least 1"),
        "{err}"
    );
}
