//! A resolution of an unknown outcome that the store refused for contention
//! (on a cluster, a twin's resolution certified first on another node)
//! changed nothing and runs again: the caller gets the store's real answer,
//! never the contention.

use std::sync::atomic::{AtomicU32, Ordering};

use idem_core::{
    Acquire, BoxFuture, Call, ClaimRequest, Error, Fingerprint, IdempotencyKey, Lease, LeaseClaim, LeaseEngine,
    LeaseStore, Record, Resolution, Result, Scope, StoreErrorKind, StoredRow,
};
use idem_memory::MemoryStore;

/// The memory store, refusing its first `refusals` resolutions as a
/// deadlock victim (nothing changed).
struct Contended {
    inner: MemoryStore,
    refusals: AtomicU32,
    resolutions: AtomicU32,
}

impl LeaseStore for Contended {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        self.inner.try_claim(req)
    }
    fn mark_sent<'a>(&'a self, lease: &'a Lease, now_ms: i64) -> BoxFuture<'a, Result<()>> {
        self.inner.mark_sent(lease, now_ms)
    }
    fn lookup<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<StoredRow>>> {
        self.inner.lookup(scope, key)
    }
    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> BoxFuture<'a, Result<()>> {
        self.inner.complete(lease, record)
    }
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<()>> {
        self.inner.release(lease)
    }
    fn extend<'a>(&'a self, lease: &'a Lease, lease_expires_at_ms: i64) -> BoxFuture<'a, Result<()>> {
        self.inner.extend(lease, lease_expires_at_ms)
    }
    fn resolve_unknown<'a>(&'a self, req: &'a Resolution<'a>) -> BoxFuture<'a, Result<bool>> {
        self.resolutions.fetch_add(1, Ordering::SeqCst);
        if self
            .refusals
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Box::pin(async {
                Err(Error::store(
                    StoreErrorKind::Deadlock,
                    "deadlock found when trying to get lock; try restarting transaction",
                ))
            });
        }
        self.inner.resolve_unknown(req)
    }
}

#[tokio::test]
async fn a_resolution_refused_for_contention_runs_again() {
    let engine = LeaseEngine::new(Contended {
        inner: MemoryStore::default(),
        refusals: AtomicU32::new(2),
        resolutions: AtomicU32::new(0),
    });
    let scope = Scope::parse("tenant", "payout").unwrap();
    let key = IdempotencyKey::generate();
    let call = Call::new(
        scope.clone(),
        key.clone(),
        Fingerprint::of_json(scope.operation(), b"{}").unwrap(),
    );
    let Acquire::Claimed(lease) = engine.acquire(&call).await.unwrap() else {
        panic!("a fresh key is claimed");
    };
    engine.mark_unknown(&lease, b"timed out".to_vec()).await.unwrap();

    let applied = Record::completed(b"paid".to_vec());
    assert!(
        engine.resolve_unknown(&scope, &key, Some(&applied)).await.unwrap(),
        "the third try takes"
    );
    assert_eq!(engine.store().resolutions.load(Ordering::SeqCst), 3);
    match engine.acquire(&call).await.unwrap() {
        Acquire::Replay(record) => assert_eq!(record.payload, b"paid"),
        other => panic!("the resolution is the key's outcome: {other:?}"),
    }
    // Nothing left to resolve: the store's own answer, `false`.
    assert!(!engine.resolve_unknown(&scope, &key, None).await.unwrap());
}

#[tokio::test]
async fn contention_past_the_budget_is_answered() {
    let engine = LeaseEngine::new(Contended {
        inner: MemoryStore::default(),
        refusals: AtomicU32::new(u32::MAX),
        resolutions: AtomicU32::new(0),
    });
    let scope = Scope::parse("tenant", "payout").unwrap();
    let key = IdempotencyKey::generate();
    let err = engine.resolve_unknown(&scope, &key, None).await.unwrap_err();
    assert_eq!(err.store_kind(), Some(StoreErrorKind::Deadlock));
    assert_eq!(
        engine.store().resolutions.load(Ordering::SeqCst),
        idem_core::ContentionRetries::MAX_RUNS
    );
}
