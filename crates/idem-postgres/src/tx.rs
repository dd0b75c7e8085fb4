//! The transaction a [`PgStore`](crate::PgStore) hands out, and the
//! statements that open it with a claim and close it with a record, each in
//! one round trip.
//!
//! sqlx sends one statement per round trip and opens its own transactions
//! with a `BEGIN` round trip of their own. A transactional claim would then
//! cost `BEGIN`, the claim, the record and `COMMIT`: two round trips more than
//! the caller's own transaction. PostgreSQL's simple-query protocol runs
//! several statements sent as one text, so this module sends
//! `BEGIN; EXECUTE claim(…)` and `<record>; COMMIT` instead. The text protocol
//! takes no bound parameters, so values are written as literals that mean
//! the same under every server setting (see [`Literals`]), and the claim is a
//! statement prepared once per connection with SQL `PREPARE`, so it is
//! planned once and not on every request.
//!
//! sqlx counts the transactions it began on a connection, and a `begin()` on
//! a connection it counts as inside one is a `SAVEPOINT`. Before the caller's
//! work runs on a claimed transaction, the store has sqlx count it (an
//! empty query, one round trip), so that a `begin()` in the caller's code
//! (`sqlx::Connection::begin(&mut *tx)`, common in functions that take a
//! `&mut PgConnection`) nests inside the claim's transaction. Uncounted, it
//! would send a second `BEGIN`, and its `COMMIT` or `ROLLBACK` would end the
//! claim's transaction half-way, leaving the rest of the caller's writes to
//! commit one by one without the key. The count is back at zero whenever the
//! connection returns to the pool.

use std::ops::{Deref, DerefMut};

use futures_util::{FutureExt, TryStreamExt};
use idem_core::{ClaimRequest, Error, Record, Result};
use idem_sql::UnwrittenClaims;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgRow, PgTransactionManager};
use sqlx::{AssertSqlSafe, Either, Executor, Postgres, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use crate::error::{sqlstate, store_error};

/// SQLSTATE `invalid_sql_statement_name`: the connection has not prepared
/// the claim yet (a new connection, or one whose prepared statements were
/// deallocated).
const NOT_PREPARED: &str = "26000";

/// SQLSTATE `unique_violation`: a one-write record met a completed row
/// committed meanwhile (a lease-mode claim of the key).
const UNIQUE_VIOLATION: &str = "23505";

/// SQLSTATE `division_by_zero`: the record statement's guard when it did not
/// update exactly one row.
const NO_CLAIM: &str = "22012";

/// The open transaction of a [`PgStore`](crate::PgStore): a pooled
/// connection inside `BEGIN`. The caller's queries run on it (`&mut **tx` is
/// a `&mut PgConnection`), so they commit or roll back with the claim.
///
/// Dropping an open transaction rolls it back: on a tokio runtime a task
/// sends `ROLLBACK` and then returns the connection to the pool (or closes it
/// if that fails); without a runtime the connection is closed, which makes
/// the server roll back. A connection is never handed out of the pool again
/// inside a transaction: one rolled back right after its claim reaches the
/// pool with its `ROLLBACK` sent and unanswered, and the pool's release ping
/// reads that answer before the connection can be acquired.
pub struct PgTx {
    conn: Option<PoolConnection<Postgres>>,
    /// Whether the server may be inside a transaction on this connection.
    open: bool,
    /// Whether this transaction began with the prepared claim, so the
    /// connection has the prepared record too.
    prepared: bool,
    /// The keys claimed in this transaction on the one-write path (nothing
    /// written yet), with the token the record inserts.
    one_write: UnwrittenClaims<i64>,
    /// Whether the connection's last exchange was this transaction's own
    /// claim text, ran to its end and found the key held (a replay, a key in
    /// progress), so the connection awaits no answer and the transaction
    /// holds nothing a claim that follows at once would wait for: then
    /// [`rollback`](Self::rollback) need not wait for its own. A claim that
    /// claimed, and any mutable use of the connection (the caller's queries,
    /// a query dropped half-way or failed), clears it.
    settled: bool,
    /// Whether sqlx counts this transaction as begun on the connection
    /// (see the module's docs): from then on a count of zero means sqlx has
    /// rolled it back (as it does when a nested `begin` fails or is
    /// cancelled), and nothing of it may be committed.
    counted: bool,
}

impl std::fmt::Debug for PgTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTx").field("open", &self.open).finish_non_exhaustive()
    }
}

impl Deref for PgTx {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.conn.as_ref().expect("a PgTx holds its connection until it ends")
    }
}

impl DerefMut for PgTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.settled = false;
        self.conn.as_mut().expect("a PgTx holds its connection until it ends")
    }
}

impl Drop for PgTx {
    fn drop(&mut self) {
        let nested = self.check_intact().is_err();
        let Some(mut conn) = self.conn.take() else { return };
        if !self.open {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            // A nested level left open (one `ROLLBACK` would end only that
            // level), or a transaction sqlx has already rolled back: closing
            // the session ends everything.
            Ok(_) if nested => conn.close_on_drop(),
            // As a dropped `sqlx::Transaction`: the `ROLLBACK` is queued, and
            // the pool's release ping sends it and reads its answer.
            Ok(_) if PgTransactionManager::get_transaction_depth(&conn) == 1 => {
                PgTransactionManager::start_rollback(&mut conn);
            }
            Ok(runtime) => {
                runtime.spawn(async move {
                    if let Err(e) = conn.execute("ROLLBACK").await {
                        tracing::debug!(error = %e, "rollback of a dropped transaction failed; closing its connection");
                        conn.close_on_drop();
                    }
                });
            }
            // Closing the connection ends its session, and with it the
            // transaction.
            Err(_) => drop(conn.detach()),
        }
    }
}

impl PgTx {
    /// Opens a transaction on a connection of `pool`.
    pub(crate) async fn begin(pool: &sqlx::PgPool) -> Result<Self> {
        let conn = pool.acquire().await.map_err(store_error)?;
        let mut tx = Self::on(conn);
        if let Err(e) = PgTransactionManager::begin(&mut tx, None).await {
            tx.close();
            return Err(store_error(e));
        }
        tx.counted = true;
        Ok(tx)
    }

    /// The transaction about to begin on `conn`: open, as the server will
    /// be once its `BEGIN` is sent.
    fn on(conn: PoolConnection<Postgres>) -> Self {
        Self {
            conn: Some(conn),
            open: true,
            prepared: false,
            one_write: UnwrittenClaims::default(),
            settled: false,
            counted: false,
        }
    }

    /// Has sqlx count this transaction as begun on its connection (see the
    /// module's docs), if it does not already: an empty query, one round
    /// trip. Run once a claim has claimed, before the caller's work.
    pub(crate) async fn count_in_sqlx(&mut self) -> Result<()> {
        if !self.counted {
            PgTransactionManager::begin(self, Some(AssertSqlSafe("").into_sql_str()))
                .await
                .map_err(store_error)?;
            self.counted = true;
        }
        Ok(())
    }

    /// Fails unless the transaction is still the one its claim began, with
    /// nothing nested left open on it: a write sent otherwise would commit
    /// on its own, or inside a level that never ends.
    pub(crate) fn check_intact(&self) -> Result<()> {
        let depth = self.depth();
        if self.counted || depth > 1 {
            idem_sql::check_claim_depth(depth)?;
        }
        Ok(())
    }

    /// How many transactions sqlx counts as begun on the connection.
    fn depth(&self) -> usize {
        self.conn
            .as_ref()
            .map_or(0, |conn| PgTransactionManager::get_transaction_depth(conn))
    }

    /// Commits the transaction.
    ///
    /// A nested transaction begun on the connection and never ended fails
    /// the commit, and nothing is committed: the connection is closed, which
    /// rolls the whole transaction back on the server.
    pub(crate) async fn commit(mut self) -> Result<()> {
        if let Err(e) = self.check_intact() {
            self.close();
            return Err(e);
        }
        let done = if self.counted {
            PgTransactionManager::commit(&mut self).await
        } else {
            self.execute("COMMIT").await.map(drop)
        };
        // A failed COMMIT ends the transaction too; only a broken connection
        // leaves it unknown, and that one is closed below.
        self.end(done.is_ok());
        done.map(drop).map_err(store_error)
    }

    /// Rolls the transaction back.
    ///
    /// Right after a claim text that ran to its end and found the key held
    /// (a replay, a key in progress, under every claim strategy), with
    /// nothing sent on the connection since, it does not wait for the
    /// server's answer: `ROLLBACK` is written to the connection and its
    /// answer left for the connection's next exchange. sqlx counts that
    /// answer as pending and reads it before the connection does anything
    /// else, and the next thing is the ping with which the pool takes every
    /// connection back, before anyone else can acquire it. So a replay
    /// answers after its claim's round trip; a `ROLLBACK` that cannot be sent
    /// fails that ping, and the pool closes the connection, which ends the
    /// transaction on the server.
    ///
    /// Otherwise it waits for the answer: a transaction that claimed holds
    /// the key's row (or lock), which a claim that follows at once must find
    /// free, and after the caller's queries an answer may still be pending,
    /// which the first poll would wait for before writing anything.
    pub(crate) async fn rollback(mut self) -> Result<()> {
        if self.check_intact().is_err() {
            // A `ROLLBACK` would end only the nested level, or draw a warning
            // outside any transaction; closing the session ends everything.
            self.close();
            return Ok(());
        }
        let done = if self.settled {
            // Nothing pending: the first poll writes and flushes `ROLLBACK`,
            // then waits for the answer, which is left to the next exchange.
            match self.execute("ROLLBACK").now_or_never() {
                Some(done) => done.map(drop),
                None => {
                    self.open = false;
                    return Ok(());
                }
            }
        } else {
            self.roll_back().await
        };
        self.end(done.is_ok());
        done.map(drop).map_err(store_error)
    }

    /// [`rollback`](Self::rollback) after a failed `step` (a claim, a
    /// record), whose own error the caller answers: a rollback that fails
    /// too is only logged.
    pub(crate) async fn roll_back_after(self, step: &str) {
        if let Err(rollback) = self.rollback().await {
            tracing::debug!(error = %rollback, "rollback after a failed {step} failed");
        }
    }

    /// Notes that this transaction holds what a claim that follows at once
    /// would wait for (see [`rollback`](Self::rollback)).
    pub(crate) fn unsettle(&mut self) {
        self.settled = false;
    }

    /// Whether the record-and-commit round trip can run on this transaction
    /// (its connection has the prepared record).
    pub(crate) fn has_prepared_record(&self) -> bool {
        self.prepared
    }

    /// Notes a one-write claim of `req`'s key: the record inserts its row
    /// with `token`.
    pub(crate) fn hold_one_write(&mut self, req: &ClaimRequest<'_>, token: i64) {
        self.one_write.hold(req, token);
    }

    /// The token to insert if this transaction holds a one-write claim of
    /// `req`'s key.
    pub(crate) fn one_write_token(&self, req: &ClaimRequest<'_>) -> Option<i64> {
        self.one_write.get(req).copied()
    }

    /// Marks the transaction ended; the connection goes back to the pool if
    /// the server is known to be outside a transaction, and is closed
    /// otherwise.
    fn end(&mut self, clean: bool) {
        self.open = false;
        if !clean {
            self.close();
        }
    }

    /// Sends `ROLLBACK` and waits for its answer, keeping sqlx's count.
    async fn roll_back(&mut self) -> std::result::Result<(), sqlx::Error> {
        if self.counted {
            PgTransactionManager::rollback(self).await
        } else {
            self.execute("ROLLBACK").await.map(drop)
        }
    }

    /// Closes the connection instead of returning it to the pool.
    fn close(&mut self) {
        self.open = false;
        if let Some(conn) = self.conn.as_mut() {
            conn.close_on_drop();
        }
    }

    /// Runs `script` (several statements, no parameters) and collects the
    /// rows, and how many statements completed before an error.
    async fn script(&mut self, script: String) -> (Vec<PgRow>, usize, Option<sqlx::Error>) {
        let mut rows = Vec::new();
        let mut completed = 0;
        let mut results = sqlx::raw_sql(AssertSqlSafe(script)).fetch_many(&mut **self);
        loop {
            match results.try_next().await {
                Ok(Some(Either::Left(_))) => completed += 1,
                Ok(Some(Either::Right(row))) => rows.push(row),
                Ok(None) => return (rows, completed, None),
                Err(e) => return (rows, completed, Some(e)),
            }
        }
    }
}

/// The rows a claim's text query answered: the claim's row; under the
/// one-write strategy the lock statement's row and then the claim's; or, for
/// the claim a transaction begins with under the insert-on-conflict
/// strategy, the insert's token (if it inserted) and the look's row.
pub(crate) enum ClaimRows {
    Claim(PgRow),
    LockThenClaim(PgRow, PgRow),
    FirstThenLook(Option<PgRow>, PgRow),
}

/// Which statements a claim's text query runs after `BEGIN`, and so how its
/// rows are read.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClaimShape {
    /// One claim statement: one row.
    Claim,
    /// The one-write lock, then its claim: a row each.
    LockThenClaim,
    /// The insert (a row if it inserted), then the look (one row).
    FirstThenLook,
}

/// Opens a transaction on `conn` and runs the prepared claim in it, in one
/// round trip, preparing the statements first on a connection that lacks
/// them. `prepared` lists the statements a connection prepares once (with
/// SQL `PREPARE`), by name and `PREPARE` text.
///
/// Answers the open transaction and the claim's rows, or the transaction
/// (aborted by the error, still to be rolled back) and the error.
pub(crate) async fn begin_claim(
    conn: PoolConnection<Postgres>,
    prepared: &[(&str, &str)],
    execute: String,
    shape: ClaimShape,
) -> std::result::Result<(PgTx, ClaimRows), (PgTx, sqlx::Error)> {
    let mut tx = PgTx::on(conn);
    let (mut rows, _, mut error) = tx.script(format!("BEGIN; {execute}")).await;
    if error
        .as_ref()
        .is_some_and(|e| sqlstate(e).as_deref() == Some(NOT_PREPARED))
    {
        // A new connection, or one that lost some of them: prepare what it
        // lacks, then begin again.
        (rows, error) = match prepare_missing(&mut tx, prepared).await {
            Ok(prepare) => {
                let (rows, _, error) = tx.script(format!("{prepare}BEGIN; {execute}")).await;
                (rows, error)
            }
            Err(e) => (Vec::new(), Some(e)),
        };
    }
    if let Some(e) = error {
        return Err((tx, e));
    }
    tx.prepared = true;
    tx.settled = true;
    let last = rows.pop();
    let before = rows.pop();
    match (shape, before, last) {
        (ClaimShape::Claim, None, Some(claim)) => Ok((tx, ClaimRows::Claim(claim))),
        (ClaimShape::LockThenClaim, Some(lock), Some(claim)) => Ok((tx, ClaimRows::LockThenClaim(lock, claim))),
        (ClaimShape::FirstThenLook, inserted, Some(look)) if rows.is_empty() => {
            Ok((tx, ClaimRows::FirstThenLook(inserted, look)))
        }
        _ => Err((tx, sqlx::Error::RowNotFound)),
    }
}

/// Rolls back the failed attempt and answers the `PREPARE`s of the
/// statements this connection lacks, each followed by `; `.
async fn prepare_missing(tx: &mut PgTx, prepared: &[(&str, &str)]) -> std::result::Result<String, sqlx::Error> {
    tx.execute("ROLLBACK").await?;
    let names: Vec<String> = prepared.iter().map(|(name, _)| (*name).to_owned()).collect();
    let have: Vec<String> = sqlx::query_scalar("SELECT name FROM pg_prepared_statements WHERE name = ANY($1)")
        .bind(&names)
        .fetch_all(&mut **tx)
        .await?;
    Ok(prepared
        .iter()
        .filter(|(name, _)| !have.iter().any(|h| h == name))
        .map(|(_, prepare)| format!("{prepare}; "))
        .collect())
}

/// Records the outcome and commits, in one round trip: `execute` is the
/// prepared record, which fails unless it updated the claimed row, and a
/// failure skips the `COMMIT`.
///
/// On a transaction sqlx counts, a `BEGIN` follows the `COMMIT` in the same
/// text, and sqlx's own `ROLLBACK` of it is queued for the pool's release
/// ping, which takes sqlx's count back to zero without a round trip of its
/// own (a `ROLLBACK` outside any transaction would draw a warning in the
/// server's log).
pub(crate) async fn record_commit(mut tx: PgTx, prepare: &str, execute: String) -> Result<()> {
    if let Err(e) = tx.check_intact() {
        tx.close();
        return Err(e);
    }
    let counted = tx.counted;
    let then = if counted { "; BEGIN" } else { "" };
    let (_, completed, error) = tx.script(format!("{execute}; COMMIT{then}")).await;
    let Some(e) = error else {
        if counted {
            PgTransactionManager::start_rollback(&mut tx);
        }
        tx.end(true);
        return Ok(());
    };
    if completed >= 2 {
        // Committed; only the `BEGIN` after it failed, so sqlx's count is
        // wrong for the session: it is closed.
        tx.close();
        return Ok(());
    }
    if completed == 1 {
        // The record statement went through and the COMMIT failed, which ends
        // the transaction (a serialisation failure, a deferred constraint).
        // sqlx still counts it: an empty one is begun for its queued
        // `ROLLBACK` to end, as after a commit (a round trip on this path
        // only); a session that cannot is closed.
        if counted {
            match tx.execute("BEGIN").await {
                Ok(_) => {
                    PgTransactionManager::start_rollback(&mut tx);
                    tx.end(true);
                }
                Err(begin) => {
                    tracing::debug!(error = %begin, "beginning after a failed commit failed; closing the connection");
                    tx.close();
                }
            }
        } else {
            tx.end(true);
        }
        return Err(store_error(e));
    }
    let code = sqlstate(&e);
    let Ok(()) = rollback_in_place(&mut tx).await else {
        return Err(store_error(e));
    };
    match code.as_deref() {
        Some(UNIQUE_VIOLATION) => Err(record_error(e)),
        Some(NO_CLAIM) => Err(Error::Config(
            "record called on a transaction that holds no claim of this key".into(),
        )),
        Some(NOT_PREPARED) => {
            // Something deallocated the record on this connection: prepare it
            // again for the next call; this one has rolled back.
            if let Err(prepare_error) = tx.execute(AssertSqlSafe(prepare.to_owned())).await {
                tracing::debug!(error = %prepare_error, "preparing the record again failed");
                tx.close();
            }
            Err(Error::store(
                idem_core::StoreErrorKind::Unavailable,
                "the connection had lost its prepared record statement; the call rolled back and may be retried",
            ))
        }
        _ => Err(store_error(e)),
    }
}

/// The error of a record statement: a unique violation of a one-write
/// insert is contention (a lease-mode claim of the key committed after the
/// claim read it), so the engine runs the call again and finds that row.
pub(crate) fn record_error(e: sqlx::Error) -> Error {
    if sqlstate(&e).as_deref() == Some(UNIQUE_VIOLATION) {
        return Error::store(
            idem_core::StoreErrorKind::Serialization,
            format!("the key's row was written by another claim before this record: {e}"),
        );
    }
    store_error(e)
}

/// Rolls back and keeps the connection (for a statement after the rollback).
async fn rollback_in_place(tx: &mut PgTx) -> std::result::Result<(), ()> {
    match tx.roll_back().await {
        Ok(()) => {
            tx.open = false;
            Ok(())
        }
        Err(e) => {
            tracing::debug!(error = %e, "rollback after a failed record failed");
            tx.close();
            Err(())
        }
    }
}

/// Writers of SQL literals whose meaning no server setting changes.
///
/// - Text is an escape string `E'…'` (its backslashes and quotes doubled):
///   escape strings are read the same whatever `standard_conforming_strings`
///   says. Tenants, operations and keys contain no NUL (they exclude control
///   characters).
/// - Bytes are `decode('<hex>', 'hex')`: hexadecimal digits only.
/// - Integers are decimal; an absent one is `NULL`.
mod literal {
    use std::fmt::Write as _;

    pub(crate) fn text(sql: &mut String, value: &str) {
        sql.reserve(value.len() + 3);
        sql.push_str("E'");
        for c in value.chars() {
            match c {
                '\'' => sql.push_str("''"),
                '\\' => sql.push_str("\\\\"),
                c => sql.push(c),
            }
        }
        sql.push('\'');
    }

    pub(crate) fn bytes(sql: &mut String, value: &[u8]) {
        sql.reserve(value.len() * 2 + 20);
        sql.push_str("decode('");
        for b in value {
            let _ = write!(sql, "{b:02x}");
        }
        sql.push_str("', 'hex')");
    }

    pub(crate) fn int(sql: &mut String, value: Option<i64>) {
        match value {
            Some(v) => {
                let _ = write!(sql, "{v}");
            }
            None => sql.push_str("NULL"),
        }
    }
}

/// `EXECUTE <name>(` and the key's tenant, operation and key, each
/// followed by `, `: the start of every keyed statement's execution.
fn execute_keyed(name: &str, req: &ClaimRequest<'_>) -> String {
    let mut sql = format!("EXECUTE {name}(");
    for text in [
        req.scope.tenant().as_str(),
        req.scope.operation().as_str(),
        req.key.as_str(),
    ] {
        literal::text(&mut sql, text);
        sql.push_str(", ");
    }
    sql
}

/// `EXECUTE <name>(…)` of the transactional claim with `req`'s values.
pub(crate) fn execute_claim(name: &str, req: &ClaimRequest<'_>, lock_timeout: &str, advisory: Option<i64>) -> String {
    let mut sql = execute_keyed(name, req);
    literal::bytes(&mut sql, &req.fingerprint.as_bytes()[..]);
    for value in [
        Some(req.fresh_token.0),
        Some(req.now_ms),
        Some(req.expires_at_ms),
        req.lease_expires_at_ms,
    ] {
        sql.push_str(", ");
        literal::int(&mut sql, value);
    }
    sql.push_str(", ");
    literal::text(&mut sql, lock_timeout);
    if let Some(key) = advisory {
        sql.push_str(", ");
        literal::int(&mut sql, Some(key));
    }
    sql.push(')');
    sql
}

/// `EXECUTE <name>(…)` of the look that follows the first insert, with
/// `req`'s values.
pub(crate) fn execute_look(name: &str, req: &ClaimRequest<'_>) -> String {
    let mut sql = execute_keyed(name, req);
    literal::int(&mut sql, Some(req.now_ms));
    sql.push(')');
    sql
}

/// `EXECUTE <name>(…)` of the one-write lock statement with `req`'s values.
pub(crate) fn execute_lock(name: &str, req: &ClaimRequest<'_>, lock_timeout: &str, advisory: i64) -> String {
    let mut sql = execute_keyed(name, req);
    literal::int(&mut sql, Some(req.now_ms));
    sql.push_str(", ");
    literal::text(&mut sql, lock_timeout);
    sql.push_str(", ");
    literal::int(&mut sql, Some(advisory));
    sql.push(')');
    sql
}

/// `EXECUTE <name>(…)` of the one-write insert of the completed row.
pub(crate) fn execute_insert(name: &str, req: &ClaimRequest<'_>, record: &Record, token: i64) -> String {
    let mut sql = execute_keyed(name, req);
    literal::bytes(&mut sql, &req.fingerprint.as_bytes()[..]);
    sql.push_str(", ");
    literal::int(&mut sql, Some(i64::from(record.status.code())));
    sql.push_str(", ");
    literal::int(&mut sql, Some(token));
    sql.push_str(", ");
    literal::bytes(&mut sql, &record.payload);
    for value in [req.now_ms, req.expires_at_ms] {
        sql.push_str(", ");
        literal::int(&mut sql, Some(value));
    }
    sql.push(')');
    sql
}

/// `EXECUTE <name>(…)` of the prepared record with `req`'s and `record`'s
/// values.
pub(crate) fn execute_record(name: &str, req: &ClaimRequest<'_>, record: &Record) -> String {
    let mut sql = format!("EXECUTE {name}(");
    literal::int(&mut sql, Some(i64::from(record.status.code())));
    sql.push_str(", ");
    literal::bytes(&mut sql, &record.payload);
    for text in [
        req.scope.tenant().as_str(),
        req.scope.operation().as_str(),
        req.key.as_str(),
    ] {
        sql.push_str(", ");
        literal::text(&mut sql, text);
    }
    sql.push(')');
    sql
}

#[cfg(test)]
mod tests {
    use super::literal;

    #[test]
    fn text_literals_double_quotes_and_backslashes() {
        let mut s = String::new();
        literal::text(&mut s, "a'b\\c é");
        assert_eq!(s, "E'a''b\\\\c é'");
    }

    #[test]
    fn bytes_and_integers() {
        let mut s = String::new();
        literal::bytes(&mut s, &[0, 255, 16]);
        literal::int(&mut s, Some(i64::MIN));
        literal::int(&mut s, None);
        assert_eq!(s, "decode('00ff10', 'hex')-9223372036854775808NULL");
    }

    /// The `EXECUTE` texts, argument by argument in the prepared
    /// statements' order.
    #[test]
    fn execute_texts() {
        use idem_core::{ClaimRequest, Fingerprint, IdempotencyKey, Operation, Record, Scope, Tenant, Token};
        let scope = Scope::new(Tenant::new("t1").unwrap(), Operation::new("op").unwrap());
        let key = IdempotencyKey::new("k-1").unwrap();
        let fingerprint = Fingerprint::from_bytes([7; 32]);
        let req = ClaimRequest {
            scope: &scope,
            key: &key,
            fingerprint: &fingerprint,
            now_ms: 1_000,
            expires_at_ms: 2_000,
            fresh_token: Token(5),
            lease_expires_at_ms: None,
        };
        let fp = format!("decode('{}', 'hex')", "07".repeat(32));
        assert_eq!(
            super::execute_claim("c", &req, "1s", Some(9)),
            format!("EXECUTE c(E't1', E'op', E'k-1', {fp}, 5, 1000, 2000, NULL, E'1s', 9)")
        );
        assert_eq!(
            super::execute_lock("l", &req, "1s", 9),
            "EXECUTE l(E't1', E'op', E'k-1', 1000, E'1s', 9)"
        );
        let record = Record::completed(b"ok".to_vec());
        assert_eq!(
            super::execute_insert("i", &req, &record, 6),
            format!("EXECUTE i(E't1', E'op', E'k-1', {fp}, 1, 6, decode('6f6b', 'hex'), 1000, 2000)")
        );
    }
}
