//! The fault points of a run (feature `fault-injection`): each is reached
//! where its name says, and switching the recovery points off makes a
//! resumed run do again what the journal had recorded — the double effect
//! a harness's checker must see.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use idem_core::{BoxFuture, Call, Fingerprint, IdempotencyKey, Scope};
use idem_memory::{MemoryMultiSteps, MemoryStore};
use idem_steps::fault::{self, Point};
use idem_steps::{Finished, Halt, Operation, Run, StepError, StepsEngine};

/// A debit (local), then a send that asks to be called again the first
/// time it runs and answers the second time.
struct DebitThenSend {
    debits: Arc<AtomicU32>,
    sends: Arc<AtomicU32>,
}

impl Operation<MemoryStore> for DebitThenSend {
    type Input = i64;
    type Output = u32;
    const NAME: &'static str = "debit-then-send@1";

    fn run<'r>(&'r self, run: &'r mut Run<'_, MemoryStore>, _: &'r i64) -> BoxFuture<'r, Result<u32, Halt>> {
        Box::pin(async move {
            let debits = self.debits.clone();
            run.local("debit", move |tx| {
                let debits = debits.clone();
                Box::pin(async move {
                    tx.on_commit(move || {
                        debits.fetch_add(1, Ordering::SeqCst);
                    });
                    Ok(())
                })
            })
            .await?;
            let sends = self.sends.clone();
            run.external("send", move |_sending| async move {
                match sends.fetch_add(1, Ordering::SeqCst) {
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

fn call(key: &str) -> Call {
    let scope = Scope::parse("acme", "POST /v1/moves").unwrap();
    let fingerprint = Fingerprint::of_bytes(scope.operation(), b"1");
    Call::new(scope, IdempotencyKey::new(key).unwrap(), fingerprint)
}

async fn debits_after_a_resume(key: &str) -> u32 {
    let engine = StepsEngine::new(MemoryStore::new(), MemoryMultiSteps::new());
    let op = DebitThenSend {
        debits: Arc::default(),
        sends: Arc::default(),
    };
    assert_eq!(engine.execute(&op, &call(key), &1).await.unwrap(), Finished::InFlight);
    let done = engine.execute(&op, &call(key), &1).await.unwrap();
    assert!(matches!(done, Finished::Completed { replayed: false, .. }), "{done:?}");
    op.debits.load(Ordering::SeqCst)
}

// One test: the hook and the switch are the process's.
#[tokio::test]
async fn points_are_reached_in_order_and_the_switch_breaks_recovery() {
    let seen: Arc<Mutex<Vec<(Point, String)>>> = Arc::default();
    let log = seen.clone();
    assert!(fault::set_hook(move |point, step| log
        .lock()
        .unwrap()
        .push((point, step.to_owned()))));

    assert_eq!(debits_after_a_resume("k1").await, 1, "the journal answers the debit");
    let seen: Vec<(Point, String)> = seen.lock().unwrap().drain(..).collect();
    let expected = [
        (Point::BeforeStepCommit, "debit"),
        (Point::AfterStepCommit, "debit"),
        (Point::AfterSentMark, "send"),
        // The resume: the debit is recorded, the send marked again.
        (Point::AfterSentMark, "send"),
        (Point::AfterAnswer, "send"),
        (Point::AfterStepCommit, "send"),
    ];
    let seen: Vec<(Point, &str)> = seen.iter().map(|(p, s)| (*p, s.as_str())).collect();
    assert_eq!(seen, expected);
    for point in Point::ALL {
        assert_eq!(Point::parse(point.name()), Some(point));
    }

    fault::set_skip_recovery_points(true);
    assert_eq!(
        debits_after_a_resume("k2").await,
        2,
        "without recovery points the debit runs again"
    );
    fault::set_skip_recovery_points(false);
}
