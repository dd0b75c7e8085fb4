use std::time::Duration;

use serde_json::json;

use super::*;
use crate::deadletter::{SentUnder, Settlement, Verdict, VerdictSource};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::scope::Scope;

const LEASE: i64 = 30_000;

fn new_op() -> NewMultiStep {
    let scope = Scope::parse("acme", "POST /v1/withdrawals").unwrap();
    NewMultiStep {
        fingerprint: Fingerprint::of_bytes(scope.operation(), b"{}"),
        scope,
        key: IdempotencyKey::new("w-1").unwrap(),
        definition: "withdrawal@1".into(),
        input: br#"{"amount":100}"#.to_vec(),
        ttl_ms: 86_400_000,
    }
}

fn started(now: i64) -> MultiStep {
    MultiStep::created(&new_op(), 1, now, LEASE).unwrap()
}

fn step(name: &str, kind: StepKind, outcome: StepOutcome) -> JournalEntry {
    JournalEntry {
        name: name.into(),
        kind,
        undo: false,
        outcome,
        at_ms: 0,
    }
}

fn ok(name: &str, kind: StepKind) -> JournalEntry {
    step(name, kind, StepOutcome::Output(json!({ "step": name })))
}

fn undo(name: &str) -> JournalEntry {
    JournalEntry {
        undo: true,
        ..ok(name, StepKind::Local)
    }
}

fn terms(settle_ms: u64) -> SentUnder {
    SentUnder {
        key_horizon: Duration::from_secs(3600),
        horizon_margin: Duration::from_secs(60),
        settle: Duration::from_millis(settle_ms),
    }
}

fn settlement(verdict: Verdict) -> Settlement {
    Settlement {
        verdict,
        by: VerdictSource::Operator,
        status: Some(201),
        body: br#"{"id":"po_1"}"#.to_vec(),
        note: "checked the vendor's dashboard".into(),
    }
}

/// Steps recorded in order make the recovery point, and the journal survives its stored form.
#[test]
fn steps_are_journalled_in_order_and_round_trip() {
    let mut op = started(1_000);
    op.record(1, ok("debit", StepKind::Local), 1_001).unwrap();
    op.mark_sent(1, "payout", 1_002, Some(terms(5_000))).unwrap();
    op.record(1, ok("payout", StepKind::External), 1_003).unwrap();
    assert_eq!(op.journal.len(), 2);
    assert_eq!(op.open, None, "the answer closed the open send");
    assert_eq!(op.journal.get(1).unwrap().at_ms, 1_003, "recorded on the store's clock");
    let decoded = Journal::decode(&op.journal.encode()).unwrap();
    assert_eq!(decoded, op.journal);
    assert_eq!(Journal::decode(&[]).unwrap(), Journal::new());
    assert!(matches!(Journal::decode(&[0x07, b'[', b']']), Err(Error::Corrupt(_))));
    assert!(matches!(Journal::decode(&[0x01, b'{']), Err(Error::Corrupt(_))));
}

/// A step is recorded once per direction; names and sizes are bounded.
#[test]
fn journal_refuses_twins_bad_names_and_oversized_outputs() {
    let mut j = Journal::new();
    j.push(ok("debit", StepKind::Local)).unwrap();
    assert!(matches!(
        j.push(ok("debit", StepKind::Local)),
        Err(Error::InvalidRequest(_))
    ));
    j.push(undo("debit")).unwrap();
    assert!(matches!(j.push(ok("", StepKind::Local)), Err(Error::InvalidRequest(_))));
    assert!(matches!(
        j.push(ok("two words", StepKind::Local)),
        Err(Error::InvalidRequest(_))
    ));
    let big = step(
        "big",
        StepKind::Local,
        StepOutcome::Output(json!("x".repeat(MAX_STEP_OUTPUT))),
    );
    assert!(matches!(j.push(big), Err(Error::RecordTooLarge { .. })));
    let mut full = Journal::new();
    for i in 0..MAX_STEPS {
        full.push(ok(&format!("s{i}"), StepKind::Local)).unwrap();
    }
    assert!(matches!(
        full.push(ok("one-more", StepKind::Local)),
        Err(Error::InvalidRequest(_))
    ));
}

/// A runner is taken over only once its lease ran out, and the old token can then write nothing.
#[test]
fn takeover_fences_the_stale_runner() {
    let mut op = started(1_000);
    assert_eq!(op.take(1_000 + LEASE - 1, LEASE), None, "the lease is live");
    let token = op.take(1_000 + LEASE, LEASE).unwrap();
    assert_eq!((token, op.runs), (2, 2));
    for write in [
        op.clone().record(1, ok("debit", StepKind::Local), 40_000),
        op.clone().mark_sent(1, "payout", 40_000, None),
        op.clone().extend(1, 40_000, LEASE),
        op.clone().hold(1, HoldKind::Failed, "x", 40_000),
        op.clone().defer(1, 50_000, 40_000),
        op.clone().finish(1, b"{}".to_vec(), 40_000),
    ] {
        assert!(matches!(write, Err(Error::Fenced)), "{write:?}");
    }
    op.record(token, ok("debit", StepKind::Local), 40_000).unwrap();
}

/// A resend keeps the first send's time and counts; terms only get stricter; one send is open at a time.
#[test]
fn sent_mark_keeps_the_earliest_send() {
    let mut op = started(1_000);
    op.mark_sent(1, "fx-quote", 2_000, Some(terms(5_000))).unwrap();
    op.mark_sent(1, "fx-quote", 3_000, Some(terms(9_000))).unwrap();
    let open = op.open.clone().unwrap();
    assert_eq!(
        (open.first_sent_at_ms, open.last_sent_at_ms, open.sends),
        (2_000, 3_000, 2)
    );
    assert_eq!(open.sent_under.unwrap().settle, Duration::from_millis(9_000));
    assert!(matches!(
        op.mark_sent(1, "payout", 3_100, None),
        Err(Error::InvalidRequest(_))
    ));
    assert!(
        matches!(
            op.record(1, ok("payout", StepKind::External), 3_100),
            Err(Error::InvalidRequest(_))
        ),
        "another step cannot be recorded over an open send"
    );
    assert!(matches!(
        op.finish(1, b"{}".to_vec(), 3_100),
        Err(Error::InvalidRequest(_))
    ));
    op.record(1, ok("fx-quote", StepKind::External), 3_200).unwrap();
    assert!(
        matches!(op.mark_sent(1, "fx-quote", 3_300, None), Err(Error::InvalidRequest(_))),
        "a recorded step never sends again"
    );
}

/// A declared failure starts the compensation, whose steps are journalled apart, then the operation ends compensated.
#[test]
fn declared_failure_compensates() {
    let mut op = started(1_000);
    op.record(1, ok("debit", StepKind::Local), 1_001).unwrap();
    let declined = step("payout", StepKind::External, StepOutcome::Failed(json!("declined")));
    op.record(1, declined, 1_002).unwrap();
    assert_eq!(op.state, MultiStepState::Compensating);
    assert_eq!(op.failure, Some(json!("declined")));
    assert!(
        matches!(
            op.record(1, ok("credit-back", StepKind::Local), 1_003),
            Err(Error::InvalidRequest(_))
        ),
        "a forward step is refused while compensating"
    );
    let failed_undo = JournalEntry {
        outcome: StepOutcome::Failed(json!("no")),
        ..undo("credit-back")
    };
    assert!(matches!(
        op.record(1, failed_undo, 1_003),
        Err(Error::InvalidRequest(_))
    ));
    op.record(1, undo("credit-back"), 1_004).unwrap();
    op.finish(1, b"declined".to_vec(), 1_005).unwrap();
    assert_eq!(op.state, MultiStepState::Compensated);
    assert_eq!(op.expires_at_ms, Some(1_005 + new_op().ttl_ms));
    assert_eq!(op.take(1_000_000, LEASE), None, "a final operation is never taken");
}

/// A deferred operation is not due before its time, then any runner takes it.
#[test]
fn deferred_operation_waits() {
    let mut op = started(1_000);
    op.defer(1, 10_000, 1_500).unwrap();
    assert_eq!(op.lease_until_ms, None);
    assert!(!op.is_due(9_999));
    assert_eq!(op.take(10_000, LEASE), Some(2));
    assert_eq!(op.not_before_ms, None);
}

/// An unknown outcome holds the operation until a verdict: "applied" lets it go on with the answer kept.
#[test]
fn unknown_outcome_applied_verdict() {
    let mut op = started(1_000);
    op.mark_sent(1, "payout", 2_000, Some(terms(5_000))).unwrap();
    op.hold(1, HoldKind::Unknown, "the vendor cannot say", 3_000).unwrap();
    assert_eq!(op.take(1_000_000, LEASE), None, "a held operation is never taken");
    assert!(
        matches!(op.resume(4_000), Err(Error::InvalidRequest(_))),
        "an unknown outcome needs a verdict"
    );
    assert!(
        matches!(op.cancel("x", 4_000), Err(Error::InvalidRequest(_))),
        "it may have been paid"
    );
    op.settle(&settlement(Verdict::Unknown), 4_000).unwrap();
    assert_eq!(op.state, MultiStepState::Held);
    op.settle(&settlement(Verdict::Applied), 4_100).unwrap();
    assert_eq!(
        (op.state, op.token, op.lease_until_ms),
        (MultiStepState::Running, 2, None)
    );
    let verdict: SendVerdict = op.verdict.clone().unwrap();
    assert_eq!(
        (verdict.status, verdict.body.as_slice()),
        (Some(201), &br#"{"id":"po_1"}"#[..])
    );
    assert!(op.open.is_some(), "the runner records the step from the answer");
    let token = op.take(4_100, LEASE).unwrap();
    op.record(token, ok("payout", StepKind::External), 4_200).unwrap();
    assert_eq!((op.open.clone(), op.verdict.clone()), (None, None));
}

/// "Not applied" is trusted only after the latest send settled; then the step sends afresh, and a cancel is allowed.
#[test]
fn unknown_outcome_not_applied_after_settle() {
    let mut op = started(1_000);
    op.mark_sent(1, "payout", 2_000, Some(terms(5_000))).unwrap();
    op.hold(1, HoldKind::Unknown, "lost answer", 3_000).unwrap();
    assert!(matches!(
        op.settle(&settlement(Verdict::NotApplied), 6_999),
        Err(Error::InvalidRequest(_))
    ));
    assert_eq!(op.state, MultiStepState::Held, "a refused verdict changes nothing");
    op.settle(&settlement(Verdict::NotApplied), 7_000).unwrap();
    assert_eq!((op.state, op.open.clone()), (MultiStepState::Running, None));
    assert_eq!(op.verdict.as_ref().map(|v| v.status), Some(None));
    op.cancel("customer asked", 7_100).unwrap();
    assert_eq!(op.state, MultiStepState::Compensating);
    assert_eq!(op.failure, Some(json!({ "cancelled": "customer asked" })));
    assert!(matches!(op.cancel("again", 7_200), Err(Error::InvalidRequest(_))));
}

/// Operators hold and resume; a live runner is never cancelled or held under it; a verdict needs an unknown hold.
#[test]
fn operator_actions_fence_runners() {
    let mut op = started(1_000);
    assert!(
        matches!(op.cancel("x", 2_000), Err(Error::InvalidRequest(_))),
        "a runner holds it"
    );
    assert!(matches!(
        op.hold_for_operator("x", 2_000),
        Err(Error::InvalidRequest(_))
    ));
    assert!(matches!(
        op.settle(&settlement(Verdict::Applied), 2_000),
        Err(Error::InvalidRequest(_))
    ));
    assert!(matches!(op.resume(2_000), Err(Error::InvalidRequest(_))));
    let after = 1_000 + LEASE;
    op.hold_for_operator("looking into it", after).unwrap();
    assert!(matches!(
        op.record(1, ok("debit", StepKind::Local), after),
        Err(Error::Fenced)
    ));
    op.resume(after + 1).unwrap();
    assert_eq!((op.state, op.token), (MultiStepState::Running, 3));
    op.hold(3, HoldKind::Exhausted, "vendor down", after + 2).unwrap();
    op.resume(after + 3).unwrap();
    assert!(op.is_due(after + 3));
}

/// A held compensation resumes as a compensation.
#[test]
fn held_compensation_resumes_compensating() {
    let mut op = started(1_000);
    let declined = step("debit", StepKind::Local, StepOutcome::Failed(json!("no funds")));
    op.record(1, declined, 1_001).unwrap();
    op.hold(1, HoldKind::Failed, "credit-back refused", 1_002).unwrap();
    op.resume(1_003).unwrap();
    assert_eq!(op.state, MultiStepState::Compensating);
}

/// Bad starts are refused: oversized input, a bad definition name, a TTL that is not positive.
#[test]
fn bad_starts_are_refused() {
    let big = NewMultiStep {
        input: vec![b'x'; MAX_OPERATION_INPUT + 1],
        ..new_op()
    };
    assert!(matches!(
        MultiStep::created(&big, 1, 0, LEASE),
        Err(Error::RecordTooLarge { .. })
    ));
    let unnamed = NewMultiStep {
        definition: String::new(),
        ..new_op()
    };
    assert!(matches!(
        MultiStep::created(&unnamed, 1, 0, LEASE),
        Err(Error::InvalidRequest(_))
    ));
    let forever = NewMultiStep { ttl_ms: 0, ..new_op() };
    assert!(matches!(
        MultiStep::created(&forever, 1, 0, LEASE),
        Err(Error::Config(_))
    ));
}

/// States and hold kinds round-trip their stored names; unknown names are corrupt rows.
#[test]
fn names_round_trip() {
    for s in [
        MultiStepState::Running,
        MultiStepState::Held,
        MultiStepState::Compensating,
        MultiStepState::Completed,
        MultiStepState::Compensated,
    ] {
        assert_eq!(MultiStepState::parse(s.as_str()).unwrap(), s);
    }
    for k in [
        HoldKind::Unknown,
        HoldKind::Exhausted,
        HoldKind::Failed,
        HoldKind::Nondeterministic,
        HoldKind::Operator,
    ] {
        assert_eq!(HoldKind::parse(k.as_str()).unwrap(), k);
    }
    assert!(matches!(MultiStepState::parse("done"), Err(Error::Corrupt(_))));
    assert!(matches!(HoldKind::parse("odd"), Err(Error::Corrupt(_))));
}

/// Step keys are stable, distinct per step, per key and per tenant, and valid keys.
#[test]
fn step_keys_are_derived_and_scoped() {
    let scope = Scope::parse("acme", "POST /v1/withdrawals").unwrap();
    let other = Scope::parse("globex", "POST /v1/withdrawals").unwrap();
    let key = IdempotencyKey::new("w-1").unwrap();
    let a = step_key(&scope, &key, "payout");
    assert_eq!(a, step_key(&scope, &key, "payout"));
    assert_eq!(a.as_str().len(), 45);
    assert!(a.as_str().starts_with("idem-"));
    assert_ne!(a, step_key(&scope, &key, "fx-quote"));
    assert_ne!(a, step_key(&other, &key, "payout"));
    assert_ne!(a, step_key(&scope, &IdempotencyKey::new("w-2").unwrap(), "payout"));
    // Length prefixes: moving a boundary between parts changes the key.
    let k1 = IdempotencyKey::new("ab").unwrap();
    let k2 = IdempotencyKey::new("a").unwrap();
    assert_ne!(step_key(&scope, &k1, "c"), step_key(&scope, &k2, "bc"));
}

/// Every field survives the stored form; a document that does not decode is a corrupt row.
#[test]
fn stored_row_round_trips() {
    let mut op = started(1_000);
    op.id = 7;
    op.version = 3;
    op.record(1, ok("debit", StepKind::Local), 1_001).unwrap();
    op.mark_sent(1, "payout", 1_002, Some(terms(5_000))).unwrap();
    op.hold(1, HoldKind::Unknown, "lost ✓ answer", 1_003).unwrap();
    let fresh = op.clone();
    op.settle(&settlement(Verdict::Applied), 1_004).unwrap();
    let token = op.take(1_005, LEASE).unwrap();
    op.record(
        token,
        step("payout", StepKind::External, StepOutcome::Failed(json!({"code": 7}))),
        1_006,
    )
    .unwrap();
    op.defer(token, 9_000, 1_007).unwrap();
    for row in [fresh, op.clone()] {
        let stored = MultiStepRow::from(&row);
        assert_eq!(
            (stored.step, stored.state.as_str()),
            (row.journal.len() as i64, row.state.as_str())
        );
        assert_eq!(stored.decode().unwrap(), row);
    }
    let token = op.take(9_000, LEASE).unwrap();
    op.record(token, undo("credit-back"), 9_001).unwrap();
    op.finish(token, vec![0, 255, 1], 9_002).unwrap();
    assert_eq!(MultiStepRow::from(&op).decode().unwrap(), op);
    let mut bad = MultiStepRow::from(&op);
    bad.document[0] = 9;
    assert!(matches!(bad.decode(), Err(Error::Corrupt(_))));
    bad.document = b"\x01{}".to_vec();
    assert!(matches!(bad.decode(), Err(Error::Corrupt(_))));
    let mut bad = MultiStepRow::from(&op);
    bad.state = "done".into();
    assert!(matches!(bad.decode(), Err(Error::Corrupt(_))));
}

/// An operation that fails by itself compensates; a send still open refuses it; a compensating one cannot fail again.
#[test]
fn the_operation_itself_may_fail() {
    let mut op = started(1_000);
    op.record(1, ok("debit", StepKind::Local), 1_001).unwrap();
    op.mark_sent(1, "pay", 1_002, None).unwrap();
    assert!(matches!(op.fail(1, json!("x"), 1_003), Err(Error::InvalidRequest(_))));
    op.record(1, ok("pay", StepKind::External), 1_004).unwrap();
    assert!(matches!(op.fail(2, json!("x"), 1_005), Err(Error::Fenced)));
    op.fail(1, json!("limit exceeded"), 1_005).unwrap();
    assert_eq!(
        (op.state, op.failure.clone()),
        (MultiStepState::Compensating, Some(json!("limit exceeded")))
    );
    assert!(matches!(
        op.fail(1, json!("again"), 1_006),
        Err(Error::InvalidRequest(_))
    ));
}

/// A hold of kind unknown with no send open (a local step cannot have reached anyone) resumes.
#[test]
fn unknown_hold_without_a_send_resumes() {
    let mut op = started(1_000);
    op.hold(1, HoldKind::Unknown, "odd", 1_001).unwrap();
    op.resume(1_002).unwrap();
    assert_eq!(op.state, MultiStepState::Running);
}

/// Step names cannot hold ':', so no forward step shares a compensation step's key.
#[test]
fn step_names_exclude_colons() {
    assert!(check_step_name("undo:refund").is_err());
    assert!(check_step_name("refund").is_ok());
}

/// A journal stops growing at its byte limit, and a response over its limit is refused; neither changes the row.
#[test]
fn journal_and_response_are_bounded() {
    let mut j = Journal::new();
    let big = |i: usize| {
        step(
            &format!("s{i}"),
            StepKind::Local,
            StepOutcome::Output(json!("x".repeat(60 * 1024))),
        )
    };
    let mut refused = None;
    for i in 0..MAX_STEPS {
        if let Err(e) = j.push(big(i)) {
            refused = Some((i, e));
            break;
        }
    }
    let (at, e) = refused.expect("the byte limit comes before the step limit");
    assert!(matches!(e, Error::RecordTooLarge { .. }));
    assert_eq!(j.len(), at, "the refused step is not kept");
    assert!(j.encode().len() <= MAX_JOURNAL_BYTES);
    // The size kept as the journal grew is the stored size.
    let stored = j.encode().len();
    let mut one_more = Journal::decode(&j.encode()).unwrap();
    assert_eq!(one_more, j);
    let small = step("small", StepKind::Local, StepOutcome::Output(json!(1)));
    let small_bytes = serde_json::to_vec(&small).unwrap().len();
    assert!(stored + 1 + small_bytes <= MAX_JOURNAL_BYTES, "room for a small step");
    one_more.push(small).unwrap();
    assert_eq!(one_more.encode().len(), stored + 1 + small_bytes);
    let mut op = started(1_000);
    let before = op.clone();
    assert!(matches!(
        op.finish(1, vec![b'x'; MAX_RESPONSE_BYTES + 1], 1_001),
        Err(Error::RecordTooLarge { .. })
    ));
    assert_eq!(op, before);
}

/// A listing's filter refuses pages out of bounds, empty names and a bad step name, and reads no state it cannot match.
#[test]
fn a_filter_is_checked_before_anything_is_read() {
    let ok = MultiStepFilter::default();
    ok.check().unwrap();
    for limit in [0, MAX_MULTISTEP_PAGE + 1] {
        let f = MultiStepFilter { limit, ..ok.clone() };
        assert!(matches!(f.check(), Err(Error::InvalidRequest(_))), "{limit}");
    }
    MultiStepFilter {
        limit: MAX_MULTISTEP_PAGE,
        ..ok.clone()
    }
    .check()
    .unwrap();
    for f in [
        MultiStepFilter {
            tenant: Some(String::new()),
            ..ok.clone()
        },
        MultiStepFilter {
            operation: Some(String::new()),
            ..ok.clone()
        },
        MultiStepFilter {
            open_step: Some("undo:pay".into()),
            ..ok.clone()
        },
    ] {
        assert!(matches!(f.check(), Err(Error::InvalidRequest(_))), "{f:?}");
    }
    assert_eq!(ok.scanned_states().len(), 5, "every state");
    let open = MultiStepFilter {
        open_step: Some("pay".into()),
        ..ok.clone()
    };
    assert_eq!(
        open.scanned_states(),
        [
            MultiStepState::Running,
            MultiStepState::Held,
            MultiStepState::Compensating
        ],
        "a final operation has no open send"
    );
    let none = MultiStepFilter {
        states: vec![MultiStepState::Completed],
        ..open
    };
    assert!(none.scanned_states().is_empty());
}

/// Each filter of a listing tests its own part of the row; the page starts after the cursor, ties broken by id.
#[test]
fn a_filter_matches_each_part_of_the_row() {
    let mut running = started(1_000);
    running.id = 1;
    running.record(1, ok("debit", StepKind::Local), 1_001).unwrap();
    let mut held = started(1_000);
    held.id = 2;
    held.record(1, ok("debit", StepKind::Local), 1_001).unwrap();
    held.mark_sent(1, "payout", 1_001, None).unwrap();
    held.hold(1, HoldKind::Unknown, "lost", 1_001).unwrap();
    let all = MultiStepFilter::default();
    let only = |f: MultiStepFilter| -> Vec<i64> {
        [&running, &held]
            .into_iter()
            .filter(|op| f.matches(op))
            .map(|op| op.id)
            .collect()
    };
    assert_eq!(only(all.clone()), [1, 2]);
    let states = MultiStepFilter {
        states: vec![MultiStepState::Held, MultiStepState::Completed],
        ..all.clone()
    };
    assert_eq!(only(states), [2]);
    let tenant = MultiStepFilter {
        tenant: Some("other".into()),
        ..all.clone()
    };
    assert_eq!(only(tenant), [] as [i64; 0]);
    let operation = MultiStepFilter {
        tenant: Some("acme".into()),
        operation: Some("POST /v1/withdrawals".into()),
        ..all.clone()
    };
    assert_eq!(only(operation), [1, 2]);
    let step = |n| MultiStepFilter {
        recovery_point: Some(n),
        ..all.clone()
    };
    assert_eq!((only(step(1)), only(step(0))), (vec![1, 2], vec![]));
    let open = |s: &str| MultiStepFilter {
        open_step: Some(s.into()),
        ..all.clone()
    };
    assert_eq!((only(open("payout")), only(open("debit"))), (vec![2], vec![]));
    let since = |t| MultiStepFilter {
        unchanged_since_ms: Some(t),
        ..all.clone()
    };
    assert_eq!((only(since(1_001)), only(since(1_000))), (vec![1, 2], vec![]));
    // Both changed at 1 001: the id breaks the tie.
    let after = MultiStepFilter {
        after: Some(MultiStepCursor::of(&running)),
        ..all.clone()
    };
    assert_eq!(only(after), [2]);
    let past = MultiStepFilter {
        after: Some(MultiStepCursor {
            updated_at_ms: 1_001,
            id: 2,
        }),
        ..all
    };
    assert_eq!(only(past), [] as [i64; 0]);
}
