//! A service whose multi-step operations get stuck, for trying `idem ops`
//! on a SQLite file: withdrawals that debit an account (a local step),
//! check a limit, then pay out through a vendor (an external step).
//!
//! ```text
//! cargo run -p idem-cli -- migrate --store ./shop.db --operations
//! cargo run -p idem-cli --example stuck_operations -- ./shop.db start
//! cargo run -p idem-cli -- ops list --store ./shop.db
//! cargo run -p idem-cli --example stuck_operations -- ./shop.db complete
//! ```
//!
//! `start` runs two withdrawals: `w-1`, whose payout the vendor makes and
//! whose answer is lost (held on an unknown outcome), and `w-2`, over the
//! daily limit after its debit (held failed). `complete` runs the service's
//! completer once, and counts the debits, credits and payouts made so far.
//! The vendor is a table of the same file: a payout is a row.

use std::time::Duration;

use idem_core::{BoxFuture, Call, Fingerprint, IdempotencyKey, Scope};
use idem_sqlite::{SqliteMultiSteps, SqliteStore, SqliteTx};
use idem_steps::{Finished, Halt, Operation, Registry, Run, StepError, StepsEngine};

/// A withdrawal of an amount: debit, limit check, payout; a declared
/// failure or a cancellation credits the debit back.
struct Withdrawal {
    pool: sqlx::SqlitePool,
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

async fn count(pool: &sqlx::SqlitePool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .expect("count")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(path), Some(what)) = (args.next(), args.next()) else {
        return Err("usage: stuck_operations <sqlite file> start|complete".into());
    };
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&path)
        .busy_timeout(Duration::from_secs(5));
    let pool = sqlx::SqlitePool::connect_with(options).await?;
    for table in [
        "CREATE TABLE IF NOT EXISTS shop_movements (kind TEXT NOT NULL, amount INTEGER NOT NULL)",
        "CREATE TABLE IF NOT EXISTS vendor_payouts (step_key TEXT NOT NULL, amount INTEGER NOT NULL)",
    ] {
        sqlx::query(table).execute(&pool).await?;
    }
    let store = SqliteStore::new(pool.clone());
    // Operations live in `idem_operations` (`idem migrate --operations`).
    let engine = StepsEngine::new(store, SqliteMultiSteps::new(pool.clone())).with_lease_ms(120_000);
    let op = Withdrawal { pool: pool.clone() };
    match what.as_str() {
        "start" => {
            let scope = Scope::parse("acme", "POST /v1/withdrawals")?;
            for (key, amount) in [("w-1", 100_i64), ("w-2", 5_000)] {
                let call = Call::new(
                    scope.clone(),
                    IdempotencyKey::new(key)?,
                    Fingerprint::of_bytes(scope.operation(), amount.to_string().as_bytes()),
                );
                match engine.execute(&op, &call, &amount).await? {
                    Finished::Held(kind) => println!("{key}: held ({})", kind.as_str()),
                    other => println!("{key}: {other:?}"),
                }
            }
        }
        "complete" => {
            let registry = Registry::new().with(op);
            let pass = engine.complete_due(&registry, 64).await?;
            println!(
                "completer: {} completed, {} compensated, {} held",
                pass.completed, pass.compensated, pass.held
            );
        }
        other => return Err(format!("{other}: start or complete").into()),
    }
    println!(
        "debited {} time(s), credited {} time(s), paid {} time(s)",
        count(&pool, "SELECT COUNT(*) FROM shop_movements WHERE kind = 'debit'").await,
        count(&pool, "SELECT COUNT(*) FROM shop_movements WHERE kind = 'credit'").await,
        count(&pool, "SELECT COUNT(*) FROM vendor_payouts").await
    );
    Ok(())
}
