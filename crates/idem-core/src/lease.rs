//! Lease mode (check–claim–complete) for effects outside the database.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

use crate::classify::Classify;
use crate::clock::{SharedClock, system_clock};
use crate::detached::Detached;
use crate::engine::{self, Attempts, Found, Retry};
use crate::error::{Error, Result};
use crate::heartbeat::{Heartbeat, HeldLease};
use crate::key::IdempotencyKey;
use crate::metrics;
use crate::record::{Call, ClaimRequest, Lease, Outcome, Record, Resolution, Token};
use crate::scope::{Operation, Scope};
use crate::store::{LeaseClaim, LeaseStore};
use crate::tx::status_label;

/// Runs idempotent calls in lease mode on a [`LeaseStore`].
///
/// The claim commits at once as in-progress with a lease and a fencing token.
/// The holder then does its work (a vendor call, an email) and completes or
/// releases the claim with its token. If the holder crashes, another claimer
/// takes the key over once the lease has expired, with a larger token; the
/// old holder can then neither complete nor release.
///
/// The work that must outlive a dropped caller (a claim nobody will use is
/// released, an outcome is recorded) runs through its [`Detached`], which
/// its clones share: in the caller's task while the caller stays, in a task
/// of its own once it goes away ([`Detached::finish`]); a server waits for
/// [`detached().idle()`](Detached::idle) before it stops, so that no
/// outcome is lost to a shutdown.
pub struct LeaseEngine<S> {
    store: Arc<S>,
    clock: SharedClock,
    detached: Detached,
}

impl<S> Clone for LeaseEngine<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            clock: self.clock.clone(),
            detached: self.detached.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for LeaseEngine<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseEngine")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

/// The result of [`LeaseEngine::acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// This caller holds the key until the lease expires.
    Claimed(Lease),
    /// An earlier call recorded this outcome; the work must not run.
    Replay(Record),
}

impl<S: LeaseStore> LeaseEngine<S> {
    /// An engine on `store` with the system clock.
    pub fn new(store: S) -> Self {
        Self {
            store: Arc::new(store),
            clock: system_clock(),
            detached: Detached::new(),
        }
    }

    /// Replaces the clock.
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The clock.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// The tasks this engine (and code acting for it, such as the HTTP
    /// layer's recording) runs apart from their callers.
    pub fn detached(&self) -> &Detached {
        &self.detached
    }

    /// Claims the call's key with a lease, or finds its recorded outcome.
    /// A live lease of a twin is waited for as the policy says, then reported
    /// as [`Error::InFlight`].
    pub async fn acquire(&self, call: &Call) -> Result<Acquire> {
        let span = tracing::debug_span!(
            "idem.claim",
            operation = call.scope().operation().as_str(),
            mode = "lease"
        );
        self.acquire_inner(call).instrument(span).await
    }

    async fn acquire_inner(&self, call: &Call) -> Result<Acquire> {
        call.policy().validate()?;
        let op = call.scope().operation();
        let mut attempts = Attempts::new(call);
        loop {
            let now_ms = self.clock.now_ms();
            let lease_expires_at_ms = now_ms.saturating_add(call.policy().lease_ms_i64());
            let retry = match self.try_claim_detached(call, now_ms, lease_expires_at_ms).await {
                Ok(LeaseClaim::Acquired(token)) => {
                    metrics::claim(op, "lease");
                    metrics::claim_latency(op, attempts.started.elapsed());
                    return Ok(Acquire::Claimed(Lease {
                        scope: call.scope().clone(),
                        key: call.key().clone(),
                        token,
                        lease_expires_at_ms,
                    }));
                }
                Ok(LeaseClaim::Found(row)) => match engine::decide(call, row, now_ms)? {
                    Found::Replay(record) => {
                        metrics::count(metrics::REPLAYS, op);
                        metrics::claim_latency(op, attempts.started.elapsed());
                        return Ok(Acquire::Replay(record));
                    }
                    Found::Wait => Retry::Busy,
                },
                Err(e) if engine::is_contention(&e) => Retry::Contention(e),
                Err(e) => return Err(e),
            };
            attempts.next(retry).await?;
        }
    }

    /// One claim attempt. The store commits the claim before it answers; if
    /// the caller goes away in between (a dropped request), nobody would
    /// hold the claim and its key would wait for the lease to run out. So
    /// the attempt runs in the caller's task through [`Detached::finish`]:
    /// a caller that stays costs no hand-off, and one that goes away leaves
    /// the attempt to end in a task of its own, which releases what it
    /// claimed.
    async fn try_claim_detached(&self, call: &Call, now_ms: i64, lease_expires_at_ms: i64) -> Result<LeaseClaim> {
        let store = self.store.clone();
        let owned = call.clone();
        let claim = async move {
            let req = ClaimRequest {
                scope: owned.scope(),
                key: owned.key(),
                fingerprint: owned.fingerprint(),
                now_ms,
                expires_at_ms: now_ms.saturating_add(owned.policy().ttl_ms()),
                fresh_token: Token::fresh(now_ms),
                lease_expires_at_ms: Some(lease_expires_at_ms),
            };
            store.try_claim(&req).await
        };
        let store = self.store.clone();
        let scope = call.scope().clone();
        let key = call.key().clone();
        self.detached
            .finish_then(claim, move |claimed| {
                Box::pin(async move {
                    if let Ok(LeaseClaim::Acquired(token)) = claimed {
                        let lease = Lease {
                            scope,
                            key,
                            token,
                            lease_expires_at_ms,
                        };
                        release_abandoned(&*store, lease).await;
                    }
                })
            })
            .await
    }

    /// Records the outcome of a held lease. Fails with [`Error::Fenced`] if
    /// the lease was taken over; the newer outcome is never overwritten.
    pub async fn complete(&self, lease: &Lease, record: Record) -> Result<()> {
        let written = self.store.complete(lease, &record).await;
        counted(lease, written, |op| metrics::record(op, status_label(record.status)))
    }

    /// Marks a held lease as sent, durably, before anything leaves this
    /// process (see [`LeaseStore::mark_sent`]): from now on the request may
    /// reach the other side, so the key is never taken over when the lease
    /// runs out. A holder that dies or stalls past its lease leaves an
    /// unknown outcome, settled by a reconciliation or an operator, never a
    /// blind second send. Call it right before the first byte is sent; if
    /// it fails nothing may be sent. Fails with [`Error::Fenced`] if the
    /// lease was taken over.
    pub async fn mark_sent(&self, lease: &Lease) -> Result<()> {
        let written = self.store.mark_sent(lease, self.clock.now_ms()).await;
        counted(lease, written, |op| metrics::count(metrics::SENT, op))
    }

    /// The key's row as the store holds it, with the time it was first
    /// marked sent.
    pub async fn lookup(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<crate::StoredRow>> {
        self.store.lookup(scope, key).await
    }

    /// Completes `lease` with `record` (or releases it, with `None`), and
    /// tries again with backoff while the store fails, for at most `window`:
    /// an outcome is never dropped because one write was refused.
    ///
    /// A write the store applied but reported as failed is recognised on
    /// the next try: the key then holds this very record (or, for a
    /// release, no longer this lease), which counts as done. A lease lost
    /// meanwhile is [`Error::Fenced`]; a sent lease whose lease ran out
    /// while the store refused is still this holder's to complete, so its
    /// answer is kept if the store accepts it before anyone resolves it.
    /// Keep the lease's heartbeat beating while this runs.
    pub async fn settle_retrying(
        &self,
        lease: &Lease,
        record: Option<Record>,
        window: std::time::Duration,
    ) -> Result<()> {
        let deadline = tokio::time::Instant::now() + window;
        let mut backoff = std::time::Duration::from_millis(50);
        let mut refused = false;
        loop {
            // Each try is bounded: a store that hangs is a store that refused
            // (the write may still land; the next try recognises it).
            let attempt = tokio::time::timeout(SETTLE_TRY_TIMEOUT, async {
                match &record {
                    Some(record) if record.status == crate::RecordStatus::Unknown => {
                        self.mark_unknown(lease, record.payload.clone()).await
                    }
                    Some(record) => self.complete(lease, record.clone()).await,
                    None => self.release(lease).await,
                }
            })
            .await
            .unwrap_or_else(|_| {
                Err(Error::store(
                    crate::StoreErrorKind::Unavailable,
                    "the store did not answer the outcome's write in time",
                ))
            });
            let e = match attempt {
                Ok(()) => return Ok(()),
                Err(Error::Fenced) if refused => match self.settled_by_earlier_try(lease, record.as_ref()).await {
                    Ok(true) => return Ok(()),
                    Ok(false) => return Err(Error::Fenced),
                    Err(e) => e,
                },
                Err(Error::Fenced) => return Err(Error::Fenced),
                // Only the store's failures pass; anything else would fail
                // the same way every time.
                Err(e @ Error::Store { .. }) => e,
                Err(e) => return Err(e),
            };
            refused = true;
            metrics::count(metrics::SETTLE_RETRIES, lease.scope.operation());
            if tokio::time::Instant::now() + backoff > deadline {
                tracing::warn!(error = %e, "the store kept refusing the outcome; giving up");
                return Err(e);
            }
            tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "the store refused the outcome; trying again");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(std::time::Duration::from_secs(2));
        }
    }

    /// Gives back a claim whose sent mark the store refused: nothing was
    /// sent. Tried again for a few seconds, since the mark may have been
    /// applied and reported as failed, and a key left marked would be held
    /// as an unknown outcome once its lease ran out.
    pub async fn release_unsent(&self, lease: &Lease) -> Result<()> {
        self.settle_retrying(lease, None, UNSENT_RELEASE_WINDOW).await
    }

    /// After a refused write and then a fenced one: whether the refused one
    /// was applied after all (the row holds this record, or, for a
    /// release, the lease's row is gone or belongs to a later claim).
    async fn settled_by_earlier_try(&self, lease: &Lease, record: Option<&Record>) -> Result<bool> {
        let row = self.store.lookup(&lease.scope, &lease.key).await?;
        Ok(match (record, row) {
            (Some(record), Some(row)) => matches!(&row.state, crate::RowState::Done(done) if done == record),
            (Some(_), None) => false,
            (None, None) => true,
            (None, Some(row)) => match row.state {
                crate::RowState::InProgress { token, .. } | crate::RowState::Sent { token, .. } => token > lease.token,
                crate::RowState::Done(_) => false,
            },
        })
    }

    /// Gives the key back unused. Fails with [`Error::Fenced`] if the lease
    /// was taken over.
    pub async fn release(&self, lease: &Lease) -> Result<()> {
        let written = self.store.release(lease).await;
        counted(lease, written, |op| metrics::count(metrics::RELEASES, op))
    }

    /// Records that the outcome of a held lease is unknown: the work may have
    /// taken effect (the upstream got the whole request, then failed or went
    /// silent). The key is held: every later claim fails with
    /// [`Error::OutcomeUnknown`], a lease's end never frees it, and only
    /// [`resolve_unknown`](Self::resolve_unknown) or its expiry does. `note`
    /// (what was seen) is kept for the operator. Fails with
    /// [`Error::Fenced`] if the lease was taken over.
    pub async fn mark_unknown(&self, lease: &Lease, note: impl Into<Vec<u8>>) -> Result<()> {
        let written = self.store.complete(lease, &Record::unknown(note)).await;
        counted(lease, written, |op| metrics::count(metrics::UNKNOWN, op))
    }

    /// Resolves an unknown outcome: `Some(record)` (the work took effect,
    /// with this outcome) records it, and retries replay it; `None` (it did
    /// not) frees the key, and the next retry runs the work. Answers whether
    /// the key held an unknown outcome; nothing else is ever changed.
    ///
    /// A resolution the store refused for contention (a twin's resolution
    /// on another node of a cluster, certified first) changed nothing, and
    /// runs again within the engines' contention budget: it then answers
    /// `false` if the twin took.
    pub async fn resolve_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        resolution: Option<&Record>,
    ) -> Result<bool> {
        if resolution.is_some_and(|r| r.status == crate::record::RecordStatus::Unknown) {
            return Err(Error::Config("an unknown outcome is resolved with a known one".into()));
        }
        let now_ms = self.clock.now_ms();
        let req = Resolution {
            scope,
            key,
            now_ms,
            record: resolution,
        };
        let mut retries = crate::contention::ContentionRetries::new();
        let resolved = loop {
            match self.store.resolve_unknown(&req).await {
                Err(e)
                    if engine::is_contention(&e)
                        && retries.again(scope.operation().as_str(), metrics::Stage::Commit).await => {}
                answered => break answered?,
            }
        };
        if resolved {
            let label = if resolution.is_some() { "applied" } else { "not_applied" };
            metrics::unknown_resolved(scope.operation(), label);
        }
        Ok(resolved)
    }

    /// Extends a held lease by `lease_ms` from now (a heartbeat for long work).
    pub async fn extend(&self, lease: &Lease, lease_ms: u64) -> Result<Lease> {
        let until = self
            .clock
            .now_ms()
            .saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX));
        self.store.extend(lease, until).await?;
        Ok(Lease {
            lease_expires_at_ms: until,
            ..lease.clone()
        })
    }

    /// Starts extending `lease` with its fencing token every third of
    /// `lease_ms`, until the returned [`Heartbeat`] is stopped or dropped.
    /// When an extension is fenced (another caller took the key over) the
    /// heartbeat stops, [`HeldLease::is_held`] turns false, the loss is logged
    /// and counted in `idem_leases_lost_total`, and a later `complete` with the
    /// lease fails with [`Error::Fenced`]: the new holder is never overwritten.
    pub fn heartbeat(&self, lease: &Lease, lease_ms: u64) -> Heartbeat {
        Heartbeat::start(self.store.clone(), self.clock.clone(), lease.clone(), lease_ms)
    }

    /// Keeps `lease` alive like [`heartbeat`](Self::heartbeat), in the
    /// caller's own task instead of one of its own: the future returned
    /// extends the lease with its token every third of `lease_ms` for as long
    /// as it is polled, and never completes. Poll it beside the work and the
    /// settlement (`tokio::select!`), and drop it once the outcome is
    /// settled; the [`HeldLease`] says whether the lease was lost meanwhile.
    pub fn heartbeat_in_place(
        &self,
        lease: &Lease,
        lease_ms: u64,
    ) -> (
        HeldLease,
        impl Future<Output = std::convert::Infallible> + Send + 'static,
    ) {
        crate::heartbeat::in_place(self.store.clone(), self.clock.clone(), lease.clone(), lease_ms)
    }

    /// Runs `work` once per key in lease mode: claims, runs, records its value
    /// (as JSON) — or replays the recorded value without running `work`.
    ///
    /// While `work` runs, a [`Heartbeat`] keeps the lease alive, so a twin
    /// waits or is told the call is in flight for as long as this holder
    /// lives. `work` receives the [`HeldLease`], whose fencing token it can
    /// pass downstream.
    ///
    /// Before `work` runs, the key is marked sent
    /// ([`mark_sent`](Self::mark_sent)); a mark the store refuses runs
    /// nothing and gives the key back. An `Err` from `work` says it did not
    /// take effect and releases the key; a panic holds it as an unknown
    /// outcome (the work may have acted). Once `work` has returned, the
    /// outcome is recorded (or the key released) in a task that outlives
    /// this future, tried again while the store refuses it, so dropping the
    /// future then changes nothing. If this future is dropped while `work`
    /// runs, the work may already have taken effect: the key is not
    /// released, the heartbeat stops, and once the lease runs out the key is
    /// held as an unknown outcome — never taken over and run again — until
    /// [`resolve_unknown`](Self::resolve_unknown) or its expiry.
    pub async fn run<T, E, F, Fut>(&self, call: &Call, work: F) -> Result<Outcome<T>, E>
    where
        F: FnOnce(HeldLease) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let outcome = self
            .run_with_rejections(
                call,
                |lease| async move { work(lease).await.map(Ok::<T, crate::Never>) },
            )
            .await?;
        Ok(outcome.map(|r| match r {
            Ok(v) => v,
            Err(never) => match never {},
        }))
    }

    /// Like [`run`](Self::run), but `work` may reject with `Ok(Err(_))`; a
    /// final rejection is recorded only if the policy consumes keys on final
    /// rejections, otherwise the key is released.
    pub async fn run_with_rejections<T, R, E, F, Fut>(&self, call: &Call, work: F) -> Result<Outcome<Result<T, R>>, E>
    where
        F: FnOnce(HeldLease) -> Fut,
        Fut: Future<Output = Result<Result<T, R>, E>>,
        T: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned + Classify,
        E: From<Error>,
    {
        let lease = match self.acquire(call).await? {
            Acquire::Replay(record) => return Ok(Outcome::Replayed(engine::decode::<T, R>(&record)?)),
            Acquire::Claimed(lease) => lease,
        };
        // Nothing leaves this process before the key is marked sent: a holder
        // that dies in the work leaves an unknown outcome, never a key a
        // twin takes over and runs again.
        if let Err(e) = self.mark_sent(&lease).await {
            if !matches!(e, Error::Fenced)
                && let Err(release) = self.release_unsent(&lease).await
            {
                tracing::warn!(error = %release, "could not give back a claim whose sent mark was refused");
            }
            return Err(e.into());
        }
        let beat = self.heartbeat(&lease, call.policy().effective_lease_ms());
        let mut guard = HoldOnPanic {
            store: Some(self.store.clone()),
            detached: self.detached.clone(),
            lease: lease.clone(),
        };
        let result = work(beat.held().clone()).await;
        guard.disarm();
        let limit = call.policy().max_record_bytes();
        let (settle, result) = match result {
            Ok(Ok(value)) => match engine::encode(&value, limit) {
                Ok(payload) => (Settle::Complete(Record::completed(payload)), Ok(Ok(value))),
                // The effect happened but cannot be recorded: keep the claim
                // (held as an unknown outcome once its lease runs out) rather
                // than let a retry run the effect again.
                Err(e) => return Err(e.into()),
            },
            Ok(Err(rejection)) => {
                if engine::records_rejection(call, &rejection) {
                    let payload = engine::encode(&rejection, limit)?;
                    (Settle::Complete(Record::rejected(payload)), Ok(Err(rejection)))
                } else {
                    (Settle::Release, Ok(Err(rejection)))
                }
            }
            Err(e) => (Settle::Release, Err(e)),
        };
        self.settle_detached(lease, settle, beat).await?;
        result.map(Outcome::Executed)
    }

    /// Completes or releases `lease`, keeping `beat` alive until it is done
    /// (a refused write is tried again, see
    /// [`settle_retrying`](Self::settle_retrying)), and waits for it. It runs
    /// in the caller's task; dropping the returned future moves the rest of
    /// it into a task of its own ([`Detached::finish`]), so it still ends.
    pub(crate) async fn settle_detached(&self, lease: Lease, settle: Settle, beat: Heartbeat) -> Result<()> {
        let engine = self.clone();
        let settling = async move {
            let record = match settle {
                Settle::Complete(record) => Some(record),
                Settle::Release => None,
            };
            let settled = engine.settle_retrying(&lease, record, SETTLE_RETRY_WINDOW).await;
            beat.stop();
            settled
        };
        self.detached.finish(settling).await
    }
}

/// How long a refused completion (or release) is tried again before the
/// outcome is left to the sent mark: a key whose lease then runs out is held
/// as an unknown outcome, never released.
pub const SETTLE_RETRY_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

/// The longest one try of an outcome's write may take before it counts as
/// refused.
const SETTLE_TRY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a claim whose sent mark was refused is tried to be given back:
/// nothing was sent, and a retry should find the key free.
const UNSENT_RELEASE_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);

/// How a lease is given back once the work is done.
#[derive(Debug)]
pub(crate) enum Settle {
    /// Record this outcome; the key is consumed.
    Complete(Record),
    /// Give the key back unused.
    Release,
}

/// Holds the outcome of a lease whose work panicked as unknown (the work
/// was marked sent and may have acted). A future dropped while the work
/// ran changes nothing: the sent mark holds the key once its lease runs out.
struct HoldOnPanic<S: LeaseStore> {
    store: Option<Arc<S>>,
    detached: Detached,
    lease: Lease,
}

impl<S: LeaseStore> HoldOnPanic<S> {
    fn disarm(&mut self) {
        self.store = None;
    }
}

impl<S: LeaseStore> Drop for HoldOnPanic<S> {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else { return };
        if !std::thread::panicking() {
            tracing::debug!(
                "lease-mode work dropped before it finished; the key is held as an unknown outcome once its lease runs out"
            );
            return;
        }
        // The work was marked sent and may have acted before it panicked: its
        // outcome is unknown, never released for a blind second run.
        let lease = self.lease.clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            self.detached.spawn_on(&handle, async move {
                let note = Record::unknown(b"the work panicked after the request was marked sent".to_vec());
                match store.complete(&lease, &note).await {
                    Ok(()) => metrics::count(metrics::UNKNOWN, lease.scope.operation()),
                    Err(e) => tracing::warn!(
                        error = %e,
                        "could not hold the outcome of a panicked work; its sent mark holds it once the lease runs out"
                    ),
                }
            });
        }
    }
}

async fn release_abandoned<S: LeaseStore>(store: &S, lease: Lease) {
    match store.release(&lease).await {
        Ok(()) => metrics::count(metrics::RELEASES, lease.scope.operation()),
        Err(e) => tracing::warn!(error = %e, "could not release an abandoned claim; it will expire"),
    }
}

/// A holder's write of `lease`, counted: `done` on success, a fencing when
/// the lease was taken over.
fn counted(lease: &Lease, written: Result<()>, done: impl FnOnce(&Operation)) -> Result<()> {
    let op = lease.scope.operation();
    match written {
        Ok(()) => {
            done(op);
            Ok(())
        }
        Err(Error::Fenced) => {
            metrics::count(metrics::FENCED, op);
            Err(Error::Fenced)
        }
        Err(e) => Err(e),
    }
}
