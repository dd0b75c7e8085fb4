//! The statement projection, fed by the ledger's own events, and the
//! balance snapshots of the scheduled job.

use super::dialect::sql_statements;

use super::Dialect;

/// One account's change in the statement projection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatementChange {
    /// The account.
    pub account_id: String,
    /// Added to its credits.
    pub credit: i64,
    /// Added to its debits.
    pub debit: i64,
}

/// An account's statement, as the projection holds it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Statement {
    /// The account.
    pub account_id: String,
    /// The sum of money in.
    pub credits: i64,
    /// The sum of money out.
    pub debits: i64,
    /// credits − debits.
    pub balance: i64,
    /// Events applied to this account.
    pub events: i64,
}

sql_statements! {
    /// The statements of the projection and the snapshots.
    |dialect, p| {
        upsert_statement: p(match dialect {
            Dialect::MySql => {
                "INSERT INTO ledger_statements (tenant, account_id, credits, debits, events) VALUES (?, ?, ?, ?, 1) \
                 ON DUPLICATE KEY UPDATE credits = credits + VALUES(credits), debits = debits + VALUES(debits), \
                 events = events + 1"
            }
            _ => {
                "INSERT INTO ledger_statements (tenant, account_id, credits, debits, events) VALUES (?, ?, ?, ?, 1) \
                 ON CONFLICT (tenant, account_id) DO UPDATE SET credits = ledger_statements.credits + excluded.credits, \
                 debits = ledger_statements.debits + excluded.debits, events = ledger_statements.events + 1"
            }
        }),
        insert_projection_log: p(
            "INSERT INTO ledger_projection_log (tenant, event_id, occurred_at_ms, applied_at_ms) VALUES (?, ?, ?, ?)",
        ),
        select_statement: p(
            "SELECT credits, debits, events FROM ledger_statements WHERE tenant = ? AND account_id = ?",
        ),
        snapshot_balances: p(
            "INSERT INTO ledger_balance_snapshots (run_id, tenant, account_id, balance, taken_at_ms) \
             SELECT ?, tenant, id, balance, ? FROM ledger_accounts",
        ),
    }
}

/// The [`LedgerDb`](super::LedgerDb) methods of the projection and the
/// snapshots, for `$store`.
macro_rules! statement_methods {
    ($store:ty) => {
        fn statement<'a>(
            &'a self,
            tenant: &'a str,
            account_id: &'a str,
        ) -> BoxFuture<'a, Result<Option<Statement>, DbError>> {
            Box::pin(async move {
                let row: Option<(i64, i64, i64)> = row_by_id(
                    self.pool(),
                    &queries().statements.select_statement,
                    tenant,
                    account_id,
                )
                .await?;
                Ok(row.map(|(credits, debits, events)| Statement {
                    account_id: account_id.to_owned(),
                    credits,
                    debits,
                    balance: credits - debits,
                    events,
                }))
            })
        }
    };
}
pub(super) use statement_methods;

/// The [`LedgerTx`](super::LedgerTx) methods of statements, for a transaction
/// of the engine whose `queries` and money functions are in scope.
macro_rules! statement_tx_methods {
    () => {
        fn apply_statement<'c>(
            &'c mut self,
            tenant: &'c str,
            event_id: &'c str,
            changes: &'c [StatementChange],
            occurred_at_ms: i64,
            now_ms: i64,
        ) -> BoxFuture<'c, Result<(), DbError>> {
            Box::pin(async move {
                let q = &queries().statements;
                // A fixed order of rows, so two projections of opposite
                // transfers cannot deadlock each other.
                let mut changes: Vec<&StatementChange> = changes.iter().collect();
                changes.sort_by(|a, b| a.account_id.cmp(&b.account_id));
                for c in changes {
                    sqlx::query(q.upsert_statement.clone())
                        .bind(tenant)
                        .bind(&c.account_id)
                        .bind(c.credit)
                        .bind(c.debit)
                        .execute(&mut **self)
                        .await?;
                }
                sqlx::query(q.insert_projection_log.clone())
                    .bind(tenant)
                    .bind(event_id)
                    .bind(occurred_at_ms)
                    .bind(now_ms)
                    .execute(&mut **self)
                    .await?;
                Ok(())
            })
        }

        fn snapshot_balances<'c>(&'c mut self, run_id: &'c str, now_ms: i64) -> BoxFuture<'c, Result<u64, DbError>> {
            Box::pin(async move {
                let done = sqlx::query(queries().statements.snapshot_balances.clone())
                    .bind(run_id)
                    .bind(now_ms)
                    .execute(&mut **self)
                    .await?;
                Ok(done.rows_affected())
            })
        }
    };
}
pub(super) use statement_tx_methods;
