//! `idem`: the gateway that gives any HTTP API the Idempotency-Key
//! contract, and the operator's commands.
//!
//! Exit codes: 0 done, 1 a failure while running (an absent key; for `dlq
//! redrive`: a dead letter that failed again), 2 a bad argument or
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

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use idem_core::{KeyAdmin, LeaseStore, Sweep, TableName, TimeSource};
use idem_gateway::AnyLease;

/// idem's command line.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about)]
struct Args {
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

impl Args {
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
    Gateway {
        /// The API behind the gateway.
        #[arg(long, env = "IDEM_UPSTREAM")]
        upstream: Option<String>,
        /// The CA certificates (PEM) an https upstream must be signed by, in
        /// place of the platform's roots (overrides the file's
        /// upstream_ca_file).
        #[arg(long, env = "IDEM_UPSTREAM_CA_FILE")]
        upstream_ca_file: Option<PathBuf>,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8000")]
        listen: String,
        /// The store: a SQLite path (default ./idem-gateway.db), postgres://,
        /// mysql:// or redis:// (shared by several gateway instances).
        #[arg(long, env = "IDEM_STORE")]
        store: Option<String>,
        /// A TOML file with routes and policies (see the README).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Who the caller is (keys are scoped by it; overrides the file's
        /// [tenant]): credentials separated by commas (authorization,
        /// header:NAME, cookie:NAME), trusted-header:NAME, or anonymous.
        #[arg(long, env = "IDEM_TENANT")]
        tenant: Option<String>,
        /// Serve /_idem/healthz and /_idem/metrics on this address instead
        /// of the proxy's (overrides the file's admin_listen).
        #[arg(long)]
        admin_listen: Option<String>,
    },
    /// Creates or upgrades the keys table (idempotent; safe from several
    /// processes at once). The only command that creates a database file or
    /// a table.
    Migrate {
        /// The store URL.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// The keys table (an inbox or job table shares its schema).
        #[arg(long)]
        table: Option<String>,
        /// Say which versions would be applied, and apply nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print the SQL of the versions to apply.
        #[arg(long)]
        show_sql: bool,
        /// Also create or upgrade the dead-letter table of outbound calls
        /// (SQL stores).
        #[arg(long)]
        dead_letters: bool,
        /// The dead-letter table, with --dead-letters.
        #[arg(long, default_value = "idem_dead_letters")]
        dead_letter_table: String,
    },
    /// Deletes expired keys in bounded batches (a progress bar on a terminal).
    Sweep {
        /// The store URL.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// The keys table (an inbox or job table shares its schema).
        #[arg(long)]
        table: Option<String>,
        /// Keys deleted per batch.
        #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        batch: u32,
        /// Pause between batches, in ms (room for live traffic).
        #[arg(long, default_value_t = 10)]
        pause_ms: u64,
        /// Stop after this many batches.
        #[arg(long)]
        max_batches: Option<u64>,
    },
    /// Keys by state.
    Stats {
        /// The store URL.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// The keys table (an inbox or job table shares its schema).
        #[arg(long)]
        table: Option<String>,
    },
    /// Stored keys: list, show, resolve (an unknown outcome), purge.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// The transactional outbox.
    Outbox {
        #[command(subcommand)]
        command: OutboxCommand,
    },
    /// Dead letters of outbound calls: list, show, redrive, resolve.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Dead letters of JetStream inbox consumers: list, redrive.
    Events {
        #[command(subcommand)]
        command: events::EventsCommand,
    },
}

/// The dead-letter table and which of its rows a command selects.
#[derive(Debug, clap::Args)]
struct DlqSelection {
    /// The service's database URL (SQLite path, postgres:// or mysql://).
    #[arg(long, env = "IDEM_STORE")]
    store: String,
    /// The dead-letter table.
    #[arg(long, default_value = "idem_dead_letters")]
    table: String,
    /// Only this tenant.
    #[arg(long)]
    tenant: Option<String>,
    /// Only this operation.
    #[arg(long)]
    operation: Option<String>,
    /// Only ids greater than this (the last id of the previous page).
    #[arg(long)]
    after_id: Option<i64>,
}

impl DlqSelection {
    fn filter(&self, state: Option<&str>, limit: u32) -> Result<idem_core::DeadLetterFilter, Failure> {
        Ok(idem_core::DeadLetterFilter {
            tenant: self.tenant.clone(),
            operation: self.operation.clone(),
            state: state
                .map(idem_core::DeadLetterState::parse)
                .transpose()
                .map_err(|e| Failure(2, e.to_string()))?,
            after_id: self.after_id,
            limit,
        })
    }

    async fn open(&self) -> Result<dlq::AnyDeadLetters, Failure> {
        let table = TableName::new(self.table.clone())?;
        dlq::AnyDeadLetters::open(&self.store, table)
            .await
            .map_err(|e| store_failure(&self.store, e))
    }
}

#[derive(Debug, Subcommand)]
enum DlqCommand {
    /// Dead letters matching the filters, oldest first.
    List {
        #[command(flatten)]
        selection: DlqSelection,
        /// Only in this state.
        #[arg(long, value_parser = ["dead", "redriving", "resolved", "unknown", "cancelled"])]
        state: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000))]
        limit: u32,
    },
    /// One dead letter, with its request and the answer that resolved it.
    Show {
        /// The service's database URL.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// The dead-letter table.
        #[arg(long, default_value = "idem_dead_letters")]
        table: String,
        /// The dead letter's id.
        #[arg(long)]
        id: i64,
    },
    /// Sends dead letters again with their own idempotency key (a vendor
    /// that applied one answers with its recorded result), one at a time,
    /// capped and paced; each is resolved or dead again.
    Redrive {
        #[command(flatten)]
        selection: DlqSelection,
        /// Only this dead letter.
        #[arg(long, conflicts_with_all = ["tenant", "operation", "after_id", "state"])]
        id: Option<i64>,
        /// Which state to take them from (`redriving`: holds that ran out).
        #[arg(long, default_value = "dead", value_parser = ["dead", "redriving"])]
        state: String,
        /// At most this many dead letters considered.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        max: u32,
        /// At most this many sends started per second.
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1_000))]
        per_second: u32,
        /// Each send's deadline, retries included, in seconds.
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3_600))]
        deadline_secs: u64,
        #[command(flatten)]
        resend: dlq::ResendArgs,
    },
    /// Records what the vendor says of a dead or unknown letter, checked by
    /// the operator: `--applied` resolves it with the vendor's answer;
    /// `--not-applied` makes it dead again with nothing counted as sent, so a
    /// redrive sends it (even past the vendor's key horizon) and the service
    /// may cancel it.
    Resolve {
        /// The service's database URL.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// The dead-letter table.
        #[arg(long, default_value = "idem_dead_letters")]
        table: String,
        /// The dead letter's id.
        #[arg(long)]
        id: i64,
        /// The vendor applied it.
        #[arg(long, conflicts_with = "not_applied", required_unless_present = "not_applied")]
        applied: bool,
        /// The vendor did not apply it.
        #[arg(long)]
        not_applied: bool,
        /// With --applied: the vendor's success status.
        #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u16).range(200..=299), requires = "applied")]
        status: u16,
        /// With --applied: the vendor's record of it (its answer), as text.
        #[arg(long, default_value = "", requires = "applied")]
        body: String,
        /// Where it was checked, or why (kept with the letter).
        #[arg(long)]
        note: String,
    },
}

/// Which keys a command selects.
#[derive(Debug, clap::Args)]
struct Selection {
    /// The store URL.
    #[arg(long, env = "IDEM_STORE")]
    store: String,
    /// The keys table (an inbox or job table shares its schema).
    #[arg(long)]
    table: Option<String>,
    /// Only this tenant.
    #[arg(long)]
    tenant: Option<String>,
    /// Only this operation (`POST /v1/payments`).
    #[arg(long)]
    operation: Option<String>,
    /// Only keys starting with this.
    #[arg(long)]
    key_prefix: Option<String>,
    /// Only keys in this state.
    #[arg(long, value_parser = ["in_progress", "sent", "completed", "rejected", "unknown", "expired"])]
    state: Option<String>,
    /// Only keys claimed at least this many seconds ago.
    #[arg(long)]
    older_than_secs: Option<u64>,
    /// At most this many keys.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    limit: u32,
}

impl Selection {
    /// The filter the flags give; an empty value is refused: it would
    /// select nothing meaningful (an empty prefix matches every key).
    fn filter(&self) -> Result<idem_core::KeyFilter, Failure> {
        for (flag, value) in [
            ("--tenant", &self.tenant),
            ("--operation", &self.operation),
            ("--key-prefix", &self.key_prefix),
        ] {
            if value.as_deref().is_some_and(str::is_empty) {
                return Err(Failure(
                    2,
                    format!("{flag} is empty: give a value, or leave the filter out"),
                ));
            }
        }
        Ok(idem_core::KeyFilter {
            tenant: self.tenant.clone(),
            operation: self.operation.clone(),
            key_prefix: self.key_prefix.clone(),
            state: self.state.as_deref().map(|s| match s {
                "in_progress" => idem_core::KeyState::InProgress,
                "completed" => idem_core::KeyState::Completed,
                "rejected" => idem_core::KeyState::Rejected,
                "unknown" => idem_core::KeyState::Unknown,
                "sent" => idem_core::KeyState::Sent,
                _ => idem_core::KeyState::Expired,
            }),
            older_than_ms: self
                .older_than_secs
                .map(|s| i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX)),
        })
    }
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Keys matching the filters, oldest first.
    List(Selection),
    /// One key, by its exact value, with its recorded outcome.
    Show {
        /// The store URL.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// The keys table (an inbox or job table shares its schema).
        #[arg(long)]
        table: Option<String>,
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The operation.
        #[arg(long)]
        operation: String,
        /// The key.
        #[arg(long)]
        key: String,
    },
    /// Resolves a key whose outcome is unknown (the upstream got the whole
    /// request, then failed or went silent): --applied records what the
    /// upstream did, and retries replay it; --not-applied releases the key,
    /// and the next retry is sent. Any other key is left alone.
    Resolve {
        /// The store URL.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// The keys table (an inbox or job table shares its schema).
        #[arg(long)]
        table: Option<String>,
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The operation.
        #[arg(long)]
        operation: String,
        /// The key.
        #[arg(long)]
        key: String,
        /// The upstream applied the request: record --status (and --body,
        /// --header) as its answer.
        #[arg(
            long,
            conflicts_with = "not_applied",
            required_unless_present = "not_applied",
            requires = "status"
        )]
        applied: bool,
        /// The upstream did not apply the request: release the key.
        #[arg(long)]
        not_applied: bool,
        /// The answer's status (2xx, 3xx or 4xx).
        #[arg(long, requires = "applied")]
        status: Option<u16>,
        /// A file holding the answer's body.
        #[arg(long, requires = "applied")]
        body: Option<std::path::PathBuf>,
        /// An answer header, `Name: value` (repeatable); with a body and no
        /// Content-Type, `application/json`.
        #[arg(long = "header", requires = "applied")]
        headers: Vec<String>,
    },
    /// Deletes the keys matching the filters (at least one filter; a key
    /// still in progress only with --force: its holder may be working).
    Purge {
        #[command(flatten)]
        selection: Selection,
        /// Also delete keys in progress.
        #[arg(long)]
        force: bool,
    },
}

/// The recorded answer an operator gives for an applied request; a 5xx is
/// no answer (the request's outcome would still be unknown).
fn resolved_answer(
    status: Option<u16>,
    body: Option<&std::path::Path>,
    headers: &[String],
) -> Result<idem_core::Record, Failure> {
    let status = status.ok_or_else(|| Failure(2, "--applied needs --status".into()))?;
    let status = http::StatusCode::from_u16(status)
        .ok()
        .filter(|s| s.is_success() || s.is_redirection() || s.is_client_error())
        .ok_or_else(|| {
            Failure(
                2,
                format!("--status {status}: give the 2xx, 3xx or 4xx the upstream answered (a 5xx is no outcome)"),
            )
        })?;
    let mut map = http::HeaderMap::new();
    for h in headers {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| Failure(2, format!("--header {h:?}: write `Name: value`")))?;
        let name = http::HeaderName::from_bytes(name.trim().as_bytes())
            .map_err(|e| Failure(2, format!("--header {h:?}: {e}")))?;
        let value =
            http::HeaderValue::from_str(value.trim()).map_err(|e| Failure(2, format!("--header {h:?}: {e}")))?;
        // What the layer never records, an operator does not record either:
        // a private header would be replayed to every retry, a hop-by-hop
        // one describes a connection that is gone.
        if name == http::header::SET_COOKIE || idem_http::is_hop_by_hop(&name) {
            return Err(Failure(
                2,
                format!(
                    "--header {name}: never recorded (a private or hop-by-hop header would be replayed to every \
                     retry); leave it out"
                ),
            ));
        }
        map.append(name, value);
    }
    let body = match body {
        Some(path) => std::fs::read(path).map_err(|e| Failure(2, format!("--body {}: {e}", path.display())))?,
        None => Vec::new(),
    };
    if !body.is_empty() && !map.contains_key(http::header::CONTENT_TYPE) {
        map.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
    }
    let encoded = idem_http::RecordedResponse {
        status,
        headers: map,
        body: body.into(),
        trailers: http::HeaderMap::new(),
    }
    .encode();
    Ok(if status.is_client_error() {
        idem_core::Record::rejected(encoded)
    } else {
        idem_core::Record::completed(encoded)
    })
}

fn key_json(k: &idem_core::KeyInfo) -> serde_json::Value {
    serde_json::json!({
        "tenant": k.tenant,
        "operation": k.operation,
        "key": k.key,
        "state": k.state.name(),
        "created_at_ms": k.created_at_ms,
        "expires_at_ms": k.expires_at_ms,
        "payload_bytes": k.payload.len(),
    })
}

#[derive(Debug, Subcommand)]
enum OutboxCommand {
    /// Unsent events and the age of the oldest.
    Status {
        /// The service's database URL.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// The outbox table.
        #[arg(long, default_value = "idem_outbox")]
        table: String,
    },
}

/// A failure with its exit code.
pub(crate) struct Failure(pub(crate) u8, pub(crate) String);

impl From<idem_core::Error> for Failure {
    fn from(e: idem_core::Error) -> Self {
        let code = match &e {
            idem_core::Error::Config(_) => 2,
            e if e.store_kind() == Some(idem_core::StoreErrorKind::Unavailable) => 3,
            _ => 1,
        };
        Failure(code, e.to_string())
    }
}

impl From<idem_outbound::OutboundError> for Failure {
    fn from(e: idem_outbound::OutboundError) -> Self {
        match e {
            idem_outbound::OutboundError::Store(e) => e.into(),
            idem_outbound::OutboundError::InvalidConfig(m) => Failure(2, m),
            other => Failure(1, other.to_string()),
        }
    }
}

/// A dead-letter store error, with a hint when the table is missing.
fn dlq_failure(table: &str, e: idem_core::Error) -> Failure {
    let Failure(code, message) = e.into();
    if code == 1 {
        Failure(1, format!("dead letters {table}: {message} (is the table there?)"))
    } else {
        Failure(code, message)
    }
}

impl From<idem_gateway::GatewayError> for Failure {
    fn from(e: idem_gateway::GatewayError) -> Self {
        match e {
            idem_gateway::GatewayError::Store(e) => e.into(),
            idem_gateway::GatewayError::Config(e) => Failure(2, e.to_string()),
            other => Failure(1, other.to_string()),
        }
    }
}

/// A store that could not be opened, with the store's URL (credentials
/// masked) in the message.
fn store_failure(url: &str, e: idem_core::Error) -> Failure {
    let Failure(code, message) = e.into();
    Failure(code, format!("store {}: {message}", idem_core::redact_credentials(url)))
}

/// Opens the store at `url` as it is (no file, table or schema created), on
/// `table` if given.
async fn open(url: &str, table: Option<&str>, redis: &idem_gateway::RedisSettings) -> Result<AnyLease, Failure> {
    let s = AnyLease::open_with(url, redis)
        .await
        .map_err(|e| store_failure(url, e))?;
    match table {
        Some(t) => {
            let t = TableName::new(t).map_err(|e| Failure(2, format!("--table: {e}")))?;
            Ok(s.with_table(t)?)
        }
        None => Ok(s),
    }
}

/// Fails with exit 3 unless the keys table is there and current: the
/// commands other than `migrate` never create or change a schema.
async fn require_schema(s: &AnyLease) -> Result<(), Failure> {
    let Some(table) = s.table() else { return Ok(()) };
    let migrate = if table.as_str() == idem_core::TableName::default().as_str() {
        "`idem migrate`".to_owned()
    } else {
        format!("`idem migrate --table {table}`")
    };
    if !s.table_exists(table).await? {
        return Err(Failure(3, format!("table {table} does not exist; run {migrate}")));
    }
    let pending: Vec<i64> = s.pending_migrations().await?.iter().map(|m| m.version).collect();
    if !pending.is_empty() {
        return Err(Failure(
            3,
            format!("table {table} lacks schema version(s) {pending:?}; run {migrate}"),
        ));
    }
    Ok(())
}

/// Opens the keys of `url` for a command that reads them.
async fn open_keys(url: &str, table: Option<&str>, redis: &idem_gateway::RedisSettings) -> Result<AnyLease, Failure> {
    let s = open(url, table, redis).await?;
    require_schema(&s).await?;
    Ok(s)
}

/// Opens the keys of `url` for a command that deletes some: a Redis
/// deployment is checked first.
async fn open_keys_to_write(
    url: &str,
    table: Option<&str>,
    redis: &idem_gateway::RedisSettings,
) -> Result<AnyLease, Failure> {
    let s = open_keys(url, table, redis).await?;
    s.check_deployment(redis).await.map_err(|e| store_failure(url, e))?;
    Ok(s)
}

/// Whether anything went to standard output: with `--json` that is the
/// run's one JSON document, and a failure after it (`dlq redrive` with a
/// letter that failed again) is told on stderr instead of in a second one.
static STDOUT_USED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Writes a line to standard output; a closed pipe (`idem … | head`) is
/// not an error worth a panic.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        STDOUT_USED.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

mod events;

fn print(json: bool, value: serde_json::Value, text: String) {
    if json {
        say!("{value}");
    } else {
        say!("{text}");
    }
}

async fn run(args: Args) -> Result<(), Failure> {
    let json = args.json;
    let redis = args.redis();
    match args.command {
        Command::Gateway {
            upstream,
            upstream_ca_file,
            listen,
            store,
            config,
            tenant,
            admin_listen,
        } => {
            #[cfg(feature = "fault-injection")]
            if std::env::var_os("IDEM_FAULT_SKIP_SENT_MARK").is_some() {
                tracing::warn!("fault injection: the sent mark is off; keys of killed requests are sent again");
                idem_http::fault::set_skip_sent_mark(true);
            }
            let mut cfg = match &config {
                Some(path) => idem_gateway::Config::from_file(path).map_err(|e| Failure(2, e.to_string()))?,
                None => idem_gateway::Config::default(),
            };
            if upstream.is_some() {
                cfg.upstream = upstream;
            }
            if upstream_ca_file.is_some() {
                cfg.upstream_ca_file = upstream_ca_file;
            }
            if store.is_some() {
                cfg.store = store;
            }
            if let Some(spec) = tenant {
                cfg.tenant = Some(idem_gateway::TenantConfig::from_flag(&spec).map_err(|e| Failure(2, e.to_string()))?);
            }
            if admin_listen.is_some() {
                cfg.admin_listen = admin_listen;
            }
            if let Some(prefix) = args.redis_prefix {
                cfg.redis.prefix = prefix;
            }
            if args.skip_redis_checks {
                cfg.redis.skip_deployment_checks = true;
            }
            cfg.validate().map_err(|e| Failure(2, e.to_string()))?;
            let listener = tokio::net::TcpListener::bind(&listen)
                .await
                .map_err(|e| Failure(2, format!("cannot listen on {listen}: {e}")))?;
            idem_gateway::serve(&cfg, listener, shutdown()).await?;
        }
        Command::Migrate {
            store,
            table,
            dry_run,
            show_sql,
            dead_letters,
            dead_letter_table,
        } => {
            // A dry run creates nothing: where no SQLite file is yet, an
            // empty in-memory database stands in for it.
            let s = if dry_run {
                AnyLease::open_for_dry_run(&store, &redis).await
            } else {
                AnyLease::create_with(&store, &redis).await
            }
            .map_err(|e| store_failure(&store, e))?;
            let s = match &table {
                Some(t) => s.with_table(TableName::new(t).map_err(|e| Failure(2, format!("--table: {e}")))?)?,
                None => s,
            };
            s.check_deployment(&redis).await.map_err(|e| store_failure(&store, e))?;
            let letters = if dead_letters {
                let table =
                    TableName::new(&dead_letter_table).map_err(|e| Failure(2, format!("--dead-letter-table: {e}")))?;
                Some(match &s {
                    // The same file (or stand-in) as the keys table.
                    AnyLease::Sqlite(sqlite) => dlq::AnyDeadLetters::Sqlite(
                        idem_sqlite::SqliteDeadLetters::with_table(sqlite.pool().clone(), table),
                    ),
                    _ => dlq::AnyDeadLetters::open(&store, table).await.map_err(|e| match e {
                        idem_core::Error::Config(why) => Failure(2, why),
                        e => store_failure(&store, e),
                    })?,
                })
            } else {
                None
            };
            let mut pending = s.pending_migrations().await?;
            if let Some(letters) = &letters {
                pending.extend(letters.pending_migrations().await?);
            }
            if show_sql && !json {
                for m in &pending {
                    say!("-- version {}: {}", m.version, m.description);
                    for statement in &m.statements {
                        say!("{};", statement.trim());
                    }
                }
            }
            if !dry_run {
                s.migrate().await?;
                if let Some(letters) = &letters {
                    letters.migrate().await?;
                }
            }
            let versions: Vec<i64> = pending.iter().map(|m| m.version).collect();
            let mut v = serde_json::json!({ "store": s.kind(), "pending": versions, "applied": !dry_run });
            if show_sql {
                v["sql"] = pending
                    .iter()
                    .flat_map(|m| m.statements.clone())
                    .collect::<Vec<_>>()
                    .into();
            }
            let what = s
                .table()
                .map_or_else(|| "the keys table".to_owned(), |t| format!("table {t}"));
            let text = match (pending.is_empty(), dry_run) {
                (true, _) if letters.is_some() => format!("{}: {what} and the dead-letter table are current", s.kind()),
                (true, _) if s.table().is_none() => format!("{}: no schema to migrate", s.kind()),
                (true, _) => format!("{}: {what} is current", s.kind()),
                (false, true) => format!("{}: would apply version(s) {versions:?} (nothing applied)", s.kind()),
                (false, false) => format!("{}: applied version(s) {versions:?}", s.kind()),
            };
            print(json, v, text);
        }
        Command::Sweep {
            store,
            table,
            batch,
            pause_ms,
            max_batches,
        } => {
            let s = open_keys_to_write(&store, table.as_deref(), &redis).await?;
            let now = s.source_now_ms().await?;
            let bar = if !json && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                let expired = s.stats(now).await?.expired;
                let bar = indicatif::ProgressBar::new(expired);
                bar.set_style(
                    indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} expired keys deleted ({per_sec})")
                        .expect("a valid template"),
                );
                Some(bar)
            } else {
                None
            };
            let mut report = idem_core::SweepReport::default();
            loop {
                if max_batches.is_some_and(|m| report.batches >= m) {
                    break;
                }
                let done = s.sweep_batch(now, batch).await?;
                report.batches += 1;
                report.deleted += done.deleted;
                report.ghosts += done.ghosts;
                if let Some(bar) = &bar {
                    bar.inc(done.deleted);
                }
                // Entries whose rows were already gone are work done too:
                // only a batch that found less than it could take is the last.
                if done.examined < u64::from(batch) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(pause_ms)).await;
            }
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            let (deleted, ghosts, batches) = (report.deleted, report.ghosts, report.batches);
            let mut v =
                serde_json::json!({ "store": s.kind(), "deleted": deleted, "ghosts": ghosts, "batches": batches });
            if let Some(t) = s.table() {
                v["table"] = t.as_str().into();
            }
            let text = if matches!(s, AnyLease::Redis(_)) {
                format!(
                    "{}: {deleted} expired keys deleted, {ghosts} index entries of keys Redis had expired removed, in {batches} batches",
                    s.kind()
                )
            } else {
                format!("{}: {deleted} expired keys deleted in {batches} batches", s.kind())
            };
            print(json, v, text);
        }
        Command::Stats { store, table } => {
            let s = open_keys(&store, table.as_deref(), &redis).await?;
            let now = s.source_now_ms().await?;
            let st = s.stats(now).await?;
            let mut v = serde_json::json!({
                "store": s.kind(),
                "in_progress": st.in_progress,
                "completed": st.completed,
                "rejected": st.rejected,
                "unknown": st.unknown,
                "sent": st.sent,
                "expired": st.expired,
            });
            if let Some(t) = s.table() {
                v["table"] = t.as_str().into();
            }
            print(
                json,
                v,
                format!(
                    "{}: {} in progress, {} sent (may have reached the other side), {} completed, {} rejected, {} unknown \
                     (held for an operator), {} expired (to sweep)",
                    s.kind(),
                    st.in_progress,
                    st.sent,
                    st.completed,
                    st.rejected,
                    st.unknown,
                    st.expired
                ),
            );
        }
        Command::Keys {
            command: KeysCommand::List(sel),
        } => {
            let filter = sel.filter()?;
            let s = open_keys(&sel.store, sel.table.as_deref(), &redis).await?;
            let now = s.source_now_ms().await?;
            let keys = s.list_keys(&filter, now, sel.limit).await?;
            if json {
                say!("{}", serde_json::Value::Array(keys.iter().map(key_json).collect()));
            } else {
                for k in &keys {
                    say!(
                        "{}\t{}\t{}\t{}\t{} bytes",
                        k.tenant,
                        k.operation,
                        k.key,
                        k.state.name(),
                        k.payload.len()
                    );
                }
                eprintln!("{} key(s)", keys.len());
            }
        }
        Command::Keys {
            command:
                KeysCommand::Show {
                    store,
                    table,
                    tenant,
                    operation,
                    key,
                },
        } => {
            let scope = idem_core::Scope::parse(&tenant, &operation)
                .map_err(|e| Failure(2, format!("--tenant/--operation: {e}")))?;
            let key = idem_core::IdempotencyKey::new(key.as_str()).map_err(|e| Failure(2, format!("--key: {e}")))?;
            let s = open_keys(&store, table.as_deref(), &redis).await?;
            let now = s.source_now_ms().await?;
            let Some(k) = s.find_key(&scope, &key, now).await? else {
                return Err(Failure(
                    1,
                    format!(
                        "no key {:?} for tenant {tenant:?} and operation {operation:?}",
                        key.as_str()
                    ),
                ));
            };
            let mut v = key_json(&k);
            match idem_http::RecordedResponse::decode(&k.payload) {
                Ok(r) if !k.payload.is_empty() => {
                    v["response"] = serde_json::json!({
                        "status": r.status.as_u16(),
                        "body": String::from_utf8_lossy(&r.body).chars().take(4096).collect::<String>(),
                    });
                }
                _ => {
                    v["payload"] = String::from_utf8_lossy(&k.payload)
                        .chars()
                        .take(4096)
                        .collect::<String>()
                        .into()
                }
            }
            if json {
                say!("{v}");
            } else {
                say!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            }
        }
        Command::Keys {
            command:
                KeysCommand::Resolve {
                    store,
                    table,
                    tenant,
                    operation,
                    key,
                    applied,
                    not_applied: _,
                    status,
                    body,
                    headers,
                },
        } => {
            let scope = idem_core::Scope::parse(&tenant, &operation)
                .map_err(|e| Failure(2, format!("--tenant/--operation: {e}")))?;
            let key = idem_core::IdempotencyKey::new(key.as_str()).map_err(|e| Failure(2, format!("--key: {e}")))?;
            let record = if applied {
                Some(resolved_answer(status, body.as_deref(), &headers)?)
            } else {
                None
            };
            let s = open_keys_to_write(&store, table.as_deref(), &redis).await?;
            // The store's clock, as the gateway's keys are timed by it.
            let now = s.source_now_ms().await?;
            let resolved = s.resolve_unknown(&scope, &key, now, record.as_ref()).await?;
            if !resolved {
                let state = s
                    .find_key(&scope, &key, now)
                    .await?
                    .map_or("no such key", |k| k.state.name());
                return Err(Failure(
                    1,
                    format!(
                        "key {:?} of tenant {tenant:?} and operation {operation:?} holds no unknown outcome \
                         ({state}); nothing was changed",
                        key.as_str()
                    ),
                ));
            }
            let what = if applied { "applied" } else { "not_applied" };
            let text = if applied {
                "the answer is recorded; retries replay it"
            } else {
                "the key is released; the next retry is sent"
            };
            print(
                json,
                serde_json::json!({ "store": s.kind(), "resolved": what, "key": key.as_str() }),
                format!("{}: {text}", s.kind()),
            );
        }
        Command::Keys {
            command: KeysCommand::Purge { selection: sel, force },
        } => {
            let filter = sel.filter()?;
            if filter == idem_core::KeyFilter::default() {
                return Err(Failure(
                    2,
                    "purge needs at least one filter (--tenant, --operation, --key-prefix, --state, --older-than-secs)"
                        .into(),
                ));
            }
            if !force
                && filter.state != Some(idem_core::KeyState::Expired)
                && filter.state != Some(idem_core::KeyState::Completed)
                && filter.state != Some(idem_core::KeyState::Rejected)
            {
                return Err(Failure(2, "keys in progress may have a holder at work: pass --state (completed, rejected or expired), or --force".into()));
            }
            let s = open_keys_to_write(&sel.store, sel.table.as_deref(), &redis).await?;
            let now = s.source_now_ms().await?;
            let mut deleted = 0u64;
            // Batches of 500 until one deletes nothing: a batch may delete
            // fewer than it selected (a key claimed again meanwhile stays),
            // and the next one looks again.
            while deleted < u64::from(sel.limit) {
                let batch = (u64::from(sel.limit) - deleted).min(500) as u32;
                let n = s.purge_keys(&filter, now, batch).await?;
                deleted += n;
                if n == 0 {
                    break;
                }
            }
            print(
                json,
                serde_json::json!({ "store": s.kind(), "deleted": deleted }),
                format!("{}: {deleted} key(s) deleted", s.kind()),
            );
        }
        Command::Outbox {
            command: OutboxCommand::Status { store, table },
        } => {
            let table = TableName::new(table)?;
            let s = open(&store, None, &redis).await?;
            if matches!(s, AnyLease::Redis(_)) {
                return Err(Failure(
                    2,
                    "Redis keeps no outbox: use the service's SQL database".into(),
                ));
            }
            if !s.table_exists(&table).await? {
                return Err(Failure(
                    3,
                    format!("table {table} does not exist (the service's outbox table?)"),
                ));
            }
            let lag = s.outbox_lag(table.clone()).await.map_err(|e| match e {
                idem_core::Error::Config(m) => Failure(2, m),
                other => Failure(1, format!("outbox {table}: {other}")),
            })?;
            let age = lag.oldest_unsent_age_ms.map(|ms| ms as f64 / 1000.0);
            print(
                json,
                serde_json::json!({ "store": s.kind(), "table": table.as_str(), "unsent": lag.unsent, "oldest_unsent_age_seconds": age }),
                format!(
                    "{table}: {} unsent{}",
                    lag.unsent,
                    age.map(|a| format!(", the oldest {a:.1} s old")).unwrap_or_default()
                ),
            );
        }
        Command::Dlq { command } => return dlq(command, json).await,
        Command::Events { command } => return events::run(command, json).await,
    }
    Ok(())
}

async fn dlq(command: DlqCommand, json: bool) -> Result<(), Failure> {
    use idem_core::DeadLetterStore;
    match command {
        DlqCommand::List {
            selection,
            state,
            limit,
        } => {
            let filter = selection.filter(state.as_deref(), limit)?;
            let store = selection.open().await?;
            let letters = store
                .list(&filter)
                .await
                .map_err(|e| dlq_failure(&selection.table, e))?;
            if json {
                say!(
                    "{}",
                    serde_json::Value::Array(letters.iter().map(dlq::summary_json).collect::<Vec<_>>())
                );
            } else {
                for l in &letters {
                    say!("{}", dlq::summary_line(l));
                }
                eprintln!("{} dead letter(s)", letters.len());
            }
        }
        DlqCommand::Resolve {
            store,
            table,
            id,
            applied,
            not_applied: _,
            status,
            body,
            note,
        } => {
            let selection = DlqSelection {
                store,
                table,
                tenant: None,
                operation: None,
                after_id: None,
            };
            let s = selection.open().await?;
            let settlement = dlq::settlement(applied, status, body, note)?;
            let letter = s.get(id).await.map_err(|e| dlq_failure(&selection.table, e))?;
            let Some(letter) = letter else {
                return Err(Failure(1, format!("no dead letter {id} in {}", selection.table)));
            };
            if !s
                .settle(id, &settlement)
                .await
                .map_err(|e| dlq_failure(&selection.table, e))?
            {
                return Err(Failure(
                    1,
                    format!(
                        "dead letter {id} is {}: only a dead or unknown letter is resolved",
                        letter.state.as_str()
                    ),
                ));
            }
            let after = s.get(id).await.map_err(|e| dlq_failure(&selection.table, e))?;
            let v = after.as_ref().map(dlq::detail_json).unwrap_or_default();
            print(json, v, format!("{id}\t{}", after.map_or("gone", |l| l.state.as_str())));
        }
        DlqCommand::Show { store, table, id } => {
            let selection = DlqSelection {
                store,
                table,
                tenant: None,
                operation: None,
                after_id: None,
            };
            let s = selection.open().await?;
            let letter = s.get(id).await.map_err(|e| dlq_failure(&selection.table, e))?;
            let Some(letter) = letter else {
                return Err(Failure(1, format!("no dead letter {id} in {}", selection.table)));
            };
            let v = dlq::detail_json(&letter);
            if json {
                say!("{v}");
            } else {
                say!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            }
        }
        DlqCommand::Redrive {
            selection,
            id,
            state,
            max,
            per_second,
            deadline_secs,
            resend,
        } => {
            if let Some(hold) = resend.hold_secs()
                && hold < deadline_secs
            {
                return Err(Failure(
                    2,
                    format!(
                        "--hold-secs ({hold}) must be at least --deadline-secs ({deadline_secs}): a hold that runs \
                         out mid-send cuts the send's retries off and lets another redrive take the letter"
                    ),
                ));
            }
            if resend.retargets() && id.is_none() && selection.operation.is_none() {
                return Err(Failure(
                    2,
                    "--url sends every selected letter to one target and stores it in each: \
                     name the letters' --operation (or one --id)"
                        .into(),
                ));
            }
            let filter = selection.filter(Some(&state), 100)?;
            let config = resend.config(idem_outbound::OutboundConfig {
                name: "idem-cli".into(),
                deadline: Duration::from_secs(deadline_secs),
                ..idem_outbound::OutboundConfig::default()
            })?;
            let client = idem_outbound::OutboundClient::new(config)?;
            let store = selection.open().await?;
            let redriver = resend.redriver(client, store.clone())?;
            let report = match id {
                Some(id) => {
                    // A mistyped id is an error, not a quiet "skipped".
                    if store
                        .get(id)
                        .await
                        .map_err(|e| dlq_failure(&selection.table, e))?
                        .is_none()
                    {
                        return Err(Failure(1, format!("no dead letter {id} in {}", selection.table)));
                    }
                    let result = redriver.redrive_one(id).await.map_err(|e| match e {
                        idem_outbound::OutboundError::Store(e) => dlq_failure(&selection.table, e),
                        other => other.into(),
                    })?;
                    let mut report = idem_outbound::RedriveReport::default();
                    report.add(id, result);
                    report
                }
                None => redriver
                    .redrive(&filter, idem_outbound::RedriveOptions { max, per_second })
                    .await
                    .map_err(|e| match e {
                        idem_outbound::OutboundError::Store(e) => dlq_failure(&selection.table, e),
                        other => other.into(),
                    })?,
            };
            if json {
                say!("{}", dlq::report_json(store.kind(), &report));
            } else {
                for item in &report.items {
                    say!("{}", dlq::result_line(item.id, &item.result));
                }
                say!(
                    "{}: {} resolved, {} failed, {} held as unknown, {} skipped, {} refused, {} error(s)",
                    store.kind(),
                    report.resolved,
                    report.failed,
                    report.unknown,
                    report.skipped,
                    report.refused,
                    report.errors
                );
            }
            if report.refused > 0 {
                return Err(Failure(
                    2,
                    format!(
                        "{} dead letter(s) do not say the key horizon their sends were made under: nothing sent for \
                         them; give --key-horizon-secs (and --settle-secs) to judge them by",
                        report.refused
                    ),
                ));
            }
            if report.failed > 0 || report.errors > 0 || report.unknown > 0 {
                return Err(Failure(
                    1,
                    format!(
                        "{} dead letter(s) failed again, {} held as unknown (see `idem dlq resolve`), {} error(s)",
                        report.failed, report.unknown, report.errors
                    ),
                ));
            }
        }
    }
    Ok(())
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
    let outcome = match Args::try_parse_from(&raw) {
        Ok(args) => run(args).await,
        Err(e) => {
            use clap::error::ErrorKind;
            if !json || matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                e.exit();
            }
            Err(Failure(2, e.render().to_string().trim().to_owned()))
        }
    };
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(Failure(code, message)) => {
            // Whatever the failure, no credential reaches the output: the
            // passwords of the URLs given on the command line and in the
            // environment are known whole, whatever characters they hold.
            let passwords = given_passwords(&raw);
            let passwords: Vec<&str> = passwords.iter().map(String::as_str).collect();
            let message = idem_core::redact_known(&message, &passwords);
            if json && !STDOUT_USED.load(std::sync::atomic::Ordering::Relaxed) {
                say!("{}", serde_json::json!({ "error": message, "exit_code": code }));
            } else {
                eprintln!("idem: {message}");
            }
            std::process::ExitCode::from(code)
        }
    }
}

/// The passwords of every URL among the arguments (`--store URL`,
/// `--store=URL`) and the environment's values (`IDEM_STORE`…).
fn given_passwords(raw: &[std::ffi::OsString]) -> Vec<String> {
    let mut texts: Vec<String> = raw.iter().filter_map(|a| a.to_str()).map(str::to_owned).collect();
    texts.extend(std::env::vars_os().filter_map(|(_, v)| v.into_string().ok()));
    let mut found = Vec::new();
    for text in texts {
        // `--flag=URL` and the URL itself.
        for candidate in [Some(text.as_str()), text.split_once('=').map(|(_, v)| v)]
            .into_iter()
            .flatten()
        {
            found.extend(idem_core::url_passwords(candidate).into_iter().map(str::to_owned));
        }
    }
    found.sort();
    found.dedup();
    found
}

async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("idem gateway: draining in-flight requests");
}
