//! How a claim is made: the placeholder row, the named lock, a takeover
//! of a stale lease.

use sqlx::MySql;
use sqlx::pool::PoolConnection;

use super::*;

/// What one claim attempt found.
pub(crate) enum Claim {
    Claimed(Token),
    Found(StoredRow),
    Busy,
}

/// A transaction's claim: the token stays with the transaction.
impl From<Claim> for TxClaim {
    fn from(claim: Claim) -> Self {
        match claim {
            Claim::Claimed(_) => TxClaim::Claimed,
            Claim::Found(row) => TxClaim::Found(row),
            Claim::Busy => TxClaim::Busy,
        }
    }
}

/// A stored row with the raw columns a takeover needs.
pub(crate) struct RawRow {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) status: i16,
    pub(crate) token: i64,
    pub(crate) payload: Option<Vec<u8>>,
    pub(crate) lease_expires_at_ms: Option<i64>,
    pub(crate) expires_at_ms: i64,
}

impl RawRow {
    pub(crate) fn decode(row: &MySqlRow) -> Result<Self> {
        Ok(Self {
            fingerprint: row.try_get(0).map_err(store_error)?,
            status: row.try_get(1).map_err(store_error)?,
            token: row.try_get(2).map_err(store_error)?,
            payload: row.try_get(3).map_err(store_error)?,
            lease_expires_at_ms: row.try_get(4).map_err(store_error)?,
            expires_at_ms: row.try_get(5).map_err(store_error)?,
        })
    }

    /// The staleness rule of the store traits: an expired key, or an
    /// in-progress lease whose holder's lease ran out. A sent claim
    /// (status 4) is not stale until the key expires, however long ago its
    /// lease ran out: it is found, and the engine answers it as an unknown
    /// outcome. The takeover statement repeats this rule in SQL.
    pub(crate) fn is_stale(&self, now_ms: i64) -> bool {
        idem_core::is_stale(self.status, self.lease_expires_at_ms, self.expires_at_ms, now_ms)
    }

    /// Decodes the key's row from the columns after the first of the
    /// named-lock read (`None`: no row, the join found nothing).
    pub(crate) fn decode_joined(row: &MySqlRow) -> Result<Option<Self>> {
        let fingerprint: Option<Vec<u8>> = row.try_get(1).map_err(store_error)?;
        let Some(fingerprint) = fingerprint else {
            return Ok(None);
        };
        Ok(Some(Self {
            fingerprint,
            status: row.try_get(2).map_err(store_error)?,
            token: row.try_get(3).map_err(store_error)?,
            payload: row.try_get(4).map_err(store_error)?,
            lease_expires_at_ms: row.try_get(5).map_err(store_error)?,
            expires_at_ms: row.try_get(6).map_err(store_error)?,
        }))
    }

    pub(crate) fn into_stored(self) -> Result<StoredRow> {
        StoredRow::from_columns(
            &self.fingerprint,
            self.status,
            self.token,
            self.payload,
            self.lease_expires_at_ms,
            self.expires_at_ms,
        )
    }
}

impl MySqlStore {
    pub(crate) async fn flavor(&self, conn: &mut MySqlConnection) -> Result<Flavor> {
        if let Some(flavor) = self.flavor.get() {
            return Ok(*flavor);
        }
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(&mut *conn)
            .await
            .map_err(store_error)?;
        let flavor = if version.to_ascii_lowercase().contains("mariadb") {
            Flavor::MariaDb
        } else {
            Flavor::MySql
        };
        tracing::debug!(%version, ?flavor, "detected the server flavour");
        Ok(*self.flavor.get_or_init(|| flavor))
    }

    /// Claims the key on `conn`, inside the caller's open transaction,
    /// waiting at most `lock_wait_secs` on a concurrent uncommitted claim.
    pub(crate) async fn claim_on(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
        lock_wait_secs: u64,
    ) -> Result<Claim> {
        if let Flavor::MariaDb = self.flavor(conn).await? {
            return self.claim_steps(conn, req, &statement_lock_wait(lock_wait_secs)).await;
        }
        // MySQL has no per-statement form of the lock wait, so the session's
        // value is saved, set for the claim's statements and restored,
        // whether the claim succeeded or not. MySQL's smallest lock wait is
        // one second.
        let secs = lock_wait_secs.max(1);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SET @idem_saved_lock_wait = @@SESSION.innodb_lock_wait_timeout, SESSION innodb_lock_wait_timeout = {secs}"
        )))
        .execute(&mut *conn)
        .await
        .map_err(store_error)?;
        let claim = self.claim_steps(conn, req, "").await;
        let restored = sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = @idem_saved_lock_wait")
            .execute(&mut *conn)
            .await
            .map_err(store_error);
        let claim = claim?;
        restored?;
        Ok(claim)
    }

    /// The claim itself: insert the placeholder; on a duplicate, read the
    /// committed row under a shared lock and either answer it or take it
    /// over if it is stale. `prefix` bounds each statement's lock wait.
    pub(crate) async fn claim_steps(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
        prefix: &str,
    ) -> Result<Claim> {
        let tenant = req.scope.tenant().as_str().as_bytes();
        let operation = req.scope.operation().as_str().as_bytes();
        let key = req.key.as_str().as_bytes();
        let inserted = idem_sql::bound::<MySqlDialect>(
            AssertSqlSafe(format!("{prefix}{}", self.sql.insert)),
            idem_sql::claim_args::<MySqlDialect>(req, req.fresh_token.0),
        )
        .execute(&mut *conn)
        .await;
        match inserted {
            Ok(_) => return Ok(Claim::Claimed(req.fresh_token)),
            Err(e) if error_number(&e) == Some(ER_DUP_ENTRY) => {}
            Err(e) => return busy_or_error(e),
        }
        // The duplicate-key check left this transaction holding a shared lock
        // on the committed row. Under REPEATABLE READ a plain SELECT could
        // still answer from an older snapshot (taken before the twin
        // committed), so the row is read with a locking read, which always
        // sees the latest committed version.
        let row = match sqlx::query(AssertSqlSafe(format!("{prefix}{}", self.sql.select_locked)))
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await
        {
            Ok(row) => row,
            Err(e) => return busy_or_error(e),
        };
        let Some(row) = row else {
            // The shared lock from the duplicate-key check keeps the row from
            // being deleted, so this is a concurrency anomaly (for example a
            // non-default isolation level); the engine retries the claim.
            return Err(Error::store(
                StoreErrorKind::Serialization,
                "the key's row vanished between the duplicate-key error and its locking read",
            ));
        };
        let row = RawRow::decode(&row)?;
        if !row.is_stale(req.now_ms) {
            return Ok(Claim::Found(row.into_stored()?));
        }
        self.take_over(conn, req, &row, prefix).await
    }

    /// Takes over a stale row (expired, or a lease whose holder's lease ran
    /// out) in place, as an in-progress row the record updates, never
    /// marked sent (an expired key's old mark goes with it). The token
    /// only grows, so a fenced holder's old token can never match again; the
    /// `token = ?` guard and the repeated staleness test (on the row's
    /// newest version) make the update a no-op if the row changed since it
    /// was read.
    pub(crate) async fn take_over(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
        row: &RawRow,
        prefix: &str,
    ) -> Result<Claim> {
        let tenant = req.scope.tenant().as_str().as_bytes();
        let operation = req.scope.operation().as_str().as_bytes();
        let key = req.key.as_str().as_bytes();
        let token = req.token_over(Some(row.token));
        let updated = sqlx::query(AssertSqlSafe(format!("{prefix}{}", self.sql.takeover)))
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(token)
            .bind(req.now_ms)
            .bind(req.expires_at_ms)
            .bind(req.lease_expires_at_ms)
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .bind(row.token)
            .bind(req.now_ms)
            .bind(req.now_ms)
            .execute(&mut *conn)
            .await;
        match updated {
            Ok(done) if done.rows_affected() == 1 => {
                tracing::debug!(old_token = row.token, token, "took over a stale idempotency key");
                Ok(Claim::Claimed(Token(token)))
            }
            Ok(_) => Err(Error::store(
                StoreErrorKind::Serialization,
                "the stale row changed while it was being taken over",
            )),
            Err(e) => busy_or_error(e),
        }
    }

    /// The server-wide name of the key's named lock: a hash of the table,
    /// tenant, operation and key (names are limited to 64 characters).
    pub(crate) fn lock_name(&self, scope: &Scope, key: &IdempotencyKey) -> String {
        use std::fmt::Write as _;
        let mut hash = Sha256::new();
        for part in [
            self.table.as_str(),
            scope.tenant().as_str(),
            scope.operation().as_str(),
            key.as_str(),
        ] {
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part.as_bytes());
        }
        let digest = hash.finalize();
        let mut name = String::with_capacity(5 + 48);
        name.push_str("idem:");
        for b in &digest[..24] {
            let _ = write!(name, "{b:02x}");
        }
        name
    }

    /// The claim of [`ClaimStrategy::NamedLock`] on `tx`: the key's named
    /// lock first (unless this transaction holds it), then a plain read of
    /// the row. An absent key is noted on `tx` as claimed with no row; the
    /// record inserts it.
    pub(crate) async fn claim_named(&self, tx: &mut MySqlTx, req: &ClaimRequest<'_>, wait: Duration) -> Result<Claim> {
        let flavor = self.flavor(tx).await?;
        let name = self.lock_name(req.scope, req.key);
        if !tx.holds_lock(&name) {
            let statement = match flavor {
                Flavor::MariaDb => &self.sql.named_lock_mariadb,
                Flavor::MySql => &self.sql.named_lock_mysql,
            };
            // GET_LOCK takes fractions of a second; the cap keeps a long
            // wait in steps, as the placeholder claim's row-lock wait is.
            let secs = wait.min(Duration::from_secs(MAX_LOCK_WAIT_SECS)).as_secs_f64();
            // Noted before it is asked for: a caller that goes away while
            // the server waits drops the transaction, whose session may be
            // granted the lock later, so it must be closed, not pooled.
            tx.note_lock(name.clone());
            let answer: Option<i64> = sqlx::query_scalar(statement.clone())
                .bind(name.as_str())
                .bind(secs)
                .fetch_one(&mut **tx)
                .await
                .map_err(store_error)?;
            if answer != Some(1) {
                tx.forget_lock(&name);
                return self.not_locked(tx, req, wait, answer).await;
            }
        }
        // The lock was taken before this transaction read anything, so at
        // REPEATABLE READ the snapshot begins here, after the twin that held
        // the lock committed and released it.
        let row = idem_sql::bound::<MySqlDialect>(
            self.sql.select.clone(),
            idem_sql::key_args::<MySqlDialect>(req.scope, req.key),
        )
        .fetch_optional(&mut **tx)
        .await
        .map_err(store_error)?;
        let row = row.map(|row| RawRow::decode(&row)).transpose()?;
        self.decide_named(tx, req, wait, flavor, row).await
    }

    /// The answer of a named-lock statement that did not take the lock:
    /// busy when its wait ran out, the placeholder claim under
    /// SERIALIZABLE.
    pub(crate) async fn not_locked(
        &self,
        tx: &mut MySqlTx,
        req: &ClaimRequest<'_>,
        wait: Duration,
        answer: Option<i64>,
    ) -> Result<Claim> {
        match answer {
            Some(0) => {
                tracing::debug!("a concurrent claim still holds the key's named lock; answering busy");
                Ok(Claim::Busy)
            }
            Some(NAMED_LOCK_SERIALIZABLE) => self.claim_on(tx, req, lock_wait_secs(wait)).await,
            other => Err(Error::store(
                StoreErrorKind::Other,
                format!("GET_LOCK of the key's named lock answered {other:?}"),
            )),
        }
    }

    /// Decides a named-lock claim from the key's row read under the lock:
    /// an absent key is claimed with no row written (noted on `tx`), a live
    /// row is found, a stale one taken over.
    pub(crate) async fn decide_named(
        &self,
        tx: &mut MySqlTx,
        req: &ClaimRequest<'_>,
        wait: Duration,
        flavor: Flavor,
        row: Option<RawRow>,
    ) -> Result<Claim> {
        let Some(row) = row else {
            tx.note_unwritten(req, req.fresh_token.0);
            return Ok(Claim::Claimed(req.fresh_token));
        };
        if !row.is_stale(req.now_ms) {
            return Ok(Claim::Found(row.into_stored()?));
        }
        // A lease-mode claim commits at once, so the takeover's row lock is
        // normally free; on MariaDB its wait is bounded as the placeholder
        // claim's, on MySQL it is the session's own.
        let prefix = match flavor {
            Flavor::MariaDb => statement_lock_wait(lock_wait_secs(wait)),
            Flavor::MySql => String::new(),
        };
        self.take_over(tx, req, &row, &prefix).await
    }

    /// [`begin_claim`](TxBackend::begin_claim) on `conn`, a connection of
    /// the store's pool.
    pub(crate) async fn begin_claim_on(
        &self,
        conn: PoolConnection<MySql>,
        req: &ClaimRequest<'_>,
        wait: Duration,
    ) -> Result<(MySqlTx, TxClaim)> {
        let (mut tx, claim) = match self.strategy {
            ClaimStrategy::NamedLock => self.begin_named(conn, req, wait).await?,
            ClaimStrategy::Placeholder => {
                let mut tx = MySqlTx::begin_on(conn).await?;
                match self.claim_on(&mut tx, req, lock_wait_secs(wait)).await {
                    Ok(claim) => (tx, claim),
                    Err(e) => {
                        tx.roll_back_after("claim").await;
                        return Err(e);
                    }
                }
            }
        };
        if matches!(claim, Claim::Found(_)) {
            tx.note_found();
        }
        Ok((tx, claim.into()))
    }

    /// The named-lock claim as the engine opens it, in one round trip
    /// before `BEGIN`: a text of two statements takes the lock
    /// (`SET @idem_named_lock = GET_LOCK(…)`) and then reads the key's row
    /// with the lock's answer. Outside a transaction the read is a
    /// consistent read in a snapshot of its own, taken after the lock was
    /// granted, and it locks nothing at any isolation level. Values are
    /// written as literals whose meaning no setting changes: the lock name in
    /// hexadecimal digits, the wait in decimal, the key's columns (binary)
    /// as `X'…'`, the engine's clock as an integer.
    ///
    /// A live row (one the claim only answers: a replay, a conflict, a key
    /// in progress under a lease) releases the lock in the read itself,
    /// once it has been read, so a replay costs this one round trip. `BEGIN`
    /// follows only when the claim writes (a fresh key, a takeover, the
    /// placeholder claim under SERIALIZABLE); a busy key answers a
    /// transaction that never began and holds nothing.
    pub(crate) async fn begin_named(
        &self,
        mut conn: PoolConnection<MySql>,
        req: &ClaimRequest<'_>,
        wait: Duration,
    ) -> Result<(MySqlTx, Claim)> {
        let flavor = self.flavor(&mut conn).await?;
        let name = self.lock_name(req.scope, req.key);
        let text = named_claim_text(flavor, self.table.as_str(), &name, wait, req);
        // Until its answer is read, the lock counts as held: ending the
        // transaction releases it, or closes the connection if the text
        // failed or the caller went away while the server waits (releasing
        // a lock not held does nothing).
        let mut tx = MySqlTx::idle(conn, name.clone());
        let rows = sqlx::raw_sql(AssertSqlSafe(text)).fetch_all(&mut *tx).await;
        let claim = async {
            let rows = rows.map_err(store_error)?;
            let [row] = &rows[..] else {
                return Err(Error::store(
                    StoreErrorKind::Other,
                    format!("the named-lock read answered {} rows, not 1", rows.len()),
                ));
            };
            let answer: Option<i64> = row.try_get(0).map_err(store_error)?;
            if answer != Some(1) {
                tx.forget_lock(&name);
                if answer == Some(NAMED_LOCK_SERIALIZABLE) {
                    tx.start().await?;
                }
                return self.not_locked(&mut tx, req, wait, answer).await;
            }
            let released: Option<i64> = row.try_get(7).map_err(store_error)?;
            let found = RawRow::decode_joined(row)?;
            let live = found.as_ref().is_some_and(|found| !found.is_stale(req.now_ms));
            if released == Some(1) {
                tx.forget_lock(&name);
                return match found {
                    Some(found) if live => Ok(Claim::Found(found.into_stored()?)),
                    // The text and this decoding apply the same staleness
                    // rule to the same values; a row released but not live
                    // would be claimed without the lock.
                    _ => Err(Error::store(
                        StoreErrorKind::Serialization,
                        "the named-lock read released the lock of a key it must claim",
                    )),
                };
            }
            match found {
                // Still locked (the release did not answer 1): rolling the
                // idle transaction back releases it.
                Some(found) if live => Ok(Claim::Found(found.into_stored()?)),
                found => {
                    tx.start().await?;
                    self.decide_named(&mut tx, req, wait, flavor, found).await
                }
            }
        }
        .await;
        match claim {
            Ok(claim) => Ok((tx, claim)),
            Err(e) => {
                tx.roll_back_after("claim").await;
                Err(e)
            }
        }
    }

    /// The named-lock record: one `INSERT` of the completed row. A
    /// duplicate key means another claim's row committed after this claim
    /// read the key: a serialisation failure, so the engine rolls back and
    /// runs the call again.
    pub(crate) async fn insert_completed(
        &self,
        tx: &mut MySqlTx,
        req: &ClaimRequest<'_>,
        record: &Record,
        token: i64,
    ) -> Result<()> {
        let inserted = idem_sql::bound::<MySqlDialect>(
            self.sql.insert_completed.clone(),
            idem_sql::completed_args::<MySqlDialect>(req, record, token),
        )
        .execute(&mut **tx)
        .await;
        match inserted {
            Ok(_) => Ok(()),
            Err(e) if error_number(&e) == Some(ER_DUP_ENTRY) => Err(Error::store(
                StoreErrorKind::Serialization,
                format!("the key's row was written by another claim before this record: {e}"),
            )),
            Err(e) => Err(store_error(e)),
        }
    }
}

/// A lock-wait timeout while claiming means a twin still holds the key:
/// the engine polls again until its deadline. Everything else is mapped.
pub(crate) fn busy_or_error(e: sqlx::Error) -> Result<Claim> {
    if error_number(&e) == Some(ER_LOCK_WAIT_TIMEOUT) {
        tracing::debug!("a concurrent claim still holds the key; answering busy");
        Ok(Claim::Busy)
    } else {
        let e = store_error(e);
        if e.store_kind() == Some(StoreErrorKind::Deadlock) {
            tracing::debug!("claim chosen as a deadlock victim; the engine retries it");
        }
        Err(e)
    }
}

/// The text of [`MySqlStore::begin_named`]: the lock, then the read of the
/// key's row with the lock's answer (column 0), the row's columns (1–6,
/// `NULL` for an absent key) and the answer of the lock's release
/// (column 7: `1` when the row read is live and the lock was released,
/// otherwise `NULL`). The staleness test is [`idem_core::is_stale`]'s, on
/// the engine's clock.
pub(crate) fn named_claim_text(
    flavor: Flavor,
    table: &str,
    name: &str,
    wait: Duration,
    req: &ClaimRequest<'_>,
) -> String {
    use std::fmt::Write as _;
    let isolation = match flavor {
        Flavor::MariaDb => "@@tx_isolation",
        Flavor::MySql => "@@transaction_isolation",
    };
    let secs = wait.min(Duration::from_secs(MAX_LOCK_WAIT_SECS)).as_secs_f64();
    let now = req.now_ms;
    let mut text = String::with_capacity(640);
    let _ = write!(
        text,
        "SET @{LOCK_VARIABLE} = IF({isolation} = 'SERIALIZABLE', {NAMED_LOCK_SERIALIZABLE}, \
         GET_LOCK('{name}', {secs:.3})); \
         SELECT CAST(@{LOCK_VARIABLE} AS SIGNED), k.fingerprint, k.status, k.token, k.payload, \
         k.lease_expires_at_ms, k.expires_at_ms, \
         IF(@{LOCK_VARIABLE} = 1 AND k.fingerprint IS NOT NULL AND k.expires_at_ms > {now} \
         AND NOT (k.status = {STATUS_IN_PROGRESS} AND IFNULL(k.lease_expires_at_ms <= {now}, FALSE)), \
         RELEASE_LOCK('{name}'), NULL) \
         FROM (SELECT 1) AS one LEFT JOIN `{table}` AS k ON "
    );
    for (column, value) in [
        ("tenant", req.scope.tenant().as_str()),
        ("operation", req.scope.operation().as_str()),
        ("idem_key", req.key.as_str()),
    ] {
        if column != "tenant" {
            text.push_str(" AND ");
        }
        let _ = write!(text, "k.{column} = X'");
        push_hex(&mut text, value.as_bytes());
        text.push('\'');
    }
    text
}

/// Appends `bytes` to `text` in upper-case hexadecimal digits.
pub(crate) fn push_hex(text: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    text.reserve(bytes.len() * 2);
    for b in bytes {
        text.push(DIGITS[usize::from(b >> 4)] as char);
        text.push(DIGITS[usize::from(b & 0xf)] as char);
    }
}

/// What MariaDB puts before a statement to bound its lock wait to `secs`
/// (the session's own wait is left untouched).
fn statement_lock_wait(secs: u64) -> String {
    format!("SET STATEMENT innodb_lock_wait_timeout = {secs} FOR ")
}

/// The whole seconds of `wait` an attempt may block, capped.
pub(crate) fn lock_wait_secs(wait: Duration) -> u64 {
    wait.as_secs().min(MAX_LOCK_WAIT_SECS)
}
