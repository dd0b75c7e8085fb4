//! Jobs on PostgreSQL, MariaDB and SQLite: one slot started by many tasks
//! and by a second scheduler instance (its own pool) runs once; a failed
//! attempt leaves the slot to its retry; an explicit run id runs once.

#[macro_use]
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::tag;
use idem_core::{Error, TableName, TxEngine};
use idem_jobs::{Job, Scheduler};

macro_rules! jobs_suite {
    ($engine:ident, $store:ty, $pool:ty, $open:expr, $create:literal, $insert:literal, $count:literal) => {
        mod $engine {
            use super::*;

            struct Subject {
                instances: Vec<Scheduler<$store>>,
                pool: $pool,
                effects: Arc<String>,
            }

            async fn subject() -> Subject {
                let tag = tag();
                let table = TableName::new(format!("jobs_{tag}")).unwrap();
                let mut instances = Vec::new();
                let mut first_pool = None;
                // Two instances, each with its own pool, as two processes would have.
                for _ in 0..2 {
                    let (store, pool): ($store, $pool) = $open(&tag, table.clone()).await;
                    store.migrate().await.expect("migrate");
                    instances.push(Scheduler::new(TxEngine::new(store)));
                    first_pool.get_or_insert(pool);
                }
                let pool = first_pool.unwrap();
                let effects = format!("job_effects_{tag}");
                sqlx::query(sqlx::AssertSqlSafe(format!($create, effects)))
                    .execute(&pool)
                    .await
                    .expect("create the effects table");
                Subject {
                    instances,
                    pool,
                    effects: Arc::new(effects),
                }
            }

            impl Subject {
                async fn run(&self, instance: usize, job: &Job, run_id: &str, fail: bool) -> Result<bool, Error> {
                    let effects = self.effects.clone();
                    let run = run_id.to_owned();
                    self.instances[instance]
                        .run(job, run_id, move |tx| {
                            let (effects, run) = (effects.clone(), run.clone());
                            Box::pin(async move {
                                common::insert_run(&mut **tx, format!($insert, effects), &run, fail).await
                            })
                        })
                        .await
                        .map(|d| d.is_applied())
                }

                async fn effects(&self, run_id: &str) -> i64 {
                    sqlx::query_scalar(sqlx::AssertSqlSafe(format!($count, self.effects)))
                        .bind(run_id)
                        .fetch_one(&self.pool)
                        .await
                        .expect("count")
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn one_slot_started_by_many_tasks_and_two_instances_runs_once() {
                let s = Arc::new(subject().await);
                let job = Job::new("statements", Duration::from_secs(3_600)).unwrap();
                let run_id = job.run_id(job.slot_at(1_732_450_000_000));
                let tasks: Vec<_> = (0..16)
                    .map(|i| {
                        let (s, job, run_id) = (s.clone(), job.clone(), run_id.clone());
                        tokio::spawn(async move {
                            loop {
                                match s.run(i % 2, &job, &run_id, false).await {
                                    Err(Error::InFlight { retry_after }) => tokio::time::sleep(retry_after).await,
                                    other => return other.expect("run"),
                                }
                            }
                        })
                    })
                    .collect();
                let mut applied = 0;
                for t in tasks {
                    applied += usize::from(t.await.unwrap());
                }
                assert_eq!(applied, 1, "one attempt ran the job");
                assert_eq!(s.effects(&run_id).await, 1, "its writes committed once");
                // The next slot is another run.
                let next = job.run_id(job.next(job.slot_at(1_732_450_000_000)));
                assert!(s.run(1, &job, &next, false).await.unwrap());
                assert_eq!(s.effects(&next).await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_failed_attempt_leaves_the_slot_to_its_retry() {
                let s = subject().await;
                let job = Job::new("fees", Duration::from_secs(86_400)).unwrap();
                let run_id = job.run_id(job.slot_at(1_732_450_000_000));
                assert!(s.run(0, &job, &run_id, true).await.is_err());
                assert_eq!(s.effects(&run_id).await, 0, "the failed attempt wrote nothing");
                assert!(s.run(1, &job, &run_id, false).await.unwrap(), "the retry runs");
                assert!(
                    !s.run(0, &job, &run_id, false).await.unwrap(),
                    "a third attempt is a no-op"
                );
                assert_eq!(s.effects(&run_id).await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn an_explicit_run_id_runs_once() {
                let s = subject().await;
                let job = Job::new("backfill", Duration::from_secs(86_400)).unwrap();
                assert!(s.run(0, &job, "backfill-2026-11", false).await.unwrap());
                assert!(!s.run(1, &job, "backfill-2026-11", false).await.unwrap());
                assert_eq!(s.effects("backfill-2026-11").await, 1);
            }
        }
    };
}

on_every_engine!(jobs_suite);
