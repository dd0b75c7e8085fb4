//! The conformance suites against the in-memory stores.

#[macro_use]
#[path = "support/effects.rs"]
mod effects;

use idem_conformance::multistep_tests::MultiStepSubject;
use idem_conformance::{DeadLetterSubject, Subject, deadletter_conformance, lease_conformance, tx_conformance};
use idem_core::{BoxFuture, ManualClock};
use idem_memory::{MemoryDeadLetters, MemoryMultiSteps, MemoryStore};
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Default)]
struct Memory {
    store: MemoryStore,
    steps: MemoryMultiSteps,
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
    memory_effects!();
    fn another(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move { self.clone() })
    }
    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move { Memory::default() })
    }
}

impl MultiStepSubject for Memory {
    type Steps = MemoryMultiSteps;

    fn steps(&self) -> MemoryMultiSteps {
        self.steps.clone()
    }
    fn isolated_steps(&self) -> BoxFuture<'_, MemoryMultiSteps> {
        Box::pin(async { MemoryMultiSteps::new() })
    }
}

tx_conformance!(memory_tx, async { Memory::default() });
idem_conformance::multistep_conformance!(memory_multistep, async { Memory::default() });
lease_conformance!(memory_lease, async { Memory::default() });

/// Dead letters on a manual clock that the tests move.
#[derive(Clone)]
struct MemoryLetters {
    letters: MemoryDeadLetters,
    clock: ManualClock,
}

impl MemoryLetters {
    fn new() -> Self {
        let clock = ManualClock::starting_now();
        let letters = MemoryDeadLetters::new().with_clock(Arc::new(clock.clone()));
        Self { letters, clock }
    }
}

impl DeadLetterSubject for MemoryLetters {
    type Store = MemoryDeadLetters;

    fn store(&self) -> MemoryDeadLetters {
        self.letters.clone()
    }
    fn another(&self) -> BoxFuture<'_, MemoryDeadLetters> {
        Box::pin(async move { self.letters.clone() })
    }
    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move { MemoryLetters::new() })
    }
    fn elapse(&self, ms: u64) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.clock.advance(Duration::from_millis(ms)) })
    }
}

deadletter_conformance!(memory_deadletters, async { MemoryLetters::new() });

/// A read-first replay on a store whose claims queue in a local registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn read_first_replay_takes_no_registry_place() {
    idem_conformance::read_first_tests::read_first_replay_takes_no_registry_place(Memory::default()).await;
}
