//! Short chaos runs on every engine (every fault on) must find no violation
//! while the faults really happen; with the claim switched off, the checker
//! must find double applications. Seeds come from `CHAOS_SEED` or are random,
//! and are printed so a failure can be replayed with `--seed`. The events
//! run too: relays and projectors killed, the broker restarted, every
//! committed event published and applied exactly once. So do payouts: two
//! payout workers killed and paused past their lease, a vendor dropping
//! answers after paying, failing and refusing connections, every dead letter
//! redriven at the end, each committed payout paid exactly once. Three
//! ledger instances on one database behind the balancer, killed one at a
//! time at random, hold the same properties, and the checker still catches
//! the claim switched off on all three.

use chaos::rng::seed_from_env;
use chaos::{Config, Engine, Report};

async fn short_run(engine: Engine) -> Report {
    let seed = seed_from_env();
    println!("chaos {}: seed {seed}", engine.name());
    let mut config = Config::new(engine, seed);
    config.ops = 2_000;
    let report = chaos::run(config)
        .await
        .unwrap_or_else(|e| panic!("chaos run failed (seed {seed}): {e}"));
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    report
}

/// Asserts what every run under the service's faults must show: no
/// violation after at least `ops` operations, three kills or more, dropped
/// responses and replays, database sessions killed if `sessions`, and the
/// ledger's money conserved.
fn assert_clean(report: &Report, ops: u64, sessions: bool) {
    let seed = report.seed;
    assert!(
        report.violations.is_empty(),
        "seed {seed}: violations: {:#?}",
        report.violations
    );
    assert!(report.counts.ops >= ops, "seed {seed}: ran {} ops", report.counts.ops);
    assert!(
        report.faults.kills() >= 3,
        "seed {seed}: only {} kills",
        report.faults.kills()
    );
    assert!(report.faults.responses_dropped > 0, "seed {seed}: no dropped response");
    assert!(report.counts.replays_seen > 0, "seed {seed}: no replay seen");
    if sessions {
        assert!(
            report.faults.sessions_killed > 0,
            "seed {seed}: no database session killed"
        );
    }
    assert_eq!(report.audit["conserved"], true);
}

/// Asserts that the checker caught keys applied twice.
fn assert_doubles_caught(report: &Report) {
    let doubles = report
        .violations
        .iter()
        .filter(|v| v.contains("applied") && !v.contains("applied 1 time"))
        .count();
    assert!(
        doubles > 0,
        "seed {}: no double application reported: {:#?}",
        report.seed,
        report.violations
    );
}

fn assert_clean_and_attacked(report: &Report, sessions: bool) {
    let seed = report.seed;
    assert_clean(report, 2_000, sessions);
    assert!(
        report.faults.fault_point_kills.values().sum::<u64>() > 0,
        "seed {seed}: no fault-point kill"
    );
    assert!(report.faults.connections_cut > 0, "seed {seed}: no cut request");
    assert!(
        report.counts.bursts > 0 && report.counts.mismatch_probes > 0,
        "seed {seed}: no burst or probe"
    );
    let (ef, ev) = (&report.event_faults, &report.events);
    assert!(ef.broker_restarts > 0, "seed {seed}: the broker was never restarted");
    assert!(
        ef.relay_kills > 0 && ef.projector_kills > 0,
        "seed {seed}: no relay or projector killed: {ef:?}"
    );
    assert!(
        ev.committed > 1_000 && ev.published == ev.committed && ev.applied == ev.committed,
        "seed {seed}: {ev:?}"
    );
    assert!(
        ev.redriven_after_panics > 0 && ev.dead_letters == 0,
        "seed {seed}: no dead letter of a panic redriven, or some left: {ev:?}"
    );
    let (pf, p) = (&report.payout_faults, &report.payouts);
    assert!(report.payouts_enabled);
    assert!(
        p.acknowledged > 0 && p.rejected > 0,
        "seed {seed}: no payout acknowledged or declined: {p:?}"
    );
    assert!(
        p.committed >= p.acknowledged && p.paid + p.cancelled == p.committed,
        "seed {seed}: payouts neither paid nor cancelled: {p:?}"
    );
    assert!(
        p.vendor_keys == p.paid && p.vendor_payouts == p.paid,
        "seed {seed}: the vendor's payouts differ from the paid ones: {p:?}"
    );
    // A redrive killed mid-send counts as a send that may have reached the
    // vendor: the service refuses to cancel (refund) every such payout.
    let rk = &p.redrive_kills;
    assert_eq!(rk.cancels_refused, rk.killed, "seed {seed}: {rk:?}");
    let sf = &report.faults.store_faults;
    for fault in ["refused", "timed_out", "applied_then_refused"] {
        assert!(
            sf.get(&format!("commit/{fault}")).is_some_and(|n| *n > 0),
            "seed {seed}: no commit {fault} injected: {sf:?}"
        );
    }
    // Every dead letter redriven, but the control's, which was cancelled.
    assert!(
        p.dead_lettered > 0 && p.redriven + rk.control_cancels == p.dead_lettered,
        "seed {seed}: no dead letter, or not all redriven: {p:?}"
    );
    assert!(
        pf.worker_kills > 0 && pf.worker_pauses_past_lease > 0,
        "seed {seed}: no payout worker killed or paused past its lease: {pf:?}"
    );
    assert!(
        pf.vendor_dropped_after_paying > 0 && p.vendor_replays > 0,
        "seed {seed}: no vendor answer dropped after paying, or no replay: {pf:?} {p:?}"
    );
    assert!(
        p.vendor_references == p.paid && p.vendor_lookups > 0,
        "seed {seed}: a reference paid twice, or no takeover crossed the vendor's key horizon: {p:?}"
    );
}

/// 2,000 operations on `engine` under every fault, no violation (its
/// database sessions killed too, if `sessions`).
async fn run_has_no_violation(engine: Engine, sessions: bool) {
    let report = short_run(engine).await;
    assert_clean_and_attacked(&report, sessions);
}

idem_conformance::cases!(run_has_no_violation, 4 => {
    /// SQLite: 2,000 operations under every fault, no violation.
    sqlite_run_has_no_violation(Engine::Sqlite, false);
    /// PostgreSQL: 2,000 operations under every fault, no violation.
    postgres_run_has_no_violation(Engine::Postgres, true);
    /// MariaDB: 2,000 operations under every fault, no violation.
    mysql_run_has_no_violation(Engine::Mysql, true);
});

/// With the idempotency claim switched off, the same workload must be caught applying keys twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn checker_catches_broken_idempotency() {
    let seed = seed_from_env();
    println!("chaos break-idempotency: seed {seed}");
    let mut config = Config::new(Engine::Sqlite, seed);
    config.ops = 400;
    config.break_idempotency = true;
    config.events = false;
    config.payouts = false;
    let report = chaos::run(config).await.unwrap();
    assert_doubles_caught(&report);
}

/// A short run of `instances` ledger servers on one database behind the
/// balancer: the main workload (top-ups, transfers, bursts, probes) under
/// every service fault, the events and payouts off.
async fn instances_run(engine: Engine, instances: usize, ops: usize, break_idempotency: bool) -> Report {
    let seed = seed_from_env();
    println!("chaos {} with {instances} instances: seed {seed}", engine.name());
    let mut config = Config::new(engine, seed);
    config.ops = ops;
    config.instances = instances;
    config.kill_interval_ms = 700;
    config.events = false;
    config.payouts = false;
    config.break_idempotency = break_idempotency;
    let started = std::time::Instant::now();
    let report = chaos::run(config)
        .await
        .unwrap_or_else(|e| panic!("chaos run failed (seed {seed}): {e}"));
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    println!(
        "| instance | port | requests | refused (passed on) | kills: random + scheduled + fault points | pauses | restarts |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (i, c) in report.per_instance.iter().enumerate() {
        println!(
            "| {i} | {} | {} | {} | {} + {} + {} | {} | {} |",
            c.port, c.served, c.refused, c.random_kills, c.scheduled_kills, c.fault_point_kills, c.pauses, c.restarts
        );
    }
    println!(
        "{} ops ({} ok, {} rejected, {} unknown), {} violation(s), {:.1} s",
        report.counts.ops,
        report.counts.ok,
        report.counts.rejected,
        report.counts.unknown,
        report.violations.len(),
        started.elapsed().as_secs_f64()
    );
    report
}

/// Asserts the instances were really attacked and really used: kills on at
/// least two instances, requests served by every one.
fn assert_instances_attacked(report: &Report, instances: usize) {
    let seed = report.seed;
    assert_eq!(report.per_instance.len(), instances, "seed {seed}");
    let killed = report.per_instance.iter().filter(|c| c.kills() > 0).count();
    assert!(
        killed >= 2,
        "seed {seed}: kills hit {killed} instance(s): {:#?}",
        report.per_instance
    );
    assert!(
        report.per_instance.iter().all(|c| c.served > 0),
        "seed {seed}: an instance served no request: {:#?}",
        report.per_instance
    );
    assert!(
        report.per_instance.iter().map(|c| c.refused).sum::<u64>() > 0,
        "seed {seed}: no connection met a dead instance and went on to the next: {:#?}",
        report.per_instance
    );
}

/// Three ledger instances on one database behind the balancer, each
/// killed and paused at random: no violation, kills on several instances,
/// requests on every one.
async fn three_instances_have_no_violation(engine: Engine) {
    let report = instances_run(engine, 3, 1_000, false).await;
    assert_clean(&report, 1_000, true);
    assert_instances_attacked(&report, 3);
}

idem_conformance::cases!(three_instances_have_no_violation, 4 => {
    /// PostgreSQL, three ledger instances: no violation, every instance used and several killed.
    postgres_three_instances_have_no_violation(Engine::Postgres);
    /// MariaDB, three ledger instances: no violation, every instance used and several killed.
    mysql_three_instances_have_no_violation(Engine::Mysql);
});

/// With the claim switched off on all three instances, the checker must
/// still find keys applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn checker_catches_broken_idempotency_across_three_instances() {
    let report = instances_run(Engine::Postgres, 3, 300, true).await;
    assert_doubles_caught(&report);
    assert!(
        report.per_instance.iter().all(|c| c.served > 0),
        "seed {}: an instance served no request: {:#?}",
        report.seed,
        report.per_instance
    );
}
