//! The lease conformance suite against the local Redis
//! (`IDEM_TEST_REDIS_URL`, default `redis://127.0.0.1:6379`). Each test
//! gets its own key prefix; the transactional side (the suite's business
//! writes) is the in-memory store.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use idem_conformance::{Subject, lease_conformance};
use idem_core::{BoxError, BoxFuture};
use idem_memory::{MemoryStore, MemoryTx};
use idem_redis::RedisStore;

fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

#[derive(Clone)]
struct Redis {
    memory: MemoryStore,
    store: RedisStore,
}

impl Redis {
    async fn connect() -> Self {
        let url = redis_url();
        let store = RedisStore::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("cannot reach Redis at {url} (set IDEM_TEST_REDIS_URL): {e}"));
        let prefix = format!("idemtest:{}", uuid::Uuid::now_v7().simple());
        Self {
            memory: MemoryStore::default(),
            store: store.with_prefix(&prefix).unwrap(),
        }
    }
}

static EFFECTS: LazyLock<Arc<Mutex<HashMap<String, u64>>>> = LazyLock::new(Default::default);

impl Subject for Redis {
    type Backend = MemoryStore;
    type Lease = RedisStore;
    type Sweeper = RedisStore;

    fn backend(&self) -> MemoryStore {
        self.memory.clone()
    }
    fn lease_store(&self) -> RedisStore {
        self.store.clone()
    }
    fn sweeper(&self) -> RedisStore {
        self.store.clone()
    }
    fn write_effect<'c>(tx: &'c mut MemoryTx, effect_id: String) -> BoxFuture<'c, Result<(), BoxError>> {
        Box::pin(async move {
            let effects = EFFECTS.clone();
            tx.on_commit(move || *effects.lock().unwrap().entry(effect_id).or_default() += 1);
            Ok(())
        })
    }
    fn count_effects(&self, effect_id: String) -> BoxFuture<'_, Result<u64, BoxError>> {
        Box::pin(async move { Ok(EFFECTS.lock().unwrap().get(&effect_id).copied().unwrap_or(0)) })
    }
    fn another(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            // Its own connection, the same keys.
            let other = Redis::connect().await;
            Self {
                memory: self.memory.clone(),
                store: other.store.with_prefix(self.store.prefix()).unwrap(),
            }
        })
    }
    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(Redis::connect())
    }
}

lease_conformance!(redis_lease, Redis::connect());

/// A prefix that could break out of the key layout (a hash tag, spaces)
/// is refused.
#[tokio::test]
async fn prefixes_are_validated() {
    let store = Redis::connect().await.store;
    for bad in ["", "a{b}", "with space", &"x".repeat(65)] {
        assert!(store.clone().with_prefix(bad).is_err(), "{bad:?}");
    }
    assert!(store.with_prefix("orders:v2").is_ok());
}

/// Tokens past 2^53 are compared and incremented exactly (Lua's numbers
/// are doubles; the scripts work on decimal strings).
#[tokio::test]
async fn tokens_past_two_to_the_53_stay_exact() {
    use idem_core::{ClaimRequest, Fingerprint, IdempotencyKey, LeaseClaim, LeaseStore, Scope, Token};
    let store = Redis::connect().await.store;
    let scope = Scope::parse("t", "op").unwrap();
    let key = IdempotencyKey::generate();
    let fingerprint = Fingerprint::of_json(scope.operation(), b"{}").unwrap();
    let claim = |now_ms: i64, fresh: i64| ClaimRequest {
        scope: &scope,
        key: &key,
        fingerprint: &fingerprint,
        now_ms,
        expires_at_ms: now_ms + 60_000,
        fresh_token: Token(fresh),
        lease_expires_at_ms: Some(now_ms + 1_000),
    };
    let big = i64::MAX - 10;
    let first = store.try_claim(&claim(1_000, big)).await.unwrap();
    assert_eq!(first, LeaseClaim::Acquired(Token(big)));
    // The lease ran out; a claimer with a small fresh token takes over with
    // exactly the old token plus one.
    let second = store.try_claim(&claim(5_000, 7)).await.unwrap();
    assert_eq!(second, LeaseClaim::Acquired(Token(big + 1)));
}

/// Claims are indexed off their path: once `flush_index` returns, every
/// claim made through the store (more than its queue holds, from many tasks
/// at once) is in the expiry index, for this store and for another
/// connection on the same prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_reach_the_expiry_index_once_flushed() {
    use idem_core::{ClaimRequest, Fingerprint, IdempotencyKey, LeaseClaim, LeaseStore, Scope, Token};
    let store = Redis::connect().await.store;
    let scope = Scope::parse("t", "op").unwrap();
    let fingerprint = Fingerprint::of_json(scope.operation(), b"{}").unwrap();
    let now_ms = 1_000_000;
    let claims: u64 = 5_000;
    let tasks: Vec<_> = (0..claims)
        .map(|_| {
            let (store, scope) = (store.clone(), scope.clone());
            tokio::spawn(async move {
                let key = IdempotencyKey::generate();
                let req = ClaimRequest {
                    scope: &scope,
                    key: &key,
                    fingerprint: &fingerprint,
                    now_ms,
                    expires_at_ms: now_ms + 60_000,
                    fresh_token: Token::fresh(now_ms),
                    lease_expires_at_ms: Some(now_ms + 30_000),
                };
                let claimed = store.try_claim(&req).await.unwrap();
                assert!(matches!(claimed, LeaseClaim::Acquired(_)), "{claimed:?}");
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    store.flush_index().await;
    let other = RedisStore::connect(&redis_url())
        .await
        .unwrap()
        .with_prefix(store.prefix())
        .unwrap();
    let seen = other.stats(now_ms).await.unwrap();
    assert_eq!(seen.in_progress, claims, "{seen:?}");
    let own = store.stats(now_ms).await.unwrap();
    assert_eq!(own.in_progress, claims, "{own:?}");
}
