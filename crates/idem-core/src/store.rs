//! The traits stores implement. Engines in this crate hold all the policy;
//! stores only read and write rows atomically.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::error::Result;
use crate::key::IdempotencyKey;
use crate::record::{ClaimRequest, Lease, Record, Resolution, StoredRow, Token};
use crate::registry::KeyRegistry;
use crate::scope::Scope;
use crate::sweep::{KeyFilter, KeyInfo, KeyStats};

/// A boxed, sendable future (stores are used behind `dyn` as well as generically).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The answer of a transactional claim attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxClaim {
    /// This transaction now holds the key; it is visible to nobody else until
    /// commit.
    Claimed,
    /// The key is held by a committed row (a recorded outcome or a live lease).
    Found(StoredRow),
    /// A concurrent transaction holds the key and did not finish within the
    /// attempt's wait.
    Busy,
}

/// The answer of a claim that read the key's committed row first
/// ([`TxBackend::read_then_claim`]).
#[derive(Debug)]
pub enum ReadFirst<Tx> {
    /// The row read holds a recorded outcome that has not expired
    /// ([`StoredRow::is_recorded_at`]): nothing was opened or claimed.
    Recorded(StoredRow),
    /// Anything else: the transaction opened and the claim's answer, as
    /// [`begin_claim`](TxBackend::begin_claim) answers them.
    Claim(Tx, TxClaim),
}

/// A store that can claim a key inside a database transaction, so the claim,
/// the caller's writes and the recorded outcome commit together.
///
/// Contract for [`claim`](Self::claim): inside `tx`, if no row exists for the
/// (scope, key), or the row is stale (its `expires_at_ms <= now_ms`, or it is
/// an in-progress lease whose `lease_expires_at_ms <= now_ms`), write an
/// in-progress row with `fresh_token` (on a takeover, the larger of it and the
/// old token plus one) and answer `Claimed`. Otherwise answer `Found` with the
/// committed row. A concurrent uncommitted claim of the same key may be
/// waited for up to `wait`; if it is still undecided then, answer `Busy`.
pub trait TxBackend: Send + Sync + 'static {
    /// The open transaction handed to the caller's work.
    type Tx: Send + 'static;

    /// Opens a transaction.
    fn begin(&self) -> BoxFuture<'_, Result<Self::Tx>>;

    /// Claims the key inside `tx` (see the trait's contract).
    fn claim<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<TxClaim>>;

    /// Records the outcome on the row claimed in `tx`.
    fn record<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>>;

    /// Commits `tx`.
    fn commit(&self, tx: Self::Tx) -> BoxFuture<'_, Result<()>>;

    /// Rolls `tx` back.
    fn rollback(&self, tx: Self::Tx) -> BoxFuture<'_, Result<()>>;

    /// Opens a transaction and claims the key in it (see
    /// [`claim`](Self::claim)). Whatever the answer, the transaction is
    /// returned open: the engine keeps it on `Claimed` and rolls it back
    /// otherwise. On an error the store has already ended the transaction.
    ///
    /// The default runs [`begin`](Self::begin) then [`claim`](Self::claim);
    /// a store whose driver can send several statements at once overrides it
    /// to open the transaction and claim in one round trip.
    fn begin_claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<(Self::Tx, TxClaim)>> {
        Box::pin(async move {
            let mut tx = self.begin().await?;
            match self.claim(&mut tx, req, wait).await {
                Ok(answer) => Ok((tx, answer)),
                Err(e) => {
                    if let Err(rollback) = self.rollback(tx).await {
                        tracing::debug!(error = %rollback, "rollback after a failed claim failed");
                    }
                    Err(e)
                }
            }
        })
    }

    /// Records the outcome on the row claimed in `tx` and commits `tx`: the
    /// caller's writes, the claim and the outcome become durable together, or
    /// (on any error) nothing does and the transaction is ended.
    ///
    /// The default runs [`record`](Self::record) then [`commit`](Self::commit);
    /// a store whose driver can send several statements at once overrides it
    /// to record and commit in one round trip.
    fn record_commit<'a>(
        &'a self,
        mut tx: Self::Tx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if let Err(e) = self.record(&mut tx, req, record).await {
                if let Err(rollback) = self.rollback(tx).await {
                    tracing::debug!(error = %rollback, "rollback after a failed record failed");
                }
                return Err(e);
            }
            self.commit(tx).await
        })
    }

    /// Reads the key's committed row as it is (expired or not), with one
    /// statement outside any transaction, for an engine that reads before it
    /// claims ([`TxEngine::with_read_first`](crate::TxEngine::with_read_first)).
    /// It sees only what has committed, takes no lock and writes nothing.
    ///
    /// `None` where the store has no such read: the default. A store that
    /// has one and overrides [`read_then_claim`](Self::read_then_claim)
    /// still implements it.
    fn read_committed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> Option<BoxFuture<'a, Result<Option<StoredRow>>>> {
        let _ = (scope, key);
        None
    }

    /// Reads the key's committed row outside any transaction and answers it
    /// if it holds a recorded outcome that has not expired at the request's
    /// time; otherwise opens a transaction and claims the key, as
    /// [`begin_claim`](Self::begin_claim) does.
    ///
    /// The default runs [`read_committed`](Self::read_committed) (failing
    /// with [`Error::Config`](crate::Error::Config) where there is none),
    /// then `begin_claim`; the PostgreSQL and MySQL stores override it to
    /// read and claim on one connection of their pool. An engine whose store
    /// has a [`local_registry`](Self::local_registry) does not call it: it
    /// reads with `read_committed` before taking the key's place there.
    fn read_then_claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<ReadFirst<Self::Tx>>> {
        Box::pin(async move {
            let Some(read) = self.read_committed(req.scope, req.key) else {
                return Err(crate::Error::Config(crate::tx::NO_READ.into()));
            };
            if let Some(row) = read.await?
                && row.is_recorded_at(req.now_ms)
            {
                return Ok(ReadFirst::Recorded(row));
            }
            let (tx, claim) = self.begin_claim(req, wait).await?;
            Ok(ReadFirst::Claim(tx, claim))
        })
    }

    /// A registry that serialises claims of one key before they reach the
    /// database, for engines whose database lock is not per key (SQLite's
    /// single writer): in this process, and with a
    /// [`SharedKeyLock`](crate::SharedKeyLock) also across processes. The
    /// key is held until the claim's transaction commits or rolls back, and
    /// it is taken before [`begin`](Self::begin), so no database lock is held
    /// while waiting for it. `None` by default.
    fn local_registry(&self) -> Option<&KeyRegistry> {
        None
    }
}

/// The answer of a lease-mode claim attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseClaim {
    /// The claim committed as in-progress with this token.
    Acquired(Token),
    /// The key is held by a committed row (a recorded outcome or a live lease).
    Found(StoredRow),
}

/// A store for lease mode (check–claim–complete), for effects outside the
/// database: the claim commits at once as in-progress with a lease and a
/// fencing token.
///
/// `try_claim` follows the same staleness rule as [`TxBackend::claim`] but
/// commits before answering, and never waits on other claimers.
/// `complete`, `release`, `extend` and `mark_sent` succeed only if the row
/// is still in progress (status [`STATUS_IN_PROGRESS`](crate::STATUS_IN_PROGRESS)
/// or [`STATUS_SENT`](crate::STATUS_SENT)) with `lease.token`, whether or
/// not its lease has run out; otherwise they fail with
/// [`Error::Fenced`](crate::Error::Fenced) and change nothing.
///
/// **Sent claims.** A row marked sent ([`mark_sent`](Self::mark_sent)) is
/// never stale while the key lives: a claim whose lease ran out is taken
/// over only if it was never marked. Its lease's end makes it an unknown
/// outcome instead ([`StoredRow::is_unknown_at`]), which
/// [`resolve_unknown`](Self::resolve_unknown) settles like one recorded as
/// unknown, and which its holder may still complete with its token.
/// Completing keeps the mark's time (`sent_at_ms`).
pub trait LeaseStore: Send + Sync + 'static {
    /// Claims the key with a lease.
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>>;

    /// Marks a held lease as sent, durably, before anything leaves the
    /// holder's process: from now on its request may reach the other side.
    /// Sets the row's status to [`STATUS_SENT`](crate::STATUS_SENT) and its
    /// `sent_at_ms` to `now_ms` unless it holds an earlier time (the
    /// earliest reach only moves earlier). Fails with
    /// [`Error::Fenced`](crate::Error::Fenced) if the lease is no longer
    /// current.
    fn mark_sent<'a>(&'a self, lease: &'a Lease, now_ms: i64) -> BoxFuture<'a, Result<()>>;

    /// Reads the key's row as it is, expired or not, with its
    /// [`sent_at_ms`](StoredRow::sent_at_ms).
    fn lookup<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<StoredRow>>>;

    /// Records the outcome of a held lease.
    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> BoxFuture<'a, Result<()>>;

    /// Gives the key back unused.
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<()>>;

    /// Moves a held lease's expiry to `lease_expires_at_ms`.
    fn extend<'a>(&'a self, lease: &'a Lease, lease_expires_at_ms: i64) -> BoxFuture<'a, Result<()>>;

    /// Resolves the unknown outcome of `req.key` in `req.scope` (a row whose
    /// status is [`STATUS_UNKNOWN`](crate::STATUS_UNKNOWN), recorded by
    /// [`complete`](Self::complete) with an unknown [`Record`]): with
    /// `Some(record)`, records it as the key's outcome (expiry unchanged);
    /// with `None`, deletes the row so the next claim runs the work.
    ///
    /// Only a row that still holds an unknown outcome at `req.now_ms`
    /// (status unknown, or sent with its lease run out) and has not expired
    /// is changed, in one atomic step; anything else (no row, a live claim,
    /// a recorded outcome) is left alone and the answer is `false`.
    fn resolve_unknown<'a>(&'a self, req: &'a Resolution<'a>) -> BoxFuture<'a, Result<bool>>;
}

/// A store whose expired rows can be deleted in bounded batches.
pub trait Sweep: Send + Sync + 'static {
    /// Deletes at most `limit` rows whose `expires_at_ms <= now_ms` and
    /// answers how many it deleted.
    fn sweep_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>>;

    /// Runs one batch of at most `limit` and says what it did
    /// ([`sweep_expired`](crate::sweep_expired) runs these).
    ///
    /// The default runs [`sweep_expired`](Self::sweep_expired): every row
    /// the batch took up was deleted. A store whose sweep walks an index
    /// kept apart from its rows (Redis, whose rows also expire on their own)
    /// overrides it, so that index entries whose row is already gone count
    /// as work done rather than as the end of the sweep.
    fn sweep_batch(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<SweepBatch>> {
        Box::pin(async move {
            let deleted = self.sweep_expired(now_ms, limit).await?;
            Ok(SweepBatch {
                deleted,
                ghosts: 0,
                examined: deleted,
            })
        })
    }
}

/// What one batch of a sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepBatch {
    /// Expired rows deleted.
    pub deleted: u64,
    /// Index entries removed whose row the store had already deleted by
    /// itself (Redis expires rows by their TTL): no row was deleted for
    /// them, and they are not keys.
    pub ghosts: u64,
    /// Rows and index entries the batch took up, at most its limit: a batch
    /// that took up fewer than its limit found nothing more to do.
    pub examined: u64,
}

/// The operator's view of a keys table (the `idem` CLI's `stats` and `keys`
/// commands): counts, listings and purges, at a time the caller reads from
/// the store's clock.
///
/// Every method reads or deletes rows of one keys table (or, on Redis, one
/// key prefix) and nothing else.
pub trait KeyAdmin: Send + Sync + 'static {
    /// How many keys the table holds, by state, at `now_ms`.
    fn stats(&self, now_ms: i64) -> BoxFuture<'_, Result<KeyStats>>;

    /// Keys matching `filter` at `now_ms`, oldest first, at most `limit`.
    fn list_keys<'a>(&'a self, filter: &'a KeyFilter, now_ms: i64, limit: u32) -> BoxFuture<'a, Result<Vec<KeyInfo>>>;

    /// The key `key` of `scope`, looked up by its exact value (expired or
    /// not, until it is swept); `None` if the store holds no such key.
    fn find_key<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<Option<KeyInfo>>>;

    /// Deletes at most `limit` keys that match `filter` at `now_ms`, and
    /// answers how many it deleted.
    ///
    /// A key is deleted only if it still matches `filter` when it is
    /// deleted: a key claimed again since it was selected (an expired key
    /// taken over, now in progress) is left alone, so a purge never deletes
    /// a live claim it was not asked to delete.
    fn purge_keys<'a>(&'a self, filter: &'a KeyFilter, now_ms: i64, limit: u32) -> BoxFuture<'a, Result<u64>>;
}
