//! The suite's multi-step workload on every engine: on both paths (one
//! operation of two steps; two single-step calls) each withdrawal writes
//! its debit once and is paid once, with sixteen workers at once, and the
//! cost meter's counts per operation are whole and plausible.
//!
//! Needs PostgreSQL and MariaDB (`IDEM_TEST_POSTGRES_URL`,
//! `IDEM_TEST_MYSQL_URL`, defaults `postgres://postgres@127.0.0.1:5432/test`
//! and `mysql://root@127.0.0.1:3306/test`); SQLite runs on a temporary file.
//! The engine's tests share the suite's tables, so each engine runs in one
//! test.

use std::sync::Arc;

use idem_bench::cost::Cost;
use idem_bench::engines::{self, BenchDb, KEYS_TABLE, OPERATIONS_TABLE};
use idem_bench::measure::Paths;
use idem_bench::steps::{PATHS, StepsPaths, Vendor};
use idem_conformance::env::{mysql_url, postgres_url};

/// Concurrent workers, and the withdrawals each makes per path.
const WORKERS: usize = 16;
const EACH: u64 = 8;
/// Operations the cost meter counts per path.
const METERED: u64 = 20;

/// Runs `EACH` withdrawals on `path` in each of `WORKERS` tasks at once.
async fn withdraw<D: BenchDb>(bench: &Arc<StepsPaths<D>>, path: &'static str) {
    let tasks: Vec<_> = (0..WORKERS)
        .map(|worker| {
            let bench = bench.clone();
            tokio::spawn(async move {
                for n in 0..EACH {
                    bench.one(path, worker, n, &[]).await.expect(path);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("a worker");
    }
}

/// What the suite's tables hold: business rows, keys, completed operations.
#[derive(Debug, PartialEq, Eq)]
struct Rows {
    effects: i64,
    keys: i64,
    completed: i64,
}

macro_rules! count_rows {
    ($pool:expr) => {{
        let pool = $pool;
        let count = |sql: String| async move {
            let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.unwrap();
            n
        };
        Rows {
            effects: count("SELECT COUNT(*) FROM bench_effects".into()).await,
            keys: count(format!("SELECT COUNT(*) FROM {KEYS_TABLE}")).await,
            completed: count(format!(
                "SELECT COUNT(*) FROM {OPERATIONS_TABLE} WHERE state = 'completed'"
            ))
            .await,
        }
    }};
}

/// Both paths with `WORKERS` at once on `db`: each withdrawal is paid once
/// and debited once; a two-step one leaves one completed operation and no
/// key, a two-call one two keys (the debit's and the payout's) and no
/// operation. Answers the rows after each path.
async fn both_paths<D: BenchDb>(db: &D, rows: impl AsyncFn() -> Rows) -> [Rows; 2] {
    db.prepare().await.expect("prepare");
    assert_eq!(
        rows().await,
        Rows {
            effects: 0,
            keys: 0,
            completed: 0
        }
    );
    let vendor = Arc::new(Vendor::new());
    let bench = Arc::new(StepsPaths::new(db, vendor.clone()).unwrap());
    let ops = (WORKERS as u64 * EACH) as i64;
    withdraw(&bench, "two-step").await;
    let after_steps = rows().await;
    assert_eq!((vendor.sends(), vendor.payouts()), (ops as u64, ops as u64));
    withdraw(&bench, "two-calls").await;
    let after_calls = rows().await;
    assert_eq!((vendor.sends(), vendor.payouts()), (2 * ops as u64, 2 * ops as u64));
    db.clean_up().await.expect("clean up");
    [after_steps, after_calls]
}

fn expected() -> [Rows; 2] {
    let ops = (WORKERS as u64 * EACH) as i64;
    [
        Rows {
            effects: ops,
            keys: 0,
            completed: ops,
        },
        Rows {
            effects: 2 * ops,
            keys: 2 * ops,
            completed: ops,
        },
    ]
}

/// The meter's figures for both paths: rows written per operation a whole
/// number (every operation writes the same rows), at least the debit and
/// one of idem's; round trips (where counted) whole too, but for the few a
/// pooled connection's return ping shares with the next request at the
/// proxy (each of those shows as 1/`METERED` less).
fn check_costs(engine: &str, costs: &[Cost], round_trips: bool) {
    assert_eq!(costs.len(), PATHS.len(), "{costs:?}");
    for (cost, path) in costs.iter().zip(PATHS) {
        assert_eq!((cost.engine.as_str(), cost.workload.as_str()), (engine, "steps"));
        assert_eq!((cost.path.as_str(), cost.ops), (path, METERED), "{cost:?}");
        let rows = cost.rows_written.expect("rows are counted on every engine");
        assert!((2.0..=12.0).contains(&rows), "{cost:?}");
        assert_eq!(rows, rows.round(), "rows written vary: {cost:?}");
        match cost.round_trips {
            Some(trips) if round_trips => {
                assert!((6.0..=40.0).contains(&trips), "{cost:?}");
                assert!((trips - trips.round()).abs() <= 0.15, "round trips vary: {cost:?}");
            }
            None if !round_trips => {}
            other => panic!("round trips {other:?} on {engine}"),
        }
        // Read (its value is the process's, which this test shares with
        // the others running beside it).
        assert!(cost.client_cpu_us.is_some(), "{cost:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_pays_each_withdrawal_once_and_is_metered() {
    let url = postgres_url();
    let costs = idem_bench::meter::postgres(
        &url,
        idem_postgres::ClaimStrategy::InsertOnConflict,
        &["steps".into()],
        METERED,
    )
    .await
    .expect("the meter");
    check_costs("postgres", &costs, true);
    let db = engines::postgres(&url, WORKERS as u32 + 4).await.unwrap();
    let pool = db.pool().clone();
    let rows = async || count_rows!(&pool);
    assert_eq!(both_paths(&db, rows).await, expected());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_pays_each_withdrawal_once_and_is_metered() {
    let url = mysql_url();
    let costs = idem_bench::meter::mysql(&url, idem_mysql::ClaimStrategy::Placeholder, &["steps".into()], METERED)
        .await
        .expect("the meter");
    check_costs("mysql", &costs, true);
    let db = engines::mysql(&url, WORKERS as u32 + 4).await.unwrap();
    let pool = db.pool().clone();
    let rows = async || count_rows!(&pool);
    assert_eq!(both_paths(&db, rows).await, expected());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_pays_each_withdrawal_once_and_is_metered() {
    let costs = idem_bench::meter::sqlite(&["steps".into()], METERED)
        .await
        .expect("the meter");
    check_costs("sqlite", &costs, false);
    let file = engines::SqliteFile::new();
    let db = file.open().await.unwrap();
    let pool = db.pool().clone();
    let rows = async || count_rows!(&pool);
    assert_eq!(both_paths(&db, rows).await, expected());
}
