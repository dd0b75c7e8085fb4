//! The transactional outbox on PostgreSQL.
//!
//! Rows are enqueued in the caller's transaction. A relay takes unsent rows
//! with `FOR UPDATE SKIP LOCKED` in a READ COMMITTED transaction that it
//! holds while it publishes: parallel relays never take the same row, a
//! relay that dies lets go of its rows with its connection, and every pass
//! looks at every unsent row (no high-water mark), so a row whose
//! transaction commits after later rows is still found.

use std::fmt;
use std::sync::Arc;

use idem_core::{
    BoxFuture, OutboxBatch, OutboxEvent, OutboxLag, OutboxMessage, OutboxStore, Result, RetryBackoff, TableName,
};
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{AssertSqlSafe, Postgres, Transaction};

use crate::sql::{derived_name, fnv1a};
use crate::store_error;

/// The default outbox table.
pub const DEFAULT_OUTBOX_TABLE: &str = "idem_outbox";

/// The database's clock in milliseconds, read when the statement runs.
const NOW_MS: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::bigint";

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

/// The outbox on PostgreSQL: enqueue inside a transaction; relays take rows
/// through [`OutboxStore`].
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), idem_core::Error> {
/// use idem_core::OutboxEvent;
/// use idem_postgres::PgOutbox;
///
/// let outbox = PgOutbox::new(pool.clone());
/// outbox.migrate().await?;
/// let mut tx = pool.begin().await.map_err(idem_postgres::store_error)?;
/// // ... the business writes ...
/// outbox.enqueue(&mut tx, &OutboxEvent::new("orders.created", b"{}".to_vec())?).await?;
/// tx.commit().await.map_err(idem_postgres::store_error)?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgOutbox {
    pool: PgPool,
    table: TableName,
    sql: Arc<Sql>,
}

impl fmt::Debug for PgOutbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgOutbox")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl PgOutbox {
    /// The outbox in [`DEFAULT_OUTBOX_TABLE`].
    pub fn new(pool: PgPool) -> Self {
        Self::with_table(pool, TableName::new(DEFAULT_OUTBOX_TABLE).expect("a valid table name"))
    }

    /// The outbox in `table`.
    pub fn with_table(pool: PgPool, table: TableName) -> Self {
        let t = table.as_str();
        let sql = Sql {
            insert: format!(
                "INSERT INTO {t} (event_id, subject, payload, created_at_ms) VALUES ($1, $2, $3, {NOW_MS})"
            ),
            take: format!(
                "SELECT seq, event_id, subject, payload, created_at_ms, attempts FROM {t} \
                 WHERE sent_at_ms IS NULL AND next_attempt_at_ms <= {NOW_MS} ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED"
            ),
            mark_sent: format!("UPDATE {t} SET sent_at_ms = {NOW_MS} WHERE seq = ANY($1)"),
            mark_failed: format!(
                "UPDATE {t} SET attempts = attempts + 1, \
                 next_attempt_at_ms = {NOW_MS} + LEAST($2, $1 << LEAST(attempts, 20)) WHERE seq = ANY($3)"
            ),
            lag: format!("SELECT COUNT(*), {NOW_MS} - MIN(created_at_ms) FROM {t} WHERE sent_at_ms IS NULL"),
            purge: format!(
                "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} \
                 WHERE sent_at_ms IS NOT NULL AND sent_at_ms < {NOW_MS} - $1 LIMIT $2)"
            ),
        };
        Self {
            pool,
            table,
            sql: Arc::new(sql),
        }
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates the table and its indexes if they do not exist. Safe from
    /// several processes at once.
    pub async fn migrate(&self) -> Result<()> {
        let t = self.table.as_str();
        let unsent = derived_name(&self.table, "unsent_idx");
        let sent = derived_name(&self.table, "sent_idx");
        let mut tx = self.pool.begin().await.map_err(store_error)?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        let lock_key = fnv1a(&[b"idem-postgres outbox migrate", t.as_bytes()]) as i64;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(lock_key)
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        for ddl in [
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                    event_id TEXT COLLATE \"C\" NOT NULL,
                    subject TEXT COLLATE \"C\" NOT NULL,
                    payload BYTEA NOT NULL,
                    created_at_ms BIGINT NOT NULL,
                    sent_at_ms BIGINT NULL,
                    attempts INTEGER NOT NULL DEFAULT 0,
                    next_attempt_at_ms BIGINT NOT NULL DEFAULT 0
                )"
            ),
            // Relays read unsent rows in order; the index holds only them.
            format!("CREATE INDEX IF NOT EXISTS {unsent} ON {t} (seq) WHERE sent_at_ms IS NULL"),
            // Retention deletes sent rows by age.
            format!("CREATE INDEX IF NOT EXISTS {sent} ON {t} (sent_at_ms) WHERE sent_at_ms IS NOT NULL"),
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
    pub async fn enqueue(&self, conn: &mut PgConnection, event: &OutboxEvent) -> Result<()> {
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

/// Rows held by one relay: a READ COMMITTED transaction with the rows locked.
pub struct PgOutboxBatch {
    tx: Option<Transaction<'static, Postgres>>,
    messages: Vec<OutboxMessage>,
    sql: Arc<Sql>,
}

impl fmt::Debug for PgOutboxBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgOutboxBatch")
            .field("messages", &self.messages.len())
            .finish()
    }
}

impl OutboxBatch for PgOutboxBatch {
    fn messages(&self) -> &[OutboxMessage] {
        &self.messages
    }

    fn finish(mut self, sent: Vec<i64>, backoff: RetryBackoff) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move {
            let Some(mut tx) = self.tx.take() else { return Ok(()) };
            if self.messages.is_empty() {
                return tx.rollback().await.map_err(store_error);
            }
            let failed: Vec<i64> = self
                .messages
                .iter()
                .map(|m| m.seq)
                .filter(|s| !sent.contains(s))
                .collect();
            if !sent.is_empty() {
                sqlx::query(AssertSqlSafe(self.sql.mark_sent.as_str()))
                    .bind(&sent)
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
            }
            if !failed.is_empty() {
                sqlx::query(AssertSqlSafe(self.sql.mark_failed.as_str()))
                    .bind(backoff.min_ms.max(1))
                    .bind(backoff.max_ms.max(1))
                    .bind(&failed)
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
            }
            tx.commit().await.map_err(store_error)
        })
    }
}

impl OutboxStore for PgOutbox {
    type Batch = PgOutboxBatch;

    fn take(&self, limit: usize) -> BoxFuture<'_, Result<PgOutboxBatch>> {
        Box::pin(async move {
            // READ COMMITTED whatever the database's default: a row another
            // relay marked sent after this transaction began is re-checked
            // against `sent_at_ms IS NULL` when it is locked, not reported as
            // a serialisation failure.
            let mut tx = self
                .pool
                .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await
                .map_err(store_error)?;
            let rows: Vec<RawRow> = sqlx::query_as(AssertSqlSafe(self.sql.take.as_str()))
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(&mut *tx)
                .await
                .map_err(store_error)?;
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
            Ok(PgOutboxBatch {
                tx: Some(tx),
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
