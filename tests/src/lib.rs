//! Shared helpers for nacre's end-to-end tests.
pub mod nvmf_host;
