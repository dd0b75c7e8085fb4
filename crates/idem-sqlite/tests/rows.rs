//! What a transactional call writes: the rows counted by SQLite's
//! `total_changes()` on the store's only connection, the rows a claim must
//! never touch, and twins of both modes on a key whose transactional claim
//! wrote no row yet.

mod common;

use common::{TempDb, count_effects, migrated_with, write_effect};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{
    Call, ClaimRequest, Clock, Error, Fingerprint, IdempotencyKey, InFlight, Lease, LeaseClaim, LeaseEngine,
    LeaseStore, Policy, Record, RecordStatus, RowState, Scope, Token, TxBackend, TxClaim, TxEngine,
};
use idem_sqlite::{SqliteOptions, SqliteStore, store_error};

/// A migrated store on one connection, so that `total_changes()` counts
/// every row any of its statements wrote.
async fn one_connection(db: &TempDb) -> SqliteStore {
    migrated_with(&db.path, SqliteOptions::new().max_connections(1)).await
}

/// Rows inserted, updated or deleted on the store's connection since it opened.
async fn changes(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT total_changes()")
        .fetch_one(store.pool())
        .await
        .expect("total_changes")
}

async fn token_of(store: &SqliteStore, key: &IdempotencyKey) -> i64 {
    sqlx::query_scalar("SELECT token FROM idem_keys WHERE idem_key = ?1")
        .bind(key.as_str())
        .fetch_one(store.pool())
        .await
        .expect("the key's row")
}

fn scope() -> Scope {
    Scope::parse(&format!("tenant-{}", uuid::Uuid::new_v4()), "POST /v1/transfers").expect("scope")
}

fn fingerprint(scope: &Scope) -> Fingerprint {
    Fingerprint::of_bytes(scope.operation(), b"body")
}

/// A fresh key of a scope of its own, and the fingerprint of its request.
fn fresh_key() -> (Scope, IdempotencyKey, Fingerprint) {
    let scope = scope();
    let fp = fingerprint(&scope);
    (scope, IdempotencyKey::generate(), fp)
}

fn request<'a>(
    scope: &'a Scope,
    key: &'a IdempotencyKey,
    fingerprint: &'a Fingerprint,
    now_ms: i64,
    fresh_token: i64,
    lease_expires_at_ms: Option<i64>,
) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        fingerprint,
        now_ms,
        expires_at_ms: now_ms + 100_000,
        fresh_token: Token(fresh_token),
        lease_expires_at_ms,
    }
}

/// Takes a lease on `key` at 1 s with token 7, running out at 2 s.
async fn lease_from_1s_to_2s(store: &SqliteStore, scope: &Scope, key: &IdempotencyKey, fp: &Fingerprint) -> Lease {
    let lease_req = request(scope, key, fp, 1_000, 7, Some(2_000));
    assert_eq!(
        store.try_claim(&lease_req).await.expect("lease claim"),
        LeaseClaim::Acquired(Token(7))
    );
    Lease {
        scope: scope.clone(),
        key: key.clone(),
        token: Token(7),
        lease_expires_at_ms: 2_000,
    }
}

/// A fresh transactional call writes its work's rows plus exactly one (the completed record), and a replay writes none.
#[tokio::test]
async fn fresh_call_writes_one_row_beyond_its_work() {
    let db = TempDb::new("rows");
    let store = one_connection(&db).await;

    // The bare transaction: the same work, no key.
    let before = changes(&store).await;
    let mut bare = TxBackend::begin(&store).await.expect("begin");
    write_effect(&mut bare, "bare").await.expect("bare work");
    TxBackend::commit(&store, bare).await.expect("commit");
    let bare_rows = changes(&store).await - before;
    assert_eq!(bare_rows, 1, "the work writes one row");

    let engine = TxEngine::new(store.clone());
    let scope = scope();
    let key = IdempotencyKey::generate();
    let call = Call::new(scope.clone(), key.clone(), fingerprint(&scope));
    let before = changes(&store).await;
    let first = engine
        .execute(&call, |tx| {
            Box::pin(async move {
                write_effect(tx, "fresh").await?;
                Ok::<_, Error>(42u32)
            })
        })
        .await
        .expect("fresh call");
    assert!(!first.is_replayed());
    let fresh_rows = changes(&store).await - before;
    assert_eq!(
        fresh_rows,
        bare_rows + 1,
        "a fresh call writes the bare rows and one more"
    );

    let row = store.get(&scope, &key).await.expect("get").expect("the key's row");
    assert!(
        matches!(&row.state, RowState::Done(record) if record.status == RecordStatus::Completed),
        "{row:?}"
    );

    let before = changes(&store).await;
    let again = engine
        .execute(&call, |_tx| Box::pin(async { Ok::<_, Error>(0u32) }))
        .await
        .expect("replay");
    assert_eq!(again.into_inner(), 42);
    assert_eq!(changes(&store).await - before, 0, "a replay writes nothing");
    assert_eq!(count_effects(&store, "fresh").await, 1);
}

/// A transactional claim of a stale row (a lease that ran out, or an expired outcome) replaces it with one row write and a larger token, and the stale lease holder is fenced.
#[tokio::test]
async fn stale_row_is_replaced_with_one_write() {
    let db = TempDb::new("rows");
    let store = one_connection(&db).await;
    for stale in ["lease ran out", "outcome expired"] {
        let (scope, key, fp) = fresh_key();
        let lease = lease_from_1s_to_2s(&store, &scope, &key, &fp).await;
        // An expired outcome: completed, then past its TTL (100 s after 1 s).
        let now_ms = if stale == "outcome expired" {
            store
                .complete(&lease, &Record::completed(b"old".to_vec()))
                .await
                .expect("complete");
            200_000
        } else {
            5_000
        };

        let before = changes(&store).await;
        let req = request(&scope, &key, &fp, now_ms, 3, None);
        let (tx, claim) = store.begin_claim(&req, Duration::ZERO).await.expect("claim");
        assert_eq!(claim, TxClaim::Claimed, "{stale}");
        store
            .record_commit(tx, &req, &Record::completed(b"new".to_vec()))
            .await
            .expect("record");
        assert_eq!(changes(&store).await - before, 1, "{stale}: one row written");

        assert_eq!(token_of(&store, &key).await, 8, "{stale}: the old token plus one");
        let row = store.get(&scope, &key).await.expect("get").expect("row");
        assert_eq!(row.state, RowState::Done(Record::completed(b"new".to_vec())), "{stale}");
        assert_eq!(row.expires_at_ms, now_ms + 100_000, "{stale}: the new TTL");
        if stale == "lease ran out" {
            let fenced = store.complete(&lease, &Record::completed(b"late".to_vec())).await;
            assert!(matches!(fenced, Err(Error::Fenced)), "{stale}: {fenced:?}");
        }
    }
}

/// A lease row marked sent is never taken over while its key lives, even with its lease run out: a transactional or lease claim finds it and writes nothing. Once the key expires, either claim takes it over with one write and the new row carries no sent mark.
#[tokio::test]
async fn sent_row_is_taken_over_only_once_expired() {
    let db = TempDb::new("rows");
    let store = one_connection(&db).await;
    for taker in ["transactional", "lease"] {
        let (scope, key, fp) = fresh_key();
        let lease = lease_from_1s_to_2s(&store, &scope, &key, &fp).await;
        let before = changes(&store).await;
        store.mark_sent(&lease, 1_500).await.expect("mark sent");
        assert_eq!(changes(&store).await - before, 1, "the mark writes one row");

        // The lease ran out at 2 s; the key lives until 101 s.
        let sent = RowState::Sent {
            token: Token(7),
            lease_expires_at_ms: 2_000,
        };
        let before = changes(&store).await;
        let req = request(&scope, &key, &fp, 5_000, 3, None);
        let (tx, claim) = store.begin_claim(&req, Duration::ZERO).await.expect("claim");
        assert!(matches!(&claim, TxClaim::Found(row) if row.state == sent), "{claim:?}");
        TxBackend::rollback(&store, tx).await.expect("rollback");
        let found = store
            .try_claim(&request(&scope, &key, &fp, 5_000, 3, Some(6_000)))
            .await
            .expect("lease claim");
        assert!(
            matches!(&found, LeaseClaim::Found(row) if row.state == sent),
            "{found:?}"
        );
        assert_eq!(changes(&store).await - before, 0, "nothing written");
        assert_eq!(
            store
                .lookup(&scope, &key)
                .await
                .expect("lookup")
                .expect("row")
                .sent_at_ms,
            Some(1_500)
        );

        let before = changes(&store).await;
        if taker == "transactional" {
            let req = request(&scope, &key, &fp, 200_000, 3, None);
            let (tx, claim) = store.begin_claim(&req, Duration::ZERO).await.expect("claim");
            assert_eq!(claim, TxClaim::Claimed);
            store
                .record_commit(tx, &req, &Record::completed(b"new".to_vec()))
                .await
                .expect("record");
        } else {
            assert_eq!(
                store
                    .try_claim(&request(&scope, &key, &fp, 200_000, 3, Some(201_000)))
                    .await
                    .expect("lease claim"),
                LeaseClaim::Acquired(Token(8))
            );
        }
        assert_eq!(changes(&store).await - before, 1, "{taker}: one row written");
        assert_eq!(token_of(&store, &key).await, 8, "{taker}: the old token plus one");
        let row = store.lookup(&scope, &key).await.expect("lookup").expect("row");
        assert_eq!(row.sent_at_ms, None, "{taker}: the new claim is not marked");
        assert!(matches!(store.mark_sent(&lease, 200_000).await, Err(Error::Fenced)));
    }
}

/// A live lease row answers a transactional claim as in flight, and the claim writes nothing.
#[tokio::test]
async fn live_lease_row_is_in_flight() {
    let db = TempDb::new("rows");
    let store = one_connection(&db).await;
    let (scope, key, fp) = fresh_key();
    let now_ms = idem_core::SystemClock.now_ms();
    let lease_req = request(&scope, &key, &fp, now_ms, 7, Some(now_ms + 600_000));
    assert!(matches!(
        store.try_claim(&lease_req).await.expect("lease claim"),
        LeaseClaim::Acquired(_)
    ));

    let before = changes(&store).await;
    let call =
        Call::new(scope.clone(), key.clone(), fp).with_policy(Policy::default().with_in_flight(InFlight::Reject));
    let answer = TxEngine::new(store.clone())
        .execute(&call, |tx| {
            Box::pin(async move {
                write_effect(tx, "twin").await?;
                Ok::<_, Error>(1u32)
            })
        })
        .await;
    assert!(matches!(answer, Err(Error::InFlight { .. })), "{answer:?}");
    assert_eq!(changes(&store).await - before, 0, "nothing written");
    assert_eq!(count_effects(&store, "twin").await, 0);
    assert_eq!(token_of(&store, &key).await, 7, "the lease row is untouched");
}

/// A record in a transaction that holds no claim of its key fails, writes nothing, and leaves a lease holder's row of that key as it was.
#[tokio::test]
async fn record_without_claim_touches_no_row() {
    let db = TempDb::new("rows");
    let store = one_connection(&db).await;
    let (scope, key, fp) = fresh_key();
    let lease_req = request(&scope, &key, &fp, 1_000, 7, Some(2_000_000));
    assert_eq!(
        store.try_claim(&lease_req).await.expect("lease claim"),
        LeaseClaim::Acquired(Token(7))
    );

    let req = request(&scope, &key, &fp, 1_000, 9, None);
    let mut tx = TxBackend::begin(&store).await.expect("begin");
    write_effect(&mut tx, "unclaimed").await.expect("work");
    let err = store
        .record_commit(tx, &req, &Record::completed(b"r".to_vec()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    assert_eq!(count_effects(&store, "unclaimed").await, 0, "the work did not commit");
    let row = store.get(&scope, &key).await.expect("get").expect("row");
    assert_eq!(
        row.state,
        RowState::InProgress {
            token: Token(7),
            lease_expires_at_ms: 2_000_000
        },
        "the lease holder's row is untouched"
    );

    // A key with no row at all is no claim either.
    let other = IdempotencyKey::generate();
    let req = request(&scope, &other, &fp, 1_000, 9, None);
    let tx = TxBackend::begin(&store).await.expect("begin");
    let err = store
        .record_commit(tx, &req, &Record::completed(b"r".to_vec()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    assert!(store.get(&scope, &other).await.expect("get").is_none());
}

/// A record whose key's row was written by the claiming transaction's own work fails, and nothing of that transaction commits.
#[tokio::test]
async fn row_written_by_the_work_fails_the_record() {
    let db = TempDb::new("rows");
    let store = one_connection(&db).await;
    let (scope, key, fp) = fresh_key();
    let req = request(&scope, &key, &fp, 1_000, 9, None);
    let (mut tx, claim) = store.begin_claim(&req, Duration::ZERO).await.expect("claim");
    assert_eq!(claim, TxClaim::Claimed);
    write_effect(&mut tx, "meddling").await.expect("work");
    sqlx::query(
        "INSERT INTO idem_keys (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms)
         VALUES (?1, ?2, ?3, zeroblob(32), 1, 1, 0, 10000000)",
    )
    .bind(scope.tenant().as_str())
    .bind(scope.operation().as_str())
    .bind(key.as_str())
    .execute(&mut *tx)
    .await
    .expect("the work writes the key's row");
    let err = store
        .record_commit(tx, &req, &Record::completed(b"r".to_vec()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    assert_eq!(count_effects(&store, "meddling").await, 0, "the work did not commit");
    assert!(
        store.get(&scope, &key).await.expect("get").is_none(),
        "no row committed"
    );
}

/// 32 concurrent tasks on one key, half transactional and half in lease mode: a transactional claim writes no row until its record, yet the effect runs once and every task sees its outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_and_lease_twins_run_the_effect_once() {
    let db = TempDb::new("rows");
    let store = SqliteStore::open(&db.path).await.expect("open");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE effects (effect_id TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects table");
    let tx_engine = Arc::new(TxEngine::new(store.clone()));
    let lease_engine = Arc::new(LeaseEngine::new(store.clone()));
    let scope = scope();
    let key = IdempotencyKey::generate();
    let call = Call::new(scope.clone(), key.clone(), fingerprint(&scope))
        .with_policy(Policy::default().with_in_flight(InFlight::Wait { max_ms: 120_000 }));
    let runs = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let (tx_engine, lease_engine, store, call, runs, barrier) = (
                tx_engine.clone(),
                lease_engine.clone(),
                store.clone(),
                call.clone(),
                runs.clone(),
                barrier.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                if i % 2 == 0 {
                    tx_engine
                        .execute(&call, |tx| {
                            let runs = runs.clone();
                            Box::pin(async move {
                                runs.fetch_add(1, Ordering::SeqCst);
                                write_effect(tx, "mixed").await?;
                                // Hold the claim so that twins of both modes meet it.
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                Ok::<_, Error>(format!("transactional {i}"))
                            })
                        })
                        .await
                } else {
                    lease_engine
                        .run(&call, |_lease| async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            sqlx::query("INSERT INTO effects (effect_id) VALUES ('mixed')")
                                .execute(store.pool())
                                .await
                                .map_err(store_error)?;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            Ok::<_, Error>(format!("lease {i}"))
                        })
                        .await
                }
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.expect("task").expect("every task gets an outcome"));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran once");
    assert_eq!(count_effects(&store, "mixed").await, 1, "the effect exists once");
    assert_eq!(outcomes.iter().filter(|o| !o.is_replayed()).count(), 1);
    assert!(
        outcomes.iter().all(|o| o.value() == outcomes[0].value()),
        "all 32 saw the same outcome"
    );
}

/// A claimed transaction of a fresh key on `store`'s only connection, with
/// the caller's write `effect` in it.
async fn claimed_with_a_write<'a>(store: &SqliteStore, req: &ClaimRequest<'a>, effect: &str) -> idem_sqlite::SqliteTx {
    let (mut tx, claim) = store.begin_claim(req, Duration::ZERO).await.expect("claim");
    assert_eq!(claim, TxClaim::Claimed);
    write_effect(&mut tx, effect).await.expect("the caller's write");
    tx
}

/// That the store's only connection is outside any transaction, and every
/// write it holds committed: sqlx counts no transaction on it once its
/// worker has answered, and a second pool on the file, which sees only
/// committed rows, takes the database's write lock at once.
async fn connection_is_clean(store: &SqliteStore, db: &TempDb) {
    use sqlx_core::transaction::TransactionManager;
    let mut conn = store.pool().acquire().await.expect("the store's connection");
    sqlx::Connection::ping(&mut *conn).await.expect("ping");
    let depth = sqlx::sqlite::SqliteTransactionManager::get_transaction_depth(&conn);
    assert_eq!(depth, 0, "the connection came back inside a transaction");
    drop(conn);
    let other = sqlx::SqlitePool::connect_with(
        sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&db.path)
            .busy_timeout(Duration::ZERO),
    )
    .await
    .expect("a second pool on the file");
    let lock = other
        .begin_with("BEGIN IMMEDIATE")
        .await
        .expect("the write lock is free");
    lock.rollback().await.expect("rollback");
    other.close().await;
}

/// How many committed business rows are named `effect`, read through a
/// pool of its own (which cannot see a transaction left open on the
/// store's connection).
async fn committed_effects(db: &TempDb, effect: &str) -> i64 {
    let other = sqlx::SqlitePool::connect_with(sqlx::sqlite::SqliteConnectOptions::new().filename(&db.path))
        .await
        .expect("a second pool on the file");
    let count = sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE effect_id = ?1")
        .bind(effect)
        .fetch_one(&other)
        .await
        .expect("count");
    other.close().await;
    count
}

async fn write_to(conn: &mut sqlx::SqliteConnection, effect: &str) {
    sqlx::query("INSERT INTO effects (effect_id) VALUES (?1)")
        .bind(effect)
        .execute(conn)
        .await
        .expect("a write");
}

/// A transaction begun in the caller's code on a claimed transaction's
/// connection (`sqlx::Connection::begin`) is a savepoint of the claim's:
/// rolling it back undoes only its own write, and the claim, the caller's
/// other writes and the record commit together, once.
#[tokio::test]
async fn a_transaction_begun_in_the_callers_work_nests_in_the_claim() {
    let db = TempDb::new("rows");
    let store = one_connection(&db).await;
    for inner_commits in [false, true] {
        let (scope, key, fp) = fresh_key();
        let req = request(&scope, &key, &fp, 1_000, 3, None);
        let [a, b, c] = [(); 3].map(|()| uuid::Uuid::new_v4().to_string());
        let mut tx = claimed_with_a_write(&store, &req, &a).await;
        let mut inner = sqlx::Connection::begin(&mut *tx).await.expect("a nested transaction");
        write_to(&mut inner, &b).await;
        if inner_commits {
            inner.commit().await.expect("commit the savepoint");
        } else {
            inner.rollback().await.expect("roll the savepoint back");
        }
        write_effect(&mut tx, &c).await.expect("the caller's last write");
        let record = Record::completed(b"done".to_vec());
        store.record_commit(tx, &req, &record).await.expect("record");
        assert_eq!(committed_effects(&db, &a).await, 1);
        assert_eq!(committed_effects(&db, &b).await, i64::from(inner_commits));
        assert_eq!(committed_effects(&db, &c).await, 1);
        let row = store.get(&scope, &key).await.expect("get").expect("recorded");
        assert_eq!(row.state, RowState::Done(record));
        connection_is_clean(&store, &db).await;
    }
}

/// A nested transaction left open on a claimed transaction's connection
/// (its `sqlx::Transaction` leaked), or one whose cancelled `begin` made
/// sqlx roll the claim's transaction back: the record fails and nothing of
/// the claim commits (neither its row nor the caller's write), where the
/// record's insert would otherwise commit on its own or inside a level that
/// never ends; a rollback or a drop ends every level. Each way, the store's
/// only connection comes back outside any transaction, the write lock free.
#[tokio::test]
async fn a_nested_level_left_open_or_rolled_back_under_the_claim_commits_nothing() {
    let db = TempDb::new("rows");
    let store = one_connection(&db).await;
    for how in ["left open", "cut off"] {
        for end in ["record", "rollback", "drop"] {
            let (scope, key, fp) = fresh_key();
            let req = request(&scope, &key, &fp, 1_000, 3, None);
            let effect = uuid::Uuid::new_v4().to_string();
            let mut tx = claimed_with_a_write(&store, &req, &effect).await;
            if how == "left open" {
                let mut inner = sqlx::Connection::begin(&mut *tx).await.expect("a nested transaction");
                write_to(&mut inner, &effect).await;
                std::mem::forget(inner);
            } else {
                cut_off_a_nested_begin(&mut tx).await;
            }
            match end {
                "record" => {
                    let err = store
                        .record_commit(tx, &req, &Record::completed(b"done".to_vec()))
                        .await
                        .unwrap_err();
                    assert!(matches!(err, Error::Config(_)), "{how}: {err:?}");
                }
                "rollback" => store.rollback(tx).await.expect("rollback"),
                _ => drop(tx),
            }
            connection_is_clean(&store, &db).await;
            assert_eq!(committed_effects(&db, &effect).await, 0, "{how}, {end}");
            assert!(store.get(&scope, &key).await.expect("get").is_none(), "{how}, {end}");
        }
    }
}

/// Cuts a nested `begin` on `tx` off half-way, as a timeout around the
/// caller's code would: its future is polled once (which sends it to the
/// connection's worker) and dropped, trying again in the rare case the
/// worker answered within that poll.
async fn cut_off_a_nested_begin(tx: &mut idem_sqlite::SqliteTx) {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    for _ in 0..1_000 {
        let mut begin = std::pin::pin!(sqlx::Connection::begin(&mut **tx));
        match begin.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Pending => return,
            Poll::Ready(nested) => nested
                .expect("a nested transaction")
                .rollback()
                .await
                .expect("rollback"),
        }
    }
    panic!("a nested begin was never cut off");
}

/// A transaction that commits without a record (a request without a key)
/// right after the caller's code dropped a nested transaction (which sqlx
/// rolls back on the connection's worker, queued): the commit sees that
/// level ended and commits the caller's other write. After a nested
/// `begin` cut off half-way instead, which made sqlx roll this transaction
/// back, the commit fails rather than answer Ok for nothing committed.
#[tokio::test]
async fn a_commit_without_a_record_sees_what_the_callers_nested_transactions_left() {
    let db = TempDb::new("rows");
    let store = one_connection(&db).await;
    for cut_off in [false, true] {
        let (kept, dropped) = (uuid::Uuid::new_v4().to_string(), uuid::Uuid::new_v4().to_string());
        let mut tx = store.begin().await.expect("begin");
        write_effect(&mut tx, &kept).await.expect("the caller's write");
        if cut_off {
            cut_off_a_nested_begin(&mut tx).await;
        } else {
            let mut inner = sqlx::Connection::begin(&mut *tx).await.expect("a nested transaction");
            write_to(&mut inner, &dropped).await;
            drop(inner);
        }
        let committed = store.commit(tx).await;
        if cut_off {
            assert!(matches!(committed, Err(Error::Config(_))), "{committed:?}");
            assert_eq!(committed_effects(&db, &kept).await, 0);
        } else {
            committed.expect("the commit");
            assert_eq!(committed_effects(&db, &kept).await, 1);
            assert_eq!(committed_effects(&db, &dropped).await, 0);
        }
        connection_is_clean(&store, &db).await;
    }
}

/// A multi-step operation's local step whose work swallowed a nested
/// `begin` cut off half-way (which made sqlx roll the step's transaction
/// back): the step's row is not written, where it would otherwise commit
/// on its own and record the step done without its work.
#[tokio::test]
async fn a_local_step_is_not_recorded_once_its_transaction_was_rolled_back_under_it() {
    use idem_core::multistep::{MultiStep, MultiStepStore, NewMultiStep};
    let db = TempDb::new("rows");
    let store = one_connection(&db).await;
    let steps = idem_sqlite::SqliteMultiSteps::new(store.pool().clone());
    steps.migrate().await.expect("migrate the operations table");
    let scope = scope();
    let new = NewMultiStep {
        fingerprint: fingerprint(&scope),
        scope,
        key: IdempotencyKey::generate(),
        definition: "transfer@1".into(),
        input: b"{}".to_vec(),
        ttl_ms: 60_000,
    };
    let row = MultiStep::created(&new, 7, 1_000, 30_000).expect("a new operation");
    let mut tx = store.begin().await.expect("begin");
    let effect = uuid::Uuid::new_v4().to_string();
    write_effect(&mut tx, &effect).await.expect("the step's work");
    cut_off_a_nested_begin(&mut tx).await;
    let written = MultiStepStore::<SqliteStore>::insert_in(&steps, &mut tx, &row).await;
    assert!(matches!(written, Err(Error::Config(_))), "{written:?}");
    store.rollback(tx).await.expect("rollback");
    let found = MultiStepStore::<SqliteStore>::find(&steps, &new.scope, &new.key).await;
    assert!(found.expect("find").is_none(), "the step's row was not written");
    assert_eq!(committed_effects(&db, &effect).await, 0);
    connection_is_clean(&store, &db).await;
}
