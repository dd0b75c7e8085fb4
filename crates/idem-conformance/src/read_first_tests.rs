//! Transactional-mode behaviours of an engine that reads the key's committed
//! row before it claims ([`TxEngine::with_read_first`]): a recorded outcome
//! is answered from the read without a transaction, and everything else is
//! the claim's, as without the read.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{
    ClaimRequest, Error, IdempotencyKey, KeyRegistry, LeaseEngine, Outcome, Policy, ReadFirst, Record, StoredRow,
    TxClaim, TxEngine,
};

use crate::lease_tests::{assert_in_flight, assert_unknown, held};
use crate::tx_tests::{
    concurrent_64_tasks_one_key_on, effects, executes_then_replays, run_answering, run_receipt,
    twin_waits_then_replays_on,
};
use crate::*;

/// A transactional backend that counts the transactions it opens (`begin`,
/// `begin_claim`, and `read_then_claim` when it claims) and forwards
/// everything to the store it wraps; its clones share the count.
#[derive(Clone)]
pub struct CountingClaims<B> {
    inner: B,
    opened: Arc<AtomicUsize>,
}

impl<B> CountingClaims<B> {
    /// Wraps `inner`, with no transaction opened yet.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            opened: Arc::default(),
        }
    }

    /// How many transactions have been opened through this wrapper and its
    /// clones.
    pub fn opened(&self) -> usize {
        self.opened.load(Ordering::SeqCst)
    }
}

impl<B: TxBackend> TxBackend for CountingClaims<B> {
    type Tx = B::Tx;

    fn begin(&self) -> BoxFuture<'_, idem_core::Result<B::Tx>> {
        self.opened.fetch_add(1, Ordering::SeqCst);
        self.inner.begin()
    }

    fn claim<'a>(
        &'a self,
        tx: &'a mut B::Tx,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, idem_core::Result<TxClaim>> {
        self.inner.claim(tx, req, wait)
    }

    fn record<'a>(
        &'a self,
        tx: &'a mut B::Tx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, idem_core::Result<()>> {
        self.inner.record(tx, req, record)
    }

    fn commit(&self, tx: B::Tx) -> BoxFuture<'_, idem_core::Result<()>> {
        self.inner.commit(tx)
    }

    fn rollback(&self, tx: B::Tx) -> BoxFuture<'_, idem_core::Result<()>> {
        self.inner.rollback(tx)
    }

    fn begin_claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, idem_core::Result<(B::Tx, TxClaim)>> {
        self.opened.fetch_add(1, Ordering::SeqCst);
        self.inner.begin_claim(req, wait)
    }

    fn record_commit<'a>(
        &'a self,
        tx: B::Tx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, idem_core::Result<()>> {
        self.inner.record_commit(tx, req, record)
    }

    fn read_committed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> Option<BoxFuture<'a, idem_core::Result<Option<StoredRow>>>> {
        self.inner.read_committed(scope, key)
    }

    /// The store's own, counted when it claims.
    fn read_then_claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, idem_core::Result<ReadFirst<B::Tx>>> {
        Box::pin(async move {
            let answer = self.inner.read_then_claim(req, wait).await?;
            if matches!(answer, ReadFirst::Claim(..)) {
                self.opened.fetch_add(1, Ordering::SeqCst);
            }
            Ok(answer)
        })
    }

    fn local_registry(&self) -> Option<&KeyRegistry> {
        self.inner.local_registry()
    }
}

/// A read-first engine on `s` whose transactions are counted.
fn counting<S: Subject>(s: &S) -> TxEngine<CountingClaims<S::Backend>> {
    let engine = TxEngine::new(CountingClaims::new(s.backend())).with_read_first(true);
    assert!(engine.reads_first());
    engine
}

fn opened<B>(engine: &TxEngine<CountingClaims<B>>) -> usize
where
    CountingClaims<B>: TxBackend,
{
    engine.backend().opened()
}

async fn receipt<S: Subject>(
    engine: &TxEngine<CountingClaims<S::Backend>>,
    call: &Call,
    eid: &str,
    runs: &Runs,
    amount: i64,
) -> Result<Outcome<Receipt>, TestError> {
    run_answering::<S, _, _>(engine, call, eid, runs, move |_| Ok(Receipt::new(amount))).await
}

/// Retries of a recorded key replay it without opening a transaction; a
/// different request is a mismatch, again without one; the same key in
/// another tenant's scope is its own key.
pub async fn read_first_replays_without_a_transaction<S: Subject>(s: S) {
    let engine = counting(&s);
    let scope = unique_scope("POST /v1/transfers");
    let key = IdempotencyKey::generate();
    let call = call_for(&scope, &key, r#"{"amount":5}"#, Policy::default());
    let (eid, runs) = (effect_id(), Runs::default());
    executes_then_replays::<S, _>(&engine, &call, &eid, &runs).await;
    assert_eq!(opened(&engine), 1, "only the first call claims, in a transaction");
    let other = call_for(&scope, &key, r#"{"amount":6}"#, Policy::default());
    match receipt::<S>(&engine, &other, &eid, &runs, 6).await {
        Err(TestError::Idem(Error::Mismatch)) => {}
        other => panic!("expected a mismatch, got {other:?}"),
    }
    assert_eq!(opened(&engine), 1, "replays and mismatches open no transaction");
    assert_eq!(runs.get(), 1, "the work ran once");
    let elsewhere = unique_scope("POST /v1/transfers");
    let theirs = call_for(&elsewhere, &key, r#"{"amount":5}"#, Policy::default());
    let eid_theirs = effect_id();
    let out = receipt::<S>(&engine, &theirs, &eid_theirs, &runs, 7).await.unwrap();
    assert!(!out.is_replayed(), "another tenant's key of the same name executes");
    assert_eq!(out.value().amount, 7, "with its own outcome");
    assert_eq!(effects(&s, &eid).await, 1);
    assert_eq!(effects(&s, &eid_theirs).await, 1);
}

/// A recorded key past its TTL is not answered from the read: it is
/// claimed and executes anew.
pub async fn read_first_claims_an_expired_key<S: Subject>(s: S) {
    let (clock, shared) = manual_clock();
    let engine = counting(&s).with_clock(shared);
    let call = fresh_call("POST /v1/transfers", "{}", Policy::default().with_ttl_secs(60));
    let (eid, runs) = (effect_id(), Runs::default());
    let first = receipt::<S>(&engine, &call, &eid, &runs, 1).await.unwrap();
    clock.advance(Duration::from_secs(59));
    assert!(
        receipt::<S>(&engine, &call, &eid, &runs, 1)
            .await
            .unwrap()
            .is_replayed()
    );
    assert_eq!(opened(&engine), 1, "alive at 59 s: answered from the read");
    clock.advance(Duration::from_secs(2));
    let anew = receipt::<S>(&engine, &call, &eid, &runs, 1).await.unwrap();
    assert!(!anew.is_replayed(), "expired at 61 s: executes anew");
    assert_ne!(anew.value(), first.value());
    assert_eq!(opened(&engine), 2);
    assert_eq!(effects(&s, &eid).await, 2);
}

/// A twin's claim not yet committed is invisible to the read: the call
/// waits on the claim as without the read, then replays (a check of
/// safety: it holds with the read or without it).
pub async fn read_first_twin_waits_then_replays<S: Subject>(s: S) {
    twin_waits_then_replays_on(&s, Arc::new(tx_engine(&s).with_read_first(true))).await;
}

/// 64 concurrent read-first tasks on one key across two pools: one effect
/// (a check of safety: it holds with the read or without it).
pub async fn read_first_concurrent_64_tasks_one_key_one_effect<S: Subject>(s: S) {
    let other = s.another().await;
    let engines = [
        Arc::new(tx_engine(&s).with_read_first(true)),
        Arc::new(tx_engine(&other).with_read_first(true)),
    ];
    concurrent_64_tasks_one_key_on(&s, engines).await;
}

/// A lease in progress on the key is the claim's to answer (in flight),
/// and an unknown outcome recorded on it is held, as without the read.
pub async fn read_first_leaves_a_lease_to_the_claim<S: Subject>(s: S) {
    let lease_engine = LeaseEngine::new(s.lease_store());
    let call = fresh_call("POST /v1/transfers", "{}", rejecting());
    let lease = held(lease_engine.acquire(&call).await.unwrap());
    let engine = counting(&s);
    let (eid, runs) = (effect_id(), Runs::default());
    let in_flight = receipt::<S>(&engine, &call, &eid, &runs, 1).await;
    assert_in_flight(in_flight.map_err(|e| match e {
        TestError::Idem(e) => e,
        other => panic!("expected an idem error, got {other:?}"),
    }));
    assert_eq!(opened(&engine), 1, "a lease in progress goes to the claim");
    lease_engine.mark_unknown(&lease, b"timed out".to_vec()).await.unwrap();
    let unknown = receipt::<S>(&engine, &call, &eid, &runs, 1).await;
    assert_unknown(unknown.map_err(|e| match e {
        TestError::Idem(e) => e,
        other => panic!("expected an idem error, got {other:?}"),
    }));
    assert_eq!(
        opened(&engine),
        1,
        "a recorded unknown outcome is answered from the read"
    );
    assert_eq!(runs.get(), 0, "the work never ran");
    assert_eq!(effects(&s, &eid).await, 0);
}

/// A read the store refuses, times out or loses fails the call with
/// nothing run or written, on a new key and on a recorded one; the call
/// made again executes once, then replays.
pub async fn read_first_failed_read_runs_nothing<S: Subject>(s: S) {
    use idem_faults::{Fault, FaultPlan, Faulty, Op};
    let store = Faulty::new(s.backend(), FaultPlan::none());
    let engine = TxEngine::new(store.clone()).with_read_first(true);
    for fault in [Fault::Refused, Fault::TimedOut, Fault::AppliedThenRefused] {
        let call = fresh_call("POST /v1/transfers", r#"{"amount":5}"#, Policy::default());
        let (eid, runs) = (effect_id(), Runs::default());
        let run = || run_answering::<S, _, _>(&engine, &call, &eid, &runs, |_| Ok(Receipt::new(5)));
        store.faults().fail_next(Op::Lookup, fault);
        let failed = run().await;
        assert!(failed.is_err(), "{fault:?}: the caller hears the read fail: {failed:?}");
        assert_eq!((runs.get(), effects(&s, &eid).await), (0, 0), "{fault:?}: nothing ran");
        let first = run().await.unwrap();
        assert!(!first.is_replayed(), "{fault:?}: the call made again executes");
        store.faults().fail_next(Op::Lookup, fault);
        assert!(
            run().await.is_err(),
            "{fault:?}: a recorded key's failed read fails the call"
        );
        let again = run().await.unwrap();
        assert!(again.is_replayed(), "{fault:?}: then it replays");
        assert_eq!(again.value(), first.value());
        assert_eq!(
            (runs.get(), effects(&s, &eid).await),
            (1, 1),
            "{fault:?}: the effect once"
        );
    }
    assert_eq!(store.faults().total(), 6);
}

/// For a store that serialises claims in a local registry (SQLite, the
/// memory store; it fails on any other): a read-first retry of a recorded
/// key is answered without waiting for the key's place there, so a claim
/// holding it delays no replay, even under a policy that refuses twins.
/// Without the read the same retry meets the place held and is in flight.
pub async fn read_first_replay_takes_no_registry_place<S: Subject>(s: S) {
    let engine = tx_engine(&s).with_read_first(true);
    let call = fresh_call("POST /v1/transfers", "{}", rejecting());
    let (eid, runs) = (effect_id(), Runs::default());
    let first = run_receipt::<S>(&engine, &call, &eid, &runs, 3).await.unwrap();
    let backend = s.backend();
    let registry = backend
        .local_registry()
        .expect("a store that serialises claims in a local registry");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let _held = registry
        .acquire(call.scope(), call.key(), deadline)
        .await
        .unwrap()
        .expect("the key's place is free");
    let again = run_receipt::<S>(&engine, &call, &eid, &runs, 4).await.unwrap();
    assert!(again.is_replayed(), "answered from the read");
    assert_eq!(again.value(), first.value());
    match run_receipt::<S>(&tx_engine(&s), &call, &eid, &runs, 5).await {
        Err(TestError::Idem(Error::InFlight { .. })) => {}
        other => panic!("without the read the held place answers in flight, got {other:?}"),
    }
    assert_eq!((runs.get(), effects(&s, &eid).await), (1, 1));
}
