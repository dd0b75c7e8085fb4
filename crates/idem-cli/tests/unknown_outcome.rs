//! `idem gateway` as a process in front of an upstream that applies a
//! request and then fails: it answers 500, or drops the connection. With
//! `on_unknown_outcome = "hold"` (the default) the key is held as an unknown
//! outcome: retries get a 409 `idempotency-outcome-unknown` problem and the
//! upstream is called once, until `idem keys resolve` says what happened
//! (then retries replay the operator's answer, or reach the upstream once
//! more). With `release` the retry reaches the upstream again. On SQLite,
//! PostgreSQL and Redis.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::{MethodRouter, post};
use support::{
    Answer, Gateway, gateway_config, idem_json, keys_command, listed_tenant_and_state, post_keyed, postgres_url,
    redis_url, start_gateway,
};

fn temp(name: &str) -> String {
    support::temp("unknown", name)
}

/// What the upstream applied, per route.
#[derive(Clone, Default)]
struct Applied {
    fail: Arc<AtomicUsize>,
    drop: Arc<AtomicUsize>,
    released: Arc<AtomicUsize>,
}

/// The upstream: every route applies the request (counts it), then
/// `/v1/fail` and `/v1/released` answer 500 and `/v1/drop` drops the
/// connection without an answer, on their first call; later calls answer 201.
async fn upstream() -> (String, Applied) {
    let applied = Applied::default();
    let a = applied.clone();
    let app = Router::new()
        .route("/v1/fail", fails_first(a.fail.clone(), "fail"))
        .route("/v1/released", fails_first(a.released.clone(), "released"))
        .route(
            "/v1/drop",
            post({
                let c = a.drop.clone();
                move |_body: String| async move {
                    let n = c.fetch_add(1, Ordering::SeqCst) + 1;
                    if n == 1 {
                        // The request was applied; the connection's task
                        // ends without an answer, closing the socket.
                        panic!("applied, then the connection drops");
                    }
                    (StatusCode::CREATED, format!("drop call {n}"))
                }
            }),
        );
    (support::serve(app).await, applied)
}

/// A route that applies the request (counts it in `calls`), then answers
/// 500 on its first call and 201 `{name} call {n}` on the n-th.
fn fails_first(calls: Arc<AtomicUsize>, name: &'static str) -> MethodRouter {
    post(move || async move {
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        if n == 1 {
            (StatusCode::INTERNAL_SERVER_ERROR, "applied, then failed".to_owned())
        } else {
            (StatusCode::CREATED, format!("{name} call {n}"))
        }
    })
}

const ROUTES: &str = r#"
[[routes]]
method = "POST"
path = "/v1/fail"

[[routes]]
method = "POST"
path = "/v1/drop"

[[routes]]
method = "POST"
path = "/v1/released"
on_unknown_outcome = "release"
"#;

async fn start(upstream: &str, store: &str) -> (Gateway, String) {
    start_gateway(upstream, store, &gateway_config(ROUTES)).await
}

async fn send(base: &str, path: &str, token: &str, key: &str) -> Answer {
    post_keyed(base, path, token, key).await.expect("the gateway answers")
}

/// The retries of a held key: a 409 problem each, naming the key and how
/// to resolve it; the upstream is not called.
async fn assert_held(base: &str, path: &str, token: &str, key: &str, calls: &AtomicUsize) {
    for _ in 0..3 {
        let a = send(base, path, token, key).await;
        assert_eq!(a.status, 409, "{path}: {}", a.body);
        assert_eq!(a.content_type, "application/problem+json");
        let problem: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("/idempotency-outcome-unknown"),
            "{problem}"
        );
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains("idem keys resolve") && detail.contains(key), "{detail}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "{path}: the upstream was called once");
}

/// The tenant the gateway scoped `key` of `operation` by, as `idem keys
/// list` shows it, with the key's state there.
fn listed(store: &str, key: &str, operation: &str) -> (String, String) {
    listed_tenant_and_state(store, key, &["--operation", operation])
}

async fn hold_and_resolve(store: &str) {
    let (up, applied) = upstream().await;
    let (_g, base) = start(&up, store).await;
    let token = uuid::Uuid::now_v7().to_string();

    // Applied, then 500: held; the operator records the answer; retries replay it.
    let key = uuid::Uuid::now_v7().to_string();
    let first = send(&base, "/v1/fail", &token, &key).await;
    assert_eq!((first.status, first.body.as_str()), (500, "applied, then failed"));
    assert_held(&base, "/v1/fail", &token, &key, &applied.fail).await;
    let (tenant, state) = listed(store, &key, "POST /v1/fail");
    assert_eq!(state, "unknown");
    let (code, shown) = idem_json(&keys_command("show", store, &tenant, "POST /v1/fail", &key, &[]));
    assert_eq!((code, shown["state"].as_str()), (0, Some("unknown")), "{shown}");
    // Bad input changes nothing: a 5xx is no answer, a key not held is refused.
    let resolve = |key: &str, verdict: &[&str]| {
        idem_json(&keys_command("resolve", store, &tenant, "POST /v1/fail", key, verdict))
    };
    let (code, e) = resolve(&key, &["--applied", "--status", "500"]);
    assert_eq!(code, 2, "{e}");
    let (code, e) = resolve("never-used", &["--not-applied"]);
    assert_eq!(code, 1, "{e}");
    assert!(e["error"].as_str().unwrap().contains("no unknown outcome"), "{e}");
    assert_held(&base, "/v1/fail", &token, &key, &applied.fail).await;
    let body = temp("answer.json");
    std::fs::write(&body, r#"{"id":"pay_1","status":"paid"}"#).unwrap();
    let (code, done) = resolve(&key, &["--applied", "--status", "201", "--body", &body]);
    assert_eq!((code, done["resolved"].as_str()), (0, Some("applied")), "{done}");
    for _ in 0..2 {
        let a = send(&base, "/v1/fail", &token, &key).await;
        assert_eq!((a.status, a.body.as_str()), (201, r#"{"id":"pay_1","status":"paid"}"#));
        assert!(a.replayed);
        assert_eq!(a.content_type, "application/json");
    }
    assert_eq!(applied.fail.load(Ordering::SeqCst), 1, "one upstream call in all");
    // Resolved once: a second resolution is refused and changes nothing.
    let (code, _) = resolve(&key, &["--not-applied"]);
    assert_eq!(code, 1);
    assert!(send(&base, "/v1/fail", &token, &key).await.replayed);

    // Applied, then the connection drops: held; the operator says it was
    // not applied; the next retry reaches the upstream, once.
    let key = uuid::Uuid::now_v7().to_string();
    let first = send(&base, "/v1/drop", &token, &key).await;
    assert_eq!(first.status, 502, "{}", first.body);
    assert_eq!(first.content_type, "application/problem+json");
    assert_held(&base, "/v1/drop", &token, &key, &applied.drop).await;
    let (tenant, state) = listed(store, &key, "POST /v1/drop");
    assert_eq!(state, "unknown");
    let (code, done) = idem_json(&keys_command(
        "resolve",
        store,
        &tenant,
        "POST /v1/drop",
        &key,
        &["--not-applied"],
    ));
    assert_eq!((code, done["resolved"].as_str()), (0, Some("not_applied")), "{done}");
    let a = send(&base, "/v1/drop", &token, &key).await;
    assert_eq!((a.status, a.body.as_str(), a.replayed), (201, "drop call 2", false));
    let a = send(&base, "/v1/drop", &token, &key).await;
    assert_eq!((a.status, a.body.as_str(), a.replayed), (201, "drop call 2", true));
    assert_eq!(applied.drop.load(Ordering::SeqCst), 2);

    // `release`: the retry reaches the upstream again (for an upstream that
    // deduplicates by the forwarded key itself).
    let key = uuid::Uuid::now_v7().to_string();
    assert_eq!(send(&base, "/v1/released", &token, &key).await.status, 500);
    let a = send(&base, "/v1/released", &token, &key).await;
    assert_eq!((a.status, a.body.as_str(), a.replayed), (201, "released call 2", false));
    assert_eq!(applied.released.load(Ordering::SeqCst), 2);
}

idem_conformance::cases!(hold_and_resolve, 2 => {
    hold_turns_apply_then_fail_into_one_call_on_sqlite(&temp("keys.db"));
    hold_turns_apply_then_fail_into_one_call_on_postgres(&postgres_url());
    hold_turns_apply_then_fail_into_one_call_on_redis(&redis_url());
});
