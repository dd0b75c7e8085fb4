//! Sent claims: a lease marked sent before its request left the holder's
//! process is never taken over, and every recovery path treats it as an
//! unknown outcome; outcomes the store refused are tried again.

use std::time::Duration;

use idem_core::{Acquire, Error, IdempotencyKey, Lease, LeaseEngine, Outcome, Record, RowState, StoredRow};

use crate::lease_tests::{assert_in_flight, assert_unknown, held};
use idem_faults::{Fault, FaultPlan, Faulty, Op};

use crate::*;

async fn row<S: Subject>(engine: &LeaseEngine<S::Lease>, lease: &Lease) -> StoredRow {
    engine
        .lookup(&lease.scope, &lease.key)
        .await
        .unwrap()
        .expect("the key has a row")
}

/// A sent claim whose lease runs out is held as an unknown outcome, never
/// taken over, however long after; its holder can still complete it with
/// its token, and that outcome is replayed.
pub async fn sent_claim_is_never_taken_over<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, rejecting().with_lease_ms(1_000).with_ttl_secs(600));
    let lease = held(engine.acquire(&call).await.unwrap());
    let sent_at = idem_core::Clock::now_ms(&clock);
    engine.mark_sent(&lease).await.unwrap();
    assert_in_flight(engine.acquire(&call).await);
    let seen = row::<S>(&engine, &lease).await;
    assert!(
        matches!(seen.state, RowState::Sent { token, .. } if token == lease.token),
        "{seen:?}"
    );
    assert_eq!(seen.sent_at_ms, Some(sent_at));
    clock.advance(Duration::from_millis(1_001));
    assert_unknown(engine.acquire(&call).await);
    clock.advance(Duration::from_secs(300));
    assert_unknown(engine.acquire(&call).await);
    let record = Record::completed(b"{\"paid\":true}".to_vec());
    engine.complete(&lease, record.clone()).await.unwrap();
    assert_eq!(engine.acquire(&call).await.unwrap(), Acquire::Replay(record));
    assert_eq!(
        row::<S>(&engine, &lease).await.sent_at_ms,
        Some(sent_at),
        "completing keeps the time of the mark"
    );
}

/// The mark keeps the earliest time; a stale holder can mark nothing; an
/// unknown outcome recorded after the mark keeps the mark's time.
pub async fn sent_mark_keeps_the_earliest_time<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, rejecting().with_lease_ms(10_000));
    let lease = held(engine.acquire(&call).await.unwrap());
    let first = idem_core::Clock::now_ms(&clock);
    engine.mark_sent(&lease).await.unwrap();
    clock.advance(Duration::from_millis(500));
    engine.mark_sent(&lease).await.unwrap();
    let lease = engine.extend(&lease, 10_000).await.unwrap();
    assert_eq!(row::<S>(&engine, &lease).await.sent_at_ms, Some(first));
    engine
        .mark_unknown(&lease, b"upstream timed out".to_vec())
        .await
        .unwrap();
    let seen = row::<S>(&engine, &lease).await;
    assert!(seen.is_unknown_at(idem_core::Clock::now_ms(&clock)), "{seen:?}");
    assert_eq!(
        seen.sent_at_ms,
        Some(first),
        "the unknown outcome keeps the mark's time"
    );
    assert!(matches!(engine.mark_sent(&lease).await, Err(Error::Fenced)));
    // A claim that was released cannot be marked by its old holder.
    let other = call_for(call.scope(), &IdempotencyKey::generate(), "{}", rejecting());
    let a = held(engine.acquire(&other).await.unwrap());
    engine.release(&a).await.unwrap();
    let b = held(engine.acquire(&other).await.unwrap());
    assert!(matches!(engine.mark_sent(&a).await, Err(Error::Fenced)));
    assert_eq!(row::<S>(&engine, &b).await.sent_at_ms, None, "never marked");
    engine.release(&b).await.unwrap();
}

/// A key claimed anew once its sent claim expired starts afresh: the new
/// claim is not held, and its own mark's time is the one kept, not the
/// expired claim's.
pub async fn sent_mark_of_a_new_claim_starts_afresh<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, rejecting().with_lease_ms(1_000).with_ttl_secs(60));
    let old = held(engine.acquire(&call).await.unwrap());
    engine.mark_sent(&old).await.unwrap();
    engine.mark_unknown(&old, b"timed out".to_vec()).await.unwrap();
    clock.advance(Duration::from_secs(61));
    let new = held(engine.acquire(&call).await.unwrap());
    assert!(new.token > old.token);
    let fresh = row::<S>(&engine, &new).await;
    assert_eq!(
        fresh.state,
        RowState::InProgress {
            token: new.token,
            lease_expires_at_ms: new.lease_expires_at_ms
        }
    );
    assert_eq!(fresh.sent_at_ms, None, "the expired claim's mark is gone");
    let marked_at = idem_core::Clock::now_ms(&clock);
    engine.mark_sent(&new).await.unwrap();
    assert_eq!(row::<S>(&engine, &new).await.sent_at_ms, Some(marked_at));
    engine.release(&new).await.unwrap();
}

/// A sent claim is resolved like an unknown outcome once its lease has run
/// out, never while it lives; "not applied" frees the key for a new claim
/// that fences the old holder, "applied" records the outcome.
pub async fn sent_claim_resolved_like_unknown<S: Subject>(s: S) {
    let (clock, shared) = manual_clock();
    let engine = lease_engine(&s).with_clock(shared);
    let scope = unique_scope("op");
    for applied in [false, true] {
        let key = IdempotencyKey::generate();
        let call = call_for(&scope, &key, "{}", rejecting().with_lease_ms(1_000));
        let lease = held(engine.acquire(&call).await.unwrap());
        engine.mark_sent(&lease).await.unwrap();
        let record = Record::completed(b"{\"found\":true}".to_vec());
        let resolution = applied.then_some(&record);
        assert!(
            !engine.resolve_unknown(&scope, &key, resolution).await.unwrap(),
            "a live sent claim is not resolved"
        );
        clock.advance(Duration::from_millis(1_500));
        assert!(engine.resolve_unknown(&scope, &key, resolution).await.unwrap());
        assert!(
            !engine.resolve_unknown(&scope, &key, resolution).await.unwrap(),
            "resolved once"
        );
        if applied {
            assert_eq!(engine.acquire(&call).await.unwrap(), Acquire::Replay(record));
        } else {
            let again = held(engine.acquire(&call).await.unwrap());
            assert!(again.token > lease.token);
            assert!(matches!(
                engine.complete(&lease, Record::completed(b"1".to_vec())).await,
                Err(Error::Fenced)
            ));
            engine.release(&again).await.unwrap();
        }
    }
}

/// The holder of a sent claim extends and releases it like any claim (it
/// knows the answer: nothing is in flight any more).
pub async fn sent_claim_holder_extends_and_releases<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, rejecting().with_lease_ms(1_000));
    let lease = held(engine.acquire(&call).await.unwrap());
    engine.mark_sent(&lease).await.unwrap();
    clock.advance(Duration::from_millis(800));
    let lease = engine.extend(&lease, 1_000).await.unwrap();
    clock.advance(Duration::from_millis(800));
    assert_in_flight(engine.acquire(&call).await);
    engine.release(&lease).await.unwrap();
    let again = held(engine.acquire(&call).await.unwrap());
    engine.release(&again).await.unwrap();
}

/// `run` marks the key sent before its work runs: a run dropped mid-work
/// leaves an unknown outcome once its lease runs out, never a key a twin
/// takes over and runs again.
pub async fn sent_dropped_run_is_held_not_taken_over<S: Subject>(s: S) {
    let (clock, engine, call) = clocked_lease(&s, rejecting().with_lease_ms(1_000));
    let (scope, key) = (call.scope().clone(), call.key().clone());
    // The run is dropped once its work has started, however long the claim
    // and the mark took to get there.
    let (started, mut working) = tokio::sync::mpsc::channel::<()>(1);
    tokio::select! {
        done = engine.run(&call, move |_lease| async move {
            let _ = started.send(()).await;
            std::future::pending::<()>().await;
            Ok::<_, TestError>(Receipt::new(1))
        }) => panic!("the work never ends, yet the run returned {done:?}"),
        _ = working.recv() => {}
    }
    assert_in_flight(engine.acquire(&call).await);
    clock.advance(Duration::from_millis(1_001));
    assert_unknown(engine.acquire(&call).await);
    let runs = Runs::default();
    let again = run_counted(&engine, &call, &runs, 2).await;
    assert!(
        matches!(again, Err(TestError::Idem(Error::OutcomeUnknown))),
        "{again:?}"
    );
    assert_eq!(runs.get(), 0, "nothing ran again");
    assert!(engine.resolve_unknown(&scope, &key, None).await.unwrap());
    let lease = held(engine.acquire(&call).await.unwrap());
    engine.release(&lease).await.unwrap();
}

/// A completion the store refuses, times out on, or applies and reports as
/// failed is tried again: the outcome is recorded once, the work ran once,
/// and every retry replays it.
pub async fn sent_refused_completion_is_retried<S: Subject>(s: S) {
    let store = Faulty::new(s.lease_store(), FaultPlan::none());
    let engine = LeaseEngine::new(store.clone());
    let scope = unique_scope("op");
    let runs = Runs::default();
    for faults in [
        vec![Fault::Refused, Fault::Refused, Fault::TimedOut],
        vec![Fault::AppliedThenRefused],
        vec![Fault::Refused, Fault::AppliedThenRefused],
    ] {
        let call = call_for(&scope, &IdempotencyKey::generate(), "{}", rejecting());
        for fault in &faults {
            store.faults().fail_next(Op::Complete, *fault);
        }
        let before = store.faults().calls(Op::Complete);
        let first = run_counted(&engine, &call, &runs, 9).await.unwrap();
        assert!(!first.is_replayed());
        assert_eq!(
            store.faults().calls(Op::Complete) - before,
            faults.len() as u64 + 1,
            "{faults:?}: one try per fault, and one that was answered"
        );
        let again = run_counted(&engine, &call, &runs, 0).await.unwrap();
        assert_eq!(again, Outcome::Replayed(first.into_inner()), "{faults:?}");
    }
    assert_eq!(runs.get(), 3, "each work ran once");
}

/// A release the store refuses is tried again, and one applied but
/// reported as failed is recognised: the key is free either way.
pub async fn sent_refused_release_is_retried<S: Subject>(s: S) {
    let store = Faulty::new(s.lease_store(), FaultPlan::none());
    let engine = LeaseEngine::new(store.clone());
    let scope = unique_scope("op");
    for fault in [Fault::Refused, Fault::AppliedThenRefused] {
        let call = call_for(&scope, &IdempotencyKey::generate(), "{}", rejecting());
        store.faults().fail_next(Op::Release, fault);
        let out = engine
            .run(&call, |_| async {
                Err::<Receipt, _>(TestError::Work("declined".into()))
            })
            .await;
        assert!(matches!(out, Err(TestError::Work(_))), "{out:?}");
        let lease = held(engine.acquire(&call).await.unwrap());
        engine.release(&lease).await.unwrap();
    }
}

/// A mark the store refuses sends nothing: `run` fails before its work
/// starts and the key is free again.
pub async fn sent_refused_mark_runs_nothing<S: Subject>(s: S) {
    let store = Faulty::new(s.lease_store(), FaultPlan::none());
    let engine = LeaseEngine::new(store.clone());
    let call = fresh_call("op", "{}", rejecting());
    store.faults().fail_next(Op::MarkSent, Fault::Refused);
    let runs = Runs::default();
    let out = run_counted(&engine, &call, &runs, 1).await;
    assert!(
        matches!(out, Err(TestError::Idem(ref e)) if e.is_retryable()),
        "{out:?}"
    );
    assert_eq!(runs.get(), 0, "nothing ran without the mark");
    let again = run_counted(&engine, &call, &runs, 0).await.unwrap();
    assert!(!again.is_replayed());
    assert_eq!(runs.get(), 1);
}
