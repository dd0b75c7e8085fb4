//! The ledger as a child process: started, watched, killed, restarted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::{Mutex, Notify};

use crate::Error;

/// Kills and restarts, by cause.
#[derive(Debug, Default)]
pub struct ServiceCounts {
    /// Kills at random moments.
    pub random_kills: AtomicU64,
    /// Kills at fixed fractions of the workload.
    pub scheduled_kills: AtomicU64,
    /// Kills at idem's named fault points, by point.
    pub fault_point_kills: Mutex<BTreeMap<String, u64>>,
    /// Pauses (SIGSTOP … SIGCONT).
    pub pauses: AtomicU64,
    /// Times the service was started after the first.
    pub restarts: AtomicU64,
    /// Store faults the process injected (`IDEM_STORE_FAULT` lines), by
    /// `call/fault`.
    pub store_faults: Mutex<BTreeMap<String, u64>>,
    /// `/healthz` answers of "database unavailable" seen by
    /// [`Service::watch_health`].
    pub database_unavailable: AtomicU64,
    /// Times `/healthz` answered 200 again after such answers.
    pub recoveries: AtomicU64,
}

/// The `call/fault` of an `IDEM_STORE_FAULT call=<call> fault=<fault>` line.
fn store_fault(line: &str) -> Option<String> {
    let rest = line.strip_prefix("IDEM_STORE_FAULT ")?;
    let mut call = None;
    let mut fault = None;
    for part in rest.split_whitespace() {
        if let Some(c) = part.strip_prefix("call=") {
            call = Some(c);
        } else if let Some(f) = part.strip_prefix("fault=") {
            fault = Some(f);
        }
    }
    Some(format!("{}/{}", call?, fault?))
}

/// The fault seeds one instance's lives draw from (its `n`-th life runs
/// with `index * FAULT_SEEDS_PER_INSTANCE + n`): instances never share one.
const FAULT_SEEDS_PER_INSTANCE: u64 = 1 << 32;

/// A supervised ledger process.
pub struct Service {
    bin: PathBuf,
    /// The port it listens on.
    pub port: u16,
    database_url: String,
    env: Vec<(String, String)>,
    /// Arguments of a worker (`relay`, `project`); `None`: the HTTP service.
    worker: Option<Vec<String>>,
    /// Arguments after the database's (the vendors of withdrawals).
    extra: Vec<String>,
    /// Its index among instances on one database (0 when alone): its fault
    /// points draw a sequence of their own.
    index: u64,
    /// Its database pool's size.
    max_connections: u32,
    pid: AtomicU32,
    stopping: AtomicBool,
    ready: Notify,
    up: AtomicBool,
    spawn_failures: AtomicU64,
    /// What happened to it.
    pub counts: ServiceCounts,
    log: PathBuf,
}

fn signal(pid: u32, sig: &str) -> bool {
    std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Service {
    /// A service of `bin` (the server on `port`, or the worker `worker`)
    /// not started yet: instance 0, a pool of 16 connections.
    fn new(
        bin: &Path,
        port: u16,
        database_url: &str,
        env: Vec<(String, String)>,
        worker: Option<Vec<String>>,
        extra: Vec<String>,
        log: PathBuf,
    ) -> Self {
        Service {
            bin: bin.to_owned(),
            port,
            database_url: database_url.to_owned(),
            env,
            worker,
            extra,
            index: 0,
            max_connections: 16,
            pid: AtomicU32::new(0),
            stopping: AtomicBool::new(false),
            ready: Notify::new(),
            up: AtomicBool::new(false),
            spawn_failures: AtomicU64::new(0),
            counts: ServiceCounts::default(),
            log,
        }
    }

    /// Starts its supervisor.
    fn supervise_from_now(self) -> Arc<Self> {
        let service = Arc::new(self);
        tokio::spawn(service.clone().supervise());
        service
    }

    /// Starts its supervisor and answers once the server is healthy.
    async fn supervise_until_healthy(self) -> Result<Arc<Self>, Error> {
        let service = self.supervise_from_now();
        service.wait_healthy(Duration::from_secs(120)).await?;
        Ok(service)
    }

    /// Starts the ledger and keeps it running (restarting it whenever it
    /// dies) until [`Service::stop`].
    pub async fn start(
        bin: &Path,
        port: u16,
        database_url: &str,
        env: Vec<(String, String)>,
        log: PathBuf,
    ) -> Result<Arc<Self>, Error> {
        Self::start_with_args(bin, port, database_url, Vec::new(), env, log).await
    }

    /// [`start`](Self::start) for the instance `index` of several servers on
    /// one database: its fault points draw a sequence of their own, and its
    /// pool holds `max_connections` (so that all of them fit the server's
    /// connection limit).
    pub async fn start_instance(
        bin: &Path,
        port: u16,
        database_url: &str,
        env: Vec<(String, String)>,
        log: PathBuf,
        index: u64,
        max_connections: u32,
    ) -> Result<Arc<Self>, Error> {
        Service {
            index,
            max_connections,
            ..Self::new(bin, port, database_url, env, None, Vec::new(), log)
        }
        .supervise_until_healthy()
        .await
    }

    /// [`start`](Self::start), with `args` after the standard ones.
    pub async fn start_with_args(
        bin: &Path,
        port: u16,
        database_url: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
        log: PathBuf,
    ) -> Result<Arc<Self>, Error> {
        Self::new(bin, port, database_url, env, None, args, log)
            .supervise_until_healthy()
            .await
    }

    /// Starts a ledger worker (`ledger <args>`: a relay or a projection)
    /// and keeps it running until [`Service::stop`]; answers once it runs.
    pub async fn start_worker(
        bin: &Path,
        database_url: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
        log: PathBuf,
    ) -> Result<Arc<Self>, Error> {
        let service = Self::new(bin, 0, database_url, env, Some(args), Vec::new(), log).supervise_from_now();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while service.pid.load(Ordering::SeqCst) == 0 {
            if service.broken() || tokio::time::Instant::now() > deadline {
                return Err(Error::Service(format!(
                    "the worker {} did not start",
                    service.bin.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(service)
    }

    async fn supervise(self: Arc<Self>) {
        let mut generation = 0u64;
        while !self.stopping.load(Ordering::SeqCst) {
            let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log);
            let mut cmd = Command::new(&self.bin);
            match &self.worker {
                None => cmd.args(["--listen", &format!("127.0.0.1:{}", self.port)]),
                Some(args) => cmd.args(args),
            };
            cmd.args(["--database-url", &self.database_url])
                .args(["--max-connections", &self.max_connections.to_string()])
                .args(&self.extra)
                .env("RUST_LOG", "warn")
                .envs(self.env.iter().cloned())
                .env(
                    "LEDGER_FAULT_SEED",
                    (generation + self.index * FAULT_SEEDS_PER_INSTANCE).to_string(),
                )
                .stdin(Stdio::null())
                .stdout(match log.as_ref().ok().and_then(|f| f.try_clone().ok()) {
                    Some(f) => Stdio::from(f),
                    None => Stdio::null(),
                })
                .stderr(Stdio::piped())
                .kill_on_drop(true);
            let mut child = match cmd.spawn() {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("chaos: cannot start {}: {e}", self.bin.display());
                    self.spawn_failures.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            let pid = child.id().unwrap_or(0);
            self.pid.store(pid, Ordering::SeqCst);
            if let Some(stderr) = child.stderr.take() {
                let me = self.clone();
                let mut log = log.ok();
                tokio::spawn(async move {
                    let mut lines = BufReader::new(stderr).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        if let Some(point) = line.strip_prefix("IDEM_FAULT point=") {
                            // The service froze at a named fault point: kill it there.
                            if signal(pid, "-9") {
                                *me.counts
                                    .fault_point_kills
                                    .lock()
                                    .await
                                    .entry(point.trim().to_owned())
                                    .or_default() += 1;
                            }
                        }
                        if let Some(fault) = store_fault(&line) {
                            *me.counts.store_faults.lock().await.entry(fault).or_default() += 1;
                            continue;
                        }
                        if let Some(f) = log.as_mut() {
                            use std::io::Write;
                            let _ = writeln!(f, "{line}");
                        }
                    }
                });
            }
            let _ = child.wait().await;
            self.up.store(false, Ordering::SeqCst);
            self.pid.store(0, Ordering::SeqCst);
            generation += 1;
            if self.stopping.load(Ordering::SeqCst) {
                break;
            }
            self.counts.restarts.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.ready.notify_waiters();
    }

    /// Waits until `/healthz` answers 200.
    pub async fn wait_healthy(&self, within: Duration) -> Result<(), Error> {
        let client = ledger::http_builder().timeout(Duration::from_secs(2)).build()?;
        let url = format!("http://127.0.0.1:{}/healthz", self.port);
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Ok(r) = client.get(&url).send().await
                && r.status().is_success()
            {
                self.up.store(true, Ordering::SeqCst);
                return Ok(());
            }
            if self.spawn_failures.load(Ordering::SeqCst) >= 5 {
                return Err(Error::Service(format!(
                    "the ledger cannot be started ({})",
                    self.bin.display()
                )));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Service(format!(
                    "the ledger did not become healthy on port {} (log: {})",
                    self.port,
                    self.log.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Asks `/healthz` every quarter of a second until `calm`, counting
    /// the answers of 503 (the process is up, its database is not) and the
    /// 200s that follow them. A refused connection (the process is down) or
    /// an answer that takes longer than 15 s (paused) counts as neither.
    pub async fn watch_health(&self, calm: &AtomicBool) {
        let Ok(client) = ledger::http_builder().timeout(Duration::from_secs(15)).build() else {
            return;
        };
        let url = format!("http://127.0.0.1:{}/healthz", self.port);
        let mut unavailable = false;
        while !calm.load(Ordering::SeqCst) {
            if let Ok(r) = client.get(&url).send().await {
                if r.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE {
                    self.counts.database_unavailable.fetch_add(1, Ordering::SeqCst);
                    unavailable = true;
                } else if r.status().is_success() && unavailable {
                    self.counts.recoveries.fetch_add(1, Ordering::SeqCst);
                    unavailable = false;
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Whether the service can no longer be started.
    pub fn broken(&self) -> bool {
        self.spawn_failures.load(Ordering::SeqCst) >= 5
    }

    /// Kills the running process with SIGKILL (it is restarted).
    pub fn kill(&self) -> bool {
        let pid = self.pid.load(Ordering::SeqCst);
        pid != 0 && signal(pid, "-9")
    }

    /// Pauses the process for `d` (SIGSTOP, then SIGCONT).
    pub async fn pause(&self, d: Duration) -> bool {
        let pid = self.pid.load(Ordering::SeqCst);
        if pid == 0 || !signal(pid, "-STOP") {
            return false;
        }
        tokio::time::sleep(d).await;
        signal(pid, "-CONT");
        true
    }

    /// Stops the process for good.
    pub async fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let pid = self.pid.load(Ordering::SeqCst);
        if pid != 0 {
            signal(pid, "-CONT");
            signal(pid, "-TERM");
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), self.ready.notified()).await;
        let pid = self.pid.load(Ordering::SeqCst);
        if pid != 0 {
            signal(pid, "-9");
        }
    }
}

/// Several ledger servers on one database, each supervised on its own
/// (killed and restarted apart from the others), behind one
/// [`Balancer`](crate::balancer::Balancer).
pub struct Instances {
    /// The instances, by index.
    pub services: Vec<Arc<Service>>,
}

impl Instances {
    /// Starts one server per port, instance `i` on the database at
    /// `database_urls[i % database_urls.len()]` (one database, or one seen
    /// through the nodes of a cluster), one after the other (the first one
    /// migrates the database), each healthy before the next starts, and
    /// each only once `before(i)` has answered; `log(i)` is the log file of
    /// instance `i`; each pool holds `max_connections`.
    pub async fn start(
        bin: &Path,
        ports: &[u16],
        database_urls: &[String],
        env: Vec<(String, String)>,
        max_connections: u32,
        log: impl Fn(usize) -> PathBuf,
        before: impl AsyncFn(usize) -> Result<(), Error>,
    ) -> Result<Self, Error> {
        let mut services = Vec::with_capacity(ports.len());
        for (i, port) in ports.iter().enumerate() {
            before(i).await?;
            let url = &database_urls[i % database_urls.len()];
            services
                .push(Service::start_instance(bin, *port, url, env.clone(), log(i), i as u64, max_connections).await?);
        }
        Ok(Self { services })
    }

    /// The first instance (the harness's direct line: audit, payouts).
    pub fn first(&self) -> &Arc<Service> {
        &self.services[0]
    }

    /// The indexes of the instances running now.
    fn running(&self) -> Vec<usize> {
        (0..self.services.len())
            .filter(|i| self.services[*i].pid.load(Ordering::SeqCst) != 0)
            .collect()
    }

    /// Kills (SIGKILL) one running instance drawn at random; answers its
    /// index, or `None` if none was running.
    pub fn kill_any(&self, rng: &mut crate::rng::Rng) -> Option<usize> {
        let running = self.running();
        if running.is_empty() {
            return None;
        }
        let i = running[rng.range(0, running.len() as u64) as usize];
        self.services[i].kill().then_some(i)
    }

    /// Pauses one running instance drawn at random for `d`; answers its
    /// index, or `None` if none was running.
    pub async fn pause_any(&self, rng: &mut crate::rng::Rng, d: Duration) -> Option<usize> {
        let running = self.running();
        if running.is_empty() {
            return None;
        }
        let i = running[rng.range(0, running.len() as u64) as usize];
        self.services[i].pause(d).await.then_some(i)
    }

    /// Waits until every instance answers `/healthz`.
    pub async fn wait_healthy(&self, within: Duration) -> Result<(), Error> {
        for s in &self.services {
            s.wait_healthy(within).await?;
        }
        Ok(())
    }

    /// Whether some instance can no longer be started.
    pub fn broken(&self) -> bool {
        self.services.iter().any(|s| s.broken())
    }

    /// Stops every instance for good.
    pub async fn stop(&self) {
        for s in &self.services {
            s.stop().await;
        }
    }
}
