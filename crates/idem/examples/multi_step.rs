//! A multi-step operation: a withdrawal debits an account (a local step) and
//! pays it out through a vendor (an external step). The vendor's answer to
//! the first send is lost; the caller goes away; a completer finishes the
//! operation from its recovery point, and the caller's retry gets the
//! recorded outcome. The debit and the payment each happen once.
//!
//! Run (self-contained: an in-memory store and a fake vendor on a free
//! port):
//!
//! ```sh
//! cargo run -p idem --features steps,memory,outbound --example multi_step
//! #   first call: in flight (the vendor's answer was lost)
//! #   completer: completed 1 operation(s)
//! #   retry: completed (replayed: true), payout po_…
//! #   debited 1 time(s), paid 1 time(s)
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem::memory::{MemoryMultiSteps, MemoryStore};
use idem::outbound::{Jitter, KeyHorizon, OutboundClient, OutboundConfig};
use idem::steps::{Answer, Finished, Halt, Operation, Registry, Run, StepError, StepsEngine};
use idem::{BoxFuture, Call, Fingerprint, IdempotencyKey, OutboundRequest, Scope};
use serde_json::{Value, json};

/// Debit `amount`, then pay it out through the vendor at `vendor_url`.
struct Withdrawal {
    debits: Arc<AtomicU32>,
    client: OutboundClient,
    vendor_url: String,
}

impl Operation<MemoryStore> for Withdrawal {
    type Input = i64;
    type Output = Value;
    const NAME: &'static str = "withdrawal@1";

    fn run<'r>(&'r self, run: &'r mut Run<'_, MemoryStore>, amount: &'r i64) -> BoxFuture<'r, Result<Value, Halt>> {
        Box::pin(async move {
            // Local: the debit commits with the step's recorded output.
            let debits = self.debits.clone();
            let journal: String = run
                .local("debit", move |tx| {
                    let debits = debits.clone();
                    Box::pin(async move {
                        tx.on_commit(move || {
                            debits.fetch_add(1, Ordering::SeqCst);
                        });
                        Ok("j-1".to_owned())
                    })
                })
                .await?;
            // External: marked sent before it leaves, sent with a key derived
            // from the operation's key and the step's name.
            let body = json!({ "amount": amount, "reference": journal })
                .to_string()
                .into_bytes();
            let request = OutboundRequest::new("POST", format!("{}/v1/payouts", self.vendor_url), vec![], body)
                .map_err(Halt::Store)?;
            run.outbound("payout", &self.client, &request, |answer| match answer {
                Answer::Applied { body, .. } => {
                    serde_json::from_slice(body).map_err(|e| StepError::Fatal(format!("vendor answer: {e}")))
                }
                Answer::Rejected { status, .. } => Err(StepError::Declared(json!({ "refused": status }))),
            })
            .await
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The vendor's lost answer ends its connection's task on purpose;
    // `fake_vendor::start` keeps those panics out of the output.
    let (vendor_url, vendor) = fake_vendor::start(fake_vendor::Options::default(), None).await?;
    let debits = Arc::new(AtomicU32::new(0));
    let client = OutboundClient::new(OutboundConfig {
        // One send per call: a lost answer ends the call, and the next run
        // of the step sends again with the same key.
        retry_delays: Vec::new(),
        jitter: Jitter::None,
        key_horizon: KeyHorizon::new(Duration::from_secs(3600), Duration::from_secs(60)),
        ..OutboundConfig::default()
    })?;
    let op = || Withdrawal {
        debits: debits.clone(),
        client: client.clone(),
        vendor_url: vendor_url.clone(),
    };
    let engine = StepsEngine::new(MemoryStore::new(), MemoryMultiSteps::new());
    let scope = Scope::parse("acme", "POST /v1/withdrawals")?;
    let call = Call::new(
        scope.clone(),
        IdempotencyKey::new("w-1")?,
        Fingerprint::of_bytes(scope.operation(), b"500"),
    );

    // The vendor pays, and its answer is lost.
    vendor
        .set_faults(fake_vendor::Faults {
            apply_then_drop: 1.0,
            ..fake_vendor::Faults::default()
        })
        .await;
    let first = engine.execute(&op(), &call, &500).await?;
    println!("first call: {}", describe(&first));
    vendor.set_faults(fake_vendor::Faults::default()).await;

    // The caller went away; a completer finishes the operation once the
    // step's wait is over.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let registry = Registry::new().with(op());
    let pass = engine.complete_due(&registry, 10).await?;
    println!("completer: completed {} operation(s)", pass.completed);

    // The caller's retry gets the recorded outcome.
    let retry = engine.execute(&op(), &call, &500).await?;
    println!("retry: {}", describe(&retry));
    println!(
        "debited {} time(s), paid {} time(s)",
        debits.load(Ordering::SeqCst),
        vendor.paid()
    );
    Ok(())
}

fn describe(f: &Finished<Value>) -> String {
    match f {
        Finished::InFlight => "in flight (the vendor's answer was lost)".into(),
        Finished::Completed { output, replayed } => {
            format!(
                "completed (replayed: {replayed}), payout {}",
                output["id"].as_str().unwrap_or("?")
            )
        }
        other => format!("{other:?}"),
    }
}
