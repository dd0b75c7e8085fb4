//! The lease and operator conformance suites against a 3-master Redis
//! Cluster that this test starts itself on loopback ports (redis-server and
//! redis-cli from the machine), and stops. It fails loudly if the cluster
//! cannot start.

#[path = "support/servers.rs"]
mod servers;

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use idem_conformance::{Subject, admin_tests, lease_tests, sent_tests};
use idem_core::{BoxError, BoxFuture};
use idem_memory::{MemoryStore, MemoryTx};
use idem_redis::RedisStore;
use redis::cluster_async::ClusterConnection;
use servers::RedisCluster;

static NODES: Mutex<Vec<String>> = Mutex::new(Vec::new());
static EFFECTS: LazyLock<Arc<Mutex<HashMap<String, u64>>>> = LazyLock::new(Default::default);

#[derive(Clone)]
struct ClusterRedis {
    memory: MemoryStore,
    store: RedisStore<ClusterConnection>,
}

impl ClusterRedis {
    async fn connect(prefix: Option<&str>) -> Self {
        let nodes: Vec<String> = NODES.lock().unwrap().clone();
        let refs: Vec<&str> = nodes.iter().map(String::as_str).collect();
        let store = RedisStore::connect_cluster(&refs)
            .await
            .expect("connect to the cluster");
        let prefix = prefix
            .map(str::to_owned)
            .unwrap_or_else(|| format!("idemtest:{}", uuid::Uuid::now_v7().simple()));
        Self {
            memory: MemoryStore::default(),
            store: store.with_prefix(&prefix).unwrap(),
        }
    }
}

impl Subject for ClusterRedis {
    type Backend = MemoryStore;
    type Lease = RedisStore<ClusterConnection>;
    type Sweeper = RedisStore<ClusterConnection>;

    fn backend(&self) -> MemoryStore {
        self.memory.clone()
    }
    fn lease_store(&self) -> Self::Lease {
        self.store.clone()
    }
    fn sweeper(&self) -> Self::Sweeper {
        self.store.clone()
    }
    fn write_effect<'c>(tx: &'c mut MemoryTx, effect_id: String) -> BoxFuture<'c, Result<(), BoxError>> {
        Box::pin(async move {
            let effects = EFFECTS.clone();
            tx.on_commit(move || *effects.lock().unwrap().entry(effect_id).or_default() += 1);
            Ok(())
        })
    }
    fn count_effects(&self, effect_id: String) -> BoxFuture<'_, Result<u64, BoxError>> {
        Box::pin(async move { Ok(EFFECTS.lock().unwrap().get(&effect_id).copied().unwrap_or(0)) })
    }
    fn another(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            let other = ClusterRedis::connect(Some(self.store.prefix())).await;
            Self {
                memory: self.memory.clone(),
                store: other.store,
            }
        })
    }
    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(ClusterRedis::connect(None))
    }
}

macro_rules! run_all {
    ($rt:expr, $ran:expr, $failures:expr, $suite:ident; $($name:ident),* $(,)?) => {
        $(
            let outcome = $rt.block_on(async {
                tokio::spawn(async { $suite::$name(ClusterRedis::connect(None).await).await }).await
            });
            $ran += 1;
            match outcome {
                Ok(()) => println!("test redis_cluster::{} ... ok", stringify!($name)),
                Err(e) => {
                    println!("test redis_cluster::{} ... FAILED: {e}", stringify!($name));
                    $failures.push(stringify!($name));
                }
            }
        )*
    };
}

fn main() {
    let cluster = RedisCluster::start();
    *NODES.lock().unwrap() = cluster.urls();
    println!("redis cluster: 3 masters on ports {:?}", cluster.ports);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let mut failures: Vec<&str> = Vec::new();
    let mut ran = 0;
    run_all!(rt, ran, failures, lease_tests;
        lease_claim_complete_replay,
        lease_mismatch,
        lease_release_leaves_key_unused,
        lease_error_releases_and_panic_holds_the_key,
        lease_live_claim_is_in_flight,
        lease_twin_waits_then_replays,
        lease_takeover_after_expiry,
        lease_stale_holder_is_fenced,
        lease_extend_keeps_the_claim,
        lease_extend_outlives_the_key_ttl,
        lease_final_rejection_recorded_when_policy_says,
        lease_tenant_and_operation_isolation,
        lease_expired_key_executes_anew,
        lease_sweep_deletes_expired,
        lease_concurrent_64_tasks_one_key_one_effect,
        lease_heartbeat_keeps_a_slow_holder,
        lease_lost_heartbeat_is_reported,
        lease_outcome_recorded_after_a_drop,
        lease_skewed_host_cannot_take_over,
        lease_abandoned_claim_is_released,
    );
    run_all!(rt, ran, failures, sent_tests;
        sent_claim_is_never_taken_over,
        sent_mark_keeps_the_earliest_time,
        sent_mark_of_a_new_claim_starts_afresh,
        sent_claim_resolved_like_unknown,
        sent_claim_holder_extends_and_releases,
        sent_dropped_run_is_held_not_taken_over,
        sent_refused_completion_is_retried,
        sent_refused_release_is_retried,
        sent_refused_mark_runs_nothing,
    );
    run_all!(rt, ran, failures, admin_tests;
        purge_spares_keys_claimed_during_the_purge,
        find_key_is_exact,
        stats_count_keys_by_state,
        list_and_purge_follow_every_filter,
    );
    // The keys really spread over the three masters.
    let spread = cluster.keys_per_master();
    println!("keys per master: {spread:?}");
    drop(rt);
    drop(cluster);
    if spread.iter().filter(|n| **n > 0).count() < 3 {
        println!("keys did not reach every master: {spread:?}");
        std::process::exit(1);
    }
    if !failures.is_empty() {
        println!("test result: FAILED. {} failed: {failures:?}", failures.len());
        std::process::exit(1);
    }
    println!("test result: ok. {ran} passed; 0 failed");
}
