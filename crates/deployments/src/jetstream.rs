//! A three-node NATS JetStream cluster on loopback ports of its own.
//!
//! [`NatsCluster::start`] runs three `nats-server` processes, each with
//! JetStream storing in a directory of its own (`-js -sd`), a server name
//! (`n0`, `n1`, `n2`), a client port, a monitoring port and a route port, all
//! three in the cluster `idem` with routes to each other. It answers once
//! JetStream has a meta leader that every node agrees on and that sees both
//! other peers as current. A node can be killed (SIGKILL) and restarted on
//! the same store directory, where it rejoins the cluster and catches up.
//! Dropping the cluster kills every node and removes the directory.
//!
//! The binary is `$DEPLOY_NATS_SERVER`, else `/usr/sbin/nats-server`, else
//! `nats-server` on the `PATH`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), String> {
//! use deployments::jetstream::NatsCluster;
//!
//! let mut cluster = NatsCluster::start().await?;
//! let urls = cluster.urls(); // a client given all three fails over
//! cluster.kill(0);
//! cluster.restart(0).await?;
//! # Ok(()) }
//! ```

use std::fs::File;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::process::{Guarded, Scratch, free_port, wait_until};

/// The cluster's name (`--cluster_name`).
pub const CLUSTER_NAME: &str = "idem";

/// How long a start or a restart may take before it is an error.
const READY_WITHIN: Duration = Duration::from_secs(45);

/// One `nats-server` of the cluster.
#[derive(Debug)]
struct Node {
    name: String,
    client_port: u16,
    cluster_port: u16,
    monitor_port: u16,
    store: PathBuf,
    log: PathBuf,
    process: Option<Guarded>,
}

/// Three `nats-server` processes with JetStream in one cluster.
#[derive(Debug)]
pub struct NatsCluster {
    // Declared before the scratch directory: the processes are killed
    // before their store directories are removed.
    nodes: Vec<Node>,
    bin: PathBuf,
    scratch: Scratch,
}

impl NatsCluster {
    /// Starts three nodes and waits until JetStream has a meta leader with
    /// both other peers current; fails naming the binary when it cannot be
    /// run, or with the nodes' log tails when the cluster does not form.
    pub async fn start() -> Result<Self, String> {
        let bin = nats_server()?;
        let scratch = Scratch::new("jetstream").map_err(|e| format!("scratch directory: {e}"))?;
        let nodes = (0..3)
            .map(|i| Node {
                name: format!("n{i}"),
                client_port: free_port(),
                cluster_port: free_port(),
                monitor_port: free_port(),
                store: scratch.path().join(format!("n{i}")),
                log: scratch.path().join(format!("n{i}.log")),
                process: None,
            })
            .collect();
        let mut cluster = Self { nodes, bin, scratch };
        for node in 0..cluster.nodes.len() {
            cluster.spawn(node)?;
        }
        cluster.wait_ready().await?;
        Ok(cluster)
    }

    /// The client URLs of every node, in node order.
    pub fn urls(&self) -> Vec<String> {
        (0..self.nodes.len()).map(|n| self.url(n)).collect()
    }

    /// The client URLs with `first` first, then the others in node order:
    /// for a client that keeps the order of its servers, so that it
    /// connects to `first` and fails over to the others.
    pub fn urls_from(&self, first: usize) -> Vec<String> {
        let mut urls = vec![self.url(first)];
        urls.extend((0..self.nodes.len()).filter(|&n| n != first).map(|n| self.url(n)));
        urls
    }

    /// The client URL of `node`.
    pub fn url(&self, node: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[node].client_port)
    }

    /// The server name of `node` (`n0`, `n1`, `n2`).
    pub fn name(&self, node: usize) -> &str {
        &self.nodes[node].name
    }

    /// The node whose server name is `name` (as stream and consumer infos
    /// name their leaders).
    pub fn node_named(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// Whether `node`'s process is running.
    pub fn is_up(&mut self, node: usize) -> bool {
        self.nodes[node].process.as_mut().is_some_and(|p| !p.exited())
    }

    /// The directory holding every node's store and log.
    pub fn dir(&self) -> &Path {
        self.scratch.path()
    }

    /// Kills `node` with SIGKILL (no shutdown, no flush) and reaps it.
    pub fn kill(&mut self, node: usize) {
        if let Some(mut process) = self.nodes[node].process.take() {
            process.kill();
        }
    }

    /// Starts `node` again on its store directory and waits until it has
    /// rejoined: every running node agrees on a meta leader that sees the
    /// others as current.
    pub async fn restart(&mut self, node: usize) -> Result<(), String> {
        self.kill(node);
        self.spawn(node)?;
        self.wait_ready().await
    }

    /// `node`'s `/jsz` monitoring answer with `query` (e.g.
    /// `accounts=true&streams=true`), as JSON.
    pub async fn jsz(&self, node: usize, query: &str) -> Result<serde_json::Value, String> {
        let port = self.nodes[node].monitor_port;
        let path = if query.is_empty() {
            "/jsz".to_owned()
        } else {
            format!("/jsz?{query}")
        };
        tokio::task::spawn_blocking(move || http_get_json(port, &path))
            .await
            .map_err(|e| format!("jsz: {e}"))?
    }

    /// How many messages `node` holds in its replica of `stream`, from its
    /// monitoring endpoint; `None` when it holds no replica of it (or is
    /// down).
    pub async fn stream_messages(&self, node: usize, stream: &str) -> Option<u64> {
        let jsz = self.jsz(node, "accounts=true&streams=true").await.ok()?;
        jsz["account_details"]
            .as_array()?
            .iter()
            .filter_map(|account| account["stream_detail"].as_array())
            .flatten()
            .find(|s| s["name"] == stream)
            .and_then(|s| s["state"]["messages"].as_u64())
    }

    /// The last lines of `node`'s log, for a failure message.
    pub fn log_tail(&self, node: usize, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.nodes[node].log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Waits until every running node names the same meta leader, that
    /// leader is running, and its view of the meta group lists every other
    /// running node as a current peer.
    pub async fn wait_ready(&mut self) -> Result<(), String> {
        let up: Vec<usize> = (0..self.nodes.len()).filter(|&n| self.is_up(n)).collect();
        if up.len() < self.nodes.len() {
            let down: Vec<&str> = (0..self.nodes.len())
                .filter(|n| !up.contains(n))
                .map(|n| self.name(n))
                .collect();
            return Err(format!(
                "nats-server {} not running; log:\n{}",
                down.join(", "),
                self.log_tail(self.node_named(down[0]).unwrap_or(0), 20)
            ));
        }
        let (this, up) = (&*self, up.as_slice());
        let ready = wait_until(READY_WITHIN, "the JetStream cluster", || async move {
            this.meta_ready(up).await
        })
        .await;
        ready.map_err(|e| {
            let logs: Vec<String> = (0..this.nodes.len())
                .map(|n| format!("--- {}:\n{}", this.name(n), this.log_tail(n, 15)))
                .collect();
            format!("{e}\n{}", logs.join("\n"))
        })
    }

    /// Whether the nodes `up` agree on a meta leader among them that sees
    /// the rest as current peers.
    async fn meta_ready(&self, up: &[usize]) -> bool {
        let mut leader = None;
        for &node in up {
            if TcpStream::connect(("127.0.0.1", self.nodes[node].client_port)).is_err() {
                return false;
            }
            let Ok(jsz) = self.jsz(node, "").await else {
                return false;
            };
            let Some(name) = jsz["meta_cluster"]["leader"].as_str().filter(|l| !l.is_empty()) else {
                return false;
            };
            if leader.get_or_insert_with(|| name.to_owned()) != name {
                return false;
            }
        }
        let Some(leader) = leader.and_then(|name| self.node_named(&name)) else {
            return false;
        };
        if !up.contains(&leader) {
            return false;
        }
        let Ok(jsz) = self.jsz(leader, "").await else {
            return false;
        };
        let replicas = jsz["meta_cluster"]["replicas"].as_array().cloned().unwrap_or_default();
        up.iter().filter(|&&n| n != leader).all(|&n| {
            replicas
                .iter()
                .any(|r| r["name"] == self.name(n) && r["current"].as_bool() == Some(true))
        })
    }

    /// Starts `node`'s process.
    fn spawn(&mut self, node: usize) -> Result<(), String> {
        let routes: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|&(n, _)| n != node)
            .map(|(_, n)| format!("nats://127.0.0.1:{}", n.cluster_port))
            .collect();
        let n = &self.nodes[node];
        std::fs::create_dir_all(&n.store).map_err(|e| format!("{}: {e}", n.store.display()))?;
        let log = File::options()
            .create(true)
            .append(true)
            .open(&n.log)
            .map_err(|e| format!("{}: {e}", n.log.display()))?;
        let log_err = log.try_clone().map_err(|e| format!("{}: {e}", n.log.display()))?;
        let child = Command::new(&self.bin)
            .args(["-a", "127.0.0.1", "-p", &n.client_port.to_string()])
            .args(["-m", &n.monitor_port.to_string()])
            .args(["--server_name", &n.name])
            .args(["-js", "-sd"])
            .arg(&n.store)
            .args(["--cluster", &format!("nats://127.0.0.1:{}", n.cluster_port)])
            .args(["--cluster_name", CLUSTER_NAME])
            .args(["--routes", &routes.join(",")])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot run {} (install nats-server, or set DEPLOY_NATS_SERVER): {e}",
                    self.bin.display()
                )
            })?;
        self.nodes[node].process = Some(Guarded::new(child));
        Ok(())
    }
}

/// The `nats-server` binary to run.
fn nats_server() -> Result<PathBuf, String> {
    if let Ok(bin) = std::env::var("DEPLOY_NATS_SERVER") {
        let bin = PathBuf::from(bin);
        return if bin.is_file() {
            Ok(bin)
        } else {
            Err(format!("DEPLOY_NATS_SERVER={} is not a file", bin.display()))
        };
    }
    let packaged = PathBuf::from("/usr/sbin/nats-server");
    if packaged.is_file() {
        return Ok(packaged);
    }
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("nats-server"))
                .find(|bin| bin.is_file())
        })
        .ok_or_else(|| {
            "nats-server not found (not at /usr/sbin/nats-server nor on the PATH; set DEPLOY_NATS_SERVER)".into()
        })
}

/// `GET path` on the loopback `port` (HTTP/1.0, so the server closes the
/// connection after its answer), with the body parsed as JSON.
fn http_get_json(port: u16, path: &str) -> Result<serde_json::Value, String> {
    let timeout = Duration::from_secs(2);
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&address, timeout).map_err(|e| format!("{address}: {e}"))?;
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .map_err(|e| format!("{address}: {e}"))?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).map_err(|e| format!("{address}: {e}"))?;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{address}{path}: no HTTP answer"))?;
    if !head.starts_with("HTTP/1.") || head.split_whitespace().nth(1) != Some("200") {
        return Err(format!("{address}{path}: {}", head.lines().next().unwrap_or_default()));
    }
    serde_json::from_str(body).map_err(|e| format!("{address}{path}: {e}"))
}
