//! Shared helpers for nacre's end-to-end tests.

pub mod blkio_client;
pub mod daemon;
pub mod fabric_support;
pub mod fuzz;
pub mod load;
pub mod nvmf_host;
pub mod skip;
pub mod testbed;
pub mod xts_oracle;
