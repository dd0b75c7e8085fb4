//! Lease mode and a holder stopped past its lease between its claim and its
//! handler (a paused process): a twin that took the key over meanwhile runs
//! the handler once, and the stopped holder, when it carries on, runs
//! nothing.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use idem_core::{
    BoxFuture, ClaimRequest, IdempotencyKey, Lease, LeaseClaim, LeaseEngine, LeaseStore, ManualClock, Policy, Record,
    Resolution, Scope,
};
use idem_http::{IdempotencyLayer, RoutePolicy};
use idem_memory::MemoryStore;
use support::{counted_pay, post_with_key, tenant};
use tokio::sync::Notify;
use tower::ServiceExt;

const LEASE: Duration = Duration::from_secs(60);

/// A store whose next successful claim is followed by a pause: the clock
/// moves past the lease and the claimer waits until it is let go.
#[derive(Clone)]
struct PausingStore {
    inner: MemoryStore,
    clock: ManualClock,
    pause_next: Arc<AtomicBool>,
    paused: Arc<Notify>,
    resume: Arc<Notify>,
}

impl LeaseStore for PausingStore {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, idem_core::Result<LeaseClaim>> {
        Box::pin(async move {
            let claim = self.inner.try_claim(req).await?;
            if matches!(claim, LeaseClaim::Acquired(_)) && self.pause_next.swap(false, Ordering::SeqCst) {
                self.clock.advance(LEASE * 2);
                self.paused.notify_one();
                self.resume.notified().await;
            }
            Ok(claim)
        })
    }

    fn mark_sent<'a>(&'a self, lease: &'a Lease, now_ms: i64) -> BoxFuture<'a, idem_core::Result<()>> {
        self.inner.mark_sent(lease, now_ms)
    }

    fn lookup<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, idem_core::Result<Option<idem_core::StoredRow>>> {
        self.inner.lookup(scope, key)
    }

    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> BoxFuture<'a, idem_core::Result<()>> {
        self.inner.complete(lease, record)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, idem_core::Result<()>> {
        self.inner.release(lease)
    }

    fn extend<'a>(&'a self, lease: &'a Lease, until: i64) -> BoxFuture<'a, idem_core::Result<()>> {
        self.inner.extend(lease, until)
    }

    fn resolve_unknown<'a>(&'a self, req: &'a Resolution<'a>) -> BoxFuture<'a, idem_core::Result<bool>> {
        self.inner.resolve_unknown(req)
    }
}

/// The first request is stopped right after its claim for twice its lease;
/// its twin takes the key over and runs the handler; the first, when it
/// carries on, runs nothing and answers 409. The handler ran once, and a
/// later retry replays the twin's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_stopped_past_its_lease_before_its_handler_runs_nothing() {
    let clock = ManualClock::starting_now();
    let store = PausingStore {
        inner: MemoryStore::new(),
        clock: clock.clone(),
        pause_next: Arc::new(AtomicBool::new(true)),
        paused: Arc::new(Notify::new()),
        resume: Arc::new(Notify::new()),
    };
    let engine = LeaseEngine::new(store.clone()).with_clock(Arc::new(clock.clone()));
    let layer = IdempotencyLayer::lease(engine, tenant)
        .default_route(RoutePolicy::required().with_policy(Policy::default().with_lease_ms(LEASE.as_millis() as u64)));
    let detached = layer.detached().clone();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counted_pay(&runs, |run| async move {
        (StatusCode::CREATED, format!("payment {}", run + 1))
    })
    .route_layer(layer);

    let stopped = tokio::spawn(app.clone().oneshot(post_with_key("k")));
    store.paused.notified().await;
    let twin = app.clone().oneshot(post_with_key("k")).await.expect("infallible");
    // A whole answer is handed over once its outcome is recorded. (The
    // stopped claim counts as detached work, so no wait for idle here.)
    assert_eq!(twin.status(), StatusCode::CREATED);
    store.resume.notify_one();
    let late = stopped.await.expect("no panic").expect("infallible");
    assert_eq!(late.status(), StatusCode::CONFLICT, "the stopped holder runs nothing");
    detached.idle().await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    let retry = app.oneshot(post_with_key("k")).await.expect("infallible");
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
}
