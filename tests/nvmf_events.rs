//! Asynchronous events and keep-alive: runtime namespace changes complete a pending
//! Asynchronous Event Request with a Namespace Attribute Changed notice and appear in the
//! Changed Namespace List; a controller whose Keep Alive Timeout expires is torn down.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::null::NullVolume;
use nacre_dpu::volume::ram::RamVolume;
use nacre_shared::nvme::features::{fid, AEC_NS_ATTR};
use nacre_shared::nvme::log::{aen, lid};
use nacre_shared::nvme::{identify, Status};
use nacre_tests::nvmf_host::{HostError, HostOptions, NvmfHost};

const NQN: &str = "nqn.2024-01.io.nacre:events";

fn target() -> (Arc<NvmfTarget>, SocketAddr) {
    let t = NvmfTarget::new();
    t.create_subsystem(NQN, "S", "M", true).unwrap();
    t.add_namespace(
        NQN,
        Some(1),
        Arc::new(RamVolume::new(1 << 20, 512).unwrap()),
        [1; 16],
        "a".into(),
    )
    .unwrap();
    let addr = t.add_listener(NQN, "127.0.0.1:0".parse().unwrap()).unwrap();
    (t, addr)
}

fn changed_list(h: &mut NvmfHost) -> Vec<u32> {
    identify::decode_ns_list(
        &h.get_log_page(lid::CHANGED_NS_LIST, 0, 4096, 0, false)
            .unwrap(),
    )
}

#[test]
fn namespace_hot_add_and_remove_raise_async_events() {
    let (t, addr) = target();
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    h.set_features(fid::ASYNC_EVENT_CONFIG, AEC_NS_ATTR)
        .unwrap();
    let aer = h.submit_aer().unwrap();

    let nsid = t
        .add_namespace(
            NQN,
            None,
            Arc::new(NullVolume::new(1 << 30, 4096)),
            [2; 16],
            "b".into(),
        )
        .unwrap();
    assert_eq!(nsid, 2);
    let r = h.admin.wait(aer).unwrap().ok().unwrap();
    assert_eq!(
        aen::parse(r.cqe.dw0),
        (
            aen::TYPE_NOTICE,
            aen::INFO_NS_ATTR_CHANGED,
            lid::CHANGED_NS_LIST
        )
    );
    assert_eq!(changed_list(&mut h), vec![2]);
    assert_eq!(h.active_namespaces().unwrap(), vec![1, 2]);
    let ns = h.identify_namespace(2).unwrap();
    assert_eq!((ns.nsze, ns.lbads), ((1 << 30) / 4096, 12));
    // Reading the log cleared it.
    assert_eq!(changed_list(&mut h), Vec::<u32>::new());

    // Removal: the notice arrives for a pending AER, and I/O to the NSID now fails.
    let aer = h.submit_aer().unwrap();
    t.remove_namespace(NQN, 1).unwrap();
    let r = h.admin.wait(aer).unwrap().ok().unwrap();
    assert_eq!(aen::parse(r.cqe.dw0).2, lid::CHANGED_NS_LIST);
    assert_eq!(changed_list(&mut h), vec![1]);
    assert_eq!(h.active_namespaces().unwrap(), vec![2]);
    assert!(matches!(
        h.read(0, 1, 0, 1, 512),
        Err(HostError::Nvme(Status::INVALID_NAMESPACE, _))
    ));
}

#[test]
fn events_wait_for_a_request_and_are_masked_until_the_log_is_read() {
    let (t, addr) = target();
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    h.set_features(fid::ASYNC_EVENT_CONFIG, AEC_NS_ATTR)
        .unwrap();
    let vol = || Arc::new(NullVolume::new(1 << 20, 512));
    // No AER outstanding: the event is kept; a second change is masked (one notice).
    t.add_namespace(NQN, Some(5), vol(), [5; 16], "e".into())
        .unwrap();
    t.add_namespace(NQN, Some(6), vol(), [6; 16], "f".into())
        .unwrap();
    let aer = h.submit_aer().unwrap();
    let r = h.admin.wait(aer).unwrap().ok().unwrap();
    assert_eq!(aen::parse(r.cqe.dw0).0, aen::TYPE_NOTICE);
    // Retain Asynchronous Event: reading with RAE keeps the list and the mask.
    let keep = h
        .get_log_page(lid::CHANGED_NS_LIST, 0, 4096, 0, true)
        .unwrap();
    assert_eq!(identify::decode_ns_list(&keep), vec![5, 6]);
    assert_eq!(changed_list(&mut h), vec![5, 6]);
    // Limit: AERL + 1 = 4 outstanding requests.
    for _ in 0..4 {
        h.submit_aer().unwrap();
    }
    let extra = h.submit_aer().unwrap();
    let r = h.admin.wait(extra).unwrap();
    assert_eq!(r.status(), Status::ASYNC_EVENT_LIMIT_EXCEEDED);
}

#[test]
fn events_are_not_sent_unless_enabled() {
    let (t, addr) = target();
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    let aer = h.submit_aer().unwrap();
    t.add_namespace(
        NQN,
        Some(3),
        Arc::new(NullVolume::new(1 << 20, 512)),
        [3; 16],
        "c".into(),
    )
    .unwrap();
    // The change is logged, but the AER stays outstanding.
    assert_eq!(changed_list(&mut h), vec![3]);
    h.keep_alive().unwrap();
    h.set_features(fid::ASYNC_EVENT_CONFIG, AEC_NS_ATTR)
        .unwrap();
    t.remove_namespace(NQN, 3).unwrap();
    let r = h.admin.wait(aer).unwrap().ok().unwrap();
    assert_eq!(aen::parse(r.cqe.dw0).2, lid::CHANGED_NS_LIST);
}

#[test]
fn keep_alive_timeout_tears_the_controller_down() {
    let (t, addr) = target();
    let opts = HostOptions {
        kato_ms: 1000,
        ..Default::default()
    };
    let mut h = NvmfHost::connect(addr, NQN, opts.clone()).unwrap();
    assert_eq!(h.get_features(fid::KEEP_ALIVE_TIMER).unwrap(), 1000);
    assert_eq!(t.subsystems()[1].controllers, 1);
    // Silence: the target must close both the admin and the I/O queue. The wait is bounded
    // generously; only the outcome is asserted.
    h.admin
        .socket()
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    match h.admin.recv_pdu_raw() {
        Err(HostError::Io(e)) => assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ),
            "the target must close the queue, not leave it idle: {e}"
        ),
        other => panic!("admin queue should be closed, got {other:?}"),
    }
    assert!(
        h.read(0, 1, 0, 1, 512).is_err(),
        "I/O queue must be closed too"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while t.subsystems()[1].controllers != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(t.subsystems()[1].controllers, 0);

    // A host that keeps sending Keep Alive keeps its controller (KATO 1 s, every 100 ms).
    let mut h = NvmfHost::connect(addr, NQN, opts).unwrap();
    for _ in 0..25 {
        std::thread::sleep(Duration::from_millis(100));
        h.keep_alive().unwrap();
    }
    h.read(0, 1, 0, 1, 512).unwrap();
}

#[test]
fn delete_subsystem_closes_connections_and_listeners() {
    let (t, addr) = target();
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    h.keep_alive().unwrap();
    t.delete_subsystem(NQN).unwrap();
    h.admin
        .socket()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert!(h.admin.recv_pdu_raw().is_err());
    assert!(t.listeners().is_empty());
    assert_eq!(t.subsystems().len(), 1, "only discovery remains");
}
