//! The cost meter: what one request costs, counted rather than timed.
//!
//! Each path runs `ops` times, one after another, on a store whose single
//! connection goes through a counting proxy ([`crate::wire`]); counters read
//! before and after give per-request figures that hold on a busy machine:
//!
//! | figure | PostgreSQL | MariaDB/MySQL | SQLite |
//! |---|---|---|---|
//! | round trips | the proxy | the proxy | — (in-process) |
//! | rows written | `pg_stat_user_tables` `n_tup_ins + n_tup_upd + n_tup_del` of the suite's tables | the session's `Handler_write + Handler_update + Handler_delete` | the connection's `total_changes()` |
//! | log written | `pg_stat_wal` records and bytes (cluster-wide) | `Innodb_os_log_written` bytes (server-wide) | — |
//! | server CPU | the connection's backend (`/proc/<pid>/schedstat`) | the whole `mariadbd` (its threads' `schedstat`) | — (in the client) |
//! | client CPU | this process's threads but the proxy's (`/proc/self/task/*/schedstat`) | same | same |
//!
//! Cluster- and server-wide figures include whatever else the server did
//! meanwhile; each figure says its scope.

use std::future::Future;

use idem_core::BoxError;
use serde::{Deserialize, Serialize};

use crate::measure::Paths;

/// Counters read at one instant. `None` where the engine has no such counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sample {
    /// Round trips at the wire.
    pub round_trips: Option<u64>,
    /// Rows inserted, updated or deleted.
    pub rows: Option<u64>,
    /// Log records written.
    pub log_records: Option<u64>,
    /// Log bytes written.
    pub log_bytes: Option<u64>,
    /// Server CPU time, ns.
    pub server_cpu_ns: Option<u64>,
    /// Client CPU time, ns.
    pub client_cpu_ns: Option<u64>,
}

/// What one request of one path costs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Cost {
    /// `postgres`, `mysql` or `sqlite`.
    pub engine: String,
    /// `micro` or `transfer`.
    pub workload: String,
    /// `bare`, `fresh`, `replay` or `three-commit`.
    pub path: String,
    /// Requests counted.
    pub ops: u64,
    /// Round trips per request.
    pub round_trips: Option<f64>,
    /// Rows written per request.
    pub rows_written: Option<f64>,
    /// Log records per request.
    pub log_records: Option<f64>,
    /// Log bytes per request.
    pub log_bytes: Option<f64>,
    /// Server CPU µs per request.
    pub server_cpu_us: Option<f64>,
    /// Client CPU µs per request.
    pub client_cpu_us: Option<f64>,
    /// What the log and server CPU figures cover (`backend`, `cluster`, `server`).
    pub scope: String,
}

impl Cost {
    /// The cost per request of `ops` requests between `before` and `after`.
    pub fn between(before: &Sample, after: &Sample, ops: u64, scope: &str) -> Self {
        let per = |b: Option<u64>, a: Option<u64>, unit: f64| match (b, a) {
            (Some(b), Some(a)) if ops > 0 => Some(a.saturating_sub(b) as f64 / ops as f64 / unit),
            _ => None,
        };
        Self {
            engine: String::new(),
            workload: String::new(),
            path: String::new(),
            ops,
            round_trips: per(before.round_trips, after.round_trips, 1.0),
            rows_written: per(before.rows, after.rows, 1.0),
            log_records: per(before.log_records, after.log_records, 1.0),
            log_bytes: per(before.log_bytes, after.log_bytes, 1.0),
            server_cpu_us: per(before.server_cpu_ns, after.server_cpu_ns, 1000.0),
            client_cpu_us: per(before.client_cpu_ns, after.client_cpu_ns, 1000.0),
            scope: scope.to_owned(),
        }
    }
}

/// The CPU time (ns) in a `/proc/…/schedstat` text: its first field.
pub fn parse_schedstat(text: &str) -> Option<u64> {
    text.split_whitespace().next()?.parse().ok()
}

/// The CPU time of a process in clock ticks, `utime + stime`, from a
/// `/proc/<pid>/stat` text. Unlike the threads' `schedstat`, it keeps the
/// time of threads that have already ended. The process name (field 2) may
/// hold spaces and parentheses, so the fields are counted from its last `)`.
pub fn parse_stat_cpu_ticks(text: &str) -> Option<u64> {
    let after_name = &text[text.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace();
    // After the name: state (3), ppid, pgrp, session, tty_nr, tpgid, flags,
    // minflt, cminflt, majflt, cmajflt, utime (14), stime (15).
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`), the unit of
/// [`parse_stat_cpu_ticks`].
pub fn clock_ticks_per_sec() -> Result<u64, String> {
    let out = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .map_err(|e| format!("getconf CLK_TCK: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|e| format!("getconf CLK_TCK: {e}"))
}

/// The CPU time (µs) process `pid` has used (all its threads, ended ones
/// included), from `/proc/<pid>/stat`; `None` once it has exited.
pub fn process_stat_cpu_us(pid: u32, ticks_per_sec: u64) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(parse_stat_cpu_ticks(&text)? * 1_000_000 / ticks_per_sec.max(1))
}

/// The CPU time (ns) of every thread of process `pid` (`self` for this
/// one) whose name is not `skip`.
pub fn process_cpu_ns(pid: &str, skip: Option<&str>) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.flatten() {
        let dir = task.path();
        if let Some(skip) = skip
            && std::fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.trim() == skip)
        {
            continue;
        }
        // A thread that ended between the listing and the read is skipped.
        if let Some(ns) = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .as_deref()
            .and_then(parse_schedstat)
        {
            total += ns;
        }
    }
    Some(total)
}

/// This process's CPU time (ns), the proxy's threads left out.
pub fn client_cpu_ns() -> Option<u64> {
    process_cpu_ns("self", Some(crate::wire::THREAD_NAME))
}

/// The pid of the oldest process whose `comm` is one of `names`.
pub fn pid_named(names: &[&str]) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| names.contains(&c.trim())))
        .min()
}

/// The sum of `names`' values in rows of `(name, value)` (such as `SHOW
/// STATUS`); `None` if one is missing or not a number.
pub fn sum_status(rows: &[(String, String)], names: &[&str]) -> Option<u64> {
    names
        .iter()
        .map(|n| {
            rows.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(n))
                .and_then(|(_, v)| v.trim().parse::<u64>().ok())
        })
        .sum()
}

/// Reads an engine's counters (everything but the client's CPU).
pub trait Probe: Send + Sync {
    /// What the log and server CPU figures cover.
    fn scope(&self) -> &'static str;
    /// The counters now.
    fn sample(&self) -> impl Future<Output = Result<Sample, BoxError>> + Send;
}

/// Runs each of `paths` `ops` times on `bench` (one request after another)
/// and answers each path's cost per request. Keys the last path that
/// returned any produced are what `replay` replays, as in the suite.
pub async fn measure<P: Paths, R: Probe>(
    bench: &P,
    probe: &R,
    wire: Option<&crate::wire::Wire>,
    engine: &str,
    workload: &str,
    paths: &[&'static str],
    ops: u64,
) -> Result<Vec<Cost>, BoxError> {
    let mut used = Vec::new();
    let mut out = Vec::new();
    for path in paths {
        let mut keys = Vec::new();
        // One request first, so connecting and preparing statements are not counted.
        keys.extend(bench.one(path, 0, 0, &used).await?);
        // The probe's own statements fall outside the counted window.
        let mut before = probe.sample().await?;
        before.round_trips = wire.map(|w| w.round_trips());
        before.client_cpu_ns = client_cpu_ns();
        for n in 1..=ops {
            keys.extend(bench.one(path, 0, n, &used).await?);
        }
        let (client, round_trips) = (client_cpu_ns(), wire.map(|w| w.round_trips()));
        let mut after = probe.sample().await?;
        after.client_cpu_ns = client;
        after.round_trips = round_trips;
        let mut cost = Cost::between(&before, &after, ops, probe.scope());
        cost.engine = engine.to_owned();
        cost.workload = workload.to_owned();
        cost.path = (*path).to_owned();
        println!(
            "{engine:>8} {workload:>9} cost {path:>13}: round trips {}, rows {}, log records {}, log bytes {}, server CPU µs {}, client CPU µs {} ({})",
            show(cost.round_trips),
            show(cost.rows_written),
            show(cost.log_records),
            show(cost.log_bytes),
            show(cost.server_cpu_us),
            show(cost.client_cpu_us),
            cost.scope,
        );
        out.push(cost);
        if !keys.is_empty() {
            used = keys;
        }
    }
    Ok(out)
}

/// A counted target of the cost meter checked against one run: a fresh
/// call's figure against the bare transaction's on the same engine and
/// workload.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CostTarget {
    /// `postgres`, `mysql` or `sqlite`.
    pub engine: String,
    /// `micro` or `transfer`.
    pub workload: String,
    /// What is compared: `round trips`, `log records`, `rows written` or
    /// `CPU µs (server + client)`.
    pub figure: String,
    /// The bare transaction's figure per request.
    pub bare: f64,
    /// A fresh call's figure per request.
    pub fresh: f64,
    /// `fresh − bare` for counts, `fresh / bare` for CPU.
    pub measured: f64,
    /// The target, as written (`= bare`, `≤ bare + 2`, `≤ 1.3×`).
    pub target: String,
    /// Whether `measured` reaches it.
    pub met: bool,
}

/// How far an averaged count may sit from a whole number and still count
/// as it (a stray write or round trip of the server in 300 requests).
const COUNT_SLACK: f64 = 0.05;

/// The counted targets the runs in `costs` can be checked against:
///
/// - PostgreSQL: a fresh call's round trips equal the bare transaction's,
///   its WAL records are at most the bare's plus 2 (the completed row's
///   heap tuple and its primary-key entry), and on the transfer its CPU
///   (server and client) is at most 1.3× the bare's.
/// - MariaDB/MySQL and SQLite: a fresh call writes the bare's rows plus 1
///   (the completed record).
///
/// An engine and workload without both a bare and a fresh figure gives no
/// row.
pub fn cost_targets(costs: &[Cost]) -> Vec<CostTarget> {
    let mut out = Vec::new();
    let mut seen: Vec<(&str, &str)> = Vec::new();
    for c in costs {
        let (engine, workload) = (c.engine.as_str(), c.workload.as_str());
        if seen.contains(&(engine, workload)) {
            continue;
        }
        seen.push((engine, workload));
        let path = |name: &str| {
            costs
                .iter()
                .find(|x| x.engine == engine && x.workload == workload && x.path == name)
        };
        let (Some(bare), Some(fresh)) = (path("bare"), path("fresh")) else {
            continue;
        };
        let mut push =
            |figure: &str, b: Option<f64>, f: Option<f64>, target: &str, check: &dyn Fn(f64, f64) -> (f64, bool)| {
                if let (Some(b), Some(f)) = (b, f) {
                    let (measured, met) = check(b, f);
                    out.push(CostTarget {
                        engine: engine.to_owned(),
                        workload: workload.to_owned(),
                        figure: figure.to_owned(),
                        bare: b,
                        fresh: f,
                        measured,
                        target: target.to_owned(),
                        met,
                    });
                }
            };
        let cpu = |c: &Cost| Some(c.server_cpu_us? + c.client_cpu_us?);
        match engine {
            "postgres" => {
                push("round trips", bare.round_trips, fresh.round_trips, "= bare", &|b, f| {
                    (f - b, (f - b).abs() <= COUNT_SLACK)
                });
                push(
                    "log records",
                    bare.log_records,
                    fresh.log_records,
                    "≤ bare + 2",
                    &|b, f| (f - b, f - b <= 2.0 + COUNT_SLACK),
                );
                if workload == "transfer" {
                    push(
                        "CPU µs (server + client)",
                        cpu(bare),
                        cpu(fresh),
                        "≤ 1.3×",
                        &|b, f| {
                            let ratio = if b > 0.0 { f / b } else { f64::INFINITY };
                            (ratio, ratio <= 1.3)
                        },
                    );
                }
            }
            "mysql" | "sqlite" => {
                push(
                    "rows written",
                    bare.rows_written,
                    fresh.rows_written,
                    "= bare + 1",
                    &|b, f| (f - b, (f - b - 1.0).abs() <= COUNT_SLACK),
                );
            }
            _ => {}
        }
    }
    out
}

/// A figure with two decimals, `—` if missing.
pub fn show(value: Option<f64>) -> String {
    value.map_or("—".into(), |v| format!("{v:.2}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(engine: &str, workload: &str, path: &str, figures: [Option<f64>; 5]) -> Cost {
        let [round_trips, rows_written, log_records, server_cpu_us, client_cpu_us] = figures;
        Cost {
            engine: engine.into(),
            workload: workload.into(),
            path: path.into(),
            ops: 300,
            round_trips,
            rows_written,
            log_records,
            log_bytes: None,
            server_cpu_us,
            client_cpu_us,
            scope: "backend".into(),
        }
    }

    /// Each engine is held to its own counted targets, fresh against bare
    /// on the same workload; a count a hair off a whole number still counts
    /// as it, one request's worth more does not.
    #[test]
    fn checks_the_counted_targets() {
        // engine, workload, path: round trips, rows written, log records,
        // server CPU µs, client CPU µs.
        #[rustfmt::skip]
        let figures = [
            ("postgres", "micro", "bare", [Some(5.0), Some(1.0), Some(3.01), Some(270.0), Some(240.0)]),
            ("postgres", "micro", "fresh", [Some(5.0), Some(2.0), Some(5.02), Some(500.0), Some(230.0)]),
            ("postgres", "micro", "replay", [Some(4.0), Some(0.0), Some(0.0), Some(150.0), Some(130.0)]),
            ("postgres", "transfer", "bare", [Some(9.0), Some(5.0), Some(11.0), Some(600.0), Some(400.0)]),
            ("postgres", "transfer", "fresh", [Some(10.0), Some(7.0), Some(16.0), Some(900.0), Some(420.0)]),
            ("mysql", "micro", "bare", [Some(5.0), Some(1.0), None, None, Some(200.0)]),
            ("mysql", "micro", "fresh", [Some(7.0), Some(3.0), None, None, Some(250.0)]),
            ("sqlite", "micro", "bare", [None, Some(1.0), None, None, Some(90.0)]),
            ("sqlite", "micro", "fresh", [None, Some(2.0), None, None, Some(120.0)]),
            ("sqlite", "transfer", "fresh", [None, Some(6.0), None, None, Some(120.0)]),
        ];
        let costs = figures.map(|(engine, workload, path, figures)| cost(engine, workload, path, figures));
        let targets = cost_targets(&costs);
        let find = |engine: &str, workload: &str, figure: &str| {
            targets
                .iter()
                .find(|t| t.engine == engine && t.workload == workload && t.figure == figure)
                .unwrap_or_else(|| panic!("no {engine} {workload} {figure} in {targets:?}"))
        };
        assert!(find("postgres", "micro", "round trips").met);
        let wal = find("postgres", "micro", "log records");
        assert!(wal.met && (wal.measured - 2.01).abs() < 1e-9, "{wal:?}");
        assert!(!find("postgres", "transfer", "round trips").met);
        assert!(!find("postgres", "transfer", "log records").met);
        let cpu = find("postgres", "transfer", "CPU µs (server + client)");
        assert!(!cpu.met && (cpu.measured - 1.32).abs() < 1e-9, "{cpu:?}");
        assert!(!find("mysql", "micro", "rows written").met);
        assert!(find("sqlite", "micro", "rows written").met);
        // CPU is a target on the transfer only; SQLite's transfer has no bare.
        assert!(
            !targets
                .iter()
                .any(|t| t.workload == "micro" && t.figure.starts_with("CPU"))
        );
        assert!(!targets.iter().any(|t| t.engine == "sqlite" && t.workload == "transfer"));
        assert_eq!(targets.len(), 7, "{targets:?}");
    }

    /// Per-request figures are the counters' deltas over the requests, CPU
    /// in µs; a counter missing on either side gives no figure.
    #[test]
    fn divides_deltas_by_requests() {
        let before = Sample {
            round_trips: Some(10),
            rows: Some(100),
            log_records: Some(1_000),
            log_bytes: Some(50_000),
            server_cpu_ns: Some(1_000_000),
            client_cpu_ns: Some(2_000_000),
        };
        let after = Sample {
            round_trips: Some(310),
            rows: Some(300),
            log_records: Some(1_600),
            log_bytes: Some(120_000),
            server_cpu_ns: Some(31_000_000),
            client_cpu_ns: None,
        };
        let c = Cost::between(&before, &after, 100, "backend");
        assert_eq!(c.round_trips, Some(3.0));
        assert_eq!(c.rows_written, Some(2.0));
        assert_eq!(c.log_records, Some(6.0));
        assert_eq!(c.log_bytes, Some(700.0));
        assert_eq!(c.server_cpu_us, Some(300.0));
        assert_eq!(c.client_cpu_us, None);
        assert_eq!(c.scope, "backend");
        // No requests, no figures; a counter that went back gives zero.
        assert_eq!(Cost::between(&before, &after, 0, "x").round_trips, None);
        assert_eq!(Cost::between(&after, &before, 1, "x").rows_written, Some(0.0));
    }

    /// The first schedstat field is the CPU time in ns.
    #[test]
    fn parses_schedstat_and_status() {
        assert_eq!(parse_schedstat("4755029079 19150908845 11867\n"), Some(4_755_029_079));
        assert_eq!(parse_schedstat(""), None);
        assert_eq!(parse_schedstat("x 1 2"), None);
        let rows = vec![
            ("Handler_write".to_owned(), "7".to_owned()),
            ("Handler_update".to_owned(), "2".to_owned()),
            ("handler_delete".to_owned(), "1".to_owned()),
        ];
        assert_eq!(
            sum_status(&rows, &["Handler_write", "Handler_update", "Handler_delete"]),
            Some(10)
        );
        assert_eq!(sum_status(&rows, &["Handler_write", "Handler_read_key"]), None);
    }

    /// utime and stime are fields 14 and 15 of `/proc/<pid>/stat`, counted
    /// after the process name whatever it holds.
    #[test]
    fn parses_stat_cpu_ticks() {
        let line = "4242 (idem gw (x)) S 1 4242 4242 0 -1 4194560 1200 0 3 0 250 75 0 0 20 0 9 0 100 0 0\n";
        assert_eq!(parse_stat_cpu_ticks(line), Some(325));
        assert_eq!(parse_stat_cpu_ticks("4242 (idem) S 1 2"), None);
        assert_eq!(parse_stat_cpu_ticks("no name here"), None);
        let own = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat is readable");
        assert!(parse_stat_cpu_ticks(&own).is_some());
        assert!(clock_ticks_per_sec().is_ok_and(|t| t > 0));
    }

    /// This process's CPU time is readable and grows with work.
    #[test]
    fn reads_this_process_cpu() {
        let before = client_cpu_ns().expect("schedstat is readable");
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(client_cpu_ns().unwrap() > before);
    }
}
