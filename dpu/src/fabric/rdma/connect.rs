//! RDMA CM connection setup of an NVMe/RDMA host queue (NVMe RDMA Transport 1.0 §3.1):
//! waiting for each CM step with a bound, and turning every way it can fail — no device,
//! no route, a reject with or without the NVMe RDMA status, silence — into an error that
//! says which step failed and why.

use std::ffi::CStr;
use std::net::SocketAddr;
use std::time::Instant;

use rdma_sys::*;

use crate::fabric::FabricError;
use crate::rdma::cm;
use crate::rdma::verbs::{self, EventChannel};

/// Why no RDMA queue could be made on this machine at all (no device or no RDMA CM).
pub(super) fn no_rdma(what: &str) -> FabricError {
    FabricError::Connect(format!(
        "NVMe/RDMA needs an RDMA device and it has none{what} (load the NIC's RDMA driver, or \
         for soft-RoCE `modprobe rdma_rxe rdma_ucm` and `rdma link add rxe0 type rxe netdev IFACE`)"
    ))
}

/// What an RDMA_CM_REJECT private data status means (NVMe RDMA 1.0 Figure 7).
pub fn reject_name(status: u16) -> &'static str {
    match status {
        cm::reject::INVALID_LEN => "NVME_RDMA_CM_INVALID_LEN (bad private data length)",
        cm::reject::INVALID_RECFMT => "NVME_RDMA_CM_INVALID_RECFMT (record format)",
        cm::reject::INVALID_QID => "NVME_RDMA_CM_INVALID_QID (queue id not supported)",
        cm::reject::INVALID_HSQSIZE => {
            "NVME_RDMA_CM_INVALID_HSQSIZE (queue too deep for the controller: lower queue_depth)"
        }
        cm::reject::INVALID_HRQSIZE => "NVME_RDMA_CM_INVALID_HRQSIZE (host receive queue size)",
        cm::reject::NO_RESOURCES => "NVME_RDMA_CM_NO_RSC (the controller is out of resources)",
        cm::reject::INVALID_IRD => "NVME_RDMA_CM_INVALID_IRD (inbound RDMA Read depth)",
        cm::reject::INVALID_ORD => "NVME_RDMA_CM_INVALID_ORD (outbound RDMA Read depth)",
        _ => "an unknown NVMe RDMA status",
    }
}

/// The error an RDMA_CM_EVENT_REJECTED stands for: the controller's NVMe RDMA status when
/// its private data carries one (RECFMT 0 and a status 1-8), else the CM's reason (no
/// listener on that port gives reason 8, invalid service ID).
fn rejected(addr: SocketAddr, qid: u16, reason: i32, pd: &[u8]) -> FabricError {
    if pd.len() >= cm::REJECT_LEN {
        let recfmt = u16::from_le_bytes([pd[0], pd[1]]);
        let sts = u16::from_le_bytes([pd[2], pd[3]]);
        if recfmt == cm::RECFMT_1_0 && (1..=8).contains(&sts) {
            return FabricError::Refused(format!(
                "{addr} rejected the NVMe/RDMA connection of queue {qid}: {} (status {sts})",
                reject_name(sts)
            ));
        }
    }
    FabricError::Connect(format!(
        "{addr} rejected the RDMA connection of queue {qid} (RDMA CM reject reason {reason}: \
         no NVMe/RDMA listener on that address and port?)"
    ))
}

pub(super) fn event_name(kind: u32) -> String {
    // SAFETY: rdma_event_str returns a pointer to a static string for any value.
    unsafe {
        let p = rdma_event_str(kind);
        if p.is_null() {
            return format!("event {kind}");
        }
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// Wait for CM event `want` on `ch` until `deadline`; any other outcome is an error that
/// says which step failed.
pub(super) fn wait_cm(
    ch: &EventChannel,
    want: u32,
    deadline: Instant,
    addr: SocketAddr,
    qid: u16,
    step: &str,
) -> Result<verbs::CmEvent, FabricError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(FabricError::Timeout(format!(
                "RDMA CM {step} for {addr} (queue {qid}): no answer within the connect timeout"
            )));
        }
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        let ev = match ch.get(ms) {
            Ok(Some(ev)) => ev,
            Ok(None) => continue,
            Err(e) => return Err(FabricError::Connect(format!("RDMA CM event channel: {e}"))),
        };
        if ev.kind == want {
            return Ok(ev);
        }
        use rdma_cm_event_type::*;
        return Err(match ev.kind {
            RDMA_CM_EVENT_REJECTED => rejected(addr, qid, ev.status, &ev.private_data),
            RDMA_CM_EVENT_ADDR_ERROR | RDMA_CM_EVENT_ROUTE_ERROR => FabricError::Connect(format!(
                "RDMA CM {step} for {addr} failed ({}, status {}): no RDMA device can reach it \
                 (is rdma_rxe on the right interface?)",
                event_name(ev.kind),
                ev.status
            )),
            RDMA_CM_EVENT_UNREACHABLE | RDMA_CM_EVENT_CONNECT_ERROR => {
                FabricError::Connect(format!(
                    "RDMA CM {step} for {addr} (queue {qid}) failed: {} (status {})",
                    event_name(ev.kind),
                    ev.status
                ))
            }
            k => FabricError::Protocol(format!(
                "unexpected RDMA CM event {} during {step} for {addr}",
                event_name(k)
            )),
        });
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn reject_private_data_names_the_nvme_rdma_status() {
        let a: SocketAddr = "192.0.2.1:4420".parse().unwrap();
        let e = rejected(a, 1, 28, &cm::encode_reject(cm::reject::INVALID_HSQSIZE)).to_string();
        assert!(
            e.contains("NVME_RDMA_CM_INVALID_HSQSIZE") && e.contains("queue 1"),
            "{e}"
        );
        // IB CM pads reject private data; only the first four bytes count.
        let mut padded = cm::encode_reject(cm::reject::NO_RESOURCES).to_vec();
        padded.resize(148, 0);
        assert!(rejected(a, 0, 28, &padded).to_string().contains("NO_RSC"));
        // No NVMe status: the CM's reason, and what it usually means.
        let e = rejected(a, 0, 8, &[]).to_string();
        assert!(
            e.contains("reason 8") && e.contains("no NVMe/RDMA listener"),
            "{e}"
        );
        assert!(rejected(a, 0, 28, &[0, 0, 9, 0])
            .to_string()
            .contains("reason 28"));
    }
}
