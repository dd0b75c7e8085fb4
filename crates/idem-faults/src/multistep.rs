//! Faults of a store of multi-step operations: an operation's first write,
//! a recovery point, a sent mark or a recorded answer refused, timed out,
//! or applied and reported as failed; and its reads refused. A step's
//! writes joining a transaction fail before the commit does (the commit's
//! own faults are the backend's, [`Op::Commit`]), so a write applied and
//! reported as failed there is rolled back with its transaction; a write
//! in a transaction of its own (taking an operation, marking a send,
//! recording an answer, holding, finishing) is applied for good.
//!
//! The store joins the transactions of the backend it is wrapped beside:
//! `Faulty<M>` stores operations for `Faulty<B>` when `M` stores them for
//! `B`, so one plan covers the commits and the rows.

use idem_core::multistep::{MultiStep, MultiStepFilter, MultiStepStore};
use idem_core::{BoxFuture, IdempotencyKey, Result, Scope, TxBackend};

use crate::{Faulty, Op};

impl<B, M> MultiStepStore<Faulty<B>> for Faulty<M>
where
    B: TxBackend,
    M: MultiStepStore<B>,
{
    fn insert_in<'a>(&'a self, tx: &'a mut B::Tx, row: &'a MultiStep) -> BoxFuture<'a, Result<Option<i64>>> {
        Box::pin(self.faulty(Op::StepInsert, self.inner.insert_in(tx, row)))
    }

    fn write_in<'a>(&'a self, tx: &'a mut B::Tx, row: &'a MultiStep) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.faulty(Op::StepWrite, self.inner.write_in(tx, row)))
    }

    fn write<'a>(&'a self, row: &'a MultiStep) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.faulty(Op::StepWrite, self.inner.write(row)))
    }

    fn find<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<MultiStep>>> {
        Box::pin(self.faulty(Op::StepRead, self.inner.find(scope, key)))
    }

    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<MultiStep>>> {
        Box::pin(self.faulty(Op::StepRead, self.inner.get(id)))
    }

    fn due(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<Vec<i64>>> {
        Box::pin(self.faulty(Op::StepRead, self.inner.due(now_ms, limit)))
    }

    /// The operator's view and the purge pass through unharmed.
    fn list<'a>(&'a self, filter: &'a MultiStepFilter) -> BoxFuture<'a, Result<Vec<MultiStep>>> {
        self.inner.list(filter)
    }

    fn purge_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        self.inner.purge_expired(now_ms, limit)
    }
}
