//! Following one request through nacred: with `--log info,nacre::io=trace`, a
//! write and a read of an encrypted remote volume served over vhost-user-blk can each be
//! followed from the frontend through the QoS layer and the crypto layer to the NVMe/TCP
//! command on the wire, and back from the controller's completion through decryption to
//! the frontend, by the identifiers the lines share (dpu/src/telemetry/trace.rs); and the same
//! for a read through the NVMe/TCP frontend.
//!
//! Real peers: the storage shelf is nacre's NVMe/TCP target in this process (a RAM volume),
//! the client is libblkio over vhost-user-blk.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::ram::RamVolume;
use nacre_tests::blkio_client::{read, write, BlkioClient, ClientOptions};
use nacre_tests::daemon::Nacred;
use nacre_tests::fabric_support::pattern;
use nacre_tests::nvmf_host::{HostOptions, NvmfHost};
use serde_json::json;

const NQN: &str = "nqn.2024-01.io.nacre:trace-shelf";

/// `key=value` from a log line (value up to the next space, `}` or `,`; quotes kept).
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!("{key}=");
    let mut from = 0;
    while let Some(i) = line[from..].find(&pat) {
        let at = from + i;
        // A whole key, not the tail of a longer one.
        let whole = at == 0 || matches!(line.as_bytes()[at - 1], b' ' | b'{' | b',');
        let v = &line[at + pat.len()..];
        if whole {
            let end = v.find([' ', '}', ',']).unwrap_or(v.len());
            return Some(&v[..end]);
        }
        from = at + pat.len();
    }
    None
}

/// The spans a line was logged in, outermost first: `name{fields}` up to the target.
fn spans(line: &str) -> Vec<&str> {
    let Some(end) = line.find(": nacre::io:") else {
        return Vec::new();
    };
    let head = &line[..end];
    // The span chain starts after the level.
    let start = head.find("TRACE ").map(|i| i + 6).unwrap_or(0);
    head[start..]
        .split("}:")
        .map(|s| s.split('{').next().unwrap_or(""))
        .collect()
}

#[test]
fn a_request_is_followed_from_the_frontend_to_the_wire_and_back() {
    let shelf_vol = Arc::new(RamVolume::new(8 << 20, 4096).unwrap());
    let target = NvmfTarget::new();
    target
        .create_subsystem(NQN, "TRACESHELF", "nacre shelf", true)
        .unwrap();
    target
        .add_namespace(NQN, Some(1), shelf_vol, [0x42; 16], "v".into())
        .unwrap();
    let addr = target
        .add_listener(NQN, "127.0.0.1:0".parse().unwrap())
        .unwrap();

    let n = Nacred::start_args(&["--no-default", "--log", "info,nacre::io=trace"]);
    let tmp = tempfile::tempdir().unwrap();
    let kek = tmp.path().join("t.kek");
    std::fs::write(&kek, pattern(3, 0, 32)).unwrap();
    n.ok(
        "tenant_create",
        json!({"name": "t", "kek": {"key_file": kek}}),
    );
    n.ok(
        "remote_attach",
        json!({"name": "shelf", "address": "127.0.0.1", "port": addr.port(), "subnqn": NQN,
               "io_queues": 1, "queue_depth": 8}),
    );
    n.ok(
        "volume_create",
        json!({"name": "ev", "backend": "remote", "size": 0, "tenant": "t", "encrypt": true,
               "remote": {"extents": ["shelf:1"]}}),
    );
    n.ok("vhost_blk_create", json!({"name": "ev", "volume": "ev"}));
    let data = pattern(9, 0, 4096);
    {
        let mut c =
            BlkioClient::connect(&n.run_dir.join("vhost-ev.sock"), &ClientOptions::default())
                .unwrap();
        let mut q = c.take_queues().remove(0);
        let buf = &mut c.mem()[..4096];
        buf.copy_from_slice(&data);
        assert_eq!(write(&mut q, 1 << 20, buf).unwrap(), 0);
        buf.fill(0);
        assert_eq!(read(&mut q, 1 << 20, buf).unwrap(), 0);
        assert!(buf[..] == data[..]);
    }

    // The same volume as an NVMe-oF namespace, read by an NVMe/TCP host: block 256 is the
    // byte offset written above.
    let nqn = "nqn.2024-01.io.nacre:trace-export";
    let addr = n.export_nvmf(nqn, "ev");
    let mut h = NvmfHost::connect(addr, nqn, HostOptions::default()).unwrap();
    assert_eq!(h.read(0, 1, 256, 1, 4096).unwrap(), data);

    // The trace lines are written as the requests run; give the log a moment to settle.
    let deadline = Instant::now() + Duration::from_secs(10);
    let log = loop {
        let log = n.log_text();
        if (log.lines().filter(|l| l.contains("vhost: done")).count() >= 2
            && log.contains("nvmf: done"))
            || Instant::now() > deadline
        {
            break log;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let io: Vec<&str> = log.lines().filter(|l| l.contains(" nacre::io: ")).collect();
    let show = || io.join("\n");

    // The write: one line on the submitting thread carries the whole chain, down to the
    // NVMe Write (opcode 1) sent with a command identifier.
    // The vhost-user-blk command with this NVMe opcode at byte offset 1 MiB, sent to the shelf.
    let sent = |opcode: &str| -> &str {
        let l = io
            .iter()
            .find(|l| {
                l.contains("fabric: command sent")
                    && field(l, "opcode") == Some(opcode)
                    && field(l, "offset") == Some("1048576")
            })
            .unwrap_or_else(|| panic!("no traced command with opcode {opcode}\n{}", show()));
        assert_eq!(spans(l), ["vhost", "volume", "crypt"], "{l}");
        l
    };
    let sent_write = sent("1");
    assert_eq!(
        field(sent_write, "step"),
        Some("\"encrypt\""),
        "{sent_write}"
    );
    assert_eq!(field(sent_write, "volume"), Some("\"ev\""), "{sent_write}");
    let write_head = field(sent_write, "head").unwrap();

    // The read: its command on the wire, then its completion (same fabric qid and cid)
    // decrypted and handed to the vhost queue worker for the same descriptor head, and the
    // worker's "done" for that head with its latency.
    let sent_read = sent("2");
    assert_eq!(field(sent_read, "step"), Some("\"read\""), "{sent_read}");
    let read_head = field(sent_read, "head").unwrap();
    let (qid, cid) = (
        field(sent_read, "qid").unwrap(),
        field(sent_read, "cid").unwrap(),
    );
    let sent_at = io.iter().position(|l| *l == sent_read).unwrap();
    let back = io[sent_at..]
        .iter()
        .find(|l| l.contains("vhost: completion queued") && field(l, "head") == Some(read_head))
        .unwrap_or_else(|| panic!("read completion not traced\n{}", show()));
    assert_eq!(spans(back), ["fabric_cpl", "crypt"], "{back}");
    assert_eq!(field(back, "step"), Some("\"decrypt\""), "{back}");
    // The fabric_cpl span's fields come first on the line: they are the completion's.
    assert_eq!(field(back, "qid"), Some(qid), "{back}");
    assert_eq!(field(back, "cid"), Some(cid), "{back}");
    assert_eq!(
        (field(back, "sct"), field(back, "sc")),
        (Some("0"), Some("0")),
        "{back}"
    );
    let done = io[sent_at..]
        .iter()
        .find(|l| l.contains("vhost: done") && field(l, "head") == Some(read_head))
        .unwrap_or_else(|| panic!("no done line for the read\n{}", show()));
    let latency: f64 = field(done, "latency_us")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no latency on {done}"));
    assert!(latency > 0.0, "{done}");
    assert_eq!(field(done, "status"), Some("0"), "{done}");
    // And the write's done line exists for its head too.
    assert!(
        io.iter()
            .any(|l| l.contains("vhost: done") && field(l, "head") == Some(write_head)),
        "{}",
        show()
    );

    // The NVMe/TCP frontend: its read's command to the shelf runs in its `nvmf` span (the
    // host's queue and command identifier), and its "done" names the same pair.
    let nvmf_read = io
        .iter()
        .find(|l| {
            l.contains("fabric: command sent")
                && field(l, "opcode") == Some("2")
                && spans(l).first() == Some(&"nvmf")
        })
        .unwrap_or_else(|| panic!("no traced NVMe/TCP read\n{}", show()));
    assert_eq!(spans(nvmf_read), ["nvmf", "volume", "crypt"], "{nvmf_read}");
    let host_cid = field(nvmf_read, "cid").unwrap();
    assert!(
        io.iter().any(|l| l.contains("nvmf: done")
            && l.contains(&format!(" cid={host_cid} "))
            && field(l, "latency_us").is_some()),
        "{}",
        show()
    );
}
