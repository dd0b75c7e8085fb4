//! A tiny API that is not idempotent at all, for the gateway demo:
//! `POST /v1/orders` creates a new order on every call.
//!
//! `cargo run -p idem-gateway --example counter` (listens on 127.0.0.1:9000,
//! or on the address in `COUNTER_LISTEN`)

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::{get, post};

#[tokio::main]
async fn main() {
    let orders = Arc::new(AtomicU64::new(0));
    let (created, counted) = (orders.clone(), orders.clone());
    let app = Router::new()
        .route(
            "/v1/orders",
            post(move |body: String| {
                let n = created.fetch_add(1, Ordering::SeqCst) + 1;
                async move { (StatusCode::CREATED, format!("{{\"order\":{n},\"request\":{body}}}\n")) }
            }),
        )
        .route(
            "/v1/orders/count",
            get(move || async move { format!("{{\"orders\":{}}}\n", counted.load(Ordering::SeqCst)) }),
        );
    let addr = std::env::var("COUNTER_LISTEN").unwrap_or_else(|_| "127.0.0.1:9000".into());
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .unwrap_or_else(|e| panic!("cannot listen on {addr}: {e}"));
    println!("counter upstream on http://{addr}");
    axum::serve(listener, app).await.unwrap();
}
