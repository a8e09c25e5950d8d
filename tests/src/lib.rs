//! Shared helpers for nacre's end-to-end tests.

pub mod daemon;
pub mod blkio_client;
