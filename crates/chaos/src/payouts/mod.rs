//! Payouts under attack: a fake vendor of the harness's own (in this
//! process, on a free loopback port) that **forgets idempotency keys after
//! a short horizon** ([`VENDOR_KEY_HORIZON_SECS`]: the same request then
//! pays again), drops answers after paying, fails, rate-limits, slows down
//! and refuses connections; two `ledger payouts` worker processes killed
//! with `kill -9` and paused past their lease — and so past the vendor's
//! horizon — whose takeovers must ask the vendor (a lookup by reference)
//! instead of sending again; and, once all is quiet, every dead letter
//! redriven (asking the vendor first) and the set checks: each committed
//! payout paid exactly once at the vendor, none lost, nothing paid that no
//! transaction committed.
//!
//! One concern a file: the vendor and the control of its faults
//! (`vendor.rs`), the attacks on it (`vendor_attacks.rs`), the workers and
//! the attacks on them (`workers.rs`), the settling redrive and the reading
//! back (`settle.rs`), and the judge of what was read (`judge.rs`).

mod judge;
mod settle;
mod vendor;
mod vendor_attacks;
mod workers;

use std::time::Duration;

use serde::Serialize;

pub(crate) use settle::settle_and_check;
pub(crate) use vendor::{Vendor, VendorLedger};
pub(crate) use vendor_attacks::{HeldWindows, attack_vendor};
pub(crate) use workers::{attack_workers, start_workers};

/// The lease of a payout being paid, in seconds (short, so pauses and kills
/// hand payouts over within the run).
pub const LEASE_SECS: u64 = 3;
/// The payout workers' retry schedule (short, so dead letters happen within
/// the run).
const RETRY_DELAYS_MS: &str = "50,100,200,400";
/// How long the fake vendor remembers a key, in seconds: shorter than a
/// pause of a worker (twice its lease), so takeovers cross it.
pub const VENDOR_KEY_HORIZON_SECS: u64 = 3;
/// What the workers trust of it: a key younger than 3 − 1 seconds.
const VENDOR_HORIZON_MARGIN_SECS: u64 = 1;

/// Payout faults that really happened.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PayoutFaults {
    /// Payout workers killed with `kill -9` (each is restarted).
    pub worker_kills: u64,
    /// Payout workers stopped (SIGSTOP) for at least twice their lease, then
    /// continued.
    pub worker_pauses_past_lease: u64,
    /// Payout worker restarts.
    pub worker_restarts: u64,
    /// Answers the vendor dropped after paying (`apply_then_drop`).
    pub vendor_dropped_after_paying: u64,
    /// Injected 500s (nothing paid).
    pub vendor_500s: u64,
    /// Injected 429s with `Retry-After` (nothing paid).
    pub vendor_429s: u64,
    /// Windows in which the vendor answered late (`slow_ms`).
    pub vendor_slow_windows: u64,
    /// Outages: windows in which the vendor refused new connections
    /// (`refuse_ms`) and answered 500 on kept-alive ones.
    pub vendor_refuse_windows: u64,
    /// Windows in which the vendor dropped every answer after paying, held
    /// until a dropped payment was replayed (one per run, at a sixth of
    /// the workload).
    pub vendor_held_drop_windows: u64,
    /// Outages in which the vendor answered every call 500, held until a
    /// payout called in it was dead-lettered (one per run, at a third of
    /// the workload).
    pub vendor_held_outages: u64,
    /// When the held outage saw its dead letter: the final redrive waits
    /// until that letter is past the vendor's key horizon, so it asks the
    /// vendor before sending.
    #[serde(skip)]
    pub(crate) outage_letter_seen_at: Option<tokio::time::Instant>,
}

/// What the payout checks saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PayoutCounts {
    /// Payout requests the workload got a 201 for.
    pub acknowledged: u64,
    /// Payout requests declined (422 insufficient funds).
    pub rejected: u64,
    /// Payout requests without a definite answer.
    pub unknown: u64,
    /// Payouts the ledger committed (rows of `ledger_payouts`).
    pub committed: u64,
    /// Committed payouts `paid` at the end.
    pub paid: u64,
    /// Payouts dead-lettered during the run (dead letters recorded).
    pub dead_lettered: u64,
    /// Dead letters the final redrive resolved.
    pub redriven: u64,
    /// Payouts the vendor made (its `payouts` count).
    pub vendor_payouts: u64,
    /// Distinct keys the vendor paid.
    pub vendor_keys: u64,
    /// The vendor's total.
    pub vendor_total: u64,
    /// Answers the vendor replayed for a key it had paid.
    pub vendor_replays: u64,
    /// Distinct payout references the vendor paid.
    pub vendor_references: u64,
    /// Keys the vendor had forgotten when they came again (each such send
    /// would pay again: with the fix, none comes).
    pub vendor_keys_forgotten: u64,
    /// Lookups by reference the vendor answered (reconciles before a
    /// re-send past its horizon).
    pub vendor_lookups: u64,
    /// 409 `idempotency_key_in_use` answers (a re-send overtaking a slow
    /// first call).
    pub vendor_in_use: u64,
    /// Payouts whose outcome was held as unknown at some point (dead
    /// letters in state `unknown` before the final redrive).
    pub held_unknown: u64,
    /// Payouts cancelled (their amount refunded): only ever ones the vendor
    /// never paid.
    pub cancelled: u64,
    /// `idem dlq redrive` killed mid-send, and the cancels that followed.
    pub redrive_kills: crate::dlqkill::RedriveKills,
    /// Seconds from the end of the faults until every payout was settled,
    /// redriven and reconciled.
    pub settle_secs: f64,
}

/// Closes the store's connections now, not at the pool's idle timeout: no
/// session of the harness outlives the run's database.
async fn close(store: &ledger::Store) {
    let closed = async {
        match store {
            ledger::Store::Postgres(s) => s.pool().close().await,
            ledger::Store::MySql(s) => s.pool().close().await,
            ledger::Store::Sqlite(s) => s.pool().close().await,
        }
    };
    if tokio::time::timeout(Duration::from_secs(10), closed).await.is_err() {
        eprintln!("chaos: the payout checks' connections did not close within 10 s");
    }
}
