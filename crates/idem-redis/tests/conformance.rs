//! The lease conformance suite against the local Redis
//! (`IDEM_TEST_REDIS_URL`, default `redis://127.0.0.1:6379`). Each test
//! gets its own key prefix; the transactional side (the suite's business
//! writes) is the in-memory store.

#[path = "support/subject.rs"]
mod subject;

use idem_conformance::env::redis_url;
use idem_conformance::{admin_conformance, lease_conformance};
use idem_core::BoxFuture;
use idem_redis::RedisStore;
use redis::aio::ConnectionManager;
use subject::{Reach, RedisSubject};

/// The local Redis, through a connection manager.
type Redis = RedisSubject<ConnectionManager>;

impl Reach for ConnectionManager {
    fn open() -> BoxFuture<'static, RedisStore<Self>> {
        Box::pin(async {
            let url = redis_url();
            RedisStore::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("cannot reach Redis at {url} (set IDEM_TEST_REDIS_URL): {e}"))
        })
    }
}

lease_conformance!(redis_lease, Redis::connect(None));
admin_conformance!(redis_admin, Redis::connect(None));

/// A prefix that could break out of the key layout (a hash tag, spaces)
/// is refused.
#[tokio::test]
async fn prefixes_are_validated() {
    let store = Redis::connect(None).await.store;
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
    let store = Redis::connect(None).await.store;
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
    use idem_core::{ClaimRequest, Fingerprint, IdempotencyKey, KeyAdmin, LeaseClaim, LeaseStore, Scope, Token};
    let store = Redis::connect(None).await.store;
    let scope = Scope::parse("t", "op").unwrap();
    let fingerprint = Fingerprint::of_json(scope.operation(), b"{}").unwrap();
    let now_ms = idem_core::Clock::now_ms(&idem_core::SystemClock);
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

/// A claim on `store` of a fresh key at `now_ms` that Redis keeps for `ttl_ms`.
async fn claim_for(store: &RedisStore, now_ms: i64, ttl_ms: i64) -> idem_core::Lease {
    use idem_core::{ClaimRequest, Fingerprint, IdempotencyKey, LeaseClaim, LeaseStore, Scope, Token};
    let scope = Scope::parse("t", "op").unwrap();
    let key = IdempotencyKey::generate();
    let fingerprint = Fingerprint::of_json(scope.operation(), b"{}").unwrap();
    let req = ClaimRequest {
        scope: &scope,
        key: &key,
        fingerprint: &fingerprint,
        now_ms,
        expires_at_ms: now_ms + ttl_ms,
        fresh_token: Token::fresh(now_ms),
        lease_expires_at_ms: Some(now_ms + ttl_ms),
    };
    match store.try_claim(&req).await.unwrap() {
        LeaseClaim::Acquired(token) => idem_core::Lease {
            scope,
            key,
            token,
            lease_expires_at_ms: now_ms + ttl_ms,
        },
        other => panic!("a fresh key: {other:?}"),
    }
}

async fn index_len(store: &RedisStore) -> u64 {
    let url = redis_url();
    let mut conn = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("ZCARD")
        .arg(format!("{}:expiry", store.prefix()))
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// Rows Redis expired by their TTL leave ghost entries in the expiry index:
/// `stats` does not count them, and a sweep removes them all, batch after
/// batch, counting them apart from deleted rows, until the index holds the
/// live rows only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ghost_entries_are_swept_and_never_counted() {
    use idem_core::{KeyAdmin, SweepOptions, SystemClock};
    let store = Redis::connect(None).await.store;
    let now = idem_core::Clock::now_ms(&SystemClock);
    for _ in 0..30 {
        claim_for(&store, now, 50).await;
    }
    for _ in 0..5 {
        claim_for(&store, now, 60_000).await;
    }
    store.flush_index().await;
    assert_eq!(index_len(&store).await, 35);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let later = idem_core::Clock::now_ms(&SystemClock);
    let stats = store.stats(later).await.unwrap();
    assert_eq!((stats.in_progress, stats.expired), (5, 0), "{stats:?}");
    let options = SweepOptions {
        batch_size: 7,
        pause: std::time::Duration::ZERO,
        busy_percent: 100,
        max_batches: None,
    };
    let report = idem_core::sweep_expired(&store, &SystemClock, options).await.unwrap();
    assert_eq!(
        (report.deleted, report.ghosts, report.batches),
        (0, 30, 5),
        "{report:?}"
    );
    assert_eq!(index_len(&store).await, 5, "the index holds the live rows only");
}

/// An extension past the key's TTL keeps the row in Redis (its TTL moves
/// with the lease) and moves its index entry to the new expiry, so the
/// sweeper neither deletes it nor keeps meeting it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extension_moves_the_ttl_and_the_index_entry() {
    use idem_core::{KeyAdmin, LeaseStore, Sweep, SystemClock};
    let store = Redis::connect(None).await.store;
    let now = idem_core::Clock::now_ms(&SystemClock);
    let lease = claim_for(&store, now, 200).await;
    store.extend(&lease, now + 60_000).await.unwrap();
    store.flush_index().await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let later = idem_core::Clock::now_ms(&SystemClock);
    let found = store.find_key(&lease.scope, &lease.key, later).await.unwrap();
    assert_eq!(
        found.map(|k| (k.state, k.expires_at_ms)),
        Some((idem_core::KeyState::InProgress, now + 60_000)),
        "the row outlived its first TTL with the lease"
    );
    let batch = store.sweep_batch(later, 100).await.unwrap();
    assert_eq!(batch.examined, 0, "its index entry moved to the new expiry: {batch:?}");
    // A shorter extension never shortens the key.
    store.extend(&lease, later + 1_000).await.unwrap();
    let found = store.find_key(&lease.scope, &lease.key, later).await.unwrap().unwrap();
    assert_eq!(found.expires_at_ms, now + 60_000);
}

/// A purge by the state `sent` deletes the claims marked sent, and neither
/// a claim still in progress nor a sent claim claimed again meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_by_sent_state_deletes_sent_claims_only() {
    use idem_core::{KeyAdmin, KeyFilter, KeyState, LeaseStore, SystemClock};
    let store = Redis::connect(None).await.store;
    let now = idem_core::Clock::now_ms(&SystemClock);
    let sent = claim_for(&store, now, 60_000).await;
    let running = claim_for(&store, now, 60_000).await;
    store.mark_sent(&sent, now).await.unwrap();
    store.flush_index().await;
    let filter = KeyFilter {
        state: Some(KeyState::Sent),
        ..KeyFilter::default()
    };
    assert_eq!(store.purge_keys(&filter, now, 100).await.unwrap(), 1);
    assert_eq!(store.lookup(&sent.scope, &sent.key).await.unwrap(), None);
    let left = store.lookup(&running.scope, &running.key).await.unwrap().unwrap();
    assert_eq!(left.sent_at_ms, None, "{left:?}");
    let stats = store.stats(now).await.unwrap();
    assert_eq!((stats.in_progress, stats.sent), (1, 0), "{stats:?}");
}
