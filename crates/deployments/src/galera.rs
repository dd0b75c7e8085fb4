//! A MariaDB Galera cluster of three (or more) nodes on loopback ports.
//!
//! [`Galera::start`] makes one data directory with `mariadb-install-db`,
//! starts the first node on it with `--wsrep-new-cluster`, then starts the
//! other nodes on empty data directories: each joins the cluster and
//! receives the first node's data by a state snapshot transfer (SST, method
//! `rsync`). Every node listens for clients, group communication (`gcomm`),
//! incremental state transfers (IST) and SSTs on free loopback ports of its
//! own, and keeps its data, socket, pid file and error log in a [`Scratch`]
//! directory. The cluster is ready when every node reports
//! `wsrep_local_state_comment = Synced` and `wsrep_cluster_size` equal to the
//! number of running nodes.
//!
//! The `rsync` SST runs an rsync daemon that writes the joiner's files; run
//! by root, that daemon writes as `nobody`, which cannot replace the files a
//! root server left in a data directory it had used before. So as root every
//! server runs as the `mysql` user (`--user=mysql`) and the scratch
//! directory is given to that user: the daemon then runs as `mysql` too, and
//! a node can receive an SST into the directory it crashed with. Run by
//! another user, everything runs as that user.
//!
//! [`Galera::kill`] sends SIGKILL to a node. A node killed that way leaves
//! `seqno: -1` in its `grastate.dat`, and on its own it would ask for a full
//! SST; [`Galera::restart`] first runs `mariadbd --wsrep-recover` on the
//! data directory, which reads the last committed position from InnoDB
//! (`Recovered position: <uuid>:<seqno>`), and starts the node with
//! `--wsrep-start-position` at it, so the node catches up by IST from a
//! donor's write-set cache (`gcache.size=64M`) when the cache still holds
//! what it missed, and by SST otherwise. The answer says which one it got.
//!
//! Dropping the cluster kills every node (SIGKILL) and removes the scratch
//! directory.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::mysql::{MySqlConnectOptions, MySqlConnection};
use sqlx::{ConnectOptions, Connection};

use crate::process::{Guarded, Scratch, free_port};

/// The Galera provider library of Debian's `galera-4` package.
pub const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";

/// How long a node may take to start, join and reach `Synced`.
const READY_WITHIN: Duration = Duration::from_secs(90);

/// How many lines of a node's error log a failure quotes.
const LOG_TAIL_LINES: usize = 30;

/// One node's ports and files.
#[derive(Debug)]
struct Node {
    /// `n1`, `n2`, …
    name: String,
    /// The client port.
    port: u16,
    /// Group communication.
    gcomm: u16,
    /// Incremental state transfers received.
    ist: u16,
    /// State snapshot transfers received.
    sst: u16,
    /// The running server, if any.
    process: Option<Guarded>,
}

/// How a restarted node caught up with the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejoin {
    /// An incremental state transfer: the write sets it missed, from a
    /// donor's cache.
    Ist,
    /// A full state snapshot transfer (a copy of a donor's data directory).
    Sst,
    /// Neither appears in its error log: it had missed nothing.
    Neither,
}

impl fmt::Display for Rejoin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Rejoin::Ist => "IST",
            Rejoin::Sst => "SST",
            Rejoin::Neither => "no transfer",
        })
    }
}

/// A running Galera cluster; dropped, it kills its nodes and removes its
/// directory.
#[derive(Debug)]
pub struct Galera {
    // Declared first so that the nodes are killed before their directory
    // is removed.
    nodes: Vec<Node>,
    /// `--user=mysql` when run by root, nothing otherwise.
    user: Option<&'static str>,
    /// Added to every node's command line.
    settings: Vec<String>,
    scratch: Scratch,
}

impl Galera {
    /// Starts a cluster of `nodes` nodes (at least 1) with the settings above
    /// and waits until every node is `Synced` in a cluster of that size.
    pub async fn start(nodes: usize) -> Result<Self, String> {
        Self::start_with(nodes, &[]).await
    }

    /// Like [`start`](Self::start), with `settings` (server options such as
    /// `--wsrep-retry-autocommit=10`) added to every node's command line,
    /// restarts included.
    pub async fn start_with(nodes: usize, settings: &[String]) -> Result<Self, String> {
        if nodes == 0 {
            return Err("a Galera cluster needs at least one node".into());
        }
        for binary in ["mariadbd", "mariadb-install-db"] {
            if which(binary).is_none() {
                return Err(format!(
                    "`{binary}` is not on PATH: install the MariaDB server (Debian: mariadb-server)"
                ));
            }
        }
        if !Path::new(PROVIDER).exists() {
            return Err(format!(
                "the Galera provider {PROVIDER} is missing: install Debian's galera-4 package"
            ));
        }
        let scratch = Scratch::new("galera").map_err(|e| format!("create the scratch directory: {e}"))?;
        let user = if is_root() { Some("mysql") } else { None };
        let nodes = (1..=nodes)
            .map(|i| Node {
                name: format!("n{i}"),
                port: free_port(),
                gcomm: free_port(),
                ist: free_port(),
                sst: free_port(),
                process: None,
            })
            .collect();
        let settings = settings.to_vec();
        let mut cluster = Self {
            nodes,
            user,
            settings,
            scratch,
        };
        for i in 0..cluster.nodes.len() {
            std::fs::create_dir_all(cluster.datadir(i)).map_err(|e| format!("create a data directory: {e}"))?;
        }
        if let Some(user) = user {
            run(Command::new("chown")
                .arg("-R")
                .arg(format!("{user}:"))
                .arg(cluster.scratch.path()))?;
        }
        let mut install = Command::new(binary("mariadb-install-db"));
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", cluster.datadir(0).display()))
            .arg("--auth-root-authentication-method=normal");
        if let Some(user) = user {
            install.arg(format!("--user={user}"));
        }
        run(&mut install)?;
        cluster.spawn(0, &["--wsrep-new-cluster".to_owned()])?;
        cluster.wait_node_synced(0, 1).await?;
        for i in 1..cluster.nodes.len() {
            cluster.spawn(i, &[])?;
        }
        cluster.wait_synced().await?;
        Ok(cluster)
    }

    /// How many nodes the cluster has (running or not).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the cluster has no node (never, once started).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The client URL of node `node` (0-based), on the database `test`.
    pub fn url(&self, node: usize) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.nodes[node].port)
    }

    /// The error log of node `node`.
    pub fn error_log(&self, node: usize) -> PathBuf {
        self.scratch.path().join(format!("{}.err", self.nodes[node].name))
    }

    /// The last `lines` lines of node `node`'s error log.
    pub fn log_tail(&self, node: usize, lines: usize) -> String {
        let text = std::fs::read_to_string(self.error_log(node)).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Whether node `node`'s server is running.
    pub fn is_running(&mut self, node: usize) -> bool {
        self.nodes[node].process.as_mut().is_some_and(|p| !p.exited())
    }

    /// Kills node `node` with SIGKILL, as a crash of its host would stop it.
    pub fn kill(&mut self, node: usize) {
        if let Some(mut process) = self.nodes[node].process.take() {
            process.kill();
        }
    }

    /// Starts node `node` again after [`kill`](Self::kill): recovers its
    /// last committed position from InnoDB, starts it at that position and
    /// waits until the whole cluster is `Synced` again. Answers how the node
    /// caught up.
    pub async fn restart(&mut self, node: usize) -> Result<Rejoin, String> {
        self.kill(node);
        let log_len = std::fs::metadata(self.error_log(node)).map(|m| m.len()).unwrap_or(0);
        let position = self.recover(node)?;
        let extra: Vec<String> = position
            .map(|p| format!("--wsrep-start-position={p}"))
            .into_iter()
            .collect();
        self.spawn(node, &extra)?;
        self.wait_synced().await?;
        let text = std::fs::read(self.error_log(node)).unwrap_or_default();
        let since =
            String::from_utf8_lossy(&text[usize::try_from(log_len).unwrap_or(0).min(text.len())..]).into_owned();
        // The rsync script also runs (and logs "SST received") when the
        // joiner gets an IST; what it transferred is in its own lines.
        Ok(if since.contains("rsync SST completed on joiner") {
            Rejoin::Sst
        } else if since.contains("IST received") {
            Rejoin::Ist
        } else {
            Rejoin::Neither
        })
    }

    /// Waits until every running node is `Synced` in a cluster whose size
    /// is the number of running nodes.
    pub async fn wait_synced(&mut self) -> Result<(), String> {
        let running: Vec<usize> = (0..self.nodes.len()).filter(|&i| self.is_running(i)).collect();
        for &i in &running {
            self.wait_node_synced(i, running.len()).await?;
        }
        Ok(())
    }

    /// Node `node`'s `SHOW STATUS` value of `name` (for example
    /// `wsrep_local_cert_failures`).
    pub async fn status(&self, node: usize, name: &str) -> Result<String, String> {
        let mut conn = self
            .connect(node)
            .await
            .map_err(|e| self.failure(node, &format!("connect: {e}")))?;
        let row: Option<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!("SHOW STATUS LIKE '{name}'")))
            .fetch_optional(&mut conn)
            .await
            .map_err(|e| self.failure(node, &format!("SHOW STATUS LIKE '{name}': {e}")))?;
        let _ = conn.close().await;
        row.map(|(_, v)| v)
            .ok_or_else(|| self.failure(node, &format!("no status variable {name}")))
    }

    /// A failure of node `node`, with the tail of its error log.
    fn failure(&self, node: usize, what: &str) -> String {
        let name = &self.nodes[node].name;
        format!(
            "galera node {name} ({}): {what}\n--- last lines of {} ---\n{}",
            self.url(node),
            self.error_log(node).display(),
            self.log_tail(node, LOG_TAIL_LINES)
        )
    }

    fn datadir(&self, node: usize) -> PathBuf {
        self.scratch.path().join(&self.nodes[node].name)
    }

    async fn connect(&self, node: usize) -> Result<MySqlConnection, sqlx::Error> {
        let options: MySqlConnectOptions = self.url(node).parse()?;
        options.connect().await
    }

    /// The command line of node `node`.
    fn args(&self, node: usize) -> Vec<String> {
        let dir = self.scratch.path();
        let n = &self.nodes[node];
        let members: Vec<String> = self.nodes.iter().map(|m| format!("127.0.0.1:{}", m.gcomm)).collect();
        let mut args = vec!["--no-defaults".to_owned()];
        if let Some(user) = self.user {
            args.push(format!("--user={user}"));
        }
        args.extend([
            format!("--datadir={}", self.datadir(node).display()),
            format!("--socket={}", dir.join(format!("{}.sock", n.name)).display()),
            format!("--port={}", n.port),
            "--bind-address=127.0.0.1".to_owned(),
            format!("--pid-file={}", dir.join(format!("{}.pid", n.name)).display()),
            format!("--log-error={}", self.error_log(node).display()),
            "--skip-log-bin".to_owned(),
            "--binlog-format=ROW".to_owned(),
            "--innodb-autoinc-lock-mode=2".to_owned(),
            "--innodb-buffer-pool-size=64M".to_owned(),
            "--wsrep-on=ON".to_owned(),
            format!("--wsrep-provider={PROVIDER}"),
            "--wsrep-cluster-name=idem".to_owned(),
            format!("--wsrep-cluster-address=gcomm://{}", members.join(",")),
            format!("--wsrep-node-address=127.0.0.1:{}", n.gcomm),
            format!("--wsrep-node-name={}", n.name),
            format!(
                "--wsrep-provider-options=gmcast.listen_addr=tcp://127.0.0.1:{};ist.recv_addr=127.0.0.1:{};gcache.size=64M",
                n.gcomm, n.ist
            ),
            format!("--wsrep-sst-receive-address=127.0.0.1:{}", n.sst),
            "--wsrep-sst-method=rsync".to_owned(),
        ]);
        args.extend(self.settings.iter().cloned());
        args
    }

    fn spawn(&mut self, node: usize, extra: &[String]) -> Result<(), String> {
        let child = Command::new(binary("mariadbd"))
            .args(self.args(node))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| self.failure(node, &format!("spawn mariadbd: {e}")))?;
        self.nodes[node].process = Some(Guarded::new(child));
        Ok(())
    }

    /// Runs `mariadbd --wsrep-recover` on node `node`'s data directory and
    /// answers the position it recovered, if any.
    fn recover(&self, node: usize) -> Result<Option<String>, String> {
        let log = self
            .scratch
            .path()
            .join(format!("{}.recover.err", self.nodes[node].name));
        let _ = std::fs::remove_file(&log);
        let status = Command::new(binary("mariadbd"))
            .args(self.args(node))
            .arg("--wsrep-recover")
            .arg(format!("--log-error={}", log.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| self.failure(node, &format!("run mariadbd --wsrep-recover: {e}")))?;
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let position = text
            .lines()
            .rev()
            .find_map(|line| line.split("Recovered position: ").nth(1))
            .map(|p| p.trim().to_owned())
            .filter(|p| !p.ends_with(":-1"));
        if position.is_none() && !status.success() {
            return Err(self.failure(
                node,
                &format!("mariadbd --wsrep-recover failed ({status}); see {}", log.display()),
            ));
        }
        Ok(position)
    }

    /// Waits until node `node` is `Synced` in a cluster of `size` nodes,
    /// failing early (with its log) if its server exits.
    async fn wait_node_synced(&mut self, node: usize, size: usize) -> Result<(), String> {
        let deadline = Instant::now() + READY_WITHIN;
        let mut last = String::from("not reachable yet");
        loop {
            if !self.is_running(node) {
                return Err(self.failure(
                    node,
                    &format!("mariadbd exited before it was Synced (last seen: {last})"),
                ));
            }
            match self.synced(node).await {
                Ok((state, members)) if state == "Synced" && members == size => return Ok(()),
                Ok((state, members)) => last = format!("{state} in a cluster of {members}"),
                Err(e) => last = e,
            }
            if Instant::now() >= deadline {
                return Err(self.failure(
                    node,
                    &format!("not Synced in a cluster of {size} within {READY_WITHIN:?} (last seen: {last})"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Node `node`'s `wsrep_local_state_comment` and `wsrep_cluster_size`.
    async fn synced(&self, node: usize) -> Result<(String, usize), String> {
        let mut conn = self.connect(node).await.map_err(|e| e.to_string())?;
        let rows: Vec<(String, String)> =
            sqlx::query_as("SHOW STATUS WHERE Variable_name IN ('wsrep_local_state_comment', 'wsrep_cluster_size')")
                .fetch_all(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
        let _ = conn.close().await;
        let value = |name: &str| {
            rows.iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        let size = value("wsrep_cluster_size").parse().unwrap_or(0);
        Ok((value("wsrep_local_state_comment"), size))
    }
}

/// Runs `command` to its end, failing with its output unless it succeeds.
fn run(command: &mut Command) -> Result<(), String> {
    let out = command.output().map_err(|e| format!("run {command:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{command:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Where `binary` is on `PATH` (and the system directories servers live in).
fn which(binary: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file())
}

/// `binary`'s path, or its bare name when it is nowhere to be found.
fn binary(name: &str) -> PathBuf {
    which(name).unwrap_or_else(|| PathBuf::from(name))
}

/// Whether this process runs as root.
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}
