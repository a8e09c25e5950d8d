//! Descriptor chains through the vhost-user-blk queue worker (see nacre_dpu::fuzzing::virtqueue).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nacre_dpu::fuzzing::virtqueue(data));
