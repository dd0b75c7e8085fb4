//! A payment that must not happen twice, on an embedded SQLite file.
//!
//! Run: `cargo run -p idem --features sqlite --example exactly_once`
//!
//! The same logical request is sent three times with one idempotency key (as
//! a client would after lost responses): the payment row is written once, and
//! the retries replay the first receipt. The same key with a different body
//! is refused.

use idem::sqlite::SqliteStore;
use idem::{Call, Error, Fingerprint, IdempotencyKey, Scope, TxEngine};

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Receipt {
    payment_id: String,
    amount: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join(format!("idem-example-{}.db", std::process::id()));
    let store = SqliteStore::open(&path).await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS payments (id TEXT PRIMARY KEY, amount INTEGER NOT NULL)")
        .execute(store.pool())
        .await?;
    let engine = TxEngine::new(store.clone());

    let scope = Scope::parse("merchant-42", "POST /v1/payments")?;
    let key = IdempotencyKey::generate(); // the client makes one key per logical operation
    let body = br#"{"amount": 1500}"#;

    for attempt in 1..=3 {
        let call = Call::new(
            scope.clone(),
            key.clone(),
            Fingerprint::of_json(scope.operation(), body)?,
        );
        let outcome = engine
            .execute(&call, |tx| {
                Box::pin(async move {
                    let id = uuid_like();
                    sqlx::query("INSERT INTO payments (id, amount) VALUES (?, ?)")
                        .bind(&id)
                        .bind(1500_i64)
                        .execute(&mut **tx)
                        .await
                        .map_err(idem::sqlite::store_error)?;
                    Ok::<_, Error>(Receipt {
                        payment_id: id,
                        amount: 1500,
                    })
                })
            })
            .await?;
        let how = if outcome.is_replayed() { "replayed" } else { "executed" };
        println!("attempt {attempt}: {how} {:?}", outcome.value());
    }

    let other = Call::new(
        scope.clone(),
        key,
        Fingerprint::of_json(scope.operation(), br#"{"amount": 9999}"#)?,
    );
    let refused = engine
        .execute(&other, |_tx| Box::pin(async { Ok::<_, Error>(0) }))
        .await;
    println!("same key, different body: {}", refused.unwrap_err());

    let (rows,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM payments")
        .fetch_one(store.pool())
        .await?;
    println!("payment rows: {rows}");
    assert_eq!(rows, 1, "the payment happened exactly once");

    store.pool().close().await;
    for suffix in ["", "-wal", "-shm", "-idem.lock"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok(())
}

/// A unique payment id (the example keeps its dependencies to a minimum).
fn uuid_like() -> String {
    IdempotencyKey::generate().as_str().to_owned()
}
