//! One nacred per state directory and per run directory.
//!
//! Two daemons over the same state directory would each write `state.json` and serve the same
//! backing files; over the same run directory the second would replace the first's sockets.
//! So before nacred touches anything in a directory it takes an exclusive `flock` on
//! `<dir>/nacred.lock` and writes its PID there for the error the next one prints. The lock is
//! the kernel's: it goes away with the process however it ends (a crash leaves a file, never a
//! stale lock), and the descriptor is close-on-exec, so no child inherits it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use thiserror::Error;

pub const LOCK_FILE: &str = "nacred.lock";

#[derive(Debug, Error)]
pub enum LockError {
    #[error(
        "{dir} is in use by another nacred ({holder}); stop it first or give this one other \
         --state-dir/--run-dir directories"
    )]
    Held { dir: PathBuf, holder: String },
    #[error("cannot lock {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A held directory lock; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    path: PathBuf,
}

impl DirLock {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Take `<dir>/nacred.lock` without waiting.
pub fn acquire(dir: &Path) -> Result<DirLock, LockError> {
    let path = dir.join(LOCK_FILE);
    let io = |source| LockError::Io {
        path: path.clone(),
        source,
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(io)?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(io(err));
        }
        let mut text = String::new();
        let _ = file.read_to_string(&mut text);
        let holder = match text.trim().parse::<u32>() {
            Ok(pid) => format!("pid {pid}, holding {}", path.display()),
            Err(_) => format!("holding {}", path.display()),
        };
        return Err(LockError::Held {
            dir: dir.to_path_buf(),
            holder,
        });
    }
    file.set_len(0).map_err(io)?;
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    writeln!(file, "{}", std::process::id()).map_err(io)?;
    Ok(DirLock { _file: file, path })
}

/// Lock each distinct directory of `dirs` (the state and run directories may be one).
pub fn acquire_all(dirs: &[&Path]) -> Result<Vec<DirLock>, LockError> {
    let mut seen: Vec<PathBuf> = Vec::new();
    let mut locks = Vec::new();
    for dir in dirs {
        let canon = dir.canonicalize().map_err(|source| LockError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        if seen.contains(&canon) {
            continue;
        }
        seen.push(canon);
        locks.push(acquire(dir)?);
    }
    Ok(locks)
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn second_lock_names_the_holder_and_the_first_release_frees_it() {
        let d = tempfile::tempdir().unwrap();
        let first = acquire(d.path()).unwrap();
        let e = acquire(d.path()).unwrap_err().to_string();
        assert!(
            e.contains(&format!("pid {}", std::process::id())) && e.contains("in use"),
            "{e}"
        );
        drop(first);
        acquire(d.path()).unwrap();
    }

    #[test]
    fn one_directory_given_twice_is_locked_once() {
        let d = tempfile::tempdir().unwrap();
        let locks = acquire_all(&[d.path(), d.path()]).unwrap();
        assert_eq!(locks.len(), 1);
    }
}
