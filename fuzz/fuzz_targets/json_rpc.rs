//! A client's bytes on nacred's JSON-RPC control socket (see nacre_dpu::fuzzing::json_rpc).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nacre_dpu::fuzzing::json_rpc(data));
