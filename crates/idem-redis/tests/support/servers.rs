//! Redis servers a test starts for itself on free loopback ports: a single
//! server with the settings a test needs (an eviction policy, commands
//! disabled), or a 3-master Redis Cluster. Both are stopped and their files
//! removed when dropped, also when the test panics. They need
//! `redis-server` and `redis-cli` on the machine and fail loudly without.
//!
//! Test crates include this file with
//! `#[path = "../../idem-redis/tests/support/servers.rs"] mod servers;`.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free loopback port whose cluster-bus port (+10000) is free as well.
pub(crate) fn free_port() -> u16 {
    idem_conformance::free_port_beside(10_000)
}

fn scratch_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "idem-{what}-{}-{}",
        std::process::id(),
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn spawn(port: u16, dir: &std::path::Path, args: &[&str]) -> Child {
    Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start redis-server (install redis-server): {e}"))
}

/// Starts redis-server with `args` on a free port and waits until it
/// answers itself (its `INFO` names its process): a port another process took between the choice
/// and the bind (the server then exits), or a server still loading, is not
/// taken for ready; another port is tried instead.
fn spawn_ready(dir: &std::path::Path, args: &[&str]) -> (Child, u16) {
    for _ in 0..10 {
        let port = free_port();
        let mut child = spawn(port, dir, args);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if child.try_wait().ok().flatten().is_some() {
                break; // it could not bind: try another port
            }
            if serves(port, child.id()) {
                return (child, port);
            }
            assert!(Instant::now() < deadline, "redis-server on {port} did not answer PING");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    panic!("redis-server did not start on any of 10 free ports");
}

/// Whether the server answering on `port` is the process `pid` (its
/// `INFO server` says so): not another test's server on a port taken first.
fn serves(port: u16, pid: u32) -> bool {
    use std::io::{Read, Write};
    let Ok(mut tcp) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = tcp.set_read_timeout(Some(Duration::from_secs(1)));
    if tcp.write_all(b"INFO server\r\n").is_err() {
        return false;
    }
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = tcp.read(&mut buf) {
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&seen);
        if let Some(line) = text.lines().find(|l| l.starts_with("process_id:")) {
            return line.trim_start_matches("process_id:").trim() == pid.to_string();
        }
        if text.starts_with("-LOADING") || seen.len() > 64 * 1024 {
            return false; // still loading, or not a Redis we know
        }
        if text.starts_with('-') {
            // INFO renamed away (a test's own setting): a server that
            // answers and whose process is still alive a moment later (it
            // bound the port) is ours.
            std::thread::sleep(Duration::from_millis(200));
            return alive(pid);
        }
    }
    false
}
/// One redis-server of the test's own.
pub(crate) struct RedisServer {
    child: Child,
    /// Its port on 127.0.0.1.
    pub(crate) port: u16,
    dir: PathBuf,
}

impl RedisServer {
    /// Starts a server with `args` added to its command line (for example
    /// `["--maxmemory-policy", "allkeys-lru"]`), and waits until it listens.
    pub(crate) fn start(args: &[&str]) -> Self {
        let dir = scratch_dir("redis");
        let (child, port) = spawn_ready(&dir, args);
        Self { child, port, dir }
    }

    /// Its URL.
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A 3-master Redis Cluster of the test's own.
pub(crate) struct RedisCluster {
    nodes: Vec<Child>,
    /// The masters' ports on 127.0.0.1.
    pub(crate) ports: Vec<u16>,
    dir: PathBuf,
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            let _ = n.kill();
            let _ = n.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl RedisCluster {
    /// Starts three masters with AOF and `noeviction`, joins them into a
    /// cluster covering every slot, and waits for `cluster_state:ok`.
    pub(crate) fn start() -> Self {
        let dir = scratch_dir("redis-cluster");
        let mut cluster = Self {
            nodes: Vec::new(),
            ports: Vec::new(),
            dir: dir.clone(),
        };
        for i in 0..3 {
            let node_dir = dir.join(format!("n{i}"));
            std::fs::create_dir_all(&node_dir).unwrap();
            let (child, port) = spawn_ready(
                &node_dir,
                &[
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
                ],
            );
            cluster.nodes.push(child);
            cluster.ports.push(port);
        }
        let mut create = vec!["create".to_owned()];
        create.extend(cluster.ports.iter().map(|p| format!("127.0.0.1:{p}")));
        create.extend(["--cluster-replicas", "0", "--cluster-yes"].map(str::to_owned));
        cluster_cli(&create);
        let ok = polled(Duration::from_millis(100), || {
            cluster
                .ports
                .iter()
                .all(|p| ask(*p, &["cluster", "info"]).contains("cluster_state:ok"))
        });
        assert!(ok, "the cluster did not reach cluster_state:ok");
        cluster
    }

    /// Adds a replica of the first master with `args` added to its
    /// command line, and waits until the cluster lists it as a replica.
    /// Answers its port.
    #[allow(dead_code)]
    pub(crate) fn add_replica(&mut self, args: &[&str]) -> u16 {
        let node_dir = self.dir.join(format!("r{}", self.nodes.len()));
        std::fs::create_dir_all(&node_dir).unwrap();
        let mut all = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--save",
            "",
        ];
        all.extend_from_slice(args);
        let (child, port) = spawn_ready(&node_dir, &all);
        self.nodes.push(child);
        cluster_cli(&[
            "add-node".to_owned(),
            format!("127.0.0.1:{port}"),
            format!("127.0.0.1:{}", self.ports[0]),
            "--cluster-slave".to_owned(),
        ]);
        // Every master knows it as a replica (gossip reaches them one after
        // the other).
        let listed = polled(Duration::from_millis(100), || {
            self.ports.iter().all(|master| {
                ask(*master, &["cluster", "nodes"])
                    .lines()
                    .any(|l| l.contains(&format!(":{port}@")) && l.contains("slave"))
            })
        });
        assert!(listed, "the replica on {port} did not join the cluster");
        port
    }

    /// The masters' URLs.
    pub(crate) fn urls(&self) -> Vec<String> {
        self.ports.iter().map(|p| format!("redis://127.0.0.1:{p}")).collect()
    }

    /// How many keys each master holds.
    pub(crate) fn keys_per_master(&self) -> Vec<usize> {
        self.ports
            .iter()
            .map(|p| ask(*p, &["dbsize"]).trim().parse().unwrap_or(0))
            .collect()
    }
}

/// Runs `redis-cli` with `args`.
fn redis_cli<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> std::process::Output {
    Command::new("redis-cli")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run redis-cli: {e}"))
}

/// What `redis-cli -p <port> <args…>` prints.
pub(crate) fn ask(port: u16, args: &[&str]) -> String {
    let mut all = vec!["-p".to_owned(), port.to_string()];
    all.extend(args.iter().map(|a| (*a).to_owned()));
    String::from_utf8_lossy(&redis_cli(&all).stdout).into_owned()
}

/// Runs `redis-cli --cluster <args…>`, asserting that it succeeded.
fn cluster_cli(args: &[String]) {
    let mut all = vec!["--cluster".to_owned()];
    all.extend_from_slice(args);
    let out = redis_cli(&all);
    assert!(
        out.status.success(),
        "redis-cli --cluster {} failed: {}{}",
        args[0],
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Asks `done` every `every` for up to 30 s: whether it came to hold.
pub(crate) fn polled(every: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// Whether the process `pid` still runs (Linux).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "))
}
