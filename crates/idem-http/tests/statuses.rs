//! Which answers consume a key, in both modes: every 2xx and 3xx; a final
//! 4xx only when the policy records rejections; 408, 425, 429 and 5xx never.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::BodyExt;
use idem_core::{Consume, LeaseEngine, Policy, TxEngine};
use idem_http::{IdempotencyLayer, RoutePolicy, Tx};
use idem_memory::MemoryStore;
use support::{Counters, tenant};
use tower::ServiceExt;

/// The answer of status `status`, with a `Location` as a create's redirect has.
fn answer(status: u16, run: usize) -> Response {
    let status = StatusCode::from_u16(status).expect("a valid status");
    (status, [("location", format!("/orders/{run}"))], format!("run {run}")).into_response()
}

fn policy(record_rejections: bool) -> RoutePolicy {
    let consume = if record_rejections {
        Consume::SuccessOrFinalRejection
    } else {
        Consume::Success
    };
    RoutePolicy::required().with_policy(Policy::default().with_consume(consume))
}

/// `POST /orders/{status}` answers that status in transactional mode, its
/// write counted at commit.
fn transactional(c: &Counters, record_rejections: bool) -> Router {
    let layer = IdempotencyLayer::transactional(TxEngine::new(MemoryStore::new()), tenant)
        .default_route(policy(record_rejections));
    let c = c.clone();
    let handler = move |axum::extract::Path(status): axum::extract::Path<u16>, mut tx: Tx<MemoryStore>| {
        let c = c.clone();
        async move { answer(status, c.run_in(&mut tx)) }
    };
    Router::new()
        .route("/orders/{status}", post(handler))
        .route_layer(layer)
}

/// The same in lease mode (no transaction: runs only).
fn leased(c: &Counters, record_rejections: bool) -> Router {
    let layer =
        IdempotencyLayer::lease(LeaseEngine::new(MemoryStore::new()), tenant).default_route(policy(record_rejections));
    let c = c.clone();
    let handler = move |axum::extract::Path(status): axum::extract::Path<u16>| {
        let c = c.clone();
        async move { answer(status, c.runs.fetch_add(1, Ordering::SeqCst) + 1) }
    };
    Router::new()
        .route("/orders/{status}", post(handler))
        .route_layer(layer)
}

async fn send(app: &Router, status: u16, key: &str) -> (StatusCode, http::HeaderMap, String) {
    let req = Request::post(format!("/orders/{status}"))
        .header("idempotency-key", format!("\"{key}\""))
        .body(Body::from("{}"))
        .expect("a valid request");
    let response = app.clone().oneshot(req).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("a body").to_bytes();
    (parts.status, parts.headers, String::from_utf8_lossy(&body).into_owned())
}

/// Whether a key used once with `status` is consumed: the retry replays
/// instead of running the handler again.
async fn consumed(app: &Router, runs: &AtomicUsize, status: u16) -> bool {
    let key = format!("k-{status}");
    let before = runs.load(Ordering::SeqCst);
    let (first, headers, _) = send(app, status, &key).await;
    assert_eq!(first.as_u16(), status);
    assert!(!headers.contains_key("idempotent-replayed"));
    let (again, headers, body) = send(app, status, &key).await;
    assert_eq!(again.as_u16(), status, "{body}");
    let ran = runs.load(Ordering::SeqCst) - before;
    if headers.contains_key("idempotent-replayed") {
        assert_eq!(ran, 1, "a replayed key ran once");
        assert_eq!(body, format!("run {}", before + 1), "the first answer is replayed");
        true
    } else {
        assert_eq!(ran, 2, "an unused key runs again");
        false
    }
}

const STATUSES: [u16; 16] = [
    200, 201, 204, 301, 302, 303, 307, 308, 400, 404, 408, 422, 425, 429, 500, 503,
];

/// Asserts that a key used once with `status` is [`consumed`] as it should
/// be: after every 2xx and 3xx, after a final 4xx only when rejections are
/// recorded, never after 408, 425, 429 or a 5xx.
async fn assert_consumed_as_expected(app: &Router, runs: &AtomicUsize, status: u16, record_rejections: bool) {
    let expected = match status {
        200..=399 => true,
        408 | 425 | 429 => false,
        400..=499 => record_rejections,
        _ => false,
    };
    assert_eq!(
        consumed(app, runs, status).await,
        expected,
        "status {status}, record_rejections {record_rejections}"
    );
}

/// Lease mode: 2xx and 3xx consume the key; final 4xx only when rejections are recorded.
#[tokio::test]
async fn lease_mode_consumes_keys_on_2xx_and_3xx() {
    for record_rejections in [false, true] {
        let c = Counters::default();
        let app = leased(&c, record_rejections);
        for status in STATUSES {
            assert_consumed_as_expected(&app, &c.runs, status, record_rejections).await;
        }
    }
}

/// Transactional mode: a 303 after a create commits its writes with the key, like any 2xx.
#[tokio::test]
async fn transactional_mode_commits_2xx_and_3xx() {
    for record_rejections in [false, true] {
        let c = Counters::default();
        let app = transactional(&c, record_rejections);
        for status in STATUSES {
            let committed = c.commit_count();
            assert_consumed_as_expected(&app, &c.runs, status, record_rejections).await;
            // Only an answer that consumes the key as a success commits the
            // handler's writes; a recorded rejection keeps the key, not the writes.
            let writes = c.commit_count() - committed;
            assert_eq!(writes, usize::from(status < 400), "status {status}: writes committed");
        }
    }
}

/// A 303's `Location` is recorded and replayed with it.
#[tokio::test]
async fn a_303_replays_its_location() {
    let c = Counters::default();
    let app = transactional(&c, false);
    let (_, first, _) = send(&app, 303, "see-other").await;
    let (status, again, _) = send(&app, 303, "see-other").await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(again["idempotent-replayed"], "true");
    assert_eq!(again["location"], first["location"]);
    assert_eq!(c.commit_count(), 1);
}

/// Without a key (an optional route), transactional writes commit on a 3xx as on a 2xx.
#[tokio::test]
async fn an_unkeyed_303_commits_its_writes() {
    let c = Counters::default();
    let layer = IdempotencyLayer::transactional(TxEngine::new(MemoryStore::new()), tenant)
        .default_route(RoutePolicy::optional());
    let counters = c.clone();
    let handler = move |mut tx: Tx<MemoryStore>| {
        let c = counters.clone();
        async move {
            let committed = c.committed.clone();
            tx.on_commit(move || {
                committed.fetch_add(1, Ordering::SeqCst);
            });
            answer(303, 1)
        }
    };
    let app = Router::new().route("/orders", post(handler)).route_layer(layer);
    let response = app
        .oneshot(
            Request::post("/orders")
                .body(Body::from("{}"))
                .expect("a valid request"),
        )
        .await
        .expect("infallible");
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(c.commit_count(), 1, "the writes committed");
}
