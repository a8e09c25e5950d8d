//! The real nacred daemon serving vhost-user-blk to libblkio: the embedded default, devices
//! made over RPC, and acknowledged writes that survive a crash of nacred.

use nacre_tests::blkio_client::{read, write, BlkioClient, ClientOptions};
use nacre_tests::daemon::Nacred;
use serde_json::json;

/// A pattern unique to (queue, offset) so misplaced blocks cannot compare equal.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

const CHUNK: usize = 64 << 10;

/// Write a distinct chunk from each queue at spread offsets; return (offset, data).
fn write_spread(c: &mut BlkioClient, round: u64) -> Vec<(u64, Vec<u8>)> {
    let mut queues = c.take_queues();
    let mem = c.mem();
    let mut written = Vec::new();
    for (qi, q) in queues.iter_mut().enumerate() {
        for k in 0..8u64 {
            let off = (k * 127 + qi as u64 * 31 + round * 7) % 16_000 * 65536;
            let data = pattern(round << 32 | (qi as u64) << 16 | k, CHUNK);
            let buf = &mut mem[qi * CHUNK..(qi + 1) * CHUNK];
            buf.copy_from_slice(&data);
            assert_eq!(write(q, off, buf).unwrap(), 0, "write q{qi} @{off}");
            written.retain(|(o, _): &(u64, Vec<u8>)| *o != off);
            written.push((off, data));
        }
    }
    c.queues = queues;
    written
}

fn verify(c: &mut BlkioClient, expect: &[(u64, Vec<u8>)]) {
    let mut queues = c.take_queues();
    let mem = c.mem();
    for (i, (off, data)) in expect.iter().enumerate() {
        let qi = i % queues.len();
        let buf = &mut mem[qi * CHUNK..(qi + 1) * CHUNK];
        buf.fill(0xEE);
        assert_eq!(read(&mut queues[qi], *off, buf).unwrap(), 0);
        assert!(buf[..] == data[..], "data at {off} differs after reconnect");
    }
    c.queues = queues;
}

fn opts(queues: usize) -> ClientOptions {
    ClientOptions {
        queues,
        ..Default::default()
    }
}

#[test]
fn embedded_default_survives_a_crash_of_nacred() {
    let mut n = Nacred::start();
    let sock = n.run_dir.join("vhost-default.sock");
    let mut c = BlkioClient::connect(&sock, &opts(4)).unwrap();
    assert_eq!(c.capacity().unwrap(), 1 << 30);
    let written = write_spread(&mut c, 1);
    // No flush: an acknowledged write must survive a crash of the daemon.
    n.crash_restart();
    drop(c);
    let mut c = BlkioClient::connect(&sock, &opts(4))
        .unwrap_or_else(|e| panic!("reconnect: {e}\n{}", n.log_text()));
    verify(&mut c, &written);
    // And an orderly restart while a client is connected.
    let more = write_spread(&mut c, 2);
    n.restart();
    drop(c);
    let mut c = BlkioClient::connect(&sock, &opts(2)).unwrap();
    let mut all = written;
    for (o, d) in more {
        all.retain(|(x, _)| *x != o);
        all.push((o, d));
    }
    verify(&mut c, &all);
}

/// A nacred without the embedded default, serving a 1 GiB file volume `volume` (512-byte
/// blocks) as vhost-user-blk device `d` with two queues, made over RPC.
fn nacred_with_device(volume: &str) -> Nacred {
    let n = Nacred::start_args(&["--no-default"]);
    n.ok(
        "volume_create",
        json!({"name": volume, "size": 1 << 30, "block_size": 512}),
    );
    n.ok(
        "vhost_blk_create",
        json!({"name": "d", "volume": volume, "queues": 2}),
    );
    n
}

#[test]
fn devices_made_over_rpc_serve_and_come_back() {
    let mut n = nacred_with_device("f");
    n.ok(
        "vhost_blk_create",
        json!({"name": "ro", "volume": "f", "queues": 1, "read_only": true}),
    );
    let sock = n.run_dir.join("vhost-d.sock");
    let mut c = BlkioClient::connect(&sock, &opts(2)).unwrap();
    // Marked connected once the accepting thread has handed the client on, which may be
    // after the client is done negotiating.
    let connected = || {
        let devs = n.ok("vhost_blk_list", json!({}));
        let d = devs
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == "d")
            .cloned();
        d.unwrap()["connected"] == true
    };
    let t = std::time::Instant::now();
    while !connected() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "never listed as connected"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let written = write_spread(&mut c, 3);
    drop(c);
    // The read-only device sees the same data and refuses writes.
    let mut ro = BlkioClient::connect(
        &n.run_dir.join("vhost-ro.sock"),
        &ClientOptions {
            queues: 1,
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    verify(&mut ro, &written[..4]);
    drop(ro);
    n.crash_restart();
    let mut c = BlkioClient::connect(&sock, &opts(2)).unwrap();
    verify(&mut c, &written);
    drop(c);
    // Deleting the device disconnects nothing else and removes the socket.
    n.ok("vhost_blk_delete", json!({"name": "d"}));
    assert!(!sock.exists());
    assert!(BlkioClient::connect(&sock, &opts(1)).is_err());
}

/// A client that connects, does I/O and goes away, again and again (a VM rebooting, a libblkio
/// job per epoch), must not leave descriptors or threads behind in nacred: each connection
/// gets fresh kick/call eventfds, worker threads with exit events, a memory table. A leak of
/// one fd per connection ends a long-lived daemon with EMFILE.
#[test]
fn reconnecting_clients_leak_no_descriptors_or_threads() {
    let n = nacred_with_device("v");
    let sock = n.run_dir.join("vhost-d.sock");
    let cycle = |round: u64| {
        let mut c = BlkioClient::connect(&sock, &opts(2))
            .unwrap_or_else(|e| panic!("connect {round}: {e}\n{}", n.log_text()));
        let written = write_spread(&mut c, round);
        verify(&mut c, &written[..2]);
    };
    // The device is back to waiting for a client.
    let idle = || n.ok("vhost_blk_list", json!({}))[0]["connected"] == false;
    // The first connection may allocate what later ones reuse.
    cycle(0);
    let before = n.settled_footprint(idle);
    const ROUNDS: u64 = 25;
    for round in 1..=ROUNDS {
        cycle(round);
    }
    let after = n.footprint_back_to(before, idle);
    after.assert_no_more_than(before, ROUNDS as usize, "connections");
}

/// nacred's open-file limit (soft, hard), from /proc.
fn fd_limits(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files line");
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (v[0], v[1])
}

/// Started by a service manager with the usual soft limit of 1,024 open files (or less),
/// nacred raises it to the hard limit: every VM queue and NVMe-oF queue holds descriptors. A
/// hard limit that is itself low is logged as a warning an operator can act on.
#[test]
fn nacred_raises_its_open_file_limit() {
    // A hard limit can be lowered but not raised without privilege: stay under the test's own.
    let own_hard = fd_limits(std::process::id()).1;
    let hard = own_hard.min(8192);
    let n = Nacred::start_with_fd_limit(&["--no-default"], 256, hard);
    assert_eq!(fd_limits(n.pid()), (hard, hard));
    assert!(
        n.log_text().contains("raised the open-file limit"),
        "{}",
        n.log_text()
    );
    let low_hard = own_hard.min(1024);
    let low = Nacred::start_with_fd_limit(&["--no-default"], 512.min(low_hard), low_hard);
    assert_eq!(fd_limits(low.pid()), (low_hard, low_hard));
    assert!(
        low.log_text().contains("open-file limit is low"),
        "{}",
        low.log_text()
    );
}
