//! The results file and the README's tables rendered from it.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::cost::{Cost, CostTarget, cost_targets, show};
use crate::machine::{Commit, Machine};
use crate::measure::Comparison;
use crate::steps::report::WORKLOAD;

/// Where the generated tables start in the README.
pub const BEGIN: &str = "<!-- bench:begin -->";
/// Where they end.
pub const END: &str = "<!-- bench:end -->";

/// Everything one run of the suite measured, and where.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    /// When the run started (UTC, RFC 3339).
    pub date: String,
    /// The machine.
    pub machine: Machine,
    /// The commit.
    pub git: Commit,
    /// Each engine's server version.
    pub servers: BTreeMap<String, String>,
    /// The suite's arguments.
    pub args: serde_json::Value,
    /// Every comparison, in the order measured.
    pub comparisons: Vec<Comparison>,
    /// The cost per request of each transactional path (the cost meter).
    #[serde(default)]
    pub costs: Vec<Cost>,
    /// The counted targets checked against [`costs`](Self::costs) (see
    /// [`cost_targets`]).
    #[serde(default)]
    pub cost_targets: Vec<CostTarget>,
    /// The scale benchmark's own results, when it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<serde_json::Value>,
}

pub(crate) fn engine_name(results: &Results, engine: &str) -> String {
    match engine {
        "postgres" => "PostgreSQL".into(),
        "mysql" if results.servers.get("mysql").is_some_and(|v| v.contains("MariaDB")) => "MariaDB".into(),
        "mysql" => "MySQL".into(),
        "sqlite" => "SQLite".into(),
        other => other.into(),
    }
}

/// `12345.6` as `12 346`.
pub(crate) fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

pub(crate) fn summary(results: &Results) -> String {
    let arg = |name: &str| {
        results
            .args
            .get(name)
            .map(|v| v.to_string())
            .unwrap_or_else(|| "?".into())
    };
    let servers: Vec<String> = results
        .servers
        .iter()
        .map(|(engine, version)| format!("{} {version}", engine_name(results, engine)))
        .collect();
    let commit: String = results.git.commit.chars().take(10).collect();
    format!(
        "Measured {date} on {nproc} × {cpu}, {mem:.1} GiB, Linux {kernel}, load average {load} at the start; commit `{commit}`{dirty}; \
         {seconds} s per path, {repeat} repetition(s), baseline and idem interleaved; {servers}.\n",
        date = results.date,
        nproc = results.machine.nproc,
        cpu = results.machine.cpu_model,
        mem = results.machine.memory_kb as f64 / 1024.0 / 1024.0,
        kernel = results.machine.kernel,
        load = results.machine.load_average,
        dirty = if results.git.dirty {
            " (with uncommitted changes)"
        } else {
            ""
        },
        seconds = arg("seconds"),
        repeat = arg("repeat"),
        servers = servers.join(", "),
    )
}

fn comparisons_table(results: &Results) -> String {
    let mut out = String::from(
        "| engine | workload | workers | ratio | baseline ops/s | idem ops/s | ratio: median (min–max) | target | met |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for c in results.comparisons.iter().filter(|c| c.workload != WORKLOAD) {
        let rate = |path: &str| {
            c.paths
                .iter()
                .find(|p| p.path == path)
                .map_or(0.0, |p| p.median_ops_per_sec)
        };
        for r in &c.ratios {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} ({}) | {} ({}) | {:.2} ({:.2}–{:.2}) | {} | {} |",
                row_name(results, &c.engine, &c.workload),
                c.workers,
                r.name,
                thousands(rate(&r.denominator)),
                r.denominator,
                thousands(rate(&r.numerator)),
                r.numerator,
                r.median,
                r.min,
                r.max,
                r.target.map_or("—".into(), |t| format!("≥ {t}")),
                met(r.met),
            );
        }
    }
    out
}

fn costs_table(results: &Results) -> String {
    let costs: Vec<&Cost> = results.costs.iter().filter(|c| c.workload != WORKLOAD).collect();
    if costs.is_empty() {
        return "Cost per request: not counted in this run (the suite counts it unless `--cost-ops 0`).\n".into();
    }
    let ops = costs.first().map_or(0, |c| c.ops);
    let mut out = format!(
        "Cost per request ({ops} requests per path, one connection, one after another; round trips counted at the wire; \
         rows written: PostgreSQL `n_tup_ins + n_tup_upd + n_tup_del` of the suite's tables, MariaDB the session's \
         `Handler_write + Handler_update + Handler_delete`, SQLite `total_changes()`; log: PostgreSQL `pg_stat_wal` \
         (cluster-wide), MariaDB `Innodb_os_log_written` (server-wide); server CPU: the PostgreSQL backend, the whole \
         `mariadbd`; client CPU: the suite's process, its proxy left out):\n\n\
         | engine | workload | path | round trips | rows written | log records | log bytes | server CPU µs | client CPU µs |\n\
         |---|---|---|---|---|---|---|---|---|\n"
    );
    for c in costs {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            row_name(results, &c.engine, &c.workload),
            c.path,
            show(c.round_trips),
            show(c.rows_written),
            show(c.log_records),
            c.log_bytes.map_or("—".into(), thousands),
            c.server_cpu_us.map_or("—".into(), thousands),
            c.client_cpu_us.map_or("—".into(), thousands),
        );
    }
    out
}

/// The cells that name a row of the comparison and cost tables: its
/// engine and workload.
fn row_name(results: &Results, engine: &str, workload: &str) -> String {
    format!("{} | {workload}", engine_name(results, engine))
}

/// Whether a target was met: `yes`, `**no**`, or `—` when it was not
/// judged.
fn met(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "yes",
        Some(false) => "**no**",
        None => "—",
    }
}

/// A target's measured figure: a ratio as it is, a difference with its sign
/// (`+0.00` for one that rounds to nothing, never `-0.00`).
fn signed(t: &CostTarget) -> String {
    if t.figure.starts_with("CPU") {
        return format!("{:.2}", t.measured);
    }
    let rounded = (t.measured * 100.0).round() / 100.0;
    if rounded < 0.0 {
        format!("{rounded:.2}")
    } else {
        format!("+{:.2}", rounded.abs())
    }
}

/// The counted targets, recomputed from the costs so that a results file
/// written before they were recorded renders them too.
fn cost_targets_table(results: &Results) -> String {
    let targets = cost_targets(&results.costs);
    if targets.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "Counted targets (a fresh call against the bare transaction, from the costs above; counts as fresh − bare, \
         CPU as fresh / bare):\n\n\
         | engine | workload | figure | bare | fresh | measured | target | met |\n|---|---|---|---|---|---|---|---|\n",
    );
    for t in &targets {
        let _ = writeln!(
            out,
            "| {} | {} | {:.2} | {:.2} | {} | {} | {} |",
            row_name(results, &t.engine, &t.workload),
            t.figure,
            t.bare,
            t.fresh,
            signed(t),
            t.target,
            met(Some(t.met)),
        );
    }
    out + "\n"
}

/// Every leaf of `value` with its path (`a.b[2].c`).
fn leaves(prefix: &str, value: &serde_json::Value, out: &mut Vec<(String, String)>) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(&path, v, out);
            }
        }
        serde_json::Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                leaves(&format!("{prefix}[{i}]"), v, out);
            }
        }
        serde_json::Value::Number(n) => out.push((
            prefix.to_owned(),
            n.as_f64()
                .filter(|f| f.fract() != 0.0)
                .map_or(n.to_string(), |f| format!("{f:.3}")),
        )),
        other => out.push((prefix.to_owned(), other.to_string().trim_matches('"').to_owned())),
    }
}

fn scale_section(results: &Results) -> String {
    let Some(scale) = &results.scale else {
        return "Scale: not measured in this run (the suite runs it with `--scale`).\n".into();
    };
    let Some(engines) = scale.get("results").and_then(|r| r.as_array()) else {
        let mut rows = Vec::new();
        leaves("", scale, &mut rows);
        let mut out = String::from("Scale (the `scale` benchmark's figures):\n\n| figure | value |\n|---|---|\n");
        for (k, v) in rows {
            let _ = writeln!(out, "| `{k}` | {v} |");
        }
        return out;
    };
    let num = |v: &serde_json::Value, path: &[&str]| {
        path.iter()
            .try_fold(v, |v, k| v.get(*k))
            .and_then(serde_json::Value::as_f64)
    };
    let ms = |v: Option<f64>| v.map_or("—".into(), |v| format!("{v:.2} ms"));
    let met_in = |v: &serde_json::Value| met(v.get("p99_met").and_then(serde_json::Value::as_bool));
    let mut out = String::from(
        "Scale (`scale`: fresh claims with few and many stored keys; live claims without and during a sweep):\n\n\
         | engine | figure | without | with | ratio | target | met |\n|---|---|---|---|---|---|---|\n",
    );
    let mut bytes = String::from(
        "\n| engine | bytes per key | table bytes | index bytes | sweep rows/s |\n|---|---|---|---|---|\n",
    );
    for e in engines {
        let name = engine_name(results, e.get("engine").and_then(|v| v.as_str()).unwrap_or("?"));
        let keys = |k: &str| num(e, &[k]).map_or("?".into(), thousands);
        let sweep = e.get("sweep").cloned().unwrap_or_default();
        let _ = writeln!(
            out,
            "| {name} | claim p99, {} → {} keys | {} | {} | {} | ≤ {} | {} |",
            keys("keys_small"),
            keys("keys_large"),
            ms(num(e, &["small", "p99_ms"])),
            ms(num(e, &["large", "p99_ms"])),
            show(num(e, &["p99_ratio"])),
            show(num(e, &["p99_target"])),
            met_in(e),
        );
        let _ = writeln!(
            out,
            "| {name} | live p99, sweeping {} expired rows | {} | {} | {} | ≤ {} | {} |",
            num(&sweep, &["expired"])
                .or_else(|| num(&sweep, &["rows"]))
                .map_or("?".into(), thousands),
            ms(num(&sweep, &["live_without", "p99_ms"])),
            ms(num(&sweep, &["live_during", "p99_ms"])),
            show(num(&sweep, &["p99_ratio"])),
            show(num(&sweep, &["p99_target"])),
            met_in(&sweep),
        );
        let count = |path: &[&str]| num(e, path).map_or("—".into(), thousands);
        let _ = writeln!(
            bytes,
            "| {name} | {} | {} | {} | {} |",
            count(&["bytes", "bytes_per_key"]),
            count(&["bytes", "table_bytes"]),
            count(&["bytes", "index_bytes"]),
            num(&sweep, &["rows_per_sec"]).map_or("—".into(), thousands),
        );
    }
    out + &bytes
}

/// The README's generated part: the run's summary, the comparisons, scale.
pub fn render(results: &Results) -> String {
    format!(
        "{}\n{}\n{}\n{}{}",
        summary(results),
        comparisons_table(results),
        costs_table(results),
        cost_targets_table(results),
        scale_section(results)
    )
}

/// `readme` with everything between [`BEGIN`] and [`END`] replaced by
/// `generated`; the markers and the rest are kept as they are.
pub fn replace_generated(readme: &str, generated: &str) -> Result<String, String> {
    replace_between(readme, BEGIN, END, generated)
}

/// `readme` with everything between `begin` and `end` replaced by
/// `generated`; the markers and the rest are kept as they are.
pub fn replace_between(readme: &str, begin: &str, end: &str, generated: &str) -> Result<String, String> {
    let start = readme
        .find(begin)
        .ok_or_else(|| format!("no {begin} marker in the page"))?
        + begin.len();
    let stop = readme[start..]
        .find(end)
        .ok_or_else(|| format!("no {end} marker after {begin} in the page"))?
        + start;
    let mut generated = generated.to_owned();
    if !generated.ends_with('\n') {
        generated.push('\n');
    }
    Ok(format!("{}\n{generated}{}", &readme[..start], &readme[stop..]))
}

/// `readme` with the tables of what `results` measured regenerated: the
/// suite's tables ([`BEGIN`]…[`END`], unless the results hold the `steps`
/// workload alone) and the multi-step workload's
/// ([`steps::report::BEGIN`](crate::steps::report::BEGIN)…, when they hold
/// it). A block the results did not measure is kept as it is.
pub fn update_page(readme: &str, results: &Results) -> Result<String, String> {
    let steps = crate::steps::report::render(results);
    let others = results.comparisons.iter().any(|c| c.workload != WORKLOAD)
        || results.costs.iter().any(|c| c.workload != WORKLOAD)
        || results.scale.is_some();
    let mut page = readme.to_owned();
    if others || steps.is_none() {
        page = replace_generated(&page, &render(results))?;
    }
    if let Some(steps) = steps {
        use crate::steps::report::{BEGIN, END};
        page = replace_between(&page, BEGIN, END, &steps)?;
    }
    Ok(page)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Results {
        serde_json::from_value(serde_json::json!({
            "date": "2026-11-25T15:30:58Z",
            "machine": {"nproc": 2, "cpu_model": "Test CPU", "memory_kb": 4194304, "kernel": "6.1.0"},
            "git": {"commit": "0123456789abcdef", "dirty": false},
            "servers": {"postgres": "17.2", "mysql": "11.4.2-MariaDB"},
            "args": {"seconds": 2, "repeat": 3},
            "comparisons": [{
                "engine": "postgres", "workload": "micro", "workers": 16,
                "paths": [
                    {"path": "bare", "runs": [], "median_ops_per_sec": 5400.0},
                    {"path": "fresh", "runs": [], "median_ops_per_sec": 4000.0},
                    {"path": "replay", "runs": [], "median_ops_per_sec": 13000.0}
                ],
                "ratios": [
                    {"name": "idem/bare", "numerator": "fresh", "denominator": "bare",
                     "values": [0.7, 0.74, 0.76], "median": 0.74, "min": 0.7, "max": 0.76,
                     "target": 0.85, "met": false},
                    {"name": "replay/fresh", "numerator": "replay", "denominator": "fresh",
                     "values": [3.25], "median": 3.25, "min": 3.25, "max": 3.25,
                     "target": 3.0, "met": true}
                ]
            }]
        }))
        .expect("a valid sample")
    }

    /// The generated part replaces only what lies between the markers; a
    /// missed target is shown as missed, a met one as met.
    #[test]
    fn renders_between_the_markers_only() {
        let readme = format!("# Title\n\n## Benchmarks\n\n{BEGIN}\nold table\n{END}\n\nAfter.\n");
        let out = replace_generated(&readme, &render(&sample())).unwrap();
        let (before, rest) = out.split_once(BEGIN).unwrap();
        let (generated, after) = rest.split_once(END).unwrap();
        assert_eq!(before, "# Title\n\n## Benchmarks\n\n");
        assert_eq!(after, "\n\nAfter.\n");
        assert!(!generated.contains("old table"));
        assert!(generated.contains(
            "| PostgreSQL | micro | 16 | idem/bare | 5 400 (bare) | 4 000 (fresh) | 0.74 (0.70–0.76) | ≥ 0.85 | **no** |"
        ));
        assert!(generated.contains(
            "| PostgreSQL | micro | 16 | replay/fresh | 4 000 (fresh) | 13 000 (replay) | 3.25 (3.25–3.25) | ≥ 3 | yes |"
        ));
        assert!(generated.contains("commit `0123456789`"));
        assert!(generated.contains("MariaDB 11.4.2-MariaDB"));
        assert!(generated.contains("Scale: not measured in this run"));
        assert!(generated.contains("Cost per request: not counted in this run"));
        // Rendering again from the output changes nothing.
        assert_eq!(replace_generated(&out, &render(&sample())).unwrap(), out);
    }

    /// The cost meter's figures become one row per engine, workload and
    /// path; a figure the engine has no counter for is a dash.
    #[test]
    fn lists_costs() {
        let mut results = sample();
        results.costs = serde_json::from_value(serde_json::json!([{
            "engine": "postgres", "workload": "micro", "path": "fresh", "ops": 300,
            "round_trips": 4.0, "rows_written": 3.0, "log_records": 8.01, "log_bytes": 818.4,
            "server_cpu_us": 1234.5, "client_cpu_us": 210.0, "scope": "backend"
        }, {
            "engine": "sqlite", "workload": "micro", "path": "bare", "ops": 300,
            "round_trips": null, "rows_written": 1.0, "log_records": null, "log_bytes": null,
            "server_cpu_us": null, "client_cpu_us": 95.2, "scope": "in-process"
        }]))
        .unwrap();
        let out = render(&results);
        assert!(out.contains("Cost per request (300 requests per path"));
        assert!(out.contains("| PostgreSQL | micro | fresh | 4.00 | 3.00 | 8.01 | 818 | 1 234 | 210 |"));
        assert!(out.contains("| SQLite | micro | bare | — | 1.00 | — | — | — | 95 |"));
        // Without a bare and a fresh figure on one workload, no target is checked.
        assert!(!out.contains("Counted targets"));
        results.costs.push(
            serde_json::from_value(serde_json::json!({
                "engine": "postgres", "workload": "micro", "path": "bare", "ops": 300,
                "round_trips": 4.0, "rows_written": 1.0, "log_records": 3.01, "log_bytes": 260.0,
                "server_cpu_us": 600.0, "client_cpu_us": 200.0, "scope": "backend"
            }))
            .unwrap(),
        );
        let out = render(&results);
        assert!(
            out.contains("| PostgreSQL | micro | round trips | 4.00 | 4.00 | +0.00 | = bare | yes |"),
            "{out}"
        );
        // A count a hair under the bare's is shown as none, not as -0.00.
        results.costs[0].round_trips = Some(3.999);
        assert!(render(&results).contains("| round trips | 4.00 | 4.00 | +0.00 | = bare | yes |"));
        assert!(
            out.contains("| PostgreSQL | micro | log records | 3.01 | 8.01 | +5.00 | ≤ bare + 2 | **no** |"),
            "{out}"
        );
        // A results file from before the meter still renders.
        let mut old = serde_json::to_value(sample()).unwrap();
        old.as_object_mut().unwrap().remove("costs");
        let old: Results = serde_json::from_value(old).unwrap();
        assert!(render(&old).contains("not counted in this run"));
    }

    /// Each block is regenerated from the results that measured it: a run
    /// of the multi-step workload alone leaves the suite's tables as they
    /// were, and a run without it leaves the workload's table.
    #[test]
    fn regenerates_only_what_the_results_measured() {
        use crate::steps::report as steps;
        let page = format!("{BEGIN}\nsuite\n{END}\n\n{}\nsteps\n{}\n", steps::BEGIN, steps::END);
        let without = update_page(&page, &sample()).unwrap();
        assert!(
            !without.contains("\nsuite\n") && without.contains("\nsteps\n"),
            "{without}"
        );
        let mut only_steps = sample();
        only_steps.comparisons[0].workload = "steps".into();
        only_steps.comparisons[0].paths[0].path = "two-calls".into();
        only_steps.comparisons[0].paths[1].path = "two-step".into();
        let with = update_page(&page, &only_steps).unwrap();
        assert!(with.contains("\nsuite\n") && !with.contains("\nsteps\n"), "{with}");
        assert!(
            with.contains("| PostgreSQL | ops/s, 16 workers | 4 000 | 5 400 |"),
            "{with}"
        );
        // A page without the workload's markers is refused for its figures.
        assert!(update_page(&format!("{BEGIN}\n{END}\n"), &only_steps).is_err());
    }

    /// A README without the markers is refused, not rewritten.
    #[test]
    fn refuses_a_readme_without_markers() {
        assert!(replace_generated("# Title\n", "table").is_err());
        assert!(replace_generated(&format!("{END}\n{BEGIN}\n"), "table").is_err());
    }

    /// The scale benchmark's figures become rows per engine, a missed
    /// target shown as missed; a shape it does not know is listed leaf by leaf.
    #[test]
    fn lists_scale_figures() {
        let mut results = sample();
        results.scale = Some(serde_json::json!({"results": [{
            "engine": "postgres", "keys_small": 10000, "keys_large": 10000000,
            "small": {"p99_ms": 10.0}, "large": {"p99_ms": 12.5},
            "p99_ratio": 1.25, "p99_target": 1.1, "p99_met": false,
            "sweep": {"rows": 1000000, "rows_per_sec": 25000.0,
                      "live_without": {"p99_ms": 10.0}, "live_during": {"p99_ms": 11.0},
                      "p99_ratio": 1.1, "p99_target": 1.2, "p99_met": true},
            "bytes": {"bytes_per_key": 280.4, "table_bytes": 1900000000, "index_bytes": 900000000}
        }]}));
        let out = render(&results);
        assert!(out.contains(
            "| PostgreSQL | claim p99, 10 000 → 10 000 000 keys | 10.00 ms | 12.50 ms | 1.25 | ≤ 1.10 | **no** |"
        ));
        assert!(out.contains(
            "| PostgreSQL | live p99, sweeping 1 000 000 expired rows | 10.00 ms | 11.00 ms | 1.10 | ≤ 1.20 | yes |"
        ));
        assert!(out.contains("| PostgreSQL | 280 | 1 900 000 000 | 900 000 000 | 25 000 |"));
        results.scale = Some(serde_json::json!({"postgres": {"claim_p99_ms": {"10M": 1.5}}}));
        assert!(render(&results).contains("| `postgres.claim_p99_ms.10M` | 1.500 |"));
    }
}
