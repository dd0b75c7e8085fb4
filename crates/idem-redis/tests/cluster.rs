//! The lease and operator conformance suites against a 3-master Redis
//! Cluster that this test starts itself on loopback ports (redis-server and
//! redis-cli from the machine), and stops. It fails loudly if the cluster
//! cannot start.

#[path = "support/servers.rs"]
mod servers;

#[path = "support/subject.rs"]
mod subject;

use std::sync::Mutex;

use idem_conformance::{admin_tests, lease_tests, sent_tests};
use idem_core::BoxFuture;
use idem_redis::RedisStore;
use redis::cluster_async::ClusterConnection;
use servers::RedisCluster;
use subject::{Reach, RedisSubject};

static NODES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The test's own cluster.
type ClusterRedis = RedisSubject<ClusterConnection>;

impl Reach for ClusterConnection {
    fn open() -> BoxFuture<'static, RedisStore<Self>> {
        Box::pin(async {
            let nodes: Vec<String> = NODES.lock().unwrap().clone();
            let refs: Vec<&str> = nodes.iter().map(String::as_str).collect();
            RedisStore::connect_cluster(&refs)
                .await
                .expect("connect to the cluster")
        })
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
    idem_conformance::lease_behaviours!([run_all] rt, ran, failures, lease_tests);
    idem_conformance::sent_behaviours!([run_all] rt, ran, failures, sent_tests);
    idem_conformance::admin_behaviours!([run_all] rt, ran, failures, admin_tests);
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
