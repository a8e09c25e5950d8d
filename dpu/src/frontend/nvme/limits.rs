//! Limits nacre advertises (and enforces).

/// CAP.MQES + 1: the largest I/O queue a host may create.
pub const MAX_QUEUE_ENTRIES: u32 = 1024;
/// Largest admin queue (Linux uses 32).
pub const MAX_ADMIN_QUEUE_ENTRIES: u32 = 1024;
/// I/O queues a controller grants (Set Features Number of Queues).
pub const MAX_IO_QUEUES: u16 = 128;
/// In-capsule data accepted on I/O queues: IOCCSZ = (64 + this) / 16.
pub const IO_INLINE_DATA: usize = 8192;
/// The admin queue always accepts 8 KiB in capsule: Linux sends up to
/// NVME_TCP_ADMIN_CCSZ there regardless of IOCCSZ.
pub const ADMIN_INLINE_DATA: usize = 8192;
/// MDTS = 5: 2^5 × 4 KiB = 128 KiB per command.
pub const MDTS: u8 = 5;
pub const MAX_TRANSFER: usize = 4096 << MDTS;
/// ICResp MAXH2CDATA: one H2CData PDU may carry a whole command's data.
pub const MAX_H2C_DATA: u32 = MAX_TRANSFER as u32;
/// Largest NSID (Identify Controller NN).
pub const MAX_NSID: u32 = 1024;
/// AERL + 1: outstanding Asynchronous Event Requests per controller.
pub const MAX_AERS: usize = 4;
/// Keep Alive Support granularity: 1 s (KAS in 100 ms units).
pub const KAS_100MS: u16 = 10;
/// CAP.TO: CSTS.RDY follows CC.EN at once; 15 s is the worst case we promise.
pub const CAP_TO_500MS: u8 = 30;
/// Bytes of host data one queue holds buffers for while waiting for it (R2Ts
/// outstanding). Further writes wait for their R2T until earlier data has arrived
/// (NVMe/TCP 1.0 §3.3.3 lets the controller choose when to send an R2T), so a host cannot
/// pin queue entries × MDTS of target memory by announcing writes and never sending data.
/// 16 × 128 KiB keeps a queue's pipe full on any link nacre serves.
pub const R2T_BUDGET: usize = 16 * MAX_TRANSFER;
/// Idle data buffers a queue keeps for reuse, in bytes (the rest are freed).
pub const POOL_BYTES: usize = R2T_BUDGET;
