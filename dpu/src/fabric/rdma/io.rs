//! The I/O path of an NVMe/RDMA host queue (module docs of [`super`], NVMe RDMA 1.0 §3.2):
//! putting a command in a slot and posting its capsule SEND, with its data in the capsule or
//! named by a Keyed SGL Data Block (the request's own registered memory, or the slot's
//! buffer), releasing slots, and posting the RECV ring's buffers.

use std::sync::atomic::Ordering;

use nacre_shared::nvme::command::{PSDT_SGL, SQE_LEN};
use nacre_shared::nvme::{admin_opcode, put_u32, put_u64, SglDescriptor};
use rdma_sys::*;
use tracing::warn;

use super::{
    RdmaQueue, Slots, MAX_TRANSFER, RSP_LEN, SGL_KEYED_DATA_BLOCK_ADDRESS, WR_RECV, WR_SEND,
};
use crate::fabric::cmd::{Cmd, Dir};
use crate::fabric::queue::cid_of;
use crate::rdma::verbs;
use crate::telemetry::clock;

impl RdmaQueue {
    /// Put `cmd` in slot `idx` and post its capsule. On failure the command comes back.
    pub(super) fn issue(&self, s: &mut Slots, idx: u16, mut cmd: Cmd) -> Result<(), Cmd> {
        let i = idx as usize;
        let slot = &mut s.entries[i];
        slot.gen = slot.gen.wrapping_add(1) & 0x3F;
        let cid = cid_of(idx, slot.gen);
        cmd.sqe.cid = cid;
        cmd.sqe.flags = (cmd.sqe.flags & !0xC0) | PSDT_SGL;
        let in_capsule = cmd.dir == Dir::H2C
            && cmd.len <= self.icd_max
            && cmd.sqe.opcode != admin_opcode::FABRICS;
        let send = self.send.as_ref().expect("registered at setup");
        // SAFETY: slot i's capsule is ours: the slot was free, so its previous SEND has
        // completed (a slot is freed only after that).
        let capsule = unsafe {
            std::slice::from_raw_parts_mut(send.ptr.add(i * self.capsule_len), self.capsule_len)
        };
        let direct = if cmd.len > 0 { self.direct(&cmd) } else { None };
        let mut sges = [ibv_sge {
            addr: send.addr(i * self.capsule_len),
            length: SQE_LEN as u32,
            lkey: send.lkey(),
        }; 2];
        let mut nsge = 1;
        if in_capsule {
            cmd.sqe.sgl = SglDescriptor::in_capsule(cmd.len as u32);
            cmd.sqe.encode(&mut capsule[..SQE_LEN]);
            match &direct {
                // The data follows the SQE in the same SEND, gathered from request memory.
                Some((addr, d)) => {
                    sges[1] = ibv_sge {
                        addr: *addr,
                        length: cmd.len as u32,
                        lkey: d.mr.lkey(),
                    };
                    nsge = 2;
                    self.direct_bytes
                        .fetch_add(cmd.len as u64, Ordering::Relaxed);
                }
                None => {
                    cmd.read_data(0, &mut capsule[SQE_LEN..SQE_LEN + cmd.len]);
                    sges[0].length += cmd.len as u32;
                    self.bounced_bytes
                        .fetch_add(cmd.len as u64, Ordering::Relaxed);
                }
            }
            self.in_capsule.fetch_add(1, Ordering::Relaxed);
        } else {
            cmd.sqe.encode(&mut capsule[..SQE_LEN]);
            // Keyed SGL Data Block (NVMe Base 2.0 Figure 119): address, 24-bit length, key,
            // identifier in byte 15. A command without data carries one of length 0 (what
            // Linux sends; nvmet-rdma refuses any other descriptor type as an invalid field).
            let (addr, key) = match &direct {
                Some((addr, d)) => {
                    self.direct_bytes
                        .fetch_add(cmd.len as u64, Ordering::Relaxed);
                    (*addr, d.mr.rkey())
                }
                None if cmd.len > 0 => {
                    let d = &self.data[i];
                    if cmd.dir == Dir::H2C {
                        // SAFETY: slot i is ours and its SEND is not posted yet.
                        let b = unsafe { self.data_buf(i, cmd.len) };
                        cmd.read_data(0, b);
                        self.bounced_bytes
                            .fetch_add(cmd.len as u64, Ordering::Relaxed);
                    }
                    (d.addr(0), d.rkey())
                }
                None => (0, 0),
            };
            capsule[24..40].copy_from_slice(&keyed_sgl(addr, cmd.len as u32, key));
        }
        // SAFETY: plain data; all-zero is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_SEND | i as u64;
        wr.sg_list = sges.as_mut_ptr();
        wr.num_sge = nsge;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        tracing::trace!(target: crate::telemetry::trace::TARGET, qid = self.qid,
            cid = format_args!("{cid:#06x}"), opcode = cmd.sqe.opcode, len = cmd.len,
            "fabric: RDMA command sent");
        let slot = &mut s.entries[i];
        slot.sending = true;
        slot.answered = false;
        slot.issued_ns = clock::now_ns();
        slot.direct = direct.map(|(_, d)| d);
        // SAFETY: the queue pair lives as long as self; the request and its SGE are copied
        // by the provider; the capsule and data buffer are the slot's until it is freed.
        let rc = unsafe { ibv_post_send((*self.id).qp, &mut wr, &mut bad) };
        if rc != 0 {
            slot.sending = false;
            slot.direct = None;
            s.free.push(idx);
            warn!(
                qid = self.qid,
                rc, "ibv_post_send failed: closing the NVMe/RDMA queue"
            );
            self.dead.store(true, Ordering::Release);
            return Err(cmd);
        }
        s.entries[i].cmd = Some(cmd);
        Ok(())
    }

    /// Release slot `i` if both its response and its own SEND completion are in (either
    /// may arrive first); otherwise nothing yet.
    pub(super) fn release_when_done(&self, s: &mut Slots, i: usize) -> Vec<Cmd> {
        let e = &s.entries[i];
        if e.answered && !e.sending {
            self.release(s, i)
        } else {
            Vec::new()
        }
    }

    /// Slot `i` is done with (answered and its SEND completed): the next waiting command
    /// takes it, or it goes back on the free list.
    fn release(&self, s: &mut Slots, i: usize) -> Vec<Cmd> {
        let slot = &mut s.entries[i];
        slot.sending = false;
        slot.answered = false;
        let mut failed = Vec::new();
        if !s.closed {
            if let Some(c) = s.overflow.pop_front() {
                if let Err(c) = self.issue(s, i as u16, c) {
                    failed.push(c);
                }
                return failed;
            }
        }
        s.free.push(i as u16);
        failed
    }

    pub(super) fn post_recv(&self, r: usize) -> bool {
        let b = self.recv.as_ref().expect("registered at setup");
        // SAFETY: the queue pair exists for self's life; RECV buffer r belongs to the device
        // until its completion is polled.
        unsafe {
            verbs::post_recv_slot(
                (*self.id).qp,
                b,
                r * RSP_LEN,
                RSP_LEN as u32,
                WR_RECV | r as u64,
            )
        }
    }

    /// The data buffer of slot `s`.
    ///
    /// # Safety
    /// The caller holds slot `s` (a command is in it, or its response arrived and the caller
    /// is the completion thread) and the controller is not moving data for it at the same
    /// time: before the SEND is posted, or after its response arrived.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn data_buf(&self, s: usize, len: usize) -> &mut [u8] {
        let d = &self.data[s];
        debug_assert!(len <= MAX_TRANSFER);
        // SAFETY: in bounds (slot s's buffer is MAX_TRANSFER bytes); exclusive per the caller.
        unsafe { std::slice::from_raw_parts_mut(d.ptr, len) }
    }
}

/// A Keyed SGL Data Block descriptor, Address subtype (NVMe Base 2.0 §4.3.2, Figure 119):
/// bytes 0-7 address, 8-10 length (24 bits), 11-14 key, 15 the identifier (type 4h, subtype
/// 0h). `len` is below 2^24 ([`MAX_TRANSFER`] is 128 KiB).
fn keyed_sgl(addr: u64, len: u32, key: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    put_u64(&mut b, 0, addr);
    b[8..11].copy_from_slice(&len.to_le_bytes()[..3]);
    put_u32(&mut b, 11, key);
    b[15] = SGL_KEYED_DATA_BLOCK_ADDRESS;
    b
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn keyed_sgl_layout_matches_figure_119() {
        let b = keyed_sgl(0x1122_3344_5566_7788, 0x02_0000, 0xAABB_CCDD);
        assert_eq!(&b[..8], &[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]);
        assert_eq!(
            &b[8..11],
            &[0x00, 0x00, 0x02],
            "24-bit length, little-endian"
        );
        assert_eq!(&b[11..15], &[0xDD, 0xCC, 0xBB, 0xAA], "key");
        assert_eq!(
            b[15], 0x40,
            "type 4h (keyed data block), subtype 0h (address)"
        );
        // What a command without data carries (Linux's nvme_rdma_set_sg_null).
        assert_eq!(keyed_sgl(0, 0, 0), {
            let mut z = [0u8; 16];
            z[15] = 0x40;
            z
        });
    }
}
