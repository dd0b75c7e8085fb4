//! The ledger's tables, and the migration that creates them (with the idem
//! tables the ledger uses) and adds the columns newer than a database.

use super::dialect::sql_statements;

use super::Dialect;

impl Dialect {
    /// The ledger's tables and indexes, each created only if missing.
    pub(super) fn ddl(self) -> Vec<String> {
        let mut ddl: Vec<String> = [
            "CREATE TABLE IF NOT EXISTS ledger_accounts (tenant VARCHAR(80) NOT NULL, id VARCHAR(80) NOT NULL, \
             name VARCHAR(400) NOT NULL, balance BIGINT NOT NULL, created_at_ms BIGINT NOT NULL, \
             PRIMARY KEY (tenant, id))",
            "CREATE TABLE IF NOT EXISTS ledger_journal (tenant VARCHAR(80) NOT NULL, id VARCHAR(80) NOT NULL, \
             kind VARCHAR(20) NOT NULL, amount BIGINT NOT NULL, from_account VARCHAR(80) NULL, \
             to_account VARCHAR(80) NULL, created_at_ms BIGINT NOT NULL, PRIMARY KEY (tenant, id))",
            "CREATE TABLE IF NOT EXISTS ledger_entries (tenant VARCHAR(80) NOT NULL, journal_id VARCHAR(80) NOT NULL, \
             account_id VARCHAR(80) NOT NULL, delta BIGINT NOT NULL, PRIMARY KEY (tenant, journal_id, account_id))",

            // The statement projection, fed by the ledger's own events.
            "CREATE TABLE IF NOT EXISTS ledger_statements (tenant VARCHAR(80) NOT NULL, account_id VARCHAR(80) NOT NULL, \
             credits BIGINT NOT NULL, debits BIGINT NOT NULL, events BIGINT NOT NULL, PRIMARY KEY (tenant, account_id))",
            // One row per application of an event to the projection (no
            // unique key on purpose: the harness counts them).
            "CREATE TABLE IF NOT EXISTS ledger_projection_log (tenant VARCHAR(80) NOT NULL, event_id VARCHAR(80) NOT NULL, \
             occurred_at_ms BIGINT NOT NULL, applied_at_ms BIGINT NOT NULL)",
            // The balance snapshots job: one row per account per run.
            "CREATE TABLE IF NOT EXISTS ledger_balance_snapshots (run_id VARCHAR(100) NOT NULL, tenant VARCHAR(80) NOT NULL, \
             account_id VARCHAR(80) NOT NULL, balance BIGINT NOT NULL, taken_at_ms BIGINT NOT NULL)",
            // Payouts: debited at once (a `payout` journal row), then paid at
            // the vendor by the payout worker with the payout id as its key.
            "CREATE TABLE IF NOT EXISTS ledger_payouts (tenant VARCHAR(80) NOT NULL, id VARCHAR(80) NOT NULL, \
             account_id VARCHAR(80) NOT NULL, amount BIGINT NOT NULL, state VARCHAR(20) NOT NULL, \
             vendor_payout_id VARCHAR(200) NULL, attempts BIGINT NOT NULL, last_error TEXT NULL, \
             created_at_ms BIGINT NOT NULL, updated_at_ms BIGINT NOT NULL, first_sent_at_ms BIGINT NULL, \
             not_before_ms BIGINT NULL, PRIMARY KEY (tenant, id))",
            // Withdrawals: debited by the first step of `withdrawal@1`, then
            // paid or declined (the debit credited back) by its last ones.
            "CREATE TABLE IF NOT EXISTS ledger_withdrawals (tenant VARCHAR(80) NOT NULL, id VARCHAR(80) NOT NULL, \
             account_id VARCHAR(80) NOT NULL, amount BIGINT NOT NULL, currency VARCHAR(3) NOT NULL, \
             payout_currency VARCHAR(3) NOT NULL, destination VARCHAR(100) NOT NULL, state VARCHAR(20) NOT NULL, \
             quote_id VARCHAR(200) NULL, rate VARCHAR(40) NULL, amount_out BIGINT NULL, \
             vendor_payout_id VARCHAR(200) NULL, reason TEXT NULL, created_at_ms BIGINT NOT NULL, \
             updated_at_ms BIGINT NOT NULL, PRIMARY KEY (tenant, id))",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        for index in [
            "ledger_entries_account ON ledger_entries (tenant, account_id)",
            "ledger_projection_log_event ON ledger_projection_log (event_id)",
            "ledger_balance_snapshots_run ON ledger_balance_snapshots (run_id)",
            "ledger_payouts_state ON ledger_payouts (state, created_at_ms)",
        ] {
            ddl.push(match self {
                Dialect::MySql => format!("CREATE INDEX {index}"),
                _ => format!("CREATE INDEX IF NOT EXISTS {index}"),
            });
        }
        ddl
    }
}

sql_statements! {
    /// The statements of the migration.
    |dialect, p| {
        /// The names of the columns `ledger_payouts` has.
        payout_columns: p(match dialect {
            Dialect::Sqlite => "SELECT name FROM pragma_table_info('ledger_payouts')",
            Dialect::Postgres => {
                "SELECT column_name::text FROM information_schema.columns \
                 WHERE table_schema = current_schema() AND table_name = 'ledger_payouts'"
            }
            Dialect::MySql => {
                "SELECT CAST(column_name AS CHAR) FROM information_schema.columns \
                 WHERE table_schema = DATABASE() AND table_name = 'ledger_payouts'"
            }
        }),
    }
}

/// [`LedgerDb::migrate`](super::LedgerDb::migrate) for a store of
/// `$dialect`, whose migrators take the lock `$lock` (released by
/// `$unlock`), if any.
macro_rules! migrate_method {
    ($dialect:expr, $lock:expr, $unlock:expr) => {
        fn migrate(&self) -> BoxFuture<'_, Result<(), DbError>> {
            Box::pin(async move {
                self.migrate().await?;
                let mut conn = self.pool().acquire().await?;
                // Serialise concurrent migrators: CREATE ... IF NOT EXISTS races on some engines.
                if let Some(lock) = $lock {
                    sqlx::query(lock).execute(&mut *conn).await?;
                }
                let mut result: Result<(), DbError> = Ok(());
                for stmt in $dialect.ddl() {
                    if let Err(e) = sqlx::query(sqlx::AssertSqlSafe(stmt.clone()))
                        .execute(&mut *conn)
                        .await
                    {
                        // MySQL has no CREATE INDEX IF NOT EXISTS: a duplicate key name (1061) means done.
                        let duplicate_index = e
                            .as_database_error()
                            .and_then(|d| d.code())
                            .is_some_and(|c| c == "42000" || c == "1061");
                        if !(duplicate_index && stmt.starts_with("CREATE INDEX ledger_")) {
                            result = Err(e.into());
                            break;
                        }
                    }
                }
                if let Some(unlock) = $unlock {
                    sqlx::query(unlock).execute(&mut *conn).await?;
                }
                result?;
                // Older databases: the payout columns added since.
                let columns: Vec<String> = sqlx::query_scalar(queries().schema.payout_columns.clone())
                    .fetch_all(self.pool())
                    .await?;
                for (column, ty) in [
                    ("first_sent_at_ms", "BIGINT NULL"),
                    ("not_before_ms", "BIGINT NULL"),
                ] {
                    if !columns.iter().any(|c| c == column) {
                        let added = sqlx::query(sqlx::AssertSqlSafe(format!(
                            "ALTER TABLE ledger_payouts ADD COLUMN {column} {ty}"
                        )))
                        .execute(self.pool())
                        .await;
                        // Another process may have added it meanwhile.
                        if let Err(e) = added
                            && !e.to_string().to_ascii_lowercase().contains("duplicate")
                            && !e.to_string().to_ascii_lowercase().contains("already exists")
                        {
                            return Err(e.into());
                        }
                    }
                }
                for table in [
                    WEBHOOK_INBOX_TABLE,
                    PROJECTION_INBOX_TABLE,
                    JOB_RUNS_TABLE,
                    PAYOUT_LEASES_TABLE,
                ] {
                    self.keyed(TableName::new(table)?).migrate().await?;
                }
                self.outbox().migrate().await?;
                self.dead_letters().migrate().await?;
                self.multi_steps().migrate().await?;
                Ok(())
            })
        }
    };
}
pub(super) use migrate_method;
