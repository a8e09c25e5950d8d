//! Shared helpers for nacre's end-to-end tests.

pub mod blkio_client;
pub mod daemon;
pub mod fabric_support;
