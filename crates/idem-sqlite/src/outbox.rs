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

use idem_core::TableName;
use idem_sql::{OutboxSchema, Relay, SqlOutbox};

use crate::dialect::SqliteDialect;

pub use idem_sql::DEFAULT_OUTBOX_TABLE;
pub use idem_sql::outbox::DEFAULT_RELAY_LEASE;

/// The outbox on SQLite: enqueue inside a transaction; relays take rows
/// through [`OutboxStore`](idem_core::OutboxStore) by lease.
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
pub type SqliteOutbox = SqlOutbox<SqliteDialect>;

/// Rows leased by one relay.
pub type SqliteOutboxBatch = idem_sql::SqlOutboxBatch<SqliteDialect>;

impl OutboxSchema for SqliteDialect {
    /// One writer at a time: a relay cannot keep a transaction open while it
    /// publishes.
    const RELAY: Relay = Relay::Leased;

    fn create_outbox(table: &TableName) -> Vec<String> {
        let t = table.as_str();
        vec![
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
        ]
    }
}
