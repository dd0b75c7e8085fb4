//! Transactional-mode behaviours.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Begin, Call, Error, IdempotencyKey, Outcome, Policy, Record, RecordStatus, TxEngine};

use crate::*;

pub(crate) async fn run_receipt<S: Subject>(
    engine: &TxEngine<S::Backend>,
    call: &Call,
    eid: &str,
    runs: &Runs,
    amount: i64,
) -> Result<Outcome<Receipt>, TestError> {
    run_answering::<S, _, _>(engine, call, eid, runs, move |_| Ok(Receipt::new(amount))).await
}

/// Runs `call` on `engine` (on the subject's transactions) with the work of
/// [`writing`].
pub(crate) async fn run_answering<S, B, T>(
    engine: &TxEngine<B>,
    call: &Call,
    eid: &str,
    runs: &Runs,
    answer: impl Fn(usize) -> Result<T, TestError> + Clone + Send + 'static,
) -> Result<Outcome<T>, TestError>
where
    S: Subject,
    B: TxBackend<Tx = <S::Backend as TxBackend>::Tx>,
    T: Serialize + serde::de::DeserializeOwned + Send + 'static,
{
    engine.execute(call, writing::<S, T>(eid, runs, answer)).await
}

async fn run_decline<S: Subject>(
    engine: &TxEngine<S::Backend>,
    call: &Call,
    eid: &str,
    runs: &Runs,
    decline: Option<Decline>,
) -> Result<Outcome<Result<Receipt, Decline>>, TestError> {
    let answer = move |_| {
        Ok(match decline.clone() {
            Some(d) => Err(d),
            None => Ok(Receipt::new(1)),
        })
    };
    engine
        .execute_with_rejections(call, writing::<S, _>(eid, runs, answer))
        .await
}

/// Work on the subject's transactions that notes its run in `runs`, writes
/// the effect `eid`, then answers what `answer` makes of the runs so far.
fn writing<S: Subject, T: Send + 'static>(
    eid: &str,
    runs: &Runs,
    answer: impl Fn(usize) -> Result<T, TestError> + Clone + Send + 'static,
) -> impl for<'c> FnMut(&'c mut <S::Backend as TxBackend>::Tx) -> BoxFuture<'c, Result<T, TestError>> {
    let (eid, runs) = (eid.to_owned(), runs.clone());
    move |tx| {
        let (eid, runs, answer) = (eid.clone(), runs.clone(), answer.clone());
        Box::pin(async move {
            runs.hit();
            S::write_effect(tx, eid).await?;
            answer(runs.get())
        })
    }
}

pub(crate) async fn effects<S: Subject>(s: &S, eid: &str) -> u64 {
    s.count_effects(eid.to_owned()).await.expect("count effects")
}

fn claimed<Tx>(begin: Begin<Tx>) -> idem_core::Claimed<Tx> {
    match begin {
        Begin::Claimed(c) => c,
        Begin::Replay(r) => panic!("expected a claim, got a replay of {r:?}"),
    }
}

/// Runs `call` on `engine` with the work of `eid`: it executes, then three
/// retries replay its outcome without running. Answers the first outcome.
pub(crate) async fn executes_then_replays<S, B>(
    engine: &TxEngine<B>,
    call: &Call,
    eid: &str,
    runs: &Runs,
) -> Outcome<Receipt>
where
    S: Subject,
    B: TxBackend<Tx = <S::Backend as TxBackend>::Tx>,
{
    let first = run_answering::<S, _, _>(engine, call, eid, runs, |_| Ok(Receipt::new(5)))
        .await
        .unwrap();
    assert!(!first.is_replayed(), "the first call executes");
    for _ in 0..3 {
        let again = run_answering::<S, _, _>(engine, call, eid, runs, |_| Ok(Receipt::new(999)))
            .await
            .unwrap();
        assert!(again.is_replayed(), "a retry is a replay");
        assert_eq!(again.value(), first.value(), "the replay is the first outcome");
    }
    first
}

/// A retry replays the recorded value exactly and never runs the work again.
pub async fn replay_is_verbatim<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let scope = unique_scope("POST /v1/transfers");
    let key = IdempotencyKey::generate();
    let call = call_for(&scope, &key, r#"{"amount":5}"#, Policy::default());
    let (eid, runs) = (effect_id(), Runs::default());
    executes_then_replays::<S, _>(&engine, &call, &eid, &runs).await;
    // The same JSON with other key order and spacing is the same request.
    let reordered = call_for(&scope, &key, "{ \"amount\" : 5 }", Policy::default());
    assert!(
        run_receipt::<S>(&engine, &reordered, &eid, &runs, 7)
            .await
            .unwrap()
            .is_replayed()
    );
    assert_eq!(runs.get(), 1, "the work ran once");
    assert_eq!(effects(&s, &eid).await, 1, "the effect exists once");
}

/// Arbitrary bytes (every byte value, a large payload) are stored and replayed exactly, with their status.
pub async fn raw_record_bytes_replay_exactly<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let scope = unique_scope("raw");
    let mut payload: Vec<u8> = (0..=255u8).collect();
    payload.extend(std::iter::repeat_n(0xA5u8, 300_000));
    for status in [RecordStatus::Completed, RecordStatus::Rejected] {
        let key = IdempotencyKey::generate();
        let call = call_for(&scope, &key, "{}", Policy::default());
        let c = claimed(engine.begin(&call).await.unwrap());
        let record = Record {
            status,
            payload: payload.clone(),
        };
        engine.commit(c, record.clone()).await.unwrap();
        match engine.begin(&call).await.unwrap() {
            Begin::Replay(r) => assert_eq!(r, record, "replayed record is byte-identical"),
            Begin::Claimed(_) => panic!("a recorded key must replay"),
        }
    }
}

/// The same key with a different request is an error, and nothing runs.
pub async fn mismatch_is_an_error_and_runs_nothing<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let scope = unique_scope("POST /v1/transfers");
    let key = IdempotencyKey::generate();
    let (eid, runs) = (effect_id(), Runs::default());
    run_receipt::<S>(
        &engine,
        &call_for(&scope, &key, r#"{"amount":5}"#, Policy::default()),
        &eid,
        &runs,
        5,
    )
    .await
    .unwrap();
    let other = call_for(&scope, &key, r#"{"amount":6}"#, Policy::default());
    let err = run_receipt::<S>(&engine, &other, &eid, &runs, 6).await.unwrap_err();
    assert!(matches!(err, TestError::Idem(Error::Mismatch)), "got {err:?}");
    assert_eq!(runs.get(), 1);
    assert_eq!(effects(&s, &eid).await, 1);
}

/// A rejection rolls the work's writes back and leaves the key usable.
pub async fn rejection_leaves_key_unused<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let call = fresh_call("POST /v1/transfers", r#"{"amount":5}"#, Policy::default());
    let (eid, runs) = (effect_id(), Runs::default());
    let declined = run_decline::<S>(
        &engine,
        &call,
        &eid,
        &runs,
        Some(Decline::InsufficientFunds { short_by: 3 }),
    )
    .await
    .unwrap();
    assert_eq!(
        declined,
        Outcome::Executed(Err(Decline::InsufficientFunds { short_by: 3 }))
    );
    assert_eq!(effects(&s, &eid).await, 0, "a rejection's writes roll back");
    let ok = run_decline::<S>(&engine, &call, &eid, &runs, None).await.unwrap();
    assert!(
        matches!(ok, Outcome::Executed(Ok(_))),
        "the same key runs again: {ok:?}"
    );
    let replay = run_decline::<S>(&engine, &call, &eid, &runs, None).await.unwrap();
    assert_eq!(replay, Outcome::Replayed(ok.clone().into_inner()));
    assert_eq!(effects(&s, &eid).await, 1);
    assert_eq!(runs.get(), 2);
}

/// An error from the work rolls everything back and leaves the key usable.
pub async fn error_leaves_key_unused<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let call = fresh_call("POST /v1/transfers", "{}", Policy::default());
    let (eid, runs) = (effect_id(), Runs::default());
    let err = run_answering::<S, _, _>(&engine, &call, &eid, &runs, |_| {
        Err::<Receipt, _>(TestError::Work("fault after the write".into()))
    })
    .await
    .unwrap_err();
    assert!(matches!(err, TestError::Work(_)));
    assert_eq!(effects(&s, &eid).await, 0, "the fault's writes roll back");
    let ok = run_receipt::<S>(&engine, &call, &eid, &runs, 1).await.unwrap();
    assert!(!ok.is_replayed(), "the key was left unused");
    assert_eq!(effects(&s, &eid).await, 1);
}

/// A panic in the work rolls everything back and leaves the key usable.
pub async fn panic_leaves_key_unused<S: Subject>(s: S) {
    let engine = Arc::new(tx_engine(&s));
    let call = fresh_call("POST /v1/transfers", "{}", waiting(20_000));
    let eid = effect_id();
    let task = {
        let (engine, call, eid) = (engine.clone(), call.clone(), eid.clone());
        tokio::spawn(async move {
            engine
                .execute(&call, move |tx| {
                    let eid = eid.clone();
                    Box::pin(async move {
                        S::write_effect(tx, eid).await?;
                        if panics() {
                            panic!("work panicked after its write");
                        }
                        Ok::<Receipt, TestError>(Receipt::new(1))
                    })
                })
                .await
        })
    };
    let joined = task.await;
    assert!(joined.is_err_and(|e| e.is_panic()), "the work panicked");
    assert_eq!(effects(&s, &eid).await, 0, "the panicking work's writes roll back");
    let runs = Runs::default();
    let ok = run_receipt::<S>(&engine, &call, &eid, &runs, 1).await.unwrap();
    assert!(!ok.is_replayed(), "the key was left unused");
    assert_eq!(effects(&s, &eid).await, 1);
}

/// Always true; a plain `panic!` would leave the work's `Ok` unreachable
/// and its type uninferable.
fn panics() -> bool {
    true
}

/// Dropping the call's future mid-work rolls everything back and leaves the key usable.
pub async fn dropped_future_leaves_key_unused<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let call = fresh_call("POST /v1/transfers", "{}", waiting(20_000));
    let eid = effect_id();
    let eid2 = eid.clone();
    let (wrote_tx, wrote_rx) = tokio::sync::oneshot::channel::<()>();
    let mut wrote_tx = Some(wrote_tx);
    let fut = engine.execute(&call, move |tx| {
        let (eid2, wrote_tx) = (eid2.clone(), wrote_tx.take());
        Box::pin(async move {
            S::write_effect(tx, eid2).await?;
            if let Some(wrote_tx) = wrote_tx {
                let _ = wrote_tx.send(());
            }
            std::future::pending::<()>().await;
            Ok::<Receipt, TestError>(Receipt::new(1))
        })
    });
    tokio::select! {
        _ = fut => panic!("the work never finishes"),
        _ = wrote_rx => {}
    }
    // `fut` is dropped here, mid-work, with its write made.
    assert_eq!(effects(&s, &eid).await, 0, "uncommitted writes are invisible");
    let runs = Runs::default();
    let ok = run_receipt::<S>(&engine, &call, &eid, &runs, 1).await.unwrap();
    assert!(!ok.is_replayed(), "the key was left unused");
    assert_eq!(effects(&s, &eid).await, 1);
}

/// With a policy that records final rejections, a final rejection is replayed and its writes stay rolled back.
pub async fn final_rejection_is_recorded_when_policy_says<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let call = fresh_call("POST /v1/payouts", "{}", recording_rejections());
    let (eid, runs) = (effect_id(), Runs::default());
    let decline = Decline::InsufficientFunds { short_by: 7 };
    let first = run_decline::<S>(&engine, &call, &eid, &runs, Some(decline.clone()))
        .await
        .unwrap();
    assert_eq!(first, Outcome::Executed(Err(decline.clone())));
    let again = run_decline::<S>(&engine, &call, &eid, &runs, None).await.unwrap();
    assert_eq!(again, Outcome::Replayed(Err(decline)), "the recorded rejection replays");
    assert_eq!(runs.get(), 1);
    assert_eq!(effects(&s, &eid).await, 0, "the rejection's writes stay rolled back");
}

/// A transient rejection is never recorded, whatever the policy.
pub async fn transient_rejection_is_never_recorded<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let call = fresh_call("POST /v1/payouts", "{}", recording_rejections());
    let (eid, runs) = (effect_id(), Runs::default());
    let first = run_decline::<S>(&engine, &call, &eid, &runs, Some(Decline::VendorBusy))
        .await
        .unwrap();
    assert_eq!(first, Outcome::Executed(Err(Decline::VendorBusy)));
    let again = run_decline::<S>(&engine, &call, &eid, &runs, None).await.unwrap();
    assert!(
        matches!(again, Outcome::Executed(Ok(_))),
        "the key was left unused: {again:?}"
    );
    assert_eq!(effects(&s, &eid).await, 1);
}

/// A first caller's claim of `call` with its write of `eid` made, and a
/// twin started beside it on a task of its own (its work writes
/// `twin_eid`), with the twin's runs.
async fn first_and_twin<S: Subject>(
    engine: &Arc<TxEngine<S::Backend>>,
    call: &Call,
    eid: &str,
    twin_eid: &str,
) -> (
    idem_core::Claimed<<S::Backend as TxBackend>::Tx>,
    tokio::task::JoinHandle<Result<Outcome<Receipt>, TestError>>,
    Runs,
) {
    let mut first = claimed(engine.begin(call).await.unwrap());
    S::write_effect(&mut first.tx, eid.to_owned()).await.unwrap();
    let twin_runs = Runs::default();
    let twin = {
        let (engine, call, eid, runs) = (engine.clone(), call.clone(), twin_eid.to_owned(), twin_runs.clone());
        tokio::spawn(async move { run_receipt::<S>(&engine, &call, &eid, &runs, 9).await })
    };
    (first, twin, twin_runs)
}

/// A twin that arrives while the first holds the key waits, then replays the first's outcome.
pub async fn twin_waits_then_replays<S: Subject>(s: S) {
    twin_waits_then_replays_on(&s, Arc::new(tx_engine(&s))).await;
}

/// [`twin_waits_then_replays`] on `engine`, an engine on `s`.
pub(crate) async fn twin_waits_then_replays_on<S: Subject>(s: &S, engine: Arc<TxEngine<S::Backend>>) {
    let call = fresh_call("POST /v1/transfers", "{}", waiting(30_000));
    let eid = effect_id();
    let (first, twin, twin_runs) = first_and_twin::<S>(&engine, &call, &eid, &eid).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!twin.is_finished(), "the twin waits while the first holds the key");
    let receipt = Receipt::new(5);
    engine
        .commit(first, Record::completed(serde_json::to_vec(&receipt).unwrap()))
        .await
        .unwrap();
    let out = twin.await.unwrap().unwrap();
    assert_eq!(out, Outcome::Replayed(receipt), "the twin replays the first outcome");
    assert_eq!(twin_runs.get(), 0, "the twin's work never ran");
    assert_eq!(effects(s, &eid).await, 1);
}

/// A twin waiting on a claim that rolls back then claims the key and runs itself.
pub async fn twin_claims_after_first_rolls_back<S: Subject>(s: S) {
    let engine = Arc::new(tx_engine(&s));
    let call = fresh_call("POST /v1/transfers", "{}", waiting(30_000));
    let (eid_first, eid_twin) = (effect_id(), effect_id());
    let (first, twin, twin_runs) = first_and_twin::<S>(&engine, &call, &eid_first, &eid_twin).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    engine.abandon(first).await;
    let out = twin.await.unwrap().unwrap();
    assert!(!out.is_replayed(), "the twin executed after the rollback");
    assert_eq!(twin_runs.get(), 1);
    assert_eq!(effects(&s, &eid_first).await, 0);
    assert_eq!(effects(&s, &eid_twin).await, 1);
}

/// A twin is reported in flight at once under a rejecting policy, or after its bounded wait.
pub async fn twin_reported_in_flight<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let scope = unique_scope("POST /v1/transfers");
    let key = IdempotencyKey::generate();
    let eid = effect_id();
    let first = claimed(
        engine
            .begin(&call_for(&scope, &key, "{}", Policy::default()))
            .await
            .unwrap(),
    );
    let runs = Runs::default();
    for policy in [rejecting(), waiting(250)] {
        let err = run_receipt::<S>(&engine, &call_for(&scope, &key, "{}", policy), &eid, &runs, 1)
            .await
            .unwrap_err();
        match err {
            TestError::Idem(Error::InFlight { retry_after }) => assert!(retry_after > Duration::ZERO),
            other => panic!("expected in-flight, got {other:?}"),
        }
    }
    assert_eq!(runs.get(), 0);
    engine
        .commit(first, Record::completed(serde_json::to_vec(&Receipt::new(1)).unwrap()))
        .await
        .unwrap();
    let out = run_receipt::<S>(&engine, &call_for(&scope, &key, "{}", rejecting()), &eid, &runs, 1)
        .await
        .unwrap();
    assert!(out.is_replayed(), "after the first commits, the twin replays");
}

/// Runs `call` under `key` in `scope` with `eid`'s work answering `amount`.
async fn run_in<S: Subject>(
    engine: &TxEngine<S::Backend>,
    scope: &Scope,
    key: &IdempotencyKey,
    eid: &str,
    runs: &Runs,
    amount: i64,
) -> Outcome<Receipt> {
    let call = call_for(scope, key, "{}", Policy::default());
    run_receipt::<S>(engine, &call, eid, runs, amount).await.unwrap()
}

/// Runs `key` in `a` with the work of `eid_a`, then in `b` with that of
/// `eid_b`: each executes its own, and their outcomes differ.
async fn each_scope_executes<S: Subject>(
    engine: &TxEngine<S::Backend>,
    (a, b): (&Scope, &Scope),
    key: &IdempotencyKey,
    (eid_a, eid_b): (&str, &str),
    runs: &Runs,
) -> (Outcome<Receipt>, Outcome<Receipt>) {
    let ra = run_in::<S>(engine, a, key, eid_a, runs, 1).await;
    let rb = run_in::<S>(engine, b, key, eid_b, runs, 2).await;
    assert!(!ra.is_replayed() && !rb.is_replayed(), "each scope executes its own");
    assert_ne!(ra.value(), rb.value());
    (ra, rb)
}

/// The same key and request from two tenants are two independent keys; neither sees the other's outcome.
pub async fn tenant_isolation<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let a = unique_scope("POST /v1/transfers");
    let b = unique_scope("POST /v1/transfers");
    let key = IdempotencyKey::generate();
    let (eid_a, eid_b, runs) = (effect_id(), effect_id(), Runs::default());
    let (ra, rb) = each_scope_executes::<S>(&engine, (&a, &b), &key, (&eid_a, &eid_b), &runs).await;
    let ra2 = run_in::<S>(&engine, &a, &key, &eid_a, &runs, 3).await;
    let rb2 = run_in::<S>(&engine, &b, &key, &eid_b, &runs, 4).await;
    assert_eq!(ra2.value(), ra.value(), "tenant A replays its own outcome");
    assert_eq!(rb2.value(), rb.value(), "tenant B replays its own outcome, never A's");
    assert_eq!(effects(&s, &eid_a).await, 1);
    assert_eq!(effects(&s, &eid_b).await, 1);
}

/// The same key and tenant on two operations are two independent keys.
pub async fn operation_isolation<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let a = unique_scope("POST /v1/transfers");
    let b = Scope::new(
        a.tenant().clone(),
        idem_core::Operation::new("POST /v1/top-ups").unwrap(),
    );
    let key = IdempotencyKey::generate();
    let (eid_a, eid_b, runs) = (effect_id(), effect_id(), Runs::default());
    each_scope_executes::<S>(&engine, (&a, &b), &key, (&eid_a, &eid_b), &runs).await;
    assert_eq!(runs.get(), 2);
}

/// A key past its TTL is treated as absent and executes anew.
pub async fn expired_key_executes_anew<S: Subject>(s: S) {
    let (clock, shared) = manual_clock();
    let engine = tx_engine(&s).with_clock(shared);
    let scope = unique_scope("POST /v1/transfers");
    let key = IdempotencyKey::generate();
    let call = call_for(&scope, &key, "{}", Policy::default().with_ttl_secs(60));
    let (eid, runs) = (effect_id(), Runs::default());
    let first = run_receipt::<S>(&engine, &call, &eid, &runs, 1).await.unwrap();
    clock.advance(Duration::from_secs(59));
    assert!(
        run_receipt::<S>(&engine, &call, &eid, &runs, 1)
            .await
            .unwrap()
            .is_replayed(),
        "alive at 59 s"
    );
    clock.advance(Duration::from_secs(2));
    let anew = run_receipt::<S>(&engine, &call, &eid, &runs, 1).await.unwrap();
    assert!(!anew.is_replayed(), "expired at 61 s: executes anew");
    assert_ne!(anew.value(), first.value());
    // Even a different request may use an expired key.
    clock.advance(Duration::from_secs(61));
    let other = call_for(&scope, &key, r#"{"x":1}"#, Policy::default().with_ttl_secs(60));
    assert!(
        !run_receipt::<S>(&engine, &other, &eid, &runs, 1)
            .await
            .unwrap()
            .is_replayed()
    );
    assert_eq!(effects(&s, &eid).await, 3);
}

/// The sweeper deletes exactly the expired keys, in batches of the asked size.
pub async fn sweep_deletes_expired_in_batches<S: Subject>(s: S) {
    let s = s.isolated().await;
    let (clock, shared) = manual_clock();
    let engine = tx_engine(&s).with_clock(shared);
    let scope = unique_scope("POST /v1/transfers");
    let runs = Runs::default();
    let eid = effect_id();
    let short = Policy::default().with_ttl_secs(10);
    let long = Policy::default().with_ttl_secs(3600);
    let mut long_calls = Vec::new();
    for i in 0..9 {
        let policy = if i < 7 { short } else { long };
        let call = call_for(&scope, &IdempotencyKey::generate(), "{}", policy);
        run_receipt::<S>(&engine, &call, &eid, &runs, 1).await.unwrap();
        if i >= 7 {
            long_calls.push(call);
        }
    }
    clock.advance(Duration::from_secs(11));
    let options = unpaced_sweep(3);
    let report = idem_core::sweep_expired(&s.sweeper(), &*engine.clock().clone(), options)
        .await
        .unwrap();
    assert_eq!(report.deleted, 7, "exactly the expired keys are deleted");
    assert_eq!(report.batches, 3, "in batches of 3: 3 + 3 + 1");
    for call in &long_calls {
        assert!(
            run_receipt::<S>(&engine, call, &eid, &runs, 1)
                .await
                .unwrap()
                .is_replayed(),
            "live keys survive"
        );
    }
    let again = idem_core::sweep_expired(&s.sweeper(), &*engine.clock().clone(), options)
        .await
        .unwrap();
    assert_eq!(again.deleted, 0);
}

/// 64 concurrent tasks on one key, across two connection pools: the effect exists exactly once and all saw the same outcome.
pub async fn concurrent_64_tasks_one_key_one_effect<S: Subject>(s: S) {
    let other = s.another().await;
    concurrent_64_tasks_one_key_on(&s, [Arc::new(tx_engine(&s)), Arc::new(tx_engine(&other))]).await;
}

/// [`concurrent_64_tasks_one_key_one_effect`] on `engines`, engines on `s`
/// through pools of their own.
pub(crate) async fn concurrent_64_tasks_one_key_on<S: Subject>(s: &S, engines: [Arc<TxEngine<S::Backend>>; 2]) {
    let call = fresh_call("POST /v1/transfers", r#"{"amount":100}"#, waiting(120_000));
    let (eid, runs) = (effect_id(), Runs::default());
    let tasks = spawn_together(64, |i| {
        let (engine, call, eid, runs) = (engines[i % 2].clone(), call.clone(), eid.clone(), runs.clone());
        async move { run_receipt::<S>(&engine, &call, &eid, &runs, 100).await }
    });
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap().expect("every task gets an outcome"));
    }
    let executed = outcomes.iter().filter(|o| !o.is_replayed()).count();
    assert_eq!(executed, 1, "exactly one task executed");
    assert!(
        outcomes.iter().all(|o| o.value() == outcomes[0].value()),
        "all 64 saw the same outcome"
    );
    // A run that lost a race at commit (SERIALIZABLE) runs again; only one run commits.
    assert!(runs.get() >= 1, "the work ran");
    assert_eq!(effects(s, &eid).await, 1, "the effect exists exactly once");
}

/// 64 concurrent tasks on 64 distinct keys: 64 effects.
pub async fn concurrent_64_tasks_distinct_keys<S: Subject>(s: S) {
    let other = s.another().await;
    let engines = [Arc::new(tx_engine(&s)), Arc::new(tx_engine(&other))];
    let scope = unique_scope("POST /v1/transfers");
    let runs = Runs::default();
    let eids: Vec<String> = (0..64).map(|_| effect_id()).collect();
    let tasks = spawn_together(64, |i| {
        let (engine, scope, eid, runs) = (engines[i % 2].clone(), scope.clone(), eids[i].clone(), runs.clone());
        async move {
            let call = call_for(&scope, &IdempotencyKey::generate(), "{}", waiting(120_000));
            run_receipt::<S>(&engine, &call, &eid, &runs, 1).await
        }
    });
    for t in tasks {
        let outcome = t.await.unwrap();
        assert!(
            outcome.as_ref().is_ok_and(|o| !o.is_replayed()),
            "every distinct key executes, contention included: {outcome:?}"
        );
    }
    // Under SERIALIZABLE a run may lose a race and run again; each committed once.
    assert!(runs.get() >= 64);
    for eid in &eids {
        assert_eq!(effects(&s, eid).await, 1);
    }
}

/// An outcome over the policy's record limit is refused: the writes roll back and the key stays usable.
pub async fn oversized_record_rolls_back<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let scope = unique_scope("POST /v1/transfers");
    let key = IdempotencyKey::generate();
    let (eid, runs) = (effect_id(), Runs::default());
    let tiny = call_for(&scope, &key, "{}", Policy::default().with_max_record_bytes(16));
    let err = run_receipt::<S>(&engine, &tiny, &eid, &runs, 1).await.unwrap_err();
    assert!(
        matches!(err, TestError::Idem(Error::RecordTooLarge { limit: 16, .. })),
        "got {err:?}"
    );
    assert_eq!(effects(&s, &eid).await, 0);
    let ok = run_receipt::<S>(
        &engine,
        &call_for(&scope, &key, "{}", Policy::default()),
        &eid,
        &runs,
        1,
    )
    .await
    .unwrap();
    assert!(!ok.is_replayed());
    assert_eq!(effects(&s, &eid).await, 1);
}

/// Work whose statement lost a race (a deadlock or serialisation failure) is rolled back and run again; the effect exists once.
pub async fn work_contention_runs_again<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let call = fresh_call("POST /v1/transfers", "{}", Policy::default());
    let (eid, runs) = (effect_id(), Runs::default());
    let out = run_answering::<S, _, _>(&engine, &call, &eid, &runs, |runs| {
        if runs == 1 {
            return Err(TestError::Idem(Error::store(
                idem_core::StoreErrorKind::Deadlock,
                "chosen as the deadlock victim",
            )));
        }
        Ok(Receipt::new(1))
    })
    .await
    .expect("contention in the work is retried");
    assert!(!out.is_replayed());
    assert_eq!(runs.get(), 2, "the work ran again after contention");
    assert_eq!(effects(&s, &eid).await, 1, "only the second run's effect committed");
    let again = run_receipt::<S>(&engine, &call, &eid, &runs, 1).await.unwrap();
    assert!(again.is_replayed());
}

/// Contention that never stops is retried a bounded number of times, then surfaces as a retryable error with nothing applied.
pub async fn contention_retries_are_bounded<S: Subject>(s: S) {
    let engine = tx_engine(&s);
    let call = fresh_call("POST /v1/transfers", "{}", Policy::default());
    let (eid, runs) = (effect_id(), Runs::default());
    let err = run_answering::<S, _, _>(&engine, &call, &eid, &runs, |_| {
        Err::<Receipt, _>(TestError::Idem(Error::store(
            idem_core::StoreErrorKind::Serialization,
            "could not serialize access",
        )))
    })
    .await
    .unwrap_err();
    assert!(
        matches!(&err, TestError::Idem(e) if e.is_retryable() && e.is_contention()),
        "got {err:?}"
    );
    assert_eq!(runs.get(), idem_core::ContentionRetries::MAX_RUNS as usize);
    assert_eq!(effects(&s, &eid).await, 0, "nothing was applied");
    let ok = run_receipt::<S>(&engine, &call, &eid, &runs, 1).await.unwrap();
    assert!(!ok.is_replayed(), "the key was left unused");
}

/// A commit the store refuses, times out on, or applies and reports as
/// failed: the caller retries with the same key and the effect is applied
/// exactly once — run again after a refusal (nothing committed), replayed
/// after a commit that was applied although the caller heard a failure.
pub async fn tx_commit_refused_or_lost_applies_once<S: Subject>(s: S) {
    use idem_faults::{Fault, FaultPlan, Faulty, Op};
    let store = Faulty::new(s.backend(), FaultPlan::none());
    let engine = TxEngine::new(store.clone());
    for fault in [Fault::Refused, Fault::TimedOut, Fault::AppliedThenRefused] {
        let call = fresh_call("POST /v1/transfers", r#"{"amount":5}"#, Policy::default());
        let (eid, runs) = (effect_id(), Runs::default());
        store.faults().fail_next(Op::Commit, fault);
        let run = || run_answering::<S, _, _>(&engine, &call, &eid, &runs, |_| Ok(Receipt::new(5)));
        let first = run().await;
        assert!(first.is_err(), "{fault:?}: the caller hears the commit fail: {first:?}");
        let again = run().await.unwrap();
        assert_eq!(
            again.is_replayed(),
            fault == Fault::AppliedThenRefused,
            "{fault:?}: a commit that was applied is replayed, one that was not runs again"
        );
        assert_eq!(effects(&s, &eid).await, 1, "{fault:?}: the effect was applied once");
        let expected_runs = if fault == Fault::AppliedThenRefused { 1 } else { 2 };
        assert_eq!(runs.get(), expected_runs, "{fault:?}");
        assert!(run().await.unwrap().is_replayed());
    }
    assert_eq!(store.faults().total(), 3);
}
