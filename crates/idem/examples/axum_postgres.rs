//! An axum service on PostgreSQL whose `POST /v1/payments` runs once per
//! idempotency key: the claim, the handler's insert and the recorded
//! response commit in one transaction.
//!
//! Run (PostgreSQL on 127.0.0.1:5432, database `test`):
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo run -p idem --features postgres,http --example axum_postgres
//! curl -i localhost:3000/v1/payments -H 'Authorization: Bearer t1' \
//!     -H 'Idempotency-Key: "pay-1"' -d '{"amount":500}'      # 201, the payment is inserted
//! # the same command again: the same 201, `idempotent-replayed: true`, nothing inserted
//! ```

use axum::{Router, http::StatusCode, http::request::Parts, routing::post};
use idem::http::{IdempotencyLayer, Problem, Tx};
use idem::postgres::PgStore;
use idem::{Tenant, TxEngine};

async fn pay(mut tx: Tx<PgStore>, body: String) -> Result<(StatusCode, String), StatusCode> {
    let id = uuid::Uuid::now_v7().to_string();
    sqlx::query("INSERT INTO example_payments (id, body) VALUES ($1, $2)")
        .bind(&id)
        .bind(&body)
        .execute(&mut **tx) // commits with the key and the recorded response, or not at all
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, format!("{{\"payment_id\":\"{id}\"}}")))
}

/// The tenant: a real service takes it from its authenticated principal.
fn tenant(parts: &Parts) -> Result<Tenant, Problem> {
    let auth = parts.headers.get("authorization").and_then(|v| v.to_str().ok());
    auth.and_then(|a| Tenant::new(a).ok())
        .ok_or_else(|| Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = sqlx::PgPool::connect(&url).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS example_payments (id TEXT PRIMARY KEY, body TEXT NOT NULL)")
        .execute(&pool)
        .await?;

    // The five lines that protect the service.
    let store = PgStore::new(pool);
    store.migrate().await?;
    let app = Router::new()
        .route("/v1/payments", post(pay))
        .route_layer(IdempotencyLayer::transactional(TxEngine::new(store), tenant));

    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    println!("listening on http://{addr}");
    axum::serve(tokio::net::TcpListener::bind(&addr).await?, app).await?;
    Ok(())
}
