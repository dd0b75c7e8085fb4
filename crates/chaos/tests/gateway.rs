//! A short gateway chaos run on PostgreSQL and on Redis: three `idem gateway`
//! processes on one store behind a round-robin balancer, killed with
//! `kill -9` and SIGTERMed while clients of several tenants retry through
//! the balancer. No recorded key is
//! applied twice, no caller reads another tenant's answer, and every
//! operation is answered once the faults stop — while the store refuses
//! writes for moments and has its connections killed. Seeds come from
//! `CHAOS_SEED` or are random, and are printed.

use chaos::gateway::{GatewayConfig, GatewayReport, GatewayStore, run_gateway};
use chaos::rng::seed_from_env;

async fn short_run(store: GatewayStore) -> GatewayReport {
    let seed = seed_from_env();
    println!("chaos gateway on {}: seed {seed}", store.name());
    let mut config = GatewayConfig::new(store, seed);
    config.ops = 600;
    config.fault_interval_ms = 700;
    let report = run(config).await;
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    assert!(report.violations.is_empty(), "seed {seed}: {:#?}", report.violations);
    assert!(report.kills >= 3, "seed {seed}: only {} kills", report.kills);
    assert_eq!(report.instances, 3, "seed {seed}");
    // Every gateway killed (all three at once mid-request, by construction),
    // and at least one more kill of a gateway drawn at random.
    assert!(
        report.kills_per_instance.len() == 3 && report.kills_per_instance.iter().all(|k| *k >= 1),
        "seed {seed}: kills per instance {:?}",
        report.kills_per_instance
    );
    assert!(
        report.kills + report.sigterms > 3,
        "seed {seed}: no gateway killed or stopped at random: {:?} {:?}",
        report.kills_per_instance,
        report.sigterms_per_instance
    );
    assert!(
        report.balancer.served.len() == 3 && report.balancer.served.iter().all(|n| *n > 0),
        "seed {seed}: a gateway served no request: {:?}",
        report.balancer
    );
    assert!(
        report.balancer.refused.iter().sum::<u64>() > 0,
        "seed {seed}: no connection met a dead gateway and went on to the next: {:?}",
        report.balancer
    );
    assert_eq!(
        report.mid_request_kills, 1,
        "seed {seed}: the gateways were not killed mid-request"
    );
    assert!(report.restarts >= 2, "seed {seed}: only {} restarts", report.restarts);
    assert!(
        report.ok > 0 && report.replays_seen > 0,
        "seed {seed}: no answer or replay"
    );
    assert!(
        report.connection_failures > 0,
        "seed {seed}: no attempt hit a dead gateway"
    );
    assert!(
        report.store_faults.sessions_killed > 0,
        "seed {seed}: no store connection killed: {:?}",
        report.store_faults
    );
    if store == GatewayStore::Redis {
        assert!(
            report.store_faults.refusal_windows > 0,
            "seed {seed}: the store never refused a write: {:?}",
            report.store_faults
        );
    }
    report
}

idem_conformance::cases!(short_run, 4 => {
    gateway_chaos_on_postgres(GatewayStore::Postgres);
    gateway_chaos_on_redis(GatewayStore::Redis);
});

/// A run as `config` says.
async fn run(config: GatewayConfig) -> GatewayReport {
    let seed = config.seed;
    run_gateway(config)
        .await
        .unwrap_or_else(|e| panic!("gateway chaos run failed (seed {seed}): {e}"))
}

/// A checker's run: 200 operations on PostgreSQL, with what `broken`
/// switches off.
async fn broken_run(broken: impl FnOnce(&mut GatewayConfig)) -> GatewayReport {
    let mut config = GatewayConfig::new(GatewayStore::Postgres, seed_from_env());
    config.ops = 200;
    broken(&mut config);
    run(config).await
}

/// The checker can fail: gateways that scope nobody's keys (an anonymous
/// tenant for every caller) replay one tenant's answer to another, and the
/// run must say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_checker_can_fail() {
    let report = broken_run(|config| config.break_tenancy = true).await;
    assert!(
        report.violations.iter().any(|v| v.contains("made for tenant")),
        "seed {}: no cross-tenant answer reported: {:#?}",
        report.seed,
        report.violations
    );
}

/// The checker catches what the sent mark prevents: gateways built with
/// fault injection and the mark switched off send a request cut off by a
/// kill again once its lease runs out, and the run must report the key
/// applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_checker_catches_a_missing_sent_mark() {
    let report = broken_run(|config| {
        config.break_sent_mark = true;
        config.store_faults = false;
    })
    .await;
    let seed = report.seed;
    assert_eq!(report.mid_request_kills, 1, "seed {seed}");
    assert!(
        report.reapplied > 0 && report.violations.iter().any(|v| v.contains("the upstream applied it")),
        "seed {seed}: no key reported applied twice: {:#?}",
        report.violations
    );
}
