//! The trait stores of multi-step operations implement.

use crate::error::Result;
use crate::key::IdempotencyKey;
use crate::scope::Scope;
use crate::store::{BoxFuture, TxBackend};

use super::{MultiStep, MultiStepFilter};

/// A store of multi-step operations whose writes can join the transactions
/// of the backend `B`, so that a local step's writes, its recorded output
/// and its recovery point commit together, or none of them does.
///
/// Every write is made only over the version of the row its writer read
/// ([`MultiStep::version`]), and stores the next version: a write that
/// finds another version writes nothing and fails with
/// [`Error::Fenced`](crate::Error::Fenced). An operation is unique per
/// (scope, key).
pub trait MultiStepStore<B: TxBackend>: Clone + Send + Sync + 'static {
    /// Inserts a new operation (its `version` 0) inside `tx`: its id, or
    /// `None` when the scope and key already have one (committed, or
    /// inserted by a transaction that then commits).
    fn insert_in<'a>(&'a self, tx: &'a mut B::Tx, row: &'a MultiStep) -> BoxFuture<'a, Result<Option<i64>>>;

    /// Writes `row` over the stored one inside `tx`, if the stored version
    /// is still `row.version` (see the trait's contract).
    fn write_in<'a>(&'a self, tx: &'a mut B::Tx, row: &'a MultiStep) -> BoxFuture<'a, Result<()>>;

    /// [`write_in`](Self::write_in) in a transaction of its own.
    fn write<'a>(&'a self, row: &'a MultiStep) -> BoxFuture<'a, Result<()>>;

    /// The operation of (scope, key), as committed.
    fn find<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<MultiStep>>>;

    /// The operation `id`, as committed.
    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<MultiStep>>>;

    /// The ids of at most `limit` operations [due](MultiStep::is_due) at
    /// `now_ms`, the longest unchanged first.
    fn due(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<Vec<i64>>>;

    /// At most `filter.limit` operations matching `filter`, as committed,
    /// the longest unchanged first (by `updated_at_ms`, then id): an
    /// operator's view of where operations stand. A filter that
    /// [`check`](MultiStepFilter::check) refuses is
    /// [`Error::InvalidRequest`](crate::Error::InvalidRequest), and nothing
    /// is read.
    fn list<'a>(&'a self, filter: &'a MultiStepFilter) -> BoxFuture<'a, Result<Vec<MultiStep>>>;

    /// Deletes at most `limit` final operations (completed or compensated)
    /// whose `expires_at_ms` is at or before `now_ms`, the earliest expired
    /// first, and answers how many it deleted. An operation that is
    /// running, held or compensating is never deleted, whatever its times:
    /// only a final outcome expires (its row is never written again, so
    /// what was selected is what is deleted).
    ///
    /// What a purge means for a retry of the key: until its row is purged,
    /// an expired final operation is still there, and a retry still
    /// replays its recorded outcome (expiry alone changes nothing). Once
    /// purged, the key is unused: a call with it starts a new operation
    /// that runs every step again, as an idempotency key does after its
    /// TTL. Purge only what callers no longer retry: the engine's TTL
    /// (`idem_steps::StepsEngine::with_ttl_ms`, 24 h by default) is that
    /// promise.
    fn purge_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>>;
}
