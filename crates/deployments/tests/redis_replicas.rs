//! Redis with a replica: the lease conformance suite on a store whose
//! writes count only once the replica acknowledged them; such a write
//! refused while the replica is away; and a failover under load, the master
//! killed (SIGKILL) while its replica is paused and the replica promoted,
//! with and without acknowledgements, counting the effects that ran twice.
//! The same behind Sentinel: the suite through a `redis+sentinel://` URL,
//! the failover done by the sentinels themselves and followed by the store
//! that ran the workload, a forced failover under traffic, and URLs that
//! name no master refused at once.
//!
//! The long run: `DEPLOY_REDIS_SECONDS=10 cargo test -p deployments --test
//! redis_replicas -- --nocapture failover`.

#[path = "../../idem-redis/tests/support/subject.rs"]
mod subject;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use deployments::redis_cluster::RedisClusterReplicas;
use deployments::redis_replica::RedisReplicas;
use deployments::redis_sentinel::RedisSentinels;
use idem_conformance::lease_conformance;
use idem_core::{
    Acquire, BoxFuture, Call, Error, Fingerprint, IdempotencyKey, InFlight, LeaseEngine, LeaseStore, Policy, Record,
    Scope, StoreErrorKind,
};
use idem_redis::{RedisConnection, RedisStore};
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use subject::{Reach, RedisSubject};
use tokio::sync::OnceCell;

/// How long a write waits for its replica.
const ACK_WAIT: Duration = Duration::from_millis(300);

/// The deployment the conformance suite runs on, started once per process.
static SUITE_DEPLOYMENT: OnceCell<RedisReplicas> = OnceCell::const_new();
static SUITE_URL: OnceLock<String> = OnceLock::new();

async fn suite_url() -> String {
    let deployment = SUITE_DEPLOYMENT
        .get_or_init(|| async { RedisReplicas::start(1).await.expect("Redis master and replica") })
        .await;
    SUITE_URL.get_or_init(|| deployment.master_url()).clone()
}

/// The suite's store: the master, every write acknowledged by the replica.
type Replicated = RedisSubject<ConnectionManager>;

impl Reach for ConnectionManager {
    fn open() -> BoxFuture<'static, RedisStore<Self>> {
        Box::pin(async {
            let url = suite_url().await;
            acknowledging(RedisStore::connect(&url).await, "Redis master", &url)
        })
    }
}

/// A suite's store as it was `opened` at `url` (`what` is there), every
/// write acknowledged by the replica.
fn acknowledging<C>(opened: Result<RedisStore<C>, Error>, what: &str, url: &str) -> RedisStore<C> {
    opened
        .unwrap_or_else(|e| panic!("{what} at {url}: {e}"))
        .with_replica_acks(1, Duration::from_secs(2))
        .expect("a valid setting")
}

lease_conformance!(acknowledged_lease, Replicated::connect(None));

/// The Sentinel deployment the conformance suite runs on.
static SENTINEL_SUITE: OnceCell<RedisSentinels> = OnceCell::const_new();

async fn sentinel_suite_url() -> String {
    SENTINEL_SUITE
        .get_or_init(|| async { RedisSentinels::start(1).await.expect("Redis with sentinels") })
        .await
        .url()
}

/// The suite's store behind Sentinel: every write acknowledged by the
/// replica, the master found through the sentinels.
type BehindSentinel = RedisSubject<RedisConnection>;

impl Reach for RedisConnection {
    fn open() -> BoxFuture<'static, RedisStore<Self>> {
        Box::pin(async {
            let url = sentinel_suite_url().await;
            acknowledging(RedisStore::connect_any(&url).await, "Redis behind the sentinels", &url)
        })
    }
}

lease_conformance!(sentinel_lease, BehindSentinel::connect(None));

fn call(scope: &Scope, key: &IdempotencyKey, lease_ms: u64) -> Call {
    let fingerprint = Fingerprint::of_json(scope.operation(), br#"{"amount":1}"#).expect("valid JSON");
    Call::new(scope.clone(), key.clone(), fingerprint).with_policy(
        Policy::default()
            .with_lease_ms(lease_ms)
            .with_in_flight(InFlight::Reject),
    )
}

fn unique_scope() -> Scope {
    Scope::parse(&format!("tenant-{}", uuid::Uuid::now_v7().simple()), "payout").expect("a valid scope")
}

async fn store(url: &str, acks: bool) -> RedisStore<ConnectionManager> {
    let store = RedisStore::connect(url)
        .await
        .unwrap_or_else(|e| panic!("Redis at {url}: {e}"));
    workload(store, acks)
}

/// `store` on a prefix of its own, each write acknowledged by the replica
/// within [`ACK_WAIT`] if `acks`.
fn workload<C>(store: RedisStore<C>, acks: bool) -> RedisStore<C> {
    let store = store
        .with_prefix(&format!("deploy:{}", uuid::Uuid::now_v7().simple()))
        .expect("a valid prefix");
    if acks {
        store.with_replica_acks(1, ACK_WAIT).expect("a valid setting")
    } else {
        store
    }
}

/// While the replica is paused, a claim is applied on the master but
/// refused to its caller (no replica acknowledged it), a replay of a key
/// completed earlier still answers, and once the replica is back claims
/// count again.
#[tokio::test]
async fn a_write_no_replica_acknowledged_is_refused() {
    let deployment = RedisReplicas::start(1).await.expect("Redis master and replica");
    let engine = LeaseEngine::new(store(&deployment.master_url(), true).await);
    let scope = unique_scope();
    let done = IdempotencyKey::generate();
    let Acquire::Claimed(lease) = engine.acquire(&call(&scope, &done, 5_000)).await.expect("claim") else {
        panic!("a fresh key is claimed");
    };
    engine
        .complete(&lease, Record::completed(b"paid".to_vec()))
        .await
        .expect("complete");

    deployment.pause_replica(0);
    let fresh = IdempotencyKey::generate();
    let started = Instant::now();
    let refused = engine.acquire(&call(&scope, &fresh, 5_000)).await;
    let waited = started.elapsed();
    let replay = engine.acquire(&call(&scope, &done, 5_000)).await;
    deployment.resume_replica(0);

    let err = refused.expect_err("a claim no replica acknowledged is refused");
    assert_eq!(err.store_kind(), Some(StoreErrorKind::Unavailable), "{err}");
    assert!(err.to_string().contains("0 of the 1 replicas"), "{err}");
    assert!(waited >= ACK_WAIT, "the claim waited {waited:?} for its replica");
    let held = engine.lookup(&scope, &fresh).await.expect("lookup");
    assert!(held.is_some(), "the master holds the refused claim");
    assert!(
        matches!(replay, Ok(Acquire::Replay(ref r)) if r.payload == b"paid"),
        "a replay writes nothing and answers while the replica is away: {replay:?}"
    );
    match engine.acquire(&call(&scope, &fresh, 5_000)).await {
        Err(Error::InFlight { .. }) => {}
        other => panic!("the refused claim is in flight until its lease ends: {other:?}"),
    }
    let another = IdempotencyKey::generate();
    assert!(
        matches!(
            engine.acquire(&call(&scope, &another, 5_000)).await,
            Ok(Acquire::Claimed(_))
        ),
        "with the replica back, claims count again"
    );
}

/// What one failover run saw.
#[derive(Debug, Default)]
struct Run {
    ops: u64,
    acknowledged: u64,
    ops_per_sec: f64,
    lag_bytes_at_kill: i64,
    lost: u64,
    replayed: u64,
    ran_again: u64,
    held: u64,
    doubled: u64,
}

/// What the tasks of a workload share: the flag that stops them and what
/// they count.
#[derive(Default)]
struct Tally {
    stopped: AtomicBool,
    /// Effects run, per key.
    effects: Mutex<BTreeMap<String, u64>>,
    /// Keys tried.
    attempted: Mutex<Vec<IdempotencyKey>>,
    /// Keys whose outcome the store acknowledged.
    acknowledged: Mutex<Vec<IdempotencyKey>>,
    /// Calls that failed, and how.
    failures: Mutex<Vec<String>>,
}

impl Tally {
    /// Counts a run of `key`'s effect: answers whether it had run before.
    fn ran(&self, key: &IdempotencyKey) -> bool {
        let mut effects = self.effects.lock().unwrap();
        let count = effects.entry(key.as_str().to_owned()).or_default();
        *count += 1;
        *count > 1
    }

    fn failed(&self, how: String) {
        self.failures.lock().unwrap().push(how);
    }

    /// Keys whose effect ran.
    fn keys_run(&self) -> usize {
        self.effects.lock().unwrap().len()
    }

    /// Keys whose effect ran more than once.
    fn doubled(&self) -> usize {
        self.effects.lock().unwrap().values().filter(|n| **n > 1).count()
    }

    /// Stops the `workers`, each of which must end within `within`
    /// (`what` says why it would).
    async fn stop(&self, workers: Vec<tokio::task::JoinHandle<()>>, within: Duration, what: &str) {
        self.stopped.store(true, Ordering::Relaxed);
        for worker in workers {
            tokio::time::timeout(within, worker).await.expect(what).expect("worker");
        }
    }
}

/// How many of the `acknowledged` keys `engine` (on what is left after a
/// failover) does not hold as done.
async fn lost<S: LeaseStore>(engine: &LeaseEngine<S>, scope: &Scope, acknowledged: &[IdempotencyKey]) -> u64 {
    let mut lost = 0;
    for key in acknowledged {
        let row = engine.lookup(scope, key).await.expect("lookup on the promoted master");
        if !row.is_some_and(|row| matches!(row.state, idem_core::RowState::Done(_))) {
            lost += 1;
        }
    }
    lost
}

/// A deployment a failover run attacks.
trait Deployment {
    /// The connection of the store the workload runs on.
    type Conn: redis::aio::ConnectionLike + Clone + Send + Sync + 'static;
    /// A store on the deployment, with or without acknowledgements.
    async fn store(&self, acks: bool) -> RedisStore<Self::Conn>;
    /// Pauses a replica, kills its master, lets the replica take over;
    /// answers how far behind the replica was when its master died.
    async fn fail_over(&mut self) -> i64;
    /// A store on what is left (no acknowledgements: the promoted master has
    /// no replica), on `prefix`.
    async fn after(&self, prefix: &str) -> RedisStore<Self::Conn>;
}

impl Deployment for RedisReplicas {
    type Conn = ConnectionManager;

    async fn store(&self, acks: bool) -> RedisStore<ConnectionManager> {
        store(&self.master_url(), acks).await
    }

    async fn fail_over(&mut self) -> i64 {
        self.pause_replica(0);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let lag = self.lag_bytes().await.unwrap_or(-1);
        self.kill_master();
        self.resume_replica(0);
        self.promote(0).await.expect("promotion");
        lag
    }

    async fn after(&self, prefix: &str) -> RedisStore<ConnectionManager> {
        RedisStore::connect(&self.replica_url(0))
            .await
            .expect("the promoted replica")
            .with_prefix(prefix)
            .expect("prefix")
    }
}

/// A cluster and the master it fails over (with its replica).
struct ClusterFailover {
    cluster: RedisClusterReplicas,
    master: usize,
    replica: usize,
}

impl Deployment for ClusterFailover {
    type Conn = ClusterConnection;

    async fn store(&self, acks: bool) -> RedisStore<ClusterConnection> {
        let urls = self.cluster.urls();
        let seeds: Vec<&str> = urls.iter().map(String::as_str).collect();
        workload(RedisStore::connect_cluster(&seeds).await.expect("the cluster"), acks)
    }

    async fn fail_over(&mut self) -> i64 {
        self.cluster.pause(self.replica);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let lag = self.cluster.lag_bytes(self.master).unwrap_or(-1);
        self.cluster.kill(self.master);
        self.cluster.resume(self.replica);
        self.cluster
            .wait_master(self.replica, Duration::from_secs(30))
            .await
            .expect("the cluster promotes the replica");
        lag
    }

    async fn after(&self, prefix: &str) -> RedisStore<ClusterConnection> {
        let urls: Vec<String> = self
            .cluster
            .urls()
            .into_iter()
            .enumerate()
            .filter(|(i, _)| *i != self.master)
            .map(|(_, url)| url)
            .collect();
        let seeds: Vec<&str> = urls.iter().map(String::as_str).collect();
        RedisStore::connect_cluster(&seeds)
            .await
            .expect("the cluster after its failover")
            .with_prefix(prefix)
            .expect("prefix")
    }
}

/// Redis behind three sentinels. The store the workload ran on is the one
/// read after the failover: it must have followed the sentinels to the
/// promoted replica.
struct SentinelFailover {
    deployment: RedisSentinels,
    first: OnceLock<RedisStore<RedisConnection>>,
    old_master: u16,
    new_master: u16,
}

impl SentinelFailover {
    async fn start() -> Self {
        Self {
            deployment: RedisSentinels::start(1).await.expect("Redis with sentinels"),
            first: OnceLock::new(),
            old_master: 0,
            new_master: 0,
        }
    }
}

impl Deployment for SentinelFailover {
    type Conn = RedisConnection;

    async fn store(&self, acks: bool) -> RedisStore<RedisConnection> {
        let url = self.deployment.url();
        let store = RedisStore::connect_any(&url)
            .await
            .unwrap_or_else(|e| panic!("Redis behind the sentinels at {url}: {e}"));
        let store = workload(store, acks);
        let _ = self.first.set(store.clone());
        store
    }

    async fn fail_over(&mut self) -> i64 {
        let master = self
            .deployment
            .master_port()
            .await
            .expect("the sentinels name a master");
        let replica = *self
            .deployment
            .server_ports()
            .iter()
            .find(|p| **p != master)
            .expect("a replica");
        self.deployment.pause(replica);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let lag = self.deployment.lag_bytes(master).await.unwrap_or(-1);
        self.deployment.kill(master);
        let killed = Instant::now();
        self.deployment.resume(replica);
        self.old_master = master;
        self.new_master = self
            .deployment
            .wait_new_master(master, Duration::from_secs(60))
            .await
            .expect("the sentinels promote the replica");
        println!(
            "the sentinels named 127.0.0.1:{} {:?} after the kill of 127.0.0.1:{master}",
            self.new_master,
            killed.elapsed()
        );
        lag
    }

    async fn after(&self, prefix: &str) -> RedisStore<RedisConnection> {
        // The workload's own connection, without acknowledgements (the
        // promoted master has no replica left).
        let first = self.first.get().expect("the workload's store");
        RedisStore::new(first.connection().clone())
            .with_prefix(prefix)
            .expect("prefix")
    }
}

/// The failover: workers claim, mark sent, run the effect (counted per
/// key) and complete keys, 32 KiB outcomes each; then the deployment fails
/// over with its replica behind. Every acknowledged outcome is looked up on
/// what is left, and every key is tried again once the leases of the
/// claims in progress have run out.
async fn failover<D: Deployment>(deployment: &mut D, acks: bool, seconds: f64) -> Run {
    const LEASE_MS: u64 = 1_500;
    let first = deployment.store(acks).await;
    let prefix = first.prefix().to_owned();
    let engine = Arc::new(LeaseEngine::new(first));
    let scope = unique_scope();
    let tally = Arc::new(Tally::default());
    let payload = vec![b'x'; 32 * 1024];
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..8 {
        let (engine, scope, tally, payload) = (engine.clone(), scope.clone(), tally.clone(), payload.clone());
        workers.push(tokio::spawn(async move {
            while !tally.stopped.load(Ordering::Relaxed) {
                let key = IdempotencyKey::generate();
                tally.attempted.lock().unwrap().push(key.clone());
                let one = async {
                    let lease = match engine.acquire(&call(&scope, &key, LEASE_MS)).await {
                        Ok(Acquire::Claimed(lease)) => lease,
                        Ok(_) => return,
                        // No master yet (a store following Sentinel fails at
                        // once meanwhile): a client backs off.
                        Err(_) => return tokio::time::sleep(Duration::from_millis(50)).await,
                    };
                    if engine.mark_sent(&lease).await.is_err() {
                        return;
                    }
                    tally.ran(&key);
                    if engine
                        .complete(&lease, Record::completed(payload.clone()))
                        .await
                        .is_ok()
                    {
                        tally.acknowledged.lock().unwrap().push(key.clone());
                    }
                };
                if tokio::time::timeout(Duration::from_secs(8), one).await.is_err() {
                    return; // the master is gone and the driver still waits
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    let before = tally.acknowledged.lock().unwrap().len() as f64 / started.elapsed().as_secs_f64();
    let lag_bytes_at_kill = deployment.fail_over().await;
    tally
        .stop(
            workers,
            Duration::from_secs(30),
            "in-flight calls end once the master is gone",
        )
        .await;

    let promoted = LeaseEngine::new(deployment.after(&prefix).await);
    let acknowledged = tally.acknowledged.lock().unwrap().clone();
    let keys: Vec<IdempotencyKey> = tally.attempted.lock().unwrap().clone();
    let mut run = Run {
        ops: keys.len() as u64,
        acknowledged: acknowledged.len() as u64,
        ops_per_sec: before,
        lag_bytes_at_kill,
        lost: lost(&promoted, &scope, &acknowledged).await,
        ..Run::default()
    };
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 200)).await;
    for key in keys {
        match promoted.acquire(&call(&scope, &key, LEASE_MS)).await {
            Ok(Acquire::Replay(_)) => run.replayed += 1,
            Ok(Acquire::Claimed(lease)) => {
                if tally.ran(&key) {
                    run.ran_again += 1;
                }
                promoted
                    .complete(&lease, Record::completed(b"again".to_vec()))
                    .await
                    .expect("complete after the failover");
            }
            // An unknown outcome (a sent mark whose lease ran out): held for
            // reconcile, never run blindly.
            Err(_) => run.held += 1,
        }
    }
    run.doubled = tally.doubled() as u64;
    run
}

fn print_runs(runs: &[(&str, &Run)]) {
    println!(
        "| replica acks | ops | acknowledged | ops/s before the failover | replica behind at the kill (bytes) | acknowledged lost | replayed | ran again | held (unknown) | effects doubled |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (name, run) in runs {
        println!(
            "| {name} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} |",
            run.ops,
            run.acknowledged,
            run.ops_per_sec,
            run.lag_bytes_at_kill,
            run.lost,
            run.replayed,
            run.ran_again,
            run.held,
            run.doubled
        );
    }
}

/// The verdicts every failover pair must meet.
fn judge(unsafe_run: &Run, safe_run: &Run) {
    for run in [unsafe_run, safe_run] {
        assert!(run.acknowledged > 0, "the workload ran: {run:?}");
        assert!(
            run.lag_bytes_at_kill > 0,
            "the replica was behind when the master died: {run:?}"
        );
    }
    assert!(
        unsafe_run.lost > 0 && unsafe_run.doubled > 0,
        "without acknowledgements the failover loses acknowledged outcomes and runs keys again: {unsafe_run:?}"
    );
    assert_eq!(safe_run.lost, 0, "{safe_run:?}");
    assert_eq!(safe_run.doubled, 0, "{safe_run:?}");
}

fn seconds() -> f64 {
    std::env::var("DEPLOY_REDIS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.5)
}

/// Without acknowledgements, a failover to a replica that was behind loses
/// outcomes and sent marks the master had acknowledged, and their keys run
/// again; with them, nothing acknowledged is lost and nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_with_and_without_replica_acks() {
    let seconds = seconds();
    let mut plain = RedisReplicas::start(1).await.expect("Redis master and replica");
    let unsafe_run = failover(&mut plain, false, seconds).await;
    let mut acknowledged = RedisReplicas::start(1).await.expect("Redis master and replica");
    let safe_run = failover(&mut acknowledged, true, seconds).await;
    println!("A master and its replica, the replica promoted by REPLICAOF NO ONE:");
    print_runs(&[("none", &unsafe_run), ("1, 300 ms", &safe_run)]);
    judge(&unsafe_run, &safe_run);
}

/// The same on a Redis Cluster (three masters with a replica each) that
/// fails over by itself: the cluster client follows the promotion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_with_and_without_replica_acks() {
    let seconds = seconds();
    let mut runs = Vec::new();
    for acks in [false, true] {
        let cluster = RedisClusterReplicas::start()
            .await
            .expect("a Redis Cluster with replicas");
        let (master, replica) = cluster.a_master_and_its_replica().expect("roles");
        let mut deployment = ClusterFailover {
            cluster,
            master,
            replica,
        };
        runs.push(failover(&mut deployment, acks, seconds).await);
    }
    println!("A Redis Cluster, one master of three killed, its replica promoted by the cluster:");
    print_runs(&[("none", &runs[0]), ("1, 300 ms", &runs[1])]);
    judge(&runs[0], &runs[1]);
}

/// Behind Sentinel, the failover is the sentinels' own: the master killed
/// while its replica is paused, the replica promoted once they agree. The
/// store the workload ran on follows them to the promoted replica; without
/// acknowledgements it has lost outcomes and keys run again, with them
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_with_and_without_replica_acks() {
    let seconds = seconds();
    let mut runs = Vec::new();
    for acks in [false, true] {
        let mut deployment = SentinelFailover::start().await;
        runs.push(failover(&mut deployment, acks, seconds).await);
        let conn = deployment
            .first
            .get()
            .expect("the workload's store")
            .connection()
            .clone();
        let RedisConnection::Sentinel(sentinel) = conn else {
            panic!("a redis+sentinel:// URL gives a Sentinel connection");
        };
        assert_eq!(
            sentinel.master().as_deref(),
            Some(format!("127.0.0.1:{}", deployment.new_master).as_str()),
            "the store follows the sentinels from 127.0.0.1:{} to the promoted replica",
            deployment.old_master
        );
        assert!(sentinel.discoveries() >= 2, "{} discoveries", sentinel.discoveries());
    }
    println!("A master and its replica behind three sentinels, the master killed, the replica promoted by them:");
    print_runs(&[("none", &runs[0]), ("1, 300 ms", &runs[1])]);
    judge(&runs[0], &runs[1]);
}

/// A failover the sentinels are told to make (`SENTINEL FAILOVER`) while
/// calls run, every write acknowledged by the replica. The old master still
/// runs: it takes no acknowledged write once its replica is promoted, and
/// the store leaves it as soon as the sentinels name the new master (their
/// watch), not when they demote it seconds later. Calls fail as unavailable
/// meanwhile; once the old master serves as the new one's replica, keys
/// are claimed and completed again, and no effect runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_follows_a_forced_failover() {
    let deployment = RedisSentinels::start(1).await.expect("Redis with sentinels");
    let old = deployment.master_port().await.expect("a master");
    let store = workload(
        RedisStore::connect_any(&deployment.url()).await.expect("the store"),
        true,
    );
    let engine = Arc::new(LeaseEngine::new(store.clone()));
    let scope = unique_scope();
    let tally = Arc::new(Tally::default());
    let mut workers = Vec::new();
    for _ in 0..4 {
        let (engine, scope, tally) = (engine.clone(), scope.clone(), tally.clone());
        workers.push(tokio::spawn(async move {
            while !tally.stopped.load(Ordering::Relaxed) {
                let key = IdempotencyKey::generate();
                // Each key until it is done, as a client retrying would.
                for _ in 0..200 {
                    match engine.acquire(&call(&scope, &key, 60_000)).await {
                        Ok(Acquire::Claimed(lease)) => {
                            tally.ran(&key);
                            match engine.complete(&lease, Record::completed(b"ok".to_vec())).await {
                                Ok(_) => {
                                    tally.acknowledged.lock().unwrap().push(key.clone());
                                    break;
                                }
                                Err(e) => tally.failed(format!("complete: {e}")),
                            }
                        }
                        Ok(Acquire::Replay(_)) => break,
                        Err(e) if e.store_kind() == Some(StoreErrorKind::Unavailable) => {
                            tally.failed(format!("acquire: {e}"));
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        // A claim whose answer was lost is in flight until
                        // its lease ends: this key is given up, counted.
                        Err(e) => {
                            tally.failed(format!("given up: {e}"));
                            break;
                        }
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    deployment.force_failover().await.expect("SENTINEL FAILOVER");
    let new = deployment
        .wait_new_master(old, Duration::from_secs(60))
        .await
        .expect("the sentinels promote the replica");
    let switched = Instant::now();
    let done_before = tally.keys_run();
    let RedisConnection::Sentinel(sentinel) = store.connection().clone() else {
        panic!("a Sentinel connection");
    };
    // Within a few of the watch's rounds: the sentinels demote the old
    // master (which cuts its clients off) only 8 s or more later.
    let followed = tokio::time::timeout(idem_redis::WATCH_INTERVAL * 4, async {
        while sentinel.master() != Some(format!("127.0.0.1:{new}")) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        switched.elapsed()
    })
    .await;
    // Calls go on until keys complete on the promoted master (its replica,
    // the old master, is back within about ten seconds).
    let _ = tokio::time::timeout(Duration::from_secs(40), async {
        while tally.keys_run() < done_before + 50 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let resumed = switched.elapsed();
    tally.stop(workers, Duration::from_secs(60), "workers end").await;
    // Every outcome the store acknowledged, before and after the failover,
    // is on the promoted master.
    let acknowledged = tally.acknowledged.lock().unwrap().clone();
    let lost = lost(&engine, &scope, &acknowledged).await;
    let keys_run = tally.keys_run();
    let doubled = tally.doubled();
    let failures = tally.failures.lock().unwrap();
    println!(
        "forced failover 127.0.0.1:{old} -> 127.0.0.1:{new}: {} keys run, {} before the new master was named; \
         the store followed after {followed:?}, keys completed again after {resumed:?}; {} failed calls \
         ({:?}), {} effects doubled, {} discoveries; {lost} of {} acknowledged outcomes lost",
        keys_run,
        done_before,
        failures.len(),
        failures.iter().take(3).collect::<Vec<_>>(),
        doubled,
        sentinel.discoveries(),
        acknowledged.len()
    );
    assert_eq!(lost, 0, "every acknowledged outcome is on the promoted master");
    assert!(
        followed.is_ok(),
        "the store follows the sentinels to 127.0.0.1:{new}: it is on {:?}",
        sentinel.master()
    );
    assert_eq!(doubled, 0, "no effect runs twice");
    assert!(
        keys_run >= done_before + 50,
        "keys are claimed and completed on the promoted master: {} before, {} after",
        done_before,
        keys_run
    );
}

/// The deployment check reads the master the sentinels name (and its
/// replica), as the gateway does at start.
#[tokio::test]
async fn the_deployment_check_reads_the_master_the_sentinels_name() {
    let url = sentinel_suite_url().await;
    let master = SENTINEL_SUITE
        .get()
        .expect("started")
        .master_port()
        .await
        .expect("a master");
    let store = RedisStore::connect_any(&url).await.expect("the store");
    let warnings = store.check_deployment().await.expect("no eviction policy");
    // The servers keep nothing on disk: the check says so, of the master
    // the sentinels name, and reads the replica's policy without a warning.
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains(&format!("master 127.0.0.1:{master}")) && warnings[0].contains("appendonly"),
        "{warnings:?}"
    );
}

/// Connects through the sentinels of `url`, asserting that the answer,
/// a store or a refusal, came within `bound`.
async fn connect_within(url: &str, bound: Duration) -> Result<RedisStore<RedisConnection>, Error> {
    let started = Instant::now();
    let connected = RedisStore::connect_any(url).await;
    let took = started.elapsed();
    let answer = if connected.is_ok() { "connected" } else { "refused" };
    assert!(took < bound, "{answer} in {took:?}");
    connected
}

/// A Sentinel URL that names no master is refused at once, saying why: a
/// service the sentinels do not watch, sentinels that do not answer.
#[tokio::test]
async fn sentinel_urls_that_name_no_master_are_refused() {
    let url = sentinel_suite_url().await;
    let unknown = url.replace("/idem", "/payments");
    let e = RedisStore::connect_any(&unknown).await.expect_err("no such service");
    assert_eq!(e.store_kind(), Some(StoreErrorKind::Unavailable), "{e}");
    assert!(e.to_string().contains("knows no service \"payments\""), "{e}");

    let dead = format!(
        "redis+sentinel://:s3cret@127.0.0.1:{},127.0.0.1:{}/idem",
        deployments::process::free_port(),
        deployments::process::free_port()
    );
    let e = connect_within(&dead, Duration::from_secs(10))
        .await
        .expect_err("no sentinel answers");
    assert_eq!(e.store_kind(), Some(StoreErrorKind::Unavailable), "{e}");
    assert!(e.to_string().contains("no master for service \"idem\""), "{e}");
    assert!(!e.to_string().contains("s3cret"), "{e}");

    // A sentinel that takes connections and never answers delays a search
    // by the lookup bound at most (the sentinels are asked at once), and
    // alone fails within it.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
    let silent_at = silent.local_addr().expect("its address");
    let with_silent = url.replace("redis+sentinel://", &format!("redis+sentinel://{silent_at},"));
    connect_within(&with_silent, idem_redis::LOOKUP_TIMEOUT * 2)
        .await
        .expect("the answering sentinels suffice");
    let e = connect_within(
        &format!("redis+sentinel://{silent_at}/idem"),
        idem_redis::LOOKUP_TIMEOUT * 2,
    )
    .await
    .expect_err("a silent sentinel names nothing");
    let said = e.to_string();
    assert!(
        said.contains(&format!("sentinel {silent_at}")) && (said.contains("timed out") || said.contains("no answer")),
        "{said}"
    );
    drop(silent);

    let e = RedisStore::connect_any("redis+sentinel://127.0.0.1:1")
        .await
        .expect_err("no service");
    assert!(
        matches!(e, Error::Config(_)) && e.to_string().contains("no service name"),
        "{e}"
    );
}
