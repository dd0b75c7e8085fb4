//! The HTTP layer of **idem**: the IETF "Idempotency-Key HTTP Header Field"
//! contract as a tower [`Layer`](tower_layer::Layer), for axum and any tower
//! HTTP service.
//!
//! The guide, with examples: `docs/http.md` in the repository.
//!
//! - A mutating request (POST, PATCH, PUT, DELETE) carries
//!   `Idempotency-Key: "…"` (an RFC 9651 sf-string; a bare token is also
//!   accepted, and parameters are ignored; see [`parse_key_header`]). The first request with a key claims it, runs, and records its
//!   response; a retry replays the recorded status, headers and
//!   byte-identical body with `Idempotent-Replayed: true`.
//! - Errors are RFC 9457 `application/problem+json`: `idempotency-key-missing`
//!   (400), `idempotency-key-invalid` (400), `idempotency-key-reused` (422),
//!   `idempotency-key-in-flight` (409 with `Retry-After`),
//!   `request-body-too-large` (413, before anything is claimed),
//!   `request-body-timeout` (408: the body's read failed with a `TimedOut`
//!   I/O error, as a server's read timeout reports it; nothing claimed); in
//!   transactional mode also `idempotency-response-too-large` (500, a
//!   response to be recorded over the record limit),
//!   `idempotency-response-failed` (500, its body stream failed) and
//!   `idempotency-transaction-conflict` (503 with `Retry-After`, contention
//!   outlasted the bounded re-runs; see [`RetryTransaction`]).
//! - Scope = (tenant from your extractor, method + route template). Apply
//!   the layer with `Router::route_layer` on each router, after its routes.
//!   A request that reaches the layer with no matched route (the layer wraps
//!   the whole app, or `Router::layer` also wraps the fallback) is still
//!   protected, as `"<METHOD> (unrouted)"` with the concrete path in the
//!   fingerprint, and the layer logs one error saying how to wire it.
//! - A replay carries the recorded headers minus hop-by-hop ones
//!   ([`HOP_BY_HOP`], and those `Connection` names) and minus the private
//!   ones ([`IdempotencyLayer::private_headers`]), which reach the first
//!   caller only and are never stored.
//! - Metric labels are bounded: operations are named from [`method_label`]
//!   (nine standard methods or `OTHER`) and the route template.
//! - A 2xx or 3xx answer consumes a key (in transactional mode its writes
//!   commit: a `303 See Other` after a create is a success); a final 4xx
//!   only if the route's policy says so; 408, 425, 429 and 5xx never.
//!
//! Two modes: [`IdempotencyLayer::transactional`] lends the claim's open
//! database transaction to the handler through the [`Tx`] extractor, so the
//! handler's writes, the claim and the recorded response commit together;
//! [`IdempotencyLayer::lease`] is for handlers whose effects are outside the
//! database.
//!
//! ```no_run
//! use axum::{Router, routing::post, http::StatusCode};
//! use idem_core::{Tenant, TxEngine};
//! use idem_http::{IdempotencyLayer, Problem, Tx};
//! use idem_memory::{MemoryStore, MemoryTx};
//!
//! async fn create(mut tx: Tx<MemoryStore>, body: String) -> (StatusCode, String) {
//!     // Writes through `tx` commit with the key and the recorded response.
//!     let tx: &mut MemoryTx = &mut tx;
//!     tx.on_commit(|| println!("created once"));
//!     (StatusCode::CREATED, body)
//! }
//!
//! # async fn run() {
//! let layer = IdempotencyLayer::transactional(TxEngine::new(MemoryStore::new()), |parts| {
//!     // A real service takes the tenant from its authenticated principal.
//!     let auth = parts.headers.get("authorization").and_then(|v| v.to_str().ok());
//!     auth.and_then(|t| Tenant::new(t).ok()).ok_or_else(|| {
//!         Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized")
//!     })
//! });
//! let app: Router = Router::new().route("/v1/things", post(create)).route_layer(layer);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await.unwrap();
//! axum::serve(listener, app).await.unwrap();
//! # }
//! ```

mod body;
mod drain;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod future;
mod headers;
mod key;
mod layer;
mod lease;
mod lease_mode;
mod problem;
mod reconcile;
mod recorded;
mod retry;
mod service;
#[cfg(feature = "steps")]
pub mod steps;
mod stream;
mod tx;
mod tx_mode;

pub use future::ResponseFuture;
pub use headers::{HOP_BY_HOP, is_hop_by_hop, strip_hop_by_hop};
pub use key::{IDEMPOTENCY_KEY, KeyHeader, MAX_HEADER_BYTES, parse_key_header};
pub use layer::{
    IdempotencyLayer, KeyRequirement, Leased, OperationFn, RoutePolicy, TenantFn, Transactional, UNROUTED,
    matched_route_operation, method_label,
};
pub use lease::{HeldLease, HeldLeaseRejection, OutcomeUnknown};
pub use problem::{DEFAULT_PROBLEM_BASE, PROBLEM_JSON, Problem, slugs};
pub use reconcile::{DEFAULT_SETTLE, Reconcile, Reconciled};
pub use recorded::RecordedResponse;
pub use retry::RetryTransaction;
pub use service::{ByteBody, Idempotency, InnerService, Mode};
pub use tx::{Tx, TxCell, TxRejection};

/// The header that marks a replayed response.
pub static IDEMPOTENT_REPLAYED: http::HeaderName = http::HeaderName::from_static("idempotent-replayed");
