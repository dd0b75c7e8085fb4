//! A Redis master with replicas on loopback ports of its own, and a
//! failover by promotion: the master killed with SIGKILL, a replica made
//! master with `REPLICAOF NO ONE`, which is what Sentinel and Redis Cluster
//! do by themselves once they agree the master is gone. Doing it by hand
//! lets a test choose the moment, and pause a replica first (SIGSTOP) so
//! that it is really behind.
//!
//! The servers keep nothing on disk (`--save ""`, no AOF): what survives
//! the master is what its replica received.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::process::{Guarded, Scratch, free_port, wait_until};

/// One redis-server of a deployment.
#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) process: Guarded,
    pub(crate) port: u16,
}

/// Starts a master and `replicas` replicas of it in `dir`, and waits until
/// each replica's link to the master is up; the master comes first.
pub(crate) async fn start_servers(dir: &std::path::Path, replicas: usize) -> Result<Vec<Node>, String> {
    let port = free_port();
    let mut nodes = vec![Node {
        process: spawn(port, dir, None)?,
        port,
    }];
    wait_until(Duration::from_secs(20), "the Redis master answering", || async move {
        replication(port).await.is_some()
    })
    .await?;
    for _ in 0..replicas {
        let replica = free_port();
        nodes.push(Node {
            process: spawn(replica, dir, Some(port))?,
            port: replica,
        });
    }
    for node in &nodes[1..] {
        let port = node.port;
        wait_until(
            Duration::from_secs(30),
            "a Redis replica's link to its master",
            || async move {
                replication(port)
                    .await
                    .is_some_and(|info| field(&info, "master_link_status") == Some("up"))
            },
        )
        .await?;
    }
    Ok(nodes)
}

/// A master and its replicas.
#[derive(Debug)]
pub struct RedisReplicas {
    master: Node,
    replicas: Vec<Node>,
    _dir: Scratch,
}

/// Starts a redis-server on `port` in `dir`, a replica of the server on
/// `replica_of` if given.
pub(crate) fn spawn(port: u16, dir: &std::path::Path, replica_of: Option<u16>) -> Result<Guarded, String> {
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .args(["--logfile", &format!("redis-{port}.log")])
        // A replica paused for a moment must not be dropped for the
        // backlog its master builds meanwhile.
        .args(["--client-output-buffer-limit", "replica 1gb 1gb 60"])
        .args(["--repl-backlog-size", "64mb"]);
    if let Some(master) = replica_of {
        cmd.args(["--replicaof", "127.0.0.1", &master.to_string()]);
    }
    run_in(&mut cmd, dir, "redis-server")
}

/// Runs `command` (`what`, as a failure names it) in `dir`, its output
/// discarded (each server logs to a file of its own).
pub(crate) fn run_in(command: &mut Command, dir: &std::path::Path, what: &str) -> Result<Guarded, String> {
    let child = command
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {what} (install redis-server): {e}"))?;
    Ok(Guarded::new(child))
}

/// A connection to the server on `port`.
pub(crate) async fn connect(port: u16) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))?
        .get_multiplexed_async_connection()
        .await
}

/// `INFO replication` of the server on `port`, as `field:value` lines.
pub(crate) async fn replication(port: u16) -> Option<String> {
    let mut conn = connect(port).await.ok()?;
    redis::cmd("INFO")
        .arg("replication")
        .query_async::<String>(&mut conn)
        .await
        .ok()
}

/// The value of `name` in `INFO` text.
pub(crate) fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
}

/// Sends `sig` (`-STOP`, `-CONT`) to `process`.
pub(crate) fn signal(process: &Guarded, sig: &str) {
    if let Some(pid) = process.id() {
        let _ = Command::new("kill").args([sig, &pid.to_string()]).status();
    }
}

impl RedisReplicas {
    /// Starts a master and `replicas` replicas of it, and waits until each
    /// replica's link to the master is up.
    pub async fn start(replicas: usize) -> Result<Self, String> {
        let dir = Scratch::new("redis-replicas").map_err(|e| format!("scratch directory: {e}"))?;
        let mut nodes = start_servers(dir.path(), replicas).await?;
        let master = nodes.remove(0);
        Ok(Self {
            master,
            replicas: nodes,
            _dir: dir,
        })
    }

    /// The master's URL.
    pub fn master_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.master.port)
    }

    /// Replica `i`'s URL.
    pub fn replica_url(&self, i: usize) -> String {
        format!("redis://127.0.0.1:{}", self.replicas[i].port)
    }

    /// Stops replica `i` (SIGSTOP): it receives nothing more, and its
    /// master's output to it backs up.
    pub fn pause_replica(&self, i: usize) {
        signal(&self.replicas[i].process, "-STOP");
    }

    /// Lets replica `i` run again (SIGCONT).
    pub fn resume_replica(&self, i: usize) {
        signal(&self.replicas[i].process, "-CONT");
    }

    /// Kills the master (SIGKILL): what it had not sent to a replica is
    /// gone.
    pub fn kill_master(&mut self) {
        self.master.process.kill();
    }

    /// Makes replica `i` a master (`REPLICAOF NO ONE`) once it has read
    /// what its link still held, and waits until it says so.
    pub async fn promote(&self, i: usize) -> Result<(), String> {
        let port = self.replicas[i].port;
        // The replica still reads what reached its socket before the master
        // died; promote it once its offset stops moving.
        let mut last = None;
        for _ in 0..50 {
            let offset = replication(port)
                .await
                .and_then(|info| field(&info, "slave_repl_offset").map(str::to_owned));
            if offset.is_some() && offset == last {
                break;
            }
            last = offset;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut conn = connect(port).await.map_err(|e| format!("replica on {port}: {e}"))?;
        redis::cmd("REPLICAOF")
            .arg("NO")
            .arg("ONE")
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| format!("REPLICAOF NO ONE on {port}: {e}"))?;
        wait_until(Duration::from_secs(10), "the promoted replica's role", || async move {
            replication(port)
                .await
                .is_some_and(|info| field(&info, "role") == Some("master"))
        })
        .await
    }

    /// How far the replica that acknowledged least is behind the master,
    /// in bytes of the replication stream, as the master knows it (the
    /// offsets its replicas last acknowledged): readable while a replica is
    /// paused. `None` if the master cannot be read.
    pub async fn lag_bytes(&self) -> Option<i64> {
        let master = replication(self.master.port).await?;
        let head = field(&master, "master_repl_offset")?.parse::<i64>().ok()?;
        let acknowledged = (0..self.replicas.len())
            .filter_map(|i| {
                let line = field(&master, &format!("slave{i}"))?;
                line.split(',')
                    .find_map(|part| part.strip_prefix("offset="))?
                    .parse::<i64>()
                    .ok()
            })
            .min()?;
        Some(head - acknowledged)
    }
}
