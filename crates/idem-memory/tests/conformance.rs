//! The conformance suite against the in-memory store.

use idem_conformance::{Subject, lease_conformance, tx_conformance};
use idem_core::{BoxError, BoxFuture};
use idem_memory::{MemoryStore, MemoryTx};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
struct Memory {
    store: MemoryStore,
}

impl Subject for Memory {
    type Backend = MemoryStore;
    type Lease = MemoryStore;
    type Sweeper = MemoryStore;

    fn backend(&self) -> MemoryStore {
        self.store.clone()
    }
    fn lease_store(&self) -> MemoryStore {
        self.store.clone()
    }
    fn sweeper(&self) -> MemoryStore {
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
        Box::pin(async move { self.clone() })
    }
    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move { Memory::default() })
    }
}

/// Effects are keyed by unique ids, so one process-wide table serves every test.
static EFFECTS: std::sync::LazyLock<Arc<Mutex<HashMap<String, u64>>>> = std::sync::LazyLock::new(Default::default);

tx_conformance!(memory_tx, async { Memory::default() });
lease_conformance!(memory_lease, async { Memory::default() });
