//! Faults of a transactional backend: a claim refused, and above all a
//! commit refused, timed out, or applied and then reported as failed — the
//! one outcome a caller can never tell from a failure, and must survive by
//! retrying with the same key.

use std::time::Duration;

use idem_core::{
    BoxFuture, ClaimRequest, IdempotencyKey, KeyRegistry, Record, Result, Scope, StoredRow, TxBackend, TxClaim,
};

use crate::{Faulty, Op};

impl<S: TxBackend> TxBackend for Faulty<S> {
    type Tx = S::Tx;

    fn begin(&self) -> BoxFuture<'_, Result<Self::Tx>> {
        self.inner.begin()
    }

    fn claim<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<TxClaim>> {
        Box::pin(self.faulty(Op::Claim, self.inner.claim(tx, req, wait)))
    }

    fn record<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        self.inner.record(tx, req, record)
    }

    fn commit(&self, tx: Self::Tx) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.faulty_commit(self.inner.commit(tx)))
    }

    fn rollback(&self, tx: Self::Tx) -> BoxFuture<'_, Result<()>> {
        self.inner.rollback(tx)
    }

    fn begin_claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<(Self::Tx, TxClaim)>> {
        Box::pin(self.faulty(Op::Claim, self.inner.begin_claim(req, wait)))
    }

    fn record_commit<'a>(
        &'a self,
        tx: Self::Tx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.faulty_commit(self.inner.record_commit(tx, req, record)))
    }

    /// The wrapped store's read under the [`Op::Lookup`] fault. A
    /// read-first engine on a faulty store reads with it and then claims
    /// with `begin_claim` (the trait's default `read_then_claim`), so the
    /// read and the claim fail each under its own fault; the wrapped
    /// store's own `read_then_claim` is not used.
    fn read_committed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> Option<BoxFuture<'a, Result<Option<StoredRow>>>> {
        let read = self.inner.read_committed(scope, key)?;
        Some(Box::pin(self.faulty(Op::Lookup, read)))
    }

    fn local_registry(&self) -> Option<&KeyRegistry> {
        self.inner.local_registry()
    }
}

impl<S> Faulty<S> {
    /// A commit under its fault. A refused or timed-out commit must leave
    /// nothing behind, so the wrapped commit is not run at all then (its
    /// transaction is dropped, which rolls it back); an applied one runs and
    /// is then reported as failed.
    async fn faulty_commit(&self, commit: impl std::future::Future<Output = Result<()>>) -> Result<()> {
        self.faulty(Op::Commit, commit).await
    }
}
