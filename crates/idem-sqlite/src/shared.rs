//! The process-wide map from database file to its [`KeyRegistry`].
//!
//! Every [`SqliteStore`](crate::SqliteStore) on one file in one process must
//! serialise claims of a key through the same registry; otherwise a second
//! pool on the file would let a twin bypass the in-process wait for its key
//! and only wait on SQLite's global write lock.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use idem_core::KeyRegistry;

use crate::keylock::FileKeyLock;

/// One registry per database file, keyed by the file's canonical path. An
/// entry is an empty map when no key is being claimed, so entries are kept
/// for the life of the process.
static REGISTRIES: LazyLock<Mutex<HashMap<PathBuf, KeyRegistry>>> = LazyLock::new(Default::default);

/// The registry shared by every store on `file` in this process. It also
/// holds each key against other processes through the file's side lock
/// file (see [`FileKeyLock`]).
pub(crate) fn registry_for(file: &Path) -> KeyRegistry {
    let identity = identity_of(file);
    let mut map = REGISTRIES.lock().unwrap_or_else(PoisonError::into_inner);
    map.entry(identity)
        .or_insert_with_key(|db| {
            if is_in_memory(file) {
                // One process only; there is no file to lock beside it.
                KeyRegistry::new()
            } else {
                KeyRegistry::new().with_shared_lock(Arc::new(FileKeyLock::new(db)))
            }
        })
        .clone()
}

/// Whether `file` names an in-memory database rather than a file.
fn is_in_memory(file: &Path) -> bool {
    let name = file.as_os_str();
    name.is_empty() || name == ":memory:"
}

/// The name under which a database file is known in the map: its canonical
/// path, so that relative paths, `..` and symbolic links to one file agree.
/// A file that does not exist yet (a caller-built pool that has not
/// connected) is named by its canonical directory and file name, which is
/// what its canonical path will be once SQLite creates it.
fn identity_of(file: &Path) -> PathBuf {
    if let Ok(canonical) = std::fs::canonicalize(file) {
        return canonical;
    }
    if let (Some(parent), Some(name)) = (file.parent(), file.file_name()) {
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        if let Ok(dir) = std::fs::canonicalize(parent) {
            return dir.join(name);
        }
    }
    std::path::absolute(file).unwrap_or_else(|_| file.to_path_buf())
}
