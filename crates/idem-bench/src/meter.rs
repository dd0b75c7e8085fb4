//! The cost meter's probes, one per engine, and its pass over the suite's
//! transactional paths (see [`crate::cost`] for what each figure counts).

use std::time::Duration;

use idem_core::BoxError;

use crate::cost::{self, Cost, Probe, Sample};
use crate::engines::{self, BenchDb, KEYS_TABLE, OPERATIONS_TABLE};
use crate::micro::Insert;
use crate::steps::{StepsPaths, Vendor};
use crate::transfer::{TENANT, Transfer, fund_accounts};
use crate::txpaths::TxPaths;
use crate::wire::{Wire, server_of, via};

/// The paths the meter counts, in this order (a replay replays the keys of
/// the fresh path before it).
pub const PATHS: [&str; 6] = ["bare", "fresh", "replay", "fresh+read", "replay+read", "three-commit"];

/// Accounts the metered transfers move money among.
const ACCOUNTS: usize = 100;

/// The tables the suite writes (rows written are counted on these).
fn suite_tables() -> Vec<String> {
    [
        KEYS_TABLE,
        OPERATIONS_TABLE,
        "bench_effects",
        "ledger_accounts",
        "ledger_journal",
        "ledger_entries",
        ledger::db::OUTBOX_TABLE,
    ]
    .map(str::to_owned)
    .to_vec()
}

/// PostgreSQL: the measured connection's backend, the suite's tables,
/// the cluster's WAL.
pub struct PgProbe {
    measured: sqlx::PgPool,
    observer: sqlx::PgPool,
    backend: u32,
}

impl Probe for PgProbe {
    fn scope(&self) -> &'static str {
        "log: cluster; server CPU: backend"
    }

    async fn sample(&self) -> Result<Sample, BoxError> {
        // The backend's pending table and WAL counters reach the shared
        // statistics when it next goes idle.
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&self.measured)
            .await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let server_cpu_ns = std::fs::read_to_string(format!("/proc/{}/schedstat", self.backend))
            .ok()
            .as_deref()
            .and_then(cost::parse_schedstat);
        let (rows, records, bytes): (i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables \
             WHERE relname = ANY($1) AND schemaname = current_schema())::bigint, \
             wal_records::bigint, wal_bytes::bigint FROM pg_stat_wal",
        )
        .bind(suite_tables())
        .fetch_one(&self.observer)
        .await?;
        Ok(Sample {
            rows: Some(rows as u64),
            log_records: Some(records as u64),
            log_bytes: Some(bytes as u64),
            server_cpu_ns,
            ..Sample::default()
        })
    }
}

/// MariaDB/MySQL: the measured session's handler counters, the server's
/// redo log and CPU.
pub struct MySqlProbe {
    measured: sqlx::MySqlPool,
    observer: sqlx::MySqlPool,
    server: Option<u32>,
}

impl Probe for MySqlProbe {
    fn scope(&self) -> &'static str {
        "log: server; server CPU: server"
    }

    async fn sample(&self) -> Result<Sample, BoxError> {
        let session: Vec<(String, String)> = sqlx::query_as("SHOW SESSION STATUS LIKE 'Handler\\_%'")
            .fetch_all(&self.measured)
            .await?;
        let global: Vec<(String, String)> = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_os_log_written'")
            .fetch_all(&self.observer)
            .await?;
        Ok(Sample {
            rows: cost::sum_status(&session, &["Handler_write", "Handler_update", "Handler_delete"]),
            log_bytes: cost::sum_status(&global, &["Innodb_os_log_written"]),
            server_cpu_ns: self.server.and_then(|pid| cost::process_cpu_ns(&pid.to_string(), None)),
            ..Sample::default()
        })
    }
}

/// SQLite: the connection's changed rows (the engine runs in the client).
pub struct SqliteProbe {
    measured: sqlx::SqlitePool,
}

impl Probe for SqliteProbe {
    fn scope(&self) -> &'static str {
        "in-process"
    }

    async fn sample(&self) -> Result<Sample, BoxError> {
        let (changes,): (i64,) = sqlx::query_as("SELECT total_changes()")
            .fetch_one(&self.measured)
            .await?;
        Ok(Sample {
            rows: Some(changes as u64),
            ..Sample::default()
        })
    }
}

/// Meters `workloads` (micro, transfer, steps) on `db`, whose only connection
/// `probe` reads and `wire` (if any) carries; `admin`, another store on the
/// same tables, prepares and cleans up.
async fn meter_store<D: BenchDb, R: Probe>(
    engine: &str,
    admin: D,
    db: D,
    probe: &R,
    wire: Option<&Wire>,
    workloads: &[String],
    ops: u64,
) -> Result<Vec<Cost>, BoxError> {
    admin.prepare().await?;
    let mut out = Vec::new();
    if workloads.iter().any(|w| w == "micro") {
        let bench = TxPaths::new(&db, "POST /bench/insert", Insert::<D>::new())?;
        out.extend(cost::measure(&bench, probe, wire, engine, "micro", &PATHS, ops).await?);
    }
    if workloads.iter().any(|w| w == "transfer") {
        let accounts = fund_accounts(&admin, TENANT, ACCOUNTS).await?;
        let bench = TxPaths::new(&db, "POST /bench/transfer", Transfer::new(accounts))?;
        out.extend(cost::measure(&bench, probe, wire, engine, "transfer", &PATHS, ops).await?);
    }
    if workloads.iter().any(|w| w == "steps") {
        let bench = StepsPaths::new(&db, std::sync::Arc::new(Vendor::new()))?;
        let paths = crate::steps::PATHS;
        out.extend(cost::measure(&bench, probe, wire, engine, "steps", &paths, ops).await?);
        // Each path's operations, the one before the count included.
        let expected = paths.len() as u64 * (ops + 1);
        let vendor = bench.vendor();
        if vendor.sends() != expected || vendor.payouts() != expected {
            return Err(format!(
                "steps: {} sends and {} payouts for {expected} operations",
                vendor.sends(),
                vendor.payouts()
            )
            .into());
        }
    }
    admin.clean_up().await?;
    Ok(out)
}

/// Meters PostgreSQL at `url` with the store's claim `strategy`.
pub async fn postgres(
    url: &str,
    strategy: idem_postgres::ClaimStrategy,
    workloads: &[String],
    ops: u64,
) -> Result<Vec<Cost>, BoxError> {
    postgres_with(url, strategy, idem_postgres::ExpiryIndex::default(), workloads, ops).await
}

/// Meters PostgreSQL at `url` with the store's claim `strategy`, the keys
/// table migrated to `expiry_index`.
pub async fn postgres_with(
    url: &str,
    strategy: idem_postgres::ClaimStrategy,
    expiry_index: idem_postgres::ExpiryIndex,
    workloads: &[String],
    ops: u64,
) -> Result<Vec<Cost>, BoxError> {
    let wire = Wire::start(server_of(url, 5432)?)?;
    let db = engines::postgres(&via(url, wire.addr())?, 1)
        .await?
        .with_claim_strategy(strategy);
    let observer = engines::pool(url, 1, "postgres").await?;
    let measured = db.pool().clone();
    let (backend,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()").fetch_one(&measured).await?;
    let probe = PgProbe {
        measured,
        observer,
        backend: backend as u32,
    };
    let admin = engines::postgres(url, 2).await?.with_expiry_index(expiry_index);
    meter_store("postgres", admin, db, &probe, Some(&wire), workloads, ops).await
}

/// Meters MariaDB/MySQL at `url` with the store's claim `strategy`.
pub async fn mysql(
    url: &str,
    strategy: idem_mysql::ClaimStrategy,
    workloads: &[String],
    ops: u64,
) -> Result<Vec<Cost>, BoxError> {
    let wire = Wire::start(server_of(url, 3306)?)?;
    let db = engines::mysql(&via(url, wire.addr())?, 1)
        .await?
        .with_claim_strategy(strategy);
    let observer = engines::pool(url, 1, "mysql").await?;
    let probe = MySqlProbe {
        measured: db.pool().clone(),
        observer,
        server: cost::pid_named(&["mariadbd", "mysqld"]),
    };
    let admin = engines::mysql(url, 2).await?;
    meter_store("mysql", admin, db, &probe, Some(&wire), workloads, ops).await
}

/// Meters SQLite on a temporary file.
pub async fn sqlite(workloads: &[String], ops: u64) -> Result<Vec<Cost>, BoxError> {
    let file = engines::SqliteFile::new();
    let db = file.open_with_connections(1).await?;
    let probe = SqliteProbe {
        measured: db.pool().clone(),
    };
    meter_store("sqlite", file.open().await?, db, &probe, None, workloads, ops).await
}
