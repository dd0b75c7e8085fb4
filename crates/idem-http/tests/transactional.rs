//! Transactional mode's own behaviours: handler re-runs on contention, and
//! which responses the record limit applies to.

mod support;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_conformance::CountingClaims;
use idem_core::{ContentionRetries, Tenant, TxEngine};
use idem_http::{IdempotencyLayer, Problem, RetryTransaction, Tx, slugs};
use idem_memory::MemoryStore;
use support::{Counters, failing_body};
use tower::ServiceExt;

/// The record limit of the test app.
const LIMIT: usize = 1024;

fn tenant(parts: &http::request::Parts) -> Result<Tenant, Problem> {
    Ok(Tenant::new(
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("t"),
    )
    .unwrap())
}

/// A transactional app whose one route writes (counted at commit in its
/// counters) and then answers what `respond` makes of the run number.
fn app(respond: fn(usize) -> Response) -> (Counters, Router) {
    let c = Counters::default();
    let layer = IdempotencyLayer::transactional(TxEngine::new(MemoryStore::new()), tenant).max_response_bytes(LIMIT);
    let handler = {
        let c = c.clone();
        move |mut tx: Tx<MemoryStore>| {
            let c = c.clone();
            async move { respond(c.run_in(&mut tx)) }
        }
    };
    (c, Router::new().route("/things", post(handler)).layer(layer))
}

/// A `status` response with a body three times the record limit.
fn over_the_limit(status: StatusCode) -> Response {
    (status, "n".repeat(3 * LIMIT)).into_response()
}

fn request(key: &str) -> Request<Body> {
    Request::post("/things")
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .unwrap()
}

async fn send(app: &Router, key: &str) -> (StatusCode, http::HeaderMap, Result<Bytes, String>) {
    let response = app.clone().oneshot(request(key)).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.map(|b| b.to_bytes()).map_err(|e| e.to_string());
    (parts.status, parts.headers, body)
}

fn problem_type(body: &Bytes) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).expect("a problem body");
    v["type"].as_str().unwrap_or_default().to_owned()
}

/// A handler whose statement lost a race asks for a re-run with `RetryTransaction`: it runs again in a new transaction, and only the second run's effect commits.
#[tokio::test]
async fn handler_asking_to_retry_runs_again_with_one_effect() {
    let (c, app) = app(|run| {
        if run == 1 {
            RetryTransaction.into_response()
        } else {
            (StatusCode::CREATED, format!("run {run}")).into_response()
        }
    });
    let (status, headers, body) = send(&app, "k1").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(body.unwrap(), "run 2");
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(c.run_count(), 2, "the handler ran again");
    assert_eq!(c.commit_count(), 1, "one effect committed");
    let (status, headers, body) = send(&app, "k1").await;
    assert_eq!((status, body.unwrap()), (StatusCode::CREATED, Bytes::from("run 2")));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(c.run_count(), 2);
}

/// A handler that asks for a re-run every time runs a bounded number of times; the client gets a retryable 503, and nothing is applied or recorded.
#[tokio::test]
async fn retry_requests_are_bounded() {
    let (c, app) = app(|_| {
        // The marker as a response part, on a response that would otherwise succeed.
        (StatusCode::CREATED, RetryTransaction, "lost a race").into_response()
    });
    let (status, headers, body) = send(&app, "k2").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "1");
    assert!(problem_type(&body.unwrap()).ends_with(slugs::TRANSACTION_CONFLICT));
    assert_eq!(c.run_count(), ContentionRetries::MAX_RUNS as usize);
    assert_eq!(c.commit_count(), 0, "nothing committed");
    let (status, ..) = send(&app, "k2").await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the key was left unused: it runs again"
    );
    assert_eq!(c.run_count(), 2 * ContentionRetries::MAX_RUNS as usize);
}

/// A 404 larger than the record limit is never recorded, so the limit does not apply: it passes through whole, not as a 500.
#[tokio::test]
async fn unrecorded_response_over_the_limit_passes_through() {
    let (c, app) = app(|_| over_the_limit(StatusCode::NOT_FOUND));
    let (status, headers, body) = send(&app, "k3").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body.unwrap().len(), 3 * LIMIT, "the whole body");
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(c.commit_count(), 0, "a 404 rolls back");
    let (status, ..) = send(&app, "k3").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(c.run_count(), 2, "the key stayed unused");
}

/// A response to be recorded over the limit is refused as too large, and nothing is applied.
#[tokio::test]
async fn recorded_response_over_the_limit_is_too_large() {
    let (c, app) = app(|_| over_the_limit(StatusCode::CREATED));
    let (status, _, body) = send(&app, "k4").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(problem_type(&body.unwrap()).ends_with(slugs::RESPONSE_TOO_LARGE));
    assert_eq!(c.commit_count(), 0);
}

/// A success whose body stream fails is reported as a failed response, not as too large, and nothing is applied.
#[tokio::test]
async fn failing_body_is_reported_as_failed() {
    let (c, app) = app(|_| {
        (
            StatusCode::CREATED,
            failing_body(b"{\"partial\":", "the upstream stream broke"),
        )
            .into_response()
    });
    let (status, _, body) = send(&app, "k5").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let body = body.unwrap();
    assert!(
        problem_type(&body).ends_with(slugs::RESPONSE_FAILED),
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert!(String::from_utf8_lossy(&body).contains("the upstream stream broke"));
    assert_eq!(c.commit_count(), 0, "nothing was applied");
    let (status, ..) = send(&app, "k5").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(c.run_count(), 2, "the key stayed unused");
}

/// On an engine that reads before it claims, a retry is answered from the
/// read: the layer replays the recorded response without opening a
/// transaction, refuses a different request under the key without one, and
/// serves the same key of another tenant as its own.
#[tokio::test]
async fn read_first_replays_without_a_transaction() {
    let backend = CountingClaims::new(MemoryStore::new());
    let engine = TxEngine::new(backend.clone()).with_read_first(true);
    let c = Counters::default();
    let handler = {
        let c = c.clone();
        move |mut tx: Tx<CountingClaims<MemoryStore>>| {
            let c = c.clone();
            async move { (StatusCode::CREATED, format!("run {}", c.run_in(&mut tx))) }
        }
    };
    let app = Router::new()
        .route("/things", post(handler))
        .layer(IdempotencyLayer::transactional(engine, tenant));
    let (status, headers, body) = send(&app, "rf").await;
    assert_eq!((status, body.unwrap()), (StatusCode::CREATED, Bytes::from("run 1")));
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(backend.opened(), 1, "a new key is claimed in a transaction");
    for _ in 0..2 {
        let (status, headers, body) = send(&app, "rf").await;
        assert_eq!((status, body.unwrap()), (StatusCode::CREATED, Bytes::from("run 1")));
        assert_eq!(headers["idempotent-replayed"], "true");
    }
    let other_body = Request::post("/things")
        .header("idempotency-key", "\"rf\"")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"other":1}"#))
        .unwrap();
    let response = app.clone().oneshot(other_body).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(backend.opened(), 1, "replays and mismatches open no transaction");
    let theirs = Request::post("/things")
        .header("idempotency-key", "\"rf\"")
        .header("x-tenant", "u")
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .unwrap();
    let response = app.clone().oneshot(theirs).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(!response.headers().contains_key("idempotent-replayed"));
    assert_eq!(backend.opened(), 2, "another tenant's key is its own");
    assert_eq!(c.run_count(), 2);
    assert_eq!(c.commit_count(), 2);
}
