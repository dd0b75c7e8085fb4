//! Multi-step operations on MySQL and MariaDB: one row per (tenant,
//! operation, key), whose binary columns compare byte for byte, written
//! only over the version its writer read (see
//! [`idem_sql::SqlMultiSteps`]); a local step's write joins the caller's
//! [`MySqlTx`](crate::MySqlTx).

use idem_core::TableName;
use idem_sql::{MultiStepSchema, SqlMultiSteps};

use crate::dialect::{MySqlDialect, SCOPED_ROW};

pub use idem_sql::DEFAULT_MULTISTEP_TABLE;

/// Multi-step operations on MySQL or MariaDB.
pub type MySqlMultiSteps = SqlMultiSteps<MySqlDialect>;

impl MultiStepSchema for MySqlDialect {
    fn create_multisteps(table: &TableName) -> Vec<String> {
        let t = table.as_str();
        // A document holds up to 256 steps' outputs: LONGBLOB.
        vec![format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                {SCOPED_ROW}
                state VARBINARY(16) NOT NULL,
                version BIGINT NOT NULL,
                token BIGINT NOT NULL,
                step BIGINT NOT NULL,
                lease_until_ms BIGINT NULL,
                not_before_ms BIGINT NULL,
                updated_at_ms BIGINT NOT NULL,
                expires_at_ms BIGINT NULL,
                document LONGBLOB NOT NULL,
                UNIQUE KEY scope_key (tenant, operation, idem_key),
                KEY due_idx (state, updated_at_ms),
                KEY expiry_idx (expires_at_ms),
                CHECK (state IN ('running', 'held', 'compensating', 'completed', 'compensated'))
            ) ENGINE=InnoDB"
        )]
    }
}
