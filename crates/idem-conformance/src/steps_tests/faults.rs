//! Multi-step operations on a store that fails on purpose: every call a
//! run makes to the operations' rows and every commit of its steps, taken
//! one at a time, refused, timed out, or applied and reported as failed;
//! the caller's retries (and takeovers once the failed run's lease ran
//! out) finish the operation with each effect once.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use idem_core::ManualClock;
use idem_faults::{Fault, FaultPlan, Faulty, Op};
use idem_steps::{Finished, StepsEngine};
use serde_json::json;

use super::{LEASE_MS, Next, Vendor, Withdrawal, effects, new_call, replayed};
use crate::effect_id;
use crate::multistep_tests::MultiStepSubject;

/// A faulty engine: the subject's backend and, beside it, its operations'
/// store, failing with one plan (no fault unless one is aimed; a timeout
/// hangs 2 ms), on `clock`. The store's faults are the backend's.
pub(super) fn faulty_engine<S: MultiStepSubject>(
    s: &S,
    clock: &ManualClock,
) -> StepsEngine<Faulty<S::Backend>, Faulty<S::Steps>> {
    let plan = FaultPlan {
        timeout: Duration::from_millis(2),
        ..FaultPlan::none()
    };
    let backend = Faulty::new(s.backend(), plan);
    StepsEngine::new(backend.clone(), backend.beside(s.steps()))
        .with_clock(Arc::new(clock.clone()))
        .with_lease_ms(LEASE_MS)
}

/// The calls a fault is aimed at, one at a time.
const AIMED: [Op; 4] = [Op::StepRead, Op::StepInsert, Op::StepWrite, Op::Commit];

/// Each call a run makes to the operations' store or to its backend's
/// commit, refused, timed out, or applied and reported as failed, for an
/// operation that completes and one whose payment is declined and
/// compensated: retried until it ends, each local step's write is
/// committed once, the vendor applies one payment under one key, and the
/// ending is replayed as it was first answered.
pub async fn steps_store_faults_leave_each_effect_once<S: MultiStepSubject>(s: S) {
    let clock = ManualClock::starting_now();
    let engine = faulty_engine(&s, &clock);
    let faults = engine.store().faults();
    let (mut aimed, mut heard) = (0, 0);
    for declined in [false, true] {
        let script: &[Next] = if declined { &[Next::Decline] } else { &[] };
        // A run without faults: how many calls of each kind one makes.
        let before = AIMED.map(|op| faults.calls(op));
        let eid = effect_id();
        let clean = engine
            .execute(&Withdrawal::<S>::new(Vendor::scripted(script)), &new_call(&eid), &eid)
            .await
            .unwrap();
        assert!(
            !matches!(clean, Finished::InFlight | Finished::Held(_)),
            "got {clean:?}"
        );
        let calls = AIMED.map(|op| faults.calls(op));
        for (i, op) in AIMED.into_iter().enumerate() {
            assert!(calls[i] > before[i], "a run calls {} (declined: {declined})", op.name());
            for n in 0..calls[i] - before[i] {
                for fault in [Fault::Refused, Fault::TimedOut, Fault::AppliedThenRefused] {
                    let what = format!("{} #{n} {} (declined: {declined})", op.name(), fault.name());
                    let injected = faults.total();
                    let (vendor, eid) = (Vendor::scripted(script), effect_id());
                    let withdrawal = Withdrawal::<S>::new(vendor.clone());
                    let call = new_call(&eid);
                    faults.fail_nth(op, n, fault);
                    let mut tries = 0;
                    let ending = loop {
                        tries += 1;
                        assert!(tries <= 8, "{what}: the operation never ended");
                        match engine.execute(&withdrawal, &call, &eid).await {
                            Ok(Finished::InFlight) | Err(_) => {
                                // The failed run holds its lease until it runs out.
                                clock.advance(Duration::from_millis(LEASE_MS as u64));
                            }
                            Ok(done) => break done,
                        }
                    };
                    assert_eq!(faults.total(), injected + 1, "{what}: the fault hit its call");
                    aimed += 1;
                    heard += usize::from(tries > 1);
                    let (debits, settles, credits) = (
                        effects(&s, &eid, "debit").await,
                        effects(&s, &eid, "settle").await,
                        effects(&s, &eid, "credit").await,
                    );
                    // The ending follows the vendor's truth: this vendor
                    // takes each send afresh, so a payment it declined may
                    // be applied by the resend of a run that could not
                    // record the decline. An ending applied and reported as
                    // failed is replayed to the retry.
                    let paid = vendor.applied();
                    assert!(paid <= 1, "{what}: {paid} payments applied");
                    match &ending {
                        Finished::Completed { .. } if paid == 1 => {}
                        Finished::Compensated { failure, .. }
                            if paid == 0 && *failure == json!({ "declined": "account closed" }) => {}
                        other => panic!("{what}: ended {other:?} with {paid} payment(s) applied"),
                    }
                    assert_eq!(
                        (debits, settles, credits),
                        (1, paid as u64, 1 - paid as u64),
                        "{what}: each local step once"
                    );
                    let seen = vendor.seen.lock().unwrap().clone();
                    assert!(!seen.is_empty(), "{what}: the payment was asked for");
                    assert!(seen.iter().all(|(key, _)| *key == seen[0].0), "{what}: one key");
                    let again = engine.execute(&withdrawal, &call, &eid).await.unwrap();
                    assert_eq!(again, replayed(ending), "{what}: the ending is replayed");
                    assert!(vendor.sends.load(Ordering::SeqCst) <= tries, "{what}");
                }
            }
        }
    }
    assert!(aimed >= 30, "every call of a run was aimed at ({aimed})");
    assert_eq!(heard, aimed, "every fault reached the caller");
}
