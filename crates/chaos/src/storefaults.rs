//! Faults of the store the gateways share, while they serve: writes
//! refused (a Redis of the run's own at `maxmemory` under `noeviction` for
//! a moment) and connections killed mid-command (Redis `CLIENT KILL`,
//! PostgreSQL `pg_terminate_backend`), so a command may be applied and
//! reported as failed. Every recovery path of the gateways — the sent
//! mark refused, a completion refused and tried again, a write applied
//! but reported as failed — is attacked by them.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use sqlx::Row;

use crate::Error;
use crate::rng::Rng;

/// What the store attack did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StoreFaultCounts {
    /// Windows in which the store refused every write.
    pub refusal_windows: u64,
    /// Milliseconds the store refused writes, in all.
    pub refusal_ms: u64,
    /// Store connections killed mid-use.
    pub sessions_killed: u64,
}

/// A Redis server of the run's own, so that filling it harms nobody.
pub(crate) struct PrivateRedis {
    child: tokio::process::Child,
    port: u16,
}

impl PrivateRedis {
    pub(crate) async fn start() -> Result<Self, Error> {
        let port = crate::free_port().await?;
        let child = tokio::process::Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        for _ in 0..400 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
                return Ok(Self { child, port });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(Error::Service("the run's Redis did not start".into()))
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn cli(&self, args: &[&str]) -> Result<String, Error> {
        let out = tokio::process::Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .stderr(Stdio::null())
            .output()
            .await?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    pub(crate) async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// The store under attack.
pub(crate) enum Target {
    /// The run's own Redis.
    Redis(Arc<PrivateRedis>),
    /// A PostgreSQL database the gateways use.
    Postgres(sqlx::PgPool),
}

/// Attacks the store until `stop` is set: every `interval` ±50 %, one
/// fault. The first two faults are a refusal window and a session kill, so
/// every run has both.
pub(crate) async fn attack(
    target: Target,
    mut rng: Rng,
    interval_ms: u64,
    stop: Arc<std::sync::atomic::AtomicBool>,
    counts: Arc<Counters>,
) {
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(rng.range(interval_ms / 2, interval_ms * 3 / 2))).await;
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let refuse = match n {
            0 => true,
            1 => false,
            _ => rng.chance(0.5),
        };
        n += 1;
        let result = match (&target, refuse) {
            (Target::Redis(redis), true) => {
                let window = rng.range(200, 1_500);
                refuse_writes(redis, window, &counts).await
            }
            (Target::Redis(redis), false) => match redis.cli(&["CLIENT", "KILL", "TYPE", "normal"]).await {
                Ok(killed) => {
                    counts
                        .sessions_killed
                        .fetch_add(killed.parse().unwrap_or(0), Ordering::Relaxed);
                    Ok(())
                }
                Err(e) => Err(e),
            },
            // PostgreSQL has no refusal switch that spares the admin: its
            // faults are sessions killed, twice as often.
            (Target::Postgres(admin), _) => kill_postgres_sessions(admin, &counts).await,
        };
        if let Err(e) = result {
            eprintln!("chaos: a store fault could not be injected: {e}");
        }
    }
}

async fn refuse_writes(redis: &PrivateRedis, window_ms: u64, counts: &Counters) -> Result<(), Error> {
    redis.cli(&["CONFIG", "SET", "maxmemory", "1"]).await?;
    tokio::time::sleep(Duration::from_millis(window_ms)).await;
    // Lifted whatever happens, and checked.
    for _ in 0..50 {
        if redis
            .cli(&["CONFIG", "SET", "maxmemory", "0"])
            .await
            .is_ok_and(|r| r == "OK")
        {
            counts.refusal_windows.fetch_add(1, Ordering::Relaxed);
            counts.refusal_ms.fetch_add(window_ms, Ordering::Relaxed);
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(Error::Service("the run's Redis kept refusing writes".into()))
}

async fn kill_postgres_sessions(admin: &sqlx::PgPool, counts: &Counters) -> Result<(), Error> {
    let row = sqlx::query(
        "SELECT COUNT(*) FILTER (WHERE pg_terminate_backend(pid)) FROM \
         (SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() \
          AND backend_type = 'client backend' ORDER BY random() LIMIT 3) s",
    )
    .fetch_one(admin)
    .await?;
    counts
        .sessions_killed
        .fetch_add(row.get::<i64, _>(0).max(0) as u64, Ordering::Relaxed);
    Ok(())
}

/// Counts, shared with the attacking task.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    refusal_windows: AtomicU64,
    refusal_ms: AtomicU64,
    sessions_killed: AtomicU64,
}

impl Counters {
    pub(crate) fn report(&self) -> StoreFaultCounts {
        StoreFaultCounts {
            refusal_windows: self.refusal_windows.load(Ordering::Relaxed),
            refusal_ms: self.refusal_ms.load(Ordering::Relaxed),
            sessions_killed: self.sessions_killed.load(Ordering::Relaxed),
        }
    }
}
