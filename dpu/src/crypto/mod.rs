//! Per-tenant AES-XTS encryption of volumes. (In progress.)
