//! The whole suite: every workload on every engine, the results file, the
//! README's tables.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Parser;
use idem_core::BoxError;
use serde::Serialize;

use crate::cost::Cost;
use crate::engines::{self, BenchDb};
use crate::http::HttpPaths;
use crate::machine::{Commit, Machine, now_rfc3339};
use crate::measure::{Comparison, Paths, RatioSpec, Setting, compare, print_header};
use crate::meter;
use crate::micro::Insert;
use crate::report::{Results, update_page};
use crate::steps::{StepsPaths, Vendor};
use crate::transfer::{TENANT, Transfer, fund_accounts};
use crate::txpaths::TxPaths;

/// The suite's command line.
#[derive(Debug, Clone, Parser, Serialize)]
#[command(about = "idem's performance suite: each workload against its baseline, per engine")]
pub struct Args {
    /// Seconds each path runs in each repetition (after a 0.5 s warm-up).
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Repetitions of each comparison (baseline and idem interleaved).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Engines to measure.
    #[arg(long, value_delimiter = ',', default_value = "postgres,mysql,sqlite")]
    pub engines: Vec<String>,
    /// Workloads to run: micro, transfer, http, steps.
    #[arg(long, value_delimiter = ',', default_value = "micro,transfer,http,steps")]
    pub workloads: Vec<String>,
    /// Worker counts of the micro, transfer and steps workloads.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub workers: Vec<usize>,
    /// Concurrent clients of the HTTP workload.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub clients: Vec<usize>,
    /// Funded accounts the transfers pick random pairs from.
    #[arg(long, default_value_t = 1000)]
    pub accounts: usize,
    /// Database connections of the HTTP server.
    #[arg(long, default_value_t = 32)]
    pub http_connections: u32,
    /// Requests the cost meter counts per path (one connection, one after
    /// another, after the throughput runs); 0 skips the meter.
    #[arg(long, default_value_t = 300)]
    pub cost_ops: u64,
    /// The PostgreSQL store's claim strategy: `insert-on-conflict` (the
    /// default), `advisory-lock` or `one-write`.
    #[arg(long, default_value = "insert-on-conflict", value_parser = ["insert-on-conflict", "advisory-lock", "one-write"])]
    pub pg_claim_strategy: String,
    /// The MySQL/MariaDB store's claim strategy: `placeholder` (the
    /// default) or `named-lock`.
    #[arg(long, default_value = "placeholder", value_parser = ["placeholder", "named-lock"])]
    pub mysql_claim_strategy: String,
    /// The HTTP workload's ledger reads a key's committed row before it
    /// claims it (the ledger's `--read-first`): its `with` path pays the
    /// read, its `replay` path is answered by it.
    #[arg(long)]
    pub http_read_first: bool,
    /// Also run the scale benchmark (`scale`, next to this binary).
    #[arg(long)]
    pub scale: bool,
    /// Where to write the results.
    #[arg(long, default_value = "target/bench/results.json")]
    pub out: PathBuf,
    /// Regenerates the tables of this page (`docs/benchmarks.md`, or any
    /// file with the `<!-- bench:begin -->`/`<!-- bench:end -->` markers) from the results.
    #[arg(long)]
    pub readme: Option<PathBuf>,
    /// Runs nothing: renders the README's tables (`--readme`) from this results file.
    #[arg(long, requires = "readme")]
    pub from_json: Option<PathBuf>,
    /// The servers.
    #[command(flatten)]
    #[serde(skip)]
    pub urls: crate::engines::EngineUrls,
}

/// The micro-benchmark's and the transfer's idem/bare targets (at 16
/// workers).
fn idem_over_bare_target(engine: &str, workload: &str, workers: usize) -> Option<f64> {
    match (engine, workload, workers) {
        ("postgres" | "mysql", "micro", 16) => Some(0.65),
        ("sqlite", "micro", 16) => Some(0.80),
        (_, "transfer", 16) => Some(0.85),
        _ => None,
    }
}

const REPLAY_TARGET: Option<f64> = Some(3.0);
/// The ledger over HTTP with the layer against without it, on PostgreSQL
/// and MariaDB at 16 clients.
const HTTP_LAYER_TARGET: f64 = 0.85;
/// Transactional over three-commit, on the micro-benchmark.
const THREE_COMMIT_TARGET: Option<f64> = Some(2.0);

/// The paths of `workload`, in the order each repetition runs them.
fn paths_of(workload: &str) -> &'static [&'static str] {
    match workload {
        "micro" => &["bare", "fresh", "replay", "fresh+read", "replay+read", "three-commit"],
        "transfer" => &["bare", "fresh", "three-commit"],
        "steps" => &crate::steps::PATHS,
        _ => &["without", "with", "replay"],
    }
}

/// The ratios of `workload` on `engine` at `workers`, with their targets.
fn ratios_of(engine: &str, workload: &str, workers: usize) -> Vec<RatioSpec> {
    let ratio = |name, numerator, denominator, target| RatioSpec {
        name,
        numerator,
        denominator,
        target,
    };
    let paths = paths_of(workload);
    if workload == "steps" {
        // Its targets are counts (`crate::steps::report`), not throughput.
        return vec![ratio("two-step/two-calls", "two-step", "two-calls", None)];
    }
    if workload == "http" {
        let layer = (matches!(engine, "postgres" | "mysql") && workers == 16).then_some(HTTP_LAYER_TARGET);
        return vec![
            ratio("with layer/without", "with", "without", layer),
            ratio("replay/fresh", "replay", "with", REPLAY_TARGET),
        ];
    }
    let mut ratios = vec![ratio(
        "idem/bare",
        "fresh",
        "bare",
        idem_over_bare_target(engine, workload, workers),
    )];
    if paths.contains(&"replay") {
        ratios.push(ratio("replay/fresh", "replay", "fresh", REPLAY_TARGET));
    }
    if paths.contains(&"replay+read") {
        // The engine that reads before it claims: its replays against its
        // own fresh calls, and what the read costs a fresh call.
        ratios.push(ratio(
            "read first: replay/fresh",
            "replay+read",
            "fresh+read",
            REPLAY_TARGET,
        ));
        ratios.push(ratio("read first: fresh/fresh", "fresh+read", "fresh", None));
    }
    ratios.push(ratio(
        "transactional/three-commit",
        "fresh",
        "three-commit",
        THREE_COMMIT_TARGET.filter(|_| workload == "micro"),
    ));
    ratios
}

/// Runs the paths of `workload` on `bench` at each of its concurrencies.
async fn at_each<P: Paths>(
    bench: &Arc<P>,
    args: &Args,
    engine: &str,
    workload: &str,
    out: &mut Vec<Comparison>,
) -> Result<(), BoxError> {
    let counts = if workload == "http" {
        &args.clients
    } else {
        &args.workers
    };
    for &workers in counts {
        let setting = Setting {
            engine,
            workload,
            workers,
            seconds: args.seconds,
            repeat: args.repeat,
        };
        let ratios = ratios_of(engine, workload, workers);
        out.push(compare(bench, setting, paths_of(workload), &ratios).await?);
    }
    Ok(())
}

/// Every selected workload on one engine.
async fn run_engine<D: BenchDb>(engine: &str, db: D, args: &Args, out: &mut Vec<Comparison>) -> Result<(), BoxError> {
    db.prepare().await?;
    let wants = |w: &str| args.workloads.iter().any(|x| x == w);
    if wants("micro") {
        let bench = Arc::new(TxPaths::new(&db, "POST /bench/insert", Insert::<D>::new())?);
        at_each(&bench, args, engine, "micro", out).await?;
    }
    if wants("transfer") {
        let accounts = fund_accounts(&db, TENANT, args.accounts).await?;
        let bench = Arc::new(TxPaths::new(&db, "POST /bench/transfer", Transfer::new(accounts))?);
        at_each(&bench, args, engine, "transfer", out).await?;
    }
    if wants("steps") {
        let bench = Arc::new(StepsPaths::new(&db, Arc::new(Vendor::new()))?);
        at_each(&bench, args, engine, "steps", out).await?;
    }
    Ok(())
}

/// The HTTP workload on one engine (its own pool, sized like a service's).
async fn run_http<D: BenchDb>(engine: &str, db: D, args: &Args, out: &mut Vec<Comparison>) -> Result<(), BoxError> {
    let tenant = ledger::tenant_for_token(crate::http::TOKEN);
    let accounts = fund_accounts(&db, tenant.as_str(), args.accounts).await?;
    let bench = Arc::new(HttpPaths::start(db.ledger_store(), accounts, args.http_read_first).await?);
    at_each(&bench, args, engine, "http", out).await
}

/// Measures the engine whose store `connect` opens (with a pool of the
/// given size), and answers its server version.
async fn measure_store<D, F, Fut>(
    engine: &str,
    args: &Args,
    out: &mut Vec<Comparison>,
    connect: F,
) -> Result<String, BoxError>
where
    D: BenchDb,
    F: Fn(u32) -> Fut,
    Fut: Future<Output = Result<D, BoxError>>,
{
    let db = connect(args.workers.iter().copied().max().unwrap_or(1) as u32 + 4).await?;
    run_engine(engine, db.clone(), args, out).await?;
    if args.workloads.iter().any(|w| w == "http") {
        run_http(engine, connect(args.http_connections).await?, args, out).await?;
    }
    db.clean_up().await?;
    db.server_version().await
}

/// Counts the cost per request of the transactional paths on `engine`.
async fn meter_engine(engine: &str, args: &Args) -> Result<Vec<Cost>, BoxError> {
    let workloads: Vec<String> = args
        .workloads
        .iter()
        .filter(|w| ["micro", "transfer", "steps"].contains(&w.as_str()))
        .cloned()
        .collect();
    if args.cost_ops == 0 || workloads.is_empty() {
        return Ok(Vec::new());
    }
    match engine {
        "postgres" => {
            let strategy = engines::claim_strategy(&args.pg_claim_strategy)?;
            meter::postgres(&args.urls.postgres_url, strategy, &workloads, args.cost_ops).await
        }
        "mysql" => {
            let strategy = engines::mysql_claim_strategy(&args.mysql_claim_strategy)?;
            meter::mysql(&args.urls.mysql_url, strategy, &workloads, args.cost_ops).await
        }
        _ => meter::sqlite(&workloads, args.cost_ops).await,
    }
}

/// Connects to `engine`, measures it, and answers its server version.
async fn measure_engine(engine: &str, args: &Args, out: &mut Vec<Comparison>) -> Result<String, BoxError> {
    match engine {
        "postgres" => {
            let strategy = engines::claim_strategy(&args.pg_claim_strategy)?;
            measure_store(engine, args, out, |n| async move {
                Ok(engines::postgres(&args.urls.postgres_url, n)
                    .await?
                    .with_claim_strategy(strategy))
            })
            .await
        }
        "mysql" => {
            let strategy = engines::mysql_claim_strategy(&args.mysql_claim_strategy)?;
            measure_store(engine, args, out, |n| async move {
                Ok(engines::mysql(&args.urls.mysql_url, n)
                    .await?
                    .with_claim_strategy(strategy))
            })
            .await
        }
        "sqlite" => {
            let file = engines::SqliteFile::new();
            measure_store(engine, args, out, |_| file.open()).await
        }
        other => Err(format!("unknown engine {other:?} (postgres, mysql, sqlite)").into()),
    }
}

/// The scale benchmark binary, next to this one.
fn scale_binary() -> Result<PathBuf, BoxError> {
    let exe = std::env::current_exe()?.with_file_name("scale");
    if !exe.exists() {
        return Err(format!(
            "--scale: the scale benchmark is not built ({} is missing); build it with \
             `cargo build --release -p idem-bench --bin scale`",
            exe.display()
        )
        .into());
    }
    Ok(exe)
}

/// Runs the scale benchmark `exe` with its results in `dir/scale.json`, and
/// answers them.
async fn run_scale(exe: &Path, dir: &Path) -> Result<serde_json::Value, BoxError> {
    let out = dir.join("scale.json");
    println!("\n== scale: {} --out {} ==", exe.display(), out.display());
    let status = tokio::process::Command::new(exe)
        .arg("--out")
        .arg(&out)
        .status()
        .await?;
    if !status.success() {
        return Err(format!("--scale: {} failed ({status})", exe.display()).into());
    }
    Ok(serde_json::from_slice(&std::fs::read(&out)?)?)
}

/// Sets every ratio's target to the one [`ratios_of`] gives now, and
/// whether its median reaches it, so a results file written under earlier
/// targets renders against today's; the measured figures are not touched.
fn retarget(results: &mut Results) {
    for c in &mut results.comparisons {
        let specs = ratios_of(&c.engine, &c.workload, c.workers);
        for r in &mut c.ratios {
            if let Some(spec) = specs.iter().find(|s| s.name == r.name) {
                r.target = spec.target;
                r.met = spec.target.map(|t| r.median >= t);
            }
        }
    }
}

fn write_readme(path: &Path, results: &Results) -> Result<(), BoxError> {
    let readme = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let updated = update_page(&readme, results).map_err(|e| format!("{}: {e}", path.display()))?;
    std::fs::write(path, updated)?;
    println!("tables regenerated in {}", path.display());
    Ok(())
}

/// Runs what `args` asks: the suite (then its results file and, with
/// `--readme`, the README's tables), or with `--from-json` only the tables.
pub async fn run(args: Args) -> Result<(), BoxError> {
    if let (Some(json), Some(readme)) = (&args.from_json, &args.readme) {
        let mut results: Results =
            serde_json::from_slice(&std::fs::read(json).map_err(|e| format!("{}: {e}", json.display()))?)?;
        retarget(&mut results);
        return write_readme(readme, &results);
    }
    let scale_exe = if args.scale { Some(scale_binary()?) } else { None };
    let date = now_rfc3339();
    let machine = Machine::this();
    let mut comparisons = Vec::new();
    let mut servers = BTreeMap::new();
    let mut costs = Vec::new();
    print_header();
    for engine in &args.engines {
        let version = measure_engine(engine, &args, &mut comparisons).await?;
        servers.insert(engine.clone(), version);
        costs.extend(meter_engine(engine, &args).await?);
    }
    let cost_targets = crate::cost::cost_targets(&costs);
    for t in &cost_targets {
        println!(
            "{:>8} {:>9} target {}: bare {:.2}, fresh {:.2}, measured {:.2}, target {}, met: {}",
            t.engine, t.workload, t.figure, t.bare, t.fresh, t.measured, t.target, t.met
        );
    }
    for f in crate::steps::report::figures(&costs, &comparisons) {
        println!(
            "{:>8} {:>9} {}: two-step {:.2}, two calls {:.2}, ratio {:.2}{}",
            f.engine,
            crate::steps::report::WORKLOAD,
            f.figure,
            f.two_step,
            f.two_calls,
            f.ratio,
            match (&f.target, f.met) {
                (Some(t), Some(met)) => format!(", target {t}, met: {met}"),
                _ => String::new(),
            }
        );
    }
    let dir = args.out.parent().unwrap_or(Path::new(".")).to_path_buf();
    std::fs::create_dir_all(&dir)?;
    let scale = match &scale_exe {
        Some(exe) => Some(run_scale(exe, &dir).await?),
        None => None,
    };
    let results = Results {
        date,
        machine,
        git: Commit::current(),
        servers,
        args: serde_json::to_value(&args)?,
        comparisons,
        cost_targets,
        costs,
        scale,
    };
    std::fs::write(&args.out, serde_json::to_vec_pretty(&results)?)?;
    println!("\nresults written to {}", args.out.display());
    if let Some(readme) = &args.readme {
        write_readme(readme, &results)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A results file rendered again takes today's targets, and whether each
    /// median reaches them, without its figures changing.
    #[test]
    fn renders_an_older_file_against_todays_targets() {
        let ratio = |name: &str, median: f64, target: Option<f64>| {
            serde_json::json!({"name": name, "numerator": "a", "denominator": "b", "values": [median],
                "median": median, "min": median, "max": median, "target": target, "met": target.map(|t| median >= t)})
        };
        let mut results: Results = serde_json::from_value(serde_json::json!({
            "date": "2026-11-25T15:30:58Z",
            "machine": {"nproc": 2, "cpu_model": "Test CPU", "memory_kb": 4194304, "kernel": "6.1.0"},
            "git": {"commit": "0123456789abcdef", "dirty": false},
            "servers": {}, "args": {},
            "comparisons": [
                {"engine": "postgres", "workload": "micro", "workers": 16, "paths": [],
                 "ratios": [ratio("idem/bare", 0.8, Some(0.85)), ratio("replay/fresh", 2.5, Some(3.0))]},
                {"engine": "postgres", "workload": "http", "workers": 16, "paths": [],
                 "ratios": [ratio("with layer/without", 0.7, None)]},
                {"engine": "sqlite", "workload": "http", "workers": 16, "paths": [],
                 "ratios": [ratio("with layer/without", 0.9, None)]},
                {"engine": "mysql", "workload": "transfer", "workers": 16, "paths": [],
                 "ratios": [ratio("idem/bare", 0.8, Some(0.85)),
                            ratio("transactional/three-commit", 1.5, Some(2.0))]}
            ]
        }))
        .unwrap();
        retarget(&mut results);
        let got = |i: usize, j: usize| {
            let r = &results.comparisons[i].ratios[j];
            (r.median, r.target, r.met)
        };
        assert_eq!(got(0, 0), (0.8, Some(0.65), Some(true)));
        assert_eq!(got(0, 1), (2.5, Some(3.0), Some(false)));
        assert_eq!(got(1, 0), (0.7, Some(0.85), Some(false)));
        assert_eq!(got(2, 0), (0.9, None, None));
        assert_eq!(got(3, 0), (0.8, Some(0.85), Some(false)));
        // Transactional over three-commit has its target on micro only.
        assert_eq!(got(3, 1), (1.5, None, None));
    }
}
