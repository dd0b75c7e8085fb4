//! Dead letters of outbound calls on SQLite.
//!
//! One row per (tenant, operation, key). Every write reads the row with the
//! database's clock inside a `BEGIN IMMEDIATE` transaction (SQLite's single
//! writer lock, so two redrives never both take one letter), applies one of
//! the core's transitions ([`DeadLetter`](idem_core::DeadLetter)'s methods: the same decisions on
//! every engine), and writes the row back. A first record is an
//! `INSERT … ON CONFLICT DO NOTHING`, so two writers of one call make one
//! row. Timestamps and holds are on the database's clock.

use idem_core::TableName;
use idem_sql::{DeadLetterSchema, SqlDeadLetters};

use crate::dialect::{SCOPED_ROW, SqliteDialect};

pub use idem_sql::DEFAULT_DEAD_LETTER_TABLE;

/// The columns of the first schema version, which an upgrade copies.
const V1_COLUMNS: &str = "id, tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
                          redrives, created_at_ms, updated_at_ms, redrive_until_ms, response_status, response_body";

/// Dead letters on SQLite.
///
/// ```no_run
/// # async fn demo(store: idem_sqlite::SqliteStore, letter: idem_core::NewDeadLetter) -> Result<(), idem_core::Error> {
/// use idem_core::DeadLetterStore;
/// use idem_sqlite::SqliteDeadLetters;
///
/// let letters = SqliteDeadLetters::new(store.pool().clone());
/// letters.migrate().await?;
/// // Alone:
/// letters.record(&letter).await?;
/// // Or with the business writes, in one transaction:
/// let mut tx = store.pool().begin().await.map_err(idem_sqlite::store_error)?;
/// letters.record_in(&mut tx, &letter).await?;
/// tx.commit().await.map_err(idem_sqlite::store_error)?;
/// # Ok(()) }
/// ```
pub type SqliteDeadLetters = SqlDeadLetters<SqliteDialect>;

impl DeadLetterSchema for SqliteDialect {
    /// SQLite cannot change a CHECK constraint (the new states): the table
    /// is rebuilt.
    const V1_REBUILDS: bool = true;

    fn create_dead_letters(table: &TableName) -> Vec<String> {
        let schema = Schema { table };
        vec![schema.create(table.as_str()), schema.index()]
    }

    fn dead_letters_from_v1(table: &TableName) -> Vec<String> {
        Schema { table }.upgrade()
    }

    fn dead_letters_from_v2(table: &TableName) -> Vec<String> {
        ["key_horizon_ms", "horizon_margin_ms", "settle_ms"]
            .iter()
            .map(|c| format!("ALTER TABLE {table} ADD COLUMN {c} INTEGER NULL"))
            .collect()
    }
}

/// The dead-letter table's schema and its versions.
struct Schema<'a> {
    table: &'a TableName,
}

impl Schema<'_> {
    fn create(&self, t: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                {SCOPED_ROW}
                method TEXT NOT NULL,
                url TEXT NOT NULL,
                headers TEXT NOT NULL,
                body BLOB NOT NULL,
                attempts INTEGER NOT NULL,
                last_error TEXT NOT NULL,
                state TEXT NOT NULL CHECK (state IN ('dead', 'redriving', 'resolved', 'unknown', 'cancelled')),
                redrives INTEGER NOT NULL DEFAULT 0,
                created_at_ms INTEGER NOT NULL,
                updated_at_ms INTEGER NOT NULL,
                redrive_until_ms INTEGER NULL,
                response_status INTEGER NULL,
                response_body BLOB NULL,
                first_reached_at_ms INTEGER NULL,
                verdict TEXT NULL,
                verdict_by TEXT NULL,
                verdict_at_ms INTEGER NULL,
                verdict_note TEXT NULL,
                key_horizon_ms INTEGER NULL,
                horizon_margin_ms INTEGER NULL,
                settle_ms INTEGER NULL,
                UNIQUE (tenant, operation, idem_key)
            )"
        )
    }

    fn index(&self) -> String {
        let t = self.table.as_str();
        // Listing by state, in id order; purging final letters.
        format!("CREATE INDEX IF NOT EXISTS {t}_state_idx ON {t} (state, id)")
    }

    /// The latest version from version 1: SQLite cannot change a CHECK
    /// constraint (the new states), so the table is rebuilt under the same
    /// name, rows, ids and id sequence kept.
    fn upgrade(&self) -> Vec<String> {
        let t = self.table.as_str();
        let new = format!("{t}_v2");
        vec![
            format!("DROP TABLE IF EXISTS {new}"),
            self.create(&new),
            format!("INSERT INTO {new} ({V1_COLUMNS}) SELECT {V1_COLUMNS} FROM {t}"),
            format!("DROP TABLE {t}"),
            format!("ALTER TABLE {new} RENAME TO {t}"),
            self.index(),
        ]
    }
}
