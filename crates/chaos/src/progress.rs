//! How far the workload has got, so that the faults a run promises are
//! scheduled by its operations rather than by the clock: a fault made "at a
//! quarter of the workload" happens while the workload runs, on a fast
//! machine as on a slow one.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// Operations the workload has taken, of all it plans.
#[derive(Debug)]
pub(crate) struct Progress {
    taken: AtomicUsize,
    total: usize,
}

impl Progress {
    /// A workload of `total` operations, none taken yet.
    pub(crate) fn new(total: usize) -> Self {
        Self {
            taken: AtomicUsize::new(0),
            total,
        }
    }

    /// Takes the next operation: answers its index (past the plan once all
    /// are taken).
    pub(crate) fn take(&self) -> usize {
        self.taken.fetch_add(1, Ordering::SeqCst)
    }

    /// Whether `fraction` of the operations have been taken.
    pub(crate) fn reached(&self, fraction: f64) -> bool {
        self.taken.load(Ordering::SeqCst) as f64 >= self.total as f64 * fraction
    }

    /// Waits until `fraction` of the operations have been taken; answers
    /// false if `calm` came first (the workload ended early, on an error).
    pub(crate) async fn wait_for(&self, fraction: f64, calm: &AtomicBool) -> bool {
        loop {
            if self.reached(fraction) {
                return true;
            }
            if calm.load(Ordering::SeqCst) {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
