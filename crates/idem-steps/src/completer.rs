//! The completer: finishes the operations whose callers went away.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idem_core::multistep::{MultiStep, MultiStepStore};
use idem_core::{BoxFuture, Result, TxBackend};

use crate::{Finished, Operation, StepsEngine};

/// Runs a registered operation on a row, whatever its types.
trait Resume<B: TxBackend, S: MultiStepStore<B>>: Send + Sync {
    fn resume<'a>(&'a self, engine: &'a StepsEngine<B, S>, row: MultiStep) -> BoxFuture<'a, Result<Finished<()>>>;
}

struct Registered<O>(O);

impl<B, S, O> Resume<B, S> for Registered<O>
where
    B: TxBackend,
    S: MultiStepStore<B>,
    O: Operation<B>,
{
    fn resume<'a>(&'a self, engine: &'a StepsEngine<B, S>, row: MultiStep) -> BoxFuture<'a, Result<Finished<()>>> {
        Box::pin(async move {
            Ok(match engine.drive(&self.0, row).await? {
                Finished::Completed { replayed, .. } => Finished::Completed { output: (), replayed },
                Finished::Compensated { failure, replayed } => Finished::Compensated { failure, replayed },
                Finished::Rejected(failure) => Finished::Rejected(failure),
                Finished::Held(kind) => Finished::Held(kind),
                Finished::InFlight => Finished::InFlight,
            })
        })
    }
}

/// The operations a completer can resume, by their definitions' names
/// ([`Operation::NAME`]). An operation whose definition is not registered
/// is left for a process that registers it.
pub struct Registry<B: TxBackend, S: MultiStepStore<B>> {
    ops: HashMap<&'static str, Arc<dyn Resume<B, S>>>,
}

impl<B: TxBackend, S: MultiStepStore<B>> Default for Registry<B, S> {
    fn default() -> Self {
        Self { ops: HashMap::new() }
    }
}

impl<B: TxBackend, S: MultiStepStore<B>> std::fmt::Debug for Registry<B, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&str> = self.ops.keys().copied().collect();
        names.sort_unstable();
        f.debug_struct("Registry").field("operations", &names).finish()
    }
}

impl<B: TxBackend, S: MultiStepStore<B>> Registry<B, S> {
    /// No operations.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `op` under its name (replacing one of the same name).
    pub fn with<O: Operation<B> + 'static>(mut self, op: O) -> Self {
        self.ops.insert(O::NAME, Arc::new(Registered(op)));
        self
    }
}

/// What one pass of a completer did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pass {
    /// Operations it took and ran.
    pub taken: u64,
    /// Of those, completed.
    pub completed: u64,
    /// Of those, compensated.
    pub compensated: u64,
    /// Of those, held for an operator.
    pub held: u64,
    /// Of those, stopped before their end (deferred, taken over, or a
    /// store failure): a later pass resumes them.
    pub unfinished: u64,
    /// Due, but of a definition not registered here.
    pub unknown_definitions: u64,
}

impl<B: TxBackend, S: MultiStepStore<B>> StepsEngine<B, S> {
    /// One completer pass: takes at most `limit` due operations (no live
    /// lease, not waiting) whose definitions `registry` holds, and runs
    /// each from its recovery point, as a retry of its key would. Several
    /// completers may run at once: each operation is taken by one (the
    /// others' takes write nothing).
    pub async fn complete_due(&self, registry: &Registry<B, S>, limit: u32) -> Result<Pass> {
        let mut pass = Pass::default();
        for id in self.store.due(self.clock.now_ms(), limit).await? {
            // Each take reads the clock anew: the runs before it took time,
            // and a lease counted from a stale time would end early.
            let now = self.clock.now_ms();
            let Some(row) = self.store.get(id).await? else { continue };
            let Some(op) = registry.ops.get(row.definition.as_str()) else {
                pass.unknown_definitions += 1;
                tracing::warn!(operation = id, definition = %row.definition, "no such definition registered here");
                continue;
            };
            let Some(row) = self.take(row, now).await? else {
                continue;
            };
            pass.taken += 1;
            match op.resume(self, row).await {
                Ok(Finished::Completed { .. }) => pass.completed += 1,
                Ok(Finished::Compensated { .. }) => pass.compensated += 1,
                Ok(Finished::Held(_)) => pass.held += 1,
                Ok(Finished::InFlight | Finished::Rejected(_)) => pass.unfinished += 1,
                Err(e) => {
                    tracing::warn!(operation = id, error = %e, "a completer's run stopped");
                    pass.unfinished += 1;
                }
            }
        }
        Ok(pass)
    }

    /// Runs completer passes until the returned future is dropped, waiting
    /// `idle` after a pass that found nothing to do.
    pub async fn complete_forever(&self, registry: &Registry<B, S>, idle: Duration) {
        loop {
            match self.complete_due(registry, 64).await {
                Ok(pass) if pass.taken > 0 => continue,
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "a completer pass failed"),
            }
            tokio::time::sleep(idle).await;
        }
    }
}
