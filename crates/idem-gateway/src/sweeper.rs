//! The gateway's background sweeper: expired keys are deleted in bounded,
//! paced batches while the gateway runs, on every store (the SQL tables
//! would grow without it; on Redis it also clears the expiry index of the
//! entries whose rows Redis expired by their TTL).
//!
//! ```toml
//! [sweeper]
//! interval_secs = 60   # between runs; 0 turns the sweeper off
//! batch = 1000         # rows (or index entries) per batch
//! busy_percent = 20    # most of a run's time spent in its batches
//! pause_ms = 10        # least rest between batches
//! max_batches = 100    # per run; what is left waits for the next run
//! ```
//!
//! After each batch the sweeper rests in proportion to the time the batch
//! took, so that a run spends at most `busy_percent` of its time inside the
//! store and leaves the rest to live traffic, however slow the store is
//! today; `pause_ms` is only the least rest.
//!
//! Several gateways on one store may all sweep: each batch is atomic per
//! row (`SKIP LOCKED` on PostgreSQL and MySQL, one script per row on Redis,
//! the single writer on SQLite), so they only share the work. The time of a
//! run is the store's clock (the gateway's anchored clock), as for claims.
//!
//! Metrics: `idem_sweep_runs_total{result="ok"|"error"}`,
//! `idem_sweep_duration_seconds`, `idem_sweep_last_success_timestamp_seconds`,
//! and from the core `idem_swept_total` and `idem_sweep_ghosts_total`.

use std::time::{Duration, Instant};

use idem_core::{DEFAULT_SWEEP_BUSY_PERCENT, SharedClock, SweepOptions};
use serde::Deserialize;
use tokio::task::JoinHandle;

use crate::config::ConfigError;
use crate::store::AnyLease;

/// Counter: sweeper runs (`result` = `ok` | `error`).
pub const SWEEP_RUNS: &str = "idem_sweep_runs_total";
/// Histogram: seconds one sweeper run took.
pub const SWEEP_SECONDS: &str = "idem_sweep_duration_seconds";
/// Gauge: when the last run succeeded (seconds since the epoch, store clock).
pub const SWEEP_LAST_SUCCESS: &str = "idem_sweep_last_success_timestamp_seconds";

/// The `[sweeper]` table of the gateway's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SweeperConfig {
    /// Seconds between runs; 0 turns the background sweep off.
    pub interval_secs: u64,
    /// Rows (or Redis index entries) per batch, 1 to 100 000.
    pub batch: u32,
    /// The least rest between batches, ms.
    pub pause_ms: u64,
    /// The most of a run's time spent in its batches, in percent (1 to
    /// 100): each batch is followed by a rest in proportion to its own time
    /// (see [`SweepOptions::busy_percent`]).
    pub busy_percent: u8,
    /// Batches per run at most (at least 1): a run is bounded (each batch
    /// and its rest, which is at most 10 s), and what is left waits for the
    /// next run, an interval after this one ends.
    pub max_batches: u64,
}

impl Default for SweeperConfig {
    fn default() -> Self {
        Self {
            interval_secs: 60,
            batch: 1_000,
            pause_ms: 10,
            busy_percent: DEFAULT_SWEEP_BUSY_PERCENT,
            max_batches: 100,
        }
    }
}

impl SweeperConfig {
    /// Refuses settings that cannot work, naming them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=100_000).contains(&self.batch) {
            return Err(ConfigError(format!(
                "[sweeper] batch = {} must be 1 to 100000",
                self.batch
            )));
        }
        if self.max_batches == 0 {
            return Err(ConfigError("[sweeper] max_batches must be at least 1".into()));
        }
        if self.pause_ms > 60_000 {
            return Err(ConfigError(format!(
                "[sweeper] pause_ms = {} must be at most 60000",
                self.pause_ms
            )));
        }
        if !(1..=100).contains(&self.busy_percent) {
            return Err(ConfigError(format!(
                "[sweeper] busy_percent = {} must be 1 to 100",
                self.busy_percent
            )));
        }
        Ok(())
    }
}

/// A running sweeper; dropping it stops it (a batch in flight is dropped
/// with it: each batch is atomic per row, so nothing is left half done).
#[derive(Debug)]
pub struct Sweeper {
    task: Option<JoinHandle<()>>,
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Sweeper {
    /// Starts sweeping `store` on `clock` as `config` says (nothing runs
    /// when its interval is 0); the first run comes one interval after the
    /// start.
    pub fn start(store: AnyLease, clock: SharedClock, config: &SweeperConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        if config.interval_secs == 0 {
            tracing::info!("background sweep off ([sweeper] interval_secs = 0)");
            return Ok(Self { task: None });
        }
        let interval = Duration::from_secs(config.interval_secs);
        let options = SweepOptions {
            batch_size: config.batch,
            pause: Duration::from_millis(config.pause_ms),
            busy_percent: config.busy_percent,
            max_batches: Some(config.max_batches),
        };
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
            // A run slower than the interval is followed by the next one an
            // interval later, never by a burst of catch-up runs.
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                run_once(&store, &clock, options).await;
            }
        });
        Ok(Self { task: Some(task) })
    }
}

async fn run_once(store: &AnyLease, clock: &SharedClock, options: SweepOptions) {
    let started = Instant::now();
    match idem_core::sweep_expired(store, &**clock, options).await {
        Ok(report) => {
            metrics::counter!(SWEEP_RUNS, "result" => "ok").increment(1);
            metrics::gauge!(SWEEP_LAST_SUCCESS).set(clock.now_ms() as f64 / 1000.0);
            if report.batches >= options.max_batches.unwrap_or(u64::MAX) {
                tracing::info!(
                    deleted = report.deleted,
                    ghosts = report.ghosts,
                    batches = report.batches,
                    "sweep run reached [sweeper] max_batches; the rest waits for the next run"
                );
            } else {
                tracing::debug!(
                    deleted = report.deleted,
                    ghosts = report.ghosts,
                    batches = report.batches,
                    "swept expired keys"
                );
            }
        }
        Err(e) => {
            metrics::counter!(SWEEP_RUNS, "result" => "error").increment(1);
            tracing::warn!(
                error = %idem_core::redact_credentials(&e.to_string()),
                "sweep run failed; the next run tries again"
            );
        }
    }
    metrics::histogram!(SWEEP_SECONDS).record(started.elapsed().as_secs_f64());
}
