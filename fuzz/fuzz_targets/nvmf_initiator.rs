//! A controller's byte stream into the NVMe/TCP initiator's queue (see nacre_dpu::fuzzing::nvmf_initiator).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nacre_dpu::fuzzing::nvmf_initiator(data));
