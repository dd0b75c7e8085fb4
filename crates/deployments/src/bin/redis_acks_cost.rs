//! The cost of replica acknowledgements on a Redis master with one replica:
//! lease calls (claim, sent mark, outcome) per second with and without
//! `with_replica_acks(1, …)`, at 1 and 16 concurrent callers, alternated in
//! one run. Prints a table; asserts nothing about times.
//!
//! `cargo run --release -p deployments --bin redis_acks_cost -- --seconds 3 --rounds 3`

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use deployments::redis_replica::RedisReplicas;
use idem_core::{Acquire, Call, Fingerprint, IdempotencyKey, LeaseEngine, Policy, Record, Scope};
use idem_redis::RedisStore;

async fn rate(url: &str, acks: bool, callers: usize, seconds: f64) -> f64 {
    let mut store = RedisStore::connect(url)
        .await
        .expect("the master")
        .with_prefix(&format!("cost:{}", uuid::Uuid::now_v7().simple()))
        .expect("prefix");
    if acks {
        store = store.with_replica_acks(1, Duration::from_millis(500)).expect("setting");
    }
    let engine = Arc::new(LeaseEngine::new(store));
    let scope = Scope::parse("tenant", "cost").expect("scope");
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let (engine, scope, done, stop) = (engine.clone(), scope.clone(), done.clone(), stop.clone());
            tokio::spawn(async move {
                let fingerprint = Fingerprint::of_json(scope.operation(), b"{}").expect("json");
                while !stop.load(Ordering::Relaxed) {
                    let call = Call::new(scope.clone(), IdempotencyKey::generate(), fingerprint)
                        .with_policy(Policy::default());
                    let Ok(Acquire::Claimed(lease)) = engine.acquire(&call).await else {
                        panic!("a fresh key is claimed")
                    };
                    engine.mark_sent(&lease).await.expect("mark");
                    engine
                        .complete(&lease, Record::completed(vec![b'x'; 1024]))
                        .await
                        .expect("complete");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("caller");
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The cost of replica acknowledgements on a Redis master with one replica
/// (it starts its own, on free loopback ports).
#[derive(clap::Parser)]
struct Args {
    /// Seconds each path runs, per round.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Rounds, each path once per round, alternated; the table gives medians.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

#[tokio::main]
async fn main() {
    let Args { seconds, rounds } = clap::Parser::parse();
    let rounds = rounds.max(1);
    let deployment = RedisReplicas::start(1).await.expect("a Redis master and replica");
    let url = deployment.master_url();
    println!("| callers | without acks, calls/s | with acks (1 replica, 500 ms), calls/s | ratio |");
    println!("|---|---|---|---|");
    for callers in [1, 16] {
        let (mut plain, mut acked) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            plain.push(rate(&url, false, callers, seconds).await);
            acked.push(rate(&url, true, callers, seconds).await);
        }
        let (p, a) = (median(plain), median(acked));
        println!("| {callers} | {p:.0} | {a:.0} | {:.2} |", a / p);
    }
}
