//! Telling contention (a deadlock, a serialisation failure, a lock wait that
//! ran out) apart from every other failure, so that a transaction that lost
//! a race can be run again from the start.

use std::time::Duration;

use crate::error::{BoxError, Error};
use crate::metrics::{self, Stage};

/// Whether a failure means the transaction lost a race with another one and
/// may succeed if run again from the start: a deadlock, a serialisation
/// failure (PostgreSQL `40001`, `40P01`; MySQL `1213`), a lock wait that ran
/// out.
///
/// [`TxEngine::execute`](crate::TxEngine::execute) asks it of the work's
/// error: on contention, nothing has committed, so the engine rolls back and
/// runs the work again (a bounded number of times). Implement it for the
/// error type of your work; the store crates export classifiers for their
/// drivers' errors (`idem_postgres::is_contention`,
/// `idem_mysql::is_contention`), and their `store_error` maps a driver error
/// to an [`Error`] that answers it.
///
/// ```
/// use idem_core::{Contention, Error, StoreErrorKind};
///
/// enum PaymentError {
///     Store(Error),
///     Declined,
/// }
///
/// impl From<Error> for PaymentError {
///     fn from(e: Error) -> Self {
///         PaymentError::Store(e)
///     }
/// }
///
/// impl Contention for PaymentError {
///     fn is_contention(&self) -> bool {
///         matches!(self, PaymentError::Store(e) if e.is_contention())
///     }
/// }
///
/// let lost = PaymentError::Store(Error::store(StoreErrorKind::Serialization, "40001"));
/// assert!(lost.is_contention());
/// assert!(!PaymentError::Declined.is_contention());
/// ```
pub trait Contention {
    /// Whether running the transaction again from the start may succeed.
    fn is_contention(&self) -> bool;
}

impl Contention for Error {
    fn is_contention(&self) -> bool {
        Error::is_contention(self)
    }
}

/// A boxed error is contention if it, or any error in its source chain, is
/// an idem [`Error`] that is contention.
impl Contention for BoxError {
    fn is_contention(&self) -> bool {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(self.as_ref());
        while let Some(e) = next {
            if e.downcast_ref::<Error>().is_some_and(Error::is_contention) {
                return true;
            }
            next = e.source();
        }
        false
    }
}

impl Contention for std::convert::Infallible {
    fn is_contention(&self) -> bool {
        match *self {}
    }
}

/// The bounded, jittered re-runs of one transactional call after contention.
///
/// A call may run at most [`MAX_RUNS`](Self::MAX_RUNS) times, and no run
/// starts [`MAX_ELAPSED`](Self::MAX_ELAPSED) after the first. Before each
/// re-run it sleeps a jittered, doubling backoff (4 ms at first, at most
/// 512 ms), so transactions that aborted each other do not collide again in
/// step, and each re-run is counted in
/// [`idem_tx_retries_total`](crate::metrics::TX_RETRIES). Only re-run a call
/// whose failed attempt committed nothing.
///
/// [`TxEngine::execute`](crate::TxEngine::execute) uses it; so does the HTTP
/// layer, which re-runs a buffered request's handler.
#[derive(Debug, Clone)]
pub struct ContentionRetries {
    runs: u32,
    started: tokio::time::Instant,
}

impl Default for ContentionRetries {
    fn default() -> Self {
        Self::new()
    }
}

impl ContentionRetries {
    /// The most runs of one call, the first included.
    pub const MAX_RUNS: u32 = 10;
    /// The backoff before the first re-run (before jitter).
    pub const FIRST_BACKOFF: Duration = Duration::from_millis(4);
    /// The longest backoff.
    pub const MAX_BACKOFF: Duration = Duration::from_millis(512);
    /// No run starts this long after the first one did: runs that each
    /// waited out a lock wait timeout must not add up without bound.
    pub const MAX_ELAPSED: Duration = Duration::from_secs(30);

    /// A fresh budget: the first run is under way.
    pub fn new() -> Self {
        Self {
            runs: 1,
            started: tokio::time::Instant::now(),
        }
    }

    /// How many runs have started so far.
    pub fn runs(&self) -> u32 {
        self.runs
    }

    /// After contention at `stage` of a call to `operation`: sleeps the
    /// backoff and answers `true` if another run may start, or answers
    /// `false` at once when the budget is spent.
    pub async fn again(&mut self, operation: &str, stage: Stage) -> bool {
        if self.runs >= Self::MAX_RUNS || self.started.elapsed() >= Self::MAX_ELAPSED {
            tracing::debug!(
                operation,
                stage = stage.as_str(),
                runs = self.runs,
                "contention; retries spent"
            );
            return false;
        }
        let backoff = self.backoff();
        self.runs += 1;
        metrics::tx_retry(operation, stage);
        tracing::debug!(
            operation,
            stage = stage.as_str(),
            run = self.runs,
            backoff_ms = backoff.as_millis() as u64,
            "contention; running the transaction again"
        );
        tokio::time::sleep(backoff).await;
        true
    }

    /// The jittered backoff before the next run: uniformly between half and
    /// all of 4 ms doubled per run so far, capped at 512 ms.
    fn backoff(&self) -> Duration {
        let shift = (self.runs - 1).min(16);
        let full = Self::FIRST_BACKOFF.saturating_mul(1 << shift).min(Self::MAX_BACKOFF);
        let full_us = full.as_micros() as u64;
        let half_us = full_us / 2;
        Duration::from_micros(half_us + jitter() % (full_us - half_us + 1))
    }
}

/// A random number from the standard library's per-process random hash keys.
fn jitter() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::StoreErrorKind;

    #[test]
    fn deadlocks_serialisation_failures_and_lock_waits_are_contention() {
        for kind in [
            StoreErrorKind::Deadlock,
            StoreErrorKind::Serialization,
            StoreErrorKind::LockTimeout,
        ] {
            assert!(Error::store(kind, "x").is_contention(), "{kind:?}");
        }
        assert!(!Error::store(StoreErrorKind::Unavailable, "x").is_contention());
        assert!(!Error::store(StoreErrorKind::Other, "x").is_contention());
        assert!(!Error::Mismatch.is_contention());
    }

    #[test]
    fn boxed_errors_are_searched_through_their_sources() {
        let boxed: BoxError = Box::new(Error::store(StoreErrorKind::Deadlock, "1213"));
        assert!(Contention::is_contention(&boxed));
        let plain: BoxError = "something else".into();
        assert!(!Contention::is_contention(&plain));
    }

    #[test]
    fn backoff_is_jittered_doubling_and_bounded() {
        let mut r = ContentionRetries::new();
        for run in 1..=9u32 {
            r.runs = run;
            let full = (4u64 << (run - 1)).min(512);
            for _ in 0..50 {
                let b = r.backoff().as_micros() as u64;
                assert!(b >= full * 500 && b <= full * 1000, "run {run}: {b} µs");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn at_most_ten_runs() {
        let mut r = ContentionRetries::new();
        let mut more = 0;
        while r.again("op", Stage::Work).await {
            more += 1;
        }
        assert_eq!(more, 9, "nine re-runs after the first run");
        assert_eq!(r.runs(), ContentionRetries::MAX_RUNS);
        assert!(!r.again("op", Stage::Work).await, "a spent budget stays spent");
    }

    #[tokio::test(start_paused = true)]
    async fn no_run_starts_after_the_time_budget() {
        let mut r = ContentionRetries::new();
        tokio::time::advance(ContentionRetries::MAX_ELAPSED).await;
        assert!(!r.again("op", Stage::Work).await);
        assert_eq!(r.runs(), 1);
    }
}
