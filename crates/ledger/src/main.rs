//! The `ledger` binary: parses flags and runs the service, its relays, its
//! projection, or a job.

use std::time::Duration;

use clap::{Parser, Subcommand};

/// idem's reference service: a credits ledger with exactly-once mutations.
#[derive(Debug, Parser)]
#[command(name = "ledger", version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// Database: postgres://…, mysql://… (MariaDB too), or a SQLite file path.
    #[arg(long, env = "DATABASE_URL", default_value = "./ledger.db", global = true)]
    database_url: String,
    /// How long idempotency keys are kept, in seconds.
    #[arg(long, default_value_t = 86_400, value_parser = clap::value_parser!(u64).range(1..=315_360_000))]
    key_ttl_secs: u64,
    /// Read an idempotency key's committed row before claiming it: a retry
    /// of a recorded request is answered by that one statement, without a
    /// transaction; every new key pays one statement more.
    #[arg(long, env = "LEDGER_READ_FIRST")]
    read_first: bool,
    /// The bearer tokens accepted (repeat the flag, or a comma-separated
    /// LEDGER_TOKENS). None: demo mode, every token is its own tenant.
    #[arg(long = "token", env = "LEDGER_TOKENS", value_delimiter = ',')]
    tokens: Vec<String>,
    /// The webhook signing secrets (Standard Webhooks, `whsec_…`; several,
    /// comma-separated, while a provider rotates). Unset in demo mode: the
    /// documented demo secret. Unset with --token: webhooks are refused.
    #[arg(long = "webhook-secret", env = "LEDGER_WEBHOOK_SECRET", value_delimiter = ',')]
    webhook_secrets: Vec<String>,
    /// Database connections at most.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1000), global = true)]
    max_connections: u32,
    /// NATS server for the ledger's events (relays and projection run in
    /// this process). Unset: events wait in the outbox.
    #[arg(long, env = "NATS_URL", global = true)]
    nats_url: Option<String>,
    /// The CA certificates (PEM) the NATS server must be signed by, in place
    /// of the platform's roots; TLS is then required (`tls://` URLs use the
    /// platform's roots without it).
    #[arg(long, env = "NATS_CA", global = true)]
    nats_ca: Option<std::path::PathBuf>,
    /// Relays in this process (with --nats-url).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(0..=64), global = true)]
    relays: u16,
    /// Projection consumers in this process (with --nats-url).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(0..=64), global = true)]
    projectors: u16,
    /// Seconds the NATS server waits for the projection's acknowledgement
    /// before delivering a message again.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3_600), global = true)]
    projection_ack_wait_secs: u64,
    /// The names of the event streams, subjects and consumers (several
    /// ledgers can share one NATS server).
    #[arg(long, env = "LEDGER_EVENTS_NAMESPACE", default_value = ledger::events::DEFAULT_NAMESPACE, global = true)]
    events_namespace: String,
    /// The payout vendor's base URL (payouts are sent to
    /// `{url}/v1/payouts`); the payout worker runs in this process. Unset:
    /// payouts stay requested until a payout worker runs.
    #[arg(long, env = "LEDGER_VENDOR_URL", global = true)]
    vendor_url: Option<String>,
    /// The CA certificates (PEM) an https vendor must be signed by, in place
    /// of the platform's roots.
    #[arg(long, env = "LEDGER_VENDOR_CA_FILE", global = true)]
    vendor_ca_file: Option<std::path::PathBuf>,
    /// Vendor calls in flight at once in this process.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..=256), global = true)]
    payout_concurrency: u16,
    /// The lease of a payout being paid, in seconds (kept alive by a
    /// heartbeat; a worker that stops for longer is taken over).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3_600), global = true)]
    payout_lease_secs: u64,
    /// The waits before each retry of a vendor call, in ms; after the last
    /// one the payout is dead-lettered.
    #[arg(long, value_delimiter = ',', default_value = "500,2000,5000,30000", global = true)]
    payout_retry_delays_ms: Vec<u64>,
    /// The longest a vendor call may take, retries included, in seconds.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3_600), global = true)]
    payout_deadline_secs: u64,
    /// How long the vendor remembers idempotency keys, in seconds (0: it has
    /// none). Past it a payout is looked up at the vendor before it is sent
    /// again.
    #[arg(long, default_value_t = 86_400, value_parser = clap::value_parser!(u64).range(0..=31_622_400), global = true)]
    vendor_key_horizon_secs: u64,
    /// Kept from the vendor's key horizon, in seconds (default an hour, at
    /// most a tenth of the horizon below an hour's horizon).
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=31_622_400), global = true)]
    vendor_horizon_margin_secs: Option<u64>,
    /// A header sent to the vendor with every call but never stored (its
    /// credentials), as NAME:ENV_VAR: the value is read from the
    /// environment variable, never from the command line. Repeatable.
    #[arg(long = "vendor-secret-header", global = true)]
    vendor_secret_headers: Vec<String>,
    /// The FX vendor's base URL (quotes at `{url}/v1/quotes`; it has no
    /// idempotency keys). With --vendor-url, `POST /v1/withdrawals` pays out
    /// through both vendors. Unset: withdrawals answer 503.
    #[arg(long, env = "LEDGER_FX_URL", global = true)]
    fx_url: Option<String>,
    /// The lease of a withdrawal's run, in seconds: a run stopped for longer
    /// (a crash, a client gone) is taken over by a retry or a completer.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3_600), global = true)]
    withdrawal_lease_secs: u64,
    /// Completers of withdrawals in this process: they finish withdrawals
    /// whose run stopped (0: none).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(0..=64), global = true)]
    completers: u16,
    /// The balance snapshots job's period in seconds (0: off).
    #[arg(long, default_value_t = 86_400, value_parser = clap::value_parser!(u64).range(0..=31_622_400))]
    snapshot_every_secs: u64,
    /// What the snapshots job does with slots that go by without a run (a
    /// run longer than the period, or failing until the next slot): `skip`
    /// them (logged, counted in idem_job_slots_skipped_total) or `catch-up`
    /// (run them afterwards in order, at most --snapshot-catch-up-max).
    #[arg(long, default_value = "skip", value_parser = ["skip", "catch-up"])]
    snapshot_missed_slots: String,
    /// The most missed slots the snapshots job catches up.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    snapshot_catch_up_max: u32,
    /// Seconds between sweeps of expired rows of every keyed table (request
    /// keys, webhook and projection inboxes, job runs, payout leases); 0:
    /// this process does not sweep.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    sweep_every_secs: u64,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Publishes the outbox to NATS (--nats-url) without serving HTTP.
    Relay,
    /// Runs the statement projection (--nats-url) without serving HTTP.
    Project,
    /// Pays requested payouts at the vendor (--vendor-url) without serving
    /// HTTP.
    Payouts,
    /// Completes withdrawals whose run stopped (--fx-url, --vendor-url,
    /// --completers) without serving HTTP.
    Complete,
    /// Runs a job once and exits.
    Job {
        /// The job: `snapshots` (one balance row per account).
        #[arg(value_parser = ["snapshots"])]
        name: String,
        /// The run id (default: the id of the current slot; a second run
        /// with the same id does nothing).
        #[arg(long)]
        run_id: Option<String>,
        /// The slot's period in seconds, for the default run id.
        #[arg(long, default_value_t = 86_400, value_parser = clap::value_parser!(u64).range(1..=31_622_400))]
        every_secs: u64,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // Colour only for a terminal: logs written to a file or a pipe stay
    // plain text. NO_COLOR (https://no-color.org) turns colour off anywhere.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_ansi(ansi)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    let args = Args::parse();
    // One rustls provider for the process: ring.
    idem_tls::install_default_provider();
    let namespace = match ledger::events::Namespace::new(&args.events_namespace) {
        Ok(ns) => ns,
        Err(e) => {
            eprintln!("ledger: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let events = args.nats_url.clone().map(|nats_url| ledger::events::EventsConfig {
        nats_url,
        ca_file: args.nats_ca.clone(),
        relays: usize::from(args.relays),
        projectors: usize::from(args.projectors),
        namespace: namespace.clone(),
        ack_wait: Duration::from_secs(args.projection_ack_wait_secs),
    });
    let result = match args.command {
        None => serve(&args, events, namespace).await,
        Some(Command::Relay) => {
            events_only(&args, "relay", events, |e| ledger::events::EventsConfig {
                projectors: 0,
                ..e
            })
            .await
        }
        Some(Command::Project) => {
            events_only(&args, "project", events, |e| ledger::events::EventsConfig {
                relays: 0,
                ..e
            })
            .await
        }
        Some(Command::Payouts) => match payouts(&args, &namespace) {
            Ok(Some((config, outbound))) => {
                ledger::run_payouts(&args.database_url, args.max_connections, config, outbound).await
            }
            Ok(None) => Err(ledger::StartError::Config(
                "payouts needs --vendor-url (or LEDGER_VENDOR_URL)".into(),
            )),
            Err(e) => Err(e),
        },
        Some(Command::Complete) => match payouts(&args, &namespace).and_then(|p| withdrawals(&args, p.as_ref())) {
            Ok(Some(config)) => {
                ledger::run_withdrawal_completers(&args.database_url, args.max_connections, config, namespace).await
            }
            Ok(None) => Err(ledger::StartError::Config(
                "complete needs --fx-url and --vendor-url (or LEDGER_FX_URL and LEDGER_VENDOR_URL)".into(),
            )),
            Err(e) => Err(e),
        },
        Some(Command::Job {
            name: _,
            ref run_id,
            every_secs,
        }) => ledger::run_snapshot_job(&args.database_url, run_id.clone(), Duration::from_secs(every_secs))
            .await
            .map(|(run_id, outcome)| match outcome {
                Some(rows) => println!("run {run_id}: applied, {rows} snapshot rows"),
                None => println!("run {run_id}: already applied; nothing done"),
            }),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ledger: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// `ledger relay` / `ledger project` (`command`): the part of `events`
/// that `part` keeps, without the HTTP server; an error without
/// `--nats-url`.
async fn events_only(
    args: &Args,
    command: &str,
    events: Option<ledger::events::EventsConfig>,
    part: impl FnOnce(ledger::events::EventsConfig) -> ledger::events::EventsConfig,
) -> Result<(), ledger::StartError> {
    let Some(events) = events else {
        return Err(ledger::StartError::Config(format!(
            "{command} needs --nats-url (or NATS_URL)"
        )));
    };
    ledger::run_events(&args.database_url, args.max_connections, part(events)).await
}

async fn serve(
    args: &Args,
    events: Option<ledger::events::EventsConfig>,
    events_namespace: ledger::events::Namespace,
) -> Result<(), ledger::StartError> {
    let tokens: std::collections::HashSet<String> = args.tokens.iter().filter(|t| !t.is_empty()).cloned().collect();
    let secrets: Vec<&String> = args.webhook_secrets.iter().filter(|s| !s.is_empty()).collect();
    let webhooks = if !secrets.is_empty() {
        Some(
            idem_webhooks::Verifier::new(secrets)
                .map_err(|e| ledger::StartError::Config(format!("--webhook-secret: {e}")))?,
        )
    } else if tokens.is_empty() {
        tracing::warn!("demo mode: webhooks are verified with the documented demo secret");
        ledger::Options::default().webhooks
    } else {
        tracing::warn!("no webhook secret configured: POST /v1/webhooks/payments refuses every webhook");
        None
    };
    let options = ledger::Options {
        key_ttl_secs: args.key_ttl_secs,
        tokens: std::sync::Arc::new(tokens),
        webhooks,
        events_namespace,
        require_keys: true,
        read_first: args.read_first,
        events_health: ledger::events::EventsHealth::default(),
        withdrawals: None,
    };
    let snapshots = match args.snapshot_every_secs {
        0 => None,
        secs => {
            let missed = match args.snapshot_missed_slots.as_str() {
                "catch-up" => idem_jobs::MissedSlots::CatchUp {
                    max: args.snapshot_catch_up_max,
                },
                _ => idem_jobs::MissedSlots::Skip,
            };
            Some(ledger::snapshot_job(Duration::from_secs(secs))?.with_missed_slots(missed)?)
        }
    };
    let background = ledger::Background {
        snapshots,
        sweep_every: (args.sweep_every_secs > 0).then(|| Duration::from_secs(args.sweep_every_secs)),
    };
    let payouts = payouts(args, &options.events_namespace)?;
    let options = ledger::Options {
        withdrawals: withdrawals(args, payouts.as_ref())?,
        ..options
    };
    ledger::run(
        &args.listen,
        &args.database_url,
        args.max_connections,
        options,
        events,
        background,
        payouts,
    )
    .await
}

/// The vendor URL given by `flag`, if any (an empty one is none); one with
/// white space in it is refused.
fn vendor_url<'a>(flag: &str, url: Option<&'a str>) -> Result<Option<&'a str>, ledger::StartError> {
    match url.filter(|u| !u.is_empty()) {
        Some(url) if url.contains(char::is_whitespace) => Err(ledger::StartError::Config(format!(
            "{flag} {url:?} must be an absolute http or https URL"
        ))),
        url => Ok(url),
    }
}

/// The payout worker's settings, if a vendor is configured.
fn payouts(
    args: &Args,
    namespace: &ledger::events::Namespace,
) -> Result<Option<(ledger::payouts::PayoutConfig, idem_outbound::OutboundConfig)>, ledger::StartError> {
    let Some(url) = vendor_url("--vendor-url", args.vendor_url.as_deref())? else {
        return Ok(None);
    };
    let bad = |why: String| ledger::StartError::Config(why);
    if args.payout_retry_delays_ms.len() > 20 || args.payout_retry_delays_ms.iter().any(|&ms| ms > 3_600_000) {
        return Err(bad(
            "--payout-retry-delays-ms: at most 20 delays of at most an hour each".into(),
        ));
    }
    let mut config = ledger::payouts::PayoutConfig::new(url, namespace.clone());
    config.concurrency = usize::from(args.payout_concurrency);
    config.lease = Duration::from_secs(args.payout_lease_secs);
    let horizon = Duration::from_secs(args.vendor_key_horizon_secs);
    let margin = args
        .vendor_horizon_margin_secs
        .map(Duration::from_secs)
        .unwrap_or_else(|| Duration::from_secs(3600).min(horizon / 10));
    let mut outbound = idem_outbound::OutboundConfig {
        name: "payouts".into(),
        retry_delays: args
            .payout_retry_delays_ms
            .iter()
            .map(|&ms| Duration::from_millis(ms))
            .collect(),
        deadline: Duration::from_secs(args.payout_deadline_secs),
        key_horizon: idem_outbound::KeyHorizon::new(horizon, margin),
        ca_file: args.vendor_ca_file.clone(),
        ..Default::default()
    };
    for spec in &args.vendor_secret_headers {
        let Some((name, var)) = spec.split_once(':') else {
            return Err(bad(format!("--vendor-secret-header {spec:?}: expected NAME:ENV_VAR")));
        };
        let value = std::env::var(var).map_err(|_| {
            bad(format!(
                "--vendor-secret-header {name}: the environment variable {var} is not set"
            ))
        })?;
        outbound = outbound
            .with_secret_header(name, &value)
            .map_err(|e| bad(format!("--vendor-secret-header {name}: {e}")))?;
    }
    outbound.validate().map_err(|e| bad(format!("payouts: {e}")))?;
    // A vendor URL that could never work (https without TLS, a fragment,
    // user information, a bad port) stops the start, naming the setting.
    let client =
        idem_outbound::OutboundClient::new(outbound.clone()).map_err(|e| bad(format!("--vendor-ca-file: {e}")))?;
    client
        .check_target(&config.payouts_url())
        .map_err(|e| bad(format!("--vendor-url: {e}")))?;
    Ok(Some((config, outbound)))
}

/// The withdrawals' settings, if an FX vendor is configured (the payout
/// vendor's are `payouts`'s).
fn withdrawals(
    args: &Args,
    payouts: Option<&(ledger::payouts::PayoutConfig, idem_outbound::OutboundConfig)>,
) -> Result<Option<ledger::withdrawals::WithdrawalsConfig>, ledger::StartError> {
    let Some(fx_url) = vendor_url("--fx-url", args.fx_url.as_deref())? else {
        return Ok(None);
    };
    let bad = |why: String| ledger::StartError::Config(why);
    let Some((payout, outbound)) = payouts else {
        return Err(bad(
            "--fx-url needs --vendor-url: withdrawals pay out at the payout vendor".into(),
        ));
    };
    let mut config = ledger::withdrawals::WithdrawalsConfig::new(fx_url, &payout.vendor_url);
    // The payout vendor's memory of keys, credentials and TLS roots are the
    // payout worker's; the FX vendor is trusted by the same roots.
    config.payout = idem_outbound::OutboundConfig {
        name: config.payout.name.clone(),
        retry_delays: config.payout.retry_delays.clone(),
        deadline: config.payout.deadline,
        attempt_timeout: config.payout.attempt_timeout,
        ..outbound.clone()
    };
    config.fx.ca_file = args.vendor_ca_file.clone();
    config.lease = Duration::from_secs(args.withdrawal_lease_secs);
    config.completers = usize::from(args.completers);
    config.validate()?;
    Ok(Some(config))
}
