//! The lease conformance suite against a 3-master Redis Cluster that this
//! test starts itself on loopback ports (redis-server and redis-cli from
//! the machine), and stops. It fails loudly if the cluster cannot start.

use std::collections::HashMap;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use idem_conformance::{Subject, lease_tests};
use idem_core::{BoxError, BoxFuture};
use idem_memory::{MemoryStore, MemoryTx};
use idem_redis::RedisStore;
use redis::cluster_async::ClusterConnection;

struct Cluster {
    nodes: Vec<Child>,
    ports: Vec<u16>,
    dir: std::path::PathBuf,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            let _ = n.kill();
            let _ = n.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port_pair() -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("a free port");
        let port = l.local_addr().unwrap().port();
        drop(l);
        // The cluster bus listens on port + 10000.
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

fn start_cluster() -> Cluster {
    let dir = std::env::temp_dir().join(format!("idem-redis-cluster-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cluster = Cluster {
        nodes: Vec::new(),
        ports: Vec::new(),
        dir: dir.clone(),
    };
    for i in 0..3 {
        let port = free_port_pair();
        let node_dir = dir.join(format!("n{i}"));
        std::fs::create_dir_all(&node_dir).unwrap();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--appendonly",
                "yes",
                "--maxmemory-policy",
                "noeviction",
                "--save",
                "",
            ])
            .current_dir(&node_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server (install redis-server): {e}"));
        cluster.nodes.push(child);
        cluster.ports.push(port);
    }
    for port in &cluster.ports {
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", *port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server on {port} did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let addrs: Vec<String> = cluster.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let out = Command::new("redis-cli")
        .arg("--cluster")
        .arg("create")
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run redis-cli: {e}"));
    assert!(
        out.status.success(),
        "redis-cli --cluster create failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = cluster.ports.iter().all(|p| {
            Command::new("redis-cli")
                .args(["-p", &p.to_string(), "cluster", "info"])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("cluster_state:ok"))
        });
        if ok {
            break;
        }
        assert!(Instant::now() < deadline, "the cluster did not reach cluster_state:ok");
        std::thread::sleep(Duration::from_millis(100));
    }
    cluster
}

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
    ($rt:expr, $failures:expr; $($name:ident),* $(,)?) => {
        $(
            let outcome = $rt.block_on(async {
                tokio::spawn(async { lease_tests::$name(ClusterRedis::connect(None).await).await }).await
            });
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
    let cluster = start_cluster();
    *NODES.lock().unwrap() = cluster.ports.iter().map(|p| format!("redis://127.0.0.1:{p}")).collect();
    println!("redis cluster: 3 masters on ports {:?}", cluster.ports);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let mut failures: Vec<&str> = Vec::new();
    run_all!(rt, failures;
        lease_claim_complete_replay,
        lease_mismatch,
        lease_release_leaves_key_unused,
        lease_error_and_panic_release_the_key,
        lease_live_claim_is_in_flight,
        lease_twin_waits_then_replays,
        lease_takeover_after_expiry,
        lease_stale_holder_is_fenced,
        lease_extend_keeps_the_claim,
        lease_final_rejection_recorded_when_policy_says,
        lease_tenant_and_operation_isolation,
        lease_expired_key_executes_anew,
        lease_sweep_deletes_expired,
        lease_concurrent_64_tasks_one_key_one_effect,
        lease_heartbeat_keeps_a_slow_holder,
        lease_lost_heartbeat_is_reported,
        lease_dropped_work_keeps_the_key_until_expiry,
        lease_outcome_recorded_after_a_drop,
        lease_skewed_host_cannot_take_over,
        lease_abandoned_claim_is_released,
    );
    // The keys really spread over the three masters.
    let spread: Vec<usize> = cluster
        .ports
        .iter()
        .map(|p| {
            let out = Command::new("redis-cli")
                .args(["-p", &p.to_string(), "dbsize"])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0)
        })
        .collect();
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
    println!("test result: ok. 20 passed; 0 failed");
}
