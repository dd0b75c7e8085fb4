//! `idem`: the gateway that gives any HTTP API the Idempotency-Key
//! contract, and the operator's commands.
//!
//! Exit codes: 0 done, 1 a failure while running (an absent key; for `dlq
//! redrive`: a dead letter that failed again; for `ops`: a change the
//! operation refuses, or one that changed meanwhile), 2 a bad argument or
//! configuration (a bad store URL, an empty filter, a Redis that may evict
//! keys), 3 the store is not there as asked: unreachable, no such database
//! file, or its table does not exist (only `idem migrate` creates one).
//!
//! With `--json`, a run prints one JSON document on stdout: its result, or
//! its failure, `{"error": "…", "exit_code": N}` (a run that printed its
//! result and still fails, like `dlq redrive` with a letter that failed
//! again, tells the failure on stderr). Store URLs, and anything else
//! printed, have their credentials masked.

mod dlq;
mod events;
mod gateway;
mod keys;
mod migrate;
mod ops;
mod outbox;
mod output;
mod stats;
mod store;
mod sweep;

use clap::{Parser, Subcommand};

use crate::output::Failure;

/// idem's command line.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about)]
struct Cli {
    /// Print results as JSON (for scripts); failures too, as
    /// {"error": "…", "exit_code": N} on stdout.
    #[arg(long, global = true)]
    json: bool,
    /// On Redis: the key prefix (default idem, the gateway's).
    #[arg(long, global = true, env = "IDEM_REDIS_PREFIX")]
    redis_prefix: Option<String>,
    /// On Redis: skip the deployment check that the gateway and the
    /// commands that write run first (eviction policy refused, persistence
    /// warned about).
    #[arg(
        long,
        global = true,
        env = "IDEM_SKIP_REDIS_CHECKS",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    skip_redis_checks: bool,
    #[command(subcommand)]
    command: Command,
}

impl Cli {
    /// The Redis settings the flags give.
    fn redis(&self) -> idem_gateway::RedisSettings {
        let mut redis = idem_gateway::RedisSettings::default();
        if let Some(prefix) = &self.redis_prefix {
            redis.prefix.clone_from(prefix);
        }
        redis.skip_deployment_checks = self.skip_redis_checks;
        redis
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A reverse proxy in front of --upstream: retried requests with one
    /// Idempotency-Key reach the upstream once (lease mode).
    Gateway(gateway::GatewayArgs),
    /// Creates or upgrades the keys table (idempotent; safe from several
    /// processes at once). The only command that creates a database file or
    /// a table.
    Migrate(migrate::MigrateArgs),
    /// Deletes expired keys in bounded batches (a progress bar on a terminal).
    Sweep(sweep::SweepArgs),
    /// Keys by state.
    Stats(stats::StatsArgs),
    /// Stored keys: list, show, resolve (an unknown outcome), purge.
    Keys {
        #[command(subcommand)]
        command: keys::KeysCommand,
    },
    /// The transactional outbox.
    Outbox {
        #[command(subcommand)]
        command: outbox::OutboxCommand,
    },
    /// Dead letters of outbound calls: list, show, redrive, resolve.
    Dlq {
        #[command(subcommand)]
        command: dlq::DlqCommand,
    },
    /// Dead letters of JetStream inbox consumers: list, redrive.
    Events {
        #[command(subcommand)]
        command: events::EventsCommand,
    },
    /// Multi-step operations: list, show, resume, mark (a step's outcome),
    /// cancel, hold, purge (the final ones past their expiry).
    Ops {
        #[command(subcommand)]
        command: ops::OpsCommand,
    },
}

/// Runs the command the arguments name.
async fn run(cli: Cli) -> Result<(), Failure> {
    let json = cli.json;
    let redis = cli.redis();
    match cli.command {
        Command::Gateway(args) => gateway::run(args, cli.redis_prefix, cli.skip_redis_checks).await,
        Command::Migrate(args) => migrate::run(args, &redis, json).await,
        Command::Sweep(args) => sweep::run(args, &redis, json).await,
        Command::Stats(args) => stats::run(args, &redis, json).await,
        Command::Keys { command } => keys::run(command, &redis, json).await,
        Command::Outbox { command } => outbox::run(command, &redis, json).await,
        Command::Dlq { command } => dlq::run(command, json).await,
        Command::Events { command } => events::run(command, json).await,
        Command::Ops { command } => ops::run(command, json).await,
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,idem_gateway=info".into()),
        )
        .init();
    let raw: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // Whether the caller asked for JSON, also when the arguments do not
    // parse (their error is then printed as JSON too).
    let json = raw.iter().skip(1).take_while(|a| *a != "--").any(|a| a == "--json");
    let outcome = match Cli::try_parse_from(&raw) {
        Ok(args) => run(args).await,
        Err(e) => {
            use clap::error::ErrorKind;
            if !json || matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                e.exit();
            }
            Err(Failure(2, e.render().to_string().trim().to_owned()))
        }
    };
    output::finish(outcome, json, &raw)
}
