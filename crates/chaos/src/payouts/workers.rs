//! The payout workers: two `ledger payouts` processes, killed with
//! `kill -9` and paused past their lease.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::Mutex;

use super::vendor_attacks::BASE_FAULTS;
use super::{LEASE_SECS, PayoutFaults, RETRY_DELAYS_MS, VENDOR_HORIZON_MARGIN_SECS, VENDOR_KEY_HORIZON_SECS, Vendor};
use crate::Error;
use crate::rng::Rng;
use crate::service::Service;

/// Starts two `ledger payouts` processes against `vendor_url`, worker `i`
/// on the database at `database_urls[i]` (one database seen through the
/// nodes of a cluster, or the same URL).
pub(crate) async fn start_workers(
    bin: &Path,
    database_urls: [&str; 2],
    vendor_url: &str,
    log: &Path,
    env: &[(String, String)],
) -> Result<Vec<Arc<Service>>, Error> {
    let mut workers = Vec::new();
    for (i, database_url) in database_urls.into_iter().enumerate() {
        workers.push(
            Service::start_worker(
                bin,
                database_url,
                vec![
                    "payouts".into(),
                    "--vendor-url".into(),
                    vendor_url.into(),
                    "--payout-lease-secs".into(),
                    LEASE_SECS.to_string(),
                    "--payout-retry-delays-ms".into(),
                    RETRY_DELAYS_MS.into(),
                    "--payout-deadline-secs".into(),
                    "10".into(),
                    "--payout-concurrency".into(),
                    "8".into(),
                    "--vendor-key-horizon-secs".into(),
                    VENDOR_KEY_HORIZON_SECS.to_string(),
                    "--vendor-horizon-margin-secs".into(),
                    VENDOR_HORIZON_MARGIN_SECS.to_string(),
                ],
                env.to_vec(),
                log.with_extension(format!("payouts{i}.log")),
            )
            .await?,
        );
    }
    Ok(workers)
}

/// Kills a payout worker every 0.8–2.5 s and, every 6–12 s, stops one for
/// twice its lease or more, until `calm`. Each stop comes half a second into
/// a window of slow vendor answers, so the stopped worker most likely holds
/// payouts mid-call: the other worker takes them over once the lease runs
/// out and pays them with the same key (the vendor replays). Every run has
/// at least one kill and one stop: the first of each is made even if the
/// workload ended before it.
pub(crate) async fn attack_workers(
    workers: Vec<Arc<Service>>,
    vendor: Arc<Vendor>,
    calm: Arc<AtomicBool>,
    mut rng: Rng,
    faults: Arc<Mutex<PayoutFaults>>,
) {
    let paused: Arc<Vec<AtomicBool>> = Arc::new(workers.iter().map(|_| AtomicBool::new(false)).collect());
    let pauses = {
        let (workers, calm, paused, faults, mut rng) = (
            workers.clone(),
            calm.clone(),
            paused.clone(),
            faults.clone(),
            rng.fork(1),
        );
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(rng.range(1_000, 3_000))).await;
            let (mut made, mut tries_past_calm) = (0u64, 0u32);
            while !calm.load(Ordering::SeqCst) || (made == 0 && tries_past_calm < 50) {
                tries_past_calm += u32::from(calm.load(Ordering::SeqCst));
                let i = rng.range(0, workers.len() as u64) as usize;
                let d = Duration::from_millis(LEASE_SECS * 2_000 + rng.range(0, 1_000));
                let slow = fake_vendor::Faults {
                    slow_ms: rng.range(1_000, 2_000),
                    ..BASE_FAULTS
                };
                // During a held window the vendor's faults stay as they are.
                if let Ok(true) = vendor.change(&slow).await {
                    faults.lock().await.vendor_slow_windows += 1;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                paused[i].store(true, Ordering::SeqCst);
                let stopped = workers[i].pause(d).await;
                paused[i].store(false, Ordering::SeqCst);
                if !stopped {
                    // Between a kill and its restart there is no process to
                    // stop: try again.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                faults.lock().await.worker_pauses_past_lease += 1;
                made += 1;
                tokio::time::sleep(Duration::from_millis(rng.range(6_000, 12_000))).await;
            }
        })
    };
    // Past `calm`, a bounded number of tries (a worker that cannot be
    // started again does not hold the run up).
    let (mut killed, mut tries_past_calm) = (0u64, 0u32);
    let go_on = |killed: u64, tries: u32| !calm.load(Ordering::SeqCst) || (killed == 0 && tries < 50);
    while go_on(killed, tries_past_calm) {
        tokio::time::sleep(Duration::from_millis(rng.range(800, 2_500))).await;
        tries_past_calm += u32::from(calm.load(Ordering::SeqCst));
        if !go_on(killed, tries_past_calm) {
            break;
        }
        let i = rng.range(0, workers.len() as u64) as usize;
        // A stopped worker is left stopped: its pause must outlast its lease.
        if !paused[i].load(Ordering::SeqCst) && workers[i].kill() {
            faults.lock().await.worker_kills += 1;
            killed += 1;
        }
    }
    let _ = pauses.await;
}
