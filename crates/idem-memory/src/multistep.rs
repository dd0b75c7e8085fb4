//! Multi-step operations in memory, whose writes join [`MemoryStore`]
//! transactions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use idem_core::multistep::{MultiStep, MultiStepCursor, MultiStepFilter, MultiStepStore};
use idem_core::{BoxFuture, Error, IdempotencyKey, Result, Scope, StoreErrorKind};

use crate::{MemoryStore, MemoryTx};

#[derive(Default)]
struct Table {
    rows: HashMap<i64, MultiStep>,
    by_key: HashMap<(Scope, IdempotencyKey), i64>,
    last_id: i64,
}

impl Table {
    /// Writes `row` over the stored version it was read at; the stored row
    /// gets the next version.
    fn write(&mut self, row: &MultiStep) -> Result<()> {
        match self.rows.get_mut(&row.id) {
            Some(stored) if stored.version == row.version => {
                *stored = MultiStep {
                    version: row.version + 1,
                    ..row.clone()
                };
                Ok(())
            }
            _ => Err(Error::Fenced),
        }
    }
}

/// The multi-step operations of a [`MemoryStore`]'s callers: a local step's
/// write joins the step's [`MemoryTx`] and applies, checked against the
/// version it was read at, when it commits. Clones share the same rows.
#[derive(Clone, Default)]
pub struct MemoryMultiSteps {
    table: Arc<Mutex<Table>>,
}

impl std::fmt::Debug for MemoryMultiSteps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryMultiSteps")
            .field("operations", &self.lock().rows.len())
            .finish()
    }
}

impl MemoryMultiSteps {
    /// No operations.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl MultiStepStore<MemoryStore> for MemoryMultiSteps {
    fn insert_in<'a>(&'a self, tx: &'a mut MemoryTx, row: &'a MultiStep) -> BoxFuture<'a, Result<Option<i64>>> {
        Box::pin(async move {
            let slot = (row.scope.clone(), row.key.clone());
            let id = {
                let mut t = self.lock();
                if t.by_key.contains_key(&slot) {
                    return Ok(None);
                }
                t.last_id += 1;
                t.last_id
            };
            let row = MultiStep {
                id,
                version: 0,
                ..row.clone()
            };
            let table = self.table.clone();
            tx.on_commit_checked(move || {
                let mut t = table.lock().unwrap_or_else(PoisonError::into_inner);
                // Inserted since: the unique key refuses this one, as a
                // database's would; the caller reads the other and goes on.
                if t.by_key.contains_key(&slot) {
                    return Err(Error::store(
                        StoreErrorKind::Serialization,
                        "the operation was started concurrently",
                    ));
                }
                t.by_key.insert(slot, id);
                t.rows.insert(id, row);
                Ok(())
            });
            Ok(Some(id))
        })
    }

    fn write_in<'a>(&'a self, tx: &'a mut MemoryTx, row: &'a MultiStep) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let (table, row) = (self.table.clone(), row.clone());
            tx.on_commit_checked(move || table.lock().unwrap_or_else(PoisonError::into_inner).write(&row));
            Ok(())
        })
    }

    fn write<'a>(&'a self, row: &'a MultiStep) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.lock().write(row) })
    }

    fn find<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<MultiStep>>> {
        Box::pin(async move {
            let t = self.lock();
            Ok(t.by_key
                .get(&(scope.clone(), key.clone()))
                .and_then(|id| t.rows.get(id))
                .cloned())
        })
    }

    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<MultiStep>>> {
        Box::pin(async move { Ok(self.lock().rows.get(&id).cloned()) })
    }

    fn due(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<Vec<i64>>> {
        Box::pin(async move {
            let t = self.lock();
            let mut due: Vec<(i64, i64)> = t
                .rows
                .values()
                .filter(|r| r.is_due(now_ms))
                .map(|r| (r.updated_at_ms, r.id))
                .collect();
            due.sort_unstable();
            Ok(due.into_iter().take(limit as usize).map(|(_, id)| id).collect())
        })
    }

    fn list<'a>(&'a self, filter: &'a MultiStepFilter) -> BoxFuture<'a, Result<Vec<MultiStep>>> {
        Box::pin(async move {
            filter.check()?;
            let t = self.lock();
            let mut found: Vec<&MultiStep> = t.rows.values().filter(|r| filter.matches(r)).collect();
            found.sort_unstable_by_key(|r| MultiStepCursor::of(r));
            Ok(found.into_iter().take(filter.limit as usize).cloned().collect())
        })
    }

    fn purge_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let mut t = self.lock();
            let mut expired: Vec<(i64, i64)> = t
                .rows
                .values()
                .filter(|r| r.state.is_final())
                .filter_map(|r| r.expires_at_ms.filter(|at| *at <= now_ms).map(|at| (at, r.id)))
                .collect();
            expired.sort_unstable();
            expired.truncate(limit as usize);
            for (_, id) in &expired {
                if let Some(row) = t.rows.remove(id) {
                    t.by_key.remove(&(row.scope, row.key));
                }
            }
            Ok(expired.len() as u64)
        })
    }
}
