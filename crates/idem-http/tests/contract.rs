//! The Idempotency-Key HTTP contract, point by point, on the in-memory store
//! in both modes. (The ledger's tests repeat it on PostgreSQL, MariaDB and SQLite.)

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use http_body_util::BodyExt;
use idem_core::{Consume, InFlight, LeaseEngine, Policy, Tenant, TxEngine};
use idem_http::{IdempotencyLayer, Problem, RoutePolicy, Tx};
use idem_memory::MemoryStore;
use support::{Counters, counted_post};
use tower::ServiceExt;

fn tenant(parts: &http::request::Parts) -> Result<Tenant, Problem> {
    parts
        .headers
        .get("x-tenant")
        .and_then(|v| v.to_str().ok())
        .and_then(|t| Tenant::new(t).ok())
        .ok_or_else(|| Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized"))
}

/// A transactional app: `/things` creates (status from the body's "status" field), `/slow` waits.
fn tx_app(store: MemoryStore, c: Counters, gate: Arc<tokio::sync::Notify>) -> Router {
    let engine = TxEngine::new(store);
    let layer = IdempotencyLayer::transactional(engine, tenant)
        .route("POST /optional", RoutePolicy::optional())
        .route(
            "POST /reject-twins",
            RoutePolicy::required().with_policy(Policy::default().with_in_flight(InFlight::Reject)),
        )
        .route(
            "POST /final",
            RoutePolicy::required().with_policy(Policy::default().with_consume(Consume::SuccessOrFinalRejection)),
        )
        .max_request_bytes(1024)
        .max_response_bytes(4096);
    let handler = move |mut tx: Tx<MemoryStore>, body: String| {
        let c = c.clone();
        async move {
            c.run_in(&mut tx);
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let status = v.get("status").and_then(|s| s.as_u64()).unwrap_or(201) as u16;
            let size = v.get("size").and_then(|s| s.as_u64()).unwrap_or(0) as usize;
            let run = c.run_count();
            let mut headers = HeaderMap::new();
            headers.insert("x-run", run.into());
            headers.insert("connection", "keep-alive".parse().unwrap());
            let body = format!("{{\"run\":{run},\"pad\":\"{}\"}}", "x".repeat(size));
            (StatusCode::from_u16(status).unwrap(), headers, body).into_response()
        }
    };
    let slow = {
        let gate = gate.clone();
        move |_tx: Tx<MemoryStore>| {
            let gate = gate.clone();
            async move {
                gate.notified().await;
                (StatusCode::CREATED, "slow done")
            }
        }
    };
    Router::new()
        .route("/things", post(handler.clone()))
        .route(
            "/things/{id}",
            post(handler.clone()).get(|Path(id): Path<String>| async move { id }),
        )
        .route("/optional", post(handler.clone()))
        .route("/final", post(handler))
        .route("/slow", post(slow.clone()))
        .route("/reject-twins", post(slow))
        .layer(layer)
}

fn req(method: &str, uri: &str, tenant: &str, key: Option<&str>, body: &str) -> Request<Body> {
    let mut b = Request::builder()
        .method(method)
        .uri(uri)
        .header("x-tenant", tenant)
        .header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Body::from(body.to_owned())).unwrap()
}

struct Resp {
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Resp {
    fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").is_some_and(|v| v == "true")
    }
    fn problem_type(&self) -> String {
        assert_eq!(self.headers["content-type"], "application/problem+json");
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(v["status"], self.status.as_u16());
        assert!(v["title"].is_string() && v["detail"].is_string());
        v["type"].as_str().unwrap().to_owned()
    }
}

async fn send(app: &Router, r: Request<Body>) -> Resp {
    let res = app.clone().oneshot(r).await.unwrap();
    let (parts, body) = res.into_parts();
    Resp {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes().to_vec(),
    }
}

fn setup() -> (Router, Counters, Arc<tokio::sync::Notify>) {
    let c = Counters::default();
    let gate = Arc::new(tokio::sync::Notify::new());
    (tx_app(MemoryStore::new(), c.clone(), gate.clone()), c, gate)
}

/// A missing key on a required route is a 400 problem, and nothing runs.
#[tokio::test]
async fn missing_key_is_400_and_runs_nothing() {
    let (app, c, _) = setup();
    let r = send(&app, req("POST", "/things", "t1", None, "{}")).await;
    assert_eq!(r.status, 400);
    assert!(r.problem_type().ends_with("/idempotency-key-missing"));
    assert_eq!(c.run_count(), 0);
}

/// Malformed keys are 400 problems: empty, too long, two headers, broken sf-strings, spaces.
#[tokio::test]
async fn malformed_keys_are_400() {
    let (app, c, _) = setup();
    for bad in [
        "\"\"",
        &format!("\"{}\"", "k".repeat(256)),
        "\"open",
        "two words",
        "\"caf\u{e9}\"",
    ] {
        let mut r = Request::builder().method("POST").uri("/things").header("x-tenant", "t");
        r = r.header(
            "idempotency-key",
            http::HeaderValue::from_bytes(bad.as_bytes()).unwrap(),
        );
        let r = send(&app, r.body(Body::from("{}")).unwrap()).await;
        assert_eq!(r.status, 400, "{bad:?}");
        assert!(r.problem_type().ends_with("/idempotency-key-invalid"), "{bad:?}");
    }
    let two = Request::builder()
        .method("POST")
        .uri("/things")
        .header("x-tenant", "t")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(send(&app, two).await.status, 400);
    assert_eq!(c.run_count(), 0);
}

/// First call executes unmarked; a retry replays status, end-to-end headers and the byte-identical body, marked.
#[tokio::test]
async fn replay_is_byte_identical_and_marked() {
    let (app, c, _) = setup();
    let first = send(
        &app,
        req("POST", "/things", "t", Some("\"k1\""), r#"{"a":1,"b":[1,2]}"#),
    )
    .await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed(), "a first response never says it was replayed");
    for body in [r#"{"a":1,"b":[1,2]}"#, "{ \"b\": [1, 2], \"a\": 1 }"] {
        let again = send(&app, req("POST", "/things", "t", Some("k1"), body)).await;
        assert_eq!(again.status, 201);
        assert!(again.replayed());
        assert_eq!(again.body, first.body, "byte-identical body");
        assert_eq!(again.headers["x-run"], first.headers["x-run"]);
        assert!(
            again.headers.get("connection").is_none(),
            "hop-by-hop headers are not replayed"
        );
    }
    assert_eq!(c.run_count(), 1);
    assert_eq!(c.commit_count(), 1);
}

/// The same key with a different body, or another resource under the same route, is a 422 problem.
#[tokio::test]
async fn reuse_with_different_request_is_422() {
    let (app, c, _) = setup();
    send(&app, req("POST", "/things/1", "t", Some("k"), r#"{"a":1}"#)).await;
    let r = send(&app, req("POST", "/things/1", "t", Some("k"), r#"{"a":2}"#)).await;
    assert_eq!(r.status, 422);
    assert!(r.problem_type().ends_with("/idempotency-key-reused"));
    let r = send(&app, req("POST", "/things/2", "t", Some("k"), r#"{"a":1}"#)).await;
    assert_eq!(r.status, 422, "same template, other resource: a different request");
    assert_eq!(c.run_count(), 1);
}

/// GET needs no key; an optional route without a key runs every time.
#[tokio::test]
async fn safe_methods_and_optional_routes() {
    let (app, c, _) = setup();
    assert_eq!(send(&app, req("GET", "/things/7", "t", None, "")).await.status, 200);
    for _ in 0..2 {
        let r = send(&app, req("POST", "/optional", "t", None, "{}")).await;
        assert_eq!(r.status, 201);
        assert!(!r.replayed());
    }
    assert_eq!(c.run_count(), 2);
    assert_eq!(c.commit_count(), 2, "unkeyed writes commit on success");
}

/// A twin of a running request gets 409 with Retry-After under a rejecting policy, and replays after a wait otherwise.
#[tokio::test]
async fn in_flight_twins() {
    let (app, _, gate) = setup();
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, req("POST", "/reject-twins", "t", Some("k"), "{}")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let twin = send(&app, req("POST", "/reject-twins", "t", Some("k"), "{}")).await;
    assert_eq!(twin.status, 409);
    assert!(twin.problem_type().ends_with("/idempotency-key-in-flight"));
    assert!(twin.headers["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
    gate.notify_waiters();
    assert_eq!(first.await.unwrap().status, 201);

    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, req("POST", "/slow", "t", Some("k2"), "{}")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiting = tokio::spawn({
        let app = app.clone();
        async move { send(&app, req("POST", "/slow", "t", Some("k2"), "{}")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "the twin waits for the first");
    gate.notify_waiters();
    let (a, b) = (first.await.unwrap(), waiting.await.unwrap());
    assert!(!a.replayed() && b.replayed());
    assert_eq!(a.body, b.body);
}

/// A body over the limit is 413 before anything is claimed: the key stays usable.
#[tokio::test]
async fn oversized_body_is_413_and_claims_nothing() {
    let (app, c, _) = setup();
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(2000));
    let r = send(&app, req("POST", "/things", "t", Some("k"), &big)).await;
    assert_eq!(r.status, 413);
    assert!(r.problem_type().ends_with("/request-body-too-large"));
    assert_eq!(
        r.headers["connection"], "close",
        "the unread body makes the connection unusable"
    );
    assert_eq!(c.run_count(), 0);
    let r = send(&app, req("POST", "/things", "t", Some("k"), "{}")).await;
    assert_eq!(r.status, 201, "the key was never claimed");
}

/// The same key from two tenants is two keys: B never receives A's response.
#[tokio::test]
async fn tenants_are_isolated() {
    let (app, c, _) = setup();
    let a = send(&app, req("POST", "/things", "alice", Some("shared"), "{}")).await;
    let b = send(&app, req("POST", "/things", "bob", Some("shared"), "{}")).await;
    assert!(!a.replayed() && !b.replayed());
    assert_ne!(a.body, b.body);
    let b2 = send(&app, req("POST", "/things", "bob", Some("shared"), "{}")).await;
    assert_eq!(b2.body, b.body);
    assert_eq!(c.run_count(), 2);
}

/// 4xx and 5xx do not consume a key by default; a final 4xx does under a recording policy; 5xx never.
#[tokio::test]
async fn which_statuses_consume_a_key() {
    let (app, c, _) = setup();
    for (uri, status, consumed) in [
        ("/things", 422, false),
        ("/things", 503, false),
        ("/final", 422, true),
        ("/final", 500, false),
        ("/final", 429, false),
    ] {
        let key = format!("\"{uri}-{status}\"");
        let body = format!("{{\"status\":{status}}}");
        let before = c.run_count();
        let first = send(&app, req("POST", uri, "t", Some(&key), &body)).await;
        assert_eq!(first.status, status);
        let again = send(&app, req("POST", uri, "t", Some(&key), &body)).await;
        assert_eq!(again.replayed(), consumed, "{uri} {status}");
        assert_eq!(c.run_count() - before, if consumed { 1 } else { 2 }, "{uri} {status}");
    }
    assert_eq!(c.commit_count(), 0, "no 4xx or 5xx response commits its writes");
}

/// A response over the record limit rolls the work back (transactional) and leaves the key usable.
#[tokio::test]
async fn oversized_response_rolls_back_in_transactional_mode() {
    let (app, c, _) = setup();
    let r = send(&app, req("POST", "/things", "t", Some("big"), r#"{"size":10000}"#)).await;
    assert_eq!(r.status, 500);
    assert!(r.problem_type().ends_with("/idempotency-response-too-large"));
    assert_eq!(c.commit_count(), 0, "the effect was rolled back");
    let r = send(&app, req("POST", "/things", "t", Some("big"), r#"{"size":10000}"#)).await;
    assert!(!r.replayed(), "the key was left unused");
}

fn lease_app(store: MemoryStore, runs: Arc<AtomicUsize>) -> Router {
    let layer = IdempotencyLayer::lease(LeaseEngine::new(store), tenant).max_response_bytes(4096);
    counted_post("/send", &runs, |n, body| async move {
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let status = v.get("status").and_then(|s| s.as_u64()).unwrap_or(202) as u16;
        let size = v.get("size").and_then(|s| s.as_u64()).unwrap_or(0) as usize;
        (
            StatusCode::from_u16(status).unwrap(),
            format!("sent {n} {}", "y".repeat(size)),
        )
    })
    .route("/read", get(|| async { "ok" }))
    .layer(layer)
}

/// Lease mode: claim, run, record, replay; mismatch; a failure releases the key; an oversized response is replayed as a problem naming the original status.
#[tokio::test]
async fn lease_mode_contract() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = lease_app(MemoryStore::new(), runs.clone());
    let first = send(&app, req("POST", "/send", "t", Some("m1"), r#"{"to":"a"}"#)).await;
    let again = send(&app, req("POST", "/send", "t", Some("m1"), r#"{"to":"a"}"#)).await;
    assert_eq!(
        (first.status, again.status),
        (StatusCode::ACCEPTED, StatusCode::ACCEPTED)
    );
    assert!(!first.replayed() && again.replayed());
    assert_eq!(first.body, again.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let other = send(&app, req("POST", "/send", "t", Some("m1"), r#"{"to":"b"}"#)).await;
    assert_eq!(other.status, 422);
    let failed = send(&app, req("POST", "/send", "t", Some("m2"), r#"{"status":502}"#)).await;
    assert_eq!(failed.status, 502);
    let retried = send(&app, req("POST", "/send", "t", Some("m2"), r#"{"status":502}"#)).await;
    assert!(!retried.replayed(), "a 5xx released the key");
    let big = send(&app, req("POST", "/send", "t", Some("m3"), r#"{"size":9000}"#)).await;
    assert_eq!(big.status, 202);
    assert!(big.body.len() > 9000, "the first caller gets the whole response");
    let big_again = send(&app, req("POST", "/send", "t", Some("m3"), r#"{"size":9000}"#)).await;
    assert_eq!(big_again.status, 500);
    assert!(big_again.replayed());
    assert!(String::from_utf8_lossy(&big_again.body).contains("status 202"));
    assert_eq!(runs.load(Ordering::SeqCst), 4, "the oversized effect did not run twice");
}

/// A tenant extractor's refusal is the response, and nothing is claimed.
#[tokio::test]
async fn tenant_refusal_is_the_response() {
    let (app, c, _) = setup();
    let r = Request::builder()
        .method("POST")
        .uri("/things")
        .header("idempotency-key", "k")
        .body(Body::from("{}"))
        .unwrap();
    let r = send(&app, r).await;
    assert_eq!(r.status, 401);
    assert_eq!(c.run_count(), 0);
}
