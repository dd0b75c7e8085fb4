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
            Ok(match claim {
                Claim::Claimed(_) => TxClaim::Claimed,
                Claim::Found(row) => TxClaim::Found(row),
                Claim::Busy => TxClaim::Busy,
            })
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
            let (tx, claim) = match self.strategy {
                ClaimStrategy::NamedLock => self.begin_named(req, wait).await?,
                ClaimStrategy::Placeholder => {
                    let mut tx = self.begin().await?;
                    match self.claim_on(&mut tx, req, lock_wait_secs(wait)).await {
                        Ok(claim) => (tx, claim),
                        Err(e) => {
                            if let Err(rollback) = tx.rollback().await {
                                tracing::debug!(error = %rollback, "rollback after a failed claim failed");
                            }
                            return Err(e);
                        }
                    }
                }
            };
            Ok((
                tx,
                match claim {
                    Claim::Claimed(_) => TxClaim::Claimed,
                    Claim::Found(row) => TxClaim::Found(row),
                    Claim::Busy => TxClaim::Busy,
                },
            ))
        })
    }

    fn record<'a>(
        &'a self,
        tx: &'a mut MySqlTx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if let Some(token) = tx.take_unwritten(req) {
                return self.insert_completed(tx, req, record, token).await;
            }
            let done = sqlx::query(self.sql.record.clone())
                .bind(record.status.code())
                .bind(&record.payload[..])
                .bind(req.scope.tenant().as_str().as_bytes())
                .bind(req.scope.operation().as_str().as_bytes())
                .bind(req.key.as_str().as_bytes())
                .execute(&mut **tx)
                .await
                .map_err(store_error)?;
            if done.rows_affected() != 1 {
                return Err(Error::Config(
                    "record called on a transaction that holds no claim of this key".into(),
                ));
            }
            Ok(())
        })
    }

    fn commit(&self, tx: MySqlTx) -> BoxFuture<'_, Result<()>> {
        Box::pin(tx.commit())
    }

    fn rollback(&self, tx: MySqlTx) -> BoxFuture<'_, Result<()>> {
        Box::pin(tx.rollback())
    }
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

    /// One `UPDATE` guarded by the token: a row still held (in progress or
    /// already sent) becomes sent, keeping the earliest mark's time.
    fn mark_sent<'a>(&'a self, lease: &'a Lease, now_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            // Marking a row already sent at an earlier time changes nothing,
            // but CLIENT_FOUND_ROWS counts it as matched (see `extend`).
            let done = sqlx::query(self.sql.mark_sent.clone())
                .bind(now_ms)
                .bind(now_ms)
                .bind(lease.scope.tenant().as_str().as_bytes())
                .bind(lease.scope.operation().as_str().as_bytes())
                .bind(lease.key.as_str().as_bytes())
                .bind(lease.token.0)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            lease.fenced_unless_one(done.rows_affected(), "mark sent")
        })
    }

    fn lookup<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<StoredRow>>> {
        Box::pin(self.get(scope, key))
    }

    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let done = sqlx::query(self.sql.complete.clone())
                .bind(record.status.code())
                .bind(&record.payload[..])
                .bind(lease.scope.tenant().as_str().as_bytes())
                .bind(lease.scope.operation().as_str().as_bytes())
                .bind(lease.key.as_str().as_bytes())
                .bind(lease.token.0)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            lease.fenced_unless_one(done.rows_affected(), "complete")
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let done = sqlx::query(self.sql.release.clone())
                .bind(lease.scope.tenant().as_str().as_bytes())
                .bind(lease.scope.operation().as_str().as_bytes())
                .bind(lease.key.as_str().as_bytes())
                .bind(lease.token.0)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            lease.fenced_unless_one(done.rows_affected(), "release")
        })
    }

    fn extend<'a>(&'a self, lease: &'a Lease, lease_expires_at_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            // sqlx connects with CLIENT_FOUND_ROWS, so the affected-row count
            // is the number of rows matched, not changed: extending a lease to
            // the expiry it already has still counts one row and is not
            // mistaken for a fenced lease.
            let done = sqlx::query(self.sql.extend.clone())
                .bind(lease_expires_at_ms)
                .bind(lease_expires_at_ms)
                .bind(lease.scope.tenant().as_str().as_bytes())
                .bind(lease.scope.operation().as_str().as_bytes())
                .bind(lease.key.as_str().as_bytes())
                .bind(lease.token.0)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            lease.fenced_unless_one(done.rows_affected(), "extend")
        })
    }

    fn resolve_unknown<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        now_ms: i64,
        resolution: Option<&'a Record>,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let mut query = match resolution {
                Some(record) => sqlx::query(self.sql.resolve_record.clone())
                    .bind(record.status.code())
                    .bind(record.payload.clone()),
                None => sqlx::query(self.sql.resolve_release.clone()),
            };
            // The key's expiry, then the end of a sent claim's lease.
            query = query
                .bind(scope.tenant().as_str().as_bytes())
                .bind(scope.operation().as_str().as_bytes())
                .bind(key.as_str().as_bytes())
                .bind(now_ms)
                .bind(now_ms);
            let done = query.execute(&self.pool).await.map_err(store_error)?;
            Ok(done.rows_affected() == 1)
        })
    }
}

impl Sweep for MySqlStore {
    fn sweep_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let done = sqlx::query(self.sql.sweep.clone())
                .bind(now_ms)
                .bind(limit)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            tracing::debug!(
                table = self.table.as_str(),
                deleted = done.rows_affected(),
                "swept expired keys"
            );
            Ok(done.rows_affected())
        })
    }
}

async fn rollback_quietly(tx: sqlx::Transaction<'static, sqlx::MySql>) {
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %e, "rollback failed; the connection will be discarded");
    }
}
