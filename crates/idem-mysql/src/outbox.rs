//! The transactional outbox on MySQL and MariaDB.
//!
//! Rows are enqueued in the caller's transaction. A relay takes unsent rows
//! with `FOR UPDATE SKIP LOCKED` (MySQL 8.0.1+, MariaDB 10.6+) in a READ
//! COMMITTED transaction (no gap locks, so enqueuers never wait on a relay) that it
//! holds while it publishes: parallel relays never take the same row, a
//! relay that dies lets go of its rows with its connection, and every pass
//! looks at every unsent row (no high-water mark), so a row whose
//! transaction commits after later rows is still found.

use std::fmt;
use std::sync::Arc;

use idem_core::{
    BoxFuture, OutboxBatch, OutboxEvent, OutboxLag, OutboxMessage, OutboxStore, Result, RetryBackoff, TableName,
};
use sqlx::mysql::{MySqlConnection, MySqlPool};
use sqlx::{AssertSqlSafe, MySql, Transaction};

use crate::store_error;

/// The default outbox table.
pub const DEFAULT_OUTBOX_TABLE: &str = "idem_outbox";

/// The database's clock in milliseconds, read when the statement runs.
const NOW_MS: &str = "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)";

/// seq, event id, subject, payload, created_at_ms, attempts.
type RawRow = (i64, Vec<u8>, Vec<u8>, Vec<u8>, i64, i32);

struct Sql {
    insert: String,
    take: String,
    mark_sent: String,
    mark_failed: String,
    lag: String,
    purge: String,
}

/// The outbox on MySQL or MariaDB: enqueue inside a transaction; relays take rows
/// through [`OutboxStore`].
///
/// ```no_run
/// # async fn demo(pool: sqlx::MySqlPool) -> Result<(), idem_core::Error> {
/// use idem_core::OutboxEvent;
/// use idem_mysql::MySqlOutbox;
///
/// let outbox = MySqlOutbox::new(pool.clone());
/// outbox.migrate().await?;
/// let mut tx = pool.begin().await.map_err(idem_mysql::store_error)?;
/// // ... the business writes ...
/// outbox.enqueue(&mut tx, &OutboxEvent::new("orders.created", b"{}".to_vec())?).await?;
/// tx.commit().await.map_err(idem_mysql::store_error)?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MySqlOutbox {
    pool: MySqlPool,
    table: TableName,
    sql: Arc<Sql>,
}

impl fmt::Debug for MySqlOutbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlOutbox")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl MySqlOutbox {
    /// The outbox in [`DEFAULT_OUTBOX_TABLE`].
    pub fn new(pool: MySqlPool) -> Self {
        Self::with_table(pool, TableName::new(DEFAULT_OUTBOX_TABLE).expect("a valid table name"))
    }

    /// The outbox in `table`.
    pub fn with_table(pool: MySqlPool, table: TableName) -> Self {
        let t = table.as_str();
        let sql = Sql {
            insert: format!("INSERT INTO {t} (event_id, subject, payload, created_at_ms) VALUES (?, ?, ?, {NOW_MS})"),
            take: format!(
                "SELECT seq, event_id, subject, payload, created_at_ms, attempts FROM {t} \
                 WHERE sent_at_ms IS NULL AND next_attempt_at_ms <= {NOW_MS} ORDER BY seq LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
            mark_sent: format!("UPDATE {t} SET sent_at_ms = {NOW_MS} WHERE seq IN "),
            mark_failed: format!(
                "UPDATE {t} SET next_attempt_at_ms = {NOW_MS} + LEAST(?, ? << LEAST(attempts, 20)), \
                 attempts = attempts + 1 WHERE seq IN "
            ),
            lag: format!(
                "SELECT CAST(COUNT(*) AS SIGNED), CAST({NOW_MS} - MIN(created_at_ms) AS SIGNED) FROM {t} WHERE sent_at_ms IS NULL"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE sent_at_ms IS NOT NULL AND sent_at_ms < {NOW_MS} - ? ORDER BY sent_at_ms LIMIT ?"
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
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Creates the table and its indexes if they do not exist. Safe from
    /// several processes at once.
    pub async fn migrate(&self) -> Result<()> {
        let t = self.table.as_str();
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        // The named lock belongs to the session: closing the connection if
        // this future is dropped is what releases it.
        conn.close_on_drop();
        let lock = "LEFT(CONCAT('idem-outbox-migrate:', COALESCE(DATABASE(), ''), '.', ?), 64)";
        let acquired: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT GET_LOCK({lock}, 60)")))
            .bind(t)
            .fetch_one(&mut *conn)
            .await
            .map_err(store_error)?;
        if acquired != Some(1) {
            return Err(idem_core::Error::store(
                idem_core::StoreErrorKind::LockTimeout,
                format!("the outbox migration lock of {t} was not granted within 60 s"),
            ));
        }
        // Relays read unsent rows in order (`sent_at_ms IS NULL`, by seq) and
        // retention deletes sent rows by age: one index serves both.
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                event_id VARBINARY(255) NOT NULL,
                subject VARBINARY(255) NOT NULL,
                payload LONGBLOB NOT NULL,
                created_at_ms BIGINT NOT NULL,
                sent_at_ms BIGINT NULL,
                attempts INT NOT NULL DEFAULT 0,
                next_attempt_at_ms BIGINT NOT NULL DEFAULT 0,
                KEY {t}_state (sent_at_ms, seq)
            ) ENGINE=InnoDB"
        );
        let result = sqlx::query(AssertSqlSafe(ddl))
            .execute(&mut *conn)
            .await
            .map_err(store_error);
        sqlx::query(AssertSqlSafe(format!("SELECT RELEASE_LOCK({lock})")))
            .bind(t)
            .execute(&mut *conn)
            .await
            .map_err(store_error)?;
        result.map(|_| ())
    }

    /// Enqueues `event` in the caller's open transaction: it is published if
    /// and only if that transaction commits.
    pub async fn enqueue(&self, conn: &mut MySqlConnection, event: &OutboxEvent) -> Result<()> {
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
pub struct MySqlOutboxBatch {
    tx: Option<Transaction<'static, MySql>>,
    messages: Vec<OutboxMessage>,
    sql: Arc<Sql>,
}

impl fmt::Debug for MySqlOutboxBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlOutboxBatch")
            .field("messages", &self.messages.len())
            .finish()
    }
}

/// Row sequences marked per statement: under every engine's limit of bound
/// values, whatever the relay's batch size.
const MARK_CHUNK: usize = 1_000;

impl OutboxBatch for MySqlOutboxBatch {
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
            // In bounded statements: a prepared statement takes at most
            // 65,535 placeholders, and a relay's batch may be larger.
            for chunk in sent.chunks(MARK_CHUNK) {
                let list = vec!["?"; chunk.len()].join(", ");
                let mut query = sqlx::query(AssertSqlSafe(format!("{}({list})", self.sql.mark_sent)));
                for seq in chunk {
                    query = query.bind(*seq);
                }
                query.execute(&mut *tx).await.map_err(store_error)?;
            }
            for chunk in failed.chunks(MARK_CHUNK) {
                let list = vec!["?"; chunk.len()].join(", ");
                let mut query = sqlx::query(AssertSqlSafe(format!("{}({list})", self.sql.mark_failed)))
                    .bind(backoff.max_ms.max(1))
                    .bind(backoff.min_ms.max(1));
                for seq in chunk {
                    query = query.bind(*seq);
                }
                query.execute(&mut *tx).await.map_err(store_error)?;
            }
            tx.commit().await.map_err(store_error)
        })
    }
}

impl OutboxStore for MySqlOutbox {
    type Batch = MySqlOutboxBatch;

    fn take(&self, limit: usize) -> BoxFuture<'_, Result<MySqlOutboxBatch>> {
        Box::pin(async move {
            // READ COMMITTED whatever the server's default: REPEATABLE READ
            // would lock the gap after the last unsent row and make every
            // enqueuer wait for this relay's publish.
            let mut conn = self.pool.acquire().await.map_err(store_error)?;
            sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                .execute(&mut *conn)
                .await
                .map_err(store_error)?;
            let mut tx = Transaction::begin(conn, None).await.map_err(store_error)?;
            let rows: Vec<RawRow> = sqlx::query_as(AssertSqlSafe(self.sql.take.as_str()))
                .bind(u64::try_from(limit).unwrap_or(u64::MAX))
                .fetch_all(&mut *tx)
                .await
                .map_err(store_error)?;
            let messages = rows
                .into_iter()
                .map(|(seq, id, subject, payload, created_at_ms, attempts)| OutboxMessage {
                    seq,
                    // Written from validated ASCII; binary columns compare
                    // byte for byte.
                    id: String::from_utf8_lossy(&id).into_owned(),
                    subject: String::from_utf8_lossy(&subject).into_owned(),
                    payload,
                    created_at_ms,
                    attempts,
                })
                .collect();
            Ok(MySqlOutboxBatch {
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
            // READ COMMITTED: at REPEATABLE READ the delete would lock the
            // gap where new rows are inserted, and enqueuers would wait.
            let mut conn = self.pool.acquire().await.map_err(store_error)?;
            sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                .execute(&mut *conn)
                .await
                .map_err(store_error)?;
            let mut tx = Transaction::begin(conn, None).await.map_err(store_error)?;
            let done = sqlx::query(AssertSqlSafe(self.sql.purge.as_str()))
                .bind(older_than_ms.max(0))
                .bind(u64::from(limit))
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
            tx.commit().await.map_err(store_error)?;
            Ok(done.rows_affected())
        })
    }
}
