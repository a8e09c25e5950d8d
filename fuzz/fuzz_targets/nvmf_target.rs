//! A host's byte stream into one NVMe/TCP target connection (see nacre_dpu::fuzzing::nvmf_target).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nacre_dpu::fuzzing::nvmf_target(data));
