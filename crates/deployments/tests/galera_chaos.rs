//! The chaos harness on a three-node MariaDB Galera cluster: three ledger
//! instances behind the harness's balancer, instance `i` writing through
//! node `i + 1`, under every fault the harness has (kills, pauses, kills at
//! named points, database sessions killed on a node drawn at random, store
//! faults, a fault proxy, bursts), while node 3 (index 2) is killed with
//! SIGKILL and rejoins by a state transfer (IST, or SST). The instance on
//! that node answers errors while its node is away and serves again once it
//! is back; the history must hold no violation.
//!
//! The node is killed once the instance on it has committed
//! `KILL_AFTER_COMMITS` transactions there, and restarted once the other two
//! have evicted it (a node restarted before that waits for the eviction to
//! join); with more node kills asked for, the next one comes once the
//! rejoined node has committed as many again, until the run ends.
//! Sizes come from the environment: `DEPLOY_GALERA_CHAOS_OPS` (1000: the
//! workload's operations), `DEPLOY_GALERA_CHAOS_NODE_KILLS` (1: the most node
//! kills; at least one always happens), `DEPLOY_GALERA_CHAOS_SYNC_WAIT` (3:
//! the nodes' `wsrep_sync_wait`, which the ledger's sessions inherit; 0
//! runs without it), `DEPLOY_GALERA_CHAOS_FULL` (1: the events and payouts
//! too, their relays, projectors and payout workers spread over the nodes;
//! off in the suite for time) and `CHAOS_SEED` (random; always printed).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chaos::{Config, Engine};
use deployments::galera::{Galera, Rejoin};

/// The node killed and rejoined (0-based: the third node).
const VICTIM: usize = 2;

/// Transactions the instance on the victim commits there before each kill.
const KILL_AFTER_COMMITS: u64 = 50;

/// An environment variable's number, or `default`.
fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn seed() -> u64 {
    std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| uuid::Uuid::now_v7().as_u128() as u64)
}

/// One kill of the victim and its rejoin.
#[derive(Debug)]
struct NodeKill {
    /// Seconds into the run.
    at_secs: f64,
    /// From the kill until the other two nodes had evicted it.
    evicted_ms: u128,
    /// How it caught up.
    rejoin: Rejoin,
    /// From the kill until the cluster was `Synced` again at full size.
    down_ms: u128,
}

/// What the node attack did, and the victim's local commits after its last
/// rejoin (read once the run is over).
#[derive(Debug)]
struct Attack {
    kills: Vec<NodeKill>,
    commits_after_rejoin: u64,
    /// How long the run went on after the last rejoin (none if it ended
    /// first).
    run_after_rejoin: Option<Duration>,
}

/// The victim's `wsrep_local_commits`: transactions committed by clients
/// of that node since its server started.
async fn local_commits(galera: &Galera, node: usize) -> u64 {
    galera
        .status(node, "wsrep_local_commits")
        .await
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Kills the victim (SIGKILL) once the instance on it has committed
/// [`KILL_AFTER_COMMITS`] transactions there, waits until the other nodes
/// have evicted it, restarts it and waits until the cluster is synced;
/// again, up to `most` kills, while the run goes on.
async fn attack_node(galera: &mut Galera, most: u64, run_over: &AtomicBool, started: Instant) -> Vec<NodeKill> {
    let mut kills = Vec::new();
    while (kills.len() as u64) < most {
        // The first kill waits for the run's pace; a run over before it
        // leaves none, which the test reports.
        while local_commits(galera, VICTIM).await < KILL_AFTER_COMMITS {
            if run_over.load(Ordering::SeqCst) {
                return kills;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let at_secs = started.elapsed().as_secs_f64();
        let down = Instant::now();
        galera.kill(VICTIM);
        println!("galera chaos: node {} killed at {at_secs:.1} s", VICTIM + 1);
        galera.wait_synced().await.unwrap_or_else(|e| panic!("{e}"));
        let evicted_ms = down.elapsed().as_millis();
        let rejoin = galera.restart(VICTIM).await.unwrap_or_else(|e| panic!("{e}"));
        let down_ms = down.elapsed().as_millis();
        println!(
            "galera chaos: node {} evicted {evicted_ms} ms after its kill, rejoined by {rejoin} after {down_ms} ms",
            VICTIM + 1
        );
        kills.push(NodeKill {
            at_secs,
            evicted_ms,
            rejoin,
            down_ms,
        });
    }
    kills
}

/// Three ledger instances on the three nodes of a Galera cluster under
/// every fault, one node killed and rejoined mid-run: no violation, the
/// node killed and back, every instance used, the one on the killed node
/// committing again after the rejoin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_on_galera_with_a_node_killed_and_rejoined() {
    let started = Instant::now();
    let seed = seed();
    let ops = env_or("DEPLOY_GALERA_CHAOS_OPS", 1_000);
    let most_kills = env_or("DEPLOY_GALERA_CHAOS_NODE_KILLS", 1).max(1);
    let sync_wait = env_or("DEPLOY_GALERA_CHAOS_SYNC_WAIT", 3);
    println!(
        "galera chaos: seed {seed}, {ops} operations, up to {most_kills} node kill(s), wsrep_sync_wait = {sync_wait}"
    );
    // Built before the cluster starts (unless `CHAOS_LEDGER_BIN` names
    // one): the build is no part of the run.
    let ledger = chaos::ledger_binary(None).unwrap_or_else(|e| panic!("the ledger with fault-injection: {e}"));
    let built = started.elapsed();
    let settings = [
        "--wsrep-retry-autocommit=10".to_owned(),
        format!("--wsrep-sync-wait={sync_wait}"),
    ];
    let mut galera = Galera::start_with(3, &settings).await.unwrap_or_else(|e| panic!("{e}"));
    let cluster_started = started.elapsed();
    let nodes: Vec<String> = (0..galera.len()).map(|i| galera.url(i)).collect();

    let mut config = Config::new(Engine::Mysql, seed);
    config.mysql_url.clone_from(&nodes[0]);
    config.mysql_nodes = nodes;
    config.instances = 3;
    config.ops = usize::try_from(ops).expect("a count of operations");
    // Four clients: the workload outlasts a node's eviction and rejoin
    // (about 15 s), so the instance on it serves again before the end.
    config.clients = 4;
    config.kill_interval_ms = 700;
    let full = env_or("DEPLOY_GALERA_CHAOS_FULL", 0) == 1;
    config.events = full;
    config.payouts = full;
    config.ledger_bin = Some(ledger.clone());

    let run_over = Arc::new(AtomicBool::new(false));
    let attack = {
        let run_over = run_over.clone();
        tokio::spawn(async move {
            let kills = attack_node(&mut galera, most_kills, &run_over, started).await;
            let rejoined = Instant::now();
            let before_the_end = !run_over.load(Ordering::SeqCst);
            // Wait for the run to end, then count what the victim's
            // clients committed there since its last rejoin.
            while !run_over.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let commits_after_rejoin = local_commits(&galera, VICTIM).await;
            (
                Attack {
                    kills,
                    commits_after_rejoin,
                    run_after_rejoin: before_the_end.then(|| rejoined.elapsed()),
                },
                galera,
            )
        })
    };
    let run_started = Instant::now();
    let report = chaos::run(config).await;
    let run_secs = run_started.elapsed().as_secs_f64();
    run_over.store(true, Ordering::SeqCst);
    let (attack, galera) = match tokio::time::timeout(Duration::from_secs(300), attack).await {
        Ok(joined) => joined.expect("the node attack"),
        Err(_) => panic!(
            "seed {seed}: the node attack did not end within 300 s of the run ({})",
            match &report {
                Ok(r) => format!("{} violation(s)", r.violations.len()),
                Err(e) => format!("the run failed: {e}"),
            }
        ),
    };
    if std::env::var_os("CHAOS_LEDGER_BIN").is_none() {
        let _ = std::fs::remove_file(&ledger);
    }
    let report = report.unwrap_or_else(|e| panic!("chaos run failed (seed {seed}): {e}"));
    println!("{}", serde_json::to_string_pretty(&report).unwrap());

    println!("| instance | database node | requests | kills | pauses | restarts | /healthz 503s | recoveries |");
    println!("|---|---|---|---|---|---|---|---|");
    for (i, c) in report.per_instance.iter().enumerate() {
        println!(
            "| {i} | {} | {} | {} | {} | {} | {} | {} |",
            c.database_node + 1,
            c.served,
            c.kills(),
            c.pauses,
            c.restarts,
            c.database_unavailable,
            c.recoveries
        );
    }
    for (node, n) in report.database_nodes.iter().enumerate() {
        println!(
            "node {}: {} used by {:?}, {} session(s) killed",
            node + 1,
            n.url,
            n.used_by,
            n.sessions_killed
        );
    }
    for k in &attack.kills {
        println!(
            "node {} killed at {:.1} s, evicted after {} ms, rejoined by {} after {} ms",
            VICTIM + 1,
            k.at_secs,
            k.evicted_ms,
            k.rejoin,
            k.down_ms
        );
    }
    println!(
        "galera chaos: seed {seed}: {} ops ({} ok, {} rejected, {} unknown), {} kills, {} sessions killed, \
         {} store faults, {} node kill(s), {} commits on node {} after its last rejoin, {} violation(s); \
         ledger ready {:.1} s, cluster {:.1} s, run {run_secs:.1} s, total {:.1} s",
        report.counts.ops,
        report.counts.ok,
        report.counts.rejected,
        report.counts.unknown,
        report.faults.kills(),
        report.faults.sessions_killed,
        report.faults.store_faults.values().sum::<u64>(),
        attack.kills.len(),
        attack.commits_after_rejoin,
        VICTIM + 1,
        report.violations.len(),
        built.as_secs_f64(),
        (cluster_started - built).as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    drop(galera);

    assert!(
        report.violations.is_empty(),
        "seed {seed}: violations: {:#?}",
        report.violations
    );
    assert!(report.counts.ops >= ops, "seed {seed}: ran {} ops", report.counts.ops);
    assert!(
        !attack.kills.is_empty(),
        "seed {seed}: node {} was never killed",
        VICTIM + 1
    );
    for k in &attack.kills {
        assert_ne!(
            k.rejoin,
            Rejoin::Neither,
            "seed {seed}: node {} missed nothing while it was down: {attack:?}",
            VICTIM + 1
        );
    }
    assert!(report.faults.kills() >= 1, "seed {seed}: no ledger instance killed");
    assert!(
        report.faults.sessions_killed > 0,
        "seed {seed}: no database session killed"
    );
    assert_eq!(report.audit["conserved"], true, "seed {seed}");
    assert_eq!(report.per_instance.len(), 3, "seed {seed}");
    for (i, c) in report.per_instance.iter().enumerate() {
        assert_eq!(
            c.database_node, i,
            "seed {seed}: instance {i} on node {}",
            c.database_node
        );
        assert!(c.served > 0, "seed {seed}: instance {i} served no request: {c:?}");
    }
    if !full {
        assert_eq!(
            report.database_nodes[VICTIM].used_by,
            [format!("instance {VICTIM}")],
            "seed {seed}: the victim's clients"
        );
    }
    // The instance on the victim rode it out: it committed there again once
    // the node was back (nothing else writes through that node). Judged
    // when the run went on for a few seconds after the rejoin.
    match attack.run_after_rejoin {
        Some(left) if left >= Duration::from_secs(3) => assert!(
            attack.commits_after_rejoin > 0,
            "seed {seed}: instance {VICTIM} committed nothing on node {} in the {left:?} after its rejoin: {attack:?}",
            VICTIM + 1
        ),
        left => {
            println!("galera chaos: the run ended {left:?} after the rejoin: the instance's recovery is not judged")
        }
    }
}
