//! A registry of keys being claimed, for stores whose database lock is not
//! per key: in-process, optionally joined by a lock shared between
//! processes ([`SharedKeyLock`]).

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::error::Result;
use crate::key::IdempotencyKey;
use crate::scope::Scope;

/// Holds a key in a [`SharedKeyLock`] until dropped.
pub type SharedKeyGuard = Box<dyn Any + Send + Sync>;

/// A per-key lock shared with other processes (for SQLite, a byte-range lock
/// on a side file). It only has to exclude other processes: the
/// [`KeyRegistry`] that uses it serialises the key inside this process
/// first, and only then takes the shared lock.
pub trait SharedKeyLock: Send + Sync + 'static {
    /// Takes the key without waiting. Answers `None` if another process
    /// holds it. Must not block: the registry calls it on the async runtime
    /// and polls it with short pauses until its deadline.
    fn try_lock(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<SharedKeyGuard>>;
}

/// The first pause between two attempts at a [`SharedKeyLock`].
const SHARED_FIRST_PAUSE: Duration = Duration::from_millis(1);
/// The longest pause between two attempts at a [`SharedKeyLock`].
const SHARED_MAX_PAUSE: Duration = Duration::from_millis(20);

type Slot = (Scope, IdempotencyKey);

/// Serialises claims of one (scope, key) inside one process. SQLite has a
/// single writer for the whole database, so without this a twin could only
/// ever wait for the global write lock; with it, a twin waits for (or is
/// rejected by) exactly the claim of its own key, as on the other engines.
/// Clones share the same registry.
///
/// With a [`SharedKeyLock`] ([`with_shared_lock`](Self::with_shared_lock)),
/// a key is also held against other processes for as long as the
/// [`RegistryGuard`] lives.
#[derive(Clone, Default)]
pub struct KeyRegistry {
    slots: Arc<Mutex<HashMap<Slot, Arc<Notify>>>>,
    shared: Option<Arc<dyn SharedKeyLock>>,
}

impl fmt::Debug for KeyRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.slots.lock().unwrap_or_else(PoisonError::into_inner).len();
        f.debug_struct("KeyRegistry")
            .field("held", &n)
            .field("shared_lock", &self.shared.is_some())
            .finish()
    }
}

/// Holds a key in a [`KeyRegistry`] until dropped.
#[must_use = "the key is held only while the guard lives"]
pub struct RegistryGuard {
    slots: Arc<Mutex<HashMap<Slot, Arc<Notify>>>>,
    slot: Option<Slot>,
    shared: Option<SharedKeyGuard>,
}

impl fmt::Debug for RegistryGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryGuard").finish_non_exhaustive()
    }
}

impl Drop for RegistryGuard {
    fn drop(&mut self) {
        // Other processes may take the key once this process lets go of it,
        // and before a twin in this process does.
        drop(self.shared.take());
        if let Some(slot) = self.slot.take() {
            let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(notify) = slots.remove(&slot) {
                notify.notify_waiters();
            }
        }
    }
}

impl KeyRegistry {
    /// A new, empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also holds every key in `lock`, shared with other processes, for as
    /// long as its [`RegistryGuard`] lives.
    pub fn with_shared_lock(mut self, lock: Arc<dyn SharedKeyLock>) -> Self {
        self.shared = Some(lock);
        self
    }

    /// Whether keys are also held against other processes.
    pub fn has_shared_lock(&self) -> bool {
        self.shared.is_some()
    }

    /// Takes the key, waiting until `deadline` for its current holder (in
    /// this process, then, with a [`SharedKeyLock`], in other processes).
    /// Answers `Ok(None)` if the key is still held then; a `deadline` that
    /// has passed makes one attempt. Fails if the shared lock fails.
    pub async fn acquire(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        deadline: Instant,
    ) -> Result<Option<RegistryGuard>> {
        let Some(mut guard) = self.acquire_local(scope, key, deadline).await else {
            return Ok(None);
        };
        let Some(shared) = &self.shared else {
            return Ok(Some(guard));
        };
        let mut pause = SHARED_FIRST_PAUSE;
        loop {
            if let Some(held) = shared.try_lock(scope, key)? {
                guard.shared = Some(held);
                return Ok(Some(guard));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(SHARED_MAX_PAUSE);
        }
    }

    async fn acquire_local(&self, scope: &Scope, key: &IdempotencyKey, deadline: Instant) -> Option<RegistryGuard> {
        let slot = (scope.clone(), key.clone());
        loop {
            let notify = {
                let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
                match slots.get(&slot) {
                    None => {
                        slots.insert(slot.clone(), Arc::new(Notify::new()));
                        return Some(RegistryGuard {
                            slots: self.slots.clone(),
                            slot: Some(slot),
                            shared: None,
                        });
                    }
                    Some(n) => n.clone(),
                }
            };
            let notified = notify.notified();
            tokio::pin!(notified);
            // Register interest, then re-check: the holder may have left
            // between the lookup above and now.
            notified.as_mut().enable();
            let still_held = self
                .slots
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&slot)
                .is_some_and(|n| Arc::ptr_eq(n, &notify));
            if still_held && tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    /// How many keys are held now.
    pub fn held(&self) -> usize {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;

    /// A lock "held by another process" while `held` is set; counts attempts
    /// and the guards alive.
    #[derive(Default)]
    struct Other {
        held: AtomicBool,
        attempts: AtomicUsize,
        alive: Arc<AtomicUsize>,
    }

    struct Alive(Arc<AtomicUsize>);

    impl Drop for Alive {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl SharedKeyLock for Other {
        fn try_lock(&self, _: &Scope, _: &IdempotencyKey) -> Result<Option<SharedKeyGuard>> {
            self.attempts.fetch_add(1, Ordering::SeqCst);
            if self.held.load(Ordering::SeqCst) {
                return Ok(None);
            }
            self.alive.fetch_add(1, Ordering::SeqCst);
            Ok(Some(Box::new(Alive(self.alive.clone()))))
        }
    }

    fn slot() -> (Scope, IdempotencyKey) {
        (Scope::parse("t", "POST /x").unwrap(), IdempotencyKey::new("k").unwrap())
    }

    #[tokio::test]
    async fn shared_lock_is_held_with_the_guard_and_bounds_the_wait() {
        let other = Arc::new(Other::default());
        let registry = KeyRegistry::new().with_shared_lock(other.clone());
        let (scope, key) = slot();

        let guard = registry
            .acquire(&scope, &key, Instant::now())
            .await
            .unwrap()
            .expect("free");
        assert_eq!(other.alive.load(Ordering::SeqCst), 1);
        drop(guard);
        assert_eq!(
            other.alive.load(Ordering::SeqCst),
            0,
            "the shared lock goes with the guard"
        );
        assert_eq!(registry.held(), 0);

        // Held elsewhere: a passed deadline makes one attempt, a later one polls until it.
        other.held.store(true, Ordering::SeqCst);
        let before = other.attempts.load(Ordering::SeqCst);
        assert!(registry.acquire(&scope, &key, Instant::now()).await.unwrap().is_none());
        assert_eq!(other.attempts.load(Ordering::SeqCst), before + 1);
        let started = Instant::now();
        let bound = Duration::from_millis(60);
        assert!(registry.acquire(&scope, &key, started + bound).await.unwrap().is_none());
        assert!(started.elapsed() >= bound);
        assert_eq!(registry.held(), 0, "a failed wait leaves the key free in this process");

        // Freed elsewhere while waiting: the waiter takes it.
        let releaser = {
            let other = other.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(30)).await;
                other.held.store(false, Ordering::SeqCst);
            })
        };
        let guard = registry
            .acquire(&scope, &key, Instant::now() + Duration::from_secs(5))
            .await
            .unwrap()
            .expect("freed");
        releaser.await.unwrap();
        assert_eq!(other.alive.load(Ordering::SeqCst), 1);
        drop(guard);
    }
}
