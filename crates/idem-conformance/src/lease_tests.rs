//! Lease-mode behaviours.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Acquire, Call, Error, IdempotencyKey, Lease, LeaseEngine, Outcome, Policy, Record};

use crate::*;

async fn run_receipt<S: Subject>(
    engine: &LeaseEngine<S::Lease>,
    call: &Call,
    runs: &Runs,
) -> Result<Outcome<Receipt>, TestError> {
    run_counted(engine, call, runs, 1).await
}

/// `n` tasks released together run `call`, on `engines` in turn; the work
/// holds its claim 50 ms, long enough for every twin to find it running.
/// Answers each task's outcome.
async fn run_together<S: Subject>(
    engines: &[Arc<LeaseEngine<S::Lease>>; 2],
    call: &Call,
    n: usize,
    runs: &Runs,
) -> Vec<Outcome<Receipt>> {
    let tasks = spawn_together(n, |i| {
        let (engine, call, runs) = (engines[i % 2].clone(), call.clone(), runs.clone());
        async move {
            engine
                .run(&call, move |_lease| async move {
                    runs.hit();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok::<_, TestError>(Receipt::new(1))
                })
                .await
        }
    });
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap().expect("every task gets an outcome"));
    }
    outcomes
}

/// A lease engine of `s`, a call of a fresh key in a scope of its own
/// under `policy`, and the lease of its first claim.
async fn claimed<S: Subject>(s: &S, policy: Policy) -> (LeaseEngine<S::Lease>, Call, Lease) {
    let engine = lease_engine(s);
    let call = fresh_call("op", "{}", policy);
    let lease = held(engine.acquire(&call).await.unwrap());
    (engine, call, lease)
}

pub(crate) fn held(acquire: Acquire) -> Lease {
    match acquire {
        Acquire::Claimed(lease) => lease,
        Acquire::Replay(r) => panic!("expected a claim, got a replay of {r:?}"),
    }
}

fn record_of(r: &Receipt) -> Record {
    Record::completed(serde_json::to_vec(r).unwrap())
}

pub(crate) fn assert_in_flight<T: std::fmt::Debug>(r: Result<T, Error>) {
    match r {
        Err(Error::InFlight { .. }) => {}
        other => panic!("expected in-flight, got {other:?}"),
    }
}

/// Claim, run, complete; a retry replays the recorded value and does not run.
pub async fn lease_claim_complete_replay<S: Subject>(s: S) {
    let engine = lease_engine(&s);
    let scope = unique_scope("POST /v1/payouts");
    let call = call_for(&scope, &IdempotencyKey::generate(), "{}", Policy::default());
    let runs = Runs::default();
    let first = run_receipt::<S>(&engine, &call, &runs).await.unwrap();
    assert!(!first.is_replayed());
    let again = run_receipt::<S>(&engine, &call, &runs).await.unwrap();
    assert_eq!(again, Outcome::Replayed(first.into_inner()));
    assert_eq!(runs.get(), 1);
}

/// The same key with a different request is an error, whether the first is running or done.
pub async fn lease_mismatch<S: Subject>(s: S) {
    let engine = lease_engine(&s);
    let scope = unique_scope("POST /v1/payouts");
    let key = IdempotencyKey::generate();
    let lease = held(
        engine
            .acquire(&call_for(&scope, &key, r#"{"a":1}"#, Policy::default()))
            .await
            .unwrap(),
    );
    let other = call_for(&scope, &key, r#"{"a":2}"#, Policy::default());
    assert!(
        matches!(engine.acquire(&other).await, Err(Error::Mismatch)),
        "running: mismatch"
    );
    engine.complete(&lease, record_of(&Receipt::new(1))).await.unwrap();
    assert!(
        matches!(engine.acquire(&other).await, Err(Error::Mismatch)),
        "done: mismatch"
    );
}

/// A released claim leaves the key unused.
pub async fn lease_release_leaves_key_unused<S: Subject>(s: S) {
    let engine = lease_engine(&s);
    let call = fresh_call("op", "{}", rejecting());
    let lease = held(engine.acquire(&call).await.unwrap());
    engine.release(&lease).await.unwrap();
    let again = held(engine.acquire(&call).await.unwrap());
    assert_ne!(again.token, lease.token, "a new claim gets a new token");
    assert!(
        matches!(engine.release(&lease).await, Err(Error::Fenced)),
        "the old token is dead"
    );
    engine.release(&again).await.unwrap();
}

/// An error in the work releases the key, so a retry runs; a panic holds
/// it as an unknown outcome (the work was marked sent and may have acted),
/// so nothing runs again until it is resolved.
pub async fn lease_error_releases_and_panic_holds_the_key<S: Subject>(s: S) {
    let engine = lease_engine(&s);
    let call = fresh_call("op", "{}", waiting(20_000));
    let err = engine
        .run(&call, |_lease| async {
            Err::<Receipt, _>(TestError::Work("vendor down".into()))
        })
        .await
        .unwrap_err();
    assert!(matches!(err, TestError::Work(_)));
    let panicked = {
        let (engine, call) = (engine.clone(), call.clone());
        tokio::spawn(async move {
            engine
                .run(&call, |_lease| async {
                    if panics() {
                        panic!("work panicked");
                    }
                    Ok::<Receipt, TestError>(Receipt::new(1))
                })
                .await
        })
        .await
    };
    assert!(panicked.is_err_and(|e| e.is_panic()));
    engine.detached().idle().await;
    let runs = Runs::default();
    let held = run_receipt::<S>(&engine, &call, &runs).await;
    assert!(
        matches!(held, Err(TestError::Idem(Error::OutcomeUnknown))),
        "a panicked work's key is held: {held:?}"
    );
    assert_eq!(runs.get(), 0);
    assert!(engine.resolve_unknown(call.scope(), call.key(), None).await.unwrap());
    let ok = run_receipt::<S>(&engine, &call, &runs).await.unwrap();
    assert!(!ok.is_replayed(), "resolved not applied, the key runs again");
    assert_eq!(runs.get(), 1);
}

/// Always true; a plain `panic!` would leave the work's `Ok` unreachable
/// and its type uninferable.
fn panics() -> bool {
    true
}

/// A live claim is reported in flight at once, or after a bounded wait.
pub async fn lease_live_claim_is_in_flight<S: Subject>(s: S) {
    let (engine, call, lease) = claimed(&s, Policy::default()).await;
    let (scope, key) = (call.scope(), call.key());
    assert_in_flight(engine.acquire(&call_for(scope, key, "{}", rejecting())).await);
    assert_in_flight(engine.acquire(&call_for(scope, key, "{}", waiting(200))).await);
    engine.release(&lease).await.unwrap();
}

/// A twin waits for a live claim to complete, then replays its outcome.
pub async fn lease_twin_waits_then_replays<S: Subject>(s: S) {
    let (engine, call, lease) = claimed(&s, waiting(30_000)).await;
    let twin = {
        let (engine, call) = (engine.clone(), call.clone());
        tokio::spawn(async move { engine.acquire(&call).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!twin.is_finished(), "the twin waits on the live claim");
    let record = record_of(&Receipt::new(3));
    engine.complete(&lease, record.clone()).await.unwrap();
    assert_eq!(twin.await.unwrap().unwrap(), Acquire::Replay(record));
}

/// After the lease expires, a new claimer takes the key over with a larger token, and its outcome stands.
pub async fn lease_takeover_after_expiry<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, rejecting().with_lease_ms(1_000));
    let a = held(engine.acquire(&call).await.unwrap());
    clock.advance(Duration::from_millis(999));
    assert_in_flight(engine.acquire(&call).await);
    clock.advance(Duration::from_millis(2));
    let b = held(engine.acquire(&call).await.unwrap());
    assert!(b.token > a.token, "the takeover's token is larger");
    let b_record = record_of(&Receipt::new(2));
    engine.complete(&b, b_record.clone()).await.unwrap();
    assert!(matches!(
        engine.complete(&a, record_of(&Receipt::new(1))).await,
        Err(Error::Fenced)
    ));
    assert_eq!(
        engine.acquire(&call).await.unwrap(),
        Acquire::Replay(b_record),
        "the new outcome stands"
    );
}

/// A holder whose lease was taken over can neither complete, release nor extend.
pub async fn lease_stale_holder_is_fenced<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, rejecting().with_lease_ms(1_000));
    let a = held(engine.acquire(&call).await.unwrap());
    clock.advance(Duration::from_millis(1_500));
    let b = held(engine.acquire(&call).await.unwrap());
    assert!(matches!(
        engine.complete(&a, record_of(&Receipt::new(1))).await,
        Err(Error::Fenced)
    ));
    assert!(matches!(engine.release(&a).await, Err(Error::Fenced)));
    assert!(matches!(engine.extend(&a, 60_000).await, Err(Error::Fenced)));
    assert_in_flight(engine.acquire(&call).await);
    engine.release(&b).await.unwrap();
}

/// Extending a lease keeps the claim past its original expiry.
pub async fn lease_extend_keeps_the_claim<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, rejecting().with_lease_ms(1_000));
    let a = held(engine.acquire(&call).await.unwrap());
    clock.advance(Duration::from_millis(800));
    let a = engine.extend(&a, 1_000).await.unwrap();
    clock.advance(Duration::from_millis(800));
    assert_in_flight(engine.acquire(&call).await);
    engine.complete(&a, record_of(&Receipt::new(1))).await.unwrap();
}

/// A final rejection is recorded and replayed only under a policy that asks for it.
pub async fn lease_final_rejection_recorded_when_policy_says<S: Subject>(s: S) {
    let engine = lease_engine(&s);
    let decline = Decline::InsufficientFunds { short_by: 1 };
    for (policy, recorded) in [(recording_rejections(), true), (Policy::default(), false)] {
        let call = fresh_call("op", "{}", policy);
        let runs = Runs::default();
        for _ in 0..2 {
            let (runs, d) = (runs.clone(), decline.clone());
            let out = engine
                .run_with_rejections(&call, move |_| async move {
                    runs.hit();
                    Ok::<Result<Receipt, Decline>, TestError>(Err(d))
                })
                .await
                .unwrap();
            assert_eq!(out.into_inner(), Err(decline.clone()));
        }
        assert_eq!(runs.get(), if recorded { 1 } else { 2 });
    }
}

/// Keys are independent across tenants and operations.
pub async fn lease_tenant_and_operation_isolation<S: Subject>(s: S) {
    let engine = lease_engine(&s);
    let a = unique_scope("op-a");
    let b = unique_scope("op-a");
    let c = idem_core::Scope::new(a.tenant().clone(), idem_core::Operation::new("op-c").unwrap());
    let key = IdempotencyKey::generate();
    let runs = Runs::default();
    let mut values = Vec::new();
    for scope in [&a, &b, &c] {
        let out = run_receipt::<S>(&engine, &call_for(scope, &key, "{}", rejecting()), &runs)
            .await
            .unwrap();
        assert!(!out.is_replayed());
        values.push(out.into_inner());
    }
    assert_eq!(runs.get(), 3);
    for (scope, value) in [&a, &b, &c].into_iter().zip(&values) {
        let out = run_receipt::<S>(&engine, &call_for(scope, &key, "{}", rejecting()), &runs)
            .await
            .unwrap();
        assert_eq!(
            out,
            Outcome::Replayed(value.clone()),
            "each scope replays its own outcome"
        );
    }
}

/// A completed key past its TTL executes anew.
pub async fn lease_expired_key_executes_anew<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, Policy::default().with_ttl_secs(60));
    let runs = Runs::default();
    run_receipt::<S>(&engine, &call, &runs).await.unwrap();
    clock.advance(Duration::from_secs(30));
    assert!(run_receipt::<S>(&engine, &call, &runs).await.unwrap().is_replayed());
    clock.advance(Duration::from_secs(31));
    assert!(!run_receipt::<S>(&engine, &call, &runs).await.unwrap().is_replayed());
    assert_eq!(runs.get(), 2);
}

/// The sweeper deletes expired lease-mode keys and spares live ones.
pub async fn lease_sweep_deletes_expired<S: Subject>(s: S) {
    let s = s.isolated().await;
    let (clock, shared) = manual_clock();
    let engine = lease_engine(&s).with_clock(shared.clone());
    let scope = unique_scope("op");
    let kept_for = |secs| {
        call_for(
            &scope,
            &IdempotencyKey::generate(),
            "{}",
            Policy::default().with_ttl_secs(secs),
        )
    };
    let runs = Runs::default();
    for _ in 0..5 {
        run_receipt::<S>(&engine, &kept_for(10), &runs).await.unwrap();
    }
    let live = kept_for(3600);
    run_receipt::<S>(&engine, &live, &runs).await.unwrap();
    clock.advance(Duration::from_secs(11));
    let report = idem_core::sweep_expired(&s.sweeper(), &*shared, unpaced_sweep(2))
        .await
        .unwrap();
    assert_eq!(report.deleted, 5);
    assert!(run_receipt::<S>(&engine, &live, &runs).await.unwrap().is_replayed());
}

/// 64 concurrent tasks on one key in lease mode, across two pools: the work runs once and all see its outcome.
pub async fn lease_concurrent_64_tasks_one_key_one_effect<S: Subject>(s: S) {
    let other = s.another().await;
    let engines = [Arc::new(lease_engine(&s)), Arc::new(lease_engine(&other))];
    let call = fresh_call("op", "{}", waiting(120_000));
    let runs = Runs::default();
    let outcomes = run_together::<S>(&engines, &call, 64, &runs).await;
    assert_eq!(runs.get(), 1, "the effect ran once");
    assert_eq!(outcomes.iter().filter(|o| !o.is_replayed()).count(), 1);
    assert!(outcomes.iter().all(|o| o.value() == outcomes[0].value()));
}

/// A holder slower than its lease keeps the key: the heartbeat extends the
/// lease while the work runs, so twins are in flight until it completes, and
/// then replay. The work runs once.
pub async fn lease_heartbeat_keeps_a_slow_holder<S: Subject>(s: S) {
    let engine = lease_engine(&s);
    let call = call_for(
        &unique_scope("op"),
        &IdempotencyKey::generate(),
        "{}",
        rejecting().with_lease_ms(LEASE_MS),
    );
    let runs = Runs::default();
    // The work lasts until every twin has been turned away (over two lease
    // lengths), however slow the machine is. The lease is long enough that a
    // heartbeat delayed by a loaded machine (it beats every third of a lease)
    // still lands in time.
    const LEASE_MS: u64 = 1_000;
    let done = std::sync::Arc::new(tokio::sync::Notify::new());
    let holder = {
        let (engine, call, runs, done) = (engine.clone(), call.clone(), runs.clone(), done.clone());
        tokio::spawn(async move {
            engine
                .run(&call, move |lease| async move {
                    runs.hit();
                    let _ = tokio::time::timeout(Duration::from_secs(30), done.notified()).await;
                    assert!(lease.is_held(), "the heartbeat kept the lease");
                    Ok::<_, TestError>(Receipt::new(lease.token().0))
                })
                .await
        })
    };
    for at in [100u64, LEASE_MS + 100, LEASE_MS + 100] {
        tokio::time::sleep(Duration::from_millis(at)).await;
        let twin = run_receipt::<S>(&engine, &call, &runs).await;
        assert!(
            matches!(twin, Err(TestError::Idem(Error::InFlight { .. }))),
            "a twin while the holder works is in flight, got {twin:?}"
        );
    }
    done.notify_one();
    let first = holder.await.unwrap().unwrap();
    assert!(!first.is_replayed());
    let again = run_receipt::<S>(&engine, &call, &runs).await.unwrap();
    assert_eq!(again, Outcome::Replayed(first.into_inner()));
    assert_eq!(runs.get(), 1, "the work ran once");
}

/// A heartbeat whose lease was taken over stops, says the lease is no longer
/// held, and the old holder's outcome is never recorded over the new one's.
pub async fn lease_lost_heartbeat_is_reported<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, rejecting().with_lease_ms(300));
    let a = held(engine.acquire(&call).await.unwrap());
    clock.advance(Duration::from_millis(500));
    let b = held(engine.acquire(&call).await.unwrap());
    let beat = engine.heartbeat(&a, 300);
    assert!(beat.held().is_held());
    assert_eq!(beat.held().token(), a.token);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!beat.held().is_held(), "the fenced extension marks the lease lost");
    assert!(matches!(
        engine.complete(&a, record_of(&Receipt::new(1))).await,
        Err(Error::Fenced)
    ));
    let b_record = record_of(&Receipt::new(2));
    engine.complete(&b, b_record.clone()).await.unwrap();
    assert_eq!(engine.acquire(&call).await.unwrap(), Acquire::Replay(b_record));
}

/// Once the work returned, the outcome is recorded even if the caller's
/// future is dropped while recording.
pub async fn lease_outcome_recorded_after_a_drop<S: Subject>(s: S) {
    let engine = lease_engine(&s);
    let call = fresh_call("op", "{}", waiting(5_000));
    let runs = Runs::default();
    // Poll the run just far enough for the work to finish, then drop it.
    let finished = Arc::new(tokio::sync::Notify::new());
    {
        let (runs, notify) = (runs.clone(), finished.clone());
        let run = engine.run(&call, move |_lease| async move {
            runs.hit();
            notify.notify_one();
            Ok::<_, TestError>(Receipt::new(7))
        });
        tokio::select! {
            biased;
            _ = finished.notified() => {}
            _ = run => {}
        }
    }
    let again = run_receipt::<S>(&engine, &call, &runs).await.unwrap();
    assert!(again.is_replayed(), "the outcome was recorded");
    assert_eq!(again.into_inner().amount, 7);
    assert_eq!(runs.get(), 1, "the work ran once");
}

/// Leases are decided on the store's clock. A second host whose wall clock
/// runs 10 minutes ahead cannot take over a live lease when its engine is
/// anchored to the store; deciding on its own clock, it would (the hazard the
/// anchoring removes, shown here so the test can fail).
pub async fn lease_skewed_host_cannot_take_over<S: Subject>(s: S)
where
    S::Lease: idem_core::TimeSource,
{
    let anchored = || async {
        let clock = idem_core::AnchoredClock::start(Arc::new(s.lease_store()), idem_core::AnchorOptions::default())
            .await
            .expect("the store's clock can be read");
        Arc::new(clock) as idem_core::SharedClock
    };
    let holder = lease_engine(&s).with_clock(anchored().await);
    let call = call_for(
        &unique_scope("op"),
        &IdempotencyKey::generate(),
        "{}",
        rejecting().with_lease_ms(60_000),
    );
    let lease = held(holder.acquire(&call).await.unwrap());
    let ahead = idem_core::ManualClock::new(idem_core::Clock::now_ms(&idem_core::SystemClock) + 600_000);
    let skewed_host = lease_engine(&s).with_clock(anchored().await);
    assert_in_flight(skewed_host.acquire(&call).await);
    let own_clock = lease_engine(&s).with_clock(Arc::new(ahead));
    let stolen = held(own_clock.acquire(&call).await.unwrap());
    assert!(
        stolen.token > lease.token,
        "on its own clock the skewed host took the live lease over"
    );
    own_clock.release(&stolen).await.unwrap();
}

/// `S` whose claims hand their answer over only after one more turn of the
/// scheduler: a caller dropped after its first poll has always left a claim
/// behind, committed by the store and never taken, whatever the store's
/// speed (an in-memory store answers within that first poll).
struct AnswersLate<S>(Arc<S>);

impl<S: idem_core::LeaseStore> idem_core::LeaseStore for AnswersLate<S> {
    fn try_claim<'a>(
        &'a self,
        req: &'a idem_core::ClaimRequest<'a>,
    ) -> idem_core::BoxFuture<'a, idem_core::Result<idem_core::LeaseClaim>> {
        Box::pin(async move {
            let claimed = self.0.try_claim(req).await;
            tokio::task::yield_now().await;
            claimed
        })
    }
    fn mark_sent<'a>(&'a self, lease: &'a Lease, now_ms: i64) -> idem_core::BoxFuture<'a, idem_core::Result<()>> {
        self.0.mark_sent(lease, now_ms)
    }
    fn lookup<'a>(
        &'a self,
        scope: &'a idem_core::Scope,
        key: &'a IdempotencyKey,
    ) -> idem_core::BoxFuture<'a, idem_core::Result<Option<idem_core::StoredRow>>> {
        self.0.lookup(scope, key)
    }
    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> idem_core::BoxFuture<'a, idem_core::Result<()>> {
        self.0.complete(lease, record)
    }
    fn release<'a>(&'a self, lease: &'a Lease) -> idem_core::BoxFuture<'a, idem_core::Result<()>> {
        self.0.release(lease)
    }
    fn extend<'a>(&'a self, lease: &'a Lease, until: i64) -> idem_core::BoxFuture<'a, idem_core::Result<()>> {
        self.0.extend(lease, until)
    }
    fn resolve_unknown<'a>(
        &'a self,
        req: &'a idem_core::Resolution<'a>,
    ) -> idem_core::BoxFuture<'a, idem_core::Result<bool>> {
        self.0.resolve_unknown(req)
    }
}

/// A claim whose caller went away while the store committed it (a dropped
/// request) is released, not left to wait for its lease to run out: both
/// when the store had not answered yet, and when its answer was there but
/// never taken.
pub async fn lease_abandoned_claim_is_released<S: Subject>(s: S) {
    let late = LeaseEngine::new(AnswersLate(Arc::new(s.lease_store())));
    let engine = lease_engine(&s);
    let scope = unique_scope("op");
    let mut calls: Vec<Call> = Vec::new();
    for i in 0..20 {
        calls.push(call_for(
            &scope,
            &IdempotencyKey::generate(),
            "{}",
            rejecting().with_lease_ms(60_000),
        ));
        let call = &calls[i];
        // Polled once, then dropped: the claim is in flight in the store, or
        // answered and waiting for a turn that never comes. Every other call
        // is dropped only after the store had time to answer.
        let mut acquiring = Box::pin(late.acquire(call));
        let polled = acquiring
            .as_mut()
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
        assert!(polled.is_pending(), "a claim answers only after one more turn");
        if i % 2 == 1 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(acquiring);
    }
    late.detached().idle().await;
    for call in &calls {
        match engine.acquire(call).await {
            Ok(Acquire::Claimed(lease)) => engine.release(&lease).await.unwrap(),
            other => panic!("an abandoned claim still holds its key: {other:?}"),
        }
    }
}

/// A heartbeat that extends a lease past the key's TTL keeps the key alive
/// with it, as a slow upstream needs: on the real clock (a store that expires
/// rows by a server-side TTL, like Redis, must move that too), no twin takes
/// the key over after the TTL has passed, the sweeper spares it, and the
/// holder records its outcome.
pub async fn lease_extend_outlives_the_key_ttl<S: Subject>(s: S) {
    let s = s.isolated().await;
    let engine = lease_engine(&s);
    let call = call_for(
        &unique_scope("op"),
        &IdempotencyKey::generate(),
        "{}",
        rejecting().with_ttl_secs(1).with_lease_ms(1_000),
    );
    let lease = held(engine.acquire(&call).await.unwrap());
    let lease = engine.extend(&lease, 4_000).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_in_flight(engine.acquire(&call).await);
    let now = idem_core::Clock::now_ms(&idem_core::SystemClock);
    let swept = s.sweeper().sweep_expired(now, 100).await.unwrap();
    assert_eq!(swept, 0, "the sweeper spares a claim whose lease outlives its TTL");
    assert_in_flight(engine.acquire(&call).await);
    let record = record_of(&Receipt::new(7));
    engine.complete(&lease, record.clone()).await.unwrap();
    assert_eq!(engine.acquire(&call).await.unwrap(), Acquire::Replay(record));
}

pub(crate) fn assert_unknown<T: std::fmt::Debug>(r: Result<T, Error>) {
    match r {
        Err(Error::OutcomeUnknown) => {}
        other => panic!("expected an unknown outcome, got {other:?}"),
    }
}

/// A key whose outcome is marked unknown is held: every later claim is told
/// so (never a new claim), however long after the lease ran out; the holder
/// can no longer complete, release or extend it; a different request is
/// still a mismatch; only the key's expiry frees it.
pub async fn lease_unknown_outcome_is_held<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, rejecting().with_lease_ms(1_000).with_ttl_secs(60));
    let (scope, key) = (call.scope().clone(), call.key().clone());
    let lease = held(engine.acquire(&call).await.unwrap());
    engine
        .mark_unknown(&lease, b"upstream answered 500".to_vec())
        .await
        .unwrap();
    assert_unknown(engine.acquire(&call).await);
    clock.advance(Duration::from_millis(5_000));
    assert_unknown(engine.acquire(&call).await);
    assert!(matches!(
        engine.complete(&lease, record_of(&Receipt::new(1))).await,
        Err(Error::Fenced)
    ));
    assert!(matches!(engine.release(&lease).await, Err(Error::Fenced)));
    assert!(matches!(engine.extend(&lease, 10_000).await, Err(Error::Fenced)));
    assert!(matches!(
        engine.mark_unknown(&lease, Vec::new()).await,
        Err(Error::Fenced)
    ));
    let other = call_for(&scope, &key, r#"{"a":2}"#, rejecting());
    assert!(matches!(engine.acquire(&other).await, Err(Error::Mismatch)));
    assert_unknown(engine.acquire(&call).await);
    clock.advance(Duration::from_millis(60_000));
    let again = held(engine.acquire(&call).await.unwrap());
    assert!(again.token > lease.token, "the key expired and was claimed anew");
}

/// An unknown outcome resolved as applied records the operator's outcome:
/// retries replay it, and resolving again changes nothing.
pub async fn lease_unknown_outcome_resolved_applied<S: Subject>(s: S) {
    let (engine, call, lease) = claimed(&s, rejecting()).await;
    let (scope, key) = (call.scope(), call.key());
    engine.mark_unknown(&lease, Vec::new()).await.unwrap();
    let record = record_of(&Receipt::new(7));
    assert!(engine.resolve_unknown(scope, key, Some(&record)).await.unwrap());
    assert_eq!(engine.acquire(&call).await.unwrap(), Acquire::Replay(record.clone()));
    let other = record_of(&Receipt::new(8));
    assert!(
        !engine.resolve_unknown(scope, key, Some(&other)).await.unwrap(),
        "a recorded outcome is not unknown"
    );
    assert!(!engine.resolve_unknown(scope, key, None).await.unwrap());
    assert_eq!(engine.acquire(&call).await.unwrap(), Acquire::Replay(record));
    assert!(matches!(
        engine
            .resolve_unknown(scope, key, Some(&Record::unknown(Vec::new())))
            .await,
        Err(Error::Config(_))
    ));
}

/// An unknown outcome resolved as not applied frees the key: the next claim
/// runs. Resolving leaves every other state alone: no row, a live claim, an
/// expired unknown outcome.
pub async fn lease_unknown_outcome_resolved_not_applied<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, rejecting().with_ttl_secs(60));
    let (scope, key) = (call.scope().clone(), call.key().clone());
    assert!(!engine.resolve_unknown(&scope, &key, None).await.unwrap(), "no row");
    let lease = held(engine.acquire(&call).await.unwrap());
    assert!(
        !engine.resolve_unknown(&scope, &key, None).await.unwrap(),
        "a live claim is not unknown"
    );
    engine.mark_unknown(&lease, Vec::new()).await.unwrap();
    assert!(engine.resolve_unknown(&scope, &key, None).await.unwrap());
    let runs = Runs::default();
    let outcome = run_receipt::<S>(&engine, &call, &runs).await.unwrap();
    assert!(!outcome.is_replayed());
    assert_eq!(runs.get(), 1, "the released key ran again");
    // An expired unknown outcome is the sweeper's, not the operator's.
    let key2 = IdempotencyKey::generate();
    let call2 = call_for(&scope, &key2, "{}", rejecting().with_ttl_secs(60));
    let lease2 = held(engine.acquire(&call2).await.unwrap());
    engine.mark_unknown(&lease2, Vec::new()).await.unwrap();
    clock.advance(Duration::from_millis(61_000));
    let record = record_of(&Receipt::new(1));
    assert!(!engine.resolve_unknown(&scope, &key2, Some(&record)).await.unwrap());
}

/// Many tasks on two pools, on one key whose outcome is unknown: every
/// claimer is told so, and of many concurrent resolutions exactly one
/// takes; then many claimers run the work once.
pub async fn lease_unknown_outcome_resolved_once_under_concurrency<S: Subject>(s: S) {
    let other = s.another().await;
    let engines = [Arc::new(lease_engine(&s)), Arc::new(lease_engine(&other))];
    let scope = unique_scope("op");
    let key = IdempotencyKey::generate();
    let call = call_for(&scope, &key, "{}", waiting(120_000));
    let lease = held(engines[0].acquire(&call).await.unwrap());
    engines[0].mark_unknown(&lease, Vec::new()).await.unwrap();
    let claims: Vec<_> = (0..32)
        .map(|i| {
            let (engine, call) = (engines[i % 2].clone(), call.clone());
            tokio::spawn(async move { engine.acquire(&call).await })
        })
        .collect();
    for t in claims {
        assert_unknown(t.await.unwrap());
    }
    let resolutions: Vec<_> = (0..32)
        .map(|i| {
            let (engine, scope, key) = (engines[i % 2].clone(), scope.clone(), key.clone());
            tokio::spawn(async move { engine.resolve_unknown(&scope, &key, None).await.unwrap() })
        })
        .collect();
    let mut taken = 0;
    for t in resolutions {
        taken += usize::from(t.await.unwrap());
    }
    assert_eq!(taken, 1, "exactly one resolution took");
    let runs = Runs::default();
    run_together::<S>(&engines, &call, 32, &runs).await;
    assert_eq!(runs.get(), 1, "the work ran once after the release");
}
