//! The business writes of a conformance subject whose transactional side
//! is the in-memory store: counted in one process-wide table when their
//! transaction commits (effect ids are unique, so every test shares it).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use idem_core::{BoxError, BoxFuture};
use idem_memory::MemoryTx;

static EFFECTS: LazyLock<Mutex<HashMap<String, u64>>> = LazyLock::new(Default::default);

/// Writes the business row `effect_id` inside `tx`.
pub(crate) fn write<'c>(tx: &'c mut MemoryTx, effect_id: String) -> BoxFuture<'c, Result<(), BoxError>> {
    Box::pin(async move {
        tx.on_commit(move || *EFFECTS.lock().unwrap().entry(effect_id).or_default() += 1);
        Ok(())
    })
}

/// Counts the committed business rows named `effect_id`.
pub(crate) fn count(effect_id: String) -> BoxFuture<'static, Result<u64, BoxError>> {
    Box::pin(async move { Ok(EFFECTS.lock().unwrap().get(&effect_id).copied().unwrap_or(0)) })
}

/// `Subject::write_effect` and `Subject::count_effects` for a subject whose
/// backend is the in-memory store.
macro_rules! memory_effects {
    () => {
        fn write_effect<'c>(
            tx: &'c mut idem_memory::MemoryTx,
            effect_id: String,
        ) -> idem_core::BoxFuture<'c, Result<(), idem_core::BoxError>> {
            effects::write(tx, effect_id)
        }
        fn count_effects(&self, effect_id: String) -> idem_core::BoxFuture<'_, Result<u64, idem_core::BoxError>> {
            effects::count(effect_id)
        }
    };
}
