//! The client side: a caller that dies mid-call resumes its operation with
//! the same idempotency key, so the server applies it once.
//!
//! Run (self-contained: an in-process idem-protected server on a free port,
//! the client's pending operations in a SQLite file):
//!
//! ```sh
//! cargo run -p idem --features client-sqlite,http,memory --example client_resume
//! #   the first client died mid-call; 1 operation(s) pending
//! #   resumed key=…: 201 (replayed: false)
//! #   the server applied it 1 time(s)
//! ```
//!
//! Here the dropped connection rolled the server's transaction back, so the
//! resumed send applies the operation (`replayed: false`); had the server
//! committed before the client died, the resumed send would get the
//! recorded answer (`replayed: true`). Either way it is applied once.
//!
//! `crates/idem-client/tests/ledger.rs` does the same with a client process
//! killed by `kill -9`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::{Router, http::StatusCode, routing::post};
use idem::client::{Client, Operation, PendingStore, SqlitePending};
use idem::http::{IdempotencyLayer, Problem, Tx};
use idem::memory::MemoryStore;
use idem::{Tenant, TxEngine};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The server: a slow handler whose effect is counted when it commits.
    let applied = Arc::new(AtomicU32::new(0));
    let counter = applied.clone();
    let handler = move |mut tx: Tx<MemoryStore>| {
        let counter = counter.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            tx.on_commit(move || {
                counter.fetch_add(1, Ordering::SeqCst);
            });
            (StatusCode::CREATED, "{\"paid\":true}")
        }
    };
    let layer = IdempotencyLayer::transactional(TxEngine::new(MemoryStore::new()), |_| {
        Tenant::new("example").map_err(|_| Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized"))
    });
    let app = Router::new().route("/v1/payments", post(handler)).route_layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/v1/payments", listener.local_addr()?);
    tokio::spawn(axum::serve(listener, app).into_future());

    let pending = std::env::temp_dir().join(format!("idem-example-pending-{}.db", std::process::id()));
    let op = Operation::post(&url)
        .json(&serde_json::json!({ "amount": 500 }))
        .build()?;

    // A client saves the operation before its first byte is sent, then dies
    // while the server is still working on it.
    let first = Client::builder().store(SqlitePending::open(&pending).await?).build()?;
    let call = tokio::spawn(async move { first.send(&op).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    call.abort();
    let _ = call.await;
    tokio::time::sleep(Duration::from_millis(400)).await; // the server finishes meanwhile
    let store = SqlitePending::open(&pending).await?;
    println!(
        "the first client died mid-call; {} operation(s) pending",
        store.list().await?.len()
    );

    // A restarted client resumes it with the same key: the server replays.
    let restarted = Client::builder().store(store).build()?;
    for resumed in restarted.resume().await? {
        let answer = resumed.result?;
        println!(
            "resumed key={}: {} (replayed: {})",
            resumed.operation.key(),
            answer.status().as_u16(),
            answer.replayed()
        );
    }
    println!("the server applied it {} time(s)", applied.load(Ordering::SeqCst));
    let _ = std::fs::remove_file(&pending);
    Ok(())
}
