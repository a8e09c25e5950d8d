//! RDMA CM private data of NVMe/RDMA queue setup (NVMe RDMA Transport 1.0 §3.1,
//! Figures 5-7): what the host sends with its connect request (RDMA_CM_REQUEST), what the
//! controller returns when it accepts (RDMA_CM_ACCEPT) or rejects (RDMA_CM_REJECT).
//!
//! The request is checked before any queue resources exist, so a host that sends bad private
//! data costs the target nothing but the reject.

use nacre_shared::nvme::{get_u16, put_u16};

/// Length of the RDMA_CM_REQUEST private data (Figure 5: 10 defined bytes, 22 reserved).
pub const REQUEST_LEN: usize = 32;
/// Length of the RDMA_CM_ACCEPT private data (Figure 6).
pub const ACCEPT_LEN: usize = 32;
/// Length of the RDMA_CM_REJECT private data (Figure 7).
pub const REJECT_LEN: usize = 4;

/// Record format 0 (the only one defined).
pub const RECFMT_1_0: u16 = 0;

/// RDMA_CM_REJECT status codes (Figure 7).
pub mod reject {
    /// The private data is shorter than an RDMA_CM_REQUEST.
    pub const INVALID_LEN: u16 = 0x01;
    /// RECFMT is not 0.
    pub const INVALID_RECFMT: u16 = 0x02;
    /// QID is larger than the controller supports.
    pub const INVALID_QID: u16 = 0x03;
    /// HSQSIZE is 0 or larger than the controller supports.
    pub const INVALID_HSQSIZE: u16 = 0x04;
    /// HRQSIZE is smaller than the host's submission queue needs.
    pub const INVALID_HRQSIZE: u16 = 0x05;
    /// The controller is out of resources (memory, queue pairs).
    pub const NO_RESOURCES: u16 = 0x06;
    /// The inbound RDMA Read queue depth is not acceptable.
    pub const INVALID_IRD: u16 = 0x07;
    /// The outbound RDMA Read queue depth is not acceptable.
    pub const INVALID_ORD: u16 = 0x08;
}

/// RDMA_CM_REQUEST private data (Figure 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmRequest {
    pub recfmt: u16,
    /// The queue this connection becomes: 0 admin, else an I/O queue.
    pub qid: u16,
    /// Host receive queue size: the number of responses the host can take at once.
    pub hrqsize: u16,
    /// Host send queue size, 0's based (the queue's SQSIZE): capsules the host may have
    /// outstanding.
    pub hsqsize: u16,
    /// The controller this I/O queue joins (FFFFh on the admin queue).
    pub cntlid: u16,
}

impl CmRequest {
    /// Decode and check the request against what this target accepts: at most
    /// `max_admin`/`max_io` entries per queue, I/O queues up to `max_qid`.
    pub fn parse(b: &[u8], max_admin: u32, max_io: u32, max_qid: u16) -> Result<Self, u16> {
        if b.len() < REQUEST_LEN {
            return Err(reject::INVALID_LEN);
        }
        let r = CmRequest {
            recfmt: get_u16(b, 0),
            qid: get_u16(b, 2),
            hrqsize: get_u16(b, 4),
            hsqsize: get_u16(b, 6),
            cntlid: get_u16(b, 8),
        };
        if r.recfmt != RECFMT_1_0 {
            return Err(reject::INVALID_RECFMT);
        }
        if r.qid > max_qid {
            return Err(reject::INVALID_QID);
        }
        let max = if r.qid == 0 { max_admin } else { max_io };
        if r.hsqsize == 0 || r.entries() > max {
            return Err(reject::INVALID_HSQSIZE);
        }
        if r.hrqsize == 0 || r.hrqsize as u32 > max {
            return Err(reject::INVALID_HRQSIZE);
        }
        Ok(r)
    }

    /// Submission queue entries (HSQSIZE is 0's based).
    pub fn entries(&self) -> u32 {
        self.hsqsize as u32 + 1
    }

    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        put_u16(&mut b, 0, self.recfmt);
        put_u16(&mut b, 2, self.qid);
        put_u16(&mut b, 4, self.hrqsize);
        put_u16(&mut b, 6, self.hsqsize);
        put_u16(&mut b, 8, self.cntlid);
        b
    }
}

/// RDMA_CM_ACCEPT private data (Figure 6): RECFMT and the controller's receive queue size
/// (CRQSIZE: capsules it has receive buffers posted for).
pub fn encode_accept(crqsize: u16) -> [u8; ACCEPT_LEN] {
    let mut b = [0u8; ACCEPT_LEN];
    put_u16(&mut b, 0, RECFMT_1_0);
    put_u16(&mut b, 2, crqsize);
    b
}

/// RDMA_CM_REJECT private data (Figure 7): RECFMT and the status.
pub fn encode_reject(status: u16) -> [u8; REJECT_LEN] {
    let mut b = [0u8; REJECT_LEN];
    put_u16(&mut b, 0, RECFMT_1_0);
    put_u16(&mut b, 2, status);
    b
}

#[cfg(test)]
mod test {
    use super::*;

    fn req(qid: u16, hrq: u16, hsq: u16) -> [u8; REQUEST_LEN] {
        CmRequest {
            recfmt: 0,
            qid,
            hrqsize: hrq,
            hsqsize: hsq,
            cntlid: 0xFFFF,
        }
        .encode()
    }

    #[test]
    fn request_layout_matches_figure_5() {
        let b = req(3, 128, 127);
        assert_eq!(&b[..10], &[0, 0, 3, 0, 128, 0, 127, 0, 0xFF, 0xFF]);
        assert!(b[10..].iter().all(|&x| x == 0));
        let r = CmRequest::parse(&b, 32, 1024, 128).unwrap();
        assert_eq!(
            (r.qid, r.hrqsize, r.hsqsize, r.cntlid),
            (3, 128, 127, 0xFFFF)
        );
        assert_eq!(r.entries(), 128);
    }

    #[test]
    fn bad_requests_get_the_matching_reject_status() {
        assert_eq!(
            CmRequest::parse(&[0u8; 16], 32, 1024, 128),
            Err(reject::INVALID_LEN)
        );
        let mut b = req(0, 32, 31);
        b[0] = 1;
        assert_eq!(
            CmRequest::parse(&b, 32, 1024, 128),
            Err(reject::INVALID_RECFMT)
        );
        assert_eq!(
            CmRequest::parse(&req(129, 32, 31), 32, 1024, 128),
            Err(reject::INVALID_QID)
        );
        // The admin queue is bounded by its own limit, I/O queues by theirs.
        assert_eq!(
            CmRequest::parse(&req(0, 32, 32), 32, 1024, 128),
            Err(reject::INVALID_HSQSIZE)
        );
        assert!(CmRequest::parse(&req(1, 64, 63), 32, 1024, 128).is_ok());
        assert_eq!(
            CmRequest::parse(&req(1, 64, 0), 32, 1024, 128),
            Err(reject::INVALID_HSQSIZE)
        );
        assert_eq!(
            CmRequest::parse(&req(1, 0, 63), 32, 1024, 128),
            Err(reject::INVALID_HRQSIZE)
        );
    }

    #[test]
    fn accept_and_reject_layouts() {
        let a = encode_accept(128);
        assert_eq!(&a[..4], &[0, 0, 128, 0]);
        assert!(a[4..].iter().all(|&x| x == 0));
        assert_eq!(encode_reject(reject::NO_RESOURCES), [0, 0, 6, 0]);
    }
}
