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

mod shop;

use std::time::Duration;

use idem_core::Scope;
use idem_sqlite::{SqliteMultiSteps, SqliteStore};
use idem_steps::{Finished, Registry, StepsEngine};
use shop::{Withdrawal, count, create_tables, withdrawal};

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
    create_tables(&pool).await?;
    let store = SqliteStore::new(pool.clone());
    // Operations live in `idem_operations` (`idem migrate --operations`).
    let engine = StepsEngine::new(store, SqliteMultiSteps::new(pool.clone())).with_lease_ms(120_000);
    let op = Withdrawal { pool: pool.clone() };
    match what.as_str() {
        "start" => {
            let scope = Scope::parse("acme", "POST /v1/withdrawals")?;
            for (key, amount) in [("w-1", 100_i64), ("w-2", 5_000)] {
                let call = withdrawal(&scope, key, amount)?;
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
