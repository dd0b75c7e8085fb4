//! Multi-step operations run by [`StepsEngine`] on a store: each step's
//! effect happens once whatever stops a run, a resumed run replays what was
//! recorded, an external step's resend carries the same key, a declared
//! failure is compensated once, and an unknown outcome is held.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use idem_core::multistep::{HoldKind, MultiStepState, MultiStepStore};
use idem_core::{
    BoxFuture, Call, Error, IdempotencyKey, ManualClock, Policy, Settlement, TxBackend, Verdict, VerdictSource,
};
use idem_steps::{Finished, Halt, Operation, Pass, Registry, Run, StepError, StepsEngine};
use serde_json::{Value, json};

use crate::multistep_tests::MultiStepSubject;
use crate::{Subject, call_for, effect_id, unique_scope};

mod faults;
mod purge;
mod refusals;
pub use faults::steps_store_faults_leave_each_effect_once;
pub use purge::steps_purge_deletes_only_expired_final_operations;
pub use refusals::{
    steps_first_step_rejection_is_recorded_when_consumed, steps_recorded_refusal_answers_as_a_twin_that_started_first,
    steps_refusal_too_large_to_record_is_answered_unrecorded, steps_store_faults_on_a_recorded_refusal,
};

/// What the vendor does with the next send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Applies it (once per key) and answers.
    Answer,
    /// Applies it, and the answer is lost: the step is tried again later.
    LoseAnswer,
    /// Declines it, applying nothing.
    Decline,
    /// Cannot say whether it applied it.
    Unknown,
}

/// A vendor that applies a key once, counts every send, and follows a
/// script.
#[derive(Debug, Default)]
struct Vendor {
    applied: Mutex<HashMap<String, Value>>,
    sends: AtomicUsize,
    script: Mutex<VecDeque<Next>>,
    /// Each send's key and whether the step said an earlier one may have
    /// reached the vendor.
    seen: Mutex<Vec<(String, bool)>>,
}

impl Vendor {
    fn scripted(script: &[Next]) -> Arc<Self> {
        Arc::new(Self {
            script: Mutex::new(script.iter().copied().collect()),
            ..Self::default()
        })
    }

    fn applied(&self) -> usize {
        self.applied.lock().unwrap().len()
    }

    fn send(&self, key: &IdempotencyKey, earlier: bool) -> Result<Value, StepError> {
        self.sends.fetch_add(1, Ordering::SeqCst);
        self.seen.lock().unwrap().push((key.as_str().to_owned(), earlier));
        let next = self.script.lock().unwrap().pop_front().unwrap_or(Next::Answer);
        let apply = || {
            let mut applied = self.applied.lock().unwrap();
            let n = applied.len();
            applied
                .entry(key.as_str().to_owned())
                .or_insert_with(|| json!({ "payout": format!("po_{n}") }))
                .clone()
        };
        match next {
            Next::Answer => Ok(apply()),
            Next::LoseAnswer => {
                apply();
                Err(StepError::Retry {
                    why: "the answer was lost".into(),
                    after_ms: 0,
                })
            }
            Next::Decline => Err(StepError::Declared(json!({ "declined": "account closed" }))),
            Next::Unknown => Err(StepError::Unknown("the vendor cannot say".into())),
        }
    }
}

/// A withdrawal: debit (local), pay (external), settle (local); a declined
/// payment is compensated by a credit (local). Each local step writes one
/// business row named after the operation's effect id and the step.
struct Withdrawal<S: Subject> {
    vendor: Arc<Vendor>,
    /// A run stops with a store failure at this step's start (a crash),
    /// once.
    crash_at: Mutex<Option<&'static str>>,
    /// A run stops for good at this point (and its task is aborted: the
    /// process died there), once.
    stall: Arc<Stall>,
    subject: std::marker::PhantomData<fn() -> S>,
}

/// A point where a run waits forever, once, after saying it got there.
#[derive(Debug, Default)]
struct Stall {
    at: Mutex<Option<&'static str>>,
    reached: tokio::sync::Notify,
}

impl Stall {
    async fn at(stall: &Stall, point: &str) {
        let here = {
            let mut at = stall.at.lock().unwrap();
            let here = *at == Some(point);
            if here {
                *at = None;
            }
            here
        };
        if here {
            stall.reached.notify_one();
            std::future::pending::<()>().await;
        }
    }
}

impl<S: Subject> Withdrawal<S> {
    fn new(vendor: Arc<Vendor>) -> Self {
        Self {
            vendor,
            crash_at: Mutex::new(None),
            stall: Arc::default(),
            subject: std::marker::PhantomData,
        }
    }

    fn crashing_at(self, step: &'static str) -> Self {
        *self.crash_at.lock().unwrap() = Some(step);
        self
    }

    fn crash(&self, step: &str) -> Result<(), Halt> {
        let mut at = self.crash_at.lock().unwrap();
        if *at == Some(step) {
            *at = None;
            return Err(Halt::Store(Error::store(
                idem_core::StoreErrorKind::Unavailable,
                "the process died",
            )));
        }
        Ok(())
    }

    async fn write<'r, B: SubjectTx<S>>(run: &mut Run<'r, B>, step: &str, eid: &str) -> Result<String, Halt> {
        Self::write_stalling(run, step, eid, Arc::default()).await
    }

    async fn write_stalling<'r, B: SubjectTx<S>>(
        run: &mut Run<'r, B>,
        step: &str,
        eid: &str,
        stall: Arc<Stall>,
    ) -> Result<String, Halt> {
        let row = format!("{eid}-{step}");
        let point = format!("in-{step}");
        run.local(step, move |tx| {
            let (row, stall, point) = (row.clone(), stall.clone(), point.clone());
            Box::pin(async move {
                S::write_effect(tx, row)
                    .await
                    .map_err(|e| StepError::Fatal(e.to_string()))?;
                // Written, not committed.
                Stall::at(&stall, &point).await;
                // A value the step makes: replayed, never made again.
                Ok(uuid::Uuid::new_v4().to_string())
            })
        })
        .await
    }
}

/// A backend whose transactions are those of the subject `S` (its own, or
/// its own wrapped to fail on purpose).
trait SubjectTx<S: Subject>: idem_core::TxBackend<Tx = <S::Backend as idem_core::TxBackend>::Tx> {}

impl<S: Subject, B: idem_core::TxBackend<Tx = <S::Backend as idem_core::TxBackend>::Tx>> SubjectTx<S> for B {}

impl<S: Subject, B: SubjectTx<S>> Operation<B> for Withdrawal<S> {
    type Input = String;
    type Output = Value;
    const NAME: &'static str = "withdrawal@1";

    fn run<'r>(&'r self, run: &'r mut Run<'_, B>, eid: &'r String) -> BoxFuture<'r, Result<Value, Halt>> {
        Box::pin(async move {
            self.crash("debit")?;
            let debit = Self::write_stalling(run, "debit", eid, self.stall.clone()).await?;
            self.crash("pay")?;
            let vendor = self.vendor.clone();
            let stall = self.stall.clone();
            let paid: Value = run
                .external("pay", |s| async move {
                    // An operator said the vendor applied it: its answer.
                    if let Some(v) = &s.verdict
                        && v.status.is_some()
                    {
                        return serde_json::from_slice(&v.body).map_err(|e| StepError::Fatal(e.to_string()));
                    }
                    Stall::at(&stall, "before-send").await;
                    let answer = vendor.send(&s.key, s.earlier.is_some());
                    Stall::at(&stall, "after-send").await;
                    answer
                })
                .await?;
            self.crash("settle")?;
            Self::write_stalling(run, "settle", eid, self.stall.clone()).await?;
            Ok(json!({ "debit": debit, "paid": paid }))
        })
    }

    fn compensate<'r>(
        &'r self,
        run: &'r mut Run<'_, B>,
        eid: &'r String,
        _failure: &'r Value,
    ) -> BoxFuture<'r, Result<(), Halt>> {
        Box::pin(async move {
            self.crash("credit")?;
            Self::write_stalling(run, "credit", eid, self.stall.clone())
                .await
                .map(drop)
        })
    }
}

const LEASE_MS: i64 = 30_000;

fn engine<S: MultiStepSubject>(s: &S, clock: &ManualClock) -> StepsEngine<S::Backend, S::Steps> {
    StepsEngine::new(s.backend(), s.steps())
        .with_clock(Arc::new(clock.clone()))
        .with_lease_ms(LEASE_MS)
}

fn new_call(eid: &str) -> Call {
    let body = json!({ "effect": eid }).to_string();
    call_for(
        &unique_scope("POST /v1/withdrawals"),
        &IdempotencyKey::generate(),
        &body,
        Policy::default(),
    )
}

async fn effects<S: Subject>(s: &S, eid: &str, step: &str) -> u64 {
    s.count_effects(format!("{eid}-{step}")).await.unwrap()
}

/// Asserts that `done` is a completion: afresh, or the recorded one
/// when `replayed`.
fn assert_completed(done: &Finished<Value>, replayed: bool) {
    assert!(
        matches!(done, Finished::Completed { replayed: r, .. } if *r == replayed),
        "got {done:?}"
    );
}

/// Runs `op` on `call` twice: the first run ends compensated after
/// `failure` (not replayed), and the second answers that ending again,
/// replayed.
async fn compensates_then_replays<B: TxBackend, M: MultiStepStore<B>, O: Operation<B, Output = Value>>(
    engine: &StepsEngine<B, M>,
    op: &O,
    call: &Call,
    input: &O::Input,
    failure: Value,
) {
    let ending = Finished::Compensated {
        failure,
        replayed: false,
    };
    let done = engine.execute(op, call, input).await.unwrap();
    assert_eq!(done, ending);
    let again = engine.execute(op, call, input).await.unwrap();
    assert_eq!(again, replayed(ending));
}

/// `done` as a retry answers it.
fn replayed(done: Finished<Value>) -> Finished<Value> {
    match done {
        Finished::Completed { output, .. } => Finished::Completed { output, replayed: true },
        Finished::Compensated { failure, .. } => Finished::Compensated {
            failure,
            replayed: true,
        },
        other => other,
    }
}

/// An operation runs each step once; a retry answers the recorded output and runs nothing; another request under its key is refused.
pub async fn steps_complete_once_and_replay<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let (engine, vendor, eid) = (engine(&s, &clock), Vendor::scripted(&[]), effect_id());
    let op = Withdrawal::<S>::new(vendor.clone());
    let call = new_call(&eid);
    let first = engine.execute(&op, &call, &eid).await.unwrap();
    let Finished::Completed {
        output,
        replayed: false,
    } = first
    else {
        panic!("got {first:?}")
    };
    let again = engine.execute(&op, &call, &eid).await.unwrap();
    assert_eq!(again, Finished::Completed { output, replayed: true });
    assert_eq!(
        (effects(&s, &eid, "debit").await, effects(&s, &eid, "settle").await),
        (1, 1)
    );
    assert_eq!((vendor.sends.load(Ordering::SeqCst), vendor.applied()), (1, 1));
    let other = call_for(call.scope(), call.key(), r#"{"another":"request"}"#, Policy::default());
    assert!(matches!(engine.execute(&op, &other, &eid).await, Err(Error::Mismatch)));
    struct Renamed<S: Subject>(Withdrawal<S>);
    impl<S: Subject> Operation<S::Backend> for Renamed<S> {
        type Input = String;
        type Output = Value;
        const NAME: &'static str = "withdrawal@2";
        fn run<'r>(&'r self, run: &'r mut Run<'_, S::Backend>, eid: &'r String) -> BoxFuture<'r, Result<Value, Halt>> {
            self.0.run(run, eid)
        }
    }
    let renamed = Renamed(Withdrawal::<S>::new(vendor.clone()));
    assert!(matches!(
        engine.execute(&renamed, &call, &eid).await,
        Err(Error::InvalidRequest(_))
    ));
    assert_eq!(vendor.sends.load(Ordering::SeqCst), 1, "nothing ran");
}

/// A send whose answer was lost is sent again with the same key, told an earlier send may have arrived; the vendor applies it once and the local steps before it are not run again.
pub async fn steps_lost_answer_resends_the_same_key<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let (engine, vendor, eid) = (engine(&s, &clock), Vendor::scripted(&[Next::LoseAnswer]), effect_id());
    let op = Withdrawal::<S>::new(vendor.clone());
    let call = new_call(&eid);
    assert_eq!(engine.execute(&op, &call, &eid).await.unwrap(), Finished::InFlight);
    assert_completed(&engine.execute(&op, &call, &eid).await.unwrap(), false);
    let seen = vendor.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].0, seen[1].0, "one key for every send of the step");
    assert_eq!((seen[0].1, seen[1].1), (false, true), "the resend knows of the first");
    assert_eq!(vendor.applied(), 1);
    assert_eq!(
        (effects(&s, &eid, "debit").await, effects(&s, &eid, "settle").await),
        (1, 1)
    );
}

/// A run that died between steps is taken over once its lease ran out, resuming after its last recorded step: nothing recorded runs twice.
pub async fn steps_dead_run_is_resumed_after_its_lease<S: MultiStepSubject>(s: S) {
    for crash in ["pay", "settle"] {
        let clock = ManualClock::starting_now();
        let (engine, vendor, eid) = (engine(&s, &clock), Vendor::scripted(&[]), effect_id());
        let op = Withdrawal::<S>::new(vendor.clone()).crashing_at(crash);
        let call = new_call(&eid);
        assert!(
            engine.execute(&op, &call, &eid).await.is_err(),
            "the run died at {crash}"
        );
        assert_eq!(
            engine.execute(&op, &call, &eid).await.unwrap(),
            Finished::InFlight,
            "its lease is still live"
        );
        clock.advance(std::time::Duration::from_millis(LEASE_MS as u64));
        assert_completed(&engine.execute(&op, &call, &eid).await.unwrap(), false);
        assert_eq!(
            (effects(&s, &eid, "debit").await, effects(&s, &eid, "settle").await),
            (1, 1)
        );
        assert_eq!(
            (vendor.sends.load(Ordering::SeqCst), vendor.applied()),
            (1, 1),
            "after {crash}"
        );
    }
}

/// A declared failure runs the compensation once, even when a run dies inside it; its outcome is replayed.
pub async fn steps_declared_failure_is_compensated_once<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let (engine, vendor, eid) = (engine(&s, &clock), Vendor::scripted(&[Next::Decline]), effect_id());
    let op = Withdrawal::<S>::new(vendor.clone()).crashing_at("credit");
    let call = new_call(&eid);
    assert!(
        engine.execute(&op, &call, &eid).await.is_err(),
        "the run died in its compensation"
    );
    clock.advance(std::time::Duration::from_millis(LEASE_MS as u64));
    let failure = json!({ "declined": "account closed" });
    compensates_then_replays(&engine, &op, &call, &eid, failure).await;
    assert_eq!(effects(&s, &eid, "debit").await, 1);
    assert_eq!(effects(&s, &eid, "credit").await, 1, "credited back once");
    assert_eq!(effects(&s, &eid, "settle").await, 0);
    assert_eq!((vendor.sends.load(Ordering::SeqCst), vendor.applied()), (1, 0));
}

/// An operation whose payment's outcome is unknown, run once: held.
async fn held_on_unknown<S: MultiStepSubject>(
    s: &S,
    clock: &ManualClock,
) -> (
    StepsEngine<S::Backend, S::Steps>,
    Arc<Vendor>,
    Withdrawal<S>,
    Call,
    String,
) {
    let (engine, vendor, eid) = (engine(s, clock), Vendor::scripted(&[Next::Unknown]), effect_id());
    let op = Withdrawal::<S>::new(vendor.clone());
    let call = new_call(&eid);
    assert_eq!(
        engine.execute(&op, &call, &eid).await.unwrap(),
        Finished::Held(HoldKind::Unknown)
    );
    (engine, vendor, op, call, eid)
}

/// An unknown outcome holds the operation: later calls answer held and send nothing.
pub async fn steps_unknown_outcome_is_held<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let (engine, vendor, op, call, eid) = held_on_unknown(&s, &clock).await;
    clock.advance(std::time::Duration::from_millis(10 * LEASE_MS as u64));
    assert_eq!(
        engine.execute(&op, &call, &eid).await.unwrap(),
        Finished::Held(HoldKind::Unknown)
    );
    assert_eq!(vendor.sends.load(Ordering::SeqCst), 1);
    let row = engine.store().find(call.scope(), call.key()).await.unwrap().unwrap();
    assert_eq!(
        row.open.map(|o| o.step),
        Some("pay".to_owned()),
        "the send stays open for a verdict"
    );
    assert_eq!(effects(&s, &eid, "settle").await, 0);
}

/// Twins of one operation at once: each step's effect happens once; the others answer in flight.
pub async fn steps_twins_run_each_step_once<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let (vendor, eid) = (Vendor::scripted(&[]), effect_id());
    let call = new_call(&eid);
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (twin, barrier, vendor, call, eid) = (
            s.another().await,
            barrier.clone(),
            vendor.clone(),
            call.clone(),
            eid.clone(),
        );
        let engine = engine(&twin, &clock);
        tasks.push(tokio::spawn(async move {
            let op = Withdrawal::<S>::new(vendor);
            barrier.wait().await;
            engine.execute(&op, &call, &eid).await
        }));
    }
    let mut completed = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(Finished::Completed { .. }) => completed += 1,
            Ok(Finished::InFlight) => {}
            other => panic!("a twin got {other:?}"),
        }
    }
    assert!(completed >= 1, "one twin completed it");
    assert_eq!(
        (effects(&s, &eid, "debit").await, effects(&s, &eid, "settle").await),
        (1, 1)
    );
    assert_eq!(vendor.applied(), 1);
    let op = Withdrawal::<S>::new(vendor.clone());
    assert_completed(&engine(&s, &clock).execute(&op, &call, &eid).await.unwrap(), true);
}

/// A first step that declares a failure records nothing: the key stays unused.
pub async fn steps_first_step_rejection_leaves_the_key_unused<S: MultiStepSubject>(s: S) {
    struct Refused;
    impl<B: idem_core::TxBackend> Operation<B> for Refused {
        type Input = ();
        type Output = ();
        const NAME: &'static str = "refused@1";
        fn run<'r>(&'r self, run: &'r mut Run<'_, B>, _: &'r ()) -> BoxFuture<'r, Result<(), Halt>> {
            Box::pin(async move {
                run.local::<(), _>("debit", |_tx| {
                    Box::pin(async { Err(StepError::Declared(json!("insufficient funds"))) })
                })
                .await
            })
        }
    }
    let clock = ManualClock::starting_now();
    let engine = engine(&s, &clock);
    let call = new_call("{}");
    assert_eq!(
        engine.execute(&Refused, &call, &()).await.unwrap(),
        Finished::Rejected(json!("insufficient funds"))
    );
    assert_eq!(engine.store().find(call.scope(), call.key()).await.unwrap(), None);
}

/// An engine on an operations table of its own (a completer scans a whole table).
async fn isolated_engine<S: MultiStepSubject>(s: &S, clock: &ManualClock) -> StepsEngine<S::Backend, S::Steps> {
    StepsEngine::new(s.backend(), s.isolated_steps().await)
        .with_clock(Arc::new(clock.clone()))
        .with_lease_ms(LEASE_MS)
}

/// A completer finishes an operation whose caller went away, once its run's lease ran out; an operation of a definition it does not know is left alone.
pub async fn steps_completer_finishes_what_the_caller_left<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let (engine, vendor, eid) = (isolated_engine(&s, &clock).await, Vendor::scripted(&[]), effect_id());
    let call = new_call(&eid);
    let op = Withdrawal::<S>::new(vendor.clone()).crashing_at("settle");
    assert!(engine.execute(&op, &call, &eid).await.is_err(), "the caller's run died");
    let registry = Registry::new().with(Withdrawal::<S>::new(vendor.clone()));
    assert_eq!(
        engine.complete_due(&registry, 10).await.unwrap(),
        Pass::default(),
        "its lease is live"
    );
    clock.advance(std::time::Duration::from_millis(LEASE_MS as u64));
    let strangers = Registry::<S::Backend, S::Steps>::new();
    let skipped = engine.complete_due(&strangers, 10).await.unwrap();
    assert_eq!((skipped.taken, skipped.unknown_definitions), (0, 1));
    let pass = engine.complete_due(&registry, 10).await.unwrap();
    assert_eq!((pass.taken, pass.completed), (1, 1), "{pass:?}");
    assert_completed(&engine.execute(&op, &call, &eid).await.unwrap(), true);
    assert_eq!(
        (effects(&s, &eid, "debit").await, effects(&s, &eid, "settle").await),
        (1, 1)
    );
    assert_eq!((vendor.sends.load(Ordering::SeqCst), vendor.applied()), (1, 1));
}

/// Completers racing over the same operations: each is taken and finished by one, and every step's effect happens once.
pub async fn steps_completers_race_each_operation_once<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let (engine, vendor) = (isolated_engine(&s, &clock).await, Vendor::scripted(&[]));
    let eids: Vec<String> = (0..6).map(|_| effect_id()).collect();
    for eid in &eids {
        let op = Withdrawal::<S>::new(vendor.clone()).crashing_at("pay");
        assert!(engine.execute(&op, &new_call(eid), eid).await.is_err());
    }
    clock.advance(std::time::Duration::from_millis(LEASE_MS as u64));
    let barrier = Arc::new(tokio::sync::Barrier::new(4));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let twin = s.another().await;
        let completer = StepsEngine::new(twin.backend(), engine.store().clone())
            .with_clock(Arc::new(clock.clone()))
            .with_lease_ms(LEASE_MS);
        let (registry, barrier) = (
            Registry::new().with(Withdrawal::<S>::new(vendor.clone())),
            barrier.clone(),
        );
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            completer.complete_due(&registry, 100).await.unwrap()
        }));
    }
    let mut completed = 0;
    for t in tasks {
        completed += t.await.unwrap().completed;
    }
    assert_eq!(completed, 6, "each operation was finished by one completer");
    for eid in &eids {
        assert_eq!(
            (effects(&s, eid, "debit").await, effects(&s, eid, "settle").await),
            (1, 1)
        );
    }
    assert_eq!((vendor.sends.load(Ordering::SeqCst), vendor.applied()), (6, 6));
}

/// A failure the operation's own code returns after a step committed starts its compensation, recorded so: retries replay it.
pub async fn steps_failure_returned_by_the_operation_is_compensated<S: MultiStepSubject>(s: S) {
    struct OverLimit<S: Subject>(std::marker::PhantomData<fn() -> S>);
    impl<S: Subject> Operation<S::Backend> for OverLimit<S> {
        type Input = String;
        type Output = Value;
        const NAME: &'static str = "over-limit@1";
        fn run<'r>(&'r self, run: &'r mut Run<'_, S::Backend>, eid: &'r String) -> BoxFuture<'r, Result<Value, Halt>> {
            Box::pin(async move {
                Withdrawal::<S>::write(run, "debit", eid).await?;
                Err(Halt::Failed(json!("over the daily limit")))
            })
        }
        fn compensate<'r>(
            &'r self,
            run: &'r mut Run<'_, S::Backend>,
            eid: &'r String,
            _failure: &'r Value,
        ) -> BoxFuture<'r, Result<(), Halt>> {
            Box::pin(async move {
                // Only what ran is undone.
                assert!(run.forward::<String>("debit").is_some());
                assert!(run.forward::<Value>("pay").is_none());
                Withdrawal::<S>::write(run, "credit", eid).await.map(drop)
            })
        }
    }
    let clock = ManualClock::starting_now();
    let (engine, eid) = (engine(&s, &clock), effect_id());
    let (op, call) = (OverLimit::<S>(std::marker::PhantomData), new_call(&eid));
    let failure = json!("over the daily limit");
    compensates_then_replays(&engine, &op, &call, &eid, failure).await;
    assert_eq!(
        (effects(&s, &eid, "debit").await, effects(&s, &eid, "credit").await),
        (1, 1)
    );
}

/// An external step may start a send only while its run holds the operation.
pub async fn steps_no_send_starts_after_the_lease<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let (engine, eid) = (engine(&s, &clock), effect_id());
    struct Late(ManualClock);
    impl<B: idem_core::TxBackend> Operation<B> for Late {
        type Input = String;
        type Output = Value;
        const NAME: &'static str = "late@1";
        fn run<'r>(&'r self, run: &'r mut Run<'_, B>, _: &'r String) -> BoxFuture<'r, Result<Value, Halt>> {
            Box::pin(async move {
                let clock = self.0.clone();
                run.external("pay", |s| async move {
                    let before = s.may_send();
                    clock.advance(std::time::Duration::from_millis(LEASE_MS as u64));
                    let after = s.may_send();
                    Ok(json!({ "before": before.is_ok(), "after": after.is_ok() }))
                })
                .await
            })
        }
    }
    let done = engine
        .execute(&Late(clock.clone()), &new_call(&eid), &eid)
        .await
        .unwrap();
    let Finished::Completed { output, .. } = done else {
        panic!("got {done:?}")
    };
    assert_eq!(output, json!({ "before": true, "after": false }));
}

/// A run whose process dies at any point of any step (its task aborted
/// there: a local step's transaction written and not committed, an external
/// step marked and not sent, sent and its answer not recorded) is resumed
/// after its lease from its recovery point: every step's effect happens
/// once, and the vendor applies the payment once.
pub async fn steps_run_killed_at_each_boundary_resumes_once<S: MultiStepSubject>(s: S) {
    for point in ["in-debit", "before-send", "after-send", "in-settle"] {
        let clock = ManualClock::starting_now();
        let (engine, vendor, eid) = (Arc::new(engine(&s, &clock)), Vendor::scripted(&[]), effect_id());
        let op = Arc::new(Withdrawal::<S>::new(vendor.clone()));
        *op.stall.at.lock().unwrap() = Some(point);
        let call = new_call(&eid);
        let run = {
            let (engine, op, call, eid) = (engine.clone(), op.clone(), call.clone(), eid.clone());
            tokio::spawn(async move { engine.execute(&*op, &call, &eid).await })
        };
        tokio::time::timeout(std::time::Duration::from_secs(30), op.stall.reached.notified())
            .await
            .unwrap_or_else(|_| panic!("the run reached {point}"));
        run.abort();
        assert!(run.await.unwrap_err().is_cancelled(), "the run died at {point}");
        clock.advance(std::time::Duration::from_millis(LEASE_MS as u64));
        let done = engine.execute(&*op, &call, &eid).await.unwrap();
        assert!(
            matches!(done, Finished::Completed { replayed: false, .. }),
            "after a death at {point}: {done:?}"
        );
        assert_eq!(
            (effects(&s, &eid, "debit").await, effects(&s, &eid, "settle").await),
            (1, 1),
            "after a death at {point}"
        );
        assert_eq!(vendor.applied(), 1, "after a death at {point}");
        let again = engine.execute(&*op, &call, &eid).await.unwrap();
        assert!(matches!(again, Finished::Completed { replayed: true, .. }), "{again:?}");
    }
}

/// An operation held on an unknown outcome is let go by an operator's
/// verdict and finished once: "applied" finishes the step from the answer
/// the operator gave, sending nothing; "not applied" (once the send has
/// settled) sends afresh with the same key.
pub async fn steps_unknown_outcome_is_resolved_by_a_verdict<S: MultiStepSubject>(s: S) {
    for verdict in [Verdict::Applied, Verdict::NotApplied] {
        let clock = ManualClock::starting_now();
        let (engine, vendor, op, call, eid) = held_on_unknown(&s, &clock).await;
        clock.advance(std::time::Duration::from_millis(2 * LEASE_MS as u64));
        let mut row = engine.store().find(call.scope(), call.key()).await.unwrap().unwrap();
        let settlement = Settlement {
            verdict,
            by: VerdictSource::Operator,
            status: (verdict == Verdict::Applied).then_some(200),
            body: br#"{"payout":"po_operator"}"#.to_vec(),
            note: "checked at the vendor".into(),
        };
        row.settle(&settlement, idem_core::Clock::now_ms(&clock)).unwrap();
        engine.store().write(&row).await.unwrap();
        let done = engine.execute(&op, &call, &eid).await.unwrap();
        let Finished::Completed {
            output,
            replayed: false,
        } = done
        else {
            panic!("{verdict:?}: got {done:?}")
        };
        assert_eq!(
            (effects(&s, &eid, "debit").await, effects(&s, &eid, "settle").await),
            (1, 1)
        );
        if verdict == Verdict::Applied {
            assert_eq!(output["paid"]["payout"], "po_operator");
            assert_eq!(vendor.sends.load(Ordering::SeqCst), 1, "nothing sent again");
        } else {
            assert_eq!(vendor.sends.load(Ordering::SeqCst), 2, "sent afresh");
            assert_eq!(vendor.applied(), 1);
            let seen = vendor.seen.lock().unwrap().clone();
            assert_eq!(seen[0].0, seen[1].0, "with the same key");
        }
    }
}
