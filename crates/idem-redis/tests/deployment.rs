//! The deployment check reads the replicas too: a replica that evicts
//! keys (a failover would promote it with its policy) is refused, on one
//! server and on a cluster, and a sound one passes. The servers are the
//! test's own, on loopback ports.

#[path = "support/servers.rs"]
mod servers;

use std::process::Command;
use std::time::{Duration, Instant};

use idem_redis::RedisStore;
use servers::{RedisCluster, RedisServer};

/// Waits until the server on `port` counts `replicas` connected replicas.
fn wait_for_replicas(port: u16, replicas: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = Command::new("redis-cli")
            .args(["-p", &port.to_string(), "info", "replication"])
            .output()
            .expect("redis-cli runs");
        let text = String::from_utf8_lossy(&out.stdout);
        if text.contains(&format!("connected_slaves:{replicas}")) {
            return;
        }
        assert!(Instant::now() < deadline, "no replica connected to {port}: {text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn set_policy(port: u16, policy: &str) {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "config", "set", "maxmemory-policy", policy])
        .output()
        .expect("redis-cli runs");
    assert!(String::from_utf8_lossy(&out.stdout).contains("OK"), "{out:?}");
}

/// A server whose replica evicts keys is refused, naming the replica and its policy; once the replica is set to noeviction the check passes without a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_evicts_is_refused_on_one_server() {
    let master = RedisServer::start(&["--appendonly", "yes", "--maxmemory-policy", "noeviction"]);
    let replica = RedisServer::start(&[
        "--replicaof",
        "127.0.0.1",
        &master.port.to_string(),
        "--maxmemory-policy",
        "allkeys-lru",
    ]);
    wait_for_replicas(master.port, 1);
    let store = RedisStore::connect_any(&master.url()).await.unwrap();
    let e = store.check_deployment().await.unwrap_err().to_string();
    assert!(
        e.contains(&format!("replica 127.0.0.1:{}", replica.port)) && e.contains("allkeys-lru"),
        "{e}"
    );
    set_policy(replica.port, "noeviction");
    assert_eq!(store.check_deployment().await.unwrap(), Vec::<String>::new());
}

/// A store pointed at a replica is refused by the check, naming the way
/// out: every write would be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_on_a_replica_is_refused() {
    let master = RedisServer::start(&["--appendonly", "yes", "--maxmemory-policy", "noeviction"]);
    let replica = RedisServer::start(&[
        "--replicaof",
        "127.0.0.1",
        &master.port.to_string(),
        "--maxmemory-policy",
        "noeviction",
    ]);
    wait_for_replicas(master.port, 1);
    let store = RedisStore::connect_any(&replica.url()).await.unwrap();
    let e = store.check_deployment().await.unwrap_err();
    assert!(matches!(e, idem_core::Error::Config(_)), "{e}");
    let e = e.to_string();
    assert!(e.contains("role:slave") && e.contains("redis+sentinel://"), "{e}");
    let on_master = RedisStore::connect_any(&master.url()).await.unwrap();
    assert_eq!(on_master.check_deployment().await.unwrap(), Vec::<String>::new());
}

/// A replica the check cannot reach at its advertised address is a warning, not a pass in silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_out_of_reach_is_a_warning() {
    let master = RedisServer::start(&["--appendonly", "yes", "--maxmemory-policy", "noeviction"]);
    // It announces a port nothing listens on.
    let nowhere = servers::free_port();
    let _replica = RedisServer::start(&[
        "--replicaof",
        "127.0.0.1",
        &master.port.to_string(),
        "--replica-announce-port",
        &nowhere.to_string(),
    ]);
    wait_for_replicas(master.port, 1);
    let store = RedisStore::connect_any(&master.url()).await.unwrap();
    let warnings = store.check_deployment().await.unwrap();
    assert!(
        warnings.len() == 1 && warnings[0].contains(&format!("replica 127.0.0.1:{nowhere}")),
        "{warnings:?}"
    );
}

/// A cluster whose replica evicts keys is refused; set to noeviction, it passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_evicts_is_refused_on_a_cluster() {
    let mut cluster = RedisCluster::start();
    let replica = cluster.add_replica(&["--appendonly", "yes", "--maxmemory-policy", "allkeys-lru"]);
    let urls = cluster.urls().join(",");
    let store = RedisStore::connect_any(&urls).await.unwrap();
    let e = store.check_deployment().await.unwrap_err().to_string();
    assert!(
        e.contains(&format!("replica 127.0.0.1:{replica}")) && e.contains("allkeys-lru"),
        "{e}"
    );
    set_policy(replica, "noeviction");
    assert_eq!(store.check_deployment().await.unwrap(), Vec::<String>::new());
}
