//! Pending operations in a local SQLite file.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::Row;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};

use crate::store::{Bounds, BoxFuture, PendingStore, bounds_setters};
use crate::{Error, Key, Operation, Result};

const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS idem_client_pending (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    method TEXT NOT NULL,
    url TEXT NOT NULL,
    headers BLOB NOT NULL,
    body BLOB NOT NULL,
    saved_at_ms INTEGER NOT NULL
)";

// One statement decides both the key's uniqueness and the bound, so two
// savers cannot both pass the count; the WHERE clause also keeps SQLite
// from reading ON CONFLICT as part of a join.
const INSERT: &str = "INSERT INTO idem_client_pending (key, method, url, headers, body, saved_at_ms)
    SELECT ?1, ?2, ?3, ?4, ?5, ?6 WHERE (SELECT COUNT(*) FROM idem_client_pending) < ?7
    ON CONFLICT (key) DO NOTHING";

/// Pending operations in a SQLite file: WAL journal, `synchronous = FULL`,
/// so a [`save`](PendingStore::save) has reached the disk when it returns,
/// before the operation's first byte is sent.
///
/// One table, `idem_client_pending`, created on open. Bodies are bounded
/// ([`with_max_body_bytes`](Self::with_max_body_bytes), default 1 MiB) and so
/// is the number of operations ([`with_max_pending`](Self::with_max_pending),
/// default 10,000).
///
/// ```no_run
/// # async fn demo() -> idem_client::Result<()> {
/// use idem_client::{Client, SqlitePending};
/// let pending = SqlitePending::open("pending.db").await?;
/// let client = Client::builder().store(pending).build()?;
/// for resumed in client.resume().await? {
///     println!("{}: {:?}", resumed.operation.key(), resumed.result.map(|r| r.status()));
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SqlitePending {
    pool: SqlitePool,
    bounds: Bounds,
}

impl SqlitePending {
    /// Opens (creating it if missing) the file at `path` and its table.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = path.to_string_lossy();
        if text.is_empty() || text == ":memory:" || text.starts_with("file:") {
            return Err(Error::Store(format!(
                "{text:?} is not a file path; pending operations must outlive the process (use MemoryPending otherwise)"
            )));
        }
        let connect = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(connect)
            .await
            .map_err(|e| Error::Store(format!("cannot open {}: {e}", path.display())))?;
        sqlx::query(CREATE_TABLE).execute(&pool).await?;
        Ok(Self {
            pool,
            bounds: Bounds::DEFAULT,
        })
    }

    bounds_setters!();

    /// Closes the file's connections.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    async fn save_op(&self, op: &Operation) -> Result<()> {
        self.bounds.check_body(op)?;
        let headers = op.header_lines();
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let max_pending = i64::try_from(self.bounds.max_pending).unwrap_or(i64::MAX);
        let done = sqlx::query(INSERT)
            .bind(op.key().as_str())
            .bind(op.method().as_str())
            .bind(op.url().as_str())
            .bind(headers.as_slice())
            .bind(op.body().as_ref())
            .bind(now_ms)
            .bind(max_pending)
            .execute(&self.pool)
            .await?;
        if done.rows_affected() == 1 {
            return Ok(());
        }
        // Either the key is pending already, or the store is full.
        let row = sqlx::query("SELECT method, url, headers, body FROM idem_client_pending WHERE key = ?1")
            .bind(op.key().as_str())
            .fetch_optional(&self.pool)
            .await?;
        match row {
            Some(row) => {
                let same = row.try_get::<String, _>("method")? == op.method().as_str()
                    && row.try_get::<String, _>("url")? == op.url().as_str()
                    && row.try_get::<Vec<u8>, _>("headers")? == headers
                    && row.try_get::<Vec<u8>, _>("body")? == op.body().as_ref();
                if same {
                    Ok(())
                } else {
                    Err(Error::KeyInUse(op.key().clone()))
                }
            }
            None => Err(self.bounds.full()),
        }
    }

    async fn list_ops(&self) -> Result<Vec<Operation>> {
        let rows = sqlx::query("SELECT key, method, url, headers, body FROM idem_client_pending ORDER BY seq")
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| {
                Operation::from_stored(
                    &row.try_get::<String, _>("key")?,
                    &row.try_get::<String, _>("method")?,
                    &row.try_get::<String, _>("url")?,
                    &row.try_get::<Vec<u8>, _>("headers")?,
                    row.try_get::<Vec<u8>, _>("body")?,
                )
            })
            .collect()
    }
}

impl PendingStore for SqlitePending {
    fn save<'a>(&'a self, op: &'a Operation) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.save_op(op))
    }

    fn remove<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            sqlx::query("DELETE FROM idem_client_pending WHERE key = ?1")
                .bind(key.as_str())
                .execute(&self.pool)
                .await?;
            Ok(())
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<Operation>>> {
        Box::pin(self.list_ops())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file() -> std::path::PathBuf {
        std::env::temp_dir().join(format!("idem-client-test-{}.db", uuid::Uuid::now_v7()))
    }

    /// The SQLite store keeps the store contract.
    #[tokio::test]
    async fn sqlite_store_contract() {
        let store = SqlitePending::open(temp_file())
            .await
            .unwrap()
            .with_max_body_bytes(100)
            .with_max_pending(5);
        crate::store::tests::contract(&store, 100, 5).await;
    }

    /// A saved operation is found, byte for byte, by a store opened later on the same file.
    #[tokio::test]
    async fn saved_operations_survive_reopening() {
        let path = temp_file();
        let op = Operation::patch("http://127.0.0.1:9/v1/x?y=1")
            .header("x-one", "1")
            .body(vec![0u8, 159, 255])
            .build()
            .unwrap();
        let store = SqlitePending::open(&path).await.unwrap();
        store.save(&op).await.unwrap();
        store.close().await;
        let again = SqlitePending::open(&path).await.unwrap();
        assert_eq!(again.list().await.unwrap(), vec![op.clone()]);
        again.remove(op.key()).await.unwrap();
        assert!(again.list().await.unwrap().is_empty());
        let mode: String = sqlx::query("PRAGMA journal_mode")
            .fetch_one(&again.pool)
            .await
            .unwrap()
            .get(0);
        assert_eq!(mode, "wal");
    }

    /// A row that is not a valid operation is reported as corrupt, not sent.
    #[tokio::test]
    async fn corrupt_rows_are_errors() {
        let store = SqlitePending::open(temp_file()).await.unwrap();
        sqlx::query(
            "INSERT INTO idem_client_pending (key, method, url, headers, body, saved_at_ms)
             VALUES ('k', 'POST', 'not a url', x'', x'', 0)",
        )
        .execute(&store.pool)
        .await
        .unwrap();
        assert!(matches!(store.list().await, Err(Error::Corrupt(_))));
    }

    /// Paths that would not outlive the process are refused.
    #[tokio::test]
    async fn memory_databases_are_refused() {
        for p in [":memory:", "", "file::memory:?cache=shared"] {
            assert!(matches!(SqlitePending::open(p).await, Err(Error::Store(_))), "{p:?}");
        }
    }
}
