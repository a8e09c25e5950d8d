//! `tenant_*` methods: tenants, their key-encryption keys and encryption policy.
//! (Filled in by the encryption work; see issue "Per-tenant AES-XTS encryption".)
