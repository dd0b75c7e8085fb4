//! Where pending operations wait for their final answer.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;

use crate::{Error, Key, Operation, Result};

/// A boxed future, as the [`PendingStore`] methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The default bound on a stored body: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;
/// The default bound on the number of pending operations.
pub const DEFAULT_MAX_PENDING: usize = 10_000;

/// Keeps the operations sent but not yet answered with a final answer, so a
/// client that restarts sends them again with their original keys.
///
/// The [`Client`](crate::Client) calls [`save`](Self::save) before the first
/// byte of an operation is sent, [`remove`](Self::remove) once it got a
/// final answer, and [`list`](Self::list) in
/// [`resume`](crate::Client::resume).
pub trait PendingStore: Send + Sync + 'static {
    /// Keeps `op` until it is removed. The future completes only once `op`
    /// would survive a crash of this process (for a file: committed).
    /// Saving an operation that is already pending with the same key and
    /// the same request succeeds and keeps one copy; a different request
    /// under a pending key is [`Error::KeyInUse`]. A body over the store's
    /// bound is [`Error::InvalidOperation`]; a full store is
    /// [`Error::StoreFull`].
    fn save<'a>(&'a self, op: &'a Operation) -> BoxFuture<'a, Result<()>>;

    /// Forgets the operation named `key` (nothing if it is not pending).
    fn remove<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<()>>;

    /// Every pending operation, oldest saved first.
    fn list(&self) -> BoxFuture<'_, Result<Vec<Operation>>>;
}

/// What a pending store keeps at most: the body of an operation, and the
/// number of operations.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    pub(crate) max_body_bytes: usize,
    pub(crate) max_pending: usize,
}

impl Bounds {
    /// [`DEFAULT_MAX_BODY_BYTES`] and [`DEFAULT_MAX_PENDING`].
    pub(crate) const DEFAULT: Self = Self {
        max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        max_pending: DEFAULT_MAX_PENDING,
    };

    /// Refuses a body over `max_body_bytes`.
    pub(crate) fn check_body(&self, op: &Operation) -> Result<()> {
        let max_body_bytes = self.max_body_bytes;
        if op.body().len() > max_body_bytes {
            return Err(Error::InvalidOperation(format!(
                "the body is {} bytes long; the pending store keeps at most {max_body_bytes}",
                op.body().len()
            )));
        }
        Ok(())
    }

    /// The refusal of an operation by a store that holds `max_pending`.
    pub(crate) fn full(&self) -> Error {
        Error::StoreFull {
            max_pending: self.max_pending,
        }
    }
}

/// The builder methods of a pending store's [`Bounds`], its field `bounds`
/// (written inside the store's `impl` block).
macro_rules! bounds_setters {
    () => {
        $crate::store::bounds_setters!(
            /// Bounds the body of an operation kept.
            with_max_body_bytes sets max_body_bytes
        );
        $crate::store::bounds_setters!(
            /// Bounds the number of pending operations.
            with_max_pending sets max_pending
        );
    };
    ($(#[$doc:meta])* $setter:ident sets $bound:ident) => {
        $(#[$doc])*
        pub fn $setter(mut self, $bound: usize) -> Self {
            self.bounds.$bound = $bound;
            self
        }
    };
}
pub(crate) use bounds_setters;

/// Pending operations in memory: for tests, and for clients that only need
/// retries within one process (nothing survives a restart).
#[derive(Debug)]
pub struct MemoryPending {
    ops: Mutex<Pending>,
    bounds: Bounds,
}

#[derive(Debug, Default)]
struct Pending {
    next: u64,
    by_key: BTreeMap<Key, (u64, Operation)>,
}

impl Default for MemoryPending {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryPending {
    /// An empty store with the default bounds ([`DEFAULT_MAX_BODY_BYTES`],
    /// [`DEFAULT_MAX_PENDING`]).
    pub fn new() -> Self {
        Self {
            ops: Mutex::default(),
            bounds: Bounds::DEFAULT,
        }
    }

    bounds_setters!();

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        // A panic elsewhere cannot leave the map half-written: every
        // mutation is one call on it.
        self.ops.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl PendingStore for MemoryPending {
    fn save<'a>(&'a self, op: &'a Operation) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.bounds.check_body(op)?;
            let mut pending = self.lock();
            if let Some((_, existing)) = pending.by_key.get(op.key()) {
                return if existing == op {
                    Ok(())
                } else {
                    Err(Error::KeyInUse(op.key().clone()))
                };
            }
            if pending.by_key.len() >= self.bounds.max_pending {
                return Err(self.bounds.full());
            }
            let seq = pending.next;
            pending.next += 1;
            pending.by_key.insert(op.key().clone(), (seq, op.clone()));
            Ok(())
        })
    }

    fn remove<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.lock().by_key.remove(key);
            Ok(())
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<Operation>>> {
        Box::pin(async move {
            let pending = self.lock();
            let mut ops: Vec<&(u64, Operation)> = pending.by_key.values().collect();
            ops.sort_by_key(|(seq, _)| *seq);
            Ok(ops.into_iter().map(|(_, op)| op.clone()).collect())
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn op(url: &str) -> Operation {
        Operation::post(url).body("{}").build().unwrap()
    }

    /// The store contract, run on every implementation in this crate.
    pub(crate) async fn contract(store: &dyn PendingStore, max_body_bytes: usize, max_pending: usize) {
        assert!(store.list().await.unwrap().is_empty());
        let a = op("http://127.0.0.1:1/a");
        let b = op("http://127.0.0.1:1/b");
        store.save(&a).await.unwrap();
        store.save(&b).await.unwrap();
        // Saving the same operation again keeps one copy.
        store.save(&a).await.unwrap();
        assert_eq!(store.list().await.unwrap(), vec![a.clone(), b.clone()]);
        // Another request under a pending key is refused.
        let twin = Operation::post("http://127.0.0.1:1/other")
            .key(a.key().clone())
            .build()
            .unwrap();
        assert!(matches!(store.save(&twin).await, Err(Error::KeyInUse(k)) if &k == a.key()));
        // Bodies over the bound are refused and not kept.
        let big = Operation::post("http://127.0.0.1:1/big")
            .body(vec![b'x'; max_body_bytes + 1])
            .build()
            .unwrap();
        assert!(matches!(store.save(&big).await, Err(Error::InvalidOperation(_))));
        let exact = Operation::post("http://127.0.0.1:1/exact")
            .body(vec![b'x'; max_body_bytes])
            .build()
            .unwrap();
        store.save(&exact).await.unwrap();
        store.remove(exact.key()).await.unwrap();
        // Removal, also of a key that is not pending.
        store.remove(a.key()).await.unwrap();
        store.remove(a.key()).await.unwrap();
        assert_eq!(store.list().await.unwrap(), vec![b.clone()]);
        // The bound on the number of pending operations.
        for i in 1..max_pending {
            store.save(&op(&format!("http://127.0.0.1:1/{i}"))).await.unwrap();
        }
        assert!(matches!(
            store.save(&op("http://127.0.0.1:1/one-too-many")).await,
            Err(Error::StoreFull { max_pending: m }) if m == max_pending
        ));
        // The operation already pending may still be saved again.
        store.save(&b).await.unwrap();
        let listed = store.list().await.unwrap();
        assert_eq!(listed.len(), max_pending);
        assert_eq!(listed[0], b);
        for op in listed {
            store.remove(op.key()).await.unwrap();
        }
        assert!(store.list().await.unwrap().is_empty());
    }

    /// The in-memory store keeps the store contract.
    #[tokio::test]
    async fn memory_store_contract() {
        let store = MemoryPending::new().with_max_body_bytes(100).with_max_pending(5);
        contract(&store, 100, 5).await;
    }
}
