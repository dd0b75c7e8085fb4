//! The run's fresh database: creating, reading back, killing sessions, dropping.
//!
//! On MariaDB the database may live on several nodes of one Galera cluster
//! (`Config::mysql_nodes`): it is created on the first node, and the run
//! goes on once every node has it. Each node keeps an administrator's pool
//! of its own (the process list and `KILL` are local to a node), and every
//! read of the checks runs with `wsrep_sync_wait = 1`, so it first waits
//! until its node has applied every write set the cluster had committed.

use std::time::Duration;

use sqlx::mysql::MySqlPoolOptions;
use sqlx::{AssertSqlSafe, Row};

use crate::{Config, Error};

/// The engine under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Engine {
    /// A SQLite file.
    Sqlite,
    /// PostgreSQL.
    Postgres,
    /// MySQL/MariaDB.
    Mysql,
}

impl Engine {
    /// The engine's name.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Sqlite => "sqlite",
            Engine::Postgres => "postgres",
            Engine::Mysql => "mysql",
        }
    }
}

impl std::str::FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sqlite" => Ok(Engine::Sqlite),
            "postgres" | "postgresql" => Ok(Engine::Postgres),
            "mysql" | "mariadb" => Ok(Engine::Mysql),
            other => Err(format!("unknown engine {other:?} (sqlite, postgres or mysql)")),
        }
    }
}

#[derive(Clone)]
enum Admin {
    Postgres(sqlx::PgPool),
    /// One pool per server: the one server, or each node of a cluster.
    Mysql(Vec<sqlx::MySqlPool>),
    Sqlite(std::path::PathBuf),
}

/// A database made for one run.
#[derive(Clone)]
pub(crate) struct Database {
    /// The URL the ledger uses (on the first node of a cluster).
    pub(crate) url: String,
    /// The database's URL on each node: `url` alone, unless it lives on
    /// several nodes of a MariaDB Galera cluster.
    pub(crate) urls: Vec<String>,
    name: String,
    admin: Admin,
}

/// How long the nodes of a cluster may take to show a database created on
/// the first one.
const REPLICATED_WITHIN: Duration = Duration::from_secs(30);

/// A pool on one node of a Galera cluster whose connections run
/// `wsrep_sync_wait = 1`: a read first waits until the node has applied
/// every write set the cluster had committed when the read began, so it
/// sees every write acknowledged on any node. Connections are given up on
/// after a few seconds, so a dead node fails fast.
fn causal(max_connections: u32) -> MySqlPoolOptions {
    MySqlPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .after_connect(|conn, _meta| {
            Box::pin(async move {
                sqlx::Executor::execute(&mut *conn, "SET SESSION wsrep_sync_wait = 1").await?;
                Ok(())
            })
        })
}

/// Drops a run's database, even with sessions still connected (PostgreSQL).
/// `name` is always `chaos_<digits>_<digits>_<digits>`, made by `Database::create`.
fn drop_statement(engine: Engine, name: &str) -> String {
    match engine {
        Engine::Postgres => format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        Engine::Mysql | Engine::Sqlite => format!("DROP DATABASE IF EXISTS {name}"),
    }
}

/// An administrator's pool on the server at `server_url`, and the database
/// `name` on it created afresh (dropped first if a run left one).
async fn fresh<DB>(engine: Engine, server_url: &str, name: &str) -> Result<sqlx::Pool<DB>, Error>
where
    DB: sqlx::Database,
    <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let admin = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(2)
        .connect(server_url)
        .await?;
    for statement in [drop_statement(engine, name), format!("CREATE DATABASE {name}")] {
        sqlx::query(AssertSqlSafe(statement)).execute(&admin).await?;
    }
    Ok(admin)
}

fn with_database(server_url: &str, name: &str) -> String {
    let (scheme, rest) = server_url.split_once("://").unwrap_or(("", server_url));
    let authority = rest.split('/').next().unwrap_or(rest);
    format!("{scheme}://{authority}/{name}")
}

/// Rows read back for the checks.
pub(crate) struct Stored {
    pub(crate) accounts: Vec<(String, i64)>,
    pub(crate) entries: Vec<(String, i64)>,
    pub(crate) journal: Vec<(String, i64)>,
    pub(crate) in_progress: i64,
}

/// Runs the function's own macro `$read!(pool, text)` on a fresh pool of
/// the run's engine, with the engine's `text` (`$pg`, `$my` or `$lite`:
/// a placeholder, a column's cast).
/// Every row `$p` reads on `$pool`, which is closed after.
macro_rules! all_rows {
    ($pool:expr, $p:literal) => {{
        let pool = $pool;
        let rows = sqlx::query_as($p).fetch_all(&pool).await?;
        pool.close().await;
        rows
    }};
}

macro_rules! on_pool {
    ($db:expr, $read:ident, $pg:literal, $my:literal, $lite:literal) => {
        match &$db.admin {
            Admin::Postgres(_) => $read!(sqlx::PgPool::connect(&$db.url).await?, $pg),
            Admin::Mysql(_) => $read!($db.mysql_reader().await?, $my),
            Admin::Sqlite(path) => $read!(
                sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display())).await?,
                $lite
            ),
        }
    };
}

impl Database {
    pub(crate) async fn create(config: &Config) -> Result<Self, Error> {
        // The run's number in this process too: runs of one test binary
        // with one seed (`CHAOS_SEED`) on one engine never share a database.
        static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("chaos_{}_{}_{run}", config.seed % 1_000_000_007, std::process::id());
        Ok(match config.engine {
            Engine::Postgres => {
                let url = with_database(&config.postgres_url, &name);
                Database {
                    urls: vec![url.clone()],
                    url,
                    admin: Admin::Postgres(fresh(Engine::Postgres, &config.postgres_url, &name).await?),
                    name,
                }
            }
            Engine::Mysql if config.mysql_nodes.len() > 1 => {
                let nodes = &config.mysql_nodes;
                let mut admins = Vec::with_capacity(nodes.len());
                for node in nodes {
                    admins.push(causal(2).connect(node).await?);
                }
                for statement in [drop_statement(Engine::Mysql, &name), format!("CREATE DATABASE {name}")] {
                    sqlx::query(AssertSqlSafe(statement)).execute(&admins[0]).await?;
                }
                let urls: Vec<String> = nodes.iter().map(|n| with_database(n, &name)).collect();
                let database = Database {
                    url: urls[0].clone(),
                    urls,
                    admin: Admin::Mysql(admins),
                    name,
                };
                database.wait_replicated().await?;
                database
            }
            Engine::Mysql => {
                let server = config.mysql_nodes.first().unwrap_or(&config.mysql_url);
                let url = with_database(server, &name);
                Database {
                    urls: vec![url.clone()],
                    url,
                    admin: Admin::Mysql(vec![fresh(Engine::Mysql, server, &name).await?]),
                    name,
                }
            }
            Engine::Sqlite => {
                let path = std::env::temp_dir().join(format!("{name}.db"));
                for suffix in ["", "-wal", "-shm", "-idem.lock"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
                }
                let url = path.display().to_string();
                Database {
                    urls: vec![url.clone()],
                    url,
                    name,
                    admin: Admin::Sqlite(path),
                }
            }
        })
    }

    /// How many nodes the database lives on (1 unless a cluster's).
    pub(crate) fn nodes(&self) -> usize {
        self.urls.len()
    }

    /// Waits until every node of the cluster shows the run's database.
    async fn wait_replicated(&self) -> Result<(), Error> {
        let Admin::Mysql(admins) = &self.admin else {
            return Ok(());
        };
        let deadline = tokio::time::Instant::now() + REPLICATED_WITHIN;
        for (node, admin) in admins.iter().enumerate().skip(1) {
            loop {
                let (n,): (i64,) =
                    sqlx::query_as("SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?")
                        .bind(&self.name)
                        .fetch_one(admin)
                        .await?;
                if n == 1 {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(Error::Service(format!(
                        "the database {} did not reach node {node} within {REPLICATED_WITHIN:?}",
                        self.name
                    )));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// Waits until node `node` has applied every write set the cluster had
    /// committed (nothing to wait for on a single server): a process started
    /// on it next sees what the processes before it wrote, on any node.
    pub(crate) async fn caught_up(&self, node: usize) -> Result<(), Error> {
        if let Admin::Mysql(admins) = &self.admin
            && admins.len() > 1
        {
            sqlx::query("SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?")
                .bind(&self.name)
                .execute(&admins[node % admins.len()])
                .await?;
        }
        Ok(())
    }

    /// A pool for the checks' reads on MariaDB: on the one server, or on the
    /// first node of a cluster that answers, every connection running
    /// `wsrep_sync_wait = 1` (see [`causal`]).
    async fn mysql_reader(&self) -> Result<sqlx::MySqlPool, Error> {
        if self.urls.len() == 1 {
            return Ok(sqlx::MySqlPool::connect(&self.url).await?);
        }
        let mut failure = None;
        for url in &self.urls {
            match causal(4).connect(url).await {
                Ok(pool) => return Ok(pool),
                Err(e) => failure = Some(e),
            }
        }
        Err(failure.map_or_else(|| Error::Service("no node to read from".into()), Error::from))
    }

    /// Kills up to two of the service's database sessions; answers how many.
    pub(crate) async fn kill_sessions(&self) -> Result<u64, Error> {
        self.kill_sessions_on(0).await
    }

    /// Kills up to two of the database's sessions on node `node` (modulo the
    /// nodes; the one server unless a cluster's); answers how many.
    pub(crate) async fn kill_sessions_on(&self, node: usize) -> Result<u64, Error> {
        match &self.admin {
            Admin::Postgres(admin) => {
                let row = sqlx::query(
                    "SELECT COUNT(*) FILTER (WHERE pg_terminate_backend(pid)) FROM \
                     (SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid() \
                      ORDER BY random() LIMIT 2) s",
                )
                .bind(&self.name)
                .fetch_one(admin)
                .await?;
                Ok(row.get::<i64, _>(0) as u64)
            }
            Admin::Mysql(admins) => {
                let admin = &admins[node % admins.len()];
                let ids: Vec<(i64,)> = sqlx::query_as(
                    "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = ? AND ID <> CONNECTION_ID() \
                     ORDER BY RAND() LIMIT 2",
                )
                .bind(&self.name)
                .fetch_all(admin)
                .await?;
                let mut killed = 0;
                for (id,) in ids {
                    if sqlx::query(AssertSqlSafe(format!("KILL CONNECTION {id}")))
                        .execute(admin)
                        .await
                        .is_ok()
                    {
                        killed += 1;
                    }
                }
                Ok(killed)
            }
            Admin::Sqlite(_) => Ok(0),
        }
    }

    /// Reads back the tenant's rows and the claims left in progress.
    pub(crate) async fn stored(&self, tenant: &str) -> Result<Stored, Error> {
        macro_rules! read {
            ($pool:expr, $p:literal) => {{
                let pool = $pool;
                let accounts = sqlx::query_as(concat!(
                    "SELECT id, balance FROM ledger_accounts WHERE tenant = ",
                    $p
                ))
                .bind(tenant)
                .fetch_all(&pool)
                .await?;
                let entries = sqlx::query_as(concat!(
                    "SELECT account_id, delta FROM ledger_entries WHERE tenant = ",
                    $p
                ))
                .bind(tenant)
                .fetch_all(&pool)
                .await?;
                let journal = sqlx::query_as(concat!(
                    "SELECT kind, amount FROM ledger_journal WHERE tenant = ",
                    $p
                ))
                .bind(tenant)
                .fetch_all(&pool)
                .await?;
                let (in_progress,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM idem_keys WHERE status = 0")
                    .fetch_one(&pool)
                    .await?;
                pool.close().await;
                Stored {
                    accounts,
                    entries,
                    journal,
                    in_progress,
                }
            }};
        }
        Ok(on_pool!(self, read, "$1", "?", "?"))
    }

    /// Reads back the tenant's payouts: per id, the amount and the state.
    pub(crate) async fn payouts(
        &self,
        tenant: &str,
    ) -> Result<std::collections::BTreeMap<String, (i64, String)>, Error> {
        macro_rules! read {
            ($pool:expr, $p:literal) => {{
                let pool = $pool;
                let rows: Vec<(String, i64, String)> = sqlx::query_as(concat!(
                    "SELECT id, amount, state FROM ledger_payouts WHERE tenant = ",
                    $p
                ))
                .bind(tenant)
                .fetch_all(&pool)
                .await?;
                pool.close().await;
                rows.into_iter()
                    .map(|(id, amount, state)| (id, (amount, state)))
                    .collect()
            }};
        }
        Ok(on_pool!(self, read, "$1", "?", "?"))
    }

    /// The multi-step operations by state.
    pub(crate) async fn operation_states(&self) -> Result<std::collections::BTreeMap<String, u64>, Error> {
        macro_rules! read {
            ($pool:expr, $p:literal) => {{
                let pool = $pool;
                let rows: Vec<(String, i64)> = sqlx::query_as($p).fetch_all(&pool).await?;
                pool.close().await;
                rows.into_iter().map(|(s, n)| (s, n as u64)).collect()
            }};
        }
        // MariaDB keeps the state as bytes.
        Ok(on_pool!(
            self,
            read,
            "SELECT state, COUNT(*) FROM idem_operations GROUP BY state",
            "SELECT CAST(state AS CHAR), COUNT(*) FROM idem_operations GROUP BY state",
            "SELECT state, COUNT(*) FROM idem_operations GROUP BY state"
        ))
    }

    /// The multi-step operations: per key, the state.
    pub(crate) async fn operations(&self) -> Result<Vec<(String, String)>, Error> {
        Ok(on_pool!(
            self,
            all_rows,
            "SELECT idem_key, state FROM idem_operations",
            "SELECT CAST(idem_key AS CHAR), CAST(state AS CHAR) FROM idem_operations",
            "SELECT idem_key, state FROM idem_operations"
        ))
    }

    /// The held multi-step operations: id and key.
    pub(crate) async fn held_operations(&self) -> Result<Vec<(i64, String)>, Error> {
        Ok(on_pool!(
            self,
            all_rows,
            "SELECT id, idem_key FROM idem_operations WHERE state = 'held' ORDER BY id",
            "SELECT id, CAST(idem_key AS CHAR) FROM idem_operations WHERE state = 'held' ORDER BY id",
            "SELECT id, idem_key FROM idem_operations WHERE state = 'held' ORDER BY id"
        ))
    }

    /// The withdrawals: id, destination, state.
    pub(crate) async fn withdrawals(&self) -> Result<Vec<(String, String, String)>, Error> {
        macro_rules! read {
            ($pool:expr, $p:literal) => {{
                let pool = $pool;
                let rows = sqlx::query_as("SELECT id, destination, state FROM ledger_withdrawals ORDER BY id")
                    .fetch_all(&pool)
                    .await?;
                pool.close().await;
                rows
            }};
        }
        Ok(on_pool!(self, read, "$1", "?", "?"))
    }

    /// The id of the withdrawal to `destination`, if one was debited.
    pub(crate) async fn withdrawal_of(&self, destination: &str) -> Result<Option<String>, Error> {
        Ok(self
            .withdrawals()
            .await?
            .into_iter()
            .find(|(_, d, _)| d == destination)
            .map(|(id, _, _)| id))
    }

    /// The journal rows of withdrawals and their credit-backs: id, kind.
    pub(crate) async fn withdrawal_journal(&self) -> Result<Vec<(String, String)>, Error> {
        macro_rules! read {
            ($pool:expr, $p:literal) => {{
                let pool = $pool;
                let rows = sqlx::query_as(
                    "SELECT id, kind FROM ledger_journal WHERE kind IN ('withdrawal', 'withdrawal_reversal')",
                )
                .fetch_all(&pool)
                .await?;
                pool.close().await;
                rows
            }};
        }
        Ok(on_pool!(self, read, "$1", "?", "?"))
    }

    /// Reads back the events: the outbox, the projection's applications,
    /// and each account's balance beside its statement.
    pub(crate) async fn events(&self) -> Result<crate::events::EventState, Error> {
        macro_rules! read {
            ($pool:expr, $id:literal) => {{
                let pool = $pool;
                let outbox: Vec<(String,)> = sqlx::query_as(concat!("SELECT ", $id, " FROM ledger_outbox"))
                    .fetch_all(&pool)
                    .await?;
                let (unsent,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM ledger_outbox WHERE sent_at_ms IS NULL")
                    .fetch_one(&pool)
                    .await?;
                let applied: Vec<(String, i64)> =
                    sqlx::query_as("SELECT event_id, COUNT(*) FROM ledger_projection_log GROUP BY event_id")
                        .fetch_all(&pool)
                        .await?;
                let balances: Vec<(String, String, i64, Option<i64>)> = sqlx::query_as(
                    "SELECT a.tenant, a.id, a.balance, s.credits - s.debits FROM ledger_accounts a \
                     LEFT JOIN ledger_statements s ON s.tenant = a.tenant AND s.account_id = a.id",
                )
                .fetch_all(&pool)
                .await?;
                pool.close().await;
                crate::events::EventState {
                    outbox: outbox.into_iter().map(|(id,)| id).collect(),
                    unsent,
                    applied: applied.into_iter().map(|(id, n)| (id, n as u64)).collect(),
                    balances: balances
                        .into_iter()
                        .map(|(tenant, id, balance, statement)| (format!("{tenant}/{id}"), (balance, statement)))
                        .collect(),
                }
            }};
        }
        Ok(on_pool!(self, read, "event_id", "CAST(event_id AS CHAR)", "event_id"))
    }

    pub(crate) async fn drop_database(&self) {
        match &self.admin {
            Admin::Postgres(admin) => {
                let _ = sqlx::query(AssertSqlSafe(drop_statement(Engine::Postgres, &self.name)))
                    .execute(admin)
                    .await;
            }
            Admin::Mysql(admins) => {
                let _ = sqlx::query(AssertSqlSafe(drop_statement(Engine::Mysql, &self.name)))
                    .execute(&admins[0])
                    .await;
            }
            Admin::Sqlite(path) => {
                for suffix in ["", "-wal", "-shm", "-idem.lock"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
                }
            }
        }
    }
}
