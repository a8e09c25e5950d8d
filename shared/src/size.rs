//! Sizes as operators write them: `4096`, `512K`, `1G`, `1.5T`, `2GiB`.
//!
//! Suffixes are binary (K = 1024), as in qemu-img, SPDK's `bdev_malloc_create -b` helpers
//! and nvme-cli; a trailing `B` or `iB` is accepted and means the same.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SizeError {
    #[error("size is empty: give a number with an optional K, M, G or T suffix, e.g. 1G")]
    Empty,
    #[error("invalid size {0:?}: give a number with an optional K, M, G or T suffix, e.g. 1G")]
    Invalid(String),
    #[error("size {0:?} is too large")]
    Overflow(String),
}

/// Parse a size with an optional binary suffix into bytes.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(SizeError::Empty);
    }
    let upper = t.to_ascii_uppercase();
    let body = upper
        .strip_suffix("IB")
        .or_else(|| upper.strip_suffix('B'))
        .unwrap_or(&upper);
    let (num, shift) = match body.chars().last() {
        Some('K') => (&body[..body.len() - 1], 10),
        Some('M') => (&body[..body.len() - 1], 20),
        Some('G') => (&body[..body.len() - 1], 30),
        Some('T') => (&body[..body.len() - 1], 40),
        Some('P') => (&body[..body.len() - 1], 50),
        _ => (body, 0),
    };
    let invalid = || SizeError::Invalid(text.to_string());
    if num.is_empty() {
        return Err(invalid());
    }
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(1u64 << shift)
            .ok_or_else(|| SizeError::Overflow(text.to_string()));
    }
    // Fractions only make sense with a suffix ("1.5G"); the result must be whole bytes.
    let f: f64 = num.parse().map_err(|_| invalid())?;
    if shift == 0 || !f.is_finite() || f < 0.0 {
        return Err(invalid());
    }
    let bytes = f * (1u64 << shift) as f64;
    if bytes > u64::MAX as f64 {
        return Err(SizeError::Overflow(text.to_string()));
    }
    if bytes.fract() != 0.0 {
        return Err(invalid());
    }
    Ok(bytes as u64)
}

/// Format bytes the way `parse_size` reads them back, exactly (largest exact suffix).
pub fn format_size(bytes: u64) -> String {
    for (suffix, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if bytes != 0 && bytes % (1u64 << shift) == 0 {
            return format!("{}{}", bytes >> shift, suffix);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn parses_plain_and_suffixed_sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("512MB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size(" 8T "), Ok(8 << 40));
    }

    #[test]
    fn rejects_garbage_and_overflow() {
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert!(matches!(parse_size("G"), Err(SizeError::Invalid(_))));
        assert!(matches!(parse_size("1X"), Err(SizeError::Invalid(_))));
        assert!(matches!(parse_size("-1G"), Err(SizeError::Invalid(_))));
        assert!(matches!(parse_size("1.5"), Err(SizeError::Invalid(_))));
        assert!(matches!(
            parse_size("99999999999P"),
            Err(SizeError::Overflow(_))
        ));
    }

    #[test]
    fn format_round_trips() {
        for b in [0, 1, 4096, 1 << 30, 3 << 29, 12345] {
            assert_eq!(parse_size(&format_size(b)), Ok(b));
        }
        assert_eq!(format_size(1 << 30), "1G");
    }
}
