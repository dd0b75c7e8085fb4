//! Which response headers a replay carries: private headers reach the first
//! caller only, and hop-by-hop headers (with those `Connection` names) are
//! never recorded, in both modes.

mod support;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderName, Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use idem_core::{LeaseEngine, TxEngine};
use idem_http::{IdempotencyLayer, Leased, Tx};
use idem_memory::MemoryStore;
use support::tenant;
use tower::ServiceExt;

fn private() -> [HeaderName; 2] {
    [
        HeaderName::from_static("set-cookie"),
        HeaderName::from_static("x-session-token"),
    ]
}

fn answer() -> axum::response::Response {
    (
        StatusCode::CREATED,
        [
            ("set-cookie", "session=alice; HttpOnly"),
            ("x-session-token", "secret-of-alice"),
            ("x-order", "o_1"),
            ("connection", "x-hop"),
            ("x-hop", "1"),
            ("proxy-authenticate", "Basic realm=\"upstream\""),
        ],
        "created",
    )
        .into_response()
}

async fn send(app: &Router) -> http::HeaderMap {
    let req = Request::post("/orders")
        .header("idempotency-key", "\"k\"")
        .body(Body::from("{}"))
        .expect("a valid request");
    let response = app.clone().oneshot(req).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::CREATED);
    response.headers().clone()
}

async fn check(app: Router) {
    let first = send(&app).await;
    assert_eq!(
        first["set-cookie"], "session=alice; HttpOnly",
        "the first caller gets its cookie"
    );
    assert_eq!(first["x-session-token"], "secret-of-alice");
    let replay = send(&app).await;
    assert_eq!(replay["idempotent-replayed"], "true");
    assert_eq!(replay["x-order"], "o_1", "end-to-end headers are replayed");
    for name in [
        "set-cookie",
        "x-session-token",
        "x-hop",
        "connection",
        "proxy-authenticate",
    ] {
        assert!(!replay.contains_key(name), "a replay carries no {name}: {replay:?}");
    }
}

/// A lease-mode layer that keeps [`private`] headers from replays.
fn lease_layer() -> IdempotencyLayer<Leased<MemoryStore>> {
    IdempotencyLayer::lease(LeaseEngine::new(MemoryStore::new()), tenant).private_headers(private())
}

/// `POST /orders` answering [`answer`] behind `layer`.
fn leased(layer: IdempotencyLayer<Leased<MemoryStore>>) -> Router {
    Router::new()
        .route("/orders", post(|| async { answer() }))
        .route_layer(layer)
}

/// Lease mode: a replay carries neither private nor hop-by-hop headers.
#[tokio::test]
async fn lease_mode_replays_no_private_header() {
    check(leased(lease_layer())).await;
}

/// Lease mode with streamed responses: the same.
#[tokio::test]
async fn streamed_lease_mode_replays_no_private_header() {
    check(leased(
        lease_layer().stream_responses(std::time::Duration::from_secs(5)),
    ))
    .await;
}

/// Transactional mode: the same.
#[tokio::test]
async fn transactional_mode_replays_no_private_header() {
    let layer = IdempotencyLayer::transactional(TxEngine::new(MemoryStore::new()), tenant).private_headers(private());
    let handler = |_tx: Tx<MemoryStore>| async { answer() };
    check(Router::new().route("/orders", post(handler)).route_layer(layer)).await;
}
