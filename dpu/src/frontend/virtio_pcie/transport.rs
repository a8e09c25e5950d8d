//! The virtio PCI modern transport's registers (virtio 1.2 §4.1.4): where the structures
//! lie in BAR0, the vendor-specific capabilities that point at them, the common
//! configuration (§4.1.4.3: feature negotiation, device status, queue setup, MSI-X vector
//! mapping), the ISR status (§4.1.4.5) and the notification area (§4.1.4.4).
//!
//! This is register logic only: a [`Transport`] answers reads and writes and says what the
//! function must do about a write ([`Effect`]: reset, start queues, tell the driver the
//! device needs a reset). Nothing a driver writes is trusted: feature bits the device did
//! not offer make FEATURES_OK fail to stick (§3.1.1: the driver reads it back and gives
//! up); a queue size that is not a power of two or exceeds the maximum, or a misaligned
//! ring, makes the queue's enable set DEVICE_NEEDS_RESET (§2.1.1) instead of serving it;
//! MSI-X vectors past the table read back as VIRTIO_MSI_NO_VECTOR (§4.1.4.3.1); and queue
//! configuration stops changing once the queue is enabled.

use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;

/// BAR0's layout: one 4 KiB page per structure (§4.1.4: each lies in a BAR at an offset
/// its capability gives).
pub mod bar0 {
    pub const COMMON: u64 = 0x0000;
    pub const ISR: u64 = 0x1000;
    pub const DEVICE: u64 = 0x2000;
    pub const NOTIFY: u64 = 0x3000;
    pub const LEN: u64 = 0x4000;
    /// Each page's length as the capabilities give it.
    pub const PAGE: u64 = 0x1000;
}

/// `notify_off_multiplier` (§4.1.4.4): queue `q`'s notification address is
/// `NOTIFY + q * 4` (queue_notify_off reads as the queue's index).
pub const NOTIFY_OFF_MULTIPLIER: u32 = 4;

/// `cfg_type` of the vendor-specific capabilities (§4.1.4).
pub mod cap {
    pub const COMMON_CFG: u8 = 1;
    pub const NOTIFY_CFG: u8 = 2;
    pub const ISR_CFG: u8 = 3;
    pub const DEVICE_CFG: u8 = 4;
}

/// Device status bits (§2.1).
pub mod status {
    pub const ACKNOWLEDGE: u8 = 1;
    pub const DRIVER: u8 = 2;
    pub const DRIVER_OK: u8 = 4;
    pub const FEATURES_OK: u8 = 8;
    pub const DEVICE_NEEDS_RESET: u8 = 0x40;
    pub const FAILED: u8 = 0x80;
}

/// `VIRTIO_MSI_NO_VECTOR` (§4.1.4.3.1).
pub const NO_VECTOR: u16 = 0xFFFF;

/// ISR status bits (§4.1.4.5).
pub const ISR_QUEUE: u8 = 1;
pub const ISR_CONFIG: u8 = 2;

/// `struct virtio_pci_common_cfg` field offsets (§4.1.4.3).
pub mod common {
    pub const DEVICE_FEATURE_SELECT: usize = 0x00;
    pub const DEVICE_FEATURE: usize = 0x04;
    pub const DRIVER_FEATURE_SELECT: usize = 0x08;
    pub const DRIVER_FEATURE: usize = 0x0C;
    pub const CONFIG_MSIX_VECTOR: usize = 0x10;
    pub const NUM_QUEUES: usize = 0x12;
    pub const DEVICE_STATUS: usize = 0x14;
    pub const CONFIG_GENERATION: usize = 0x15;
    pub const QUEUE_SELECT: usize = 0x16;
    pub const QUEUE_SIZE: usize = 0x18;
    pub const QUEUE_MSIX_VECTOR: usize = 0x1A;
    pub const QUEUE_ENABLE: usize = 0x1C;
    pub const QUEUE_NOTIFY_OFF: usize = 0x1E;
    pub const QUEUE_DESC: usize = 0x20;
    pub const QUEUE_DRIVER: usize = 0x28;
    pub const QUEUE_DEVICE: usize = 0x30;
    /// Through `queue_notify_data` and `queue_reset` (read as zero: neither
    /// VIRTIO_F_NOTIF_CONFIG_DATA nor VIRTIO_F_RING_RESET is offered).
    pub const LEN: usize = 0x3C;
}

/// The vendor-specific capabilities (from `cap_len` on, for
/// [`crate::frontend::vfio_user::config::ConfigSpace::add_vendor_caps`]): common, notify,
/// ISR, device configuration, all in BAR0.
pub fn capabilities() -> Vec<Vec<u8>> {
    let body = |cfg_type: u8, offset: u64, length: u64, extra: Option<u32>| {
        // cap_len, cfg_type, bar, id, padding[2], offset, length (§4.1.4 struct virtio_pci_cap).
        let len = if extra.is_some() { 20u8 } else { 16 };
        let mut b = vec![len, cfg_type, 0, 0, 0, 0];
        b.extend_from_slice(&(offset as u32).to_le_bytes());
        b.extend_from_slice(&(length as u32).to_le_bytes());
        if let Some(m) = extra {
            b.extend_from_slice(&m.to_le_bytes());
        }
        b
    };
    vec![
        body(cap::COMMON_CFG, bar0::COMMON, common::LEN as u64, None),
        body(
            cap::NOTIFY_CFG,
            bar0::NOTIFY,
            bar0::PAGE,
            Some(NOTIFY_OFF_MULTIPLIER),
        ),
        body(cap::ISR_CFG, bar0::ISR, 1, None),
        body(
            cap::DEVICE_CFG,
            bar0::DEVICE,
            crate::frontend::vhost_user_blk::spec::cfg::LEN as u64,
            None,
        ),
    ]
}

/// One queue's configuration as the driver wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueConfig {
    pub size: u16,
    pub msix_vector: u16,
    pub enabled: bool,
    pub desc: u64,
    pub driver: u64,
    pub device: u64,
}

impl QueueConfig {
    fn new(max: u16) -> Self {
        QueueConfig {
            size: max,
            msix_vector: NO_VECTOR,
            enabled: false,
            desc: 0,
            driver: 0,
            device: 0,
        }
    }

    /// §2.7: a split ring's size is a power of two (at most the device's maximum); the
    /// descriptor table is 16-byte aligned, the available ring 2-byte, the used ring 4-byte.
    pub fn check(&self, max: u16) -> Result<(), &'static str> {
        if self.size == 0 || !self.size.is_power_of_two() || self.size > max {
            return Err("queue size is not a power of two up to the maximum");
        }
        if self.desc % 16 != 0 || self.driver % 2 != 0 || self.device % 4 != 0 {
            return Err("queue ring addresses are misaligned");
        }
        Ok(())
    }

    /// Byte lengths of the descriptor table, available ring and used ring (with their
    /// event words, §2.7.6, §2.7.8).
    pub fn ring_lengths(&self) -> [(u64, u64); 3] {
        let n = u64::from(self.size);
        [
            (self.desc, 16 * n),
            (self.driver, 6 + 2 * n),
            (self.device, 6 + 8 * n),
        ]
    }
}

/// What the function must do after a write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    None,
    /// The driver wrote 0 to device_status: stop the queues, forget everything (§2.1.2).
    Reset,
    /// DRIVER_OK is set: serve these enabled queues (after checking their rings lie in the
    /// mapped memory).
    Start(Vec<u16>),
    /// DEVICE_NEEDS_RESET was set: send the configuration change interrupt.
    NeedsReset,
}

/// The transport's register state of one function.
#[derive(Debug)]
pub struct Transport {
    device_features: u64,
    num_queues: u16,
    max_queue_size: u16,
    /// MSI-X table entries: a vector at or past it maps to nothing.
    vectors: u16,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    config_vector: u16,
    status: u8,
    queue_select: u16,
    queues: Vec<QueueConfig>,
    isr: u8,
}

fn put(img: &mut [u8], off: usize, v: &[u8]) {
    img[off..off + v.len()].copy_from_slice(v);
}

impl Transport {
    pub fn new(device_features: u64, num_queues: u16, max_queue_size: u16, vectors: u16) -> Self {
        Transport {
            device_features,
            num_queues,
            max_queue_size,
            vectors,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            config_vector: NO_VECTOR,
            status: 0,
            queue_select: 0,
            queues: vec![QueueConfig::new(max_queue_size); num_queues as usize],
            isr: 0,
        }
    }

    /// Back to the state after power-on (§2.1.2: writing 0 to device_status).
    pub fn reset(&mut self) {
        *self = Transport::new(
            self.device_features,
            self.num_queues,
            self.max_queue_size,
            self.vectors,
        );
    }

    pub fn status(&self) -> u8 {
        self.status
    }

    /// The features both sides agreed on (valid once FEATURES_OK is set).
    pub fn negotiated(&self) -> u64 {
        self.driver_features & self.device_features
    }

    pub fn queue(&self, q: u16) -> Option<&QueueConfig> {
        self.queues.get(q as usize)
    }

    pub fn config_vector(&self) -> u16 {
        self.config_vector
    }

    /// The function could not go on with the driver's setup: say so, and ask for the
    /// configuration change interrupt (§2.1.2).
    pub fn needs_reset(&mut self) -> Effect {
        self.status |= status::DEVICE_NEEDS_RESET;
        self.isr |= ISR_CONFIG;
        Effect::NeedsReset
    }

    /// A used buffer notification is due (MSI-X carries it; the ISR bit is for drivers that
    /// read it).
    pub fn queue_interrupt(&mut self) {
        self.isr |= ISR_QUEUE;
    }

    /// ISR status: reading clears it (§4.1.4.5).
    pub fn read_isr(&mut self, out: &mut [u8]) {
        out.fill(0);
        if let Some(b) = out.first_mut() {
            *b = std::mem::take(&mut self.isr);
        }
    }

    fn image(&self) -> [u8; common::LEN] {
        let mut img = [0u8; common::LEN];
        let df = match self.device_feature_select {
            0 => self.device_features as u32,
            1 => (self.device_features >> 32) as u32,
            _ => 0,
        };
        let gf = match self.driver_feature_select {
            0 => self.driver_features as u32,
            1 => (self.driver_features >> 32) as u32,
            _ => 0,
        };
        put(
            &mut img,
            common::DEVICE_FEATURE_SELECT,
            &self.device_feature_select.to_le_bytes(),
        );
        put(&mut img, common::DEVICE_FEATURE, &df.to_le_bytes());
        put(
            &mut img,
            common::DRIVER_FEATURE_SELECT,
            &self.driver_feature_select.to_le_bytes(),
        );
        put(&mut img, common::DRIVER_FEATURE, &gf.to_le_bytes());
        put(
            &mut img,
            common::CONFIG_MSIX_VECTOR,
            &self.config_vector.to_le_bytes(),
        );
        put(&mut img, common::NUM_QUEUES, &self.num_queues.to_le_bytes());
        img[common::DEVICE_STATUS] = self.status;
        img[common::CONFIG_GENERATION] = 0;
        put(
            &mut img,
            common::QUEUE_SELECT,
            &self.queue_select.to_le_bytes(),
        );
        // A queue_select past the last queue reads queue_size 0: no such queue (§4.1.4.3.2).
        if let Some(q) = self.queues.get(self.queue_select as usize) {
            put(&mut img, common::QUEUE_SIZE, &q.size.to_le_bytes());
            put(
                &mut img,
                common::QUEUE_MSIX_VECTOR,
                &q.msix_vector.to_le_bytes(),
            );
            put(
                &mut img,
                common::QUEUE_ENABLE,
                &u16::from(q.enabled).to_le_bytes(),
            );
            put(
                &mut img,
                common::QUEUE_NOTIFY_OFF,
                &self.queue_select.to_le_bytes(),
            );
            put(&mut img, common::QUEUE_DESC, &q.desc.to_le_bytes());
            put(&mut img, common::QUEUE_DRIVER, &q.driver.to_le_bytes());
            put(&mut img, common::QUEUE_DEVICE, &q.device.to_le_bytes());
        } else {
            put(
                &mut img,
                common::QUEUE_MSIX_VECTOR,
                &NO_VECTOR.to_le_bytes(),
            );
        }
        img
    }

    /// A read of the common configuration; bytes past it read as zero.
    pub fn read_common(&self, offset: u64, out: &mut [u8]) {
        let img = self.image();
        for (i, o) in out.iter_mut().enumerate() {
            *o = usize::try_from(offset)
                .ok()
                .and_then(|off| off.checked_add(i))
                .and_then(|at| img.get(at).copied())
                .unwrap_or(0);
        }
    }

    /// A write to the common configuration, of any width: the written bytes are laid over
    /// the current values and every field they touch takes its new value (a 64-bit queue
    /// address written as two 32-bit halves, as Linux does, works the same as one write).
    pub fn write_common(&mut self, offset: u64, data: &[u8]) -> Effect {
        let Ok(off) = usize::try_from(offset) else {
            return Effect::None;
        };
        let mut img = self.image();
        let end = off.saturating_add(data.len()).min(common::LEN);
        if off >= end {
            return Effect::None;
        }
        img[off..end].copy_from_slice(&data[..end - off]);
        let touched = |field: usize, len: usize| field < end && off < field + len;
        let u16_at = |at: usize| u16::from_le_bytes([img[at], img[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes(img[at..at + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |at: usize| u64::from_le_bytes(img[at..at + 8].try_into().unwrap_or([0; 8]));
        let mut effect = Effect::None;
        if touched(common::DEVICE_FEATURE_SELECT, 4) {
            self.device_feature_select = u32_at(common::DEVICE_FEATURE_SELECT);
        }
        if touched(common::DRIVER_FEATURE_SELECT, 4) {
            self.driver_feature_select = u32_at(common::DRIVER_FEATURE_SELECT);
        }
        // Features are fixed once FEATURES_OK is set (§3.1.1).
        if touched(common::DRIVER_FEATURE, 4) && self.status & status::FEATURES_OK == 0 {
            let v = u64::from(u32_at(common::DRIVER_FEATURE));
            match self.driver_feature_select {
                0 => self.driver_features = (self.driver_features & !0xFFFF_FFFF) | v,
                1 => self.driver_features = (self.driver_features & 0xFFFF_FFFF) | v << 32,
                _ => {}
            }
        }
        if touched(common::CONFIG_MSIX_VECTOR, 2) {
            self.config_vector = self.vector(u16_at(common::CONFIG_MSIX_VECTOR));
        }
        if touched(common::QUEUE_SELECT, 2) {
            self.queue_select = u16_at(common::QUEUE_SELECT);
        }
        let max = self.max_queue_size;
        let vector = self.vector(u16_at(common::QUEUE_MSIX_VECTOR));
        let sel = self.queue_select;
        if let Some(q) = self.queues.get_mut(sel as usize) {
            if touched(common::QUEUE_MSIX_VECTOR, 2) {
                q.msix_vector = vector;
            }
            // Once enabled, a queue's size and rings stay as they were (§4.1.4.3.2).
            if !q.enabled {
                if touched(common::QUEUE_SIZE, 2) {
                    q.size = u16_at(common::QUEUE_SIZE);
                }
                if touched(common::QUEUE_DESC, 8) {
                    q.desc = u64_at(common::QUEUE_DESC);
                }
                if touched(common::QUEUE_DRIVER, 8) {
                    q.driver = u64_at(common::QUEUE_DRIVER);
                }
                if touched(common::QUEUE_DEVICE, 8) {
                    q.device = u64_at(common::QUEUE_DEVICE);
                }
                // Only 1 enables; disabling takes VIRTIO_F_RING_RESET, not offered.
                if touched(common::QUEUE_ENABLE, 2) && u16_at(common::QUEUE_ENABLE) == 1 {
                    match q.check(max) {
                        Ok(()) => {
                            q.enabled = true;
                            if self.status & status::DRIVER_OK != 0 {
                                effect = Effect::Start(vec![sel]);
                            }
                        }
                        Err(why) => {
                            tracing::warn!(queue = sel, "virtio-pci: {why}; device needs reset");
                            effect = self.needs_reset();
                        }
                    }
                }
            }
        }
        if touched(common::DEVICE_STATUS, 1) {
            effect = self.write_status(img[common::DEVICE_STATUS]);
        }
        effect
    }

    /// A vector the MSI-X table has, or NO_VECTOR: what the driver reads back tells it
    /// whether the mapping took (§4.1.4.3.1).
    fn vector(&self, v: u16) -> u16 {
        if v < self.vectors {
            v
        } else {
            NO_VECTOR
        }
    }

    /// The device status state machine (§2.1, §3.1.1).
    fn write_status(&mut self, new: u8) -> Effect {
        if new == 0 {
            return Effect::Reset;
        }
        let old = self.status;
        // A driver only ever adds bits (§2.1.1); anything else is ignored.
        if new & old != old & !status::DEVICE_NEEDS_RESET {
            tracing::warn!(old, new, "virtio-pci: device_status may only gain bits");
            return Effect::None;
        }
        let mut new = new | (old & status::DEVICE_NEEDS_RESET);
        if new & status::FEATURES_OK != 0 && old & status::FEATURES_OK == 0 {
            let extra = self.driver_features & !self.device_features;
            let version_1 = self.driver_features & (1 << VIRTIO_F_VERSION_1) != 0;
            if extra != 0 || !version_1 {
                tracing::warn!(
                    driver = self.driver_features,
                    offered = self.device_features,
                    "virtio-pci: features refused (need VERSION_1, nothing not offered)"
                );
                new &= !status::FEATURES_OK;
            }
        }
        self.status = new;
        if new & status::DRIVER_OK != 0 && old & status::DRIVER_OK == 0 {
            if new & status::FEATURES_OK == 0 {
                tracing::warn!("virtio-pci: DRIVER_OK without FEATURES_OK; device needs reset");
                return self.needs_reset();
            }
            let live = (0..self.num_queues)
                .filter(|&q| self.queues[q as usize].enabled)
                .collect();
            return Effect::Start(live);
        }
        Effect::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: u64 = 1 << VIRTIO_F_VERSION_1 | 1 << 9 | 1 << 6;

    fn w16(t: &mut Transport, off: usize, v: u16) -> Effect {
        t.write_common(off as u64, &v.to_le_bytes())
    }
    fn w32(t: &mut Transport, off: usize, v: u32) -> Effect {
        t.write_common(off as u64, &v.to_le_bytes())
    }
    fn r16(t: &Transport, off: usize) -> u16 {
        let mut b = [0u8; 2];
        t.read_common(off as u64, &mut b);
        u16::from_le_bytes(b)
    }
    fn r32(t: &Transport, off: usize) -> u32 {
        let mut b = [0u8; 4];
        t.read_common(off as u64, &mut b);
        u32::from_le_bytes(b)
    }
    fn st(t: &mut Transport, v: u8) -> Effect {
        t.write_common(common::DEVICE_STATUS as u64, &[v])
    }

    /// Linux's order (virtio_pci_modern): features, FEATURES_OK, queues, DRIVER_OK.
    fn negotiate(t: &mut Transport, features: u64) -> u8 {
        st(t, status::ACKNOWLEDGE);
        st(t, status::ACKNOWLEDGE | status::DRIVER);
        w32(t, common::DRIVER_FEATURE_SELECT, 0);
        w32(t, common::DRIVER_FEATURE, features as u32);
        w32(t, common::DRIVER_FEATURE_SELECT, 1);
        w32(t, common::DRIVER_FEATURE, (features >> 32) as u32);
        st(
            t,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        t.status()
    }

    fn setup_queue(t: &mut Transport, q: u16, size: u16, base: u64) -> Effect {
        w16(t, common::QUEUE_SELECT, q);
        w16(t, common::QUEUE_SIZE, size);
        // Two 32-bit halves, as Linux writes 64-bit fields.
        for (off, a) in [
            (common::QUEUE_DESC, base),
            (common::QUEUE_DRIVER, base + 0x1000),
            (common::QUEUE_DEVICE, base + 0x2000),
        ] {
            w32(t, off, a as u32);
            w32(t, off + 4, (a >> 32) as u32);
        }
        w16(t, common::QUEUE_MSIX_VECTOR, q + 1);
        w16(t, common::QUEUE_ENABLE, 1)
    }

    #[test]
    fn a_driver_negotiates_sets_up_queues_and_goes_live() {
        let mut t = Transport::new(F, 2, 256, 3);
        w32(&mut t, common::DEVICE_FEATURE_SELECT, 1);
        assert_eq!(r32(&t, common::DEVICE_FEATURE), 1, "VERSION_1 is bit 32");
        assert_eq!(r16(&t, common::NUM_QUEUES), 2);
        assert_ne!(negotiate(&mut t, F) & status::FEATURES_OK, 0);
        assert_eq!(t.negotiated(), F);
        w16(&mut t, common::QUEUE_SELECT, 1);
        assert_eq!(
            r16(&t, common::QUEUE_SIZE),
            256,
            "the maximum before the driver writes"
        );
        assert_eq!(r16(&t, common::QUEUE_NOTIFY_OFF), 1);
        assert_eq!(setup_queue(&mut t, 0, 128, 0x1_0000_0000), Effect::None);
        assert_eq!(setup_queue(&mut t, 1, 64, 0x20_0000), Effect::None);
        let q = *t.queue(0).unwrap();
        assert_eq!(
            (q.size, q.desc, q.device, q.msix_vector),
            (128, 0x1_0000_0000, 0x1_0000_2000, 1)
        );
        assert!(q.enabled);
        let live = st(
            &mut t,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
        );
        assert_eq!(live, Effect::Start(vec![0, 1]));
        // An enabled queue's rings no longer move.
        w16(&mut t, common::QUEUE_SELECT, 0);
        w32(&mut t, common::QUEUE_DESC, 0x5000);
        assert_eq!(t.queue(0).unwrap().desc, 0x1_0000_0000);
        assert_eq!(st(&mut t, 0), Effect::Reset);
    }

    #[test]
    fn features_not_offered_or_without_version_1_are_refused() {
        let mut t = Transport::new(F, 1, 256, 2);
        assert_eq!(
            negotiate(&mut t, F | 1 << 3) & status::FEATURES_OK,
            0,
            "unoffered bit"
        );
        let mut t = Transport::new(F, 1, 256, 2);
        assert_eq!(
            negotiate(&mut t, 1 << 9) & status::FEATURES_OK,
            0,
            "legacy driver"
        );
        // Once accepted, the features stay.
        let mut t = Transport::new(F, 1, 256, 2);
        negotiate(&mut t, F);
        w32(&mut t, common::DRIVER_FEATURE_SELECT, 0);
        w32(&mut t, common::DRIVER_FEATURE, 0);
        assert_eq!(t.negotiated(), F);
    }

    #[test]
    fn hostile_queue_setups_need_a_reset_and_are_never_served() {
        for (size, base) in [
            (100u16, 0x10000u64),
            (512, 0x10000),
            (0, 0x10000),
            (64, 0x10008),
        ] {
            let mut t = Transport::new(F, 1, 256, 2);
            negotiate(&mut t, F);
            assert_eq!(
                setup_queue(&mut t, 0, size, base),
                Effect::NeedsReset,
                "size {size} at {base:#x}"
            );
            assert!(!t.queue(0).unwrap().enabled);
            assert_ne!(t.status() & status::DEVICE_NEEDS_RESET, 0);
            let mut isr = [0u8; 4];
            t.read_isr(&mut isr);
            assert_eq!(isr[0], ISR_CONFIG);
            t.read_isr(&mut isr);
            assert_eq!(isr[0], 0, "reading the ISR clears it");
            // DRIVER_OK then serves nothing.
            assert_eq!(
                st(
                    &mut t,
                    status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK
                ),
                Effect::Start(vec![])
            );
        }
    }

    #[test]
    fn out_of_range_selects_vectors_and_status_regressions_are_harmless() {
        let mut t = Transport::new(F, 1, 256, 2);
        w16(&mut t, common::QUEUE_SELECT, 7);
        assert_eq!(r16(&t, common::QUEUE_SIZE), 0, "no queue 7");
        assert_eq!(w16(&mut t, common::QUEUE_ENABLE, 1), Effect::None);
        w16(&mut t, common::CONFIG_MSIX_VECTOR, 2);
        assert_eq!(
            r16(&t, common::CONFIG_MSIX_VECTOR),
            NO_VECTOR,
            "past the table"
        );
        w16(&mut t, common::CONFIG_MSIX_VECTOR, 1);
        assert_eq!(t.config_vector(), 1);
        negotiate(&mut t, F);
        assert_eq!(
            st(&mut t, status::ACKNOWLEDGE),
            Effect::None,
            "clearing bits is ignored"
        );
        assert_ne!(t.status() & status::FEATURES_OK, 0);
        // DRIVER_OK without FEATURES_OK.
        let mut t = Transport::new(F, 1, 256, 2);
        assert_eq!(
            st(
                &mut t,
                status::ACKNOWLEDGE | status::DRIVER | status::DRIVER_OK
            ),
            Effect::NeedsReset
        );
        // Accesses past the structure, of odd widths, at huge offsets.
        let mut b = [0xAAu8; 8];
        t.read_common(common::LEN as u64 - 2, &mut b);
        assert_eq!(&b[2..], &[0; 6]);
        assert_eq!(t.write_common(u64::MAX, &[1; 8]), Effect::None);
        assert_eq!(t.write_common(0x100, &[1; 8]), Effect::None);
    }

    #[test]
    fn capabilities_point_into_bar0() {
        let caps = capabilities();
        assert_eq!(caps.len(), 4);
        assert_eq!(caps[0][..2], [16, cap::COMMON_CFG]);
        assert_eq!(caps[1][..2], [20, cap::NOTIFY_CFG]);
        assert_eq!(
            u32::from_le_bytes(caps[1][14..18].try_into().unwrap()),
            NOTIFY_OFF_MULTIPLIER
        );
        for c in &caps {
            let off = u32::from_le_bytes(c[6..10].try_into().unwrap()) as u64;
            let len = u32::from_le_bytes(c[10..14].try_into().unwrap()) as u64;
            assert_eq!(c[2], 0, "BAR0");
            assert!(off + len <= bar0::LEN);
        }
    }
}
