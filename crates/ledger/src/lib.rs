//! `ledger`: idem's reference service, a small credits ledger whose every
//! mutation is exactly-once.
//!
//! Accounts, top-ups and transfers are double-entry rows; every mutating
//! route sits behind idem's transactional [`IdempotencyLayer`](idem_http::IdempotencyLayer),
//! so a retried request replays its recorded response and never applies
//! twice. `GET /v1/audit` proves conservation from the stored rows.
//!
//! The binary (`cargo run --release -p ledger`) is a thin wrapper over
//! [`run`]; tests build the router with [`app`] and drive it in-process or
//! over a socket with [`serve`].

/// Runs `$body` with `$db` bound to the concrete store.
macro_rules! with_db {
    ($store:expr, $db:ident => $body:expr) => {
        match $store {
            $crate::Store::Postgres($db) => $body,
            $crate::Store::MySql($db) => $body,
            $crate::Store::Sqlite($db) => $body,
        }
    };
}

pub mod api;
pub mod db;
pub mod events;
#[cfg(feature = "fault-injection")]
pub mod fault;
#[cfg(feature = "fault-injection")]
pub mod faulty;
pub mod openapi;
pub mod payouts;
pub mod sweeper;
pub mod withdrawals;

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use api::{AppState, Options, WithdrawalRoute, app, tenant_for_token};
pub use db::{Audit, DbError, LedgerDb, LedgerTx};
use idem_core::{Detached, SharedClock, TableName};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;

/// Where the ledger keeps its data.
#[derive(Clone)]
pub enum Store {
    /// PostgreSQL.
    Postgres(idem_postgres::PgStore),
    /// MySQL or MariaDB.
    MySql(idem_mysql::MySqlStore),
    /// A SQLite file.
    Sqlite(idem_sqlite::SqliteStore),
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.engine())
    }
}

/// Startup failures.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The database URL names no supported engine.
    #[error("unsupported database URL {0:?}: use postgres://, mysql:// (or mariadb://), sqlite:// or a file path")]
    Url(String),
    /// The database could not be reached or migrated.
    #[error("database: {0}")]
    Db(#[from] DbError),
    /// The idempotency store failed.
    #[error("idempotency store: {0}")]
    Idem(#[from] idem_core::Error),
    /// sqlx failed.
    #[error("database: {0}")]
    Sql(#[from] sqlx::Error),
    /// A setting is invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// A server's TLS handshake failed (which server, and why).
    #[error("{0}")]
    Handshake(String),
    /// The listener failed.
    #[error("listener: {0}")]
    Io(#[from] std::io::Error),
}

/// A reqwest client builder for plain HTTP or the platform's roots, with
/// ring installed as the process's rustls provider first (reqwest panics
/// without one when ring is the only provider compiled in).
pub fn http_builder() -> reqwest::ClientBuilder {
    idem_tls::install_default_provider();
    reqwest::Client::builder()
}

/// A database's connection failure; a failed TLS handshake names the
/// database and rustls's reason.
fn connect_error(url: &str, e: sqlx::Error) -> StartError {
    match idem_tls::handshake_failure(&e) {
        Some(failed) => StartError::Handshake(format!(
            "database {}: {failed}",
            idem_core::redact_credentials(url.split('?').next().unwrap_or(url))
        )),
        None => StartError::Sql(e),
    }
}

impl Store {
    /// Connects to `url` (`postgres://…`, `mysql://…`, `mariadb://…`,
    /// `sqlite://PATH` or a plain file path) with at most `max_connections`,
    /// and migrates every table.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StartError> {
        let store = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(max_connections)
                .acquire_timeout(Duration::from_secs(10))
                .connect(url)
                .await
                .map_err(|e| connect_error(url, e))?;
            Store::Postgres(idem_postgres::PgStore::new(pool))
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            let url = url.replacen("mariadb://", "mysql://", 1);
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(max_connections)
                .acquire_timeout(Duration::from_secs(10))
                .connect(&url)
                .await
                .map_err(|e| connect_error(&url, e))?;
            Store::MySql(idem_mysql::MySqlStore::new(pool))
        } else if let Some(path) = url
            .strip_prefix("sqlite://")
            .or(url.strip_prefix("sqlite:"))
            .or_else(|| (!url.contains("://")).then_some(url))
        {
            Store::Sqlite(idem_sqlite::SqliteStore::open(path).await?)
        } else {
            return Err(StartError::Url(url.to_owned()));
        };
        store.migrate().await?;
        Ok(store)
    }

    async fn migrate(&self) -> Result<(), DbError> {
        match self {
            Store::Postgres(s) => LedgerDb::migrate(s).await,
            Store::MySql(s) => LedgerDb::migrate(s).await,
            Store::Sqlite(s) => LedgerDb::migrate(s).await,
        }
    }

    /// The ledger's router on this store.
    pub fn router(&self, clock: SharedClock, options: Options) -> axum::Router {
        self.router_detached(clock, options).0
    }

    /// [`router`](Self::router), and the withdrawals still running after
    /// their answers (with withdrawals on), which a server waits for before
    /// it stops.
    pub fn router_detached(&self, clock: SharedClock, options: Options) -> (axum::Router, Option<Detached>) {
        with_db!(self.clone(), db => routed(db, clock, options))
    }

    /// One completer pass of withdrawals on this store: at most `limit`
    /// withdrawals whose run stopped resumed from their recovery points
    /// (see [`withdrawals::complete_due`]).
    pub async fn complete_withdrawals(
        &self,
        clock: SharedClock,
        config: &withdrawals::WithdrawalsConfig,
        namespace: &events::Namespace,
        limit: u32,
    ) -> Result<idem_steps::Pass, StartError> {
        with_db!(self, db => withdrawals::complete_due(db, clock, config, namespace, limit).await)
    }

    /// The engine's name.
    pub fn engine(&self) -> &'static str {
        match self {
            Store::Postgres(_) => "postgres",
            Store::MySql(_) => "mysql",
            Store::Sqlite(_) => "sqlite",
        }
    }

    /// The table name of idempotency keys.
    pub fn keys_table() -> TableName {
        TableName::default()
    }

    /// The dead letters of vendor calls.
    pub fn dead_letters(&self) -> DeadLetters {
        match self {
            Store::Postgres(s) => DeadLetters::Postgres(s.dead_letters()),
            Store::MySql(s) => DeadLetters::MySql(s.dead_letters()),
            Store::Sqlite(s) => DeadLetters::Sqlite(s.dead_letters()),
        }
    }
}

/// The ledger's router on `db` (on `db` failing on purpose, with the
/// `fault-injection` feature and `LEDGER_STORE_FAULTS` set).
fn routed<D: LedgerDb>(db: D, clock: SharedClock, options: Options) -> (axum::Router, Option<Detached>)
where
    D::DeadLetters: Send + Sync + 'static,
{
    #[cfg(feature = "fault-injection")]
    if let Some(faults) = faulty::store_faults() {
        return routed_on(faults.beside(db), clock, options);
    }
    routed_on(db, clock, options)
}

fn routed_on<D: LedgerDb>(db: D, clock: SharedClock, options: Options) -> (axum::Router, Option<Detached>) {
    let withdrawals = options.withdrawals.as_ref().and_then(|config| {
        WithdrawalRoute::new(&db, clock.clone(), config, options.events_namespace.clone())
            .inspect_err(|e| tracing::error!(error = %e, "withdrawals are unavailable"))
            .ok()
    });
    let detached = withdrawals.as_ref().map(|w| w.steps.detached().clone());
    let router = app(
        AppState {
            events: events::EventOutbox::new(&db, options.events_namespace.clone()),
            events_health: options.events_health.clone(),
            db,
            clock,
            metrics: metrics_handle(),
            withdrawals,
        },
        options,
    );
    (router, detached)
}

/// The dead letters of vendor calls on the ledger's engine.
#[derive(Debug, Clone)]
pub enum DeadLetters {
    /// PostgreSQL.
    Postgres(idem_postgres::PgDeadLetters),
    /// MySQL or MariaDB.
    MySql(idem_mysql::MySqlDeadLetters),
    /// SQLite.
    Sqlite(idem_sqlite::SqliteDeadLetters),
}

idem_core::dead_letters_of_each!(DeadLetters {
    Postgres,
    MySql,
    Sqlite
});

impl idem_core::TimeSource for Store {
    fn source_now_ms(&self) -> idem_core::BoxFuture<'_, idem_core::Result<i64>> {
        match self {
            Store::Postgres(s) => s.source_now_ms(),
            Store::MySql(s) => s.source_now_ms(),
            Store::Sqlite(s) => s.source_now_ms(),
        }
    }
}

/// The process-wide Prometheus recorder (installed on first call).
pub fn metrics_handle() -> Option<PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok().map(|_| handle)
        })
        .clone()
}

/// Serves the ledger on `listener` until `shutdown` completes, then drains
/// in-flight requests.
pub async fn serve(
    listener: TcpListener,
    store: Store,
    clock: SharedClock,
    options: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartError> {
    let (router, detached) = store.router_detached(clock, options);
    axum::serve(listener, router).with_graceful_shutdown(shutdown).await?;
    // A withdrawal whose client went away runs on; a stop waits for it to
    // reach its end or a recovery point.
    if let Some(detached) = detached
        && tokio::time::timeout(DETACHED_WAIT, detached.idle()).await.is_err()
    {
        tracing::warn!(
            running = detached.running(),
            "withdrawals still running at stop; a retry or a completer resumes them"
        );
    }
    Ok(())
}

/// How long a stopping server waits for the withdrawals still running.
const DETACHED_WAIT: Duration = Duration::from_secs(30);

/// The clock of every instance on one database: the database's, so a host
/// whose clock is off cannot expire keys early.
async fn anchored_clock(store: &Store) -> Result<SharedClock, StartError> {
    let clock = idem_core::AnchoredClock::start(Arc::new(store.clone()), idem_core::AnchorOptions::default())
        .await
        .map_err(|e| StartError::Config(format!("cannot read the database's clock: {e}")))?;
    tracing::info!(
        uncertainty_ms = clock.uncertainty().as_secs_f64() * 1000.0,
        "clock anchored to the database"
    );
    Ok(Arc::new(clock))
}

/// The balance snapshots job: one row per account, once per run id.
pub fn snapshot_job(every: Duration) -> Result<idem_jobs::Job, StartError> {
    Ok(idem_jobs::Job::new("balance-snapshots", every)?)
}

/// Runs the balance snapshots job once under `run_id`: `Some(rows)` if this
/// call applied it, `None` if the run id was applied before.
pub async fn snapshot<D: LedgerDb>(
    db: &D,
    clock: SharedClock,
    job: &idem_jobs::Job,
    run_id: &str,
) -> Result<Option<u64>, DbError> {
    let scheduler = snapshot_scheduler(db, clock.clone())?;
    let run = run_id.to_owned();
    let delivery = scheduler
        .run(job, run_id, |tx| {
            let (run, clock) = (run.clone(), clock.clone());
            Box::pin(async move { tx.snapshot_balances(&run, clock.now_ms()).await })
        })
        .await?;
    Ok(match delivery {
        idem_jobs::Delivery::Applied(rows) => Some(rows),
        idem_jobs::Delivery::Duplicate(_) => None,
    })
}

fn snapshot_scheduler<D: LedgerDb>(db: &D, clock: SharedClock) -> Result<idem_jobs::Scheduler<D>, DbError> {
    let store = db.keyed(TableName::new(db::JOB_RUNS_TABLE)?);
    Ok(idem_jobs::Scheduler::new(
        idem_core::TxEngine::new(store).with_clock(clock),
    ))
}

/// Gives a closure the job work's higher-ranked signature.
fn snapshot_work<D: LedgerDb, F>(f: F) -> F
where
    F: for<'c> FnMut(&'c mut D::Tx) -> idem_core::BoxFuture<'c, Result<u64, DbError>>,
{
    f
}

/// The balance snapshots job on its schedule, until `shutdown`.
async fn run_snapshots<D: LedgerDb>(
    db: D,
    clock: SharedClock,
    job: idem_jobs::Job,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let scheduler = match snapshot_scheduler(&db, clock.clone()) {
        Ok(s) => s,
        Err(e) => return tracing::error!(error = %e, "the snapshot job did not start"),
    };
    let make = |run_id: String| {
        let clock = clock.clone();
        snapshot_work::<D, _>(move |tx| {
            let (run_id, clock) = (run_id.clone(), clock.clone());
            Box::pin(async move { tx.snapshot_balances(&run_id, clock.now_ms()).await })
        })
    };
    scheduler.run_every(&job, Duration::from_secs(30), make, shutdown).await;
}

/// `ledger job snapshots`: runs the job once, under `run_id` or the current
/// slot's id; answers the run id and the rows written (`None`: already run).
pub async fn run_snapshot_job(
    database_url: &str,
    run_id: Option<String>,
    every: Duration,
) -> Result<(String, Option<u64>), StartError> {
    let store = Store::connect(database_url, 2).await?;
    let clock = anchored_clock(&store).await?;
    let job = snapshot_job(every)?;
    let run_id = run_id.unwrap_or_else(|| job.run_id(job.slot_at(clock.now_ms())));
    let outcome = with_db!(&store, db => snapshot(db, clock.clone(), &job, &run_id).await?);
    Ok((run_id, outcome))
}

/// `ledger payouts`: the payout worker without the HTTP server, until
/// SIGTERM or Ctrl-C.
pub async fn run_payouts(
    database_url: &str,
    max_connections: u32,
    config: payouts::PayoutConfig,
    outbound: idem_outbound::OutboundConfig,
) -> Result<(), StartError> {
    let store = Store::connect(database_url, max_connections).await?;
    let clock = anchored_clock(&store).await?;
    let client =
        idem_outbound::OutboundClient::new(outbound).map_err(|e| StartError::Config(format!("payouts: {e}")))?;
    until_shutdown("payout worker", move |stopped| async move {
        payouts::run(&store, clock, client, config, stopped).await
    })
    .await
}

/// `ledger complete`: completers of withdrawals without the HTTP server
/// (`config.completers` of them, at least one), until SIGTERM or Ctrl-C.
pub async fn run_withdrawal_completers(
    database_url: &str,
    max_connections: u32,
    config: withdrawals::WithdrawalsConfig,
    namespace: events::Namespace,
) -> Result<(), StartError> {
    #[cfg(feature = "fault-injection")]
    fault::install_from_env().map_err(StartError::Config)?;
    let store = Store::connect(database_url, max_connections).await?;
    let clock = anchored_clock(&store).await?;
    let completers = config.completers.max(1);
    until_shutdown("withdrawal completers", move |stopped| async move {
        with_db!(store, db => withdrawals::run_completers(db, clock, config, namespace, completers, stopped).await)
    })
    .await
}

/// Runs `work` in a task of its own, handed a receiver that turns true at
/// SIGTERM or Ctrl-C, and waits for it to stop after that; `what` names it
/// if the task fails.
async fn until_shutdown<F>(
    what: &str,
    work: impl FnOnce(tokio::sync::watch::Receiver<bool>) -> F,
) -> Result<(), StartError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(work(stopped));
    shutdown_signal().await;
    let _ = stop.send(true);
    task.await.map_err(|e| StartError::Config(format!("{what}: {e}")))
}

/// `ledger relay` / `ledger project`: the events without the HTTP server,
/// until SIGTERM or Ctrl-C.
pub async fn run_events(
    database_url: &str,
    max_connections: u32,
    config: events::EventsConfig,
) -> Result<(), StartError> {
    let store = Store::connect(database_url, max_connections).await?;
    let clock = anchored_clock(&store).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut task = {
        let store = store.clone();
        let health = events::EventsHealth::default();
        tokio::spawn(async move { with_db!(store, db => events::run(db, clock, config, stopped, health).await) })
    };
    // A task that ends on its own (a configuration it cannot retry) ends
    // the process with its error.
    tokio::select! {
        _ = shutdown_signal() => {}
        done = &mut task => {
            return done.map_err(|e| StartError::Config(format!("events task: {e}")))?;
        }
    }
    let _ = stop.send(true);
    task.await
        .map_err(|e| StartError::Config(format!("events task: {e}")))??;
    Ok(())
}

/// The server's background work besides events and payouts.
#[derive(Debug, Clone)]
pub struct Background {
    /// The balance snapshots job (its period and missed-slot policy), if on.
    pub snapshots: Option<idem_jobs::Job>,
    /// How often expired rows of every keyed table are swept, if at all.
    pub sweep_every: Option<Duration>,
}

/// What the binary runs: connect, migrate, listen, serve until SIGTERM or
/// Ctrl-C; with `events`, relays and the projection in the same process;
/// the balance snapshots job on its schedule and the sweeper, as
/// `background` says.
pub async fn run(
    listen: &str,
    database_url: &str,
    max_connections: u32,
    options: Options,
    events: Option<events::EventsConfig>,
    background: Background,
    payouts: Option<(payouts::PayoutConfig, idem_outbound::OutboundConfig)>,
) -> Result<(), StartError> {
    // The recorder first: what the background tasks count before the
    // router is built (an events setting refused at start) would otherwise
    // go to no recorder and never show in `/metrics`.
    let _ = metrics_handle();
    #[cfg(feature = "fault-injection")]
    fault::install_from_env().map_err(StartError::Config)?;
    let store = Store::connect(database_url, max_connections).await?;
    let listener = TcpListener::bind(listen).await?;
    tracing::info!(addr = %listener.local_addr()?, engine = store.engine(), "ledger listening");
    let clock = anchored_clock(&store).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut background_tasks = tokio::task::JoinSet::new();
    if let Some(config) = events {
        let (store, clock, stopped) = (store.clone(), clock.clone(), stopped.clone());
        let health = options.events_health.clone();
        background_tasks.spawn(async move {
            if let Err(e) = with_db!(store, db => events::run(db, clock, config, stopped, health).await) {
                tracing::error!(error = %e, "events stopped");
            }
        });
    } else {
        tracing::info!("no --nats-url: events stay in the outbox until a relay runs");
    }
    if let Some(every) = background.sweep_every {
        let (store, clock, stopped) = (store.clone(), clock.clone(), stopped.clone());
        background_tasks.spawn(async move { with_db!(store, db => sweeper::run(db, clock, every, stopped).await) });
    } else {
        tracing::info!("--sweep-every-secs 0: expired keys are not swept by this process");
    }
    if let Some(job) = background.snapshots {
        let (store, clock, mut stopped) = (store.clone(), clock.clone(), stopped.clone());
        background_tasks.spawn(async move {
            let shutdown = async move {
                let _ = stopped.wait_for(|s| *s).await;
            };
            with_db!(store, db => run_snapshots(db, clock, job, shutdown).await)
        });
    }
    match options.withdrawals.clone() {
        Some(config) if config.completers > 0 => {
            let (store, clock, stopped) = (store.clone(), clock.clone(), stopped.clone());
            let namespace = options.events_namespace.clone();
            let completers = config.completers;
            background_tasks.spawn(async move {
                with_db!(store, db => withdrawals::run_completers(db, clock, config, namespace, completers, stopped).await)
            });
        }
        Some(_) => tracing::info!("--completers 0: withdrawals whose client went away wait for its retry"),
        None => tracing::info!("no --fx-url: POST /v1/withdrawals answers 503"),
    }
    if let Some((config, outbound)) = payouts {
        let client =
            idem_outbound::OutboundClient::new(outbound).map_err(|e| StartError::Config(format!("payouts: {e}")))?;
        let (store, clock, stopped) = (store.clone(), clock.clone(), stopped.clone());
        background_tasks.spawn(async move { payouts::run(&store, clock, client, config, stopped).await });
    } else {
        tracing::info!("no --vendor-url: payouts stay requested until a payout worker runs");
    }
    serve(listener, store, clock, options, shutdown_signal()).await?;
    let _ = stop.send(true);
    while background_tasks.join_next().await.is_some() {}
    tracing::info!("ledger stopped");
    Ok(())
}

/// Completes on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: draining in-flight requests");
}
