//! A Redis master with replicas watched by three sentinels (quorum two), on
//! loopback ports of their own: the deployment `redis+sentinel://` URLs
//! name. Killing the master (SIGKILL) is all a test does; the sentinels
//! agree it is down after [`DOWN_AFTER_MS`], elect a leader among
//! themselves and promote a replica, which is what a store following the
//! sentinels must find.
//!
//! The servers keep nothing on disk (`--save ""`, no AOF): what survives
//! the master is what its replica received.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::process::{Guarded, Scratch, free_port, wait_until};
use crate::redis_replica::{Node, connect, field, replication, run_in, signal, start_servers};

/// The service (master name) the sentinels watch.
pub const SERVICE: &str = "idem";

/// How long the sentinels wait before they call a silent master down.
pub const DOWN_AFTER_MS: u64 = 1_000;

/// Redis servers and the sentinels watching them.
#[derive(Debug)]
pub struct RedisSentinels {
    /// The servers; the first started as the master.
    servers: Vec<Node>,
    sentinels: Vec<Node>,
    _dir: Scratch,
}

/// Starts a sentinel on `port` watching the master on `master`.
fn spawn_sentinel(port: u16, dir: &Path, master: u16) -> Result<Guarded, String> {
    let conf = dir.join(format!("sentinel-{port}.conf"));
    std::fs::write(
        &conf,
        format!(
            "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile sentinel-{port}.log\n\
             sentinel monitor {SERVICE} 127.0.0.1 {master} 2\n\
             sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n\
             sentinel failover-timeout {SERVICE} 10000\n\
             sentinel parallel-syncs {SERVICE} 1\n",
            dir = dir.display()
        ),
    )
    .map_err(|e| format!("sentinel configuration {}: {e}", conf.display()))?;
    run_in(
        Command::new("redis-server").arg(&conf).arg("--sentinel"),
        dir,
        "redis-server --sentinel",
    )
}

/// What the sentinel on `port` answers to `SENTINEL <args…>`.
async fn ask(port: u16, args: &[&str]) -> Option<redis::Value> {
    let mut conn = connect(port).await.ok()?;
    let mut cmd = redis::cmd("SENTINEL");
    for arg in args {
        cmd.arg(*arg);
    }
    cmd.query_async(&mut conn).await.ok()
}

/// How many entries a `SENTINEL replicas|sentinels` reply lists.
fn entries(reply: Option<redis::Value>) -> usize {
    match reply {
        Some(redis::Value::Array(items)) => items.len(),
        _ => 0,
    }
}

/// The master port the sentinel on `port` names.
async fn master_of(port: u16) -> Option<u16> {
    let reply = ask(port, &["get-master-addr-by-name", SERVICE]).await?;
    let (_, master): (String, String) = redis::FromRedisValue::from_redis_value(reply).ok()?;
    master.parse().ok()
}

impl RedisSentinels {
    /// Starts a master, `replicas` replicas of it and three sentinels, and
    /// waits until every replica's link is up and every sentinel knows the
    /// replicas and the two other sentinels (they find each other through
    /// the master, within a few seconds).
    pub async fn start(replicas: usize) -> Result<Self, String> {
        let dir = Scratch::new("redis-sentinel").map_err(|e| format!("scratch directory: {e}"))?;
        let servers = start_servers(dir.path(), replicas).await?;
        let master = servers[0].port;
        let mut sentinels = Vec::with_capacity(3);
        for _ in 0..3 {
            let port = free_port();
            sentinels.push(Node {
                process: spawn_sentinel(port, dir.path(), master)?,
                port,
            });
        }
        for node in &sentinels {
            let port = node.port;
            wait_until(
                Duration::from_secs(30),
                "a sentinel knowing the replicas and the other sentinels",
                || async move {
                    entries(ask(port, &["replicas", SERVICE]).await) == replicas
                        && entries(ask(port, &["sentinels", SERVICE]).await) == 2
                },
            )
            .await?;
        }
        Ok(Self {
            servers,
            sentinels,
            _dir: dir,
        })
    }

    /// The store's URL: `redis+sentinel://` and the three sentinels.
    pub fn url(&self) -> String {
        let sentinels: Vec<String> = self.sentinels.iter().map(|s| format!("127.0.0.1:{}", s.port)).collect();
        format!("redis+sentinel://{}/{SERVICE}", sentinels.join(","))
    }

    /// The port of the master the first sentinel that answers names.
    pub async fn master_port(&self) -> Option<u16> {
        for s in &self.sentinels {
            if let Some(port) = master_of(s.port).await {
                return Some(port);
            }
        }
        None
    }

    /// The ports of the servers (the first started as the master).
    pub fn server_ports(&self) -> Vec<u16> {
        self.servers.iter().map(|n| n.port).collect()
    }

    fn server(&mut self, port: u16) -> Option<&mut Node> {
        self.servers.iter_mut().find(|n| n.port == port)
    }

    /// Kills the server on `port` (SIGKILL).
    pub fn kill(&mut self, port: u16) {
        if let Some(node) = self.server(port) {
            node.process.kill();
        }
    }

    /// Stops the server on `port` (SIGSTOP): it receives nothing more.
    pub fn pause(&mut self, port: u16) {
        if let Some(node) = self.server(port) {
            signal(&node.process, "-STOP");
        }
    }

    /// Lets the server on `port` run again (SIGCONT).
    pub fn resume(&mut self, port: u16) {
        if let Some(node) = self.server(port) {
            signal(&node.process, "-CONT");
        }
    }

    /// Asks a sentinel for a failover without waiting for the master to be
    /// down (`SENTINEL FAILOVER`): the master is demoted, a replica promoted.
    /// The last sentinel is asked: the others learn of it from it, so a
    /// client that believes the first sentinel alone is shown wrong.
    pub async fn force_failover(&self) -> Result<(), String> {
        let port = self.sentinels[self.sentinels.len() - 1].port;
        let mut conn = connect(port).await.map_err(|e| format!("sentinel on {port}: {e}"))?;
        redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(SERVICE)
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| format!("SENTINEL FAILOVER: {e}"))
    }

    /// Waits until every sentinel names a master other than `old` and that
    /// server says it is one; answers its port.
    pub async fn wait_new_master(&self, old: u16, within: Duration) -> Result<u16, String> {
        let ports: Vec<u16> = self.sentinels.iter().map(|s| s.port).collect();
        let found = std::sync::Arc::new(std::sync::Mutex::new(None));
        wait_until(within, "the sentinels promoting a replica", || {
            let (ports, found) = (ports.clone(), found.clone());
            async move {
                let mut named = Vec::new();
                for port in &ports {
                    named.push(master_of(*port).await);
                }
                let Some(Some(new)) = named.first().copied() else {
                    return false;
                };
                let agreed = new != old && named.iter().all(|n| *n == Some(new));
                let is_master = agreed
                    && replication(new)
                        .await
                        .is_some_and(|info| field(&info, "role") == Some("master"));
                if is_master {
                    *found.lock().unwrap() = Some(new);
                }
                is_master
            }
        })
        .await?;
        let port = found.lock().unwrap().take();
        port.ok_or_else(|| "no new master".to_owned())
    }

    /// How far the replica that acknowledged least is behind the master on
    /// `master`, in bytes of the replication stream, as the master knows it.
    pub async fn lag_bytes(&self, master: u16) -> Option<i64> {
        let info = replication(master).await?;
        let head = field(&info, "master_repl_offset")?.parse::<i64>().ok()?;
        (0..self.servers.len())
            .filter_map(|i| {
                field(&info, &format!("slave{i}"))?
                    .split(',')
                    .find_map(|part| part.strip_prefix("offset="))?
                    .parse::<i64>()
                    .ok()
            })
            .min()
            .map(|acknowledged| head - acknowledged)
    }
}
