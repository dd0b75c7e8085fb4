//! **idem**: exactly-once effects for Rust services.
//!
//! ```text
//! at-least-once delivery + idempotent handler = exactly-once effect
//! ```
//!
//! An idempotency key's claim, your business writes and the recorded outcome
//! commit together; a retry with the same key replays the outcome and does
//! not run again. See the repository's README for the HTTP contract and the
//! reference service.
//!
//! ```
//! # #[cfg(feature = "memory")] {
//! use idem::{Call, Fingerprint, IdempotencyKey, Scope, TxEngine};
//! use idem::memory::MemoryStore;
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let engine = TxEngine::new(MemoryStore::new());
//! let scope = Scope::parse("tenant-1", "POST /v1/payouts")?;
//! let fp = Fingerprint::of_json(scope.operation(), br#"{"amount":500}"#)?;
//! let call = Call::new(scope, IdempotencyKey::generate(), fp);
//! let paid = engine.execute(&call, |tx| Box::pin(async move {
//!     tx.on_commit(|| println!("paid once"));
//!     Ok::<_, idem::Error>("payout-1".to_string())
//! })).await?;
//! let again = engine.execute(&call, |_| Box::pin(async { Ok::<_, idem::Error>("never".to_string()) })).await?;
//! assert_eq!(again.into_inner(), paid.into_inner());
//! # Ok::<(), idem::Error>(()) }).unwrap();
//! # }
//! ```
//!
//! | feature | what it adds |
//! |---|---|
//! | `memory` | `memory::MemoryStore` |
//! | `postgres` | `postgres::PgStore` (PostgreSQL, CockroachDB, YugabyteDB) |
//! | `mysql` | `mysql::MySqlStore` (MySQL, MariaDB) |
//! | `sqlite` | `sqlite::SqliteStore` |
//! | `http` | `http::IdempotencyLayer`, the tower/axum layer, transactional and lease mode |
//! | `redis` | `redis::RedisStore` (Redis and Redis Cluster, lease mode) |
//! | `inbox` | `inbox::Inbox`: an event handler applied once per (handler, event id) |
//! | `steps` | `steps::StepsEngine`: multi-step operations (local and external steps, compensation) resumed from their recovery points |
//! | `webhooks` | `webhooks::Verifier` and `webhooks::WebhookInbox` (Standard Webhooks, Svix) |
//! | `outbox` | `outbox::Relay`: the transactional outbox, published at least once |
//! | `jetstream` | `jetstream::JetStreamPublisher` and `jetstream::InboxConsumer` (NATS JetStream) |
//! | `jobs` | `jobs::Scheduler`: scheduled jobs run once per slot |
//! | `outbound` | `outbound::OutboundClient`, `outbound::Reconcile`, `outbound::Redriver`: calls to vendors |
//! | `client` | `client::Client`, `client::Key`, `client::MemoryPending`: the caller's side |
//! | `client-sqlite` | `client::SqlitePending`: pending operations that survive a crash |
//! | `gateway` | `gateway::Gateway`: the reverse proxy of `idem gateway`, as a library |
//! | `tls` | TLS for the crates enabled above that connect (https, sqlx's `sslmode`/`ssl-mode`, `rediss://`) |
//! | `full` | all of the above |
//!
//! Nothing is on by default: `idem = { version = "0.1", features = ["postgres", "http"] }`
//! is a typical axum service on PostgreSQL.

pub use idem_core::*;

/// The in-memory store.
#[cfg(feature = "memory")]
pub mod memory {
    pub use idem_memory::*;
}

/// The PostgreSQL store.
#[cfg(feature = "postgres")]
pub mod postgres {
    pub use idem_postgres::*;
}

/// The MySQL/MariaDB store.
#[cfg(feature = "mysql")]
pub mod mysql {
    pub use idem_mysql::*;
}

/// The SQLite store.
#[cfg(feature = "sqlite")]
pub mod sqlite {
    pub use idem_sqlite::*;
}

/// The HTTP layer.
#[cfg(feature = "http")]
pub mod http {
    pub use idem_http::*;
}

/// Multi-step operations resumed from their recovery points.
#[cfg(feature = "steps")]
pub mod steps {
    pub use idem_steps::*;
}

/// The inbox for event consumers and webhooks.
#[cfg(feature = "inbox")]
pub mod inbox {
    pub use idem_inbox::*;
}

/// Standard Webhooks verification.
#[cfg(feature = "webhooks")]
pub mod webhooks {
    pub use idem_webhooks::*;
}

/// The transactional outbox relay.
#[cfg(feature = "outbox")]
pub mod outbox {
    pub use idem_outbox::*;
}

/// NATS JetStream: the relay's publisher and the inbox consumer.
#[cfg(feature = "jetstream")]
pub mod jetstream {
    pub use idem_jetstream::*;
}

/// Scheduled jobs with run ids.
#[cfg(feature = "jobs")]
pub mod jobs {
    pub use idem_jobs::*;
}

/// The Redis and Redis Cluster lease store.
#[cfg(feature = "redis")]
pub mod redis {
    pub use idem_redis::*;
}

/// Outbound calls: one idempotency key per logical call, retries, the circuit
/// breaker, reconcile before re-send, and dead letters.
#[cfg(feature = "outbound")]
pub mod outbound {
    pub use idem_outbound::*;
}

/// The client side: idempotency keys, a retrying client that keeps one key
/// per logical operation, and pending operations resumed after a crash.
#[cfg(feature = "client")]
pub mod client {
    pub use idem_client::*;
}

/// The gateway as a library: a reverse proxy that gives any HTTP API the
/// Idempotency-Key contract in lease mode.
#[cfg(feature = "gateway")]
pub mod gateway {
    pub use idem_gateway::*;
}
