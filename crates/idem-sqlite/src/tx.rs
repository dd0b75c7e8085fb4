//! The transaction a [`SqliteStore`](crate::SqliteStore) hands out in
//! transactional mode, and the claims it holds without a row.

use std::fmt;
use std::ops::{Deref, DerefMut};

use idem_core::{ClaimRequest, Result};
use sqlx::{Sqlite, SqliteConnection, Transaction};

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
pub struct SqliteTx {
    inner: Transaction<'static, Sqlite>,
    /// The keys claimed in this transaction, with what their record writes.
    claims: Vec<HeldClaim>,
}

/// A key claimed in a transaction: no row written yet.
#[derive(Debug)]
pub(crate) struct HeldClaim {
    tenant: String,
    operation: String,
    key: String,
    /// The token the record writes.
    pub(crate) token: i64,
    /// The token of the stale row the record replaces, or `None` if the key
    /// had no row: the record then inserts one.
    pub(crate) replaces: Option<i64>,
}

impl HeldClaim {
    fn is(&self, req: &ClaimRequest<'_>) -> bool {
        self.key == req.key.as_str()
            && self.operation == req.scope.operation().as_str()
            && self.tenant == req.scope.tenant().as_str()
    }
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
        &self.inner
    }
}

impl DerefMut for SqliteTx {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.inner
    }
}

impl SqliteTx {
    pub(crate) fn new(inner: Transaction<'static, Sqlite>) -> Self {
        Self {
            inner,
            claims: Vec::new(),
        }
    }

    /// Commits the transaction.
    pub(crate) async fn commit(self) -> Result<()> {
        self.inner.commit().await.map_err(store_error)
    }

    /// Rolls the transaction back.
    pub(crate) async fn rollback(self) -> Result<()> {
        self.inner.rollback().await.map_err(store_error)
    }

    /// Notes a claim of `req`'s key: its record writes the row with `token`,
    /// in place of the stale row whose token is `replaces` (if any).
    pub(crate) fn hold(&mut self, req: &ClaimRequest<'_>, token: i64, replaces: Option<i64>) {
        self.claims.retain(|held| !held.is(req));
        self.claims.push(HeldClaim {
            tenant: req.scope.tenant().as_str().to_owned(),
            operation: req.scope.operation().as_str().to_owned(),
            key: req.key.as_str().to_owned(),
            token,
            replaces,
        });
    }

    /// The claim of `req`'s key this transaction holds, if any.
    pub(crate) fn held(&self, req: &ClaimRequest<'_>) -> Option<&HeldClaim> {
        self.claims.iter().find(|held| held.is(req))
    }

    /// Forgets the claim of `req`'s key (its record is written).
    pub(crate) fn release(&mut self, req: &ClaimRequest<'_>) {
        self.claims.retain(|held| !held.is(req));
    }
}
