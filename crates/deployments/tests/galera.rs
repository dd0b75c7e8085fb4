//! idem on a three-node MariaDB Galera cluster, writes spread over every node:
//! the conformance suites with each test's twin store on another node, twins
//! of one key claimed on different nodes, a node killed (SIGKILL) mid-run and
//! rejoined, and the named-lock claim strategy.
//!
//! One cluster serves every part, in sequence, in one test (a cluster takes
//! about 12 s to start). Sizes come from the environment, with small
//! defaults: `DEPLOY_GALERA_TWIN_KEYS` (30), `DEPLOY_GALERA_TWINS_PER_NODE`
//! (3), `DEPLOY_GALERA_KILL_KEYS` (20000, the most keys the kill run may
//! start in its fixed time), `DEPLOY_GALERA_SYNC_WAIT` (3: the
//! `wsrep_sync_wait` every connection of idem's pools sets; 0 runs without
//! it) and `DEPLOY_GALERA_RETRY_AUTOCOMMIT` (10: the nodes'
//! `wsrep_retry_autocommit`; the server's default is 1).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use deployments::galera::Galera;
use idem_conformance::{Runs, Subject, TestError, call_for, unique_scope, waiting};
use idem_core::{BoxError, BoxFuture, IdempotencyKey, Outcome, StoreErrorKind, TableName, TxEngine};
use idem_mysql::{ClaimStrategy, MySqlStore, MySqlTx};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{Connection, MySqlPool};
use tokio::sync::Semaphore;

/// The business rows. A surrogate primary key (Galera certifies rows by
/// their primary key) and no unique constraint on `effect_id`, so a double
/// write would be counted rather than refused.
const EFFECTS_TABLE: &str = "galera_effects";
/// The keys table the conformance suite and the attacks share (tests use
/// unique scopes).
const KEYS_TABLE: &str = "galera_keys";

/// An environment variable's number, or `default`.
fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The `wsrep_sync_wait` idem's connections set: 3 (reads, updates and
/// deletes wait for causality) unless the environment says otherwise.
fn sync_wait() -> u8 {
    u8::try_from(env_or("DEPLOY_GALERA_SYNC_WAIT", 3)).expect("wsrep_sync_wait is 0 to 15")
}

/// A pool on `url` whose connections run REPEATABLE READ (InnoDB's
/// default, said aloud) and `wsrep_sync_wait = sync_wait`: with 1 or more a read
/// first waits until this node has applied every write set the cluster
/// had committed when the read began, so a read on one node sees what a
/// commit on another node acknowledged.
async fn pool(url: &str, sync_wait: u8, max: u32) -> MySqlPool {
    let set = format!("SET SESSION tx_isolation = 'REPEATABLE-READ', SESSION wsrep_sync_wait = {sync_wait}");
    MySqlPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(3))
        .after_connect(move |conn, _meta| {
            let set = set.clone();
            Box::pin(async move {
                sqlx::Executor::execute(&mut *conn, sqlx::AssertSqlSafe(set)).await?;
                Ok(())
            })
        })
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach the Galera node at {url}: {e}"))
}

/// Writes the business row `id` inside `tx`.
async fn write_effect(tx: &mut MySqlTx, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {EFFECTS_TABLE} (effect_id) VALUES (?)"
    )))
    .bind(id)
    .execute(&mut **tx)
    .await
    .map(drop)
}

/// How many business rows named `id` node `pool` holds.
async fn effects(pool: &MySqlPool, id: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {EFFECTS_TABLE} WHERE effect_id = ?"
    )))
    .bind(id)
    .fetch_one(pool)
    .await
}

/// A store under test: the keys table through a pool on one node; its
/// twin store ([`Subject::another`]) is on the next node.
#[derive(Clone)]
struct GaleraSubject {
    store: MySqlStore,
    urls: Arc<Vec<String>>,
    node: usize,
    sync_wait: u8,
}

impl Subject for GaleraSubject {
    idem_conformance::one_store_subject!(MySqlStore);

    fn write_effect<'c>(tx: &'c mut MySqlTx, effect_id: String) -> BoxFuture<'c, Result<(), BoxError>> {
        Box::pin(async move {
            write_effect(tx, &effect_id).await.map_err(idem_mysql::store_error)?;
            Ok(())
        })
    }

    fn count_effects(&self, effect_id: String) -> BoxFuture<'_, Result<u64, BoxError>> {
        Box::pin(async move { Ok(u64::try_from(effects(self.store.pool(), &effect_id).await?)?) })
    }

    fn another(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            let node = (self.node + 1) % self.urls.len();
            Self {
                store: MySqlStore::new(pool(&self.urls[node], self.sync_wait, 8).await)
                    .with_table(self.store.table().clone())
                    .with_claim_strategy(self.store.claim_strategy()),
                urls: self.urls.clone(),
                node,
                sync_wait: self.sync_wait,
            }
        })
    }

    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            let table = TableName::new(format!("galera_iso_{}", uuid::Uuid::new_v4().simple())).unwrap();
            let store = MySqlStore::new(self.store.pool().clone())
                .with_table(table)
                .with_claim_strategy(self.store.claim_strategy());
            store.migrate().await.expect("migrate an isolated keys table");
            Self { store, ..self.clone() }
        })
    }
}

/// One conformance test: its name and the function that runs it.
type Case = (
    &'static str,
    fn(GaleraSubject) -> Pin<Box<dyn Future<Output = ()> + Send>>,
);

/// The cases of `$module` named in the list, as [`Case`]s (the callback of
/// `idem_conformance`'s behaviour lists).
macro_rules! cases_of {
    ($module:ident; $($name:ident),* $(,)?) => {
        vec![$((
            concat!(stringify!($module), "::", stringify!($name)),
            (|s: GaleraSubject| -> Pin<Box<dyn Future<Output = ()> + Send>> {
                Box::pin(idem_conformance::$module::$name(s))
            }) as fn(GaleraSubject) -> Pin<Box<dyn Future<Output = ()> + Send>>,
        )),*]
    };
}

/// Every case the cluster runs: the transactional suite (the list of
/// `tx_conformance!`), the lease suite (`lease_conformance!`'s) and the
/// operator's suite.
fn conformance_cases() -> Vec<Case> {
    let mut cases: Vec<Case> = idem_conformance::tx_behaviours!([cases_of] tx_tests);
    cases.extend(idem_conformance::lease_behaviours!([cases_of] lease_tests));
    cases.extend(idem_conformance::unknown_outcome_behaviours!([cases_of] lease_tests));
    cases.extend(idem_conformance::sent_behaviours!([cases_of] sent_tests));
    cases.extend(idem_conformance::admin_behaviours!([cases_of] admin_tests));
    cases
}

/// The conformance suites on the cluster, four tests at a time; answers the
/// names of the tests that failed (each runs in a task of its own, so a
/// failure does not hide the others).
async fn conformance(galera: &Galera, sync_wait: u8) -> (usize, Vec<String>) {
    let urls = Arc::new((0..galera.len()).map(|i| galera.url(i)).collect::<Vec<_>>());
    let base = GaleraSubject {
        store: MySqlStore::new(pool(&urls[0], sync_wait, 8).await)
            .with_table(TableName::new(KEYS_TABLE).unwrap())
            .with_claim_strategy(ClaimStrategy::Placeholder),
        urls,
        node: 0,
        sync_wait,
    };
    let cases = conformance_cases();
    let total = cases.len();
    let slots = Arc::new(Semaphore::new(4));
    let mut running = Vec::new();
    for (name, case) in cases {
        let subject = base.clone();
        let slot = slots.clone().acquire_owned().await.unwrap();
        running.push((
            name,
            tokio::spawn(async move {
                let _slot = slot;
                tokio::time::timeout(Duration::from_secs(60), case(subject)).await
            }),
        ));
    }
    let mut failed = Vec::new();
    for (name, handle) in running {
        match handle.await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => failed.push(format!("{name} (timed out after 60 s)")),
            Err(e) => {
                let why = e
                    .try_into_panic()
                    .ok()
                    .and_then(|p| {
                        p.downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    })
                    .unwrap_or_default();
                failed.push(format!("{name}: {}", why.lines().next().unwrap_or("")));
            }
        }
    }
    (total, failed)
}

/// Sums a status counter over every node.
async fn status_sum(galera: &Galera, name: &str) -> u64 {
    let mut sum = 0;
    for i in 0..galera.len() {
        sum += galera.status(i, name).await.unwrap().parse::<u64>().unwrap_or(0);
    }
    sum
}

/// Certification failures and brute-force aborts, over every node.
async fn conflicts(galera: &Galera) -> u64 {
    status_sum(galera, "wsrep_local_cert_failures").await + status_sum(galera, "wsrep_local_bf_aborts").await
}

/// What a run of twins saw.
#[derive(Debug, Default)]
struct Tally {
    keys: usize,
    tasks: usize,
    work_runs: usize,
    executed: usize,
    replayed: usize,
    errors: usize,
    conflicts: u64,
    effects: usize,
}

/// Whether an error seen by a client is one idem classifies as retryable
/// (contention or an unavailable server), and its kind.
fn kind_of(e: &TestError) -> String {
    match e {
        TestError::Idem(e) => format!("{:?}", e.store_kind()),
        TestError::Work(w) => format!("work: {w}"),
    }
}

/// Twins on different nodes: `keys` keys, each run by `per_node` tasks on
/// every node at once through `TxEngine::execute`, under `strategy`. Every
/// task retries its key (on the same node) until it gets an outcome; the
/// errors it saw are counted by kind.
async fn twins(
    galera: &Galera,
    pools: &[MySqlPool],
    strategy: ClaimStrategy,
    keys: usize,
    per_node: usize,
) -> (Tally, HashMap<String, usize>) {
    let table = TableName::new(KEYS_TABLE).unwrap();
    let before = conflicts(galera).await;
    let runs = Runs::default();
    let executed = Arc::new(AtomicUsize::new(0));
    let replayed = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(std::sync::Mutex::new(HashMap::<String, usize>::new()));
    let scope = unique_scope("twins");
    let mut effect_ids = Vec::new();
    let mut tasks = Vec::new();
    for k in 0..keys {
        let key = IdempotencyKey::generate();
        let effect_id = format!("twins-{k}-{}", uuid::Uuid::new_v4().simple());
        effect_ids.push(effect_id.clone());
        let call = call_for(&scope, &key, &format!("{{\"k\":{k}}}"), waiting(20_000));
        for pool in pools {
            for _ in 0..per_node {
                let store = MySqlStore::new(pool.clone())
                    .with_table(table.clone())
                    .with_claim_strategy(strategy);
                let (call, effect_id, runs) = (call.clone(), effect_id.clone(), runs.clone());
                let (executed, replayed, errors) = (executed.clone(), replayed.clone(), errors.clone());
                tasks.push(tokio::spawn(async move {
                    let engine = TxEngine::new(store);
                    for _ in 0..50 {
                        let result = engine
                            .execute(&call, |tx| {
                                let (effect_id, runs) = (effect_id.clone(), runs.clone());
                                Box::pin(async move {
                                    runs.hit();
                                    write_effect(tx, &effect_id).await.map_err(idem_mysql::store_error)?;
                                    Ok::<_, TestError>(effect_id)
                                })
                            })
                            .await;
                        match result {
                            Ok(Outcome::Executed(_)) => {
                                executed.fetch_add(1, Ordering::SeqCst);
                                return;
                            }
                            Ok(Outcome::Replayed(_)) => {
                                replayed.fetch_add(1, Ordering::SeqCst);
                                return;
                            }
                            Err(e) => {
                                *errors.lock().unwrap().entry(kind_of(&e)).or_default() += 1;
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                        }
                    }
                    panic!("a twin got no outcome in 50 attempts");
                }));
            }
        }
    }
    let task_count = tasks.len();
    for task in tasks {
        task.await.expect("a twin task failed");
    }
    let errors = errors.lock().unwrap().clone();
    let mut tally = Tally {
        keys,
        tasks: task_count,
        work_runs: runs.get(),
        executed: executed.load(Ordering::SeqCst),
        replayed: replayed.load(Ordering::SeqCst),
        errors: errors.values().sum(),
        conflicts: conflicts(galera).await - before,
        effects: 0,
    };
    // Every node, read after the cluster's commits (wsrep_sync_wait on
    // these pools), holds exactly one business row per key.
    for (node, pool) in pools.iter().enumerate() {
        let mut total = 0;
        for id in &effect_ids {
            let n = effects(pool, id).await.unwrap();
            assert_eq!(n, 1, "key {id} has {n} effects on node {}", node + 1);
            total += 1;
        }
        tally.effects = total;
    }
    (tally, errors)
}

/// Galera's certification failure surfaces at `COMMIT` as error 1213: two
/// transactions insert the same row on nodes 1 and 2; the second commit
/// loses. idem must classify it as a deadlock (contention: run again).
async fn certification_failure_kind(pools: &[MySqlPool]) -> String {
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS galera_probe (id INT PRIMARY KEY, v INT)")
        .execute(&pools[0])
        .await
        .unwrap();
    let id: i32 = rand_id();
    let mut a = pools[0].begin().await.unwrap();
    let mut b = pools[1].begin().await.unwrap();
    sqlx::query("INSERT INTO galera_probe VALUES (?, 1)")
        .bind(id)
        .execute(&mut *a)
        .await
        .unwrap();
    sqlx::query("INSERT INTO galera_probe VALUES (?, 2)")
        .bind(id)
        .execute(&mut *b)
        .await
        .unwrap();
    a.commit().await.expect("the first commit certifies");
    let lost = b
        .commit()
        .await
        .expect_err("the second commit of the same row must fail certification");
    classified(
        lost,
        (1213, StoreErrorKind::Deadlock),
        ("contention", idem_core::Error::is_contention),
    )
}

/// A node cut off from the others (`gmcast.isolate=1`: a non-primary
/// component of one) refuses queries on data with error 1047 ("WSREP has
/// not yet prepared node for application use"), as a node that is not yet
/// synced does. idem must classify it as unavailable (retryable, elsewhere
/// or later). The node is left isolated: this runs last.
async fn isolated_node_kind(galera: &Galera) -> String {
    let mut node3 = sqlx::mysql::MySqlConnection::connect(&galera.url(2)).await.unwrap();
    sqlx::raw_sql("SET GLOBAL wsrep_provider_options = 'gmcast.isolate=1'")
        .execute(&mut node3)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let refused = loop {
        match sqlx::query("SELECT COUNT(*) FROM galera_probe")
            .execute(&mut node3)
            .await
        {
            Err(e) => break e,
            Ok(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
            Ok(_) => panic!("node 3, isolated, still answered after 20 s"),
        }
    };
    classified(
        refused,
        (1047, StoreErrorKind::Unavailable),
        ("retryable", idem_core::Error::is_retryable),
    )
}

/// Asserts that `error` is the MySQL error `number` that idem maps to
/// `kind`, and `what` ("contention", "retryable") as `is` tells; answers
/// the report's row: `1213 -> Some(Deadlock) (contention: true)`.
fn classified(
    error: sqlx::Error,
    (number, kind): (u16, StoreErrorKind),
    (what, is): (&str, fn(&idem_core::Error) -> bool),
) -> String {
    let got = error_number(&error);
    let mapped = idem_mysql::store_error(error);
    assert_eq!(got, number, "{mapped}");
    assert_eq!(mapped.store_kind(), Some(kind), "{mapped}");
    assert!(is(&mapped), "error {number} must be {what}: {mapped}");
    format!("{got} -> {:?} ({what}: {})", mapped.store_kind(), is(&mapped))
}

/// The MySQL error number of a driver error (0 if it has none).
fn error_number(e: &sqlx::Error) -> u16 {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map_or(0, sqlx::mysql::MySqlDatabaseError::number),
        _ => 0,
    }
}

/// A random positive id for a probe row.
fn rand_id() -> i32 {
    i32::try_from(uuid::Uuid::new_v4().as_u128() % 1_000_000_000).unwrap()
}

/// What the kill run saw.
#[derive(Debug, Default)]
struct KillTally {
    ops: usize,
    acknowledged: usize,
    errors: usize,
    errors_on_killed: usize,
    rejoin: String,
    rejoin_ms: u128,
    evicted_ms: u128,
    stall_ms: u128,
    effects: usize,
    duplicates: usize,
}

/// A node killed (SIGKILL) mid-run and rejoined: six clients, two starting
/// on each node, run fresh keys, each key by two clients that start on
/// different nodes; a client that meets an error moves to the next node and
/// retries the same key. After a second of traffic node 3 is killed; 1.5 s
/// later it is restarted, and traffic runs a second more once it has
/// rejoined. Keys nobody started are not counted.
async fn kill_and_rejoin(galera: &mut Galera, pools: &[MySqlPool]) -> KillTally {
    let cap = env_or("DEPLOY_GALERA_KILL_KEYS", 20_000);
    let table = TableName::new(KEYS_TABLE).unwrap();
    let scope = unique_scope("kill");
    let killed = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let acknowledged = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let errors_on_killed = Arc::new(AtomicUsize::new(0));
    let ops = Arc::new(AtomicUsize::new(0));
    // The longest time no client got an acknowledgement: how long the
    // cluster stalled.
    let gap = Arc::new(std::sync::Mutex::new((Instant::now(), Duration::ZERO)));
    let calls: Arc<Vec<(idem_core::Call, String)>> = Arc::new(
        (0..cap)
            .map(|k| {
                let call = call_for(
                    &scope,
                    &IdempotencyKey::generate(),
                    &format!("{{\"k\":{k}}}"),
                    waiting(20_000),
                );
                (call, format!("kill-{k}-{}", uuid::Uuid::new_v4().simple()))
            })
            .collect(),
    );
    // Client c runs every key k with k % 3 == c % 3, so each key has two
    // clients, c and c + 3, which start on nodes c % 3 and (c + 1) % 3.
    let mut clients = Vec::new();
    for c in 0..6 {
        let stores: Vec<MySqlStore> = pools
            .iter()
            .map(|p| MySqlStore::new(p.clone()).with_table(table.clone()))
            .collect();
        let gap = gap.clone();
        let (calls, killed, stop, acknowledged, errors, errors_on_killed, ops) = (
            calls.clone(),
            killed.clone(),
            stop.clone(),
            acknowledged.clone(),
            errors.clone(),
            errors_on_killed.clone(),
            ops.clone(),
        );
        clients.push(tokio::spawn(async move {
            let mut node = if c < 3 { c % 3 } else { (c + 1) % 3 };
            let mut acked = Vec::new();
            for (k, (call, effect_id)) in calls.iter().enumerate() {
                if k % 3 != c % 3 {
                    continue;
                }
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let mut attempts = 0;
                loop {
                    attempts += 1;
                    assert!(attempts < 500, "key {k} got no outcome in 500 attempts");
                    ops.fetch_add(1, Ordering::SeqCst);
                    let engine = TxEngine::new(stores[node].clone());
                    let result = engine
                        .execute(call, |tx| {
                            let effect_id = effect_id.clone();
                            Box::pin(async move {
                                write_effect(tx, &effect_id).await.map_err(idem_mysql::store_error)?;
                                Ok::<_, TestError>(effect_id)
                            })
                        })
                        .await;
                    match result {
                        Ok(_) => {
                            acknowledged.fetch_add(1, Ordering::SeqCst);
                            let mut gap = gap.lock().unwrap();
                            gap.1 = gap.1.max(gap.0.elapsed());
                            gap.0 = Instant::now();
                            drop(gap);
                            acked.push(k);
                            break;
                        }
                        Err(_) => {
                            errors.fetch_add(1, Ordering::SeqCst);
                            if node == 2 && killed.load(Ordering::SeqCst) {
                                errors_on_killed.fetch_add(1, Ordering::SeqCst);
                            }
                            node = (node + 1) % 3;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            }
            acked
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let acked_at_kill = acknowledged.load(Ordering::SeqCst);
    killed.store(true, Ordering::SeqCst);
    galera.kill(2);
    // The survivors go on once they have evicted the dead node (after
    // `evs.suspect_timeout`, 5 s by default): until then no commit
    // certifies anywhere.
    let killed_at = Instant::now();
    galera.wait_synced().await.unwrap_or_else(|e| panic!("{e}"));
    let evicted_ms = killed_at.elapsed().as_millis();
    let started = Instant::now();
    let rejoin = galera.restart(2).await.unwrap_or_else(|e| panic!("{e}"));
    let rejoin_ms = started.elapsed().as_millis();
    let acked_at_rejoin = acknowledged.load(Ordering::SeqCst);
    println!(
        "  kill: {acked_at_kill} acknowledgements before the kill, {} more until node 3 was Synced again ({rejoin} in {rejoin_ms} ms)",
        acked_at_rejoin - acked_at_kill
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    let mut acked = Vec::new();
    for client in clients {
        acked.extend(client.await.expect("a client failed"));
    }
    assert!(
        acked_at_rejoin < acked.len(),
        "traffic must still run after the node rejoined (all {} acknowledged before)",
        acked.len()
    );
    assert!(
        errors_on_killed.load(Ordering::SeqCst) > 0,
        "clients must have met the killed node ({} errors in all)",
        errors.load(Ordering::SeqCst)
    );
    assert!(acked.len() < 2 * cap, "traffic must have run until told to stop");
    // Every acknowledged key: exactly one business row and one completed key
    // row, on every node (wsrep_sync_wait on these pools); no business
    // row of the run twice.
    acked.sort_unstable();
    acked.dedup();
    let mut duplicates = 0;
    for (node, pool) in pools.iter().enumerate() {
        let effect_rows: HashMap<String, i64> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT effect_id, COUNT(*) FROM {EFFECTS_TABLE} WHERE effect_id LIKE 'kill-%' GROUP BY effect_id"
        )))
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
        let key_rows: HashMap<Vec<u8>, i64> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT idem_key, COUNT(*) FROM {KEYS_TABLE} WHERE tenant = ? AND operation = ? AND status = {} GROUP BY idem_key",
            idem_core::STATUS_COMPLETED
        )))
        .bind(scope.tenant().as_str().as_bytes())
        .bind(scope.operation().as_str().as_bytes())
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
        duplicates += effect_rows.values().filter(|&&n| n > 1).count();
        assert_eq!(duplicates, 0, "node {}: a business row written twice", node + 1);
        for &k in &acked {
            let (call, effect_id) = &calls[k];
            let effects = effect_rows.get(effect_id).copied().unwrap_or(0);
            let rows = key_rows.get(call.key().as_str().as_bytes()).copied().unwrap_or(0);
            assert_eq!(
                (effects, rows),
                (1, 1),
                "key {k} on node {}: effects, completed rows",
                node + 1
            );
        }
    }
    KillTally {
        ops: ops.load(Ordering::SeqCst),
        acknowledged: acked.len(),
        errors: errors.load(Ordering::SeqCst),
        errors_on_killed: errors_on_killed.load(Ordering::SeqCst),
        rejoin: rejoin.to_string(),
        rejoin_ms,
        evicted_ms,
        stall_ms: gap.lock().unwrap().1.as_millis(),
        effects: acked.len(),
        duplicates,
    }
}

/// Every guarantee of idem on a Galera cluster, on one cluster, in
/// sequence: the conformance suites, twins on different nodes, the
/// named-lock strategy and a node killed and rejoined.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn galera_cluster() {
    let sync_wait = sync_wait();
    let mut timings: Vec<(&str, u128)> = Vec::new();
    let started = Instant::now();
    let retry_autocommit = env_or("DEPLOY_GALERA_RETRY_AUTOCOMMIT", 10);
    let settings = [format!("--wsrep-retry-autocommit={retry_autocommit}")];
    let mut galera = Galera::start_with(3, &settings).await.unwrap_or_else(|e| panic!("{e}"));
    timings.push(("cluster start (3 nodes)", started.elapsed().as_millis()));
    let mut pools = Vec::new();
    for i in 0..galera.len() {
        pools.push(pool(&galera.url(i), sync_wait, 32).await);
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (
            id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
            effect_id VARCHAR(255) NOT NULL,
            KEY effect_id_idx (effect_id)
        ) ENGINE=InnoDB"
    )))
    .execute(&pools[0])
    .await
    .expect("create the effects table");
    MySqlStore::new(pools[0].clone())
        .with_table(TableName::new(KEYS_TABLE).unwrap())
        .migrate()
        .await
        .expect("migrate the keys table on node 1");

    println!(
        "galera (wsrep_sync_wait = {}, wsrep_retry_autocommit = {retry_autocommit}): started in {} ms",
        sync_wait,
        started.elapsed().as_millis()
    );

    // 1. A certification failure, as idem sees it.
    println!(
        "  certification failure at COMMIT: {}",
        certification_failure_kind(&pools).await
    );

    // 2. The conformance suites, each test's twin store on another node.
    let t = Instant::now();
    let (total, failed) = conformance(&galera, sync_wait).await;
    timings.push(("conformance suites", t.elapsed().as_millis()));
    println!("  conformance: {} of {total} passed", total - failed.len());
    for f in &failed {
        println!("    FAILED {f}");
    }

    // 3. Twins of one key on different nodes, then 4. the named-lock
    // strategy (GET_LOCK is local to a node).
    let keys = env_or("DEPLOY_GALERA_TWIN_KEYS", 30);
    let per_node = env_or("DEPLOY_GALERA_TWINS_PER_NODE", 3);
    let mut runs = Vec::new();
    for (name, strategy, keys) in [
        ("twins, placeholder", ClaimStrategy::Placeholder, keys),
        ("twins, named lock", ClaimStrategy::NamedLock, keys / 3 + 1),
    ] {
        let t = Instant::now();
        let (tally, errors) = twins(&galera, &pools, strategy, keys, per_node).await;
        timings.push((name, t.elapsed().as_millis()));
        println!(
            "  {name}: keys {} tasks {} work runs {} executed {} replayed {} errors {} conflicts {} effects {} (errors by kind: {errors:?})",
            tally.keys,
            tally.tasks,
            tally.work_runs,
            tally.executed,
            tally.replayed,
            tally.errors,
            tally.conflicts,
            tally.effects
        );
        runs.push((name, tally));
    }

    // 5. A node killed mid-run and rejoined.
    let t = Instant::now();
    let kill = kill_and_rejoin(&mut galera, &pools).await;
    timings.push(("kill and rejoin", t.elapsed().as_millis()));
    println!(
        "  kill: ops {} acknowledged keys {} errors {} (on the killed node {}) evicted after {} ms, longest stall {} ms, rejoin by {} in {} ms, effects {} duplicates {}",
        kill.ops,
        kill.acknowledged,
        kill.errors,
        kill.errors_on_killed,
        kill.evicted_ms,
        kill.stall_ms,
        kill.rejoin,
        kill.rejoin_ms,
        kill.effects,
        kill.duplicates
    );
    // 6. A node that is not part of the primary component, as idem sees it.
    let t = Instant::now();
    println!("  query on an isolated node: {}", isolated_node_kind(&galera).await);
    timings.push(("isolated node", t.elapsed().as_millis()));

    println!("  {:<26} {:>8}", "part", "ms");
    for (name, ms) in &timings {
        println!("  {name:<26} {ms:>8}");
    }

    assert!(failed.is_empty(), "conformance tests failed on Galera: {failed:#?}");
    for (name, t) in &runs {
        assert_eq!(t.executed, t.keys, "{name}: one execution per key");
        assert_eq!(t.executed + t.replayed, t.tasks, "{name}: every twin got an outcome");
        assert_eq!(t.effects, t.keys, "{name}: one effect per key");
    }
    assert!(
        runs[0].1.conflicts > 0,
        "the twins must have raced into certification conflicts"
    );
    assert_eq!(kill.duplicates, 0);
}
