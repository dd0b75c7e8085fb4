//! The live claims: fresh transactional claims from many workers, with a
//! warm-up, over a timed window, and their figures.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::{BoxError, Call, Fingerprint, IdempotencyKey, InFlight, Policy, Scope, TxEngine};
use serde_json::{Value, json};

use crate::db::{Engine, ScaleDb};
use crate::{Args, OPERATIONS, SEEDS, TENANTS, WARMUP};

#[derive(Debug, Clone, Copy)]
pub(crate) struct Figures {
    pub(crate) ops: usize,
    pub(crate) ops_per_sec: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
}

impl Figures {
    pub(crate) fn json(&self) -> Value {
        json!({"ops": self.ops, "ops_per_sec": self.ops_per_sec, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms})
    }
}

pub(crate) fn scope_of(seed: usize) -> Result<Scope, BoxError> {
    Ok(Scope::parse(
        TENANTS[seed / OPERATIONS.len()],
        OPERATIONS[seed % OPERATIONS.len()],
    )?)
}

fn call(scope: &Scope, key: IdempotencyKey) -> Call {
    let fp = Fingerprint::of_bytes(scope.operation(), b"{\"amount\":100,\"currency\":\"EUR\"}");
    Call::new(scope.clone(), key, fp).with_policy(Policy::default().with_in_flight(InFlight::Wait { max_ms: 30_000 }))
}

/// A key spread over the key space: the bits of a UUIDv7 multiplied by an
/// odd constant (a bijection), so keys stay unique and their order is random.
fn random_key() -> Result<IdempotencyKey, BoxError> {
    let mixed = uuid::Uuid::now_v7()
        .as_u128()
        .wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
    let id = uuid::Builder::from_random_bytes(mixed.to_be_bytes()).into_uuid();
    Ok(IdempotencyKey::new(id.to_string())?)
}

/// One fresh claim with its business insert; the outcome is a small JSON
/// object naming the inserted row, as a real handler's would be.
pub(crate) async fn claim<D: ScaleDb>(
    engine: &TxEngine<D>,
    scope: &Scope,
    key: IdempotencyKey,
) -> Result<(), BoxError> {
    let id = uuid::Uuid::now_v7().to_string();
    let out = engine
        .execute(&call(scope, key), move |tx| {
            let id = id.clone();
            Box::pin(async move {
                D::effect(tx, id.clone()).await?;
                Ok::<_, BoxError>(json!({"id": id, "status": "ok"}))
            })
        })
        .await?;
    if out.is_replayed() {
        return Err("a fresh key replayed".into());
    }
    Ok(())
}

/// Latencies of live claims over a window, and the window's length.
#[derive(Debug, Default)]
pub(crate) struct Sample {
    pub(crate) latencies: Vec<Duration>,
    pub(crate) counted: Duration,
}

impl Sample {
    /// Adds another window's latencies and time.
    pub(crate) fn extend(&mut self, other: Sample) {
        self.latencies.extend(other.latencies);
        self.counted += other.counted;
    }

    /// Throughput and percentiles of a copy.
    pub(crate) fn figures_of(&self) -> Figures {
        Sample {
            latencies: self.latencies.clone(),
            counted: self.counted,
        }
        .figures()
    }

    /// Throughput and percentiles.
    pub(crate) fn figures(mut self) -> Figures {
        self.latencies.sort();
        let latencies = &self.latencies;
        let pct = |p: f64| {
            if latencies.is_empty() {
                return 0.0;
            }
            let idx = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len()) - 1;
            latencies[idx].as_secs_f64() * 1000.0
        };
        Figures {
            ops: latencies.len(),
            ops_per_sec: latencies.len() as f64 / self.counted.as_secs_f64().max(1e-9),
            p50_ms: pct(0.50),
            p99_ms: pct(0.99),
        }
    }
}

/// Fresh claims from `--workers` workers: a warm-up, then `--seconds`.
pub(crate) async fn measure<D: ScaleDb>(db: &D, args: &Args) -> Result<Figures, BoxError> {
    Ok(sample(db, args).await?.figures())
}

/// The latencies of [`measure`], unsorted.
pub(crate) async fn sample<D: ScaleDb>(db: &D, args: &Args) -> Result<Sample, BoxError> {
    let engine = Arc::new(TxEngine::new(db.clone()));
    let run = Duration::from_secs(args.seconds);
    let random = args.live_keys == "random";
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..args.workers {
        let engine = engine.clone();
        let scope = scope_of(w % SEEDS)?;
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let t0 = Instant::now();
                if t0.duration_since(start) >= WARMUP + run {
                    break;
                }
                let key = if random {
                    random_key()?
                } else {
                    IdempotencyKey::generate()
                };
                claim(&engine, &scope, key).await?;
                if t0.duration_since(start) >= WARMUP {
                    latencies.push(t0.elapsed());
                }
            }
            Ok::<_, BoxError>(latencies)
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await??);
    }
    Ok(Sample {
        latencies,
        counted: run,
    })
}

pub(crate) fn print_figures(engine: Engine, what: &str, f: &Figures) {
    println!(
        "  {:<8} {:<28} {:>8} ops {:>9.0} ops/s   p50 {:>7.2} ms   p99 {:>7.2} ms",
        engine.name(),
        what,
        f.ops,
        f.ops_per_sec,
        f.p50_ms,
        f.p99_ms
    );
}

pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}
