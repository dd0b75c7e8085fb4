//! The store's modes: the transactional backend, the lease store and the
//! sweeper.

use super::*;

impl TxBackend for MySqlStore {
    type Tx = MySqlTx;

    fn begin(&self) -> BoxFuture<'_, Result<MySqlTx>> {
        Box::pin(MySqlTx::begin(&self.pool))
    }

    fn claim<'a>(
        &'a self,
        tx: &'a mut MySqlTx,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<TxClaim>> {
        Box::pin(async move {
            let claim = match self.strategy {
                ClaimStrategy::Placeholder => self.claim_on(tx, req, lock_wait_secs(wait)).await?,
                ClaimStrategy::NamedLock => self.claim_named(tx, req, wait).await?,
            };
            Ok(claim.into())
        })
    }

    /// Under [`ClaimStrategy::NamedLock`], the lock and the read of the key
    /// in one round trip, before `BEGIN` (which follows only if the claim
    /// writes); otherwise `begin` then `claim`.
    fn begin_claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<(MySqlTx, TxClaim)>> {
        Box::pin(async move {
            let conn = self.pool.acquire().await.map_err(store_error)?;
            self.begin_claim_on(conn, req, wait).await
        })
    }

    idem_sql::read_then_claim_on_one_connection!(store_error);

    fn record<'a>(
        &'a self,
        tx: &'a mut MySqlTx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            tx.check_intact()?;
            if let Some(token) = tx.take_unwritten(req) {
                return self.insert_completed(tx, req, record, token).await;
            }
            let args = [Arg::Int16(record.status.code()), Arg::Bytes(&record.payload)]
                .into_iter()
                .chain(idem_sql::key_args::<MySqlDialect>(req.scope, req.key));
            let statement = idem_sql::bound::<MySqlDialect>(self.sql.record.clone(), args);
            idem_sql::record_claimed::<MySqlDialect>(statement, &mut **tx).await
        })
    }

    idem_sql::tx_ends!();
}

impl LeaseStore for MySqlStore {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        Box::pin(async move {
            let mut tx = self.pool.begin().await.map_err(store_error)?;
            let claim = self.claim_on(&mut tx, req, LEASE_CLAIM_LOCK_WAIT_SECS).await;
            match claim {
                Ok(Claim::Claimed(token)) => {
                    tx.commit().await.map_err(store_error)?;
                    Ok(LeaseClaim::Acquired(token))
                }
                Ok(Claim::Found(row)) => {
                    rollback_quietly(tx).await;
                    Ok(LeaseClaim::Found(row))
                }
                Ok(Claim::Busy) => {
                    rollback_quietly(tx).await;
                    Err(Error::store(
                        StoreErrorKind::LockTimeout,
                        "another transaction held the key's row for the whole lease-claim lock wait",
                    ))
                }
                Err(e) => {
                    rollback_quietly(tx).await;
                    Err(e)
                }
            }
        })
    }

    idem_sql::lease_writes!(rows);
}

idem_sql::key_sweep!(MySqlStore, rows);

async fn rollback_quietly(tx: sqlx::Transaction<'static, sqlx::MySql>) {
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %e, "rollback failed; the connection will be discarded");
    }
}
