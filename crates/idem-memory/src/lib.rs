//! An in-memory store for idem, in transactional and lease mode.
//!
//! The guide, with examples: `docs/http.md` in the repository.
//!
//! Useful for tests and single-process tools; everything is lost when the
//! process exits. It passes the same conformance suite as the SQL stores.
//!
//! ```
//! use idem_core::{Call, Fingerprint, IdempotencyKey, Scope, TxEngine};
//! use idem_memory::MemoryStore;
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> idem_core::Result<()> {
//! let engine = TxEngine::new(MemoryStore::new());
//! let scope = Scope::parse("tenant", "send-email")?;
//! let call = Call::new(scope.clone(), IdempotencyKey::new("k1")?, Fingerprint::of_bytes(scope.operation(), b"hi"));
//! let first = engine.execute(&call, |_tx| Box::pin(async { Ok::<_, idem_core::Error>(42) })).await?;
//! let again = engine.execute(&call, |_tx| Box::pin(async { Ok::<_, idem_core::Error>(7) })).await?;
//! assert!(!first.is_replayed());
//! assert_eq!(again.into_inner(), 42); // replayed; the second closure never ran
//! # Ok(()) }
//! ```

mod deadletter;
mod multistep;

pub use deadletter::MemoryDeadLetters;
pub use multistep::MemoryMultiSteps;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::{
    BoxFuture, ClaimRequest, Error, Fingerprint, IdempotencyKey, KeyRegistry, Lease, LeaseClaim, LeaseStore, Record,
    Resolution, Result, STATUS_IN_PROGRESS, STATUS_SENT, STATUS_UNKNOWN, Scope, StoreErrorKind, StoredRow, Sweep,
    Token, TxBackend, TxClaim,
};

type Slot = (Scope, IdempotencyKey);

#[derive(Clone, Debug)]
struct Row {
    fingerprint: Fingerprint,
    status: i16,
    token: i64,
    payload: Option<Vec<u8>>,
    lease_expires_at_ms: Option<i64>,
    expires_at_ms: i64,
    sent_at_ms: Option<i64>,
}

impl Row {
    fn is_stale(&self, now_ms: i64) -> bool {
        idem_core::is_stale(self.status, self.lease_expires_at_ms, self.expires_at_ms, now_ms)
    }

    fn stored(&self) -> Result<StoredRow> {
        StoredRow::from_columns(
            self.fingerprint.as_bytes(),
            self.status,
            self.token,
            self.payload.clone(),
            self.lease_expires_at_ms,
            self.expires_at_ms,
        )
        .map(|row| row.with_sent_at_ms(self.sent_at_ms))
    }

    /// Whether it holds an unknown outcome at `now_ms`: recorded as
    /// unknown, or sent with its lease run out.
    fn is_unknown(&self, now_ms: i64) -> bool {
        self.status == STATUS_UNKNOWN
            || (self.status == STATUS_SENT && self.lease_expires_at_ms.is_some_and(|l| l <= now_ms))
    }

    fn fresh(req: &ClaimRequest<'_>, previous: Option<&Row>) -> Row {
        let token = req.token_over(previous.map(|p| p.token));
        Row {
            fingerprint: *req.fingerprint,
            status: STATUS_IN_PROGRESS,
            token,
            payload: None,
            lease_expires_at_ms: req.lease_expires_at_ms,
            expires_at_ms: req.expires_at_ms,
            sent_at_ms: None,
        }
    }
}

/// The in-memory store. Clones share the same data.
#[derive(Clone, Default)]
pub struct MemoryStore {
    rows: Arc<Mutex<HashMap<Slot, Row>>>,
    registry: KeyRegistry,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore").field("keys", &self.len()).finish()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many keys are stored (including expired ones not yet swept).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The stored row of a key, if any.
    pub fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<StoredRow>> {
        self.lock()
            .get(&(scope.clone(), key.clone()))
            .map(Row::stored)
            .transpose()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Slot, Row>> {
        self.rows.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A staged write that checks what it writes over, and writes nothing if
/// that fails.
type CheckedWrite = Box<dyn FnOnce() -> Result<()> + Send>;

/// A transaction of the in-memory store: the claim and any staged effects
/// apply together on commit and vanish on rollback or drop.
#[derive(Default)]
pub struct MemoryTx {
    pending: Option<(Slot, Row, Option<i64>)>,
    checked: Vec<CheckedWrite>,
    effects: Vec<Box<dyn FnOnce() + Send>>,
}

impl fmt::Debug for MemoryTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryTx")
            .field("effects", &self.effects.len())
            .finish_non_exhaustive()
    }
}

impl MemoryTx {
    /// Stages an effect that runs only if the transaction commits.
    pub fn on_commit(&mut self, effect: impl FnOnce() + Send + 'static) {
        self.effects.push(Box::new(effect));
    }

    /// Stages a write that checks, atomically, what it writes over, and
    /// writes nothing when that check fails: the commit then fails with its
    /// error, and neither the claim nor any effect is applied. Checked
    /// writes run first, in order, before the claim and the effects; keep
    /// one to a transaction, as a failure leaves the ones before it applied.
    pub fn on_commit_checked(&mut self, write: impl FnOnce() -> Result<()> + Send + 'static) {
        self.checked.push(Box::new(write));
    }
}

impl TxBackend for MemoryStore {
    type Tx = MemoryTx;

    fn begin(&self) -> BoxFuture<'_, Result<MemoryTx>> {
        Box::pin(async { Ok(MemoryTx::default()) })
    }

    fn claim<'a>(
        &'a self,
        tx: &'a mut MemoryTx,
        req: &'a ClaimRequest<'a>,
        _wait: Duration,
    ) -> BoxFuture<'a, Result<TxClaim>> {
        Box::pin(async move {
            // The engine holds this key in the registry, so no other
            // transactional claim of it runs until this one ends.
            let slot = (req.scope.clone(), req.key.clone());
            let rows = self.lock();
            match rows.get(&slot) {
                Some(row) if !row.is_stale(req.now_ms) => Ok(TxClaim::Found(row.stored()?)),
                previous => {
                    let seen_token = previous.map(|p| p.token);
                    let row = Row::fresh(req, previous);
                    tx.pending = Some((slot, row, seen_token));
                    Ok(TxClaim::Claimed)
                }
            }
        })
    }

    fn record<'a>(
        &'a self,
        tx: &'a mut MemoryTx,
        _req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let (_, row, _) = tx
                .pending
                .as_mut()
                .ok_or_else(|| Error::Config("record called on a transaction that holds no claim".into()))?;
            row.status = record.status.code();
            row.payload = Some(record.payload.clone());
            row.lease_expires_at_ms = None;
            Ok(())
        })
    }

    fn commit(&self, tx: MemoryTx) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let mut rows = self.lock();
            if let Some((slot, _, seen_token)) = &tx.pending {
                // A lease-mode claim may have slipped in since the claim was
                // read; never overwrite it.
                if rows.get(slot).map(|r| r.token) != *seen_token {
                    return Err(Error::store(
                        StoreErrorKind::Serialization,
                        "key was claimed concurrently",
                    ));
                }
            }
            for write in tx.checked {
                write()?;
            }
            if let Some((slot, row, _)) = tx.pending {
                rows.insert(slot, row);
            }
            for effect in tx.effects {
                effect();
            }
            Ok(())
        })
    }

    fn rollback(&self, _tx: MemoryTx) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    fn local_registry(&self) -> Option<&KeyRegistry> {
        Some(&self.registry)
    }

    fn read_committed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> Option<BoxFuture<'a, Result<Option<StoredRow>>>> {
        Some(Box::pin(async move { self.get(scope, key) }))
    }
}

impl LeaseStore for MemoryStore {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        Box::pin(async move {
            let slot = (req.scope.clone(), req.key.clone());
            let mut rows = self.lock();
            match rows.get(&slot) {
                Some(row) if !row.is_stale(req.now_ms) => Ok(LeaseClaim::Found(row.stored()?)),
                previous => {
                    let row = Row::fresh(req, previous);
                    let token = Token(row.token);
                    rows.insert(slot, row);
                    Ok(LeaseClaim::Acquired(token))
                }
            }
        })
    }

    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut rows = self.lock();
            let row = held(&mut rows, lease)?;
            row.status = record.status.code();
            row.payload = Some(record.payload.clone());
            row.lease_expires_at_ms = None;
            Ok(())
        })
    }

    fn mark_sent<'a>(&'a self, lease: &'a Lease, now_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut rows = self.lock();
            let row = held(&mut rows, lease)?;
            row.status = STATUS_SENT;
            row.sent_at_ms = Some(row.sent_at_ms.map_or(now_ms, |at| at.min(now_ms)));
            Ok(())
        })
    }

    fn lookup<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<StoredRow>>> {
        Box::pin(async move { self.get(scope, key) })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut rows = self.lock();
            held(&mut rows, lease)?;
            rows.remove(&(lease.scope.clone(), lease.key.clone()));
            Ok(())
        })
    }

    fn extend<'a>(&'a self, lease: &'a Lease, lease_expires_at_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut rows = self.lock();
            let row = held(&mut rows, lease)?;
            row.lease_expires_at_ms = Some(lease_expires_at_ms);
            row.expires_at_ms = row.expires_at_ms.max(lease_expires_at_ms);
            Ok(())
        })
    }

    fn resolve_unknown<'a>(&'a self, req: &'a Resolution<'a>) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let mut rows = self.lock();
            let slot = (req.scope.clone(), req.key.clone());
            let Some(row) = rows
                .get_mut(&slot)
                .filter(|r| r.is_unknown(req.now_ms) && r.expires_at_ms > req.now_ms)
            else {
                return Ok(false);
            };
            match req.record {
                Some(record) => {
                    row.status = record.status.code();
                    row.payload = Some(record.payload.clone());
                    row.lease_expires_at_ms = None;
                }
                None => {
                    rows.remove(&slot);
                }
            }
            Ok(true)
        })
    }
}

fn held<'r>(rows: &'r mut HashMap<Slot, Row>, lease: &Lease) -> Result<&'r mut Row> {
    match rows.get_mut(&(lease.scope.clone(), lease.key.clone())) {
        Some(row) if matches!(row.status, STATUS_IN_PROGRESS | STATUS_SENT) && row.token == lease.token.0 => Ok(row),
        _ => Err(Error::Fenced),
    }
}

impl Sweep for MemoryStore {
    fn sweep_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let mut rows = self.lock();
            let expired: Vec<Slot> = rows
                .iter()
                .filter(|(_, r)| r.expires_at_ms <= now_ms)
                .map(|(k, _)| k.clone())
                .take(limit as usize)
                .collect();
            for slot in &expired {
                rows.remove(slot);
            }
            Ok(expired.len() as u64)
        })
    }
}

impl idem_core::TimeSource for MemoryStore {
    /// The system clock: an in-memory store lives in one process.
    fn source_now_ms(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async { Ok(idem_core::Clock::now_ms(&idem_core::SystemClock)) })
    }
}
