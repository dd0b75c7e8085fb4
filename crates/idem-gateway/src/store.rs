//! The lease store the gateway runs on, chosen by URL.

use std::time::Duration;

use idem_core::{BoxFuture, ClaimRequest, Error, Lease, LeaseClaim, LeaseStore, Record, Result, TimeSource};

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
        let store = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(32)
                .acquire_timeout(Duration::from_secs(10))
                .connect(url)
                .await
                .map_err(idem_postgres::store_error)?;
            let store = idem_postgres::PgStore::new(pool);
            store.migrate().await?;
            AnyLease::Postgres(store)
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            let url = url.replacen("mariadb://", "mysql://", 1);
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(32)
                .acquire_timeout(Duration::from_secs(10))
                .connect(&url)
                .await
                .map_err(idem_mysql::store_error)?;
            let store = idem_mysql::MySqlStore::new(pool);
            store.migrate().await?;
            AnyLease::MySql(store)
        } else if url.starts_with("redis://") || url.starts_with("rediss://") {
            AnyLease::Redis(idem_redis::RedisStore::connect(url).await?)
        } else if let Some(path) = url
            .strip_prefix("sqlite://")
            .or(url.strip_prefix("sqlite:"))
            .or_else(|| (!url.contains("://")).then_some(url))
        {
            let store = idem_sqlite::SqliteStore::open(path).await?;
            store.migrate().await?;
            AnyLease::Sqlite(store)
        } else {
            return Err(Error::Config(format!(
                "unsupported store URL {url:?}: use a SQLite path, postgres://, mysql:// or redis://"
            )));
        };
        Ok(store)
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
