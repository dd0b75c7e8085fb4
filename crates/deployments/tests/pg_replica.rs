//! A PostgreSQL primary with a streaming replica, started by each test on
//! loopback ports of its own (see `deployments::pg_replica`):
//!
//! - the transactional and lease conformance suites through `PgStore` on a
//!   primary whose replica is synchronous (`synchronous_commit = on`);
//! - failover by promotion under load, in each mode (async, sync on,
//!   remote_apply): the acknowledged keys the promoted server lost, and what
//!   a retry of every key sent then does.
//!
//! The failover's size comes from the environment: `DEPLOY_PG_OPS`
//! (acknowledged calls before the crash, default 400), `DEPLOY_PG_WORKERS`
//! (concurrent callers, default 8) and `DEPLOY_PG_STALL_OPS` (calls
//! acknowledged while the async replica's stream is stalled, default 100).
//! Run `cargo test -p deployments --test pg_replica failover -- --nocapture`
//! for the figures alone.

#[path = "../../idem-postgres/tests/effects/mod.rs"]
mod effects;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use deployments::pg_replica::{Mode, PgPair, parse_lsn};
use idem_conformance::{Subject, lease_conformance, tx_conformance};
use idem_core::{BoxError, BoxFuture, Call, Error, Fingerprint, IdempotencyKey, Scope, TableName, TxEngine};
use idem_postgres::{PgStore, PgTx};
use sqlx::Row;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

// ---------------------------------------------------------------------------
// The conformance suites on the primary of a synchronous pair.
// ---------------------------------------------------------------------------

/// The pair every conformance test shares, started by the first test that
/// needs it and kept for the life of the test process (its watcher stops it
/// and removes its directory once the process has gone).
fn shared_pair() -> &'static PgPair {
    static PAIR: OnceLock<Result<PgPair, String>> = OnceLock::new();
    let pair = PAIR.get_or_init(|| {
        // A runtime of its own on a thread of its own: the caller's runtime
        // cannot be blocked on from inside, and the pair holds no handle on
        // any runtime once started.
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let started = Instant::now();
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("a runtime");
                    let pair = runtime.block_on(PgPair::start(Mode::SyncOn));
                    if pair.is_ok() {
                        println!(
                            "pg_replica: sync pair for the conformance suite started in {:?}",
                            started.elapsed()
                        );
                    }
                    pair
                })
                .join()
                .expect("the starting thread")
        })
    });
    pair.as_ref()
        .unwrap_or_else(|e| panic!("the PostgreSQL primary and replica did not start: {e}"))
}

/// The keys table every conformance test shares; tests use unique tenants.
const SHARED_TABLE: &str = "idem_conformance_keys";

/// The conformance subject: a `PgStore` on the primary.
#[derive(Clone)]
struct Primary {
    store: PgStore,
    url: String,
}

impl Primary {
    async fn connect() -> Self {
        let url = shared_pair().primary_url();
        effects::create_table(&open_pool(&url, 2).await).await;
        let store = PgStore::new(open_pool(&url, 8).await).with_table(TableName::new(SHARED_TABLE).unwrap());
        store.migrate().await.expect("migrate the shared keys table");
        Self { store, url }
    }
}

/// A small pool of its own on `url`: sqlx pools cannot cross the runtimes of
/// `#[tokio::test]`s.
async fn open_pool(url: &str, max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot open a pool on {url}: {e}"))
}

impl Subject for Primary {
    idem_conformance::one_store_subject!(PgStore);

    fn write_effect<'c>(tx: &'c mut PgTx, effect_id: String) -> BoxFuture<'c, Result<(), BoxError>> {
        effects::write(tx, effect_id)
    }

    fn count_effects(&self, effect_id: String) -> BoxFuture<'_, Result<u64, BoxError>> {
        effects::count(self.store.pool(), effect_id)
    }

    fn another(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            let store = PgStore::new(open_pool(&self.url, 8).await).with_table(self.store.table().clone());
            Self {
                store,
                url: self.url.clone(),
            }
        })
    }

    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            // The pair's database is new with every test process: nothing to
            // clean up from earlier runs.
            let table = TableName::new(format!("idem_iso_{}", uuid::Uuid::now_v7().simple())).unwrap();
            let store = PgStore::new(self.store.pool().clone()).with_table(table);
            store.migrate().await.expect("migrate an isolated keys table");
            Self {
                store,
                url: self.url.clone(),
            }
        })
    }
}

tx_conformance!(sync_replica_tx, Primary::connect());
lease_conformance!(sync_replica_lease, Primary::connect());

/// The suites above really ran against a primary with a synchronous
/// standby: the replica streams, is `sync`, and has the suite's keys table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_primary_has_a_synchronous_replica() {
    let pair = shared_pair();
    let subject = Primary::connect().await;
    let state = pair.replication().await.unwrap().expect("a connected replica");
    assert_eq!(
        (state.state.as_str(), state.sync_state.as_str()),
        ("streaming", "sync"),
        "{state:?}"
    );
    let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(subject.store.pool())
        .await
        .unwrap();
    assert_eq!(setting, "on");
    // A commit acknowledged by the primary is on the replica.
    let id = format!("probe-{}", uuid::Uuid::now_v7());
    sqlx::query("INSERT INTO idem_conformance_effects (effect_id) VALUES ($1)")
        .bind(&id)
        .execute(subject.store.pool())
        .await
        .unwrap();
    let replica = open_pool(&pair.replica_url(), 1).await;
    let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&replica)
        .await
        .unwrap();
    assert!(in_recovery, "the replica is a standby");
    // `on` waits for the replica's flush, not its replay: poll briefly.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_conformance_effects WHERE effect_id = $1")
            .bind(&id)
            .fetch_one(&replica)
            .await
            .unwrap();
        if n == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the replica never applied the probe row");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------
// What sqlx 0.9 offers for failover.
// ---------------------------------------------------------------------------

/// sqlx 0.9's `PgConnectOptions` reaches one host: a libpq multi-host URL is
/// refused, and `target_session_attrs` is ignored (it parses, with a logged
/// warning, and changes nothing), so a client follows a promotion by opening a
/// pool on the new primary's address (or through a proxy or DNS name that
/// moves with it).
#[test]
fn sqlx_reaches_one_host_per_pool() {
    let multi = "postgres://postgres@127.0.0.1:5433,127.0.0.1:5434/postgres".parse::<PgConnectOptions>();
    assert!(multi.is_err(), "a multi-host URL parsed: {multi:?}");
    let attrs: PgConnectOptions = "postgres://postgres@127.0.0.1:5433/postgres?target_session_attrs=read-write"
        .parse()
        .expect("target_session_attrs is accepted");
    let plain: PgConnectOptions = "postgres://postgres@127.0.0.1:5433/postgres".parse().unwrap();
    assert_eq!(
        format!("{attrs:?}"),
        format!("{plain:?}"),
        "target_session_attrs changed the options"
    );
}

// ---------------------------------------------------------------------------
// Failover by promotion under load.
// ---------------------------------------------------------------------------

/// How a call made before the crash ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// `execute` returned `Ok`: the caller was told it committed.
    Acked,
    /// `execute` returned an error.
    Failed,
    /// `execute` did not end within [`CALL_TIMEOUT`].
    Hung,
}

/// A key a caller sent.
#[derive(Debug, Clone)]
struct Sent {
    key: String,
    fate: Fate,
    started: Instant,
    ended: Instant,
}

/// Bounds every call: one that takes longer hangs.
const CALL_TIMEOUT: Duration = Duration::from_secs(15);

/// The scope of every failover call.
fn failover_scope() -> Scope {
    Scope::parse("tenant-failover", "POST /v1/transfers").unwrap()
}

/// The call of `key`, the same before and after the failover.
fn call_of(scope: &Scope, key: &str) -> Call {
    let body = format!(r#"{{"key":"{key}","amount":100}}"#);
    let fingerprint = Fingerprint::of_json(scope.operation(), body.as_bytes()).unwrap();
    Call::new(scope.clone(), IdempotencyKey::new(key).unwrap(), fingerprint)
}

/// Runs `key`'s call: the business row (the effect) is written in the
/// transaction that records the key. `ran` counts the runs of the work.
async fn transfer(engine: &TxEngine<PgStore>, scope: &Scope, key: &str, ran: &AtomicUsize) -> Result<bool, Error> {
    let call = call_of(scope, key);
    let outcome = engine
        .execute(&call, |tx| {
            let key = key.to_owned();
            ran.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                sqlx::query("INSERT INTO transfers (idem_key, amount) VALUES ($1, 100)")
                    .bind(key)
                    .execute(&mut **tx)
                    .await
                    .map_err(idem_postgres::store_error)?;
                Ok::<i64, Error>(100)
            })
        })
        .await?;
    Ok(!outcome.is_replayed())
}

/// The figures of one mode's failover.
#[derive(Debug)]
struct Figures {
    mode: Mode,
    ops: usize,
    acked: usize,
    lost: usize,
    in_flight: usize,
    hung: usize,
    retried: usize,
    replayed: usize,
    ran_again: usize,
    doubled: usize,
    ops_per_s: f64,
    behind_bytes: u64,
    stall_acked: usize,
    start_ms: u128,
    promote_ms: u128,
}

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v} is not a number")),
        Err(_) => default,
    }
}

/// One mode's failover: load, (async: stall the stream), crash, promote,
/// check, retry every key, check again.
async fn failover(mode: Mode, target_acks: usize, workers: usize, stall_acks: usize) -> Figures {
    let starting = Instant::now();
    let mut pair = PgPair::start(mode).await.unwrap_or_else(|e| panic!("{mode}: {e}"));
    let start_ms = starting.elapsed().as_millis();
    let pool = PgPoolOptions::new()
        .max_connections(workers as u32 + 2)
        // A call that starts after the crash fails once no new connection
        // came within this; the pool never waits for a connection before it,
        // having one more than there are workers.
        .acquire_timeout(Duration::from_secs(1))
        .connect(&pair.primary_url())
        .await
        .expect("a pool on the primary");
    let store = PgStore::new(pool.clone());
    store.migrate().await.expect("migrate");
    // No unique constraint: a second run of a key's work would be counted.
    sqlx::query("CREATE TABLE transfers (idem_key TEXT NOT NULL, amount BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let engine = TxEngine::new(store);
    let scope = failover_scope();
    let acked = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let runs = Arc::new(AtomicUsize::new(0));

    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..workers {
        let (engine, scope, acked, stop, runs) =
            (engine.clone(), scope.clone(), acked.clone(), stop.clone(), runs.clone());
        let mode_tag = mode.name().replace(' ', "_");
        tasks.push(tokio::spawn(async move {
            let mut sent = Vec::new();
            let mut n = 0usize;
            while !stop.load(Ordering::SeqCst) {
                let key = format!("{mode_tag}-{worker}-{n}");
                n += 1;
                let call_started = Instant::now();
                let fate = match tokio::time::timeout(CALL_TIMEOUT, transfer(&engine, &scope, &key, &runs)).await {
                    Ok(Ok(_)) => {
                        acked.fetch_add(1, Ordering::SeqCst);
                        Fate::Acked
                    }
                    Ok(Err(_)) => Fate::Failed,
                    Err(_) => Fate::Hung,
                };
                sent.push(Sent {
                    key,
                    fate,
                    started: call_started,
                    ended: Instant::now(),
                });
            }
            sent
        }));
    }
    let wait_for = |count: usize| {
        let acked = acked.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(300);
            while acked.load(Ordering::SeqCst) < count {
                assert!(
                    Instant::now() < deadline,
                    "{mode}: {count} acknowledged calls never came"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    };
    wait_for(target_acks).await;
    let load_acked = acked.load(Ordering::SeqCst);
    let ops_per_s = load_acked as f64 / started.elapsed().as_secs_f64();

    let mut stalled_from = None;
    if mode == Mode::Async {
        // The replica falls behind: every commit from here on is acknowledged
        // by the primary alone and never reaches the replica.
        pair.stall_replication().await.expect("stall the stream");
        let from = acked.load(Ordering::SeqCst);
        stalled_from = Some(from);
        wait_for(from + stall_acks).await;
    }
    // Through the workers' pool, whose spare connection is open: no
    // connection set up between this reading and the crash.
    let primary_lsn: String = sqlx::query_scalar("SELECT pg_current_wal_flush_lsn()::text")
        .fetch_one(&pool)
        .await
        .expect("the primary's LSN");
    let primary_lsn = parse_lsn(&primary_lsn).unwrap();
    let crashed_at = Instant::now();
    pair.kill_primary();
    stop.store(true, Ordering::SeqCst);
    let stall_acked = stalled_from.map_or(0, |from| acked.load(Ordering::SeqCst) - from);
    let mut sent: Vec<Sent> = Vec::new();
    for task in tasks {
        sent.extend(task.await.expect("a worker"));
    }
    pool.close().await;
    let received_lsn = pair.replica_received_lsn().await.expect("the replica's LSN");
    let behind_bytes = primary_lsn.saturating_sub(received_lsn);
    let promote = pair.promote().await.unwrap_or_else(|e| panic!("{mode}: promote: {e}"));
    if promote > Duration::from_secs(2) {
        // Rare; the replica's log says where the time went.
        let log = std::fs::read_to_string(pair.dir().join("r.log")).unwrap_or_default();
        println!("{mode}: the promotion took {promote:?}; the replica's log:\n{log}");
    }

    let in_flight = sent
        .iter()
        .filter(|s| s.started < crashed_at && s.ended > crashed_at)
        .count();
    let hung = sent.iter().filter(|s| s.fate == Fate::Hung).count();
    assert_eq!(
        hung, 0,
        "{mode}: calls in flight at the crash must end with an error, not hang"
    );
    let acked_keys: HashSet<&str> = sent
        .iter()
        .filter(|s| s.fate == Fate::Acked)
        .map(|s| s.key.as_str())
        .collect();

    // The promoted server, before any retry: key rows and business rows
    // committed together, or neither did.
    let promoted = open_pool(&pair.replica_url(), workers as u32 + 2).await;
    let key_rows: HashSet<String> = sqlx::query("SELECT idem_key FROM idem_keys WHERE tenant = $1 AND status = 1")
        .bind(scope.tenant().as_str())
        .fetch_all(&promoted)
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    let all_key_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_keys")
        .fetch_one(&promoted)
        .await
        .unwrap();
    assert_eq!(
        all_key_rows as usize,
        key_rows.len(),
        "{mode}: a key row that is not completed"
    );
    let effects = effects_per_key(&promoted).await;
    let effect_keys: HashSet<String> = effects.keys().cloned().collect();
    assert_eq!(
        key_rows.difference(&effect_keys).count(),
        0,
        "{mode}: key rows without their business row"
    );
    assert_eq!(
        effect_keys.difference(&key_rows).count(),
        0,
        "{mode}: business rows without their key row"
    );
    assert!(
        effects.values().all(|n| *n == 1),
        "{mode}: a key's effect twice before the retries"
    );
    let lost: HashSet<&str> = acked_keys.iter().copied().filter(|k| !key_rows.contains(*k)).collect();

    // The callers reconnect to the promoted server and retry every key they
    // sent, with the same key and request.
    let engine = TxEngine::new(PgStore::new(promoted.clone()));
    let keys: Vec<String> = sent.iter().map(|s| s.key.clone()).collect();
    let mut retries = Vec::new();
    for chunk in keys.chunks(keys.len().div_ceil(workers).max(1)) {
        let (engine, scope, chunk) = (engine.clone(), scope.clone(), chunk.to_vec());
        retries.push(tokio::spawn(async move {
            let runs = AtomicUsize::new(0);
            let mut executed = Vec::new();
            for key in chunk {
                let ran = tokio::time::timeout(CALL_TIMEOUT, transfer(&engine, &scope, &key, &runs))
                    .await
                    .unwrap_or_else(|_| panic!("the retry of {key} hung"))
                    .unwrap_or_else(|e| panic!("the retry of {key} failed: {e}"));
                if ran {
                    executed.push(key);
                }
            }
            (executed, runs.load(Ordering::SeqCst))
        }));
    }
    let mut ran_again_keys = HashSet::new();
    let mut retry_runs = 0;
    for retry in retries {
        let (executed, runs) = retry.await.expect("a retrying caller");
        ran_again_keys.extend(executed);
        retry_runs += runs;
    }
    // A replay never starts the work, not even to roll it back.
    assert_eq!(
        retry_runs,
        ran_again_keys.len(),
        "{mode}: work started for a replayed key"
    );
    let effects = effects_per_key(&promoted).await;
    let doubled = effects.values().filter(|n| **n > 1).count();
    assert_eq!(doubled, 0, "{mode}: a key's effect applied twice");
    for key in &keys {
        assert_eq!(
            effects.get(key),
            Some(&1),
            "{mode}: {key} has no effect after its retry"
        );
    }
    for key in &lost {
        assert!(
            ran_again_keys.contains(*key),
            "{mode}: lost key {key} did not run again"
        );
    }
    for key in acked_keys.difference(&lost) {
        assert!(!ran_again_keys.contains(*key), "{mode}: surviving key {key} ran again");
    }
    // Every key that survived replays; only keys missing on the promoted
    // server run again.
    for key in &ran_again_keys {
        assert!(
            !key_rows.contains(key),
            "{mode}: {key} was on the promoted server yet ran again"
        );
    }
    promoted.close().await;

    Figures {
        mode,
        ops: sent.len(),
        acked: acked_keys.len(),
        lost: lost.len(),
        in_flight,
        hung,
        retried: keys.len(),
        replayed: keys.len() - ran_again_keys.len(),
        ran_again: ran_again_keys.len(),
        doubled,
        ops_per_s,
        behind_bytes,
        stall_acked,
        start_ms,
        promote_ms: promote.as_millis(),
    }
}

/// The committed rows of `transfers`, counted per key.
async fn effects_per_key(pool: &PgPool) -> HashMap<String, i64> {
    sqlx::query("SELECT idem_key, count(*) FROM transfers GROUP BY idem_key")
        .fetch_all(pool)
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Failover by promotion under load, in each mode: the synchronous modes
/// lose no acknowledged key; async loses the keys acknowledged while its
/// replica was behind (measured, and asserted to be more than none); a retry
/// of every key sent runs each key's effect exactly once in the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_by_promotion_per_mode() {
    let target = env_usize("DEPLOY_PG_OPS", 400);
    let workers = env_usize("DEPLOY_PG_WORKERS", 8);
    let stall = env_usize("DEPLOY_PG_STALL_OPS", 100);
    println!(
        "pg_replica failover: {target} acknowledged calls before the crash, {workers} workers, async stall {stall}"
    );
    let mut rows = Vec::new();
    for mode in Mode::ALL {
        let started = Instant::now();
        let figures = failover(mode, target, workers, stall).await;
        println!("{mode}: {figures:?} ({:?})", started.elapsed());
        rows.push(figures);
    }
    println!();
    println!(
        "| mode | ops run | acked | lost | in flight at crash | hung | retried | replayed | ran again | doubled | ops/s before crash | replica behind (bytes) | start (ms) | promote (ms) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for f in &rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {} | {} | {} |",
            f.mode,
            f.ops,
            f.acked,
            f.lost,
            f.in_flight,
            f.hung,
            f.retried,
            f.replayed,
            f.ran_again,
            f.doubled,
            f.ops_per_s,
            f.behind_bytes,
            f.start_ms,
            f.promote_ms
        );
    }
    for f in &rows {
        assert_eq!(f.doubled, 0, "{}: doubled effects", f.mode);
        if f.mode.is_synchronous() {
            assert_eq!(f.lost, 0, "{}: acknowledged keys lost", f.mode);
        } else {
            // The attack happened: the replica was behind at the crash, and the
            // keys acknowledged during the stall are gone.
            assert!(f.behind_bytes > 0, "async: the replica was not behind at the crash");
            assert!(
                f.stall_acked >= stall,
                "async: the stall saw {} acknowledged calls",
                f.stall_acked
            );
            assert!(f.lost > 0, "async: no acknowledged key lost despite the stall");
            // Only a call whose commit record was written before the stall
            // (one per worker at most) may be acknowledged during it and survive.
            assert!(
                f.lost + workers >= f.stall_acked,
                "async: {} lost of {} acknowledged during the stall",
                f.lost,
                f.stall_acked
            );
        }
    }
}
