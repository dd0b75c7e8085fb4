//! What the SQLite test files share: a temporary database file, and a
//! migrated store with a business table.

use std::path::{Path, PathBuf};

use idem_core::Error;
use idem_sqlite::{SqliteOptions, SqliteStore, SqliteTx, store_error};

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

    /// A store on this file, on a pool of its own.
    #[allow(dead_code)]
    pub(crate) async fn open(&self) -> SqliteStore {
        SqliteStore::open(&self.path).await.expect("open the test database")
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

/// A store on `path` opened with `options` and migrated, with the business
/// table `effects` the tests write to.
#[allow(dead_code)]
pub(crate) async fn migrated_with(path: &Path, options: SqliteOptions) -> SqliteStore {
    let store = SqliteStore::open_with(path, options).await.expect("open");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE IF NOT EXISTS effects (effect_id TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects table");
    store
}

/// Writes the business row `effect_id` inside `tx`.
#[allow(dead_code)]
pub(crate) async fn write_effect(tx: &mut SqliteTx, effect_id: &str) -> Result<(), Error> {
    sqlx::query("INSERT INTO effects (effect_id) VALUES (?1)")
        .bind(effect_id)
        .execute(&mut **tx)
        .await
        .map_err(store_error)?;
    Ok(())
}

/// How many business rows are named `effect_id`.
#[allow(dead_code)]
pub(crate) async fn count_effects(store: &SqliteStore, effect_id: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE effect_id = ?1")
        .bind(effect_id)
        .fetch_one(store.pool())
        .await
        .expect("count")
}
