//! Refusals declared before anything of an operation was committed, by an
//! operation that consumes final rejections ([`Consume::SuccessOrFinalRejection`]):
//! recorded in one row already ended, replayed to every later call of the
//! key, and recorded once or not at all on a store that fails on purpose.

use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::multistep::{MultiStepState, MultiStepStore};
use idem_core::{BoxFuture, Error, ManualClock, Policy, TxBackend};
use idem_faults::{Fault, Op};
use idem_steps::{Consume, Finished, Halt, Operation, Run, StepError};
use serde_json::{Value, json};

use super::{engine, new_call};
use crate::call_for;
use crate::multistep_tests::MultiStepSubject;

/// Refuses every call: its first step (a local one) declares
/// "insufficient funds", or, with input `false`, the operation itself
/// refuses "over the limit" before any step.
#[derive(Default)]
struct Refusing {
    /// Times `run` was entered.
    runs: AtomicUsize,
    /// Times `compensate` was entered.
    compensations: AtomicUsize,
}

impl<B: TxBackend> Operation<B> for Refusing {
    type Input = bool;
    type Output = ();
    const NAME: &'static str = "refusing@1";
    const CONSUME: Consume = Consume::SuccessOrFinalRejection;

    fn run<'r>(&'r self, run: &'r mut Run<'_, B>, by_step: &'r bool) -> BoxFuture<'r, Result<(), Halt>> {
        Box::pin(async move {
            self.runs.fetch_add(1, Ordering::SeqCst);
            if !*by_step {
                return Err(Halt::Failed(json!("over the limit")));
            }
            run.local::<(), _>("debit", |_tx| {
                Box::pin(async { Err(StepError::Declared(json!("insufficient funds"))) })
            })
            .await
        })
    }

    fn compensate<'r>(
        &'r self,
        _run: &'r mut Run<'_, B>,
        _input: &'r bool,
        _failure: &'r Value,
    ) -> BoxFuture<'r, Result<(), Halt>> {
        self.compensations.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Ok(()) })
    }
}

fn failure_of(by_step: bool) -> Value {
    if by_step {
        json!("insufficient funds")
    } else {
        json!("over the limit")
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
    for by_step in [true, false] {
        let failure = failure_of(by_step);
        let op = Refusing::default();
        let call = new_call(&format!("refused-{by_step}"));
        assert_eq!(
            engine.execute(&op, &call, &by_step).await.unwrap(),
            ended(&failure, false),
            "by step: {by_step}"
        );
        let row = engine
            .store()
            .find(call.scope(), call.key())
            .await
            .unwrap()
            .expect("the refusal is recorded");
        assert_eq!(row.state, MultiStepState::Compensated, "by step: {by_step}");
        assert_eq!(row.failure.as_ref(), Some(&failure));
        assert!(row.journal.is_empty(), "no step was committed: {:?}", row.journal);
        assert_eq!(row.response, Some(serde_json::to_vec(&failure).unwrap()));
        assert!(row.expires_at_ms.is_some(), "a recorded refusal expires with its key");
        for _ in 0..2 {
            assert_eq!(
                engine.execute(&op, &call, &by_step).await.unwrap(),
                ended(&failure, true)
            );
        }
        assert_eq!(op.runs.load(Ordering::SeqCst), 1, "the refusal was decided once");
        assert_eq!(op.compensations.load(Ordering::SeqCst), 0, "nothing to compensate");
        let other = call_for(call.scope(), call.key(), r#"{"another":"request"}"#, Policy::default());
        assert!(matches!(
            engine.execute(&op, &other, &by_step).await,
            Err(Error::Mismatch)
        ));
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
    for op in [Op::StepInsert, Op::Commit] {
        for fault in [Fault::Refused, Fault::TimedOut, Fault::AppliedThenRefused] {
            let what = format!("{} {}", op.name(), fault.name());
            let refusing = Refusing::default();
            let failure = failure_of(true);
            let call = new_call(&what);
            let injected = faults.total();
            faults.fail_next(op, fault);
            assert!(
                engine.execute(&refusing, &call, &true).await.is_err(),
                "{what}: the failed recording reaches the caller"
            );
            assert_eq!(faults.total(), injected + 1, "{what}: the fault hit its call");
            let committed = engine.store().find(call.scope(), call.key()).await.unwrap().is_some();
            let retry = engine.execute(&refusing, &call, &true).await.unwrap();
            assert_eq!(retry, ended(&failure, committed), "{what}");
            assert_eq!(
                engine.execute(&refusing, &call, &true).await.unwrap(),
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
