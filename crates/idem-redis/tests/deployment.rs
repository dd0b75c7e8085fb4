//! The deployment check reads the replicas too: a replica that evicts
//! keys (a failover would promote it with its policy) is refused, on one
//! server and on a cluster, and a sound one passes. The servers are the
//! test's own, on loopback ports.

#[path = "support/servers.rs"]
mod servers;

use std::time::Duration;

use idem_redis::RedisStore;
use servers::{RedisCluster, RedisServer};

/// Waits until the server on `port` counts `replicas` connected replicas.
fn wait_for_replicas(port: u16, replicas: usize) {
    let mut text = String::new();
    let connected = servers::polled(Duration::from_millis(50), || {
        text = servers::ask(port, &["info", "replication"]);
        text.contains(&format!("connected_slaves:{replicas}"))
    });
    assert!(connected, "no replica connected to {port}: {text}");
}

fn set_policy(port: u16, policy: &str) {
    let said = servers::ask(port, &["config", "set", "maxmemory-policy", policy]);
    assert!(said.contains("OK"), "{said}");
}

/// A master that keeps its data and evicts nothing, and a replica of it
/// started with `args`, once the master counts it connected.
fn master_and_replica(args: &[&str]) -> (RedisServer, RedisServer) {
    let master = RedisServer::start(&["--appendonly", "yes", "--maxmemory-policy", "noeviction"]);
    let port = master.port.to_string();
    let mut all = vec!["--replicaof", "127.0.0.1", &port];
    all.extend_from_slice(args);
    let replica = RedisServer::start(&all);
    wait_for_replicas(master.port, 1);
    (master, replica)
}

/// A server whose replica evicts keys is refused, naming the replica and its policy; once the replica is set to noeviction the check passes without a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_evicts_is_refused_on_one_server() {
    let (master, replica) = master_and_replica(&["--maxmemory-policy", "allkeys-lru"]);
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
    let (master, replica) = master_and_replica(&["--maxmemory-policy", "noeviction"]);
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
    // The replica announces a port nothing listens on.
    let nowhere = servers::free_port();
    let (master, _replica) = master_and_replica(&["--replica-announce-port", &nowhere.to_string()]);
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
