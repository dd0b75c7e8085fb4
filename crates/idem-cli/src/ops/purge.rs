//! `idem ops purge`: deletes final operations (completed or compensated)
//! past their expiry, in bounded batches, until none is left or `--limit`
//! is reached. Running, held and compensating operations are never
//! deleted, whatever their age.

use std::time::Duration;

use idem_core::{DEFAULT_SWEEP_BUSY_PERCENT, SweepOptions};

use super::{OpsTable, list};
use crate::output::{Failure, print};

/// Operations deleted per batch: each batch is one statement in a
/// transaction of its own, so a batch's locks (on SQLite, the file's write
/// lock) are held only that long.
const BATCH: u32 = 500;

/// The rest between batches, room for the service's own writes: a sweep's
/// (`SweepOptions::rest_after`), in proportion to the batch's own time.
const PACING: SweepOptions = SweepOptions {
    batch_size: BATCH,
    pause: Duration::from_millis(10),
    busy_percent: DEFAULT_SWEEP_BUSY_PERCENT,
    max_batches: None,
};

/// Which operations `idem ops purge` deletes.
#[derive(Debug, clap::Args)]
pub(crate) struct PurgeArgs {
    #[command(flatten)]
    at: OpsTable,
    /// Only those expired at least this long ago (`90s`, `10m`, `2h`,
    /// `1d`), or `now`: every final operation past its expiry.
    #[arg(long, default_value = "now", value_parser = parse_expired_for)]
    older_than: i64,
    /// Delete at most this many (by default, every one that matches).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    limit: Option<u64>,
}

/// `now` (0 ms), or a duration as `idem ops list --older-than` takes one.
fn parse_expired_for(s: &str) -> Result<i64, String> {
    if s == "now" {
        return Ok(0);
    }
    list::parse_age(s).map_err(|e| format!("{e}, or now"))
}

/// Deletes the expired final operations, a batch at a time.
pub(super) async fn run(args: &PurgeArgs, json: bool) -> Result<(), Failure> {
    let ops = args.at.open().await?;
    // The database's clock, which the service's anchored clock reads: an
    // operator's host running ahead would delete what the service still
    // replays.
    let now = ops.database_now_ms().await?;
    let expired_by = now.saturating_sub(args.older_than);
    let cap = args.limit.unwrap_or(u64::MAX);
    let (mut deleted, mut batches) = (0u64, 0u64);
    // Batches until one deletes nothing: one may delete fewer than it
    // could (another purge took some of its rows), and the next looks
    // again. A failure stops the run; what its batches deleted stays
    // deleted, and running it again goes on.
    while deleted < cap {
        let batch = u32::try_from((cap - deleted).min(u64::from(BATCH))).unwrap_or(BATCH);
        let started = tokio::time::Instant::now();
        let n = ops.purge_expired(expired_by, batch).await?;
        let took = started.elapsed();
        batches += 1;
        deleted += n;
        if n == 0 || deleted >= cap {
            break;
        }
        tokio::time::sleep(PACING.rest_after(took)).await;
    }
    let table = ops.table().as_str();
    print(
        json,
        serde_json::json!({
            "table": table,
            "deleted": deleted,
            "batches": batches,
            "expired_by_ms": expired_by,
        }),
        format!("{table}: {deleted} final operation(s) past their expiry deleted"),
    );
    Ok(())
}
