//! The behaviours of a store of multi-step operations
//! ([`MultiStepStore`]): an operation's row commits with the caller's
//! writes or not at all, one per scope and key, and a write made over a
//! version that moved writes nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::multistep::{JournalEntry, MultiStep, MultiStepStore, NewMultiStep, StepKind, StepOutcome};
use idem_core::{BoxFuture, Error, Fingerprint, IdempotencyKey, TxBackend};

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
    let scope = unique_scope("POST /v1/withdrawals");
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
    full.hold(1, idem_core::multistep::HoldKind::Unknown, "lost answer ✓", 1_003)
        .unwrap();
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
            2 => r
                .hold(1, idem_core::multistep::HoldKind::Failed, "broken", 2_000)
                .unwrap(),
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
