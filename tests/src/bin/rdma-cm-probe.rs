//! rdma-cm-probe: a misbehaving NVMe/RDMA host, to check what nacred's RDMA target does with
//! bad input (the test bed runs it inside the guest next to nacred: `nvmf-rdma-target.sh`).
//!
//! ```text
//! rdma-cm-probe ADDR PORT CASE
//!   short      RDMA_CM_REQUEST private data of 8 bytes       -> expect a reject, status 1
//!   recfmt     RECFMT 1                                       -> status 2
//!   qid        QID 5000                                       -> status 3
//!   hsqsize    HSQSIZE 0                                      -> status 4
//!   bad-sgl    a good admin queue, then a Connect capsule whose SGL is a Segment descriptor
//!              (type 2h, not usable on RDMA)                  -> a response, SGL Descriptor Type Invalid
//!   bad-key    a good admin queue, then a Connect whose keyed SGL names an rkey the host
//!              never registered                               -> the target's RDMA READ fails
//!                                                                and it closes the queue
//!   idle       a good admin queue and then silence            -> closed after the target's
//!                                                                setup timeout (30 s), timed
//!                                                                from the connect request
//! ```
//!
//! Prints one line `PROBE case=CASE result=...` (`rejected status=N`, `response cid=N sct=N
//! sc=0xNN`, `closed`, `established`, `timeout`) and exits 0 when it got an answer at all.
//! (On RoCE and InfiniBand the CM pads the request's private data to 56 bytes, so `short` is
//! seen there as an all-zero request: HSQSIZE 0.)

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rdma_sys::*;

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

struct Cm {
    ch: *mut rdma_event_channel,
}

/// The next CM event (type, status, private data), within `t`.
fn next_event(cm: &Cm, t: Duration) -> Result<Option<(u32, i32, Vec<u8>)>> {
    let mut p = libc::pollfd {
        // SAFETY: the channel is valid for the program's life.
        fd: unsafe { (*cm.ch).fd },
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    if unsafe { libc::poll(&mut p, 1, t.as_millis() as i32) } <= 0 {
        return Ok(None);
    }
    let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
    // SAFETY: valid channel; the event is copied, then acknowledged.
    unsafe {
        if rdma_get_cm_event(cm.ch, &mut ev) != 0 {
            bail!("rdma_get_cm_event: {}", errno());
        }
        let e = &*ev;
        let c = &e.param.conn;
        let pd = if c.private_data.is_null() {
            Vec::new()
        } else {
            std::slice::from_raw_parts(c.private_data as *const u8, c.private_data_len as usize)
                .to_vec()
        };
        let out = (e.event, e.status, pd);
        rdma_ack_cm_event(ev);
        Ok(Some(out))
    }
}

fn expect(cm: &Cm, want: u32, what: &str) -> Result<()> {
    match next_event(cm, Duration::from_secs(10))? {
        Some((k, _, _)) if k == want => Ok(()),
        Some((k, s, _)) => bail!("{what}: got CM event {k} (status {s})"),
        None => bail!("{what}: no CM event within 10 s"),
    }
}

fn sockaddr(a: SocketAddr) -> libc::sockaddr_in {
    let SocketAddr::V4(v4) = a else {
        panic!("IPv4 only")
    };
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(v4.ip().octets()),
        },
        sin_zero: [0; 8],
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        bail!("usage: rdma-cm-probe ADDR PORT CASE");
    }
    let addr: SocketAddr = format!("{}:{}", args[1], args[2]).parse()?;
    let case = args[3].as_str();
    // recfmt, qid, hrqsize, hsqsize, cntlid, then 22 reserved bytes.
    let mut pd = [0u8; 32];
    let mut put = |off: usize, v: u16| pd[off..off + 2].copy_from_slice(&v.to_le_bytes());
    put(0, 0);
    put(2, 0);
    put(4, 32);
    put(6, 31);
    put(8, 0xFFFF);
    let mut pd_len = 32;
    match case {
        "short" => pd_len = 8,
        "recfmt" => put(0, 1),
        "qid" => put(2, 5000),
        "hsqsize" => put(6, 0),
        "bad-sgl" | "bad-key" | "idle" => {}
        _ => bail!("unknown case {case}"),
    }
    // SAFETY: every verbs call below gets valid objects made just before it; the program is
    // short-lived and single-threaded, and frees nothing (the kernel cleans up at exit).
    unsafe {
        let ch = rdma_create_event_channel();
        if ch.is_null() {
            bail!("rdma_create_event_channel: {}", errno());
        }
        let cm = Cm { ch };
        let mut id: *mut rdma_cm_id = std::ptr::null_mut();
        if rdma_create_id(
            ch,
            &mut id,
            std::ptr::null_mut(),
            rdma_port_space::RDMA_PS_TCP,
        ) != 0
        {
            bail!("rdma_create_id: {}", errno());
        }
        let mut dst = sockaddr(addr);
        if rdma_resolve_addr(id, std::ptr::null_mut(), &mut dst as *mut _ as *mut _, 2000) != 0 {
            bail!("rdma_resolve_addr: {}", errno());
        }
        expect(
            &cm,
            rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
            "resolve address",
        )?;
        if rdma_resolve_route(id, 2000) != 0 {
            bail!("rdma_resolve_route: {}", errno());
        }
        expect(
            &cm,
            rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED,
            "resolve route",
        )?;
        let ctx = (*id).verbs;
        let pdom = ibv_alloc_pd(ctx);
        let cq = ibv_create_cq(ctx, 16, std::ptr::null_mut(), std::ptr::null_mut(), 0);
        if pdom.is_null() || cq.is_null() {
            bail!("pd/cq: {}", errno());
        }
        let mut attr: ibv_qp_init_attr = std::mem::zeroed();
        attr.send_cq = cq;
        attr.recv_cq = cq;
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        attr.cap.max_send_wr = 4;
        attr.cap.max_recv_wr = 4;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        if rdma_create_qp(id, pdom, &mut attr) != 0 {
            bail!("rdma_create_qp: {}", errno());
        }
        let buf: &'static mut [u8] = Box::leak(vec![0u8; 4096].into_boxed_slice());
        let mr = ibv_reg_mr(
            pdom,
            buf.as_mut_ptr() as *mut _,
            buf.len(),
            ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
        );
        if mr.is_null() {
            bail!("ibv_reg_mr: {}", errno());
        }
        // A RECV for the response capsule (bytes 2048..).
        let mut rsge = ibv_sge {
            addr: buf.as_ptr() as u64 + 2048,
            length: 64,
            lkey: (*mr).lkey,
        };
        let mut rwr: ibv_recv_wr = std::mem::zeroed();
        rwr.wr_id = 1;
        rwr.sg_list = &mut rsge;
        rwr.num_sge = 1;
        let mut bad_r: *mut ibv_recv_wr = std::ptr::null_mut();
        if ibv_post_recv((*id).qp, &mut rwr, &mut bad_r) != 0 {
            bail!("ibv_post_recv: {}", errno());
        }
        let mut param: rdma_conn_param = std::mem::zeroed();
        param.private_data = pd.as_ptr() as *const _;
        param.private_data_len = pd_len;
        param.responder_resources = 4;
        param.initiator_depth = 4;
        param.flow_control = 1;
        param.retry_count = 7;
        param.rnr_retry_count = 7;
        // `idle` times the close from here, before the request leaves: the target starts its
        // setup deadline after it has the request, so the time seen is never shorter than
        // the timeout, however slow the machine (from ESTABLISHED it could be).
        let requested = Instant::now();
        if rdma_connect(id, &mut param) != 0 {
            bail!("rdma_connect: {}", errno());
        }
        let result = match next_event(&cm, Duration::from_secs(10))? {
            None => "timeout".to_string(),
            Some((k, _, p)) if k == rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => {
                let sts = if p.len() >= 4 {
                    u16::from_le_bytes([p[2], p[3]]).to_string()
                } else {
                    format!("none ({} bytes of private data)", p.len())
                };
                format!("rejected status={sts}")
            }
            Some((k, _, _))
                if k == rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED && case == "idle" =>
            {
                match next_event(&cm, Duration::from_secs(90))? {
                    Some((k, _, _)) if k == rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED => {
                        format!("closed after={}s", requested.elapsed().as_secs())
                    }
                    Some((k, s, _)) => format!("event {k} status {s}"),
                    None => "timeout".into(),
                }
            }
            Some((k, _, _)) if k == rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED => {
                if case == "bad-sgl" || case == "bad-key" {
                    capsule(&cm, id, cq, mr, buf, case)?
                } else {
                    "established".to_string()
                }
            }
            Some((k, s, _)) => format!("event {k} status {s}"),
        };
        println!("PROBE case={case} result={result}");
    }
    Ok(())
}

/// Send one bad Connect capsule on an established admin queue and report what came back.
///
/// # Safety
/// `id`, `cq` and `mr` are valid and `buf` is `mr`'s registered memory.
unsafe fn capsule(
    cm: &Cm,
    id: *mut rdma_cm_id,
    cq: *mut ibv_cq,
    mr: *mut ibv_mr,
    buf: &mut [u8],
    case: &str,
) -> Result<String> {
    let sqe = &mut buf[..64];
    sqe.fill(0);
    sqe[0] = 0x7F; // Fabrics
    sqe[1] = 0x40; // PSDT: SGL
    sqe[2..4].copy_from_slice(&7u16.to_le_bytes()); // CID
    sqe[4] = 0x01; // FCTYPE Connect
    sqe[42..44].copy_from_slice(&31u16.to_le_bytes()); // SQSIZE
    if case == "bad-sgl" {
        // A Segment descriptor (type 2h): 1024 bytes somewhere; RDMA hosts never send it.
        sqe[32..36].copy_from_slice(&1024u32.to_le_bytes());
        sqe[39] = 0x20;
    } else {
        // Keyed SGL data block (4h) of 1024 bytes at address 0 under an rkey never issued.
        sqe[32..35].copy_from_slice(&[0x00, 0x04, 0x00]);
        sqe[35..39].copy_from_slice(&0x0bad_cafe_u32.to_le_bytes());
        sqe[39] = 0x40;
    }
    // SAFETY: the caller passes valid verbs objects and the registered buffer; the SQE stays
    // in it until the SEND completes (polled below).
    unsafe {
        let mut sge = ibv_sge {
            addr: buf.as_ptr() as u64,
            length: 64,
            lkey: (*mr).lkey,
        };
        let mut wr: ibv_send_wr = std::mem::zeroed();
        wr.wr_id = 2;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        if ibv_post_send((*id).qp, &mut wr, &mut bad) != 0 {
            bail!("ibv_post_send: {}", errno());
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut wc: ibv_wc = std::mem::zeroed();
        while Instant::now() < deadline {
            if ibv_poll_cq(cq, 1, &mut wc) == 1 {
                if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
                    // Our RECV flushed: the target closed the queue pair.
                    return Ok("closed".into());
                }
                if wc.wr_id == 1 {
                    let f = u16::from_le_bytes([buf[2048 + 14], buf[2048 + 15]]);
                    let cid = u16::from_le_bytes([buf[2048 + 12], buf[2048 + 13]]);
                    return Ok(format!(
                        "response cid={cid} sct={} sc={:#04x}",
                        (f >> 9) & 7,
                        (f >> 1) & 0xFF
                    ));
                }
                continue;
            }
            if let Some((k, _, _)) = next_event(cm, Duration::from_millis(1)).context("cm")? {
                if k == rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED {
                    return Ok("closed".into());
                }
            }
        }
        Ok("timeout".into())
    }
}
