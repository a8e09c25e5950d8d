//! NVMe admin and I/O commands on a connected, enabled controller (see nacre_dpu::fuzzing::nvme_commands).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nacre_dpu::fuzzing::nvme_commands(data));
