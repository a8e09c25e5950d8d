//! [`Storage`]: the RAM namespaces behind a [`FakeTarget`](super::FakeTarget).

use std::sync::{Arc, Mutex};

/// RAM namespaces, shareable between target instances (a target that "comes back").
#[derive(Clone)]
pub struct Storage {
    pub namespaces: Arc<Mutex<Vec<Ns>>>,
}

pub struct Ns {
    pub nsid: u32,
    pub block_size: u32,
    pub data: Vec<u8>,
    pub nguid: [u8; 16],
}

impl Storage {
    pub fn new(namespaces: &[(u32, u64, u32, [u8; 16])]) -> Self {
        Storage {
            namespaces: Arc::new(Mutex::new(
                namespaces
                    .iter()
                    .map(|&(nsid, size, bs, nguid)| Ns {
                        nsid,
                        block_size: bs,
                        data: vec![0u8; size as usize],
                        nguid,
                    })
                    .collect(),
            )),
        }
    }

    pub fn read(&self, nsid: u32, off: usize, len: usize) -> Vec<u8> {
        let g = self.namespaces.lock().unwrap();
        let ns = g.iter().find(|n| n.nsid == nsid).unwrap();
        ns.data[off..off + len].to_vec()
    }
}
