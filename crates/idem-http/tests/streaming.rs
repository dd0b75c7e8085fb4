//! Lease mode with `stream_responses`: the first caller gets the response as
//! the handler produces it, while it is recorded.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_core::{InFlight, LeaseEngine, Policy};
use idem_http::{IdempotencyLayer, RoutePolicy};
use idem_memory::MemoryStore;
use support::{counted_pay, failing_body, post_with_key, send, tenant};
use tokio::sync::Semaphore;
use tower::ServiceExt;

const LIMIT: usize = 1024;

/// `POST /pay` behind a streaming lease-mode layer, and the count of its
/// runs.
fn app<F>(limit: usize, stall: Duration, policy: Policy, handler: F) -> (Arc<AtomicUsize>, Router)
where
    F: Fn() -> Response + Clone + Send + Sync + 'static,
{
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::lease(LeaseEngine::new(MemoryStore::new()), tenant)
        .default_route(RoutePolicy::required().with_policy(policy))
        .max_response_bytes(limit)
        .stream_responses(stall);
    let app = counted_pay(&runs, move |_| {
        let handler = handler.clone();
        async move { handler() }
    })
    .route_layer(layer);
    (runs, app)
}

/// [`app`] with the test record limit, a ten-second stall and the default
/// policy.
fn limited_app<F>(handler: F) -> (Arc<AtomicUsize>, Router)
where
    F: Fn() -> Response + Clone + Send + Sync + 'static,
{
    app(LIMIT, Duration::from_secs(10), Policy::default(), handler)
}

/// [`app`] under `policy` answering 201 "paid " at once and "once" when a
/// permit of the gate it returns is added.
fn gated_app(policy: Policy) -> (Arc<AtomicUsize>, Arc<Semaphore>, Router) {
    let gate = Arc::new(Semaphore::new(0));
    let handler_gate = gate.clone();
    let (runs, app) = app(LIMIT, Duration::from_secs(10), policy, move || {
        (StatusCode::CREATED, gated_body("paid ", "once", handler_gate.clone())).into_response()
    });
    (runs, gate, app)
}

/// A body that yields `first`, then waits for a permit of `gate` before
/// `rest`.
fn gated_body(first: &'static str, rest: &'static str, gate: Arc<Semaphore>) -> Body {
    let stream = futures_util::stream::unfold(0u8, move |step| {
        let gate = gate.clone();
        async move {
            match step {
                0 => Some((Ok::<_, std::io::Error>(Bytes::from_static(first.as_bytes())), 1)),
                1 => {
                    gate.acquire().await.expect("gate open").forget();
                    Some((Ok(Bytes::from_static(rest.as_bytes())), 2))
                }
                _ => None,
            }
        }
    });
    Body::from_stream(stream)
}

/// `POST /pay` answering `n` small numbered chunks at once, with a 1 MiB
/// record limit, `stall` and a twin waiting up to `wait_ms`; and the whole
/// body it answers.
fn numbered_app(n: u32, stall: Duration, wait_ms: u64) -> (Arc<AtomicUsize>, Router, String) {
    let (runs, app) = app(
        1 << 20,
        stall,
        Policy::default().with_in_flight(InFlight::Wait { max_ms: wait_ms }),
        move || {
            let chunks = (0..n).map(|i| Ok::<_, std::io::Error>(Bytes::from(format!("{i:05}"))));
            (
                StatusCode::CREATED,
                Body::from_stream(futures_util::stream::iter(chunks)),
            )
                .into_response()
        },
    );
    (runs, app, (0..n).map(|i| format!("{i:05}")).collect())
}

/// Sends `key` to `app` and reads none of the answer; a twin meanwhile
/// replays `expected` whole. The unread answer.
async fn unread_while_a_twin_replays(app: &Router, key: &str, expected: &str) -> Response {
    let stalled = app.clone().oneshot(post_with_key(key)).await.expect("infallible");
    let twin = send(app, post_with_key(key)).await;
    assert_eq!(twin, (StatusCode::CREATED, true, Bytes::from(expected.to_owned())));
    stalled
}

/// A retry of `key` replays the 500 problem `slug` recorded in place of a
/// 201 that took effect.
async fn replays_stand_in(app: &Router, key: &str, slug: &str) {
    let (status, replayed, again) = send(app, post_with_key(key)).await;
    assert_eq!((status, replayed), (StatusCode::INTERNAL_SERVER_ERROR, true));
    let text = String::from_utf8_lossy(&again);
    assert!(text.contains(slug) && text.contains("status 201"), "{text}");
}

/// The status and the first chunk reach the caller while the handler's body
/// is still being produced; a twin meanwhile is told the key is in flight;
/// once the caller has read the whole body, the key replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_first_caller_reads_the_response_as_it_is_produced() {
    let (runs, gate, app) = gated_app(Policy::default().with_in_flight(InFlight::Reject));
    let response = tokio::time::timeout(Duration::from_secs(10), app.clone().oneshot(post_with_key("k")))
        .await
        .expect("the head arrives before the body is finished")
        .expect("infallible");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(!response.headers().contains_key("idempotent-replayed"));
    let mut body = response.into_body();
    let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("the first chunk arrives before the body is finished")
        .expect("a frame")
        .expect("data");
    assert_eq!(frame.into_data().expect("data"), Bytes::from_static(b"paid "));

    let (status, replayed, _) = send(&app, post_with_key("k")).await;
    assert_eq!(
        (status, replayed),
        (StatusCode::CONFLICT, false),
        "a twin while it streams"
    );

    gate.add_permits(1);
    let rest = body.collect().await.expect("the rest").to_bytes();
    assert_eq!(rest, Bytes::from_static(b"once"));
    // The body ended only once the outcome was recorded.
    let again = send(&app, post_with_key("k")).await;
    assert_eq!(again, (StatusCode::CREATED, true, Bytes::from_static(b"paid once")));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A first caller that goes away mid-stream: the body is still read to its
/// end and recorded, and the retry replays all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_caller_gone_mid_stream_leaves_the_whole_response_recorded() {
    let (runs, gate, app) = gated_app(Policy::default().with_in_flight(InFlight::Wait { max_ms: 10_000 }));
    let response = app.clone().oneshot(post_with_key("gone")).await.expect("infallible");
    let mut body = response.into_body();
    let first = body.frame().await.expect("a frame").expect("data");
    assert_eq!(first.into_data().expect("data"), Bytes::from_static(b"paid "));
    drop(body);
    gate.add_permits(1);
    let retry = send(&app, post_with_key("gone")).await;
    assert_eq!(retry, (StatusCode::CREATED, true, Bytes::from_static(b"paid once")));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Longer than the record limit: the first caller still gets all of it; the
/// retry replays the problem naming the original status.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_streamed_response_over_the_limit_reaches_the_first_caller_whole() {
    let (runs, app) = limited_app(|| {
        let chunks = (0..6).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 500])));
        (
            StatusCode::CREATED,
            Body::from_stream(futures_util::stream::iter(chunks)),
        )
            .into_response()
    });
    let (status, replayed, body) = send(&app, post_with_key("big")).await;
    assert_eq!((status, replayed, body.len()), (StatusCode::CREATED, false, 3_000));
    replays_stand_in(&app, "big", "idempotency-response-too-large").await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A body that fails midway: the first caller's response is cut off with an
/// error (never taken for a whole one), and the retry replays the problem.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_streamed_body_that_fails_cuts_the_first_caller_off() {
    let (runs, app) =
        limited_app(|| (StatusCode::CREATED, failing_body(b"partial", "serialiser failed")).into_response());
    let response = app.clone().oneshot(post_with_key("failed")).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::CREATED, "the status was sent first");
    assert!(response.into_body().collect().await.is_err(), "the body fails");
    replays_stand_in(&app, "failed", "idempotency-response-failed").await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A first caller that reads nothing is left behind after the stall: its
/// body ends in an error, and the response is recorded whole all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_first_caller_is_left_behind_and_the_record_completes() {
    let (runs, app, expected) = numbered_app(200, Duration::from_millis(200), 10_000);
    let stalled = unread_while_a_twin_replays(&app, "slow", &expected).await;
    // The caller reads nothing for longer than the stall.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        stalled.into_body().collect().await.is_err(),
        "the stalled caller's response was cut off"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Responses that are not recorded stream as before and leave the key
/// usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_streamed_5xx_is_not_recorded() {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let (runs, app) = limited_app(move || {
        if seen.fetch_add(1, Ordering::SeqCst) == 0 {
            (StatusCode::SERVICE_UNAVAILABLE, "x".repeat(5_000)).into_response()
        } else {
            (StatusCode::CREATED, "paid").into_response()
        }
    });
    let (status, replayed, body) = send(&app, post_with_key("503")).await;
    assert_eq!(
        (status, replayed, body.len()),
        (StatusCode::SERVICE_UNAVAILABLE, false, 5_000)
    );
    let retry = send(&app, post_with_key("503")).await;
    assert_eq!(retry, (StatusCode::CREATED, false, Bytes::from_static(b"paid")));
    let replay = send(&app, post_with_key("503")).await;
    assert_eq!(replay, (StatusCode::CREATED, true, Bytes::from_static(b"paid")));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A first caller that reads nothing does not hold up the recording of a
/// response that fits the record: the body is read at its own pace, and a
/// twin replays it long before the caller would be cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_caller_does_not_hold_up_the_record() {
    let (runs, app, expected) = numbered_app(500, Duration::from_secs(30), 5_000);
    let stalled = unread_while_a_twin_replays(&app, "stalled", &expected).await;
    // The stalled caller still gets the whole response when it reads.
    let body = stalled.into_body().collect().await.expect("whole").to_bytes();
    assert_eq!(body, Bytes::from(expected));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
