//! Benchmark program (not a test): per engine, in one run, measures
//!
//! - **bare**: `BEGIN; INSERT` one business row`; COMMIT` — no idem;
//! - **fresh**: the same insert through idem's transactional path with a new
//!   key each time (claim + insert + record + commit);
//! - **replay**: the same calls again with keys already used (claim finds the
//!   record; the insert never runs);
//!
//! at 1 and 16 concurrent workers, and prints ops/s, p50 and p99 latency and
//! the ratios fresh/bare and replay/fresh. Figures go to a JSON file too.
//!
//! Run: `cargo run --release -p idem-bench -- --seconds 5`
//! (engines from `IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL`, and a
//! temporary SQLite file).

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use idem_core::{
    BoxError, BoxFuture, Call, Fingerprint, IdempotencyKey, InFlight, Outcome, Policy, Scope, TableName, TxBackend,
    TxEngine,
};
use sqlx::Executor;

#[derive(Debug, Parser)]
#[command(about = "idem transactional-path benchmark")]
struct Args {
    /// Seconds each scenario runs (after a short warm-up).
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Engines to measure.
    #[arg(long, value_delimiter = ',', default_value = "postgres,mysql,sqlite")]
    engines: Vec<String>,
    /// Worker counts.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    workers: Vec<usize>,
    /// Where to write the figures.
    #[arg(long, default_value = "target/bench-results.json")]
    out: String,
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "IDEM_TEST_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    postgres_url: String,
    /// MySQL/MariaDB URL.
    #[arg(
        long,
        env = "IDEM_TEST_MYSQL_URL",
        default_value = "mysql://root@127.0.0.1:3306/test"
    )]
    mysql_url: String,
}

/// What an engine must provide to be measured.
trait BenchDb: TxBackend + Clone {
    fn reset(&self) -> BoxFuture<'_, Result<(), BoxError>>;
    fn bare(&self, id: String) -> BoxFuture<'_, Result<(), BoxError>>;
    fn insert<'c>(tx: &'c mut Self::Tx, id: String) -> BoxFuture<'c, Result<(), BoxError>>;
}

const BENCH_TABLE: &str = "idem_bench_keys";

macro_rules! bench_db {
    ($store:ty, $db:ty, $create:literal, $truncate_keys:literal, $insert:literal) => {
        impl BenchDb for $store {
            fn reset(&self) -> BoxFuture<'_, Result<(), BoxError>> {
                Box::pin(async move {
                    self.migrate().await?;
                    self.pool().execute($create).await?;
                    self.pool().execute("DELETE FROM bench_effects").await?;
                    self.pool().execute($truncate_keys).await?;
                    Ok(())
                })
            }
            fn bare(&self, id: String) -> BoxFuture<'_, Result<(), BoxError>> {
                Box::pin(async move {
                    let mut tx = TxBackend::begin(self).await?;
                    sqlx::query($insert)
                        .bind(id)
                        .bind("payload")
                        .execute(&mut *tx)
                        .await?;
                    TxBackend::commit(self, tx).await?;
                    Ok(())
                })
            }
            fn insert<'c>(
                tx: &'c mut sqlx::Transaction<'static, $db>,
                id: String,
            ) -> BoxFuture<'c, Result<(), BoxError>> {
                Box::pin(async move {
                    sqlx::query($insert)
                        .bind(id)
                        .bind("payload")
                        .execute(&mut **tx)
                        .await?;
                    Ok(())
                })
            }
        }
    };
}

bench_db!(
    idem_postgres::PgStore,
    sqlx::Postgres,
    "CREATE TABLE IF NOT EXISTS bench_effects (id VARCHAR(64) PRIMARY KEY, payload VARCHAR(200) NOT NULL)",
    "DELETE FROM idem_bench_keys",
    "INSERT INTO bench_effects (id, payload) VALUES ($1, $2)"
);
bench_db!(
    idem_mysql::MySqlStore,
    sqlx::MySql,
    "CREATE TABLE IF NOT EXISTS bench_effects (id VARCHAR(64) PRIMARY KEY, payload VARCHAR(200) NOT NULL) ENGINE=InnoDB",
    "DELETE FROM idem_bench_keys",
    "INSERT INTO bench_effects (id, payload) VALUES (?, ?)"
);
bench_db!(
    idem_sqlite::SqliteStore,
    sqlx::Sqlite,
    "CREATE TABLE IF NOT EXISTS bench_effects (id TEXT PRIMARY KEY, payload TEXT NOT NULL)",
    "DELETE FROM idem_bench_keys",
    "INSERT INTO bench_effects (id, payload) VALUES (?, ?)"
);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Bare,
    Fresh,
    Replay,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Bare => "bare",
            Scenario::Fresh => "fresh",
            Scenario::Replay => "replay",
        }
    }
}

struct Figures {
    ops: usize,
    ops_per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
}

fn call(scope: &Scope, key: IdempotencyKey) -> Call {
    let fp = Fingerprint::of_bytes(scope.operation(), b"bench");
    Call::new(scope.clone(), key, fp).with_policy(Policy::default().with_in_flight(InFlight::Wait { max_ms: 30_000 }))
}

async fn one<D: BenchDb>(
    db: &D,
    engine: &TxEngine<D>,
    scenario: Scenario,
    scope: &Scope,
    used: &[IdempotencyKey],
    i: usize,
) -> Result<Option<IdempotencyKey>, BoxError> {
    match scenario {
        Scenario::Bare => {
            db.bare(uuid::Uuid::now_v7().to_string()).await?;
            Ok(None)
        }
        Scenario::Fresh => {
            let key = IdempotencyKey::generate();
            let id = uuid::Uuid::now_v7().to_string();
            let out = engine
                .execute(&call(scope, key.clone()), move |tx| {
                    let id = id.clone();
                    Box::pin(async move { D::insert(tx, id).await.map(|()| 1u8) })
                })
                .await
                .map_err(|e: BoxError| e)?;
            if out.is_replayed() {
                return Err("a fresh key replayed".into());
            }
            Ok(Some(key))
        }
        Scenario::Replay => {
            let key = used[i % used.len()].clone();
            let out = engine
                .execute(&call(scope, key), |_tx| {
                    Box::pin(async { Err::<u8, BoxError>("a used key executed".into()) })
                })
                .await?;
            match out {
                Outcome::Replayed(_) => Ok(None),
                Outcome::Executed(_) => Err("a used key executed".into()),
            }
        }
    }
}

async fn measure<D: BenchDb>(
    db: &D,
    scenario: Scenario,
    workers: usize,
    seconds: u64,
    used: Arc<Vec<IdempotencyKey>>,
) -> Result<(Figures, Vec<IdempotencyKey>), BoxError> {
    let engine = Arc::new(TxEngine::new(db.clone()));
    let scope = Scope::parse("bench-tenant", "POST /bench")?;
    let warmup = Duration::from_millis(500);
    let run = Duration::from_secs(seconds);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (db, engine, scope, used) = (db.clone(), engine.clone(), scope.clone(), used.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut keys = Vec::new();
            let mut i = w * 7919;
            loop {
                let t0 = Instant::now();
                if t0.duration_since(start) >= warmup + run {
                    break;
                }
                let key = one(&db, &engine, scenario, &scope, &used, i).await?;
                i += 1;
                if t0.duration_since(start) >= warmup {
                    latencies.push(t0.elapsed());
                    keys.extend(key);
                }
            }
            Ok::<_, BoxError>((latencies, keys))
        }));
    }
    let mut latencies = Vec::new();
    let mut keys = Vec::new();
    for t in tasks {
        let (l, k) = t.await??;
        latencies.extend(l);
        keys.extend(k);
    }
    latencies.sort();
    let pct = |p: f64| {
        if latencies.is_empty() {
            return 0.0;
        }
        let idx = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len()) - 1;
        latencies[idx].as_secs_f64() * 1000.0
    };
    let figures = Figures {
        ops: latencies.len(),
        ops_per_sec: latencies.len() as f64 / run.as_secs_f64(),
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
    };
    Ok((figures, keys))
}

async fn bench_engine<D: BenchDb>(
    name: &str,
    db: D,
    args: &Args,
    report: &mut Vec<serde_json::Value>,
) -> Result<(), BoxError> {
    db.reset().await?;
    println!("\n== {name} ==");
    println!(
        "{:>8} {:>7} {:>10} {:>10} {:>9} {:>9}",
        "workers", "path", "ops", "ops/s", "p50 ms", "p99 ms"
    );
    for &workers in &args.workers {
        let mut row = serde_json::json!({"engine": name, "workers": workers});
        let mut rates = std::collections::HashMap::new();
        let mut used = Arc::new(Vec::new());
        for scenario in [Scenario::Bare, Scenario::Fresh, Scenario::Replay] {
            let (f, keys) = measure(&db, scenario, workers, args.seconds, used.clone()).await?;
            if scenario == Scenario::Fresh {
                used = Arc::new(keys);
            }
            println!(
                "{:>8} {:>7} {:>10} {:>10.0} {:>9.2} {:>9.2}",
                workers,
                scenario.name(),
                f.ops,
                f.ops_per_sec,
                f.p50_ms,
                f.p99_ms
            );
            row[scenario.name()] = serde_json::json!({
                "ops": f.ops, "ops_per_sec": f.ops_per_sec, "p50_ms": f.p50_ms, "p99_ms": f.p99_ms
            });
            rates.insert(scenario.name(), f.ops_per_sec);
        }
        let fresh_over_bare = rates["fresh"] / rates["bare"];
        let replay_over_fresh = rates["replay"] / rates["fresh"];
        println!(
            "{:>8} ratios: idem/bare = {:.3}   replay/fresh = {:.3}",
            workers, fresh_over_bare, replay_over_fresh
        );
        row["idem_over_bare"] = fresh_over_bare.into();
        row["replay_over_fresh"] = replay_over_fresh.into();
        report.push(row);
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let table = TableName::new(BENCH_TABLE)?;
    let pool_size = args.workers.iter().copied().max().unwrap_or(1) as u32 + 4;
    let mut report = Vec::new();
    for engine in &args.engines {
        match engine.as_str() {
            "postgres" => {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(pool_size)
                    .connect(&args.postgres_url)
                    .await?;
                bench_engine(
                    "postgres",
                    idem_postgres::PgStore::new(pool).with_table(table.clone()),
                    &args,
                    &mut report,
                )
                .await?;
            }
            "mysql" => {
                let pool = sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(pool_size)
                    .connect(&args.mysql_url)
                    .await?;
                bench_engine(
                    "mysql",
                    idem_mysql::MySqlStore::new(pool).with_table(table.clone()),
                    &args,
                    &mut report,
                )
                .await?;
            }
            "sqlite" => {
                let path = std::env::temp_dir().join(format!("idem-bench-{}.db", std::process::id()));
                let store = idem_sqlite::SqliteStore::open(&path).await?.with_table(table.clone());
                bench_engine("sqlite", store, &args, &mut report).await?;
                for suffix in ["", "-wal", "-shm", "-idem.lock"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
                }
            }
            other => return Err(format!("unknown engine {other:?}").into()),
        }
    }
    let json = serde_json::json!({"seconds_per_scenario": args.seconds, "results": report});
    if let Some(dir) = std::path::Path::new(&args.out).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_vec_pretty(&json)?)?;
    println!("\nfigures written to {}", args.out);
    Ok(())
}
