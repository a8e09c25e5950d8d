//! A peer's DH-HMAC-CHAP messages into both roles of the authentication state machines (see nacre_dpu::fuzzing::nvme_auth).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nacre_dpu::fuzzing::nvme_auth(data));
