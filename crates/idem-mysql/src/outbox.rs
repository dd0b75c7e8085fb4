//! The transactional outbox on MySQL and MariaDB.
//!
//! Rows are enqueued in the caller's transaction. A relay takes unsent rows
//! with `FOR UPDATE SKIP LOCKED` (MySQL 8.0.1+, MariaDB 10.6+) in a READ
//! COMMITTED transaction (no gap locks, so enqueuers never wait on a relay) that it
//! holds while it publishes: parallel relays never take the same row, a
//! relay that dies lets go of its rows with its connection, and every pass
//! looks at every unsent row (no high-water mark), so a row whose
//! transaction commits after later rows is still found.

use idem_core::TableName;
use idem_sql::{OutboxSchema, Relay, SqlOutbox};

use crate::dialect::MySqlDialect;

pub use idem_sql::DEFAULT_OUTBOX_TABLE;

/// The outbox on MySQL or MariaDB: enqueue inside a transaction; relays take rows
/// through [`OutboxStore`](idem_core::OutboxStore).
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
pub type MySqlOutbox = SqlOutbox<MySqlDialect>;

/// Rows held by one relay: a READ COMMITTED transaction with the rows locked.
pub type MySqlOutboxBatch = idem_sql::SqlOutboxBatch<MySqlDialect>;

impl OutboxSchema for MySqlDialect {
    const RELAY: Relay = Relay::Held;

    fn create_outbox(table: &TableName) -> Vec<String> {
        let t = table.as_str();
        // Relays read unsent rows in order (`sent_at_ms IS NULL`, by seq) and
        // retention deletes sent rows by age: one index serves both.
        vec![format!(
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
        )]
    }
}
