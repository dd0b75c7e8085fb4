//! The transaction a [`SqliteStore`](crate::SqliteStore) hands out in
//! transactional mode, and the claims it holds without a row.

use std::fmt;
use std::ops::{Deref, DerefMut};

use idem_core::{ClaimRequest, Result};
use idem_sql::UnwrittenClaims;
use sqlx::sqlite::SqliteTransactionManager;
use sqlx::{Sqlite, SqliteConnection, Transaction};
use sqlx_core::transaction::TransactionManager;

use crate::error::store_error;

/// The transaction type of [`SqliteStore`](crate::SqliteStore) in
/// transactional mode: a pooled connection inside `BEGIN IMMEDIATE`, so it
/// holds the database's write lock from its start. The caller's own writes
/// go through it (`&mut **tx` is a `&mut SqliteConnection`), so they commit
/// or roll back with the claim.
///
/// A claim made in it writes nothing; the transaction notes the key, and the
/// record writes the completed row (see the crate docs, "One row per fresh
/// call"). Dropping an open transaction rolls it back, as sqlx's
/// `Transaction` does: before its connection is used again.
///
/// A `begin()` in the caller's code on `&mut **tx` is a savepoint of it. A
/// nested transaction left open (its `sqlx::Transaction` leaked), or one
/// whose failed or cancelled `begin` made sqlx roll this transaction back,
/// fails the record and the commit: nothing of the claim commits, and every
/// level still open is rolled back, so the connection never goes back to
/// the pool inside a transaction (holding the database's write lock).
pub struct SqliteTx {
    /// `None` once ended.
    inner: Option<Transaction<'static, Sqlite>>,
    /// The keys claimed in this transaction, with what their record writes.
    claims: UnwrittenClaims<HeldClaim>,
    /// Whether the connection's worker has answered a command of this
    /// transaction's own since the connection was last lent out, so the
    /// depth it counts covers everything sent before.
    settled: bool,
}

/// What the record of a key claimed in a transaction writes: no row
/// written yet.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeldClaim {
    /// The token the record writes.
    pub(crate) token: i64,
    /// The token of the stale row the record replaces, or `None` if the key
    /// had no row: the record then inserts one.
    pub(crate) replaces: Option<i64>,
}

impl fmt::Debug for SqliteTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteTx")
            .field("claims", &self.claims.len())
            .finish_non_exhaustive()
    }
}

impl Deref for SqliteTx {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        self.inner
            .as_ref()
            .expect("a SqliteTx holds its transaction until it ends")
    }
}

impl DerefMut for SqliteTx {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        self.settled = false;
        self.inner
            .as_mut()
            .expect("a SqliteTx holds its transaction until it ends")
    }
}

impl Drop for SqliteTx {
    fn drop(&mut self) {
        let Some(mut inner) = self.inner.take() else { return };
        // The transaction's own drop rolls back one level, the innermost:
        // the levels a nested transaction left open above it first, each
        // queued on the connection's worker in order. One more than the
        // count is queued: the count may be one short (a rollback the worker
        // ran but whose answer was lost, after which the worker skips the
        // next queued one), and a rollback at depth 0 does nothing.
        for _ in 0..SqliteTransactionManager::get_transaction_depth(&inner) {
            SqliteTransactionManager::start_rollback(&mut inner);
        }
    }
}

impl SqliteTx {
    pub(crate) fn new(inner: Transaction<'static, Sqlite>) -> Self {
        Self {
            inner: Some(inner),
            claims: UnwrittenClaims::default(),
            settled: false,
        }
    }

    /// Fails unless the transaction is still the one its claim began, with
    /// nothing nested left open on it (see [`idem_sql::check_claim_depth`]).
    pub(crate) fn check_intact(&self) -> Result<()> {
        idem_sql::check_claim_depth(SqliteTransactionManager::get_transaction_depth(self))
    }

    /// [`check_intact`](Self::check_intact) once the connection's worker
    /// has run every command sent to it: the count it keeps moves only as
    /// the worker runs them, and a nested `begin` cut off half-way leaves
    /// its `SAVEPOINT` and sqlx's `ROLLBACK` of the claim's transaction
    /// queued. A ping, which the worker answers after them, costs no
    /// statement.
    pub(crate) async fn check_settled(&mut self) -> Result<()> {
        if !self.settled {
            sqlx::Connection::ping(&mut **self).await.map_err(store_error)?;
            self.settled = true;
        }
        self.check_intact()
    }

    /// Notes that the worker has just answered a command of this
    /// transaction's own (see [`check_settled`](Self::check_settled)).
    pub(crate) fn note_settled(&mut self) {
        self.settled = true;
    }

    /// Commits the transaction; one not intact (see the type's docs) is
    /// rolled back instead, and the commit fails.
    pub(crate) async fn commit(mut self) -> Result<()> {
        if let Err(e) = self.check_settled().await {
            self.unwind().await;
            return Err(e);
        }
        let inner = self
            .inner
            .take()
            .expect("a SqliteTx holds its transaction until it ends");
        inner.commit().await.map_err(store_error)
    }

    /// Rolls the transaction back, with any nested level left open on it.
    pub(crate) async fn rollback(mut self) -> Result<()> {
        if self.check_intact().is_err() {
            self.unwind().await;
            return Ok(());
        }
        let inner = self
            .inner
            .take()
            .expect("a SqliteTx holds its transaction until it ends");
        inner.rollback().await.map_err(store_error)
    }

    /// Rolls back every level still open on the connection, the innermost
    /// first; a level that cannot be rolled back is left to Drop, which
    /// queues the rest.
    async fn unwind(&mut self) {
        while SqliteTransactionManager::get_transaction_depth(self) > 0 {
            if let Err(e) = SqliteTransactionManager::rollback(self).await {
                tracing::debug!(error = %e, "rolling back a transaction that was not intact failed");
                return;
            }
        }
        // Nothing open is left: the transaction's own drop has nothing to do.
        if let Some(inner) = self.inner.take() {
            drop(inner);
        }
    }

    /// Notes a claim of `req`'s key: its record writes the row with `token`,
    /// in place of the stale row whose token is `replaces` (if any).
    pub(crate) fn hold(&mut self, req: &ClaimRequest<'_>, token: i64, replaces: Option<i64>) {
        self.claims.hold(req, HeldClaim { token, replaces });
    }

    /// The claim of `req`'s key this transaction holds, if any.
    pub(crate) fn held(&self, req: &ClaimRequest<'_>) -> Option<&HeldClaim> {
        self.claims.get(req)
    }

    /// Forgets the claim of `req`'s key (its record is written).
    pub(crate) fn release(&mut self, req: &ClaimRequest<'_>) {
        self.claims.forget(req);
    }
}
