//! Multi-step operations on PostgreSQL: one row per (tenant, operation,
//! key), written only over the version its writer read (see
//! [`idem_sql::SqlMultiSteps`]); a local step's write joins the caller's
//! [`PgTx`](crate::PgTx).

use idem_core::TableName;
use idem_sql::{MultiStepSchema, SqlMultiSteps};

use crate::dialect::{PgDialect, SCOPED_ROW};
use crate::sql::derived_name;

pub use idem_sql::DEFAULT_MULTISTEP_TABLE;

/// Multi-step operations on PostgreSQL.
pub type PgMultiSteps = SqlMultiSteps<PgDialect>;

impl MultiStepSchema for PgDialect {
    fn create_multisteps(table: &TableName) -> Vec<String> {
        let t = table.as_str();
        let unique = derived_name(table, "scope_key");
        let check = derived_name(table, "state_check");
        let due = derived_name(table, "due_idx");
        let expiry = derived_name(table, "expiry_idx");
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    {SCOPED_ROW}
                    state TEXT COLLATE \"C\" NOT NULL,
                    version BIGINT NOT NULL,
                    token BIGINT NOT NULL,
                    step BIGINT NOT NULL,
                    lease_until_ms BIGINT NULL,
                    not_before_ms BIGINT NULL,
                    updated_at_ms BIGINT NOT NULL,
                    expires_at_ms BIGINT NULL,
                    document BYTEA NOT NULL,
                    CONSTRAINT {unique} UNIQUE (tenant, operation, idem_key),
                    CONSTRAINT {check} CHECK (state IN ('running', 'held', 'compensating', 'completed', 'compensated'))
                )"
            ),
            // The due scan and the operator's listing by state and age.
            format!("CREATE INDEX IF NOT EXISTS {due} ON {t} (state, updated_at_ms)"),
            format!("CREATE INDEX IF NOT EXISTS {expiry} ON {t} (expires_at_ms) WHERE expires_at_ms IS NOT NULL"),
        ]
    }
}
