//! The PostgreSQL claim strategies side by side, counted by the cost meter
//! in one run: round trips, rows written, WAL records and bytes, and CPU per
//! request of the bare transaction and of a fresh call (and a replay) under
//! each strategy.
//!
//! Run: `cargo run --release -p idem-bench --bin claims -- --ops 300`

use clap::Parser;
use idem_bench::cost::{Cost, show};
use idem_bench::{engines, meter};
use idem_core::BoxError;

/// Counts what one request costs under each PostgreSQL claim strategy.
#[derive(Debug, Parser)]
#[command(name = "claims")]
struct Args {
    /// The PostgreSQL server (its `test` database).
    #[arg(
        long,
        env = "IDEM_BENCH_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    postgres_url: String,
    /// Requests counted per path and strategy (one connection, one after another).
    #[arg(long, default_value_t = 300)]
    ops: u64,
    /// The workload: `micro` (one business insert) or `transfer`.
    #[arg(long, default_value = "micro", value_parser = ["micro", "transfer"])]
    workload: String,
    /// The strategies, in the order they run.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "insert-on-conflict,advisory-lock,one-write"
    )]
    strategies: Vec<String>,
    /// The keys table's expiry index for the strategies' runs: `btree`,
    /// `brin` or `none`; several run one after another (the bare path is
    /// measured again in each).
    #[arg(long, value_delimiter = ',', default_value = "btree")]
    expiry_indexes: Vec<String>,
    /// Where to write every figure as JSON.
    #[arg(long, default_value = "target/bench-claims.json")]
    out: std::path::PathBuf,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let workloads = [args.workload.clone()];
    let mut rows: Vec<(String, Cost)> = Vec::new();
    for index_name in &args.expiry_indexes {
        let index = engines::expiry_index(index_name)?;
        for name in &args.strategies {
            let strategy = engines::claim_strategy(name)?;
            let label = if args.expiry_indexes.len() > 1 {
                format!("{name}, {index_name} expiry index")
            } else {
                name.clone()
            };
            for cost in meter::postgres_with(&args.postgres_url, strategy, index, &workloads, args.ops).await? {
                rows.push((label.clone(), cost));
            }
        }
    }
    // The suite's table keeps the default index afterwards.
    engines::postgres(&args.postgres_url, 1).await?.migrate().await?;
    println!();
    println!("| path | round trips | rows written | WAL records | WAL bytes | server CPU µs | client CPU µs |");
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
            "bare" if first_bare => line("bare `BEGIN; INSERT; COMMIT`", cost),
            "bare" => line(&format!("bare (again, with {name})"), cost),
            "fresh" | "replay" => line(&format!("{} ({name})", cost.path), cost),
            _ => {}
        }
    }
    let json = serde_json::json!({
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
