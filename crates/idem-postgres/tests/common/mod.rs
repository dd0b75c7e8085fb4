//! Connecting the tests to PostgreSQL.

use std::time::{SystemTime, UNIX_EPOCH};

use idem_core::TableName;
use idem_postgres::ClaimStrategy;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Row};

/// The variable naming the test database.
pub(crate) const URL_VAR: &str = "IDEM_TEST_POSTGRES_URL";

/// The test database's URL.
pub(crate) fn database_url() -> String {
    idem_conformance::env::postgres_url()
}

/// Opens a small pool of its own; sqlx pools cannot be shared across the runtimes of `#[tokio::test]`s.
pub(crate) async fn open_pool(url: &str) -> PgPool {
    open_pool_at(url, Isolation::ReadCommitted).await
}

/// A default transaction isolation level, set on every connection of a pool
/// as a team would set it for its database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)]
pub(crate) enum Isolation {
    /// PostgreSQL's default.
    ReadCommitted,
    /// Snapshot isolation.
    RepeatableRead,
    /// Serialisable snapshot isolation.
    Serializable,
    /// Whatever the database's default is (nothing set on the session).
    DatabaseDefault,
}

impl Isolation {
    /// The SQL name of the level.
    pub(crate) fn sql(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE READ",
            Isolation::Serializable | Isolation::DatabaseDefault => "SERIALIZABLE",
        }
    }
}

/// Opens a small pool whose connections default to `isolation`
/// (`SET SESSION CHARACTERISTICS`, as `ALTER DATABASE … SET
/// default_transaction_isolation` would).
pub(crate) async fn open_pool_at(url: &str, isolation: Isolation) -> PgPool {
    let options: PgConnectOptions = url
        .parse()
        .unwrap_or_else(|e| panic!("{URL_VAR}={url} is not a PostgreSQL URL: {e}"));
    // One direct connection first, so an unreachable server fails at once with
    // a clear message instead of after the pool's acquire timeout.
    if let Err(e) = options.connect().await {
        panic!("PostgreSQL is unreachable at {url} ({e}); start it or point {URL_VAR} at a reachable database");
    }
    let set = match isolation {
        Isolation::DatabaseDefault => "SELECT 1".to_owned(),
        level => format!(
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {}",
            level.sql()
        ),
    };
    PgPoolOptions::new()
        .max_connections(8)
        .after_connect(move |conn, _meta| {
            let set = set.clone();
            Box::pin(async move {
                sqlx::Executor::execute(&mut *conn, AssertSqlSafe(set)).await?;
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("cannot open a pool on {url} (set by {URL_VAR}): {e}"))
}

/// The URL of a database of the tests' own whose default isolation is
/// SERIALIZABLE (`ALTER DATABASE … SET default_transaction_isolation`),
/// created on the server of [`database_url`] if missing; concurrent
/// creators tolerate each other.
#[allow(dead_code)]
pub(crate) async fn serializable_database_url() -> String {
    const DATABASE: &str = "idem_rt_serializable";
    let url = database_url();
    let admin = open_pool(&url).await;
    let mut conn = admin.acquire().await.expect("a connection");
    // Concurrent test processes take turns (CREATE DATABASE runs outside a
    // transaction, so the lock is the session's).
    let lock = "SELECT pg_advisory_lock(hashtextextended('idem_rt_serializable', 0))";
    sqlx::query(lock).execute(&mut *conn).await.expect("lock");
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(DATABASE)
        .fetch_one(&mut *conn)
        .await
        .expect("look the database up");
    if !exists {
        for sql in [
            format!("CREATE DATABASE {DATABASE}"),
            format!("ALTER DATABASE {DATABASE} SET default_transaction_isolation = 'serializable'"),
        ] {
            sqlx::query(AssertSqlSafe(sql.clone()))
                .execute(&mut *conn)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
    }
    sqlx::query("SELECT pg_advisory_unlock(hashtextextended('idem_rt_serializable', 0))")
        .execute(&mut *conn)
        .await
        .expect("unlock");
    let options: PgConnectOptions = url.parse().expect("a PostgreSQL URL");
    options.database(DATABASE).to_url_lossy().to_string()
}

/// Milliseconds since the epoch.
fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as i64
}

/// Isolated tables are named `idem_iso_<created ms>_<random>`, so old ones can be recognised and dropped.
const ISOLATED_PREFIX: &str = "idem_iso_";

/// Isolated tables older than this are left over from earlier runs.
const ISOLATED_MAX_AGE_MS: i64 = 3_600_000;

/// A fresh, unused keys table name (the caller migrates it). Tables that
/// earlier runs left behind are dropped first, so the test database does not
/// grow without bound.
pub(crate) async fn isolated_table(pool: &PgPool) -> TableName {
    let names: Vec<String> = sqlx::query("SELECT tablename FROM pg_tables WHERE tablename LIKE 'idem\\_iso\\_%'")
        .fetch_all(pool)
        .await
        .expect("list isolated tables")
        .iter()
        .map(|row| row.get(0))
        .collect();
    let cutoff = unix_ms() - ISOLATED_MAX_AGE_MS;
    for name in names {
        let created = name
            .strip_prefix(ISOLATED_PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|ms| ms.parse::<i64>().ok());
        if created.is_some_and(|ms| ms < cutoff) && TableName::new(name.as_str()).is_ok() {
            // Another test process may drop the same table at the same moment; that is fine.
            let _ = sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {name}")))
                .execute(pool)
                .await;
        }
    }
    let name = format!("{ISOLATED_PREFIX}{}_{}", unix_ms(), uuid::Uuid::new_v4().simple());
    TableName::new(name).expect("a valid table name")
}

/// The session's `lock_timeout` on `conn`, as `SHOW` gives it.
#[allow(dead_code)]
pub(crate) async fn show_lock_timeout<'c>(conn: impl sqlx::PgExecutor<'c>) -> String {
    sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(conn)
        .await
        .expect("SHOW lock_timeout")
}

/// Every claim strategy, for the tests that hold under each.
#[allow(dead_code)]
pub(crate) const STRATEGIES: [ClaimStrategy; 3] = [
    ClaimStrategy::InsertOnConflict,
    ClaimStrategy::AdvisoryLock,
    ClaimStrategy::OneWrite,
];
