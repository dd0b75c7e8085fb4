//! Keeping a lease alive while its holder works.
//!
//! A lease that only lasted its initial length would expose every holder
//! slower than the lease: a twin would take the key over and run the effect a
//! second time. While the work runs, a [`Heartbeat`] extends the lease with its
//! fencing token every third of the lease's length, so the claim outlives the
//! work for as long as the holder is alive, and expires within one lease length
//! once it is not (a crash, a dropped future).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use crate::clock::SharedClock;
use crate::error::Error;
use crate::key::IdempotencyKey;
use crate::metrics;
use crate::record::{Lease, Token};
use crate::scope::Scope;
use crate::store::LeaseStore;

/// A lease held by the current work: its key, scope and fencing token, and
/// whether it is still held.
///
/// Pass [`token`](Self::token) downstream (a vendor, another service, a row you
/// write) so that a system that sees several holders over time can refuse any
/// token smaller than the largest it has seen.
#[derive(Debug, Clone)]
pub struct HeldLease {
    lease: Lease,
    lost: Arc<AtomicBool>,
    /// Until when the lease is known to be held (ms, the engine's clock):
    /// its claim's expiry, moved on by each extension that succeeded.
    until_ms: Arc<AtomicI64>,
}

impl HeldLease {
    pub(crate) fn new(lease: Lease) -> Self {
        let until_ms = Arc::new(AtomicI64::new(lease.lease_expires_at_ms));
        Self {
            lease,
            lost: Arc::new(AtomicBool::new(false)),
            until_ms,
        }
    }

    /// The fencing token: larger on every new claim of the key.
    pub fn token(&self) -> Token {
        self.lease.token
    }

    /// The key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.lease.key
    }

    /// The scope (tenant, operation) of the key.
    pub fn scope(&self) -> &Scope {
        &self.lease.scope
    }

    /// The lease as claimed.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// False once an extension was fenced: another caller took the key over
    /// and this holder's outcome will not be recorded. Work that can stop
    /// early should.
    pub fn is_held(&self) -> bool {
        !self.lost.load(Ordering::Acquire)
    }

    /// Until when the lease is known to be held (ms since the epoch, on the
    /// engine's clock): the claim's expiry, moved on by every extension that
    /// succeeded. Past it another caller may have taken the key over even
    /// if no extension was fenced yet (this process was paused, its store
    /// unreachable).
    pub fn held_until_ms(&self) -> i64 {
        self.until_ms.load(Ordering::Acquire)
    }

    /// Whether the lease is held and will still be for `margin_ms` after
    /// `now_ms`: the check to make right before an effect that another
    /// holder must never repeat (a send to a vendor). A holder that was
    /// stopped past its lease (a `SIGSTOP`, a long pause) finds it false
    /// before its heartbeat has had a chance to be fenced.
    pub fn holds_for(&self, now_ms: i64, margin_ms: i64) -> bool {
        self.is_held() && now_ms.saturating_add(margin_ms) < self.held_until_ms()
    }

    fn extended_until(&self, until_ms: i64) {
        self.until_ms.fetch_max(until_ms, Ordering::AcqRel);
    }

    fn mark_lost(&self) {
        self.lost.store(true, Ordering::Release);
    }
}

/// Extends a lease in the background until it is stopped or dropped.
///
/// Started by [`LeaseEngine::heartbeat`](crate::LeaseEngine::heartbeat) (and by
/// `LeaseEngine::run`). Dropping it stops the extensions; the lease then
/// expires on its own within one lease length.
#[derive(Debug)]
pub struct Heartbeat {
    held: HeldLease,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Heartbeat {
    pub(crate) fn start<S: LeaseStore>(store: Arc<S>, clock: SharedClock, lease: Lease, lease_ms: u64) -> Self {
        let held = HeldLease::new(lease);
        let beat = held.clone();
        let task = tokio::runtime::Handle::try_current()
            .ok()
            .map(|handle| handle.spawn(beat_until_lost(store, clock, beat, lease_ms)));
        if task.is_none() {
            tracing::warn!("no tokio runtime: the lease will not be extended while the work runs");
        }
        Self { held, task }
    }

    /// The lease it keeps alive.
    pub fn held(&self) -> &HeldLease {
        &self.held
    }

    /// Stops extending the lease.
    pub fn stop(mut self) {
        self.abort();
    }

    fn abort(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.abort();
    }
}

/// How often a lease of `lease_ms` is extended: a third of its length, so two
/// extensions in a row may fail (a slow store, a pause) before it runs out.
/// A heartbeat that runs in its caller's task: the lease it keeps alive,
/// and a future that extends the lease every third of `lease_ms` for as
/// long as it is polled. The future never completes (after a lost lease it
/// only waits); dropping it stops the beats.
pub(crate) fn in_place<S: LeaseStore>(
    store: Arc<S>,
    clock: SharedClock,
    lease: Lease,
    lease_ms: u64,
) -> (HeldLease, impl Future<Output = Infallible> + Send + 'static) {
    let held = HeldLease::new(lease);
    let beat = held.clone();
    (held, async move {
        beat_until_lost(store, clock, beat, lease_ms).await;
        std::future::pending().await
    })
}

pub(crate) fn interval(lease_ms: u64) -> Duration {
    Duration::from_millis((lease_ms / 3).max(1))
}

async fn beat_until_lost<S: LeaseStore>(store: Arc<S>, clock: SharedClock, held: HeldLease, lease_ms: u64) {
    let every = interval(lease_ms);
    let length = i64::try_from(lease_ms).unwrap_or(i64::MAX);
    let operation = held.scope().operation().clone();
    loop {
        tokio::time::sleep(every).await;
        let until = clock.now_ms().saturating_add(length);
        match store.extend(held.lease(), until).await {
            // `until` was computed before the store was asked: the lease
            // is held at least that long.
            Ok(()) => held.extended_until(until),
            Err(Error::Fenced) => {
                held.mark_lost();
                metrics::lease_lost(&operation);
                tracing::warn!(
                    operation = %operation,
                    token = held.token().0,
                    "lease lost: another caller took the key over; this holder's outcome will not be recorded"
                );
                return;
            }
            Err(e) => {
                // The lease may still be live: try again at the next beat.
                tracing::warn!(operation = %operation, error = %e, "could not extend a lease");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IdempotencyKey, Scope};

    fn lease(until: i64) -> Lease {
        Lease {
            scope: Scope::parse("t", "op").unwrap(),
            key: IdempotencyKey::new("k").unwrap(),
            token: Token(1),
            lease_expires_at_ms: until,
        }
    }

    #[test]
    fn a_lease_holds_until_its_expiry_less_the_margin() {
        let held = HeldLease::new(lease(1_000));
        assert_eq!(held.held_until_ms(), 1_000);
        assert!(held.holds_for(500, 400));
        assert!(!held.holds_for(500, 500), "the margin reaches the expiry");
        assert!(!held.holds_for(2_000, 0), "past the expiry");
        held.extended_until(3_000);
        held.extended_until(2_000);
        assert_eq!(held.held_until_ms(), 3_000, "an extension never moves it back");
        assert!(held.holds_for(2_000, 500));
        held.mark_lost();
        assert!(!held.holds_for(2_000, 500), "a fenced lease is not held");
    }
}
