//! The store's modes: the transactional backend, the lease store and the
//! sweeper.

use super::*;

impl TxBackend for PgStore {
    type Tx = PgTx;

    fn begin(&self) -> BoxFuture<'_, Result<PgTx>> {
        Box::pin(PgTx::begin(&self.pool))
    }

    fn claim<'a>(
        &'a self,
        tx: &'a mut PgTx,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<TxClaim>> {
        Box::pin(async move {
            if let Some(one_write) = &self.sql.one_write {
                return self.claim_one_write(tx, one_write, req, wait).await;
            }
            let advisory = self.strategy == ClaimStrategy::AdvisoryLock;
            for _ in 0..VANISHED_ROW_ATTEMPTS {
                let Some(row) = self.claim_row(tx, req, wait, advisory).await? else {
                    return Ok(self.busy(wait));
                };
                if let Some(answer) = decide_claim(&row)? {
                    return Ok(answer);
                }
                if let Some(answer) = self.reread(tx, req).await? {
                    return Ok(answer);
                }
            }
            Err(vanished())
        })
    }

    /// `BEGIN` and the claim in one round trip (see [`PgTx`]). Under the
    /// insert-on-conflict strategy that claim is the first insert and its
    /// look (`sql::FirstStatements`); a stale row to take over takes one
    /// round trip more, for the general claim. Under the others a claim that
    /// must read a row committed after its snapshot takes one more.
    fn begin_claim<'a>(&'a self, req: &'a ClaimRequest<'a>, wait: Duration) -> BoxFuture<'a, Result<(PgTx, TxClaim)>> {
        Box::pin(async move {
            let conn = self.pool.acquire().await.map_err(store_error)?;
            self.begin_claim_on(conn, req, wait).await
        })
    }

    idem_sql::read_then_claim_on_one_connection!(store_error);

    fn record<'a>(
        &'a self,
        tx: &'a mut PgTx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            tx.check_intact()?;
            if let (Some(one_write), Some(token)) = (&self.sql.one_write, tx.one_write_token(req)) {
                idem_sql::bound::<PgDialect>(
                    AssertSqlSafe(one_write.insert.text.clone()),
                    idem_sql::completed_args::<PgDialect>(req, record, token),
                )
                .execute(&mut **tx)
                .await
                .map_err(tx::record_error)?;
                return Ok(());
            }
            let args = idem_sql::key_args::<PgDialect>(req.scope, req.key)
                .into_iter()
                .chain([Arg::Int16(record.status.code()), Arg::Bytes(&record.payload)]);
            let statement = idem_sql::bound::<PgDialect>(AssertSqlSafe(self.sql.record.clone()), args);
            idem_sql::record_claimed::<PgDialect>(statement, &mut **tx).await
        })
    }

    /// The record and `COMMIT` in one round trip (see [`PgTx`]).
    fn record_commit<'a>(
        &'a self,
        tx: PgTx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if !tx.has_prepared_record() {
                // A transaction opened with `begin` and claimed with `claim`:
                // its connection may not have the prepared record.
                let mut tx = tx;
                if let Err(e) = self.record(&mut tx, req, record).await {
                    tx.roll_back_after("record").await;
                    return Err(e);
                }
                return tx.commit().await;
            }
            if let (Some(one_write), Some(token)) = (&self.sql.one_write, tx.one_write_token(req)) {
                return tx::record_commit(
                    tx,
                    &one_write.insert.prepare,
                    tx::execute_insert(&one_write.insert.name, req, record, token),
                )
                .await;
            }
            tx::record_commit(
                tx,
                &self.sql.record_tx.prepare,
                tx::execute_record(&self.sql.record_tx.name, req, record),
            )
            .await
        })
    }

    idem_sql::tx_ends!();
}

impl LeaseStore for PgStore {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        Box::pin(async move {
            for _ in 0..VANISHED_ROW_ATTEMPTS {
                // Autocommit: the claim is durable when this statement returns.
                let inserted = self
                    .claim_query(&self.sql.claim_lease, req, LEASE_CLAIM_LOCK_TIMEOUT, false)
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(store_error)?;
                if let Some(row) = inserted {
                    let token = Token(row.try_get(0).map_err(store_error)?);
                    tracing::debug!(table = self.table.as_str(), token = token.0, "acquired lease");
                    return Ok(LeaseClaim::Acquired(token));
                }
                let found = self.get(req.scope, req.key).await?;
                if let Some(row) = found {
                    return Ok(LeaseClaim::Found(row));
                }
                // Released or swept between the two statements: the key is free again.
                tracing::debug!(table = self.table.as_str(), "conflicting row vanished; claiming again");
            }
            Err(vanished())
        })
    }

    idem_sql::lease_writes!(rows);
}

idem_sql::key_sweep!(PgStore, rows);
