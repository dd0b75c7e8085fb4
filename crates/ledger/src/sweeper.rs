//! The server's sweeper: expired rows of every keyed table the ledger
//! writes — request keys, the webhook and projection inboxes, job runs and
//! payout leases — are deleted in bounded, paced batches while it runs.
//! Without it those tables only grow.
//!
//! Several instances on one database may all sweep: each batch deletes rows
//! that are already expired (`SKIP LOCKED` on PostgreSQL and MariaDB, the
//! single writer on SQLite), so they only share the work. The time is the
//! database's (the anchored clock), as for claims.
//!
//! Metrics: `ledger_sweep_runs_total{table, result="ok"|"error"}` and, from
//! the core, `idem_swept_total`.

use std::time::Duration;

use idem_core::{SharedClock, Sweep, SweepOptions, TableName};

use crate::db::{JOB_RUNS_TABLE, LedgerDb, PAYOUT_LEASES_TABLE, PROJECTION_INBOX_TABLE, WEBHOOK_INBOX_TABLE};

/// Counter: sweeps of one table (`table`, `result` = `ok` | `error`).
pub const SWEEP_RUNS: &str = "ledger_sweep_runs_total";

/// The keyed tables the sweeper clears, the request keys' first.
pub fn tables() -> Vec<TableName> {
    std::iter::once(crate::Store::keys_table())
        .chain(
            [
                WEBHOOK_INBOX_TABLE,
                PROJECTION_INBOX_TABLE,
                JOB_RUNS_TABLE,
                PAYOUT_LEASES_TABLE,
            ]
            .into_iter()
            .map(|t| TableName::new(t).expect("a valid table name")),
        )
        .collect()
}

/// How one sweep runs: batches of 1 000 rows 10 ms apart, at most 100 per
/// table (what is left waits for the next run).
pub fn options() -> SweepOptions {
    SweepOptions {
        batch_size: 1_000,
        pause: Duration::from_millis(10),
        max_batches: Some(100),
    }
}

/// Sweeps every keyed table once; answers the rows deleted per table. A
/// table that fails is logged and counted, and the others are still swept.
pub async fn sweep_once<D: LedgerDb + Sweep>(db: &D, clock: &SharedClock) -> Vec<(TableName, Result<u64, String>)> {
    let mut done = Vec::new();
    for table in tables() {
        let store = db.keyed(table.clone());
        let result = idem_core::sweep_expired(&store, clock.as_ref(), options())
            .await
            .map(|r| r.deleted)
            .map_err(|e| e.to_string());
        let label = if result.is_ok() { "ok" } else { "error" };
        metrics::counter!(SWEEP_RUNS, "table" => table.as_str().to_owned(), "result" => label).increment(1);
        match &result {
            Ok(n) if *n > 0 => tracing::info!(table = table.as_str(), deleted = n, "swept expired rows"),
            Ok(_) => {}
            Err(e) => tracing::warn!(table = table.as_str(), error = %e, "sweep failed; retried next run"),
        }
        done.push((table, result));
    }
    done
}

/// Sweeps every `every` until `stopped` turns true.
pub async fn run<D: LedgerDb + Sweep>(
    db: D,
    clock: SharedClock,
    every: Duration,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        sweep_once(&db, &clock).await;
        tokio::select! {
            _ = stopped.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}
