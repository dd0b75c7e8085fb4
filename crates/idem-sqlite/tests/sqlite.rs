//! SQLite-specific behaviour beyond the shared suite: registries per file,
//! safety across pools that share no registry, busy and unavailable
//! databases, connection settings and migrations.

mod common;

use common::{TempDb, count_effects, migrated_with, write_effect};

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_core::{
    Call, Error, Fingerprint, IdempotencyKey, InFlight, KeyRegistry, LeaseClaim, LeaseStore, Policy, RowState, Scope,
    StoreErrorKind, Sweep, TableName, Token, TxBackend, TxEngine,
};
use idem_sqlite::{SqliteOptions, SqliteStore, store_error};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

async fn migrated(path: &Path) -> SqliteStore {
    migrated_with(path, SqliteOptions::default()).await
}

/// A pool built by hand, as an application with its own pool would.
async fn separate_pool(path: &Path) -> sqlx::SqlitePool {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5))
        .synchronous(SqliteSynchronous::Full);
    SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("separate pool")
}

fn call(scope: &Scope, key: &IdempotencyKey, policy: Policy) -> Call {
    Call::new(
        scope.clone(),
        key.clone(),
        Fingerprint::of_bytes(scope.operation(), b"body"),
    )
    .with_policy(policy)
}

fn unique_scope() -> Scope {
    Scope::parse(&format!("tenant-{}", uuid::Uuid::new_v4()), "POST /v1/transfers").expect("scope")
}

fn assert_kind(result: Result<impl std::fmt::Debug, Error>, kind: StoreErrorKind) {
    match result {
        Err(e) => assert_eq!(e.store_kind(), Some(kind), "unexpected error {e:?}"),
        Ok(v) => panic!("expected a {kind:?} error, got {v:?}"),
    }
}

/// Two stores on one file that share no key registry (the second on a separately built pool, as a second process would be, its tasks not even sharing a registry among themselves) still run the effect exactly once under 64 concurrent tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn separate_registries_64_tasks_one_effect() {
    let db = TempDb::new("test");
    let a = migrated(&db.path).await;
    let b = SqliteStore::new(separate_pool(&db.path).await).with_registry(KeyRegistry::new());

    // The registries really are separate: a key held in one is not held in the other.
    let scope = unique_scope();
    let key = IdempotencyKey::generate();
    let held = a
        .registry()
        .acquire(&scope, &key, tokio::time::Instant::now())
        .await
        .expect("the key lock works")
        .expect("free key");
    assert_eq!(a.registry().held(), 1);
    assert_eq!(
        b.registry().held(),
        0,
        "the second store does not see the first store's registry"
    );
    drop(held);

    // Even tasks share the first store's registry; odd tasks each get a
    // private registry on the second pool, so nothing but the database
    // stands between them.
    let engines: Vec<_> = (0..64)
        .map(|i| {
            let store = if i % 2 == 0 {
                a.clone()
            } else {
                b.clone().with_registry(KeyRegistry::new())
            };
            Arc::new(TxEngine::new(store))
        })
        .collect();
    let policy = Policy::default().with_in_flight(InFlight::Wait { max_ms: 120_000 });
    let call = call(&scope, &key, policy);
    let effect_id = format!("effect-{}", uuid::Uuid::new_v4());
    let runs = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let (engine, call, effect_id, runs, barrier) = (
                engines[i].clone(),
                call.clone(),
                effect_id.clone(),
                runs.clone(),
                barrier.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                engine
                    .execute(&call, move |tx| {
                        let (runs, effect_id) = (runs.clone(), effect_id.clone());
                        Box::pin(async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            write_effect(tx, &effect_id).await?;
                            // Hold the claim so twins of the other store meet it uncommitted.
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            Ok::<_, Error>(uuid::Uuid::new_v4().to_string())
                        })
                    })
                    .await
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.expect("task").expect("every task gets an outcome"));
    }
    assert_eq!(
        outcomes.iter().filter(|o| !o.is_replayed()).count(),
        1,
        "exactly one task executed"
    );
    assert!(
        outcomes.iter().all(|o| o.value() == outcomes[0].value()),
        "all 64 saw the same outcome"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran once");
    assert_eq!(count_effects(&a, &effect_id).await, 1, "the effect exists exactly once");
}

/// Every store on one file in a process shares one key registry, however the file is named or the pool built; another file has its own.
#[tokio::test]
async fn stores_on_one_file_share_a_registry() {
    let db = TempDb::new("test");
    let first = migrated(&db.path).await;
    let dir = db.path.parent().expect("temp dir");
    let detour = dir.join(".").join(db.path.file_name().expect("file name"));
    let second = SqliteStore::open(&detour).await.expect("open by another name");
    let third = SqliteStore::new(separate_pool(&db.path).await);
    let other_db = TempDb::new("test");
    let elsewhere = SqliteStore::open(&other_db.path).await.expect("open another file");

    let guard = first
        .registry()
        .acquire(
            &unique_scope(),
            &IdempotencyKey::generate(),
            tokio::time::Instant::now(),
        )
        .await
        .expect("the key lock works")
        .expect("free key");
    assert_eq!(
        second.registry().held(),
        1,
        "a second open of the file shares the registry"
    );
    assert_eq!(
        third.registry().held(),
        1,
        "a store on a caller-built pool shares the registry"
    );
    assert_eq!(elsewhere.registry().held(), 0, "another file has its own registry");
    drop(guard);
    assert_eq!(second.registry().held(), 0);
}

/// A twin in another store on the same file is serialised by the shared registry: it is rejected at once rather than waiting on the write lock.
#[tokio::test]
async fn shared_registry_rejects_twin_of_another_pool() {
    let db = TempDb::new("test");
    let a = migrated(&db.path).await;
    let b = SqliteStore::open(&db.path).await.expect("second pool");
    let (ea, eb) = (TxEngine::new(a), TxEngine::new(b));
    let (scope, key) = (unique_scope(), IdempotencyKey::generate());
    let first = match ea.begin(&call(&scope, &key, Policy::default())).await.expect("claim") {
        idem_core::Begin::Claimed(c) => c,
        idem_core::Begin::Replay(r) => panic!("unexpected replay {r:?}"),
    };
    let started = Instant::now();
    let twin = eb
        .begin(&call(&scope, &key, Policy::default().with_in_flight(InFlight::Reject)))
        .await;
    assert!(matches!(twin, Err(Error::InFlight { .. })), "got {twin:?}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "rejected without waiting on the write lock"
    );
    ea.abandon(first).await;
}

/// A database held busy by another writer fails with LockTimeout after the busy timeout, on every path, and works again once released.
#[tokio::test]
async fn busy_database_is_lock_timeout() {
    let db = TempDb::new("test");
    let holder = migrated(&db.path).await;
    let busy = SqliteStore::open_with(&db.path, SqliteOptions::new().busy_timeout_ms(100))
        .await
        .expect("open");
    let write_lock = TxBackend::begin(&holder).await.expect("hold the write lock");

    let started = Instant::now();
    assert_kind(TxBackend::begin(&busy).await, StoreErrorKind::LockTimeout);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(90),
        "waited the busy timeout first: {waited:?}"
    );

    let scope = unique_scope();
    let key = IdempotencyKey::generate();
    let fingerprint = Fingerprint::of_bytes(scope.operation(), b"body");
    let req = idem_core::ClaimRequest {
        scope: &scope,
        key: &key,
        fingerprint: &fingerprint,
        now_ms: 1_000,
        expires_at_ms: 100_000,
        fresh_token: Token(7),
        lease_expires_at_ms: Some(2_000),
    };
    assert_kind(busy.try_claim(&req).await, StoreErrorKind::LockTimeout);
    assert_kind(busy.sweep_expired(i64::MAX, 10).await, StoreErrorKind::LockTimeout);

    // Through the engine, contention is retried a bounded number of times,
    // then reported as a retryable error that consumed nothing.
    let err = TxEngine::new(busy.clone())
        .execute(&call(&scope, &key, Policy::default()), |_tx| {
            Box::pin(async { Ok::<_, Error>(1) })
        })
        .await
        .unwrap_err();
    assert_eq!(err.store_kind(), Some(StoreErrorKind::LockTimeout), "got {err:?}");
    assert!(err.is_retryable());

    TxBackend::rollback(&holder, write_lock)
        .await
        .expect("release the write lock");
    assert_eq!(
        busy.try_claim(&req).await.expect("claim"),
        LeaseClaim::Acquired(Token(7))
    );
    let row = busy.get(&scope, &key).await.expect("get").expect("row");
    assert_eq!(
        row.state,
        RowState::InProgress {
            token: Token(7),
            lease_expires_at_ms: 2_000
        }
    );
}

/// A file that cannot be opened is reported as unavailable storage.
#[tokio::test]
async fn unopenable_file_is_unavailable() {
    let path = std::env::temp_dir()
        .join(format!("idem-missing-dir-{}", uuid::Uuid::new_v4()))
        .join("keys.db");
    assert_kind(SqliteStore::open(&path).await, StoreErrorKind::Unavailable);
}

/// The value of the pragma `name` on a connection of `pool`.
async fn pragma<T>(pool: &sqlx::SqlitePool, name: &str) -> T
where
    T: for<'r> sqlx::Decode<'r, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite> + Send + Unpin,
{
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("PRAGMA {name}")))
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("PRAGMA {name}: {e}"))
}

/// `open` configures WAL, `synchronous = FULL`, a 5 s busy timeout and foreign keys, and the busy timeout is configurable.
#[tokio::test]
async fn open_configures_the_connections() {
    let db = TempDb::new("test");
    let store = SqliteStore::open(&db.path).await.expect("open");
    let pool = store.pool();
    let journal: String = pragma(pool, "journal_mode").await;
    let synchronous: i64 = pragma(pool, "synchronous").await;
    let busy: i64 = pragma(pool, "busy_timeout").await;
    let fks: i64 = pragma(pool, "foreign_keys").await;
    assert_eq!(journal, "wal");
    assert_eq!(synchronous, 2, "synchronous = FULL");
    assert_eq!(busy, 5_000);
    assert_eq!(fks, 1);

    let tuned = SqliteStore::open_with(
        &db.path,
        SqliteOptions::new()
            .busy_timeout_ms(250)
            .synchronous(SqliteSynchronous::Normal),
    )
    .await
    .expect("open with options");
    let busy: i64 = pragma(tuned.pool(), "busy_timeout").await;
    let synchronous: i64 = pragma(tuned.pool(), "synchronous").await;
    assert_eq!((busy, synchronous), (250, 1));
}

/// Concurrent `migrate` calls from two pools apply each schema version once, a repeat is a no-op, and a newer schema is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrate_is_versioned_and_safe_concurrently() {
    let db = TempDb::new("test");
    let table = TableName::new("payments_keys").expect("table");
    let a = SqliteStore::open(&db.path)
        .await
        .expect("open")
        .with_table(table.clone());
    let b = SqliteStore::new(separate_pool(&db.path).await).with_table(table);
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for task in tasks {
        task.await.expect("task").expect("migrate");
    }
    a.migrate().await.expect("a repeat is a no-op");
    let versions: Vec<i64> = sqlx::query_scalar("SELECT version FROM payments_keys_schema ORDER BY version")
        .fetch_all(a.pool())
        .await
        .expect("versions");
    assert_eq!(versions, vec![1, 2, 3], "each version applied exactly once");
    let index: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM sqlite_schema WHERE type = 'index' AND tbl_name = 'payments_keys' AND sql LIKE '%expires_at_ms%'",
    )
    .fetch_one(a.pool())
    .await
    .expect("index");
    assert_eq!(index, 1, "the expiry index exists");

    sqlx::query("INSERT INTO payments_keys_schema (version, description, applied_at_ms) VALUES (99, 'future', 0)")
        .execute(a.pool())
        .await
        .expect("fake a newer schema");
    assert!(
        matches!(a.migrate().await, Err(Error::Config(_))),
        "a newer schema is refused"
    );
}

/// The keys table refuses malformed rows: a fingerprint must be 32 bytes and the status a known code (0 to 4).
#[tokio::test]
async fn schema_refuses_malformed_rows() {
    let db = TempDb::new("test");
    let store = migrated(&db.path).await;
    // A row with a fingerprint of `fingerprint_len` bytes and `status`.
    let insert = |fingerprint_len: usize, status: i64| {
        sqlx::query(
            "INSERT INTO idem_keys (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms)
            VALUES ('t', 'o', 'k', ?1, ?2, 1, 0, 10)",
        )
        .bind(vec![0u8; fingerprint_len])
        .bind(status)
        .execute(store.pool())
    };
    let short = insert(31, 1).await;
    assert!(short.is_err(), "a 31-byte fingerprint is refused");
    let unknown = insert(32, 5).await;
    assert!(unknown.is_err(), "status 5 is refused");
    let mapped = store_error(unknown.unwrap_err());
    assert_eq!(mapped.store_kind(), Some(StoreErrorKind::Other));
}

/// Many stores opening a brand-new file at once all succeed, although switching a new database to WAL needs an exclusive lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_opens_succeed() {
    for _ in 0..20 {
        let db = TempDb::new("test");
        let path = Arc::new(db.path.clone());
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let path = path.clone();
                tokio::spawn(async move {
                    let store = SqliteStore::open(&*path).await.map_err(|e| format!("open: {e}"))?;
                    store.migrate().await.map_err(|e| format!("migrate: {e}"))?;
                    Ok::<_, String>(store)
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("task").expect("open and migrate");
        }
    }
}

/// A store on `db` opened without migrating, after running `statements`
/// (an older version's tables and rows).
async fn seeded(db: &TempDb, statements: &[&'static str]) -> SqliteStore {
    let store = SqliteStore::open(&db.path).await.expect("open");
    for &statement in statements {
        sqlx::query(statement).execute(store.pool()).await.expect(statement);
    }
    store
}

/// The versions `migrate` would apply.
async fn pending_versions(store: &SqliteStore) -> Vec<i64> {
    idem_conformance::versions(&store.pending_migrations().await.unwrap())
}

/// How many indexes of the keys table are on `expires_at_ms`.
async fn expiry_indexes(store: &SqliteStore) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM sqlite_schema WHERE type = 'index' AND tbl_name = 'idem_keys' AND sql LIKE '%expires_at_ms%'",
    )
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// A version-1 keys table (status 0 to 2 only) is upgraded to the newest
/// version in place: its rows and expiry index are kept, and status 3 (an
/// unknown outcome) is then accepted.
#[tokio::test]
async fn version_1_table_is_upgraded_keeping_its_rows() {
    let db = TempDb::new("test");
    let store = seeded(&db, &[
        "CREATE TABLE idem_keys_schema (version INTEGER PRIMARY KEY NOT NULL, description TEXT NOT NULL, applied_at_ms INTEGER NOT NULL) STRICT",
        "INSERT INTO idem_keys_schema VALUES (1, 'keys table and expiry index', 0)",
        "CREATE TABLE idem_keys (tenant TEXT NOT NULL, operation TEXT NOT NULL, idem_key TEXT NOT NULL,
            fingerprint BLOB NOT NULL CHECK (length(fingerprint) = 32),
            status INTEGER NOT NULL CHECK (status IN (0, 1, 2)), token INTEGER NOT NULL, payload BLOB,
            created_at_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, lease_expires_at_ms INTEGER,
            PRIMARY KEY (tenant, operation, idem_key)) STRICT",
        "CREATE INDEX idem_keys_expires_at_ms_idx ON idem_keys (expires_at_ms)",
        "INSERT INTO idem_keys VALUES ('t', 'o', 'k', zeroblob(32), 1, 7, x'6f6b', 1, 99, NULL)",
    ])
    .await;
    let pending = pending_versions(&store).await;
    assert_eq!(pending, vec![2, 3]);
    store.migrate().await.expect("upgrade");
    let row: (i64, i64, Vec<u8>, i64) =
        sqlx::query_as("SELECT status, token, payload, expires_at_ms FROM idem_keys WHERE idem_key = 'k'")
            .fetch_one(store.pool())
            .await
            .expect("the row is kept");
    assert_eq!(row, (1, 7, b"ok".to_vec(), 99));
    assert_eq!(expiry_indexes(&store).await, 1, "the expiry index exists");
    sqlx::query(
        "INSERT INTO idem_keys (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms)
        VALUES ('t', 'o', 'k2', zeroblob(32), 3, 8, 1, 99)",
    )
    .execute(store.pool())
    .await
    .expect("status 3 is accepted after the upgrade");
    assert!(store.pending_migrations().await.unwrap().is_empty());
}

/// A version-2 keys table (status 0 to 3, no `sent_at_ms`) is upgraded to version 3 in place by `migrate`: its rows and expiry index are kept, and a lease claim taken over on it is then marked sent, never taken over once its lease runs out, and completed keeping the mark's time.
#[tokio::test]
async fn version_2_table_is_upgraded_and_takes_sent_claims() {
    let db = TempDb::new("test");
    let store = seeded(&db, &[
        "CREATE TABLE idem_keys_schema (version INTEGER PRIMARY KEY NOT NULL, description TEXT NOT NULL, applied_at_ms INTEGER NOT NULL) STRICT",
        "INSERT INTO idem_keys_schema VALUES (1, 'keys table and expiry index', 0)",
        "INSERT INTO idem_keys_schema VALUES (2, 'status 3: unknown outcomes', 0)",
        "CREATE TABLE idem_keys (tenant TEXT NOT NULL, operation TEXT NOT NULL, idem_key TEXT NOT NULL,
            fingerprint BLOB NOT NULL CHECK (length(fingerprint) = 32),
            status INTEGER NOT NULL CHECK (status IN (0, 1, 2, 3)), token INTEGER NOT NULL, payload BLOB,
            created_at_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, lease_expires_at_ms INTEGER,
            PRIMARY KEY (tenant, operation, idem_key)) STRICT",
        "CREATE INDEX idem_keys_expires_at_ms_idx ON idem_keys (expires_at_ms)",
        // A lease that ran out at 500, and an unknown outcome.
        "INSERT INTO idem_keys VALUES ('t', 'POST /pay', 'k', zeroblob(32), 0, 7, NULL, 1, 100000, 500)",
        "INSERT INTO idem_keys VALUES ('t', 'POST /pay', 'u', zeroblob(32), 3, 3, x'3f', 1, 100000, NULL)",
    ])
    .await;
    let pending = pending_versions(&store).await;
    assert_eq!(pending, vec![3]);
    store.migrate().await.expect("upgrade");
    assert!(store.pending_migrations().await.unwrap().is_empty());
    // Key, status, token, lease expiry, sent mark.
    type Upgraded = (String, i64, i64, Option<i64>, Option<i64>);
    let rows: Vec<Upgraded> = sqlx::query_as(
        "SELECT idem_key, status, token, lease_expires_at_ms, sent_at_ms FROM idem_keys ORDER BY idem_key",
    )
    .fetch_all(store.pool())
    .await
    .expect("the rows are kept");
    assert_eq!(
        rows,
        vec![("k".into(), 0, 7, Some(500), None), ("u".into(), 3, 3, None, None)]
    );
    assert_eq!(expiry_indexes(&store).await, 1, "the expiry index exists");

    let scope = Scope::parse("t", "POST /pay").expect("scope");
    let key = IdempotencyKey::new("k").expect("key");
    let fingerprint = Fingerprint::of_bytes(scope.operation(), b"body");
    let request = |now_ms: i64| idem_core::ClaimRequest {
        scope: &scope,
        key: &key,
        fingerprint: &fingerprint,
        now_ms,
        expires_at_ms: 100_000,
        fresh_token: Token(1),
        lease_expires_at_ms: Some(now_ms + 1_000),
    };
    assert_eq!(
        store.try_claim(&request(1_000)).await.expect("take over"),
        LeaseClaim::Acquired(Token(8)),
        "the upgraded row's lease ran out: it is taken over"
    );
    let lease = idem_core::Lease {
        scope: scope.clone(),
        key: key.clone(),
        token: Token(8),
        lease_expires_at_ms: 2_000,
    };
    store.mark_sent(&lease, 1_100).await.expect("mark sent");
    store.mark_sent(&lease, 1_200).await.expect("mark again");
    let row = store.lookup(&scope, &key).await.expect("lookup").expect("row");
    assert_eq!(
        row.state,
        RowState::Sent {
            token: Token(8),
            lease_expires_at_ms: 2_000
        }
    );
    assert_eq!(row.sent_at_ms, Some(1_100), "the earliest mark is kept");
    match store.try_claim(&request(3_000)).await.expect("claim") {
        LeaseClaim::Found(found) => assert!(found.is_unknown_at(3_000), "{found:?}"),
        other => panic!("a sent claim whose lease ran out is never taken over: {other:?}"),
    }
    store
        .complete(&lease, &idem_core::Record::completed(b"ok".to_vec()))
        .await
        .expect("the holder completes");
    let row = store.lookup(&scope, &key).await.expect("lookup").expect("row");
    assert!(matches!(row.state, RowState::Done(_)), "{row:?}");
    assert_eq!(row.sent_at_ms, Some(1_100), "completing keeps the mark's time");
}

/// A busy timeout longer than SQLite takes is refused with a clear error
/// before any file is created; the longest it takes opens.
#[tokio::test]
async fn busy_timeout_beyond_sqlites_limit_is_refused() {
    for ms in [u64::MAX, idem_sqlite::MAX_BUSY_TIMEOUT_MS + 1] {
        let db = TempDb::new("test");
        let err = SqliteStore::open_with(&db.path, SqliteOptions::new().busy_timeout_ms(ms))
            .await
            .expect_err("a busy timeout beyond SQLite's limit");
        assert!(
            matches!(&err, idem_core::Error::Config(m) if m.contains("busy timeout")),
            "{ms} ms: {err}"
        );
        assert!(!db.path.exists(), "{ms} ms: nothing is created");
    }
    let db = TempDb::new("test");
    let store = SqliteStore::open_with(
        &db.path,
        SqliteOptions::new().busy_timeout_ms(idem_sqlite::MAX_BUSY_TIMEOUT_MS),
    )
    .await
    .expect("the longest busy timeout SQLite takes");
    let busy: i64 = pragma(store.pool(), "busy_timeout").await;
    assert_eq!(busy, i64::from(i32::MAX));
}
