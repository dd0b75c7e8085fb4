//! Which requests the layer treats as the same: exact JSON, ignoring only
//! spelling, and fingerprints recorded in the previous format.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use idem_core::{
    Acquire, Call, FingerprintBuilder, FingerprintVersion, IdempotencyKey, InFlight, LeaseEngine, Operation, Policy,
    Scope, Tenant,
};
use idem_http::{IdempotencyLayer, RoutePolicy};
use idem_memory::MemoryStore;
use support::{counted_post, tenant};
use tower::ServiceExt;

fn app(store: MemoryStore, runs: Arc<AtomicUsize>, strict: bool) -> Router {
    let mut layer = IdempotencyLayer::lease(LeaseEngine::new(store), tenant)
        .default_route(RoutePolicy::required().with_policy(Policy::default().with_in_flight(InFlight::Reject)));
    if strict {
        layer = layer.strict_fingerprints();
    }
    counted_post("/payouts", &runs, |n, body| async move {
        (StatusCode::CREATED, format!("run {n}: {body}"))
    })
    .layer(layer)
}

async fn post_json(app: &Router, key: &str, body: &str) -> (StatusCode, bool, String) {
    let req = Request::builder()
        .method("POST")
        .uri("/payouts")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    let replayed = res.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    let status = res.status();
    let bytes = http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap()
        .to_bytes();
    (status, replayed, String::from_utf8_lossy(&bytes).into_owned())
}

/// Two account ids that one `f64` cannot tell apart are two requests: the second is refused with 422, not replayed.
#[tokio::test]
async fn integers_past_double_precision_are_different_requests() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(MemoryStore::new(), runs.clone(), false);
    let first = post_json(&app, "k1", r#"{"account_id":9007199254740993}"#).await;
    assert_eq!(first.0, StatusCode::CREATED);
    let second = post_json(&app, "k1", r#"{"account_id":9007199254740992}"#).await;
    assert_eq!(
        second.0,
        StatusCode::UNPROCESSABLE_ENTITY,
        "replayed another request: {second:?}"
    );
    assert!(!second.1);
    let third = post_json(&app, "k2", r#"{"amount":0.3}"#).await;
    assert_eq!(third.0, StatusCode::CREATED);
    let fourth = post_json(&app, "k2", r#"{"amount":0.30000000000000001}"#).await;
    assert_eq!(fourth.0, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Whitespace, member order, escapes and number spelling do not make a different request: the retry is a replay.
#[tokio::test]
async fn spelling_differences_are_replays() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(MemoryStore::new(), runs.clone(), false);
    let first = post_json(&app, "k", r#"{"to":"A","amount":100,"meta":{"x":[1,2]}}"#).await;
    assert_eq!(first.0, StatusCode::CREATED);
    let again = post_json(
        &app,
        "k",
        "{ \"meta\" : { \"x\" : [ 1.0 , 2e0 ] },\n  \"amount\": 1e2, \"to\": \"\\u0041\" }",
    )
    .await;
    assert_eq!(again.0, StatusCode::CREATED);
    assert!(again.1, "not a replay: {again:?}");
    assert_eq!(first.2, again.2);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A key held under a fingerprint of the previous format is the same request (409 in flight), unless strict_fingerprints is set (422).
#[tokio::test]
async fn previous_format_is_accepted_unless_strict() {
    let body = r#"{"account_id":12,"amount":5}"#;
    let operation = Operation::new("POST /payouts").unwrap();
    let v1 = FingerprintBuilder::with_version(&operation, FingerprintVersion::V1)
        .field("path", "/payouts")
        .field("query", "")
        .json(body.as_bytes())
        .unwrap()
        .finish();
    for (strict, expected) in [(false, StatusCode::CONFLICT), (true, StatusCode::UNPROCESSABLE_ENTITY)] {
        let store = MemoryStore::new();
        let engine = LeaseEngine::new(store.clone());
        let scope = Scope::new(Tenant::new("t").unwrap(), operation.clone());
        let call = Call::new(scope, IdempotencyKey::new("old").unwrap(), v1);
        assert!(matches!(engine.acquire(&call).await.unwrap(), Acquire::Claimed(_)));
        let runs = Arc::new(AtomicUsize::new(0));
        let app = app(store, runs.clone(), strict);
        let retry = post_json(&app, "old", " {\"amount\": 5, \"account_id\": 12} ").await;
        assert_eq!(retry.0, expected, "strict = {strict}: {retry:?}");
        // Another body is another request in either case.
        let other = post_json(&app, "old", r#"{"account_id":12,"amount":6}"#).await;
        assert_eq!(other.0, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(runs.load(Ordering::SeqCst), 0);
    }
}
