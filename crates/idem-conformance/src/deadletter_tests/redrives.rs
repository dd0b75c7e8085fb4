//! Redriving dead letters: one redrive holds a letter at a time, a hold
//! runs out and fences its old token, a redrive resolves, fails or points a
//! letter elsewhere; unknown outcomes are held until a verdict, and only a
//! letter known not applied is cancelled.

use std::sync::Arc;

use idem_core::{
    DeadLetterFilter, DeadLetterState, DeadLetterStore, MAX_DEAD_LETTER_RESPONSE, MAX_DEAD_LETTER_TEXT, RedriveOutcome,
    Settlement, Verdict, VerdictSource, clip_response, clip_text,
};
use tokio::sync::Barrier;

use super::{LONG_HOLD_MS, fetch, fresh_tenant, letter, request, resolved, scope_of, take};
use crate::DeadLetterSubject;

fn failed(attempts: u32, error: &str) -> RedriveOutcome {
    RedriveOutcome::Failed {
        attempts,
        error: error.into(),
        first_reached_at_ms: None,
        not_applied_at_ms: None,
    }
}

fn settlement(verdict: Verdict, body: &[u8]) -> Settlement {
    Settlement {
        verdict,
        by: VerdictSource::Operator,
        status: (verdict == Verdict::Applied).then_some(201),
        body: body.to_vec(),
        note: "checked at the vendor".into(),
    }
}

/// A letter being redriven that is recorded again keeps its state and its hold: the redrive still finishes it, and no second redrive takes it meanwhile.
pub async fn recording_a_held_letter_keeps_its_hold<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let id = store.record(&letter(&scope, "k", 1, "first")).await.unwrap();
    let hold = take(&store, id, LONG_HOLD_MS).await;
    assert_eq!(store.record(&letter(&scope, "k", 2, "second")).await.unwrap(), id);
    let got = fetch(&store, id).await;
    assert_eq!(got.state, DeadLetterState::Redriving, "still held");
    assert_eq!(got.redrive_until_ms, hold.dead_letter.redrive_until_ms);
    assert_eq!(got.attempts, 3);
    assert_eq!(got.last_error, "second");
    assert!(
        store.begin_redrive(id, LONG_HOLD_MS).await.unwrap().is_none(),
        "no second redrive while the first holds it"
    );
    assert!(
        store
            .finish_redrive(id, hold.token, &resolved(200, b"ok"))
            .await
            .unwrap(),
        "the redrive that holds it finishes it"
    );
    assert_eq!(fetch(&store, id).await.state, DeadLetterState::Resolved);
}

/// An unknown outcome is held (recorded unknown, or ended unknown by a redrive), kept unknown when recorded again as dead, and settled only by a verdict: applied resolves it with the vendor's answer, not applied makes it dead with no send counted as reached.
pub async fn unknown_outcomes_are_held_until_settled<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let held = letter(&scope, "held", 3, "no way to ask the vendor")
        .reached_at(Some(1_000))
        .outcome_unknown();
    let id = store.record(&held).await.unwrap();
    let got = fetch(&store, id).await;
    assert_eq!(got.state, DeadLetterState::Unknown);
    let r = got.reconciliation.clone().expect("why it is held");
    assert_eq!((r.verdict, r.by), (Verdict::Unknown, VerdictSource::Sender));
    assert_eq!(r.note, "no way to ask the vendor");
    store.record(&letter(&scope, "held", 1, "dead again")).await.unwrap();
    assert_eq!(
        fetch(&store, id).await.state,
        DeadLetterState::Unknown,
        "recording it as dead does not release it"
    );
    let listed = store
        .list(&DeadLetterFilter {
            tenant: Some(scope.tenant().as_str().to_owned()),
            state: Some(DeadLetterState::Unknown),
            ..DeadLetterFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(listed.iter().map(|l| l.id).collect::<Vec<_>>(), vec![id]);
    assert!(
        !store.cancel(id).await.unwrap(),
        "an unknown outcome may have been paid: never cancelled"
    );
    // An operator checked the vendor: it was applied.
    assert!(
        store
            .settle(id, &settlement(Verdict::Applied, b"{\"id\":\"po_1\"}"))
            .await
            .unwrap()
    );
    let got = fetch(&store, id).await;
    assert_eq!(got.state, DeadLetterState::Resolved);
    assert_eq!(got.response_status, Some(201));
    assert_eq!(got.response_body.as_deref(), Some(&b"{\"id\":\"po_1\"}"[..]));
    let r = got.reconciliation.expect("the verdict");
    assert_eq!((r.verdict, r.by), (Verdict::Applied, VerdictSource::Operator));
    assert_eq!(r.note, "checked at the vendor");
    assert!(
        !store.settle(id, &settlement(Verdict::NotApplied, b"")).await.unwrap(),
        "a resolved letter is final"
    );

    // Another one, held by a redrive that could not tell, then found not applied.
    let id = store
        .record(&letter(&scope, "redriven", 1, "e").reached_at(Some(2_000)))
        .await
        .unwrap();
    let hold = take(&store, id, LONG_HOLD_MS).await;
    assert!(
        !store.settle(id, &settlement(Verdict::NotApplied, b"")).await.unwrap(),
        "not while a redrive holds it"
    );
    let unknown = RedriveOutcome::Unknown {
        attempts: 0,
        reason: "past the vendor's key horizon; no way to ask it".into(),
        first_reached_at_ms: Some(2_000),
    };
    assert!(store.finish_redrive(id, hold.token, &unknown).await.unwrap());
    let got = fetch(&store, id).await;
    assert_eq!(got.state, DeadLetterState::Unknown);
    assert_eq!(got.last_error, "past the vendor's key horizon; no way to ask it");
    assert!(store.settle(id, &settlement(Verdict::NotApplied, b"")).await.unwrap());
    let got = fetch(&store, id).await;
    assert_eq!(got.state, DeadLetterState::Dead);
    assert_eq!(
        got.first_reached_at_ms, None,
        "nothing reached the vendor since it said so"
    );
    assert_eq!(got.reconciliation.map(|r| r.verdict), Some(Verdict::NotApplied));
}

/// The earliest send that may have reached the vendor is kept across records; a redrive's account replaces it, and a redrive that found the call not applied says so.
pub async fn first_reach_is_kept_and_a_redrive_replaces_it<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let id = store
        .record(&letter(&scope, "k", 1, "e").reached_at(Some(5_000)))
        .await
        .unwrap();
    store
        .record(&letter(&scope, "k", 1, "e").reached_at(Some(9_000)))
        .await
        .unwrap();
    store.record(&letter(&scope, "k", 1, "e")).await.unwrap();
    assert_eq!(fetch(&store, id).await.first_reached_at_ms, Some(5_000));
    store
        .record(&letter(&scope, "k", 1, "e").reached_at(Some(4_000)))
        .await
        .unwrap();
    assert_eq!(fetch(&store, id).await.first_reached_at_ms, Some(4_000));
    let hold = take(&store, id, LONG_HOLD_MS).await;
    let asked = RedriveOutcome::Failed {
        attempts: 2,
        error: "connection refused".into(),
        first_reached_at_ms: None,
        not_applied_at_ms: Some(7_000),
    };
    assert!(store.finish_redrive(id, hold.token, &asked).await.unwrap());
    let got = fetch(&store, id).await;
    assert_eq!(got.state, DeadLetterState::Dead);
    assert_eq!(got.first_reached_at_ms, None);
    let r = got.reconciliation.expect("the vendor's verdict");
    assert_eq!(
        (r.verdict, r.by, r.at_ms),
        (Verdict::NotApplied, VerdictSource::Vendor, 7_000)
    );
    // Found applied when asked: resolved without a send, and it says so.
    let hold = take(&store, id, LONG_HOLD_MS).await;
    let found = RedriveOutcome::Resolved {
        status: 200,
        body: b"{\"id\":\"po_9\"}".to_vec(),
        reconciled: true,
    };
    assert!(store.finish_redrive(id, hold.token, &found).await.unwrap());
    let got = fetch(&store, id).await;
    assert_eq!(got.state, DeadLetterState::Resolved);
    assert_eq!(
        got.reconciliation.map(|r| (r.verdict, r.by)),
        Some((Verdict::Applied, VerdictSource::Vendor))
    );
}

/// Only a dead letter known not to have been applied is cancelled, once; a cancelled letter is final and purged like a resolved one.
pub async fn only_a_letter_known_not_applied_is_cancelled<S: DeadLetterSubject>(s: S) {
    let s = s.isolated().await;
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let id = store.record(&letter(&scope, "k", 1, "e")).await.unwrap();
    assert!(!store.cancel(id).await.unwrap(), "no verdict yet");
    assert!(!store.cancel(i64::MAX).await.unwrap(), "missing");
    assert!(store.settle(id, &settlement(Verdict::NotApplied, b"")).await.unwrap());
    // A send after the verdict may have reached the vendor: not cancelled.
    store
        .record(&letter(&scope, "k", 1, "timeout").reached_at(Some(1)))
        .await
        .unwrap();
    assert!(!store.cancel(id).await.unwrap());
    assert!(store.settle(id, &settlement(Verdict::NotApplied, b"")).await.unwrap());
    let hold = take(&store, id, LONG_HOLD_MS).await;
    assert!(!store.cancel(id).await.unwrap(), "not while a redrive holds it");
    assert!(
        store
            .finish_redrive(id, hold.token, &failed(1, "refused"))
            .await
            .unwrap()
    );
    // The take was the redrive's sent mark: from then on a send may have
    // reached the vendor, and only a verdict given after it clears that.
    let after = fetch(&store, id).await;
    assert!(after.first_reached_at_ms.is_some(), "{after:?}");
    assert!(
        !store.cancel(id).await.unwrap(),
        "a redrive may have reached the vendor"
    );
    assert!(store.settle(id, &settlement(Verdict::NotApplied, b"")).await.unwrap());
    assert!(store.cancel(id).await.unwrap());
    assert!(!store.cancel(id).await.unwrap(), "once");
    let got = fetch(&store, id).await;
    assert_eq!(got.state, DeadLetterState::Cancelled);
    assert!(
        store.begin_redrive(id, LONG_HOLD_MS).await.unwrap().is_none(),
        "never sent again"
    );
    store.record(&letter(&scope, "k", 5, "again")).await.unwrap();
    assert_eq!(fetch(&store, id).await, got, "recording does not revive it");
    s.elapse(30).await;
    assert_eq!(store.purge_resolved(10, 10).await.unwrap(), 1);
    assert!(store.get(id).await.unwrap().is_none());
}

/// A redrive may point a held letter at another URL (what is stored is what was sent); only its holder may, and only with a valid URL.
pub async fn a_held_letter_can_be_pointed_elsewhere<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let id = store.record(&letter(&scope, "k", 1, "e")).await.unwrap();
    assert!(
        !store.retarget(id, 1, "http://fixed.example/v1/payouts").await.unwrap(),
        "not held"
    );
    let hold = take(&store, id, LONG_HOLD_MS).await;
    assert!(store.retarget(id, hold.token, "ftp://nope").await.is_err());
    assert!(
        !store
            .retarget(id, hold.token + 1, "http://fixed.example/v1/payouts")
            .await
            .unwrap()
    );
    assert!(
        store
            .retarget(id, hold.token, "http://fixed.example:8443/v1/payouts?x=1")
            .await
            .unwrap()
    );
    let got = fetch(&store, id).await;
    assert_eq!(got.request.url(), "http://fixed.example:8443/v1/payouts?x=1");
    assert_eq!(got.request.body(), request(b"{\"amount\":100}").body());
    assert_eq!(got.state, DeadLetterState::Redriving);
}

/// Sixteen concurrent redrives of one dead letter: exactly one holds it.
pub async fn begin_redrive_takes_a_letter_once<S: DeadLetterSubject>(s: S) {
    const TASKS: usize = 16;
    let store = s.store();
    let other = s.another().await;
    let scope = scope_of(&fresh_tenant(), "payout");
    let id = store.record(&letter(&scope, "contended", 1, "e")).await.unwrap();
    let barrier = Arc::new(Barrier::new(TASKS));
    let mut tasks = Vec::new();
    for i in 0..TASKS {
        let barrier = barrier.clone();
        let store = if i % 2 == 0 { store.clone() } else { other.clone() };
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            store.begin_redrive(id, LONG_HOLD_MS).await.expect("begin_redrive")
        }));
    }
    let mut holds = Vec::new();
    for task in tasks {
        if let Some(hold) = task.await.expect("task") {
            holds.push(hold);
        }
    }
    assert_eq!(holds.len(), 1, "exactly one redrive holds the letter");
    assert_eq!(holds[0].token, 1);
    let got = fetch(&store, id).await;
    assert_eq!(got.redrives, 1, "the losers changed nothing");
    assert_eq!(got.state, DeadLetterState::Redriving);
}

/// A held letter is not taken again until the hold runs out; the hold shows in the row.
pub async fn held_letter_is_not_taken_again<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let id = store.record(&letter(&scope, "k", 4, "e")).await.unwrap();
    let hold = take(&store, id, LONG_HOLD_MS).await;
    assert_eq!(hold.token, 1);
    assert_eq!(hold.dead_letter.id, id);
    assert_eq!(hold.dead_letter.state, DeadLetterState::Redriving);
    assert_eq!(hold.dead_letter.redrives, 1);
    assert_eq!(hold.dead_letter.attempts, 4);
    assert_eq!(hold.dead_letter.request, request(b"{\"amount\":100}"));
    let until = hold.dead_letter.redrive_until_ms.expect("a hold has an end");
    assert!(until >= hold.dead_letter.updated_at_ms + LONG_HOLD_MS - 1000);
    assert!(store.begin_redrive(id, LONG_HOLD_MS).await.unwrap().is_none());
    assert_eq!(
        fetch(&store, id).await,
        hold.dead_letter,
        "the row is as the hold took it"
    );
}

/// After its hold runs out a letter is taken again with a larger token; the old token can no longer finish it.
pub async fn expired_hold_is_taken_again_and_fences_the_old_token<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let id = store.record(&letter(&scope, "k", 1, "e")).await.unwrap();
    let old = take(&store, id, 50).await;
    s.elapse(120).await;
    let new = take(&store, id, LONG_HOLD_MS).await;
    assert!(new.token > old.token, "{} > {}", new.token, old.token);
    let before = fetch(&store, id).await;
    assert!(
        !store
            .finish_redrive(id, old.token, &resolved(200, b"late"))
            .await
            .unwrap()
    );
    assert!(!store.finish_redrive(id, old.token, &failed(3, "late")).await.unwrap());
    assert_eq!(fetch(&store, id).await, before, "the stale redrive changed nothing");
    assert!(store.finish_redrive(id, new.token, &failed(1, "again")).await.unwrap());
    assert_eq!(fetch(&store, id).await.attempts, 2);
}

/// A resolved redrive keeps status and body up to the response bound (a vendor's answer of several KiB whole); the letter is final: not taken, not revived by recording.
pub async fn resolved_letter_is_final<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let id = store.record(&letter(&scope, "k", 2, "e")).await.unwrap();
    let hold = take(&store, id, LONG_HOLD_MS).await;
    let mut body = vec![0xFFu8, 0x00, 0xFE];
    body.resize(MAX_DEAD_LETTER_RESPONSE + 100, 0xAB);
    assert!(
        store
            .finish_redrive(id, hold.token, &resolved(201, &body))
            .await
            .unwrap()
    );
    let got = fetch(&store, id).await;
    assert_eq!(got.state, DeadLetterState::Resolved);
    assert_eq!(got.response_status, Some(201));
    assert_eq!(got.response_body.as_deref(), Some(&body[..MAX_DEAD_LETTER_RESPONSE]));
    assert_eq!(got.redrive_until_ms, None);
    assert_eq!(got.attempts, 2);
    assert!(store.begin_redrive(id, LONG_HOLD_MS).await.unwrap().is_none());
    assert!(
        !store.finish_redrive(id, hold.token, &failed(1, "twice")).await.unwrap(),
        "a redrive finishes once"
    );
    assert_eq!(
        store.record(&letter(&scope, "k", 9, "recorded again")).await.unwrap(),
        id
    );
    assert_eq!(
        fetch(&store, id).await,
        got,
        "recording does not revive a resolved letter"
    );
    // A text answer is clipped on a character boundary.
    let id2 = store.record(&letter(&scope, "k2", 1, "e")).await.unwrap();
    let hold = take(&store, id2, LONG_HOLD_MS).await;
    let text = format!(
        "{{\"id\":\"po_1\",\"pad\":\"{}\"}}",
        "ü".repeat(MAX_DEAD_LETTER_RESPONSE)
    );
    assert!(
        store
            .finish_redrive(id2, hold.token, &resolved(200, text.as_bytes()))
            .await
            .unwrap()
    );
    let kept = fetch(&store, id2).await.response_body.expect("a body");
    assert_eq!(kept, clip_response(text.as_bytes()));
    assert!(std::str::from_utf8(&kept).is_ok(), "cut on a character boundary");
    // An answer of 8 KiB, twice the old bound, is kept whole.
    let id3 = store.record(&letter(&scope, "k3", 1, "e")).await.unwrap();
    let hold = take(&store, id3, LONG_HOLD_MS).await;
    let answer = format!("{{\"id\":\"po_8k\",\"metadata\":\"{}\"}}", "m".repeat(8 * 1024));
    assert!(
        store
            .finish_redrive(id3, hold.token, &resolved(201, answer.as_bytes()))
            .await
            .unwrap()
    );
    assert_eq!(
        fetch(&store, id3).await.response_body.as_deref(),
        Some(answer.as_bytes())
    );
}

/// A failed redrive makes the letter dead again, attempts added and the error replaced (clipped), ready to be taken again.
pub async fn failed_redrive_is_dead_again<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let id = store.record(&letter(&scope, "k", 5, "first")).await.unwrap();
    let hold = take(&store, id, LONG_HOLD_MS).await;
    let error = format!("502 {}", "ø".repeat(MAX_DEAD_LETTER_TEXT));
    assert!(store.finish_redrive(id, hold.token, &failed(3, &error)).await.unwrap());
    let got = fetch(&store, id).await;
    assert_eq!(got.state, DeadLetterState::Dead);
    assert_eq!(got.attempts, 8);
    assert_eq!(got.last_error, clip_text(&error));
    assert_eq!(got.redrive_until_ms, None);
    assert_eq!(got.response_status, None);
    assert_eq!(got.redrives, 1);
    assert!(
        !store.finish_redrive(id, hold.token, &failed(3, &error)).await.unwrap(),
        "a redrive finishes once"
    );
    assert_eq!(fetch(&store, id).await.attempts, 8);
    let next = take(&store, id, LONG_HOLD_MS).await;
    assert_eq!(next.token, 2);
}

/// Unknown ids answer nothing; a hold that is not positive is refused.
pub async fn missing_letters_and_bad_holds<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    for id in [i64::MAX, -1, 0] {
        assert!(store.get(id).await.unwrap().is_none(), "get {id}");
        assert!(
            store.begin_redrive(id, LONG_HOLD_MS).await.unwrap().is_none(),
            "begin {id}"
        );
        assert!(
            !store.finish_redrive(id, 1, &resolved(200, b"")).await.unwrap(),
            "finish {id}"
        );
    }
    let scope = scope_of(&fresh_tenant(), "payout");
    let id = store.record(&letter(&scope, "k", 1, "e")).await.unwrap();
    assert!(store.begin_redrive(id, 0).await.is_err());
    assert!(store.begin_redrive(id, -5).await.is_err());
    assert_eq!(
        fetch(&store, id).await.state,
        DeadLetterState::Dead,
        "a refused hold takes nothing"
    );
    assert!(
        !store.finish_redrive(id, 0, &resolved(200, b"")).await.unwrap(),
        "not held"
    );
}
