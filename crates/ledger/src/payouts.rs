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

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    Acquire, Call, DeadLetterState, DeadLetterStore, Error as IdemError, Fingerprint, HeldLease, IdempotencyKey,
    InFlight, LeaseEngine, LeaseStore, NewDeadLetter, OutboundRequest, Policy, Scope, SharedClock, VerdictSource,
};
use idem_outbound::{Earlier, OutboundClient, OutboundError, Reconcile, Reconciled};
use tokio::sync::watch;

use crate::db::{DbError, LedgerDb, PayoutChange, PayoutState, PayoutTask};
use crate::events::Namespace;

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
            let lookup = VendorLookup::new(&config.vendor_url)?
                .with_http_client(client.http_client().clone())
                .with_headers(client.config().secret_headers.clone());
            client.with_reconcile(Arc::new(lookup))
        } else {
            client
        };
        Ok(Self {
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
                    let moved = D::change_payout(&mut tx, &task.tenant, &task.id, &change).await?;
                    if moved {
                        self.event(
                            &mut tx,
                            task,
                            "payout.paid",
                            serde_json::json!({ "vendor_payout_id": vendor_id }),
                            now_ms,
                        )
                        .await?;
                    }
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
                let not_before = now_ms.saturating_add(i64::try_from(after.as_millis()).unwrap_or(i64::MAX));
                let deferred = D::defer_payout(
                    &mut tx,
                    &task.tenant,
                    &task.id,
                    not_before,
                    i64::from(attempts),
                    idem_core::clip_text(&last_error),
                    now_ms,
                )
                .await?;
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
                let moved = D::change_payout(&mut tx, &task.tenant, &task.id, &change).await?;
                if moved {
                    // The first call that may have reached the vendor is
                    // the earliest of this worker's and any before it.
                    let reached = match (failed.first_reached_at_ms(), payout.first_sent_at_ms) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    let letter =
                        NewDeadLetter::new(scope.clone(), key.clone(), request.clone(), failed.attempts(), &error)
                            .reached_at(reached)
                            .sent_under(failed.sent_under().unwrap_or_else(|| self.client.terms_of(request)));
                    D::record_dead_letter(&self.db.dead_letters(), &mut tx, &letter).await?;
                    self.event(
                        &mut tx,
                        task,
                        "payout.dead_lettered",
                        serde_json::json!({ "error": error }),
                        now_ms,
                    )
                    .await?;
                    tracing::warn!(payout = %task.id, error = %failed, "payout dead-lettered");
                }
                moved.then_some(Settled::DeadLettered)
            }
        };
        self.db.commit(tx).await?;
        Ok(settled.unwrap_or(Settled::Skipped))
    }

    /// Moves a requested payout to `unknown` with its dead letter held as
    /// unknown, in `tx`.
    async fn hold_unknown(
        &self,
        tx: &mut D::Tx,
        task: &PayoutTask,
        letter: &NewDeadLetter,
        attempts: u32,
        reason: &str,
        now_ms: i64,
    ) -> Result<Option<Settled>, DbError> {
        let change = PayoutChange {
            from: PayoutState::Requested,
            to: PayoutState::Unknown,
            vendor_payout_id: None,
            attempts: i64::from(attempts),
            last_error: Some(idem_core::clip_text(reason)),
            now_ms,
        };
        let moved = D::change_payout(tx, &task.tenant, &task.id, &change).await?;
        if moved {
            D::record_dead_letter(&self.db.dead_letters(), tx, letter).await?;
            self.event(
                tx,
                task,
                "payout.outcome_unknown",
                serde_json::json!({ "error": reason }),
                now_ms,
            )
            .await?;
            metrics::counter!("ledger_payouts_unknown_total").increment(1);
            tracing::error!(payout = %task.id, reason, "payout outcome unknown: held for an operator (idem dlq resolve)");
        }
        Ok(moved.then_some(Settled::Unknown))
    }

    /// Settles the dead-lettered and unknown payouts whose dead letter was
    /// settled elsewhere (up to a batch, oldest first): resolved → paid
    /// (when the answer holds what the vendor promises; otherwise unknown);
    /// held as unknown → unknown; found not applied by an operator (dead
    /// again) → dead-lettered. Answers how many became paid.
    pub async fn reconcile(&self) -> Result<u64, DbError> {
        let dead = self.db.payouts_redriven(PAYOUT_OPERATION, 100).await?;
        let letters = self.db.dead_letters();
        let mut reconciled = 0;
        for task in dead {
            let scope = Scope::parse(&task.tenant, PAYOUT_OPERATION)?;
            let key = IdempotencyKey::new(&task.id)?;
            let Some(letter) = letters.find(&scope, &key).await? else {
                continue;
            };
            let Some(payout) = self.db.payout(&task.tenant, &task.id).await? else {
                continue;
            };
            let now_ms = self.clock.now_ms();
            let (to, vendor_id, last_error, kind) = match letter.state {
                DeadLetterState::Resolved => {
                    let body = letter.response_body.as_deref().unwrap_or_default();
                    let by_operator = letter
                        .reconciliation
                        .as_ref()
                        .is_some_and(|r| r.by == VerdictSource::Operator);
                    match check_answer(&task, body) {
                        Ok(id) => (PayoutState::Paid, id, None, "payout.paid"),
                        // An operator's word stands, with whatever id it gave.
                        Err(_) if by_operator => (PayoutState::Paid, vendor_payout_id(body), None, "payout.paid"),
                        Err(why) => (
                            PayoutState::Unknown,
                            None,
                            Some(format!(
                                "the vendor's answer to a redrive does not match its contract: {why}"
                            )),
                            "payout.outcome_unknown",
                        ),
                    }
                }
                DeadLetterState::Unknown => (
                    PayoutState::Unknown,
                    None,
                    Some(letter.last_error.clone()),
                    "payout.outcome_unknown",
                ),
                DeadLetterState::Dead => (
                    PayoutState::DeadLettered,
                    None,
                    Some(letter.last_error.clone()),
                    "payout.dead_lettered",
                ),
                _ => continue,
            };
            if to == payout.status {
                continue;
            }
            let change = PayoutChange {
                from: payout.status,
                to,
                vendor_payout_id: vendor_id.as_deref(),
                attempts: 0,
                last_error: last_error.as_deref().map(idem_core::clip_text),
                now_ms,
            };
            let mut tx = self.db.begin().await?;
            if D::change_payout(&mut tx, &task.tenant, &task.id, &change).await? {
                let extra = match &last_error {
                    None => serde_json::json!({ "vendor_payout_id": vendor_id }),
                    Some(e) => serde_json::json!({ "error": e }),
                };
                self.event(&mut tx, &task, kind, extra, now_ms).await?;
                reconciled += u64::from(to == PayoutState::Paid);
            }
            self.db.commit(tx).await?;
        }
        Ok(reconciled)
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
        crate::events::enqueue::<D>(
            &self.db.outbox(),
            tx,
            &self.config.namespace,
            kind,
            &task.tenant,
            now_ms,
            data,
        )
        .await
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

/// The vendor call of a payout: `POST {vendor}/v1/payouts` with the amount
/// and the payout id as the reference.
pub fn vendor_request(vendor_url: &str, task: &PayoutTask) -> Result<OutboundRequest, DbError> {
    let body = serde_json::to_vec(&serde_json::json!({ "amount": task.amount, "reference": task.id }))
        .map_err(|e| DbError::Idem(IdemError::Encode(e.to_string())))?;
    Ok(OutboundRequest::new(
        "POST",
        format!("{vendor_url}/v1/payouts"),
        vec![("content-type".to_owned(), "application/json".to_owned())],
        body,
    )?)
}

/// What the vendor's success answer promises, checked against the payout:
/// a JSON object with the vendor's `id` (1 to 200 bytes without control
/// characters, storable on every engine), the payout's `amount` and its
/// id as `reference`. Answers the vendor's id.
pub fn check_answer(task: &PayoutTask, body: &[u8]) -> Result<Option<String>, String> {
    check_promise(task.amount, &task.id, body)
}

/// [`check_answer`] for a redrive (`idem_outbound::Redriver::with_answer_check`):
/// the amount and reference are the ones the request sent. A redrive's 2xx
/// that is not the payout (`200 {"error": …}`) then holds the dead letter
/// as unknown, for `idem dlq resolve`, instead of resolving it.
pub fn answer_check() -> idem_outbound::AnswerCheck {
    Arc::new(|request: &OutboundRequest, body: &[u8]| {
        let sent: serde_json::Value =
            serde_json::from_slice(request.body()).map_err(|e| format!("the request is not JSON: {e}"))?;
        let (Some(amount), Some(reference)) = (sent["amount"].as_i64(), sent["reference"].as_str()) else {
            return Err("the request has no amount or reference to check the answer against".into());
        };
        check_promise(amount, reference, body).map(|_| ())
    })
}

fn check_promise(amount: i64, reference: &str, body: &[u8]) -> Result<Option<String>, String> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| format!("not a JSON object ({e})"))?;
    if !value.is_object() {
        return Err("not a JSON object".into());
    }
    if value.get("amount").and_then(serde_json::Value::as_i64) != Some(amount) {
        return Err(format!("its amount is {}, not {amount}", value["amount"]));
    }
    if value.get("reference").and_then(serde_json::Value::as_str) != Some(reference) {
        return Err(format!("its reference is {}, not {reference}", value["reference"]));
    }
    match value.get("id").and_then(serde_json::Value::as_str) {
        None | Some("") => Err("it has no vendor id".into()),
        // An id the database cannot store (a NUL) does not keep a paid
        // payout requested, called again on every pass: paid, without it.
        Some(_) => Ok(vendor_payout_id(body)),
    }
}

/// The vendor's id in its answer (`{"id": …}`), if it has one that every
/// engine can store: 1 to 200 bytes without control characters (PostgreSQL
/// refuses a NUL, and a payout whose result cannot be stored would stay
/// requested and be sent again on every pass).
fn vendor_payout_id(body: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let id = value.get("id")?.as_str()?;
    (!id.is_empty() && id.len() <= 200 && !id.chars().any(char::is_control)).then(|| id.to_owned())
}

/// The ledger's reconcile hook: asks the vendor for its record of a payout,
/// by the payout id it was sent as `reference` —
/// `GET {vendor}/v1/payouts?reference={payout id}`, answering `{"data":
/// [{"id", "amount", "reference", "status"}, …]}`.
///
/// - one record `paid`, for the payout's amount → applied (its record is
///   the answer; nothing is sent);
/// - none → not applied (the vendor keeps every payout it made, forever);
/// - a request still `processing` → in flight (asked again later);
/// - several paid, or a record that does not match → unknown.
#[derive(Debug, Clone)]
pub struct VendorLookup {
    http: reqwest::Client,
    url: reqwest::Url,
    headers: reqwest::header::HeaderMap,
}

impl VendorLookup {
    /// The lookup of the vendor at `vendor_url`.
    pub fn new(vendor_url: &str) -> Result<Self, DbError> {
        let bad = |why: String| DbError::Idem(IdemError::Config(why));
        let url = reqwest::Url::parse(&format!("{}/v1/payouts", vendor_url.trim_end_matches('/')))
            .map_err(|e| bad(format!("vendor URL {vendor_url:?}: {e}")))?;
        let http = crate::http_builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| bad(format!("the vendor lookup's HTTP client: {e}")))?;
        Ok(Self {
            http,
            url,
            headers: reqwest::header::HeaderMap::new(),
        })
    }

    /// Asks through `http` (its TLS roots and pool; redirects must be
    /// off), in place of a client of its own.
    pub fn with_http_client(mut self, http: reqwest::Client) -> Self {
        self.http = http;
        self
    }

    /// Sends `headers` with every lookup (the vendor's credentials, kept
    /// sensitive).
    pub fn with_headers(mut self, headers: Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>) -> Self {
        for (name, mut value) in headers {
            value.set_sensitive(true);
            self.headers.insert(name, value);
        }
        self
    }

    async fn ask(&self, request: &OutboundRequest, timeout: Duration) -> Result<Reconciled, String> {
        let sent: serde_json::Value =
            serde_json::from_slice(request.body()).map_err(|e| format!("the request is not JSON: {e}"))?;
        let (Some(reference), Some(amount)) = (sent["reference"].as_str(), sent["amount"].as_i64()) else {
            return Ok(Reconciled::Unknown(
                "the request has no reference or amount to look up".into(),
            ));
        };
        let mut url = self.url.clone();
        url.query_pairs_mut().append_pair("reference", reference);
        let response = self
            .http
            .get(url)
            .headers(self.headers.clone())
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| format!("lookup failed: {e}"))?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!("lookup answered HTTP {status}"));
        }
        let body = read_bounded(response, MAX_LOOKUP_BYTES).await?;
        let found: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| format!("lookup answer is not JSON: {e}"))?;
        // A list object, as the vendor's list endpoints answer: an empty
        // body, `{}` or a bare `[]` (a wrong URL, a proxy's page) says
        // nothing, and is never taken for "not applied".
        let (true, Some(listed)) = (found["object"] == "list", found["data"].as_array()) else {
            return Err("lookup answer is not a list (object \"list\" with a data array)".into());
        };
        // A record without a reference cannot be told apart: it may be
        // this payout under another field's name.
        if listed.iter().any(|p| !p["reference"].is_string()) {
            return Ok(Reconciled::Unknown(format!(
                "the vendor's answer for reference {reference} lists a record without a reference"
            )));
        }
        // Only records of this very reference count: a vendor that ignored
        // the filter lists other payouts, which say nothing of this one.
        let data: Vec<&serde_json::Value> = listed.iter().filter(|p| p["reference"] == reference).collect();
        if data.is_empty() && found["has_more"] == true {
            // A first page without it proves nothing.
            return Ok(Reconciled::Unknown(format!(
                "the vendor's answer for reference {reference} has more pages and none of this one"
            )));
        }
        let paid: Vec<&serde_json::Value> = data.iter().copied().filter(|p| p["status"] == "paid").collect();
        Ok(match paid.as_slice() {
            [one] if one["amount"].as_i64() == Some(amount) => Reconciled::Applied {
                status: 201,
                body: serde_json::to_vec(one).map_err(|e| e.to_string())?,
            },
            [one] => Reconciled::Unknown(format!(
                "the vendor paid reference {reference} for {}, not {amount}",
                one["amount"]
            )),
            [] if data.iter().any(|p| p["status"] == "processing") => Reconciled::InFlight,
            [] if data.is_empty() => Reconciled::NotApplied,
            [] => Reconciled::Unknown(format!("the vendor's records of {reference} are in no known state")),
            many => Reconciled::Unknown(format!("the vendor paid reference {reference} {} times", many.len())),
        })
    }
}

/// The most bytes of a lookup's answer read; a longer one is an error.
pub const MAX_LOOKUP_BYTES: usize = 1024 * 1024;

/// `response`'s body, refused past `max` bytes (never buffered whole).
async fn read_bounded(mut response: reqwest::Response, max: usize) -> Result<Vec<u8>, String> {
    if response.content_length().is_some_and(|n| n > max as u64) {
        return Err(format!("lookup answer over {max} bytes"));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| format!("lookup failed: {e}"))? {
        if body.len() + chunk.len() > max {
            return Err(format!("lookup answer over {max} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

impl Reconcile for VendorLookup {
    fn reconcile<'a>(
        &'a self,
        _key: &'a IdempotencyKey,
        request: &'a OutboundRequest,
        timeout: Duration,
    ) -> idem_core::BoxFuture<'a, Result<Reconciled, String>> {
        Box::pin(self.ask(request, timeout))
    }
}
