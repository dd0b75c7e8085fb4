//! Lease mode under slow handlers, cancelled requests and responses that
//! must not be recorded.

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_core::{InFlight, LeaseEngine, Policy};
use idem_http::{HeldLease, IdempotencyLayer, RoutePolicy};
use idem_memory::MemoryStore;
use support::{counted_pay, failing_body, post_to, post_with_key, send, tenant};
use tower::ServiceExt;

fn layer(policy: Policy) -> IdempotencyLayer<idem_http::Leased<MemoryStore>> {
    IdempotencyLayer::lease(LeaseEngine::new(MemoryStore::new()), tenant)
        .default_route(RoutePolicy::required().with_policy(policy))
        .max_response_bytes(1024)
}

fn counter() -> Arc<AtomicUsize> {
    Arc::new(AtomicUsize::new(0))
}

/// An app whose `POST /pay` counts its runs in `runs` and answers with
/// `handler(run)`, where `run` counts from 0.
fn pay_app<F, Fut, R>(runs: &Arc<AtomicUsize>, policy: Policy, handler: F) -> Router
where
    F: Fn(usize) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse + 'static,
{
    counted_pay(runs, handler).route_layer(layer(policy))
}

/// A handler three times slower than its lease: twins sent while it runs
/// are told it is in flight, and after it finishes they replay. It runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_slower_than_its_lease_runs_once() {
    let runs = counter();
    let app = pay_app(
        &runs,
        Policy::default().with_lease_ms(200).with_in_flight(InFlight::Reject),
        |run| async move {
            let n = run + 1;
            tokio::time::sleep(Duration::from_millis(600)).await;
            (StatusCode::CREATED, format!("paid {n}"))
        },
    );
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_with_key("slow")).await }
    });
    for at in [50u64, 200, 200] {
        tokio::time::sleep(Duration::from_millis(at)).await;
        let (status, _, _) = send(&app, post_with_key("slow")).await;
        assert_eq!(
            status,
            StatusCode::CONFLICT,
            "a twin while the handler runs is in flight"
        );
    }
    let (status, replayed, body) = first.await.expect("first request");
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let again = send(&app, post_with_key("slow")).await;
    assert_eq!(again, (StatusCode::CREATED, true, body));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
}

/// A twin with a bounded wait waits for the slow holder and replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_twin_replays_the_slow_holder() {
    let runs = counter();
    let app = pay_app(
        &runs,
        Policy::default()
            .with_lease_ms(200)
            .with_in_flight(InFlight::Wait { max_ms: 5_000 }),
        |_run| async move {
            tokio::time::sleep(Duration::from_millis(600)).await;
            StatusCode::CREATED
        },
    );
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_with_key("wait")).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let twin = send(&app, post_with_key("wait")).await;
    assert_eq!(first.await.expect("first").0, StatusCode::CREATED);
    assert_eq!((twin.0, twin.1), (StatusCode::CREATED, true));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A body that yields one chunk, then waits before the rest.
fn slow_body(first: &'static str, rest: &'static str, pause: Duration) -> Body {
    let stream = futures_util::stream::unfold(0u8, move |step| async move {
        match step {
            0 => Some((Ok::<_, Infallible>(Bytes::from_static(first.as_bytes())), 1)),
            1 => {
                tokio::time::sleep(pause).await;
                Some((Ok(Bytes::from_static(rest.as_bytes())), 2))
            }
            _ => None,
        }
    });
    Body::from_stream(stream)
}

/// The handler returned, its body was still streaming, and the request was
/// dropped (the client went away, an outer timeout): the outcome is still
/// recorded, and the retry replays it instead of running the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_dropped_after_the_handler_still_records() {
    let runs = counter();
    let app = pay_app(
        &runs,
        Policy::default().with_in_flight(InFlight::Wait { max_ms: 5_000 }),
        |_run| async move {
            (
                StatusCode::CREATED,
                slow_body("paid ", "once", Duration::from_millis(300)),
            )
        },
    );
    let dropped = tokio::time::timeout(Duration::from_millis(100), send(&app, post_with_key("gone"))).await;
    assert!(dropped.is_err(), "the request was dropped mid-response");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler had run");
    let retry = send(&app, post_with_key("gone")).await;
    assert_eq!(retry, (StatusCode::CREATED, true, Bytes::from_static(b"paid once")));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler did not run again");
}

/// The request is dropped while the handler still runs (the client went
/// away, an outer timeout): the handler is not cut off, it runs to its end
/// in a task of its own, its outcome is recorded, and the retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_dropped_while_the_handler_runs_still_records() {
    let runs = counter();
    let finished = counter();
    let done = finished.clone();
    let app = pay_app(
        &runs,
        Policy::default().with_in_flight(InFlight::Wait { max_ms: 5_000 }),
        move |_run| {
            let done = done.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                done.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, "paid once")
            }
        },
    );
    let dropped = tokio::time::timeout(Duration::from_millis(100), send(&app, post_with_key("cut"))).await;
    assert!(dropped.is_err(), "the request was dropped while the handler ran");
    assert_eq!(finished.load(Ordering::SeqCst), 0, "the handler had not finished yet");
    let retry = send(&app, post_with_key("cut")).await;
    assert_eq!(retry, (StatusCode::CREATED, true, Bytes::from_static(b"paid once")));
    assert_eq!(finished.load(Ordering::SeqCst), 1, "the dropped handler ran to its end");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler did not run again");
}

/// A memory store that notes, for each claim, sent mark and completion,
/// whether it ran inside a spawned task (`tokio::task::try_id`).
#[derive(Clone, Default)]
struct TaskNoting {
    inner: MemoryStore,
    in_task: Arc<std::sync::Mutex<Vec<(&'static str, bool)>>>,
}

impl TaskNoting {
    fn note(&self, what: &'static str) {
        let spawned = tokio::task::try_id().is_some();
        self.in_task.lock().unwrap().push((what, spawned));
    }
}

impl idem_core::LeaseStore for TaskNoting {
    fn try_claim<'a>(
        &'a self,
        req: &'a idem_core::ClaimRequest<'a>,
    ) -> idem_core::BoxFuture<'a, idem_core::Result<idem_core::LeaseClaim>> {
        self.note("claim");
        self.inner.try_claim(req)
    }
    fn mark_sent<'a>(
        &'a self,
        lease: &'a idem_core::Lease,
        now_ms: i64,
    ) -> idem_core::BoxFuture<'a, idem_core::Result<()>> {
        self.note("mark_sent");
        self.inner.mark_sent(lease, now_ms)
    }
    fn lookup<'a>(
        &'a self,
        scope: &'a idem_core::Scope,
        key: &'a idem_core::IdempotencyKey,
    ) -> idem_core::BoxFuture<'a, idem_core::Result<Option<idem_core::StoredRow>>> {
        self.inner.lookup(scope, key)
    }
    fn complete<'a>(
        &'a self,
        lease: &'a idem_core::Lease,
        record: &'a idem_core::Record,
    ) -> idem_core::BoxFuture<'a, idem_core::Result<()>> {
        self.note("complete");
        self.inner.complete(lease, record)
    }
    fn release<'a>(&'a self, lease: &'a idem_core::Lease) -> idem_core::BoxFuture<'a, idem_core::Result<()>> {
        self.inner.release(lease)
    }
    fn extend<'a>(
        &'a self,
        lease: &'a idem_core::Lease,
        until: i64,
    ) -> idem_core::BoxFuture<'a, idem_core::Result<()>> {
        self.inner.extend(lease, until)
    }
    fn resolve_unknown<'a>(
        &'a self,
        req: &'a idem_core::Resolution<'a>,
    ) -> idem_core::BoxFuture<'a, idem_core::Result<bool>> {
        self.inner.resolve_unknown(req)
    }
}

/// A fresh request whose caller stays runs its claim, its sent mark, its
/// handler and its recording in the caller's own task: none of them in a
/// spawned task, and no task alive while the handler runs (on a
/// current-thread runtime, where the test itself is no spawned task).
#[tokio::test(flavor = "current_thread")]
async fn a_fresh_request_spawns_no_task() {
    let runs = counter();
    let store = TaskNoting::default();
    let alive = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = alive.clone();
    let app = counted_pay(&runs, move |_run| {
        let seen = seen.clone();
        async move {
            let tasks = tokio::runtime::Handle::current().metrics().num_alive_tasks();
            seen.lock().unwrap().push((tasks, tokio::task::try_id().is_some()));
            (StatusCode::CREATED, "paid")
        }
    })
    .route_layer(
        IdempotencyLayer::lease(LeaseEngine::new(store.clone()), tenant)
            .default_route(RoutePolicy::required().with_policy(Policy::default())),
    );
    for key in ["alone-1", "alone-2", "alone-3"] {
        let (status, replayed, _) = send(&app, post_with_key(key)).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, false));
    }
    assert_eq!(
        *alive.lock().unwrap(),
        vec![(0, false); 3],
        "tasks alive while each handler ran, and whether it ran in one"
    );
    let calls = store.in_task.lock().unwrap().clone();
    assert_eq!(
        calls.len(),
        9,
        "a claim, a mark and a completion per request: {calls:?}"
    );
    assert!(
        calls.iter().all(|(_, spawned)| !spawned),
        "store calls made in a spawned task: {calls:?}"
    );
    assert_eq!(
        tokio::runtime::Handle::current().metrics().num_alive_tasks(),
        0,
        "no task left behind"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// An app whose first run answers `first()` and every later run pays (201
/// `paid`).
fn fails_once_then_pays(runs: &Arc<AtomicUsize>, first: fn() -> Response) -> Router {
    pay_app(runs, Policy::default(), move |run| async move {
        if run == 0 {
            first()
        } else {
            (StatusCode::CREATED, "paid").into_response()
        }
    })
}

/// The retry of the first request with `key` to a
/// [`fails_once_then_pays`] app runs the handler again and pays: the
/// failure was not recorded.
async fn the_retry_pays(app: &Router, key: &str, runs: &AtomicUsize) {
    let retry = send(app, post_with_key(key)).await;
    assert_eq!(retry, (StatusCode::CREATED, false, Bytes::from_static(b"paid")));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A 5xx is never recorded, even when its body is larger than the record
/// limit: the key stays usable and the retry runs the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_large_5xx_is_not_recorded() {
    let runs = counter();
    let app = fails_once_then_pays(&runs, || {
        (StatusCode::SERVICE_UNAVAILABLE, "x".repeat(10_000)).into_response()
    });
    let (status, replayed, body) = send(&app, post_with_key("503")).await;
    assert_eq!((status, replayed), (StatusCode::SERVICE_UNAVAILABLE, false));
    assert_eq!(body.len(), 10_000, "the 503 reaches the client whole");
    the_retry_pays(&app, "503", &runs).await;
}

/// A 5xx whose body stream fails is not recorded either.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_5xx_with_a_failing_body_is_not_recorded() {
    let runs = counter();
    let app = fails_once_then_pays(&runs, || {
        (StatusCode::BAD_GATEWAY, failing_body(b"partial", "upstream reset")).into_response()
    });
    let response = app.clone().oneshot(post_with_key("502")).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
    assert!(response.into_body().collect().await.is_err(), "the body fails");
    the_retry_pays(&app, "502", &runs).await;
}

/// A 2xx whose body stream fails has taken effect: the retry replays a
/// problem that says the response failed (not that it was too large), and the
/// handler does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_2xx_with_a_failing_body_is_reported_as_failed() {
    let runs = counter();
    let app = pay_app(&runs, Policy::default(), |_run| async move {
        (StatusCode::CREATED, failing_body(b"partial", "serialiser failed"))
    });
    let (status, replayed, body) = send(&app, post_with_key("failed")).await;
    assert_eq!((status, replayed), (StatusCode::INTERNAL_SERVER_ERROR, false));
    assert!(String::from_utf8_lossy(&body).contains("idempotency-response-failed"));
    let (status, replayed, again) = send(&app, post_with_key("failed")).await;
    assert_eq!((status, replayed), (StatusCode::INTERNAL_SERVER_ERROR, true));
    let text = String::from_utf8_lossy(&again);
    assert!(
        text.contains("idempotency-response-failed") && text.contains("status 201"),
        "{text}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The handler gets its lease and fencing token through the extractor.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_handler_gets_its_lease() {
    let app = Router::new()
        .route(
            "/pay",
            post(|lease: HeldLease| async move {
                assert!(lease.is_held());
                (
                    StatusCode::CREATED,
                    format!("{} {}", lease.key().as_str(), lease.token().0),
                )
            }),
        )
        .route(
            "/maybe",
            post(|lease: Option<HeldLease>| async move { format!("{}", lease.is_some()) }),
        )
        .route_layer(
            IdempotencyLayer::lease(LeaseEngine::new(MemoryStore::new()), tenant)
                .route("POST /maybe", RoutePolicy::optional()),
        );
    let (status, _, body) = send(&app, post_with_key("lease-1")).await;
    assert_eq!(status, StatusCode::CREATED);
    let text = String::from_utf8_lossy(&body).into_owned();
    let (key, token) = text.split_once(' ').expect("key and token");
    assert_eq!(key, "lease-1");
    assert!(token.parse::<i64>().expect("a token") > 0);
    let (_, _, with_key) = send(&app, post_to("/maybe", "lease-2")).await;
    assert_eq!(&with_key[..], b"true");
    let unkeyed = Request::builder()
        .method("POST")
        .uri("/maybe")
        .body(Body::empty())
        .expect("request");
    let (_, _, without) = send(&app, unkeyed).await;
    assert_eq!(&without[..], b"false", "no key, no lease");
}
