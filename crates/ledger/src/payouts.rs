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

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    Acquire, Call, DeadLetterState, DeadLetterStore, Error as IdemError, Fingerprint, IdempotencyKey, InFlight,
    LeaseEngine, LeaseStore, NewDeadLetter, OutboundRequest, Policy, Scope, SharedClock,
};
use idem_outbound::OutboundClient;
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
        }
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
    pub fn new(db: D, clock: SharedClock, client: OutboundClient, config: PayoutConfig) -> Result<Self, DbError> {
        let leases = LeaseEngine::new(db.keyed(idem_core::TableName::new(crate::db::PAYOUT_LEASES_TABLE)?))
            .with_clock(clock.clone());
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
                next_look = tokio::time::Instant::now() + this.config.poll;
                if running.len() < slots {
                    match this.db.payouts_in(PayoutState::Requested, 100).await {
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
        let due = self.db.payouts_in(PayoutState::Requested, 100).await?;
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
        let outcome = self.pay_held(&task, &key, &scope, &request).await;
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
    ) -> Result<Settled, DbError> {
        // Settled while this worker waited for the lease: nothing to do.
        match self.db.payout(&task.tenant, &task.id).await? {
            Some(p) if p.status == PayoutState::Requested => {}
            _ => return Ok(Settled::Skipped),
        }
        let sent = self.client.send(key, request).await;
        let now_ms = self.clock.now_ms();
        let mut tx = self.db.begin().await?;
        let settled = match sent {
            Ok(answer) => {
                let vendor_id = vendor_payout_id(&answer.body);
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
                    let letter = NewDeadLetter {
                        scope: scope.clone(),
                        key: key.clone(),
                        request: request.clone(),
                        attempts: failed.attempts(),
                        last_error: error.clone(),
                    };
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

    /// Marks paid the dead-lettered payouts whose dead letter a redrive
    /// resolved (up to a batch, oldest first); answers how many.
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
            if letter.state != DeadLetterState::Resolved {
                continue;
            }
            let vendor_id = letter.response_body.as_deref().and_then(vendor_payout_id);
            let now_ms = self.clock.now_ms();
            let change = PayoutChange {
                from: PayoutState::DeadLettered,
                to: PayoutState::Paid,
                vendor_payout_id: vendor_id.as_deref(),
                attempts: 0,
                last_error: None,
                now_ms,
            };
            let mut tx = self.db.begin().await?;
            if D::change_payout(&mut tx, &task.tenant, &task.id, &change).await? {
                self.event(
                    &mut tx,
                    &task,
                    "payout.paid",
                    serde_json::json!({ "vendor_payout_id": vendor_id }),
                    now_ms,
                )
                .await?;
                reconciled += 1;
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
    with_db!(store, db => Arc::new(PayoutWorker::new(db.clone(), clock, client, config)?).pass().await)
}

/// Runs a payout worker on `store` until `shutdown` turns true.
pub async fn run(
    store: &crate::Store,
    clock: SharedClock,
    client: OutboundClient,
    config: PayoutConfig,
    shutdown: watch::Receiver<bool>,
) {
    let started = with_db!(store, db => match PayoutWorker::new(db.clone(), clock, client, config) {
        Ok(worker) => {
            worker.run(shutdown).await;
            Ok(())
        }
        Err(e) => Err(e),
    });
    if let Err(e) = started {
        tracing::error!(error = %e, "the payout worker did not start");
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settled {
    Paid,
    DeadLettered,
    Skipped,
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

/// The vendor's id in its answer (`{"id": …}`), if it has one that every
/// engine can store: 1 to 200 bytes without control characters (PostgreSQL
/// refuses a NUL, and a payout whose result cannot be stored would stay
/// requested and be sent again on every pass).
fn vendor_payout_id(body: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let id = value.get("id")?.as_str()?;
    (!id.is_empty() && id.len() <= 200 && !id.chars().any(char::is_control)).then(|| id.to_owned())
}
