//! A Redis Cluster of three masters, each with one replica, on loopback
//! ports of its own, whose failovers the cluster makes by itself: a master
//! that stops answering for `cluster-node-timeout` (1 s here) is replaced
//! by its replica.

use std::process::Command;
use std::time::Duration;

use crate::process::{Scratch, wait_until};
use crate::redis_replica::{Node, run_in, signal};

/// Three masters and their replicas.
#[derive(Debug)]
pub struct RedisClusterReplicas {
    nodes: Vec<Node>,
    _dir: Scratch,
}

fn redis_cli(args: &[&str]) -> Result<String, String> {
    let out = Command::new("redis-cli")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run redis-cli (install redis-tools): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "redis-cli {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn cluster_nodes(port: u16) -> Option<String> {
    redis_cli(&["-p", &port.to_string(), "cluster", "nodes"]).ok()
}

impl RedisClusterReplicas {
    /// Starts six nodes, joins them into three masters with one replica
    /// each, and waits until every node sees the cluster whole.
    pub async fn start() -> Result<Self, String> {
        let dir = Scratch::new("redis-cluster-replicas").map_err(|e| format!("scratch directory: {e}"))?;
        let mut nodes = Vec::with_capacity(6);
        for i in 0..6 {
            let node_dir = dir.path().join(format!("n{i}"));
            std::fs::create_dir_all(&node_dir).map_err(|e| format!("{}: {e}", node_dir.display()))?;
            let port = idem_conformance::free_port_beside(10_000);
            let process = run_in(
                Command::new("redis-server")
                    .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                    .args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"])
                    .args(["--cluster-node-timeout", "1000"])
                    .args(["--save", "", "--appendonly", "no"])
                    .args(["--client-output-buffer-limit", "replica 1gb 1gb 60"])
                    .args(["--repl-backlog-size", "64mb"])
                    .args(["--logfile", "redis.log"]),
                &node_dir,
                "redis-server",
            )?;
            nodes.push(Node { process, port });
        }
        for node in &nodes {
            let port = node.port;
            wait_until(Duration::from_secs(20), "a cluster node answering", || async move {
                redis_cli(&["-p", &port.to_string(), "ping"]).is_ok_and(|out| out.contains("PONG"))
            })
            .await?;
        }
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let mut create = vec!["--cluster", "create"];
        create.extend(addrs.iter().map(String::as_str));
        create.extend(["--cluster-replicas", "1", "--cluster-yes"]);
        redis_cli(&create)?;
        let cluster = Self { nodes, _dir: dir };
        cluster.wait_whole(Duration::from_secs(30)).await?;
        Ok(cluster)
    }

    /// Waits until every running node says `cluster_state:ok` and sees
    /// three masters with a replica each, and every replica's link to its
    /// master is up.
    pub async fn wait_whole(&self, within: Duration) -> Result<(), String> {
        let ports: Vec<u16> = self.nodes.iter().map(|n| n.port).collect();
        wait_until(within, "the cluster whole again", || {
            let ports = ports.clone();
            async move {
                ports.iter().all(|port| {
                    let ok = redis_cli(&["-p", &port.to_string(), "cluster", "info"])
                        .is_ok_and(|info| info.contains("cluster_state:ok"));
                    let linked = cluster_nodes(*port).is_some_and(|nodes| {
                        let live: Vec<&str> = nodes.lines().filter(|l| !l.contains("fail")).collect();
                        live.iter().filter(|l| l.contains("master")).count() == 3
                            && live.iter().filter(|l| l.contains("slave")).count() == 3
                    });
                    // A replica counts once its link to its master is up
                    // (its first sync done): before that, the cluster
                    // would not promote it.
                    let synced = redis_cli(&["-p", &port.to_string(), "info", "replication"])
                        .is_ok_and(|info| info.contains("role:master") || info.contains("master_link_status:up"));
                    ok && linked && synced
                })
            }
        })
        .await
    }

    /// Seed URLs of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    /// The node ids and ports: the masters, each with its replica's index
    /// in this deployment.
    fn roles(&self) -> Result<Vec<(usize, usize)>, String> {
        let view = cluster_nodes(self.nodes[0].port).ok_or("CLUSTER NODES on the first node")?;
        let index = |port: u16| self.nodes.iter().position(|n| n.port == port);
        let mut masters = Vec::new();
        let mut replicas = Vec::new();
        for line in view.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(id), Some(addr), Some(flags)) = (fields.first(), fields.get(1), fields.get(2)) else {
                continue;
            };
            let port = addr
                .split('@')
                .next()
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse::<u16>().ok());
            let Some(at) = port.and_then(index) else { continue };
            if flags.contains("master") && !flags.contains("fail") {
                masters.push((id.to_string(), at));
            } else if flags.contains("slave") {
                replicas.push((fields.get(3).copied().unwrap_or("").to_string(), at));
            }
        }
        Ok(masters
            .into_iter()
            .filter_map(|(id, m)| replicas.iter().find(|(of, _)| *of == id).map(|(_, r)| (m, *r)))
            .collect())
    }

    /// A master and its replica (indexes of this deployment's nodes).
    pub fn a_master_and_its_replica(&self) -> Result<(usize, usize), String> {
        self.roles()?
            .first()
            .copied()
            .ok_or_else(|| "no master with a replica".to_owned())
    }

    /// Stops node `i` (SIGSTOP).
    pub fn pause(&self, i: usize) {
        signal(&self.nodes[i].process, "-STOP");
    }

    /// Lets node `i` run again (SIGCONT).
    pub fn resume(&self, i: usize) {
        signal(&self.nodes[i].process, "-CONT");
    }

    /// Kills node `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].process.kill();
    }

    /// Waits until node `i` is a master serving slots (its failover done).
    pub async fn wait_master(&self, i: usize, within: Duration) -> Result<(), String> {
        let port = self.nodes[i].port;
        let promoted = wait_until(within, "the replica promoted by the cluster", || async move {
            redis_cli(&["-p", &port.to_string(), "role"]).is_ok_and(|role| role.starts_with("master"))
                && redis_cli(&["-p", &port.to_string(), "cluster", "info"])
                    .is_ok_and(|info| info.contains("cluster_state:ok"))
        })
        .await;
        promoted.map_err(|e| {
            let log =
                std::fs::read_to_string(self._dir.path().join(format!("n{i}")).join("redis.log")).unwrap_or_default();
            let tail: Vec<&str> = log
                .lines()
                .filter(|l| !l.contains("SYNC") && !l.contains("MASTER"))
                .rev()
                .take(12)
                .collect();
            format!(
                "{e}; its view: {:?}; its log's tail: {:?}",
                cluster_nodes(port),
                tail.into_iter().rev().collect::<Vec<_>>()
            )
        })
    }

    /// Bytes of replication stream node `master` sent that its replica has
    /// not acknowledged (from the master's `INFO replication`).
    pub fn lag_bytes(&self, master: usize) -> Option<i64> {
        let info = redis_cli(&["-p", &self.nodes[master].port.to_string(), "info", "replication"]).ok()?;
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':').map(str::to_owned))
        };
        let head: i64 = field("master_repl_offset")?.parse().ok()?;
        let acked: i64 = field("slave0")?
            .split(',')
            .find_map(|p| p.strip_prefix("offset="))?
            .parse()
            .ok()?;
        Some(head - acked)
    }
}
