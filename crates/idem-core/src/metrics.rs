//! Metric names and recording helpers (through the `metrics` facade; install
//! any recorder, such as the Prometheus exporter, to collect them).

use std::time::Duration;

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
/// Counter: lease holders fenced off by a newer claim (`operation`).
pub const FENCED: &str = "idem_fenced_total";
/// Histogram: seconds from the start of a call to its claim or replay decision (`operation`).
pub const CLAIM_SECONDS: &str = "idem_claim_duration_seconds";
/// Counter: expired keys deleted by the sweeper.
pub const SWEPT: &str = "idem_swept_total";

pub(crate) fn count(name: &'static str, operation: &str) {
    metrics::counter!(name, "operation" => operation.to_owned()).increment(1);
}

pub(crate) fn claim(operation: &str, mode: &'static str) {
    metrics::counter!(CLAIMS, "operation" => operation.to_owned(), "mode" => mode).increment(1);
}

pub(crate) fn record(operation: &str, status: &'static str) {
    metrics::counter!(RECORDS, "operation" => operation.to_owned(), "status" => status).increment(1);
}

pub(crate) fn claim_latency(operation: &str, elapsed: Duration) {
    metrics::histogram!(CLAIM_SECONDS, "operation" => operation.to_owned()).record(elapsed.as_secs_f64());
}
