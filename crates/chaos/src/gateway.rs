//! The gateway mode: `idem gateway` processes (three by default) on one
//! shared store (PostgreSQL or Redis) behind a local round-robin balancer
//! ([`crate::balancer`]), in front of a counting upstream that is not
//! idempotent at all, killed with `kill -9` and restarted, and stopped with
//! SIGTERM, while clients of several tenants retry each logical request
//! through the balancer, with the same keys across tenants. A connection an
//! instance refuses (it is down) goes to the next one; a request in flight
//! on a killed instance is lost with its connection, and retried.
//!
//! The upstream numbers every call it applies (an effect) and answers with
//! that number and the tenant it saw; some calls are slow, and a few apply
//! and then answer 500 (on routes that hold an unknown outcome). The
//! checker proves:
//!
//! - **one effect per key**: the upstream never applies a key twice. A
//!   gateway marks a request sent before its first byte leaves, so a
//!   gateway killed mid-request leaves its key held (an unknown outcome),
//!   never taken over and sent again; once any client has read an effect's
//!   whole answer, that answer was recorded (the gateway ends a body only
//!   after its outcome is settled);
//! - **held outcomes**: a key whose upstream applied it and answered 500 is
//!   applied once, and its retries are told the outcome is unknown; a key
//!   held because its gateway was killed after marking it sent may not have
//!   reached the upstream at all (counted);
//! - **no cross-tenant replay**: every answer names the caller's tenant;
//! - **one answer per key**: every 201 a key's callers read names one effect.
//!
//! The store is attacked too (`storefaults`): on Redis (a server of the
//! run's own) writes are refused for a moment and connections killed; on
//! PostgreSQL the gateways' sessions are terminated mid-use.
//!
//! Run: `cargo run --release -p chaos -- --gateway postgres --ops 20000`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::Error;
use crate::balancer::{Balancer, BalancerCounts};
use crate::gwprocs::{Gateways, Instance, start_upstream};
pub use crate::gwprocs::{idem_binary, idem_fault_binary};
use crate::proxy::{Proxy, ProxyOdds};
use crate::rng::Rng;

/// The store the gateways share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatewayStore {
    /// PostgreSQL (the default keys table of the test database).
    Postgres,
    /// Redis (a key prefix of the run's own).
    Redis,
}

impl std::str::FromStr for GatewayStore {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "postgres" => Ok(Self::Postgres),
            "redis" => Ok(Self::Redis),
            other => Err(format!("{other:?}: the gateway mode runs on postgres or redis")),
        }
    }
}

impl GatewayStore {
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::Redis => "redis",
        }
    }
}

/// One gateway run's settings.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The shared store.
    pub store: GatewayStore,
    /// The seed of every random decision.
    pub seed: u64,
    /// Logical operations.
    pub ops: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// Tenants (each a bearer token); keys repeat across them.
    pub tenants: usize,
    /// Mean milliseconds between faults (a kill or a SIGTERM).
    pub fault_interval_ms: u64,
    /// Gateway processes behind the balancer.
    pub instances: usize,
    /// The `idem` binary; built with cargo if absent.
    pub idem_bin: Option<PathBuf>,
    /// PostgreSQL URL.
    pub postgres_url: String,
    /// Redis URL.
    pub redis_url: String,
    /// Run the gateways with `[tenant] source = "anonymous"`: every caller
    /// shares one key space (the checker must then report cross-tenant
    /// answers).
    pub break_tenancy: bool,
    /// Attack the shared store too (on Redis, a server of the run's own):
    /// writes refused for a moment, connections killed mid-command.
    pub store_faults: bool,
    /// Run gateways built with fault injection whose sent mark is off: a
    /// request cut off by a kill is then sent again, and the checker must
    /// say so.
    pub break_sent_mark: bool,
}

impl GatewayConfig {
    /// Defaults: three gateways, 8 clients, 4 tenants, 2,000 operations, a
    /// fault every 1.5 s.
    pub fn new(store: GatewayStore, seed: u64) -> Self {
        Self {
            store,
            seed,
            ops: 2_000,
            clients: 8,
            tenants: 4,
            fault_interval_ms: 1_500,
            instances: 3,
            idem_bin: std::env::var("CHAOS_IDEM_BIN").ok().map(PathBuf::from),
            postgres_url: idem_conformance::env::postgres_url(),
            redis_url: idem_conformance::env::redis_url(),
            break_tenancy: false,
            store_faults: true,
            break_sent_mark: false,
        }
    }
}

/// What a gateway run saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GatewayReport {
    /// The seed.
    pub seed: u64,
    /// The store.
    pub store: String,
    /// Gateway processes behind the balancer.
    pub instances: usize,
    /// Logical operations.
    pub ops: u64,
    /// Operations answered 201 (first or replayed).
    pub ok: u64,
    /// Operations whose retries were told the outcome is unknown (held).
    pub held: u64,
    /// Operations never answered by the end.
    pub unanswered: u64,
    /// Attempts sent again.
    pub retries: u64,
    /// Replays read (`Idempotent-Replayed: true`).
    pub replays_seen: u64,
    /// 409 in-flight answers.
    pub in_flight_seen: u64,
    /// Attempts that failed at the connection (a gateway down or killed).
    pub connection_failures: u64,
    /// Attempts the client gave up waiting for (their recording goes on).
    pub abandoned: u64,
    /// Effects the upstream applied.
    pub effects: u64,
    /// Keys the upstream applied more than once (each a violation: a sent
    /// request is never sent again).
    pub reapplied: u64,
    /// Keys held as unknown outcomes that the upstream never applied: a
    /// gateway killed after marking the request sent, before it reached
    /// the upstream.
    pub held_unapplied: u64,
    /// `kill -9` of a gateway.
    pub kills: u64,
    /// `kill -9` of each gateway, by instance.
    pub kills_per_instance: Vec<u64>,
    /// SIGTERM of each gateway, by instance.
    pub sigterms_per_instance: Vec<u64>,
    /// Requests the balancer forwarded to each gateway, the connections
    /// each refused while down (passed on to the next), and those no
    /// gateway accepted.
    pub balancer: BalancerCounts,
    /// Times every gateway was killed while the upstream worked on a
    /// request (the first fault of every run).
    pub mid_request_kills: u64,
    /// SIGTERM of a gateway.
    pub sigterms: u64,
    /// Gateway restarts.
    pub restarts: u64,
    /// Seconds the run took.
    pub duration_secs: f64,
    /// The faults of the shared store.
    pub store_faults: crate::storefaults::StoreFaultCounts,
    /// Every property that failed; empty when all held.
    pub violations: Vec<String>,
}

/// What a client saw of one logical operation.
#[derive(Debug, Default)]
struct Seen {
    /// Effects whose whole 201 answer a caller read.
    answers: Vec<u64>,
    held: bool,
    ok: bool,
}

/// One logical operation.
#[derive(Debug, Clone)]
struct Op {
    tenant: String,
    key: String,
    path: String,
    body: String,
}

#[derive(Default)]
struct Tally {
    retries: AtomicU64,
    replays: AtomicU64,
    in_flight: AtomicU64,
    connection_failures: AtomicU64,
    abandoned: AtomicU64,
}

enum Attempt {
    /// A whole 201: the effect it names, whether it was a replay.
    Answered(u64, String),
    /// 409 outcome unknown.
    Held,
    /// Try again.
    Again,
}

async fn attempt(client: &reqwest::Client, base: &str, op: &Op, patience: Option<Duration>, tally: &Tally) -> Attempt {
    let send = client
        .post(format!("{base}{}", op.path))
        .bearer_auth(&op.tenant)
        .header("idempotency-key", format!("\"{}\"", op.key))
        .header("content-type", "application/json")
        .body(op.body.clone())
        .send();
    let read = async {
        let r = send.await?;
        let status = r.status().as_u16();
        let replayed = r.headers().get("idempotent-replayed").is_some();
        let text = r.text().await?;
        Ok::<_, reqwest::Error>((status, replayed, text))
    };
    let result = match patience {
        Some(p) => match tokio::time::timeout(p, read).await {
            Ok(r) => r,
            Err(_) => {
                tally.abandoned.fetch_add(1, Ordering::Relaxed);
                return Attempt::Again;
            }
        },
        None => read.await,
    };
    match result {
        Ok((201, replayed, text)) => {
            if replayed {
                tally.replays.fetch_add(1, Ordering::Relaxed);
            }
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            Attempt::Answered(
                v["effect"].as_u64().unwrap_or(0),
                v["tenant"].as_str().unwrap_or("").to_owned(),
            )
        }
        Ok((409, _, text)) if text.contains("idempotency-outcome-unknown") => Attempt::Held,
        Ok((409, _, _)) => {
            tally.in_flight.fetch_add(1, Ordering::Relaxed);
            Attempt::Again
        }
        Ok(_) => Attempt::Again,
        Err(_) => {
            tally.connection_failures.fetch_add(1, Ordering::Relaxed);
            Attempt::Again
        }
    }
}

/// Sends `op` until it is answered or held, through any of `bases`, for
/// at most `deadline`; answers read go to `seen`. Cross-tenant answers are
/// violations.
#[allow(clippy::too_many_arguments)]
async fn drive(
    client: &reqwest::Client,
    bases: &[String],
    op: &Op,
    rng: &mut Rng,
    deadline: Instant,
    impatient: bool,
    seen: &Mutex<HashMap<(String, String), Seen>>,
    violations: &Mutex<Vec<String>>,
    tally: &Tally,
) {
    let mut first = true;
    while Instant::now() < deadline {
        if !first {
            tally.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(rng.range(20, 200))).await;
        }
        first = false;
        let base = &bases[rng.range(0, bases.len() as u64) as usize];
        let patience = (impatient && rng.chance(0.1)).then(|| Duration::from_millis(rng.range(5, 300)));
        match attempt(client, base, op, patience, tally).await {
            Attempt::Answered(effect, tenant) => {
                if tenant != op.tenant {
                    violations.lock().unwrap().push(format!(
                        "key {}: tenant {} read an answer made for tenant {tenant}",
                        op.key, op.tenant
                    ));
                }
                let mut seen = seen.lock().unwrap();
                let s = seen.entry((op.tenant.clone(), op.key.clone())).or_default();
                s.answers.push(effect);
                s.ok = true;
                return;
            }
            Attempt::Held => {
                seen.lock()
                    .unwrap()
                    .entry((op.tenant.clone(), op.key.clone()))
                    .or_default()
                    .held = true;
                return;
            }
            Attempt::Again => {}
        }
    }
}

const GATEWAY_CONFIG: &str = r#"
upstream_timeout_secs = 5

[tenant]
source = "credentials"
credentials = ["authorization"]

[defaults]
ttl_secs = 3600
lease_ms = 2000
wait_ms = 1000

[[routes]]
method = "POST"
path = "/v1/orders"

[[routes]]
method = "POST"
path = "/v1/fail"
"#;

/// Runs the gateway mode once.
pub async fn run_gateway(config: GatewayConfig) -> Result<GatewayReport, Error> {
    let started = Instant::now();
    let bin = if config.break_sent_mark {
        idem_fault_binary()?
    } else {
        idem_binary(config.idem_bin.as_ref())?
    };
    let run = uuid::Uuid::now_v7().simple().to_string();
    let (upstream_url, upstream) = start_upstream().await?;
    let own_redis = match (config.store, config.store_faults) {
        (GatewayStore::Redis, true) => Some(Arc::new(crate::storefaults::PrivateRedis::start().await?)),
        _ => None,
    };
    let (store, extra) = match config.store {
        GatewayStore::Postgres => (config.postgres_url.clone(), String::new()),
        GatewayStore::Redis => (
            own_redis.as_ref().map_or_else(|| config.redis_url.clone(), |r| r.url()),
            format!("\n[redis]\nprefix = \"chaos-gw-{run}\"\n"),
        ),
    };
    let config_path = std::env::temp_dir().join(format!("chaos-gateway-{run}.toml"));
    let mut text = format!("{GATEWAY_CONFIG}{extra}");
    if config.break_tenancy {
        text = text.replace(
            "source = \"credentials\"\ncredentials = [\"authorization\"]",
            "source = \"anonymous\"",
        );
    }
    std::fs::write(&config_path, text)?;
    let mut gateways = Gateways {
        bin,
        config: config_path.clone(),
        upstream: upstream_url,
        store,
        instances: Vec::new(),
        skip_sent_mark: config.break_sent_mark,
    };
    let n = config.instances.max(1);
    while gateways.instances.len() < n {
        let port = crate::free_port().await?;
        if gateways.instances.iter().all(|g| g.port != port) {
            gateways.instances.push(Instance { port, child: None });
        }
    }
    for i in 0..n {
        gateways.start(i).await?;
    }
    // Every client goes through the balancer: a plain pass-through (no
    // faults of its own) to the next gateway that is up.
    let balancer = Balancer::new(
        gateways
            .instances
            .iter()
            .map(|g| ([127, 0, 0, 1], g.port).into())
            .collect(),
    );
    let front = Proxy::start(balancer.clone(), ProxyOdds::NONE, Rng::new(config.seed)).await?;
    let bases = vec![format!("http://{}", front.addr)];
    let mut report = GatewayReport {
        seed: config.seed,
        store: config.store.name().to_owned(),
        instances: n,
        ..GatewayReport::default()
    };

    // The schedule: tenants share key names, so a gateway that did not
    // scope keys by tenant would replay one tenant's answer to another.
    let mut rng = Rng::new(config.seed);
    let tenants: Vec<String> = (0..config.tenants).map(|t| format!("tenant{t}-{run}")).collect();
    // Two operations per key name, each of a random tenant: of one
    // tenant, the second is a retry of the first from another client.
    let mut ops: Vec<Op> = Vec::with_capacity(config.ops);
    for j in 0..config.ops.div_ceil(2) {
        let fail = rng.chance(0.02);
        let delay = if rng.chance(0.2) { rng.range(50, 1_500) } else { 0 };
        for _ in 0..2 {
            if ops.len() == config.ops {
                break;
            }
            ops.push(Op {
                tenant: tenants[rng.range(0, tenants.len() as u64) as usize].clone(),
                key: format!("k{j}-{run}"),
                path: format!("/v1/{}?delay_ms={delay}", if fail { "fail" } else { "orders" }),
                body: format!("{{\"op\":{j}}}"),
            });
        }
    }
    let seen: Arc<Mutex<HashMap<(String, String), Seen>>> = Arc::default();
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    let tally = Arc::new(Tally::default());
    let next = Arc::new(AtomicU64::new(0));
    let ops = Arc::new(ops);
    let client = ledger::http_builder()
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(0)
        .build()?;

    // Faults: kill -9 (mostly) or SIGTERM one gateway drawn at random,
    // restart it.
    let stop = Arc::new(AtomicBool::new(false));
    let faults = {
        let stop = stop.clone();
        let mut rng = rng.fork(7);
        let interval = config.fault_interval_ms;
        let slow_in_flight = upstream.slow_in_flight.clone();
        tokio::spawn(async move {
            let (mut kills, mut sigterms, mut restarts) = (vec![0u64; n], vec![0u64; n], 0u64);
            // First, by construction: every gateway killed while the upstream
            // works on a request, so a request that may have been applied is
            // cut off from its answer in every run.
            let mut mid_request_kills = 0u64;
            for _ in 0..2_000 {
                if stop.load(Ordering::SeqCst) || slow_in_flight.load(Ordering::SeqCst) > 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if slow_in_flight.load(Ordering::SeqCst) > 0 {
                for (i, k) in kills.iter_mut().enumerate() {
                    gateways.signal(i, "-KILL");
                    *k += 1;
                }
                for i in 0..n {
                    gateways.wait_exit(i, Duration::from_secs(5)).await;
                }
                mid_request_kills += 1;
                for i in 0..n {
                    if gateways.start(i).await.is_ok() {
                        restarts += 1;
                    }
                }
            }
            while !stop.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(rng.range(interval / 2, interval * 3 / 2))).await;
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let i = rng.range(0, n as u64) as usize;
                if rng.chance(0.25) {
                    gateways.signal(i, "-TERM");
                    sigterms[i] += 1;
                    gateways.wait_exit(i, Duration::from_secs(15)).await;
                } else {
                    gateways.signal(i, "-KILL");
                    kills[i] += 1;
                    gateways.wait_exit(i, Duration::from_secs(5)).await;
                }
                tokio::time::sleep(Duration::from_millis(rng.range(50, 500))).await;
                if gateways.start(i).await.is_ok() {
                    restarts += 1;
                }
            }
            (gateways, kills, sigterms, restarts, mid_request_kills)
        })
    };

    // Faults of the store, on their own schedule.
    let store_counts = Arc::new(crate::storefaults::Counters::default());
    let store_attack = if config.store_faults {
        let target = match &own_redis {
            Some(redis) => crate::storefaults::Target::Redis(redis.clone()),
            None => crate::storefaults::Target::Postgres(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&config.postgres_url)
                    .await?,
            ),
        };
        Some(tokio::spawn(crate::storefaults::attack(
            target,
            rng.fork(11),
            config.fault_interval_ms,
            stop.clone(),
            store_counts.clone(),
        )))
    } else {
        None
    };

    let clients: Vec<_> = (0..config.clients)
        .map(|c| {
            let (ops, next, seen, violations, tally, client, bases) = (
                ops.clone(),
                next.clone(),
                seen.clone(),
                violations.clone(),
                tally.clone(),
                client.clone(),
                bases.clone(),
            );
            let mut rng = rng.fork(100 + c as u64);
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst) as usize;
                    let Some(op) = ops.get(i) else { break };
                    let deadline = Instant::now() + Duration::from_secs(20);
                    drive(
                        &client,
                        &bases,
                        op,
                        &mut rng,
                        deadline,
                        true,
                        &seen,
                        &violations,
                        &tally,
                    )
                    .await;
                }
            })
        })
        .collect();
    for c in clients {
        let _ = c.await;
    }
    stop.store(true, Ordering::SeqCst);
    let (mut gateways, kills, sigterms, restarts, mid_request_kills) = faults
        .await
        .map_err(|e| Error::Service(format!("the fault task failed: {e}")))?;
    if let Some(attack) = store_attack {
        let _ = attack.await;
    }
    report.store_faults = store_counts.report();
    report.kills = kills.iter().sum();
    report.kills_per_instance = kills;
    report.sigterms = sigterms.iter().sum();
    report.sigterms_per_instance = sigterms;
    report.mid_request_kills = mid_request_kills;
    report.restarts = restarts;
    for i in 0..n {
        if gateways.instances[i].child.is_none() {
            gateways.start(i).await?;
        }
    }

    // Quiesce: every operation not yet answered or held is driven to its
    // end without faults (a claim cut off by a kill runs out its lease).
    let mut final_rng = rng.fork(999);
    for op in ops.iter() {
        let done = seen
            .lock()
            .unwrap()
            .get(&(op.tenant.clone(), op.key.clone()))
            .is_some_and(|s| s.ok || s.held);
        if !done {
            let deadline = Instant::now() + Duration::from_secs(30);
            drive(
                &client,
                &bases,
                op,
                &mut final_rng,
                deadline,
                false,
                &seen,
                &violations,
                &tally,
            )
            .await;
        }
    }
    for i in 0..n {
        gateways.signal(i, "-TERM");
        gateways.wait_exit(i, Duration::from_secs(15)).await;
    }
    report.balancer = balancer.counts();
    drop(front);
    let _ = std::fs::remove_file(&config_path);
    if config.idem_bin.is_none() || config.break_sent_mark {
        // The run's own copy of the binary.
        let _ = std::fs::remove_file(&gateways.bin);
    }
    if let Some(redis) = own_redis.and_then(|r| Arc::try_unwrap(r).ok()) {
        redis.stop().await;
    }

    // The checks.
    let effects = upstream.effects.lock().unwrap().clone();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let mut violations = std::mem::take(&mut *violations.lock().unwrap());
    let mut distinct: BTreeMap<(String, String), ()> = BTreeMap::new();
    for op in ops.iter() {
        distinct.insert((op.tenant.clone(), op.key.clone()), ());
    }
    report.ops = ops.len() as u64;
    for ((tenant, key), s) in &seen {
        let applied = effects
            .get(&(tenant.clone(), format!("\"{key}\"")))
            .cloned()
            .unwrap_or_default();
        let mut answers = s.answers.clone();
        answers.sort_unstable();
        answers.dedup();
        if answers.len() > 1 {
            violations.push(format!("{tenant}/{key}: callers read different answers {answers:?}"));
        }
        if let Some(&read) = answers.first() {
            if !applied.contains(&read) {
                violations.push(format!(
                    "{tenant}/{key}: an answer names effect {read}, not this key's {applied:?}"
                ));
            }
            // Read whole means recorded: nothing may be applied after it.
            if let Some(after) = applied.iter().find(|&&e| e > read) {
                violations.push(format!(
                    "{tenant}/{key}: effect {after} applied after effect {read} was recorded and read"
                ));
            }
        }
        if s.held && applied.is_empty() {
            report.held_unapplied += 1;
        }
        if applied.len() > 1 {
            report.reapplied += 1;
            violations.push(format!(
                "{tenant}/{key}: the upstream applied it {} times ({applied:?})",
                applied.len()
            ));
        }
    }
    for (t, k) in distinct.keys() {
        let s = seen.get(&(t.clone(), k.clone()));
        if s.is_some_and(|s| s.held) {
            report.held += 1;
        } else if s.is_some_and(|s| s.ok) {
            report.ok += 1;
        } else {
            report.unanswered += 1;
        }
    }
    if report.unanswered > 0 {
        violations.push(format!(
            "{} operations never got an answer, even after the faults stopped",
            report.unanswered
        ));
    }
    report.effects = effects.values().map(|v| v.len() as u64).sum();
    report.retries = tally.retries.load(Ordering::Relaxed);
    report.replays_seen = tally.replays.load(Ordering::Relaxed);
    report.in_flight_seen = tally.in_flight.load(Ordering::Relaxed);
    report.connection_failures = tally.connection_failures.load(Ordering::Relaxed);
    report.abandoned = tally.abandoned.load(Ordering::Relaxed);
    report.violations = violations;
    report.duration_secs = started.elapsed().as_secs_f64();
    Ok(report)
}
