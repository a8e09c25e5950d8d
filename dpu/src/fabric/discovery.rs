//! Discovery (NVMe-oF 1.1 §5): connect to a portal's discovery controller
//! (`nqn.2014-08.org.nvmexpress.discovery`), read the Discovery Log Page (LID 70h) and
//! disconnect. Discovery controllers need no I/O queues and no keep-alive for a short visit.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use nacre_shared::nvme::discovery::{self, DiscoveryEntry};
use nacre_shared::nvme::fabrics::{ConnectData, CNTLID_DYNAMIC};
use nacre_shared::nvme::log::{lid, GetLogPage};
use nacre_shared::nvme::{admin_opcode, get_u64, Command, DISCOVERY_NQN};
use nacre_shared::nvme_tcp::Digests;

use super::cmd::{Cmd, Dir};
use super::controller::{admin_cmd, enable};
use super::queue::{self, FabricQueue, QueueOwner, QueueParams, Transport};
use super::FabricError;

struct NoOwner;
impl QueueOwner for NoOwner {
    fn queue_closed(&self, _: u64, _: u16, _: String, cmds: Vec<Cmd>) {
        for c in cmds {
            c.fail(crate::volume::IoError::PathLost);
        }
    }
}

/// Read the discovery log of the NVMe/TCP portal at `address:port`.
pub fn discover(
    address: &str,
    port: u16,
    hostnqn: &str,
    timeout: Duration,
) -> Result<Vec<DiscoveryEntry>, FabricError> {
    discover_over(
        Transport::Tcp,
        address,
        port,
        hostnqn,
        timeout,
        &crate::fabric::tcp::Reactors::shared(),
    )
}

/// Read the discovery log of the portal at `address:port` over `transport` (the discovery
/// controller is an admin queue like any other: the transport is below the queue seam); an
/// NVMe/TCP queue is served by `tcp_reactors`.
pub fn discover_over(
    transport: Transport,
    address: &str,
    port: u16,
    hostnqn: &str,
    timeout: Duration,
    tcp_reactors: &crate::fabric::tcp::Reactors,
) -> Result<Vec<DiscoveryEntry>, FabricError> {
    let mut cfg = super::ControllerConfig::new(address, port, DISCOVERY_NQN, hostnqn);
    cfg.connect_timeout = timeout;
    cfg.transport = transport;
    cfg.tcp_reactors = tcp_reactors.clone();
    let owner: Arc<dyn QueueOwner> = Arc::new(NoOwner);
    let weak: Weak<dyn QueueOwner> = Arc::downgrade(&owner);
    let cd = ConnectData {
        hostid: cfg.hostid,
        cntlid: CNTLID_DYNAMIC,
        subnqn: DISCOVERY_NQN.into(),
        hostnqn: hostnqn.into(),
    };
    let params = QueueParams {
        qid: 0,
        depth: 31,
        digests: Digests::NONE,
        kato_ms: 0,
        icd_max: 0,
        timeout,
        tls: None,
    };
    let (q, _) = queue::open(&cfg, params, &cd, 0, weak)?;
    let deadline = Instant::now() + timeout * 4;
    let res = (|| {
        enable(&*q, deadline)?;
        // Header first for NUMREC, then the whole page (GENCTR may change in between; a
        // host would re-read, a one-shot listing does not need to).
        let head = get_log(&*q, discovery::HEADER_LEN, deadline)?;
        let n = get_u64(&head, 8).min(1024) as usize;
        let page = get_log(
            &*q,
            discovery::HEADER_LEN + n * discovery::ENTRY_LEN,
            deadline,
        )?;
        Ok(discovery::decode_log(&page).1)
    })();
    q.shutdown();
    q.join(Duration::from_millis(200));
    drop(owner);
    res
}

fn get_log(q: &dyn FabricQueue, len: usize, deadline: Instant) -> Result<Vec<u8>, FabricError> {
    let mut sqe = Command {
        opcode: admin_opcode::GET_LOG_PAGE,
        ..Default::default()
    };
    GetLogPage {
        lid: lid::DISCOVERY,
        rae: false,
        len,
        offset: 0,
    }
    .apply(&mut sqe);
    admin_cmd(q, sqe, Dir::C2H, vec![0u8; len], deadline).map(|r| r.1)
}
