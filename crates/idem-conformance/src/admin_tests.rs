//! The operator's view of a keys table ([`KeyAdmin`]): counts, listings,
//! exact lookups and purges that never delete a live claim.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Acquire, Call, Clock, Error, IdempotencyKey, KeyAdmin, KeyFilter, KeyState, Lease, Record};

use crate::*;

fn held(acquire: Acquire) -> Lease {
    match acquire {
        Acquire::Claimed(lease) => lease,
        Acquire::Replay(r) => panic!("expected a claim, got a replay of {r:?}"),
    }
}

/// A purge of expired keys runs while eight tasks claim the same keys again
/// (taking the expired rows over): every claim made during the purge is
/// still in progress afterwards, with its token. A purge deletes only rows
/// that still match its filter when it deletes them.
pub async fn purge_spares_keys_claimed_during_the_purge<S: Subject<Lease: KeyAdmin>>(s: S) {
    const KEYS: usize = 300;
    const CLAIMERS: usize = 8;
    let s = s.isolated().await;
    let (clock, shared) = manual_clock();
    let engine = Arc::new(lease_engine(&s).with_clock(shared));
    let scope = unique_scope("POST /v1/payouts");
    let calls: Vec<Call> = (0..KEYS)
        .map(|_| call_for(&scope, &IdempotencyKey::generate(), "{}", rejecting().with_ttl_secs(10)))
        .collect();
    for call in &calls {
        let lease = held(engine.acquire(call).await.unwrap());
        engine.complete(&lease, Record::completed(b"1".to_vec())).await.unwrap();
    }
    clock.advance(Duration::from_secs(11));
    let now = clock.now_ms();
    let filter = KeyFilter {
        tenant: Some(scope.tenant().as_str().to_owned()),
        state: Some(KeyState::Expired),
        ..KeyFilter::default()
    };
    let start = Arc::new(tokio::sync::Barrier::new(CLAIMERS + 1));
    let purge = {
        let (admin, start) = (s.lease_store(), start.clone());
        tokio::spawn(async move {
            start.wait().await;
            let mut deleted = 0;
            loop {
                let n = admin.purge_keys(&filter, now, 10).await.unwrap();
                deleted += n;
                if n == 0 {
                    break deleted;
                }
            }
        })
    };
    let calls = Arc::new(calls);
    let claimers: Vec<_> = (0..CLAIMERS)
        .map(|t| {
            let (engine, calls, start) = (engine.clone(), calls.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                let mut leases = Vec::new();
                for call in calls.iter().skip(t).step_by(CLAIMERS) {
                    leases.push(held(engine.acquire(call).await.unwrap()));
                }
                leases
            })
        })
        .collect();
    let mut leases = Vec::new();
    for c in claimers {
        leases.extend(c.await.unwrap());
    }
    let purged = purge.await.unwrap();
    let mut deleted_live = 0;
    for lease in &leases {
        match engine.complete(lease, Record::completed(b"2".to_vec())).await {
            Ok(()) => {}
            Err(Error::Fenced) => deleted_live += 1,
            Err(e) => panic!("completing a claim failed: {e}"),
        }
    }
    assert_eq!(
        deleted_live, 0,
        "the purge deleted {deleted_live} claims in progress ({purged} rows purged, {KEYS} claimed)"
    );
}

/// A lease engine on the keys table of `s` on a manual clock, the
/// operator's view of the table, and a fresh scope of `operation`.
fn admin_on<S: Subject>(
    s: &S,
    operation: &str,
) -> (
    ManualClock,
    idem_core::LeaseEngine<S::Lease>,
    S::Lease,
    idem_core::Scope,
) {
    let (clock, shared) = manual_clock();
    let engine = lease_engine(s).with_clock(shared);
    (clock, engine, s.lease_store(), unique_scope(operation))
}

/// A completed outcome recording `payload`.
fn completed(payload: &[u8]) -> Option<Record> {
    Some(Record::completed(payload.to_vec()))
}

/// Claims `key` in `scope` at the engine's time and leaves it as `outcome`
/// says: `Some(record)` recorded, `None` in progress.
async fn put<S: Subject>(
    engine: &idem_core::LeaseEngine<S::Lease>,
    scope: &idem_core::Scope,
    key: &str,
    ttl_secs: u64,
    outcome: Option<Record>,
) {
    let call = call_for(
        scope,
        &IdempotencyKey::new(key).unwrap(),
        "{}",
        rejecting().with_ttl_secs(ttl_secs).with_lease_ms(60_000),
    );
    let lease = held(engine.acquire(&call).await.unwrap());
    if let Some(record) = outcome {
        engine.complete(&lease, record).await.unwrap();
    }
}

/// A key is found by its exact value, with its state and recorded outcome,
/// however many keys of its scope start with it; a prefix of it, another
/// tenant or another operation find nothing.
pub async fn find_key_is_exact<S: Subject<Lease: KeyAdmin>>(s: S) {
    let (clock, shared) = manual_clock();
    let engine = lease_engine(&s).with_clock(shared);
    let admin = s.lease_store();
    let scope = unique_scope("POST /v1/orders");
    for i in 0..12 {
        put::<S>(&engine, &scope, &format!("order-1{i}"), 3600, completed(b"longer")).await;
    }
    put::<S>(&engine, &scope, "order-1", 3600, completed(b"exact")).await;
    let now = clock.now_ms();
    let found = admin
        .find_key(&scope, &IdempotencyKey::new("order-1").unwrap(), now)
        .await
        .unwrap()
        .expect("the exact key is found");
    assert_eq!(
        (found.tenant.as_str(), found.operation.as_str(), found.key.as_str()),
        (scope.tenant().as_str(), scope.operation().as_str(), "order-1")
    );
    assert_eq!(
        (found.state, found.payload.as_slice()),
        (KeyState::Completed, &b"exact"[..])
    );
    for absent in ["order-", "order-2", "ORDER-1"] {
        let none = admin
            .find_key(&scope, &IdempotencyKey::new(absent).unwrap(), now)
            .await
            .unwrap();
        assert_eq!(none, None, "{absent}");
    }
    let other_tenant = unique_scope("POST /v1/orders");
    let other_operation = idem_core::Scope::new(
        scope.tenant().clone(),
        idem_core::Operation::new("POST /v1/refunds").unwrap(),
    );
    for other in [other_tenant, other_operation] {
        let none = admin
            .find_key(&other, &IdempotencyKey::new("order-1").unwrap(), now)
            .await
            .unwrap();
        assert_eq!(none, None, "{other:?}");
    }
    put::<S>(&engine, &scope, "running", 3600, None).await;
    let running = admin
        .find_key(&scope, &IdempotencyKey::new("running").unwrap(), now)
        .await
        .unwrap();
    assert_eq!(running.map(|k| k.state), Some(KeyState::InProgress));
    clock.advance(Duration::from_secs(3601));
    let expired = admin
        .find_key(&scope, &IdempotencyKey::new("order-1").unwrap(), clock.now_ms())
        .await
        .unwrap();
    assert_eq!(
        expired.map(|k| k.state),
        Some(KeyState::Expired),
        "an expired key is found until swept"
    );
}

/// `stats` counts the keys of a table by state: in progress, completed,
/// rejected, and expired (whatever they held).
pub async fn stats_count_keys_by_state<S: Subject<Lease: KeyAdmin>>(s: S) {
    let s = s.isolated().await;
    let (clock, engine, admin, scope) = admin_on(&s, "POST /v1/orders");
    put::<S>(&engine, &scope, "old-done", 60, completed(b"1")).await;
    put::<S>(&engine, &scope, "old-running", 60, None).await;
    clock.advance(Duration::from_secs(61));
    for key in ["done-1", "done-2"] {
        put::<S>(&engine, &scope, key, 3600, completed(b"1")).await;
    }
    let declined = Some(Record::rejected(b"no".to_vec()));
    put::<S>(&engine, &scope, "declined", 3600, declined).await;
    put::<S>(&engine, &scope, "running", 3600, None).await;
    let sending = held(
        engine
            .acquire(&call_for(
                &scope,
                &IdempotencyKey::new("sending").unwrap(),
                "{}",
                rejecting().with_lease_ms(60_000),
            ))
            .await
            .unwrap(),
    );
    engine.mark_sent(&sending).await.unwrap();
    let stats = admin.stats(clock.now_ms()).await.unwrap();
    assert_eq!(
        stats,
        idem_core::KeyStats {
            in_progress: 1,
            completed: 2,
            rejected: 1,
            unknown: 0,
            sent: 1,
            expired: 2,
        }
    );
    let listed = admin
        .list_keys(
            &KeyFilter {
                tenant: Some(scope.tenant().as_str().to_owned()),
                state: Some(KeyState::Sent),
                ..KeyFilter::default()
            },
            clock.now_ms(),
            10,
        )
        .await
        .unwrap();
    assert_eq!(
        listed.iter().map(|k| (k.key.as_str(), k.state)).collect::<Vec<_>>(),
        vec![("sending", KeyState::Sent)],
        "a sent claim is listed by its own state"
    );
}

/// Listing and purging select by tenant, operation, key prefix, state and
/// age, each alone and together, oldest first and at most the limit; a
/// purge deletes exactly what the same filter lists.
pub async fn list_and_purge_follow_every_filter<S: Subject<Lease: KeyAdmin>>(s: S) {
    let s = s.isolated().await;
    let (clock, engine, admin, a) = admin_on(&s, "POST /v1/orders");
    let a_refunds = idem_core::Scope::new(
        a.tenant().clone(),
        idem_core::Operation::new("POST /v1/refunds").unwrap(),
    );
    let b = unique_scope("POST /v1/orders");
    let done = || completed(b"1");
    // One millisecond apart, so "oldest first" has one answer.
    let tick = || clock.advance(Duration::from_millis(1));
    put::<S>(&engine, &a, "old-1", 3600, done()).await;
    tick();
    put::<S>(&engine, &a, "old-2", 3600, done()).await;
    clock.advance(Duration::from_secs(100));
    put::<S>(&engine, &a, "new-1", 3600, done()).await;
    tick();
    put::<S>(&engine, &a, "new-2", 3600, None).await;
    tick();
    put::<S>(&engine, &a_refunds, "new-3", 3600, done()).await;
    put::<S>(&engine, &b, "new-1", 3600, done()).await;
    let now = clock.now_ms();
    let tenant = |scope: &idem_core::Scope| Some(scope.tenant().as_str().to_owned());
    let keys = |list: Vec<idem_core::KeyInfo>| list.into_iter().map(|k| k.key).collect::<Vec<_>>();
    let by_a = KeyFilter {
        tenant: tenant(&a),
        ..KeyFilter::default()
    };
    assert_eq!(
        keys(admin.list_keys(&by_a, now, 100).await.unwrap()),
        ["old-1", "old-2", "new-1", "new-2", "new-3"],
        "oldest first"
    );
    assert_eq!(
        keys(admin.list_keys(&by_a, now, 2).await.unwrap()),
        ["old-1", "old-2"],
        "at most the limit"
    );
    let cases: Vec<(KeyFilter, Vec<&str>)> = vec![
        (
            KeyFilter {
                operation: Some("POST /v1/refunds".into()),
                ..by_a.clone()
            },
            vec!["new-3"],
        ),
        (
            KeyFilter {
                key_prefix: Some("old-".into()),
                ..by_a.clone()
            },
            vec!["old-1", "old-2"],
        ),
        (
            KeyFilter {
                state: Some(KeyState::InProgress),
                ..by_a.clone()
            },
            vec!["new-2"],
        ),
        (
            KeyFilter {
                older_than_ms: Some(50_000),
                ..by_a.clone()
            },
            vec!["old-1", "old-2"],
        ),
        (
            KeyFilter {
                key_prefix: Some("new-".into()),
                state: Some(KeyState::Completed),
                operation: Some("POST /v1/orders".into()),
                ..by_a.clone()
            },
            vec!["new-1"],
        ),
    ];
    for (filter, want) in &cases {
        assert_eq!(
            &keys(admin.list_keys(filter, now, 100).await.unwrap()),
            want,
            "{filter:?}"
        );
    }
    // Each purge deletes what its filter lists, and nothing of tenant b.
    let purge = KeyFilter {
        key_prefix: Some("old-".into()),
        ..by_a.clone()
    };
    assert_eq!(admin.purge_keys(&purge, now, 1).await.unwrap(), 1, "at most the limit");
    assert_eq!(admin.purge_keys(&purge, now, 100).await.unwrap(), 1);
    assert_eq!(admin.purge_keys(&purge, now, 100).await.unwrap(), 0);
    let completed = KeyFilter {
        state: Some(KeyState::Completed),
        ..by_a.clone()
    };
    assert_eq!(admin.purge_keys(&completed, now, 100).await.unwrap(), 2);
    assert_eq!(keys(admin.list_keys(&by_a, now, 100).await.unwrap()), ["new-2"]);
    let by_b = KeyFilter {
        tenant: tenant(&b),
        ..KeyFilter::default()
    };
    assert_eq!(keys(admin.list_keys(&by_b, now, 100).await.unwrap()), ["new-1"]);
}
