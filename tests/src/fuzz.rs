//! What the seeded random tests share: a small seedable generator (so a failing case can be
//! rerun from its seed), a process-wide panic counter (a panic on a server thread must fail
//! the test even though the thread's owner never joins it), and knobs from the environment.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

use nacre_shared::nvme::{Command, SglDescriptor};
use nacre_shared::nvme_tcp::{self as tcp, pdu_type, Digests, IcReq};
use serde_json::{json, Map, Value};

use crate::nvmf_host::raw_pdu;

/// xorshift64*: small, seedable, good enough to pick bytes. Not for anything secret.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        // Zero is xorshift's one fixed point.
        Rng(seed | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in 0..n (0 when n is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }
    pub fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize].clone()
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Count every panic in this process from now on (the default hook still prints it).
pub fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            default(info);
        }));
    });
}

/// Panics counted since [`count_panics`].
pub fn panics() -> usize {
    PANICS.load(Ordering::SeqCst)
}

/// A number from the environment (NACRE_FUZZ_SEED, NACRE_FUZZ_CASES), or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Parameters for random RPC calls: values an operator would send and values near the
/// edges (wrong types, empty and overlong names, path tricks inside `dir`, zero and huge
/// sizes, bad enums).
pub struct RpcGen {
    pub rng: Rng,
    /// Every path drawn lies inside this directory.
    pub dir: String,
}

impl RpcGen {
    pub fn name(&mut self) -> Value {
        let long = "x".repeat(300);
        json!(self.rng.pick(&[
            "v0", "v1", "v2", "t0", "t1", "d0", "shelf", "v0", "t0", "", "../v0", "a/b", "ü",
            &long, "v0 ", "-", "."
        ]))
    }
    pub fn nqn(&mut self) -> Value {
        json!(self.rng.pick(&[
            "nqn.2024-01.io.nacre:f0",
            "nqn.2024-01.io.nacre:f1",
            "nqn.2014-08.org.nvmexpress.discovery",
            "nqn.bad",
            "",
            "nqn.2024-01.io.nacre:f0:with spaces",
        ]))
    }
    pub fn path(&mut self) -> Value {
        let d = self.dir.clone();
        json!(self.rng.pick(&[
            format!("{d}/a.img"),
            format!("{d}/b.img"),
            format!("{d}/kek"),
            format!("{d}/kek31"),
            format!("{d}/export.key"),
            format!("{d}/missing/x"),
            format!("{d}/s.sock"),
            d.clone(),
            "rel.img".to_string(),
            String::new(),
        ]))
    }
    pub fn number(&mut self) -> Value {
        match self.rng.below(12) {
            0 => json!(-1),
            1 => json!(1.5),
            2 => json!(u64::MAX),
            3 => json!(u32::MAX),
            4 => json!(0),
            5 => json!(65536),
            _ => json!(self.rng.pick(&[1u64, 2, 4, 8, 16, 128, 512, 1023, 4096])),
        }
    }
    pub fn size(&mut self) -> Value {
        match self.rng.below(8) {
            0 => json!(self
                .rng
                .pick(&["1M", "16M", "1G", "abc", "-1", "1.5G", "64P"])),
            1 => self.number(),
            _ => json!(self
                .rng
                .pick(&[1u64 << 20, 4 << 20, (1 << 20) + 512, 512, 0, 1 << 62])),
        }
    }
    pub fn wrong_type(&mut self) -> Value {
        match self.rng.below(5) {
            0 => Value::Null,
            1 => json!([1, "a"]),
            2 => json!({"x": 1}),
            3 => json!(true),
            _ => json!("?"),
        }
    }
    pub fn kek(&mut self) -> Value {
        let mut m = Map::new();
        match self.rng.below(4) {
            0 => {
                m.insert("passphrase".into(), json!(self.rng.pick(&["pw", ""])));
                if self.rng.chance(2) {
                    let v = self.rng.pick(&[0u64, 7, 8, 64, 1024, u32::MAX as u64]);
                    m.insert("argon2_m_cost_kib".into(), json!(v));
                }
                if self.rng.chance(2) {
                    let v = self.rng.pick(&[0u64, 1, 2, 65, u32::MAX as u64]);
                    m.insert("argon2_t_cost".into(), json!(v));
                }
            }
            1 => {
                m.insert("key_file".into(), self.path());
                m.insert("passphrase".into(), json!("pw"));
            }
            _ => {
                let d = self.dir.clone();
                let f = if self.rng.chance(4) { "kek31" } else { "kek" };
                m.insert("key_file".into(), json!(format!("{d}/{f}")));
            }
        }
        Value::Object(m)
    }
    pub fn policy(&mut self) -> Value {
        let mut m = Map::new();
        for (k, vals) in [
            (
                "cipher",
                vec![json!("aes-xts-256"), json!("aes-xts-128"), json!("des")],
            ),
            (
                "data_unit",
                vec![json!(512), json!(4096), json!(1024), json!(0)],
            ),
            (
                "tweak",
                vec![json!("plain64"), json!("be64"), json!("be32")],
            ),
            (
                "require_encryption",
                vec![json!(true), json!(false), json!(1)],
            ),
        ] {
            if self.rng.chance(2) {
                m.insert(k.into(), self.rng.pick(&vals));
            }
        }
        Value::Object(m)
    }
    /// A plausible value for parameter `key`: what an operator would send, so that calls
    /// reach deep into the handlers and build up configuration.
    pub fn good(&mut self, method: &str, key: &str) -> Option<Value> {
        let d = self.dir.clone();
        Some(match key {
            "name" if method.starts_with("tenant") => json!(self.rng.pick(&["t0", "t1"])),
            "name" if method.starts_with("vhost") => json!(self.rng.pick(&["d0", "d1"])),
            "name" | "volume" => json!(self.rng.pick(&["v0", "v1", "v2"])),
            "tenant" => json!(self.rng.pick(&["t0", "t1"])),
            "path" if method == "volume_create" && self.rng.chance(2) => return None,
            "nqn" | "subnqn" => json!(self
                .rng
                .pick(&["nqn.2024-01.io.nacre:f0", "nqn.2024-01.io.nacre:f1"])),
            "host" | "hostnqn" => json!("nqn.2024-01.io.nacre:host"),
            "size" | "new_size" => json!(self.rng.pick(&[1u64 << 20, 4 << 20, 8 << 20])),
            "block_size" => json!(self.rng.pick(&[512, 4096])),
            "backend" => json!(self.rng.pick(&["ram", "null", "file"])),
            "path" => json!(self
                .rng
                .pick(&[format!("{d}/a.img"), format!("{d}/export.key")])),
            "socket" => json!(format!("{d}/s{}.sock", self.rng.below(3))),
            "kek" | "new_kek" => json!({"key_file": format!("{d}/kek")}),
            "policy" => self.policy(),
            "cipher" => json!("aes-xts-256"),
            "data_unit" => json!(self.rng.pick(&[512, 4096])),
            "tweak" => json!(self.rng.pick(&["plain64", "be64"])),
            "address" => json!("127.0.0.1"),
            "port" => json!(0),
            "transport" => json!("tcp"),
            "queues" | "io_queues" => json!(self.rng.pick(&[1, 2])),
            "queue_size" | "queue_depth" => json!(self.rng.pick(&[32, 128])),
            "nsid" => json!(self.rng.pick(&[1, 2])),
            "confirm" | "allow_any_host" => json!(true),
            "encrypt" | "read_only" | "force" | "delete_data" | "verbose"
            | "require_encryption" | "header_digest" | "data_digest" => json!(self.rng.chance(2)),
            _ => return None,
        })
    }

    /// A value for parameter `key`, near the edges.
    pub fn value(&mut self, key: &str) -> Value {
        if self.rng.chance(12) {
            return self.wrong_type();
        }
        let k = key;
        if k.contains("path") || k.contains("file") || k == "socket" || k.contains("dir") {
            return self.path();
        }
        match k {
            "kek" | "new_kek" => self.kek(),
            "policy" => self.policy(),
            "nqn" | "subnqn" | "hostnqn" | "host" => self.nqn(),
            "address" | "traddr" => {
                json!(self
                    .rng
                    .pick(&["127.0.0.1", "::1", "", "not-an-address", "127.0.0.1:9"]))
            }
            "port" | "trsvcid" => json!(self.rng.pick(&[0i64, 65535, 70000, -1])),
            "size" | "new_size" | "stripe_size" => self.size(),
            "block_size" | "data_unit" => json!(self.rng.pick(&[512u64, 4096, 0, 1000, 1 << 30])),
            "backend" => json!(self.rng.pick(&["ram", "null", "file", "remote", "bogus"])),
            "transport" | "trtype" => json!(self.rng.pick(&["tcp", "rdma", "TCP", ""])),
            "multipath" => json!(self.rng.pick(&["failover", "round_robin", "x"])),
            "cipher" | "tweak" => self.policy()[k].clone(),
            "extents" => {
                let e = self
                    .rng
                    .pick(&["shelf:1", "shelf:1+shelf:2", "x", "shelf:0", ":"]);
                json!([e, e])
            }
            "passphrase" => json!(self.rng.pick(&["pw", ""])),
            _ if k.starts_with("name") || k == "volume" || k == "tenant" || k == "device" => {
                self.name()
            }
            _ if self.rng.chance(3) => json!(self.rng.chance(2)),
            _ => self.number(),
        }
    }

    /// Params for `method`, whose accepted fields are `keys`: two calls in three are
    /// plausible (every field an operator would give, one of them sometimes off); the rest
    /// are edge values throughout, fields left out at random.
    pub fn params(&mut self, method: &str, keys: &[String]) -> Value {
        let mut params = Map::new();
        let plausible = !self.rng.chance(3);
        let odd_one = self.rng.below(keys.len() as u64 * 3) as usize;
        for (j, k) in keys.iter().enumerate() {
            let v = if plausible && j != odd_one {
                self.good(method, k)
            } else if self.rng.chance(4) {
                None
            } else {
                Some(self.value(k))
            };
            if let Some(v) = v {
                params.insert(k.clone(), v);
            }
        }
        if self.rng.chance(20) {
            params.insert("bogus".into(), json!(1));
        }
        if self.rng.chance(25) {
            self.wrong_type()
        } else {
            Value::Object(params)
        }
    }
}

// ---- NVMe/TCP host-side generators (nvmf_fuzz, and seeds for the cargo-fuzz targets) ----

/// A length near the interesting edges more often than uniformly.
pub fn edge_len(r: &mut Rng, max: u32) -> u32 {
    match r.below(6) {
        0 => 0,
        1 => max,
        2 => max.wrapping_add(1 + r.below(16) as u32),
        3 => u32::MAX - r.below(16) as u32,
        _ => r.below(max as u64 + 1) as u32,
    }
}

/// An ICReq asking for random digests (which the target grants as asked).
pub fn icreq(r: &mut Rng) -> (Vec<u8>, Digests) {
    let digests = Digests {
        header: r.chance(3),
        data: r.chance(3),
    };
    let mut b = Vec::new();
    IcReq {
        pfv: 0,
        hpda: 0,
        digests,
        maxr2t: 0,
    }
    .encode(&mut b);
    (b, digests)
}

/// A PDU header with fields near their legal values for the digests in force (type, HLEN,
/// flags and PLEN mostly consistent, PDO anywhere), then random bytes.
pub fn half_valid_pdu(r: &mut Rng, dg: Digests) -> Vec<u8> {
    let t = match r.below(6) {
        0 => r.next_u64() as u8,
        1 => r.below(10) as u8,
        2 => pdu_type::H2C_DATA,
        3 => pdu_type::H2C_TERM_REQ,
        _ => pdu_type::CAPSULE_CMD,
    };
    let hlen = if r.chance(4) {
        [8u8, 24, 72, 128, r.next_u64() as u8][r.below(5) as usize]
    } else {
        tcp::expected_hlen(t).unwrap_or(24) as u8
    };
    let hd = if dg.header { 4 } else { 0 };
    // A PDU without data (PLEN = HLEN) a quarter of the time: then PDO is reserved.
    let body = if r.chance(4) {
        0
    } else {
        r.below(600) as usize
    };
    let total = (hlen as usize).max(8) + hd + body;
    let plen = if r.chance(4) {
        edge_len(r, total as u32 * 2)
    } else {
        total as u32
    };
    let flags = if r.chance(4) {
        r.next_u64() as u8
    } else {
        (if dg.header { tcp::flags::HDGSTF } else { 0 })
            | (if dg.data && body > 0 {
                tcp::flags::DDGSTF
            } else {
                0
            })
    };
    let pdo = match r.below(3) {
        0 => hlen.wrapping_add(hd as u8),
        1 => hlen,
        _ => r.next_u64() as u8,
    };
    let mut b = raw_pdu(t, flags, hlen, pdo, plen, 8);
    b.extend(r.bytes(total - 8));
    b
}

/// A command capsule with a random SQE (LBAs up to a little past `lbas`) (data-changing opcodes replaced), a random SGL and
/// random in-capsule data, sometimes with one byte of the PDU flipped.
pub fn capsule(r: &mut Rng, banned: &[u8], digests: Digests, lbas: u64) -> Vec<u8> {
    let mut cmd = Command::decode(&r.bytes(64));
    while banned.contains(&cmd.opcode) {
        cmd.opcode = r.next_u64() as u8;
    }
    if r.chance(3) {
        // Mostly the commands a queue really serves: Read, Flush, Identify, Get Log Page,
        // Get/Set Features, Keep Alive, AER, Property Get/Set (fabrics).
        cmd.opcode = [0x02, 0x00, 0x06, 0x02, 0x0a, 0x09, 0x18, 0x0c, 0x7f][r.below(9) as usize];
        if banned.contains(&cmd.opcode) {
            cmd.opcode = 0x02;
        }
    }
    let data_len = r.below(9000) as u32;
    if r.chance(2) {
        cmd.flags = nacre_shared::nvme::command::PSDT_SGL;
        cmd.sgl = if r.chance(2) {
            SglDescriptor::in_capsule(edge_len(r, data_len))
        } else {
            SglDescriptor::transport(edge_len(r, data_len))
        };
        cmd.nsid = r.below(3) as u32;
        cmd.cdw10 = r.below(lbas + 4) as u32;
        cmd.cdw12 = r.below(64) as u32;
    }
    let n = if r.chance(2) { data_len as usize } else { 0 };
    let data = r.bytes(n);
    let mut out = Vec::new();
    tcp::encode_capsule_cmd(&mut out, &cmd, &data, digests, 0);
    if r.chance(4) {
        let i = r.below(out.len() as u64) as usize;
        out[i] ^= 1 << r.below(8);
    }
    out
}

/// An H2CData PDU with random CCCID, TTAG, offset and length.
pub fn h2c_data(r: &mut Rng) -> Vec<u8> {
    let len = r.below(4200) as usize;
    let flags = if r.chance(2) {
        0x04
    } else {
        r.next_u64() as u8
    };
    let mut b = raw_pdu(pdu_type::H2C_DATA, flags, 24, 24, (24 + len) as u32, 24);
    b[8..10].copy_from_slice(&(r.below(64) as u16).to_le_bytes());
    b[10..12].copy_from_slice(&(r.below(64) as u16).to_le_bytes());
    b[12..16].copy_from_slice(&edge_len(r, 8192).to_le_bytes());
    b[16..20].copy_from_slice(
        &(if r.chance(2) {
            len as u32
        } else {
            edge_len(r, 8192)
        })
        .to_le_bytes(),
    );
    b.extend(r.bytes(len));
    b
}
