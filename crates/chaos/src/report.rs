//! What a run reports: the workload's counts, the faults that happened,
//! each instance and database node, and the violations.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::{Faults, events, payouts};

/// Counts of one run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Counts {
    /// Logical operations issued (excluding setup).
    pub ops: u64,
    /// Acknowledged as applied.
    pub ok: u64,
    /// Acknowledged as rejected (insufficient funds).
    pub rejected: u64,
    /// Never got a definite answer.
    pub unknown: u64,
    /// Requests sent again after a failed attempt.
    pub retries: u64,
    /// Responses marked `Idempotent-Replayed: true`.
    pub replays_seen: u64,
    /// 409 in-flight answers.
    pub in_flight_seen: u64,
    /// Bursts of identical concurrent requests.
    pub bursts: u64,
    /// Keys reused with another body (each must be refused).
    pub mismatch_probes: u64,
}

/// Faults that really happened.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FaultCounts {
    /// Responses sent by the service that the client never got.
    pub responses_dropped: u64,
    /// Requests cut mid-way.
    pub connections_cut: u64,
    /// Delayed requests.
    pub delays: u64,
    /// `kill -9` at random moments.
    pub random_kills: u64,
    /// `kill -9` at a quarter, half and three quarters of the workload
    /// (so every run has kills however fast it goes).
    pub scheduled_kills: u64,
    /// `kill -9` at named fault points, by point.
    pub fault_point_kills: BTreeMap<String, u64>,
    /// Database sessions killed.
    pub sessions_killed: u64,
    /// Pauses of the service.
    pub pauses: u64,
    /// Service restarts.
    pub restarts: u64,
    /// Store faults injected into the service and the payout workers, by
    /// `call/fault` (`claim`, `commit`, `mark_sent`, … / `refused`,
    /// `timed_out`, `applied_then_refused`).
    pub store_faults: BTreeMap<String, u64>,
}

/// What happened to one ledger instance.
#[derive(Debug, Clone, Default, Serialize)]
pub struct InstanceCounts {
    /// The port it listened on.
    pub port: u16,
    /// Requests the balancer forwarded to it.
    pub served: u64,
    /// Connections it refused (it was down) that went to the next instance.
    pub refused: u64,
    /// `kill -9` at random moments.
    pub random_kills: u64,
    /// `kill -9` at fixed fractions of the workload.
    pub scheduled_kills: u64,
    /// `kill -9` at named fault points (all points).
    pub fault_point_kills: u64,
    /// Pauses.
    pub pauses: u64,
    /// Restarts.
    pub restarts: u64,
    /// The database node it connected to (an index into
    /// [`Report::database_nodes`]; 0 on a single server).
    pub database_node: usize,
    /// With the database on several nodes: `/healthz` answers of "database
    /// unavailable" (its node down, or not yet synced) the harness saw while
    /// it watched the instance every quarter of a second.
    pub database_unavailable: u64,
    /// With the database on several nodes: times `/healthz` answered 200
    /// again after such answers.
    pub recoveries: u64,
}

/// One server the run's database lived on.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DatabaseNode {
    /// The database's URL on it, its password masked (a file's path for
    /// SQLite).
    pub url: String,
    /// The processes that connected to it: `instance <i>`, `relay <i>`,
    /// `projector <i>`, `payouts <i>`.
    pub used_by: Vec<String>,
    /// Database sessions killed on it.
    pub sessions_killed: u64,
}

impl InstanceCounts {
    /// Every kill of this instance.
    pub fn kills(&self) -> u64 {
        self.random_kills + self.scheduled_kills + self.fault_point_kills
    }
}

impl FaultCounts {
    /// Every kill of the service.
    pub fn kills(&self) -> u64 {
        self.random_kills + self.scheduled_kills + self.fault_point_kills.values().sum::<u64>()
    }
}

/// The result of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The seed (`--seed` replays the same schedule).
    pub seed: u64,
    /// The engine.
    pub engine: String,
    /// Clients.
    pub clients: usize,
    /// Ledger server processes behind the balancer.
    pub instances: usize,
    /// Per instance: requests served, kills, pauses, restarts.
    pub per_instance: Vec<InstanceCounts>,
    /// Connections no instance accepted (all of them down at once).
    pub balancer_none_up: u64,
    /// The servers the database lived on (one, or each node of a MariaDB
    /// Galera cluster), with the processes on each.
    pub database_nodes: Vec<DatabaseNode>,
    /// Faults switched on.
    pub faults_enabled: Faults,
    /// Whether the claim was switched off.
    pub break_idempotency: bool,
    /// Workload counts.
    pub counts: Counts,
    /// Faults that happened.
    pub faults: FaultCounts,
    /// The final audit of the service.
    pub audit: serde_json::Value,
    /// Seconds the run took.
    pub duration_secs: f64,
    /// Seconds of each phase: setup (the ledger built if need be, the
    /// database and the processes started), workload, quiesce (faults stopped, the
    /// service healthy), payouts (settled, redriven, checked), history,
    /// events_and_stop (event checks, workers stopped), teardown.
    pub phase_secs: BTreeMap<String, f64>,
    /// Event faults that happened (with events on).
    pub event_faults: events::EventFaults,
    /// What the event checks saw (with events on).
    pub events: events::EventCounts,
    /// Whether payouts ran.
    pub payouts_enabled: bool,
    /// Payout faults that happened (with payouts on).
    pub payout_faults: payouts::PayoutFaults,
    /// What the payout checks saw (with payouts on).
    pub payouts: payouts::PayoutCounts,
    /// Every property that failed; empty when all held.
    pub violations: Vec<String>,
}
