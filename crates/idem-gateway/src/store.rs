//! The lease store the gateway (and the `idem` command) runs on, chosen by
//! URL.
//!
//! | URL | store |
//! |---|---|
//! | a path, `sqlite://PATH`, `sqlite:PATH` | SQLite file (one host) |
//! | `postgres://…`, `postgresql://…` | PostgreSQL |
//! | `mysql://…`, `mariadb://…` | MySQL or MariaDB |
//! | `redis://…` | one Redis server, or a Redis Cluster (a node that says `cluster_enabled:1` is taken for a seed) |
//! | `redis://a:7000,redis://b:7001,…` | a Redis Cluster through its seed nodes |
//! | `redis+sentinel://s1:26379,s2:26379/SERVICE` | the master Redis Sentinel names for `SERVICE`, followed through failovers (`rediss+sentinel://` for TLS) |
//!
//! Opening never creates a schema: [`AnyLease::open`] connects to what is
//! there (a SQLite path where no file is fails, "no such database file"),
//! [`AnyLease::create`] also creates a missing SQLite file (for `idem
//! migrate`), and [`AnyLease::connect_with`] creates, checks a Redis
//! deployment and migrates: what the gateway does at start. URLs that can
//! never work are refused before anything is opened ([`Error::Config`]):
//! an empty URL, SQLite without a file, or an in-memory SQLite database
//! (private to each pooled connection). Error messages carry URLs with
//! their credentials masked ([`idem_core::redact_credentials`]).

use std::path::Path;
use std::time::Duration;

use idem_core::{
    BoxFuture, ClaimRequest, Error, IdempotencyKey, KeyAdmin, KeyFilter, KeyInfo, KeyStats, Lease, LeaseClaim,
    LeaseStore, OutboxLag, OutboxStore, Record, Resolution, Result, Scope, StoreErrorKind, StoredRow, Sweep,
    SweepBatch, TableName, TimeSource,
};
use idem_redis::RedisConnection;
use serde::Deserialize;

/// How a Redis store is used (the `[redis]` table of the gateway's
/// configuration; the `idem` command's `--redis-prefix` and
/// `--skip-redis-checks`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisSettings {
    /// The key prefix (default `idem`): several gateways, or services, can
    /// share one Redis with prefixes of their own.
    pub prefix: String,
    /// Skips the deployment check at start (eviction policy, persistence;
    /// see [`idem_redis::RedisStore::check_deployment`]), for a deployment
    /// that knows better than the check.
    pub skip_deployment_checks: bool,
    /// How often the deployment is checked again while the gateway serves,
    /// seconds (default 60; 0: only at start): a policy switched to
    /// eviction later marks `/_idem/healthz` unhealthy and is logged.
    pub deployment_check_secs: u64,
    /// Replicas that must acknowledge each write of a key's row before it
    /// counts (0, the default: none; see
    /// [`idem_redis::RedisStore::with_replica_acks`]).
    pub replica_acks: u32,
    /// How long a write waits for those replicas, milliseconds (default
    /// 500; 1 to 4000).
    pub replica_ack_timeout_ms: u64,
}

impl Default for RedisSettings {
    fn default() -> Self {
        Self {
            prefix: idem_redis::DEFAULT_PREFIX.to_owned(),
            skip_deployment_checks: false,
            deployment_check_secs: 60,
            replica_acks: 0,
            replica_ack_timeout_ms: 500,
        }
    }
}

/// What the periodic deployment check last found wrong, if anything
/// (`/_idem/healthz` answers 503 with it).
#[derive(Debug, Clone, Default)]
pub(crate) struct DeploymentHealth(std::sync::Arc<std::sync::Mutex<Option<String>>>);

impl DeploymentHealth {
    /// The problem found, if any.
    pub(crate) fn problem(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn set(&self, problem: Option<String>) {
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = problem;
    }

    /// Checks `store`'s deployment every `redis.deployment_check_secs`
    /// until the returned task is aborted (nothing to check on the SQL
    /// stores, or when the checks are skipped or their period is 0).
    pub(crate) fn watch(&self, store: AnyLease, redis: &RedisSettings) -> Option<AbortOnDrop> {
        if redis.skip_deployment_checks || redis.deployment_check_secs == 0 {
            return None;
        }
        let AnyLease::Redis(redis_store) = store else {
            return None;
        };
        let (health, every) = (
            self.clone(),
            std::time::Duration::from_secs(redis.deployment_check_secs),
        );
        Some(AbortOnDrop(tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                match redis_store.check_deployment().await {
                    // Settings it could not read (Redis unreachable for a
                    // moment, a refused command) prove nothing: the last
                    // verdict stands.
                    Ok(warnings) if warnings.iter().any(|w| w.contains("cannot read")) => {
                        tracing::debug!(?warnings, "the Redis deployment check was inconclusive");
                    }
                    Ok(_) => {
                        if health.problem().is_some() {
                            tracing::info!("the Redis deployment passes its check again");
                        }
                        health.set(None);
                        metrics::gauge!("idem_gateway_store_deployment_ok").set(1.0);
                    }
                    Err(idem_core::Error::Config(why)) => {
                        tracing::error!(problem = %why, "the Redis deployment no longer passes its check");
                        health.set(Some(why));
                        metrics::gauge!("idem_gateway_store_deployment_ok").set(0.0);
                    }
                    // Unreachable for a moment: the health check's own
                    // store probe says so.
                    Err(e) => tracing::warn!(error = %e, "cannot check the Redis deployment"),
                }
            }
        })))
    }
}

/// A task that ends when its handle is dropped (the gateway's serving
/// future dropped, or done).
pub(crate) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One of the lease stores, chosen by URL.
#[derive(Clone, Debug)]
pub enum AnyLease {
    /// A SQLite file (one host).
    Sqlite(idem_sqlite::SqliteStore),
    /// PostgreSQL.
    Postgres(idem_postgres::PgStore),
    /// MySQL or MariaDB.
    MySql(idem_mysql::MySqlStore),
    /// Redis: one server or a cluster.
    Redis(idem_redis::RedisStore<RedisConnection>),
}

macro_rules! each {
    ($self:expr, $s:ident => $body:expr) => {
        match $self {
            AnyLease::Sqlite($s) => $body,
            AnyLease::Postgres($s) => $body,
            AnyLease::MySql($s) => $body,
            AnyLease::Redis($s) => $body,
        }
    };
}

/// What a store URL names, once it is known to be usable.
enum Target<'a> {
    Sqlite(&'a str),
    Postgres,
    MySql,
    Redis,
}

/// Refuses what can never work, naming the setting; answers what `url`
/// names otherwise.
fn target(url: &str) -> Result<Target<'_>> {
    let shown = || idem_core::redact_credentials(url);
    if url.trim().is_empty() {
        return Err(Error::Config(
            "--store (store) is empty: give a SQLite path, postgres://, mysql:// or redis://".into(),
        ));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok(Target::Postgres);
    }
    if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        return Ok(Target::MySql);
    }
    if ["redis://", "rediss://", "redis+sentinel://", "rediss+sentinel://"]
        .iter()
        .any(|scheme| url.starts_with(scheme))
    {
        return Ok(Target::Redis);
    }
    let path = url
        .strip_prefix("sqlite://")
        .or(url.strip_prefix("sqlite:"))
        .or_else(|| (!url.contains("://")).then_some(url));
    let Some(path) = path else {
        return Err(Error::Config(format!(
            "--store (store): unsupported store URL {:?}: use a SQLite path, postgres://, mysql://, redis:// or redis+sentinel://",
            shown()
        )));
    };
    let bare = path.split('?').next().unwrap_or_default();
    if bare.trim().is_empty() {
        return Err(Error::Config(format!(
            "--store (store) {:?} names no SQLite file: each pooled connection would get a private, temporary \
             database; give a file path",
            shown()
        )));
    }
    let memory = bare == ":memory:"
        || bare.starts_with("file::memory:")
        || path.contains("mode=memory")
        || bare.starts_with(":memory:");
    if memory {
        return Err(Error::Config(format!(
            "--store (store) {:?} is an in-memory SQLite database: it belongs to one connection, and every \
             pooled connection would get its own, empty one; give a file path",
            shown()
        )));
    }
    Ok(Target::Sqlite(path))
}

/// A first connection that failed, for whatever reason (refused, unknown
/// host, credentials refused, no such database): the store is not there
/// as asked.
fn unreachable(e: Error) -> Error {
    match e {
        Error::Store { source, .. } => Error::store(StoreErrorKind::Unavailable, source),
        other => other,
    }
}

/// A store URL its driver cannot read (credentials masked).
fn unparsable(url: &str, e: sqlx::Error) -> Error {
    Error::Config(idem_core::redact_credentials(&format!("--store (store) {url:?}: {e}")))
}

/// A pool of connections to the SQL server at `url`, whose driver errors
/// `store_error` maps. One plain connection comes first, so that a server
/// that cannot be reached fails at once instead of after the pool's acquire
/// timeout (the pool retries refused connections until then).
async fn sql_pool<DB: sqlx::Database>(url: &str, store_error: fn(sqlx::Error) -> Error) -> Result<sqlx::Pool<DB>> {
    let options: <DB::Connection as sqlx::Connection>::Options = url.parse().map_err(|e| unparsable(url, e))?;
    sqlx::ConnectOptions::connect(&options)
        .await
        .map_err(|e| unreachable(store_error(e)))?;
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(32)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(store_error)
}

impl AnyLease {
    /// Connects to `url` (`postgres://`, `mysql://` or `mariadb://`,
    /// `redis://`, `sqlite://PATH` or a plain path, creating a missing
    /// SQLite file), checks a Redis deployment, and migrates: what the
    /// gateway does at start, with the default [`RedisSettings`].
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, &RedisSettings::default()).await
    }

    /// [`connect`](Self::connect) with `redis` settings.
    pub async fn connect_with(url: &str, redis: &RedisSettings) -> Result<Self> {
        let store = Self::create_with(url, redis).await?;
        store.check_deployment(redis).await?;
        store.migrate().await?;
        Ok(store)
    }

    /// Connects to `url` without creating or migrating anything: a SQLite
    /// path where no file is fails with "no such database file" (an
    /// unavailable store), and tables are used as they are.
    pub async fn open(url: &str) -> Result<Self> {
        Self::open_with(url, &RedisSettings::default()).await
    }

    /// [`open`](Self::open) with `redis` settings.
    pub async fn open_with(url: &str, redis: &RedisSettings) -> Result<Self> {
        if let Target::Sqlite(path) = target(url)?
            && !Path::new(path).exists()
        {
            return Err(Error::store(
                StoreErrorKind::Unavailable,
                format!("no such database file: {path}"),
            ));
        }
        Self::connect_to(url, redis, false).await
    }

    /// Like [`open`](Self::open), but where a SQLite path names no file yet,
    /// a private, empty in-memory database stands in for it and nothing is
    /// created: for `idem migrate --dry-run`, which only reads what a
    /// migration would apply.
    pub async fn open_for_dry_run(url: &str, redis: &RedisSettings) -> Result<Self> {
        if let Target::Sqlite(path) = target(url)?
            && !Path::new(path).exists()
        {
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(1)
                .connect("sqlite::memory:")
                .await
                .map_err(idem_sqlite::store_error)?;
            return Ok(AnyLease::Sqlite(idem_sqlite::SqliteStore::new(pool)));
        }
        Self::open_with(url, redis).await
    }

    /// Like [`open`](Self::open), but creates a missing SQLite file (empty:
    /// [`migrate`](Self::migrate) creates the table).
    pub async fn create(url: &str) -> Result<Self> {
        Self::create_with(url, &RedisSettings::default()).await
    }

    /// [`create`](Self::create) with `redis` settings.
    pub async fn create_with(url: &str, redis: &RedisSettings) -> Result<Self> {
        Self::connect_to(url, redis, true).await
    }

    async fn connect_to(url: &str, redis: &RedisSettings, create_sqlite: bool) -> Result<Self> {
        Ok(match target(url)? {
            Target::Postgres => {
                let pool = sql_pool(url, idem_postgres::store_error).await?;
                AnyLease::Postgres(idem_postgres::PgStore::new(pool))
            }
            Target::MySql => {
                let url = url.replacen("mariadb://", "mysql://", 1);
                let pool = sql_pool(&url, idem_mysql::store_error).await?;
                AnyLease::MySql(idem_mysql::MySqlStore::new(pool))
            }
            Target::Redis => {
                let store = idem_redis::RedisStore::connect_any(url)
                    .await?
                    .with_prefix(&redis.prefix)?;
                AnyLease::Redis(match redis.replica_acks {
                    0 => store,
                    n => store.with_replica_acks(n, Duration::from_millis(redis.replica_ack_timeout_ms))?,
                })
            }
            Target::Sqlite(path) => {
                let options = idem_sqlite::SqliteOptions::new().create_if_missing(create_sqlite);
                AnyLease::Sqlite(idem_sqlite::SqliteStore::open_with(path, options).await?)
            }
        })
    }

    /// Checks a Redis deployment before claims are written (see
    /// [`idem_redis::RedisStore::check_deployment`]): an eviction policy is
    /// an [`Error::Config`], missing persistence a logged warning. Nothing
    /// to check on the SQL stores, nor when `redis` says to skip it.
    pub async fn check_deployment(&self, redis: &RedisSettings) -> Result<()> {
        match self {
            AnyLease::Redis(s) if !redis.skip_deployment_checks => s.check_deployment().await.map(drop),
            _ => Ok(()),
        }
    }

    /// Creates or upgrades the keys table (Redis has none).
    pub async fn migrate(&self) -> Result<()> {
        match self {
            AnyLease::Sqlite(s) => s.migrate().await,
            AnyLease::Postgres(s) => s.migrate().await,
            AnyLease::MySql(s) => s.migrate().await,
            AnyLease::Redis(_) => Ok(()),
        }
    }

    /// The schema versions the keys table has not had yet (Redis: none).
    pub async fn pending_migrations(&self) -> Result<Vec<idem_core::PendingMigration>> {
        match self {
            AnyLease::Sqlite(s) => s.pending_migrations().await,
            AnyLease::Postgres(s) => s.pending_migrations().await,
            AnyLease::MySql(s) => s.pending_migrations().await,
            AnyLease::Redis(_) => Ok(Vec::new()),
        }
    }

    /// The same store on another keys table (the inbox, webhook-inbox and
    /// job tables share the keys table's schema). Redis keeps its keys
    /// under a prefix, not in tables: an [`Error::Config`].
    pub fn with_table(self, table: TableName) -> Result<Self> {
        Ok(match self {
            AnyLease::Sqlite(s) => AnyLease::Sqlite(s.with_table(table)),
            AnyLease::Postgres(s) => AnyLease::Postgres(s.with_table(table)),
            AnyLease::MySql(s) => AnyLease::MySql(s.with_table(table)),
            AnyLease::Redis(_) => {
                return Err(Error::Config(
                    "Redis keeps keys under a prefix, not in tables: use --redis-prefix".into(),
                ));
            }
        })
    }

    /// The keys table (Redis: none).
    pub fn table(&self) -> Option<&TableName> {
        match self {
            AnyLease::Sqlite(s) => Some(s.table()),
            AnyLease::Postgres(s) => Some(s.table()),
            AnyLease::MySql(s) => Some(s.table()),
            AnyLease::Redis(_) => None,
        }
    }

    /// Whether `table` exists in the store's database (Redis: never).
    pub async fn table_exists(&self, table: &TableName) -> Result<bool> {
        match self {
            AnyLease::Sqlite(s) => s.table_exists(table).await,
            AnyLease::Postgres(s) => s.table_exists(table).await,
            AnyLease::MySql(s) => s.table_exists(table).await,
            AnyLease::Redis(_) => Ok(false),
        }
    }
}

impl AnyLease {
    /// The store's kind.
    pub fn kind(&self) -> &'static str {
        match self {
            AnyLease::Sqlite(_) => "sqlite",
            AnyLease::Postgres(_) => "postgres",
            AnyLease::MySql(_) => "mysql",
            AnyLease::Redis(_) => "redis",
        }
    }

    /// The outbox lag in `table` (SQL stores; Redis keeps no outbox).
    pub async fn outbox_lag(&self, table: TableName) -> Result<OutboxLag> {
        match self {
            AnyLease::Sqlite(s) => {
                idem_sqlite::SqliteOutbox::with_table(s.pool().clone(), table)
                    .lag()
                    .await
            }
            AnyLease::Postgres(s) => idem_postgres::PgOutbox::with_table(s.pool().clone(), table).lag().await,
            AnyLease::MySql(s) => idem_mysql::MySqlOutbox::with_table(s.pool().clone(), table).lag().await,
            AnyLease::Redis(_) => Err(Error::Config(
                "Redis keeps no outbox: use the service's SQL database".into(),
            )),
        }
    }
}

impl KeyAdmin for AnyLease {
    fn stats(&self, now_ms: i64) -> BoxFuture<'_, Result<KeyStats>> {
        each!(self, s => KeyAdmin::stats(s, now_ms))
    }

    fn list_keys<'a>(&'a self, filter: &'a KeyFilter, now_ms: i64, limit: u32) -> BoxFuture<'a, Result<Vec<KeyInfo>>> {
        each!(self, s => KeyAdmin::list_keys(s, filter, now_ms, limit))
    }

    fn find_key<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<Option<KeyInfo>>> {
        each!(self, s => KeyAdmin::find_key(s, scope, key, now_ms))
    }

    fn purge_keys<'a>(&'a self, filter: &'a KeyFilter, now_ms: i64, limit: u32) -> BoxFuture<'a, Result<u64>> {
        each!(self, s => KeyAdmin::purge_keys(s, filter, now_ms, limit))
    }
}

impl Sweep for AnyLease {
    fn sweep_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        each!(self, s => s.sweep_expired(now_ms, limit))
    }

    fn sweep_batch(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<SweepBatch>> {
        each!(self, s => s.sweep_batch(now_ms, limit))
    }
}

impl LeaseStore for AnyLease {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        each!(self, s => s.try_claim(req))
    }

    fn mark_sent<'a>(&'a self, lease: &'a Lease, now_ms: i64) -> BoxFuture<'a, Result<()>> {
        each!(self, s => s.mark_sent(lease, now_ms))
    }

    fn lookup<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<StoredRow>>> {
        each!(self, s => s.lookup(scope, key))
    }

    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> BoxFuture<'a, Result<()>> {
        each!(self, s => s.complete(lease, record))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<()>> {
        each!(self, s => s.release(lease))
    }

    fn extend<'a>(&'a self, lease: &'a Lease, lease_expires_at_ms: i64) -> BoxFuture<'a, Result<()>> {
        each!(self, s => s.extend(lease, lease_expires_at_ms))
    }

    fn resolve_unknown<'a>(&'a self, req: &'a Resolution<'a>) -> BoxFuture<'a, Result<bool>> {
        each!(self, s => s.resolve_unknown(req))
    }
}

impl TimeSource for AnyLease {
    fn source_now_ms(&self) -> BoxFuture<'_, Result<i64>> {
        each!(self, s => s.source_now_ms())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// URLs that can never work are refused before anything is opened,
    /// naming the setting, with the URL's credentials masked; usable ones
    /// pass.
    #[test]
    fn unusable_urls_are_refused() {
        for url in [
            "",
            "   ",
            "sqlite://",
            "sqlite:",
            "sqlite::memory:",
            ":memory:",
            "sqlite://:memory:",
            "file::memory:?cache=shared",
            "sqlite://x.db?mode=memory",
            "ftp://u:pw@example.com/x",
        ] {
            let e = target(url).err().unwrap_or_else(|| panic!("{url:?} was accepted"));
            let text = e.to_string();
            assert!(matches!(e, Error::Config(_)), "{url:?}: {text}");
            assert!(text.contains("--store"), "{url:?}: {text}");
            assert!(!text.contains("pw@"), "{url:?}: {text}");
        }
        for url in [
            "./idem-gateway.db",
            "sqlite://./x.db",
            "sqlite:x.db",
            "postgres://h/db",
            "redis://h",
            "redis+sentinel://s1:26379,s2:26379/main",
            "rediss+sentinel://s1/main/2",
        ] {
            assert!(target(url).is_ok(), "{url:?}");
        }
    }
}
