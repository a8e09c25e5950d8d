//! Seed inputs for the cargo-fuzz targets (fuzz/), drawn from the seeded generators in
//! `nacre_tests::fuzz` and laid out in the input formats of `nacre_dpu::fuzzing`.
//!
//!     fuzz-seeds OUT_DIR [SEEDS_PER_TARGET] [SEED]
//!
//! writes OUT_DIR/<target>/seed-NNNN for each target. `scripts/fuzz-seeds` feeds them to
//! `cargo fuzz cmin`, whose result is what fuzz/corpus/ holds.

use std::path::Path;

use anyhow::{Context, Result};
use nacre_dpu::control::{Daemon, DaemonConfig};
use nacre_dpu::frontend::vhost_user_blk::spec;
use nacre_dpu::fuzzing::{self as fz, seed, CmdRecord};
use nacre_shared::nvme::{Command, Completion, SglDescriptor, Status};
use nacre_shared::nvme_tcp::{self as tcp, pdu_type, Digests};
use nacre_tests::fuzz::{capsule, edge_len, h2c_data, half_valid_pdu, icreq, Rng, RpcGen};
use nacre_tests::nvmf_host::raw_pdu;
use serde_json::{json, Value};

/// One seed input from a generator.
type Generator = fn(&mut Rng) -> Vec<u8>;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let out = Path::new(
        args.get(1)
            .context("usage: fuzz-seeds OUT_DIR [N] [SEED]")?,
    );
    let n: usize = args.get(2).map_or(Ok(200), |s| s.parse())?;
    let seed: u64 = args
        .get(3)
        .map_or(Ok(0x6e61_6372_6566_757a), |s| s.parse())?;
    let mut r = Rng::new(seed);
    let gens: [(&str, Generator); 5] = [
        ("virtqueue", virtqueue),
        ("nvmf_target", nvmf_target),
        ("nvme_commands", nvme_commands),
        ("nvmf_initiator", nvmf_initiator),
        ("vfio_user", vfio_user),
    ];
    for (name, g) in gens {
        write_all(out, name, (0..n).map(|_| g(&mut r)))?;
    }
    let rpc = json_rpc(&mut r, n)?;
    write_all(out, "json_rpc", rpc.into_iter())?;
    Ok(())
}

fn write_all(out: &Path, target: &str, seeds: impl Iterator<Item = Vec<u8>>) -> Result<()> {
    let dir = out.join(target);
    std::fs::create_dir_all(&dir)?;
    for (i, s) in seeds.enumerate() {
        std::fs::write(dir.join(format!("seed-{i:04}")), s)?;
    }
    Ok(())
}

// ---- vfio_user ----

/// vfio-user commands (vfio-user protocol 0.1, §"Commands").
const VFU_VERSION: u16 = 1;
const VFU_DMA_UNMAP: u16 = 3;
const VFU_GET_INFO: u16 = 4;
const VFU_GET_REGION_INFO: u16 = 5;
const VFU_GET_IRQ_INFO: u16 = 7;
const VFU_SET_IRQS: u16 = 8;
const VFU_REGION_READ: u16 = 9;
const VFU_REGION_WRITE: u16 = 10;
const VFU_RESET: u16 = 13;
/// Region indexes: BAR0 and the configuration space.
const VFU_BAR0: u32 = 0;
const VFU_CONFIG: u32 = 7;

/// One vfio-user message: the 16-byte header (id, command, size, flags 0, error 0), then
/// the payload.
fn vfu_msg(out: &mut Vec<u8>, id: u16, command: u16, payload: &[u8]) {
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&command.to_le_bytes());
    out.extend_from_slice(&(16 + payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0; 8]);
    out.extend_from_slice(payload);
}

/// A region write of `data` at `offset` of region `region`.
fn vfu_write(out: &mut Vec<u8>, id: u16, region: u32, offset: u64, data: &[u8]) {
    let mut p = offset.to_le_bytes().to_vec();
    p.extend_from_slice(&region.to_le_bytes());
    p.extend_from_slice(&(data.len() as u32).to_le_bytes());
    p.extend_from_slice(data);
    vfu_msg(out, id, VFU_REGION_WRITE, &p);
}

/// A submission queue entry: opcode, command id, namespace, PRP1, PRP2, CDW10..12.
fn vfu_sqe(op: u8, cid: u16, nsid: u32, prp: (u64, u64), cdw: [u32; 3]) -> [u8; 64] {
    let mut e = [0u8; 64];
    e[0] = op;
    e[2..4].copy_from_slice(&cid.to_le_bytes());
    e[4..8].copy_from_slice(&nsid.to_le_bytes());
    e[24..32].copy_from_slice(&prp.0.to_le_bytes());
    e[32..40].copy_from_slice(&prp.1.to_le_bytes());
    for (i, d) in cdw.iter().enumerate() {
        e[40 + 4 * i..44 + 4 * i].copy_from_slice(&d.to_le_bytes());
    }
    e
}

/// A guest address for the fuzzer's PRPs: mostly page 5 or 6 (data), sometimes unaligned,
/// beyond the memory, or zero.
fn vfu_prp(r: &mut Rng) -> u64 {
    match r.below(8) {
        0 => r.next_u64(),
        1 => 0x5000 + r.below(0x1000),
        2 => 0x8000 + 0x1000 * r.below(4),
        _ => 0x5000 + 0x1000 * r.below(2),
    }
}

/// A session the way an NVMe driver starts one (guest memory: admin SQ at 0, I/O SQ at
/// 0x1000, admin CQ at 0x2000, I/O CQ at 0x3000, identify data at 0x4000, data at 0x5000
/// and 0x6000; only the two submission queues are in the input's memory image): the version and device queries, bus mastering, the admin queue registers, CC.EN,
/// Identify, an I/O queue pair, reads, writes and flushes; then some mischief — a stray
/// message, a doorbell beyond the queue, a reset, an unmap — and random bytes now and then.
fn vfio_user(r: &mut Rng) -> Vec<u8> {
    let pages = 8u8;
    let mut mem = vec![0u8; 0x1200];
    let admin = [
        vfu_sqe(0x06, 1, 0, (0x4000, 0), [1, 0, 0]),
        vfu_sqe(0x06, 2, 1, (0x4000, 0), [0, 0, 0]),
        // Create I/O CQ 1 (16 entries, contiguous, interrupts off), then I/O SQ 1 on it.
        vfu_sqe(0x05, 3, 0, (0x3000, 0), [15 << 16 | 1, 1, 0]),
        vfu_sqe(0x01, 4, 0, (0x1000, 0), [15 << 16 | 1, 1 << 16 | 1, 0]),
    ];
    let n_admin = 1 + r.below(admin.len() as u64) as usize;
    for (i, e) in admin.iter().take(n_admin).enumerate() {
        mem[i * 64..(i + 1) * 64].copy_from_slice(e);
    }
    let n_io = r.below(8) as usize;
    for i in 0..n_io {
        let any = r.below(256) as u8;
        let op = r.pick(&[0x01u8, 0x02, 0x00, 0x08, 0x09, any]);
        let far = r.next_u64();
        let slba = r.pick(&[0u64, 1, 127, 128, far]);
        let many = r.below(1 << 16) as u32;
        let nlb = r.pick(&[0u32, 7, 15, many]);
        let e = vfu_sqe(
            op,
            100 + i as u16,
            r.pick(&[1u32, 1, 0, 2, u32::MAX]),
            (vfu_prp(r), vfu_prp(r)),
            [slba as u32, (slba >> 32) as u32, nlb],
        );
        mem[0x1000 + i * 64..0x1000 + (i + 1) * 64].copy_from_slice(&e);
    }
    let mut s = Vec::new();
    let mut id = 0u16;
    let mut next = || {
        id = id.wrapping_add(1);
        id
    };
    vfu_msg(&mut s, next(), VFU_VERSION, &[0, 0, 1, 0]);
    vfu_msg(
        &mut s,
        next(),
        VFU_GET_INFO,
        &[16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    );
    let mut info = vec![0u8; 32];
    info[0] = 64;
    info[8] = r.pick(&[0u8, 4, 7, 9]);
    vfu_msg(&mut s, next(), VFU_GET_REGION_INFO, &info);
    let mut irq = vec![0u8; 16];
    irq[0] = 16;
    irq[8] = r.below(5) as u8;
    vfu_msg(&mut s, next(), VFU_GET_IRQ_INFO, &irq);
    // PCI Command: memory space and bus master.
    vfu_write(&mut s, next(), VFU_CONFIG, 4, &6u16.to_le_bytes());
    // AQA (16 entries each), ASQ 0, ACQ 0x2000, CC: IOCQES 4, IOSQES 6, EN.
    vfu_write(
        &mut s,
        next(),
        VFU_BAR0,
        0x24,
        &(15u32 << 16 | 15).to_le_bytes(),
    );
    vfu_write(&mut s, next(), VFU_BAR0, 0x28, &0u64.to_le_bytes());
    vfu_write(&mut s, next(), VFU_BAR0, 0x30, &0x2000u64.to_le_bytes());
    vfu_write(
        &mut s,
        next(),
        VFU_BAR0,
        0x14,
        &0x0046_0001u32.to_le_bytes(),
    );
    let mut read = 0x1cu64.to_le_bytes().to_vec();
    read.extend_from_slice(&VFU_BAR0.to_le_bytes());
    read.extend_from_slice(&4u32.to_le_bytes());
    vfu_msg(&mut s, next(), VFU_REGION_READ, &read);
    // Admin SQ 0 tail (doorbell page at BAR0 0x1000; stride 4 bytes).
    vfu_write(
        &mut s,
        next(),
        VFU_BAR0,
        0x1000,
        &(n_admin as u32).to_le_bytes(),
    );
    if n_io > 0 {
        let tail = if r.chance(6) { 40 } else { n_io as u32 };
        vfu_write(&mut s, next(), VFU_BAR0, 0x1008, &tail.to_le_bytes());
        vfu_write(
            &mut s,
            next(),
            VFU_BAR0,
            0x100c,
            &(n_io as u32).to_le_bytes(),
        );
    }
    vfu_write(
        &mut s,
        next(),
        VFU_BAR0,
        0x1004,
        &(n_admin as u32).to_le_bytes(),
    );
    match r.below(6) {
        0 => vfu_msg(&mut s, next(), VFU_RESET, &[]),
        1 => {
            let mut p = vec![0u8; 24];
            p[0] = 24;
            p[4] = 2; // VFIO_DMA_UNMAP_FLAG_ALL
            vfu_msg(&mut s, next(), VFU_DMA_UNMAP, &p);
            vfu_write(&mut s, next(), VFU_BAR0, 0x1000, &0u32.to_le_bytes());
        }
        2 => {
            let mut p = vec![0u8; 20];
            p[0] = 20;
            p[8] = 2;
            p[16] = 4;
            vfu_msg(&mut s, next(), VFU_SET_IRQS, &p);
        }
        3 => vfu_write(
            &mut s,
            next(),
            VFU_BAR0,
            0x14,
            &0x0046_4001u32.to_le_bytes(),
        ),
        4 => {
            let n = r.below(64) as usize;
            let junk = r.bytes(n);
            vfu_msg(&mut s, next(), r.below(20) as u16, &junk);
        }
        _ => {}
    }
    if r.chance(8) {
        let n = r.below(48) as usize;
        let junk = r.bytes(n);
        s.extend_from_slice(&junk);
    }
    let mut input = vec![pages - 1];
    input.extend_from_slice(&(mem.len() as u16).to_le_bytes());
    input.extend_from_slice(&mem);
    input.extend_from_slice(&s);
    input
}

// ---- virtqueue ----

/// Descriptor flags (virtio 1.2 §2.7.5): VIRTQ_DESC_F_NEXT, _WRITE, _INDIRECT.
const NEXT: u16 = 1;
const WRITE: u16 = 2;
const INDIRECT: u16 = 4;

/// A guest address for `len` bytes: mostly inside one region, sometimes across the hole or
/// outside guest memory.
fn guest_addr(r: &mut Rng, len: u32) -> u64 {
    let (base1, len1) = fz::VQ_REGIONS[1];
    match r.below(10) {
        0 => fz::VQ_REGIONS[0].1 as u64 - u64::from(len.min(64)) / 2,
        1 => r.next_u64(),
        2..=4 => base1 + r.below((len1 as u64).saturating_sub(u64::from(len)).max(1)),
        _ => 0x4000 + r.below(0x8000),
    }
}

/// One request laid out as descriptors (not yet linked) and the data-area bytes it needs.
fn request(r: &mut Rng, data: &mut Vec<u8>) -> Vec<seed::Desc> {
    let rtype = match r.below(8) {
        0 | 1 => spec::T_IN,
        2 | 3 => spec::T_OUT,
        4 => spec::T_FLUSH,
        5 => spec::T_GET_ID,
        6 => r.pick(&[spec::T_DISCARD, spec::T_WRITE_ZEROES]),
        _ => r.next_u64() as u32 % 16,
    };
    // Header in the data area.
    let hdr_at = fz::VQ_DATA + data.len() as u64;
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&rtype.to_le_bytes());
    let sector = if r.chance(8) {
        r.next_u64()
    } else {
        r.below(fz::VQ_VOLUME / 512 + 4)
    };
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    data.extend_from_slice(&h);
    let mut descs = Vec::new();
    if r.chance(5) {
        // Header split across two descriptors.
        descs.push(seed::Desc {
            addr: hdr_at,
            len: 8,
            flags: 0,
            next: 0,
        });
        descs.push(seed::Desc {
            addr: hdr_at + 8,
            len: 8,
            flags: 0,
            next: 0,
        });
    } else {
        descs.push(seed::Desc {
            addr: hdr_at,
            len: 16,
            flags: 0,
            next: 0,
        });
    }
    let sectors = 1 + r.below(8) as u32;
    match rtype {
        spec::T_IN | spec::T_OUT | spec::T_GET_ID => {
            let total = if rtype == spec::T_GET_ID {
                r.pick(&[20u32, 19, 32, 1])
            } else if r.chance(6) {
                edge_len(r, 4096)
            } else {
                512 * sectors
            };
            let pieces = 1 + r.below(3) as u32;
            let flags = if rtype == spec::T_OUT { 0 } else { WRITE };
            for i in 0..pieces {
                let len = if i + 1 == pieces {
                    total - total / pieces * (pieces - 1)
                } else {
                    total / pieces
                };
                descs.push(seed::Desc {
                    addr: guest_addr(r, len),
                    len,
                    flags,
                    next: 0,
                });
            }
        }
        spec::T_DISCARD | spec::T_WRITE_ZEROES => {
            let at = fz::VQ_DATA + data.len() as u64;
            let mut seg = [0u8; 16];
            seg[0..8].copy_from_slice(&r.below(fz::VQ_VOLUME / 512 + 4).to_le_bytes());
            seg[8..12].copy_from_slice(&sectors.to_le_bytes());
            let flags = if r.chance(3) { r.below(4) as u32 } else { 0 };
            seg[12..16].copy_from_slice(&flags.to_le_bytes());
            data.extend_from_slice(&seg);
            descs.push(seed::Desc {
                addr: at,
                len: 16,
                flags: 0,
                next: 0,
            });
        }
        _ => {}
    }
    // Status byte.
    let at = fz::VQ_DATA + data.len() as u64;
    data.push(0xff);
    descs.push(seed::Desc {
        addr: at,
        len: 1,
        flags: WRITE,
        next: 0,
    });
    if r.chance(10) {
        let i = r.below(descs.len() as u64) as usize;
        descs[i].flags ^= 1 << r.below(3);
    }
    descs
}

fn virtqueue(r: &mut Rng) -> Vec<u8> {
    let mut data = Vec::new();
    let mut table: Vec<seed::Desc> = Vec::new();
    let mut heads = Vec::new();
    let chains = 1 + r.below(4);
    for _ in 0..chains {
        let mut descs = request(r, &mut data);
        if r.chance(4) {
            // The whole request in an indirect table in the data area (16-byte aligned).
            while data.len() % 16 != 0 {
                data.push(0);
            }
            let at = fz::VQ_DATA + data.len() as u64;
            let n = descs.len();
            for (i, d) in descs.iter().enumerate() {
                let mut e = [0u8; 16];
                e[0..8].copy_from_slice(&d.addr.to_le_bytes());
                e[8..12].copy_from_slice(&d.len.to_le_bytes());
                let last = i + 1 == n;
                let flags = d.flags | if last { 0 } else { NEXT };
                e[12..14].copy_from_slice(&flags.to_le_bytes());
                e[14..16].copy_from_slice(&((i + 1) as u16 % n as u16).to_le_bytes());
                data.extend_from_slice(&e);
            }
            descs = vec![seed::Desc {
                addr: at,
                len: 16 * n as u32,
                flags: INDIRECT,
                next: 0,
            }];
        }
        if table.len() + descs.len() > fz::VQ_SIZE as usize {
            break;
        }
        heads.push(table.len() as u16);
        let base = table.len() as u16;
        let n = descs.len();
        for (i, mut d) in descs.into_iter().enumerate() {
            if i + 1 < n {
                d.flags |= NEXT;
                d.next = base + i as u16 + 1;
            }
            table.push(d);
        }
    }
    if r.chance(10) {
        // A loop, or a head beyond the queue.
        let i = r.below(table.len() as u64) as usize;
        table[i].flags |= NEXT;
        table[i].next = r.below(u64::from(fz::VQ_SIZE) + 2) as u16;
    }
    let flags = if r.chance(8) { 1 } else { 0 }
        | if r.chance(2) { 2 } else { 0 }
        | (r.pick(&[0u8, 1, 3, 15]) << 4);
    seed::virtqueue(flags, &heads, &table, &data)
}

// ---- NVMe/TCP target ----

const LBAS: u64 = fz::NS_BYTES / fz::NS_LBA as u64;

fn nvmf_target(r: &mut Rng) -> Vec<u8> {
    let mut stream = Vec::new();
    let mut dg = Digests::NONE;
    if r.chance(3) {
        // Connected and enabled admin queue, then random PDUs on it.
        dg = Digests {
            header: r.chance(3),
            data: r.chance(3),
        };
        stream.extend(seed::host_opening(dg));
    } else if r.chance(2) {
        let (ic, negotiated) = icreq(r);
        stream.extend(ic);
        dg = negotiated;
    }
    for _ in 0..1 + r.below(4) {
        match r.below(4) {
            0 => {
                let n = r.below(300) as usize;
                stream.extend(r.bytes(n))
            }
            1 => stream.extend(half_valid_pdu(r, dg)),
            2 => stream.extend(h2c_data(r)),
            _ => stream.extend(capsule(r, &fz::ADMIN_WRITES, dg, LBAS)),
        }
    }
    stream
}

// ---- NVMe commands ----

fn sqe(c: &Command) -> [u8; 64] {
    let mut b = [0u8; 64];
    c.encode(&mut b);
    b
}

fn nvme_commands(r: &mut Rng) -> Vec<u8> {
    let mut recs = Vec::new();
    for _ in 0..1 + r.below(6) {
        let io = r.chance(2);
        let mut c = Command::decode(&r.bytes(64));
        if !r.chance(4) {
            c = Command::decode(&[0u8; 64]);
            c.nsid = r.pick(&[1, 1, 1, 0, 2, 0xffff_ffff]);
        }
        let mut data = Vec::new();
        let mut fix_sgl = false;
        if io {
            let any = r.next_u64() as u8;
            c.opcode = r.pick(&[0x02, 0x01, 0x00, 0x08, 0x09, 0x04, 0x0c, any]);
            c.cdw10 = r.below(LBAS + 4) as u32;
            c.cdw12 = r.below(16) as u32 | if r.chance(8) { 1 << 30 } else { 0 };
            let blocks = (c.cdw12 & 0xffff) as usize + 1;
            match c.opcode {
                0x01 => {
                    data = r.bytes(blocks * fz::NS_LBA as usize);
                    fix_sgl = !r.chance(6);
                }
                0x09 => {
                    // Dataset Management ranges.
                    c.cdw10 = r.below(3) as u32;
                    c.cdw11 = r.pick(&[4, 0, 2]);
                    let mut b = Vec::new();
                    for _ in 0..=c.cdw10 {
                        let mut range = [0u8; 16];
                        range[4..8].copy_from_slice(&(1 + r.below(32) as u32).to_le_bytes());
                        range[8..16].copy_from_slice(&r.below(LBAS + 4).to_le_bytes());
                        b.extend_from_slice(&range);
                    }
                    data = b;
                    fix_sgl = true;
                }
                _ => {
                    c.flags = nacre_shared::nvme::command::PSDT_SGL;
                    c.sgl = SglDescriptor::transport(edge_len(r, 4096 * blocks as u32));
                }
            }
        } else {
            c.opcode = r.pick(&[0x06, 0x02, 0x09, 0x0a, 0x0c, 0x18, 0x7f, 0x04, 0x05]);
            match c.opcode {
                0x06 => {
                    let any = r.next_u64() as u32 & 0xff;
                    c.cdw10 = r.pick(&[0, 1, 2, 3, 5, 6, 0x10, any]);
                }
                0x02 => {
                    let dwords = r.pick(&[127u32, 1023, 3, 0xffff]);
                    c.cdw10 = r.pick(&[1, 2, 3, 0x70, 0x80, 4]) | (dwords << 16);
                }
                0x09 | 0x0a => {
                    c.cdw10 = r.pick(&[0x07, 0x0f, 0x0b, 0x04, 0x06, 0x08, 0x80]);
                    c.cdw11 = r.next_u64() as u32;
                }
                0x7f => {
                    // Fabrics Property Get/Set.
                    c.nsid = 0;
                    c.cdw10 = r.pick(&[0x00, 0x04]);
                    c.cdw11 = r.pick(&[0, 1]);
                    c.cdw12 = r.pick(&[0x00, 0x08, 0x14, 0x1c, 0x20, 0x0c]);
                    c.cdw13 = r.next_u64() as u32;
                }
                _ => {}
            }
            if r.chance(3) {
                c.flags = nacre_shared::nvme::command::PSDT_SGL;
                c.sgl = SglDescriptor::transport(r.pick(&[4096, 512, 0, 8192]));
            }
        }
        recs.push(CmdRecord {
            io,
            fix_sgl,
            sqe: sqe(&c),
            data,
        });
    }
    seed::commands(&recs)
}

// ---- NVMe/TCP initiator ----

fn nvmf_initiator(r: &mut Rng) -> Vec<u8> {
    let opts = if r.chance(3) { r.below(4) as u8 } else { 0 }
        | if r.chance(3) {
            fz::init_flags::IO_QUEUE
        } else {
            0
        };
    let dg = Digests {
        header: opts & fz::init_flags::HEADER_DIGEST != 0,
        data: opts & fz::init_flags::DATA_DIGEST != 0,
    };
    let [rd, wr, io] = fz::INIT_CIDS;
    let mut s = Vec::new();
    let ok = |s: &mut Vec<u8>, cid: u16| {
        tcp::encode_capsule_resp(s, &Completion::new(cid, Status::SUCCESS), dg)
    };
    let mut steps: Vec<u8> = (0..3 + r.below(5)).map(|_| r.below(9) as u8).collect();
    if r.chance(2) {
        steps = vec![0, 1, 2, 3, 4, 5];
    }
    for step in steps {
        match step {
            // The admin read's data in one or two PDUs, then its completion.
            0 => {
                let split = r.pick(&[4096u32, 2048, 1024]);
                let mut off = 0;
                while off < 4096 {
                    let len = split.min(4096 - off);
                    let last = off + len == 4096;
                    tcp::encode_c2h_data(
                        &mut s,
                        rd,
                        off,
                        &r.bytes(len as usize),
                        last,
                        false,
                        dg,
                        0,
                    );
                    off += len;
                }
            }
            1 => ok(&mut s, rd),
            // R2T for the write, then its completion.
            2 => {
                let (o, l) = if r.chance(3) {
                    (edge_len(r, 12288), edge_len(r, 12288))
                } else {
                    (0, 8192)
                };
                tcp::encode_r2t(&mut s, wr, r.below(4) as u16, o, l, dg);
            }
            3 => ok(&mut s, wr),
            // The I/O read's data, with SUCCESS (no CapsuleResp follows) half the time.
            4 => {
                let success = r.chance(2);
                tcp::encode_c2h_data(&mut s, io, 0, &r.bytes(fz::INIT_READ), true, success, dg, 0);
            }
            5 => ok(&mut s, io),
            6 => {
                let any = r.next_u64() as u16;
                let cid = r.pick(&[rd, wr, io, any]);
                let mut cqe = Completion::new(cid, Status::new(0, r.below(8) as u8, false));
                cqe.sqhd = r.next_u64() as u16;
                tcp::encode_capsule_resp(&mut s, &cqe, dg);
            }
            7 => {
                // A data header near its legal values.
                let t = r.pick(&[pdu_type::C2H_DATA, pdu_type::R2T, pdu_type::CAPSULE_RESP]);
                let len = r.below(600) as usize;
                let mut b = raw_pdu(t, r.next_u64() as u8, 24, 24, (24 + len) as u32, 24);
                b[8..10].copy_from_slice(&r.pick(&[rd, wr, io]).to_le_bytes());
                b[12..16].copy_from_slice(&edge_len(r, 8192).to_le_bytes());
                b[16..20].copy_from_slice(&edge_len(r, 8192).to_le_bytes());
                b.extend(r.bytes(len));
                s.extend(b);
            }
            _ => tcp::encode_term_req(&mut s, true, r.below(8) as u16, 0, &r.bytes(24)),
        }
    }
    if r.chance(8) {
        let i = r.below(s.len().max(1) as u64) as usize;
        if let Some(b) = s.get_mut(i) {
            *b ^= 1 << r.below(8);
        }
    }
    seed::initiator(opts, &s)
}

// ---- JSON-RPC ----

fn json_rpc(r: &mut Rng, n: usize) -> Result<Vec<Vec<u8>>> {
    // Learn each method's fields from its own "unknown field" error, in-process.
    let tmp = tempfile::tempdir()?;
    let (d, _) = Daemon::open(DaemonConfig::new(
        tmp.path().join("state"),
        tmp.path().join("run"),
    ))?;
    let mut fields = Vec::new();
    for m in nacre_dpu::control::methods() {
        if fz::RPC_SKIPPED.contains(&m.name) {
            continue;
        }
        let keys: Vec<String> = match d.call(m.name, json!({"__probe__": 1})) {
            Err(e) if e.message.contains("unknown field") => {
                let tail = e.message.split("expected").nth(1).unwrap_or("").to_string();
                tail.split('`')
                    .skip(1)
                    .step_by(2)
                    .map(str::to_string)
                    .collect()
            }
            _ => Vec::new(),
        };
        fields.push((m.name.to_string(), keys));
    }
    d.shutdown();
    let mut g = RpcGen {
        rng: Rng::new(r.next_u64()),
        dir: fz::RPC_DIR.trim_end_matches('/').to_string(),
    };
    let mut seeds = Vec::new();
    for _ in 0..n {
        let mut text = Vec::new();
        let calls = 1 + g.rng.below(5);
        let mut batch = Vec::new();
        for i in 0..calls {
            let (method, keys) = g.rng.pick(&fields);
            let params = g.params(&method, &keys);
            let mut call = json!({"jsonrpc": "2.0", "method": method, "params": params});
            if !g.rng.chance(8) {
                call["id"] = json!(i);
            }
            if g.rng.chance(6) {
                batch.push(call);
                continue;
            }
            text.extend(serde_json::to_vec(&call)?);
            text.push(b'\n');
        }
        if !batch.is_empty() {
            text.extend(serde_json::to_vec(&Value::Array(batch))?);
        }
        if g.rng.chance(10) {
            let cut = g.rng.below(text.len() as u64 + 1) as usize;
            text.truncate(cut);
        }
        seeds.push(text);
    }
    Ok(seeds)
}
