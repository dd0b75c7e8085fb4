//! The transactional path's transactions and values: a claim answered
//! Found or Busy leaves no transaction open on its pooled connection, a
//! dropped claim commits nothing, a record without its claim commits
//! nothing, and names and payloads are stored byte for byte whatever the
//! session's `sql_mode`.

mod common;

use std::time::Duration;

use common::{URL_VAR, effects, isolated_store, one_connection_through_proxy, shared_store, url, write_effect};
use idem_conformance::{call_for, rejecting, unique_scope};
use idem_core::{ClaimRequest, Error, IdempotencyKey, Record, RowState, Scope, TxBackend, TxClaim, TxEngine};
use idem_mysql::{ClaimStrategy, MySqlStore};
use sqlx::MySqlPool;
use sqlx::mysql::MySqlPoolOptions;

/// A call of a fresh key.
fn fresh_call() -> idem_core::Call {
    call_for(&unique_scope("op"), &IdempotencyKey::generate(), "{}", rejecting())
}

fn request(call: &idem_core::Call) -> ClaimRequest<'_> {
    common::request_at(call, common::now_ms())
}

/// A pool of `max` connections whose sessions run `setup` first.
async fn pool(max: u32, setup: &'static str) -> MySqlPool {
    let url = url();
    MySqlPoolOptions::new()
        .max_connections(max)
        .after_connect(move |conn, _meta| {
            Box::pin(async move {
                sqlx::Executor::execute(&mut *conn, setup).await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach the MySQL/MariaDB test server at {url} ({e}); set {URL_VAR}"))
}

/// A claimed transaction of `req`'s fresh key, with the caller's write
/// `effect` sent in it.
async fn claimed_with_a_write(store: &MySqlStore, req: &ClaimRequest<'_>, effect: &str) -> idem_mysql::MySqlTx {
    let (mut tx, claim) = store.begin_claim(req, Duration::ZERO).await.unwrap();
    assert_eq!(claim, TxClaim::Claimed);
    write_effect(&mut tx, effect).await;
    tx
}

/// A store on a keys table of its own (with the shared effects table in
/// place): a test whose sessions end with a transaction open, or close
/// mid-way, leaves no lock that another test's claim on the shared table
/// would meet.
async fn store_of_its_own(pool: &MySqlPool) -> MySqlStore {
    shared_store(pool.clone()).await;
    isolated_store(pool.clone()).await
}

/// Whether the pool's next connection is inside a transaction, and its autocommit setting.
async fn session_state(pool: &MySqlPool) -> (i64, i64) {
    sqlx::query_as("SELECT CAST(@@in_transaction AS SIGNED), CAST(@@autocommit AS SIGNED)")
        .fetch_one(pool)
        .await
        .expect("read the session's transaction state")
}

/// A store on `pool`, its engine, and a call it has executed once (answering 7).
async fn executed_once(pool: &MySqlPool) -> (MySqlStore, TxEngine<MySqlStore>, idem_core::Call) {
    let store = shared_store(pool.clone()).await;
    let engine = TxEngine::new(store.clone());
    let call = fresh_call();
    let first = engine
        .execute(&call, |_tx| Box::pin(async { Ok::<_, Error>(7u32) }))
        .await
        .unwrap();
    assert!(!first.is_replayed());
    (store, engine, call)
}

/// A claim answered Found, and one answered Busy, leave the single pooled connection out of any transaction.
#[tokio::test]
async fn found_and_busy_leave_no_open_transaction() {
    let pool = pool(1, "DO 0").await;
    let (store, engine, call) = executed_once(&pool).await;

    let replay = engine
        .execute(&call, |_tx| Box::pin(async { Ok::<_, Error>(8u32) }))
        .await
        .unwrap();
    assert!(replay.is_replayed());
    assert_eq!(*replay.value(), 7);
    assert_eq!(session_state(&pool).await, (0, 1), "after a Found claim");

    // A twin on another pool holds a fresh key; this pool's claim is Busy.
    let holder_store = MySqlStore::new(common::connect().await).with_table(store.table().clone());
    let busy_call = fresh_call();
    let busy_req = request(&busy_call);
    let (held, claim) = holder_store.begin_claim(&busy_req, Duration::ZERO).await.unwrap();
    assert_eq!(claim, TxClaim::Claimed);
    let (tx, claim) = store.begin_claim(&busy_req, Duration::ZERO).await.unwrap();
    assert_eq!(claim, TxClaim::Busy);
    store.rollback(tx).await.unwrap();
    assert_eq!(session_state(&pool).await, (0, 1), "after a Busy claim");
    let err = engine
        .execute(&busy_call, |_tx| Box::pin(async { Ok::<_, Error>(1u32) }))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InFlight { .. }), "{err:?}");
    assert_eq!(session_state(&pool).await, (0, 1), "after the engine's Busy answer");
    holder_store.rollback(held).await.unwrap();
}

/// A claimed transaction that is dropped commits nothing and leaves the key unused.
#[tokio::test]
async fn dropped_claimed_transaction_rolls_back() {
    let pool = pool(1, "DO 0").await;
    let store = shared_store(pool.clone()).await;
    let call = fresh_call();
    let req = request(&call);
    let effect = uuid::Uuid::new_v4().to_string();
    drop(claimed_with_a_write(&store, &req, &effect).await);

    // The single connection comes back only after its rollback.
    assert_eq!(session_state(&pool).await, (0, 1));
    assert_eq!(effects(&pool, &effect).await, 0, "the dropped transaction's write");
    assert!(
        store.get(call.scope(), call.key()).await.unwrap().is_none(),
        "the key is unused"
    );
    let again = TxEngine::new(store.clone())
        .execute(&call, |_tx| Box::pin(async { Ok::<_, Error>(1u32) }))
        .await
        .unwrap();
    assert!(!again.is_replayed(), "the key is claimed afresh");
}

/// Recording `req` in `tx`, which holds no claim of its key, fails; the
/// connection leaves the transaction, and neither the business row
/// `effect` nor the key's row commits.
async fn record_is_refused(
    store: &MySqlStore,
    pool: &MySqlPool,
    tx: idem_mysql::MySqlTx,
    req: &idem_core::ClaimRequest<'_>,
    effect: &str,
) {
    let err = store
        .record_commit(tx, req, &Record::completed(b"r".to_vec()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    nothing_committed(store, pool, req, effect, "a record without its claim").await;
}

/// That the pool's only connection is back outside any transaction, and
/// neither the caller's write `effect` nor `req`'s key committed (`what` is
/// said with any failure).
async fn nothing_committed(store: &MySqlStore, pool: &MySqlPool, req: &ClaimRequest<'_>, effect: &str, what: &str) {
    assert_eq!(session_state(pool).await, (0, 1), "{what}");
    assert_eq!(effects(pool, effect).await, 0, "{what}");
    assert!(store.get(req.scope, req.key).await.unwrap().is_none(), "{what}");
}

/// A record in a transaction that holds no claim of its key fails, and the caller's write in it never commits.
#[tokio::test]
async fn record_without_claim_commits_nothing() {
    let pool = pool(1, "DO 0").await;
    let store = shared_store(pool.clone()).await;
    let call = fresh_call();
    let req = request(&call);
    let effect = uuid::Uuid::new_v4().to_string();

    let mut tx = store.begin().await.unwrap();
    write_effect(&mut tx, &effect).await;
    record_is_refused(&store, &pool, tx, &req, &effect).await;

    // A claim deleted by the caller's own work is no claim either.
    let mut tx = claimed_with_a_write(&store, &req, &effect).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM `{}` WHERE idem_key = ?",
        store.table()
    )))
    .bind(call.key().as_str())
    .execute(&mut *tx)
    .await
    .unwrap();
    record_is_refused(&store, &pool, tx, &req, &effect).await;
}

/// A transaction begun in the caller's code on a claimed transaction's
/// connection (`sqlx::Connection::begin`) is a savepoint of the claim's:
/// rolling it back undoes only its own write, committing it commits nothing
/// yet, and the claim, the caller's other writes and the record commit
/// together, once; the pool's only connection comes back outside any
/// transaction.
#[tokio::test]
async fn a_transaction_begun_in_the_callers_work_nests_in_the_claim() {
    let pool = pool(1, "DO 0").await;
    let store = store_of_its_own(&pool).await;
    for inner_commits in [false, true] {
        let call = fresh_call();
        let req = request(&call);
        let [a, b, c] = [(); 3].map(|()| uuid::Uuid::new_v4().to_string());
        let mut tx = claimed_with_a_write(&store, &req, &a).await;
        let mut inner = sqlx::Connection::begin(&mut *tx).await.unwrap();
        write_effect(&mut inner, &b).await;
        if inner_commits {
            inner.commit().await.unwrap();
        } else {
            inner.rollback().await.unwrap();
        }
        write_effect(&mut tx, &c).await;
        let record = Record::completed(b"r".to_vec());
        store.record_commit(tx, &req, &record).await.unwrap();
        assert_eq!(session_state(&pool).await, (0, 1));
        assert_eq!(effects(&pool, &a).await, 1);
        assert_eq!(effects(&pool, &b).await, i64::from(inner_commits));
        assert_eq!(effects(&pool, &c).await, 1);
        let row = store.get(req.scope, req.key).await.unwrap().expect("recorded");
        assert_eq!(row.state, RowState::Done(record));
    }
}

/// A nested `begin` cancelled half-way (here by a timeout) makes sqlx roll
/// back the enclosing transaction, the claim's: the record then fails and
/// nothing of the claim commits (neither its row nor the caller's write
/// before it), where a named-lock record, an insert, would otherwise commit
/// on its own and `COMMIT` would answer Ok without being sent. The pool's
/// only connection comes back outside any transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_rolled_back_under_it_by_a_nested_begin_commits_nothing() {
    // The proxy holds the answer to the nested begin's `SAVEPOINT`, so the
    // timeout always cuts the begin off half-way.
    let (proxy, pool) = one_connection_through_proxy(b"SAVEPOINT").await;
    for strategy in [ClaimStrategy::NamedLock, ClaimStrategy::Placeholder] {
        let store = store_of_its_own(&pool).await.with_claim_strategy(strategy);
        for end in ["record", "rollback"] {
            let call = fresh_call();
            let req = request(&call);
            let effect = uuid::Uuid::new_v4().to_string();
            let mut tx = claimed_with_a_write(&store, &req, &effect).await;
            proxy.arm(true);
            let cut_off = tokio::time::timeout(Duration::from_millis(100), sqlx::Connection::begin(&mut *tx))
                .await
                .is_err();
            assert!(cut_off, "the nested begin was cut off");
            proxy.arm(false);
            proxy.release();
            if end == "record" {
                let err = store
                    .record_commit(tx, &req, &Record::completed(b"r".to_vec()))
                    .await
                    .unwrap_err();
                assert!(matches!(err, Error::Config(_)), "{strategy:?}: {err:?}");
            } else {
                store.rollback(tx).await.unwrap();
            }
            nothing_committed(&store, &pool, &req, &effect, &format!("{strategy:?} {end}")).await;
        }
    }
    assert_eq!(proxy.held(), 4);
}

/// A nested transaction (a savepoint) begun on the claim's connection and
/// never ended: committing fails and commits nothing (neither the claim nor
/// the caller's write), and rolling back or dropping rolls everything back;
/// each way, the only pooled connection comes back outside any transaction,
/// not inside the claim's.
#[tokio::test]
async fn a_nested_transaction_left_open_commits_nothing() {
    let pool = pool(1, "DO 0").await;
    let store = store_of_its_own(&pool).await;
    for end in ["commit", "rollback", "drop"] {
        let call = fresh_call();
        let req = request(&call);
        let effect = uuid::Uuid::new_v4().to_string();
        let mut tx = claimed_with_a_write(&store, &req, &effect).await;
        std::mem::forget(sqlx::Connection::begin(&mut *tx).await.unwrap());
        match end {
            "commit" => {
                let err = store
                    .record_commit(tx, &req, &Record::completed(b"r".to_vec()))
                    .await
                    .unwrap_err();
                assert!(matches!(err, Error::Config(_)), "{err:?}");
            }
            "rollback" => store.rollback(tx).await.unwrap(),
            _ => drop(tx),
        }
        nothing_committed(&store, &pool, &req, &effect, end).await;
    }
}

/// Tenants, operations and keys with quotes, backslashes and non-ASCII text are stored and matched exactly, whether or not backslashes escape, under each claim strategy.
#[tokio::test]
async fn awkward_names_round_trip_under_every_sql_mode() {
    for (mode, strategy) in [
        (
            "SET SESSION sql_mode = 'STRICT_TRANS_TABLES'",
            ClaimStrategy::Placeholder,
        ),
        (
            "SET SESSION sql_mode = 'ANSI,NO_BACKSLASH_ESCAPES,STRICT_ALL_TABLES'",
            ClaimStrategy::Placeholder,
        ),
        ("SET SESSION sql_mode = 'STRICT_TRANS_TABLES'", ClaimStrategy::NamedLock),
        (
            "SET SESSION sql_mode = 'ANSI,NO_BACKSLASH_ESCAPES,STRICT_ALL_TABLES'",
            ClaimStrategy::NamedLock,
        ),
    ] {
        let pool = pool(2, mode).await;
        let store = isolated_store(pool).await.with_claim_strategy(strategy);
        let engine = TxEngine::new(store.clone());
        let tenant = format!("t'\\\"%_\\' ünï {}", uuid::Uuid::new_v4().simple());
        let scope = Scope::parse(&tenant, "POST /v1/x'\\\\y\" — ✓").unwrap();
        let keys = ["a\\'b", "a'b", "a\\\\'b", "a\"b`c%_\\", "0x41", "X'41'"];
        for (i, key) in keys.iter().enumerate() {
            let call = call_for(&scope, &IdempotencyKey::new(*key).unwrap(), "{}", rejecting());
            let note = format!("{key} ✓ {i}");
            let first = engine
                .execute(&call, |_tx| {
                    let note = note.clone();
                    Box::pin(async move { Ok::<_, Error>(note) })
                })
                .await
                .unwrap();
            assert!(!first.is_replayed(), "{mode}: {key:?} is a key of its own");
            let again = engine
                .execute(&call, |_tx| Box::pin(async { Ok::<_, Error>(String::new()) }))
                .await
                .unwrap();
            assert!(again.is_replayed(), "{mode}: {key:?} replays");
            assert_eq!(*again.value(), note, "{mode}: {key:?}");
        }
        let listed = store
            .list_keys(
                &idem_core::KeyFilter {
                    tenant: Some(tenant.clone()),
                    ..Default::default()
                },
                common::now_ms(),
                100,
            )
            .await
            .unwrap();
        let mut got: Vec<(&str, &str)> = listed.iter().map(|k| (k.operation.as_str(), k.key.as_str())).collect();
        got.sort();
        let mut expected: Vec<(&str, &str)> = keys.iter().map(|k| (scope.operation().as_str(), *k)).collect();
        expected.sort();
        assert_eq!(got, expected, "{mode}: stored byte for byte");
    }
}

/// Recorded payloads holding every byte value come back exactly, empty, small and large.
#[tokio::test]
async fn payloads_of_every_byte_round_trip() {
    let store = shared_store(common::connect().await).await;
    let every: Vec<u8> = (0..=255u8).collect();
    for len in [0, 256, 100 * 1024] {
        let payload: Vec<u8> = every.iter().copied().cycle().take(len).collect();
        let call = fresh_call();
        let req = request(&call);
        let (tx, claim) = store.begin_claim(&req, Duration::ZERO).await.unwrap();
        assert_eq!(claim, TxClaim::Claimed);
        let record = Record::completed(payload);
        store.record_commit(tx, &req, &record).await.unwrap();
        let row = store.get(call.scope(), call.key()).await.unwrap().expect("recorded");
        assert_eq!(row.state, RowState::Done(record), "{len} bytes");
    }
}

/// A replay answers without waiting for its `ROLLBACK`: the `ROLLBACK` is
/// queued on the connection, and the ping with which the pool takes the
/// connection back sends it and reads its answer before anyone can acquire
/// the connection. Through a proxy that holds that answer back, the replay
/// still answers; the only connection is handed out again only once the
/// answer has arrived, outside any transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_does_not_wait_for_its_rollback() {
    let (proxy, pool) = one_connection_through_proxy(b"ROLLBACK").await;
    let (_, engine, call) = executed_once(&pool).await;
    proxy.arm(true);
    let replay = tokio::time::timeout(
        Duration::from_secs(20),
        engine.execute(&call, |_tx| Box::pin(async { Ok::<_, Error>(8u32) })),
    )
    .await
    .expect("the replay answered while its ROLLBACK's answer was held back")
    .unwrap();
    assert!(replay.is_replayed());
    let next = pool.clone();
    proxy
        .waits_for_release(
            async move { next.acquire().await.map(drop) },
            "the connection was handed out before its ROLLBACK was answered",
        )
        .await
        .expect("the connection came back");
    assert_eq!(proxy.held(), 1);
    assert_eq!(session_state(&pool).await, (0, 1), "no transaction left open");
    // A claim that claimed holds the key's placeholder row, which a claim
    // that follows at once must find free: its rollback waits for the answer.
    let fresh = fresh_call();
    let idem_core::Begin::Claimed(claimed) = engine.begin(&fresh).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    proxy
        .waits_for_release(
            async move { engine.abandon(claimed).await },
            "the rollback of a claim did not wait for its answer",
        )
        .await;
    assert_eq!(proxy.held(), 2);
    proxy.arm(false);
}
