//! Documented skips: the only way a test may pass without running what it tests.
//!
//! A test skips only behind a switch the README documents (`NACRE_SKIP_TESTBED`,
//! `NACRE_SKIP_FUZZ`, `NACRE_SKIP_MIRI`). It calls [`skip`], which prints `SKIPPED: <test>: <why>` and appends
//! the same line to the file named by `NACRE_SKIP_LOG` (scripts/test sets it and counts the
//! lines into its summary, `N passed, N failed, N skipped`). libtest captures a passing
//! test's output, so the file is what makes a skip visible. Anything else a test needs and
//! does not find is a failure that says what is missing.

use std::io::Write;

/// The environment variable naming the file skips are appended to.
pub const LOG_ENV: &str = "NACRE_SKIP_LOG";

/// Record that `test` did not run, and why. The caller then returns.
pub fn skip(test: &str, why: &str) {
    let line = format!("SKIPPED: {test}: {why}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os(LOG_ENV) {
        // One write of one line per skip (O_APPEND): tests run in parallel.
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("cannot open {LOG_ENV}={path:?}: {e}"));
        f.write_all(format!("{line}\n").as_bytes())
            .unwrap_or_else(|e| panic!("cannot write {LOG_ENV}={path:?}: {e}"));
    }
}

/// Whether the switch `env` is set (to anything but empty or `0`).
pub fn switch_on(env: &str) -> bool {
    std::env::var_os(env).is_some_and(|v| !v.is_empty() && v != "0")
}
