//! `chaos`: the reliability harness of idem.
//!
//! The guide, with examples: `docs/reliability.md` in the repository.
//!
//! It starts the `ledger` (built with the `fault-injection` feature) as a
//! child process on a fresh database, drives a workload of top-ups and
//! transfers through a fault proxy with retrying clients (`idem-client`: one
//! key per logical operation, reused on every retry), kills the service at random moments and
//! at idem's named fault points, kills its database sessions, pauses it, and
//! fires bursts of identical requests. Then, once the service is quiet, it
//! checks the history: conservation, at-most-once application of every key,
//! exactly-once application of every acknowledged success, byte-identical
//! responses per key, no application of a reused key with another body, and
//! no claim left in progress.
//!
//! With payouts (the default), the workload also requests payouts, paid by
//! two `ledger payouts` processes at a fake vendor of the harness's own that
//! drops answers, fails and refuses connections; the workers are killed and
//! paused past their lease; at the end every dead letter is redriven and each
//! committed payout must be paid exactly once at the vendor.
//!
//! With `--instances N` the ledger runs as N server processes on the one
//! database, behind a local round-robin balancer ([`balancer`]) in the fault
//! proxy; every kill and pause strikes one instance drawn at random, and
//! the report counts kills and requests per instance.
//!
//! Run: `cargo run --release -p chaos -- --engine postgres --ops 20000`.

pub mod balancer;
pub mod cargo;
mod check;
mod copy;
mod db;
pub mod dlqkill;
pub mod events;
pub mod gateway;
mod gwprocs;
pub mod payouts;
mod progress;
pub mod proxy;
mod report;
pub mod rng;
pub mod service;
pub mod storefaults;
pub mod withdrawals;
mod workload;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::balancer::{Balancer, BalancerCounts};
use crate::proxy::{Proxy, ProxyOdds};
use crate::rng::Rng;
use crate::service::Instances;

pub use db::Engine;
pub use report::{Counts, DatabaseNode, FaultCounts, InstanceCounts, Report};

/// Harness failures (not violations: those go in the report).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The database could not be prepared or read.
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    /// The ledger could not be built, started or reached.
    #[error("service: {0}")]
    Service(String),
    /// An HTTP client error outside the workload.
    #[error("http: {0}")]
    Http(#[from] reqwest::Error),
    /// I/O.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// Which faults are on (all by default).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Faults {
    /// The fault proxy: dropped responses, cut requests, delays.
    pub proxy: bool,
    /// `kill -9` at random moments.
    pub kills: bool,
    /// `kill -9` at idem's named fault points.
    pub fault_points: bool,
    /// Killing the service's database sessions.
    pub db_sessions: bool,
    /// Bursts of identical concurrent requests.
    pub bursts: bool,
    /// SIGSTOP/SIGCONT pauses of the service.
    pub pauses: bool,
    /// Store calls of the service and the payout workers failing on
    /// purpose (`LEDGER_STORE_FAULTS`): refused, timed out, or applied and
    /// reported as failed.
    pub store: bool,
}

/// The odds of each store fault per call of the service (three kinds:
/// about 1 % of its store calls fail one way or another).
pub const STORE_FAULT_RATE: f64 = 0.003;

/// The odds of each store fault per call of a payout worker (about 3 % of
/// its calls fail: it makes far fewer of them).
pub const WORKER_STORE_FAULT_RATE: f64 = 0.01;

impl Default for Faults {
    fn default() -> Self {
        Self {
            proxy: true,
            kills: true,
            fault_points: true,
            db_sessions: true,
            bursts: true,
            pauses: true,
            store: true,
        }
    }
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// The engine.
    pub engine: Engine,
    /// Concurrent clients.
    pub clients: usize,
    /// Logical operations.
    pub ops: usize,
    /// The seed of every random decision.
    pub seed: u64,
    /// Faults switched on.
    pub faults: Faults,
    /// Run the service with its idempotency claim switched off (the
    /// checker must then report double applications).
    pub break_idempotency: bool,
    /// A ledger binary built with `fault-injection`; built with cargo if absent.
    pub ledger_bin: Option<PathBuf>,
    /// PostgreSQL server (a fresh database is created on it).
    pub postgres_url: String,
    /// MySQL/MariaDB server (a fresh database is created on it).
    pub mysql_url: String,
    /// The client URLs of a MariaDB Galera cluster's nodes, in place of
    /// `mysql_url` (empty, the default: `mysql_url` alone). With two or more
    /// the run's database is created on the first node, and the run goes on
    /// once every node has it; ledger instance `i` connects to node
    /// `i % nodes`, and the relay, projection and payout workers spread over
    /// the nodes too; database sessions are killed on a node drawn at
    /// random; the checks read with `wsrep_sync_wait = 1`; the report says
    /// which node each process used.
    pub mysql_nodes: Vec<String>,
    /// Keep the database afterwards.
    pub keep_db: bool,
    /// Mean milliseconds between random kills.
    pub kill_interval_ms: u64,
    /// Publish the ledger's events through relay processes to a NATS
    /// server of the harness's own, project them with projection
    /// processes, kill both and restart the broker, and check the events.
    pub events: bool,
    /// The `nats-server` binary.
    pub nats_server: String,
    /// Request payouts in the workload, pay them with payout worker
    /// processes at a fake vendor under faults, kill and pause the workers,
    /// and check the payouts.
    pub payouts: bool,
    /// Ledger server processes on the database, behind the balancer.
    pub instances: usize,
}

impl Config {
    /// Defaults for `engine`: 8 clients, 2,000 operations, every fault on.
    pub fn new(engine: Engine, seed: u64) -> Self {
        Self {
            engine,
            clients: 8,
            ops: 2_000,
            seed,
            faults: Faults::default(),
            break_idempotency: false,
            ledger_bin: None,
            postgres_url: idem_conformance::env::postgres_url(),
            mysql_url: idem_conformance::env::mysql_url(),
            mysql_nodes: Vec::new(),
            keep_db: false,
            kill_interval_ms: 1_500,
            events: true,
            nats_server: std::env::var("CHAOS_NATS_SERVER").unwrap_or_else(|_| "nats-server".into()),
            payouts: true,
            instances: 1,
        }
    }
}

/// Finds or builds the ledger binary with the `fault-injection` feature:
/// `explicit`, `CHAOS_LEDGER_BIN`, the one the running `cargo test` built
/// (the ledger's tests turn the feature on), or a build of its own.
pub fn ledger_binary(explicit: Option<&PathBuf>) -> Result<PathBuf, Error> {
    if let Some(p) = explicit {
        return Ok(p.clone());
    }
    if let Ok(p) = std::env::var("CHAOS_LEDGER_BIN") {
        return Ok(PathBuf::from(p));
    }
    let built = cargo::fault_injection_ledger()
        .map_err(|e| Error::Service(format!("building the ledger with fault-injection: {e}")))?;
    // Keep a private copy: a plain `cargo build -p ledger` rewrites the
    // shared path with the build that has no fault points.
    let copy = built.with_file_name(format!(
        "ledger-chaos-{}-{}",
        std::process::id(),
        uuid::Uuid::now_v7().simple()
    ));
    copy::runnable_copy(&built, &copy)?;
    Ok(copy)
}

/// Runs the harness once.
pub async fn run(config: Config) -> Result<Report, Error> {
    let started = Instant::now();
    let bin = ledger_binary(config.ledger_bin.as_ref())?;
    let database = db::Database::create(&config).await?;
    let instances_n = config.instances.max(1);
    let mut ports = Vec::with_capacity(instances_n);
    while ports.len() < instances_n {
        let port = free_port().await?;
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    let port = ports[0];
    let nodes = database.nodes();
    // Which node each process connects to: instance `i` on node `i`, relay
    // `i` on node `i`, projector `i` on node `i + 1`, payout worker `i` on
    // node `i + 2` (modulo the nodes).
    let on = |node: usize| database.urls[node % nodes].as_str();
    let mut used_by: Vec<Vec<String>> = vec![Vec::new(); nodes];
    for i in 0..instances_n {
        used_by[i % nodes].push(format!("instance {i}"));
    }
    let mut env = Vec::new();
    if config.faults.fault_points {
        env.push((
            "LEDGER_FAULTS".to_owned(),
            "after_claim=0.004,before_commit=0.004,after_commit=0.004".to_owned(),
        ));
    }
    if config.break_idempotency {
        env.push(("LEDGER_BREAK_IDEMPOTENCY".to_owned(), "1".to_owned()));
    }
    let store_env = |rate: f64| -> Vec<(String, String)> {
        if config.faults.store {
            vec![("LEDGER_STORE_FAULTS".to_owned(), rate.to_string())]
        } else {
            Vec::new()
        }
    };
    env.extend(store_env(STORE_FAULT_RATE));
    let log = |i: usize| {
        let tag = if instances_n == 1 {
            String::new()
        } else {
            // The port too: two runs of one process with one seed write
            // logs of their own.
            format!("i{i}-{}.", ports[i])
        };
        std::env::temp_dir().join(format!("chaos-ledger-{}-{}.{tag}log", config.seed, std::process::id()))
    };
    // One instance keeps the pool it always had; several get 8 connections
    // each, so that three of them and the workers fit a server's default
    // limit (PostgreSQL's 100).
    let max_connections = if instances_n == 1 { 16 } else { 8 };
    // Each instance starts once its node has applied what the ones before
    // it wrote (the first one's migrations).
    let instances = Arc::new(
        Instances::start(&bin, &ports, &database.urls, env, max_connections, log, async |i| {
            database.caught_up(i).await
        })
        .await?,
    );
    // The first instance is the harness's direct line (the workload's health
    // check, the audit, the payouts' settling), used once it is healthy.
    let service = instances.first().clone();
    let mut rng = Rng::new(config.seed);
    let balancer = Balancer::new(ports.iter().map(|p| ([127, 0, 0, 1], *p).into()).collect());
    let odds = if config.faults.proxy {
        ProxyOdds {
            drop_response: 0.06,
            cut_request: 0.03,
            delay: 0.05,
        }
    } else {
        ProxyOdds::NONE
    };
    let proxy = Proxy::start(balancer.clone(), odds, rng.fork(1)).await?;

    let calm = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(progress::Progress::new(config.ops));
    let token = format!("chaos-{}-{}", config.seed, uuid::Uuid::now_v7());
    let payout_faults = Arc::new(tokio::sync::Mutex::new(payouts::PayoutFaults::default()));
    let sessions_killed = Arc::new(AtomicU64::new(0));
    let mut background = Vec::new();
    let event_faults = Arc::new(tokio::sync::Mutex::new(events::EventFaults::default()));
    let mut event_side = None;
    if config.events {
        // Named by its port too: runs of one test binary with one seed
        // (`CHAOS_SEED`) each have a store of their own.
        let nats_port = free_port().await?;
        let dir = std::env::temp_dir().join(format!("chaos-nats-{}-{}-{nats_port}", config.seed, std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let nats = events::Nats::start(&config.nats_server, nats_port, &dir).await?;
        let log = std::env::temp_dir().join(format!("chaos-events-{}-{}", config.seed, std::process::id()));
        for i in 0..2 {
            used_by[i % nodes].push(format!("relay {i}"));
            used_by[(i + 1) % nodes].push(format!("projector {i}"));
        }
        let workers = Arc::new(events::Workers::start(&bin, [on(0), on(1)], [on(1), on(2)], &nats.url(), &log).await?);
        let (w, n, c, r, f) = (
            workers.clone(),
            nats.clone(),
            calm.clone(),
            rng.fork(6),
            event_faults.clone(),
        );
        background.push(tokio::spawn(events::attack(w, n, c, r, f)));
        event_side = Some((nats, workers));
    }
    // Payouts: the ledger server runs no payout worker; two `ledger payouts`
    // processes do, so their kills and pauses are their own.
    let mut payout_side = None;
    // `idem`, whose `dlq redrive` the payouts' settling kills mid-send.
    let idem_bin = match (config.payouts, std::env::var("CHAOS_IDEM_BIN")) {
        (false, _) => None,
        (true, Ok(p)) => Some((PathBuf::from(p), false)),
        (true, Err(_)) => Some((gwprocs::idem_binary(None)?, true)),
    };
    if config.payouts {
        let vendor = payouts::Vendor::start(free_port().await?).await?;
        let log = std::env::temp_dir().join(format!("chaos-payouts-{}-{}", config.seed, std::process::id()));
        for i in 0..2 {
            used_by[(i + 2) % nodes].push(format!("payouts {i}"));
        }
        let workers = payouts::start_workers(
            &bin,
            [on(2), on(3)],
            &vendor.url,
            &log,
            &store_env(WORKER_STORE_FAULT_RATE),
        )
        .await?;
        let (w, v, c, r, f) = (
            workers.clone(),
            vendor.clone(),
            calm.clone(),
            rng.fork(7),
            payout_faults.clone(),
        );
        background.push(tokio::spawn(payouts::attack_workers(w, v, c, r, f)));
        let (v, c, r, f) = (vendor.clone(), calm.clone(), rng.fork(8), payout_faults.clone());
        let held = payouts::HeldWindows {
            progress: progress.clone(),
            database_url: database.url.clone(),
            tenant: ledger::tenant_for_token(&token).as_str().to_owned(),
        };
        background.push(tokio::spawn(payouts::attack_vendor(v, c, r, f, held)));
        payout_side = Some((vendor, workers));
    }
    if config.faults.kills {
        let (instances, calm, mut r, mean) = (instances.clone(), calm.clone(), rng.fork(2), config.kill_interval_ms);
        let config_seed = config.seed;
        background.push(tokio::spawn(async move {
            let mut pick = victims(config_seed, 2);
            while !calm.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(r.range(mean / 2, mean * 3 / 2 + 1))).await;
                if !calm.load(Ordering::SeqCst)
                    && let Some(i) = instances.kill_any(&mut pick)
                {
                    instances.services[i].counts.random_kills.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    if config.faults.kills {
        // Besides the random kills, one at each quarter of the workload:
        // the kills a run promises do not depend on how long it lasts.
        let (instances, calm, progress, mut pick) = (
            instances.clone(),
            calm.clone(),
            progress.clone(),
            victims(config.seed, 9),
        );
        background.push(tokio::spawn(async move {
            for fraction in [0.25, 0.5, 0.75] {
                if !progress.wait_for(fraction, &calm).await {
                    break;
                }
                // Between a kill and the restart there is no process to
                // kill: try again until one is.
                loop {
                    if let Some(i) = instances.kill_any(&mut pick) {
                        instances.services[i]
                            .counts
                            .scheduled_kills
                            .fetch_add(1, Ordering::SeqCst);
                        break;
                    }
                    if instances.broken() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }));
    }
    if config.faults.pauses {
        let (instances, calm, mut r, mut pick) =
            (instances.clone(), calm.clone(), rng.fork(3), victims(config.seed, 3));
        background.push(tokio::spawn(async move {
            while !calm.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(r.range(2_000, 5_000))).await;
                let d = Duration::from_millis(r.range(200, 1_500));
                if !calm.load(Ordering::SeqCst)
                    && let Some(i) = instances.pause_any(&mut pick, d).await
                {
                    instances.services[i].counts.pauses.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    let killed_per_node: Arc<Vec<AtomicU64>> = Arc::new((0..nodes).map(|_| AtomicU64::new(0)).collect());
    if config.faults.db_sessions && config.engine != Engine::Sqlite {
        let (database, calm, mut r, killed) = (database.clone(), calm.clone(), rng.fork(4), sessions_killed.clone());
        let per_node = killed_per_node.clone();
        // On a cluster, the node whose sessions are killed: drawn from a
        // stream of its own, so a single server's schedule is unchanged.
        let mut pick = victims(config.seed, 10);
        background.push(tokio::spawn(async move {
            // Until `calm`, and past it until one session has been killed
            // (a bounded number of tries).
            let mut tries_past_calm = 0;
            let go_on = |tries: u32| !calm.load(Ordering::SeqCst) || (killed.load(Ordering::SeqCst) == 0 && tries < 30);
            while go_on(tries_past_calm) {
                tokio::time::sleep(Duration::from_millis(r.range(700, 2_000))).await;
                tries_past_calm += u32::from(calm.load(Ordering::SeqCst));
                if go_on(tries_past_calm) {
                    let node = if nodes > 1 {
                        pick.range(0, nodes as u64) as usize
                    } else {
                        0
                    };
                    match database.kill_sessions_on(node).await {
                        Ok(n) => {
                            killed.fetch_add(n, Ordering::SeqCst);
                            per_node[node].fetch_add(n, Ordering::SeqCst);
                        }
                        Err(e) => eprintln!("chaos: could not kill database sessions: {e}"),
                    }
                }
            }
        }));
    }

    if nodes > 1 {
        // Each instance watched: its answers while its node is away, and
        // its recovery.
        for s in &instances.services {
            let (s, calm) = (s.clone(), calm.clone());
            background.push(tokio::spawn(async move { s.watch_health(&calm).await }));
        }
    }

    let base = format!("http://{}", proxy.addr);
    let direct = format!("http://127.0.0.1:{port}");
    let mut phases = BTreeMap::new();
    let mut lap = started;
    let mut phase = |name: &str| {
        phases.insert(name.to_owned(), lap.elapsed().as_secs_f64());
        lap = Instant::now();
    };
    phase("setup");
    let outcome = workload::run(&config, &base, &token, rng.fork(5), &service, progress).await;
    phase("workload");

    // Quiesce: no more faults, the service up, every lease long expired.
    calm.store(true, Ordering::SeqCst);
    proxy.calm();
    for task in background {
        let _ = task.await;
    }
    instances.wait_healthy(Duration::from_secs(120)).await?;
    phase("quiesce");
    let outcome = outcome?;
    let mut violations = outcome.violations.clone();
    let mut payout_counts = payouts::PayoutCounts::default();
    if let Some((vendor, _)) = &payout_side {
        let idem = idem_bin.as_ref().map(|(p, _)| p.as_path()).unwrap_or(Path::new("idem"));
        payout_counts = payouts::settle_and_check(
            &database,
            vendor,
            idem,
            &format!("http://127.0.0.1:{port}"),
            &token,
            &outcome,
            Duration::from_secs(180),
            &payout_faults,
            &mut violations,
        )
        .await?;
    }
    phase("payouts");
    let audit = check::history(&config, &database, &direct, &token, &outcome, &mut violations).await?;
    phase("history");
    let mut event_counts = events::EventCounts::default();
    if let Some((nats, workers)) = &event_side {
        // Every in-flight message of a killed projector is delivered again
        // after the consumer's ack wait (5 s here): allow many of those.
        event_counts = events::check(&database, &nats.url(), Duration::from_secs(180), &mut violations).await?;
        workers.stop().await;
        nats.stop().await;
    }

    let mut store_faults = BTreeMap::new();
    if let Some((vendor, workers)) = &payout_side {
        let mut f = payout_faults.lock().await;
        for w in workers {
            w.stop().await;
            f.worker_restarts += w.counts.restarts.load(Ordering::SeqCst);
            for (fault, n) in w.counts.store_faults.lock().await.iter() {
                *store_faults.entry(fault.clone()).or_default() += n;
            }
        }
        vendor.stop();
    }
    phase("events_and_stop");
    instances.stop().await;
    drop(service);
    let pc = &proxy.counts;
    let mut faults = FaultCounts {
        responses_dropped: pc.responses_dropped.load(Ordering::SeqCst),
        connections_cut: pc.connections_cut.load(Ordering::SeqCst),
        delays: pc.delays.load(Ordering::SeqCst),
        sessions_killed: sessions_killed.load(Ordering::SeqCst),
        ..FaultCounts::default()
    };
    let BalancerCounts {
        served,
        refused,
        none_up: balancer_none_up,
    } = balancer.counts();
    let mut per_instance = Vec::with_capacity(instances_n);
    for (i, s) in instances.services.iter().enumerate() {
        let c = &s.counts;
        for (fault, n) in c.store_faults.lock().await.iter() {
            *store_faults.entry(fault.clone()).or_default() += n;
        }
        let points = c.fault_point_kills.lock().await.clone();
        for (point, n) in &points {
            *faults.fault_point_kills.entry(point.clone()).or_default() += n;
        }
        let counts = InstanceCounts {
            port: s.port,
            served: served[i],
            refused: refused[i],
            random_kills: c.random_kills.load(Ordering::SeqCst),
            scheduled_kills: c.scheduled_kills.load(Ordering::SeqCst),
            fault_point_kills: points.values().sum(),
            pauses: c.pauses.load(Ordering::SeqCst),
            restarts: c.restarts.load(Ordering::SeqCst),
            database_node: i % nodes,
            database_unavailable: c.database_unavailable.load(Ordering::SeqCst),
            recoveries: c.recoveries.load(Ordering::SeqCst),
        };
        faults.random_kills += counts.random_kills;
        faults.scheduled_kills += counts.scheduled_kills;
        faults.pauses += counts.pauses;
        faults.restarts += counts.restarts;
        per_instance.push(counts);
    }
    faults.store_faults = store_faults;
    let database_nodes = used_by
        .into_iter()
        .enumerate()
        .map(|(node, used_by)| DatabaseNode {
            url: idem_core::redact_credentials(&database.urls[node]),
            used_by,
            sessions_killed: killed_per_node[node].load(Ordering::SeqCst),
        })
        .collect();
    if !config.keep_db {
        database.drop_database().await;
    }
    phase("teardown");
    if config.ledger_bin.is_none() && std::env::var("CHAOS_LEDGER_BIN").is_err() {
        let _ = std::fs::remove_file(&bin);
    }
    if let Some((idem, true)) = &idem_bin {
        let _ = std::fs::remove_file(idem);
    }
    let logs = process_logs(config.seed);
    // A run told to break idempotency is meant to find violations.
    if violations.is_empty() || config.break_idempotency {
        for log in &logs {
            let _ = std::fs::remove_file(log);
        }
    } else {
        eprintln!("chaos: the processes' logs are kept for the violations:");
        for log in &logs {
            eprintln!("  {}", log.display());
        }
    }
    Ok(Report {
        seed: config.seed,
        engine: config.engine.name().to_owned(),
        clients: config.clients,
        instances: instances_n,
        per_instance,
        balancer_none_up,
        database_nodes,
        faults_enabled: config.faults,
        break_idempotency: config.break_idempotency,
        counts: outcome.counts,
        faults,
        audit,
        duration_secs: started.elapsed().as_secs_f64(),
        phase_secs: phases,
        event_faults: event_faults.lock().await.clone(),
        events: event_counts,
        payouts_enabled: config.payouts,
        payout_faults: payout_faults.lock().await.clone(),
        payouts: payout_counts,
        violations,
    })
}

/// The log files of this run's child processes (ledger, relays, projectors,
/// payout workers), all named `chaos-<what>-<seed>-<pid>…`.
fn process_logs(seed: u64) -> Vec<PathBuf> {
    let tag = format!("-{seed}-{}.", std::process::id());
    let ours = |name: &str| {
        ["chaos-ledger", "chaos-events", "chaos-payouts"]
            .iter()
            .any(|what| name.strip_prefix(what).is_some_and(|rest| rest.starts_with(&tag)))
    };
    let Ok(dir) = std::fs::read_dir(std::env::temp_dir()) else {
        return Vec::new();
    };
    let mut logs: Vec<PathBuf> = dir
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(ours))
        .map(|e| e.path())
        .collect();
    logs.sort();
    logs
}

/// The stream that draws which instance a kind of fault strikes: apart from
/// the run's other streams, so that adding instances changes no other
/// decision of a seed's schedule.
fn victims(seed: u64, kind: u64) -> Rng {
    Rng::new(seed ^ 0x1A57_A4CE_0000_0000 ^ kind)
}

async fn free_port() -> Result<u16, Error> {
    Ok(idem_conformance::free_port())
}
