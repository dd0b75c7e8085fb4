//! Injectable wall clocks, so expiry and leases can be tested without sleeping.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in milliseconds since the Unix epoch.
///
/// Every expiry and lease decision is taken against this clock (stores receive
/// the time as an argument rather than reading the database's clock), so a
/// [`ManualClock`] controls them completely in tests.
pub trait Clock: Send + Sync + Debug + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;
}

/// The system's real-time clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to. Clones share the same time.
///
/// ```
/// use idem_core::{Clock, ManualClock};
/// use std::time::Duration;
/// let clock = ManualClock::new(1_000);
/// clock.advance(Duration::from_secs(2));
/// assert_eq!(clock.now_ms(), 3_000);
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// A clock reading `now_ms`.
    pub fn new(now_ms: i64) -> Self {
        Self(Arc::new(AtomicI64::new(now_ms)))
    }

    /// A clock starting at the current system time.
    pub fn starting_now() -> Self {
        Self::new(SystemClock.now_ms())
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_millis() as i64, Ordering::SeqCst);
    }

    /// Sets the clock.
    pub fn set(&self, now_ms: i64) {
        self.0.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A shared clock handle.
pub type SharedClock = Arc<dyn Clock>;

/// The default shared clock: [`SystemClock`].
pub fn system_clock() -> SharedClock {
    Arc::new(SystemClock)
}

/// A clock that several hosts share: the database's, read over the network.
///
/// Stores implement it by asking their database for the current time, so
/// every instance that uses one database can decide leases and expiry on one
/// clock ([`AnchoredClock`]).
pub trait TimeSource: Send + Sync + 'static {
    /// The source's current time, in milliseconds since the Unix epoch.
    fn source_now_ms(&self) -> crate::store::BoxFuture<'_, crate::error::Result<i64>>;
}

/// Settings of an [`AnchoredClock`].
#[derive(Debug, Clone, Copy)]
pub struct AnchorOptions {
    /// Readings per anchoring; the one with the shortest round trip wins.
    pub samples: u32,
    /// How often the anchor is renewed.
    pub refresh: Duration,
}

impl Default for AnchorOptions {
    fn default() -> Self {
        Self {
            samples: 5,
            refresh: Duration::from_secs(30),
        }
    }
}

/// Gauge: the anchored clock minus this host's system clock, in seconds.
pub const CLOCK_OFFSET: &str = "idem_clock_offset_seconds";
/// Gauge: half the round trip of the reading the anchor was taken from: how
/// far the anchored clock may be from the source's, in seconds.
pub const CLOCK_UNCERTAINTY: &str = "idem_clock_uncertainty_seconds";

#[derive(Debug, Clone, Copy)]
struct Anchor {
    /// The source's time at `at`.
    source_ms: i64,
    /// The local monotonic instant the source's reading corresponds to.
    at: std::time::Instant,
    /// Half the round trip of that reading.
    uncertainty: Duration,
}

/// A wall clock anchored to a shared [`TimeSource`] (the database), so every
/// instance on one database decides leases and expiry on the database's
/// clock, not on its own: a host whose clock runs ahead cannot take over a
/// live lease early.
///
/// It reads the source a few times, keeps the reading with the shortest
/// round trip (taken to be the source's time at the round trip's midpoint),
/// and from then on advances with this host's monotonic clock, which no
/// wall-clock step (NTP, an operator) moves. The anchor is renewed in the
/// background; between renewals the error is the monotonic clock's drift.
/// The skew tolerated between instances is therefore the anchors'
/// uncertainty — half a database round trip, a millisecond or so — instead
/// of the hosts' wall-clock skew.
///
/// It fails closed: [`start`](Self::start) fails if the source cannot be
/// read, so a service never starts on a clock it could not anchor.
#[derive(Debug, Clone)]
pub struct AnchoredClock {
    anchor: Arc<std::sync::RwLock<Anchor>>,
}

impl AnchoredClock {
    /// Anchors to `source` and keeps the anchor fresh in a background task
    /// (which ends when the last clone of the clock is dropped).
    pub async fn start<T: TimeSource>(source: Arc<T>, options: AnchorOptions) -> crate::error::Result<Self> {
        let anchor = take_anchor(source.as_ref(), options.samples).await?;
        publish(&anchor);
        let clock = Self {
            anchor: Arc::new(std::sync::RwLock::new(anchor)),
        };
        let weak = Arc::downgrade(&clock.anchor);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(options.refresh).await;
                let Some(shared) = weak.upgrade() else { return };
                match take_anchor(source.as_ref(), options.samples).await {
                    Ok(anchor) => {
                        publish(&anchor);
                        *shared.write().unwrap_or_else(|e| e.into_inner()) = anchor;
                    }
                    // The last anchor stays valid: the monotonic clock keeps
                    // time between anchors.
                    Err(e) => tracing::warn!(error = %e, "could not renew the clock's anchor"),
                }
            }
        });
        Ok(clock)
    }

    /// Half the round trip of the reading the clock is anchored on.
    pub fn uncertainty(&self) -> Duration {
        self.current().uncertainty
    }

    fn current(&self) -> Anchor {
        *self.anchor.read().unwrap_or_else(|e| e.into_inner())
    }
}

impl Clock for AnchoredClock {
    fn now_ms(&self) -> i64 {
        let anchor = self.current();
        let elapsed = i64::try_from(anchor.at.elapsed().as_millis()).unwrap_or(i64::MAX);
        anchor.source_ms.saturating_add(elapsed)
    }
}

async fn take_anchor<T: TimeSource + ?Sized>(source: &T, samples: u32) -> crate::error::Result<Anchor> {
    let mut best: Option<Anchor> = None;
    for _ in 0..samples.max(1) {
        let sent = std::time::Instant::now();
        let source_ms = source.source_now_ms().await?;
        let round_trip = sent.elapsed();
        let candidate = Anchor {
            source_ms,
            at: sent + round_trip / 2,
            uncertainty: round_trip / 2,
        };
        if best.is_none_or(|b| candidate.uncertainty < b.uncertainty) {
            best = Some(candidate);
        }
    }
    best.ok_or_else(|| crate::error::Error::Config("no clock reading".into()))
}

fn publish(anchor: &Anchor) {
    let now = anchor
        .source_ms
        .saturating_add(i64::try_from(anchor.at.elapsed().as_millis()).unwrap_or(0));
    let offset_ms = now.saturating_sub(SystemClock.now_ms());
    metrics::gauge!(CLOCK_OFFSET).set(offset_ms as f64 / 1000.0);
    metrics::gauge!(CLOCK_UNCERTAINTY).set(anchor.uncertainty.as_secs_f64());
}

#[cfg(test)]
mod anchored_tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// A source 10 minutes ahead of this host whose readings take longer
    /// each time but the third.
    #[derive(Default)]
    struct Ahead(AtomicU32);

    impl TimeSource for Ahead {
        fn source_now_ms(&self) -> crate::store::BoxFuture<'_, crate::error::Result<i64>> {
            Box::pin(async move {
                let n = self.0.fetch_add(1, Ordering::SeqCst);
                let delay = if n == 2 { 1 } else { 40 };
                tokio::time::sleep(Duration::from_millis(delay)).await;
                Ok(SystemClock.now_ms() + 600_000)
            })
        }
    }

    struct Down;

    impl TimeSource for Down {
        fn source_now_ms(&self) -> crate::store::BoxFuture<'_, crate::error::Result<i64>> {
            Box::pin(async { Err(crate::error::Error::store(crate::StoreErrorKind::Unavailable, "down")) })
        }
    }

    #[tokio::test]
    async fn follows_the_source_and_keeps_the_best_reading() {
        let clock = AnchoredClock::start(Arc::new(Ahead::default()), AnchorOptions::default())
            .await
            .unwrap();
        let offset = clock.now_ms() - SystemClock.now_ms();
        assert!((599_900..=600_100).contains(&offset), "offset {offset}");
        assert!(clock.uncertainty() < Duration::from_millis(20), "the fast reading won");
        let before = clock.now_ms();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(clock.now_ms() >= before + 50, "it advances with the monotonic clock");
    }

    #[tokio::test]
    async fn fails_closed_without_a_source() {
        assert!(
            AnchoredClock::start(Arc::new(Down), AnchorOptions::default())
                .await
                .is_err()
        );
    }
}
