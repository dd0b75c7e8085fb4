//! The transactional outbox on SQLite.
//!
//! Rows are enqueued in the caller's transaction. SQLite has one writer at a
//! time, so a relay cannot hold rows in an open transaction while it
//! publishes (every business write would wait for the broker). Instead a
//! relay leases rows: one short statement marks up to `limit` unsent,
//! unleased rows with its token and a lease deadline; finishing marks the
//! published ones sent and schedules the rest for a retry, by token. A relay that dies
//! holding rows loses them when the lease runs out, and another relay takes
//! them again (the broker's deduplication window and the consumers' inbox
//! absorb the second publish). Every pass looks at every unsent row: no
//! high-water mark, nothing skipped.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::{
    BoxFuture, OutboxBatch, OutboxEvent, OutboxLag, OutboxMessage, OutboxStore, Result, RetryBackoff, TableName,
};
use sqlx::AssertSqlSafe;
use sqlx::sqlite::{SqliteConnection, SqlitePool};

use crate::store_error;

/// The default outbox table.
pub const DEFAULT_OUTBOX_TABLE: &str = "idem_outbox";

/// How long a relay holds the rows it took, by default.
pub const DEFAULT_RELAY_LEASE: Duration = Duration::from_secs(30);

/// The database's clock in milliseconds.
const NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

/// seq, event id, subject, payload, created_at_ms, attempts.
type RawRow = (i64, String, String, Vec<u8>, i64, i32);

struct Sql {
    insert: String,
    take: String,
    mark_sent: String,
    mark_failed: String,
    lag: String,
    purge: String,
}

/// The outbox on SQLite: enqueue inside a transaction; relays take rows
/// through [`OutboxStore`] by lease.
///
/// ```no_run
/// # async fn demo(store: idem_sqlite::SqliteStore) -> Result<(), idem_core::Error> {
/// use idem_core::OutboxEvent;
/// use idem_sqlite::SqliteOutbox;
///
/// let outbox = SqliteOutbox::new(store.pool().clone());
/// outbox.migrate().await?;
/// let mut tx = store.pool().begin().await.map_err(idem_sqlite::store_error)?;
/// outbox.enqueue(&mut tx, &OutboxEvent::new("orders.created", b"{}".to_vec())?).await?;
/// tx.commit().await.map_err(idem_sqlite::store_error)?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteOutbox {
    pool: SqlitePool,
    table: TableName,
    lease: Duration,
    sql: Arc<Sql>,
}

impl fmt::Debug for SqliteOutbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteOutbox")
            .field("table", &self.table)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl SqliteOutbox {
    /// The outbox in [`DEFAULT_OUTBOX_TABLE`].
    pub fn new(pool: SqlitePool) -> Self {
        Self::with_table(pool, TableName::new(DEFAULT_OUTBOX_TABLE).expect("a valid table name"))
    }

    /// The outbox in `table`.
    pub fn with_table(pool: SqlitePool, table: TableName) -> Self {
        let t = table.as_str();
        let sql = Sql {
            insert: format!("INSERT INTO {t} (event_id, subject, payload, created_at_ms) VALUES (?, ?, ?, {NOW_MS})"),
            take: format!(
                "UPDATE {t} SET relay_token = ?1, lease_until_ms = {NOW_MS} + ?2 WHERE seq IN \
                 (SELECT seq FROM {t} WHERE sent_at_ms IS NULL AND next_attempt_at_ms <= {NOW_MS} \
                  AND (lease_until_ms IS NULL OR lease_until_ms <= {NOW_MS}) ORDER BY seq LIMIT ?3) \
                 RETURNING seq, event_id, subject, payload, created_at_ms, attempts"
            ),
            mark_sent: format!(
                "UPDATE {t} SET sent_at_ms = {NOW_MS}, relay_token = NULL, lease_until_ms = NULL \
                 WHERE relay_token = ? AND sent_at_ms IS NULL AND seq IN "
            ),
            mark_failed: format!(
                "UPDATE {t} SET relay_token = NULL, lease_until_ms = NULL, attempts = attempts + 1, \
                 next_attempt_at_ms = {NOW_MS} + MIN(?2, ?3 << MIN(attempts, 20)) \
                 WHERE relay_token = ?1 AND sent_at_ms IS NULL"
            ),
            lag: format!("SELECT COUNT(*), {NOW_MS} - MIN(created_at_ms) FROM {t} WHERE sent_at_ms IS NULL"),
            purge: format!(
                "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} \
                 WHERE sent_at_ms IS NOT NULL AND sent_at_ms < {NOW_MS} - ? LIMIT ?)"
            ),
        };
        Self {
            pool,
            table,
            lease: DEFAULT_RELAY_LEASE,
            sql: Arc::new(sql),
        }
    }

    /// How long a relay holds the rows it took before another may take
    /// them (default [`DEFAULT_RELAY_LEASE`]). Keep it longer than a
    /// batch's publish and shorter than the broker's deduplication window.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The relay lease.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// Creates the table and its indexes if they do not exist.
    pub async fn migrate(&self) -> Result<()> {
        let t = self.table.as_str();
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(store_error)?;
        for ddl in [
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    seq INTEGER PRIMARY KEY,
                    event_id TEXT NOT NULL,
                    subject TEXT NOT NULL,
                    payload BLOB NOT NULL,
                    created_at_ms INTEGER NOT NULL,
                    sent_at_ms INTEGER NULL,
                    relay_token INTEGER NULL,
                    lease_until_ms INTEGER NULL,
                    attempts INTEGER NOT NULL DEFAULT 0,
                    next_attempt_at_ms INTEGER NOT NULL DEFAULT 0
                )"
            ),
            format!("CREATE INDEX IF NOT EXISTS {t}_unsent_idx ON {t} (seq) WHERE sent_at_ms IS NULL"),
            format!("CREATE INDEX IF NOT EXISTS {t}_sent_idx ON {t} (sent_at_ms) WHERE sent_at_ms IS NOT NULL"),
        ] {
            sqlx::query(AssertSqlSafe(ddl))
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        tx.commit().await.map_err(store_error)
    }

    /// Enqueues `event` in the caller's open transaction: it is published if
    /// and only if that transaction commits.
    pub async fn enqueue(&self, conn: &mut SqliteConnection, event: &OutboxEvent) -> Result<()> {
        sqlx::query(AssertSqlSafe(self.sql.insert.as_str()))
            .bind(event.id())
            .bind(event.subject())
            .bind(event.payload())
            .execute(conn)
            .await
            .map_err(store_error)?;
        Ok(())
    }
}

/// A token that tells one relay's batch from every other's.
fn relay_token() -> i64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    // Process id, a counter and the time: distinct across relays and
    // processes on one file.
    let mixed = (u64::from(std::process::id()) << 40) ^ (n << 20) ^ nanos.rotate_left(17) ^ nanos;
    (mixed >> 1) as i64
}

/// Rows leased by one relay.
pub struct SqliteOutboxBatch {
    pool: SqlitePool,
    token: i64,
    messages: Vec<OutboxMessage>,
    sql: Arc<Sql>,
}

impl fmt::Debug for SqliteOutboxBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteOutboxBatch")
            .field("messages", &self.messages.len())
            .finish()
    }
}

/// Row sequences marked per statement: under every engine's limit of bound
/// values, whatever the relay's batch size.
const MARK_CHUNK: usize = 1_000;

impl OutboxBatch for SqliteOutboxBatch {
    fn messages(&self) -> &[OutboxMessage] {
        &self.messages
    }

    fn finish(self, sent: Vec<i64>, backoff: RetryBackoff) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move {
            if self.messages.is_empty() {
                return Ok(());
            }
            let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(store_error)?;
            // In bounded statements: SQLite takes at most 32,766 bound
            // values in one, and a relay's batch may be larger.
            for chunk in sent.chunks(MARK_CHUNK) {
                let list = vec!["?"; chunk.len()].join(", ");
                let mut query = sqlx::query(AssertSqlSafe(format!("{}({list})", self.sql.mark_sent))).bind(self.token);
                for seq in chunk {
                    query = query.bind(*seq);
                }
                query.execute(&mut *tx).await.map_err(store_error)?;
            }
            // What is left of the batch was not confirmed.
            sqlx::query(AssertSqlSafe(self.sql.mark_failed.as_str()))
                .bind(self.token)
                .bind(backoff.max_ms.max(1))
                .bind(backoff.min_ms.max(1))
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
            tx.commit().await.map_err(store_error)
        })
    }
}

impl OutboxStore for SqliteOutbox {
    type Batch = SqliteOutboxBatch;

    fn take(&self, limit: usize) -> BoxFuture<'_, Result<SqliteOutboxBatch>> {
        Box::pin(async move {
            let token = relay_token();
            let lease_ms = i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX / 4);
            let mut rows: Vec<RawRow> = sqlx::query_as(AssertSqlSafe(self.sql.take.as_str()))
                .bind(token)
                .bind(lease_ms)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(&self.pool)
                .await
                .map_err(store_error)?;
            // RETURNING gives no order.
            rows.sort_unstable_by_key(|r| r.0);
            let messages = rows
                .into_iter()
                .map(|(seq, id, subject, payload, created_at_ms, attempts)| OutboxMessage {
                    seq,
                    id,
                    subject,
                    payload,
                    created_at_ms,
                    attempts,
                })
                .collect();
            Ok(SqliteOutboxBatch {
                pool: self.pool.clone(),
                token,
                messages,
                sql: self.sql.clone(),
            })
        })
    }

    fn lag(&self) -> BoxFuture<'_, Result<OutboxLag>> {
        Box::pin(async move {
            let (unsent, age): (i64, Option<i64>) = sqlx::query_as(AssertSqlSafe(self.sql.lag.as_str()))
                .fetch_one(&self.pool)
                .await
                .map_err(store_error)?;
            Ok(OutboxLag {
                unsent: u64::try_from(unsent).unwrap_or(0),
                oldest_unsent_age_ms: age.map(|a| a.max(0)),
            })
        })
    }

    fn purge_sent(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(self.sql.purge.as_str()))
                .bind(older_than_ms.max(0))
                .bind(i64::from(limit))
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            Ok(done.rows_affected())
        })
    }
}
