//! Two calls of one key that both start the operation afresh: the one
//! whose first step refuses it (the other's debit left too little) answers
//! as the other's retry would, never as a refusal of the call that was
//! applied.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use idem_core::{BoxFuture, Call, Fingerprint, IdempotencyKey, Scope};
use idem_memory::{MemoryMultiSteps, MemoryStore};
use idem_steps::{Finished, Halt, Operation, Run, StepError, StepsEngine};
use serde_json::json;
use tokio::sync::Barrier;

/// A debit that only the first to commit can make.
struct Debit {
    debited: Arc<AtomicBool>,
    debits: Arc<AtomicU32>,
    /// Both calls are in their first step before either commits.
    both_in: Arc<Barrier>,
    /// The second waits for the first's commit before it reads the balance.
    first_done: Arc<tokio::sync::Notify>,
}

impl Operation<MemoryStore> for Debit {
    type Input = bool;
    type Output = u32;
    const NAME: &'static str = "debit@1";

    fn run<'r>(&'r self, run: &'r mut Run<'_, MemoryStore>, first: &'r bool) -> BoxFuture<'r, Result<u32, Halt>> {
        Box::pin(async move {
            let (debited, debits, both_in, first_done, first) = (
                self.debited.clone(),
                self.debits.clone(),
                self.both_in.clone(),
                self.first_done.clone(),
                *first,
            );
            run.local("debit", move |tx| {
                let (debited, debits, both_in, first_done) =
                    (debited.clone(), debits.clone(), both_in.clone(), first_done.clone());
                Box::pin(async move {
                    both_in.wait().await;
                    if !first {
                        first_done.notified().await;
                    }
                    if debited.swap(true, Ordering::SeqCst) {
                        return Err(StepError::Declared(json!("insufficient funds")));
                    }
                    tx.on_commit(move || {
                        debits.fetch_add(1, Ordering::SeqCst);
                    });
                    Ok(1)
                })
            })
            .await
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_twin_refused_by_the_first_step_answers_the_operation_started() {
    let engine = Arc::new(StepsEngine::new(MemoryStore::new(), MemoryMultiSteps::new()));
    let op = Arc::new(Debit {
        debited: Arc::default(),
        debits: Arc::default(),
        both_in: Arc::new(Barrier::new(2)),
        first_done: Arc::default(),
    });
    let scope = Scope::parse("acme", "POST /v1/debits").unwrap();
    let call = Call::new(
        scope.clone(),
        IdempotencyKey::new("k").unwrap(),
        Fingerprint::of_bytes(scope.operation(), b"same request"),
    );
    let first = {
        let (engine, op, call) = (engine.clone(), op.clone(), call.clone());
        tokio::spawn(async move { engine.execute(&*op, &call, &true).await.unwrap() })
    };
    let second = {
        let (engine, op, call) = (engine.clone(), op.clone(), call.clone());
        tokio::spawn(async move { engine.execute(&*op, &call, &false).await.unwrap() })
    };
    let first = first.await.unwrap();
    op.first_done.notify_one();
    let second = second.await.unwrap();
    assert_eq!(
        first,
        Finished::Completed {
            output: 1,
            replayed: false
        }
    );
    assert_eq!(
        second,
        Finished::Completed {
            output: 1,
            replayed: true
        },
        "not a refusal"
    );
    assert_eq!(op.debits.load(Ordering::SeqCst), 1);
}
