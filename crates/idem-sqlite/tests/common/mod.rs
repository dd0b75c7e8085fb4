//! What the SQLite test files share: a temporary database file.

use std::path::PathBuf;

/// A temporary database file, removed with its WAL, shared-memory and key
/// lock files when dropped.
pub(crate) struct TempDb {
    pub(crate) path: PathBuf,
}

impl TempDb {
    /// A new file name in the temporary directory, `label` naming the test
    /// file that uses it.
    pub(crate) fn new(label: &str) -> Self {
        let name = format!("idem-sqlite-{label}-{}.db", uuid::Uuid::new_v4().simple());
        Self {
            path: std::env::temp_dir().join(name),
        }
    }
}

impl Drop for TempDb {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-idem.lock"] {
            let mut file = self.path.clone().into_os_string();
            file.push(suffix);
            // The file may never have been created, or may still be held open
            // by a closing pool; both are harmless on a temporary file.
            let _ = std::fs::remove_file(file);
        }
    }
}
