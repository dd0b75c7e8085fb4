//! Catching up never reruns a slot whose run id the sweeper may have
//! removed: one instance's daily runs fail for two weeks while another
//! instance runs the slots on time; the expired run ids are swept; when the
//! first one recovers, its catch-up stops at the slots whose run ids are
//! still kept, so every slot's effect happened at most once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{BoxFuture, Error, ManualClock, StoreErrorKind, SweepOptions, TableName, TxEngine};
use idem_jobs::{Job, MissedSlots, Scheduler, Slot};
use idem_sqlite::{SqliteStore, SqliteTx};

const DAY_MS: i64 = 86_400_000;

fn work<F>(f: F) -> F
where
    F: for<'c> FnMut(&'c mut SqliteTx) -> BoxFuture<'c, Result<(), Error>>,
{
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catch_up_stops_at_the_slots_whose_run_ids_are_still_kept() {
    let t = uuid::Uuid::now_v7().simple().to_string();
    let tag = &t[t.len() - 12..];
    let path = std::env::temp_dir().join(format!("idem-retention-{tag}.db"));
    let store = SqliteStore::open(&path)
        .await
        .expect("open")
        .with_table(TableName::new(format!("retention_{tag}")).unwrap());
    store.migrate().await.expect("migrate");
    let job = Job::new("daily", Duration::from_secs(86_400))
        .unwrap()
        .with_missed_slots(MissedSlots::CatchUp { max: 30 })
        .unwrap();
    let first = Slot(20_000 * DAY_MS);
    let clock = ManualClock::new(first.0 + 1_000);
    let engine = || TxEngine::new(store.clone()).with_clock(Arc::new(clock.clone()));
    // How many times each slot's effect committed.
    let effects = Arc::new(Mutex::new(HashMap::<i64, u32>::new()));
    let count = |run_id: &str| -> Slot { Slot(run_id.rsplit('@').next().unwrap().parse().unwrap()) };

    // Instance A: its runs fail until `recovered`.
    let recovered = Arc::new(AtomicBool::new(false));
    // The slots A built a run for.
    let attempted = Arc::new(Mutex::new(Vec::<Slot>::new()));
    let stop = Arc::new(tokio::sync::Notify::new());
    let a = {
        let (scheduler, job, effects, recovered, attempted, stop) = (
            Scheduler::new(engine()),
            job.clone(),
            effects.clone(),
            recovered.clone(),
            attempted.clone(),
            stop.clone(),
        );
        tokio::spawn(async move {
            let make = |run_id: String| {
                let (effects, recovered) = (effects.clone(), recovered.clone());
                let slot = count(&run_id);
                attempted.lock().unwrap().push(slot);
                work(move |_tx| {
                    let (effects, recovered) = (effects.clone(), recovered.clone());
                    Box::pin(async move {
                        if !recovered.load(Ordering::SeqCst) {
                            return Err(Error::store(StoreErrorKind::Unavailable, "down"));
                        }
                        *effects.lock().unwrap().entry(slot.0).or_default() += 1;
                        Ok(())
                    })
                })
            };
            scheduler
                .run_every(&job, Duration::from_millis(5), make, stop.notified())
                .await;
        })
    };

    // A is retrying its first slot before time moves on.
    for _ in 0..1_000 {
        if attempted.lock().unwrap().len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(attempted.lock().unwrap()[..2], [first, first], "A's first slot fails");

    // Instance B, started a day later, runs each following slot on time.
    let b = Scheduler::new(engine());
    for n in 1..=14 {
        let slot = Slot(first.0 + n * DAY_MS);
        clock.set(slot.0 + 1_000);
        let effects = effects.clone();
        b.run(
            &job,
            &job.run_id(slot),
            work(move |_tx| {
                let effects = effects.clone();
                Box::pin(async move {
                    *effects.lock().unwrap().entry(slot.0).or_default() += 1;
                    Ok(())
                })
            }),
        )
        .await
        .expect("B's run");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Run ids kept ten days: those of the first four slots B ran are swept.
    let swept = idem_core::sweep_expired(&store, &clock, SweepOptions::default())
        .await
        .expect("sweep");
    assert!(swept.deleted >= 4, "the expired run ids were swept: {swept:?}");

    recovered.store(true, Ordering::SeqCst);
    let current = Slot(first.0 + 14 * DAY_MS);
    // A catches up to the current slot, then waits for the next one.
    for _ in 0..1_000 {
        if attempted.lock().unwrap().contains(&current) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let days = |slots: &[Slot]| slots.iter().map(|s| (s.0 - first.0) / DAY_MS).collect::<Vec<_>>();
    let tried = attempted.lock().unwrap().clone();
    assert!(
        tried.contains(&current),
        "A caught up to the current slot: {:?}",
        days(&tried)
    );
    stop.notify_one();
    a.await.expect("A stops");

    let effects = effects.lock().unwrap().clone();
    let mut slots: Vec<_> = effects.into_iter().collect();
    slots.sort();
    for (slot, n) in &slots {
        assert_eq!(
            *n,
            1,
            "slot {} of {current:?} ran {n} times: {slots:?}",
            (slot - first.0) / DAY_MS
        );
    }
    let _ = std::fs::remove_file(&path);
}
