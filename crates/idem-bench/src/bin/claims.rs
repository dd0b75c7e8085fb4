//! The claim strategies of the PostgreSQL store, or of the MySQL/MariaDB
//! store, side by side, counted by the cost meter in one run: round trips,
//! rows written, log records and bytes (PostgreSQL's WAL, InnoDB's redo
//! log), and CPU per request of the bare transaction and of a fresh call (and
//! a replay) under each strategy.
//!
//! Run: `cargo run --release -p idem-bench --bin claims -- --ops 300`, or
//! `… -- --engine mysql --ops 300` for MariaDB/MySQL.

use clap::Parser;
use idem_bench::cost::{Cost, show};
use idem_bench::{engines, meter};
use idem_core::BoxError;

/// Counts what one request costs under each claim strategy of one engine.
#[derive(Debug, Parser)]
#[command(name = "claims")]
struct Args {
    /// The engine: `postgres` or `mysql` (MariaDB or MySQL).
    #[arg(long, default_value = "postgres", value_parser = ["postgres", "mysql"])]
    engine: String,
    /// The servers.
    #[command(flatten)]
    urls: idem_bench::engines::EngineUrls,
    /// Requests counted per path and strategy (one connection, one after another).
    #[arg(long, default_value_t = 300)]
    ops: u64,
    /// The workload: `micro` (one business insert) or `transfer`.
    #[arg(long, default_value = "micro", value_parser = ["micro", "transfer"])]
    workload: String,
    /// The strategies, in the order they run (by default every strategy of
    /// the engine: `insert-on-conflict,advisory-lock,one-write` on
    /// PostgreSQL, `placeholder,named-lock` on MySQL/MariaDB).
    #[arg(long, value_delimiter = ',')]
    strategies: Vec<String>,
    /// The keys table's expiry index for the strategies' runs (PostgreSQL):
    /// `btree`, `brin` or `none`; several run one after another (the bare
    /// path is measured again in each).
    #[arg(long, value_delimiter = ',', default_value = "btree")]
    expiry_indexes: Vec<String>,
    /// Where to write every figure as JSON.
    #[arg(long, default_value = "target/bench-claims.json")]
    out: std::path::PathBuf,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = Args::parse();
    if args.strategies.is_empty() {
        args.strategies = match args.engine.as_str() {
            "mysql" => engines::MYSQL_CLAIM_STRATEGIES
                .map(|(name, _)| name.to_owned())
                .to_vec(),
            _ => engines::CLAIM_STRATEGIES.map(|(name, _)| name.to_owned()).to_vec(),
        };
    }
    let workloads = [args.workload.clone()];
    let mut rows: Vec<(String, Cost)> = Vec::new();
    if args.engine == "mysql" {
        for name in &args.strategies {
            let strategy = engines::mysql_claim_strategy(name)?;
            for cost in meter::mysql(&args.urls.mysql_url, strategy, &workloads, args.ops).await? {
                rows.push((name.clone(), cost));
            }
        }
        print_table(&rows, "redo records", "redo bytes");
        return write_json(&args, &rows);
    }
    for index_name in &args.expiry_indexes {
        let index = engines::expiry_index(index_name)?;
        for name in &args.strategies {
            let strategy = engines::claim_strategy(name)?;
            let label = if args.expiry_indexes.len() > 1 {
                format!("{name}, {index_name} expiry index")
            } else {
                name.clone()
            };
            for cost in meter::postgres_with(&args.urls.postgres_url, strategy, index, &workloads, args.ops).await? {
                rows.push((label.clone(), cost));
            }
        }
    }
    // The suite's table keeps the default index afterwards.
    engines::postgres(&args.urls.postgres_url, 1).await?.migrate().await?;
    print_table(&rows, "WAL records", "WAL bytes");
    write_json(&args, &rows)
}

/// Prints the figures as a Markdown table, the log columns named
/// `records` and `bytes`.
fn print_table(rows: &[(String, Cost)], records: &str, bytes: &str) {
    println!();
    println!("| path | round trips | rows written | {records} | {bytes} | server CPU µs | client CPU µs |");
    println!("|---|---|---|---|---|---|---|");
    let line = |label: &str, c: &Cost| {
        println!(
            "| {label} | {} | {} | {} | {} | {} | {} |",
            show(c.round_trips),
            show(c.rows_written),
            show(c.log_records),
            show(c.log_bytes.map(f64::round)),
            show(c.server_cpu_us),
            show(c.client_cpu_us),
        );
    };
    for (i, (name, cost)) in rows.iter().enumerate() {
        let first_bare = rows.iter().position(|(_, c)| c.path == "bare") == Some(i);
        match cost.path.as_str() {
            "bare" if first_bare => line("bare (the workload's own transaction, no idem)", cost),
            "bare" => line(&format!("bare (again, with {name})"), cost),
            "fresh" | "replay" => line(&format!("{} ({name})", cost.path), cost),
            _ => {}
        }
    }
}

/// Writes every figure as JSON to `args.out`.
fn write_json(args: &Args, rows: &[(String, Cost)]) -> Result<(), BoxError> {
    let json = serde_json::json!({
        "engine": args.engine,
        "ops": args.ops,
        "workload": args.workload,
        "costs": rows.iter().map(|(s, c)| serde_json::json!({"strategy": s, "cost": c})).collect::<Vec<_>>(),
    });
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_vec_pretty(&json)?)?;
    println!("\nfigures: {}", args.out.display());
    Ok(())
}
