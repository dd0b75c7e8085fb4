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
    /// A service of `bin` (the server on `port`, or the worker `worker`),
    /// with its supervisor started.
    fn supervised(
        bin: &Path,
        port: u16,
        database_url: &str,
        env: Vec<(String, String)>,
        worker: Option<Vec<String>>,
        log: PathBuf,
    ) -> Arc<Self> {
        Self::supervised_with(bin, port, database_url, env, worker, Vec::new(), log)
    }

    fn supervised_with(
        bin: &Path,
        port: u16,
        database_url: &str,
        env: Vec<(String, String)>,
        worker: Option<Vec<String>>,
        extra: Vec<String>,
        log: PathBuf,
    ) -> Arc<Self> {
        let service = Arc::new(Service {
            bin: bin.to_owned(),
            port,
            database_url: database_url.to_owned(),
            env,
            worker,
            extra,
            pid: AtomicU32::new(0),
            stopping: AtomicBool::new(false),
            ready: Notify::new(),
            up: AtomicBool::new(false),
            spawn_failures: AtomicU64::new(0),
            counts: ServiceCounts::default(),
            log,
        });
        tokio::spawn(service.clone().supervise());
        service
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
        let service = Self::supervised(bin, port, database_url, env, None, log);
        service.wait_healthy(Duration::from_secs(120)).await?;
        Ok(service)
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
        let service = Self::supervised_with(bin, port, database_url, env, None, args, log);
        service.wait_healthy(Duration::from_secs(120)).await?;
        Ok(service)
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
        let service = Self::supervised(bin, 0, database_url, env, Some(args), log);
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
                .args(["--max-connections", "16"])
                .args(&self.extra)
                .env("RUST_LOG", "warn")
                .envs(self.env.iter().cloned())
                .env("LEDGER_FAULT_SEED", generation.to_string())
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
