//! The behaviours of a store of multi-step operations
//! ([`MultiStepStore`]): an operation's row commits with the caller's
//! writes or not at all, one per scope and key, and a write made over a
//! version that moved writes nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::multistep::{
    HoldKind, JournalEntry, MAX_MULTISTEP_PAGE, MultiStep, MultiStepCursor, MultiStepFilter, MultiStepState,
    MultiStepStore, NewMultiStep, StepKind, StepOutcome,
};
use idem_core::{BoxFuture, Error, Fingerprint, IdempotencyKey, Scope, TxBackend};

use crate::{Subject, effect_id, unique_scope};

/// A store of multi-step operations beside a transactional backend.
pub trait MultiStepSubject: Subject {
    /// The store, whose writes join the backend's transactions.
    type Steps: MultiStepStore<Self::Backend>;

    /// A handle on the store (its table migrated).
    fn steps(&self) -> Self::Steps;

    /// A handle on a fresh, empty operations table of the same backend (for
    /// tests that scan a whole table).
    fn isolated_steps(&self) -> BoxFuture<'_, Self::Steps>;
}

const LEASE_MS: i64 = 30_000;

/// A new operation row, started at `now_ms` (times in these tests are
/// small numbers, far before any real operation's, so each test's rows
/// are the only ones due at them).
fn row(now_ms: i64) -> MultiStep {
    row_of(unique_scope("POST /v1/withdrawals"), now_ms)
}

/// A new operation row of `scope`, started at `now_ms`.
fn row_of(scope: Scope, now_ms: i64) -> MultiStep {
    let new = NewMultiStep {
        fingerprint: Fingerprint::of_bytes(scope.operation(), b"{}"),
        scope,
        key: IdempotencyKey::generate(),
        definition: "withdrawal@1".into(),
        input: br#"{"amount":100}"#.to_vec(),
        ttl_ms: 86_400_000,
    };
    MultiStep::created(&new, 1, now_ms, LEASE_MS).expect("a valid operation")
}

fn local(name: &str) -> JournalEntry {
    JournalEntry {
        name: name.into(),
        kind: StepKind::Local,
        undo: false,
        outcome: StepOutcome::Output(serde_json::json!({ "step": name })),
        at_ms: 0,
    }
}

/// Inserts `row` in a transaction with the effect `eid`, and commits.
async fn insert<S: MultiStepSubject>(s: &S, row: &MultiStep, eid: &str) -> Option<i64> {
    insert_into(s, &s.steps(), row, eid).await
}

/// [`insert`] into the store `steps`.
async fn insert_into<S: MultiStepSubject>(s: &S, steps: &S::Steps, row: &MultiStep, eid: &str) -> Option<i64> {
    let backend = s.backend();
    let mut tx = backend.begin().await.unwrap();
    S::write_effect(&mut tx, eid.to_owned()).await.unwrap();
    let id = steps.insert_in(&mut tx, row).await.unwrap();
    backend.commit(tx).await.unwrap();
    id
}

/// The first step's transaction inserts the row with the caller's write: both are found once it commits.
pub async fn multistep_insert_commits_with_the_step<S: MultiStepSubject>(s: S) {
    let r = row(1_000);
    let eid = effect_id();
    let id = insert(&s, &r, &eid).await.expect("a new operation");
    let found = s.steps().find(&r.scope, &r.key).await.unwrap().expect("committed");
    assert_eq!((found.id, found.version), (id, 0));
    assert_eq!(MultiStep { id, ..r.clone() }, found, "every field survives the store");
    assert_eq!(s.steps().get(id).await.unwrap(), Some(found.clone()));
    assert_eq!(s.count_effects(eid).await.unwrap(), 1);
    // A row with a journal, an open send and its terms, a hold and a verdict
    // survives the store too.
    let mut full = found;
    full.record(1, local("debit"), 1_001).unwrap();
    let terms = idem_core::SentUnder {
        key_horizon: std::time::Duration::from_secs(3_600),
        horizon_margin: std::time::Duration::from_secs(60),
        settle: std::time::Duration::from_secs(15),
    };
    full.mark_sent(1, "pay", 1_002, Some(terms)).unwrap();
    full.hold(1, HoldKind::Unknown, "lost answer ✓", 1_003).unwrap();
    let applied = idem_core::Settlement {
        verdict: idem_core::Verdict::Applied,
        by: idem_core::VerdictSource::Operator,
        status: Some(201),
        body: vec![0, 159, 146, 150],
        note: "seen on the dashboard".into(),
    };
    full.settle(&applied, 1_004).unwrap();
    s.steps().write(&full).await.unwrap();
    let back = s.steps().get(id).await.unwrap().unwrap();
    assert_eq!(
        back,
        MultiStep {
            version: full.version + 1,
            ..full
        }
    );
}

/// A rolled-back insert leaves neither the row nor the caller's write.
pub async fn multistep_rolled_back_insert_leaves_nothing<S: MultiStepSubject>(s: S) {
    let r = row(1_000);
    let eid = effect_id();
    let backend = s.backend();
    let mut tx = backend.begin().await.unwrap();
    S::write_effect(&mut tx, eid.clone()).await.unwrap();
    assert!(s.steps().insert_in(&mut tx, &r).await.unwrap().is_some());
    backend.rollback(tx).await.unwrap();
    assert_eq!(s.steps().find(&r.scope, &r.key).await.unwrap(), None);
    assert_eq!(s.count_effects(eid).await.unwrap(), 0);
}

/// A second operation of the same scope and key is refused: one row per key.
pub async fn multistep_twin_insert_is_refused<S: MultiStepSubject>(s: S) {
    let r = row(1_000);
    let id = insert(&s, &r, &effect_id()).await.expect("a new operation");
    let twin = MultiStep {
        definition: "other@1".into(),
        ..r.clone()
    };
    let other = s.another().await;
    assert_eq!(insert(&other, &twin, &effect_id()).await, None);
    let found = s.steps().find(&r.scope, &r.key).await.unwrap().unwrap();
    assert_eq!((found.id, found.definition.as_str()), (id, "withdrawal@1"));
}

/// A write over a version that moved writes nothing, and the caller's writes in its transaction do not commit.
pub async fn multistep_stale_write_writes_nothing<S: MultiStepSubject>(s: S) {
    let r = row(1_000);
    let id = insert(&s, &r, &effect_id()).await.unwrap();
    let read = s.steps().get(id).await.unwrap().unwrap();
    let mut first = read.clone();
    first.record(1, local("debit"), 1_001).unwrap();
    s.steps().write(&first).await.unwrap();
    // A second writer from the same read.
    let mut stale = read.clone();
    stale.record(1, local("quote"), 1_002).unwrap();
    let eid = effect_id();
    let backend = s.backend();
    let mut tx = backend.begin().await.unwrap();
    S::write_effect(&mut tx, eid.clone()).await.unwrap();
    let written = match s.steps().write_in(&mut tx, &stale).await {
        Ok(()) => backend.commit(tx).await,
        Err(e) => {
            backend.rollback(tx).await.unwrap();
            Err(e)
        }
    };
    assert!(matches!(written, Err(Error::Fenced)), "got {written:?}");
    assert_eq!(s.count_effects(eid).await.unwrap(), 0, "nothing of the step committed");
    assert!(matches!(s.steps().write(&stale).await, Err(Error::Fenced)));
    let stored = s.steps().get(id).await.unwrap().unwrap();
    assert_eq!(stored.version, 1);
    assert_eq!(stored.journal, first.journal);
}

/// Many writers from one read, at once: exactly one writes.
pub async fn multistep_one_of_concurrent_writers_wins<S: MultiStepSubject>(s: S) {
    let r = row(1_000);
    let id = insert(&s, &r, &effect_id()).await.unwrap();
    let read = s.steps().get(id).await.unwrap().unwrap();
    let won = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let (steps, barrier, won) = (s.another().await.steps(), barrier.clone(), won.clone());
        let mut mine = read.clone();
        mine.record(1, local(&format!("step-{i}")), 1_001).unwrap();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            match steps.write(&mine).await {
                Ok(()) => {
                    won.fetch_add(1, Ordering::SeqCst);
                }
                Err(Error::Fenced) => {}
                Err(e) => panic!("unexpected error: {e}"),
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(won.load(Ordering::SeqCst), 1);
    let stored = s.steps().get(id).await.unwrap().unwrap();
    assert_eq!((stored.version, stored.journal.len()), (1, 1));
}

/// Only operations a runner may take are due: not one under a live lease, asked to wait, held or final.
pub async fn multistep_due_lists_what_a_runner_may_take<S: MultiStepSubject>(s: S) {
    let now = 100_000;
    let steps = s.isolated_steps().await;
    let mut ids = Vec::new();
    // Two whose leases ran out (the older change first), one leased, one
    // deferred past `now`, one held and one completed.
    for (started, change) in [(1_000, 0), (900, 0), (now, 0), (1_000, 1), (1_000, 2), (1_000, 3)] {
        let r = row(started);
        let id = insert_into(&s, &steps, &r, &effect_id()).await.unwrap();
        let mut r = steps.get(id).await.unwrap().unwrap();
        match change {
            1 => r.defer(1, now + 1, 2_000).unwrap(),
            2 => r.hold(1, HoldKind::Failed, "broken", 2_000).unwrap(),
            3 => r.finish(1, b"{}".to_vec(), 2_000).unwrap(),
            _ => {}
        }
        if change != 0 {
            steps.write(&r).await.unwrap();
        }
        ids.push(id);
    }
    assert_eq!(
        steps.due(now, 100).await.unwrap(),
        vec![ids[1], ids[0]],
        "the longest unchanged first"
    );
    assert_eq!(steps.due(now, 1).await.unwrap(), vec![ids[1]], "the limit holds");
    assert_eq!(
        steps.due(900 + LEASE_MS - 1, 100).await.unwrap(),
        vec![] as Vec<i64>,
        "leases still live"
    );
}

/// Inserts an operation of `scope` started at `started`, then applies
/// `change` to it and writes it (when it changed anything): its id.
async fn stored<S: MultiStepSubject>(
    s: &S,
    steps: &S::Steps,
    scope: Scope,
    started: i64,
    change: impl FnOnce(&mut MultiStep),
) -> i64 {
    let id = insert_into(s, steps, &row_of(scope, started), &effect_id())
        .await
        .expect("a new operation");
    let read = steps.get(id).await.unwrap().unwrap();
    let mut changed = read.clone();
    change(&mut changed);
    if changed != read {
        steps.write(&changed).await.unwrap();
    }
    id
}

/// The ids `filter` lists from `steps`.
async fn listed<St: MultiStepStore<B>, B: TxBackend>(steps: &St, filter: MultiStepFilter) -> Vec<i64> {
    let found = steps.list(&filter).await.unwrap();
    found.iter().map(|op| op.id).collect()
}

/// Every page of `filter` from its start, `limit` at a time, each after the last one of the page before: the ids.
async fn paged<St: MultiStepStore<B>, B: TxBackend>(steps: &St, filter: MultiStepFilter, limit: u32) -> Vec<i64> {
    let mut ids = Vec::new();
    let mut after = None;
    for _ in 0..100 {
        let page = steps
            .list(&MultiStepFilter {
                after,
                limit,
                ..filter.clone()
            })
            .await
            .unwrap();
        assert!(page.len() <= limit as usize, "a page holds at most its limit");
        ids.extend(page.iter().map(|op| op.id));
        match page.last() {
            Some(last) if page.len() == limit as usize => after = Some(MultiStepCursor::of(last)),
            _ => return ids,
        }
    }
    panic!("the pages never ended: {ids:?}");
}

/// An operator's listing selects by state, tenant, operation, recovery point, open step and age, each alone and together, the longest unchanged first.
pub async fn multistep_list_follows_every_filter<S: MultiStepSubject>(s: S) {
    let steps = s.isolated_steps().await;
    let tenant = format!("tenant-{}", uuid::Uuid::new_v4());
    let withdrawals = || Scope::parse(&tenant, "POST /v1/withdrawals").unwrap();
    let refunds = Scope::parse(&tenant, "POST /v1/refunds").unwrap();
    let elsewhere = unique_scope("POST /v1/withdrawals");
    let ran = |name: &str, at: i64| {
        let name = name.to_owned();
        move |r: &mut MultiStep| r.record(1, local(&name), at).unwrap()
    };
    // Changed at 1 000 … 7 000, one per state and shape.
    let fresh = stored(&s, &steps, withdrawals(), 1_000, |_| {}).await;
    let debited = stored(&s, &steps, withdrawals(), 1_000, ran("debit", 2_000)).await;
    let unknown = stored(&s, &steps, withdrawals(), 1_000, |r| {
        r.record(1, local("debit"), 1_500).unwrap();
        r.mark_sent(1, "payout", 1_600, None).unwrap();
        r.hold(1, HoldKind::Unknown, "the answer was lost", 3_000).unwrap();
    })
    .await;
    let failed = stored(&s, &steps, refunds, 1_000, |r| {
        r.record(1, local("debit"), 1_500).unwrap();
        r.hold(1, HoldKind::Failed, "broken contract", 4_000).unwrap();
    })
    .await;
    let completed = stored(&s, &steps, withdrawals(), 1_000, |r| {
        r.record(1, local("debit"), 4_500).unwrap();
        r.finish(1, b"{}".to_vec(), 5_000).unwrap();
    })
    .await;
    let compensating = stored(&s, &steps, elsewhere.clone(), 1_000, |r| {
        r.record(1, local("debit"), 5_500).unwrap();
        r.fail(1, serde_json::json!({"declined": true}), 6_000).unwrap();
    })
    .await;
    let sending = stored(&s, &steps, withdrawals(), 1_000, |r| {
        r.mark_sent(1, "payout", 7_000, None).unwrap();
    })
    .await;
    let all = MultiStepFilter::default();
    assert_eq!(
        listed(&steps, all.clone()).await,
        [fresh, debited, unknown, failed, completed, compensating, sending],
        "every operation, the longest unchanged first"
    );
    let states = |states: Vec<MultiStepState>| MultiStepFilter { states, ..all.clone() };
    assert_eq!(
        listed(&steps, states(vec![MultiStepState::Held])).await,
        [unknown, failed]
    );
    assert_eq!(
        listed(
            &steps,
            states(vec![MultiStepState::Running, MultiStepState::Compensating])
        )
        .await,
        [fresh, debited, compensating, sending]
    );
    assert_eq!(
        listed(&steps, states(vec![MultiStepState::Compensated])).await,
        [] as [i64; 0]
    );
    let of_tenant = |t: &str| MultiStepFilter {
        tenant: Some(t.to_owned()),
        ..all.clone()
    };
    assert_eq!(
        listed(&steps, of_tenant(&tenant)).await,
        [fresh, debited, unknown, failed, completed, sending]
    );
    assert_eq!(
        listed(&steps, of_tenant(elsewhere.tenant().as_str())).await,
        [compensating]
    );
    let refunds_only = MultiStepFilter {
        operation: Some("POST /v1/refunds".into()),
        ..all.clone()
    };
    assert_eq!(listed(&steps, refunds_only).await, [failed]);
    let at = |n: u32| MultiStepFilter {
        recovery_point: Some(n),
        ..all.clone()
    };
    assert_eq!(listed(&steps, at(0)).await, [fresh, sending]);
    assert_eq!(
        listed(&steps, at(1)).await,
        [debited, unknown, failed, completed, compensating]
    );
    assert_eq!(listed(&steps, at(2)).await, [] as [i64; 0]);
    let open = |step: &str| MultiStepFilter {
        open_step: Some(step.to_owned()),
        ..all.clone()
    };
    assert_eq!(listed(&steps, open("payout")).await, [unknown, sending]);
    assert_eq!(
        listed(&steps, open("debit")).await,
        [] as [i64; 0],
        "recorded, not open"
    );
    let old = MultiStepFilter {
        unchanged_since_ms: Some(3_000),
        ..all.clone()
    };
    assert_eq!(listed(&steps, old).await, [fresh, debited, unknown]);
    // Together: every filter holds.
    let stuck = MultiStepFilter {
        states: vec![MultiStepState::Held],
        tenant: Some(tenant.clone()),
        operation: Some("POST /v1/withdrawals".into()),
        recovery_point: Some(1),
        open_step: Some("payout".into()),
        unchanged_since_ms: Some(3_000),
        ..all.clone()
    };
    assert_eq!(listed(&steps, stuck.clone()).await, [unknown]);
    let too_recent = MultiStepFilter {
        unchanged_since_ms: Some(2_999),
        ..stuck.clone()
    };
    assert_eq!(listed(&steps, too_recent).await, [] as [i64; 0]);
    let final_with_open_step = MultiStepFilter {
        states: vec![MultiStepState::Completed],
        ..open("payout")
    };
    assert_eq!(listed(&steps, final_with_open_step).await, [] as [i64; 0]);
    // What is listed is the operation as committed, every field.
    let found = steps.list(&states(vec![MultiStepState::Held])).await.unwrap();
    assert_eq!(found[0], steps.get(unknown).await.unwrap().unwrap());
    assert_eq!(found[0].open.as_ref().map(|o| o.step.as_str()), Some("payout"));
}

/// A listing pages by its cursor, the id breaking ties of time, with or without a filter on the open step; its page size is bounded and checked before anything is read.
pub async fn multistep_list_pages_by_cursor<S: MultiStepSubject>(s: S) {
    let steps = s.isolated_steps().await;
    let mut ids = Vec::new();
    // Changed at these times, every other one held on an open send.
    for (i, at) in [3_000, 1_000, 2_000, 2_000, 2_000, 1_000, 4_000, 2_000]
        .into_iter()
        .enumerate()
    {
        let held = i % 2 == 0;
        let id = stored(&s, &steps, unique_scope("POST /v1/withdrawals"), 500, move |r| {
            if held {
                r.mark_sent(1, "pay", at, None).unwrap();
                r.hold(1, HoldKind::Unknown, "lost", at).unwrap();
            } else {
                r.record(1, local("debit"), at).unwrap();
            }
        })
        .await;
        ids.push((at, id, held));
    }
    ids.sort_unstable();
    let every: Vec<i64> = ids.iter().map(|(_, id, _)| *id).collect();
    let open: Vec<i64> = ids.iter().filter(|(_, _, held)| *held).map(|(_, id, _)| *id).collect();
    let all = MultiStepFilter {
        limit: MAX_MULTISTEP_PAGE,
        ..MultiStepFilter::default()
    };
    assert_eq!(listed(&steps, all.clone()).await, every, "by time, then id");
    for limit in [1, 2, 3, 8] {
        assert_eq!(paged(&steps, all.clone(), limit).await, every, "pages of {limit}");
    }
    let pay = MultiStepFilter {
        open_step: Some("pay".into()),
        ..all.clone()
    };
    assert_eq!(listed(&steps, pay.clone()).await, open);
    for limit in [1, 2, 3] {
        assert_eq!(
            paged(&steps, pay.clone(), limit).await,
            open,
            "open sends, pages of {limit}"
        );
    }
    // A page starts after its cursor, whatever row (if any) the cursor names.
    let (at, _, _) = ids[3];
    let after = MultiStepFilter {
        after: Some(MultiStepCursor {
            updated_at_ms: at,
            id: i64::MAX,
        }),
        ..all.clone()
    };
    let later: Vec<i64> = ids.iter().filter(|(t, _, _)| *t > at).map(|(_, id, _)| *id).collect();
    assert_eq!(listed(&steps, after).await, later);
    // A page out of bounds is refused, and so is an empty name.
    for bad in [
        MultiStepFilter {
            limit: 0,
            ..all.clone()
        },
        MultiStepFilter {
            limit: MAX_MULTISTEP_PAGE + 1,
            ..all.clone()
        },
        MultiStepFilter {
            tenant: Some(String::new()),
            ..all.clone()
        },
    ] {
        let refused = steps.list(&bad).await;
        assert!(matches!(refused, Err(Error::InvalidRequest(_))), "{bad:?}: {refused:?}");
    }
}
