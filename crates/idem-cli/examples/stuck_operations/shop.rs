//! The shop of the `stuck_operations` example (and of `idem-cli`'s
//! `ops_completer` test, which runs it under the operator's commands): a
//! withdrawal debits an account (a local step), checks a limit, then pays
//! out through a vendor (an external step) whose answer is always lost.
//! The account's movements and the vendor's payouts are tables of the
//! same SQLite file.

use idem_core::{BoxFuture, Call, Fingerprint, IdempotencyKey, Scope};
use idem_sqlite::{SqliteStore, SqliteTx};
use idem_steps::{Halt, Operation, Run, StepError};

/// The shop's tables (the operations' own are `idem migrate --operations`).
pub(crate) async fn create_tables(pool: &sqlx::SqlitePool) -> Result<(), sqlx::Error> {
    for table in [
        "CREATE TABLE IF NOT EXISTS shop_movements (kind TEXT NOT NULL, amount INTEGER NOT NULL)",
        "CREATE TABLE IF NOT EXISTS vendor_payouts (step_key TEXT NOT NULL, amount INTEGER NOT NULL)",
    ] {
        sqlx::query(table).execute(pool).await?;
    }
    Ok(())
}

/// The call of the withdrawal `key` of `amount`.
pub(crate) fn withdrawal(scope: &Scope, key: &str, amount: i64) -> Result<Call, idem_core::Error> {
    Ok(Call::new(
        scope.clone(),
        IdempotencyKey::new(key)?,
        Fingerprint::of_bytes(scope.operation(), amount.to_string().as_bytes()),
    ))
}

/// A withdrawal of an amount: debit, limit check, payout; a declared
/// failure or a cancellation credits the debit back.
pub(crate) struct Withdrawal {
    /// The shop's file.
    pub(crate) pool: sqlx::SqlitePool,
}

/// Writes one account movement (`debit`, `credit`) in the step's
/// transaction.
fn movement(
    kind: &'static str,
    amount: i64,
) -> impl for<'c> FnMut(&'c mut SqliteTx) -> BoxFuture<'c, Result<(), StepError>> + Send {
    move |tx| {
        Box::pin(async move {
            sqlx::query("INSERT INTO shop_movements (kind, amount) VALUES (?, ?)")
                .bind(kind)
                .bind(amount)
                .execute(&mut **tx)
                .await
                .map_err(|e| StepError::Retry {
                    why: e.to_string(),
                    after_ms: 1_000,
                })?;
            Ok(())
        })
    }
}

impl Operation<SqliteStore> for Withdrawal {
    type Input = i64;
    type Output = String;
    const NAME: &'static str = "withdrawal@1";

    fn run<'r>(&'r self, run: &'r mut Run<'_, SqliteStore>, amount: &'r i64) -> BoxFuture<'r, Result<String, Halt>> {
        Box::pin(async move {
            let amount = *amount;
            run.local("debit", movement("debit", amount)).await?;
            run.local("limits", move |_tx| {
                Box::pin(async move {
                    if amount > 1_000 {
                        Err(StepError::Fatal("over the daily limit".into()))
                    } else {
                        Ok(())
                    }
                })
            })
            .await?;
            let pool = self.pool.clone();
            run.external("payout", move |sending| async move {
                // An operator's verdict carries the vendor's record of the
                // payout: the step's output, nothing sent.
                if let Some(verdict) = sending.verdict.as_ref().filter(|v| v.status.is_some()) {
                    let record: serde_json::Value =
                        serde_json::from_slice(&verdict.body).map_err(|e| StepError::Fatal(e.to_string()))?;
                    return record["id"]
                        .as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| StepError::Fatal(format!("a payout record without an id: {record}")));
                }
                sending
                    .may_send()
                    .map_err(|why| StepError::Retry { why, after_ms: 1_000 })?;
                // The vendor pays; its answer never arrives.
                sqlx::query("INSERT INTO vendor_payouts (step_key, amount) VALUES (?, ?)")
                    .bind(sending.key.as_str())
                    .bind(amount)
                    .execute(&pool)
                    .await
                    .map_err(|e| StepError::Retry {
                        why: e.to_string(),
                        after_ms: 1_000,
                    })?;
                Err(StepError::Unknown("the vendor's answer was lost".into()))
            })
            .await
        })
    }

    fn compensate<'r>(
        &'r self,
        run: &'r mut Run<'_, SqliteStore>,
        amount: &'r i64,
        _failure: &'r serde_json::Value,
    ) -> BoxFuture<'r, Result<(), Halt>> {
        Box::pin(async move {
            if run.forward::<()>("debit").is_some() {
                run.local("credit-back", movement("credit", *amount)).await?;
            }
            Ok(())
        })
    }
}

/// The count `sql` (a `SELECT COUNT(*)`) reads.
pub(crate) async fn count(pool: &sqlx::SqlitePool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .expect("count")
}
