//! PostgreSQL-specific behaviour of the store that the portable conformance suite cannot see:
//! where a twin waits, that `lock_timeout` bounds the wait and is restored, HOT updates,
//! concurrent migrations, `SKIP LOCKED` sweeping and the error mapping.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Isolation, STRATEGIES, database_url, isolated_table, open_pool, open_pool_at, show_lock_timeout};
use idem_core::{
    ClaimRequest, Error, Fingerprint, IdempotencyKey, Lease, LeaseClaim, LeaseStore, Record, RowState, Scope,
    StoreErrorKind, Sweep, Token, TxBackend, TxClaim,
};
use idem_postgres::{ClaimStrategy, ExpiryIndex, PgStore, store_error};
use sqlx::{AssertSqlSafe, Row};

/// One key with its scope and fingerprint.
struct Key {
    scope: Scope,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
}

impl Key {
    fn new() -> Self {
        let scope = Scope::parse(&format!("tenant-{}", uuid::Uuid::new_v4()), "POST /v1/store-tests").unwrap();
        let fingerprint = Fingerprint::of_bytes(scope.operation(), b"request");
        Self {
            scope,
            key: IdempotencyKey::generate(),
            fingerprint,
        }
    }

    /// A transactional claim at `now_ms` that expires 60 s later.
    fn at(&self, now_ms: i64) -> ClaimRequest<'_> {
        ClaimRequest {
            scope: &self.scope,
            key: &self.key,
            fingerprint: &self.fingerprint,
            now_ms,
            expires_at_ms: now_ms + 60_000,
            fresh_token: Token::fresh(now_ms),
            lease_expires_at_ms: None,
        }
    }
}

/// A store on a fresh, migrated keys table.
async fn store(strategy: ClaimStrategy) -> PgStore {
    let pool = open_pool(&database_url()).await;
    let table = isolated_table(&pool).await;
    let store = PgStore::new(pool).with_table(table).with_claim_strategy(strategy);
    store.migrate().await.expect("migrate");
    store
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// A transaction opened with `begin` in which `claim` claimed `req`'s key,
/// waiting up to `wait`.
async fn begun_and_claimed(store: &PgStore, req: &ClaimRequest<'_>, wait: Duration) -> idem_postgres::PgTx {
    let mut tx = store.begin().await.unwrap();
    assert_eq!(store.claim(&mut tx, req, wait).await.unwrap(), TxClaim::Claimed);
    tx
}

/// Claims `key` in a new transaction and commits a completed record under it.
async fn commit_record(store: &PgStore, req: &ClaimRequest<'_>) {
    let mut tx = begun_and_claimed(store, req, Duration::ZERO).await;
    store
        .record(&mut tx, req, &Record::completed(b"done".to_vec()))
        .await
        .unwrap();
    store.commit(tx).await.unwrap();
}

/// Where and how long a twin waits while the first claim's transaction is open.
async fn twin_wait_is_bounded(strategy: ClaimStrategy, expected_wait_event: &str) {
    let store = store(strategy).await;
    let key = std::sync::Arc::new(Key::new());
    let now = now_ms();
    let first = begun_and_claimed(&store, &key.at(now), Duration::ZERO).await;

    let mut twin = store.begin().await.unwrap();
    let pid: i32 = sqlx::query("SELECT pg_backend_pid()")
        .fetch_one(&mut *twin)
        .await
        .unwrap()
        .get(0);
    let started = Instant::now();
    let waiting = {
        let (store, key) = (store.clone(), key.clone());
        tokio::spawn(async move {
            let answer = store.claim(&mut twin, &key.at(now), Duration::from_millis(800)).await;
            (answer, started.elapsed())
        })
    };
    // The twin's backend is seen blocked on the lock the strategy is meant to use.
    let mut seen = None;
    while !waiting.is_finished() {
        let row = sqlx::query("SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_one(store.pool())
            .await
            .unwrap();
        let (kind, event): (Option<String>, Option<String>) = (row.get(0), row.get(1));
        if kind.as_deref() == Some("Lock") {
            seen = event;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        seen.as_deref(),
        Some(expected_wait_event),
        "the twin blocks inside its claim statement"
    );
    let (answer, elapsed) = waiting.await.unwrap();
    assert_eq!(
        answer.unwrap(),
        TxClaim::Busy,
        "an undecided twin is busy when its wait runs out"
    );
    assert!(
        elapsed >= Duration::from_millis(750),
        "lock_timeout bounds the wait at 800 ms, not less: {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_secs(5),
        "lock_timeout bounds the wait at 800 ms: {elapsed:?}"
    );

    // A zero wait is still bounded (at 1 ms), never unbounded.
    let mut impatient = store.begin().await.unwrap();
    let started = Instant::now();
    assert_eq!(
        store.claim(&mut impatient, &key.at(now), Duration::ZERO).await.unwrap(),
        TxClaim::Busy
    );
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "a zero wait answers at once: {:?}",
        started.elapsed()
    );
    store.rollback(impatient).await.unwrap();
    store.rollback(first).await.unwrap();
}

idem_conformance::cases!(twin_wait_is_bounded, 2 => {
    /// A twin under the insert-on-conflict strategy waits on the first claimer's transaction id, and only up to its wait.
    twin_waits_on_the_row_for_at_most_its_wait(ClaimStrategy::InsertOnConflict, "transactionid");
    /// A twin under the advisory strategy waits on the key's advisory lock, and only up to its wait.
    twin_waits_on_the_advisory_lock_for_at_most_its_wait(ClaimStrategy::AdvisoryLock, "advisory");
    /// A twin under the one-write strategy waits on the key's advisory lock, and only up to its wait.
    one_write_twin_waits_on_the_advisory_lock_for_at_most_its_wait(ClaimStrategy::OneWrite, "advisory");
});

/// After a claim, the caller's own `lock_timeout` is back in force for the rest of its transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_restores_the_callers_lock_timeout() {
    for strategy in STRATEGIES {
        let store = store(strategy).await;
        let key = Key::new();
        let req = key.at(now_ms());
        let mut tx = store.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = '7s'")
            .execute(&mut *tx)
            .await
            .unwrap();
        assert_eq!(
            store.claim(&mut tx, &req, Duration::from_millis(300)).await.unwrap(),
            TxClaim::Claimed
        );
        assert_eq!(show_lock_timeout(&mut *tx).await, "7s", "restored after a claim");
        store
            .record(&mut tx, &req, &Record::completed(b"{}".to_vec()))
            .await
            .unwrap();
        store.commit(tx).await.unwrap();

        let mut tx = store.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = '7s'")
            .execute(&mut *tx)
            .await
            .unwrap();
        assert!(matches!(
            store.claim(&mut tx, &req, Duration::from_millis(300)).await.unwrap(),
            TxClaim::Found(_)
        ));
        assert_eq!(
            show_lock_timeout(&mut *tx).await,
            "7s",
            "restored after finding a committed key"
        );
        store.rollback(tx).await.unwrap();
    }
}

/// The rows written to the keys table so far in the current transaction.
async fn rows_written_in(tx: &mut idem_postgres::PgTx, table: &str) -> i64 {
    sqlx::query(
        "SELECT pg_stat_get_xact_tuples_inserted($1::text::regclass) \
              + pg_stat_get_xact_tuples_updated($1::text::regclass) \
              + pg_stat_get_xact_tuples_deleted($1::text::regclass)",
    )
    .bind(table)
    .fetch_one(&mut **tx)
    .await
    .unwrap()
    .get(0)
}

/// Under the one-write strategy a fresh call writes nothing when it claims and one row when it commits:
/// the completed row is the first and only tuple of a new table (an insert and an update would leave it
/// second); the insert-on-conflict strategy writes its placeholder at the claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_write_claim_writes_nothing_and_the_record_one_row() {
    for (strategy, written_at_claim, tuple) in [
        (ClaimStrategy::OneWrite, 0, "(0,1)"),
        (ClaimStrategy::InsertOnConflict, 1, "(0,2)"),
    ] {
        let store = store(strategy).await;
        let table = store.table().as_str().to_owned();
        let key = Key::new();
        let req = key.at(now_ms());
        let (mut tx, answer) = store.begin_claim(&req, Duration::ZERO).await.unwrap();
        assert_eq!(answer, TxClaim::Claimed);
        assert_eq!(
            rows_written_in(&mut tx, &table).await,
            written_at_claim,
            "rows written by the claim under {strategy:?}"
        );
        store
            .record_commit(tx, &req, &Record::completed(b"done".to_vec()))
            .await
            .unwrap();
        let tuple_of = || async {
            let row = sqlx::query(AssertSqlSafe(format!(
                "SELECT ctid::text, xmax::text, status, payload FROM {table} WHERE idem_key = $1"
            )))
            .bind(key.key.as_str())
            .fetch_one(store.pool())
            .await
            .unwrap();
            let parts: (String, String, i16, Vec<u8>) = (row.get(0), row.get(1), row.get(2), row.get(3));
            parts
        };
        let (ctid, xmax, status, payload) = tuple_of().await;
        assert_eq!(
            (status, payload),
            (1, b"done".to_vec()),
            "the completed row under {strategy:?}"
        );
        assert_eq!(ctid, tuple, "the completed row's tuple under {strategy:?}");
        // A replay finds it and neither writes nor locks it.
        let (tx, answer) = store.begin_claim(&req, Duration::ZERO).await.unwrap();
        assert!(matches!(answer, TxClaim::Found(_)), "{answer:?}");
        store.rollback(tx).await.unwrap();
        assert_eq!(
            tuple_of().await.0,
            ctid,
            "a replay leaves the row as it was under {strategy:?}"
        );
        assert_eq!(tuple_of().await.1, xmax, "a replay locks nothing under {strategy:?}");
    }
}

/// A one-write claim holds no row, so a lease-mode claim of the same key (which takes no advisory lock)
/// may commit meanwhile; the record then meets that row, fails as contention with nothing committed,
/// and the call run again finds the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_write_record_that_meets_a_lease_row_is_contention() {
    let store = store(ClaimStrategy::OneWrite).await;
    let key = Key::new();
    let now = now_ms();
    let req = key.at(now);
    let (tx, answer) = store.begin_claim(&req, Duration::ZERO).await.unwrap();
    assert_eq!(answer, TxClaim::Claimed);
    let lease = ClaimRequest {
        lease_expires_at_ms: Some(now + 30_000),
        ..key.at(now)
    };
    assert!(matches!(
        store.try_claim(&lease).await.unwrap(),
        LeaseClaim::Acquired(_)
    ));
    let err = store
        .record_commit(tx, &req, &Record::completed(b"done".to_vec()))
        .await
        .unwrap_err();
    assert!(
        err.is_contention(),
        "a record that meets a committed row is contention: {err:?}"
    );
    let row = store.get(&key.scope, &key.key).await.unwrap().expect("the lease row");
    assert!(
        matches!(row.state, RowState::InProgress { .. }),
        "the lease's row is untouched: {row:?}"
    );
    let (tx, again) = store.begin_claim(&req, Duration::ZERO).await.unwrap();
    assert!(
        matches!(again, TxClaim::Found(_)),
        "the call run again finds the lease: {again:?}"
    );
    store.rollback(tx).await.unwrap();
}

/// A one-write claim holds nothing but its advisory lock: when the holder's session dies (its backend
/// killed), the server releases the lock and the waiting twin claims the key, which is then recorded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_write_twin_claims_when_the_holders_backend_is_killed() {
    let store = store(ClaimStrategy::OneWrite).await;
    let key = Arc::new(Key::new());
    let now = now_ms();
    let (mut first, answer) = store.begin_claim(&key.at(now), Duration::ZERO).await.unwrap();
    assert_eq!(answer, TxClaim::Claimed);
    let pid: i32 = sqlx::query("SELECT pg_backend_pid()")
        .fetch_one(&mut *first)
        .await
        .unwrap()
        .get(0);
    let twin = {
        let (store, key) = (store.clone(), key.clone());
        tokio::spawn(async move {
            let req = key.at(now);
            let (tx, answer) = store.begin_claim(&req, Duration::from_secs(20)).await.unwrap();
            assert_eq!(answer, TxClaim::Claimed, "the twin claims once the holder is gone");
            store
                .record_commit(tx, &req, &Record::completed(b"twin".to_vec()))
                .await
                .unwrap();
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!twin.is_finished(), "the twin waits on the holder's lock");
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(killed);
    tokio::time::timeout(Duration::from_secs(20), twin)
        .await
        .expect("the twin is released")
        .unwrap();
    let row = store.get(&key.scope, &key.key).await.unwrap().expect("the twin's row");
    assert!(
        matches!(&row.state, RowState::Done(record) if record.payload == b"twin"),
        "{row:?}"
    );
    drop(first);
}

/// A record on a one-write transaction that claimed another key, or none, fails and commits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_write_record_without_a_claim_commits_nothing() {
    let store = store(ClaimStrategy::OneWrite).await;
    let (claimed, other) = (Key::new(), Key::new());
    let now = now_ms();
    let (tx, answer) = store.begin_claim(&claimed.at(now), Duration::ZERO).await.unwrap();
    assert_eq!(answer, TxClaim::Claimed);
    let err = store
        .record_commit(tx, &other.at(now), &Record::completed(b"x".to_vec()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    let tx = store.begin().await.unwrap();
    let err = store
        .record_commit(tx, &other.at(now), &Record::completed(b"x".to_vec()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    for key in [&claimed, &other] {
        assert!(store.get(&key.scope, &key.key).await.unwrap().is_none());
    }
}

/// The expiry indexes of `store`'s table, by the end of their names and their access methods.
async fn expiry_indexes(store: &PgStore) -> Vec<(&'static str, String)> {
    sqlx::query(
        "SELECT c.relname::text, am.amname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         JOIN pg_am am ON am.oid = c.relam WHERE i.indrelid = to_regclass($1) AND NOT i.indisprimary \
         ORDER BY 1",
    )
    .bind(store.table().as_str())
    .fetch_all(store.pool())
    .await
    .unwrap()
    .iter()
    .map(|row| {
        let name: String = row.get(0);
        let end = ["_expires_at_ms_idx", "_expires_at_ms_brin"]
            .into_iter()
            .find(|end| name.ends_with(end))
            .unwrap_or("another index");
        (end, row.get(1))
    })
    .collect()
}

/// `migrate` gives the table the store's expiry index, switching it when the choice changes, and the
/// sweep finds expired rows through each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_applies_the_chosen_expiry_index() {
    let store = store(ClaimStrategy::OneWrite).await;
    let btree = vec![("_expires_at_ms_idx", "btree")];
    let brin = vec![("_expires_at_ms_brin", "brin")];
    let found = expiry_indexes(&store).await;
    assert_eq!(found, vec![("_expires_at_ms_idx", "btree".to_owned())]);
    for (index, expected) in [
        (ExpiryIndex::Brin, brin.clone()),
        (ExpiryIndex::None, vec![]),
        (ExpiryIndex::BTree, btree.clone()),
        (ExpiryIndex::Brin, brin.clone()),
    ] {
        let store = store.clone().with_expiry_index(index);
        store.migrate().await.unwrap();
        store.migrate().await.expect("migrating again changes nothing");
        let found = expiry_indexes(&store).await;
        let found: Vec<(&str, &str)> = found.iter().map(|(end, am)| (*end, am.as_str())).collect();
        assert_eq!(found, expected, "{index:?}");
        let key = Key::new();
        let now = now_ms();
        commit_record(&store, &key.at(now - 120_000)).await;
        assert_eq!(store.sweep_expired(now, 100).await.unwrap(), 1, "swept under {index:?}");
    }
}

/// Recording an outcome updates only unindexed columns, so PostgreSQL makes it a heap-only (HOT) update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_is_a_heap_only_update() {
    let store = store(ClaimStrategy::InsertOnConflict).await;
    let key = Key::new();
    let req = key.at(now_ms());
    let mut tx = begun_and_claimed(&store, &req, Duration::ZERO).await;
    store
        .record(&mut tx, &req, &Record::completed(vec![7; 512]))
        .await
        .unwrap();
    let row = sqlx::query(
        "SELECT pg_stat_get_xact_tuples_updated($1::text::regclass), \
                pg_stat_get_xact_tuples_hot_updated($1::text::regclass)",
    )
    .bind(store.table().as_str())
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let (updated, hot): (i64, i64) = (row.get(0), row.get(1));
    assert_eq!((updated, hot), (1, 1), "the record is one update, and it is heap-only");
    store.commit(tx).await.unwrap();
}

/// Many processes may migrate the same table at once, at any default isolation level: all succeed and the version is recorded once.
async fn concurrent_migrations_at(isolation: Isolation) {
    let pool = open_pool_at(&database_url(), isolation).await;
    let table = isolated_table(&pool).await;
    let store = PgStore::new(pool).with_table(table.clone());
    let runs: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for run in runs {
        run.await
            .unwrap()
            .unwrap_or_else(|e| panic!("every concurrent migration succeeds at {isolation:?}: {e}"));
    }
    store.migrate().await.expect("migrating a current schema is a no-op");
    let versions: Vec<i32> = sqlx::query(AssertSqlSafe(format!(
        "SELECT version FROM {table}_schema ORDER BY version"
    )))
    .fetch_all(store.pool())
    .await
    .unwrap()
    .iter()
    .map(|row| row.get(0))
    .collect();
    assert_eq!(
        versions,
        vec![1, 2, 3],
        "each version is applied and recorded exactly once"
    );
}

idem_conformance::cases!(concurrent_migrations_at, 4 => {
    /// Concurrent migrations at READ COMMITTED.
    concurrent_migrations_are_serialised(Isolation::ReadCommitted);
    /// Concurrent migrations on connections that default to REPEATABLE READ.
    concurrent_migrations_at_repeatable_read(Isolation::RepeatableRead);
    /// Concurrent migrations on connections that default to SERIALIZABLE.
    concurrent_migrations_at_serializable(Isolation::Serializable);
});

/// A lease claim of a key held by an open transaction fails with a retryable lock timeout instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_claim_never_hangs_on_an_open_transaction() {
    let store = store(ClaimStrategy::InsertOnConflict).await;
    let key = Key::new();
    let now = now_ms();
    let tx = begun_and_claimed(&store, &key.at(now), Duration::ZERO).await;
    let lease_req = ClaimRequest {
        lease_expires_at_ms: Some(now + 30_000),
        ..key.at(now)
    };
    let started = Instant::now();
    let err = store.try_claim(&lease_req).await.unwrap_err();
    assert_eq!(err.store_kind(), Some(StoreErrorKind::LockTimeout), "got {err:?}");
    assert!(err.is_retryable());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "bounded: {:?}",
        started.elapsed()
    );
    store.rollback(tx).await.unwrap();
    // With the transaction gone the lease claim succeeds and the row reads back as held.
    let token = match store.try_claim(&lease_req).await.unwrap() {
        LeaseClaim::Acquired(token) => token,
        other => panic!("expected a lease, got {other:?}"),
    };
    let row = store.get(&key.scope, &key.key).await.unwrap().expect("the claimed row");
    assert_eq!(
        row.state,
        RowState::InProgress {
            token,
            lease_expires_at_ms: now + 30_000
        }
    );
}

/// The sweeper skips an expired row that a claim is taking over, without waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_skips_rows_a_claim_holds() {
    let store = store(ClaimStrategy::InsertOnConflict).await;
    let (held, free) = (Key::new(), Key::new());
    commit_record(&store, &held.at(1_000)).await;
    commit_record(&store, &free.at(1_000)).await;
    let later = 1_000 + 120_000;
    let tx = begun_and_claimed(&store, &held.at(later), Duration::ZERO).await;
    let started = Instant::now();
    assert_eq!(
        store.sweep_expired(later, 10).await.unwrap(),
        1,
        "only the row nobody holds is deleted"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the sweeper did not wait: {:?}",
        started.elapsed()
    );
    store.rollback(tx).await.unwrap();
    assert_eq!(
        store.sweep_expired(later, 10).await.unwrap(),
        1,
        "the released row is swept next time"
    );
    assert_eq!(store.get(&held.scope, &held.key).await.unwrap(), None);
}

/// Recording without a claim in the transaction is refused rather than silently doing nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_without_a_claim_is_refused() {
    let store = store(ClaimStrategy::InsertOnConflict).await;
    let key = Key::new();
    let mut tx = store.begin().await.unwrap();
    let err = store
        .record(&mut tx, &key.at(now_ms()), &Record::completed(vec![]))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "got {err:?}");
    store.rollback(tx).await.unwrap();
}

/// PostgreSQL's SQLSTATEs map to the portable kinds the engines act on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlstates_map_to_portable_kinds() {
    let pool = open_pool(&database_url()).await;
    let cases = [
        ("40P01", StoreErrorKind::Deadlock),
        ("40001", StoreErrorKind::Serialization),
        ("55P03", StoreErrorKind::LockTimeout),
        ("57P01", StoreErrorKind::Unavailable),
        ("08006", StoreErrorKind::Unavailable),
        ("23505", StoreErrorKind::Other),
        ("22012", StoreErrorKind::Other),
    ];
    for (code, kind) in cases {
        let sql = format!("DO $$ BEGIN RAISE EXCEPTION 'raised for a test' USING ERRCODE = '{code}'; END $$");
        let err = sqlx::query(AssertSqlSafe(sql)).execute(&pool).await.unwrap_err();
        assert_eq!(store_error(err).store_kind(), Some(kind), "SQLSTATE {code}");
    }
    let refused = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect("postgres://postgres@127.0.0.1:1/test")
        .await
        .unwrap_err();
    assert_eq!(
        store_error(refused).store_kind(),
        Some(StoreErrorKind::Unavailable),
        "a refused connection"
    );
}

/// Work whose own statement fails with a real serialisation failure (40001, REPEATABLE READ) is rolled back and run again; its effect applies once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn work_serialisation_failure_is_run_again() {
    let pool = open_pool_at(&database_url(), Isolation::RepeatableRead).await;
    let store = PgStore::new(pool.clone()).with_table(isolated_table(&pool).await);
    store.migrate().await.expect("migrate");
    let counters = isolated_table(&pool).await;
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {counters} (id INT PRIMARY KEY, n INT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {counters} VALUES (1, 0)")))
        .execute(&pool)
        .await
        .unwrap();
    let engine = idem_core::TxEngine::new(store);
    let k = Key::new();
    let call = idem_core::Call::new(k.scope.clone(), k.key.clone(), k.fingerprint);
    let runs = Arc::new(AtomicUsize::new(0));
    let out = engine
        .execute(&call, |tx| {
            let (pool, runs, counters) = (pool.clone(), runs.clone(), counters.clone());
            Box::pin(async move {
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    // The claim fixed this transaction's snapshot; another
                    // transaction now changes the row the work will update.
                    sqlx::query(AssertSqlSafe(format!("UPDATE {counters} SET n = n + 100 WHERE id = 1")))
                        .execute(&pool)
                        .await
                        .map_err(store_error)?;
                }
                sqlx::query(AssertSqlSafe(format!("UPDATE {counters} SET n = n + 1 WHERE id = 1")))
                    .execute(&mut **tx)
                    .await
                    .map_err(store_error)?;
                Ok::<_, Error>(7)
            })
        })
        .await
        .expect("the serialisation failure is retried");
    assert_eq!((out.is_replayed(), *out.value()), (false, 7));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the first run failed with 40001 and ran again"
    );
    let n: i32 = sqlx::query(AssertSqlSafe(format!("SELECT n FROM {counters} WHERE id = 1")))
        .fetch_one(&pool)
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 101, "the work's increment applied once");
    sqlx::query(AssertSqlSafe(format!("DROP TABLE {counters}")))
        .execute(&pool)
        .await
        .unwrap();
}

/// The driver-error classifier marks serialisation failures and deadlocks as contention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlstates_classify_contention() {
    let pool = open_pool(&database_url()).await;
    for (code, contention) in [("40001", true), ("40P01", true), ("55P03", true), ("23505", false)] {
        let e = sqlx::query(AssertSqlSafe(format!(
            "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '{code}'; END $$"
        )))
        .execute(&pool)
        .await
        .unwrap_err();
        assert_eq!(idem_postgres::is_contention(&e), contention, "{code}");
        assert_eq!(store_error(e).is_contention(), contention, "{code}");
    }
}

/// A purge of expired keys meets a row that a transactional claim is taking
/// over at that moment (locked, not yet committed): the purge neither waits
/// for the claim nor deletes the claimed row once it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_never_deletes_a_row_claimed_under_it() {
    use idem_core::{KeyFilter, KeyState};
    let store = store(ClaimStrategy::InsertOnConflict).await;
    let k = Key::new();
    let t0 = now_ms();
    // A completed key that expired a minute ago.
    let mut tx = begun_and_claimed(&store, &k.at(t0 - 120_000), Duration::from_secs(1)).await;
    store
        .record(&mut tx, &k.at(t0 - 120_000), &Record::completed(b"old".to_vec()))
        .await
        .unwrap();
    store.commit(tx).await.unwrap();
    // A transactional claim takes the expired row over and holds it.
    let mut claim = begun_and_claimed(&store, &k.at(t0), Duration::from_secs(1)).await;
    let filter = KeyFilter {
        tenant: Some(k.scope.tenant().as_str().to_owned()),
        state: Some(KeyState::Expired),
        ..KeyFilter::default()
    };
    let purge = {
        let (store, filter) = (store.clone(), filter.clone());
        tokio::spawn(async move { store.purge_keys(&filter, t0, 100).await })
    };
    // Give the purge time to reach the locked row before the claim commits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    store
        .record(&mut claim, &k.at(t0), &Record::completed(b"new".to_vec()))
        .await
        .unwrap();
    store.commit(claim).await.unwrap();
    let purged = purge.await.unwrap().unwrap();
    assert_eq!(purged, 0, "the purge deleted the row claimed under it");
    let row = store
        .get(&k.scope, &k.key)
        .await
        .unwrap()
        .expect("the claimed row is there");
    assert_eq!(row.state, RowState::Done(Record::completed(b"new".to_vec())));
}

/// A version-1 keys table (its check allows status 0 to 2) is upgraded to
/// the latest version in place: its rows are kept, status 3 (an unknown
/// outcome) and 4 (sent) are then accepted, anything else is still
/// refused, and a lease can be marked sent on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_1_table_is_upgraded_keeping_its_rows() {
    let pool = open_pool(&database_url()).await;
    let table = isolated_table(&pool).await;
    let t = table.as_str();
    for statement in [
        format!(
            "CREATE TABLE {t}_schema (version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied_at_ms BIGINT NOT NULL)"
        ),
        format!("INSERT INTO {t}_schema VALUES (1, 'keys table and expiry index', 0)"),
        format!(
            "CREATE TABLE {t} (tenant TEXT COLLATE \"C\" NOT NULL, operation TEXT COLLATE \"C\" NOT NULL, \
             idem_key TEXT COLLATE \"C\" NOT NULL, fingerprint BYTEA NOT NULL CHECK (octet_length(fingerprint) = 32), \
             status SMALLINT NOT NULL CHECK (status IN (0, 1, 2)), token BIGINT NOT NULL, payload BYTEA NULL, \
             created_at_ms BIGINT NOT NULL, expires_at_ms BIGINT NOT NULL, lease_expires_at_ms BIGINT NULL, \
             PRIMARY KEY (tenant, operation, idem_key))"
        ),
        format!("INSERT INTO {t} VALUES ('t', 'o', 'k', decode(repeat('00', 32), 'hex'), 1, 7, 'ok', 1, 99, NULL)"),
    ] {
        sqlx::query(AssertSqlSafe(statement.clone()))
            .execute(&pool)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    let store = PgStore::new(pool.clone()).with_table(table.clone());
    store.migrate().await.expect("upgrade");
    let row: (i16, i64, Vec<u8>) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT status, token, payload FROM {t} WHERE idem_key = 'k'"
    )))
    .fetch_one(&pool)
    .await
    .expect("the row is kept");
    assert_eq!(row, (1, 7, b"ok".to_vec()));
    let insert = |status: i16, key: &str| {
        format!(
            "INSERT INTO {t} VALUES ('t', 'o', '{key}', decode(repeat('00', 32), 'hex'), {status}, 8, NULL, 1, 99, NULL)"
        )
    };
    sqlx::query(AssertSqlSafe(insert(3, "k3")))
        .execute(&pool)
        .await
        .expect("status 3 is accepted after the upgrade");
    assert_upgraded_to_version_3(&store).await;
}

/// A version-2 keys table (built by the version 1 and 2 statements as
/// `pending_migrations` lists them, holding a claim in progress) is
/// upgraded to version 3 in place: `sent_at_ms` is added, status 4 is
/// accepted, and the claim it held can be marked sent and is then never
/// taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_2_table_is_upgraded_to_sent_claims() {
    let pool = open_pool(&database_url()).await;
    let table = isolated_table(&pool).await;
    let t = table.as_str();
    let store = PgStore::new(pool.clone()).with_table(table.clone());
    let pending = store.pending_migrations().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {t}_schema (version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied_at_ms BIGINT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    for migration in pending.iter().filter(|m| m.version <= 2) {
        for statement in &migration.statements {
            sqlx::query(AssertSqlSafe(statement.clone()))
                .execute(&pool)
                .await
                .unwrap_or_else(|e| panic!("{statement}: {e}"));
        }
        sqlx::query(AssertSqlSafe(format!("INSERT INTO {t}_schema VALUES ($1, $2, 0)")))
            .bind(migration.version as i32)
            .bind(&migration.description)
            .execute(&pool)
            .await
            .unwrap();
    }
    let has_sent_at = format!(
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_name = '{t}' AND column_name = 'sent_at_ms')"
    );
    let before: bool = sqlx::query_scalar(AssertSqlSafe(has_sent_at.clone()))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(!before, "a version-2 table has no sent_at_ms");
    assert_eq!(
        idem_conformance::versions(&store.pending_migrations().await.unwrap()),
        vec![3],
        "only version 3 is pending on a version-2 table"
    );
    // A lease claimed before the upgrade, by a process of the old version
    // (the row as that version writes it).
    let k = Key::new();
    let now = now_ms();
    let token = Token::fresh(now);
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {t} (tenant, operation, idem_key, fingerprint, status, token, payload, created_at_ms, \
         expires_at_ms, lease_expires_at_ms) VALUES ($1, $2, $3, $4, 0, $5, NULL, $6, $7, $8)"
    )))
    .bind(k.scope.tenant().as_str())
    .bind(k.scope.operation().as_str())
    .bind(k.key.as_str())
    .bind(k.fingerprint.as_bytes().as_slice())
    .bind(token.0)
    .bind(now)
    .bind(now + 60_000)
    .bind(now + 1_000)
    .execute(&pool)
    .await
    .unwrap();
    store.migrate().await.expect("upgrade");
    let after: bool = sqlx::query_scalar(AssertSqlSafe(has_sent_at))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(after, "the upgrade adds sent_at_ms");
    let held = Lease {
        scope: k.scope.clone(),
        key: k.key.clone(),
        token,
        lease_expires_at_ms: now + 1_000,
    };
    store
        .mark_sent(&held, now + 10)
        .await
        .expect("the old claim is marked sent");
    let row = store.lookup(&k.scope, &k.key).await.unwrap().expect("the row");
    assert_eq!(row.sent_at_ms, Some(now + 10));
    assert!(
        matches!(row.state, RowState::Sent { token: marked, .. } if marked == token),
        "{row:?}"
    );
    // Past its lease it is an unknown outcome, answered, not taken over.
    let later = ClaimRequest {
        lease_expires_at_ms: Some(now + 5_000),
        ..k.at(now + 2_000)
    };
    match store.try_claim(&later).await.unwrap() {
        LeaseClaim::Found(found) => assert!(found.is_unknown_at(now + 2_000), "{found:?}"),
        other => panic!("a sent claim is never taken over, got {other:?}"),
    }
    assert_upgraded_to_version_3(&store).await;
}

/// After an upgrade: versions 1 to 3 are recorded, nothing is pending,
/// status 4 is accepted and 5 refused, and a fresh lease is marked sent
/// and completed keeping its mark's time.
async fn assert_upgraded_to_version_3(store: &PgStore) {
    let t = store.table().as_str();
    let pool = store.pool();
    let versions: Vec<i32> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {t}_schema ORDER BY version"
    )))
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(versions, vec![1, 2, 3]);
    assert!(store.pending_migrations().await.unwrap().is_empty());
    let insert = |status: i16, key: &str| {
        format!(
            "INSERT INTO {t} (tenant, operation, idem_key, fingerprint, status, token, payload, created_at_ms, \
             expires_at_ms, lease_expires_at_ms, sent_at_ms) \
             VALUES ('t', 'o', '{key}', decode(repeat('00', 32), 'hex'), {status}, 8, NULL, 1, 99, 50, 2)"
        )
    };
    sqlx::query(AssertSqlSafe(insert(4, "k4")))
        .execute(pool)
        .await
        .expect("status 4 is accepted after the upgrade");
    assert!(
        sqlx::query(AssertSqlSafe(insert(5, "k5"))).execute(pool).await.is_err(),
        "status 5 is still refused"
    );
    let k = Key::new();
    let now = now_ms();
    let req = ClaimRequest {
        lease_expires_at_ms: Some(now + 30_000),
        ..k.at(now)
    };
    let LeaseClaim::Acquired(token) = store.try_claim(&req).await.unwrap() else {
        panic!("a fresh key is claimed");
    };
    let lease = Lease {
        scope: k.scope.clone(),
        key: k.key.clone(),
        token,
        lease_expires_at_ms: now + 30_000,
    };
    store.mark_sent(&lease, now).await.expect("marked sent");
    store
        .complete(&lease, &Record::completed(b"done".to_vec()))
        .await
        .expect("a sent lease is completed by its holder");
    let row = store.lookup(&k.scope, &k.key).await.unwrap().expect("the row");
    assert_eq!(row.state, RowState::Done(Record::completed(b"done".to_vec())));
    assert_eq!(row.sent_at_ms, Some(now), "completing keeps the mark's time");
}

/// A store on a pool of one connection, so every check after a call reads
/// the connection that call used; and a table of business rows.
async fn one_connection_store(strategy: ClaimStrategy) -> PgStore {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&database_url())
        .await
        .expect("a pool of one connection");
    let table = isolated_table(&pool).await;
    let store = PgStore::new(pool).with_table(table).with_claim_strategy(strategy);
    store.migrate().await.expect("migrate");
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {} (id TEXT NOT NULL)",
        effects_table(&store)
    )))
    .execute(store.pool())
    .await
    .unwrap();
    store
}

/// The business rows' table of a store from [`one_connection_store`].
fn effects_table(store: &PgStore) -> String {
    format!("{}_effects", store.table().as_str())
}

async fn insert_effect(store: &PgStore, conn: &mut sqlx::PgConnection, id: String) {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (id) VALUES ($1)",
        effects_table(store)
    )))
    .bind(id)
    .execute(conn)
    .await
    .unwrap();
}

/// The committed business rows whose id starts with `tag`, sorted.
async fn nested_effects(store: &PgStore, tag: &str) -> Vec<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT id FROM {} WHERE id LIKE $1 ORDER BY id",
        effects_table(store)
    )))
    .bind(format!("{tag}%"))
    .fetch_all(store.pool())
    .await
    .unwrap()
}

/// A claimed transaction of `req`'s fresh key, with the caller's first
/// write, `{tag}-a`, sent in it: the transaction, and the new `tag` its
/// writes are named by.
async fn claimed_with_a_write(store: &PgStore, req: &ClaimRequest<'_>) -> (idem_postgres::PgTx, String) {
    let tag = uuid::Uuid::new_v4().to_string();
    let (mut tx, claim) = store.begin_claim(req, Duration::ZERO).await.unwrap();
    assert_eq!(claim, TxClaim::Claimed);
    insert_effect(store, &mut tx, format!("{tag}-a")).await;
    (tx, tag)
}

/// Ends `tx`, a claimed transaction that must commit nothing, as `end`
/// names (`what` is said with any failure): `record` (the record and the
/// commit in one) or `commit` (the record, then the commit), each refused;
/// `rollback`; or `drop`.
async fn end_refused(store: &PgStore, mut tx: idem_postgres::PgTx, req: &ClaimRequest<'_>, end: &str, what: &str) {
    let record = Record::completed(b"done".to_vec());
    match end {
        "record" => {
            let err = store.record_commit(tx, req, &record).await.unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{what}: {err:?}");
        }
        "commit" => {
            let err = store.record(&mut tx, req, &record).await.unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{what}: {err:?}");
            let err = store.commit(tx).await.unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{what}: {err:?}");
        }
        "rollback" => store.rollback(tx).await.unwrap(),
        _ => drop(tx),
    }
}

/// That nothing of `key`'s claim committed, nor the caller's writes tagged
/// `tag` (`what` is said with any failure), and the pool's connection came
/// back clean.
async fn nothing_committed(store: &PgStore, key: &Key, tag: &str, what: &str) {
    pool_is_clean(store).await;
    assert!(nested_effects(store, tag).await.is_empty(), "{what}");
    assert!(store.get(&key.scope, &key.key).await.unwrap().is_none(), "{what}");
}

/// That the pool's connection is outside any transaction and sqlx counts
/// none on it: `pool.begin()` sends `BEGIN`, not a `SAVEPOINT`.
async fn pool_is_clean(store: &PgStore) {
    let tx = store.pool().begin().await.expect("a transaction of the pool's own");
    tx.commit().await.unwrap();
    let row = sqlx::raw_sql("SELECT now() <> statement_timestamp()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    let in_transaction: bool = row.get(0);
    assert!(!in_transaction, "the connection came back inside a transaction");
}

/// A transaction begun in the caller's code on a claimed transaction's
/// connection (`sqlx::Connection::begin`, as a function taking a
/// `&mut PgConnection` does) is a savepoint of the claim's transaction:
/// rolling it back undoes only its own writes, committing it commits
/// nothing yet, and the claim, the caller's other writes and the record
/// commit together, once. Under every claim strategy; afterwards the pool's
/// connection is clean.
#[tokio::test]
async fn a_transaction_begun_in_the_callers_work_nests_in_the_claim() {
    for strategy in STRATEGIES {
        let store = one_connection_store(strategy).await;
        for inner_commits in [false, true] {
            let key = Key::new();
            let req = key.at(now_ms());
            let (mut tx, tag) = claimed_with_a_write(&store, &req).await;
            let mut inner = sqlx::Connection::begin(&mut *tx).await.unwrap();
            insert_effect(&store, &mut inner, format!("{tag}-b")).await;
            if inner_commits {
                inner.commit().await.unwrap();
            } else {
                inner.rollback().await.unwrap();
            }
            insert_effect(&store, &mut tx, format!("{tag}-c")).await;
            store
                .record_commit(tx, &req, &Record::completed(b"done".to_vec()))
                .await
                .unwrap();
            let expected: Vec<String> = if inner_commits {
                vec![format!("{tag}-a"), format!("{tag}-b"), format!("{tag}-c")]
            } else {
                vec![format!("{tag}-a"), format!("{tag}-c")]
            };
            assert_eq!(nested_effects(&store, &tag).await, expected, "{strategy:?}");
            let row = store.get(&key.scope, &key.key).await.unwrap().expect("recorded");
            assert_eq!(
                row.state,
                RowState::Done(Record::completed(b"done".to_vec())),
                "{strategy:?}"
            );
            pool_is_clean(&store).await;
        }
    }
}

/// A nested transaction begun on a claimed transaction's connection and
/// never ended: the record's commit fails and nothing commits (neither the
/// claim nor the caller's writes); a rollback or a drop rolls everything
/// back. Each way, the pool's connection comes back clean.
#[tokio::test]
async fn a_nested_transaction_left_open_commits_nothing() {
    let store = one_connection_store(ClaimStrategy::InsertOnConflict).await;
    for end in ["record", "commit", "rollback", "drop"] {
        let key = Key::new();
        let req = key.at(now_ms());
        let (mut tx, tag) = claimed_with_a_write(&store, &req).await;
        let mut inner = sqlx::Connection::begin(&mut *tx).await.unwrap();
        insert_effect(&store, &mut inner, format!("{tag}-b")).await;
        std::mem::forget(inner);
        end_refused(&store, tx, &req, end, end).await;
        nothing_committed(&store, &key, &tag, end).await;
    }
}

/// A claimed transaction dropped unfinished rolls back, and the pool's
/// connection comes back clean (sqlx counts no transaction on it).
#[tokio::test]
async fn a_dropped_claimed_transaction_leaves_the_connection_clean() {
    for strategy in [ClaimStrategy::InsertOnConflict, ClaimStrategy::OneWrite] {
        let store = one_connection_store(strategy).await;
        let key = Key::new();
        let req = key.at(now_ms());
        let (tx, tag) = claimed_with_a_write(&store, &req).await;
        drop(tx);
        nothing_committed(&store, &key, &tag, &format!("{strategy:?}")).await;
        // And the key is free: claimed again, and recorded.
        let (tx, claim) = store.begin_claim(&req, Duration::ZERO).await.unwrap();
        assert_eq!(claim, TxClaim::Claimed);
        store
            .record_commit(tx, &req, &Record::completed(b"done".to_vec()))
            .await
            .unwrap();
        pool_is_clean(&store).await;
    }
}

/// A nested `begin` that fails (here: after a statement that failed, in
/// the aborted transaction) makes sqlx roll back the enclosing
/// transaction, the claim's: the record then fails, and nothing of the
/// claim commits (neither its row nor the caller's write before it), where
/// a one-write record, an insert, would otherwise commit on its own. The
/// pool's connection comes back clean.
#[tokio::test]
async fn a_claim_rolled_back_under_it_by_a_nested_begin_commits_nothing() {
    for strategy in [ClaimStrategy::OneWrite, ClaimStrategy::InsertOnConflict] {
        let store = one_connection_store(strategy).await;
        for end in ["record", "commit", "rollback"] {
            let key = Key::new();
            let req = key.at(now_ms());
            let (mut tx, tag) = claimed_with_a_write(&store, &req).await;
            sqlx::query("SELECT 1 / 0").execute(&mut *tx).await.unwrap_err();
            sqlx::Connection::begin(&mut *tx).await.unwrap_err();
            let what = format!("{strategy:?} {end}");
            end_refused(&store, tx, &req, end, &what).await;
            nothing_committed(&store, &key, &tag, &what).await;
        }
    }
}
