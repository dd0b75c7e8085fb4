//! `idem sweep`: deletes expired keys in bounded batches, paced for live
//! traffic, with a progress bar on a terminal.
//!
//! The pacing is [`SweepOptions::rest_after`]'s: after each batch the sweep
//! rests in proportion to the time the batch took, so that it spends at
//! most `--busy-percent` of its time inside the store, however slow the
//! store is today; `--pause-ms` is only the least rest.

use std::time::Duration;

use idem_core::{DEFAULT_SWEEP_BUSY_PERCENT, KeyAdmin, Sweep, SweepOptions, TimeSource};
use idem_gateway::AnyLease;

use crate::output::{Failure, print};
use crate::store::{KeysTable, with_table};

/// The flags of `idem sweep`.
#[derive(Debug, clap::Args)]
pub(crate) struct SweepArgs {
    #[command(flatten)]
    at: KeysTable,
    /// Keys deleted per batch.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    batch: u32,
    /// The least rest between batches, in ms.
    #[arg(long, default_value_t = 10)]
    pause_ms: u64,
    /// The most of its time the sweep spends in its batches, in percent:
    /// each batch is followed by a rest in proportion to its own time,
    /// leaving the rest to live traffic.
    #[arg(long, default_value_t = DEFAULT_SWEEP_BUSY_PERCENT, value_parser = clap::value_parser!(u8).range(1..=100))]
    busy_percent: u8,
    /// Stop after this many batches.
    #[arg(long)]
    max_batches: Option<u64>,
}

/// Sweeps until a batch finds less than it could take (or `--max-batches`).
pub(crate) async fn run(args: SweepArgs, redis: &idem_gateway::RedisSettings, json: bool) -> Result<(), Failure> {
    let SweepArgs {
        at,
        batch,
        pause_ms,
        busy_percent,
        max_batches,
    } = args;
    let pacing = SweepOptions {
        batch_size: batch,
        pause: Duration::from_millis(pause_ms),
        busy_percent,
        max_batches,
    };
    let s = at.open_to_write(redis).await?;
    let now = s.source_now_ms().await?;
    let bar = if !json && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let expired = s.stats(now).await?.expired;
        let bar = indicatif::ProgressBar::new(expired);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} expired keys deleted ({per_sec})")
                .expect("a valid template"),
        );
        Some(bar)
    } else {
        None
    };
    let mut report = idem_core::SweepReport::default();
    loop {
        if max_batches.is_some_and(|m| report.batches >= m) {
            break;
        }
        let started = tokio::time::Instant::now();
        let done = s.sweep_batch(now, batch).await?;
        let took = started.elapsed();
        report.batches += 1;
        report.deleted += done.deleted;
        report.ghosts += done.ghosts;
        if let Some(bar) = &bar {
            bar.inc(done.deleted);
        }
        // Entries whose rows were already gone are work done too:
        // only a batch that found less than it could take is the last.
        if done.examined < u64::from(batch) || !pacing.allows_another(report.batches) {
            break;
        }
        let rest = pacing.rest_after(took);
        if !rest.is_zero() {
            tokio::time::sleep(rest).await;
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let (deleted, ghosts, batches) = (report.deleted, report.ghosts, report.batches);
    let v = with_table(
        &s,
        serde_json::json!({ "store": s.kind(), "deleted": deleted, "ghosts": ghosts, "batches": batches }),
    );
    let text = if matches!(s, AnyLease::Redis(_)) {
        format!(
            "{}: {deleted} expired keys deleted, {ghosts} index entries of keys Redis had expired removed, in {batches} batches",
            s.kind()
        )
    } else {
        format!("{}: {deleted} expired keys deleted in {batches} batches", s.kind())
    };
    print(json, v, text);
    Ok(())
}
