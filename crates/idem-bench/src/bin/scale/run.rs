//! One engine's run: the seed rows, the claims at the small and the large
//! number of stored keys, the bytes per key, and the sweep under live
//! traffic; its tables dropped whatever happened.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idem_core::{BoxError, IdempotencyKey, SweepOptions, TxEngine};
use serde_json::{Value, json};

use crate::claims::{Sample, claim, measure, print_figures, ratio, sample, scope_of};
use crate::db::{Engine, ScaleDb, drop_all, fresh_effects, settle};
use crate::load::load;
use crate::size::{bytes, server};
use crate::{Args, KEYS_TABLE, SEEDS};

/// Measures one engine, and drops its tables whatever happened.
pub(crate) async fn scale_engine<D: ScaleDb>(db: D, args: &Args) -> Result<Value, BoxError> {
    let result = measure_engine(&db, args).await;
    let dropped = drop_all(&db).await;
    let result = result?;
    dropped?;
    Ok(result)
}

async fn measure_engine<D: ScaleDb>(db: &D, args: &Args) -> Result<Value, BoxError> {
    let db = db.clone();
    let engine = D::ENGINE;
    let name = engine.name();
    println!("\n== {name} ==");
    drop_all(&db).await?;
    db.migrate_keys().await?;
    db.exec(engine.create_effects()).await?;
    let server = server(&db).await?;

    // Seed rows: written by the store itself, one per (tenant, operation).
    let tx_engine = TxEngine::new(db.clone());
    for seed in 0..SEEDS {
        claim(
            &tx_engine,
            &scope_of(seed)?,
            IdempotencyKey::new(format!("seed-{seed}"))?,
        )
        .await?;
    }
    db.exec(engine.copy_seeds()).await?;
    let columns = db.texts(engine.columns()).await?;
    if !["idem_key", "created_at_ms", "expires_at_ms"]
        .iter()
        .all(|c| columns.iter().any(|k| k == c))
    {
        return Err(format!("{name}: unexpected columns {columns:?}").into());
    }

    // 1. Claims with the small number of stored keys.
    let small_keys = args.small_keys.saturating_sub(SEEDS as u64);
    load(&db, &columns, small_keys, "small", None).await?;
    settle(&db).await?;
    fresh_effects(&db).await?;
    let small = measure(&db, args).await?;
    print_figures(engine, &format!("claims at {} keys", args.small_keys), &small);

    // ... and with the large number: the table is emptied and loaded again,
    // so that its pages are filled as the large number's own traffic would
    // have filled them.
    let keys_table = engine.quote(KEYS_TABLE);
    db.exec(match engine {
        Engine::Sqlite => format!("DELETE FROM {keys_table}"),
        Engine::Postgres | Engine::MySql => format!("TRUNCATE TABLE {keys_table}"),
    })
    .await?;
    let load_seconds = load(&db, &columns, args.keys, "large", None).await?;
    if engine == Engine::Postgres {
        // A table that grew over time has been vacuumed and analysed by
        // autovacuum; a fresh bulk load has not.
        db.exec(format!("VACUUM ANALYZE {}", engine.quote(KEYS_TABLE))).await?;
    } else if engine == Engine::MySql {
        db.exec(format!("ANALYZE TABLE {}", engine.quote(KEYS_TABLE))).await?;
    } else {
        db.exec("ANALYZE".to_owned()).await?;
    }
    settle(&db).await?;
    fresh_effects(&db).await?;
    let large = measure(&db, args).await?;
    print_figures(engine, &format!("claims at {} keys", args.keys), &large);
    let p99_ratio = ratio(large.p99_ms, small.p99_ms);
    println!(
        "  {name:<8} p99 at {} keys / at {} keys = {p99_ratio:.3} (target <= 1.1)",
        args.keys, args.small_keys
    );

    // 2. Bytes per key.
    let bytes = bytes(&db).await?;

    // 3. Sweeping expired rows under live traffic.
    let now_ms = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis(),
    )?;
    let expired_load_seconds = load(&db, &columns, args.sweep_rows, "expired", Some(now_ms - 60_000)).await?;
    let expired = db
        .int(format!(
            "SELECT COUNT(*) FROM {} WHERE expires_at_ms <= {now_ms}",
            engine.quote(KEYS_TABLE)
        ))
        .await?;
    println!("  {name:<8} {expired} expired rows in the table");
    settle(&db).await?;
    fresh_effects(&db).await?;
    let options = SweepOptions {
        batch_size: args.sweep_batch,
        pause: Duration::from_millis(args.sweep_pause_ms),
        busy_percent: args.sweep_busy_percent,
        ..SweepOptions::default()
    };
    let sweep = PausedSweep::start(db.clone(), options);
    let (mut without, mut during) = (Sample::default(), Sample::default());
    for round in 1..=args.sweep_rounds {
        sweep.pause().await;
        let live = sample(&db, args).await?;
        print_figures(engine, &format!("live claims, no sweep ({round})"), &live.figures_of());
        without.extend(live);
        sweep.resume().await;
        let live = sample(&db, args).await?;
        print_figures(engine, &format!("live claims, sweeping ({round})"), &live.figures_of());
        during.extend(live);
        if sweep.ended() {
            break;
        }
    }
    let swept = sweep.stop().await?;
    let (live_without, live_during) = (without.figures(), during.figures());
    print_figures(engine, "live claims, no sweep", &live_without);
    print_figures(engine, "live claims during the sweep", &live_during);
    let sweep_ratio = ratio(live_during.p99_ms, live_without.p99_ms);
    let sweep_secs = swept.sweeping.as_secs_f64();
    let rows_per_sec = swept.deleted as f64 / sweep_secs.max(1e-9);
    println!(
        "  {name:<8} sweep: {} of {expired} rows in {} batches, {sweep_secs:.1} s sweeping, {rows_per_sec:.0} rows/s \
         ({}% busy at most{}); live p99 during / without = {sweep_ratio:.3} (target <= 1.2)",
        swept.deleted,
        swept.batches,
        args.sweep_busy_percent,
        if swept.finished {
            "; it finished before the rounds did"
        } else {
            ""
        }
    );

    Ok(json!({
        "engine": name,
        "keys_small": args.small_keys,
        "keys_large": args.keys,
        "small": small.json(),
        "large": large.json(),
        "p99_ratio": p99_ratio,
        "p99_target": 1.1,
        "p99_met": p99_ratio <= 1.1,
        "sweep": {
            "expired": expired,
            "rows": swept.deleted,
            "seconds": sweep_secs,
            "rows_per_sec": rows_per_sec,
            "batches": swept.batches,
            "rounds": args.sweep_rounds,
            "busy_percent": args.sweep_busy_percent,
            "finished": swept.finished,
            "live_without": live_without.json(),
            "live_during": live_during.json(),
            "p99_ratio": sweep_ratio,
            "p99_target": 1.2,
            "p99_met": sweep_ratio <= 1.2,
        },
        "bytes": bytes,
        "load_seconds": load_seconds,
        "expired_load_seconds": expired_load_seconds,
        "server": server,
    }))
}

/// What the sweep did over the rounds.
struct Swept {
    deleted: u64,
    batches: u64,
    /// Time spent sweeping (batches, and the rests taken while it ran).
    sweeping: Duration,
    /// Whether it found nothing more to delete before the rounds ended (the
    /// later windows "with" the sweep then had none).
    finished: bool,
}

/// The sweep of the run: batches paced as [`SweepOptions::rest_after`]
/// says (the rule of `idem_core::sweep_expired`), held between batches
/// while the live claims without a sweep are measured. A batch runs only
/// under the lock of the `running` flag, so once [`pause`](Self::pause)
/// has set it no batch is in flight and none starts.
struct PausedSweep {
    running: Arc<tokio::sync::Mutex<bool>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Result<Swept, BoxError>>,
}

impl PausedSweep {
    /// Starts held.
    fn start<D: ScaleDb>(db: D, options: SweepOptions) -> Self {
        let running = Arc::new(tokio::sync::Mutex::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (running, stop) = (running.clone(), stop.clone());
            tokio::spawn(async move {
                let mut swept = Swept {
                    deleted: 0,
                    batches: 0,
                    sweeping: Duration::ZERO,
                    finished: false,
                };
                while !stop.load(Ordering::SeqCst) && !swept.finished {
                    let now_ms = i64::try_from(
                        std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)?
                            .as_millis(),
                    )?;
                    let started = Instant::now();
                    let batch = {
                        let running = running.lock().await;
                        if !*running {
                            drop(running);
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            continue;
                        }
                        db.sweep_batch(now_ms, options.batch_size).await?
                    };
                    let took = started.elapsed();
                    swept.sweeping += took;
                    swept.deleted += batch.deleted;
                    swept.batches += 1;
                    swept.finished = batch.examined < u64::from(options.batch_size);
                    // The rest, counted while the sweep runs; a pause cuts
                    // it short (the held window leaves the room anyway).
                    let rest = options.rest_after(took);
                    let resting = Instant::now();
                    while !swept.finished && resting.elapsed() < rest && *running.lock().await {
                        tokio::time::sleep(rest.saturating_sub(resting.elapsed()).min(Duration::from_millis(5))).await;
                    }
                    swept.sweeping += resting.elapsed();
                }
                Ok(swept)
            })
        };
        Self { running, stop, task }
    }

    /// Holds the sweep: returns once no batch is in flight.
    async fn pause(&self) {
        *self.running.lock().await = false;
    }

    async fn resume(&self) {
        *self.running.lock().await = true;
    }

    /// Whether the sweep has ended on its own (nothing left, or an error).
    fn ended(&self) -> bool {
        self.task.is_finished()
    }

    async fn stop(self) -> Result<Swept, BoxError> {
        self.stop.store(true, Ordering::SeqCst);
        *self.running.lock().await = false;
        self.task.await?
    }
}
