//! The purge of final operations past their expiry, run by the engine's
//! own operations: what it deletes, what it keeps, and what a retry of a
//! purged key does.

use super::*;

/// A purge deletes the final operations past their expiry, a batch at a time (`limit` bounds it), and nothing else: not a final one before its expiry, nor a running, held or compensating one whatever its times; an expired operation replays until purged, and a retry of a purged key runs a fresh operation.
pub async fn steps_purge_deletes_only_expired_final_operations<S: MultiStepSubject>(s: S) {
    const TTL_MS: i64 = 3_600_000;
    let clock = ManualClock::starting_now();
    let engine = isolated_engine(&s, &clock).await.with_ttl_ms(TTL_MS);
    let steps = engine.store().clone();
    let now = || idem_core::Clock::now_ms(&clock);
    let t0 = now();
    // One vendor, and one effect id and call, per operation.
    let start = |script: &[Next]| (Vendor::scripted(script), effect_id());
    let (completed_vendor, completed_eid) = start(&[]);
    let completed_call = new_call(&completed_eid);
    let completed_op = Withdrawal::<S>::new(completed_vendor.clone());
    let run_completed = async || {
        engine
            .execute(&completed_op, &completed_call, &completed_eid)
            .await
            .unwrap()
    };
    assert_completed(&run_completed().await, false);
    let (compensated_vendor, compensated_eid) = start(&[Next::Decline]);
    let compensated_call = new_call(&compensated_eid);
    let done = engine
        .execute(
            &Withdrawal::<S>::new(compensated_vendor),
            &compensated_call,
            &compensated_eid,
        )
        .await
        .unwrap();
    assert!(
        matches!(done, Finished::Compensated { replayed: false, .. }),
        "got {done:?}"
    );
    // Not final, each given an expiry and a change time long past: a purge
    // must not take them for expired.
    let (running_vendor, running_eid) = start(&[]);
    let running_call = new_call(&running_eid);
    let op = Withdrawal::<S>::new(running_vendor).crashing_at("settle");
    assert!(engine.execute(&op, &running_call, &running_eid).await.is_err());
    let (held_vendor, held_eid) = start(&[Next::Unknown]);
    let held_call = new_call(&held_eid);
    let done = engine
        .execute(&Withdrawal::<S>::new(held_vendor), &held_call, &held_eid)
        .await
        .unwrap();
    assert_eq!(done, Finished::Held(HoldKind::Unknown));
    let (compensating_vendor, compensating_eid) = start(&[Next::Decline]);
    let compensating_call = new_call(&compensating_eid);
    let op = Withdrawal::<S>::new(compensating_vendor).crashing_at("credit");
    assert!(
        engine
            .execute(&op, &compensating_call, &compensating_eid)
            .await
            .is_err()
    );
    let mut unfinished = Vec::new();
    for (call, state) in [
        (&running_call, MultiStepState::Running),
        (&held_call, MultiStepState::Held),
        (&compensating_call, MultiStepState::Compensating),
    ] {
        let mut row = steps.find(call.scope(), call.key()).await.unwrap().unwrap();
        assert_eq!(row.state, state);
        row.expires_at_ms = Some(1);
        row.updated_at_ms = 1;
        steps.write(&row).await.unwrap();
        unfinished.push(steps.get(row.id).await.unwrap().unwrap());
    }
    let expires = t0 + TTL_MS;
    let mut purged_ids = Vec::new();
    for call in [&completed_call, &compensated_call] {
        let row = steps.find(call.scope(), call.key()).await.unwrap().unwrap();
        assert_eq!(row.expires_at_ms, Some(expires), "kept the engine's TTL");
        purged_ids.push(row.id);
    }
    // One completed an hour later, so not yet expired when the first two are.
    clock.advance(std::time::Duration::from_millis(TTL_MS as u64));
    let (later_vendor, later_eid) = start(&[]);
    let later_call = new_call(&later_eid);
    let done = engine
        .execute(&Withdrawal::<S>::new(later_vendor), &later_call, &later_eid)
        .await
        .unwrap();
    assert_completed(&done, false);

    assert_eq!(
        steps.purge_expired(expires - 1, 100).await.unwrap(),
        0,
        "nothing has expired yet"
    );
    // Expired, not yet purged: still replayed.
    assert_completed(&run_completed().await, true);
    assert_eq!(
        steps.purge_expired(now(), 1).await.unwrap(),
        1,
        "the limit bounds the batch"
    );
    assert_eq!(
        steps.purge_expired(now(), 100).await.unwrap(),
        1,
        "the other expired one"
    );
    assert_eq!(steps.purge_expired(now(), 100).await.unwrap(), 0, "none left");
    for (call, id) in [&completed_call, &compensated_call].into_iter().zip(&purged_ids) {
        assert_eq!(steps.find(call.scope(), call.key()).await.unwrap(), None, "purged");
        assert_eq!(steps.get(*id).await.unwrap(), None, "purged");
    }
    let later = steps.find(later_call.scope(), later_call.key()).await.unwrap().unwrap();
    assert_eq!(later.state, MultiStepState::Completed, "not expired: kept");
    for row in &unfinished {
        assert_eq!(
            steps.get(row.id).await.unwrap().as_ref(),
            Some(row),
            "a {} operation is kept whatever its expiry",
            row.state.as_str()
        );
    }
    // Much later, only the later completed one goes.
    assert_eq!(steps.purge_expired(i64::MAX, 100).await.unwrap(), 1);
    assert_eq!(steps.find(later_call.scope(), later_call.key()).await.unwrap(), None);
    for row in &unfinished {
        assert!(
            steps.get(row.id).await.unwrap().is_some(),
            "{} kept",
            row.state.as_str()
        );
    }

    // A retry of a purged key starts afresh: every step runs again (the
    // vendor sees the step's same key and applies it once).
    assert_completed(&run_completed().await, false);
    assert_eq!(
        (
            effects(&s, &completed_eid, "debit").await,
            effects(&s, &completed_eid, "settle").await
        ),
        (2, 2),
        "a new operation ran every local step again"
    );
    assert_eq!(
        (
            completed_vendor.sends.load(Ordering::SeqCst),
            completed_vendor.applied()
        ),
        (2, 1)
    );
    let renewed = steps
        .find(completed_call.scope(), completed_call.key())
        .await
        .unwrap()
        .unwrap();
    assert_ne!(renewed.id, purged_ids[0], "a new row");
    assert_eq!(
        (renewed.state, renewed.runs, renewed.expires_at_ms),
        (MultiStepState::Completed, 1, Some(now() + TTL_MS))
    );
}
