//! The NVMe-oF/TCP target driven by the user-space host in `nacre_tests::nvmf_host` over
//! loopback: Connect, properties, Identify, log pages, features and the I/O command set on
//! RAM and file volumes, with and without digests, over several I/O queues.

use std::net::SocketAddr;
use std::sync::Arc;

use nacre_dpu::frontend::nvmf_tcp::NvmfTarget;
use nacre_dpu::volume::file::FileVolume;
use nacre_dpu::volume::ram::RamVolume;
use nacre_dpu::volume::BlockDevice;
use nacre_shared::nvme::discovery::{self, SUBTYPE_NVME, TRTYPE_TCP};
use nacre_shared::nvme::features::fid;
use nacre_shared::nvme::identify::{self, cntrltype, nidt, oncs, OAES_NS_ATTR};
use nacre_shared::nvme::log::{self, lid, SmartLog};
use nacre_shared::nvme::registers::{self, cc, csts};
use nacre_shared::nvme::{admin_opcode, io_opcode, Command, SglDescriptor, Status, DISCOVERY_NQN};
use nacre_shared::nvme_tcp::Digests;
use nacre_tests::nvmf_host::{HostError, HostOptions, NvmfHost};

const NQN: &str = "nqn.2024-01.io.nacre:test";
const NGUID: [u8; 16] = *b"0123456789abcdef";

fn target_with(vol: Arc<dyn BlockDevice>) -> (Arc<NvmfTarget>, SocketAddr) {
    export(NvmfTarget::new(), vol)
}

fn export(t: Arc<NvmfTarget>, vol: Arc<dyn BlockDevice>) -> (Arc<NvmfTarget>, SocketAddr) {
    t.create_subsystem(NQN, "NACRE0001", "nacre test model", true)
        .unwrap();
    let nsid = t
        .add_namespace(NQN, None, vol, NGUID, "vol0".into())
        .unwrap();
    assert_eq!(nsid, 1);
    let addr = t.add_listener(NQN, "127.0.0.1:0".parse().unwrap()).unwrap();
    (t, addr)
}

fn ram(size: u64, bs: u32) -> Arc<dyn BlockDevice> {
    Arc::new(RamVolume::new(size, bs).unwrap())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

#[test]
fn identify_controller_carries_what_nvme_list_reads() {
    let (_t, addr) = target_with(ram(8 << 20, 4096));
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    let id = &h.id;
    assert_eq!(id.serial, "NACRE0001");
    assert_eq!(id.model, "nacre test model");
    assert_eq!(id.firmware, env!("CARGO_PKG_VERSION"));
    assert_eq!(id.subnqn, NQN);
    assert_eq!(id.cntlid, h.cntlid);
    assert!(id.ver >= registers::version(1, 4, 0));
    assert_eq!(id.cntrltype, cntrltype::IO);
    assert_eq!(id.mdts, 5);
    assert_eq!(id.ioccsz, (64 + 8192) / 16);
    assert_eq!(id.iorcsz, 1);
    assert_eq!(id.icdoff, 0);
    assert_ne!(id.sgls & 0b11, 0, "Linux requires SGL support");
    assert_ne!(id.kas, 0, "Linux requires keep-alive support on fabrics");
    assert!(id.maxcmd >= 32);
    assert_eq!(
        id.oncs & (oncs::DATASET_MANAGEMENT | oncs::WRITE_ZEROES),
        0x0C
    );
    assert_eq!(id.vwc & 1, 1);
    assert!(id.nn >= 1);
    assert_ne!(id.oaes & OAES_NS_ATTR, 0);
    assert_eq!((id.sqes, id.cqes), (0x66, 0x44));

    // Namespace: size from the volume geometry, LBA format = block size, NGUID.
    assert_eq!(h.active_namespaces().unwrap(), vec![1]);
    let ns = h.identify_namespace(1).unwrap();
    assert_eq!(ns.nsze, (8 << 20) / 4096);
    assert_eq!(ns.ncap, ns.nsze);
    assert_eq!(ns.lbads, 12);
    assert_eq!(ns.nguid, NGUID);
    let d = h.ns_descriptors(1).unwrap();
    assert!(d.iter().any(|d| d.nidt == nidt::NGUID && d.nid == NGUID));
    assert!(d.iter().any(|d| d.nidt == nidt::UUID && d.nid == NGUID));
    // Inactive NSID: zero-filled; NSID 0 and descriptors of an inactive NSID: errors.
    assert_eq!(h.identify_namespace(7).unwrap().nsze, 0);
    assert!(matches!(
        h.identify(0, 0, 0),
        Err(HostError::Nvme(Status::INVALID_NAMESPACE, _))
    ));
    assert!(matches!(
        h.ns_descriptors(7),
        Err(HostError::Nvme(Status::INVALID_NAMESPACE, _))
    ));
    // Unknown CNS.
    assert!(matches!(
        h.identify(0x1F, 0, 0),
        Err(HostError::Nvme(Status::INVALID_FIELD, _))
    ));
}

#[test]
fn properties_enable_and_shutdown() {
    let (_t, addr) = target_with(ram(1 << 20, 512));
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    let cap = h.property_get(registers::CAP, true).unwrap();
    assert_eq!(registers::cap_mqes(cap), 1023);
    assert_eq!(cap >> 37 & 1, 1);
    assert_eq!(
        h.property_get(registers::VS, false).unwrap() as u32,
        registers::version(1, 4, 0)
    );
    assert_ne!(
        h.property_get(registers::CSTS, false).unwrap() as u32 & csts::RDY,
        0
    );
    let cc_v = h.property_get(registers::CC, false).unwrap() as u32;
    assert_ne!(cc_v & cc::EN, 0);
    // Read-only and unknown properties.
    assert!(matches!(
        h.property_set(registers::CSTS, 0),
        Err(HostError::Nvme(Status::INVALID_FIELD, _))
    ));
    assert!(matches!(
        h.property_get(0x40, false),
        Err(HostError::Nvme(Status::INVALID_FIELD, _))
    ));
    // Shutdown notification → CSTS.SHST = complete.
    h.property_set(
        registers::CC,
        (cc_v | cc::SHN_NORMAL << cc::SHN_SHIFT) as u64,
    )
    .unwrap();
    let s = h.property_get(registers::CSTS, false).unwrap() as u32;
    assert_eq!(s & csts::SHST_MASK, csts::SHST_COMPLETE);
    // CC.EN → 0 clears RDY, and admin commands then fail with Command Sequence Error.
    h.property_set(registers::CC, 0).unwrap();
    let s = h.property_get(registers::CSTS, false).unwrap() as u32;
    assert_eq!(s & csts::RDY, 0);
    assert!(matches!(
        h.identify_controller(),
        Err(HostError::Nvme(Status::COMMAND_SEQUENCE_ERROR, _))
    ));
}

fn io_round_trip(digests: Digests, bs: u32, vol: Arc<dyn BlockDevice>) {
    let (_t, addr) = target_with(vol);
    let opts = HostOptions {
        digests,
        io_queues: 2,
        ..Default::default()
    };
    let mut h = NvmfHost::connect(addr, NQN, opts).unwrap();
    assert_eq!(h.io.len(), 2);
    let bs_us = bs as usize;
    // Small (in-capsule) and large (R2T/H2CData) writes, on both queues.
    let small = pattern(4096, 1);
    let large = pattern(128 * 1024, 2);
    h.write(0, 1, 0, &small, bs_us).unwrap();
    h.write(1, 1, (64 * 1024 / bs) as u64, &large, bs_us)
        .unwrap();
    assert_eq!(h.read(1, 1, 0, 4096 / bs, bs_us).unwrap(), small);
    assert_eq!(
        h.read(0, 1, (64 * 1024 / bs) as u64, 128 * 1024 / bs, bs_us)
            .unwrap(),
        large
    );
    h.flush(0, 1).unwrap();
    // Write Zeroes and Deallocate read back as zeros, neighbours untouched.
    h.write_zeroes(0, 1, (64 * 1024 / bs) as u64, 8192 / bs)
        .unwrap();
    let back = h
        .read(0, 1, (64 * 1024 / bs) as u64, 16384 / bs, bs_us)
        .unwrap();
    assert!(back[..8192].iter().all(|&b| b == 0));
    assert_eq!(&back[8192..], &large[8192..16384]);
    h.deallocate(1, 1, &[(0, 4096 / bs)]).unwrap();
    assert!(h
        .read(1, 1, 0, 4096 / bs, bs_us)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    // The SMART log counts host commands.
    let smart = SmartLog::decode(
        &h.get_log_page(lid::SMART_HEALTH, 0xFFFF_FFFF, 512, 0, false)
            .unwrap(),
    );
    assert!(smart.host_read_commands >= 4);
    assert!(smart.host_write_commands >= 2);
}

#[test]
fn ram_volume_io_without_digests() {
    io_round_trip(Digests::NONE, 4096, ram(4 << 20, 4096));
}

#[test]
fn ram_volume_io_with_header_and_data_digests() {
    io_round_trip(
        Digests {
            header: true,
            data: true,
        },
        512,
        ram(4 << 20, 512),
    );
}

#[test]
fn file_volume_io_with_header_digest_only() {
    let dir = tempfile::tempdir().unwrap();
    let vol = FileVolume::open(&dir.path().join("v.img"), 4 << 20, 4096, false).unwrap();
    io_round_trip(
        Digests {
            header: true,
            data: false,
        },
        4096,
        Arc::new(vol),
    );
}

#[test]
fn many_queues_pipelined_with_sq_flow_disabled() {
    let (_t, addr) = target_with(ram(4 << 20, 4096));
    let opts = HostOptions {
        io_queues: 4,
        disable_sq_flow: true,
        ..Default::default()
    };
    let mut h = NvmfHost::connect(addr, NQN, opts).unwrap();
    assert_eq!(h.io.len(), 4);
    // 32 writes in flight per queue, then 32 reads, verified.
    for q in 0..4 {
        let mut cids = Vec::new();
        for i in 0..32u64 {
            let lba = q as u64 * 32 + i;
            let d = pattern(4096, lba as u8);
            let cmd = Command::rw(io_opcode::WRITE, 0, 1, lba, 1, SglDescriptor::default());
            cids.push(h.io[q].submit(cmd, &d, 0));
        }
        h.io[q].flush().unwrap();
        for c in cids {
            h.io[q].wait(c).unwrap().ok().unwrap();
        }
    }
    for q in 0..4 {
        let mut cids = Vec::new();
        for i in 0..32u64 {
            let lba = q as u64 * 32 + i;
            let cmd = Command::rw(io_opcode::READ, 0, 1, lba, 1, SglDescriptor::default());
            cids.push((lba, h.io[(q + 1) % 4].submit(cmd, &[], 4096)));
        }
        h.io[(q + 1) % 4].flush().unwrap();
        for (lba, c) in cids {
            let r = h.io[(q + 1) % 4].wait(c).unwrap().ok().unwrap();
            assert_eq!(r.data, pattern(4096, lba as u8), "lba {lba}");
        }
    }
}

#[test]
fn io_errors_carry_nvme_status() {
    let (_t, addr) = target_with(ram(1 << 20, 4096));
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    let blocks = (1u64 << 20) / 4096;
    assert!(matches!(
        h.read(0, 1, blocks, 1, 4096),
        Err(HostError::Nvme(Status::LBA_OUT_OF_RANGE, _))
    ));
    assert!(matches!(
        h.read(0, 1, u64::MAX / 2, 1, 4096),
        Err(HostError::Nvme(Status::LBA_OUT_OF_RANGE, _))
    ));
    assert!(matches!(
        h.read(0, 2, 0, 1, 4096),
        Err(HostError::Nvme(Status::INVALID_NAMESPACE, _))
    ));
    // More than MDTS.
    assert!(matches!(
        h.read(0, 1, 0, 64, 4096),
        Err(HostError::Nvme(Status::INVALID_FIELD, _))
    ));
    // Unknown I/O and admin opcodes.
    let bogus = Command {
        opcode: 0x7E,
        nsid: 1,
        ..Default::default()
    };
    assert!(matches!(
        h.io_cmd(0, bogus, &[], 0),
        Err(HostError::Nvme(Status::INVALID_OPCODE, _))
    ));
    // Create I/O SQ does not exist on fabrics.
    let create_sq = Command {
        opcode: admin_opcode::CREATE_IO_SQ,
        ..Default::default()
    };
    assert!(matches!(
        h.admin_cmd(create_sq, 0),
        Err(HostError::Nvme(Status::INVALID_OPCODE, _))
    ));
    // A write whose data length disagrees with NLB.
    let cmd = Command::rw(io_opcode::WRITE, 0, 1, 0, 2, SglDescriptor::default());
    assert!(matches!(
        h.io_cmd(0, cmd, &[0u8; 4096], 0),
        Err(HostError::Nvme(Status::DATA_SGL_LENGTH_INVALID, _))
    ));
    // A log page request beyond MDTS (NUMD allows 16 GiB).
    assert!(matches!(
        h.get_log_page(lid::SMART_HEALTH, 0xFFFF_FFFF, 1 << 20, 0, false),
        Err(HostError::Nvme(Status::INVALID_FIELD, _))
    ));
    let mut huge = Command {
        opcode: admin_opcode::GET_LOG_PAGE,
        nsid: 0xFFFF_FFFF,
        cdw10: lid::SMART_HEALTH as u32 | 0xFFFF << 16,
        cdw11: 0xFFFF,
        ..Default::default()
    };
    huge.sgl = SglDescriptor::transport(512);
    let r = h.admin.call(huge, &[], 512).unwrap();
    assert_eq!(r.status(), Status::INVALID_FIELD);
    // Unsupported log page and feature.
    assert!(matches!(
        h.get_log_page(0x7F, 0, 512, 0, false),
        Err(HostError::Nvme(Status::INVALID_LOG_PAGE, _))
    ));
    assert!(matches!(
        h.set_features(0x7E, 0),
        Err(HostError::Nvme(Status::INVALID_FIELD, _))
    ));
}

/// The command fields the target reads (typed in `nacre_shared::nvme`), encoded here by
/// hand as the specifications lay them out: Save and Select in Set/Get Features Dword 10,
/// CSI in Identify Dword 11, NR and the Deallocate attribute in Dataset Management.
#[test]
fn command_fields_are_read_where_the_specifications_put_them() {
    let (_t, addr) = target_with(ram(1 << 20, 4096));
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    let admin = |opcode, cdw10, cdw11| Command {
        opcode,
        cdw10,
        cdw11,
        ..Default::default()
    };
    let status = |r: Result<nacre_tests::nvmf_host::Reply, HostError>| match r {
        Ok(_) => Status::SUCCESS,
        Err(HostError::Nvme(s, _)) => s,
        Err(e) => panic!("{e}"),
    };
    // Set Features with Save (Dword 10 bit 31): nothing here is saveable.
    let kato = fid::KEEP_ALIVE_TIMER as u32;
    let save = admin(admin_opcode::SET_FEATURES, kato | 1 << 31, 7000);
    assert_eq!(status(h.admin_cmd(save, 0)), Status::FEATURE_NOT_SAVEABLE);
    assert_ne!(h.get_features(fid::KEEP_ALIVE_TIMER).unwrap(), 7000);
    // Get Features Select (bits 10:8): current, default and saved answer; supported
    // capabilities is 0 (nothing saveable or per namespace); 100b and up are reserved.
    h.set_features(fid::KEEP_ALIVE_TIMER, 5000).unwrap();
    for sel in 0..3u32 {
        let r = h.admin_cmd(admin(admin_opcode::GET_FEATURES, kato | sel << 8, 0), 0);
        assert_eq!(r.unwrap().cqe.dw0, 5000, "select {sel}");
    }
    let caps = h.admin_cmd(admin(admin_opcode::GET_FEATURES, kato | 3 << 8, 0), 0);
    assert_eq!(caps.unwrap().cqe.dw0, 0);
    for sel in 4..8u32 {
        let r = h.admin_cmd(admin(admin_opcode::GET_FEATURES, kato | sel << 8, 0), 0);
        assert_eq!(status(r), Status::INVALID_FIELD, "select {sel}");
    }
    // Identify CNS 06h: the NVM Command Set (CSI 0 in Dword 11 bits 31:24) has a data
    // structure; Key Value (CSI 1) is not supported.
    let cs = identify::cns::CS_CONTROLLER;
    assert_eq!(h.identify(cs, 0, 0).unwrap().len(), identify::IDENTIFY_LEN);
    assert!(matches!(
        h.identify(cs, 0, 1 << 24),
        Err(HostError::Nvme(Status::INVALID_FIELD, _))
    ));
    // Dataset Management: NR (Dword 10 bits 7:0) is zero-based, so NR 1 needs two
    // 16-byte ranges; without Deallocate (Dword 11 bit 2) the data stays.
    h.write(0, 1, 0, &[0xA5; 4096], 4096).unwrap();
    let mut range = [0u8; 16];
    range[4..8].copy_from_slice(&1u32.to_le_bytes());
    let dsm = |cdw10, cdw11| Command {
        opcode: io_opcode::DATASET_MANAGEMENT,
        nsid: 1,
        cdw10,
        cdw11,
        ..Default::default()
    };
    let r = h.io_cmd(0, dsm(1, 1 << 2), &range, 0);
    assert_eq!(status(r), Status::DATA_SGL_LENGTH_INVALID);
    assert_eq!(h.read(0, 1, 0, 1, 4096).unwrap(), vec![0xA5; 4096]);
    h.io_cmd(0, dsm(0, 0b11), &range, 0).unwrap();
    assert_eq!(h.read(0, 1, 0, 1, 4096).unwrap(), vec![0xA5; 4096]);
    h.io_cmd(0, dsm(0, 1 << 2), &range, 0).unwrap();
    assert_eq!(h.read(0, 1, 0, 1, 4096).unwrap(), vec![0; 4096]);
}

#[test]
fn features_and_log_pages() {
    let (_t, addr) = target_with(ram(1 << 20, 4096));
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    h.set_features(fid::KEEP_ALIVE_TIMER, 5000).unwrap();
    assert_eq!(h.get_features(fid::KEEP_ALIVE_TIMER).unwrap(), 5000);
    h.set_features(fid::ASYNC_EVENT_CONFIG, 1 << 8).unwrap();
    assert_eq!(h.get_features(fid::ASYNC_EVENT_CONFIG).unwrap(), 1 << 8);
    assert_eq!(h.get_features(fid::NUMBER_OF_QUEUES).unwrap(), 0);
    assert_eq!(h.get_features(fid::VOLATILE_WRITE_CACHE).unwrap(), 1);
    // Interrupt Coalescing and Interrupt Vector Configuration are PCIe only: a fabrics
    // controller refuses them.
    for f in [fid::INTERRUPT_COALESCING, fid::INTERRUPT_VECTOR_CONFIG] {
        assert!(
            h.get_features(f).is_err(),
            "Get Features {f:#x} over fabrics"
        );
        assert!(h.set_features(f, 0x0A03).is_err(), "Set Features {f:#x}");
    }
    h.keep_alive().unwrap();
    let fw = h
        .get_log_page(lid::FIRMWARE_SLOT, 0, 512, 0, false)
        .unwrap();
    assert_eq!(fw[0], 1);
    assert_eq!(
        String::from_utf8_lossy(&fw[8..16]).trim_end(),
        env!("CARGO_PKG_VERSION")
    );
    let err = h
        .get_log_page(lid::ERROR_INFORMATION, 0, 64, 0, false)
        .unwrap();
    assert!(err.iter().all(|&b| b == 0));
    let smart = h
        .get_log_page(lid::SMART_HEALTH, 0xFFFF_FFFF, 512, 0, false)
        .unwrap();
    assert_eq!(SmartLog::decode(&smart).available_spare, 100);
    let _ = log::SMART_LEN;
}

#[test]
fn discovery_log_lists_the_subsystem() {
    let (t, addr) = target_with(ram(1 << 20, 4096));
    t.create_subsystem("nqn.2024-01.io.nacre:hidden", "S2", "m", false)
        .unwrap();
    t.add_listener("nqn.2024-01.io.nacre:hidden", addr).unwrap();
    let mut h = NvmfHost::connect(
        addr,
        DISCOVERY_NQN,
        HostOptions {
            io_queues: 0,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(h.id.cntrltype, cntrltype::DISCOVERY);
    assert_eq!(h.id.subnqn, DISCOVERY_NQN);
    // Header first, then the whole page (as nvme-cli does).
    let hdr = h.get_log_page(lid::DISCOVERY, 0, 1024, 0, false).unwrap();
    let numrec = u64::from_le_bytes(hdr[8..16].try_into().unwrap());
    assert_eq!(
        numrec, 1,
        "the subsystem that does not allow this host is hidden"
    );
    let page = h
        .get_log_page(lid::DISCOVERY, 0, 1024 * (1 + numrec as usize), 0, false)
        .unwrap();
    let (_, entries) = discovery::decode_log(&page);
    assert_eq!(entries.len(), 1);
    let e = &entries[0];
    assert_eq!(e.subnqn, NQN);
    assert_eq!((e.trtype, e.subtype), (TRTYPE_TCP, SUBTYPE_NVME));
    assert_eq!(e.traddr, "127.0.0.1");
    assert_eq!(e.trsvcid, addr.port().to_string());
    // A discovery controller has no I/O queues and no namespaces.
    assert!(matches!(
        h.identify(0, 1, 0),
        Err(HostError::Nvme(Status::INVALID_FIELD, _))
    ));
    // With the host allowed, the second subsystem appears.
    t.add_host("nqn.2024-01.io.nacre:hidden", &h.opts.hostnqn.clone())
        .unwrap();
    let hdr = h.get_log_page(lid::DISCOVERY, 0, 1024, 0, false).unwrap();
    assert_eq!(u64::from_le_bytes(hdr[8..16].try_into().unwrap()), 2);
}

#[test]
fn access_control_refuses_unknown_hosts() {
    let t = NvmfTarget::new();
    t.create_subsystem(NQN, "S", "M", false).unwrap();
    t.add_namespace(NQN, None, ram(1 << 20, 512), NGUID, "v".into())
        .unwrap();
    let addr = t.add_listener(NQN, "127.0.0.1:0".parse().unwrap()).unwrap();
    let r = NvmfHost::connect(addr, NQN, HostOptions::default());
    assert!(
        matches!(r, Err(HostError::Nvme(Status::CONNECT_INVALID_HOST, _))),
        "{:?}",
        r.err()
    );
    // Unknown subsystem: Connect Invalid Parameters pointing at SUBNQN in the data.
    let r = NvmfHost::connect(addr, "nqn.2024-01.io.nacre:nope", HostOptions::default());
    match r {
        Err(HostError::Nvme(s, dw0)) => {
            assert_eq!(s, Status::CONNECT_INVALID_PARAMETERS);
            assert_eq!(dw0, 1 << 16 | 256);
        }
        other => panic!("unexpected {:?}", other.err()),
    }
    t.add_host(NQN, &HostOptions::default().hostnqn).unwrap();
    let mut h = NvmfHost::connect(addr, NQN, HostOptions::default()).unwrap();
    h.write(0, 1, 0, &[7u8; 512], 512).unwrap();
    assert_eq!(h.read(0, 1, 0, 1, 512).unwrap(), vec![7u8; 512]);
}

#[test]
fn io_queue_connect_checks() {
    let (_t, addr) = target_with(ram(1 << 20, 4096));
    let mut h = NvmfHost::connect(
        addr,
        NQN,
        HostOptions {
            io_queues: 1,
            ..Default::default()
        },
    )
    .unwrap();
    // qid 1 is taken, qid 2 was not granted (1 queue asked for).
    for qid in [1u16, 2] {
        match h.connect_io_queue(qid, 32) {
            Err(HostError::Nvme(s, dw0)) => {
                assert_eq!(s, Status::CONNECT_INVALID_PARAMETERS);
                assert_eq!(dw0, 42, "IPO points at QID in the SQE");
            }
            other => panic!("qid {qid}: {:?}", other.err()),
        }
    }
    // A second Connect on a connected queue is a sequence error.
    let r = h
        .admin
        .connect(NQN, &h.opts.hostnqn.clone(), [0; 16], 0, 32, 0xFFFF, 0, 0)
        .unwrap();
    assert_eq!(r.status(), Status::COMMAND_SEQUENCE_ERROR);
    // Commands on a queue before Connect.
    let mut q = nacre_tests::nvmf_host::Queue::open(addr, Digests::NONE).unwrap();
    let r = q
        .call(
            Command {
                opcode: admin_opcode::KEEP_ALIVE,
                ..Default::default()
            },
            &[],
            0,
        )
        .unwrap();
    assert_eq!(r.status(), Status::COMMAND_SEQUENCE_ERROR);
    // Wrong CNTLID for an I/O queue.
    let r = q
        .connect(NQN, &h.opts.hostnqn.clone(), [0; 16], 1, 32, 0x7777, 0, 0)
        .unwrap();
    assert_eq!(r.status(), Status::CONNECT_INVALID_PARAMETERS);
    assert_eq!(r.cqe.dw0, 1 << 16 | 16);
}

/// A volume that completes every request later, from its own worker thread, like a remote
/// or offloaded backend.
struct DeferredVolume {
    inner: Arc<dyn BlockDevice>,
    tx: std::sync::Mutex<
        std::sync::mpsc::Sender<(
            nacre_dpu::volume::IoRequest,
            Arc<dyn nacre_dpu::volume::IoCompletion>,
        )>,
    >,
}

impl DeferredVolume {
    fn new(inner: Arc<dyn BlockDevice>) -> Arc<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<(
            nacre_dpu::volume::IoRequest,
            Arc<dyn nacre_dpu::volume::IoCompletion>,
        )>();
        let dev = inner.clone();
        std::thread::spawn(move || {
            while let Ok((req, done)) = rx.recv() {
                std::thread::sleep(std::time::Duration::from_micros(50));
                dev.submit(req, &done);
            }
        });
        Arc::new(DeferredVolume {
            inner,
            tx: std::sync::Mutex::new(tx),
        })
    }
}

// SAFETY: the receiving thread submits each request, with its completion, to the inner
// volume.
unsafe impl BlockDevice for DeferredVolume {
    fn geometry(&self) -> nacre_dpu::volume::Geometry {
        self.inner.geometry()
    }
    fn submit(
        &self,
        req: nacre_dpu::volume::IoRequest,
        done: &Arc<dyn nacre_dpu::volume::IoCompletion>,
    ) {
        let _ = self.tx.lock().unwrap().send((req, done.clone()));
    }
}

#[test]
fn completions_from_another_thread_are_sent_at_once() {
    let (_t, addr) = target_with(DeferredVolume::new(ram(4 << 20, 4096)));
    let opts = HostOptions {
        io_queues: 2,
        ..Default::default()
    };
    let mut h = NvmfHost::connect(addr, NQN, opts).unwrap();
    // Single commands: the host waits for each reply, so a reply left in the target's
    // send buffer would hang this test.
    let d = pattern(65536, 9);
    h.write(0, 1, 0, &d, 4096).unwrap();
    assert_eq!(h.read(1, 1, 0, 16, 4096).unwrap(), d);
    h.flush(1, 1).unwrap();
    h.write_zeroes(0, 1, 0, 1).unwrap();
    assert!(h.read(0, 1, 0, 1, 4096).unwrap().iter().all(|&b| b == 0));
    // A pipelined burst on one queue.
    let mut cids = Vec::new();
    for lba in 0..32u64 {
        let cmd = Command::rw(io_opcode::READ, 0, 1, lba, 1, SglDescriptor::default());
        cids.push((lba, h.io[1].submit(cmd, &[], 4096)));
    }
    h.io[1].flush().unwrap();
    for (lba, c) in cids {
        let r = h.io[1].wait(c).unwrap().ok().unwrap();
        let off = lba as usize * 4096;
        let want: Vec<u8> = if lba == 0 {
            vec![0; 4096]
        } else if off < d.len() {
            d[off..off + 4096].to_vec()
        } else {
            vec![0; 4096]
        };
        assert_eq!(r.data, want, "lba {lba}");
    }
}

/// Long reads leave the target by a gather write straight from their buffers, short ones
/// are copied behind their header: a pipelined mix of both, many in one send, with digests
/// and with C2HData SUCCESS (SQ flow control disabled), completed inline and from another
/// thread, must arrive whole, in their own commands, and verify.
#[test]
fn pipelined_reads_of_every_size_arrive_intact() {
    const BS: usize = 512;
    const SIZES: [usize; 7] = [512, 4096, 16384, 65536, 131072, 12288, 20480];
    let data = pattern(8 << 20, 5);
    for (i, (digests, disable_sq_flow, deferred)) in [
        (Digests::NONE, false, false),
        (
            Digests {
                header: true,
                data: true,
            },
            true,
            false,
        ),
        (
            Digests {
                header: false,
                data: true,
            },
            false,
            true,
        ),
        (Digests::NONE, true, true),
    ]
    .into_iter()
    .enumerate()
    {
        let vol = if deferred {
            DeferredVolume::new(ram(16 << 20, BS as u32))
        } else {
            ram(16 << 20, BS as u32)
        };
        let (_t, addr) = target_with(vol);
        let opts = HostOptions {
            digests,
            disable_sq_flow,
            ..Default::default()
        };
        let mut h = NvmfHost::connect(addr, NQN, opts).unwrap();
        for (c, chunk) in data.chunks(128 << 10).enumerate() {
            h.write(0, 1, (c * (128 << 10) / BS) as u64, chunk, BS)
                .unwrap();
        }
        // 120 reads in flight on one queue: sizes cycle, offsets wander over the data.
        let mut cids = Vec::new();
        for n in 0..120usize {
            let len = SIZES[n % SIZES.len()];
            let off = (n * 77_824 + i * 4096) % (data.len() - len) / BS * BS;
            let cmd = Command::rw(
                io_opcode::READ,
                0,
                1,
                (off / BS) as u64,
                (len / BS) as u32,
                SglDescriptor::default(),
            );
            cids.push((off, len, h.io[0].submit(cmd, &[], len)));
        }
        h.io[0].flush().unwrap();
        for (off, len, cid) in cids {
            let r = h.io[0].wait(cid).unwrap().ok().unwrap();
            assert!(
                r.data == data[off..off + len],
                "case {i}: read of {len} bytes at {off} differs"
            );
        }
    }
}

/// One reactor thread serves many connections at once: 16 hosts, each with an admin and two
/// I/O queues (48 connections), write and read back blocks of their own concurrently, on a
/// volume that completes inline and on one that completes on another thread (which must
/// wake the reactor: with no deadline pending it sleeps until woken).
#[test]
fn many_connections_share_one_reactor() {
    const HOSTS: usize = 16;
    for deferred in [false, true] {
        let vol = ram(16 << 20, 512);
        let vol: Arc<dyn BlockDevice> = if deferred {
            DeferredVolume::new(vol)
        } else {
            vol
        };
        let (_t, addr) = export(NvmfTarget::with_reactors(1), vol);
        let hosts: Vec<_> = (0..HOSTS)
            .map(|i| {
                std::thread::spawn(move || {
                    let opts = HostOptions {
                        io_queues: 2,
                        ..Default::default()
                    };
                    let mut h = NvmfHost::connect(addr, NQN, opts).unwrap();
                    for q in &h.io {
                        q.socket()
                            .set_read_timeout(Some(std::time::Duration::from_secs(30)))
                            .unwrap();
                    }
                    for round in 0..8 {
                        let lba = (i * 64 + round * 8) as u64;
                        let d = pattern(4096, (i * 8 + round) as u8);
                        h.write(round % 2, 1, lba, &d, 512).unwrap();
                        let back = h.read((round + 1) % 2, 1, lba, 8, 512);
                        assert_eq!(back.unwrap(), d, "host {i} round {round}");
                    }
                })
            })
            .collect();
        for h in hosts {
            h.join().unwrap();
        }
    }
}
