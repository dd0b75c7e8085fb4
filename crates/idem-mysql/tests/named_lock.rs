//! The named-lock claim strategy beyond the conformance suite: a fresh
//! claim writes no row until its record inserts the completed one, the
//! session-scoped named lock is released after commit and rollback and never
//! returns to the pool with a dropped transaction, a lock wait that runs out
//! answers busy, a record that meets a row committed meanwhile rolls back,
//! a lease-mode row is taken over (unless it was marked sent: then only
//! once the key expired), and many sessions claiming one key run
//! the effect once, also when processes of the two strategies share a key.

mod common;

use std::time::Duration;

use common::{connect, effects, now_ms, request_at, shared_store, write_effect};
use idem_conformance::{Runs, call_for, unique_scope, waiting};
use idem_core::{
    Call, ClaimRequest, Error, IdempotencyKey, Lease, LeaseClaim, LeaseStore, Policy, Record, RowState, StoreErrorKind,
    StoredRow, TxBackend, TxClaim, TxEngine,
};
use idem_mysql::{ClaimStrategy, MySqlStore, MySqlTx};

/// The shared keys table under the named-lock strategy, on a pool of its own.
async fn named_store() -> MySqlStore {
    shared_store(connect().await)
        .await
        .with_claim_strategy(ClaimStrategy::NamedLock)
}

/// Another store on the same table with a pool (so sessions) of its own, as
/// another process would have.
async fn other_process(store: &MySqlStore) -> MySqlStore {
    MySqlStore::new(connect().await)
        .with_table(store.table().clone())
        .with_claim_strategy(store.claim_strategy())
}

fn new_call(operation: &str) -> Call {
    call_for(
        &unique_scope(operation),
        &IdempotencyKey::generate(),
        "{}",
        Policy::default(),
    )
}

/// How a test opens its claim: `begin` then `claim` (one statement for
/// the lock, one for the read), or `begin_claim` as the engine does (the
/// lock taken with `BEGIN`, the read with the lock's answer).
#[derive(Debug, Clone, Copy)]
enum Opening {
    BeginThenClaim,
    BeginClaim,
}

/// Opens a transaction and claims `req`'s key in it the way `opening` says.
async fn open_claim(
    store: &MySqlStore,
    req: &ClaimRequest<'_>,
    wait: Duration,
    opening: Opening,
) -> (MySqlTx, TxClaim) {
    match opening {
        Opening::BeginThenClaim => {
            let mut tx = store.begin().await.unwrap();
            let claim = store.claim(&mut tx, req, wait).await.unwrap();
            (tx, claim)
        }
        Opening::BeginClaim => store.begin_claim(req, wait).await.unwrap(),
    }
}

/// Opens a claim of `req`'s fresh key on `store` without waiting, which
/// must claim it.
async fn claimed(store: &MySqlStore, req: &ClaimRequest<'_>, opening: Opening) -> MySqlTx {
    let (tx, claim) = open_claim(store, req, Duration::ZERO, opening).await;
    assert_eq!(claim, TxClaim::Claimed, "{opening:?}");
    tx
}

/// Opens a claim of `req`'s key on `store` by `opening` without waiting,
/// which must find `what`, the key's row; rolls it back and answers the
/// row.
async fn found(store: &MySqlStore, req: &ClaimRequest<'_>, opening: Opening, what: &str) -> StoredRow {
    let (tx, claim) = open_claim(store, req, Duration::ZERO, opening).await;
    let TxClaim::Found(row) = claim else {
        panic!("{opening:?}: expected {what}, got {claim:?}");
    };
    store.rollback(tx).await.unwrap();
    row
}

/// Claims `req`'s key on `store` by `opening` (it must be claimed), records
/// `payload` and commits: the key's row, which holds the record.
async fn claim_and_record(store: &MySqlStore, req: &ClaimRequest<'_>, opening: Opening, payload: &[u8]) -> StoredRow {
    let tx = claimed(store, req, opening).await;
    let record = Record::completed(payload.to_vec());
    store.record_commit(tx, req, &record).await.unwrap();
    let row = store.get(req.scope, req.key).await.unwrap().expect("the row");
    assert_eq!(row.state, RowState::Done(record), "{opening:?}");
    row
}

/// The first answer but busy of up to four claims of `req` on `store`,
/// each waiting up to five seconds and rolled back (`None`: busy each
/// time).
async fn claim_once_freed(store: &MySqlStore, req: &ClaimRequest<'_>, opening: Opening) -> Option<TxClaim> {
    for _ in 0..4 {
        let (theirs, answer) = open_claim(store, req, Duration::from_secs(5), opening).await;
        store.rollback(theirs).await.unwrap();
        if answer != TxClaim::Busy {
            return Some(answer);
        }
    }
    None
}

const OPENINGS: [Opening; 2] = [Opening::BeginThenClaim, Opening::BeginClaim];

/// Takes a lease on `call`'s fresh key at `now`, running out a second
/// later; answers its token.
async fn leased(store: &MySqlStore, call: &Call, now: i64) -> idem_core::Token {
    let lease_req = ClaimRequest {
        lease_expires_at_ms: Some(now + 1_000),
        ..request_at(call, now)
    };
    let LeaseClaim::Acquired(lease_token) = store.try_claim(&lease_req).await.unwrap() else {
        panic!("a fresh key is acquired");
    };
    lease_token
}

/// The key's row as another session sees it at READ UNCOMMITTED: its status,
/// or `None` if there is no row, committed or not.
async fn uncommitted_status(store: &MySqlStore, call: &Call) -> Option<i16> {
    let mut conn = store.pool().acquire().await.unwrap();
    sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
        .execute(&mut *conn)
        .await
        .unwrap();
    let status = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT status FROM `{}` WHERE tenant = ? AND operation = ? AND idem_key = ?",
        store.table().as_str()
    )))
    .bind(call.scope().tenant().as_str().as_bytes())
    .bind(call.scope().operation().as_str().as_bytes())
    .bind(call.key().as_str().as_bytes())
    .fetch_optional(&mut *conn)
    .await
    .unwrap();
    sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *conn)
        .await
        .unwrap();
    status
}

/// The key's committed token.
async fn token_of(store: &MySqlStore, call: &Call) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT token FROM `{}` WHERE tenant = ? AND operation = ? AND idem_key = ?",
        store.table().as_str()
    )))
    .bind(call.scope().tenant().as_str().as_bytes())
    .bind(call.scope().operation().as_str().as_bytes())
    .bind(call.key().as_str().as_bytes())
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// A fresh claim writes nothing (no placeholder, not even an uncommitted one); the record writes the completed row at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_claim_writes_only_the_completed_row() {
    let store = named_store().await;
    for opening in OPENINGS {
        let call = new_call("POST /named/one-row");
        let req = request_at(&call, now_ms());
        let mut tx = claimed(&store, &req, opening).await;
        assert_eq!(
            uncommitted_status(&store, &call).await,
            None,
            "{opening:?}: the claim wrote no row"
        );
        let record = Record::completed(b"done".to_vec());
        store.record(&mut tx, &req, &record).await.unwrap();
        assert_eq!(
            uncommitted_status(&store, &call).await,
            Some(1),
            "{opening:?}: the record wrote the completed row, never an in-progress one"
        );
        store.commit(tx).await.unwrap();
        let row = store
            .get(call.scope(), call.key())
            .await
            .unwrap()
            .expect("the committed row");
        assert_eq!(row.state, RowState::Done(record));
        assert_eq!(token_of(&store, &call).await, req.fresh_token.0);
    }
}

/// After COMMIT the named lock is released: another session's claim that does not wait finds the recorded row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_is_released_after_commit() {
    let store = named_store().await;
    let other = other_process(&store).await;
    for opening in OPENINGS {
        let call = new_call("POST /named/commit");
        let req = request_at(&call, now_ms());
        let tx = claimed(&store, &req, opening).await;
        let record = Record::completed(b"r".to_vec());
        store.record_commit(tx, &req, &record).await.unwrap();

        // A replay takes the lock too, and releases it after its rollback.
        for _ in 0..2 {
            let row = found(&other, &req, opening, "the recorded row at once").await;
            assert_eq!(row.state, RowState::Done(record.clone()), "{opening:?}");
        }
    }
}

/// A replay gives the lock back in the read that found the row: another
/// session's claim that does not wait finds the row while the replay's
/// transaction (never begun) has not been rolled back, and the sessions of
/// the commit and of the replay go back to the pool clean: the same session
/// (not a new one) then autocommits a write of its own and begins the next
/// claim at its own level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_give_the_lock_back_in_their_read_and_leave_the_session_clean() {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&common::url())
        .await
        .unwrap();
    let store = shared_store(pool.clone())
        .await
        .with_claim_strategy(ClaimStrategy::NamedLock);
    let other = other_process(&store).await;
    let session = || async {
        sqlx::query_scalar::<_, u64>("SELECT CONNECTION_ID()")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let first_session = session().await;
    let call = new_call("POST /named/one-text");
    let effect = format!("one-text-{}", call.key().as_str());
    let record = Record::completed(b"once".to_vec());
    {
        let req = request_at(&call, now_ms());
        let (mut tx, claim) = store.begin_claim(&req, Duration::ZERO).await.unwrap();
        assert_eq!(claim, TxClaim::Claimed);
        write_effect(&mut tx, &effect).await;
        store.record_commit(tx, &req, &record).await.unwrap();
    }
    assert_eq!(
        session().await,
        first_session,
        "the committed session went back to the pool"
    );

    let after = format!("after-{}", call.key().as_str());
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO `{}` (effect_id) VALUES (?)",
        common::EFFECTS_TABLE
    )))
    .bind(&after)
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(effects(other.pool(), &effect).await, 1, "the claim's write committed");
    assert_eq!(
        effects(other.pool(), &after).await,
        1,
        "the next user's write autocommitted"
    );

    let req = request_at(&call, now_ms());
    let (replay, answer) = store.begin_claim(&req, Duration::ZERO).await.unwrap();
    assert_eq!(
        answer,
        TxClaim::Found(other.get(call.scope(), call.key()).await.unwrap().unwrap())
    );
    // The replay's transaction has not ended; its lock is not held.
    let (theirs, answer) = other.begin_claim(&req, Duration::ZERO).await.unwrap();
    assert!(
        matches!(answer, TxClaim::Found(_)),
        "the replay still held the key's lock: {answer:?}"
    );
    other.rollback(theirs).await.unwrap();
    store.rollback(replay).await.unwrap();
    assert_eq!(
        session().await,
        first_session,
        "the replay's session went back to the pool"
    );

    // The next claim on the same session runs at its own level: a nested
    // begin in its work is a savepoint, and its commit commits.
    let call = new_call("POST /named/one-text");
    let req = request_at(&call, now_ms());
    let effect = format!("nested-{}", call.key().as_str());
    let (mut tx, claim) = store.begin_claim(&req, Duration::ZERO).await.unwrap();
    assert_eq!(claim, TxClaim::Claimed);
    {
        let mut nested = sqlx::Connection::begin(&mut *tx).await.unwrap();
        write_effect(&mut nested, &effect).await;
        nested.commit().await.unwrap();
    }
    store.record_commit(tx, &req, &record).await.unwrap();
    assert_eq!(effects(other.pool(), &effect).await, 1);
    assert_eq!(session().await, first_session);
}

/// After ROLLBACK the named lock is released: another session's claim that does not wait claims the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_is_released_after_rollback() {
    let store = named_store().await;
    let other = other_process(&store).await;
    for opening in OPENINGS {
        let call = new_call("POST /named/rollback");
        let req = request_at(&call, now_ms());
        let tx = claimed(&store, &req, opening).await;
        store.rollback(tx).await.unwrap();

        let (theirs, answer) = open_claim(&other, &req, Duration::ZERO, opening).await;
        assert_eq!(answer, TxClaim::Claimed, "{opening:?}: the key is free at once");
        other.rollback(theirs).await.unwrap();
    }
}

/// A transaction dropped while it holds the key (a cancelled caller) does not return its session to the pool with the lock: the next caller claims the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_transaction_does_not_keep_the_key_locked() {
    let store = named_store().await;
    let other = other_process(&store).await;
    for opening in OPENINGS {
        let call = new_call("POST /named/dropped");
        let req = request_at(&call, now_ms());
        let effect = format!("dropped-{}", call.key().as_str());
        let mut tx = claimed(&store, &req, opening).await;
        write_effect(&mut tx, &effect).await;
        drop(tx);

        // Closing the dropped session runs in the background; a claim
        // waiting (up to five seconds per attempt) gets the key as soon as
        // it is freed. A session returned to the pool would hold the lock
        // for good.
        assert_eq!(
            claim_once_freed(&other, &req, opening).await,
            Some(TxClaim::Claimed),
            "{opening:?}: the dropped transaction's lock was freed"
        );
        assert_eq!(
            effects(store.pool(), &effect).await,
            0,
            "the dropped transaction's write rolled back"
        );
        // The store's own pool still serves claims of the key.
        let (again, answer) = open_claim(&store, &req, Duration::from_secs(5), opening).await;
        assert_eq!(answer, TxClaim::Claimed, "{opening:?}");
        store.rollback(again).await.unwrap();
    }
}

/// A claim cancelled while its session waits for the named lock (a caller
/// that went away) does not leave the key locked: once the holder ends, the
/// waiting session may be granted the lock, and it must not go back to the
/// pool holding it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_cancelled_while_waiting_does_not_keep_the_key_locked() {
    let store = named_store().await;
    let waiter = other_process(&store).await;
    let third = other_process(&store).await;
    for opening in OPENINGS {
        let call = new_call("POST /named/cancelled");
        let req = request_at(&call, now_ms());
        let held = claimed(&store, &req, opening).await;

        let cancelled = tokio::time::timeout(
            Duration::from_millis(500),
            open_claim(&waiter, &req, Duration::from_secs(30), opening),
        )
        .await;
        assert!(cancelled.is_err(), "{opening:?}: the waiting claim was cancelled");
        store.rollback(held).await.unwrap();

        // The waiting session is granted the lock when the holder ends,
        // unless its connection is already closed; a claim from elsewhere
        // must get the key within a few waits either way.
        assert_eq!(
            claim_once_freed(&third, &req, opening).await,
            Some(TxClaim::Claimed),
            "{opening:?}: the cancelled claim's session kept the key locked"
        );
    }
    drop(waiter);
}

/// A twin whose wait for the named lock runs out is answered busy, and the engine reports the key in flight, as under the placeholder strategy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_wait_that_runs_out_is_in_flight() {
    let store = named_store().await;
    let other = other_process(&store).await;
    let call = new_call("POST /named/busy");
    let req = request_at(&call, now_ms());
    let (tx, claim) = open_claim(&store, &req, Duration::ZERO, Opening::BeginClaim).await;
    assert_eq!(claim, TxClaim::Claimed);

    for opening in OPENINGS {
        let (theirs, answer) = open_claim(&other, &req, Duration::from_millis(300), opening).await;
        assert_eq!(answer, TxClaim::Busy, "{opening:?}");
        other.rollback(theirs).await.unwrap();
    }
    let twin = call.clone().with_policy(waiting(300));
    let engine = TxEngine::new(other.clone());
    match engine.begin(&twin).await {
        Err(Error::InFlight { .. }) => {}
        Err(e) => panic!("expected in flight, got {e}"),
        Ok(_) => panic!("expected in flight, got a claim or a replay"),
    }
    store.rollback(tx).await.unwrap();
}

/// A record that meets a row committed after the claim read the key (a lease-mode claim) fails as contention and commits none of the caller's writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_meeting_a_committed_row_rolls_back() {
    let store = named_store().await;
    let other = other_process(&store).await;
    let call = new_call("POST /named/duplicate");
    let now = now_ms();
    let req = request_at(&call, now);
    let effect = format!("duplicate-{}", call.key().as_str());
    let mut tx = store.begin().await.unwrap();
    assert_eq!(
        store.claim(&mut tx, &req, Duration::ZERO).await.unwrap(),
        TxClaim::Claimed
    );
    write_effect(&mut tx, &effect).await;

    let lease_req = ClaimRequest {
        lease_expires_at_ms: Some(now + 30_000),
        ..request_at(&call, now)
    };
    let token = match other.try_claim(&lease_req).await.unwrap() {
        LeaseClaim::Acquired(token) => token,
        found => panic!("the lease claim writes no placeholder to wait for, got {found:?}"),
    };

    let e = store
        .record_commit(tx, &req, &Record::completed(b"second".to_vec()))
        .await
        .expect_err("the primary key refuses a second row");
    assert_eq!(e.store_kind(), Some(StoreErrorKind::Serialization), "{e}");
    assert!(e.is_contention(), "the engine runs the call again: {e}");
    assert_eq!(effects(store.pool(), &effect).await, 0, "nothing of the call committed");
    let row = store
        .get(call.scope(), call.key())
        .await
        .unwrap()
        .expect("the lease's row");
    assert!(
        matches!(row.state, RowState::InProgress { token: t, .. } if t == token),
        "{row:?}"
    );
}

/// A live lease-mode row is found, and one whose lease ran out is taken over with a larger token and recorded, as under the placeholder strategy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_rows_are_found_and_taken_over() {
    let store = named_store().await;
    let call = new_call("POST /named/lease");
    let now = now_ms();
    let lease_token = leased(&store, &call, now).await;

    let live = found(
        &store,
        &request_at(&call, now + 500),
        Opening::BeginThenClaim,
        "the live lease",
    )
    .await;
    assert!(
        matches!(live.state, RowState::InProgress { token, .. } if token == lease_token),
        "{live:?}"
    );

    let later = request_at(&call, now + 2_000);
    claim_and_record(&store, &later, Opening::BeginThenClaim, b"after the lease").await;
    assert!(
        token_of(&store, &call).await > lease_token.0,
        "the takeover's token is larger"
    );
}

/// A lease-mode row marked sent is found, not taken over, however long after its lease ran out, by either opening of the claim; once the key expired it is taken over, its old mark cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sent_lease_rows_are_held_until_the_key_expires() {
    let store = named_store().await;
    let call = new_call("POST /named/sent");
    let now = now_ms();
    let lease_token = leased(&store, &call, now).await;
    let lease = Lease {
        scope: call.scope().clone(),
        key: call.key().clone(),
        token: lease_token,
        lease_expires_at_ms: now + 1_000,
    };
    store.mark_sent(&lease, now + 10).await.unwrap();

    for at in [now + 500, now + 2_000, now + 59_999] {
        for opening in OPENINGS {
            let what = format!("the sent row at +{}", at - now);
            let row = found(&store, &request_at(&call, at), opening, &what).await;
            assert!(
                matches!(row.state, RowState::Sent { token, .. } if token == lease_token),
                "{opening:?}: {what}: {row:?}"
            );
        }
    }
    assert_eq!(token_of(&store, &call).await, lease_token.0, "nothing took it over");

    // An expired key is taken over.
    let expired = request_at(&call, now + 60_000);
    let row = claim_and_record(&store, &expired, Opening::BeginClaim, b"after expiry").await;
    assert_eq!(row.sent_at_ms, None, "the expired claim's mark went with it");
    assert!(
        matches!(
            store.complete(&lease, &Record::completed(b"late".to_vec())).await,
            Err(Error::Fenced)
        ),
        "the old holder is fenced"
    );
}

/// What `tasks` callers spread over `stores` saw, all executing one new
/// key (operation `operation`) whose work writes one effect row.
struct Race {
    /// Callers whose outcome was executed rather than replayed.
    executed: usize,
    /// Times the work ran (a run rolled back counts too).
    runs: usize,
    /// Effect rows committed.
    effects: i64,
}

async fn race_one_key(stores: &[MySqlStore], tasks: usize, operation: &str) -> Race {
    let call = call_for(
        &unique_scope(operation),
        &IdempotencyKey::generate(),
        "{}",
        waiting(60_000),
    );
    let effect = format!("race-{}", call.key().as_str());
    let runs = Runs::default();
    let mut handles = Vec::new();
    for i in 0..tasks {
        let engine = TxEngine::new(stores[i % stores.len()].clone());
        let (call, effect, runs) = (call.clone(), effect.clone(), runs.clone());
        handles.push(tokio::spawn(async move {
            engine
                .execute(&call, |tx| {
                    let (effect, runs) = (effect.clone(), runs.clone());
                    Box::pin(async move {
                        runs.hit();
                        write_effect(tx, &effect).await;
                        Ok::<_, Error>(7_u32)
                    })
                })
                .await
                .expect("every caller gets the outcome")
        }));
    }
    let mut executed = 0;
    for handle in handles {
        let outcome = handle.await.unwrap();
        assert_eq!(*outcome.value(), 7);
        if !outcome.is_replayed() {
            executed += 1;
        }
    }
    Race {
        executed,
        runs: runs.get(),
        effects: effects(stores[0].pool(), &effect).await,
    }
}

/// Many tasks on four pools (sessions of four processes) run one key's effect once; every other caller replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_sessions_on_one_key_run_the_effect_once() {
    let store = named_store().await;
    let mut stores = vec![store.clone()];
    for _ in 0..3 {
        stores.push(other_process(&store).await);
    }
    let race = race_one_key(&stores, 48, "POST /named/many").await;
    assert_eq!(race.executed, 1, "one caller executed, the others replayed");
    assert_eq!(race.runs, 1, "the work ran once");
    assert_eq!(race.effects, 1, "the effect committed once");
}

/// Processes that claim one table's keys under different strategies still run a key's effect once: the primary key arbitrates between a placeholder and a named-lock claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_strategies_on_one_key_run_the_effect_once() {
    let named = named_store().await;
    let placeholder = other_process(&named)
        .await
        .with_claim_strategy(ClaimStrategy::Placeholder);
    let race = race_one_key(&[named, placeholder], 24, "POST /named/mixed").await;
    assert_eq!(race.executed, 1, "one caller executed, the others replayed");
    assert_eq!(race.effects, 1, "the effect committed once");
}
