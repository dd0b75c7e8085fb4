//! Closed-loop measurement: workers run one operation after another for a
//! fixed time, and the figures of each path are compared repetition by
//! repetition.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::BoxError;
use serde::{Deserialize, Serialize};

/// How long workers run before latencies count.
const WARMUP: Duration = Duration::from_millis(500);

/// The figures of one path in one repetition.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Figures {
    /// Operations completed after the warm-up.
    pub ops: usize,
    /// Operations per second after the warm-up.
    pub ops_per_sec: f64,
    /// Median latency.
    pub p50_ms: f64,
    /// 99th-percentile latency.
    pub p99_ms: f64,
}

/// Runs `op` on `workers` concurrent tasks for the warm-up plus `seconds`,
/// and answers the figures and every key the operations returned after the
/// warm-up. `op` gets the worker's number and a counter unique to that worker.
pub async fn closed_loop<K, F, Fut>(workers: usize, seconds: f64, op: F) -> Result<(Figures, Vec<K>), BoxError>
where
    K: Send + 'static,
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Option<K>, BoxError>> + Send,
{
    let run = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..workers {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut keys = Vec::new();
            for n in 0u64.. {
                let t0 = Instant::now();
                if t0.duration_since(start) >= WARMUP + run {
                    break;
                }
                let key = op(worker, n).await?;
                if t0.duration_since(start) >= WARMUP {
                    latencies.push(t0.elapsed());
                    keys.extend(key);
                }
            }
            Ok::<_, BoxError>((latencies, keys))
        }));
    }
    let mut latencies = Vec::new();
    let mut keys = Vec::new();
    for task in tasks {
        let (l, k) = task.await??;
        latencies.extend(l);
        keys.extend(k);
    }
    latencies.sort();
    let pct = |p: f64| match latencies.len() {
        0 => 0.0,
        len => latencies[((len as f64 * p).ceil() as usize).clamp(1, len) - 1].as_secs_f64() * 1000.0,
    };
    let figures = Figures {
        ops: latencies.len(),
        ops_per_sec: latencies.len() as f64 / run.as_secs_f64(),
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
    };
    Ok((figures, keys))
}

/// A workload whose paths can be measured one at a time. The keys one path
/// returns (its fresh keys) are what a replay path replays.
pub trait Paths: Send + Sync + 'static {
    /// What a replay needs of an earlier call.
    type Key: Send + Sync + 'static;

    /// Runs the `n`th operation of `worker` on `path`; `used` holds the keys
    /// of the last measured path that returned any.
    fn one(
        &self,
        path: &'static str,
        worker: usize,
        n: u64,
        used: &[Self::Key],
    ) -> impl Future<Output = Result<Option<Self::Key>, BoxError>> + Send;
}

/// A ratio to compute: ops/s of `numerator` over ops/s of `denominator`.
#[derive(Debug, Clone, Copy)]
pub struct RatioSpec {
    /// Its name in the report (`idem/bare`).
    pub name: &'static str,
    /// The measured path (idem's).
    pub numerator: &'static str,
    /// The baseline path.
    pub denominator: &'static str,
    /// The least acceptable value, if the issue sets one here.
    pub target: Option<f64>,
}

/// One path's figures over the repetitions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PathRuns {
    /// The path (`bare`, `fresh`, `replay`, `three-commit`, ...).
    pub path: String,
    /// Its figures, one per repetition.
    pub runs: Vec<Figures>,
    /// The median of its ops/s.
    pub median_ops_per_sec: f64,
}

/// A ratio over the repetitions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Ratio {
    /// Its name (`idem/bare`).
    pub name: String,
    /// The measured path.
    pub numerator: String,
    /// The baseline path.
    pub denominator: String,
    /// Its value in each repetition.
    pub values: Vec<f64>,
    /// The median value.
    pub median: f64,
    /// The smallest value.
    pub min: f64,
    /// The largest value.
    pub max: f64,
    /// The least acceptable value, if any.
    pub target: Option<f64>,
    /// Whether the median reaches the target (`None` without a target).
    pub met: Option<bool>,
}

/// One workload at one concurrency on one engine: every path's figures and
/// every ratio.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Comparison {
    /// `postgres`, `mysql` or `sqlite`.
    pub engine: String,
    /// `micro`, `transfer` or `http`.
    pub workload: String,
    /// Concurrent workers (or HTTP clients).
    pub workers: usize,
    /// The figures of each path.
    pub paths: Vec<PathRuns>,
    /// The ratios.
    pub ratios: Vec<Ratio>,
}

/// The median of `values` (the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Where one comparison runs.
#[derive(Debug, Clone, Copy)]
pub struct Setting<'a> {
    /// The engine's name.
    pub engine: &'a str,
    /// The workload's name.
    pub workload: &'a str,
    /// Concurrent workers.
    pub workers: usize,
    /// Seconds each path runs in each repetition.
    pub seconds: f64,
    /// Repetitions.
    pub repeat: usize,
}

/// Measures `paths` one after another, `repeat` times over (so baseline and
/// idem alternate), printing each figure as it is measured, and computes the
/// ratios.
pub async fn compare<P: Paths>(
    bench: &Arc<P>,
    setting: Setting<'_>,
    paths: &[&'static str],
    ratios: &[RatioSpec],
) -> Result<Comparison, BoxError> {
    let mut runs: Vec<Vec<Figures>> = vec![Vec::new(); paths.len()];
    for rep in 1..=setting.repeat {
        let mut used = Arc::new(Vec::new());
        for (i, path) in paths.iter().enumerate() {
            let (bench, replayed, path) = (bench.clone(), used.clone(), *path);
            let (f, keys) = closed_loop(setting.workers, setting.seconds, move |worker, n| {
                let (bench, replayed) = (bench.clone(), replayed.clone());
                async move { bench.one(path, worker, n, &replayed).await }
            })
            .await?;
            if !keys.is_empty() {
                used = Arc::new(keys);
            }
            println!(
                "{:>8} {:>9} {:>3} {:>4} {:>13} {:>9} {:>10.0} {:>8.2} {:>8.2}",
                setting.engine, setting.workload, setting.workers, rep, path, f.ops, f.ops_per_sec, f.p50_ms, f.p99_ms
            );
            runs[i].push(f);
        }
    }
    let rate = |name: &str, rep: usize| {
        let i = paths
            .iter()
            .position(|p| *p == name)
            .expect("a ratio names measured paths");
        runs[i][rep].ops_per_sec
    };
    let ratios: Vec<Ratio> = ratios
        .iter()
        .map(|spec| {
            let values: Vec<f64> = (0..setting.repeat)
                .map(|rep| rate(spec.numerator, rep) / rate(spec.denominator, rep))
                .collect();
            let median = median(&values);
            Ratio {
                name: spec.name.to_owned(),
                numerator: spec.numerator.to_owned(),
                denominator: spec.denominator.to_owned(),
                min: values.iter().copied().fold(f64::INFINITY, f64::min),
                max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                median,
                target: spec.target,
                met: spec.target.map(|t| median >= t),
                values,
            }
        })
        .collect();
    for r in &ratios {
        println!(
            "{:>8} {:>9} {:>3} ratio {:<27} median {:.3} ({:.3}–{:.3}){}",
            setting.engine,
            setting.workload,
            setting.workers,
            r.name,
            r.median,
            r.min,
            r.max,
            match (r.target, r.met) {
                (Some(t), Some(true)) => format!("  target ≥ {t}: met"),
                (Some(t), _) => format!("  target ≥ {t}: MISSED"),
                _ => String::new(),
            }
        );
    }
    Ok(Comparison {
        engine: setting.engine.to_owned(),
        workload: setting.workload.to_owned(),
        workers: setting.workers,
        paths: paths
            .iter()
            .zip(runs)
            .map(|(path, runs)| PathRuns {
                path: (*path).to_owned(),
                median_ops_per_sec: median(&runs.iter().map(|f| f.ops_per_sec).collect::<Vec<_>>()),
                runs,
            })
            .collect(),
        ratios,
    })
}

/// Prints the header of the lines [`compare`] prints.
pub fn print_header() {
    println!(
        "{:>8} {:>9} {:>3} {:>4} {:>13} {:>9} {:>10} {:>8} {:>8}",
        "engine", "workload", "w", "rep", "path", "ops", "ops/s", "p50 ms", "p99 ms"
    );
}
