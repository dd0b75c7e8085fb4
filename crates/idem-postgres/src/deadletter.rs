//! Dead letters of outbound calls on PostgreSQL.
//!
//! One row per (tenant, operation, key). Every write reads the row with the
//! database's clock by `SELECT … FOR UPDATE` in a READ COMMITTED
//! transaction (a concurrent redrive waits for the row's lock, re-reads it
//! and no longer finds it free: `None`, never a serialisation failure,
//! whatever the database's default level), applies one of the core's
//! transitions ([`DeadLetter`](idem_core::DeadLetter)'s methods: the same decisions on every
//! engine), and writes the row back. A first record is an
//! `INSERT … ON CONFLICT DO NOTHING`, so two writers of one call make one
//! row. Timestamps and holds are on the database's clock.

use idem_core::TableName;
use idem_sql::{DeadLetterSchema, SqlDeadLetters};

use crate::dialect::{PgDialect, SCOPED_ROW};
use crate::sql::derived_name;

pub use idem_sql::DEFAULT_DEAD_LETTER_TABLE;

/// Dead letters on PostgreSQL.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, letter: idem_core::NewDeadLetter) -> Result<(), idem_core::Error> {
/// use idem_core::DeadLetterStore;
/// use idem_postgres::PgDeadLetters;
///
/// let letters = PgDeadLetters::new(pool.clone());
/// letters.migrate().await?;
/// // Alone:
/// letters.record(&letter).await?;
/// // Or with the business writes, in one transaction:
/// let mut tx = pool.begin().await.map_err(idem_postgres::store_error)?;
/// letters.record_in(&mut tx, &letter).await?;
/// tx.commit().await.map_err(idem_postgres::store_error)?;
/// # Ok(()) }
/// ```
pub type PgDeadLetters = SqlDeadLetters<PgDialect>;

impl DeadLetterSchema for PgDialect {
    fn create_dead_letters(table: &TableName) -> Vec<String> {
        let schema = Schema { table };
        vec![schema.create(), schema.index()]
    }

    fn dead_letters_from_v1(table: &TableName) -> Vec<String> {
        Schema { table }.upgrade()
    }

    fn dead_letters_from_v2(table: &TableName) -> Vec<String> {
        vec![Schema { table }.upgrade_terms()]
    }
}

/// The dead-letter table's schema and its versions.
struct Schema<'a> {
    table: &'a TableName,
}

impl Schema<'_> {
    fn create(&self) -> String {
        let t = self.table.as_str();
        let unique = derived_name(self.table, "scope_key");
        let check = derived_name(self.table, "state_check");
        // Errors and notes are kept as bytes (UTF-8): they may hold a NUL,
        // which `text` refuses.
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                {SCOPED_ROW}
                method TEXT NOT NULL,
                url TEXT NOT NULL,
                headers TEXT NOT NULL,
                body BYTEA NOT NULL,
                attempts BIGINT NOT NULL,
                last_error BYTEA NOT NULL,
                state TEXT COLLATE \"C\" NOT NULL,
                redrives BIGINT NOT NULL DEFAULT 0,
                created_at_ms BIGINT NOT NULL,
                updated_at_ms BIGINT NOT NULL,
                redrive_until_ms BIGINT NULL,
                response_status INTEGER NULL,
                response_body BYTEA NULL,
                first_reached_at_ms BIGINT NULL,
                verdict TEXT NULL,
                verdict_by TEXT NULL,
                verdict_at_ms BIGINT NULL,
                verdict_note BYTEA NULL,
                key_horizon_ms BIGINT NULL,
                horizon_margin_ms BIGINT NULL,
                settle_ms BIGINT NULL,
                CONSTRAINT {unique} UNIQUE (tenant, operation, idem_key),
                CONSTRAINT {check} CHECK (state IN ('dead', 'redriving', 'resolved', 'unknown', 'cancelled'))
            )"
        )
    }

    fn index(&self) -> String {
        let t = self.table.as_str();
        let state = derived_name(self.table, "state_idx");
        // Listing by state, in id order; purging final letters.
        format!("CREATE INDEX IF NOT EXISTS {state} ON {t} (state, id)")
    }

    /// Version 2 from version 1: the new columns, and the state check (an
    /// unnamed one in version 1, whatever PostgreSQL called it) replaced by
    /// one that admits the new states.
    fn upgrade(&self) -> Vec<String> {
        let t = self.table.as_str();
        let check = derived_name(self.table, "state_check");
        vec![
            format!(
                "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS first_reached_at_ms BIGINT NULL, \
                 ADD COLUMN IF NOT EXISTS verdict TEXT NULL, ADD COLUMN IF NOT EXISTS verdict_by TEXT NULL, \
                 ADD COLUMN IF NOT EXISTS verdict_at_ms BIGINT NULL, ADD COLUMN IF NOT EXISTS verdict_note BYTEA NULL"
            ),
            format!(
                "DO $$ DECLARE c text; BEGIN FOR c IN SELECT conname FROM pg_constraint \
                 WHERE conrelid = '{t}'::regclass AND contype = 'c' LOOP \
                 EXECUTE format('ALTER TABLE {t} DROP CONSTRAINT %I', c); END LOOP; END $$"
            ),
            format!(
                "ALTER TABLE {t} ADD CONSTRAINT {check} \
                 CHECK (state IN ('dead', 'redriving', 'resolved', 'unknown', 'cancelled'))"
            ),
        ]
    }

    /// Version 3 from version 2: the terms the sends were made under.
    fn upgrade_terms(&self) -> String {
        let t = self.table.as_str();
        format!(
            "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS key_horizon_ms BIGINT NULL, \
             ADD COLUMN IF NOT EXISTS horizon_margin_ms BIGINT NULL, ADD COLUMN IF NOT EXISTS settle_ms BIGINT NULL"
        )
    }
}
