//! Transactional mode: the claim, the caller's writes and the recorded
//! outcome commit as one database transaction.

use std::fmt;
use std::time::Instant as StdInstant;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

use crate::classify::Classify;
use crate::clock::{SharedClock, system_clock};
use crate::contention::{Contention, ContentionRetries};
use crate::engine::{self, Attempts, Found, Retry};
use crate::error::{Error, Result};
use crate::metrics::{self, Stage};
use crate::record::{Call, ClaimRequest, Outcome, Record, RecordStatus, Token};
use crate::registry::RegistryGuard;
use crate::store::{BoxFuture, ReadFirst, TxBackend, TxClaim};

/// The error of a read-first engine on a store without a read outside a
/// transaction.
pub(crate) const NO_READ: &str = "the engine reads before it claims, but its store has no read outside a transaction";

/// How long recording a final rejection waits to claim the key again
/// (see [`TxEngine::reject_final`]).
pub const REJECT_CLAIM_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Runs idempotent calls in transactional mode on a [`TxBackend`].
///
/// The database's unique key is the lock: a concurrent twin blocks on the
/// first claim until it commits (then replays its outcome) or rolls back
/// (then claims the key itself). A fault, a rejection, a panic or a dropped
/// future before commit rolls everything back and leaves the key unused.
#[derive(Clone)]
pub struct TxEngine<B> {
    backend: B,
    clock: SharedClock,
    read_first: bool,
}

impl<B: fmt::Debug> fmt::Debug for TxEngine<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxEngine")
            .field("backend", &self.backend)
            .field("read_first", &self.read_first)
            .finish_non_exhaustive()
    }
}

/// The result of [`TxEngine::begin`].
// `Begin` is built once per call and matched at once; boxing the claim would
// add an allocation to every call for no gain.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Begin<Tx> {
    /// This call holds the key inside an open transaction: do the work, then
    /// [`commit`](TxEngine::commit) or drop.
    Claimed(Claimed<Tx>),
    /// An earlier call recorded this outcome; the work must not run.
    Replay(Record),
}

/// A key claimed inside an open transaction. Dropping it rolls the
/// transaction back and leaves the key unused.
pub struct Claimed<Tx> {
    /// The open transaction: the caller's writes go through it.
    pub tx: Tx,
    ticket: Ticket,
}

impl<Tx> fmt::Debug for Claimed<Tx> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claimed")
            .field("ticket", &self.ticket)
            .finish_non_exhaustive()
    }
}

/// Everything a claim needs to be finished, apart from its transaction.
/// Lets a caller lend the transaction elsewhere (an HTTP handler) and join
/// it back with [`Ticket::join`].
pub struct Ticket {
    call: Call,
    now_ms: i64,
    expires_at_ms: i64,
    token: Token,
    started: StdInstant,
    _guard: Option<RegistryGuard>,
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket")
            .field("call", &self.call)
            .finish_non_exhaustive()
    }
}

impl Ticket {
    /// The call this ticket belongs to.
    pub fn call(&self) -> &Call {
        &self.call
    }

    /// Joins a transaction back to its ticket.
    pub fn join<Tx>(self, tx: Tx) -> Claimed<Tx> {
        Claimed { tx, ticket: self }
    }

    fn request(&self) -> ClaimRequest<'_> {
        ClaimRequest {
            scope: self.call.scope(),
            key: self.call.key(),
            fingerprint: self.call.fingerprint(),
            now_ms: self.now_ms,
            expires_at_ms: self.expires_at_ms,
            fresh_token: self.token,
            lease_expires_at_ms: None,
        }
    }
}

impl<Tx> Claimed<Tx> {
    /// The call this claim belongs to.
    pub fn call(&self) -> &Call {
        &self.ticket.call
    }

    /// Separates the transaction from the ticket.
    pub fn split(self) -> (Tx, Ticket) {
        (self.tx, self.ticket)
    }
}

impl<B: TxBackend> TxEngine<B> {
    /// An engine on `backend` with the system clock.
    pub fn new(backend: B) -> Self {
        Self {
            backend,
            clock: system_clock(),
            read_first: false,
        }
    }

    /// Replaces the clock (tests use [`ManualClock`](crate::ManualClock)).
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Reads the key's committed row before claiming it (off by default).
    ///
    /// With it on, [`begin`](Self::begin) first reads the key's row, one
    /// statement outside any transaction ([`TxBackend::read_then_claim`]:
    /// the PostgreSQL and MySQL stores read on the connection the claim then
    /// uses; on a store that serialises claims in a
    /// [`local_registry`](TxBackend::local_registry), SQLite's, the read
    /// ([`TxBackend::read_committed`]) comes before the key's place in it is
    /// taken).
    /// A recorded outcome that has not expired is answered from that read
    /// (a replay, a [`Mismatch`](Error::Mismatch), an
    /// [`OutcomeUnknown`](Error::OutcomeUnknown), as the claim would
    /// answer), without opening a transaction, taking a lock or writing
    /// anything. Anything else (no row, an expired one, a lease in progress,
    /// a twin's claim not yet committed, which the read cannot see) goes on
    /// to the claim as without it.
    ///
    /// It trades one statement on every fresh call for a replay that costs
    /// one: turn it on where clients retry often. On a store with neither
    /// `read_then_claim` nor `read_committed` every call fails with
    /// [`Error::Config`].
    pub fn with_read_first(mut self, read_first: bool) -> Self {
        self.read_first = read_first;
        self
    }

    /// Whether the engine reads before it claims (see
    /// [`with_read_first`](Self::with_read_first)).
    pub fn reads_first(&self) -> bool {
        self.read_first
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The clock.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// Claims the call's key in a new transaction, or finds its recorded
    /// outcome. Fails with [`Error::Mismatch`] if the key was used with a
    /// different request, and with [`Error::InFlight`] if a twin still holds
    /// it when the policy's wait runs out.
    pub async fn begin(&self, call: &Call) -> Result<Begin<B::Tx>> {
        let span = tracing::debug_span!(
            "idem.claim",
            operation = call.scope().operation().as_str(),
            mode = "transactional"
        );
        self.begin_inner(call).instrument(span).await
    }

    async fn begin_inner(&self, call: &Call) -> Result<Begin<B::Tx>> {
        call.policy().validate()?;
        let op = call.scope().operation();
        let mut attempts = Attempts::new(call);
        let registry = self.backend.local_registry();
        // A store that serialises claims in a registry is read before the
        // key's place in it is taken, so that a replay waits for nobody; the
        // claim that follows reads nothing more. Other stores read and claim
        // together, on every attempt.
        let read_then_claim = self.read_first && registry.is_none();
        if self.read_first
            && registry.is_some()
            && let Some(record) = self.read_recorded(call).await?
        {
            metrics::count(metrics::REPLAYS, op);
            metrics::claim_latency(op, attempts.started.elapsed());
            return Ok(Begin::Replay(record));
        }
        let guard = match registry {
            Some(registry) => match registry.acquire(call.scope(), call.key(), attempts.deadline).await? {
                Some(guard) => Some(guard),
                None => {
                    metrics::count(metrics::IN_FLIGHT, op);
                    return Err(crate::record::in_flight(call.policy()));
                }
            },
            None => None,
        };
        loop {
            let now_ms = self.clock.now_ms();
            let ticket_parts = (
                now_ms,
                now_ms.saturating_add(call.policy().ttl_ms()),
                Token::fresh(now_ms),
            );
            let req = ClaimRequest {
                scope: call.scope(),
                key: call.key(),
                fingerprint: call.fingerprint(),
                now_ms,
                expires_at_ms: ticket_parts.1,
                fresh_token: ticket_parts.2,
                lease_expires_at_ms: None,
            };
            let begun = if read_then_claim {
                self.backend.read_then_claim(&req, attempts.remaining()).await
            } else {
                (self.backend.begin_claim(&req, attempts.remaining()).await)
                    .map(|(tx, claim)| ReadFirst::Claim(tx, claim))
            };
            let found = match begun {
                Ok(ReadFirst::Claim(tx, TxClaim::Claimed)) => {
                    metrics::claim(op, "transactional");
                    metrics::claim_latency(op, attempts.started.elapsed());
                    let ticket = Ticket {
                        call: call.clone(),
                        now_ms,
                        expires_at_ms: ticket_parts.1,
                        token: ticket_parts.2,
                        started: StdInstant::now(),
                        _guard: guard,
                    };
                    return Ok(Begin::Claimed(Claimed { tx, ticket }));
                }
                // Read before any transaction: nothing to roll back.
                Ok(ReadFirst::Recorded(row)) => row,
                Ok(ReadFirst::Claim(tx, TxClaim::Found(row))) => {
                    self.rollback_quietly(tx).await;
                    row
                }
                Ok(ReadFirst::Claim(tx, TxClaim::Busy)) => {
                    self.rollback_quietly(tx).await;
                    attempts.next(Retry::Busy).await?;
                    continue;
                }
                Err(e) if engine::is_contention(&e) => {
                    metrics::tx_retry(op.as_str(), Stage::Claim);
                    attempts.next(Retry::Contention(e)).await?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            match engine::decide(call, found, now_ms)? {
                Found::Replay(record) => {
                    metrics::count(metrics::REPLAYS, op);
                    metrics::claim_latency(op, attempts.started.elapsed());
                    return Ok(Begin::Replay(record));
                }
                Found::Wait => attempts.next(Retry::Busy).await?,
            }
        }
    }

    /// Records `record` under the claimed key and commits the transaction:
    /// the caller's writes, the claim and the outcome become durable together.
    /// On any error the transaction is rolled back and the key stays unused.
    pub async fn commit(&self, claimed: Claimed<B::Tx>, record: Record) -> Result<()> {
        let Claimed { tx, ticket } = claimed;
        let op = ticket.call.scope().operation();
        let limit = ticket.call.policy().max_record_bytes();
        if record.payload.len() > limit {
            self.rollback_quietly(tx).await;
            metrics::count(metrics::RELEASES, op);
            return Err(Error::RecordTooLarge {
                size: record.payload.len(),
                limit,
            });
        }
        let req = ticket.request();
        if let Err(e) = self.backend.record_commit(tx, &req, &record).await {
            metrics::count(metrics::RELEASES, op);
            return Err(e);
        }
        metrics::record(op, status_label(record.status));
        tracing::debug!(
            operation = op.as_str(),
            elapsed_ms = ticket.started.elapsed().as_millis() as u64,
            "idempotent call committed"
        );
        Ok(())
    }

    /// Rolls the caller's writes back and records a final rejection under the
    /// key in a new transaction, waiting up to [`REJECT_CLAIM_WAIT`] for the
    /// key. Answers whether it was recorded: `false` if a twin claimed the
    /// key in between (the key then belongs to it).
    pub async fn reject_final(&self, claimed: Claimed<B::Tx>, record: Record) -> Result<bool> {
        let Claimed { tx, ticket } = claimed;
        self.rollback_quietly(tx).await;
        let op = ticket.call.scope().operation();
        let limit = ticket.call.policy().max_record_bytes();
        if record.payload.len() > limit {
            metrics::count(metrics::RELEASES, op);
            return Err(Error::RecordTooLarge {
                size: record.payload.len(),
                limit,
            });
        }
        let req = ticket.request();
        // The key is claimed again with a short wait, not none: under
        // concurrent writes an insert can meet another transaction's gap or
        // next-key lock for a moment (and a Galera node, a write set being
        // applied), and a claim that gave up at once would leave the
        // rejection unrecorded, so that a retry ran the call again.
        // Contention is tried again, within the same budget.
        let deadline = StdInstant::now() + REJECT_CLAIM_WAIT;
        loop {
            let wait = deadline.saturating_duration_since(StdInstant::now());
            match self.backend.begin_claim(&req, wait).await {
                Ok((tx, TxClaim::Claimed)) => {
                    self.backend.record_commit(tx, &req, &record).await?;
                    break;
                }
                Err(e) if engine::is_contention(&e) && !wait.is_zero() => {
                    metrics::tx_retry(op.as_str(), Stage::Claim);
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                Err(e) => return Err(e),
                Ok((tx, _)) => {
                    // A twin claimed or completed the key in between.
                    self.rollback_quietly(tx).await;
                    metrics::count(metrics::RELEASES, op);
                    return Ok(false);
                }
            }
        }
        metrics::record(op, status_label(record.status));
        Ok(true)
    }

    /// Rolls the transaction back; the key stays unused.
    pub async fn abandon(&self, claimed: Claimed<B::Tx>) {
        let op = claimed.ticket.call.scope().operation().clone();
        self.rollback_quietly(claimed.tx).await;
        metrics::count(metrics::RELEASES, &op);
    }

    /// The read of a read-first engine on its own
    /// ([`TxBackend::read_committed`]): the call's answer if the key's
    /// committed row holds a recorded outcome that has not expired, `None`
    /// to claim.
    async fn read_recorded(&self, call: &Call) -> Result<Option<Record>> {
        let Some(read) = self.backend.read_committed(call.scope(), call.key()) else {
            return Err(Error::Config(NO_READ.into()));
        };
        let now_ms = self.clock.now_ms();
        match read.await? {
            Some(row) if row.is_recorded_at(now_ms) => match engine::decide(call, row, now_ms)? {
                Found::Replay(record) => Ok(Some(record)),
                Found::Wait => Ok(None),
            },
            _ => Ok(None),
        }
    }

    async fn rollback_quietly(&self, tx: B::Tx) {
        if let Err(e) = self.backend.rollback(tx).await {
            tracing::debug!(error = %e, "rollback failed; the connection will be discarded");
        }
    }

    /// Runs `work` once per key: claims the key, runs `work` with the open
    /// transaction, records its value (as JSON) and commits — or replays the
    /// recorded value without running `work`.
    ///
    /// An `Err` from `work`, a panic or a dropped future rolls everything
    /// back and leaves the key unused.
    ///
    /// Contention — a deadlock, a serialisation failure or a lock wait that
    /// ran out, at the claim, in `work` (an `Err` whose
    /// [`Contention::is_contention`] is true) or at commit — commits nothing,
    /// so the engine rolls back and runs the whole call again in a new
    /// transaction: `work` may run several times, but at most one run
    /// commits. After [`ContentionRetries::MAX_RUNS`] runs the last error is
    /// returned (retryable: [`Error::is_retryable`]).
    pub async fn execute<T, E, F>(&self, call: &Call, mut work: F) -> Result<Outcome<T>, E>
    where
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Contention,
    {
        let op = call.scope().operation().as_str();
        let mut retries = ContentionRetries::new();
        loop {
            let mut claimed = match self.begin(call).await? {
                Begin::Replay(record) => {
                    return match engine::decode::<T, crate::Never>(&record)? {
                        Ok(value) => Ok(Outcome::Replayed(value)),
                        Err(never) => match never {},
                    };
                }
                Begin::Claimed(claimed) => claimed,
            };
            let value = match work(&mut claimed.tx).await {
                Ok(value) => value,
                Err(e) => {
                    self.abandon(claimed).await;
                    if e.is_contention() && retries.again(op, Stage::Work).await {
                        continue;
                    }
                    return Err(e);
                }
            };
            let (claimed, payload) = self.encode_or_abandon(claimed, call, &value).await?;
            match self.commit(claimed, Record::completed(payload)).await {
                Ok(()) => return Ok(Outcome::Executed(value)),
                Err(e) if e.is_contention() && retries.again(op, Stage::Commit).await => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Like [`execute`](Self::execute), but `work` may also reject the call
    /// with `Ok(Err(rejection))`. A rejection always rolls back `work`'s
    /// writes; it is recorded (and replayed to later retries) only if the
    /// policy consumes keys on final rejections and the rejection
    /// [classifies](Classify) as [`Fatal`](crate::Retryable::Fatal). Otherwise
    /// the key stays unused and may be retried. Contention is retried as in
    /// [`execute`](Self::execute).
    pub async fn execute_with_rejections<T, R, E, F>(
        &self,
        call: &Call,
        mut work: F,
    ) -> Result<Outcome<Result<T, R>>, E>
    where
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<Result<T, R>, E>>,
        T: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned + Classify,
        E: From<Error> + Contention,
    {
        let op = call.scope().operation().as_str();
        let mut retries = ContentionRetries::new();
        loop {
            let mut claimed = match self.begin(call).await? {
                Begin::Replay(record) => return Ok(Outcome::Replayed(engine::decode::<T, R>(&record)?)),
                Begin::Claimed(claimed) => claimed,
            };
            let settled = match work(&mut claimed.tx).await {
                Ok(Ok(value)) => {
                    let (claimed, payload) = self.encode_or_abandon(claimed, call, &value).await?;
                    self.commit(claimed, Record::completed(payload))
                        .await
                        .map(|()| Ok(value))
                }
                Ok(Err(rejection)) => {
                    if engine::records_rejection(call, &rejection) {
                        let (claimed, payload) = self.encode_or_abandon(claimed, call, &rejection).await?;
                        self.reject_final(claimed, Record::rejected(payload))
                            .await
                            .map(|_| Err(rejection))
                    } else {
                        self.abandon(claimed).await;
                        Ok(Err(rejection))
                    }
                }
                Err(e) => {
                    self.abandon(claimed).await;
                    if e.is_contention() && retries.again(op, Stage::Work).await {
                        continue;
                    }
                    return Err(e);
                }
            };
            match settled {
                Ok(result) => return Ok(Outcome::Executed(result)),
                Err(e) if e.is_contention() && retries.again(op, Stage::Commit).await => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// `value` encoded for its record, within the call's limit, with the
    /// claim that will record it; a value that cannot be recorded gives the
    /// claim up first.
    async fn encode_or_abandon<V: Serialize>(
        &self,
        claimed: Claimed<B::Tx>,
        call: &Call,
        value: &V,
    ) -> Result<(Claimed<B::Tx>, Vec<u8>)> {
        match engine::encode(value, call.policy().max_record_bytes()) {
            Ok(payload) => Ok((claimed, payload)),
            Err(e) => {
                self.abandon(claimed).await;
                Err(e)
            }
        }
    }
}

pub(crate) fn status_label(status: RecordStatus) -> &'static str {
    match status {
        RecordStatus::Completed => "completed",
        RecordStatus::Rejected => "rejected",
        RecordStatus::Unknown => "unknown",
    }
}
