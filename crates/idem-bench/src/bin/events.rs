//! Events benchmark: relay throughput (events/s) with 1 and 4 relays,
//! consumer throughput through the inbox, and end-to-end lag (commit to the
//! projection's handler) per engine, against the local NATS JetStream.
//!
//! `cargo run --release -p idem-bench --bin events -- --events 20000`
//!
//! Prints figures; asserts nothing about time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use clap::Parser;
use idem_core::{OutboxEvent, OutboxStore, TableName, TxEngine};
use idem_inbox::Inbox;
use idem_jetstream::{ConsumerOptions, Event, HandlerError, InboxConsumer, JetStreamPublisher};
use idem_outbox::{Relay, RelayOptions};

#[derive(Debug, Parser)]
struct Args {
    /// Events per throughput measurement.
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Seconds of the lag measurement.
    #[arg(long, default_value_t = 10)]
    lag_seconds: u64,
    /// Events per second during the lag measurement.
    #[arg(long, default_value_t = 300)]
    lag_rate: u64,
    /// Engines.
    #[arg(long, value_delimiter = ',', default_value = "postgres,mysql,sqlite")]
    engines: Vec<String>,
    /// The servers.
    #[command(flatten)]
    urls: idem_bench::engines::EngineUrls,
    #[arg(long, env = "IDEM_TEST_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Where to write the figures.
    #[arg(long, default_value = "target/bench-events.json")]
    out: String,
}

/// When each event committed, for the lag.
type Commits = Arc<Mutex<HashMap<String, Instant>>>;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Ends once `stopped` turns true: the shutdown of a relay or a consumer.
async fn until_stopped(mut stopped: tokio::sync::watch::Receiver<bool>) {
    let _ = stopped.wait_for(|s| *s).await;
}

/// Starts `n` relays of `outbox` publishing to `js`, each waiting
/// `idle_wait` after a pass that found nothing, until `stopped` turns true.
fn start_relays<S: OutboxStore>(
    n: usize,
    outbox: &S,
    js: &jetstream::Context,
    idle_wait: Duration,
    stopped: &tokio::sync::watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..n)
        .map(|_| {
            let relay = Relay::new(
                outbox.clone(),
                JetStreamPublisher::new(js.clone()),
                RelayOptions {
                    idle_wait,
                    ..Default::default()
                },
            );
            let stopped = stopped.clone();
            tokio::spawn(async move { relay.run(until_stopped(stopped)).await })
        })
        .collect()
}

macro_rules! engine_bench {
    ($name:ident, $store:ty, $outbox:ty, $pool:ty, $insert:literal, $create:literal) => {
        /// Measures `store` (its inbox table and the outbox's on `pool`
        /// named after `tag`) against `js`.
        async fn $name(
            args: &Args,
            store: $store,
            pool: $pool,
            js: &jetstream::Context,
            tag: &str,
        ) -> serde_json::Value {
            let table = |prefix: &str| TableName::new(format!("{prefix}_{tag}")).unwrap();
            let store = store.with_table(table("bench_inbox"));
            let outbox = <$outbox>::with_table(pool.clone(), table("bench_outbox"));
            store.migrate().await.unwrap();
            outbox.migrate().await.unwrap();
            let effects = format!("bench_effects_{tag}");
            sqlx::query(sqlx::AssertSqlSafe(format!($create, effects)))
                .execute(&pool)
                .await
                .unwrap();
            let subjects = format!("bench_{tag}");
            let stream_name = format!("BENCH_{tag}");
            js.create_stream(stream::Config {
                name: stream_name.clone(),
                subjects: vec![format!("{subjects}.>")],
                storage: stream::StorageType::File,
                duplicate_window: Duration::from_secs(120),
                // Within the inbox's TTL (seven days): the consumer refuses
                // a stream that keeps messages longer.
                max_age: Duration::from_secs(86_400),
                // Room for a dead letter's headers under the server's max_payload.
                max_message_size: i32::try_from(
                    js.client().server_info().max_payload - idem_jetstream::DEAD_LETTER_HEADROOM,
                )
                .unwrap(),
                ..Default::default()
            })
            .await
            .unwrap();
            // Dead letters go to a stream of their own (none is expected),
            // kept until they are handled: no max_age.
            js.create_stream(stream::Config {
                name: format!("{stream_name}_DEAD"),
                subjects: vec![format!("{subjects}_dead")],
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .unwrap();

            // Fill the outbox in transactions of 500 events.
            let fill = |n: usize| {
                let (pool, outbox, subjects) = (pool.clone(), outbox.clone(), subjects.clone());
                async move {
                    let mut left = n;
                    while left > 0 {
                        let mut tx = pool.begin().await.unwrap();
                        for _ in 0..left.min(500) {
                            let e = OutboxEvent::new(format!("{subjects}.x"), br#"{"amount":1}"#.to_vec()).unwrap();
                            outbox.enqueue(&mut *tx, &e).await.unwrap();
                        }
                        tx.commit().await.unwrap();
                        left -= left.min(500);
                    }
                }
            };
            let mut relay_figures = serde_json::Map::new();
            for relays in [1usize, 4] {
                fill(args.events).await;
                let started = Instant::now();
                let (stop, stopped) = tokio::sync::watch::channel(false);
                let tasks = start_relays(relays, &outbox, js, Duration::from_millis(5), &stopped);
                while outbox.lag().await.unwrap().unsent > 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let secs = started.elapsed().as_secs_f64();
                let _ = stop.send(true);
                for t in tasks {
                    t.await.unwrap();
                }
                let rate = args.events as f64 / secs;
                println!("  relays {relays}: {rate:>9.0} events/s");
                relay_figures.insert(format!("relays_{relays}_events_per_s"), rate.round().into());
            }

            // Consumer throughput over what the relays published.
            let total = 2 * args.events;
            let commits: Commits = Arc::new(Mutex::new(HashMap::new()));
            let lags: Arc<Mutex<Vec<f64>>> = Arc::new(Mutex::new(Vec::new()));
            let consumer = js
                .get_stream(&stream_name)
                .await
                .unwrap()
                .get_or_create_consumer(
                    "bench",
                    pull::Config {
                        durable_name: Some("bench".into()),
                        ack_policy: jetstream::consumer::AckPolicy::Explicit,
                        max_deliver: -1,
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            let mut options = ConsumerOptions::new("bench");
            options.concurrency = 16;
            options.dead_letter_subject = format!("{subjects}_dead");
            let handler = {
                let (effects, commits, lags) = (Arc::new(effects.clone()), commits.clone(), lags.clone());
                idem_jetstream::handler::<$store, _>(move |tx, event: Arc<Event>| {
                    if let Some(at) = commits.lock().unwrap().get(&event.id) {
                        lags.lock().unwrap().push(at.elapsed().as_secs_f64() * 1000.0);
                    }
                    let effects = effects.clone();
                    Box::pin(async move {
                        sqlx::query(sqlx::AssertSqlSafe(format!($insert, effects)))
                            .bind(event.id.clone())
                            .execute(&mut **tx)
                            .await
                            .map_err(HandlerError::retry)?;
                        Ok(())
                    })
                })
            };
            let consumer = InboxConsumer::start(
                js.clone(),
                consumer,
                Inbox::new(TxEngine::new(store.clone())),
                options,
                handler,
            )
            .await
            .unwrap();
            let count = || {
                let pool = pool.clone();
                let effects = effects.clone();
                async move {
                    let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {effects}")))
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                    n as usize
                }
            };
            let (stop, stopped) = tokio::sync::watch::channel(false);
            let running = tokio::spawn(async move { consumer.run(until_stopped(stopped)).await });
            let started = Instant::now();
            while count().await < total {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let consumer_rate = total as f64 / started.elapsed().as_secs_f64();
            println!("  consumer (16 at once): {consumer_rate:>9.0} events/s");

            // End-to-end lag at a steady rate, two relays and the consumer running.
            let (rstop, rstopped) = tokio::sync::watch::channel(false);
            let relays = start_relays(2, &outbox, js, Duration::from_millis(20), &rstopped);
            let n = (args.lag_seconds * args.lag_rate) as usize;
            let interval = Duration::from_secs_f64(1.0 / args.lag_rate as f64);
            let mut ticker = tokio::time::interval(interval);
            for _ in 0..n {
                ticker.tick().await;
                let e = OutboxEvent::new(format!("{subjects}.x"), br#"{"amount":1}"#.to_vec()).unwrap();
                let mut tx = pool.begin().await.unwrap();
                outbox.enqueue(&mut *tx, &e).await.unwrap();
                tx.commit().await.unwrap();
                commits.lock().unwrap().insert(e.id().to_owned(), Instant::now());
            }
            while count().await < total + n {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = rstop.send(true);
            for r in relays {
                r.await.unwrap();
            }
            let _ = stop.send(true);
            running.await.unwrap();
            let mut lags = lags.lock().unwrap().clone();
            lags.sort_by(f64::total_cmp);
            let (p50, p99) = (percentile(&lags, 0.5), percentile(&lags, 0.99));
            println!(
                "  lag commit → handler at {} events/s: p50 {p50:.1} ms, p99 {p99:.1} ms ({} samples)",
                args.lag_rate,
                lags.len()
            );
            let _ = js.delete_stream(&stream_name).await;
            let _ = js.delete_stream(format!("{stream_name}_DEAD")).await;
            let mut v = serde_json::Map::new();
            v.extend(relay_figures);
            v.insert("consumer_events_per_s".into(), consumer_rate.round().into());
            v.insert("lag_rate_per_s".into(), args.lag_rate.into());
            v.insert("lag_p50_ms".into(), ((p50 * 10.0).round() / 10.0).into());
            v.insert("lag_p99_ms".into(), ((p99 * 10.0).round() / 10.0).into());
            serde_json::Value::Object(v)
        }
    };
}

engine_bench!(
    bench_postgres,
    idem_postgres::PgStore,
    idem_postgres::PgOutbox,
    sqlx::PgPool,
    "INSERT INTO {} (event_id) VALUES ($1)",
    "CREATE TABLE {} (event_id TEXT NOT NULL)"
);
engine_bench!(
    bench_mysql,
    idem_mysql::MySqlStore,
    idem_mysql::MySqlOutbox,
    sqlx::MySqlPool,
    "INSERT INTO {} (event_id) VALUES (?)",
    "CREATE TABLE {} (event_id VARCHAR(64) NOT NULL)"
);
engine_bench!(
    bench_sqlite,
    idem_sqlite::SqliteStore,
    idem_sqlite::SqliteOutbox,
    sqlx::SqlitePool,
    "INSERT INTO {} (event_id) VALUES (?1)",
    "CREATE TABLE {} (event_id TEXT NOT NULL)"
);

/// A pool of 24 connections on the server at `url` (`engine`, as a failure
/// names it).
async fn server_pool<DB: sqlx::Database>(url: &str, engine: &str) -> sqlx::Pool<DB> {
    idem_bench::engines::pool(url, 24, engine).await.unwrap()
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let client = async_nats::connect(&args.nats_url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach NATS at {}: {e}", args.nats_url));
    let js = jetstream::new(client);
    let mut results = serde_json::Map::new();
    for engine in &args.engines {
        let t = uuid::Uuid::now_v7().simple().to_string();
        let tag = &t[t.len() - 10..];
        println!("{engine}:");
        let figures = match engine.as_str() {
            "postgres" => {
                let pool = server_pool(&args.urls.postgres_url, "postgres").await;
                bench_postgres(&args, idem_postgres::PgStore::new(pool.clone()), pool, &js, tag).await
            }
            "mysql" => {
                let pool = server_pool(&args.urls.mysql_url, "mysql").await;
                bench_mysql(&args, idem_mysql::MySqlStore::new(pool.clone()), pool, &js, tag).await
            }
            "sqlite" => {
                let path = std::env::temp_dir().join(format!("idem-bench-events-{tag}.db"));
                let store = idem_sqlite::SqliteStore::open(&path).await.unwrap();
                let pool = store.pool().clone();
                bench_sqlite(&args, store, pool, &js, tag).await
            }
            other => panic!("unknown engine {other}"),
        };
        results.insert(engine.clone(), figures);
    }
    let out = serde_json::json!({ "events": args.events, "results": results });
    if let Some(dir) = std::path::Path::new(&args.out).parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&out).unwrap()).unwrap();
    println!("figures written to {}", args.out);
}
