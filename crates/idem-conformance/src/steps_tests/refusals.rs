//! Refusals declared before anything of an operation was committed, by an
//! operation that consumes final rejections ([`Consume::SuccessOrFinalRejection`]):
//! recorded in one row already ended, replayed to every later call of the
//! key, and recorded once or not at all on a store that fails on purpose.

use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::multistep::{MAX_RESPONSE_BYTES, MultiStepState, MultiStepStore};
use idem_core::{BoxFuture, Error, ManualClock, Policy, TxBackend};
use idem_faults::{Fault, Op};
use idem_steps::{Consume, Finished, Halt, Operation, Run, StepError};
use serde_json::{Value, json};

use super::{engine, new_call};
use crate::call_for;
use crate::multistep_tests::MultiStepSubject;

/// Refuses every call: with input `"step"` its first step (a local one)
/// declares "insufficient funds"; with `"itself"` the operation refuses
/// "over the limit" before any step; with `"huge"` its first step declares
/// a failure too large to record.
#[derive(Default)]
struct Refusing {
    /// Times `run` was entered.
    runs: AtomicUsize,
    /// Times `compensate` was entered.
    compensations: AtomicUsize,
}

impl<B: TxBackend> Operation<B> for Refusing {
    type Input = String;
    type Output = ();
    const NAME: &'static str = "refusing@1";
    const CONSUME: Consume = Consume::SuccessOrFinalRejection;

    fn run<'r>(&'r self, run: &'r mut Run<'_, B>, how: &'r String) -> BoxFuture<'r, Result<(), Halt>> {
        Box::pin(async move {
            self.runs.fetch_add(1, Ordering::SeqCst);
            let failure = failure_of(how);
            if how == "itself" {
                return Err(Halt::Failed(failure));
            }
            run.local::<(), _>("debit", move |_tx| {
                let failure = failure.clone();
                Box::pin(async move { Err(StepError::Declared(failure)) })
            })
            .await
        })
    }

    fn compensate<'r>(
        &'r self,
        _run: &'r mut Run<'_, B>,
        _input: &'r String,
        _failure: &'r Value,
    ) -> BoxFuture<'r, Result<(), Halt>> {
        self.compensations.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Ok(()) })
    }
}

fn failure_of(how: &str) -> Value {
    match how {
        "itself" => json!("over the limit"),
        "huge" => json!({ "detail": "x".repeat(MAX_RESPONSE_BYTES) }),
        _ => json!("insufficient funds"),
    }
}

fn ended(failure: &Value, replayed: bool) -> Finished<()> {
    Finished::Compensated {
        failure: failure.clone(),
        replayed,
    }
}

/// A refusal declared before anything was committed, by the first step or
/// by the operation itself, is recorded in one row already ended (no step
/// in its journal, the failure as its response, an expiry): later calls of
/// the key replay it without running anything, nothing is compensated, and
/// another request under the key is a mismatch.
pub async fn steps_first_step_rejection_is_recorded_when_consumed<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let engine = engine(&s, &clock);
    for how in ["step", "itself"].map(String::from) {
        let failure = failure_of(&how);
        let op = Refusing::default();
        let call = new_call(&format!("refused-{how}"));
        assert_eq!(
            engine.execute(&op, &call, &how).await.unwrap(),
            ended(&failure, false),
            "refused by {how}"
        );
        let row = engine
            .store()
            .find(call.scope(), call.key())
            .await
            .unwrap()
            .expect("the refusal is recorded");
        assert_eq!(row.state, MultiStepState::Compensated, "refused by {how}");
        assert_eq!(row.failure.as_ref(), Some(&failure));
        assert!(row.journal.is_empty(), "no step was committed: {:?}", row.journal);
        assert_eq!(row.response, Some(serde_json::to_vec(&failure).unwrap()));
        assert!(row.expires_at_ms.is_some(), "a recorded refusal expires with its key");
        for _ in 0..2 {
            assert_eq!(engine.execute(&op, &call, &how).await.unwrap(), ended(&failure, true));
        }
        assert_eq!(op.runs.load(Ordering::SeqCst), 1, "the refusal was decided once");
        assert_eq!(op.compensations.load(Ordering::SeqCst), 0, "nothing to compensate");
        let other = call_for(call.scope(), call.key(), r#"{"another":"request"}"#, Policy::default());
        assert!(matches!(engine.execute(&op, &other, &how).await, Err(Error::Mismatch)));
    }
}

/// The recording's insert and its commit, each refused, timed out, or
/// applied and reported as failed: the call that hit the fault fails; the
/// caller's retry replays the refusal when the row was committed after
/// all, and otherwise decides it again and records it. Either way the key
/// ends with one recorded refusal, replayed from then on, and nothing
/// compensated.
pub async fn steps_store_faults_on_a_recorded_refusal<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let engine = super::faults::faulty_engine(&s, &clock);
    let faults = engine.store().faults();
    let (mut landed, mut lost) = (0, 0);
    let how = "step".to_owned();
    for op in [Op::StepInsert, Op::Commit] {
        for fault in [Fault::Refused, Fault::TimedOut, Fault::AppliedThenRefused] {
            let what = format!("{} {}", op.name(), fault.name());
            let refusing = Refusing::default();
            let failure = failure_of(&how);
            let call = new_call(&what);
            let injected = faults.total();
            faults.fail_next(op, fault);
            assert!(
                engine.execute(&refusing, &call, &how).await.is_err(),
                "{what}: the failed recording reaches the caller"
            );
            assert_eq!(faults.total(), injected + 1, "{what}: the fault hit its call");
            let committed = engine.store().find(call.scope(), call.key()).await.unwrap().is_some();
            let retry = engine.execute(&refusing, &call, &how).await.unwrap();
            assert_eq!(retry, ended(&failure, committed), "{what}");
            assert_eq!(
                engine.execute(&refusing, &call, &how).await.unwrap(),
                ended(&failure, true),
                "{what}: replayed from then on"
            );
            let runs = refusing.runs.load(Ordering::SeqCst);
            assert_eq!(runs, if committed { 1 } else { 2 }, "{what}");
            assert_eq!(refusing.compensations.load(Ordering::SeqCst), 0, "{what}");
            let row = engine.store().find(call.scope(), call.key()).await.unwrap().unwrap();
            assert_eq!(row.state, MultiStepState::Compensated, "{what}");
            if committed {
                landed += 1;
            } else {
                lost += 1;
            }
        }
    }
    assert!(lost >= 4, "refused and timed-out writes record nothing ({lost})");
    assert!(
        landed >= 1,
        "a commit applied and reported as failed is replayed ({landed})"
    );
}

/// A failure too large to record (over the operation's response limit) is
/// answered unrecorded, as under the default: nothing is written, and the
/// next call decides again.
pub async fn steps_refusal_too_large_to_record_is_answered_unrecorded<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let engine = engine(&s, &clock);
    let (op, how) = (Refusing::default(), "huge".to_owned());
    let call = new_call("huge");
    for _ in 0..2 {
        assert_eq!(
            engine.execute(&op, &call, &how).await.unwrap(),
            Finished::Rejected(failure_of(&how))
        );
    }
    assert_eq!(engine.store().find(call.scope(), call.key()).await.unwrap(), None);
    assert_eq!(op.runs.load(Ordering::SeqCst), 2, "each call decided afresh");
}

/// Twins of one key: the first to start waits, then refuses, while the
/// other has started the operation and completed it. The refusal's insert
/// finds the twin's row: nothing of it is written, and the refused call
/// answers as the twin's retry.
pub async fn steps_recorded_refusal_answers_as_a_twin_that_started_first<S: MultiStepSubject>(s: S) {
    /// `"refuse"`: says it has started, waits for the go, then its first
    /// step refuses. `"pay"`: waits until the other has started, then its
    /// first step debits.
    #[derive(Default)]
    struct Racing {
        started: tokio::sync::Notify,
        go: tokio::sync::Notify,
    }
    impl<B: TxBackend> Operation<B> for Racing {
        type Input = String;
        type Output = String;
        const NAME: &'static str = "racing@1";
        const CONSUME: Consume = Consume::SuccessOrFinalRejection;

        fn run<'r>(&'r self, run: &'r mut Run<'_, B>, role: &'r String) -> BoxFuture<'r, Result<String, Halt>> {
            Box::pin(async move {
                if role == "refuse" {
                    self.started.notify_one();
                    self.go.notified().await;
                    run.local::<String, _>("debit", |_tx| {
                        Box::pin(async { Err(StepError::Declared(json!("insufficient funds"))) })
                    })
                    .await
                } else {
                    self.started.notified().await;
                    run.local("debit", |_tx| Box::pin(async { Ok("debited".to_owned()) }))
                        .await
                }
            })
        }
    }
    let clock = ManualClock::starting_now();
    let engine = engine(&s, &clock);
    let op = Racing::default();
    let call = new_call("racing");
    let (refuse, pay) = ("refuse".to_owned(), "pay".to_owned());
    let (refused, paid) = tokio::join!(engine.execute(&op, &call, &refuse), async {
        let paid = engine.execute(&op, &call, &pay).await;
        op.go.notify_one();
        paid
    });
    let completed = |replayed| Finished::Completed {
        output: "debited".to_owned(),
        replayed,
    };
    assert_eq!(paid.unwrap(), completed(false));
    assert_eq!(
        refused.unwrap(),
        completed(true),
        "the refused call answers as the twin's retry"
    );
    let row = engine.store().find(call.scope(), call.key()).await.unwrap().unwrap();
    assert_eq!(row.state, MultiStepState::Completed);
    assert_eq!(row.failure, None, "nothing of the refusal was written");
}
