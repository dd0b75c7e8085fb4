//! Recording and listing dead letters: every field kept, one row per
//! (tenant, operation, key) updated by recording again with the strictest
//! send terms, keys scoped and exact, listing filtered and paged, and
//! resolved letters purged.

use std::time::Duration;

use idem_core::{
    DeadLetterFilter, DeadLetterState, DeadLetterStore, IdempotencyKey, MAX_DEAD_LETTER_PAGE, MAX_DEAD_LETTER_TEXT,
    MAX_KEY_LEN, NewDeadLetter, SentUnder, clip_text,
};

use super::{LONG_HOLD_MS, fetch, fresh_tenant, letter, request, resolved, scope_of, take};
use crate::DeadLetterSubject;

fn of_tenant(tenant: &str) -> DeadLetterFilter {
    DeadLetterFilter {
        tenant: Some(tenant.to_owned()),
        limit: MAX_DEAD_LETTER_PAGE,
        ..DeadLetterFilter::default()
    }
}

/// Every field survives recording exactly: binary body, ordered headers, a key of the largest length, clipped non-ASCII error.
pub async fn dead_letter_round_trips_every_field<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "POST /v1/payouts — ünïcødé");
    let key = "k".repeat(MAX_KEY_LEN - 36) + &uuid::Uuid::new_v4().to_string();
    assert_eq!(key.len(), MAX_KEY_LEN);
    let body: Vec<u8> = vec![0xFF, 0x00, 0xC3, 0x28, b'{', 0x80, 0xFE, b'\n', 0x00];
    let long_error = format!("NUL \0 then {}", "é".repeat(MAX_DEAD_LETTER_TEXT));
    let new = NewDeadLetter::new(
        scope.clone(),
        IdempotencyKey::new(key.as_str()).unwrap(),
        request(&body),
        7,
        long_error.clone(),
    )
    .reached_at(Some(1_700_000_000_123))
    .sent_under(SentUnder {
        key_horizon: Duration::from_millis(86_400_001),
        horizon_margin: Duration::from_millis(3_600_002),
        settle: Duration::from_millis(35_003),
    });
    let id = store.record(&new).await.expect("record");
    let got = fetch(&store, id).await;
    assert_eq!(got.id, id);
    assert_eq!(got.scope, scope);
    assert_eq!(got.key.as_str(), key);
    assert_eq!(
        got.request, new.request,
        "method, URL, headers in order and body, exactly"
    );
    assert_eq!(got.request.body(), &body[..]);
    assert_eq!(got.request.headers()[1], ("x-trace".to_owned(), "b".to_owned()));
    assert_eq!(got.request.headers()[2], ("x-trace".to_owned(), "a".to_owned()));
    assert_eq!(got.attempts, 7);
    let clipped = clip_text(&long_error);
    assert!(
        clipped.len() < long_error.len(),
        "the error was long enough to be clipped"
    );
    assert_eq!(
        got.last_error, clipped,
        "clipped to MAX_DEAD_LETTER_TEXT on a character boundary"
    );
    assert!(got.last_error.len() <= MAX_DEAD_LETTER_TEXT);
    assert_eq!(got.state, DeadLetterState::Dead);
    assert_eq!(got.redrives, 0);
    assert!(got.created_at_ms > 0);
    assert!(got.updated_at_ms >= got.created_at_ms);
    assert_eq!(got.redrive_until_ms, None);
    assert_eq!(got.response_status, None);
    assert_eq!(got.response_body, None);
    assert_eq!(got.first_reached_at_ms, Some(1_700_000_000_123));
    assert_eq!(got.reconciliation, None);
    assert_eq!(got.sent_under, new.sent_under, "the send terms, to the millisecond");
    let found = store
        .find(&scope, &new.key)
        .await
        .expect("find")
        .expect("found by scope and key");
    assert_eq!(found, got);
    let listed = store.list(&of_tenant(scope.tenant().as_str())).await.expect("list");
    assert_eq!(listed, vec![got]);
}

/// Recording the same (tenant, operation, key) again updates the one row: attempts added, last error replaced.
pub async fn recording_twice_updates_one_row<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let first = store.record(&letter(&scope, "k-1", 3, "timeout")).await.unwrap();
    let before = fetch(&store, first).await;
    let again = letter(&scope, "k-1", 2, "503 from the vendor");
    let second = store.record(&again).await.unwrap();
    assert_eq!(first, second, "one row per (tenant, operation, key)");
    let after = fetch(&store, first).await;
    assert_eq!(after.attempts, 5);
    assert_eq!(after.last_error, "503 from the vendor");
    assert_eq!(after.state, DeadLetterState::Dead);
    assert_eq!(after.created_at_ms, before.created_at_ms);
    assert!(after.updated_at_ms >= before.updated_at_ms);
    let listed = store.list(&of_tenant(scope.tenant().as_str())).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, first);
}

/// A letter records the terms its sends were made under; recorded again under other terms (a keyless vendor now) it keeps the strictest of both; a letter recorded without terms is kept without, and takes them from a later record.
pub async fn recording_again_keeps_the_strictest_send_terms<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let day = SentUnder {
        key_horizon: Duration::from_secs(86_400),
        horizon_margin: Duration::from_secs(3_600),
        settle: Duration::from_secs(35),
    };
    let keyless = SentUnder {
        key_horizon: Duration::ZERO,
        horizon_margin: Duration::ZERO,
        settle: Duration::from_secs(90),
    };
    let id = store
        .record(&letter(&scope, "k", 1, "timeout").sent_under(day))
        .await
        .unwrap();
    assert_eq!(fetch(&store, id).await.sent_under, Some(day));
    store
        .record(&letter(&scope, "k", 1, "timeout").sent_under(keyless))
        .await
        .unwrap();
    assert_eq!(
        fetch(&store, id).await.sent_under,
        Some(SentUnder {
            key_horizon: Duration::ZERO,
            horizon_margin: Duration::from_secs(3_600),
            settle: Duration::from_secs(90),
        }),
        "the shorter horizon, the longer margin and settle time"
    );
    let bare = store.record(&letter(&scope, "bare", 1, "timeout")).await.unwrap();
    assert_eq!(fetch(&store, bare).await.sent_under, None, "a sender that did not say");
    store
        .record(&letter(&scope, "bare", 1, "timeout").sent_under(day))
        .await
        .unwrap();
    assert_eq!(fetch(&store, bare).await.sent_under, Some(day));
}

/// The same key in two tenants or two operations, or differing only in case or a trailing space, is two rows.
pub async fn keys_are_scoped_and_exact<S: DeadLetterSubject>(s: S) {
    let store = s.store();
    let tenant_a = fresh_tenant();
    let tenant_b = fresh_tenant();
    let a = scope_of(&tenant_a, "payout");
    let b = scope_of(&tenant_b, "payout");
    let a_refund = scope_of(&tenant_a, "refund");
    let ids = [
        store.record(&letter(&a, "key", 1, "a")).await.unwrap(),
        store.record(&letter(&b, "key", 1, "b")).await.unwrap(),
        store.record(&letter(&a_refund, "key", 1, "a-refund")).await.unwrap(),
        store.record(&letter(&a, "KEY", 1, "upper")).await.unwrap(),
        store.record(&letter(&a, "key ", 1, "trailing space")).await.unwrap(),
    ];
    let mut distinct = ids.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), ids.len(), "five distinct rows: {ids:?}");
    for (scope, key, error) in [
        (&a, "key", "a"),
        (&b, "key", "b"),
        (&a_refund, "key", "a-refund"),
        (&a, "KEY", "upper"),
        (&a, "key ", "trailing space"),
    ] {
        let found = store
            .find(scope, &IdempotencyKey::new(key).unwrap())
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{scope:?} {key:?} not found"));
        assert_eq!(found.last_error, error);
        assert_eq!(&found.scope, scope);
        assert_eq!(found.key.as_str(), key);
    }
    let missing = store
        .find(
            &scope_of(&fresh_tenant(), "payout"),
            &IdempotencyKey::new("key").unwrap(),
        )
        .await
        .unwrap();
    assert!(missing.is_none());
    assert_eq!(store.list(&of_tenant(&tenant_a)).await.unwrap().len(), 4);
    assert_eq!(store.list(&of_tenant(&tenant_b)).await.unwrap().len(), 1);
}

/// Listing filters by tenant, operation and state, pages by id in order, and refuses a limit of 0 or over the page size.
pub async fn list_filters_and_pages_in_id_order<S: DeadLetterSubject>(s: S) {
    let s = s.isolated().await;
    let store = s.store();
    let t1 = fresh_tenant();
    let t2 = fresh_tenant();
    let mut ids = Vec::new();
    for (tenant, operation) in [
        (&t1, "payout"),
        (&t2, "payout"),
        (&t1, "refund"),
        (&t1, "payout"),
        (&t2, "refund"),
        (&t1, "payout"),
    ] {
        let scope = scope_of(tenant, operation);
        let key = format!("k-{}", ids.len());
        ids.push(store.record(&letter(&scope, &key, 1, "e")).await.unwrap());
    }
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids grow: {ids:?}");
    // One resolved, one being redriven.
    let hold = take(&store, ids[3], LONG_HOLD_MS).await;
    assert!(
        store
            .finish_redrive(ids[3], hold.token, &resolved(200, b""))
            .await
            .unwrap()
    );
    take(&store, ids[5], LONG_HOLD_MS).await;

    let list = |filter: DeadLetterFilter| {
        let store = store.clone();
        async move {
            store
                .list(&filter)
                .await
                .expect("list")
                .into_iter()
                .map(|d| d.id)
                .collect::<Vec<_>>()
        }
    };
    let all = DeadLetterFilter {
        limit: MAX_DEAD_LETTER_PAGE,
        ..DeadLetterFilter::default()
    };
    assert_eq!(list(all.clone()).await, ids);
    assert_eq!(
        list(DeadLetterFilter {
            tenant: Some(t1.clone()),
            ..all.clone()
        })
        .await,
        vec![ids[0], ids[2], ids[3], ids[5]]
    );
    assert_eq!(
        list(DeadLetterFilter {
            operation: Some("refund".into()),
            ..all.clone()
        })
        .await,
        vec![ids[2], ids[4]]
    );
    assert_eq!(
        list(DeadLetterFilter {
            tenant: Some(t1.clone()),
            operation: Some("payout".into()),
            ..all.clone()
        })
        .await,
        vec![ids[0], ids[3], ids[5]]
    );
    for (state, want) in [
        (DeadLetterState::Dead, vec![ids[0], ids[1], ids[2], ids[4]]),
        (DeadLetterState::Resolved, vec![ids[3]]),
        (DeadLetterState::Redriving, vec![ids[5]]),
    ] {
        let got = list(DeadLetterFilter {
            state: Some(state),
            ..all.clone()
        })
        .await;
        assert_eq!(got, want, "{state:?}");
    }
    assert_eq!(
        list(DeadLetterFilter {
            tenant: Some(t2.clone()),
            state: Some(DeadLetterState::Dead),
            operation: Some("refund".into()),
            ..all.clone()
        })
        .await,
        vec![ids[4]]
    );
    // Pages of two, each after the last id of the one before.
    let mut pages = Vec::new();
    let mut after_id = None;
    loop {
        let page = list(DeadLetterFilter {
            after_id,
            limit: 2,
            ..DeadLetterFilter::default()
        })
        .await;
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 2);
        after_id = page.last().copied();
        pages.push(page);
    }
    assert_eq!(pages.len(), 3);
    assert_eq!(pages.concat(), ids);
    assert_eq!(
        list(DeadLetterFilter {
            after_id: Some(ids[4]),
            ..all.clone()
        })
        .await,
        vec![ids[5]]
    );
    for limit in [0, MAX_DEAD_LETTER_PAGE + 1, u32::MAX] {
        let bad = DeadLetterFilter {
            limit,
            ..DeadLetterFilter::default()
        };
        assert!(store.list(&bad).await.is_err(), "limit {limit} is refused");
    }
    let unknown = DeadLetterFilter {
        tenant: Some(fresh_tenant()),
        ..all
    };
    assert!(list(unknown).await.is_empty());
}

/// Purging deletes only resolved letters older than the cutoff, at most `limit` at a time.
pub async fn purge_resolved_deletes_only_old_resolved<S: DeadLetterSubject>(s: S) {
    let s = s.isolated().await;
    let store = s.store();
    let scope = scope_of(&fresh_tenant(), "payout");
    let mut resolved_ids = Vec::new();
    for i in 0..3 {
        let id = store.record(&letter(&scope, &format!("r-{i}"), 1, "e")).await.unwrap();
        let hold = take(&store, id, LONG_HOLD_MS).await;
        assert!(
            store
                .finish_redrive(id, hold.token, &resolved(200, b"ok"))
                .await
                .unwrap()
        );
        resolved_ids.push(id);
    }
    let dead = store.record(&letter(&scope, "dead", 1, "e")).await.unwrap();
    let held = store.record(&letter(&scope, "held", 1, "e")).await.unwrap();
    take(&store, held, LONG_HOLD_MS).await;
    assert_eq!(
        store.purge_resolved(3_600_000, 100).await.unwrap(),
        0,
        "none is an hour old"
    );
    s.elapse(30).await;
    assert_eq!(store.purge_resolved(10, 2).await.unwrap(), 2, "bounded by the limit");
    assert_eq!(store.purge_resolved(10, 2).await.unwrap(), 1);
    assert_eq!(store.purge_resolved(10, 2).await.unwrap(), 0);
    for id in &resolved_ids {
        assert!(store.get(*id).await.unwrap().is_none(), "{id} purged");
    }
    assert_eq!(fetch(&store, dead).await.state, DeadLetterState::Dead);
    assert_eq!(fetch(&store, held).await.state, DeadLetterState::Redriving);
    // A purged key is free: recording it again makes a new letter.
    let again = store.record(&letter(&scope, "r-0", 1, "new")).await.unwrap();
    assert!(!resolved_ids.contains(&again));
    assert_eq!(fetch(&store, again).await.attempts, 1);
}
