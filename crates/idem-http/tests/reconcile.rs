//! Lease mode with a `Reconcile` hook: a retry that meets a key held as an
//! unknown outcome asks before answering, and a retry that goes away while
//! asking gives the reconcile lock back at once, so the next retry asks
//! rather than being told the key is in flight until the lock's lease ends.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use idem_core::{BoxFuture, Call, InFlight, LeaseEngine, ManualClock, Policy};
use idem_http::{DEFAULT_SETTLE, IdempotencyLayer, Leased, OutcomeUnknown, Reconcile, Reconciled, RoutePolicy};
use idem_memory::MemoryStore;
use support::{counted_pay, post_with_key, send, tenant};
use tower::ServiceExt;

/// A lease-mode layer over a new in-memory store (on `clock`, if given)
/// under `policy`, asking `reconcile` about keys held as unknown outcomes.
fn layer(
    clock: Option<&ManualClock>,
    policy: Policy,
    reconcile: impl Reconcile,
) -> IdempotencyLayer<Leased<MemoryStore>> {
    let mut engine = LeaseEngine::new(MemoryStore::new());
    if let Some(clock) = clock {
        engine = engine.with_clock(Arc::new(clock.clone()));
    }
    IdempotencyLayer::lease(engine, tenant)
        .default_route(RoutePolicy::required().with_policy(policy))
        .reconcile(reconcile)
}

/// What a run answers, held as an unknown outcome.
#[derive(Clone, Copy)]
struct Held {
    status: StatusCode,
    body: &'static str,
    note: &'static str,
    answered: bool,
}

/// It may have taken effect: the key is held.
const FAILED: Held = Held {
    status: StatusCode::INTERNAL_SERVER_ERROR,
    body: "failed",
    note: "failed after the effect",
    answered: true,
};

/// No answer in time: the key is held.
const TIMED_OUT: Held = Held {
    status: StatusCode::GATEWAY_TIMEOUT,
    body: "timed out",
    note: "no answer in time",
    answered: false,
};

impl IntoResponse for Held {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.body).into_response();
        response.extensions_mut().insert(OutcomeUnknown {
            note: self.note.into(),
            answered: self.answered,
        });
        response
    }
}

/// `POST /pay` behind `layer`, counting its runs in `runs`: its first run
/// (every run, if `every_run`) answers `held`; later runs answer 201 "paid".
fn app(layer: IdempotencyLayer<Leased<MemoryStore>>, runs: &Arc<AtomicUsize>, held: Held, every_run: bool) -> Router {
    counted_pay(runs, move |run| async move {
        if run == 0 || every_run {
            held.into_response()
        } else {
            (StatusCode::CREATED, "paid").into_response()
        }
    })
    .route_layer(layer)
}

/// Counts its asks in `asks` and answers ask `n` (from 0) with `answer(n)`;
/// a "not applied" is trusted `settle` after the held request was sent.
struct Asker<F> {
    asks: Arc<AtomicUsize>,
    answer: F,
    settle: Duration,
}

impl<F> Asker<F>
where
    F: Fn(usize) -> BoxFuture<'static, Reconciled> + Send + Sync + 'static,
{
    /// Trusts a "not applied" after the default settle time.
    fn new(asks: &Arc<AtomicUsize>, answer: F) -> Self {
        Self {
            asks: asks.clone(),
            answer,
            settle: DEFAULT_SETTLE,
        }
    }
}

impl<F> Reconcile for Asker<F>
where
    F: Fn(usize) -> BoxFuture<'static, Reconciled> + Send + Sync + 'static,
{
    fn can_ask(&self, _parts: &http::request::Parts, _call: &Call) -> bool {
        true
    }

    fn ask<'a>(&'a self, _parts: &'a http::request::Parts, _call: &'a Call) -> BoxFuture<'a, Reconciled> {
        (self.answer)(self.asks.fetch_add(1, Ordering::SeqCst))
    }

    fn settle_after(&self, _parts: &http::request::Parts, _call: &Call) -> Duration {
        self.settle
    }
}

/// Counts the runs of `POST /pay` and the asks of its reconcile hook.
#[derive(Default)]
struct Counts {
    runs: Arc<AtomicUsize>,
    asks: Arc<AtomicUsize>,
}

impl Counts {
    /// The runs and the asks so far.
    fn get(&self) -> (usize, usize) {
        (self.runs.load(Ordering::SeqCst), self.asks.load(Ordering::SeqCst))
    }
}

/// Checks that `body` says the key is held as an unknown outcome.
fn assert_held_as_unknown(body: &[u8]) {
    assert!(
        String::from_utf8_lossy(body).contains("idempotency-outcome-unknown"),
        "{body:?}"
    );
}

/// A retry dropped while it asks frees the reconcile lock: the next retry
/// (under `in_flight = reject` and a minute-long lease, so a lock left behind
/// would answer 409 in flight) asks, hears "not applied" and runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_that_goes_away_while_asking_frees_the_lock() {
    let c = Counts::default();
    // "Not applied", except to the first asker, who never hears back.
    let first_hangs = Asker::new(&c.asks, |n| {
        Box::pin(async move {
            if n == 0 {
                std::future::pending::<()>().await;
            }
            Reconciled::NotApplied
        })
    });
    let policy = Policy::default().with_lease_ms(60_000).with_in_flight(InFlight::Reject);
    let layer = layer(None, policy, first_hangs);
    let detached = layer.detached().clone();
    let app = app(layer, &c.runs, FAILED, false);

    let first = app.clone().oneshot(post_with_key("k")).await.expect("infallible");
    assert_eq!(first.status(), 500);
    detached.idle().await;
    let gone = tokio::time::timeout(Duration::from_millis(300), app.clone().oneshot(post_with_key("k"))).await;
    assert!(gone.is_err(), "the first asker never hears back");
    assert_eq!(c.asks.load(Ordering::SeqCst), 1);
    detached.idle().await;

    let (status, replayed, body) = send(&app, post_with_key("k")).await;
    assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"paid"[..]), "{body:?}");
    assert!(!replayed);
    assert_eq!(c.get(), (2, 2));
}

/// An answer heard after the reconcile lock's lease ran out is not acted on:
/// another retry may have taken the lock over meanwhile. The key stays held
/// (409) and the handler does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_heard_after_the_lock_ran_out_is_not_acted_on() {
    let c = Counts::default();
    let clock = ManualClock::starting_now();
    // "Not applied", after moving the engine's clock past the reconcile
    // lock's lease, as a process paused while it asked would find it.
    let paused = Asker::new(&c.asks, {
        let clock = clock.clone();
        move |_| {
            clock.advance(Duration::from_secs(120));
            Box::pin(async { Reconciled::NotApplied })
        }
    });
    let layer = layer(Some(&clock), Policy::default().with_lease_ms(60_000), paused);
    let detached = layer.detached().clone();
    let app = app(layer, &c.runs, FAILED, true);

    let first = app.clone().oneshot(post_with_key("k")).await.expect("infallible");
    assert_eq!(first.status(), 500);
    detached.idle().await;
    let (status, _, body) = send(&app, post_with_key("k")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body:?}");
    assert_held_as_unknown(&body);
    assert_eq!(c.get(), (1, 1));
}

/// A "not applied" heard before the held request settled (the other side
/// may still be working on it) keeps the key held: 409 with `Retry-After`
/// until the settle time, the handler not run. Past it, the same answer
/// releases the key and the retry runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_not_applied_heard_before_the_send_settled_keeps_the_key_held() {
    let c = Counts::default();
    let clock = ManualClock::starting_now();
    // "Not applied" to every asker, with a settle time of ten seconds.
    let not_yet = Asker {
        settle: Duration::from_secs(10),
        ..Asker::new(&c.asks, |_| Box::pin(async { Reconciled::NotApplied }))
    };
    let layer = layer(Some(&clock), Policy::default().with_lease_ms(60_000), not_yet);
    let detached = layer.detached().clone();
    let app = app(layer, &c.runs, TIMED_OUT, false);

    assert_eq!(app.clone().oneshot(post_with_key("k")).await.unwrap().status(), 504);
    detached.idle().await;
    clock.advance(Duration::from_secs(3));
    let early = app.clone().oneshot(post_with_key("k")).await.unwrap();
    assert_eq!(early.status(), StatusCode::CONFLICT);
    let retry_after = early
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(retry_after.as_deref(), Some("7"), "the settle time's remainder");
    let body = early.into_body().collect().await.unwrap().to_bytes();
    assert_held_as_unknown(&body);
    assert_eq!(c.get(), (1, 1));
    detached.idle().await;

    clock.advance(Duration::from_secs(8));
    let late = app.clone().oneshot(post_with_key("k")).await.unwrap();
    assert_eq!(late.status(), StatusCode::CREATED);
    assert_eq!(c.get(), (2, 2));
}
