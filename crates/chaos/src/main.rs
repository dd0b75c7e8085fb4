//! The `chaos` binary: `cargo run --release -p chaos -- --engine sqlite --ops 2000`.

use std::path::PathBuf;

use chaos::{Config, Engine, Faults};
use clap::Parser;

/// Attacks a running ledger with retries, lost responses, kills and database
/// faults, then checks the history. Exits 1 if any property failed.
#[derive(Debug, Parser)]
#[command(name = "chaos", about)]
struct Args {
    /// sqlite, postgres or mysql.
    #[arg(long, default_value = "sqlite")]
    engine: Engine,
    /// The MariaDB (or MySQL) server of `--engine mysql`; a fresh database
    /// is created on it. Several URLs, comma-separated, name the nodes of
    /// one MariaDB Galera cluster: the database is created on the first
    /// node, ledger instance i connects to node i % nodes (`--instances 3`
    /// on three nodes writes on all of them), the relay, projection and
    /// payout workers spread over the nodes, sessions are killed on a node
    /// drawn at random, the checks read with `wsrep_sync_wait = 1`, and the
    /// report's `database_nodes` says which process used which node.
    #[arg(
        long,
        env = "IDEM_TEST_MYSQL_URL",
        hide_env_values = true,
        value_delimiter = ',',
        default_value = "mysql://root@127.0.0.1:3306/test"
    )]
    mysql_url: Vec<String>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=256))]
    clients: u64,
    /// Logical operations.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    ops: u64,
    /// The seed (random when absent; always printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Write the JSON report here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Switch the service's idempotency claim off (the checker must then fail).
    #[arg(long)]
    break_idempotency: bool,
    /// A ledger built with `--features fault-injection` (built with cargo if absent).
    #[arg(long, env = "CHAOS_LEDGER_BIN")]
    ledger_bin: Option<PathBuf>,
    /// No fault proxy.
    #[arg(long)]
    no_proxy: bool,
    /// No random kills.
    #[arg(long)]
    no_kills: bool,
    /// No kills at named fault points.
    #[arg(long)]
    no_fault_points: bool,
    /// No database session kills.
    #[arg(long)]
    no_db_kills: bool,
    /// No bursts of identical requests.
    #[arg(long)]
    no_bursts: bool,
    /// No SIGSTOP pauses.
    #[arg(long)]
    no_pauses: bool,
    /// No store faults (refused, timed-out, applied-then-refused store
    /// calls in the service and the payout workers).
    #[arg(long)]
    no_store_faults: bool,
    /// Mean milliseconds between random kills.
    #[arg(long, default_value_t = 1_500, value_parser = clap::value_parser!(u64).range(100..))]
    kill_interval_ms: u64,
    /// Keep the run's database.
    #[arg(long)]
    keep_db: bool,
    /// No events (relays, projection, broker restarts).
    #[arg(long)]
    no_events: bool,
    /// No payouts (payout workers, the fake vendor and its faults).
    #[arg(long)]
    no_payouts: bool,
    /// Server processes behind a local round-robin balancer, each killed
    /// and paused on its own: ledger servers on the one database (default
    /// 1), or `idem gateway` processes on the one store (default 3). The
    /// withdrawals mode runs one.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=16))]
    instances: Option<u64>,
    /// The gateway mode instead of the ledger: `idem gateway` processes
    /// (`--instances`, 3) on one shared store (postgres or redis) behind a
    /// round-robin balancer, killed and SIGTERMed, in front of a counting
    /// upstream (`--ops`, `--clients`, `--seed`, `--kill-interval-ms`
    /// apply).
    #[arg(long)]
    gateway: Option<chaos::gateway::GatewayStore>,
    /// Tenants of the gateway mode (keys repeat across them).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=64))]
    tenants: u64,
    /// The `idem` binary of the gateway and withdrawals modes (built with
    /// cargo if absent).
    #[arg(long, env = "CHAOS_IDEM_BIN")]
    idem_bin: Option<PathBuf>,
    /// The withdrawals mode instead: `--ops` withdrawals across two vendors
    /// (multi-step operations), the ledger and a completer process killed at
    /// random and at every named point of a run, the vendors losing answers,
    /// forgetting keys and failing lookups, an operator's pass at the end.
    #[arg(long)]
    withdrawals: bool,
    /// With --withdrawals: switch the recovery points off (the judge must
    /// then report double effects).
    #[arg(long, requires = "withdrawals")]
    break_recovery_points: bool,
}

async fn withdrawals(seed: u64, args: &Args) -> std::process::ExitCode {
    println!("chaos: withdrawals on {} seed {seed}", args.engine.name());
    let mut config = chaos::withdrawals::WithdrawalsConfig::new(args.engine, seed);
    config.withdrawals = args.ops as usize;
    config.clients = args.clients as usize;
    config.kill_interval_ms = args.kill_interval_ms;
    config.break_recovery_points = args.break_recovery_points;
    config.ledger_bin.clone_from(&args.ledger_bin);
    config.idem_bin.clone_from(&args.idem_bin);
    if let Some(url) = args.mysql_url.first() {
        config.mysql_url.clone_from(url);
    }
    let report = match chaos::withdrawals::run_withdrawals(config).await {
        Ok(r) => r,
        Err(e) => return failed(e),
    };
    publish(&report, args.report.as_deref());
    let c = &report.clients;
    println!(
        "chaos: withdrawals on {}: seed {seed}: {} requested ({} paid, {} declined, {} held, {} unanswered), \
         {} random kills, {} kills at named points, {} completer kills, {} store faults, {} sessions killed; \
         {} debited, {} quotes, {} payouts; states {:?}; operator {:?}: {} violation(s)",
        report.engine,
        c.requested,
        c.paid,
        c.declined,
        c.held,
        c.unanswered,
        report.faults.random_kills,
        report.faults.point_kills.values().sum::<u64>(),
        report.faults.completer_kills,
        report.faults.store_faults.values().sum::<u64>(),
        report.faults.sessions_killed,
        report.counts.debited,
        report.counts.quotes_booked,
        report.counts.payouts_made,
        report.counts.states,
        report.counts.operator_verdicts,
        report.violations.len()
    );
    verdict(&report.violations)
}

async fn gateway(store: chaos::gateway::GatewayStore, seed: u64, args: &Args) -> std::process::ExitCode {
    println!("chaos: gateway on {} seed {seed}", store.name());
    let mut config = chaos::gateway::GatewayConfig::new(store, seed);
    config.ops = args.ops as usize;
    config.clients = args.clients as usize;
    config.tenants = args.tenants as usize;
    config.fault_interval_ms = args.kill_interval_ms;
    if let Some(n) = args.instances {
        config.instances = n as usize;
    }
    if args.idem_bin.is_some() {
        config.idem_bin.clone_from(&args.idem_bin);
    }
    let report = match chaos::gateway::run_gateway(config).await {
        Ok(r) => r,
        Err(e) => return failed(e),
    };
    publish(&report, args.report.as_deref());
    println!(
        "chaos: gateway on {}: seed {seed}: {} ops ({} answered, {} held, {} unanswered), {} effects, {} kills, \
         {} SIGTERMs, store: {} refusal windows ({} ms), {} sessions killed; {} keys applied twice, {} held keys \
         never applied; per instance: kills {:?}, requests {:?}: {} violation(s)",
        report.store,
        report.ops,
        report.ok,
        report.held,
        report.unanswered,
        report.effects,
        report.kills,
        report.sigterms,
        report.store_faults.refusal_windows,
        report.store_faults.refusal_ms,
        report.store_faults.sessions_killed,
        report.reapplied,
        report.held_unapplied,
        report.kills_per_instance,
        report.balancer.served,
        report.violations.len()
    );
    verdict(&report.violations)
}

/// A run's verdict: success with no violation, failure with any.
fn verdict(violations: &[String]) -> std::process::ExitCode {
    if violations.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// A run that could not be made (exit code 2, not a verdict).
fn failed(e: impl std::fmt::Display) -> std::process::ExitCode {
    eprintln!("chaos: {e}");
    std::process::ExitCode::from(2)
}

/// Writes `report` as JSON to `path` (if given) and to stdout.
fn publish(report: &impl serde::Serialize, path: Option<&std::path::Path>) {
    let json = serde_json::to_string_pretty(report).unwrap_or_default();
    if let Some(path) = path
        && let Err(e) = std::fs::write(path, &json)
    {
        eprintln!("chaos: cannot write {}: {e}", path.display());
    }
    println!("{json}");
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(chaos::rng::random_seed);
    if let Some(store) = args.gateway {
        return gateway(store, seed, &args).await;
    }
    if args.mysql_url.len() > 1 && (args.engine != chaos::Engine::Mysql || args.gateway.is_some()) {
        return failed("several --mysql-url are the nodes of a MariaDB cluster: give them with --engine mysql");
    }
    if args.withdrawals {
        if args.instances.is_some_and(|n| n > 1) {
            return failed("the withdrawals mode runs one ledger instance (--instances 1)");
        }
        if args.mysql_url.len() > 1 {
            return failed("the withdrawals mode runs on one database server (one --mysql-url)");
        }
        return withdrawals(seed, &args).await;
    }
    println!("chaos: engine {} seed {seed}", args.engine.name());
    let mut config = Config::new(args.engine, seed);
    config.clients = args.clients as usize;
    config.ops = args.ops as usize;
    config.break_idempotency = args.break_idempotency;
    config.ledger_bin = args.ledger_bin;
    config.keep_db = args.keep_db;
    config.kill_interval_ms = args.kill_interval_ms;
    config.events = !args.no_events;
    config.payouts = !args.no_payouts;
    config.instances = args.instances.unwrap_or(1) as usize;
    if let Some(url) = args.mysql_url.first() {
        config.mysql_url.clone_from(url);
    }
    if args.mysql_url.len() > 1 {
        config.mysql_nodes.clone_from(&args.mysql_url);
    }
    config.faults = Faults {
        proxy: !args.no_proxy,
        kills: !args.no_kills,
        fault_points: !args.no_fault_points,
        db_sessions: !args.no_db_kills,
        bursts: !args.no_bursts,
        pauses: !args.no_pauses,
        store: !args.no_store_faults,
    };
    let report = match chaos::run(config).await {
        Ok(r) => r,
        Err(e) => return failed(e),
    };
    publish(&report, args.report.as_deref());
    println!(
        "chaos: seed {seed}: {} ops ({} ok, {} rejected, {} unknown), {} kills, {} dropped responses, {} sessions killed, \
         {} store faults, {} payouts committed ({} paid, {} cancelled, {} dead-lettered then redriven), \
         {} payout worker kills, {} dlq redrives killed mid-send ({} refunds refused); per instance: kills {:?}, \
         requests {:?}, database node {:?}: {} violation(s)",
        report.counts.ops,
        report.counts.ok,
        report.counts.rejected,
        report.counts.unknown,
        report.faults.kills(),
        report.faults.responses_dropped,
        report.faults.sessions_killed,
        report.faults.store_faults.values().sum::<u64>(),
        report.payouts.committed,
        report.payouts.paid,
        report.payouts.cancelled,
        report.payouts.redriven,
        report.payout_faults.worker_kills,
        report.payouts.redrive_kills.killed,
        report.payouts.redrive_kills.cancels_refused,
        report.per_instance.iter().map(|i| i.kills()).collect::<Vec<_>>(),
        report.per_instance.iter().map(|i| i.served).collect::<Vec<_>>(),
        report.per_instance.iter().map(|i| i.database_node).collect::<Vec<_>>(),
        report.violations.len()
    );
    verdict(&report.violations)
}
