//! The RDMA layer both NVMe/RDMA sides share: nacred's target (`frontend::nvmf_rdma`, the
//! controller's queues) and its initiator (`fabric::rdma`, the host's queues to remote
//! controllers).
//!
//! ```text
//!   frontend::nvmf_rdma (target)          fabric::rdma (initiator)
//!              │                                   │
//!              └───────────────┬───────────────────┘
//!                              ▼
//!   rdma::verbs   librdmacm / libibverbs behind owners: CM event channel and events,
//!                 a queue's completion channel, CQ and RC queue pair, registered buffers,
//!                 RECV posting, teardown order, socket addresses
//!   rdma::cm      the RDMA CM private data of NVMe/RDMA queue setup (request, accept,
//!                 reject; NVMe RDMA Transport 1.0 §3.1)
//! ```
//!
//! What differs between the sides stays with them: which work requests a queue posts (a
//! controller answers with RDMA WRITE and SEND, a host sends capsules and lends its buffers),
//! and how many of each its queue pair needs ([`verbs::QueueShape`]).

pub mod cm;
pub mod verbs;

pub use verbs::device_count;

#[cfg(test)]
mod dependencies {
    /// The initiator's RDMA files and the target's: each side reaches the other only through
    /// this module.
    const INITIATOR: &[(&str, &str)] = &[
        ("fabric/rdma/mod.rs", include_str!("../fabric/rdma/mod.rs")),
        (
            "fabric/rdma/completion.rs",
            include_str!("../fabric/rdma/completion.rs"),
        ),
        (
            "fabric/rdma/connect.rs",
            include_str!("../fabric/rdma/connect.rs"),
        ),
        ("fabric/rdma/io.rs", include_str!("../fabric/rdma/io.rs")),
        ("fabric/rdma/pd.rs", include_str!("../fabric/rdma/pd.rs")),
        (
            "fabric/rdma/setup.rs",
            include_str!("../fabric/rdma/setup.rs"),
        ),
    ];
    const TARGET: &[(&str, &str)] = &[
        (
            "frontend/nvmf_rdma/mod.rs",
            include_str!("../frontend/nvmf_rdma/mod.rs"),
        ),
        (
            "frontend/nvmf_rdma/conn.rs",
            include_str!("../frontend/nvmf_rdma/conn.rs"),
        ),
        (
            "frontend/nvmf_rdma/queue.rs",
            include_str!("../frontend/nvmf_rdma/queue.rs"),
        ),
    ];

    fn code_lines(src: &str) -> impl Iterator<Item = &str> {
        src.lines().map(str::trim).filter(|l| !l.starts_with("//"))
    }

    #[test]
    fn the_initiator_and_the_target_share_only_this_layer() {
        for (file, src) in INITIATOR {
            for line in code_lines(src) {
                assert!(
                    !line.contains("nvmf_rdma"),
                    "{file} uses the target: {line}"
                );
                assert!(
                    !line.contains("ibv_create_qp") && !line.contains("rdma_create_qp("),
                    "{file} creates a queue pair itself: {line}"
                );
            }
        }
        for (file, src) in TARGET {
            for line in code_lines(src) {
                assert!(
                    !line.contains("fabric::rdma"),
                    "{file} uses the initiator: {line}"
                );
                assert!(
                    !line.contains("rdma_create_qp("),
                    "{file} creates a queue pair itself: {line}"
                );
            }
        }
    }
}
