//! Withdrawals under attack: `POST /v1/withdrawals`, the ledger's
//! multi-step operation across two vendors (a debit, an FX quote at a
//! vendor **without idempotency keys**, a payout at a vendor that forgets
//! its keys after a horizon, a settle; a declined payout credited back).
//!
//! Retrying clients (one key per withdrawal, bursts of twins) drive the
//! ledger while it is killed with `kill -9` at random and at every named
//! point of a run (`IDEM_FAULT point=<point> step=<step>`: a local step
//! written and not committed, an external step marked sent and not sent,
//! answered and not recorded, recorded), while its store refuses, times
//! out on, or applies and reports as failed the operations' reads and
//! writes and their steps' commits (`LEDGER_STORE_FAULTS`), while its
//! database sessions are killed (PostgreSQL, MariaDB), while a `ledger
//! complete` process
//! races the server's own completers and the clients' retries, and while
//! the vendors lose answers after applying them, answer late, forget keys
//! and fail their lookups. Once quiet, every operation held on an unknown
//! outcome is settled by an operator from the vendors' truth (`idem ops
//! mark`), the completers finish them, and the judge checks each
//! withdrawal: debited once, each vendor effect at most once, paid exactly
//! when completed, credited back exactly when compensated, every operation
//! final, the audit conserved, every acknowledged answer replayed byte for
//! byte.
//!
//! With recovery points switched off (`--break-recovery-points`: every run
//! that takes an operation over starts it from its first step), the judge
//! must report the double debits and double bookings they prevent.
//!
//! One concern a file: the clients (`clients.rs`), the attacks
//! (`attacks.rs`), the operator's pass (`operator.rs`), and the judge
//! (`judge.rs`).

mod attacks;
mod clients;
mod judge;
mod operator;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::db::Database;
use crate::rng::Rng;
use crate::service::Service;
use crate::{Config, Engine, Error, free_port, gwprocs, ledger_binary};

/// How long a run holds a withdrawal, in seconds (short, so kills hand
/// operations over within the run).
pub const LEASE_SECS: u64 = 3;

/// How long the payout vendor remembers a key, in seconds: shorter than
/// most takeovers after a kill, so resends cross it and must ask the vendor.
pub const VENDOR_KEY_HORIZON_SECS: u64 = 3;

/// The odds of stopping at each named point of each step
/// (`LEDGER_STEP_FAULTS`).
const STEP_FAULT_RATE: f64 = 0.02;

/// The odds of each store fault per store call, in the server and the
/// completer (`LEDGER_STORE_FAULTS`): an operation's reads and writes, its
/// steps' commits, the idempotency and dead-letter calls beside them,
/// refused, timed out, or applied and reported as failed.
pub const STORE_FAULT_RATE: f64 = 0.005;

/// The local steps of a withdrawal (forward and compensating).
const LOCAL_STEPS: [&str; 3] = ["debit", "settle", "credit-back"];

/// Its external steps.
const EXTERNAL_STEPS: [&str; 3] = ["fx-quote", "payout", "release-quote"];

/// Every named point of every step (`step:point`): a local step written and
/// not committed, and committed; an external step marked sent and not
/// sent, answered and not recorded, and recorded.
pub fn step_points() -> Vec<String> {
    let local = ["before_step_commit", "after_step_commit"];
    let external = ["after_sent_mark", "after_answer", "after_step_commit"];
    let mut points = Vec::new();
    for step in LOCAL_STEPS {
        points.extend(local.iter().map(|p| format!("{step}:{p}")));
    }
    for step in EXTERNAL_STEPS {
        points.extend(external.iter().map(|p| format!("{step}:{p}")));
    }
    points
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct WithdrawalsConfig {
    /// The engine.
    pub engine: Engine,
    /// The seed of every random decision.
    pub seed: u64,
    /// Withdrawals requested.
    pub withdrawals: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// Mean milliseconds between random kills of the server.
    pub kill_interval_ms: u64,
    /// Switch the recovery points off (the judge must then fail).
    pub break_recovery_points: bool,
    /// A ledger binary built with `fault-injection`; built with cargo if absent.
    pub ledger_bin: Option<PathBuf>,
    /// The `idem` binary (built with cargo if absent).
    pub idem_bin: Option<PathBuf>,
    /// PostgreSQL server (a fresh database is created on it).
    pub postgres_url: String,
    /// MySQL/MariaDB server (a fresh database is created on it).
    pub mysql_url: String,
}

impl WithdrawalsConfig {
    /// Defaults for `engine`: 6 clients, 200 withdrawals, a kill every 2 s
    /// on average.
    pub fn new(engine: Engine, seed: u64) -> Self {
        let base = Config::new(engine, seed);
        Self {
            engine,
            seed,
            withdrawals: 200,
            clients: 6,
            kill_interval_ms: 2_000,
            break_recovery_points: false,
            ledger_bin: None,
            idem_bin: None,
            postgres_url: base.postgres_url,
            mysql_url: base.mysql_url,
        }
    }
}

/// What the clients saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ClientCounts {
    /// Withdrawals requested.
    pub requested: u64,
    /// Answered 201 (paid).
    pub paid: u64,
    /// Answered 422 (short of funds, or declined and credited back).
    pub declined: u64,
    /// Answered 409 held (an unknown outcome).
    pub held: u64,
    /// No definite answer within the client's deadline.
    pub unanswered: u64,
    /// Bursts of twins (one key sent by several clients at once).
    pub bursts: u64,
    /// Later twins refused by the first step whose refusal told another
    /// balance than the first twin's (each counted against the first):
    /// nothing is recorded for such a refusal, so each twin's call read the
    /// account afresh (their problem types agreed).
    pub refusals_read_afresh: u64,
}

/// Faults that really happened.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WithdrawalFaults {
    /// `kill -9` of the server at random moments.
    pub random_kills: u64,
    /// `kill -9` at named points, by `point step=<step>`.
    pub point_kills: BTreeMap<String, u64>,
    /// `kill -9` of the `ledger complete` process.
    pub completer_kills: u64,
    /// Restarts of the server.
    pub restarts: u64,
    /// Windows in which the vendors lost answers after applying them.
    pub lost_answer_windows: u64,
    /// Windows in which the vendors answered late.
    pub slow_windows: u64,
    /// Windows in which lookups by reference failed (so takeovers past a
    /// send could not tell, and held the operation).
    pub lookup_failure_windows: u64,
    /// Times the payout vendor's clock jumped past its key horizon.
    pub keys_forgotten: u64,
    /// Store faults the server and the completer injected, by
    /// `call/fault` (`step_write/applied_then_refused`: an operation's
    /// recovery point, sent mark or answer written and reported as failed).
    pub store_faults: BTreeMap<String, u64>,
    /// The service's database sessions killed (PostgreSQL and MariaDB).
    pub sessions_killed: u64,
}

/// How the operations ended, and the effects counted.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WithdrawalCounts {
    /// Operations by state once quiet, before the operator's pass.
    pub states_before_operator: BTreeMap<String, u64>,
    /// Operations by state at the end.
    pub states: BTreeMap<String, u64>,
    /// Held operations the operator settled (`applied`, `not_applied`).
    pub operator_verdicts: BTreeMap<String, u64>,
    /// Withdrawals debited (rows of `ledger_withdrawals`).
    pub debited: u64,
    /// Withdrawals paid, declined, still pending.
    pub by_state: BTreeMap<String, u64>,
    /// Quotes the FX vendor booked, and cancelled.
    pub quotes_booked: u64,
    /// Quotes cancelled (released by compensations).
    pub quotes_cancelled: u64,
    /// Payouts the payout vendor made.
    pub payouts_made: u64,
    /// Acknowledged answers replayed byte for byte at the end.
    pub replays_checked: u64,
}

/// The result of a run.
#[derive(Debug, Clone, Serialize)]
pub struct WithdrawalsReport {
    /// The seed.
    pub seed: u64,
    /// The engine.
    pub engine: String,
    /// Whether the recovery points were switched off.
    pub break_recovery_points: bool,
    /// What the clients saw.
    pub clients: ClientCounts,
    /// Faults that happened.
    pub faults: WithdrawalFaults,
    /// How the operations ended.
    pub counts: WithdrawalCounts,
    /// The service's final audit.
    pub audit: serde_json::Value,
    /// Seconds the run took.
    pub duration_secs: f64,
    /// Every property that failed; empty when all held.
    pub violations: Vec<String>,
}

/// The vendors' base URL for the ledger's flags.
fn vendor_args(url: &str) -> Vec<String> {
    [
        "--fx-url",
        url,
        "--vendor-url",
        url,
        "--withdrawal-lease-secs",
        &LEASE_SECS.to_string(),
        "--vendor-key-horizon-secs",
        &VENDOR_KEY_HORIZON_SECS.to_string(),
        "--vendor-horizon-margin-secs",
        "1",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// Runs the attack once.
pub async fn run_withdrawals(config: WithdrawalsConfig) -> Result<WithdrawalsReport, Error> {
    let started = Instant::now();
    let bin = ledger_binary(config.ledger_bin.as_ref())?;
    let idem = match &config.idem_bin {
        Some(p) => p.clone(),
        None => match std::env::var("CHAOS_IDEM_BIN") {
            Ok(p) => PathBuf::from(p),
            Err(_) => gwprocs::idem_binary(None)?,
        },
    };
    let mut base = Config::new(config.engine, config.seed);
    base.postgres_url.clone_from(&config.postgres_url);
    base.mysql_url.clone_from(&config.mysql_url);
    let database = Database::create(&base).await?;
    let (vendor_url, vendor) = fake_vendor::start(
        fake_vendor::Options {
            key_horizon: Duration::from_secs(VENDOR_KEY_HORIZON_SECS),
            idempotency: true,
        },
        None,
    )
    .await?;

    let points: Vec<String> = step_points()
        .into_iter()
        .map(|at| format!("{at}={STEP_FAULT_RATE}"))
        .collect();
    let mut env = vec![
        ("LEDGER_STEP_FAULTS".to_owned(), points.join(",")),
        ("LEDGER_STORE_FAULTS".to_owned(), STORE_FAULT_RATE.to_string()),
        ("LEDGER_FAULT_SEED".to_owned(), config.seed.to_string()),
    ];
    if config.break_recovery_points {
        env.push(("LEDGER_BREAK_RECOVERY_POINTS".to_owned(), "1".to_owned()));
    }
    let tag = format!("{}-{}", config.seed, std::process::id());
    let port = free_port().await?;
    let log = std::env::temp_dir().join(format!("chaos-ledger-{tag}.withdrawals.log"));
    let mut server_args = vendor_args(&vendor_url);
    server_args.extend(["--completers".to_owned(), "2".to_owned()]);
    let service = Service::start_with_args(&bin, port, &database.url, server_args, env.clone(), log).await?;
    // A completer process of its own, racing the server's and the clients.
    let mut completer_args = vec!["complete".to_owned()];
    completer_args.extend(vendor_args(&vendor_url));
    let log = std::env::temp_dir().join(format!("chaos-ledger-{tag}.completer.log"));
    let completer = Service::start_worker(&bin, &database.url, completer_args, env, log).await?;

    let mut rng = Rng::new(config.seed);
    let calm = Arc::new(AtomicBool::new(false));
    let faults = Arc::new(tokio::sync::Mutex::new(WithdrawalFaults::default()));
    let attacks = attacks::start(
        &config,
        attacks::Targets {
            service: service.clone(),
            completer: completer.clone(),
            database: database.clone(),
            vendor: vendor.clone(),
        },
        calm.clone(),
        rng.fork(1),
        faults.clone(),
    );
    let token = format!("chaos-w-{}-{}", config.seed, uuid::Uuid::now_v7());
    let direct = format!("http://127.0.0.1:{port}");
    let workload = clients::run(&config, &direct, &token, rng.fork(2), &service).await;

    calm.store(true, Ordering::SeqCst);
    for task in attacks {
        let _ = task.await;
    }
    vendor.set_faults(fake_vendor::Faults::default()).await;
    service.wait_healthy(Duration::from_secs(120)).await?;
    let workload = workload?;
    let mut violations = workload.violations.clone();

    // Quiet: the completers finish what they can; what is held waits for
    // the operator.
    let states_before_operator = operator::settle_down(&database, Duration::from_secs(120)).await?;
    let operator_verdicts = operator::pass(&database, &idem, &vendor_url, &workload, &mut violations).await?;
    let mut counts = WithdrawalCounts {
        states_before_operator,
        operator_verdicts,
        states: operator::settle_down(&database, Duration::from_secs(120)).await?,
        ..WithdrawalCounts::default()
    };
    let audit = judge::check(
        &database,
        &vendor_url,
        &vendor,
        &direct,
        &token,
        &workload,
        &mut counts,
        &mut violations,
    )
    .await?;

    completer.stop().await;
    service.stop().await;
    let mut f = faults.lock().await.clone();
    f.restarts = service.counts.restarts.load(Ordering::SeqCst);
    for (point, n) in service.counts.fault_point_kills.lock().await.iter() {
        *f.point_kills.entry(point.clone()).or_default() += n;
    }
    for (point, n) in completer.counts.fault_point_kills.lock().await.iter() {
        *f.point_kills.entry(point.clone()).or_default() += n;
    }
    for process in [&service, &completer] {
        for (fault, n) in process.counts.store_faults.lock().await.iter() {
            *f.store_faults.entry(fault.clone()).or_default() += n;
        }
    }
    database.drop_database().await;
    if config.ledger_bin.is_none() && std::env::var("CHAOS_LEDGER_BIN").is_err() {
        let _ = std::fs::remove_file(&bin);
    }
    if config.idem_bin.is_none() && std::env::var("CHAOS_IDEM_BIN").is_err() {
        let _ = std::fs::remove_file(&idem);
    }
    Ok(WithdrawalsReport {
        seed: config.seed,
        engine: config.engine.name().to_owned(),
        break_recovery_points: config.break_recovery_points,
        clients: workload.counts.clone(),
        faults: f,
        counts,
        audit,
        duration_secs: started.elapsed().as_secs_f64(),
        violations,
    })
}
