//! The attacks of a withdrawals run, until `calm`: the server and the
//! completer process killed with `kill -9` at random (the named points are
//! the processes' own: `LEDGER_STEP_FAULTS`, and so are their store faults:
//! `LEDGER_STORE_FAULTS`), the service's database sessions killed, and the
//! vendors losing answers after applying them, answering late, failing
//! their lookups and forgetting keys.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use super::{VENDOR_KEY_HORIZON_SECS, WithdrawalFaults, WithdrawalsConfig};
use crate::Engine;
use crate::db::Database;
use crate::rng::Rng;
use crate::service::Service;

/// Sleeps `ms`, or less once `calm`; answers whether it is still not calm.
async fn nap(calm: &AtomicBool, ms: u64) -> bool {
    let until = tokio::time::Instant::now() + Duration::from_millis(ms);
    while tokio::time::Instant::now() < until {
        if calm.load(Ordering::SeqCst) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    !calm.load(Ordering::SeqCst)
}

/// What the attacks hit.
pub(crate) struct Targets {
    /// The ledger server.
    pub(crate) service: Arc<Service>,
    /// The `ledger complete` process.
    pub(crate) completer: Arc<Service>,
    /// Their database.
    pub(crate) database: Database,
    /// Both vendors.
    pub(crate) vendor: Arc<fake_vendor::Vendor>,
}

/// Starts every attack; each task ends once `calm`.
pub(crate) fn start(
    config: &WithdrawalsConfig,
    targets: Targets,
    calm: Arc<AtomicBool>,
    mut rng: Rng,
    faults: Arc<Mutex<WithdrawalFaults>>,
) -> Vec<JoinHandle<()>> {
    let Targets {
        service,
        completer,
        database,
        vendor,
    } = targets;
    let mut tasks = Vec::new();
    let mean = config.kill_interval_ms;
    {
        let (calm, faults, mut r) = (calm.clone(), faults.clone(), rng.fork(1));
        tasks.push(tokio::spawn(async move {
            while nap(&calm, r.range(mean / 2, mean * 3 / 2 + 1)).await {
                if service.kill() {
                    faults.lock().await.random_kills += 1;
                }
            }
        }));
    }
    {
        let (calm, faults, mut r) = (calm.clone(), faults.clone(), rng.fork(2));
        tasks.push(tokio::spawn(async move {
            while nap(&calm, r.range(mean, mean * 3)).await {
                if completer.kill() {
                    faults.lock().await.completer_kills += 1;
                }
            }
        }));
    }
    if config.engine != Engine::Sqlite {
        // The sessions of both processes (a statement cut mid-step, a
        // commit whose answer never came back), at random.
        let (calm, faults, database, mut r) = (calm.clone(), faults.clone(), database.clone(), rng.fork(4));
        tasks.push(tokio::spawn(async move {
            while nap(&calm, r.range(700, 2_500)).await {
                match database.kill_sessions().await {
                    Ok(n) => faults.lock().await.sessions_killed += n,
                    Err(e) => eprintln!("chaos: could not kill database sessions: {e}"),
                }
            }
        }));
    }
    {
        // One vendor fault window at a time, then a quiet spell.
        let (calm, mut r) = (calm.clone(), rng.fork(3));
        tasks.push(tokio::spawn(async move {
            let mut kind = 0u64;
            while nap(&calm, r.range(300, 1_200)).await {
                let mut window = fake_vendor::Faults::default();
                {
                    let mut f = faults.lock().await;
                    match kind % 4 {
                        0 => {
                            window.apply_then_drop = 0.3;
                            f.lost_answer_windows += 1;
                        }
                        1 => {
                            window.slow_ms = r.range(200, 1_500);
                            f.slow_windows += 1;
                        }
                        2 => {
                            window.lookup_error_500 = 1.0;
                            window.apply_then_drop = 0.2;
                            f.lookup_failure_windows += 1;
                        }
                        _ => {
                            vendor.advance(Duration::from_secs(VENDOR_KEY_HORIZON_SECS + 1));
                            f.keys_forgotten += 1;
                        }
                    }
                }
                kind += 1;
                vendor.set_faults(window).await;
                nap(&calm, r.range(500, 1_500)).await;
                vendor.set_faults(fake_vendor::Faults::default()).await;
            }
        }));
    }
    tasks
}
