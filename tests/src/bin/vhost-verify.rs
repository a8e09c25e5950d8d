//! vhost-verify: write a pattern through a vhost-user-blk device with libblkio, read it back
//! and compare; one request per chunk, each chunk one contiguous buffer of the client's
//! shared memory (a guest whose memory is backed by large pages sends such requests). The test
//! bed runs it inside the guest next to nacred (`nvmf-rdma-initiator.sh`) to drive the
//! NVMe/RDMA initiator's zero-copy path from real guest-memory-style requests.
//!
//! ```text
//! vhost-verify SOCKET OFFSET_MIB MIB [CHUNK_KIB [QUEUES]]
//! ```
//!
//! With QUEUES > 1 the chunks go round the device's virtqueues (nacred serves each on its own
//! worker thread), so one memory table is used from several threads at once.
//!
//! Prints `VHOST-VERIFY ok bytes=N` and exits 0 when every byte read back is what was
//! written; anything else is an error on stderr and exit 1.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use nacre_tests::blkio_client::{self, BlkioClient, ClientOptions};

fn main() -> Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 3 {
        bail!("usage: vhost-verify SOCKET OFFSET_MIB MIB [CHUNK_KIB [QUEUES]]");
    }
    let socket = PathBuf::from(&a[0]);
    let offset = a[1].parse::<u64>().context("OFFSET_MIB")? << 20;
    let total = a[2].parse::<usize>().context("MIB")? << 20;
    let chunk = a
        .get(3)
        .map_or(Ok(128), |c| c.parse::<usize>())
        .context("CHUNK_KIB")?
        << 10;
    let queues = a
        .get(4)
        .map_or(Ok(1), |c| c.parse::<usize>())
        .context("QUEUES")?
        .max(1);
    if chunk == 0 || total % chunk != 0 {
        bail!("MIB must be a whole number of chunks");
    }
    let mut c = BlkioClient::connect(
        &socket,
        &ClientOptions {
            mem_len: 2 * chunk,
            queues,
            ..Default::default()
        },
    )?;
    let mut qs = c.take_queues();
    let mem = c.mem();
    let (wbuf, rbuf) = mem.split_at_mut(chunk);
    let mut x: u32 = 0x9e37_79b9 ^ (offset as u32);
    for i in 0..total / chunk {
        for b in wbuf.iter_mut() {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *b = x as u8;
        }
        let at = offset + (i * chunk) as u64;
        let q = &mut qs[i % queues];
        let rc = blkio_client::write(q, at, wbuf)?;
        if rc != 0 {
            bail!("write at {at} failed: {rc}");
        }
        let rbuf = &mut rbuf[..chunk];
        rbuf.fill(0);
        let rc = blkio_client::read(q, at, rbuf)?;
        if rc != 0 {
            bail!("read at {at} failed: {rc}");
        }
        if rbuf != wbuf {
            bail!("data read back at {at} differs from what was written");
        }
    }
    println!("VHOST-VERIFY ok bytes={total}");
    Ok(())
}
