//! Short withdrawals runs on every engine: multi-step operations across
//! two vendors, the ledger and a completer process killed at random and at
//! the named points of runs, their store failing on purpose and their
//! database sessions killed, the vendors losing answers, forgetting keys and
//! failing lookups, an operator's pass over what was held. Each must find
//! no violation while the faults really happen; with the recovery points
//! switched off, the judge must find the double effects they prevent.
//! Seeds come from `CHAOS_SEED` or are random, and are printed.

use chaos::Engine;
use chaos::rng::seed_from_env;
use chaos::withdrawals::{WithdrawalsConfig, WithdrawalsReport, run_withdrawals};

/// Withdrawals of each short run (`chaos --withdrawals --ops N` runs longer ones).
const WITHDRAWALS: usize = 60;

async fn short_run(engine: Engine, broken: bool) -> WithdrawalsReport {
    let seed = seed_from_env();
    println!("chaos withdrawals {}: seed {seed} (broken: {broken})", engine.name());
    let mut config = WithdrawalsConfig::new(engine, seed);
    config.withdrawals = WITHDRAWALS;
    config.break_recovery_points = broken;
    let report = run_withdrawals(config)
        .await
        .unwrap_or_else(|e| panic!("withdrawals run failed (seed {seed}): {e}"));
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    report
}

fn assert_clean_and_attacked(report: &WithdrawalsReport) {
    let seed = report.seed;
    assert!(
        report.violations.is_empty(),
        "seed {seed}: violations: {:#?}",
        report.violations
    );
    assert_eq!(report.clients.requested, WITHDRAWALS as u64, "seed {seed}");
    assert!(
        report.counts.debited > 40,
        "seed {seed}: only {} debited",
        report.counts.debited
    );
    assert!(
        report.clients.paid > 0 && report.clients.declined > 0,
        "seed {seed}: {:?}",
        report.clients
    );
    assert!(report.faults.random_kills > 0, "seed {seed}: no random kill");
    let at_points: u64 = report.faults.point_kills.values().sum();
    assert!(at_points > 0, "seed {seed}: no kill at a named point");
    assert!(
        report.faults.completer_kills > 0,
        "seed {seed}: the completer was never killed"
    );
    assert!(
        report.faults.lost_answer_windows > 0 && report.faults.keys_forgotten > 0,
        "seed {seed}"
    );
    let on_steps: u64 = (report.faults.store_faults.iter())
        .filter(|(call, _)| call.starts_with("step_") || call.starts_with("commit/"))
        .map(|(_, n)| n)
        .sum();
    assert!(
        on_steps > 0,
        "seed {seed}: no store fault hit an operation: {:?}",
        report.faults.store_faults
    );
    if report.engine != "sqlite" {
        assert!(report.faults.sessions_killed > 0, "seed {seed}: no session killed");
    }
    assert!(report.counts.replays_checked > 0, "seed {seed}: nothing replayed");
    let finals: u64 = ["completed", "compensated"]
        .iter()
        .map(|s| report.counts.states.get(*s).copied().unwrap_or(0))
        .sum();
    assert_eq!(
        finals,
        report.counts.states.values().sum::<u64>(),
        "seed {seed}: every operation final: {:?}",
        report.counts.states
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn withdrawals_sqlite() {
    assert_clean_and_attacked(&short_run(Engine::Sqlite, false).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn withdrawals_postgres() {
    assert_clean_and_attacked(&short_run(Engine::Postgres, false).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn withdrawals_mysql() {
    assert_clean_and_attacked(&short_run(Engine::Mysql, false).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn withdrawals_without_recovery_points_are_caught() {
    let report = short_run(Engine::Sqlite, true).await;
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.contains("debited") || v.contains("quotes booked")),
        "seed {}: the judge missed the double effects: {:#?}",
        report.seed,
        report.violations
    );
}
