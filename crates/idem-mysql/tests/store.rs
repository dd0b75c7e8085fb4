//! Behaviours specific to the MySQL/MariaDB store, beyond the conformance
//! suite: the schema, migrations, lock waits, deadlocks and error mapping.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Isolation, connect, connect_at, isolated_store, now_ms, shared_store};
use idem_conformance::{Receipt, Runs, call_for, unique_scope, waiting};
use idem_core::{
    Begin, ClaimRequest, Error, IdempotencyKey, Lease, LeaseClaim, LeaseStore, Policy, Record, StoreErrorKind,
    TableName, Token, TxBackend, TxClaim, TxEngine,
};
use idem_mysql::{MySqlStore, MySqlTx};

/// A claim request for `call` at the current time, transactional or with a lease.
fn request<'a>(call: &'a idem_core::Call, lease_expires_at_ms: Option<i64>) -> ClaimRequest<'a> {
    ClaimRequest {
        lease_expires_at_ms,
        ..common::request_at(call, now_ms())
    }
}

async fn claim(
    store: &MySqlStore,
    tx: &mut MySqlTx,
    call: &idem_core::Call,
    wait: Duration,
) -> idem_core::Result<TxClaim> {
    let req = request(call, None);
    store.claim(tx, &req, wait).await
}

/// A call of a fresh key in a scope of its own, with the default policy.
fn fresh_call() -> idem_core::Call {
    call_for(
        &unique_scope("op"),
        &IdempotencyKey::generate(),
        "{}",
        Policy::default(),
    )
}

/// A fresh call, claimed without waiting in a transaction the caller ends.
async fn claimed(store: &MySqlStore) -> (idem_core::Call, MySqlTx) {
    let call = fresh_call();
    let mut first = store.begin().await.unwrap();
    assert_eq!(
        claim(store, &mut first, &call, Duration::ZERO).await.unwrap(),
        TxClaim::Claimed
    );
    (call, first)
}

/// How long a twin of `call` allowed to wait `wait` took to be answered
/// busy (in a transaction of its own, rolled back).
async fn busy_after(store: &MySqlStore, call: &idem_core::Call, wait: Duration) -> Duration {
    let mut twin = store.begin().await.unwrap();
    let started = Instant::now();
    assert_eq!(claim(store, &mut twin, call, wait).await.unwrap(), TxClaim::Busy);
    let elapsed = started.elapsed();
    store.rollback(twin).await.unwrap();
    elapsed
}

/// How many statements are inserting into the store's table right now
/// (each test that counts uses a table of its own). While a claim holds the
/// key, such an insert can only be a twin blocked on its row lock. The
/// process list is read rather than `information_schema.innodb_trx`, whose
/// contents InnoDB caches and refreshes only after 100 ms without readers.
async fn blocked_inserts(store: &MySqlStore) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.processlist
         WHERE info LIKE CONCAT('%INSERT INTO `', ?, '`%')",
    )
    .bind(store.table().as_str())
    .fetch_one(store.pool())
    .await
    .expect("count blocked inserts")
}

/// Waits until `n` twins are blocked on the store's table.
async fn until_blocked(store: &MySqlStore, n: i64) {
    let started = Instant::now();
    while blocked_inserts(store).await < n {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{n} twins never blocked on the key"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Leave the last statement time to enqueue its lock request.
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// The server's deadlock counter.
async fn deadlocks(store: &MySqlStore) -> u64 {
    let (_, value): (String, String) = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
        .fetch_one(store.pool())
        .await
        .expect("read the deadlock counter");
    value.parse().expect("a number")
}

/// The keys table has the documented column types, binary key columns and the expiry index.
#[tokio::test]
async fn schema_matches_the_documented_layout() {
    let store = isolated_store(connect().await).await;
    let columns: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT CAST(column_name AS CHAR), CAST(column_type AS CHAR), CAST(is_nullable AS CHAR)
         FROM information_schema.columns WHERE table_schema = DATABASE() AND table_name = ?
         ORDER BY ordinal_position",
    )
    .bind(store.table().as_str())
    .fetch_all(store.pool())
    .await
    .unwrap();
    // MariaDB shows integer display widths (`bigint(20)`), MySQL 8 does not.
    let got: Vec<(&str, &str, &str)> = columns
        .iter()
        .map(|(n, t, null)| {
            (
                n.as_str(),
                t.split('(').next().filter(|b| b.ends_with("int")).unwrap_or(t.as_str()),
                null.as_str(),
            )
        })
        .collect();
    let expected = [
        ("tenant", "varbinary(255)", "NO"),
        ("operation", "varbinary(255)", "NO"),
        ("idem_key", "varbinary(255)", "NO"),
        ("fingerprint", "binary(32)", "NO"),
        ("status", "smallint", "NO"),
        ("token", "bigint", "NO"),
        ("payload", "longblob", "YES"),
        ("created_at_ms", "bigint", "NO"),
        ("expires_at_ms", "bigint", "NO"),
        ("lease_expires_at_ms", "bigint", "YES"),
        ("sent_at_ms", "bigint", "YES"),
    ];
    assert_eq!(got, expected);
    let engine: String = sqlx::query_scalar(
        "SELECT CAST(engine AS CHAR) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
    )
    .bind(store.table().as_str())
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(engine, "InnoDB");
    let index_columns: Vec<(String, String)> = sqlx::query_as(
        "SELECT CAST(index_name AS CHAR), CAST(column_name AS CHAR) FROM information_schema.statistics
         WHERE table_schema = DATABASE() AND table_name = ? ORDER BY index_name, seq_in_index",
    )
    .bind(store.table().as_str())
    .fetch_all(store.pool())
    .await
    .unwrap();
    let primary: Vec<&str> = index_columns
        .iter()
        .filter(|(i, _)| i == "PRIMARY")
        .map(|(_, c)| c.as_str())
        .collect();
    assert_eq!(primary, ["tenant", "operation", "idem_key"]);
    assert!(
        index_columns
            .iter()
            .any(|(i, c)| i != "PRIMARY" && c == "expires_at_ms"),
        "{index_columns:?}"
    );
}

/// Many processes migrating the same fresh table at once, at any default isolation level, all succeed, and each migration is recorded once.
async fn concurrent_migrations_at(isolation: Isolation) {
    let table = TableName::new(format!("{}{}", common::ISOLATED_PREFIX, uuid::Uuid::new_v4().simple())).unwrap();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let table = table.clone();
        tasks.push(tokio::spawn(async move {
            let store = MySqlStore::new(connect_at(isolation).await).with_table(table);
            store.migrate().await.map(|()| store)
        }));
    }
    let mut stores = Vec::new();
    for t in tasks {
        stores.push(
            t.await
                .unwrap()
                .unwrap_or_else(|e| panic!("every concurrent migration succeeds at {isolation:?}: {e}")),
        );
    }
    stores[0].migrate().await.expect("migrating again is a no-op");
    let versions: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT version FROM `{table}_schema`")))
        .fetch_all(stores[0].pool())
        .await
        .unwrap();
    assert_eq!(versions, [1, 2], "each version is recorded exactly once");
}

idem_conformance::cases!(concurrent_migrations_at, 4 => {
    /// Concurrent migrations at REPEATABLE READ (InnoDB's default).
    concurrent_migrations_apply_once(Isolation::RepeatableRead);
    /// Concurrent migrations on connections that default to READ COMMITTED.
    concurrent_migrations_at_read_committed(Isolation::ReadCommitted);
    /// Concurrent migrations on connections that default to SERIALIZABLE.
    concurrent_migrations_at_serializable(Isolation::Serializable);
});

/// The lease `req` (a lease claim of `call`'s fresh key) takes.
async fn leased(store: &MySqlStore, call: &idem_core::Call, req: &ClaimRequest<'_>) -> Lease {
    let LeaseClaim::Acquired(token) = store.try_claim(req).await.unwrap() else {
        panic!("a fresh key is acquired")
    };
    Lease {
        scope: call.scope().clone(),
        key: call.key().clone(),
        token,
        lease_expires_at_ms: req.lease_expires_at_ms.expect("a lease claim"),
    }
}

/// Drops the keys table `table` and its version table.
async fn drop_keys_table(pool: &sqlx::MySqlPool, table: &TableName) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE `{table}`, `{table}_schema`")))
        .execute(pool)
        .await
        .unwrap();
}

/// A keys table of schema version 1 (no `sent_at_ms`), as a release before sent claims left it, with rows of its own.
async fn version_1_table(pool: &sqlx::MySqlPool) -> TableName {
    let table = TableName::new(format!("{}{}", common::ISOLATED_PREFIX, uuid::Uuid::new_v4().simple())).unwrap();
    let t = table.as_str();
    for statement in [
        format!(
            "CREATE TABLE `{t}` (tenant VARBINARY(255) NOT NULL, operation VARBINARY(255) NOT NULL, \
             idem_key VARBINARY(255) NOT NULL, fingerprint BINARY(32) NOT NULL, status SMALLINT NOT NULL, \
             token BIGINT NOT NULL, payload LONGBLOB NULL, created_at_ms BIGINT NOT NULL, \
             expires_at_ms BIGINT NOT NULL, lease_expires_at_ms BIGINT NULL, \
             PRIMARY KEY (tenant, operation, idem_key), KEY expires_at_ms_idx (expires_at_ms)) ENGINE=InnoDB"
        ),
        format!(
            "CREATE TABLE `{t}_schema` (version BIGINT NOT NULL PRIMARY KEY, description VARCHAR(255) NOT NULL, \
             applied_at_ms BIGINT NOT NULL) ENGINE=InnoDB"
        ),
        format!("INSERT INTO `{t}_schema` VALUES (1, 'create the keys table', 1)"),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(pool)
            .await
            .unwrap();
    }
    table
}

/// A version-1 keys table is upgraded in place by `migrate` (listed as pending first, concurrent upgrades harmless, rows kept), and a sent claim then works on it: held, never taken over at its lease's end, completed with its mark's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_version_1_keys_table_is_upgraded_for_sent_claims() {
    let pool = connect().await;
    let table = version_1_table(&pool).await;
    let store = MySqlStore::new(pool.clone()).with_table(table.clone());
    let old = fresh_call();
    let old_req = request(&old, Some(now_ms() + 60_000));
    assert!(matches!(
        store.try_claim(&old_req).await.unwrap(),
        LeaseClaim::Acquired(_)
    ));

    let pending = store.pending_migrations().await.unwrap();
    assert_eq!(pending.iter().map(|m| m.version).collect::<Vec<_>>(), [2]);
    assert!(
        pending[0].statements[0].contains("ADD COLUMN sent_at_ms BIGINT NULL"),
        "{pending:?}"
    );
    let mut racers = Vec::new();
    for _ in 0..3 {
        let racer = MySqlStore::new(connect().await).with_table(table.clone());
        racers.push(tokio::spawn(async move { racer.migrate().await }));
    }
    for racer in racers {
        racer.await.unwrap().expect("concurrent upgrades all succeed");
    }
    assert!(store.pending_migrations().await.unwrap().is_empty());
    let versions: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM `{table}_schema` ORDER BY version"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(versions, [1, 2]);
    let kept = store
        .get(old.scope(), old.key())
        .await
        .unwrap()
        .expect("the old row survives");
    assert!(matches!(kept.state, idem_core::RowState::InProgress { .. }), "{kept:?}");
    assert_eq!(kept.sent_at_ms, None);

    let call = fresh_call();
    let now = now_ms();
    let lease_end = now + 1_000;
    let req = ClaimRequest {
        lease_expires_at_ms: Some(lease_end),
        ..request(&call, None)
    };
    let lease = leased(&store, &call, &req).await;
    let token = lease.token;
    store.mark_sent(&lease, now).await.unwrap();
    let after_lease = ClaimRequest {
        now_ms: lease_end + 1,
        fresh_token: Token::fresh(lease_end + 1),
        ..request(&call, None)
    };
    match store.try_claim(&after_lease).await.unwrap() {
        LeaseClaim::Found(row) => {
            assert!(row.is_unknown_at(lease_end + 1), "{row:?}");
            assert!(matches!(row.state, idem_core::RowState::Sent { token: t, .. } if t == token));
        }
        other => panic!("a sent claim is never taken over at its lease's end, got {other:?}"),
    }
    let record = Record::completed(b"paid".to_vec());
    store.complete(&lease, &record).await.unwrap();
    let row = store.lookup(call.scope(), call.key()).await.unwrap().expect("the row");
    assert_eq!(row.state, idem_core::RowState::Done(record));
    assert_eq!(row.sent_at_ms, Some(now), "the outcome keeps the mark's time");
    drop_keys_table(&pool, &table).await;
}

/// A migration whose column was added by a run that died before recording it runs again without failing.
#[tokio::test]
async fn an_unrecorded_column_migration_runs_again() {
    let pool = connect().await;
    let table = version_1_table(&pool).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE `{table}` ADD COLUMN sent_at_ms BIGINT NULL"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let store = MySqlStore::new(pool.clone()).with_table(table.clone());
    assert_eq!(store.pending_migrations().await.unwrap().len(), 1);
    store.migrate().await.expect("the column already there counts as added");
    assert!(store.pending_migrations().await.unwrap().is_empty());
    drop_keys_table(&pool, &table).await;
}

/// A table name whose version table would exceed MySQL's identifier limit is refused before touching the server.
#[tokio::test]
async fn overlong_table_name_is_a_config_error() {
    let store = MySqlStore::new(connect().await).with_table(TableName::new("k".repeat(60)).unwrap());
    assert!(matches!(store.migrate().await, Err(Error::Config(_))));
}

/// Keys, tenants and operations are compared byte for byte: keys differing only in case are distinct.
#[tokio::test]
async fn keys_are_case_sensitive() {
    let store = shared_store(connect().await).await;
    let engine = TxEngine::new(store);
    let scope = unique_scope("POST /v1/transfers");
    let runs = Runs::default();
    let mut values = Vec::new();
    for key in ["Key-ABC", "key-abc", "KEY-ABC", "Key-ABC "] {
        let call = call_for(&scope, &IdempotencyKey::new(key).unwrap(), "{}", Policy::default());
        let runs = runs.clone();
        let out = engine
            .execute(&call, move |_tx| {
                let runs = runs.clone();
                Box::pin(async move {
                    runs.hit();
                    Ok::<_, Error>(Receipt::new(1))
                })
            })
            .await
            .unwrap();
        assert!(!out.is_replayed(), "{key:?} is a key of its own");
        values.push(out.into_inner());
    }
    assert_eq!(runs.get(), 4);
    let upper_scope = idem_core::Scope::parse(&scope.tenant().as_str().to_uppercase(), "POST /v1/transfers").unwrap();
    let call = call_for(
        &upper_scope,
        &IdempotencyKey::new("Key-ABC").unwrap(),
        "{}",
        Policy::default(),
    );
    let out = engine
        .execute(&call, |_tx| Box::pin(async { Ok::<_, Error>(Receipt::new(2)) }))
        .await
        .unwrap();
    assert!(!out.is_replayed(), "a tenant differing only in case is another tenant");
}

/// Extending a lease to the expiry it already has is not mistaken for a fenced lease.
#[tokio::test]
async fn extend_with_unchanged_expiry_is_not_fenced() {
    let store = shared_store(connect().await).await;
    let call = fresh_call();
    let until = now_ms() + 30_000;
    let req = request(&call, Some(until));
    let lease = leased(&store, &call, &req).await;
    let token = lease.token;
    store.extend(&lease, until).await.expect("same expiry: still held");
    store.extend(&lease, until).await.expect("and again");
    store.extend(&lease, until + 1_000).await.expect("a later expiry");
    let stale = Lease {
        token: Token(token.0 - 1),
        ..lease.clone()
    };
    assert!(
        matches!(store.extend(&stale, until).await, Err(Error::Fenced)),
        "a wrong token is fenced"
    );
    store
        .complete(&lease, &Record::completed(b"done".to_vec()))
        .await
        .unwrap();
    assert!(
        matches!(store.extend(&lease, until).await, Err(Error::Fenced)),
        "a completed key is fenced"
    );
}

/// A twin's wait is bounded by the attempt's wait: under a second it does not block at all, otherwise it blocks whole seconds and answers busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twin_wait_is_bounded_and_answers_busy() {
    let store = shared_store(connect().await).await;
    let (call, first) = claimed(&store).await;

    let no_wait = busy_after(&store, &call, Duration::from_millis(900)).await;
    assert!(
        no_wait < Duration::from_millis(500),
        "a sub-second wait does not block: {no_wait:?}"
    );

    let blocked = busy_after(&store, &call, Duration::from_millis(1_700)).await;
    assert!(
        blocked >= Duration::from_millis(900),
        "a 1.7 s wait blocks for one whole second: {blocked:?}"
    );
    assert!(
        blocked < Duration::from_millis(1_700),
        "and never past the wait: {blocked:?}"
    );
    store.rollback(first).await.unwrap();
}

/// A blocked twin wakes as soon as the first claim commits and finds its recorded outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blocked_twin_wakes_on_commit() {
    let store = isolated_store(connect().await).await;
    let (call, mut first) = claimed(&store).await;
    let twin = {
        let (store, call) = (store.clone(), call.clone());
        tokio::spawn(async move {
            let mut tx = store.begin().await.unwrap();
            let started = Instant::now();
            let out = claim(&store, &mut tx, &call, Duration::from_secs(30)).await;
            store.rollback(tx).await.unwrap();
            (out, started.elapsed())
        })
    };
    until_blocked(&store, 1).await;
    let record = Record::completed(b"outcome".to_vec());
    let req = request(&call, None);
    store.record(&mut first, &req, &record).await.unwrap();
    store.commit(first).await.unwrap();
    let (out, elapsed) = twin.await.unwrap();
    match out.unwrap() {
        TxClaim::Found(row) => assert_eq!(row.state, idem_core::RowState::Done(record)),
        other => panic!("expected the committed row, got {other:?}"),
    }
    assert!(
        elapsed < Duration::from_secs(5),
        "the twin woke on commit, not on a timeout: {elapsed:?}"
    );
}

/// When the first claimer rolls back under several blocked twins, their inserts deadlock (1213); the losers get `StoreErrorKind::Deadlock`, never an unknown error, and exactly one twin holds the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rollback_under_blocked_twins_maps_deadlocks() {
    let store = isolated_store(connect().await).await;
    let before = deadlocks(&store).await;
    let (call, first) = claimed(&store).await;
    let answered = Arc::new(tokio::sync::Barrier::new(4));
    let twins: Vec<_> = (0..4)
        .map(|_| {
            let (store, call, answered) = (store.clone(), call.clone(), answered.clone());
            tokio::spawn(async move {
                let mut tx = store.begin().await.unwrap();
                let out = claim(&store, &mut tx, &call, Duration::from_secs(4)).await;
                // A winner holds its claim until every twin has answered, as
                // a running call would.
                answered.wait().await;
                store.rollback(tx).await.unwrap();
                out
            })
        })
        .collect();
    until_blocked(&store, 4).await;
    store.rollback(first).await.unwrap();
    let mut claimed = 0;
    let mut deadlocked = 0;
    let mut busy = 0;
    for t in twins {
        match t.await.unwrap() {
            Ok(TxClaim::Claimed) => claimed += 1,
            Err(e) if e.store_kind() == Some(StoreErrorKind::Deadlock) => {
                assert!(e.is_retryable());
                deadlocked += 1;
            }
            // A twin that queued behind the winner's insert rather than
            // deadlocking waits for it and is answered busy or with the row.
            Ok(TxClaim::Busy) => busy += 1,
            other => panic!("unexpected claim answer: {other:?}"),
        }
    }
    eprintln!("4 blocked twins after a rollback: {claimed} claimed, {deadlocked} deadlocked, {busy} busy");
    assert_eq!(claimed, 1, "exactly one twin holds the key");
    assert!(
        deadlocked >= 1,
        "the classic InnoDB duplicate-insert deadlock was reproduced"
    );
    assert!(
        deadlocks(&store).await >= before + deadlocked,
        "the server counted the deadlocks"
    );
}

/// Through the engine, a rollback under many waiting twins ends with exactly one execution and every twin answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn engine_retries_deadlocked_twins() {
    let store = isolated_store(connect().await).await;
    let engine = Arc::new(TxEngine::new(store.clone()));
    let call = call_for(&unique_scope("op"), &IdempotencyKey::generate(), "{}", waiting(60_000));
    let first = match engine.begin(&call).await.unwrap() {
        Begin::Claimed(c) => c,
        Begin::Replay(_) => panic!("a fresh key is claimed"),
    };
    let runs = Runs::default();
    let before = deadlocks(&store).await;
    let twins: Vec<_> = (0..6)
        .map(|_| {
            let (engine, call, runs) = (engine.clone(), call.clone(), runs.clone());
            tokio::spawn(async move {
                engine
                    .execute(&call, move |_tx| {
                        let runs = runs.clone();
                        Box::pin(async move {
                            runs.hit();
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            Ok::<_, Error>(Receipt::new(1))
                        })
                    })
                    .await
            })
        })
        .collect();
    until_blocked(&store, 6).await;
    engine.abandon(first).await;
    let mut outcomes = Vec::new();
    for t in twins {
        outcomes.push(t.await.unwrap().expect("every twin gets an outcome"));
    }
    assert_eq!(runs.get(), 1, "the work ran once");
    assert_eq!(outcomes.iter().filter(|o| !o.is_replayed()).count(), 1);
    assert!(outcomes.iter().all(|o| o.value() == outcomes[0].value()));
    eprintln!(
        "6 waiting twins after a rollback: {} deadlocks on the server meanwhile",
        deadlocks(&store).await - before
    );
}

/// A connection killed mid-transaction is reported as `Unavailable`, not as an unknown error.
#[tokio::test]
async fn killed_connection_is_unavailable() {
    let store = shared_store(connect().await).await;
    let call = fresh_call();
    let mut tx = store.begin().await.unwrap();
    let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
        .execute(store.pool())
        .await
        .unwrap();
    let err = claim(&store, &mut tx, &call, Duration::ZERO).await.unwrap_err();
    assert_eq!(err.store_kind(), Some(StoreErrorKind::Unavailable), "{err:?}");
    assert!(err.is_retryable());
    drop(tx);
}

/// A sweep deletes only expired rows, oldest first, at most `limit` at a time.
#[tokio::test]
async fn sweep_is_bounded_and_spares_live_rows() {
    use idem_core::Sweep;
    let store = isolated_store(connect().await).await;
    let scope = unique_scope("op");
    let now = now_ms();
    for (i, expires) in [now - 3, now - 2, now - 1, now, now + 60_000].into_iter().enumerate() {
        let call = call_for(
            &scope,
            &IdempotencyKey::new(format!("k{i}")).unwrap(),
            "{}",
            Policy::default(),
        );
        let req = ClaimRequest {
            expires_at_ms: expires,
            now_ms: now - 10,
            ..request(&call, Some(now + 1))
        };
        let mut tx = store.begin().await.unwrap();
        assert_eq!(
            store.claim(&mut tx, &req, Duration::ZERO).await.unwrap(),
            TxClaim::Claimed
        );
        store.commit(tx).await.unwrap();
    }
    assert_eq!(store.sweep_expired(now, 2).await.unwrap(), 2);
    let left = |k: &str| {
        let store = store.clone();
        let scope = scope.clone();
        let k = k.to_owned();
        async move {
            store
                .get(&scope, &IdempotencyKey::new(k).unwrap())
                .await
                .unwrap()
                .is_some()
        }
    };
    assert!(!left("k0").await && !left("k1").await, "the oldest go first");
    assert!(left("k2").await);
    assert_eq!(
        store.sweep_expired(now, 10).await.unwrap(),
        2,
        "expires_at_ms <= now is expired"
    );
    assert!(left("k4").await, "the live row survives");
    assert_eq!(store.sweep_expired(now, 10).await.unwrap(), 0);
}

/// Work whose own statement is chosen as a real deadlock victim (1213) is rolled back and run again; its effect applies once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn work_deadlock_is_run_again() {
    let pool = connect().await;
    let store = isolated_store(pool.clone()).await;
    let rows = format!("{}{}", common::ISOLATED_PREFIX, uuid::Uuid::new_v4().simple());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE `{rows}` (id INT PRIMARY KEY, n INT NOT NULL) ENGINE=InnoDB;
         INSERT INTO `{rows}` VALUES (1, 0), (2, 0)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let engine = TxEngine::new(store);
    let call = call_for(
        &unique_scope("POST /v1/transfers"),
        &IdempotencyKey::generate(),
        "{}",
        Policy::default(),
    );
    let runs = Runs::default();
    let (locked_tx, locked_rx) = tokio::sync::oneshot::channel::<()>();
    let mut locked_tx = Some(locked_tx);
    let mut locked_rx = Some(locked_rx);
    let other = Arc::new(std::sync::Mutex::new(None));
    let out = engine
        .execute(&call, |tx| {
            let (pool, runs, rows) = (pool.clone(), runs.clone(), rows.clone());
            let first = locked_tx.take().zip(locked_rx.take());
            let other = other.clone();
            Box::pin(async move {
                runs.hit();
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE `{rows}` SET n = n + 1 WHERE id = 1"
                )))
                .execute(&mut **tx)
                .await
                .map_err(idem_mysql::store_error)?;
                if let Some((locked_tx, locked_rx)) = first {
                    // Another transaction, heavier than this one (so InnoDB
                    // picks this one as the victim), holds row 2 and then
                    // waits for row 1.
                    let theirs = rows.clone();
                    let handle = tokio::spawn(async move {
                        let rows = theirs;
                        let mut conn = pool.begin().await.unwrap();
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "INSERT INTO `{rows}` VALUES (10, 0), (11, 0), (12, 0), (13, 0), (14, 0)"
                        )))
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "UPDATE `{rows}` SET n = n + 10 WHERE id = 2"
                        )))
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                        let _ = locked_tx.send(());
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "UPDATE `{rows}` SET n = n + 10 WHERE id = 1"
                        )))
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                        conn.commit().await.unwrap();
                    });
                    *other.lock().unwrap() = Some(handle);
                    locked_rx.await.unwrap();
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE `{rows}` SET n = n + 1 WHERE id = 2"
                )))
                .execute(&mut **tx)
                .await
                .map_err(idem_mysql::store_error)?;
                Ok::<_, Error>(7)
            })
        })
        .await
        .expect("the deadlock is retried");
    let handle = other.lock().unwrap().take().expect("the other transaction ran");
    handle.await.unwrap();
    assert_eq!((out.is_replayed(), *out.value()), (false, 7));
    assert_eq!(runs.get(), 2, "the first run was the deadlock victim and ran again");
    let ns: Vec<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT n FROM `{rows}` WHERE id IN (1, 2) ORDER BY id"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(ns, [11, 11], "the work's increments applied once, beside the other's");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE `{rows}`")))
        .execute(&pool)
        .await
        .unwrap();
}
