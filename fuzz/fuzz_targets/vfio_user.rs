//! A hostile vfio-user client and its guest memory against the NVMe PCIe controller (see nacre_dpu::fuzzing::vfio_user).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nacre_dpu::fuzzing::vfio_user(data));
