//! Keeping a lease alive while its holder works.
//!
//! A lease that only lasted its initial length would expose every holder
//! slower than the lease: a twin would take the key over and run the effect a
//! second time. While the work runs, a [`Heartbeat`] extends the lease with its
//! fencing token every third of the lease's length, so the claim outlives the
//! work for as long as the holder is alive, and expires within one lease length
//! once it is not (a crash, a dropped future).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
}

impl HeldLease {
    pub(crate) fn new(lease: Lease) -> Self {
        Self {
            lease,
            lost: Arc::new(AtomicBool::new(false)),
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
pub(crate) fn interval(lease_ms: u64) -> Duration {
    Duration::from_millis((lease_ms / 3).max(1))
}

async fn beat_until_lost<S: LeaseStore>(store: Arc<S>, clock: SharedClock, held: HeldLease, lease_ms: u64) {
    let every = interval(lease_ms);
    let length = i64::try_from(lease_ms).unwrap_or(i64::MAX);
    let operation = held.scope().operation().as_str().to_owned();
    loop {
        tokio::time::sleep(every).await;
        let until = clock.now_ms().saturating_add(length);
        match store.extend(held.lease(), until).await {
            Ok(()) => {}
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
