//! The per-key lock shared by every process on one database file: a POSIX
//! byte-range lock (`fcntl`) on the side file `<db>-idem.lock`.
//!
//! Each (scope, key) owns one byte of the side file, at an offset derived
//! from a hash of the scoped key among 2^40 slots. Two keys that share a
//! slot only wait for each other. The operating system releases a process's
//! locks when it exits, however it exits, so a crashed holder never strands
//! a key. POSIX locks belong to the process: they exclude other processes
//! only, which is why the in-process [`KeyRegistry`](idem_core::KeyRegistry)
//! serialises a key inside the process before this lock is taken.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use file_guard::Lock;
use idem_core::{Error, IdempotencyKey, Result, Scope, SharedKeyGuard, SharedKeyLock, StoreErrorKind};
use sha2::{Digest, Sha256};

/// How many one-byte slots the side file's keys are spread over.
const SLOTS: u64 = 1 << 40;

/// The side lock file of one database file, opened on first use and kept
/// open for the life of the process: closing any descriptor of a file drops
/// every POSIX lock the process holds on it.
pub(crate) struct FileKeyLock {
    path: PathBuf,
    file: Mutex<Option<Arc<File>>>,
}

impl FileKeyLock {
    /// The lock of the database file `db` (a canonical path).
    pub(crate) fn new(db: &Path) -> Self {
        let mut name = db.as_os_str().to_owned();
        name.push("-idem.lock");
        Self {
            path: PathBuf::from(name),
            file: Mutex::new(None),
        }
    }

    fn file(&self) -> Result<Arc<File>> {
        // Opened under the lock: a second descriptor, even one closed at
        // once, would drop every lock this process holds on the file.
        let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(file) = &*file {
            return Ok(file.clone());
        }
        let opened = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.path)
            .map_err(|e| {
                Error::store(
                    StoreErrorKind::Unavailable,
                    format!("cannot open the key lock file {}: {e}", self.path.display()),
                )
            })?;
        Ok(file.insert(Arc::new(opened)).clone())
    }
}

/// The byte of the side file that stands for a scoped key.
pub(crate) fn slot_of(scope: &Scope, key: &IdempotencyKey) -> usize {
    let mut hash = Sha256::new();
    for part in [scope.tenant().as_str(), scope.operation().as_str(), key.as_str()] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    let digest = hash.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let slots = SLOTS.min(usize::MAX as u64);
    usize::try_from(u64::from_be_bytes(first) % slots).unwrap_or(0)
}

impl SharedKeyLock for FileKeyLock {
    fn try_lock(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<SharedKeyGuard>> {
        let file = self.file()?;
        match file_guard::try_lock(file, Lock::Exclusive, slot_of(scope, key), 1) {
            Ok(guard) => Ok(Some(Box::new(guard))),
            // POSIX allows either error for a range locked by another process.
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::PermissionDenied) => Ok(None),
            Err(e) => Err(Error::store(
                StoreErrorKind::Unavailable,
                format!("cannot lock a key in {}: {e}", self.path.display()),
            )),
        }
    }
}
