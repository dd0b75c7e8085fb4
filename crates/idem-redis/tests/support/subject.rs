//! The subject of the lease and operator suites against Redis, one server
//! or a cluster: the lease side is a Redis store on a key prefix of its
//! own, the transactional side (the suites' business writes) is the
//! in-memory store.

use idem_conformance::Subject;
use idem_core::BoxFuture;
use idem_memory::MemoryStore;
use idem_redis::RedisStore;
use redis::aio::ConnectionLike;

/// The business writes, shared with the in-memory store's conformance tests.
#[macro_use]
#[path = "../../../idem-memory/tests/support/effects.rs"]
mod effects;

/// A Redis deployment the tests reach through connections of type `Self`.
pub(crate) trait Reach: ConnectionLike + Clone + Send + Sync + 'static {
    /// A store on a connection of its own (on the default prefix).
    fn open() -> BoxFuture<'static, RedisStore<Self>>;
}

/// A store under test: memory for the transactional side, Redis for leases.
#[derive(Clone)]
pub(crate) struct RedisSubject<C> {
    pub(crate) memory: MemoryStore,
    pub(crate) store: RedisStore<C>,
}

impl<C: Reach> RedisSubject<C> {
    /// A subject on its own connection, on `prefix` or else a fresh one.
    pub(crate) async fn connect(prefix: Option<&str>) -> Self {
        let store = C::open().await;
        let prefix = prefix
            .map(str::to_owned)
            .unwrap_or_else(|| format!("idemtest:{}", uuid::Uuid::now_v7().simple()));
        Self {
            memory: MemoryStore::default(),
            store: store.with_prefix(&prefix).unwrap(),
        }
    }
}

impl<C: Reach> Subject for RedisSubject<C> {
    type Backend = MemoryStore;
    type Lease = RedisStore<C>;
    type Sweeper = RedisStore<C>;

    fn backend(&self) -> MemoryStore {
        self.memory.clone()
    }
    fn lease_store(&self) -> Self::Lease {
        self.store.clone()
    }
    fn sweeper(&self) -> Self::Sweeper {
        self.store.clone()
    }
    memory_effects!();
    fn another(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            // Its own connection, the same keys.
            let other = Self::connect(Some(self.store.prefix())).await;
            Self {
                memory: self.memory.clone(),
                store: other.store,
            }
        })
    }
    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(Self::connect(None))
    }
}
