//! nacred's initiator against nacred's own NVMe-oF/TCP target on loopback: the same process
//! plays host and shelf, with plain and encrypted volumes on top of the remote namespace.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nacre_dpu::crypto::volume::EncryptedVolume;
use nacre_dpu::crypto::{EncryptionPolicy, XtsKey};
use nacre_dpu::fabric::{Controller, ControllerConfig, RemoteNamespace};
use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;
use nacre_shared::nvme_tcp::Digests;
use nacre_tests::fabric_support::pattern;

const NQN: &str = "nqn.2024-01.io.nacre:shelf0";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000aa";

fn shelf(size: u64, bs: u32) -> (Arc<NvmfTarget>, SocketAddr, Arc<RamVolume>) {
    let t = NvmfTarget::new();
    t.create_subsystem(NQN, "SHELF0", "nacre shelf", true)
        .unwrap();
    let vol = Arc::new(RamVolume::new(size, bs).unwrap());
    t.add_namespace(NQN, None, vol.clone(), [0x5C; 16], "vol".into())
        .unwrap();
    let addr = t.add_listener(NQN, "127.0.0.1:0".parse().unwrap()).unwrap();
    (t, addr, vol)
}

fn attach(addr: SocketAddr, dg: Digests) -> (Controller, Arc<RemoteNamespace>) {
    let mut c = ControllerConfig::new("127.0.0.1", addr.port(), NQN, HOSTNQN);
    c.digests = dg;
    c.io_queues = 2;
    c.queue_depth = 32;
    let ctrl = Controller::start("shelf0", c, None);
    let info = ctrl
        .wait_first_attempt(Duration::from_secs(10))
        .expect("initiator connects to nacred's target");
    assert_eq!(info.model, "nacre shelf");
    assert_eq!(info.serial, "SHELF0");
    let ns = info.namespaces[0].clone();
    assert_eq!(ns.nguid, Some([0x5C; 16]), "NGUID from the descriptor list");
    let dev = Arc::new(RemoteNamespace::new(ctrl.core().clone(), ns));
    (ctrl, dev)
}

fn verify_io(dev: &dyn BlockDevice, seed: u64) -> Vec<(u64, Vec<u8>)> {
    let mut written = Vec::new();
    for (i, len) in [4096usize, 8192, 16384, 131072, 524288]
        .into_iter()
        .enumerate()
    {
        let off = (i as u64) << 20;
        let d = pattern(seed, off, len);
        dev.write_at(off, &d).unwrap();
        let mut back = vec![0u8; len];
        dev.read_at(off, &mut back).unwrap();
        assert!(back == d, "read back differs at {off}+{len}");
        written.push((off, d));
    }
    written
}

#[test]
fn plain_volume_over_nacreds_target() {
    for dg in [
        Digests::NONE,
        Digests {
            header: true,
            data: true,
        },
    ] {
        let (_t, addr, ram) = shelf(16 << 20, 4096);
        let (ctrl, dev) = attach(addr, dg);
        for (off, d) in verify_io(&*dev, 3) {
            let mut at_rest = vec![0u8; d.len()];
            ram.read_at(off, &mut at_rest).unwrap();
            assert!(at_rest == d, "plain volume: the shelf holds the plaintext");
        }
        assert_eq!(ctrl.core().status().resets, 0);
        ctrl.close();
    }
}

#[test]
fn encrypted_volume_over_nacreds_target() {
    let (_t, addr, ram) = shelf(16 << 20, 4096);
    let (ctrl, dev) = attach(addr, Digests::NONE);
    let key_bytes: Vec<u8> = (0..64u8).collect();
    let key = XtsKey::from_bytes(&key_bytes).unwrap();
    let enc = EncryptedVolume::new(dev.clone(), &key, EncryptionPolicy::default()).unwrap();
    let written = verify_io(&enc, 4);
    for (off, d) in &written {
        let mut at_rest = vec![0u8; d.len()];
        ram.read_at(*off, &mut at_rest).unwrap();
        assert!(
            at_rest != *d,
            "encrypted volume: the shelf never sees plaintext"
        );
        let mut via_remote = vec![0u8; d.len()];
        dev.read_at(*off, &mut via_remote).unwrap();
        assert!(
            via_remote == at_rest,
            "the initiator reads what the shelf holds"
        );
    }
    // A second association with the same key reads the plaintext back.
    ctrl.close();
    let (ctrl2, dev2) = attach(addr, Digests::NONE);
    let key = XtsKey::from_bytes(&key_bytes).unwrap();
    let enc2 = EncryptedVolume::new(dev2, &key, EncryptionPolicy::default()).unwrap();
    for (off, d) in &written {
        let mut back = vec![0u8; d.len()];
        enc2.read_at(*off, &mut back).unwrap();
        assert!(back == *d);
    }
    ctrl2.close();
}

/// Long reads land in the request's memory without a copy through the reader's buffer
/// (fabric::tcp::rxbuf): after the first long C2HData PDU, the kernel reads each long PDU's
/// data straight into the request's segments, and the controller's status says how many
/// bytes went which way. With a data digest, the bytes pass through memory the reader owns
/// (it needs them for the CRC), and the status says that too.
#[test]
fn long_reads_go_straight_into_the_requests_memory() {
    const LEN: usize = 1 << 20;
    const READS: usize = 4;
    for dg in [
        Digests::NONE,
        Digests {
            header: false,
            data: true,
        },
    ] {
        let (_t, addr, ram) = shelf(16 << 20, 4096);
        let d = pattern(11, 0, LEN);
        ram.write_at(0, &d).unwrap();
        let (ctrl, dev) = attach(addr, dg);
        let before = ctrl.core().status();
        for _ in 0..READS {
            let mut back = vec![0u8; LEN];
            dev.read_at(0, &mut back).unwrap();
            assert!(back == d, "a long read returns what the shelf holds");
        }
        let s = ctrl.core().status();
        let direct = s.rx_direct_bytes - before.rx_direct_bytes;
        let copied = s.rx_copied_bytes - before.rx_copied_bytes;
        assert_eq!(
            direct + copied,
            (READS * LEN) as u64,
            "every byte read is counted once"
        );
        if dg.data {
            assert_eq!(
                direct, 0,
                "with a data digest the reader keeps the bytes for the CRC"
            );
        } else {
            assert!(
                direct * 4 >= 3 * (READS * LEN) as u64,
                "at least 3/4 of the data goes straight into the request: {direct} direct, \
                 {copied} copied"
            );
        }
        ctrl.close();
    }
}
