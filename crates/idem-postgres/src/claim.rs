//! How a claim is made: the row read or inserted on conflict, the
//! advisory-lock strategies, a takeover of a stale lease.

use sqlx::pool::PoolConnection;

use super::*;

/// `lock_timeout` in milliseconds, as the text `set_config` takes: at least
/// 1 ms (0 would mean "wait forever"), rounded up, and at most PostgreSQL's
/// largest value.
pub(crate) fn lock_timeout_setting(wait: Duration) -> String {
    let ms = wait.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128);
    ms.to_string()
}

/// Decodes the row columns every row-reading statement selects, starting at
/// column `first`.
pub(crate) fn decode_row(row: &PgRow, first: usize) -> Result<StoredRow> {
    // Rows of a text query arrive in the text format, which decodes to owned
    // bytes only.
    let fingerprint: Vec<u8> = row.try_get(first).map_err(store_error)?;
    let status: i16 = row.try_get(first + 1).map_err(store_error)?;
    let token: i64 = row.try_get(first + 2).map_err(store_error)?;
    let payload: Option<Vec<u8>> = row.try_get(first + 3).map_err(store_error)?;
    let lease_expires_at_ms: Option<i64> = row.try_get(first + 4).map_err(store_error)?;
    let expires_at_ms: i64 = row.try_get(first + 5).map_err(store_error)?;
    StoredRow::from_columns(&fingerprint, status, token, payload, lease_expires_at_ms, expires_at_ms)
}

/// Reads the transactional claim's answer (see [`sql::CLAIM_COLUMNS`]):
/// `Claimed`, `Found` with the live row it saw, or `None` when a live row
/// was committed after its snapshot and must be read again.
pub(crate) fn decide_claim(row: &PgRow) -> Result<Option<TxClaim>> {
    if row.len() < CLAIM_COLUMNS {
        return Err(Error::store(
            StoreErrorKind::Other,
            format!("the claim answered {} columns, fewer than {CLAIM_COLUMNS}", row.len()),
        ));
    }
    let token: Option<i64> = row.try_get(0).map_err(store_error)?;
    if token.is_some() {
        return Ok(Some(TxClaim::Claimed));
    }
    let live: bool = row.try_get(1).map_err(store_error)?;
    if live {
        return Ok(Some(TxClaim::Found(decode_row(row, 2)?)));
    }
    Ok(None)
}

/// The lock statement's state when it took the lock at once.
pub(crate) const LOCK_TAKEN: i32 = 0;

/// The lock statement's state when it took the lock after a twin released it.
pub(crate) const LOCK_AFTER_WAIT: i32 = 1;

/// A claim statement's row, or `None` when the twin that holds the key did
/// not finish within the claim's wait (`lock_timeout`). The failed
/// statement aborted the transaction; the engine rolls it back and decides
/// whether to try again.
pub(crate) fn within_wait(answered: std::result::Result<PgRow, sqlx::Error>) -> Result<Option<PgRow>> {
    match answered {
        Ok(row) => Ok(Some(row)),
        Err(e) if sqlstate(&e).as_deref() == Some(LOCK_NOT_AVAILABLE) => Ok(None),
        Err(e) => Err(store_error(e)),
    }
}

pub(crate) fn vanished() -> Error {
    Error::store(
        StoreErrorKind::Serialization,
        "the key's row was deleted repeatedly while it was being claimed",
    )
}

impl PgStore {
    /// [`begin_claim`](TxBackend::begin_claim) on `conn`, a connection of
    /// the store's pool.
    pub(crate) async fn begin_claim_on(
        &self,
        conn: PoolConnection<Postgres>,
        req: &ClaimRequest<'_>,
        wait: Duration,
    ) -> Result<(PgTx, TxClaim)> {
        let advisory = (self.strategy == ClaimStrategy::AdvisoryLock).then(|| self.advisory_key(req.scope, req.key));
        let lock_timeout = lock_timeout_setting(wait);
        let mut execute = tx::execute_claim(&self.sql.claim_tx.name, req, &lock_timeout, advisory);
        let mut prepared = vec![(&*self.sql.record_tx.name, &*self.sql.record_tx.prepare)];
        let mut shape = tx::ClaimShape::Claim;
        if let Some(first) = &self.sql.first {
            let insert = tx::execute_claim(&first.insert.name, req, &lock_timeout, None);
            let look = tx::execute_look(&first.look.name, req);
            execute = format!("{insert}; {look}");
            prepared.push((&first.insert.name, &first.insert.prepare));
            prepared.push((&first.look.name, &first.look.prepare));
            shape = tx::ClaimShape::FirstThenLook;
        } else {
            prepared.push((&self.sql.claim_tx.name, &self.sql.claim_tx.prepare));
        }
        if let Some(one_write) = &self.sql.one_write {
            let lock = tx::execute_lock(
                &one_write.lock.name,
                req,
                &lock_timeout,
                self.advisory_key(req.scope, req.key),
            );
            execute = format!("{lock}; {execute}");
            prepared.push((&one_write.lock.name, &one_write.lock.prepare));
            prepared.push((&one_write.insert.name, &one_write.insert.prepare));
            shape = tx::ClaimShape::LockThenClaim;
        }
        let (mut tx, row) = match tx::begin_claim(conn, &prepared, execute, shape).await {
            Ok(claimed) => claimed,
            Err((tx, e)) if sqlstate(&e).as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                return Ok((tx, self.busy(wait)));
            }
            Err((tx, e)) => {
                tx.roll_back_after("claim").await;
                return Err(store_error(e));
            }
        };
        let decided = match &row {
            tx::ClaimRows::Claim(row) => decide_claim(row),
            tx::ClaimRows::LockThenClaim(lock, row) => self.decide_one_write(&mut tx, req, lock, row),
            tx::ClaimRows::FirstThenLook(Some(_), _) => Ok(Some(TxClaim::Claimed)),
            tx::ClaimRows::FirstThenLook(None, look) => decide_claim(look),
        };
        let first = matches!(row, tx::ClaimRows::FirstThenLook(..));
        let answer = match decided {
            Ok(Some(answer)) => Ok(answer),
            // The look read its row after the insert, so there is nothing
            // newer to read: a stale row, one gone since, or nothing read
            // because the insert got a transaction id without inserting
            // (it met a twin's row only at its index entry). The general
            // claim decides.
            Ok(None) if first => self.claim(&mut tx, req, wait).await,
            Ok(None) => match self.reread(&mut tx, req).await {
                Ok(Some(answer)) => Ok(answer),
                Ok(None) => self.claim(&mut tx, req, wait).await,
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        match answer {
            Ok(answer) => {
                if answer == TxClaim::Claimed {
                    tracing::debug!(table = self.table.as_str(), "claimed key in transaction");
                    // It holds the key's row (or lock): a rollback waits.
                    tx.unsettle();
                    // The caller's work runs next.
                    if let Err(e) = tx.count_in_sqlx().await {
                        tx.roll_back_after("claim").await;
                        return Err(e);
                    }
                }
                Ok((tx, answer))
            }
            Err(e) => {
                tx.roll_back_after("claim").await;
                Err(e)
            }
        }
    }

    /// After a claim that neither claimed the key nor saw a live row: reads
    /// the row committed since in a new snapshot, or, if it vanished (a
    /// release or a sweep), claims again, in `tx`.
    pub(crate) async fn reread(&self, tx: &mut PgTx, req: &ClaimRequest<'_>) -> Result<Option<TxClaim>> {
        let found = sqlx::query(AssertSqlSafe(self.sql.select_row.clone()))
            .bind(req.scope.tenant().as_str())
            .bind(req.scope.operation().as_str())
            .bind(req.key.as_str())
            .fetch_optional(&mut **tx)
            .await
            .map_err(store_error)?;
        match found {
            Some(row) => {
                tracing::debug!(table = self.table.as_str(), "key found committed");
                Ok(Some(TxClaim::Found(decode_row(&row, 0)?)))
            }
            None => {
                tracing::debug!(table = self.table.as_str(), "conflicting row vanished; claiming again");
                Ok(None)
            }
        }
    }

    /// Reads the answers of the one-write lock and claim (see
    /// [`ClaimStrategy::OneWrite`]); on the one-write path a claim is noted
    /// on `tx`, with the token the record will insert.
    pub(crate) fn decide_one_write(
        &self,
        tx: &mut PgTx,
        req: &ClaimRequest<'_>,
        lock: &PgRow,
        row: &PgRow,
    ) -> Result<Option<TxClaim>> {
        if row.len() != ONE_WRITE_COLUMNS || lock.len() != 2 {
            return Err(Error::store(
                StoreErrorKind::Other,
                format!(
                    "the one-write claim answered {} and {} columns, not 2 and {ONE_WRITE_COLUMNS}",
                    lock.len(),
                    row.len()
                ),
            ));
        }
        let one_write: bool = row.try_get(CLAIM_COLUMNS).map_err(store_error)?;
        if !one_write {
            // SERIALIZABLE: the insert-first claim ran.
            return decide_claim(row);
        }
        let live: bool = row.try_get(1).map_err(store_error)?;
        if live {
            return Ok(Some(TxClaim::Found(decode_row(row, 2)?)));
        }
        let state: i32 = lock.try_get(0).map_err(store_error)?;
        let snapshot_held: bool = lock.try_get(1).map_err(store_error)?;
        match state {
            LOCK_TAKEN => {}
            LOCK_AFTER_WAIT if !snapshot_held => {}
            LOCK_AFTER_WAIT => {
                // The snapshot was taken before the twin we waited for
                // committed: a new transaction reads what it wrote.
                return Err(Error::store(
                    StoreErrorKind::Serialization,
                    "the key's twin ended while this claim waited, after its snapshot was taken",
                ));
            }
            _ => {
                // A live row seen by the lock statement was gone for the
                // claim (purged between the two): the lock is not held.
                return Err(Error::store(
                    StoreErrorKind::Serialization,
                    "the key's row was deleted while it was being claimed",
                ));
            }
        }
        let gone: Option<i64> = row.try_get(CLAIM_COLUMNS + 1).map_err(store_error)?;
        tx.hold_one_write(req, req.token_over(gone));
        Ok(Some(TxClaim::Claimed))
    }

    /// The one-write claim on a transaction opened with `begin`: the lock
    /// and the claim as bound statements.
    pub(crate) async fn claim_one_write(
        &self,
        tx: &mut PgTx,
        one_write: &sql::OneWriteStatements,
        req: &ClaimRequest<'_>,
        wait: Duration,
    ) -> Result<TxClaim> {
        let lock = sqlx::query(AssertSqlSafe(one_write.lock.text.clone()))
            .bind(req.scope.tenant().as_str())
            .bind(req.scope.operation().as_str())
            .bind(req.key.as_str())
            .bind(req.now_ms)
            .bind(lock_timeout_setting(wait))
            .bind(self.advisory_key(req.scope, req.key))
            .fetch_one(&mut **tx)
            .await;
        let Some(lock) = within_wait(lock)? else {
            return Ok(self.busy(wait));
        };
        let Some(row) = self.claim_row(tx, req, wait, false).await? else {
            return Ok(self.busy(wait));
        };
        if let Some(answer) = self.decide_one_write(tx, req, &lock, &row)? {
            return Ok(answer);
        }
        self.reread(tx, req).await?.ok_or_else(vanished)
    }

    /// Runs the transactional claim (with the key's advisory lock, if
    /// `advisory`) in `tx`: its row, or `None` when the twin that holds the
    /// key did not finish within `wait` (see [`within_wait`]).
    pub(crate) async fn claim_row(
        &self,
        tx: &mut PgTx,
        req: &ClaimRequest<'_>,
        wait: Duration,
        advisory: bool,
    ) -> Result<Option<PgRow>> {
        let answered = self
            .claim_query(&self.sql.claim_tx.text, req, wait, advisory)
            .fetch_one(&mut **tx)
            .await;
        within_wait(answered)
    }

    pub(crate) fn busy(&self, wait: Duration) -> TxClaim {
        tracing::debug!(
            table = self.table.as_str(),
            wait_ms = wait.as_millis() as u64,
            "key busy"
        );
        TxClaim::Busy
    }
}
