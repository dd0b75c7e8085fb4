//! Scheduled jobs with run ids.
//!
//! The guide, with examples: `docs/events.md` in the repository.
//!
//! A periodic job's time is cut into **slots** of its period, aligned to the
//! Unix epoch (a daily job's slots start at 00:00 UTC). The **run id** of a
//! slot is derived from the job and the slot — `statements@1732406400000` —
//! so every instance, every retry and every operator computes the same one.
//! A run executes through the inbox's claim on (job, run id): its writes, the
//! claim and the recorded outcome commit in one transaction. A retried
//! attempt, or the same slot started by a second instance, finds the
//! recorded run and does nothing ([`Delivery::Duplicate`]).
//!
//! An operator can run a job with an explicit run id too (a backfill, or a
//! rerun of a slot that failed): [`Scheduler::run`]. Run ids are kept for
//! [`Scheduler::ttl_secs`] (at least seven days, and at least ten periods);
//! a run id older than that runs again.
//!
//! ```no_run
//! # async fn demo(store: idem_sqlite::SqliteStore) -> Result<(), idem_core::Error> {
//! use std::time::Duration;
//! use idem_jobs::{Job, Scheduler};
//!
//! let job = Job::new("statements", Duration::from_secs(86_400))?;
//! let scheduler = Scheduler::new(idem_core::TxEngine::new(store));
//! let slot = job.slot_at(1_732_450_000_000);
//! let run = scheduler
//!     .run(&job, &job.run_id(slot), |tx| Box::pin(async move {
//!         // ... the run's writes, in `tx` ...
//!         Ok::<_, idem_core::Error>(())
//!     }))
//!     .await?;
//! assert!(run.is_applied());
//! # Ok(()) }
//! ```

use std::future::Future;
use std::time::Duration;

use idem_core::{BoxFuture, Contention, Error, Operation, Policy, SharedClock, Tenant, TxBackend, TxEngine};
pub use idem_inbox::Delivery;
use idem_inbox::Inbox;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A periodic job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    name: Operation,
    period_ms: i64,
    missed: MissedSlots,
}

/// The counter of slots [`Scheduler::run_every`] gave up without a run
/// (label `job`).
pub const SLOTS_SKIPPED: &str = "idem_job_slots_skipped_total";

/// What [`Scheduler::run_every`] does with slots that went by without a
/// successful run while it was busy: a run longer than its period, or a
/// slot whose attempts kept failing until later slots began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissedSlots {
    /// Give them up: each is counted in [`SLOTS_SKIPPED`], and each run of
    /// them logged in one line (the first and last run ids, how many); the
    /// next run is the current slot. The default.
    Skip,
    /// Run them afterwards, oldest first, each under its own run id (a slot
    /// whose attempts fail is tried again until it succeeds), but never
    /// more than `max` slots behind the current one, nor a slot whose run id
    /// may be gone (older than [`Scheduler::ttl_secs`], when a run of it by
    /// another instance may have been swept): older ones are skipped as
    /// under `Skip`.
    CatchUp {
        /// The most missed slots run (at least 1).
        max: u32,
    },
}

/// A slot of a job: the start of one period, in ms since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Slot(pub i64);

impl Job {
    /// A job named `name` (a valid operation name) that runs once per
    /// `period` (at least one second, at most a year).
    pub fn new(name: &str, period: Duration) -> Result<Self, Error> {
        let name = Operation::new(name)?;
        if period < Duration::from_secs(1) || period > Duration::from_secs(366 * 86_400) {
            return Err(Error::Config(format!(
                "job {name}: the period must be between 1 s and 366 days, got {period:?}"
            )));
        }
        Ok(Self {
            name,
            period_ms: i64::try_from(period.as_millis()).expect("bounded above"),
            missed: MissedSlots::Skip,
        })
    }

    /// The same job with `policy` for missed slots; `CatchUp` with a `max`
    /// of 0 is refused.
    pub fn with_missed_slots(mut self, policy: MissedSlots) -> Result<Self, Error> {
        if policy == (MissedSlots::CatchUp { max: 0 }) {
            return Err(Error::Config(format!(
                "job {}: catching up missed slots needs a maximum of at least 1",
                self.name
            )));
        }
        self.missed = policy;
        Ok(self)
    }

    /// The missed-slot policy.
    pub fn missed_slots(&self) -> MissedSlots {
        self.missed
    }

    /// The slot to run when `due` is the oldest slot not yet run and
    /// `current` is the slot now: the slots given up on the way are logged
    /// and counted.
    fn missed(&self, due: Slot, current: Slot) -> Slot {
        if due >= current {
            return due;
        }
        let behind = (current.0 - due.0) / self.period_ms;
        // A slot older than the run ids' retention may have run on another
        // instance and had its record swept since: running it would run it
        // twice. Its run id is kept for `ttl` from its start at the least.
        let ttl_ms = i64::try_from(self.ttl_secs().saturating_mul(1_000)).unwrap_or(i64::MAX);
        let retained = ttl_ms / self.period_ms - 1;
        let keep = match self.missed {
            MissedSlots::Skip => 0,
            MissedSlots::CatchUp { max } => i64::from(max).min(behind).min(retained),
        };
        let first_kept = Slot(current.0 - keep * self.period_ms);
        // One count and one line for the whole run of slots given up: a
        // clock that jumps years ahead must not stall the scheduler in a
        // loop over each of them.
        let skipped = (first_kept.0 - due.0) / self.period_ms;
        if skipped > 0 {
            metrics::counter!(SLOTS_SKIPPED, "job" => self.name.as_str().to_owned()).increment(skipped as u64);
            tracing::warn!(
                job = self.name(),
                first_run_id = %self.run_id(due),
                last_run_id = %self.run_id(Slot(first_kept.0 - self.period_ms)),
                skipped,
                policy = ?self.missed,
                "job slots skipped: no run succeeded before later slots began"
            );
        }
        first_kept
    }

    /// How long its run ids are kept: ten periods, at least [`MIN_TTL_SECS`].
    fn ttl_secs(&self) -> u64 {
        (self.period().as_secs().saturating_mul(10)).max(MIN_TTL_SECS)
    }

    /// The job's name.
    pub fn name(&self) -> &str {
        self.name.as_str()
    }

    /// The period.
    pub fn period(&self) -> Duration {
        Duration::from_millis(self.period_ms as u64)
    }

    /// The slot that contains `now_ms`.
    pub fn slot_at(&self, now_ms: i64) -> Slot {
        Slot(now_ms.div_euclid(self.period_ms) * self.period_ms)
    }

    /// The slot after `slot`.
    pub fn next(&self, slot: Slot) -> Slot {
        Slot(slot.0.saturating_add(self.period_ms))
    }

    /// The run id of `slot`: `<job>@<slot start in ms>`.
    pub fn run_id(&self, slot: Slot) -> String {
        format!("{}@{}", self.name, slot.0)
    }
}

/// Runs jobs through the claim of a transactional store (give it its own
/// table, apart from request keys).
#[derive(Debug)]
pub struct Scheduler<B: TxBackend> {
    inbox: Inbox<B>,
    clock: SharedClock,
}

/// The shortest time run ids are kept.
pub const MIN_TTL_SECS: u64 = 7 * 86_400;

impl<B: TxBackend> Scheduler<B> {
    /// A scheduler on `engine`, under the tenant `jobs`, on the engine's clock.
    pub fn new(engine: TxEngine<B>) -> Self {
        let clock = engine.clock().clone();
        Self {
            inbox: Inbox::new(engine).with_tenant(Tenant::new("jobs").expect("a valid tenant")),
            clock,
        }
    }

    /// How long run ids are kept for `job`: ten periods, at least
    /// [`MIN_TTL_SECS`].
    pub fn ttl_secs(job: &Job) -> u64 {
        job.ttl_secs()
    }

    /// Runs `job` under `run_id` once: the first call applies `work`'s
    /// writes with the claim; any later call with the same run id (a retry,
    /// another instance, an operator) answers the recorded outcome without
    /// running `work`. Contention re-runs `work`, a bounded number of times.
    pub async fn run<T, E, F>(&self, job: &Job, run_id: &str, work: F) -> Result<Delivery<T>, E>
    where
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Contention,
    {
        let policy = Policy::default().with_ttl_secs(Self::ttl_secs(job));
        let call = self.inbox.call(job.name(), run_id, b"")?.with_policy(policy);
        self.inbox.process_call(&call, work).await
    }

    /// Runs the slot due now, then each following slot when it starts, until
    /// `shutdown` completes; `make` builds each run's work from its run id.
    /// A slot missed while no instance ran is not caught up: the first run
    /// is the current slot. A failed run is logged and tried again after
    /// `retry` (same run id).
    ///
    /// Slots that go by while a run is running, or while a slot's attempts
    /// keep failing, are handled by the job's [`MissedSlots`] policy:
    /// skipped, each with a log line and a count in
    /// [`SLOTS_SKIPPED`] (`job` label), or run afterwards in order, each
    /// under its own run id, at most `max` of them (older ones are skipped
    /// and counted the same way).
    pub async fn run_every<T, E, M, F>(
        &self,
        job: &Job,
        retry: Duration,
        mut make: M,
        shutdown: impl Future<Output = ()>,
    ) where
        M: FnMut(String) -> F,
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Contention + std::fmt::Display,
    {
        tokio::pin!(shutdown);
        let retry_ms = i64::try_from(retry.as_millis()).unwrap_or(i64::MAX).max(1);
        // The next slot to run.
        let mut due = job.slot_at(self.clock.now_ms());
        loop {
            let now = self.clock.now_ms();
            let current = job.slot_at(now);
            due = job.missed(due, current);
            let wait_ms = if due > current {
                // Every slot up to now has run: wait for the next one.
                due.0.saturating_sub(now)
            } else {
                let run_id = job.run_id(due);
                match self.run(job, &run_id, make(run_id.clone())).await {
                    Ok(d) => {
                        if d.is_applied() {
                            tracing::info!(job = job.name(), %run_id, "job run applied");
                        }
                        due = job.next(due);
                        due.0.saturating_sub(self.clock.now_ms())
                    }
                    Err(e) => {
                        tracing::warn!(job = job.name(), %run_id, error = %e, "job run failed; retrying");
                        // Under `Skip`, the slot is given up once the next one starts.
                        let next = job.next(due).0.saturating_sub(self.clock.now_ms());
                        match job.missed {
                            MissedSlots::Skip => next.min(retry_ms),
                            MissedSlots::CatchUp { .. } => retry_ms,
                        }
                    }
                }
            };
            let wait = Duration::from_millis(u64::try_from(wait_ms.max(1)).unwrap_or(1));
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_and_run_ids_stable() {
        let day = Job::new("statements", Duration::from_secs(86_400)).unwrap();
        let s = day.slot_at(1_732_450_000_000);
        assert_eq!(s, Slot(1_732_406_400_000));
        assert_eq!(day.slot_at(s.0), s);
        assert_eq!(day.slot_at(s.0 - 1), Slot(s.0 - 86_400_000));
        assert_eq!(day.run_id(s), "statements@1732406400000");
        assert_eq!(day.next(s), Slot(1_732_492_800_000));
        assert!(Job::new("x", Duration::from_millis(10)).is_err());
        assert!(Job::new("", Duration::from_secs(60)).is_err());
    }

    #[test]
    fn missed_slots_are_skipped_or_caught_up_within_the_maximum() {
        let job = Job::new("rollup", Duration::from_secs(10)).unwrap();
        let s = |n: i64| Slot(n * 10_000);
        assert_eq!(job.missed(s(3), s(3)), s(3));
        assert_eq!(job.missed(s(4), s(3)), s(4));
        assert_eq!(job.missed(s(1), s(5)), s(5), "skip: the current slot");
        let up = job.clone().with_missed_slots(MissedSlots::CatchUp { max: 2 }).unwrap();
        assert_eq!(up.missed(s(1), s(2)), s(1), "one behind: run it");
        assert_eq!(up.missed(s(1), s(3)), s(1), "two behind: run both");
        assert_eq!(up.missed(s(1), s(6)), s(4), "five behind: the two latest");
        assert!(job.with_missed_slots(MissedSlots::CatchUp { max: 0 }).is_err());
    }

    #[test]
    fn a_clock_years_ahead_skips_its_slots_at_once_and_counts_each() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let job = Job::new("every-second", Duration::from_secs(1)).unwrap();
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let years = 1_000 * 366 * 86_400_000_i64;
        let (done, next) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(metrics::with_local_recorder(&recorder, || {
                job.missed(Slot(0), Slot(years))
            }));
        });
        let next = next
            .recv_timeout(Duration::from_secs(5))
            .expect("skipping a thousand years of slots returns at once");
        assert_eq!(next, Slot(years));
        let counted: Vec<_> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(k, ..)| k.key().name() == SLOTS_SKIPPED)
            .map(|(.., v)| v)
            .collect();
        assert_eq!(counted, [DebugValue::Counter((years / 1_000) as u64)]);
    }

    #[test]
    fn catch_up_never_reaches_past_the_run_ids_retention() {
        // Daily: run ids are kept ten days, so at most nine slots behind.
        let day = Job::new("daily", Duration::from_secs(86_400))
            .unwrap()
            .with_missed_slots(MissedSlots::CatchUp { max: 30 })
            .unwrap();
        let d = |n: i64| Slot(n * 86_400_000);
        assert_eq!(day.missed(d(20), d(25)), d(20), "within the retention: all");
        assert_eq!(day.missed(d(1), d(25)), d(16), "nine behind at most");
        // Every second: kept seven days.
        let second = Job::new("second", Duration::from_secs(1))
            .unwrap()
            .with_missed_slots(MissedSlots::CatchUp { max: u32::MAX })
            .unwrap();
        let now = Slot(10 * 86_400_000);
        assert_eq!(second.missed(Slot(0), now), Slot(now.0 - (7 * 86_400 - 1) * 1_000));
    }
}
