//! External steps through the outbound client, against the fake vendor:
//! one derived key for every send of a step, lost answers recovered by the
//! vendor's memory of the key, a refusal declared and compensated, and a
//! vendor without keys whose lost answer holds the operation rather than
//! paying twice.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{BoxFuture, Call, Fingerprint, IdempotencyKey, OutboundRequest, Scope};
use idem_memory::{MemoryMultiSteps, MemoryStore};
use idem_outbound::{Jitter, KeyHorizon, OutboundClient, OutboundConfig};
use idem_steps::{Answer, Finished, Halt, Operation, Run, StepError, StepsEngine};
use serde_json::{Value, json};

/// A payout of `amount` to the vendor at `base`, through `client`.
struct Payout {
    client: OutboundClient,
    base: String,
}

impl Operation<MemoryStore> for Payout {
    type Input = i64;
    type Output = Value;
    const NAME: &'static str = "payout@1";

    fn run<'r>(&'r self, run: &'r mut Run<'_, MemoryStore>, amount: &'r i64) -> BoxFuture<'r, Result<Value, Halt>> {
        Box::pin(async move {
            let body = json!({ "amount": amount, "reference": "w-1" }).to_string().into_bytes();
            let request =
                OutboundRequest::new("POST", format!("{}/v1/payouts", self.base), vec![], body).map_err(Halt::Store)?;
            run.outbound("pay", &self.client, &request, |answer| match answer {
                Answer::Applied { body, .. } => serde_json::from_slice::<Value>(body)
                    .map_err(|e| StepError::Fatal(format!("the vendor's answer: {e}"))),
                Answer::Rejected { status, .. } => Err(StepError::Declared(json!({ "refused": status }))),
            })
            .await
        })
    }
}

/// A client that sends once per call (no retries within it): a lost answer
/// ends the call, and the next run of the step sends again.
fn client(horizon: KeyHorizon) -> OutboundClient {
    OutboundClient::new(OutboundConfig {
        retry_delays: Vec::new(),
        jitter: Jitter::None,
        attempt_timeout: Duration::from_secs(2),
        key_horizon: horizon,
        ..OutboundConfig::default()
    })
    .unwrap()
}

fn call(key: &str) -> Call {
    let scope = Scope::parse("acme", "POST /v1/withdrawals").unwrap();
    let fingerprint = Fingerprint::of_bytes(scope.operation(), key.as_bytes());
    Call::new(scope, IdempotencyKey::new(key).unwrap(), fingerprint)
}

/// An engine in memory, a fake vendor started with `options`, and a payout
/// to it through a client whose keys live for `horizon`.
async fn setup(
    options: fake_vendor::Options,
    horizon: KeyHorizon,
) -> (
    StepsEngine<MemoryStore, MemoryMultiSteps>,
    Payout,
    Arc<fake_vendor::Vendor>,
) {
    let (base, vendor) = fake_vendor::start(options, None).await.unwrap();
    let engine = StepsEngine::new(MemoryStore::new(), MemoryMultiSteps::new());
    let op = Payout {
        client: client(horizon),
        base,
    };
    (engine, op, vendor)
}

/// A vendor that remembers keys for an hour, trusted for 59 minutes.
fn an_hour() -> KeyHorizon {
    KeyHorizon::new(Duration::from_secs(3600), Duration::from_secs(60))
}

fn dropping() -> fake_vendor::Faults {
    fake_vendor::Faults {
        apply_then_drop: 1.0,
        ..fake_vendor::Faults::default()
    }
}

/// A dropped answer is sent again by the next run with the step's key; the vendor answers its record, and pays once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_pays_once() {
    let (engine, op, vendor) = setup(fake_vendor::Options::default(), an_hour()).await;
    vendor.set_faults(dropping()).await;
    let first = engine.execute(&op, &call("w-1"), &500).await.unwrap();
    assert_eq!(first, Finished::InFlight, "every answer was lost: the step waits");
    vendor.set_faults(fake_vendor::Faults::default()).await;
    // The step asked to wait a moment before its next send.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let done = engine.execute(&op, &call("w-1"), &500).await.unwrap();
    let Finished::Completed {
        output,
        replayed: false,
    } = done
    else {
        panic!("got {done:?}")
    };
    assert_eq!(output["amount"], 500);
    assert_eq!(vendor.paid(), 1, "paid once, whatever was lost");
    let again = engine.execute(&op, &call("w-1"), &500).await.unwrap();
    assert_eq!(again, Finished::Completed { output, replayed: true });
    assert_eq!(vendor.paid(), 1);
}

/// A final refusal is the step's declared failure: the operation is compensated, and replays so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_is_declared() {
    let (engine, op, vendor) = setup(fake_vendor::Options::default(), an_hour()).await;
    // A negative amount: the vendor refuses it with a 400.
    let done = engine.execute(&op, &call("w-2"), &-5).await.unwrap();
    assert_eq!(
        done,
        Finished::Compensated {
            failure: json!({ "refused": 400 }),
            replayed: false
        }
    );
    let again = engine.execute(&op, &call("w-2"), &-5).await.unwrap();
    assert!(matches!(again, Finished::Compensated { replayed: true, .. }));
    assert_eq!(vendor.paid(), 0);
}

/// A vendor without keys: after a lost answer the step is never sent again blindly; with no way to ask, it is held, and the vendor paid once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vendor_without_keys_is_never_paid_twice() {
    let without_keys = fake_vendor::Options {
        idempotency: false,
        ..fake_vendor::Options::default()
    };
    let (engine, op, vendor) = setup(without_keys, KeyHorizon::NONE).await;
    vendor.set_faults(dropping()).await;
    let first = engine.execute(&op, &call("w-3"), &700).await.unwrap();
    vendor.set_faults(fake_vendor::Faults::default()).await;
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let later = engine.execute(&op, &call("w-3"), &700).await.unwrap();
    assert!(
        matches!(later, Finished::Held(idem_core::multistep::HoldKind::Unknown)),
        "first {first:?}, later {later:?}"
    );
    assert_eq!(vendor.paid(), 1, "the lost payment was not made again");
}
