//! The store traits of idem-core on SQLite.

use std::time::Duration;

use idem_core::{
    BoxFuture, ClaimRequest, Error, KeyRegistry, LeaseClaim, LeaseStore, Record, Result, StoreErrorKind, StoredRow,
    Token, TxBackend, TxClaim,
};
use sqlx::{AssertSqlSafe, Row, Sqlite, SqliteConnection, Transaction};

use crate::error::store_error;
use crate::{SqliteDialect, SqliteStore, SqliteTx};

/// Starts every write transaction: the write lock is taken at once, waiting
/// up to the busy timeout, so a transaction never fails half-way because a
/// read lock could not be upgraded.
const BEGIN_IMMEDIATE: &str = "BEGIN IMMEDIATE";

impl SqliteStore {
    async fn begin_immediate(&self) -> Result<Transaction<'static, Sqlite>> {
        self.pool.begin_with(BEGIN_IMMEDIATE).await.map_err(store_error)
    }

    /// Claims a free or stale key in lease mode; answers the new token, or
    /// `None` if a live row holds the key.
    async fn upsert(&self, conn: &mut SqliteConnection, req: &ClaimRequest<'_>) -> Result<Option<i64>> {
        let row = idem_sql::bound::<SqliteDialect>(
            AssertSqlSafe(self.sql.claim.clone()),
            idem_sql::claim_args::<SqliteDialect>(req, req.fresh_token.0),
        )
        .fetch_optional(&mut *conn)
        .await
        .map_err(store_error)?;
        row.map(|r| r.try_get::<i64, _>(0)).transpose().map_err(store_error)
    }

    /// The transactional claim: reads the key's row and writes nothing. A
    /// live row answers; a free key, or a stale row, is noted on `tx` as
    /// claimed, and [`record`](TxBackend::record) writes the completed row.
    async fn claim_in(&self, tx: &mut SqliteTx, req: &ClaimRequest<'_>) -> Result<TxClaim> {
        let row = sqlx::query(AssertSqlSafe(self.sql.claim_read.clone()))
            .bind(req.scope.tenant().as_str())
            .bind(req.scope.operation().as_str())
            .bind(req.key.as_str())
            .bind(req.now_ms)
            .fetch_optional(&mut **tx)
            .await
            .map_err(store_error)?;
        let fresh = req.fresh_token.0;
        let Some(row) = row else {
            tx.hold(req, fresh, None);
            tracing::debug!(table = %self.table, token = fresh, "free key claimed in transaction");
            return Ok(TxClaim::Claimed);
        };
        let stale: bool = row.try_get(6).map_err(store_error)?;
        if stale {
            // A takeover's token is larger than the stale row's, so that
            // row's lease holder is fenced once this transaction commits.
            let old: i64 = row.try_get(2).map_err(store_error)?;
            let token = req.token_over(Some(old));
            tx.hold(req, token, Some(old));
            tracing::debug!(table = %self.table, token, "stale key taken over in transaction");
            return Ok(TxClaim::Claimed);
        }
        tracing::debug!(table = %self.table, "key held by a committed row");
        idem_sql::decode_row::<SqliteDialect>(&row).map(TxClaim::Found)
    }

    /// Reads the row that made a claim attempt fail. The caller holds the
    /// write lock, so the row cannot vanish between the claim and this read.
    async fn found(&self, conn: &mut SqliteConnection, req: &ClaimRequest<'_>) -> Result<StoredRow> {
        match self.rows.get_in(conn, req.scope, req.key).await? {
            Some(row) => Ok(row),
            None => Err(Error::store(
                StoreErrorKind::Other,
                "the key's row vanished between the claim and its read inside one write transaction",
            )),
        }
    }
}

/// Transactional mode. Each transaction begins with `BEGIN IMMEDIATE`, so
/// it holds SQLite's write lock from its start: once a claim runs, no other
/// claim of any key is uncommitted, and a found row is always committed.
/// That is why [`claim`](TxBackend::claim) never answers
/// [`TxClaim::Busy`]; waiting for the key happens before the transaction
/// begins, in the key registry (in this process, then against other
/// processes through the side lock file), and waiting for the write lock in
/// [`begin`](TxBackend::begin), up to the busy timeout.
///
/// The same lock is why the claim writes nothing: no other writer can
/// change the key's row between the claim's read and the record, so the
/// record writes the completed row once (see the crate docs, "One row per
/// fresh call").
impl TxBackend for SqliteStore {
    type Tx = SqliteTx;

    fn begin(&self) -> BoxFuture<'_, Result<SqliteTx>> {
        Box::pin(async move { self.begin_immediate().await.map(SqliteTx::new) })
    }

    fn claim<'a>(
        &'a self,
        tx: &'a mut SqliteTx,
        req: &'a ClaimRequest<'a>,
        _wait: Duration,
    ) -> BoxFuture<'a, Result<TxClaim>> {
        Box::pin(self.claim_in(tx, req))
    }

    fn record<'a>(
        &'a self,
        tx: &'a mut SqliteTx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            tx.check_settled().await?;
            let Some(held) = tx.held(req) else {
                return Err(idem_sql::unclaimed_record());
            };
            let (token, replaces) = (held.token, held.replaces);
            let done = idem_sql::bound::<SqliteDialect>(
                AssertSqlSafe(self.sql.record.clone()),
                idem_sql::completed_args::<SqliteDialect>(req, record, token),
            )
            .bind(replaces)
            .execute(&mut **tx)
            .await
            .map_err(store_error)?;
            if done.rows_affected() != 1 {
                // No other writer could have touched the row under the
                // write lock: the caller's own work did, in this transaction.
                return Err(Error::Config(
                    "the key's row was written by the work of the transaction that claimed it; nothing is recorded"
                        .into(),
                ));
            }
            tx.release(req);
            // The worker has run everything sent before the record: the
            // commit that follows need not ping it again.
            tx.note_settled();
            Ok(())
        })
    }

    idem_sql::tx_ends!();

    fn local_registry(&self) -> Option<&KeyRegistry> {
        Some(&self.registry)
    }
}

/// Lease mode. A claim is its own short `BEGIN IMMEDIATE` transaction;
/// complete, mark_sent, release and extend are single statements (each one
/// atomic in SQLite's autocommit) that match the row's token and a status
/// in progress or sent. Like resolve_unknown, they need no key lock: each
/// touches one row in one statement under SQLite's write lock.
impl LeaseStore for SqliteStore {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        Box::pin(async move {
            let mut tx = self.begin_immediate().await?;
            match self.upsert(&mut tx, req).await? {
                Some(token) => {
                    tx.commit().await.map_err(store_error)?;
                    tracing::debug!(table = %self.table, token, "lease acquired");
                    Ok(LeaseClaim::Acquired(Token(token)))
                }
                None => {
                    let row = self.found(&mut tx, req).await?;
                    tx.rollback().await.map_err(store_error)?;
                    Ok(LeaseClaim::Found(row))
                }
            }
        })
    }

    idem_sql::lease_writes!(rows);
}

idem_sql::key_sweep!(
    /// Sweeping: one short statement deletes at most `limit` expired rows.
    SqliteStore,
    rows
);
