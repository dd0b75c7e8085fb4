//! Faults of a dead-letter store: a letter's writes refused, timed out, or
//! applied and reported as failed. Reads pass through.

use idem_core::{
    BoxFuture, DeadLetter, DeadLetterFilter, DeadLetterStore, IdempotencyKey, NewDeadLetter, RedriveHold,
    RedriveOutcome, Result, Scope, Settlement,
};

use crate::{Faulty, Op};

impl<S: DeadLetterStore> DeadLetterStore for Faulty<S> {
    fn record(&self, letter: &NewDeadLetter) -> BoxFuture<'_, Result<i64>> {
        let letter = letter.clone();
        Box::pin(async move { self.faulty(Op::LetterRecord, self.inner.record(&letter)).await })
    }

    fn list(&self, filter: &DeadLetterFilter) -> BoxFuture<'_, Result<Vec<DeadLetter>>> {
        self.inner.list(filter)
    }

    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        self.inner.get(id)
    }

    fn find(&self, scope: &Scope, key: &IdempotencyKey) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        self.inner.find(scope, key)
    }

    fn begin_redrive(&self, id: i64, hold_ms: i64) -> BoxFuture<'_, Result<Option<RedriveHold>>> {
        Box::pin(self.faulty(Op::LetterTake, self.inner.begin_redrive(id, hold_ms)))
    }

    fn retarget(&self, id: i64, token: u32, url: &str) -> BoxFuture<'_, Result<bool>> {
        self.inner.retarget(id, token, url)
    }

    fn finish_redrive(&self, id: i64, token: u32, outcome: &RedriveOutcome) -> BoxFuture<'_, Result<bool>> {
        let outcome = outcome.clone();
        Box::pin(async move {
            self.faulty(Op::LetterFinish, self.inner.finish_redrive(id, token, &outcome))
                .await
        })
    }

    fn settle(&self, id: i64, settlement: &Settlement) -> BoxFuture<'_, Result<bool>> {
        let settlement = settlement.clone();
        Box::pin(async move { self.faulty(Op::LetterSettle, self.inner.settle(id, &settlement)).await })
    }

    fn cancel(&self, id: i64) -> BoxFuture<'_, Result<bool>> {
        Box::pin(self.faulty(Op::LetterSettle, self.inner.cancel(id)))
    }

    fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        self.inner.purge_resolved(older_than_ms, limit)
    }
}
