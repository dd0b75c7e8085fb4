//! The server's sweeper: expired rows of every keyed table the ledger
//! writes — request keys, the webhook and projection inboxes, job runs and
//! payout leases — are deleted in bounded, paced batches while it runs, and
//! so are the withdrawals' multi-step operations that ended (completed or
//! compensated) and outlived their TTL. Without it those tables only grow.
//! An operation still running, held or compensating is never deleted; a
//! withdrawal's own row (`GET /v1/withdrawals/{id}`) is not the operation's
//! and stays.
//!
//! Several instances on one database may all sweep: each batch deletes rows
//! that are already expired (`SKIP LOCKED` on PostgreSQL and MariaDB, the
//! single writer on SQLite), so they only share the work. The time is the
//! database's (the anchored clock), as for claims.
//!
//! Metrics: `ledger_sweep_runs_total{table, result="ok"|"error"}` and, from
//! the core, `idem_swept_total`.

use std::time::Duration;

use idem_core::multistep::MultiStepStore;
use idem_core::{DEFAULT_SWEEP_BUSY_PERCENT, SharedClock, Sweep, SweepOptions, TableName};

use crate::db::{
    JOB_RUNS_TABLE, LedgerDb, OPERATIONS_TABLE, PAYOUT_LEASES_TABLE, PROJECTION_INBOX_TABLE, WEBHOOK_INBOX_TABLE,
};

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

/// How one sweep runs: batches of 1 000 rows, each followed by a rest in
/// proportion to its own time so that the sweep spends at most 20% of its
/// time in the database (and at least 10 ms apart), at most 100 batches per
/// table (what is left waits for the next run).
pub fn options() -> SweepOptions {
    SweepOptions {
        batch_size: 1_000,
        pause: Duration::from_millis(10),
        busy_percent: DEFAULT_SWEEP_BUSY_PERCENT,
        max_batches: Some(100),
    }
}

/// Operations deleted per batch: fewer than keys, as an operation's row
/// carries its journal and response.
const OPERATIONS_BATCH: u32 = 500;

/// Deletes the withdrawals' final operations past their expiry
/// ([`LedgerDb::multi_steps`], table [`OPERATIONS_TABLE`]) at the clock's
/// time, in batches of 500 paced and capped as [`options`] says; answers
/// how many it deleted. A retry of a deleted operation's key would start a
/// new withdrawal: the operations' TTL
/// ([`WithdrawalsConfig::ttl`](crate::withdrawals::WithdrawalsConfig::ttl),
/// 7 days, that of the payout keys) is how long callers may retry.
pub async fn purge_operations<D: LedgerDb>(db: &D, clock: &SharedClock) -> idem_core::Result<u64> {
    let steps = db.multi_steps();
    let options = options();
    let now = clock.now_ms();
    let (mut deleted, mut batches) = (0u64, 0u64);
    while options.max_batches.is_none_or(|m| batches < m) {
        let started = tokio::time::Instant::now();
        let n = MultiStepStore::<D>::purge_expired(&steps, now, OPERATIONS_BATCH).await?;
        let took = started.elapsed();
        deleted += n;
        batches += 1;
        // Less than a full batch: nothing was left when it ran (or another
        // instance took part of it); the next run looks again.
        if n < u64::from(OPERATIONS_BATCH) || !options.allows_another(batches) {
            break;
        }
        tokio::time::sleep(options.rest_after(took)).await;
    }
    Ok(deleted)
}

/// Sweeps every keyed table once, then purges the expired final
/// operations; answers the rows deleted per table (the operations' last).
/// A table that fails is logged and counted, and the others are still
/// swept.
pub async fn sweep_once<D: LedgerDb + Sweep>(db: &D, clock: &SharedClock) -> Vec<(TableName, Result<u64, String>)> {
    let mut done = Vec::new();
    for table in tables() {
        let store = db.keyed(table.clone());
        let result = idem_core::sweep_expired(&store, clock.as_ref(), options())
            .await
            .map(|r| r.deleted)
            .map_err(|e| e.to_string());
        done.push(counted(table, result));
    }
    let operations = TableName::new(OPERATIONS_TABLE).expect("a valid table name");
    let result = purge_operations(db, clock).await.map_err(|e| e.to_string());
    done.push(counted(operations, result));
    done
}

/// Counts and logs one table's sweep.
fn counted(table: TableName, result: Result<u64, String>) -> (TableName, Result<u64, String>) {
    let label = if result.is_ok() { "ok" } else { "error" };
    metrics::counter!(SWEEP_RUNS, "table" => table.as_str().to_owned(), "result" => label).increment(1);
    match &result {
        Ok(n) if *n > 0 => tracing::info!(table = table.as_str(), deleted = n, "swept expired rows"),
        Ok(_) => {}
        Err(e) => tracing::warn!(table = table.as_str(), error = %e, "sweep failed; retried next run"),
    }
    (table, result)
}

/// Sweeps every `every` until `stopped` turns true. A run in progress is
/// dropped when it does (its batch in flight with it: each batch is one
/// statement or transaction, so nothing is left half done), so a stopping
/// server does not wait for a paced sweep of a large backlog.
pub async fn run<D: LedgerDb + Sweep>(
    db: D,
    clock: SharedClock,
    every: Duration,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stopped.wait_for(|s| *s) => return,
            _ = sweep_once(&db, &clock) => {}
        }
        tokio::select! {
            _ = stopped.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}
