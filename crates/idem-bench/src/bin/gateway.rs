//! Gateway benchmark: `idem gateway` (on Redis, SQLite and PostgreSQL)
//! against `idempotent-proxy-server` (Redis), in front of one upstream, at
//! equal TTL: requests/s, p50 and p99 for fresh keys and for replays at 1,
//! 16 and 64 connections, in one run, with the ratios; and each gateway's
//! CPU per request: the process's `utime + stime` (`/proc/<pid>/stat`,
//! every thread, ended ones included) over the scenario, divided by the
//! requests it completed.
//!
//! ```text
//! cargo install idempotent-proxy-server --version 1.2.2 --root /tmp/ipx
//! cargo build --release -p idem-cli -p idem-bench
//! IPX_BIN=/tmp/ipx/bin/idempotent-proxy-server target/release/gateway --seconds 4
//! target/release/gateway --stores redis --connections 1,16   # idem on Redis only
//! ```
//!
//! A gateway that does not start (missing binary, exits, never listens)
//! stops the run with its log. Prints figures; asserts nothing about time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use clap::Parser;
use idem_bench::cost;

#[derive(Debug, Parser)]
struct Args {
    /// Seconds per scenario.
    #[arg(long, default_value_t = 4)]
    seconds: u64,
    /// Connection counts.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    connections: Vec<usize>,
    /// The stores idem gateway runs on (redis, sqlite, postgres).
    #[arg(long, value_delimiter = ',', default_value = "redis,sqlite,postgres")]
    stores: Vec<String>,
    /// The idempotent-proxy-server binary.
    #[arg(long, env = "IPX_BIN", default_value = "idempotent-proxy-server")]
    ipx_bin: PathBuf,
    /// The idem binary (default: next to this one).
    #[arg(long, env = "IDEM_BIN")]
    idem_bin: Option<PathBuf>,
    /// Redis server (the benchmark uses its database 14 and flushes it).
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// PostgreSQL server (a database of its own is created).
    #[arg(
        long,
        env = "IDEM_TEST_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    postgres_url: String,
    /// Key TTL of both gateways, seconds.
    #[arg(long, default_value_t = 60)]
    ttl_secs: u64,
    /// Where to write the figures.
    #[arg(long, default_value = "target/bench-gateway.json")]
    out: String,
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until the gateway `name` listens on `port`; stops the run with
/// its log if it exits first or never listens.
async fn wait_started(name: &str, proc: &mut Proc, port: u16, log: &Path) {
    fn failed(name: &str, log: &Path, why: String) -> ! {
        let log = std::fs::read_to_string(log).unwrap_or_default();
        panic!("{name} did not start: {why}\n--- its log ---\n{log}");
    }
    for _ in 0..400 {
        if let Ok(Some(status)) = proc.0.try_wait() {
            failed(name, log, format!("it exited ({status})"));
        }
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    failed(name, log, format!("nothing listens on 127.0.0.1:{port} after 10 s"));
}

/// One target: how to name a request to it.
struct Target {
    name: String,
    url: String,
    /// idem gateway: sf-string keys and a bearer token.
    idem: bool,
    proc: Proc,
}

impl Target {
    /// The gateway process's CPU time so far, µs.
    fn cpu_us(&self, ticks_per_sec: u64) -> u64 {
        cost::process_stat_cpu_us(self.proc.0.id(), ticks_per_sec).unwrap_or_else(|| {
            panic!(
                "{}: /proc/{}/stat is unreadable (did it exit?)",
                self.name,
                self.proc.0.id()
            )
        })
    }
}

#[derive(Default, Clone, Copy)]
struct Figures {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
    /// Requests answered with a success.
    completed: u64,
    /// The gateway's CPU over the scenario per completed request, µs.
    cpu_us_per_req: f64,
}

async fn load(target: &Target, connections: usize, seconds: u64, replay_keys: Option<Arc<Vec<String>>>) -> Figures {
    let client = ledger::http_builder()
        .pool_max_idle_per_host(connections)
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..connections {
        let (client, url, idem, keys, errors) = (
            client.clone(),
            target.url.clone(),
            target.idem,
            replay_keys.clone(),
            errors.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut i = c;
            while Instant::now() < deadline {
                let key = match &keys {
                    Some(k) => k[i % k.len()].clone(),
                    None => uuid::Uuid::now_v7().to_string(),
                };
                i += connections;
                let mut req = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(r#"{"item":"book","qty":1}"#);
                req = if idem {
                    req.header("idempotency-key", format!("\"{key}\"")).bearer_auth("bench")
                } else {
                    req.header("idempotency-key", key)
                };
                let started = Instant::now();
                match req.send().await {
                    Ok(r) if r.status().is_success() => {
                        let _ = r.bytes().await;
                        lat.push(started.elapsed().as_secs_f64() * 1000.0);
                    }
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        if all.is_empty() {
            f64::NAN
        } else {
            all[((all.len() - 1) as f64 * p).round() as usize]
        }
    };
    Figures {
        rps: all.len() as f64 / seconds as f64,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        errors: errors.load(Ordering::Relaxed),
        completed: all.len() as u64,
        cpu_us_per_req: f64::NAN,
    }
}

/// One scenario, with the gateway's CPU time read around it.
async fn measured(
    target: &Target,
    ticks_per_sec: u64,
    connections: usize,
    seconds: u64,
    replay_keys: Option<Arc<Vec<String>>>,
) -> Figures {
    let before = target.cpu_us(ticks_per_sec);
    let mut f = load(target, connections, seconds, replay_keys).await;
    let after = target.cpu_us(ticks_per_sec);
    if f.completed > 0 {
        f.cpu_us_per_req = after.saturating_sub(before) as f64 / f.completed as f64;
    }
    f
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    for store in &args.stores {
        assert!(
            ["redis", "sqlite", "postgres"].contains(&store.as_str()),
            "--stores: unknown store {store:?} (redis, sqlite, postgres)"
        );
    }
    let ticks_per_sec = cost::clock_ticks_per_sec().unwrap_or_else(|e| panic!("{e}"));
    let with_postgres = args.stores.iter().any(|s| s == "postgres");
    // The upstream: creates an order on every call.
    let orders = Arc::new(AtomicU64::new(0));
    let counted = orders.clone();
    let upstream = Router::new().route(
        "/v1/orders",
        post(move |body: String| {
            let n = counted.fetch_add(1, Ordering::Relaxed) + 1;
            async move { (StatusCode::CREATED, format!("{{\"order\":{n},\"request\":{body}}}")) }
        }),
    );
    let up_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = up_listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(up_listener, upstream).await.unwrap() });

    let redis_db = format!("{}/14", args.redis_url.trim_end_matches('/'));
    let flush = || {
        let _ = Command::new("redis-cli")
            .args(["-n", "14", "FLUSHDB"])
            .stdout(Stdio::null())
            .status();
    };
    flush();
    let db = "idem_gateway_bench";
    let pg = if with_postgres {
        let pg = sqlx::PgPool::connect(&args.postgres_url).await.expect("PostgreSQL");
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
        )))
        .execute(&pg)
        .await;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
            .execute(&pg)
            .await
            .unwrap();
        Some(pg)
    } else {
        None
    };
    let (base, _) = args.postgres_url.rsplit_once('/').unwrap();
    let pg_url = format!("{base}/{db}");
    let tmp = std::env::temp_dir().join(format!("idem-gw-bench-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();

    let idem_bin = args
        .idem_bin
        .clone()
        .unwrap_or_else(|| std::env::current_exe().unwrap().parent().unwrap().join("idem"));
    let ttl_ms = args.ttl_secs * 1000;

    let mut targets = Vec::new();
    // idempotent-proxy-server: reads a .env file from its working directory.
    {
        let port = free_port();
        std::fs::write(tmp.join(".env"), "").unwrap();
        let log = tmp.join("ipx.log");
        let child = Command::new(&args.ipx_bin)
            .current_dir(&tmp)
            .env("SERVER_ADDR", format!("127.0.0.1:{port}"))
            .env("REDIS_URL", &redis_db)
            .env("REQUEST_TIMEOUT", ttl_ms.to_string())
            .env("URL_ORDERS", format!("http://{up}/v1/orders"))
            .env("LOG_LEVEL", "error")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {} (set IPX_BIN): {e}", args.ipx_bin.display()));
        let name = "idempotent-proxy (Redis)";
        let mut proc = Proc(child);
        wait_started(name, &mut proc, port, &log).await;
        targets.push(Target {
            name: name.into(),
            url: format!("http://127.0.0.1:{port}/URL_ORDERS"),
            idem: false,
            proc,
        });
    }
    for (kind, name, store) in [
        ("redis", "idem gateway (Redis)", redis_db.clone()),
        (
            "sqlite",
            "idem gateway (SQLite)",
            tmp.join("gw.db").display().to_string(),
        ),
        ("postgres", "idem gateway (PostgreSQL)", pg_url.clone()),
    ] {
        if !args.stores.iter().any(|s| s == kind) {
            continue;
        }
        let port = free_port();
        let config = tmp.join(format!("{port}.toml"));
        // Keys live longer than an upstream call may take, as the gateway requires.
        std::fs::write(
            &config,
            format!(
                "upstream_timeout_secs = {}\n[tenant]\nsource = \"credentials\"\ncredentials = [\"authorization\"]\n\
                 [defaults]\nttl_secs = {}\nlease_ms = {}\n",
                (args.ttl_secs / 2).max(1),
                args.ttl_secs.max(2),
                (args.ttl_secs * 500).clamp(1, 30_000)
            ),
        )
        .unwrap();
        let child = Command::new(&idem_bin)
            .args([
                "gateway",
                "--upstream",
                &format!("http://{up}"),
                "--listen",
                &format!("127.0.0.1:{port}"),
            ])
            .args(["--store", &store, "--config"])
            .arg(&config)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(tmp.join(format!("{kind}.log"))).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {} (set IDEM_BIN): {e}", idem_bin.display()));
        let mut proc = Proc(child);
        wait_started(name, &mut proc, port, &tmp.join(format!("{kind}.log"))).await;
        targets.push(Target {
            name: name.into(),
            url: format!("http://127.0.0.1:{port}/v1/orders"),
            idem: true,
            proc,
        });
    }

    let mut results: BTreeMap<String, BTreeMap<String, serde_json::Value>> = BTreeMap::new();
    let mut table: Vec<(String, String, usize, Figures)> = Vec::new();
    for target in &targets {
        // Keys to replay: recorded once before the replay runs.
        let keys: Vec<String> = (0..256).map(|_| uuid::Uuid::now_v7().to_string()).collect();
        let warm = load(target, 4, 1, None).await;
        if warm.rps == 0.0 {
            panic!("{} answers no request", target.name);
        }
        for k in &keys {
            let mut req = ledger::http_builder()
                .build()
                .expect("an HTTP client")
                .post(&target.url)
                .header("content-type", "application/json")
                .body(r#"{"item":"book","qty":1}"#);
            req = if target.idem {
                req.header("idempotency-key", format!("\"{k}\"")).bearer_auth("bench")
            } else {
                req.header("idempotency-key", k.clone())
            };
            let r = req.send().await.unwrap();
            assert!(r.status().is_success(), "{}: {}", target.name, r.status());
        }
        let keys = Arc::new(keys);
        for &c in &args.connections {
            for (scenario, replay) in [("fresh", None), ("replay", Some(keys.clone()))] {
                let f = measured(target, ticks_per_sec, c, args.seconds, replay).await;
                println!(
                    "{:<28} {scenario:<6} {c:>3} conns: {:>8.0} req/s  p50 {:>6.2} ms  p99 {:>7.2} ms  \
                     CPU {:>6.1} µs/req  errors {}",
                    target.name, f.rps, f.p50_ms, f.p99_ms, f.cpu_us_per_req, f.errors
                );
                results.entry(target.name.clone()).or_default().insert(
                    format!("{scenario}_{c}"),
                    serde_json::json!({
                        "rps": f.rps.round(),
                        "p50_ms": f.p50_ms,
                        "p99_ms": f.p99_ms,
                        "errors": f.errors,
                        "requests": f.completed,
                        "cpu_us_per_req": (f.cpu_us_per_req * 10.0).round() / 10.0,
                    }),
                );
                table.push((target.name.clone(), scenario.into(), c, f));
            }
        }
    }
    println!("\nratios against idempotent-proxy (req/s ×, p99 ×, CPU per request ×):");
    let base: Vec<&(String, String, usize, Figures)> =
        table.iter().filter(|r| r.0.starts_with("idempotent-proxy")).collect();
    for row in table.iter().filter(|r| r.0.starts_with("idem gateway")) {
        if let Some(b) = base.iter().find(|b| b.1 == row.1 && b.2 == row.2) {
            let cpu = row.3.cpu_us_per_req / b.3.cpu_us_per_req;
            println!(
                "{:<28} {:<6} {:>3} conns: {:>5.2}× req/s, {:>5.2}× p99, {:>5.2}× CPU µs/req",
                row.0,
                row.1,
                row.2,
                row.3.rps / b.3.rps,
                row.3.p99_ms / b.3.p99_ms,
                cpu
            );
            results.entry(row.0.clone()).or_default().insert(
                format!("{}_{}_vs_idempotent_proxy", row.1, row.2),
                serde_json::json!({
                    "rps_ratio": row.3.rps / b.3.rps,
                    "p99_ratio": row.3.p99_ms / b.3.p99_ms,
                    "cpu_us_per_req_ratio": cpu,
                }),
            );
        }
    }
    println!("upstream orders created: {}", orders.load(Ordering::Relaxed));
    if let Some(dir) = std::path::Path::new(&args.out).parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&results).unwrap()).unwrap();
    println!("figures written to {}", args.out);
    drop(targets);
    flush();
    if let Some(pg) = &pg {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
        )))
        .execute(pg)
        .await;
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
