//! The librdmacm/libibverbs calls both NVMe/RDMA sides make, behind owners that free what
//! they hold: an RDMA CM event channel, CM events copied out of librdmacm's memory, a
//! queue's completion channel, completion queue and queue pair ([`create_queue_objects`],
//! [`destroy_queue_objects`]), registered buffers, RECV posting, and socket address
//! conversion. Everything `unsafe` about verbs that is not tied to one queue's work requests
//! lives here; what a queue posts is its side's (`frontend::nvmf_rdma::queue`,
//! `fabric::rdma::io`).

use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::ptr::NonNull;

use rdma_sys::*;

/// The last OS error as an `io::Error` (librdmacm and libibverbs report through errno).
pub(crate) fn errno() -> io::Error {
    io::Error::last_os_error()
}

/// Make a verbs channel's descriptor non-blocking: its owner reads events until EAGAIN, and
/// a blocking read there would stall the thread that must also notice a stop.
pub(crate) fn set_nonblocking(fd: std::os::fd::RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns; no memory is passed.
    let ok = unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        fl >= 0 && libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) >= 0
    };
    if ok {
        Ok(())
    } else {
        Err(errno())
    }
}

/// A C status return (`0` or `-1`/`-errno`) as a Result.
pub(crate) fn check(rc: i32) -> io::Result<()> {
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(io::Error::from_raw_os_error(rc)),
        _ => Err(errno()),
    }
}

/// How many RDMA devices libibverbs sees (0 where the machine has none, or no rdma modules
/// are loaded).
pub fn device_count() -> usize {
    let mut n = 0i32;
    // SAFETY: ibv_get_device_list writes the count to `n` and returns an array we free at
    // once with ibv_free_device_list; we read nothing from it.
    unsafe {
        let list = ibv_get_device_list(&mut n);
        if list.is_null() {
            return 0;
        }
        ibv_free_device_list(list);
    }
    n.max(0) as usize
}

/// An RDMA CM event channel: the file descriptor CM events for its ids arrive on.
pub(crate) struct EventChannel(NonNull<rdma_event_channel>);

// SAFETY: the channel is a file descriptor wrapper; librdmacm's calls on it are thread-safe,
// and only its owner gets events from it.
unsafe impl Send for EventChannel {}
// SAFETY: as above; shared references only read the fd.
unsafe impl Sync for EventChannel {}

/// A CM event, copied out so the event can be acknowledged at once (librdmacm frees its
/// private data on acknowledgement, and `rdma_migrate_id`/`rdma_destroy_id` wait for it).
pub(crate) struct CmEvent {
    pub kind: u32,
    pub id: *mut rdma_cm_id,
    pub status: i32,
    pub private_data: Vec<u8>,
    /// The peer's RDMA Read resources: how many Reads it accepts from us (its IRD).
    pub responder_resources: u8,
    /// How many Reads the peer wants to issue to us (its ORD).
    pub initiator_depth: u8,
    pub rnr_retry_count: u8,
}

impl EventChannel {
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: plain constructor; a null return sets errno.
        let ch = unsafe { rdma_create_event_channel() };
        let ch = NonNull::new(ch).ok_or_else(errno)?;
        let ch = EventChannel(ch);
        // Non-blocking, so `get` can wait with a timeout and the owner can notice a stop.
        set_nonblocking(ch.fd())?;
        Ok(ch)
    }

    pub(crate) fn raw(&self) -> *mut rdma_event_channel {
        self.0.as_ptr()
    }

    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: the channel is valid for self's life; `fd` is a plain field.
        unsafe { (*self.0.as_ptr()).fd }
    }

    /// The next event, waiting at most `timeout_ms` (0: do not wait).
    pub(crate) fn get(&self, timeout_ms: i32) -> io::Result<Option<CmEvent>> {
        if timeout_ms > 0 && !wait_readable(&[self.fd()], timeout_ms)? {
            return Ok(None);
        }
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is valid; on success `ev` points to an event librdmacm owns
        // until rdma_ack_cm_event, which we call after copying what we need.
        unsafe {
            if rdma_get_cm_event(self.raw(), &mut ev) != 0 {
                let e = errno();
                if e.kind() == io::ErrorKind::WouldBlock {
                    return Ok(None);
                }
                return Err(e);
            }
            let e = &*ev;
            let conn = &e.param.conn;
            let private_data = if conn.private_data.is_null() {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data as *const u8,
                    conn.private_data_len as usize,
                )
                .to_vec()
            };
            let out = CmEvent {
                kind: e.event,
                id: e.id,
                status: e.status,
                private_data,
                responder_resources: conn.responder_resources,
                initiator_depth: conn.initiator_depth,
                rnr_retry_count: conn.rnr_retry_count,
            };
            rdma_ack_cm_event(ev);
            Ok(Some(out))
        }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on this channel was destroyed or migrated by its owner first
        // (owners are declared so that they drop before their channel).
        unsafe { rdma_destroy_event_channel(self.0.as_ptr()) }
    }
}

/// Wait until one of `fds` is readable or `timeout_ms` passes; true if one is readable.
pub(crate) fn wait_readable(fds: &[RawFd], timeout_ms: i32) -> io::Result<bool> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `p` is a valid array of p.len() pollfds for the duration of the call.
    let n = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout_ms) };
    if n < 0 {
        let e = errno();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(n > 0)
}

/// A socket address in the C layout librdmacm takes.
pub(crate) struct RawAddr(libc::sockaddr_storage);

impl RawAddr {
    pub(crate) fn new(a: SocketAddr) -> Self {
        // SAFETY: sockaddr_storage is plain data; all-zero is a valid (unspecified) value.
        let mut s: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        match a {
            SocketAddr::V4(v4) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: v4.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(v4.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
                unsafe { std::ptr::write(&mut s as *mut _ as *mut libc::sockaddr_in, sin) };
            }
            SocketAddr::V6(v6) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: v6.port().to_be(),
                    sin6_flowinfo: v6.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: v6.ip().octets(),
                    },
                    sin6_scope_id: v6.scope_id(),
                };
                // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
                unsafe { std::ptr::write(&mut s as *mut _ as *mut libc::sockaddr_in6, sin6) };
            }
        }
        RawAddr(s)
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut libc::sockaddr {
        &mut self.0 as *mut _ as *mut libc::sockaddr
    }
}

/// The IP address in a C socket address (None for other families).
///
/// # Safety
/// `sa` must be null or point to a valid socket address.
pub(crate) unsafe fn ip_of(sa: *const libc::sockaddr) -> Option<std::net::IpAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller passes a valid sockaddr; the family says which layout it has.
    unsafe {
        match (*sa).sa_family as i32 {
            libc::AF_INET => {
                let sin = &*(sa as *const libc::sockaddr_in);
                Some(std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()).into())
            }
            libc::AF_INET6 => {
                let sin6 = &*(sa as *const libc::sockaddr_in6);
                Some(std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr).into())
            }
            _ => None,
        }
    }
}

/// How many completions and work requests one queue's verbs objects hold.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueueShape {
    /// Completion queue entries: every RECV and every signaled send-side request.
    pub cqe: usize,
    pub send_wr: usize,
    pub recv_wr: usize,
    /// Scatter entries of one send-side request.
    pub send_sge: u32,
}

/// Create a queue's completion channel (non-blocking, so its owner can wait with a timeout),
/// completion queue, and RC queue pair on `id` in `pd`, each stored in `comp` and `cq` (and
/// `id`'s `qp`) as soon as it exists, so the caller's owner frees whatever was made even
/// when a later step fails. The error names the step.
///
/// # Safety
/// `id` is a live CM id with a resolved route or a connect request (its `verbs` context is
/// the device's), `pd` is a protection domain of that context, and `comp` and `cq` are null
/// fields of the owner that destroys them ([`destroy_queue_objects`]).
pub(crate) unsafe fn create_queue_objects(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    shape: QueueShape,
    comp: &mut *mut ibv_comp_channel,
    cq: &mut *mut ibv_cq,
) -> Result<(), (&'static str, io::Error)> {
    // SAFETY: per the caller's contract, `verbs` is a valid device context and `pd` is of it;
    // each object is handed to the caller's fields at once.
    unsafe {
        let ctx = (*id).verbs;
        *comp = ibv_create_comp_channel(ctx);
        if comp.is_null() {
            return Err(("ibv_create_comp_channel", errno()));
        }
        set_nonblocking((**comp).fd)
            .map_err(|e| ("fcntl(O_NONBLOCK) on the completion channel", e))?;
        *cq = ibv_create_cq(ctx, shape.cqe as i32, std::ptr::null_mut(), *comp, 0);
        if cq.is_null() {
            return Err(("ibv_create_cq", errno()));
        }
        let mut attr: ibv_qp_init_attr = std::mem::zeroed();
        attr.send_cq = *cq;
        attr.recv_cq = *cq;
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        attr.cap.max_send_wr = shape.send_wr as u32;
        attr.cap.max_recv_wr = shape.recv_wr as u32;
        attr.cap.max_send_sge = shape.send_sge;
        attr.cap.max_recv_sge = 1;
        if rdma_create_qp(id, pd, &mut attr) != 0 {
            return Err(("rdma_create_qp", errno()));
        }
    }
    Ok(())
}

/// Tear down a connected queue's verbs objects in the order the device needs: the queue
/// pair first (the only way the device reaches our memory), then the completion queue and
/// its channel. Null ones are skipped. Memory regions and the protection domain are the
/// caller's to free afterwards.
///
/// # Safety
/// Nothing polls or posts on these objects any more (the last reference to their owner is
/// gone), every completion channel event was acknowledged, and each is destroyed only here.
pub(crate) unsafe fn destroy_queue_objects(
    id: *mut rdma_cm_id,
    cq: *mut ibv_cq,
    comp: *mut ibv_comp_channel,
) {
    // SAFETY: per the caller's contract.
    unsafe {
        if !id.is_null() && !(*id).qp.is_null() {
            rdma_destroy_qp(id);
        }
        if !cq.is_null() {
            ibv_destroy_cq(cq);
        }
        if !comp.is_null() {
            ibv_destroy_comp_channel(comp);
        }
    }
}

/// Post one RECV of `len` bytes at offset `off` of `buf` on queue pair `qp`, tagged `wr_id`
/// (each side keeps a ring of fixed-size receive slots in one registered buffer). False if
/// the provider refused it.
///
/// # Safety
/// `qp` is a live queue pair of the protection domain `buf` is registered in, and stays so
/// for the call; the slot `off..off + len` of `buf` belongs to the device until its
/// completion is polled (nothing reads or writes it meanwhile).
pub(crate) unsafe fn post_recv_slot(
    qp: *mut ibv_qp,
    buf: &RegBuf,
    off: usize,
    len: u32,
    wr_id: u64,
) -> bool {
    debug_assert!(off + len as usize <= buf.len);
    let mut sge = ibv_sge {
        addr: buf.addr(off),
        length: len,
        lkey: buf.lkey(),
    };
    // SAFETY: ibv_recv_wr is plain data; all-zero is a valid empty request.
    let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
    // SAFETY: per the caller's contract; the request structures are copied by the provider
    // during the call.
    unsafe { ibv_post_recv(qp, &mut wr, &mut bad) == 0 }
}

/// A registered buffer: memory from the allocator, and its memory region.
pub(crate) struct RegBuf {
    pub(crate) ptr: *mut u8,
    len: usize,
    mr: *mut ibv_mr,
}

impl RegBuf {
    /// A buffer only the local device writes (RECV rings, send capsules, target-side data
    /// buffers the target moves with its own READ/WRITE).
    pub(crate) fn new(pd: *mut ibv_pd, len: usize) -> std::io::Result<RegBuf> {
        Self::with_access(pd, len, ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32)
    }

    /// A buffer registered with `access` (e.g. remote read/write for the data a peer moves
    /// with RDMA READ/WRITE against our keyed SGLs).
    pub(crate) fn with_access(pd: *mut ibv_pd, len: usize, access: i32) -> std::io::Result<RegBuf> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(std::io::ErrorKind::OutOfMemory.into());
        }
        let mut b = RegBuf {
            ptr,
            len,
            mr: std::ptr::null_mut(),
        };
        // SAFETY: `pd` is a valid protection domain; the buffer stays allocated until this
        // RegBuf drops, which deregisters it first.
        b.mr = unsafe { ibv_reg_mr(pd, ptr as *mut _, len, access) };
        if b.mr.is_null() {
            return Err(errno());
        }
        Ok(b)
    }

    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: `mr` is valid while self lives.
        unsafe { (*self.mr).lkey }
    }

    /// The remote key a peer names this buffer with.
    #[allow(dead_code)] // used by the NVMe/RDMA host queues (fabric::rdma)
    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: `mr` is valid while self lives.
        unsafe { (*self.mr).rkey }
    }

    pub(crate) fn addr(&self, off: usize) -> u64 {
        self.ptr as u64 + off as u64
    }
}

impl Drop for RegBuf {
    fn drop(&mut self) {
        // SAFETY: deregistered once, then freed with the layout it was allocated with; the
        // queue pair that could access it is destroyed before (by its owner's Drop).
        unsafe {
            if !self.mr.is_null() {
                ibv_dereg_mr(self.mr);
            }
            let layout = std::alloc::Layout::from_size_align_unchecked(self.len.max(1), 4096);
            std::alloc::dealloc(self.ptr, layout);
        }
    }
}

// SAFETY: the buffer is plain memory and its region; who may touch which bytes is the
// owner's rule (a slot's holder), and verbs calls on a region are thread-safe.
unsafe impl Send for RegBuf {}
// SAFETY: as above.
unsafe impl Sync for RegBuf {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn set_nonblocking_sets_the_flag_and_reports_a_bad_descriptor() {
        let (r, _w) = std::os::unix::net::UnixStream::pair().unwrap();
        set_nonblocking(r.as_raw_fd()).unwrap();
        // SAFETY: fcntl F_GETFL on a descriptor this test owns.
        let fl = unsafe { libc::fcntl(r.as_raw_fd(), libc::F_GETFL) };
        assert_ne!(fl & libc::O_NONBLOCK, 0);
        let e = set_nonblocking(-1).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
    }
}
