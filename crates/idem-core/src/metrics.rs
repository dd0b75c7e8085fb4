//! Metric names and recording helpers (through the `metrics` facade; install
//! any recorder, such as the Prometheus exporter, to collect them).

use std::time::Duration;

use crate::scope::Operation;

/// Counter: claims won (`operation`, `mode` = `transactional` | `lease`).
pub const CLAIMS: &str = "idem_claims_total";
/// Counter: recorded outcomes replayed (`operation`).
pub const REPLAYS: &str = "idem_replays_total";
/// Counter: keys reused with a different request (`operation`).
pub const MISMATCHES: &str = "idem_mismatches_total";
/// Counter: twins reported in flight (`operation`).
pub const IN_FLIGHT: &str = "idem_in_flight_total";
/// Counter: claims given back unused: rollbacks and lease releases (`operation`).
pub const RELEASES: &str = "idem_releases_total";
/// Counter: outcomes recorded (`operation`, `status` = `completed` | `rejected`).
pub const RECORDS: &str = "idem_records_total";
/// Counter: outcomes marked unknown: the work may have taken effect and
/// the key is held until resolved (`operation`).
pub const UNKNOWN: &str = "idem_unknown_outcomes_total";
/// Counter: retries refused because their key's outcome is unknown (`operation`).
pub const UNKNOWN_HELD: &str = "idem_unknown_held_total";
/// Counter: unknown outcomes resolved (`operation`, `resolution` =
/// `applied` | `not_applied`).
pub const UNKNOWN_RESOLVED: &str = "idem_unknown_resolved_total";
/// Counter: leases marked sent before their request left the process (`operation`).
pub const SENT: &str = "idem_sent_marks_total";
/// Counter: completions or releases the store refused and that were tried
/// again (`operation`).
pub const SETTLE_RETRIES: &str = "idem_settle_retries_total";
/// Counter: lease holders fenced off by a newer claim (`operation`).
pub const FENCED: &str = "idem_fenced_total";
/// Counter: leases lost while their holder was still working: an extension
/// was fenced because another caller had taken the key over (`operation`).
pub const LEASES_LOST: &str = "idem_leases_lost_total";
/// Histogram: seconds from the start of a call to its claim or replay decision (`operation`).
pub const CLAIM_SECONDS: &str = "idem_claim_duration_seconds";
/// Counter: transactions run again after contention (a deadlock, a
/// serialisation failure or a lock wait that ran out) while nothing had
/// committed (`operation`, `stage` = `claim` | `work` | `commit`).
pub const TX_RETRIES: &str = "idem_tx_retries_total";
/// Counter: expired keys deleted by the sweeper.
pub const SWEPT: &str = "idem_swept_total";
/// Counter: index entries the sweeper removed whose row the store had
/// already expired by itself (Redis); no key was deleted for them.
pub const SWEPT_GHOSTS: &str = "idem_sweep_ghosts_total";

// The operation label shares the operation's name rather than copying it
// per call.

pub(crate) fn count(name: &'static str, operation: &Operation) {
    metrics::counter!(name, "operation" => operation.metric_label()).increment(1);
}

pub(crate) fn lease_lost(operation: &Operation) {
    count(LEASES_LOST, operation);
}

pub(crate) fn unknown_resolved(operation: &Operation, resolution: &'static str) {
    metrics::counter!(UNKNOWN_RESOLVED, "operation" => operation.metric_label(), "resolution" => resolution)
        .increment(1);
}

pub(crate) fn claim(operation: &Operation, mode: &'static str) {
    metrics::counter!(CLAIMS, "operation" => operation.metric_label(), "mode" => mode).increment(1);
}

pub(crate) fn record(operation: &Operation, status: &'static str) {
    metrics::counter!(RECORDS, "operation" => operation.metric_label(), "status" => status).increment(1);
}

pub(crate) fn claim_latency(operation: &Operation, elapsed: Duration) {
    metrics::histogram!(CLAIM_SECONDS, "operation" => operation.metric_label()).record(elapsed.as_secs_f64());
}

/// Where in a transactional call contention struck.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Stage {
    /// Opening the transaction or claiming the key.
    Claim,
    /// The caller's work (its own statements, or an HTTP handler).
    Work,
    /// Recording the outcome and committing.
    Commit,
}

impl Stage {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Claim => "claim",
            Stage::Work => "work",
            Stage::Commit => "commit",
        }
    }
}

/// Counts one run of a transactional call started again after contention
/// at `stage` ([`TX_RETRIES`]).
pub fn tx_retry(operation: &str, stage: Stage) {
    metrics::counter!(TX_RETRIES, "operation" => operation.to_owned(), "stage" => stage.as_str()).increment(1);
}
