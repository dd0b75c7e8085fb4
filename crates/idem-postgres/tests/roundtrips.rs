//! The one-round-trip paths of the transactional mode: `BEGIN` with the
//! claim, and the record with `COMMIT`, sent as text with their values
//! written as literals, on connections of the store's own transaction type.
//! A connection must never go back to the pool inside a transaction, values
//! must mean the same under every string setting, and a record that finds no
//! claim must commit nothing.

// The shared helpers; this file opens pools with session settings of its own.
#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::{STRATEGIES, database_url, isolated_table, show_lock_timeout};
use idem_core::{
    Begin, Call, ClaimRequest, Error, Fingerprint, IdempotencyKey, Outcome, Record, Scope, Token, TxBackend, TxClaim,
    TxEngine,
};
use idem_postgres::{ClaimStrategy, PgStore};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Row};

/// A pool of `size` connections whose sessions start with `settings`, under
/// an application name of their own.
async fn pool_with(size: u32, settings: &[(&str, &str)]) -> PgPool {
    let url = database_url();
    let options: PgConnectOptions = url.parse().expect("a PostgreSQL URL");
    let options = options
        .options(settings.iter().copied())
        .application_name(&format!("idem-rt-{}", uuid::Uuid::new_v4().simple()));
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL is unreachable at {url}: {e}"))
}

async fn store_on(pool: PgPool, strategy: ClaimStrategy) -> PgStore {
    let table = isolated_table(&pool).await;
    let store = PgStore::new(pool).with_table(table).with_claim_strategy(strategy);
    store.migrate().await.expect("migrate");
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {}_effects (id TEXT PRIMARY KEY)",
        store.table().as_str()
    )))
    .execute(store.pool())
    .await
    .expect("effects table");
    store
}

/// A store on a pool of one connection, and its engine.
async fn on_one_connection(strategy: ClaimStrategy) -> (PgStore, TxEngine<PgStore>) {
    let store = store_on(pool_with(1, &[]).await, strategy).await;
    let engine = TxEngine::new(store.clone());
    (store, engine)
}

fn call(tenant: &str, operation: &str, key: &str) -> Call {
    let scope = Scope::parse(tenant, operation).expect("scope");
    let fingerprint = Fingerprint::of_bytes(scope.operation(), b"request");
    Call::new(scope, IdempotencyKey::new(key).expect("key"), fingerprint)
}

fn fresh_call() -> Call {
    call(
        &format!("tenant-{}", uuid::Uuid::new_v4()),
        "POST /v1/round-trips",
        &uuid::Uuid::new_v4().to_string(),
    )
}

/// Runs a call that inserts one effect row named after its key.
async fn run(engine: &TxEngine<PgStore>, call: &Call) -> Outcome<String> {
    let effects = format!("{}_effects", engine.backend().table().as_str());
    let id = call.key().as_str().to_owned();
    engine
        .execute(call, move |tx| {
            let (effects, id) = (effects.clone(), id.clone());
            Box::pin(async move {
                sqlx::query(AssertSqlSafe(format!("INSERT INTO {effects} (id) VALUES ($1)")))
                    .bind(&id)
                    .execute(&mut **tx)
                    .await
                    .map_err(idem_postgres::store_error)?;
                Ok::<_, Error>(id)
            })
        })
        .await
        .expect("the call runs")
}

/// A transactional claim request of `call` in `scope` that never expires.
fn request<'a>(scope: &'a Scope, call: &'a Call) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key: call.key(),
        fingerprint: call.fingerprint(),
        now_ms: 1,
        expires_at_ms: i64::MAX,
        fresh_token: Token::fresh(1),
        lease_expires_at_ms: None,
    }
}

/// Writes the effect row `id` in `tx`.
async fn write_effect(store: &PgStore, tx: &mut idem_postgres::PgTx, id: &str) {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {}_effects (id) VALUES ($1)",
        store.table().as_str()
    )))
    .bind(id)
    .execute(&mut **tx)
    .await
    .unwrap();
}

/// The claim `engine` takes of `call`'s fresh key.
async fn fresh_claim(engine: &TxEngine<PgStore>, call: &Call) -> idem_core::Claimed<idem_postgres::PgTx> {
    let Begin::Claimed(claimed) = engine.begin(call).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    claimed
}

/// How committing `claimed` with an empty outcome fails.
async fn commit_err(engine: &TxEngine<PgStore>, claimed: idem_core::Claimed<idem_postgres::PgTx>) -> Error {
    engine
        .commit(claimed, Record::completed(b"{}".to_vec()))
        .await
        .unwrap_err()
}

async fn effects(store: &PgStore, id: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}_effects WHERE id = $1",
        store.table().as_str()
    )))
    .bind(id)
    .fetch_one(store.pool())
    .await
    .expect("count effects")
}

/// Whether every connection of the pool is back and outside a transaction,
/// as another session sees them.
async fn connection_is_clean(pool: &PgPool) -> bool {
    let size = pool.options().get_max_connections() as usize;
    // Waiting for every connection means any rollback of a dropped
    // transaction has run.
    let mut held = Vec::new();
    for _ in 0..size.min(pool.size() as usize) {
        held.push(pool.acquire().await.expect("the connection comes back"));
    }
    drop(held);
    let app = pool.connect_options().get_application_name().expect("named").to_owned();
    let mut observer = PgConnection::connect(&database_url())
        .await
        .expect("an observer session");
    for _ in 0..100 {
        let states: Vec<String> =
            sqlx::query_scalar("SELECT coalesce(state, '') FROM pg_stat_activity WHERE application_name = $1")
                .bind(&app)
                .fetch_all(&mut observer)
                .await
                .expect("read the pool's sessions");
        if states.iter().any(|s| s.starts_with("idle in transaction")) {
            return false;
        }
        if states.iter().all(|s| s == "idle") {
            return true;
        }
        // A connection is still answering the pool's release check.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_calls_and_replays_leave_the_only_connection_clean() {
    for strategy in STRATEGIES {
        let (store, engine) = on_one_connection(strategy).await;
        let call = fresh_call();
        assert!(matches!(run(&engine, &call).await, Outcome::Executed(_)));
        assert!(connection_is_clean(store.pool()).await, "after a fresh call");
        assert!(matches!(run(&engine, &call).await, Outcome::Replayed(_)));
        assert!(connection_is_clean(store.pool()).await, "after a replay");
        assert_eq!(effects(&store, call.key().as_str()).await, 1);
        // Under insert-on-conflict a transaction begins with the first
        // insert and its look; the general claim is not prepared by name.
        let claim = match strategy {
            ClaimStrategy::InsertOnConflict => "first",
            _ => "claim",
        };
        let prepared: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE $1")
            .bind(format!("idem\\_{claim}\\_%"))
            .fetch_one(store.pool())
            .await
            .unwrap();
        assert_eq!(
            prepared, 1,
            "the claim is prepared once on the connection ({strategy:?})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_claim_leaves_its_connection_clean() {
    let store = store_on(pool_with(2, &[]).await, ClaimStrategy::InsertOnConflict).await;
    let engine = TxEngine::new(store.clone());
    let call = fresh_call();
    let Begin::Claimed(holder) = engine.begin(&call).await.unwrap() else {
        panic!("the first claim claims")
    };
    let scope = call.scope().clone();
    let req = request(&scope, &call);
    let (tx, answer) = store.begin_claim(&req, Duration::from_millis(50)).await.unwrap();
    assert_eq!(answer, idem_core::TxClaim::Busy);
    store.rollback(tx).await.unwrap();
    engine.abandon(holder).await;
    assert!(connection_is_clean(store.pool()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_claim_rolls_back_and_returns_a_clean_connection() {
    let (store, engine) = on_one_connection(ClaimStrategy::InsertOnConflict).await;
    let call = fresh_call();
    let mut claimed = fresh_claim(&engine, &call).await;
    write_effect(&store, &mut claimed.tx, call.key().as_str()).await;
    drop(claimed);
    // The pool's only connection comes back once the rollback ran.
    assert!(connection_is_clean(store.pool()).await);
    assert_eq!(
        effects(&store, call.key().as_str()).await,
        0,
        "the write was rolled back"
    );
    assert!(
        store.get(call.scope(), call.key()).await.unwrap().is_none(),
        "the key is unused"
    );
    assert!(matches!(run(&engine, &call).await, Outcome::Executed(_)));
    assert_eq!(effects(&store, call.key().as_str()).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_finds_no_claim_commits_nothing() {
    let (store, engine) = on_one_connection(ClaimStrategy::InsertOnConflict).await;
    // The connection has the prepared statements once a call ran on it.
    assert!(matches!(run(&engine, &fresh_call()).await, Outcome::Executed(_)));
    let call = fresh_call();
    let mut claimed = fresh_claim(&engine, &call).await;
    // The caller's work writes, and deletes the claim under the engine's feet.
    write_effect(&store, &mut claimed.tx, call.key().as_str()).await;
    sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {} WHERE idem_key = $1",
        store.table().as_str()
    )))
    .bind(call.key().as_str())
    .execute(&mut *claimed.tx)
    .await
    .unwrap();
    let err = commit_err(&engine, claimed).await;
    assert!(matches!(err, Error::Config(_)), "got {err:?}");
    assert_eq!(effects(&store, call.key().as_str()).await, 0, "nothing committed");
    assert!(connection_is_clean(store.pool()).await);
    // Without the one-round-trip path (a transaction from `begin`), the same.
    let mut tx = store.begin().await.unwrap();
    let scope = call.scope().clone();
    let req = request(&scope, &call);
    write_effect(&store, &mut tx, call.key().as_str()).await;
    let err = store
        .record_commit(tx, &req, &Record::completed(b"{}".to_vec()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "got {err:?}");
    assert_eq!(effects(&store, call.key().as_str()).await, 0, "nothing committed");
    assert!(connection_is_clean(store.pool()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_mean_the_same_under_every_string_setting() {
    let every_byte: Vec<u8> = (0..=255).collect();
    for (conforming, strategy) in [
        ("on", ClaimStrategy::AdvisoryLock),
        ("off", ClaimStrategy::AdvisoryLock),
        ("on", ClaimStrategy::OneWrite),
        ("off", ClaimStrategy::OneWrite),
    ] {
        let pool = pool_with(1, &[("standard_conforming_strings", conforming)]).await;
        let store = store_on(pool, strategy).await;
        let engine = TxEngine::new(store.clone());
        let tenant = format!("t'e\\s ☃ \"{}\"; --", uuid::Uuid::new_v4());
        let operation = "POST /v1/x'y\\z é";
        let key = format!("k'\\'\\\\ ;{}", uuid::Uuid::new_v4());
        let call = call(&tenant, operation, &key);
        let Begin::Claimed(claimed) = engine.begin(&call).await.unwrap() else {
            panic!("a fresh key is claimed ({conforming})")
        };
        engine
            .commit(claimed, Record::completed(every_byte.clone()))
            .await
            .unwrap();
        let Begin::Replay(record) = engine.begin(&call).await.unwrap() else {
            panic!("the key replays ({conforming})")
        };
        assert_eq!(
            record.payload, every_byte,
            "every byte value round-trips ({conforming})"
        );
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT tenant, operation, idem_key FROM {}",
            store.table().as_str()
        )))
        .fetch_one(store.pool())
        .await
        .unwrap();
        let stored: (String, String, String) = (row.get(0), row.get(1), row.get(2));
        assert_eq!(stored, (tenant, operation.to_owned(), key), "({conforming})");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_lost_its_prepared_claim_prepares_it_again() {
    for lost in ["first", "look"] {
        lost_prepared_statement_is_prepared_again(ClaimStrategy::InsertOnConflict, lost).await;
    }
    lost_prepared_statement_is_prepared_again(ClaimStrategy::AdvisoryLock, "claim").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_lost_its_prepared_one_write_statements_prepares_them_again() {
    for lost in ["claim", "lock"] {
        lost_prepared_statement_is_prepared_again(ClaimStrategy::OneWrite, lost).await;
    }
}

/// Deallocates the prepared statement `idem_<lost>_…` (and only it: sqlx keeps statements of its own);
/// the next call prepares it again.
async fn lost_prepared_statement_is_prepared_again(strategy: ClaimStrategy, lost: &str) {
    let (store, engine) = on_one_connection(strategy).await;
    assert!(matches!(run(&engine, &fresh_call()).await, Outcome::Executed(_)));
    let mut conn = store.pool().acquire().await.unwrap();
    let name: String = sqlx::query_scalar("SELECT name FROM pg_prepared_statements WHERE name LIKE $1")
        .bind(format!("idem\\_{lost}\\_%"))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(format!("DEALLOCATE {name}")))
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);
    let call = fresh_call();
    assert!(matches!(run(&engine, &call).await, Outcome::Executed(_)));
    assert!(matches!(run(&engine, &call).await, Outcome::Replayed(_)));
    assert_eq!(effects(&store, call.key().as_str()).await, 1);
    assert!(connection_is_clean(store.pool()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sessions_lock_timeout_is_kept_through_a_claim() {
    let store = store_on(
        pool_with(1, &[("lock_timeout", "7s")]).await,
        ClaimStrategy::InsertOnConflict,
    )
    .await;
    let engine = TxEngine::new(store.clone());
    let call = fresh_call();
    let mut claimed = fresh_claim(&engine, &call).await;
    let inside = show_lock_timeout(&mut *claimed.tx).await;
    assert_eq!(inside, "7s", "the caller's writes keep the session's lock_timeout");
    engine.commit(claimed, Record::completed(b"{}".to_vec())).await.unwrap();
    assert!(matches!(engine.begin(&call).await.unwrap(), Begin::Replay(_)));
    let after = show_lock_timeout(store.pool()).await;
    assert_eq!(after, "7s");
    // A key taken over from a stale row (the general claim, after the first
    // insert and its look) keeps it for the caller's writes too.
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET expires_at_ms = 0",
        store.table().as_str()
    )))
    .execute(store.pool())
    .await
    .unwrap();
    let mut claimed = fresh_claim(&engine, &call).await;
    let inside = show_lock_timeout(&mut *claimed.tx).await;
    assert_eq!(inside, "7s", "after a takeover too");
    engine.abandon(claimed).await;
}

idem_conformance::cases!(lost_record_rolls_back_and_recovers, 2 => {
    a_connection_that_lost_its_prepared_record_rolls_back_and_recovers(ClaimStrategy::InsertOnConflict, "record");
    a_connection_that_lost_its_prepared_one_write_insert_rolls_back_and_recovers(ClaimStrategy::OneWrite, "insert");
});

/// Deallocates the record statement `idem_<lost>_…` inside a claimed transaction: the commit fails,
/// retryably, with nothing committed, and the connection prepares it again.
async fn lost_record_rolls_back_and_recovers(strategy: ClaimStrategy, lost: &str) {
    let (store, engine) = on_one_connection(strategy).await;
    assert!(matches!(run(&engine, &fresh_call()).await, Outcome::Executed(_)));
    let call = fresh_call();
    let mut claimed = fresh_claim(&engine, &call).await;
    let name: String = sqlx::query_scalar("SELECT name FROM pg_prepared_statements WHERE name LIKE $1")
        .bind(format!("idem\\_{lost}\\_%"))
        .fetch_one(&mut *claimed.tx)
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(format!("DEALLOCATE {name}")))
        .execute(&mut *claimed.tx)
        .await
        .unwrap();
    let err = commit_err(&engine, claimed).await;
    assert!(err.is_retryable(), "a retryable failure: {err:?}");
    assert!(
        store.get(call.scope(), call.key()).await.unwrap().is_none(),
        "nothing committed"
    );
    assert!(connection_is_clean(store.pool()).await);
    assert!(matches!(run(&engine, &call).await, Outcome::Executed(_)));
    assert!(matches!(run(&engine, &call).await, Outcome::Replayed(_)));
    assert_eq!(effects(&store, call.key().as_str()).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_takes_no_row_lock() {
    replay_takes_no_row_lock(pool_with(2, &[]).await).await;
}

/// The same on a database whose default isolation is SERIALIZABLE, as a
/// team may set it with `ALTER DATABASE`: the claim must not lock the row
/// there either.
#[tokio::test]
async fn a_replay_takes_no_row_lock_on_a_serializable_database() {
    let pool = serializable_database_pool().await;
    let level: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(level, "serializable");
    replay_takes_no_row_lock(pool).await;
}

/// A pool on the tests' SERIALIZABLE database.
async fn serializable_database_pool() -> PgPool {
    let url = common::serializable_database_url().await;
    let options: PgConnectOptions = url.parse().expect("a PostgreSQL URL");
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .expect("a pool on the serializable database")
}

async fn replay_takes_no_row_lock(pool: PgPool) {
    let store = store_on(pool, ClaimStrategy::InsertOnConflict).await;
    let engine = TxEngine::new(store.clone());
    let call = fresh_call();
    assert!(matches!(run(&engine, &call).await, Outcome::Executed(_)));
    // Another session holds the key's row lock.
    let mut holder = store.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM {} WHERE idem_key = $1 FOR UPDATE",
        store.table().as_str()
    )))
    .bind(call.key().as_str())
    .fetch_one(&mut *holder)
    .await
    .unwrap();
    // A claim that had to lock the row would find it busy at once under a
    // policy that does not wait; the replay reads the completed row instead.
    let impatient = call
        .clone()
        .with_policy(idem_core::Policy::default().with_in_flight(idem_core::InFlight::Reject));
    assert!(matches!(run(&engine, &impatient).await, Outcome::Replayed(_)));
    store.rollback(holder).await.unwrap();
}

/// On a SERIALIZABLE database a fresh claim reads nothing, so it takes no
/// predicate lock on the keys table or its indexes that would make other
/// fresh claims on the same index page fail their commits; a replay locks no
/// row (above).
#[tokio::test]
async fn a_fresh_serializable_claim_takes_no_predicate_lock() {
    let store = store_on(serializable_database_pool().await, ClaimStrategy::InsertOnConflict).await;
    let (call, scope) = (fresh_call(), Scope::parse("t", "POST /v1/predicate").unwrap());
    let (mut tx, claim) = store
        .begin_claim(&request(&scope, &call), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(claim, TxClaim::Claimed);
    let table = store.table().as_str().to_owned();
    let locks: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
         WHERE l.pid = pg_backend_pid() AND l.mode = 'SIReadLock' \
         AND (c.relname = '{table}' OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = '{table}'::regclass))"
    )))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(locks, 0, "a fresh claim took predicate locks on {table}");
    store.rollback(tx).await.unwrap();
}

/// Statements sqlx prepared on the pool's connections that hold the general
/// claim (`WITH saved …`): the claim sent where the first insert and its look
/// cannot answer.
async fn general_claims_prepared(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'WITH saved %'")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Under insert-on-conflict a fresh call and a replay are each answered by
/// the text that begins the transaction (the first insert and its look): the
/// general claim is never sent, at READ COMMITTED or on a SERIALIZABLE
/// database. A stale row is taken over by the general claim, which the check
/// then sees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_answered_by_the_text_that_begins_its_transaction() {
    let serializable = {
        let url = common::serializable_database_url().await;
        let options: PgConnectOptions = url.parse().expect("a PostgreSQL URL");
        PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .expect("a pool on the serializable database")
    };
    for (level, pool) in [
        ("read committed", pool_with(1, &[]).await),
        ("serializable", serializable),
    ] {
        let store = store_on(pool, ClaimStrategy::InsertOnConflict).await;
        let engine = TxEngine::new(store.clone());
        let call = fresh_call();
        assert!(matches!(run(&engine, &call).await, Outcome::Executed(_)), "{level}");
        assert!(matches!(run(&engine, &call).await, Outcome::Replayed(_)), "{level}");
        assert_eq!(general_claims_prepared(store.pool()).await, 0, "{level}");
        // Expire the row (and take its effect away, which the call writes
        // under a unique id): the next call takes the key over with the
        // general claim.
        let t = store.table().as_str();
        for sql in [
            format!("UPDATE {t} SET expires_at_ms = 0 WHERE idem_key = $1"),
            format!("DELETE FROM {t}_effects WHERE id = $1"),
        ] {
            sqlx::query(AssertSqlSafe(sql))
                .bind(call.key().as_str())
                .execute(store.pool())
                .await
                .unwrap();
        }
        assert!(matches!(run(&engine, &call).await, Outcome::Executed(_)), "{level}");
        assert_eq!(general_claims_prepared(store.pool()).await, 1, "{level}");
        assert_eq!(effects(&store, call.key().as_str()).await, 1, "{level}");
    }
}

/// A replay is answered after its claim's round trip: the `ROLLBACK` of its
/// read-only transaction is sent, and its answer is read by the pool's ping
/// when the connection comes back, not waited for by the caller. Through a
/// proxy that holds that answer back, the replay still answers; the
/// connection is handed out again only once the answer has arrived, clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_does_not_wait_for_its_rollback() {
    let options: PgConnectOptions = database_url().parse().expect("a PostgreSQL URL");
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let proxy = idem_conformance::wire::HoldingProxy::start(upstream, b"ROLLBACK").await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            options
                .host(&proxy.addr().ip().to_string())
                .port(proxy.addr().port())
                // In clear text, so the proxy sees each statement.
                .ssl_mode(sqlx::postgres::PgSslMode::Disable),
        )
        .await
        .expect("a pool through the proxy");
    let store = store_on(pool, ClaimStrategy::InsertOnConflict).await;
    let engine = TxEngine::new(store.clone());
    let call = fresh_call();
    assert!(matches!(run(&engine, &call).await, Outcome::Executed(_)));
    // The first call's connection is back in the pool (the release ping
    // has ended what the call queued) before anything is held.
    drop(store.pool().acquire().await.unwrap());
    proxy.arm(true);
    let replay = tokio::time::timeout(Duration::from_secs(20), run(&engine, &call))
        .await
        .expect("the replay answered while its ROLLBACK's answer was held back");
    assert!(matches!(replay, Outcome::Replayed(_)));
    // The only connection is back once the held answer arrives.
    let pool = store.pool().clone();
    proxy
        .waits_for_release(
            async move { pool.acquire().await.map(drop) },
            "the connection was handed out before its ROLLBACK was answered",
        )
        .await
        .expect("the connection came back");
    assert_eq!(proxy.held(), 1);
    let level: String = sqlx::query_scalar("SELECT current_setting('transaction_isolation')")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(level, "read committed");
    // In a transaction of its own (a simple query outside any block), a
    // statement starts when its transaction does; inside the replay's
    // transaction, it would start later.
    let row = sqlx::raw_sql("SELECT now() <> statement_timestamp()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    let in_transaction: bool = row.get(0);
    assert!(
        !in_transaction,
        "the connection came back inside the replay's transaction"
    );
    proxy.arm(false);
    assert!(matches!(run(&engine, &call).await, Outcome::Replayed(_)));
    // A claim that claimed holds the key's row, which a claim that follows
    // at once must find free: its rollback waits for the answer. (The
    // replay's ROLLBACK has passed the proxy once its connection is back.)
    drop(store.pool().acquire().await.unwrap());
    proxy.arm(true);
    let claimed = fresh_claim(&engine, &fresh_call()).await;
    proxy
        .waits_for_release(
            async move { engine.abandon(claimed).await },
            "the rollback of a claim did not wait for its answer",
        )
        .await;
    assert_eq!(proxy.held(), 2);
}

/// A claim abandoned after the caller's query was cut off half-way (its
/// answer still owed on the connection) rolls back before the connection is
/// handed out again: the rollback waits for its answer there, since the
/// first thing the connection reads is the owed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_abandoned_after_a_query_cut_off_rolls_back() {
    let (store, engine) = on_one_connection(ClaimStrategy::InsertOnConflict).await;
    let call = fresh_call();
    let mut claimed = fresh_claim(&engine, &call).await;
    let cut = tokio::time::timeout(
        Duration::from_millis(20),
        sqlx::query("SELECT pg_sleep(0.3)").execute(&mut *claimed.tx),
    )
    .await;
    assert!(cut.is_err(), "the query was cut off before its answer");
    engine.abandon(claimed).await;
    assert!(connection_is_clean(store.pool()).await);
    assert!(matches!(run(&engine, &call).await, Outcome::Executed(_)));
    assert_eq!(effects(&store, call.key().as_str()).await, 1);
}
