//! An in-process registry of keys being claimed, for stores whose database
//! lock is not per key.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::key::IdempotencyKey;
use crate::scope::Scope;

type Slot = (Scope, IdempotencyKey);

/// Serialises claims of one (scope, key) inside one process. SQLite has a
/// single writer for the whole database, so without this a twin could only
/// ever wait for the global write lock; with it, a twin waits for (or is
/// rejected by) exactly the claim of its own key, as on the other engines.
/// Clones share the same registry.
#[derive(Clone, Default)]
pub struct KeyRegistry {
    slots: Arc<Mutex<HashMap<Slot, Arc<Notify>>>>,
}

impl fmt::Debug for KeyRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.slots.lock().unwrap_or_else(PoisonError::into_inner).len();
        f.debug_struct("KeyRegistry").field("held", &n).finish()
    }
}

/// Holds a key in a [`KeyRegistry`] until dropped.
#[must_use = "the key is held only while the guard lives"]
pub struct RegistryGuard {
    slots: Arc<Mutex<HashMap<Slot, Arc<Notify>>>>,
    slot: Option<Slot>,
}

impl fmt::Debug for RegistryGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryGuard").finish_non_exhaustive()
    }
}

impl Drop for RegistryGuard {
    fn drop(&mut self) {
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

    /// Takes the key, waiting until `deadline` for its current holder.
    /// Answers `None` if the key is still held then.
    pub async fn acquire(&self, scope: &Scope, key: &IdempotencyKey, deadline: Instant) -> Option<RegistryGuard> {
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
