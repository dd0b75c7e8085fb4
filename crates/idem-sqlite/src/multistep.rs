//! Multi-step operations on SQLite: one row per (tenant, operation, key),
//! written only over the version its writer read (see
//! [`idem_sql::SqlMultiSteps`]); a local step's write joins the caller's
//! [`SqliteTx`](crate::SqliteTx).

use idem_core::TableName;
use idem_sql::{MultiStepSchema, SqlMultiSteps};

use crate::dialect::{SCOPED_ROW, SqliteDialect};

pub use idem_sql::DEFAULT_MULTISTEP_TABLE;

/// Multi-step operations on SQLite.
pub type SqliteMultiSteps = SqlMultiSteps<SqliteDialect>;

impl MultiStepSchema for SqliteDialect {
    fn create_multisteps(table: &TableName) -> Vec<String> {
        let t = table.as_str();
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    {SCOPED_ROW}
                    state TEXT NOT NULL
                        CHECK (state IN ('running', 'held', 'compensating', 'completed', 'compensated')),
                    version INTEGER NOT NULL,
                    token INTEGER NOT NULL,
                    step INTEGER NOT NULL,
                    lease_until_ms INTEGER NULL,
                    not_before_ms INTEGER NULL,
                    updated_at_ms INTEGER NOT NULL,
                    expires_at_ms INTEGER NULL,
                    document BLOB NOT NULL,
                    UNIQUE (tenant, operation, idem_key)
                )"
            ),
            format!("CREATE INDEX IF NOT EXISTS {t}_due_idx ON {t} (state, updated_at_ms)"),
            format!("CREATE INDEX IF NOT EXISTS {t}_expiry_idx ON {t} (expires_at_ms) WHERE expires_at_ms IS NOT NULL"),
        ]
    }
}
