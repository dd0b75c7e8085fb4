//! The payout worker: pays requested payouts at the vendor, each exactly
//! once.
//!
//! `POST /v1/payouts` debits the account and records the payout as
//! `requested` in one transaction. The worker then, for each requested
//! payout:
//!
//! 1. claims it in lease mode (scope: the tenant and `payout`; key: the payout
//!    id) with a heartbeat, so one worker at a time calls the vendor for it,
//!    and a worker that crashed or was paused past its lease is taken over;
//! 2. reads the payout again and skips it unless it is still `requested`;
//! 3. calls the vendor through the outbound client with **the payout id as
//!    the idempotency key** on every attempt, by every worker, so a payout the
//!    vendor already applied (a lost answer, a worker taken over) is answered
//!    with the vendor's recorded result and never paid twice;
//! 4. commits the result: `paid` with the vendor's id, or `dead_lettered` with
//!    a dead letter holding the request and its key, each with its event. The
//!    update is conditional on the payout still being `requested`, so a slow
//!    worker's late answer changes nothing.
//!
//! A dead letter redriven later (`idem dlq redrive`) is sent with the same
//! key; once it is resolved the worker marks its payout paid, however many
//! older dead-lettered payouts are still waiting. The debit stands throughout,
//! so conservation holds with payouts requested, paid and dead-lettered.
//!
//! # The vendor forgets keys
//!
//! The vendor remembers a key only for its horizon (`--vendor-key-horizon-secs`,
//! 24 h by default; 0 for a vendor without idempotency). Before its first
//! call the worker commits `first_sent_at_ms` on the payout, so a worker
//! that takes the payout over (after a crash, a pause past the lease) knows
//! a call may have reached the vendor, and when. Within the horizon it
//! sends again blindly (the vendor replays); past it, it asks the vendor
//! first ([`VendorLookup`]: `GET {vendor}/v1/payouts?reference={payout id}`):
//! found → marked paid with the vendor's record, nothing sent; not found →
//! sent; still processing → asked again; anything else → the payout's
//! status is `unknown`, its dead letter is held as unknown, and nothing is
//! sent until an operator settles it (`idem dlq resolve`).
//!
//! - Right before each send the worker checks that its lease is still held
//!   for a third of its length on its own clock: a worker stopped past its
//!   lease (whose payout another worker took over, asked about and paid)
//!   sends nothing when it wakes up, before its heartbeat is fenced.
//! - A `429` whose `Retry-After` is past the call's deadline defers the
//!   payout to that time (`not_before_ms`), still `requested`.
//! - An answer is `paid` only if it holds what the vendor's contract
//!   promises: an `id`, the payout's `amount` and its `reference`. Any other
//!   2xx is an unknown outcome.
//! - A dead-lettered or unknown payout the vendor is known not to have paid
//!   (its dead letter's verdict is "not applied", by the vendor or an
//!   operator, and nothing was sent since) can be cancelled:
//!   `POST /v1/payouts/{id}/cancel` reverses the debit (a `payout_reversal`
//!   journal entry) and cancels the dead letter in one transaction, once.
//!
//! The vendor's side (the request, its contract, the lookup by reference)
//! is in `vendor`, over the lookup by reference both vendors of the ledger
//! share (`lookup`); payouts held as unknown and those settled from their
//! dead letters are in `dead_letters`.

mod dead_letters;
mod lookup;
mod vendor;

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    Acquire, Call, Error as IdemError, Fingerprint, HeldLease, IdempotencyKey, InFlight, LeaseEngine, LeaseStore,
    NewDeadLetter, OutboundRequest, Policy, Scope, SharedClock,
};
use idem_outbound::{Earlier, OutboundClient, OutboundError};
use tokio::sync::watch;

use crate::db::{DbError, LedgerDb, LedgerTx, PayoutChange, PayoutDeferral, PayoutState, PayoutTask};
use crate::events::{EventOutbox, Namespace};

pub use lookup::MAX_LOOKUP_BYTES;
pub(crate) use lookup::{ByReference, Vendor, by_reference_hook};
pub(crate) use vendor::check_promise;
pub use vendor::{VendorLookup, answer_check, check_answer, vendor_request};

/// The operation of payout leases and dead letters.
pub const PAYOUT_OPERATION: &str = "payout";

/// How the payout worker runs.
#[derive(Debug, Clone)]
pub struct PayoutConfig {
    /// The vendor's base URL (`http://127.0.0.1:8090`); payouts are sent to
    /// `{vendor_url}/v1/payouts`.
    pub vendor_url: String,
    /// Vendor calls in flight at once in this process.
    pub concurrency: usize,
    /// The lease of a payout being paid (kept alive by a heartbeat).
    pub lease: Duration,
    /// How often requested payouts are looked for.
    pub poll: Duration,
    /// The events' names.
    pub namespace: Namespace,
    /// Ask the vendor (a lookup by reference) before a re-send it may no
    /// longer recognise (default true). Off: such a payout is held as
    /// unknown for an operator.
    pub reconcile: bool,
}

impl PayoutConfig {
    /// Ten calls at once, 30-second leases, a 250 ms poll.
    pub fn new(vendor_url: impl Into<String>, namespace: Namespace) -> Self {
        Self {
            vendor_url: vendor_url.into().trim_end_matches('/').to_owned(),
            concurrency: 10,
            lease: Duration::from_secs(30),
            poll: Duration::from_millis(250),
            namespace,
            reconcile: true,
        }
    }

    /// `{vendor_url}/v1/payouts`.
    pub fn payouts_url(&self) -> String {
        format!("{}/v1/payouts", self.vendor_url)
    }
}

/// What one pass of the worker did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Payouts the vendor confirmed.
    pub paid: u64,
    /// Payouts dead-lettered.
    pub dead_lettered: u64,
    /// Dead-lettered payouts whose dead letter was resolved by a redrive.
    pub reconciled: u64,
    /// Payouts another worker held, or that were settled meanwhile.
    pub skipped: u64,
    /// Payouts whose outcome is unknown (held for an operator).
    pub unknown: u64,
    /// Payouts the vendor asked to call again later.
    pub deferred: u64,
}

/// The payout worker of one database.
pub struct PayoutWorker<D: LedgerDb + LeaseStore> {
    db: D,
    leases: LeaseEngine<D>,
    client: OutboundClient,
    clock: SharedClock,
    events: EventOutbox<D>,
    config: PayoutConfig,
}

impl<D: LedgerDb + LeaseStore> PayoutWorker<D> {
    /// A worker on `db` calling the vendor through `client`.
    ///
    /// The client reads the worker's clock (the age of earlier calls), and
    /// with `config.reconcile` asks the vendor through [`VendorLookup`].
    pub fn new(db: D, clock: SharedClock, client: OutboundClient, config: PayoutConfig) -> Result<Self, DbError> {
        let leases = LeaseEngine::new(db.keyed(idem_core::TableName::new(crate::db::PAYOUT_LEASES_TABLE)?))
            .with_clock(clock.clone());
        let client = client.with_clock(clock.clone());
        let client = if config.reconcile {
            // The lookup carries the vendor's credentials too, and goes
            // through the calls' HTTP client (its TLS roots).
            let lookup = VendorLookup::new(&config.vendor_url)?.through(&client);
            client.with_reconcile(Arc::new(lookup))
        } else {
            client
        };
        Ok(Self {
            events: EventOutbox::new(&db, config.namespace.clone()),
            db,
            leases,
            client,
            clock,
            config,
        })
    }

    /// Pays and reconciles until `shutdown` turns true. Up to
    /// `concurrency` payouts are paid at once, and a slot is refilled as soon
    /// as its payout settles: a slow vendor call holds only its own slot.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let this = Arc::new(self);
        let slots = this.config.concurrency.max(1);
        tracing::info!(vendor = %this.config.vendor_url, slots, "payout worker running");
        let mut running: tokio::task::JoinSet<Result<Settled, DbError>> = tokio::task::JoinSet::new();
        // The payouts being paid here, by task: never two tasks for one.
        let mut paying: std::collections::HashMap<tokio::task::Id, String> = std::collections::HashMap::new();
        let mut next_look = tokio::time::Instant::now();
        loop {
            if *shutdown.borrow() {
                break;
            }
            if tokio::time::Instant::now() >= next_look {
                next_look = idem_outbound_instant_after(this.config.poll);
                if running.len() < slots {
                    match this.db.payouts_due(this.clock.now_ms(), 100).await {
                        Ok(due) => {
                            for task in due {
                                if running.len() >= slots {
                                    break;
                                }
                                if !paying.values().any(|id| *id == task.id) {
                                    let (this, id) = (this.clone(), task.id.clone());
                                    let handle = running.spawn(async move { this.pay(task).await });
                                    paying.insert(handle.id(), id);
                                }
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "requested payouts not read; trying again"),
                    }
                }
                if let Err(e) = this.reconcile().await {
                    tracing::warn!(error = %e, "redriven payouts not reconciled; trying again");
                }
            }
            tokio::select! {
                Some(done) = running.join_next_with_id(), if !running.is_empty() => match done {
                    Ok((task, settled)) => {
                        let id = paying.remove(&task).unwrap_or_default();
                        match settled {
                            Ok(s) => tracing::debug!(payout = %id, settled = ?s, "payout settled"),
                            Err(e) => tracing::warn!(payout = %id, error = %e, "a payout was not settled; it is tried again"),
                        }
                    }
                    Err(e) => {
                        // Its lease expires on its own; the payout is tried again then.
                        let id = paying.remove(&e.id()).unwrap_or_default();
                        tracing::error!(payout = %id, error = %e, "a payout task failed");
                    }
                },
                _ = tokio::time::sleep_until(next_look) => {}
                _ = shutdown.wait_for(|s| *s) => break,
            }
        }
        // Calls in flight finish (each is bounded by its deadline), so no
        // vendor answer is thrown away at shutdown.
        while running.join_next().await.is_some() {}
    }

    /// One pass: pays up to a batch of requested payouts (at most
    /// `concurrency` at once) and reconciles redriven dead letters.
    pub async fn pass(self: Arc<Self>) -> Result<PassReport, DbError> {
        let mut report = PassReport::default();
        let due = self.db.payouts_due(self.clock.now_ms(), 100).await?;
        let limit = Arc::new(tokio::sync::Semaphore::new(self.config.concurrency.max(1)));
        let mut running = tokio::task::JoinSet::new();
        for task in due {
            let permit = limit.clone().acquire_owned().await.expect("never closed");
            let this = self.clone();
            running.spawn(async move {
                let _permit = permit;
                this.pay(task).await
            });
        }
        while let Some(done) = running.join_next().await {
            match done {
                Ok(Ok(Settled::Paid)) => report.paid += 1,
                Ok(Ok(Settled::DeadLettered)) => report.dead_lettered += 1,
                Ok(Ok(Settled::Skipped)) => report.skipped += 1,
                Ok(Ok(Settled::Unknown)) => report.unknown += 1,
                Ok(Ok(Settled::Deferred)) => report.deferred += 1,
                Ok(Err(e)) => tracing::warn!(error = %e, "a payout was not settled; it is tried again"),
                Err(e) => tracing::error!(error = %e, "a payout task failed"),
            }
        }
        report.reconciled = self.reconcile().await?;
        Ok(report)
    }

    /// Pays one payout, if it is still requested and no other worker holds it.
    async fn pay(&self, task: PayoutTask) -> Result<Settled, DbError> {
        let scope = Scope::parse(&task.tenant, PAYOUT_OPERATION)?;
        let key = IdempotencyKey::new(&task.id)?;
        let request = vendor_request(&self.config.vendor_url, &task)?;
        let fingerprint = Fingerprint::of_json(scope.operation(), request.body())?;
        let lease_ms = u64::try_from(self.config.lease.as_millis()).unwrap_or(u64::MAX);
        let call = Call::new(scope.clone(), key.clone(), fingerprint).with_policy(
            Policy::default()
                .with_in_flight(InFlight::Reject)
                .with_lease_ms(lease_ms)
                .with_ttl_secs(crate::api::PAYOUT_KEY_TTL_SECS),
        );
        let lease = match self.leases.acquire(&call).await {
            Ok(Acquire::Claimed(lease)) => lease,
            // Another worker holds it, or finished it and its row says so.
            Ok(Acquire::Replay(_)) | Err(IdemError::InFlight { .. }) => return Ok(Settled::Skipped),
            Err(e) => return Err(e.into()),
        };
        let beat = self.leases.heartbeat(&lease, lease_ms);
        let outcome = self
            .pay_held(&task, &key, &scope, &request, (beat.held(), lease_ms))
            .await;
        beat.stop();
        // The key is only a lock among workers: the payout row is the
        // record. A lease taken over meanwhile is fenced; that is fine.
        match self.leases.release(&lease).await {
            Ok(()) | Err(IdemError::Fenced) => {}
            Err(e) => tracing::warn!(error = %e, payout = %task.id, "could not release a payout lease; it expires"),
        }
        outcome
    }

    async fn pay_held(
        &self,
        task: &PayoutTask,
        key: &IdempotencyKey,
        scope: &Scope,
        request: &OutboundRequest,
        (held, lease_ms): (&HeldLease, u64),
    ) -> Result<Settled, DbError> {
        // Settled while this worker waited for the lease, or deferred by
        // another worker meanwhile: nothing to do now.
        let payout = match self.db.payout(&task.tenant, &task.id).await? {
            Some(p) if p.status == PayoutState::Requested => p,
            _ => return Ok(Settled::Skipped),
        };
        if payout.not_before_ms.is_some_and(|at| at > self.clock.now_ms()) {
            return Ok(Settled::Skipped);
        }
        // Committed before the call: if this worker dies after the vendor
        // paid, the one that takes the payout over knows a call may have
        // reached the vendor, and since when.
        self.db
            .mark_payout_sent(&task.tenant, &task.id, self.clock.now_ms())
            .await?;
        let earlier = Earlier {
            first_reached_at_ms: payout.first_sent_at_ms,
            ..Earlier::default()
        };
        // Right before each send, the lease must still be this worker's for
        // a third of its length: a worker stopped past its lease (a pause,
        // a stalled machine) whose payout was taken over, asked about and
        // paid by another must not send it again when it wakes up, and
        // before its heartbeat learns it lost the lease, even to a vendor
        // that has forgotten the key by then.
        let margin_ms = i64::try_from(lease_ms / 3).unwrap_or(i64::MAX);
        let clock = self.clock.clone();
        let may_send = move || {
            if held.holds_for(clock.now_ms(), margin_ms) {
                Ok(())
            } else {
                Err(format!(
                    "this worker's lease on the payout ran out or was taken over (held until {} ms, now {} ms)",
                    held.held_until_ms(),
                    clock.now_ms()
                ))
            }
        };
        let sent = self.client.resend_while(key, request, earlier, &may_send).await;
        if let Err(stopped @ OutboundError::Stopped { .. }) = &sent {
            // The payout is another worker's now (or will be once the lease
            // is found expired): it carries on from the row, which says a
            // call may have reached the vendor.
            tracing::warn!(payout = %task.id, error = %stopped, "payout left to the worker that holds it now");
            metrics::counter!("ledger_payouts_lease_lost_total").increment(1);
            return Ok(Settled::Skipped);
        }
        let now_ms = self.clock.now_ms();
        let mut tx = self.db.begin().await?;
        let settled = match sent {
            Ok(answer) => match check_answer(task, &answer.body) {
                Ok(vendor_id) => {
                    let change = PayoutChange {
                        from: PayoutState::Requested,
                        to: PayoutState::Paid,
                        vendor_payout_id: vendor_id.as_deref(),
                        attempts: i64::from(answer.attempts),
                        last_error: None,
                        now_ms,
                    };
                    let extra = serde_json::json!({ "vendor_payout_id": vendor_id });
                    let moved = self
                        .move_payout(&mut tx, task, &change, None, "payout.paid", extra)
                        .await?;
                    moved.then_some(Settled::Paid)
                }
                // A success that does not say what the vendor promises (a
                // wrong endpoint's "200 ok"): it may or may not have paid.
                Err(why) => {
                    let reason = format!(
                        "the vendor's {} answer does not match its contract: {why}",
                        answer.status
                    );
                    let letter =
                        NewDeadLetter::new(scope.clone(), key.clone(), request.clone(), answer.attempts, &reason)
                            .reached_at(Some(payout.first_sent_at_ms.unwrap_or(now_ms)))
                            .sent_under(self.client.terms_of(request))
                            .outcome_unknown();
                    self.hold_unknown(&mut tx, task, &letter, answer.attempts, &reason, now_ms)
                        .await?
                }
            },
            Err(OutboundError::RetryLater {
                after,
                attempts,
                last_error,
                ..
            }) => {
                let deferral = PayoutDeferral {
                    not_before_ms: now_ms.saturating_add(i64::try_from(after.as_millis()).unwrap_or(i64::MAX)),
                    attempts: i64::from(attempts),
                    last_error: idem_core::clip_text(&last_error),
                };
                let deferred = tx.defer_payout(&task.tenant, &task.id, &deferral, now_ms).await?;
                tracing::info!(payout = %task.id, retry_in_s = after.as_secs(), "the vendor asked to wait; payout deferred");
                deferred.then_some(Settled::Deferred)
            }
            Err(failed @ OutboundError::Unknown { .. }) => {
                let letter = failed
                    .dead_letter(scope, key, request)
                    .expect("an unknown outcome is kept");
                let reason = failed.to_string();
                self.hold_unknown(&mut tx, task, &letter, failed.attempts(), &reason, now_ms)
                    .await?
            }
            Err(failed) => {
                let error = failed.to_string();
                let change = PayoutChange {
                    from: PayoutState::Requested,
                    to: PayoutState::DeadLettered,
                    vendor_payout_id: None,
                    attempts: i64::from(failed.attempts()),
                    last_error: Some(idem_core::clip_text(&error)),
                    now_ms,
                };
                // The first call that may have reached the vendor is the
                // earliest of this worker's and any before it.
                let reached = match (failed.first_reached_at_ms(), payout.first_sent_at_ms) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let letter = NewDeadLetter::new(scope.clone(), key.clone(), request.clone(), failed.attempts(), &error)
                    .reached_at(reached)
                    .sent_under(failed.sent_under().unwrap_or_else(|| self.client.terms_of(request)));
                let extra = serde_json::json!({ "error": error });
                let moved = self
                    .move_payout(&mut tx, task, &change, Some(&letter), "payout.dead_lettered", extra)
                    .await?;
                if moved {
                    tracing::warn!(payout = %task.id, error = %failed, "payout dead-lettered");
                }
                moved.then_some(Settled::DeadLettered)
            }
        };
        self.db.commit(tx).await?;
        Ok(settled.unwrap_or(Settled::Skipped))
    }

    /// Applies `change` to the payout in `tx` and, if it moved, records
    /// `letter` and enqueues the event `kind` (the payout and `extra`);
    /// false, and nothing written, when it was not in `change.from`.
    async fn move_payout(
        &self,
        tx: &mut D::Tx,
        task: &PayoutTask,
        change: &PayoutChange<'_>,
        letter: Option<&NewDeadLetter>,
        kind: &str,
        extra: serde_json::Value,
    ) -> Result<bool, DbError> {
        if !tx.change_payout(&task.tenant, &task.id, change).await? {
            return Ok(false);
        }
        if let Some(letter) = letter {
            D::record_dead_letter(&self.db.dead_letters(), tx, letter).await?;
        }
        self.event(tx, task, kind, extra, change.now_ms).await?;
        Ok(true)
    }

    async fn event(
        &self,
        tx: &mut D::Tx,
        task: &PayoutTask,
        kind: &str,
        extra: serde_json::Value,
        now_ms: i64,
    ) -> Result<(), DbError> {
        let mut data = serde_json::json!({
            "payout_id": task.id,
            "account_id": task.account_id,
            "amount": task.amount,
        });
        if let (Some(data), serde_json::Value::Object(extra)) = (data.as_object_mut(), extra) {
            data.extend(extra);
        }
        self.events.enqueue(tx, kind, &task.tenant, now_ms, data).await
    }
}

/// One pass of a payout worker on `store` (tests and tools; the binary
/// runs [`run`]).
pub async fn pass(
    store: &crate::Store,
    clock: SharedClock,
    client: OutboundClient,
    config: PayoutConfig,
) -> Result<PassReport, DbError> {
    with_db!(store, db => {
        #[cfg(feature = "fault-injection")]
        if let Some(faults) = crate::faulty::store_faults() {
            return Arc::new(PayoutWorker::new(faults.beside(db.clone()), clock, client, config)?).pass().await;
        }
        Arc::new(PayoutWorker::new(db.clone(), clock, client, config)?).pass().await
    })
}

/// Runs a payout worker on `store` until `shutdown` turns true.
pub async fn run(
    store: &crate::Store,
    clock: SharedClock,
    client: OutboundClient,
    config: PayoutConfig,
    shutdown: watch::Receiver<bool>,
) {
    let started = with_db!(store, db => {
        #[cfg(feature = "fault-injection")]
        if let Some(faults) = crate::faulty::store_faults() {
            return report_start(run_worker(faults.beside(db.clone()), clock, client, config, shutdown).await);
        }
        run_worker(db.clone(), clock, client, config, shutdown).await
    });
    report_start(started);
}

async fn run_worker<D: LedgerDb + LeaseStore>(
    db: D,
    clock: SharedClock,
    client: OutboundClient,
    config: PayoutConfig,
    shutdown: watch::Receiver<bool>,
) -> Result<(), DbError> {
    PayoutWorker::new(db, clock, client, config)?.run(shutdown).await;
    Ok(())
}

fn report_start(started: Result<(), DbError>) {
    if let Err(e) = started {
        tracing::error!(error = %e, "the payout worker did not start");
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settled {
    Paid,
    DeadLettered,
    Skipped,
    Unknown,
    Deferred,
}

/// `now + by` on tokio's clock, saturating instead of overflowing.
fn idem_outbound_instant_after(by: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(by)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}
