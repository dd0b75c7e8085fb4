//! The multi-step workload's figures side by side, and the targets of
//! docs/design/multi-step.md §3.12: a two-step operation (a) costs at most
//! 1.1× two single-step calls (b) in round trips and CPU, and writes no
//! more rows.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::cost::Cost;
use crate::measure::Comparison;
use crate::report::{Results, engine_name, summary, thousands};

/// The workload's name in the results.
pub const WORKLOAD: &str = "steps";

/// Where the workload's table starts in the page.
pub const BEGIN: &str = "<!-- bench:steps:begin -->";
/// Where it ends.
pub const END: &str = "<!-- bench:steps:end -->";

/// The most round trips and CPU a two-step operation may cost, as a
/// multiple of two single-step calls'.
pub const COST_TARGET: f64 = 1.1;

/// How far an averaged count may sit above the other and still count as
/// no more (a stray write of the server in 300 operations).
const COUNT_SLACK: f64 = 0.05;

/// One figure of both paths on one engine.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StepsFigure {
    /// `postgres`, `mysql` or `sqlite`.
    pub engine: String,
    /// What is compared (`round trips`, `rows written`, `ops/s, 16 workers`…).
    pub figure: String,
    /// The two-step operation's figure (a).
    pub two_step: f64,
    /// The two single-step calls' figure (b).
    pub two_calls: f64,
    /// (a)/(b).
    pub ratio: f64,
    /// The smallest and largest (a)/(b) over the repetitions (throughput only).
    pub spread: Option<(f64, f64)>,
    /// The target, as written (`≤ 1.1×`, `≤ (b)`).
    pub target: Option<String>,
    /// Whether the figures reach it.
    pub met: Option<bool>,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::INFINITY }
}

/// Every figure of the workload in `costs` and `comparisons`, engine by
/// engine in the order measured: the cost meter's counts per operation
/// (with their targets), then ops/s at each worker count.
pub fn figures(costs: &[Cost], comparisons: &[Comparison]) -> Vec<StepsFigure> {
    let mut engines: Vec<&str> = Vec::new();
    let measured = costs
        .iter()
        .filter(|c| c.workload == WORKLOAD)
        .map(|c| c.engine.as_str())
        .chain(
            comparisons
                .iter()
                .filter(|c| c.workload == WORKLOAD)
                .map(|c| c.engine.as_str()),
        );
    for engine in measured {
        if !engines.contains(&engine) {
            engines.push(engine);
        }
    }
    let mut out = Vec::new();
    for engine in engines {
        let cost = |path: &str| {
            costs
                .iter()
                .find(|c| c.engine == engine && c.workload == WORKLOAD && c.path == path)
        };
        if let (Some(a), Some(b)) = (cost("two-step"), cost("two-calls")) {
            // SQLite runs in the client: its CPU is all the client's.
            let cpu = |c: &Cost| Some(c.client_cpu_us? + c.server_cpu_us.unwrap_or(0.0));
            let counted = [
                ("round trips", a.round_trips, b.round_trips, Some("≤ 1.1×")),
                ("rows written", a.rows_written, b.rows_written, Some("≤ (b)")),
                ("log records", a.log_records, b.log_records, None),
                ("log bytes", a.log_bytes, b.log_bytes, None),
                ("CPU µs (server + client)", cpu(a), cpu(b), Some("≤ 1.1×")),
            ];
            for (figure, a, b, target) in counted {
                let (Some(a), Some(b)) = (a, b) else { continue };
                let met = target.map(|t| match t {
                    "≤ (b)" => a <= b + COUNT_SLACK,
                    _ => a <= b * COST_TARGET + COUNT_SLACK,
                });
                out.push(StepsFigure {
                    engine: engine.to_owned(),
                    figure: figure.to_owned(),
                    two_step: a,
                    two_calls: b,
                    ratio: ratio(a, b),
                    spread: None,
                    target: target.map(str::to_owned),
                    met,
                });
            }
        }
        for c in comparisons
            .iter()
            .filter(|c| c.engine == engine && c.workload == WORKLOAD)
        {
            let rate = |path: &str| c.paths.iter().find(|p| p.path == path).map(|p| p.median_ops_per_sec);
            let Some(r) = c.ratios.first() else { continue };
            let (Some(a), Some(b)) = (rate("two-step"), rate("two-calls")) else {
                continue;
            };
            out.push(StepsFigure {
                engine: engine.to_owned(),
                figure: format!("ops/s, {} worker{}", c.workers, if c.workers == 1 { "" } else { "s" }),
                two_step: a,
                two_calls: b,
                ratio: r.median,
                spread: Some((r.min, r.max)),
                target: None,
                met: None,
            });
        }
    }
    out
}

/// A figure as the table shows it: counts with two decimals, bytes, CPU
/// and ops/s whole.
fn shown(figure: &str, value: f64) -> String {
    if figure.starts_with("round") || figure.starts_with("rows") || figure.starts_with("log records") {
        format!("{value:.2}")
    } else {
        thousands(value)
    }
}

/// The workload's section: the run's summary and one table of both paths'
/// figures per engine; `None` when the results hold none of it.
pub fn render(results: &Results) -> Option<String> {
    let figures = figures(&results.costs, &results.comparisons);
    if figures.is_empty() {
        return None;
    }
    let ops = results
        .costs
        .iter()
        .find(|c| c.workload == WORKLOAD)
        .map_or(0, |c| c.ops);
    let mut out = summary(results);
    let _ = write!(
        out,
        "\nPer operation: the cost meter's counts over {ops} operations per path (one connection, one after another), \
         and ops/s as the median of the repetitions with the spread of (a)/(b). (a) is the two-step operation, \
         (b) the two single-step calls.\n\n\
         | engine | figure | two-step (a) | two calls (b) | (a)/(b) | target | met |\n|---|---|---|---|---|---|---|\n"
    );
    for f in &figures {
        let ratio = match f.spread {
            Some((min, max)) => format!("{:.2} ({min:.2}–{max:.2})", f.ratio),
            None => format!("{:.2}", f.ratio),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {ratio} | {} | {} |",
            engine_name(results, &f.engine),
            f.figure,
            shown(&f.figure, f.two_step),
            shown(&f.figure, f.two_calls),
            f.target.as_deref().unwrap_or("—"),
            match f.met {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "—",
            },
        );
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(engine: &str, path: &str, round_trips: Option<f64>, rows: f64, cpu: (Option<f64>, f64)) -> Cost {
        Cost {
            engine: engine.into(),
            workload: WORKLOAD.into(),
            path: path.into(),
            ops: 300,
            round_trips,
            rows_written: Some(rows),
            log_records: None,
            log_bytes: None,
            server_cpu_us: cpu.0,
            client_cpu_us: Some(cpu.1),
            scope: "backend".into(),
        }
    }

    fn results(costs: Vec<Cost>) -> Results {
        let mut r: Results = serde_json::from_value(serde_json::json!({
            "date": "2026-11-25T15:30:58Z",
            "machine": {"nproc": 2, "cpu_model": "Test CPU", "memory_kb": 4194304, "kernel": "6.1.0"},
            "git": {"commit": "0123456789abcdef", "dirty": false},
            "servers": {"postgres": "17.2"},
            "args": {"seconds": 2, "repeat": 3},
            "comparisons": [{
                "engine": "postgres", "workload": "steps", "workers": 16,
                "paths": [
                    {"path": "two-calls", "runs": [], "median_ops_per_sec": 1000.0},
                    {"path": "two-step", "runs": [], "median_ops_per_sec": 900.0}
                ],
                "ratios": [{"name": "two-step/two-calls", "numerator": "two-step", "denominator": "two-calls",
                            "values": [0.85, 0.9, 0.95], "median": 0.9, "min": 0.85, "max": 0.95,
                            "target": null, "met": null}]
            }]
        }))
        .expect("a valid sample");
        r.costs = costs;
        r
    }

    /// Round trips and CPU are held to 1.1× the two calls', rows to no
    /// more than theirs; SQLite has no round trips and its CPU is the
    /// client's; throughput is shown with its spread and no target.
    #[test]
    fn compares_both_paths_against_the_targets() {
        let costs = vec![
            cost("postgres", "two-calls", Some(10.0), 6.0, (Some(600.0), 400.0)),
            cost("postgres", "two-step", Some(12.0), 5.0, (Some(600.0), 500.0)),
            cost("sqlite", "two-calls", None, 6.0, (None, 100.0)),
            cost("sqlite", "two-step", None, 6.02, (None, 105.0)),
        ];
        let all = figures(&costs, &results(Vec::new()).comparisons);
        let find = |engine: &str, figure: &str| {
            all.iter()
                .find(|f| f.engine == engine && f.figure == figure)
                .unwrap_or_else(|| panic!("no {engine} {figure} in {all:?}"))
        };
        let trips = find("postgres", "round trips");
        assert_eq!((trips.ratio, trips.met), (1.2, Some(false)));
        assert_eq!(find("postgres", "rows written").met, Some(true));
        let cpu = find("postgres", "CPU µs (server + client)");
        assert_eq!((cpu.two_step, cpu.two_calls, cpu.met), (1100.0, 1000.0, Some(true)));
        assert!(!all.iter().any(|f| f.engine == "sqlite" && f.figure == "round trips"));
        assert_eq!(find("sqlite", "rows written").met, Some(true));
        assert_eq!(find("sqlite", "CPU µs (server + client)").two_step, 105.0);
        let rendered = render(&results(costs)).expect("figures to render");
        assert!(rendered.contains("| PostgreSQL | round trips | 12.00 | 10.00 | 1.20 | ≤ 1.1× | **no** |"));
        assert!(rendered.contains("| PostgreSQL | ops/s, 16 workers | 900 | 1 000 | 0.90 (0.85–0.95) | — | — |"));
        assert!(rendered.contains("| SQLite | rows written | 6.02 | 6.00 | 1.00 | ≤ (b) | yes |"));
    }

    /// Results without the workload render no section.
    #[test]
    fn renders_nothing_without_the_workload() {
        let mut r = results(Vec::new());
        r.comparisons.clear();
        assert!(render(&r).is_none());
    }
}
