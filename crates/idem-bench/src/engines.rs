//! What the suite needs of each engine's store, and the store of each engine.

use idem_core::multistep::MultiStepStore;
use idem_core::{BoxError, BoxFuture, LeaseStore, TableName};
use ledger::db::{DbError, LedgerDb};
use sqlx::{AssertSqlSafe, Executor};

/// The servers a benchmark runs on (`--postgres-url`, `--mysql-url`, or
/// `IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL`, as the tests read them).
#[derive(Debug, Clone, clap::Args)]
pub struct EngineUrls {
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "IDEM_TEST_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pub postgres_url: String,
    /// MySQL/MariaDB URL.
    #[arg(
        long,
        env = "IDEM_TEST_MYSQL_URL",
        default_value = "mysql://root@127.0.0.1:3306/test"
    )]
    pub mysql_url: String,
}

/// The table of the suite's idempotency keys (emptied before each engine runs).
pub const KEYS_TABLE: &str = "idem_bench_keys";

/// The table of the suite's multi-step operations (emptied before each
/// engine runs).
pub const OPERATIONS_TABLE: &str = "idem_bench_operations";

/// The events namespace of the ledger the suite serves over HTTP: its outbox
/// rows (subjects `idem_bench.…`) are the suite's to delete.
pub const EVENTS_NAMESPACE: &str = "idem_bench";

/// The tenants whose ledger rows the suite owns and deletes before it runs.
pub fn bench_tenants() -> [String; 2] {
    [
        crate::transfer::TENANT.to_owned(),
        ledger::tenant_for_token(crate::http::TOKEN).as_str().to_owned(),
    ]
}

/// A store the suite can measure: the ledger's statements, both idem modes,
/// multi-step operations, and the micro-benchmark's single insert.
pub trait BenchDb: LedgerDb + LeaseStore + Clone {
    /// The engine's store of multi-step operations.
    type Operations: MultiStepStore<Self>;
    /// The suite's multi-step operations ([`OPERATIONS_TABLE`]), on this
    /// store's pool.
    fn operations(&self) -> Self::Operations;
    /// Migrates the ledger's and the suite's tables and empties what the
    /// suite wrote before.
    fn prepare(&self) -> BoxFuture<'_, Result<(), BoxError>>;
    /// Deletes every row the suite wrote: its keys, effects, ledger rows and
    /// the events its ledger enqueued (which no relay of the suite ever
    /// sends, and which would otherwise wait in the shared outbox).
    fn clean_up(&self) -> BoxFuture<'_, Result<(), BoxError>>;
    /// The micro-benchmark's business write: one insert.
    fn insert<'c>(tx: &'c mut Self::Tx, id: String) -> BoxFuture<'c, Result<(), DbError>>;
    /// The server's version.
    fn server_version(&self) -> BoxFuture<'_, Result<String, BoxError>>;
    /// The ledger service's view of this store.
    fn ledger_store(&self) -> ledger::Store;
}

macro_rules! bench_db {
    ($store:ty, $multisteps:ty, $variant:ident, $create:literal, $insert:literal, $version:literal) => {
        impl BenchDb for $store {
            type Operations = $multisteps;

            fn operations(&self) -> $multisteps {
                <$multisteps>::with_table(self.pool().clone(), operations_table())
            }

            fn prepare(&self) -> BoxFuture<'_, Result<(), BoxError>> {
                Box::pin(async move {
                    LedgerDb::migrate(self).await?;
                    self.operations().migrate().await?;
                    self.pool().execute($create).await?;
                    self.clean_up().await
                })
            }

            fn clean_up(&self) -> BoxFuture<'_, Result<(), BoxError>> {
                Box::pin(async move {
                    self.pool().execute("DELETE FROM bench_effects").await?;
                    self.pool()
                        .execute(AssertSqlSafe(format!(
                            "DELETE FROM {} WHERE subject LIKE '{EVENTS_NAMESPACE}.%'",
                            ledger::db::OUTBOX_TABLE
                        )))
                        .await?;
                    self.pool()
                        .execute(AssertSqlSafe(format!("DELETE FROM {KEYS_TABLE}")))
                        .await?;
                    self.pool()
                        .execute(AssertSqlSafe(format!("DELETE FROM {OPERATIONS_TABLE}")))
                        .await?;
                    let tenants = bench_tenants().map(|t| format!("'{t}'")).join(", ");
                    for table in ["ledger_entries", "ledger_journal", "ledger_accounts"] {
                        self.pool()
                            .execute(AssertSqlSafe(format!(
                                "DELETE FROM {table} WHERE tenant IN ({tenants})"
                            )))
                            .await?;
                    }
                    Ok(())
                })
            }

            fn insert<'c>(
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                id: String,
            ) -> BoxFuture<'c, Result<(), DbError>> {
                Box::pin(async move {
                    sqlx::query($insert)
                        .bind(id)
                        .bind("payload")
                        .execute(&mut **tx)
                        .await?;
                    Ok(())
                })
            }

            fn server_version(&self) -> BoxFuture<'_, Result<String, BoxError>> {
                Box::pin(async move {
                    let (version,): (String,) = sqlx::query_as($version).fetch_one(self.pool()).await?;
                    Ok(version)
                })
            }

            fn ledger_store(&self) -> ledger::Store {
                ledger::Store::$variant(self.clone())
            }
        }
    };
}

bench_db!(
    idem_postgres::PgStore,
    idem_postgres::PgMultiSteps,
    Postgres,
    "CREATE TABLE IF NOT EXISTS bench_effects (id VARCHAR(64) PRIMARY KEY, payload VARCHAR(200) NOT NULL)",
    "INSERT INTO bench_effects (id, payload) VALUES ($1, $2)",
    "SHOW server_version"
);
bench_db!(
    idem_mysql::MySqlStore,
    idem_mysql::MySqlMultiSteps,
    MySql,
    "CREATE TABLE IF NOT EXISTS bench_effects (id VARCHAR(64) PRIMARY KEY, payload VARCHAR(200) NOT NULL) ENGINE=InnoDB",
    "INSERT INTO bench_effects (id, payload) VALUES (?, ?)",
    "SELECT VERSION()"
);
bench_db!(
    idem_sqlite::SqliteStore,
    idem_sqlite::SqliteMultiSteps,
    Sqlite,
    "CREATE TABLE IF NOT EXISTS bench_effects (id TEXT PRIMARY KEY, payload TEXT NOT NULL)",
    "INSERT INTO bench_effects (id, payload) VALUES (?, ?)",
    "SELECT sqlite_version()"
);

/// The suite's keys table.
pub fn keys_table() -> TableName {
    TableName::new(KEYS_TABLE).expect("a valid table name")
}

/// The suite's table of multi-step operations.
pub fn operations_table() -> TableName {
    TableName::new(OPERATIONS_TABLE).expect("a valid table name")
}

/// A pool of `connections` on the server at `url` (`engine`, as a failure
/// names it).
pub async fn pool<DB: sqlx::Database>(url: &str, connections: u32, engine: &str) -> Result<sqlx::Pool<DB>, BoxError> {
    sqlx::pool::PoolOptions::new()
        .max_connections(connections)
        .connect(url)
        .await
        .map_err(|e| format!("{engine} at {url}: {e}").into())
}

/// Connects to PostgreSQL with a pool of `connections`.
pub async fn postgres(url: &str, connections: u32) -> Result<idem_postgres::PgStore, BoxError> {
    let pool = pool(url, connections, "postgres").await?;
    Ok(idem_postgres::PgStore::new(pool).with_table(keys_table()))
}

/// The PostgreSQL claim strategies, by the names the benchmarks take.
pub const CLAIM_STRATEGIES: [(&str, idem_postgres::ClaimStrategy); 3] = [
    ("insert-on-conflict", idem_postgres::ClaimStrategy::InsertOnConflict),
    ("advisory-lock", idem_postgres::ClaimStrategy::AdvisoryLock),
    ("one-write", idem_postgres::ClaimStrategy::OneWrite),
];

/// The PostgreSQL expiry indexes, by the names the benchmarks take.
pub const EXPIRY_INDEXES: [(&str, idem_postgres::ExpiryIndex); 3] = [
    ("btree", idem_postgres::ExpiryIndex::BTree),
    ("brin", idem_postgres::ExpiryIndex::Brin),
    ("none", idem_postgres::ExpiryIndex::None),
];

/// The MySQL/MariaDB claim strategies, by the names the benchmarks take.
pub const MYSQL_CLAIM_STRATEGIES: [(&str, idem_mysql::ClaimStrategy); 2] = [
    ("placeholder", idem_mysql::ClaimStrategy::Placeholder),
    ("named-lock", idem_mysql::ClaimStrategy::NamedLock),
];

/// The PostgreSQL claim strategy named `name`.
pub fn claim_strategy(name: &str) -> Result<idem_postgres::ClaimStrategy, BoxError> {
    named("claim strategy", name, &CLAIM_STRATEGIES)
}

/// The PostgreSQL expiry index named `name`.
pub fn expiry_index(name: &str) -> Result<idem_postgres::ExpiryIndex, BoxError> {
    named("expiry index", name, &EXPIRY_INDEXES)
}

/// The MySQL/MariaDB claim strategy named `name`.
pub fn mysql_claim_strategy(name: &str) -> Result<idem_mysql::ClaimStrategy, BoxError> {
    named("MySQL claim strategy", name, &MYSQL_CLAIM_STRATEGIES)
}

/// The choice named `name` among `choices`; an unknown name is refused
/// with the names there are (`what` says what is chosen).
fn named<T: Copy>(what: &str, name: &str, choices: &[(&str, T)]) -> Result<T, BoxError> {
    match choices.iter().find(|(n, _)| *n == name) {
        Some(&(_, choice)) => Ok(choice),
        None => {
            let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
            Err(format!("unknown {what} {name:?} ({})", names.join(", ")).into())
        }
    }
}

/// Connects to MySQL/MariaDB with a pool of `connections`.
pub async fn mysql(url: &str, connections: u32) -> Result<idem_mysql::MySqlStore, BoxError> {
    let pool = pool(url, connections, "mysql").await?;
    Ok(idem_mysql::MySqlStore::new(pool).with_table(keys_table()))
}

/// A SQLite file that is deleted (with its WAL and lock files) on drop.
#[derive(Debug)]
pub struct SqliteFile {
    path: std::path::PathBuf,
}

impl SqliteFile {
    /// A new file name in the temporary directory.
    pub fn new() -> Self {
        let name = format!("idem-bench-{}-{}.db", std::process::id(), uuid::Uuid::now_v7());
        Self {
            path: std::env::temp_dir().join(name),
        }
    }

    /// Opens the store on it.
    pub async fn open(&self) -> Result<idem_sqlite::SqliteStore, BoxError> {
        Ok(idem_sqlite::SqliteStore::open(&self.path)
            .await?
            .with_table(keys_table()))
    }

    /// Opens the store on it with at most `connections` connections.
    pub async fn open_with_connections(&self, connections: u32) -> Result<idem_sqlite::SqliteStore, BoxError> {
        let options = idem_sqlite::SqliteOptions::new().max_connections(connections);
        Ok(idem_sqlite::SqliteStore::open_with(&self.path, options)
            .await?
            .with_table(keys_table()))
    }
}

impl Default for SqliteFile {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for SqliteFile {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-idem.lock"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.path.display()));
        }
    }
}
