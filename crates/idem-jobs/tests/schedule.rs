//! `run_every` on PostgreSQL, MariaDB and SQLite with a job slower than its
//! period, and with attempts failing until their slot ends: under `Skip`
//! every slot is either run once or counted in
//! `idem_job_slots_skipped_total`; under `CatchUp` missed slots run
//! afterwards, in order, each under its own run id, at most `max` of them.

#[macro_use]
mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::tag;
use idem_core::{BoxFuture, Error, TableName, TxBackend, TxEngine};
use idem_jobs::{Job, MissedSlots, SLOTS_SKIPPED, Scheduler, Slot};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

const PERIOD: Duration = Duration::from_secs(1);

/// The skipped-slot counters seen so far, by job: a snapshot resets the
/// recorder's counters, so every test adds what it takes here.
fn skipped(job: &str) -> u64 {
    static RECORDER: OnceLock<Snapshotter> = OnceLock::new();
    static SEEN: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);
    let snapshotter = RECORDER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("the only recorder of this test binary");
        snapshotter
    });
    let mut seen = SEEN.lock().unwrap();
    let seen = seen.get_or_insert_with(HashMap::new);
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        if key.name() != SLOTS_SKIPPED {
            continue;
        }
        if let (Some(label), DebugValue::Counter(n)) = (key.labels().find(|l| l.key() == "job"), value) {
            *seen.entry(label.value().to_owned()).or_default() += n;
        }
    }
    seen.get(job).copied().unwrap_or(0)
}

/// What the job does in one attempt of a slot: sleep, then fail or not.
type Behaviour = Arc<dyn Fn(Slot, u32) -> (Duration, bool) + Send + Sync>;

/// What one schedule did.
#[derive(Debug)]
struct Outcome {
    /// The slot current when the schedule started.
    first: Slot,
    /// The slots applied, in the order their runs committed.
    applied: Vec<Slot>,
    /// The slots counted as skipped.
    skipped: u64,
}

impl Outcome {
    /// Every slot from the first to the last one applied.
    fn span(&self) -> Vec<Slot> {
        let last = *self.applied.iter().max().expect("a slot applied");
        let period = i64::try_from(PERIOD.as_millis()).unwrap();
        (0..)
            .map(|n| Slot(self.first.0 + n * period))
            .take_while(|s| *s <= last)
            .collect()
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Gives a closure the job work's higher-ranked signature.
fn work<Tx, F>(f: F) -> F
where
    F: for<'c> FnMut(&'c mut Tx) -> BoxFuture<'c, Result<(), Error>>,
{
    f
}

macro_rules! schedule_suite {
    ($engine:ident, $store:ty, $pool:ty, $open:expr, $create:literal, $insert:literal, $count:literal) => {
        mod $engine {
            use super::*;
            use idem_core::Clock as _;

            /// Runs `job` with `behaviour` for `length`, then checks that each
            /// applied slot's writes committed once.
            async fn schedule(job: Job, retry: Duration, behaviour: Behaviour, length: Duration) -> Outcome {
                // The recorder is there before anything is counted.
                assert_eq!(skipped(job.name()), 0);
                let tag = tag();
                let table = TableName::new(format!("sched_{tag}")).unwrap();
                let (store, pool): ($store, $pool) = $open(&tag, table).await;
                store.migrate().await.expect("migrate");
                let effects = Arc::new(format!("sched_effects_{tag}"));
                sqlx::query(sqlx::AssertSqlSafe(format!($create, effects)))
                    .execute(&pool)
                    .await
                    .expect("create the effects table");
                let scheduler = Scheduler::new(TxEngine::new(store));
                let applied = Arc::new(Mutex::new(Vec::new()));
                let attempts = Arc::new(Mutex::new(HashMap::<i64, u32>::new()));
                let period = i64::try_from(job.period().as_millis()).unwrap();
                let first = job.slot_at(idem_core::SystemClock.now_ms());
                let make = |run_id: String| {
                    let (effects, applied, attempts, behaviour) = (
                        effects.clone(),
                        applied.clone(),
                        attempts.clone(),
                        behaviour.clone(),
                    );
                    let slot = Slot(run_id.rsplit('@').next().unwrap().parse().unwrap());
                    work::<<$store as TxBackend>::Tx, _>(move |tx| {
                        let (effects, applied, attempts, behaviour, run_id) = (
                            effects.clone(),
                            applied.clone(),
                            attempts.clone(),
                            behaviour.clone(),
                            run_id.clone(),
                        );
                        Box::pin(async move {
                            let attempt = {
                                let mut a = attempts.lock().unwrap();
                                let n = a.entry(slot.0).or_default();
                                *n += 1;
                                *n
                            };
                            let (sleep, fail) = behaviour(slot, attempt);
                            tokio::time::sleep(sleep).await;
                            common::insert_run(&mut **tx, format!($insert, effects), &run_id, fail).await?;
                            applied.lock().unwrap().push(slot);
                            Ok(())
                        })
                    })
                };
                let name = job.name().to_owned();
                scheduler
                    .run_every(&job, retry, make, tokio::time::sleep(length))
                    .await;
                let applied = applied.lock().unwrap().clone();
                for slot in &applied {
                    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!($count, effects)))
                        .bind(job.run_id(*slot))
                        .fetch_one(&pool)
                        .await
                        .expect("count");
                    assert_eq!(n, 1, "slot {slot:?}'s writes committed once");
                }
                assert!(applied.iter().all(|s| (s.0 - first.0) % period == 0));
                Outcome {
                    first,
                    applied,
                    skipped: skipped(&name),
                }
            }

            fn job(name: &str, missed: MissedSlots) -> Job {
                Job::new(&format!("{name}-{}", tag()), PERIOD)
                    .unwrap()
                    .with_missed_slots(missed)
                    .unwrap()
            }

            /// The first run takes `first_sleep` (longer than a period); the
            /// others are quick.
            fn slow_first(first_sleep: Duration) -> Behaviour {
                let first = Mutex::new(None);
                Arc::new(move |slot, _| {
                    let mut f = first.lock().unwrap();
                    let is_first = *f.get_or_insert(slot) == slot;
                    (if is_first { first_sleep } else { Duration::ZERO }, false)
                })
            }

            /// The first slot's first `attempts` attempts fail; every other
            /// attempt succeeds at once.
            fn failing_first(attempts: u32) -> Behaviour {
                let first = Mutex::new(None);
                Arc::new(move |slot, attempt| {
                    let fail = *first.lock().unwrap().get_or_insert(slot) == slot && attempt <= attempts;
                    (Duration::ZERO, fail)
                })
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_run_slower_than_its_period_skips_the_slots_it_overlapped_and_counts_them() {
                let job = job("slow-skip", MissedSlots::Skip);
                let out = schedule(job, ms(100), slow_first(ms(2_500)), ms(5_500)).await;
                assert_eq!(out.applied[0], out.first, "the first slot runs");
                assert!(out.applied.windows(2).all(|w| w[0] < w[1]), "in order: {out:?}");
                let span = out.span();
                let missing = span.iter().filter(|s| !out.applied.contains(s)).count() as u64;
                assert!(missing >= 1, "a 2.5-period run overlaps a whole slot: {out:?}");
                assert!(
                    !out.applied.contains(&Slot(out.first.0 + 1_000)),
                    "the overlapped slot did not run: {out:?}"
                );
                assert_eq!(
                    out.skipped, missing,
                    "each slot not run is counted as skipped: {out:?}"
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn catch_up_runs_the_slots_a_slow_run_overlapped_in_order() {
                let job = job("slow-catch-up", MissedSlots::CatchUp { max: 10 });
                let out = schedule(job, ms(100), slow_first(ms(2_500)), ms(5_500)).await;
                assert_eq!(out.applied, out.span(), "every slot ran, in order: {out:?}");
                assert!(out.applied.len() >= 4, "{out:?}");
                assert_eq!(out.skipped, 0);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn catch_up_runs_at_most_its_maximum_and_counts_the_rest() {
                let job = job("slow-bounded", MissedSlots::CatchUp { max: 1 });
                let out = schedule(job, ms(100), slow_first(ms(3_500)), ms(6_000)).await;
                assert!(out.applied.windows(2).all(|w| w[0] < w[1]), "in order: {out:?}");
                let span = out.span();
                let missing: Vec<_> = span.iter().filter(|s| !out.applied.contains(s)).collect();
                // 3.5 periods overlap at least two whole slots: the latest
                // one missed runs, the older ones are skipped.
                assert!(!missing.is_empty(), "{out:?}");
                assert!(out.applied[1] > Slot(out.first.0 + 1_000), "{out:?}");
                assert_eq!(out.skipped, missing.len() as u64, "{out:?}");
                let slow_end = out.applied[1];
                assert!(
                    missing.iter().all(|s| **s < slow_end),
                    "only slots before the caught-up one are skipped: {out:?}"
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_slot_failing_until_it_ends_is_counted_as_skipped() {
                let job = job("failing-skip", MissedSlots::Skip);
                let out = schedule(job, ms(150), failing_first(u32::MAX), ms(3_500)).await;
                assert!(
                    !out.applied.contains(&out.first),
                    "the failing slot never applied"
                );
                assert!(out.applied.len() >= 2, "the slots after it run: {out:?}");
                assert_eq!(out.applied[0], Slot(out.first.0 + 1_000), "{out:?}");
                assert_eq!(out.skipped, 1, "the failed slot is counted once: {out:?}");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn catch_up_retries_a_failing_slot_past_its_end_then_runs_the_rest_in_order() {
                let job = job("failing-catch-up", MissedSlots::CatchUp { max: 10 });
                // The first slot's attempts fail for 1.6 periods (16 attempts 100 ms apart).
                let out = schedule(job, ms(100), failing_first(16), ms(4_500)).await;
                assert_eq!(out.applied[0], out.first, "{out:?}");
                assert_eq!(out.applied, out.span(), "every slot ran, in order: {out:?}");
                assert!(out.applied.len() >= 3, "{out:?}");
                assert_eq!(out.skipped, 0);
            }
        }
    };
}

on_every_engine!(schedule_suite);
