//! Retention: deleting expired keys in bounded batches.

use std::time::Duration;

use crate::clock::Clock;
use crate::error::Result;
use crate::store::Sweep;

/// What a sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Rows deleted.
    pub deleted: u64,
    /// Index entries removed whose row the store had already deleted by
    /// itself (see [`SweepBatch::ghosts`](crate::SweepBatch::ghosts)); not counted in `deleted`.
    pub ghosts: u64,
    /// Batches run (each one short transaction).
    pub batches: u64,
}

/// How a sweep runs.
///
/// A sweep paces itself by the time its batches take: after a batch that
/// took `t`, it rests at least `t × (100 − busy_percent) / busy_percent`
/// (and at least `pause`), so it spends at most `busy_percent` of its
/// running time inside the database, however slow the server is today.
/// A fixed pause cannot do that: a batch of 1 000 rows took about 20 ms on
/// PostgreSQL and 85 ms on MariaDB on the same machine under live load, so
/// the old 10 ms pause left the sweep in the database about two thirds and
/// nine tenths of the time (`docs/benchmarks.md`, "The sweep under live traffic"). No rest
/// is longer than [`MAX_SWEEP_REST`] unless the pause is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepOptions {
    /// Rows deleted per batch: small batches keep each transaction short, so
    /// live traffic is never blocked for long.
    pub batch_size: u32,
    /// The least pause between batches.
    pub pause: Duration,
    /// The most of its running time the sweep spends in its batches, in
    /// percent (1–100; 0 counts as 1, more than 100 as 100): the rest after
    /// each batch is the batch's own time scaled to leave the rest to live
    /// traffic. 100 rests only [`pause`](Self::pause).
    pub busy_percent: u8,
    /// Stop after this many batches (`None`: until nothing expired is left).
    pub max_batches: Option<u64>,
}

impl Default for SweepOptions {
    /// Batches of 1 000 rows, at most 20% of the time busy, at least 10 ms
    /// apart, until nothing expired is left.
    fn default() -> Self {
        Self {
            batch_size: 1_000,
            pause: Duration::from_millis(10),
            busy_percent: DEFAULT_SWEEP_BUSY_PERCENT,
            max_batches: None,
        }
    }
}

/// The default [`SweepOptions::busy_percent`].
pub const DEFAULT_SWEEP_BUSY_PERCENT: u8 = 20;

/// The longest rest [`SweepOptions::rest_after`] scales to (a longer
/// [`pause`](SweepOptions::pause) still counts): a batch held up for a
/// minute by a lock does not hold the sweep back for four more.
pub const MAX_SWEEP_REST: Duration = Duration::from_secs(10);

impl SweepOptions {
    /// The rest after a batch that took `batch`: `batch` scaled by
    /// [`busy_percent`](Self::busy_percent), at most [`MAX_SWEEP_REST`],
    /// at least [`pause`](Self::pause).
    pub fn rest_after(&self, batch: Duration) -> Duration {
        let busy = u32::from(self.busy_percent.clamp(1, 100));
        let scaled = batch.checked_mul(100 - busy).map_or(Duration::MAX, |d| d / busy);
        scaled.min(MAX_SWEEP_REST).max(self.pause)
    }

    /// Whether a sweep that has run `batches` batches may run another.
    pub fn allows_another(&self, batches: u64) -> bool {
        self.max_batches.is_none_or(|max| batches < max)
    }
}

/// Deletes expired keys in batches until none is left (or `max_batches`).
///
/// The sweep goes on while its batches find work of any kind — rows to
/// delete, or index entries left behind by rows the store expired by itself
/// ([`SweepBatch::ghosts`](crate::SweepBatch::ghosts)) — and stops after the first batch that took up
/// fewer than `batch_size`.
///
/// ```
/// # async fn demo(store: &impl idem_core::Sweep) -> idem_core::Result<()> {
/// use idem_core::{sweep_expired, SweepOptions, SystemClock};
/// let report = sweep_expired(store, &SystemClock, SweepOptions::default()).await?;
/// println!("deleted {} expired keys in {} batches", report.deleted, report.batches);
/// # Ok(()) }
/// ```
pub async fn sweep_expired<S: Sweep + ?Sized>(
    store: &S,
    clock: &dyn Clock,
    options: SweepOptions,
) -> Result<SweepReport> {
    let batch_size = options.batch_size.max(1);
    let mut report = SweepReport::default();
    while options.allows_another(report.batches) {
        let started = tokio::time::Instant::now();
        let batch = store.sweep_batch(clock.now_ms(), batch_size).await?;
        let took = started.elapsed();
        report.batches += 1;
        report.deleted += batch.deleted;
        report.ghosts += batch.ghosts;
        metrics::counter!(crate::metrics::SWEPT).increment(batch.deleted);
        metrics::counter!(crate::metrics::SWEPT_GHOSTS).increment(batch.ghosts);
        if batch.examined < u64::from(batch_size) || !options.allows_another(report.batches) {
            break;
        }
        let rest = options.rest_after(took);
        if !rest.is_zero() {
            tokio::time::sleep(rest).await;
        }
    }
    // A periodic sweeper that found nothing says so only at debug level.
    if report.deleted > 0 || report.ghosts > 0 {
        tracing::info!(
            deleted = report.deleted,
            ghosts = report.ghosts,
            batches = report.batches,
            "swept expired idempotency keys"
        );
    } else {
        tracing::debug!(batches = report.batches, "swept: no expired idempotency keys");
    }
    Ok(report)
}

/// How many keys a store holds, by state (for operators).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyStats {
    /// Lease-mode claims still running (or abandoned, until their lease runs out).
    pub in_progress: u64,
    /// Recorded successes.
    pub completed: u64,
    /// Recorded final rejections.
    pub rejected: u64,
    /// Unknown outcomes held for an operator.
    pub unknown: u64,
    /// Lease-mode claims marked sent: in flight while their lease lives,
    /// unknown outcomes once it has run out (never taken over).
    pub sent: u64,
    /// Keys past their expiry, waiting for the sweeper.
    pub expired: u64,
}

/// Which stored keys an operator command selects.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyFilter {
    /// Only this tenant.
    pub tenant: Option<String>,
    /// Only this operation.
    pub operation: Option<String>,
    /// Only keys that start with this.
    pub key_prefix: Option<String>,
    /// Only keys in this state.
    pub state: Option<KeyState>,
    /// Only keys created at least this long ago, in ms.
    pub older_than_ms: Option<i64>,
}

impl KeyFilter {
    /// Whether `key` passes every filter set, at `now_ms` (for stores that
    /// select in their own process rather than in SQL; the SQL stores turn
    /// the same rules into a `WHERE` clause).
    pub fn matches(&self, key: &KeyInfo, now_ms: i64) -> bool {
        self.tenant.as_deref().is_none_or(|t| t == key.tenant)
            && self.operation.as_deref().is_none_or(|o| o == key.operation)
            && self.key_prefix.as_deref().is_none_or(|p| key.key.starts_with(p))
            && self.state.is_none_or(|s| s == key.state)
            && self
                .older_than_ms
                .is_none_or(|age| key.created_at_ms <= now_ms.saturating_sub(age))
    }
}

/// A stored key's state, for selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyState {
    /// A lease-mode claim still running (not expired).
    InProgress,
    /// A recorded success (not expired).
    Completed,
    /// A recorded final rejection (not expired).
    Rejected,
    /// An unknown outcome held for an operator (not expired).
    Unknown,
    /// A lease-mode claim marked sent: its request may have reached the
    /// other side (not expired). Once its lease has run out it is held like
    /// an unknown outcome, and resolved like one.
    Sent,
    /// Past its expiry, whatever it holds.
    Expired,
}

impl KeyState {
    /// The state of a row with `status` expiring at `expires_at_ms`, at `now_ms`.
    pub fn of(status: i16, expires_at_ms: i64, now_ms: i64) -> Self {
        if expires_at_ms <= now_ms {
            KeyState::Expired
        } else {
            match status {
                crate::record::STATUS_IN_PROGRESS => KeyState::InProgress,
                crate::record::STATUS_REJECTED => KeyState::Rejected,
                crate::record::STATUS_UNKNOWN => KeyState::Unknown,
                crate::record::STATUS_SENT => KeyState::Sent,
                _ => KeyState::Completed,
            }
        }
    }

    /// Its name in the CLI and JSON.
    pub fn name(self) -> &'static str {
        match self {
            KeyState::InProgress => "in_progress",
            KeyState::Completed => "completed",
            KeyState::Rejected => "rejected",
            KeyState::Unknown => "unknown",
            KeyState::Sent => "sent",
            KeyState::Expired => "expired",
        }
    }
}

/// One stored key, as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    /// The tenant.
    pub tenant: String,
    /// The operation.
    pub operation: String,
    /// The key.
    pub key: String,
    /// Its state at the time of reading.
    pub state: KeyState,
    /// When it was claimed (ms since the epoch).
    pub created_at_ms: i64,
    /// When it expires.
    pub expires_at_ms: i64,
    /// The recorded outcome's bytes (empty while in progress).
    pub payload: Vec<u8>,
}

/// A schema version a store's table has not had yet (for `migrate --dry-run`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingMigration {
    /// The version number.
    pub version: i64,
    /// What it does.
    pub description: String,
    /// The statements it runs.
    pub statements: Vec<String>,
}

impl PendingMigration {
    /// Refuses a table whose schema is at `current`, newer than the
    /// `latest` this store knows: a binary older than the schema would
    /// read (and write) rows it does not understand. Every command that
    /// reads or changes a table checks it first.
    pub fn refuse_newer(store: &str, table: &str, current: i64, latest: i64) -> crate::Result<()> {
        if current > latest {
            return Err(crate::Error::Config(format!(
                "table {table} is at schema version {current}, newer than the {latest} this {store} knows: \
                 run a newer idem"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::store::{BoxFuture, SweepBatch};

    /// An index of `ghosts` entries whose rows are gone, then `rows` expired rows.
    struct Index {
        left: Mutex<(u64, u64)>,
    }

    impl Sweep for Index {
        fn sweep_expired(&self, _now_ms: i64, _limit: u32) -> BoxFuture<'_, Result<u64>> {
            unreachable!("the sweep runs batches")
        }

        fn sweep_batch(&self, _now_ms: i64, limit: u32) -> BoxFuture<'_, Result<SweepBatch>> {
            Box::pin(async move {
                let mut left = self.left.lock().unwrap();
                let ghosts = left.0.min(u64::from(limit));
                left.0 -= ghosts;
                let deleted = left.1.min(u64::from(limit) - ghosts);
                left.1 -= deleted;
                Ok(SweepBatch {
                    deleted,
                    ghosts,
                    examined: deleted + ghosts,
                })
            })
        }
    }

    /// A sweep goes on through batches that delete no row but clear index
    /// entries whose rows were already gone, and stops after the first
    /// batch that took up less than its size.
    #[tokio::test]
    async fn batches_of_ghosts_keep_the_sweep_going() {
        let index = Index {
            left: Mutex::new((25, 7)),
        };
        let options = SweepOptions {
            batch_size: 10,
            pause: Duration::ZERO,
            busy_percent: 100,
            max_batches: None,
        };
        let report = sweep_expired(&index, &crate::SystemClock, options).await.unwrap();
        assert_eq!(
            report,
            SweepReport {
                deleted: 7,
                ghosts: 25,
                batches: 4
            }
        );
        assert_eq!(*index.left.lock().unwrap(), (0, 0));
    }

    /// Rows deleted one per batch, each batch taking `batch` of (paused)
    /// time.
    struct Slow {
        left: Mutex<u64>,
        batch: Duration,
    }

    impl Sweep for Slow {
        fn sweep_expired(&self, _now_ms: i64, _limit: u32) -> BoxFuture<'_, Result<u64>> {
            unreachable!("the sweep runs batches")
        }

        fn sweep_batch(&self, _now_ms: i64, _limit: u32) -> BoxFuture<'_, Result<SweepBatch>> {
            Box::pin(async move {
                tokio::time::sleep(self.batch).await;
                let mut left = self.left.lock().unwrap();
                let deleted = (*left).min(1);
                *left -= deleted;
                Ok(SweepBatch {
                    deleted,
                    ghosts: 0,
                    examined: deleted,
                })
            })
        }
    }

    /// The rest after each full batch is the batch's time scaled by the
    /// busy share, never less than the pause: three full batches of 100 ms
    /// at 20% rest 400 ms each, and the fourth, which found nothing, ends
    /// the sweep without a rest.
    #[tokio::test(start_paused = true)]
    async fn the_sweep_rests_in_proportion_to_its_batches() {
        for (busy_percent, pause_ms, rest_ms) in [
            (20, 10, 400),
            (50, 10, 100),
            (100, 10, 10),
            (20, 700, 700),
            (0, 0, 9_900),
        ] {
            let store = Slow {
                left: Mutex::new(3),
                batch: Duration::from_millis(100),
            };
            let options = SweepOptions {
                batch_size: 1,
                pause: Duration::from_millis(pause_ms),
                busy_percent,
                max_batches: None,
            };
            let started = tokio::time::Instant::now();
            let report = sweep_expired(&store, &crate::SystemClock, options).await.unwrap();
            assert_eq!((report.deleted, report.batches), (3, 4));
            assert_eq!(
                started.elapsed(),
                Duration::from_millis(4 * 100 + 3 * rest_ms),
                "busy {busy_percent}%, pause {pause_ms} ms"
            );
        }
    }

    /// A sweep that reaches `max_batches` ends after its last batch, with
    /// no rest after it.
    #[tokio::test(start_paused = true)]
    async fn the_last_allowed_batch_is_not_followed_by_a_rest() {
        let store = Slow {
            left: Mutex::new(10),
            batch: Duration::from_millis(100),
        };
        let options = SweepOptions {
            batch_size: 1,
            pause: Duration::ZERO,
            busy_percent: 20,
            max_batches: Some(2),
        };
        let started = tokio::time::Instant::now();
        let report = sweep_expired(&store, &crate::SystemClock, options).await.unwrap();
        assert_eq!((report.deleted, report.batches), (2, 2));
        assert_eq!(started.elapsed(), Duration::from_millis(2 * 100 + 400));
    }

    #[test]
    fn rests_are_bounded_and_never_panic() {
        let options = SweepOptions {
            busy_percent: 255,
            ..SweepOptions::default()
        };
        assert_eq!(options.rest_after(Duration::from_secs(1)), options.pause);
        let options = SweepOptions {
            busy_percent: 1,
            ..SweepOptions::default()
        };
        assert_eq!(options.rest_after(Duration::MAX), MAX_SWEEP_REST);
        let long_pause = SweepOptions {
            pause: Duration::from_secs(30),
            ..options
        };
        assert_eq!(
            long_pause.rest_after(Duration::MAX),
            Duration::from_secs(30),
            "a longer pause counts"
        );
        assert_eq!(
            options.rest_after(Duration::from_millis(10)),
            Duration::from_millis(990)
        );
    }
}
