//! The lease store the gateway runs on, chosen by URL.

use std::time::Duration;

use idem_core::{
    BoxFuture, ClaimRequest, Error, KeyStats, Lease, LeaseClaim, LeaseStore, OutboxLag, OutboxStore, Record, Result,
    Sweep, TableName, TimeSource,
};

/// One of the lease stores, chosen by URL.
#[derive(Clone, Debug)]
pub enum AnyLease {
    /// A SQLite file (one host).
    Sqlite(idem_sqlite::SqliteStore),
    /// PostgreSQL.
    Postgres(idem_postgres::PgStore),
    /// MySQL or MariaDB.
    MySql(idem_mysql::MySqlStore),
    /// Redis.
    Redis(idem_redis::RedisStore),
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

impl AnyLease {
    /// Connects to `url` (`postgres://`, `mysql://` or `mariadb://`,
    /// `redis://`, `sqlite://PATH` or a plain path) and migrates it.
    pub async fn connect(url: &str) -> Result<Self> {
        let store = Self::open(url).await?;
        store.migrate().await?;
        Ok(store)
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

    /// Connects to `url` without migrating anything.
    pub async fn open(url: &str) -> Result<Self> {
        let store = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(32)
                .acquire_timeout(Duration::from_secs(10))
                .connect(url)
                .await
                .map_err(idem_postgres::store_error)?;
            AnyLease::Postgres(idem_postgres::PgStore::new(pool))
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            let url = url.replacen("mariadb://", "mysql://", 1);
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(32)
                .acquire_timeout(Duration::from_secs(10))
                .connect(&url)
                .await
                .map_err(idem_mysql::store_error)?;
            AnyLease::MySql(idem_mysql::MySqlStore::new(pool))
        } else if url.starts_with("redis://") || url.starts_with("rediss://") {
            AnyLease::Redis(idem_redis::RedisStore::connect(url).await?)
        } else if let Some(path) = url
            .strip_prefix("sqlite://")
            .or(url.strip_prefix("sqlite:"))
            .or_else(|| (!url.contains("://")).then_some(url))
        {
            AnyLease::Sqlite(idem_sqlite::SqliteStore::open(path).await?)
        } else {
            return Err(Error::Config(format!(
                "unsupported store URL {url:?}: use a SQLite path, postgres://, mysql:// or redis://"
            )));
        };
        Ok(store)
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

    /// Keys by state at `now_ms`.
    pub async fn stats(&self, now_ms: i64) -> Result<KeyStats> {
        each!(self, s => s.stats(now_ms).await)
    }

    /// Keys matching `filter`, oldest first, at most `limit`.
    pub async fn list_keys(
        &self,
        filter: &idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<idem_core::KeyInfo>> {
        each!(self, s => s.list_keys(filter, now_ms, limit).await)
    }

    /// Deletes at most `limit` keys matching `filter`.
    pub async fn purge_keys(&self, filter: &idem_core::KeyFilter, now_ms: i64, limit: u32) -> Result<u64> {
        each!(self, s => s.purge_keys(filter, now_ms, limit).await)
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

impl Sweep for AnyLease {
    fn sweep_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        each!(self, s => s.sweep_expired(now_ms, limit))
    }
}

impl LeaseStore for AnyLease {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        each!(self, s => s.try_claim(req))
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
}

impl TimeSource for AnyLease {
    fn source_now_ms(&self) -> BoxFuture<'_, Result<i64>> {
        each!(self, s => s.source_now_ms())
    }
}
