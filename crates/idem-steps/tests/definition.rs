//! A definition that changed under a running operation holds it: a resumed
//! run that asks for another step than the journal recorded, or ends
//! without asking for every recorded step, never records an outcome.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use idem_core::multistep::{HoldKind, MultiStepState, MultiStepStore};
use idem_core::{BoxFuture, Call, Fingerprint, IdempotencyKey, Scope};
use idem_memory::{MemoryMultiSteps, MemoryStore};
use idem_steps::{Finished, Halt, Operation, Run, StepError, StepsEngine};

/// Two local steps, then a send that asks to be called again once; with
/// `short` set, only the first local step.
#[derive(Default)]
struct Changing {
    short: AtomicBool,
    sends: AtomicU32,
}

impl Operation<MemoryStore> for Changing {
    type Input = ();
    type Output = u32;
    const NAME: &'static str = "changing@1";

    fn run<'r>(&'r self, run: &'r mut Run<'_, MemoryStore>, _: &'r ()) -> BoxFuture<'r, Result<u32, Halt>> {
        Box::pin(async move {
            run.local("one", |_tx| Box::pin(async { Ok(1u32) })).await?;
            if self.short.load(Ordering::SeqCst) {
                return Ok(1);
            }
            run.local("two", |_tx| Box::pin(async { Ok(2u32) })).await?;
            run.external("send", |_s| async {
                match self.sends.fetch_add(1, Ordering::SeqCst) {
                    0 => Err(StepError::Retry {
                        why: "busy".into(),
                        after_ms: 0,
                    }),
                    n => Ok(n),
                }
            })
            .await
        })
    }
}

#[tokio::test]
async fn a_run_that_skips_recorded_steps_holds_the_operation() {
    let store = MemoryMultiSteps::new();
    let engine = Arc::new(StepsEngine::new(MemoryStore::new(), store.clone()));
    let scope = Scope::parse("acme", "POST /v1/changing").unwrap();
    let call = Call::new(
        scope.clone(),
        IdempotencyKey::new("k").unwrap(),
        Fingerprint::of_bytes(scope.operation(), b""),
    );
    let op = Changing::default();
    assert_eq!(engine.execute(&op, &call, &()).await.unwrap(), Finished::InFlight);
    op.short.store(true, Ordering::SeqCst);
    let held = engine.execute(&op, &call, &()).await.unwrap();
    assert_eq!(held, Finished::Held(HoldKind::Nondeterministic));
    let row = store.find(call.scope(), call.key()).await.unwrap().unwrap();
    assert_eq!(row.state, MultiStepState::Held);
    assert!(row.response.is_none(), "no outcome recorded");
    // It stays held: a retry answers the hold, and nothing runs.
    assert_eq!(
        engine.execute(&op, &call, &()).await.unwrap(),
        Finished::Held(HoldKind::Nondeterministic)
    );
    assert_eq!(op.sends.load(Ordering::SeqCst), 1);
}
