//! End-to-end tests in the QEMU test bed (`scripts/testbed`): Debian's kernel in a TCG guest plays
//! the host (nvme-tcp, virtio-blk, dm-crypt) against real peers. Each test boots as few guests as
//! it can and checks several things per boot; the guest side is `scripts/testbed.d/<scenario>.sh`.
//!
//! The first test to run installs the bed (apt-get, kernel download: a minute or two); later runs
//! use the cache in `target/testbed`. Set NACRE_SKIP_TESTBED=1 on a machine without QEMU.

use std::time::Duration;

use std::sync::Arc;

use nacre_dpu::crypto::{volume::EncryptedVolume, EncryptionPolicy, XtsKey};
use nacre_dpu::volume::{file::FileVolume, BlockDevice};
use nacre_tests::daemon::Nacred;
use nacre_tests::testbed::{self, Boot};

const MIB: u64 = 1 << 20;

fn prepare(test: &str) -> Option<std::sync::MutexGuard<'static, ()>> {
    if testbed::skipped(test) {
        return None;
    }
    let guard = testbed::exclusive();
    testbed::setup().expect("scripts/testbed setup");
    Some(guard)
}

fn log_tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// What a test prints when a guest did not get where it should in time: the guest's log, nacred's
/// log, and where every thread of QEMU and of nacred stands (a hang in a vhost-user handshake
/// shows up as QEMU waiting in `vhost_user_read` and nacred's thread that should answer).
struct StuckReport {
    qemu_stacks: String,
    text: String,
}

fn stuck_report(guest: &testbed::Guest, d: &Nacred, err: &anyhow::Error) -> StuckReport {
    let qemu_stacks = guest
        .qemu_pid()
        .map(testbed::thread_stacks)
        .unwrap_or_else(|| "(QEMU not started)".into());
    let text = format!(
        "{err}\nguest log tail:\n{}\nnacred log tail:\n{}\nQEMU threads:\n{qemu_stacks}\nnacred threads:\n{}",
        log_tail(&guest.lines().join("\n"), 40),
        log_tail(&d.log_text(), 60),
        testbed::thread_stacks(d.pid()),
    );
    StuckReport { qemu_stacks, text }
}

/// Boot a guest that nacred serves and wait for its init to start (`TB-INIT`, 3-10 s under
/// TCG). If it has not started after 90 s, look at where QEMU is: a thread inside vhost code
/// means QEMU is waiting for nacred to answer, which is nacred's fault, and fails the test. A
/// guest stuck anywhere else (the emulator, the kernel before init: CI saw one verify boot print
/// nothing for 150 s, which 11 full runs and 40 back-to-back boots here did not reproduce) is
/// reported on stderr and booted once more; a second such hang fails the test.
fn boot_served(make: impl Fn() -> Boot, d: &Nacred) -> testbed::Guest {
    for attempt in 1..=2 {
        let guest = make().spawn().expect("boot");
        let Err(e) = guest.wait_for("TB-INIT", Duration::from_secs(90)) else {
            return guest;
        };
        let report = stuck_report(&guest, d, &e);
        // Debian's QEMU is stripped of static symbols, but a wait for a vhost-user reply always
        // passes through an exported vhost_* frame (vhost_dev_init, vhost_dev_start, ...).
        if report.qemu_stacks.contains("vhost") || attempt == 2 {
            panic!(
                "guest never reached its init (attempt {attempt}):\n{}",
                report.text
            );
        }
        eprintln!(
            "guest never reached its init; QEMU is not waiting for nacred; booting again\n{}",
            report.text
        );
    }
    unreachable!()
}

/// The bed itself: kernel nvmet-tcp target and nvme-tcp host inside one guest on 127.0.0.1.
#[test]
fn kernel_selftest() {
    let Some(_bed) = prepare("kernel_selftest") else {
        return;
    };
    let out = Boot::new("kernel-selftest").run().expect("boot");
    out.assert_success();
    assert_eq!(
        out.fact("discovered"),
        "nqn.2014-08.io.nacre.testbed:selftest"
    );
    for digests in ["off", "on"] {
        assert_eq!(out.fact(&format!("transport_{digests}")), "tcp");
        assert_eq!(out.fact(&format!("model_{digests}")), "Linux");
        assert_eq!(
            out.fact(&format!("ns1_bytes_{digests}")),
            (1024 * MIB).to_string()
        );
        assert_eq!(
            out.fact(&format!("ns2_bytes_{digests}")),
            (64 * MIB).to_string()
        );
        assert_eq!(out.fact(&format!("io_queues_{digests}")), "2");
        assert_eq!(out.fact(&format!("verified_{digests}")), "16MiB");
    }
}

/// Soft-RoCE works in the bed (for the fabric's RDMA transport): rdma_rxe on a dummy netdev,
/// libibverbs sees the device, and the kernel nvme-rdma host reads and writes a kernel
/// nvmet-rdma target over RoCEv2 inside one guest.
#[test]
fn rdma_selftest() {
    let Some(_bed) = prepare("rdma_selftest") else {
        return;
    };
    let out = Boot::new("rdma-selftest").run().expect("boot");
    out.assert_success();
    assert_eq!(out.fact("rdma_link"), "rxe0/1");
    assert_eq!(out.fact("ibv_device"), "rxe0");
    assert_eq!(out.fact("transport"), "rdma");
    assert_eq!(out.fact("io_queues"), "2");
    assert_eq!(out.fact("verified"), "16MiB");
}

/// nacred's NVMe/RDMA target, running inside the guest (its binary and libraries packed into
/// the initramfs) on soft-RoCE, against the kernel's nvme-rdma host: an RDMA listener on an
/// address no RDMA device has is refused with one error line; a misbehaving host
/// (`rdma-cm-probe`) gets RDMA_CM_REJECT with the right status for bad private data, SGL
/// Descriptor Type Invalid for a Segment SGL, and a closed queue (nothing else) for an rkey it
/// never issued, and a queue that never sends Connect is closed after the 30 s setup timeout;
/// discovery over RDMA lists the subsystem with trtype rdma; `nvme list` shows
/// nacre's model and serial; a 32 MiB O_DIRECT write/read/compare passes over two I/O queues;
/// 4 KiB writes (in the capsule), Write Zeroes (read back as zeroes) and Dataset Management
/// work; data survives a disconnect and reconnect; every queue gave back its thread and
/// descriptors, and nacred is still alive; restarted, it listens again from its saved state;
/// restarted with per-listener caps, a second silent queue evicts the first and a full
/// listener rejects a third queue while its two serve; started before its RDMA device exists,
/// nacred retries the saved listener until the device comes up, then serves on it.
#[test]
fn nvme_rdma_against_nacred() {
    let Some(_bed) = prepare("nvme_rdma_against_nacred") else {
        return;
    };
    let out = Boot::new("nvmf-rdma-target")
        .pack(nacre_tests::daemon::bin("nacred"))
        .pack(nacre_tests::daemon::bin("nacre"))
        .pack(nacre_tests::daemon::bin("rdma-cm-probe"))
        .timeout(Duration::from_secs(600))
        .run()
        .expect("boot");
    out.assert_success();
    assert_eq!(out.fact("bad_listener"), "refused");
    // RDMA_CM_REJECT statuses (NVMe RDMA Transport 1.0 Figure 7).
    assert_eq!(out.fact("probe_recfmt"), "rejected,status=2");
    assert_eq!(out.fact("probe_qid"), "rejected,status=3");
    assert_eq!(out.fact("probe_hsqsize"), "rejected,status=4");
    let sgl = nacre_shared::nvme::Status::SGL_DESCRIPTOR_TYPE_INVALID.to_field();
    assert_eq!(
        out.fact("probe_bad_sgl"),
        format!(
            "response,cid=7,sct={},sc={:#04x}",
            (sgl >> 9) & 7,
            (sgl >> 1) & 0xFF
        )
    );
    assert_eq!(out.fact("probe_bad_key"), "closed");
    // A queue that never sends Connect is closed after the setup timeout (30 s), not before
    // (timed from the host's connect request, so a slow machine only makes it longer; the
    // probe itself gives up at 90 s).
    assert_eq!(out.fact("probe_idle"), "closed");
    let after: u64 = out
        .fact("idle_closed_after_s")
        .trim_end_matches('s')
        .parse()
        .expect("seconds");
    assert!((30..90).contains(&after), "closed after {after} s");
    assert_eq!(out.fact("discovered_trtype"), "rdma");
    assert_eq!(out.fact("transport"), "rdma");
    assert_eq!(out.fact("model"), "nacre");
    assert_eq!(out.fact("serial"), "NACRE-RDMA-1");
    assert_eq!(out.fact("io_queues"), "2");
    assert_eq!(out.fact("ns1_bytes"), (64 * MIB).to_string());
    assert_eq!(out.fact("verified"), "32MiB");
    assert_eq!(out.fact("small_writes"), "8x4KiB");
    assert_eq!(out.fact("zeroed"), "1MiB");
    assert_eq!(out.fact("discarded"), "1MiB");
    assert_eq!(out.fact("reverified"), "4MiB");
    assert_eq!(out.fact("leaked"), "none");
    assert_eq!(out.fact("nacred_alive"), "yes");
    assert_eq!(out.fact("replayed"), "yes");
    // Per-listener caps (nacred restarted with 2 queues per listener, 1 short of Connect):
    // a second silent queue evicts the first at once, a full listener rejects with
    // "no resources" (Figure 7: 6) while its two queues keep serving.
    assert_eq!(out.fact("cap_evicted"), "closed");
    assert_eq!(out.fact("cap_rejected"), "rejected,status=6");
    assert_eq!(out.fact("cap_served"), "yes");
    // Started before rxe0 exists, nacred lists the saved RDMA listener as failed and retried,
    // and once the device is up the retry makes it listen and serve.
    assert_eq!(out.fact("retry_failed_first"), "yes");
    assert_eq!(out.fact("retry_served"), "yes");
}

/// nacred's NVMe/RDMA initiator against an independent target: the kernel's nvmet-rdma over
/// soft-RoCE (rxe loopback in one guest, nacred packed into it). nacred attaches the target with
/// `nacre remote attach --transport rdma` and serves a plain and an encrypted volume on its
/// NVMe/TCP target to the kernel's nvme-tcp host; the plain data verifies end to end and lands
/// as written on the target's RAM disk, and the encrypted volume's RAM disk holds exactly the
/// ciphertext the independent Python XTS oracle computes for the known pattern. Then an RDMA CM
/// reject and an address nothing answers each give one clear line.
#[test]
fn nvme_rdma_initiator_against_the_kernel_nvmet_rdma_target() {
    let Some(_bed) = prepare("nvme_rdma_initiator_against_the_kernel_nvmet_rdma_target") else {
        return;
    };
    let started = std::time::Instant::now();
    let out = Boot::new("nvmf-rdma-initiator")
        .pack(nacre_tests::daemon::bin("nacred"))
        .pack(nacre_tests::daemon::bin("nacre"))
        .pack(nacre_tests::daemon::bin("vhost-verify"))
        .param("mib", 4)
        .timeout(Duration::from_secs(500))
        .run()
        .expect("boot");
    eprintln!(
        "nvmf-rdma-initiator: {:.0} s",
        started.elapsed().as_secs_f64()
    );
    out.assert_success();
    assert_eq!(out.fact("attached"), "live");
    assert_eq!(out.fact("transport"), "rdma");
    assert_eq!(out.fact("io_queues"), "2");
    assert_eq!(out.fact("namespaces"), "2");
    assert_eq!(out.fact("plain_verified"), "4MiB");
    assert_eq!(out.fact("plain_backing"), "match");
    // nvmet-rdma's default inline data (a page): 4 KiB writes travel in the capsule, and the
    // queues counted exactly the eight the guest wrote.
    assert_eq!(out.fact("io_icd_max"), "4096");
    assert_eq!(out.fact("small_writes"), "8x4KiB");
    // 8 from the kernel host's 4 KiB writes, 256 from vhost-verify's (zero copy below).
    assert_eq!(out.fact("in_capsule_writes"), "264");
    // Zero copy: vhost-user-blk requests from libblkio, plain (2 MiB in
    // 128 KiB requests, 1 MiB in 4 KiB ones, in the capsule) and encrypted (1 MiB): no byte
    // is copied through the queues' slot buffers, and every byte (written and read back)
    // moves straight between the target and guest memory or the ciphertext buffers.
    assert_eq!(out.fact("zc_bounce_bytes"), "0");
    let direct: u64 = out.fact("zc_direct_bytes").parse().expect("bytes");
    assert!(direct >= 8 * MIB, "moved directly: {direct}");
    // Registered once per region and device (the queues share a protection domain), not
    // once per queue: at least the three guest memory tables, each once.
    let regions: u64 = out.fact("zc_regions").parse().expect("count");
    assert!(regions >= 3, "regions registered: {regions}");
    assert_eq!(out.fact("zc_registrations"), out.fact("zc_regions"));
    // Counted in remote_list: at least the 4 + 1 MiB written and the 4 MiB read back, since
    // every transfer is copied through the queues' registered buffers (no zero copy there).
    let bounced: u64 = out.fact("bounce_copy_bytes").parse().expect("bytes");
    assert!(bounced >= 9 * MIB, "bounce copies counted: {bounced}");
    // A stripe over both RDMA-attached namespaces: each 128 KiB unit on the RAM disk the
    // layout names.
    assert_eq!(out.fact("stripe_verified"), "1MiB");
    assert_eq!(out.fact("enc_readback"), "ok");
    assert_eq!(out.fact("discovered_transport"), "rdma");

    // The pattern the guest wrote: 65536 lines "%015d\n", 1 MiB, at byte 1 MiB of the volume.
    let pattern: Vec<u8> = (0..65536u32)
        .flat_map(|i| format!("{i:015}\n").into_bytes())
        .collect();
    assert_eq!(
        out.fact("enc_pattern_sha"),
        testbed::sha256(&pattern).unwrap(),
        "the guest's pattern is not the one computed here"
    );
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("xts.key");
    let hex = out.fact("enc_key");
    assert_eq!(hex.len(), 128, "a 64-byte AES-256-XTS key: {hex}");
    std::fs::write(&key, nacre_tests::xts_oracle::hex(&hex)).unwrap();
    let plain = dir.path().join("plain.bin");
    let cipher = dir.path().join("cipher.bin");
    std::fs::write(&plain, &pattern).unwrap();
    testbed::xts_oracle_run("encrypt", &key, &plain, &cipher, 512, MIB / 512).expect("oracle");
    let expect = testbed::sha256(&std::fs::read(&cipher).unwrap()).unwrap();
    let got = out.fact("enc_backing_sha");
    assert_ne!(
        got,
        out.fact("enc_pattern_sha"),
        "the target holds plaintext"
    );
    assert_eq!(
        got, expect,
        "the target's bytes are not the oracle's ciphertext"
    );

    // No listener on the port: the CM's own reject, reason 8 (invalid service ID).
    assert_eq!(out.fact("reject_error"), "RDMA_CM_reject_reason_8");
    assert_eq!(out.fact("unreachable_error"), "yes");
    // nacred's own RDMA target as the peer: its reject's NVMe RDMA status is named.
    assert_eq!(out.fact("status_reject"), "NVME_RDMA_CM_INVALID_HSQSIZE");
    assert_eq!(out.fact("self_namespaces"), "3");
    assert_eq!(out.fact("nacred_alive"), "yes");
    // Restarted, nacred attaches the remote over RDMA again from its state.
    assert_eq!(out.fact("replayed"), "yes");
}

/// nacred's NVMe/RDMA initiator when the kernel's nvmet-rdma target goes away (soft-RoCE, one
/// guest; reconnect_delay 1 s, ctrl_loss_timeout 8 s): the target port removed mid-write and
/// restored 0.5 s later loses nothing (the write completes on a new session and reads back
/// identical); multipath over two RDMA controllers survives one port's removal; a controller
/// whose target went away is detached at once; a target gone for good gives the client an
/// Internal Path Error once fast_io_fail_timeout (4 s) has passed while reconnection goes on, and
/// the remote shows `failed` at ctrl_loss_timeout (8 s) while nacred keeps serving; from then on
/// the error carries Do Not Retry and a read through the host's block device fails.
#[test]
fn nvme_rdma_initiator_survives_a_target_flap_and_fails_cleanly_when_it_is_gone() {
    let Some(_bed) =
        prepare("nvme_rdma_initiator_survives_a_target_flap_and_fails_cleanly_when_it_is_gone")
    else {
        return;
    };
    let started = std::time::Instant::now();
    let out = Boot::new("nvmf-rdma-initiator-failure")
        .pack(nacre_tests::daemon::bin("nacred"))
        .pack(nacre_tests::daemon::bin("nacre"))
        .timeout(Duration::from_secs(400))
        .run()
        .expect("boot");
    eprintln!(
        "nvmf-rdma-initiator-failure: {:.0} s",
        started.elapsed().as_secs_f64()
    );
    out.assert_success();
    assert_eq!(
        out.fact("flap_in_flight"),
        "yes",
        "the write ended before the port went away: nothing was tested"
    );
    assert_eq!(out.fact("flap_verified"), "16MiB");
    let resets: u64 = out.fact("flap_resets").parse().expect("resets");
    assert!(
        resets >= 1,
        "the flap did not reset the controller: {resets}"
    );
    // Multipath composes over RDMA controllers: one path lost, I/O goes on on the other.
    assert_eq!(out.fact("mp_verified"), "4MiB");
    let mp: u64 = out.fact("mp_shelfb_resets").parse().expect("resets");
    assert!(
        mp >= 1,
        "the removed path's controller was never reset: {mp}"
    );
    // RoCE first, TCP as the fallback: a failover volume over an RDMA and a TCP path to the
    // same namespace keeps working with the RDMA port gone (the RDMA controller was still
    // reconnecting, so the TCP path carried it).
    assert_eq!(out.fact("mpx_verified"), "2MiB");
    assert_eq!(out.fact("mpx_rdma_state"), "connecting");
    let detach: f64 = out.fact("detach_s").parse().expect("seconds");
    assert!(detach < 1.0, "detaching a dead controller took {detach} s");
    // fast_io_fail_timeout (4 s) fails the held read while reconnection goes on; the
    // controller fails for good at ctrl_loss_timeout (8 s).
    let lost: f64 = out.fact("lost_error_s").parse().expect("seconds");
    assert!(
        (3.5..=7.0).contains(&lost),
        "the read failed after {lost} s, fast_io_fail_timeout is 4 s"
    );
    assert_eq!(out.fact("state_after_fast_fail"), "connecting");
    let failed: f64 = out.fact("lost_state_s").parse().expect("seconds");
    assert!(
        (7.5..=12.0).contains(&failed),
        "the remote failed after {failed} s, ctrl_loss_timeout is 8 s"
    );
    // Internal Path Error (SCT 3h, SC 00h), DNR clear while the remote reconnects: the host
    // may retry it.
    assert_eq!(out.fact("lost_status"), "0x300");
    assert_eq!(out.fact("lost_state"), "failed");
    // Failed for good: the same status with Do Not Retry (bit 14), so the kernel host's native
    // multipath ends a block-device read instead of requeueing it on its only path forever.
    // (The scenario fails if that read has not returned within 60 s.)
    assert_eq!(out.fact("failed_status"), "0x4300");
    eprintln!(
        "block-device read from the failed remote failed after {} s",
        out.fact("failed_blk_read_s")
    );
    assert_eq!(out.fact("nacred_alive"), "yes");
}

/// Real RoCEv2 between two machines: nacred's NVMe/RDMA target in one guest (rxe on its
/// virtio-net), the kernel's nvme-rdma host in another, joined by a QEMU socket netdev. The
/// host discovers and connects over RDMA, `nvme list` shows nacre, 16 MiB are written, read
/// back and compared with O_DIRECT; both guests' link counters show the data crossed the wire.
#[test]
fn nvme_rdma_between_two_guests() {
    let Some(_bed) = prepare("nvme_rdma_between_two_guests") else {
        return;
    };
    let port = testbed::free_port().expect("free port");
    let dpu = Boot::new("nvmf-rdma-dpu")
        .name("rdma-dpu")
        .pack(nacre_tests::daemon::bin("nacred"))
        .pack(nacre_tests::daemon::bin("nacre"))
        .ctl()
        .qemu([
            "-netdev".to_string(),
            format!("socket,id=n0,listen=127.0.0.1:{port}"),
            "-device".to_string(),
            "virtio-net-pci,netdev=n0,mac=52:54:00:c0:02:01".to_string(),
        ])
        .timeout(Duration::from_secs(600))
        .spawn()
        .expect("DPU guest");
    if let Err(e) = dpu.wait_for("TB-FACT ready=yes", Duration::from_secs(240)) {
        panic!(
            "nacred never served in the DPU guest: {e}
{}",
            dpu.lines().join("\n")
        );
    }
    let host = Boot::new("nvmf-rdma-remote")
        .name("rdma-host")
        .qemu([
            "-netdev".to_string(),
            format!("socket,id=n0,connect=127.0.0.1:{port}"),
            "-device".to_string(),
            "virtio-net-pci,netdev=n0,mac=52:54:00:c0:02:02".to_string(),
        ])
        .timeout(Duration::from_secs(400))
        .run()
        .expect("host guest");
    dpu.signal("done").expect("signal the DPU guest");
    let d = dpu.wait(Duration::from_secs(120)).expect("DPU guest ends");
    if !host.success() {
        panic!(
            "the host guest failed ({:?}):\n{}\n--- DPU guest:\n{}",
            host.code(),
            host.tail(60),
            d.tail(60)
        );
    }
    d.assert_success();
    assert_eq!(host.fact("discovered_trtype"), "rdma");
    assert_eq!(host.fact("transport"), "rdma");
    assert_eq!(host.fact("model"), "nacre");
    assert_eq!(host.fact("serial"), "NACRE-RDMA-2");
    assert_eq!(host.fact("verified"), "16MiB");
    assert_eq!(d.fact("nacred_alive"), "yes");
    // 16 MiB went each way over the link (RDMA READ of the writes, RDMA WRITE of the reads).
    for (who, out) in [("host", &host), ("dpu", &d)] {
        for dir in ["rx_mib", "tx_mib"] {
            let mib: u64 = out.fact(dir).parse().expect("MiB");
            assert!(
                mib >= 16,
                "{who} {dir} = {mib} MiB: the data did not cross the link"
            );
        }
    }
}

/// SIGSTOPs a guest's QEMU (a machine that goes silent without a word); SIGCONT on drop, so a
/// failing test never leaves a frozen QEMU behind.
struct Frozen(u32);

impl Frozen {
    fn freeze(pid: u32) -> Frozen {
        let ok = std::process::Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "cannot SIGSTOP QEMU {pid}");
        Frozen(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// nacred's NVMe/RDMA initiator over real RoCEv2 between two machines: nacred in one guest, the
/// kernel's nvmet-rdma target in another, joined by a QEMU socket netdev. nacred attaches the
/// target, serves a volume on it to the kernel's nvme-tcp host in its guest, and 8 MiB verify
/// across the wire (both link counters show it). Then the target's QEMU is frozen (SIGSTOP: a
/// target that goes silent, the case SPDK #1536 takes 33 s to tear down): detaching a live
/// controller of it takes under a second, and keep-alive (KATO 4 s) declares the other one lost.
#[test]
fn nvme_rdma_initiator_between_two_guests_and_a_target_that_goes_silent() {
    let Some(_bed) =
        prepare("nvme_rdma_initiator_between_two_guests_and_a_target_that_goes_silent")
    else {
        return;
    };
    let started = std::time::Instant::now();
    let port = testbed::free_port().expect("free port");
    let peer = Boot::new("nvmet-rdma-peer")
        .name("rdma-peer")
        .ctl()
        .qemu([
            "-netdev".to_string(),
            format!("socket,id=n0,listen=127.0.0.1:{port}"),
            "-device".to_string(),
            "virtio-net-pci,netdev=n0,mac=52:54:00:c0:03:01".to_string(),
        ])
        .timeout(Duration::from_secs(600))
        .spawn()
        .expect("target guest");
    if let Err(e) = peer.wait_for("TB-FACT ready=yes", Duration::from_secs(240)) {
        panic!(
            "the target guest never served: {e}\n{}",
            peer.lines().join("\n")
        );
    }
    let ini = Boot::new("nvmf-rdma-initiator-remote")
        .name("rdma-initiator")
        .pack(nacre_tests::daemon::bin("nacred"))
        .pack(nacre_tests::daemon::bin("nacre"))
        .param("mib", 8)
        .ctl()
        .qemu([
            "-netdev".to_string(),
            format!("socket,id=n0,connect=127.0.0.1:{port}"),
            "-device".to_string(),
            "virtio-net-pci,netdev=n0,mac=52:54:00:c0:03:02".to_string(),
        ])
        .timeout(Duration::from_secs(400))
        .spawn()
        .expect("nacred guest");
    if let Err(e) = ini.wait_for("TB-WAIT frozen", Duration::from_secs(300)) {
        panic!(
            "the nacred guest did not get to the freeze: {e}\n{}\n--- target guest:\n{}",
            ini.lines().join("\n"),
            peer.lines().join("\n")
        );
    }
    let frozen = Frozen::freeze(peer.qemu_pid().expect("target QEMU pid"));
    ini.signal("frozen").expect("signal the nacred guest");
    let out = ini
        .wait(Duration::from_secs(200))
        .expect("nacred guest ends");
    drop(frozen);
    peer.signal("done").expect("signal the target guest");
    let p = peer
        .wait(Duration::from_secs(120))
        .expect("target guest ends");
    eprintln!(
        "two-guest RDMA initiator test: {:.0} s",
        started.elapsed().as_secs_f64()
    );
    if !out.success() {
        panic!(
            "the nacred guest failed ({:?}):\n{}\n--- target guest:\n{}",
            out.code(),
            out.tail(80),
            p.tail(40)
        );
    }
    p.assert_success();
    assert_eq!(out.fact("attached"), "live");
    assert_eq!(out.fact("verified"), "8MiB");
    for (who, o) in [("nacred", &out), ("target", &p)] {
        for dir in ["rx_mib", "tx_mib"] {
            let mib: u64 = o.fact(dir).parse().expect("MiB");
            assert!(
                mib >= 8,
                "{who} {dir} = {mib} MiB: the data did not cross the link"
            );
        }
    }
    let detach: f64 = out.fact("silent_detach_s").parse().expect("seconds");
    assert!(
        detach < 1.0,
        "detaching a controller of a silent target took {detach} s"
    );
    let ka: f64 = out.fact("ka_lost_s").parse().expect("seconds");
    assert!(
        ka <= 10.0,
        "keep-alive (KATO 4 s) took {ka} s to declare the silent target lost"
    );
    assert_eq!(out.fact("nacred_alive"), "yes");
}

/// A guest's virtio-blk driver against nacred's vhost-user-blk devices: a device made with the
/// CLI (64 MiB file volume, 4 KiB blocks, 2 queues) and the embedded default (1 GiB) show up with
/// the right geometry; data written in one boot is on the volume's file and reads back intact
/// after a second boot against the same, still running, nacred; and when nacred is killed
/// (SIGKILL) and restarted under the running guest, QEMU reconnects and old data and new I/O
/// are fine.
#[test]
fn vhost_user_blk_nacred_survives_reboot() {
    let Some(_bed) = prepare("vhost_user_blk_nacred_survives_reboot") else {
        return;
    };
    let mut d = Nacred::start();
    let sock = d.run_dir.join("vm1.sock");
    let size = 64 * MIB;
    let queues = 2;
    let sock_arg = sock.display().to_string();
    for args in [
        vec!["volume", "create", "vm1", "--size", "64M"],
        vec![
            "vhost-blk",
            "create",
            "vm1",
            "--volume",
            "vm1",
            "--queues",
            "2",
            "--socket",
            &sock_arg,
        ],
    ] {
        let out = d.cli(&args);
        assert!(
            out.status.success(),
            "nacre {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let default_sock = d.run_dir.join("vhost-default.sock");
    let boot = |phase: &str| {
        Boot::new("vhost-user-blk")
            .name(&format!("vhost-user-blk-{phase}"))
            .param("phase", phase)
            .param("bytes", size)
            .param("queues", queues)
            .param("lbs", 4096)
            .param("mib", 8)
            .param("offset_mib", 1)
            .qemu(testbed::vhost_user_blk_args(
                &[(&sock, queues), (&default_sock, 2)],
                "1G",
            ))
            .timeout(Duration::from_secs(180))
    };
    let first = boot_served(|| boot("write"), &d)
        .wait(Duration::from_secs(240))
        .expect("first boot");
    assert!(
        first.success(),
        "{}\nnacred log tail:\n{}",
        first.tail(40),
        log_tail(&d.log_text(), 40)
    );
    assert_eq!(first.fact("bytes"), size.to_string());
    assert_eq!(first.fact("queues"), queues.to_string());
    assert_eq!(first.fact("logical_block_size"), "4096");
    assert_eq!(
        first.fact("vdb_bytes"),
        (1024 * MIB).to_string(),
        "the embedded default device"
    );
    let sha = first.fact("sha256");
    assert_eq!(sha.len(), 64, "sha256 fact: {sha}");
    // the volume's backing file holds what the guest wrote
    let image = d.state_dir.join("volumes/vm1.img");
    assert_eq!(
        testbed::sha256_of_range(&image, MIB, 8 * MIB).unwrap(),
        sha,
        "{}",
        image.display()
    );

    let second = boot_served(
        || {
            boot("verify")
                .param("sha256", &sha)
                .param("restart", 1)
                .ctl()
        },
        &d,
    );
    if let Err(e) = second.wait_for("TB-WAIT restarted", Duration::from_secs(150)) {
        panic!("{}", stuck_report(&second, &d, &e).text);
    }
    d.crash_restart();
    second.signal("restarted").expect("signal guest");
    let second = second.wait(Duration::from_secs(200)).expect("second boot");
    assert!(
        second.success(),
        "{}\nnacred log tail:\n{}",
        second.tail(40),
        log_tail(&d.log_text(), 40)
    );
    assert_eq!(second.fact("sha256"), sha);
    assert_eq!(second.fact("survived_restart"), "yes");
    assert_eq!(second.fact("verified"), "8MiB");
}

/// Drive the `nvme-tcp` scenario's hot-plug handshake: when the guest waits for `word`, run
/// `action` (which changes the target), then tell the guest to look.
fn hotplug_step(guest: &testbed::Guest, d: &Nacred, word: &str, action: impl FnOnce()) {
    if let Err(e) = guest.wait_for(&format!("TB-WAIT {word}"), Duration::from_secs(240)) {
        panic!("{}", stuck_report(guest, d, &e).text);
    }
    action();
    guest.signal(word).expect("signal guest");
}

/// Facts every nvme-tcp pass must report: namespaces, queues and data verified, with and without
/// header and data digests.
fn check_nvme_tcp_passes(out: &testbed::Outcome, nqn: &str, ns1_bytes: u64, queues: u32, mib: u32) {
    assert_eq!(out.fact("discovered"), nqn);
    for digests in ["off", "on"] {
        assert_eq!(
            out.fact(&format!("ns1_bytes_{digests}")),
            ns1_bytes.to_string()
        );
        assert_eq!(
            out.fact(&format!("io_queues_{digests}")),
            queues.to_string()
        );
        assert_eq!(
            out.fact(&format!("verified_{digests}")),
            format!("{mib}MiB")
        );
    }
}

/// An encrypted disk image, its raw 64-byte XTS key and the plaintext it holds.
struct EncryptedDisk {
    image: std::path::PathBuf,
    key: std::path::PathBuf,
    plaintext: Vec<u8>,
}

/// An encrypted disk made by nacred: a tenant with a key-file KEK and the default policy
/// (AES-256-XTS, 4 KiB data units, plain64 tweak), an encrypted 8 MiB file volume, the plaintext
/// written through its vhost-user-blk device by libblkio, and the data key taken with
/// `volume_export_key`. The Python oracle encrypts the same plaintext as a second opinion: its
/// image must equal nacred's byte for byte.
fn encrypted_disk(dir: &std::path::Path) -> EncryptedDisk {
    use nacre_tests::blkio_client::{self, BlkioClient, ClientOptions};
    use serde_json::json;
    // 4 MiB of random data, then 4 MiB of zeros (the guest writes there)
    let mut plaintext = testbed::random_bytes(4 * MIB as usize).unwrap();
    plaintext.resize(8 * MIB as usize, 0);
    let image = dir.join("disk.img");
    let key = dir.join("xts.key");
    let kek = dir.join("tenant.kek");
    std::fs::write(&kek, testbed::random_bytes(32).unwrap()).unwrap();
    let mut n = Nacred::start_args(&["--no-default"]);
    n.ok(
        "tenant_create",
        json!({"name": "tb", "kek": {"key_file": kek}, "policy": {"data_unit": 4096, "tweak": "plain64"}}),
    );
    n.ok(
        "volume_create",
        json!({"name": "disk", "size": 8 * MIB, "block_size": 4096, "backend": "file",
               "path": image, "tenant": "tb", "encrypt": true}),
    );
    n.ok("vhost_blk_create", json!({"name": "d", "volume": "disk"}));
    {
        let mut c =
            BlkioClient::connect(&n.run_dir.join("vhost-d.sock"), &ClientOptions::default())
                .unwrap();
        let mut q = c.take_queues().remove(0);
        for (i, chunk) in plaintext.chunks(MIB as usize).enumerate() {
            let buf = &mut c.mem()[..chunk.len()];
            buf.copy_from_slice(chunk);
            assert_eq!(blkio_client::write(&mut q, i as u64 * MIB, buf).unwrap(), 0);
        }
        assert_eq!(blkio_client::flush(&mut q).unwrap(), 0);
    }
    n.ok("vhost_blk_delete", json!({"name": "d"}));
    n.ok(
        "volume_export_key",
        json!({"name": "disk", "path": key, "confirm": true}),
    );
    assert!(n.stop(), "nacred did not stop cleanly");
    let plain = dir.join("plain.bin");
    std::fs::write(&plain, &plaintext).unwrap();
    let oracle = dir.join("oracle.img");
    testbed::xts_oracle_run("encrypt", &key, &plain, &oracle, 4096, 0).expect("oracle");
    assert!(
        std::fs::read(&oracle).unwrap() == std::fs::read(&image).unwrap(),
        "nacred's ciphertext differs from the oracle's"
    );
    EncryptedDisk {
        image,
        key,
        plaintext,
    }
}

fn nacre_encrypted_file(image: &std::path::Path, key: &XtsKey) -> EncryptedVolume {
    let file: Arc<dyn BlockDevice> =
        Arc::new(FileVolume::open(image, 8 * MIB, 4096, false).unwrap());
    EncryptedVolume::new(file, key, EncryptionPolicy::default()).unwrap()
}

/// nacre's encrypted volumes are dm-crypt volumes: the kernel's dm-crypt (cryptsetup plain,
/// aes-xts-plain64, 4 KiB sectors, --iv-large-sectors) reads a volume nacre encrypted back as the
/// right plaintext; what dm-crypt writes through the mapping is the ciphertext the independent
/// Python oracle computes, and nacre decrypts it to the same plaintext.
#[test]
fn dm_crypt_opens_xts_disk() {
    let Some(_bed) = prepare("dm_crypt_opens_xts_disk") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let disk = encrypted_disk(dir.path());
    // second opinion on nacre's ciphertext: the oracle decrypts it to the plaintext
    let decrypted = dir.path().join("oracle-plain.bin");
    testbed::xts_oracle_run("decrypt", &disk.key, &disk.image, &decrypted, 4096, 0).unwrap();
    assert!(
        std::fs::read(&decrypted).unwrap() == disk.plaintext,
        "the oracle disagrees with nacre's ciphertext"
    );
    let plain_sha = testbed::sha256(&disk.plaintext[..4 * MIB as usize]).unwrap();
    let out = Boot::new("dm-crypt")
        .param("mib", 4)
        .param("sha256", &plain_sha)
        .param("write_mib", 1)
        .param("write_offset_mib", 6)
        .file("key", &disk.key)
        .qemu([
            "-drive".to_string(),
            format!("file={},if=none,id=d0,format=raw", disk.image.display()),
            "-device".to_string(),
            "virtio-blk-pci,drive=d0".to_string(),
        ])
        .timeout(Duration::from_secs(180))
        .run()
        .expect("boot");
    out.assert_success();
    assert_eq!(out.fact("cipher"), "aes-xts-plain64");
    assert_eq!(out.fact("sector_size"), "4096");
    assert_eq!(out.fact("plain_bytes"), (8 * MIB).to_string());
    assert_eq!(out.fact("plaintext_sha256"), plain_sha);
    assert_eq!(out.fact("written"), "1MiB@6MiB");
    // The kernel wrote the first MiB of plaintext at 6 MiB: the oracle must produce the same bytes.
    let plain1 = dir.path().join("plain1.bin");
    std::fs::write(&plain1, &disk.plaintext[..MIB as usize]).unwrap();
    let expect = dir.path().join("cipher1.bin");
    testbed::xts_oracle_run("encrypt", &disk.key, &plain1, &expect, 4096, 6 * MIB / 4096).unwrap();
    let image = std::fs::read(&disk.image).unwrap();
    let written = &image[6 * MIB as usize..7 * MIB as usize];
    assert!(
        written == std::fs::read(&expect).unwrap().as_slice(),
        "dm-crypt's ciphertext at 6 MiB differs from the oracle's"
    );
    assert!(
        written != &disk.plaintext[..MIB as usize],
        "data at rest must not be plaintext"
    );
    // and nacre reads what dm-crypt wrote
    let key = XtsKey::from_bytes(&std::fs::read(&disk.key).unwrap()).unwrap();
    let vol = nacre_encrypted_file(&disk.image, &key);
    let mut back = vec![0u8; MIB as usize];
    vol.read_at(6 * MIB, &mut back).unwrap();
    assert!(
        back == disk.plaintext[..MIB as usize],
        "nacre decrypts dm-crypt's sectors differently"
    );
}

/// The guest's kernel nvme-tcp host against nacred's NVMe/TCP target, configured over RPC and
/// reached on the host's loopback (guestfwd + socat): discovery, connect with 2 I/O queues,
/// nacre's identify data in `nvme list`, 32 MiB O_DIRECT verify without and with header and data
/// digests (the bytes land in the volume's file), and a namespace added and removed at run time
/// (`nvmf_subsystem_add_ns` / `nvmf_subsystem_remove_ns`) reaches the connected host through an
/// Asynchronous Event, without a reconnect.
#[test]
fn nvme_tcp_against_nacred() {
    use nacre_dpu::frontend::nvmf_tcp::FIRMWARE_REVISION;
    use serde_json::json;

    let Some(_bed) = prepare("nvme_tcp_against_nacred") else {
        return;
    };
    let nqn = "nqn.2014-08.io.nacre:testbed";
    let (serial, model) = ("NACRETESTBED0001", "nacre testbed");
    let d = Nacred::start_args(&["--no-default"]);
    d.ok(
        "volume_create",
        json!({"name": "ns1", "size": 64 * MIB, "block_size": 4096, "backend": "file"}),
    );
    d.ok(
        "nvmf_subsystem_create",
        json!({"nqn": nqn, "serial": serial, "model": model, "allow_any_host": true}),
    );
    d.ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": nqn, "volume": "ns1"}),
    );
    let listener = d.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": nqn, "address": "127.0.0.1", "port": 0}),
    );
    let port = listener["port"].as_u64().expect("bound port") as u16;

    let guest = Boot::new("nvme-tcp")
        .param("nqn", nqn)
        .param("queues", 2)
        .param("mib", 32)
        .param("hotplug", 1)
        .ctl()
        .qemu(testbed::guestfwd_args("10.0.2.100", 4420, port))
        .timeout(Duration::from_secs(300))
        .spawn()
        .expect("guest");
    hotplug_step(&guest, &d, "ns-add", || {
        d.ok(
            "volume_create",
            json!({"name": "ns2", "size": 32 * MIB, "block_size": 512, "backend": "ram"}),
        );
        d.ok(
            "nvmf_subsystem_add_ns",
            json!({"nqn": nqn, "volume": "ns2", "nsid": 2}),
        );
    });
    hotplug_step(&guest, &d, "ns-remove", || {
        d.ok("nvmf_subsystem_remove_ns", json!({"nqn": nqn, "nsid": 2}));
    });
    let out = guest.wait(Duration::from_secs(360)).expect("guest");
    assert!(
        out.success(),
        "{}\nnacred log tail:\n{}",
        out.tail(60),
        log_tail(&d.log_text(), 40)
    );
    check_nvme_tcp_passes(&out, nqn, 64 * MIB, 2, 32);
    for digests in ["off", "on"] {
        assert_eq!(out.fact(&format!("model_{digests}")), model);
        assert_eq!(out.fact(&format!("serial_{digests}")), serial);
        assert_eq!(out.fact(&format!("firmware_{digests}")), FIRMWARE_REVISION);
    }
    assert_eq!(out.fact("ns2_added_bytes"), (32 * MIB).to_string());
    assert_eq!(out.fact("ns2_removed"), "yes");
    // the last pattern the guest wrote (digests on) is in the volume's file
    let image = d.state_dir.join("volumes/ns1.img");
    assert_eq!(
        testbed::sha256_of_range(&image, 0, 32 * MIB).unwrap(),
        out.fact("pattern_sha256")
    );
}

/// nacred's PCIe NVMe controller over vfio-user in a guest (trixie-backports' QEMU, the only
/// one here with `vfio-user-pci`): the guest's own `nvme` driver binds it, `nvme list` shows
/// model nacre on transport pcie with one I/O queue per vCPU (4), and 64 MiB written
/// O_DIRECT by four writers read back identical. Then a controller reset from the guest
/// (`reset_controller`), an unbind and rebind of the nvme driver, and a namespace attached and
/// detached by nacred while the guest runs (the guest sees `nvme0n2` come and go): the data
/// survives each. The hot-attached namespace is an encrypted volume: what the guest wrote is
/// ciphertext in its file, which pyca/cryptography's XTS decrypts to the guest's bytes. Then
/// the guest reboots (`reboot -f`; QMP `set-action` makes it reset the VM instead of ending
/// it): its driver shuts the controller down, QEMU resets the function, and the second boot
/// binds it again and reads what the first boot wrote. Last, in that second boot, nacred is
/// SIGKILLed while the guest writes numbered blocks, each flushed before it counts: the
/// guest's I/O fails and its driver removes the controller (QEMU does not reconnect), also
/// once nacred is started again. The operator's recovery, a function plugged in with QMP
/// `device_add` (to nacred's same socket, in a free PCIe root port), gives the guest its disk
/// back, and every block it had acknowledged reads back intact there and is in the volume's
/// file. Then a second controller whose function has MSI instead of MSI-X (`interrupts`
/// msi, replayed by the restarted nacred) is plugged in, written and read, removed with QMP
/// `device_del` while QEMU runs on (with MSI-X QEMU 11.1.3 aborts there), and plugged in again
/// with its data intact; then nacred is stopped in order under it, and after the operator's
/// recovery (`device_del`, nacred started, `device_add`) what the guest flushed before the
/// stop reads back.
#[test]
fn nvme_pcie_over_vfio_user_in_a_guest() {
    use serde_json::json;

    let Some(_bed) = prepare("nvme_pcie_over_vfio_user_in_a_guest") else {
        return;
    };
    let qemu = testbed::trixie_qemu().expect("a QEMU with vfio-user-pci");
    let nqn = "nqn.2024-01.io.nacre:pcie";
    let mut d = Nacred::start_args(&["--no-default"]);
    d.ok(
        "volume_create",
        json!({"name": "pv", "size": 128 * MIB, "block_size": 512, "backend": "file"}),
    );
    d.ok(
        "nvmf_subsystem_create",
        json!({"nqn": nqn, "serial": "NACREPCIE0001", "allow_any_host": true}),
    );
    d.ok("nvmf_subsystem_add_ns", json!({"nqn": nqn, "volume": "pv"}));
    let dir = tempfile::tempdir().expect("socket directory");
    d.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": nqn, "transport": "vfio-user", "address": dir.path()}),
    );
    let sock = dir.path().join("cntrl");
    // Beside the controller, a virtio-blk PCI function (`vhost_blk_create` with transport
    // vfio-user) on its own volume: the guest's virtio_pci and virtio_blk drivers bind it.
    let vblk_dir = tempfile::tempdir().expect("socket directory");
    d.ok(
        "volume_create",
        json!({"name": "vb", "size": 32 * MIB, "block_size": 512, "backend": "file"}),
    );
    d.ok(
        "vhost_blk_create",
        json!({"name": "vblk", "volume": "vb", "queues": 2, "transport": "vfio-user",
               "socket": vblk_dir.path()}),
    );
    let vblk_arg = json!({"driver": "vfio-user-pci", "id": "vblk", "bus": "rp2",
                          "socket": {"path": vblk_dir.path().join("cntrl"), "type": "unix"}})
    .to_string();
    // A second subsystem served by a function with MSI instead of MSI-X (`interrupts`: msi),
    // which QEMU 11.1.3 can hot-remove: plugged in (rp3), removed and plugged in again at the
    // end, after nacred's restart (so its listener is also one nacred replayed).
    let msi_nqn = "nqn.2024-01.io.nacre:pcie-msi";
    let msi_serial = "NACREPCIEMSI01";
    d.ok(
        "volume_create",
        json!({"name": "pm", "size": 16 * MIB, "block_size": 512, "backend": "file"}),
    );
    d.ok(
        "nvmf_subsystem_create",
        json!({"nqn": msi_nqn, "serial": msi_serial, "allow_any_host": true}),
    );
    d.ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": msi_nqn, "volume": "pm"}),
    );
    let msi_dir = tempfile::tempdir().expect("socket directory");
    let added = d.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": msi_nqn, "transport": "vfio-user", "address": msi_dir.path(),
               "interrupts": "msi"}),
    );
    assert_eq!(added["interrupts"], "msi");
    let msi_device = json!({"driver": "vfio-user-pci", "id": "nvme-msi", "bus": "rp3",
                            "socket": {"path": msi_dir.path().join("cntrl"), "type": "unix"}});
    // The function sits behind a PCIe root port (rp0); a second, empty one (rp1) takes the
    // function the host plugs in after nacred's restart.
    let device = json!({"driver": "vfio-user-pci", "id": "nvme", "bus": "rp0",
                        "socket": {"path": sock, "type": "unix"}});
    let device_arg = device.to_string();
    let g = Boot::new("nvme-pcie")
        .param("model", "nacre")
        .param("bytes", 128 * MIB)
        .param("queues", 4)
        .param("mib", 64)
        .param("hotplug", 1)
        .param("reboot", 1)
        .param("replug", 1)
        .param("unplug", msi_nqn)
        .param("failure", 1)
        .param("vblk_bytes", 32 * MIB)
        .smp(4)
        .ctl()
        .qmp()
        .qemu_binary(qemu)
        .qemu([
            "-object",
            "memory-backend-memfd,id=mem,size=1G,share=on",
            "-machine",
            "q35,memory-backend=mem",
            "-device",
            "pcie-root-port,id=rp0,chassis=1",
            "-device",
            "pcie-root-port,id=rp1,chassis=2",
            "-device",
            device_arg.as_str(),
            "-device",
            "pcie-root-port,id=rp2,chassis=3",
            "-device",
            vblk_arg.as_str(),
            "-device",
            "pcie-root-port,id=rp3,chassis=4",
        ])
        .timeout(Duration::from_secs(300))
        .spawn()
        .expect("guest");
    // A namespace attached and detached while the guest has the controller: the guest's
    // driver hears of each by a Namespace Attribute Changed event and rescans.
    if g.wait_for("TB-WAIT add-ns", Duration::from_secs(240))
        .is_ok()
    {
        // An encrypted volume (AES-XTS, a tenant's key): the same PCIe path, through the
        // crypto layer.
        std::fs::write(dir.path().join("t.kek"), [0x5a; 32]).unwrap();
        d.ok(
            "tenant_create",
            json!({"name": "t", "kek": {"key_file": dir.path().join("t.kek")}}),
        );
        d.ok(
            "volume_create",
            json!({"name": "pv2", "size": 16 * MIB, "block_size": 4096, "backend": "file",
                   "tenant": "t", "encrypt": true}),
        );
        d.ok(
            "nvmf_subsystem_add_ns",
            json!({"nqn": nqn, "volume": "pv2", "nsid": 2}),
        );
        g.signal("add-ns").unwrap();
        if g.wait_for("TB-WAIT remove-ns", Duration::from_secs(120))
            .is_ok()
        {
            d.ok("nvmf_subsystem_remove_ns", json!({"nqn": nqn, "nsid": 2}));
            g.signal("remove-ns").unwrap();
        }
    }
    let mut qmp = g.qmp().expect("QMP");
    // A guest reboot: the test bed runs QEMU with -no-reboot (a reboot ends the VM); here the
    // reboot resets the VM instead, so the guest boots again with the same devices.
    if g.wait_for("TB-WAIT reboot", Duration::from_secs(120))
        .is_ok()
    {
        qmp.execute("set-action", json!({"reboot": "reset"}))
            .unwrap_or_else(|e| panic!("QMP set-action: {e:#}"));
        g.signal("reboot").unwrap();
    }
    // nacred killed while the guest writes, then started again: what the guest sees (facts
    // killed_*, restarted_*); then the operator's recovery, a function plugged in again so that
    // QEMU connects to the new nacred, and every block the guest had acknowledged.
    if g.wait_for("TB-WAIT kill", Duration::from_secs(180)).is_ok() {
        d.kill();
        g.signal("kill").unwrap();
        if g.wait_for("TB-WAIT restarted", Duration::from_secs(120))
            .is_ok()
        {
            d.spawn_again();
            let t = std::time::Instant::now();
            while !sock.exists() && t.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(100));
            }
            g.signal("restarted").unwrap();
            if g.wait_for("TB-WAIT replug", Duration::from_secs(120))
                .is_ok()
            {
                // QEMU 11.1.3 aborts in device_del of a vfio-user-pci function with MSI-X
                // (vfio_user_msix_teardown deletes the PBA region from a BAR region already
                // finalized): the dead function stays, a new one goes into the free port.
                let mut again = device.clone();
                again["id"] = json!("nvme-again");
                again["bus"] = json!("rp1");
                qmp.device_add(again)
                    .unwrap_or_else(|e| panic!("device_add after nacred's restart: {e:#}"));
                g.signal("replug").unwrap();
                // The function with MSI: plugged in, removed (QMP device_del returns once
                // QEMU has freed it: DEVICE_DELETED), plugged in again.
                if g.wait_for("TB-WAIT msi-plug", Duration::from_secs(120))
                    .is_ok()
                {
                    qmp.device_add(msi_device.clone())
                        .unwrap_or_else(|e| panic!("device_add of the function with MSI: {e:#}"));
                    g.signal("msi-plug").unwrap();
                    if g.wait_for("TB-WAIT unplug", Duration::from_secs(120))
                        .is_ok()
                    {
                        qmp.device_del("nvme-msi", Duration::from_secs(60))
                            .unwrap_or_else(|e| {
                                panic!("device_del of the function with MSI: {e:#}")
                            });
                        let status = qmp
                            .execute("query-status", json!({}))
                            .unwrap_or_else(|e| panic!("QEMU after device_del: {e:#}"));
                        assert_eq!(status["status"], "running", "QEMU after device_del");
                        g.signal("unplug").unwrap();
                        if g.wait_for("TB-WAIT msi-replug", Duration::from_secs(120))
                            .is_ok()
                        {
                            qmp.device_add(msi_device.clone()).unwrap_or_else(|e| {
                                panic!("device_add of the function with MSI, again: {e:#}")
                            });
                            g.signal("msi-replug").unwrap();
                        }
                        // nacred stopped (SIGTERM) while the guest has the function; the
                        // operator's whole recovery: device_del of the dead function, nacred
                        // started again, device_add into the same port.
                        if g.wait_for("TB-WAIT stop", Duration::from_secs(120)).is_ok() {
                            assert!(d.stop(), "nacred's orderly stop failed");
                            g.signal("stop").unwrap();
                            if g.wait_for("TB-WAIT recover", Duration::from_secs(120))
                                .is_ok()
                            {
                                qmp.device_del("nvme-msi", Duration::from_secs(60))
                                    .unwrap_or_else(|e| {
                                        panic!("device_del after nacred's stop: {e:#}")
                                    });
                                d.spawn_again();
                                let sock = msi_dir.path().join("cntrl");
                                let t = std::time::Instant::now();
                                while !sock.exists() && t.elapsed() < Duration::from_secs(30) {
                                    std::thread::sleep(Duration::from_millis(100));
                                }
                                qmp.device_add(msi_device.clone()).unwrap_or_else(|e| {
                                    panic!("device_add after nacred's start: {e:#}")
                                });
                                g.signal("recover").unwrap();
                            }
                        }
                    }
                }
            }
        }
    }
    let out = g.wait(Duration::from_secs(300)).expect("guest");
    assert!(
        out.success(),
        "{}\nnacred log tail:\n{}",
        out.tail(60),
        log_tail(&d.log_text(), 40)
    );
    assert_eq!(out.fact("pci"), "0x4e58:0x0001 0x010802");
    // The virtio-blk PCI function: a modern virtio-blk device (1AF4:1042, revision 1) that
    // the guest's own virtio_blk driver bound as vda, of its volume's size, with O_DIRECT
    // data read back and a discard (VIRTIO_BLK_F_DISCARD) accepted.
    assert_eq!(out.fact("vblk_pci"), "0x1af4:0x1042 0x018000 rev 0x01");
    assert_eq!(out.fact("vblk_driver"), "virtio_blk");
    assert_eq!(out.fact("vblk_bytes"), (32 * MIB).to_string());
    assert_eq!(out.fact("vblk_verified"), "4MiB");
    assert_eq!(out.fact("vblk_discarded"), "yes");
    assert_eq!(out.fact("vblk_unbound"), "yes");
    assert_eq!(out.fact("model"), "nacre");
    assert_eq!(out.fact("serial"), "NACREPCIE0001");
    assert_eq!(out.fact("transport"), "pcie");
    assert_eq!(out.fact("queues"), "4");
    assert_eq!(out.fact("verified"), "64MiB");
    // Linux's driver configured shadow doorbells (Identify Controller OACS bit 8) and its I/O
    // went through them.
    assert!(
        d.log_text().contains("shadow doorbells configured"),
        "the guest did not configure shadow doorbells"
    );
    assert_eq!(out.fact("reset_verified"), "yes");
    assert_eq!(out.fact("rebind_verified"), "yes");
    assert_eq!(out.fact("hot_added"), (16 * MIB).to_string());
    assert_eq!(out.fact("hot_added_verified"), "yes");
    assert_eq!(out.fact("hot_removed"), "yes");
    // After a guest reboot (the driver shuts the controller down, QEMU resets the function)
    // the second boot binds it again and reads what the first boot wrote.
    assert_eq!(out.fact("rebooted"), "yes");
    assert_eq!(out.fact("reboot_verified"), "yes");
    // nacred killed: QEMU's vfio-user client stays up but its socket is gone; the guest's next
    // command times out (io_timeout 5 s), CSTS reads all ones, the driver gives the controller
    // up and removes it, and the I/O fails with an error. Started again, nacred serves its
    // listener, but QEMU does not connect again: the guest keeps no disk until the function is
    // plugged again.
    assert_eq!(out.fact("killed_io"), "error");
    assert_eq!(out.fact("writer"), "error");
    assert_ne!(out.fact("killed_state"), "live");
    assert_eq!(out.fact("restarted_io"), "error");
    assert_eq!(out.fact("restarted_state"), "gone");
    assert_eq!(out.fact("restarted_disk"), "gone");
    // Every block the guest had acknowledged (written O_DIRECT, then flushed) before the kill
    // reads back through a function plugged in after the restart (QMP device_add; the guest's
    // hot-plug driver finds it beside the dead one, its nvme driver binds it), and is in the
    // volume's file.
    assert_eq!(out.fact("replugged_functions"), "2");
    let acked: u64 = out.fact("acked_blocks").parse().unwrap();
    assert!(
        acked >= 8,
        "only {acked} blocks acknowledged before the kill"
    );
    assert_eq!(out.fact("replugged_acked"), acked.to_string());
    // The function with MSI: the guest's driver bound it with MSI (one vector on x86 without
    // interrupt remapping, so one I/O queue), its I/O worked, QMP device_del removed it while
    // QEMU ran on (QEMU 11.1.3 aborts there for a function with MSI-X), the guest let the
    // function and its disk go, and plugged in again it read back what was written.
    assert_eq!(out.fact("msi_irqs"), "msi");
    assert_eq!(out.fact("msi_queues"), "1");
    assert_eq!(out.fact("msi_verified"), "4MiB");
    assert_eq!(out.fact("unplugged"), "yes");
    assert_eq!(out.fact("msi_replug_verified"), "yes");
    // nacred stopped in order (SIGTERM: it flushes every volume, then its sockets close): the
    // guest's next I/O fails and its driver removes the controller, as when nacred is killed;
    // after device_del, nacred's start and device_add the 4 MiB the guest had flushed before
    // the stop read back.
    assert_eq!(out.fact("stopped_io"), "error");
    assert_eq!(out.fact("stopped_disk"), "gone");
    assert_eq!(out.fact("stopped_recovered"), "yes");
    let image = std::fs::read(d.state_dir.join("volumes/pv.img")).unwrap();
    for i in 0..acked {
        let at = (64 * MIB + 4096 * i) as usize;
        let want = format!("nacre-tb-block {i}\n");
        assert!(
            image[at..at + 4096].starts_with(want.as_bytes())
                && image[at + want.len()..at + 4096].iter().all(|&b| b == 0),
            "acknowledged block {i} lost when nacred was killed"
        );
    }
    // What the guest wrote to the encrypted namespace is ciphertext in the volume's file, and
    // an independent XTS (pyca/cryptography) decrypts it with the volume's key to those bytes.
    let key = dir.path().join("pv2.key");
    d.ok(
        "volume_export_key",
        json!({"name": "pv2", "path": key, "confirm": true}),
    );
    let image = d.state_dir.join("volumes/pv2.img");
    let plain = nacre_tests::xts_oracle::python_decrypt_file(
        &image,
        &std::fs::read(&key).unwrap(),
        4096,
        "plain64",
        0,
        4 * MIB as usize,
        0,
    )
    .expect("the XTS oracle (python3-cryptography)");
    let dec = dir.path().join("pv2.plain");
    std::fs::write(&dec, &plain).unwrap();
    assert_eq!(
        testbed::sha256_of_range(&dec, 0, 4 * MIB).unwrap(),
        out.fact("hot_added_sha256"),
        "the oracle's plaintext of the encrypted namespace"
    );
    assert_ne!(
        testbed::sha256_of_range(&image, 0, 4 * MIB).unwrap(),
        out.fact("hot_added_sha256"),
        "plaintext at rest"
    );
}
