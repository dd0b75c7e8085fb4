//! The transactional outbox on PostgreSQL.
//!
//! Rows are enqueued in the caller's transaction. A relay takes unsent rows
//! with `FOR UPDATE SKIP LOCKED` in a READ COMMITTED transaction that it
//! holds while it publishes: parallel relays never take the same row, a
//! relay that dies lets go of its rows with its connection, and every pass
//! looks at every unsent row (no high-water mark), so a row whose
//! transaction commits after later rows is still found.

use idem_core::{BoxFuture, Result, TableName};
use idem_sql::{Arg, OutboxSchema, Relay, SqlDb, SqlOutbox};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgConnection;

use crate::dialect::PgDialect;
use crate::sql::derived_name;
use crate::store_error;

pub use idem_sql::DEFAULT_OUTBOX_TABLE;

/// The outbox on PostgreSQL: enqueue inside a transaction; relays take rows
/// through [`OutboxStore`](idem_core::OutboxStore).
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
pub type PgOutbox = SqlOutbox<PgDialect>;

/// Rows held by one relay: a READ COMMITTED transaction with the rows locked.
pub type PgOutboxBatch = idem_sql::SqlOutboxBatch<PgDialect>;

impl OutboxSchema for PgDialect {
    const RELAY: Relay = Relay::Held;

    fn create_outbox(table: &TableName) -> Vec<String> {
        let t = table.as_str();
        let unsent = derived_name(table, "unsent_idx");
        let sent = derived_name(table, "sent_idx");
        vec![
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
        ]
    }

    /// One statement whatever the batch's size: the sequences travel as one
    /// array (`seq = ANY($n)`), and the statement's text never changes.
    fn for_rows<'c>(
        conn: &'c mut PgConnection,
        head: &'c str,
        leading: &'c [Arg<'c>],
        seqs: &'c [i64],
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(async move {
            if seqs.is_empty() {
                return Ok(());
            }
            let sql = format!("{head} seq = ANY(${})", leading.len() + 1);
            let statement = leading
                .iter()
                .copied()
                .fold(sqlx::query(AssertSqlSafe(sql)), sqlx::Postgres::bind)
                .bind(seqs);
            statement.execute(conn).await.map_err(store_error)?;
            Ok(())
        })
    }
}
