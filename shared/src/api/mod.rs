//! Parameters and results of nacred's control-plane methods, one module per object family.
//!
//! Method names follow SPDK and DOCA SNAP (`volume_create`, `vhost_blk_create`,
//! `nvmf_subsystem_create`, …). Every parameter struct rejects unknown fields, so a typo in a
//! request is an "invalid params" error that names the field, never a silently ignored knob.

pub mod host;
pub mod nvmf;
pub mod peer;
pub mod qos;
pub mod remote;
pub mod tenant;
pub mod vhost;
pub mod volume;

/// Names of objects (volumes, devices, tenants): 1–64 characters from `[A-Za-z0-9_.-]`,
/// not starting with `.` or `-`. They become file and socket names, so nothing else is safe.
pub fn validate_name(kind: &str, name: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if name.is_empty() || name.len() > 64 {
        return Err(format!(
            "{kind} name must be 1 to 64 characters long (got {})",
            name.len()
        ));
    }
    if !name.chars().all(ok_char) || name.starts_with('.') || name.starts_with('-') {
        return Err(format!(
            "{kind} name {name:?} is invalid: use letters, digits, '_', '-' and '.', not starting with '.' or '-'"
        ));
    }
    Ok(())
}

/// The result of methods that only acknowledge.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Ack {
    pub ok: bool,
}

#[cfg(test)]
mod test {
    use super::validate_name;

    #[test]
    fn names() {
        assert!(validate_name("volume", "default").is_ok());
        assert!(validate_name("volume", "a.b-c_9").is_ok());
        assert!(validate_name("volume", "").is_err());
        assert!(validate_name("volume", "../etc").is_err());
        assert!(validate_name("volume", "-x").is_err());
        assert!(validate_name("volume", "a b").is_err());
        assert!(validate_name("volume", &"x".repeat(65)).is_err());
    }
}
