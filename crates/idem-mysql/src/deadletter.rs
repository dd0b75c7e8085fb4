//! Dead letters of outbound calls on MySQL and MariaDB.
//!
//! One row per (tenant, operation, key), whose binary columns compare byte
//! for byte. Every write reads the row with the database's clock by
//! `SELECT … FOR UPDATE` in a READ COMMITTED transaction (no gap locks: a
//! redrive of a missing id never holds up new letters; a concurrent redrive
//! waits for the row's lock, re-reads it and no longer finds it free),
//! applies one of the core's transitions ([`DeadLetter`](idem_core::DeadLetter)'s methods: the
//! same decisions on every engine), and writes the row back. A first record
//! is a plain `INSERT`; a duplicate key (another writer of the same call got
//! there first) turns it into an update of that row. Timestamps and holds
//! are on the database's clock.

use idem_core::TableName;
use idem_sql::{DeadLetterSchema, SqlDeadLetters};

use crate::dialect::{MySqlDialect, SCOPED_ROW};

pub use idem_sql::DEFAULT_DEAD_LETTER_TABLE;

/// Dead letters on MySQL or MariaDB.
///
/// ```no_run
/// # async fn demo(pool: sqlx::MySqlPool, letter: idem_core::NewDeadLetter) -> Result<(), idem_core::Error> {
/// use idem_core::DeadLetterStore;
/// use idem_mysql::MySqlDeadLetters;
///
/// let letters = MySqlDeadLetters::new(pool.clone());
/// letters.migrate().await?;
/// // Alone:
/// letters.record(&letter).await?;
/// // Or with the business writes, in one transaction:
/// let mut tx = pool.begin().await.map_err(idem_mysql::store_error)?;
/// letters.record_in(&mut tx, &letter).await?;
/// tx.commit().await.map_err(idem_mysql::store_error)?;
/// # Ok(()) }
/// ```
pub type MySqlDeadLetters = SqlDeadLetters<MySqlDialect>;

impl DeadLetterSchema for MySqlDialect {
    fn create_dead_letters(table: &TableName) -> Vec<String> {
        vec![Schema { table }.create()]
    }

    fn dead_letters_from_v1(table: &TableName) -> Vec<String> {
        Schema { table }.upgrade()
    }

    fn dead_letters_from_v2(table: &TableName) -> Vec<String> {
        Schema { table }.terms_migration()
    }
}

/// The dead-letter table's schema and its versions.
struct Schema<'a> {
    table: &'a TableName,
}

impl Schema<'_> {
    fn create(&self) -> String {
        let t = self.table.as_str();
        // A vendor's answer is kept up to 64 KiB, one byte more than a BLOB
        // holds: MEDIUMBLOB.
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                {SCOPED_ROW}
                method VARBINARY(32) NOT NULL,
                url VARBINARY(2048) NOT NULL,
                headers MEDIUMBLOB NOT NULL,
                body MEDIUMBLOB NOT NULL,
                attempts BIGINT NOT NULL,
                last_error BLOB NOT NULL,
                state VARBINARY(16) NOT NULL,
                redrives BIGINT NOT NULL DEFAULT 0,
                created_at_ms BIGINT NOT NULL,
                updated_at_ms BIGINT NOT NULL,
                redrive_until_ms BIGINT NULL,
                response_status INT NULL,
                response_body MEDIUMBLOB NULL,
                first_reached_at_ms BIGINT NULL,
                verdict VARBINARY(16) NULL,
                verdict_by VARBINARY(16) NULL,
                verdict_at_ms BIGINT NULL,
                verdict_note BLOB NULL,
                key_horizon_ms BIGINT NULL,
                horizon_margin_ms BIGINT NULL,
                settle_ms BIGINT NULL,
                UNIQUE KEY scope_key (tenant, operation, idem_key),
                KEY state_idx (state, id)
            ) ENGINE=InnoDB"
        )
    }

    /// Version 2 from version 1: the new columns, and room for a whole
    /// vendor answer. (MySQL does not check the states: nothing to change
    /// there.)
    fn upgrade(&self) -> Vec<String> {
        let t = self.table.as_str();
        vec![format!(
            "ALTER TABLE {t} ADD COLUMN first_reached_at_ms BIGINT NULL, ADD COLUMN verdict VARBINARY(16) NULL, \
             ADD COLUMN verdict_by VARBINARY(16) NULL, ADD COLUMN verdict_at_ms BIGINT NULL, \
             ADD COLUMN verdict_note BLOB NULL, MODIFY COLUMN response_body MEDIUMBLOB NULL"
        )]
    }

    /// Version 3 from version 2: the terms the sends were made under.
    fn terms_migration(&self) -> Vec<String> {
        let t = self.table.as_str();
        vec![format!(
            "ALTER TABLE {t} ADD COLUMN key_horizon_ms BIGINT NULL, ADD COLUMN horizon_margin_ms BIGINT NULL, \
             ADD COLUMN settle_ms BIGINT NULL"
        )]
    }
}
